"""Next-token selection in vLLM's order.

    raw logits -> (logprobs are taken here in vLLM's default "raw_logprobs" mode, and "raw_logits")
    -> logit_bias, allowed_token_ids, bad_words, min_tokens (stop ids masked until reached)
    -> the request's own logits processors, then the engine's (engine/logits_process.py)
    -> repetition / presence / frequency penalties
    -> structured outputs: tokens the request's grammar forbids -> -inf (engine/structured_outputs.py)
    -> greedy (temperature 0)  |  temperature -> top-k -> top-p -> min-p -> sample
       ("processed_logprobs" / "processed_logits" are read here: tokens cut by top-k/top-p/min-p are -inf)

Seeded requests draw their uniform from their own generator (`Request.rng()`), so the same seed gives the
same tokens whatever else is in the batch. The full-vocabulary work runs as jitkern kernels (argmax,
log-softmax, penalties, temperature, top-k selection, inverse-CDF sampling); the sparse per-request edits
(logit_bias, allowed ids, bad words, min_tokens) and top-p/min-p over the <= k surviving candidates are
numpy glue. Top-p without top-k (or top-k > 1024) sorts the row on the host.

Constrained requests (`request.grammar`, a GrammarState) get their token bitmasks from llguidance in one
parallel call per step; unconstrained rows are never touched by it. After sampling, each grammar consumes
its token; with jump-forward, the tokens the grammar then forces are consumed too and returned in
`SampleResult.token_ids` (the sampled token first), to be appended in one go.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from engine.logit_edits import LogitEdits
from engine.logits_process import (BatchSlots, check_logprobs_mode, processor_name,
                                   run_request_processors)

log = logging.getLogger("engine.sampler")


@dataclass
class SampleResult:
    token_id: int
    logprob: float = 0.0
    rank: int = 1
    top_logprobs: tuple = ()               # ((token id, logprob, rank), ...)
    prompt_logprobs: Optional[list] = None  # [(token id, logprob, rank, top), ...] for this chunk's prompt tokens
    error: Optional[str] = None            # this request could not be sampled (the engine fails it alone)
    token_ids: Optional[list] = None       # several tokens this step: [token_id, forced...] (jump-forward)


_TOPK_KERNEL_MAX = 1024      # top-k beyond this falls back to a host sort
# What a request is told when sampling it raised; the exception itself goes to the log only.
INTERNAL_ERROR = "internal error while sampling this request (the server log has the details)"


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, tokenizer=None, logprobs_mode: str = "raw_logprobs",
                 logits_processors=()):
        self.vocab = vocab_size
        # which tensor returned logprobs are read from (vLLM's --logprobs-mode)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        # engine-wide LogitsProcessor instances, and the persistent batch they are told about
        self.logits_processors = list(logits_processors)
        self._slots = BatchSlots()
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self.grammar_compiler = None   # engine.structured_outputs.GrammarCompiler (its thread pool for masks)
        # Compute the next step's masks in the background while the forward pass runs (GrammarState.prefetch).
        # Off by default: on the CPU the extra thread competes with the kernel pool for the cores and made
        # constrained decoding slower (perf/bench_structured.py: 0.75x of free decoding with it, 1.02x without).
        self.prefetch_masks = False

    # --------------------------------------------------------------------------------- batch entry
    def sample(self, sched, result) -> dict:
        """req_id -> SampleResult for every request that samples (or wants prompt logprobs) this step.

        One request's failure never fails the others: its sparse edits run under their own guard, a
        batch stage that raises is re-run request by request to find the one at fault, and a row left
        with no token to pick is reported, each as `SampleResult(-1, error=...)`.
        """
        by_id = {s.req_id: s for s in sched.scheduled}
        # A request finished while its step ran (LLMEngine.overlap_output: a stop string found one step late)
        # samples nothing: its token would be dropped, and drawing for it would shift the shared generator
        # that unseeded requests draw from.
        rids = [rid for rid in result.sample_rows if not getattr(by_id[rid].request, "is_finished", False)]
        # Each request's uniform is drawn before anything can fail, so a retry draws nothing new (a seeded
        # request gives the same token whether or not another request's failure forced a retry).
        uniforms = {rid: (by_id[rid].request.rng() or self.rng).random() for rid in rids
                    if by_id[rid].request.sampling_params.temperature != 0}
        out: dict = {}
        if rids:
            try:
                out.update(self._sample_rows(by_id, result, rids, uniforms))
            except Exception:  # noqa: BLE001 - find the request at fault
                if len(rids) == 1:
                    log.exception("sampling request %s failed", rids[0])
                    out[rids[0]] = SampleResult(-1, error=INTERNAL_ERROR)
                else:
                    log.warning("batch sampling failed; sampling %d requests one by one", len(rids), exc_info=True)
                    for rid in rids:
                        try:
                            out.update(self._sample_rows(by_id, result, [rid], uniforms))
                        except Exception:  # noqa: BLE001
                            log.exception("sampling request %s failed", rid)
                            out[rid] = SampleResult(-1, error=INTERNAL_ERROR)
        for rid, (r0, n, start) in result.prompt_rows.items():
            # a prompt chunk that does not end the prompt samples nothing: token_id -1 carries only logprobs
            res = out.setdefault(rid, SampleResult(-1))
            if res.error is not None:
                continue
            try:
                res.prompt_logprobs = self._prompt_logprobs(by_id[rid].request, result.logits[r0:r0 + n], start)
            except Exception:  # noqa: BLE001
                log.exception("prompt logprobs of request %s failed", rid)
                res.token_id, res.error = -1, INTERNAL_ERROR
        self._advance_grammars(by_id, out)
        return out

    def _advance_grammars(self, by_id: dict, out: dict) -> None:
        """Each constrained request's grammar consumes its sampled token (and, with jump-forward, the tokens
        the grammar forces after it, unless the request wants logprobs, which forced tokens do not have)."""
        for rid, res in out.items():
            grammar = getattr(by_id[rid].request, "grammar", None)
            if grammar is None or res.error is not None or res.token_id < 0:
                continue
            try:
                if not grammar.accept(res.token_id):
                    res.token_id, res.error = -1, f"structured outputs: the sampled token was refused ({grammar.error})"
                    continue
                if grammar.jump_forward and by_id[rid].request.sampling_params.logprobs is None:
                    forced = grammar.forced_tokens()
                    if forced:
                        res.token_ids = [res.token_id] + forced
                if self.prefetch_masks:
                    grammar.prefetch()      # the next mask, computed while the next forward pass runs
            except Exception:  # noqa: BLE001 - this request alone fails
                log.exception("advancing the grammar of request %s failed", rid)
                res.token_id, res.error = -1, INTERNAL_ERROR

    def _sample_rows(self, by_id: dict, result, rids: list, uniforms: dict) -> dict:
        from engine.ops.sampling import argmax_rows
        if getattr(result, "greedy_tokens", None) is not None:
            return self._device_greedy_rows(result, rids)
        logits = result.logits
        out: dict = {}
        reqs = [by_id[r].request for r in rids]
        rows = np.array([result.sample_rows[r] for r in rids], np.int64)
        # raw logprobs (vLLM's default logprobs mode) before any processing
        lp_rows = {}
        want_lp = [i for i, q in enumerate(reqs) if q.sampling_params.logprobs is not None]
        mode = self.logprobs_mode
        if want_lp and mode == "raw_logprobs":
            from engine.ops.softmax import log_softmax
            lps = log_softmax(np.ascontiguousarray(logits[rows[want_lp]]))
            lp_rows = {i: lps[j] for j, i in enumerate(want_lp)}
        elif want_lp and mode == "raw_logits":
            lp_rows = {i: np.array(logits[rows[i]], np.float32) for i in want_lp}     # copies: x is edited below
        # processed_*: row index -> the row sampled from, filled by the greedy pick and _draw
        processed = {i: None for i in want_lp} if mode.startswith("processed") else None
        plain = [i for i, q in enumerate(reqs) if not self._has_processors(q)]
        if len(plain) == len(reqs) and not self.logits_processors \
                and np.array_equal(rows, np.arange(logits.shape[0])):
            x = logits                                   # nothing edits the logits: no copy
        else:
            x = np.ascontiguousarray(logits[rows])
        failed = self._process_batch(reqs, x)
        live = [i for i in range(len(reqs)) if i not in failed]
        greedy = [i for i in live if reqs[i].sampling_params.temperature == 0]
        toks = np.full(len(reqs), -1, np.int64)
        if greedy:
            sub = x if len(greedy) == len(reqs) else np.ascontiguousarray(x[greedy])
            toks[greedy] = argmax_rows(sub)
            if processed is not None:
                for i in greedy:
                    if i in processed:
                        processed[i] = x[i]          # greedy: no temperature, nothing cut
        sampled = [i for i in live if reqs[i].sampling_params.temperature != 0]
        if sampled:
            toks[sampled] = self._draw(reqs, x, sampled, np.array([uniforms[rids[i]] for i in sampled]),
                                       processed)
        for i, rid in enumerate(rids):
            if i in failed:
                out[rid] = SampleResult(-1, error=failed[i])
                continue
            tok = int(toks[i])
            if not 0 <= tok < self.vocab or not np.isfinite(x[i, tok]):
                # every token masked (allowed ids, bad words, min_tokens), or non-finite logits
                out[rid] = SampleResult(-1, error=self._no_token_message(reqs[i], x[i]))
                continue
            res = SampleResult(tok)
            if i in lp_rows:
                self._fill_logprobs(res, reqs[i].sampling_params, lp_rows[i])
            elif processed is not None and processed.get(i) is not None:
                row = processed[i].astype(np.float64)
                if mode == "processed_logprobs":
                    top = row.max()
                    row = row - (top + np.log(np.exp(row - top).sum()))
                self._fill_logprobs(res, reqs[i].sampling_params, row)
            out[rid] = res
        return out

    @staticmethod
    def _device_greedy_rows(result, rids: list) -> dict:
        """Tokens the runner picked on the device (ModelRunner._plain_greedy: greedy rows with nothing to edit);
        a non-finite logit at the pick means the row had a NaN (argmax picks the first, as np.argmax)."""
        out = {}
        rows = [result.sample_rows[rid] for rid in rids]     # (whole-array numpy calls: this is per step)
        tokens = result.greedy_tokens[rows].tolist()
        finite = np.isfinite(result.greedy_values[rows]).tolist()
        for rid, tok, ok in zip(rids, tokens, finite):
            if not ok:
                out[rid] = SampleResult(-1, error="internal error: the model produced invalid (NaN) logits for this "
                                                  "request")
            else:
                out[rid] = SampleResult(tok)
        return out

    @staticmethod
    def _no_token_message(req, row: np.ndarray) -> str:
        if np.isnan(row).any():
            return "internal error: the model produced invalid (NaN) logits for this request"
        if getattr(req, "grammar", None) is not None:
            return (f"no token can be generated at output position {len(req.output_token_ids)}: the structured "
                    f"output constraint, allowed_token_ids, bad_words and min_tokens together mask every token")
        return (f"no token can be generated at output position {len(req.output_token_ids)}: allowed_token_ids, "
                f"bad_words and min_tokens together mask every token")

    # ------------------------------------------------------------------------------ batch processing
    def _process_batch(self, reqs, x: np.ndarray) -> dict:
        """Logit edits (sparse per-request edits on the host), the request's own logits processors, the engine's
        processors, then the penalties kernel and structured-output masks.

        Returns {row index: error message} for the requests whose edits raised (the rest go on)."""
        pen = []
        failed: dict = {}
        for i, req in enumerate(reqs):
            if not self._has_processors(req):
                continue
            try:
                edits = self._edits(req)
                if edits.active(len(req.output_token_ids)):
                    edits.apply(x[i], req.output_token_ids)
            except Exception:  # noqa: BLE001 - this request alone fails
                log.exception("logit edits of request %s failed", req.request_id)
                failed[i] = INTERNAL_ERROR
                continue
            p = req.sampling_params
            if p.logits_processors:
                try:
                    run_request_processors(p.logits_processors, req.prompt_token_ids, req.output_token_ids, x[i])
                except Exception as e:  # noqa: BLE001 - the caller's code: this request alone fails, told why
                    log.warning("a logits processor of request %s failed", req.request_id, exc_info=True)
                    failed[i] = _processor_error(p.logits_processors, e)
                    continue
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                pen.append(i)
        if self.logits_processors:
            self._apply_engine_processors(reqs, x, failed)
        if pen:
            from engine.ops.sampling import apply_penalties, penalty_tables
            ids, counts = penalty_tables([reqs[i].prompt_token_ids for i in pen],
                                         [reqs[i].output_token_ids for i in pen])
            sub = np.ascontiguousarray(x[pen])
            f32 = lambda v: np.array(v, np.float32)  # noqa: E731
            apply_penalties(sub, ids, counts, f32([reqs[i].sampling_params.repetition_penalty for i in pen]),
                            f32([reqs[i].sampling_params.presence_penalty for i in pen]),
                            f32([reqs[i].sampling_params.frequency_penalty for i in pen]))
            x[pen] = sub
        constrained = [i for i, req in enumerate(reqs) if i not in failed and getattr(req, "grammar", None) is not None]
        if constrained:
            from engine.structured_outputs import apply_bitmask, fill_masks
            masks = fill_masks(self.grammar_compiler, [reqs[i].grammar for i in constrained])
            for j, i in enumerate(constrained):
                apply_bitmask(x[i], masks[j])
        return failed

    def _apply_engine_processors(self, reqs, x: np.ndarray, failed: dict) -> None:
        """The engine-wide processors over this step's rows in their persistent-batch order. One that raises
        raises here: `sample` then re-runs the requests one by one, and only those it raises for fail."""
        live = [i for i in range(len(reqs)) if i not in failed]
        update, order = self._slots.update([reqs[i] for i in live])
        for proc in self.logits_processors:
            proc.update_state(update)
        if not live:
            return
        idx = [live[k] for k in order]
        batch = np.ascontiguousarray(x[idx])
        for proc in self.logits_processors:
            out = proc.apply(batch)
            out = np.asarray(out) if out is not None else None
            if out is None or out.shape != batch.shape:
                raise ValueError(f"logits processor {type(proc).__name__} returned "
                                 f"{'None' if out is None else out.shape}; expected the batch's {batch.shape}")
            batch = out
        x[idx] = batch

    def _edits(self, req) -> LogitEdits:
        """The request's edits, prepared at admission by the engine; built here for a bare Request."""
        edits = getattr(req, "logit_edits", None)
        if edits is None:
            edits = req.logit_edits = LogitEdits.build(req.sampling_params, vocab_size=self.vocab,
                                                       eos_token_ids=req.eos_token_ids, tokenizer=self.tokenizer)
        return edits

    def _draw(self, reqs, x: np.ndarray, idx: list, u: np.ndarray, processed: dict | None = None) -> np.ndarray:
        """temperature -> top-k -> top-p -> min-p -> inverse-CDF draw with each request's own uniform u.
        `processed` (row index -> None for the rows that want it) receives each such row as sampled from:
        after temperature, the tokens top-k / top-p / min-p cut set to -inf."""
        from engine.ops.sampling import apply_temperature, sample_from_logits, topk_rows
        sub = np.ascontiguousarray(x[idx])
        apply_temperature(sub, np.array([reqs[i].sampling_params.temperature for i in idx], np.float32))
        u = np.asarray(u, np.float64)
        toks = np.empty(len(idx), np.int64)
        full = [j for j, i in enumerate(idx) if not self._truncates(reqs[i].sampling_params)]
        if full:
            s = sub if len(full) == len(idx) else np.ascontiguousarray(sub[full])
            toks[full] = sample_from_logits(s, u[full].astype(np.float32))
        want = processed if processed is not None else {}
        for j, i in enumerate(idx):
            p = reqs[i].sampling_params
            if not self._truncates(p):
                if i in want:
                    want[i] = sub[j]
                continue
            k = p.top_k if p.top_k and p.top_k > 0 else 0
            if k and k <= _TOPK_KERNEL_MAX:
                vals, ids = topk_rows(sub[j:j + 1], min(k, self.vocab))
                vals, ids = vals[0].astype(np.float64), ids[0].astype(np.int64)
            else:
                # top-p / min-p over the whole vocabulary needs the full order: an O(V log V) host sort
                ids = np.argsort(-sub[j], kind="stable")
                vals = sub[j][ids].astype(np.float64)
                if k:
                    ids, vals = ids[:k], vals[:k]
            keep = np.isfinite(vals) & (ids >= 0)
            ids, vals = ids[keep], vals[keep]
            if ids.size == 0:
                toks[j] = int(np.argmax(sub[j]))
                if i in want:
                    want[i] = sub[j]
                continue
            ids, probs = top_p_min_p_cut(ids, vals, p.top_p, p.min_p)
            c = int(np.searchsorted(np.cumsum(probs), u[j], side="right"))
            toks[j] = int(ids[min(c, len(ids) - 1)])
            if i in want:
                row = np.full(self.vocab, -np.inf, np.float32)
                row[ids] = sub[j][ids]
                want[i] = row
        return toks

    @staticmethod
    def _truncates(p) -> bool:
        return bool((p.top_k and p.top_k > 0) or p.top_p < 1.0 or p.min_p > 0.0)

    def _fill_logprobs(self, res: SampleResult, p, lp_row) -> None:
        lp = lp_row.astype(np.float64)
        tok = res.token_id
        res.logprob = float(lp[tok])
        res.rank = int(np.count_nonzero(lp > lp[tok])) + 1
        if p.logprob_token_ids:
            # the explicit ids, each with its rank over the whole vocabulary
            ids = np.asarray(p.logprob_token_ids, np.int64)
            vals = lp[ids]
            asc = np.sort(lp)
            ranks = len(asc) - np.searchsorted(asc, vals, side="right") + 1
            res.top_logprobs = tuple((int(t), float(v), int(r)) for t, v, r in zip(ids, vals, ranks))
            return
        n = self.vocab if p.logprobs == -1 else p.logprobs
        if n:
            top = np.argpartition(-lp, min(n, self.vocab) - 1)[:n] if n < self.vocab else np.arange(self.vocab)
            top = top[np.argsort(-lp[top], kind="stable")]
            res.top_logprobs = tuple((int(t), float(lp[t]), r + 1) for r, t in enumerate(top))

    # ----------------------------------------------------------------------------------- one row
    @staticmethod
    def _has_processors(req) -> bool:
        p = req.sampling_params
        return bool(getattr(req, "grammar", None) is not None or p.logits_processors or
                    p.logit_bias or p.allowed_token_ids or p.bad_words or
                    (p.min_tokens and len(req.output_token_ids) < p.min_tokens) or
                    p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)

    def _prompt_logprobs(self, req, rows: np.ndarray, start: int) -> list:
        """Logprobs of the prompt tokens at positions start+1 .. predicted by these rows."""
        from engine.ops.softmax import log_softmax
        prompt = req.prompt_token_ids
        n = min(len(rows), len(prompt) - 1 - start)
        if n <= 0:
            return []
        lps = log_softmax(np.ascontiguousarray(rows[:n]))
        k = req.sampling_params.prompt_logprobs
        out = []
        for j in range(n):
            tid = prompt[start + 1 + j]
            lp = lps[j].astype(np.float64)
            rank = int(np.count_nonzero(lp > lp[tid])) + 1
            top = ()
            kk = self.vocab if k == -1 else k
            if kk:
                t = np.argpartition(-lp, kk - 1)[:kk] if kk < self.vocab else np.arange(self.vocab)
                t = t[np.argsort(-lp[t], kind="stable")]
                top = tuple((int(a), float(lp[a]), r + 1) for r, a in enumerate(t))
            out.append((tid, float(lp[tid]), rank, top))
        return out


def top_p_min_p_cut(ids: np.ndarray, vals: np.ndarray, top_p: float, min_p: float) -> tuple:
    """The candidates `ids` with their float64 logits `vals`, sorted descending and finite (after temperature and
    top-k), cut by top-p (the smallest prefix whose probability reaches top_p) then min-p (probability at least
    min_p times the top one's): (ids kept, their renormalised probabilities). The sampler draws from this and
    speculative decoding's rejection sampling compares against it, so both use this one function."""
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    if top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1
        ids, probs = ids[:cut], probs[:cut] / probs[:cut].sum()
    if min_p > 0.0:
        keep = probs >= min_p * probs[0]
        ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    return ids, probs


def _processor_error(procs, e: Exception) -> str:
    """One line naming the request's processor that failed (the traceback goes to the log)."""
    names = getattr(e, "logits_processor_name", None) or ", ".join(processor_name(fn) for fn in procs)
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"logits processor failed ({names}): {type(e).__name__}{': ' + text if text else ''}"
