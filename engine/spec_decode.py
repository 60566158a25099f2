"""Speculative decoding: propose k draft tokens per decoding request, verify them in one forward pass.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    --speculative-config '{"method": "draft_model", "model": "small.gguf", "num_speculative_tokens": 4}'

(the same JSON as vLLM's). Each engine step:

1. `SpecDecoder.propose(scheduler)`: every running request in its decode phase whose sampling the
   verifier can reproduce exactly (`eligible`) gets up to k draft tokens in `Request.spec_token_ids`:
   n-gram prompt lookup over its prompt + output (`ngram_propose`), or a smaller draft model sharing the
   tokenizer (`DraftModelProposer`, its own paged KV cache). How many (its *level*, 1..k) adapts per
   request to its recent acceptance (`_DraftState`); n-gram lookup re-anchors after a mismatch.
2. The scheduler schedules the last sampled token plus the drafts (1 + k positions, like a small chunked
   prefill), the runner returns logits for all 1 + k positions (`StepResult.spec_rows`).
3. `SpecDecoder.verify`: greedy requests accept drafts while they equal the argmax of the target's logits
   (the same `argmax_rows` kernel the sampler uses); sampled requests use rejection sampling (accept
   draft d with probability min(1, p(d) / q(d)), on rejection draw from normalised max(0, p - q); an
   n-gram draft is a point mass, q(d) = 1). Accepted drafts + one more token go back to the scheduler,
   which rolls the sequence length back over the rejected positions (their KV slots are rewritten next
   step).

Greedy output is token-identical to speculation off because every kernel on the path is batch invariant
and the attention prefill kernel runs a query through the same arithmetic as the decode kernel
(tests/test_spec_decode.py checks the logits of a token verified in a 1 + k step against its decode-step
logits with assert_array_equal).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from engine.sampler import SampleResult, top_p_min_p_cut
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine.spec_decode")

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


# Adaptive drafting (per request): a request starts at START_LEVEL drafts; a step whose drafts were all
# accepted doubles its level (1 -> 3 -> 7 -> 15, up to num_speculative_tokens), a rejection steps it back (BACKOFF).
# Why: on the CPU a verification step of 1 + k tokens costs ~1.25x (k = 1) to ~2.4x (k = 7) a one-token decode
# step (SmolLM2, quiet host; far more on a loaded one), so drafts that get rejected are expensive; and an
# input-grounded output alternates between long copied stretches (all drafts accepted) and rewritten words
# (the first draft rejected). Simulated over six input-grounded SmolLM2 outputs (edit / summarise / rewrite /
# repeat) with the measured step costs, levels + anchoring gave the editing task 1.6-2.0x against 1.4-1.7x for
# a fixed k = 7, and the verbatim one 2.4-3.2x in both (docs/BENCHMARKS.md "Speculative decoding").
START_LEVEL = 3
# after a rejection: "halve" steps the level one down (7 -> 3 -> 1), "reset" drops it to 1. Halving keeps more
# drafts in flight on outputs whose copied stretches are broken by single changed words: SmolLM2 c=1, three
# same-run A/Bs (`perf/bench_spec.py --k 7 --runs 4 --halve`, load 1.7-2.2): e-mail summary 1.68-1.91x best /
# 1.63-1.69x median against 1.45-1.67x / 1.39-1.55x with reset, editing 1.26-1.80x / 1.35-1.46x against
# 1.20-1.58x / 1.41-1.48x (docs/BENCHMARKS.md). JITKERN_SPEC_BACKOFF / SpecDecoder.backoff override it.
BACKOFF = "halve"
# n-gram re-anchoring: after a step, the request's *anchor* is the position in its tokens just past the
# source text its drafts were copied from (moved on by one per token emitted since). A match whose
# continuation starts within ANCHOR_WINDOW tokens of it wins over other matches of the same length and counts
# even when shorter than prompt_lookup_min (one token suffices): after a corrected word ("recieved" ->
# "received") the output goes on copying right after it, not at the most recent occurrence of " the".
ANCHOR_WINDOW = 8


def verify_friendly(n: int) -> int:
    """Drafts to keep of n: 4..6 -> 3, 8..14 -> 7, ... so that a request's verification step (1 + drafts
    tokens) is a power of two. The CPU GEMMs tile tokens in powers of two: on AVX2 a 5..7-token step costs
    more than an 8-token one (SmolLM2 c=1 ngram k=4: 0.8x of speculation off on an editing task, k=3: 1.3x)."""
    if n < 4:
        return n
    return (1 << ((n + 1).bit_length() - 1)) - 1


class SpeculativeConfigError(ValueError):
    """A bad --speculative-config; `field` names the offending field (None: the JSON itself)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None       # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: Optional[int] = None       # ngram: longest
    model: Optional[str] = None                   # draft_model: checkpoint path

    _FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """From a JSON string, a dict or a SpeculativeConfig; raises SpeculativeConfigError naming the field."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise SpeculativeConfigError(f"not valid JSON ({e}); expected an object such as "
                                             '{"method": "ngram", "num_speculative_tokens": 4}') from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"expected a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls._FIELDS))
        if unknown:
            raise SpeculativeConfigError(f"unknown field {unknown[0]!r}; supported fields: "
                                         f"{', '.join(cls._FIELDS)}", unknown[0])
        method = value.get("method")
        if method is None:
            # vLLM infers the method from `model` ("ngram" / "[ngram]" mean prompt lookup)
            m = value.get("model")
            method = "ngram" if m in ("ngram", "[ngram]") else ("draft_model" if m is not None else None)
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise SpeculativeConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}", "method")

        def int_field(name, low, high, required=False):
            v = value.get(name)
            if v is None:
                if required:
                    raise SpeculativeConfigError(f"{name} is required (an integer in [{low}, {high}])", name)
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                raise SpeculativeConfigError(f"{name} must be an integer in [{low}, {high}], got {v!r}", name)
            return v

        k = int_field("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, required=True)
        lo = int_field("prompt_lookup_min", 1, 1024)
        hi = int_field("prompt_lookup_max", 1, 1024)
        model = value.get("model")
        if method == "ngram":
            if model not in (None, "ngram", "[ngram]"):
                raise SpeculativeConfigError("model is only for method draft_model", "model")
            # vLLM's defaults: both unset -> 5; one unset -> the other
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise SpeculativeConfigError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})",
                                             "prompt_lookup_min")
            model = None
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if value.get(name) is not None:
                    raise SpeculativeConfigError(f"{name} is only for method ngram", name)
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError("method draft_model needs model (the draft checkpoint's path)", "model")
            if not os.path.exists(model):
                raise SpeculativeConfigError(f"model: {model}: no such file or directory", "model")
        return cls(method, k, lo, hi, model)


# ------------------------------------------------------------------------------------------- n-gram
def ngram_lookup(tokens, min_n: int, max_n: int, anchor: Optional[int] = None,
                 window: int = ANCHOR_WINDOW) -> int:
    """Prompt lookup: the longest suffix n-gram (n <= max_n) of `tokens` that occurred earlier; returns the
    position where its continuation starts (-1: no match).

    Without an anchor: n >= min_n, the most recent earlier occurrence. With one: among the occurrences of
    the longest n, one whose continuation starts in [anchor, anchor + window) wins (the first there), and
    such a near occurrence counts for any n >= 1; otherwise as without.

    Vectorised over the sequence: the candidate end positions of a length-1 match are found in one
    compare, then filtered one token further back per n (they only shrink), so the cost is one O(L) pass
    plus O(candidates) per n."""
    t = np.asarray(tokens)
    L = t.shape[0]
    if L < 2:
        return -1
    last = L - 1
    cand = np.flatnonzero(t[:last] == t[last])      # p < last with t[p] == t[last]
    best = -1
    for n in range(1, max_n + 1):
        if n > 1:
            cand = cand[cand >= n - 1]
            cand = cand[t[cand - (n - 1)] == t[last - (n - 1)]]
        if cand.size == 0:
            break
        if anchor is not None:
            near = cand[(cand + 1 >= anchor) & (cand + 1 < anchor + window)]
            if near.size:
                best = int(near[0])
                continue
        if n >= min_n:
            best = int(cand[-1])
    return best + 1 if best >= 0 else -1


def ngram_propose(tokens, min_n: int, max_n: int, k: int, anchor: Optional[int] = None,
                  window: int = ANCHOR_WINDOW) -> np.ndarray:
    """The (up to k) tokens that follow `ngram_lookup`'s match (empty: no match)."""
    t = np.asarray(tokens)
    if k <= 0:
        return t[:0]
    start = ngram_lookup(t, min_n, max_n, anchor, window)
    return t[:0] if start < 0 else t[start:start + k]


# --------------------------------------------------------------------------------- target probabilities
def target_probs(logits_row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from for this row (float64 [V]): temperature -> top-k -> top-p ->
    min-p, in engine.sampler's order and with its cut rules."""
    x = logits_row.astype(np.float64) / float(p.temperature)
    V = x.shape[0]
    k = p.top_k if p.top_k and p.top_k > 0 else 0
    if not k and p.top_p >= 1.0 and p.min_p <= 0.0:
        e = np.exp(x - x.max())
        return e / e.sum()
    order = np.argsort(-x, kind="stable")
    if k:
        order = order[:k]
    vals = x[order]
    keep = np.isfinite(vals)
    order, vals = order[keep], vals[keep]
    order, probs = top_p_min_p_cut(order, vals, p.top_p, p.min_p)
    out = np.zeros(V)
    out[order] = probs
    return out


def _draw(probs: np.ndarray, u: float) -> int:
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(probs) - 1))


def rejection_sample(drafts, draft_probs, target_rows, params: SamplingParams, rng) -> list:
    """Standard speculative rejection sampling for one request (Leviathan et al. / Chen et al.).

    drafts: k draft tokens; draft_probs: None (n-gram: each draft is a point mass) or [k, V] draft
    distributions; target_rows: [k + 1, V] target logits (row j predicts the token after draft j-1).
    Returns the accepted drafts plus one token drawn from the residual (on a rejection) or from the last
    row (all accepted): the output follows the target distribution exactly."""
    out = []
    for j, d in enumerate(drafts):
        p = target_probs(target_rows[j], params)
        d = int(d)
        q_d = 1.0 if draft_probs is None else float(draft_probs[j][d])
        if q_d > 0 and rng.random() < min(1.0, p[d] / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            resid = p.copy()
            resid[d] = 0.0
        else:
            resid = np.maximum(p - draft_probs[j], 0.0)
        if resid.sum() <= 0:            # p == q: rejection has probability 0; keep the draw well defined
            resid = p
        out.append(_draw(resid, rng.random()))
        return out
    out.append(_draw(target_probs(target_rows[len(drafts)], params), rng.random()))
    return out


# ---------------------------------------------------------------------------------------- eligibility
_SAFE_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                "spaces_between_special_tokens", "detokenize", "prompt_logprobs"}
_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(SamplingParams)
             if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def eligible(request) -> bool:
    """Whether the verifier reproduces this request's sampling exactly: no logprobs, logit edits or
    penalties (their per-position state is the sampler's), min_tokens already met, and every other field
    (also ones added later, e.g. structured outputs) at its default."""
    p = request.sampling_params
    if request.num_output_tokens < p.min_tokens:
        return False
    for name, default in _DEFAULTS.items():
        if name not in _SAFE_FIELDS and getattr(p, name, default) != default:
            return False
    return True


class SpecSampleResult(SampleResult):
    """A verified request's tokens: accepted drafts + the bonus/resampled token (token_id is the last)."""

    def __init__(self, token_ids: list, num_drafts: int):
        super().__init__(int(token_ids[-1]))
        self.token_ids = [int(t) for t in token_ids]
        self.num_drafts = num_drafts


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int, k: int) -> None:
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


# ------------------------------------------------------------------------------------------ the decoder
@dataclass
class _DraftState:
    """A request's adaptive drafting state (see START_LEVEL and ANCHOR_WINDOW)."""
    level: int                      # drafts to propose next step (1..k)
    anchor: int = -1                # n-gram: where the last drafts' source continued (-1: none yet) ...
    anchor_tokens: int = 0          # ... when the request had this many tokens

    def anchor_now(self, num_tokens: int) -> Optional[int]:
        # every token emitted since consumed one source token: accepted drafts, the bonus / corrected one
        return None if self.anchor < 0 else self.anchor + num_tokens - self.anchor_tokens

    def update(self, num_drafts: int, num_accepted: int, k: int, backoff: str = "reset") -> None:
        """The level after a step of num_drafts drafts of which num_accepted were accepted: all -> 2l + 1 (up to
        k); else per `backoff` (see BACKOFF): "reset" back to 1, "halve" one level down, "keep" the same level
        when at least half the drafts were accepted, else one level down."""
        if num_drafts <= 0:
            return
        if num_accepted == num_drafts:
            self.level = min(k, 2 * self.level + 1)
        elif backoff == "keep" and 2 * num_accepted >= num_drafts:
            return
        else:
            self.level = 1 if backoff == "reset" else max(1, self.level // 2)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config
        self.k = config.num_speculative_tokens
        # adaptive drafting (levels + n-gram anchoring); off: always k drafts, plain most-recent lookup
        from engine.settings import spec_adaptive, spec_backoff
        self.adaptive = spec_adaptive()               # a bad value: SettingError naming the variable
        self.backoff = spec_backoff(BACKOFF)
        self.anchoring = True                         # n-gram re-anchoring with adaptive drafting (A/B switch)
        self._states: dict = {}               # req_id -> _DraftState
        self.max_model_len = engine.max_model_len
        self.vocab = engine.config.vocab_size
        self.rng = np.random.default_rng((engine.args.seed, 0x5bec))
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.draft = DraftModelProposer(config, engine) if config.method == "draft_model" else None
        self._proposed: list = []
        self._draft_probs: dict = {}          # req_id -> [k, V] draft distributions (sampled draft_model)

    def propose(self, scheduler) -> None:
        """Sets spec_token_ids on the running requests in their decode phase (called before schedule())."""
        reqs, ks = [], []
        if self._states:
            live = scheduler.requests
            for rid in [rid for rid in self._states if rid not in live]:
                del self._states[rid]
        for r in scheduler.running:
            if r.num_computed_tokens != r.num_tokens - 1 or not r.num_output_tokens or not eligible(r):
                continue
            # drafts never run past the context or past max_tokens (the step emits at most k + 1 tokens)
            k = min(self._state(r).level if self.adaptive else self.k, self.max_model_len - r.num_tokens,
                    (r.max_tokens or 0) - r.num_output_tokens - 1)
            k = verify_friendly(k)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        self._draft_probs = {}
        if self.draft is not None:
            self.draft.forget_except(scheduler.requests)
            if reqs:
                for r, (toks, q) in zip(reqs, self.draft.propose(reqs, ks, self.rng)):
                    if len(toks):
                        r.spec_token_ids = [int(t) for t in toks]
                        self._proposed.append(r)
                        if q is not None:
                            self._draft_probs[r.request_id] = q
            return
        cfg = self.config
        for r, k in zip(reqs, ks):
            t = np.asarray(r.all_token_ids, np.int64)
            st = self._states.get(r.request_id) if self.adaptive else None
            anchor = st.anchor_now(r.num_tokens) if st is not None and self.anchoring else None
            start = ngram_lookup(t, cfg.prompt_lookup_min, cfg.prompt_lookup_max, anchor)
            if start < 0:
                continue
            toks = t[start:start + k]
            toks = toks[:verify_friendly(toks.size)]
            if st is not None:
                st.anchor, st.anchor_tokens = start, r.num_tokens
            if toks.size:
                r.spec_token_ids = toks.tolist()
                self._proposed.append(r)

    def _state(self, r) -> _DraftState:
        st = self._states.get(r.request_id)
        if st is None:
            st = self._states[r.request_id] = _DraftState(level=min(self.k, START_LEVEL))
        return st

    def clear(self) -> None:
        """After schedule(): the drafts live on in the ScheduledRequests only."""
        for r in self._proposed:
            r.spec_token_ids = []
        self._proposed = []

    def verify(self, sched, result) -> dict:
        """req_id -> SpecSampleResult for every request in result.spec_rows."""
        from engine.ops.sampling import argmax_rows
        by_id = sched.by_id()
        out = {}
        greedy = [rid for rid in result.spec_rows if by_id[rid].request.sampling_params.temperature == 0]
        if greedy:
            rows = np.concatenate([np.arange(r0, r0 + n) for r0, n in (result.spec_rows[r] for r in greedy)])
            x = result.logits
            sub = x[: len(rows)] if np.array_equal(rows, np.arange(len(rows))) else np.ascontiguousarray(x[rows])
            am = argmax_rows(np.ascontiguousarray(sub))
            i = 0
            for rid in greedy:
                n = result.spec_rows[rid][1]
                drafts = by_id[rid].spec_token_ids
                targets = am[i:i + n]
                i += n
                a = 0
                while a < len(drafts) and drafts[a] == int(targets[a]):
                    a += 1
                out[rid] = SpecSampleResult(targets[:a + 1].tolist(), len(drafts))
        for rid, (r0, n) in result.spec_rows.items():
            if rid in out:
                continue
            s = by_id[rid]
            rng = s.request.rng() or self.rng
            toks = rejection_sample(s.spec_token_ids, self._draft_probs.get(rid), result.logits[r0:r0 + n],
                                    s.request.sampling_params, rng)
            out[rid] = SpecSampleResult(toks, len(s.spec_token_ids))
        for rid, res in out.items():
            self.stats.record(res.num_drafts, len(res.token_ids) - 1, self.k)
            st = self._states.get(rid)
            if st is not None:
                st.update(res.num_drafts, len(res.token_ids) - 1, self.k, self.backoff)
        return out

    def metrics(self) -> dict:
        s = self.stats
        return {"spec_decode_num_drafts": s.num_drafts, "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_pos)}

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None


# --------------------------------------------------------------------------------------- draft model
class DraftModelProposer:
    """A smaller model sharing the target's tokenizer, with its own paged KV cache. Per request it keeps
    a mirror sequence (block table, computed length, the tokens whose KV it holds); each step it catches
    the mirror up on the request's tokens (a chunked prefill, batched over requests), then runs k - 1
    batched decode steps feeding its own drafts. After verification the mirror's computed length rolls
    back to the longest prefix it shares with the request's tokens."""

    def __init__(self, config: SpeculativeConfig, engine):
        from engine.kv_cache_manager import KVCacheManager
        from engine.loader import load_checkpoint
        from engine.model_runner import ModelRunner
        from engine.models import build_model
        args = engine.args
        ckpt = load_checkpoint(config.model)
        check_same_vocabulary(engine.checkpoint, ckpt, config.model)
        # the target's resolved KV element type ("f32" / "f16"; LLMEngine decided "auto" from the target's
        # weights): one cache dtype per engine, as vLLM's cache config
        self.model = build_model(ckpt, kv_dtype=args.kv_cache_dtype, device="cpu")
        self.block_size = args.block_size
        self.kv = KVCacheManager(engine.num_blocks, args.block_size, enable_prefix_caching=False)
        self.budget = max(args.max_num_batched_tokens, 1)
        self.runner = ModelRunner(self.model, num_blocks=engine.num_blocks, block_size=args.block_size,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=self.budget,
                                  max_model_len=engine.max_model_len, use_graphs=args.use_graphs)
        self._seqs: dict = {}                 # req_id -> _DraftSeq

    def forget_except(self, live: dict) -> None:
        for rid in [r for r in self._seqs if r not in live]:
            self.kv.free(self._seqs.pop(rid).mirror)

    def _forward(self, items):
        """items: [(seq, token_ids, start, want_logits)] -> logits rows of the items that want them."""
        from engine.scheduler import ScheduledRequest, SchedulerOutput
        sched = SchedulerOutput()
        for seq, toks, start, want in items:
            m = seq.mirror
            sched.scheduled.append(ScheduledRequest(
                request=m, token_ids=list(toks), start=start, block_table=list(m.block_ids),
                slot_mapping=self.kv.slot_mapping(m, start, start + len(toks)), sample=want, is_prefill=True))
        res = self.runner.execute(sched)
        return res.logits, res.sample_rows

    def _pick(self, row, params, rng):
        if params.temperature == 0:
            return int(np.argmax(row)), None
        q = target_probs(row, params)
        return _draw(q, rng.random()), q

    def propose(self, reqs, ks, rng) -> list:
        from engine.request import Request
        seqs = []
        for r in reqs:
            s = self._seqs.get(r.request_id)
            if s is None:
                s = self._seqs[r.request_id] = _DraftSeq(Request(r.request_id, [], SamplingParams(max_tokens=1)))
            toks = r.all_token_ids
            # roll back over tokens this mirror computed that the request does not have (rejected drafts)
            c = min(s.mirror.num_computed_tokens, len(toks))
            lcp = 0
            fed = s.fed
            n = min(c, len(fed))
            tail = max(0, n - MAX_SPECULATIVE_TOKENS - 2)     # earlier tokens were verified equal before
            lcp = tail
            while lcp < n and fed[lcp] == toks[lcp]:
                lcp += 1
            s.mirror.num_computed_tokens = lcp
            del fed[lcp:]
            seqs.append(s)
        # 1. catch up (chunked by the token budget): every token of the request up to and including the last
        pending = {id(s): True for s in seqs}
        first_rows: dict = {}
        while pending:
            items, budget = [], self.budget
            for s, r, k in zip(seqs, reqs, ks):
                if id(s) not in pending or budget <= 0:
                    continue
                start = s.mirror.num_computed_tokens
                n = min(r.num_tokens - start, budget)
                need = n + (k - 1 if start + n == r.num_tokens else 0)   # room for the drafts fed later
                if self.kv.allocate_slots(s.mirror, need) is None:
                    pending.pop(id(s))
                    continue
                items.append((s, r.all_token_ids[start:start + n], start, start + n == r.num_tokens))
                budget -= n
            if not items:
                break
            logits, rows = self._forward(items)
            for s, toks, start, done in items:
                s.mirror.num_computed_tokens = start + len(toks)
                s.fed.extend(toks)
                if done:
                    pending.pop(id(s))
                    first_rows[id(s)] = np.array(logits[rows[s.mirror.request_id]])
        # 2. draft: first token from the catch-up logits, then k - 1 decode steps
        drafts = {id(s): [] for s in seqs}
        qs = {id(s): [] for s in seqs}
        live = []
        for s, r, k in zip(seqs, reqs, ks):
            if id(s) in first_rows:
                t, q = self._pick(first_rows[id(s)], r.sampling_params, r.rng() or rng)
                drafts[id(s)].append(t)
                qs[id(s)].append(q)
                live.append((s, r, k))
        for step in range(1, max(ks) if ks else 1):
            live = [(s, r, k) for s, r, k in live if len(drafts[id(s)]) < k]
            if not live:
                break
            items = [(s, [drafts[id(s)][-1]], s.mirror.num_computed_tokens, True) for s, r, k in live]
            logits, rows = self._forward(items)
            for s, r, k in live:
                s.fed.append(drafts[id(s)][-1])
                s.mirror.num_computed_tokens += 1
                t, q = self._pick(logits[rows[s.mirror.request_id]], r.sampling_params, r.rng() or rng)
                drafts[id(s)].append(t)
                qs[id(s)].append(q)
        out = []
        for s, r in zip(seqs, reqs):
            d = drafts[id(s)]
            q = qs[id(s)]
            out.append((d, np.stack(q) if d and q[0] is not None else None))
        return out

    def close(self) -> None:
        self.runner.close()


@dataclass
class _DraftSeq:
    mirror: object                  # an engine.request.Request carrying the block table and computed length
    fed: list = field(default_factory=list)   # tokens whose KV the mirror holds, positions 0..


def check_same_vocabulary(target_ckpt, draft_ckpt, path: str) -> None:
    """The draft must share the target's tokenizer: same vocab size, same token for every id."""
    tv, dv = target_ckpt.config.vocab_size, draft_ckpt.config.vocab_size
    if tv != dv:
        raise SpeculativeConfigError(f"model: the draft model {path} has vocab_size {dv}, the target {tv}; "
                                     "a draft model must share the target's tokenizer", "model")
    tt, dt = getattr(target_ckpt, "tokenizer", None), getattr(draft_ckpt, "tokenizer", None)
    if tt is None or dt is None:
        return
    n = max(tt.vocab_size, dt.vocab_size)
    a = tt.convert_ids_to_tokens(list(range(n)))
    b = dt.convert_ids_to_tokens(list(range(n)))
    if a != b:
        i = next(i for i in range(n) if a[i] != b[i])
        raise SpeculativeConfigError(f"model: the draft model {path} has a different vocabulary (token id {i} is "
                                     f"{b[i]!r} in the draft, {a[i]!r} in the target); a draft model must share "
                                     "the target's tokenizer", "model")
