"""The synchronous engine: requests in, `RequestOutput`s out, one `step()` at a time (vLLM V1's shape).

    add_request -> Scheduler (paged KV, chunked prefill, prefix cache, preemption)
    step()      -> schedule -> ModelRunner (jitkern kernels) -> Sampler -> Scheduler.update_from_output
                -> detokenize, stop strings, logprobs -> RequestOutput per request that changed

`n > 1` fans a request out into n sequences (`<id>#<i>`) that share the prompt (and, through the
prefix cache, its KV blocks).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("engine")


@dataclass
class EngineArgs:
    model: Optional[str] = None                 # None: the embedded SmolLM2
    tokenizer_config: Optional[str] = None
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None       # bytes for the KV pool when num_blocks is not given
    kv_cache_dtype: str = "f32"                 # "f32" | "f16"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    seed: int = 0
    use_graphs: bool = True                     # replay decode steps as recorded jitkern graphs


_DEFAULT_KV_MEMORY = 1 << 30


@dataclass
class _SeqState:
    """Per-sequence output state (one per n)."""
    index: int
    request: Request
    detok: object
    params: SamplingParams
    text: str = ""
    sent_text_len: int = 0
    token_ids: list = field(default_factory=list)
    sent_tokens: int = 0
    logprobs: Optional[list] = None
    sent_logprobs: int = 0
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    stop_buffer: int = 0


@dataclass
class _ReqState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    seqs: list
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None
    stream: bool = True
    error: Optional[str] = None


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        from engine.default_model import default_model_path
        from engine.loader import load_checkpoint
        from engine.models import build_model
        from engine.model_runner import ModelRunner
        from engine.sampler import Sampler
        from engine.sizing import kv_block_bytes, num_blocks_for_memory, resolve_max_model_len
        path = args.model or str(default_model_path())
        t0 = time.perf_counter()
        self.checkpoint = ckpt = load_checkpoint(path, tokenizer_config=args.tokenizer_config)
        self.config = cfg = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model = build_model(ckpt, kv_dtype=args.kv_cache_dtype)
        dsize = 2 if args.kv_cache_dtype == "f16" else 4
        per_block = kv_block_bytes(self.model.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, dsize)
        num_blocks = args.num_blocks or num_blocks_for_memory(args.kv_cache_memory or _DEFAULT_KV_MEMORY, per_block)
        sizing = resolve_max_model_len(num_blocks, args.block_size, args.max_model_len, cfg.max_position_embeddings)
        self.max_model_len = sizing.max_model_len
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
            max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
            vocab_size=cfg.vocab_size, max_logprobs=args.max_logprobs), self.kv)
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=args.block_size,
                                  max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
                                  max_model_len=self.max_model_len, use_graphs=args.use_graphs)
        self.sampler = Sampler(cfg.vocab_size, seed=args.seed, tokenizer=self.tokenizer)
        self.stop_ids = tuple(ckpt.stop_token_ids or cfg.eos_token_ids or ())
        self._reqs: dict[str, _ReqState] = {}
        self._seq_of: dict[str, tuple] = {}          # scheduler id -> (request id, seq index)
        self._counter = itertools.count()
        self.load_seconds = time.perf_counter() - t0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}
        log.info("engine ready: %s, %d KV blocks x %d tokens, max_model_len %d%s, load %.2fs", path, num_blocks,
                 args.block_size, self.max_model_len, " (auto-fitted)" if sizing.auto_fitted else "",
                 self.load_seconds)

    # ----------------------------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt) -> tuple:
        """(text or None, token ids) for a str prompt or a list of token ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {self.config.vocab_size})",
                                          param="prompt")
            return None, list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, stream: bool = True) -> None:
        params = params or SamplingParams()
        if request_id in self._reqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params.validate(self.config.vocab_size, self.args.max_logprobs)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the maximum context length is {self.max_model_len} "
                f"tokens (the prompt must be shorter to leave room for output)", param="prompt")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        reqs = []
        for i in range(params.n):
            p = params.clone()
            p.n = 1
            if params.seed is not None and params.n > 1:
                p.seed = params.seed + i
            sid = request_id if params.n == 1 else f"{request_id}#{i}"
            r = Request(sid, ids, p, arrival_time=arrival, priority=priority, eos_token_ids=self.stop_ids)
            reqs.append(r)
            detok = self.tokenizer.detokenizer(skip_special_tokens=p.skip_special_tokens, prompt_ids=ids) \
                if p.detokenize else None
            st = _SeqState(i, r, detok, p, logprobs=[] if p.logprobs is not None else None,
                           cumulative_logprob=0.0 if p.logprobs is not None else None)
            if p.stop and not p.include_stop_str_in_output:
                st.stop_buffer = max(len(s) for s in p.stop) - 1
            seqs.append(st)
        for r in reqs:
            self.scheduler.add_request(r)      # validates the length again; raises before anything is kept
        self._reqs[request_id] = _ReqState(request_id, text, ids, params, seqs, RequestMetrics(arrival), stream=stream,
                                           prompt_logprobs=None)
        for st in seqs:
            self._seq_of[st.request.request_id] = (request_id, st.index)

    def abort_request(self, request_id: str) -> bool:
        rs = self._reqs.pop(request_id, None)
        if rs is None:
            return False
        for st in rs.seqs:
            self.scheduler.abort_request(st.request.request_id)
            self._seq_of.pop(st.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list:
        """Runs one scheduler step; returns a RequestOutput for every request that made progress."""
        sched = self.scheduler.schedule()
        changed: dict[str, _ReqState] = {}
        for r in sched.errored:
            ent = self._seq_of.get(r.request_id)
            if ent:
                rs = self._reqs.get(ent[0])
                if rs is not None:
                    st = rs.seqs[ent[1]]
                    st.finish_reason = "error"
                    rs.error = r.error
                    changed[rs.request_id] = rs
        if sched.is_empty:
            return self._emit(changed)
        now = time.monotonic()
        result = self.runner.execute(sched)
        sampled = self.sampler.sample(sched, result)
        for s in sched.scheduled:
            ent = self._seq_of.get(s.req_id)
            if ent and self._reqs[ent[0]].metrics.first_scheduled_time is None:
                self._reqs[ent[0]].metrics.first_scheduled_time = now
        self.stats["prompt_tokens"] += sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        for rid, smp in sampled.items():
            if smp.prompt_logprobs is not None:
                ent = self._seq_of.get(rid)
                if ent is not None:
                    rs = self._reqs[ent[0]]
                    if ent[1] == 0:
                        if rs.prompt_logprobs is None:
                            rs.prompt_logprobs = [None]
                        rs.prompt_logprobs.extend(self._plp_dict(e) for e in smp.prompt_logprobs)
                    changed[rs.request_id] = rs
        updates = self.scheduler.update_from_output(
            sched, {rid: [t.token_id] for rid, t in sampled.items() if t.token_id >= 0})
        now = time.monotonic()
        for u in updates:
            ent = self._seq_of.get(u.req_id)
            if ent is None:
                continue
            rs = self._reqs[ent[0]]
            st = rs.seqs[ent[1]]
            smp = sampled.get(u.req_id)
            if rs.metrics.first_token_time is None and u.new_token_ids:
                rs.metrics.first_token_time = now
                rs.metrics.num_cached_tokens = max(st.request.num_cached_tokens, 0)
            if u.new_token_ids:
                rs.metrics.last_token_time = now
            self.stats["generation_tokens"] += len(u.new_token_ids)
            for tok in u.new_token_ids:
                st.token_ids.append(tok)
                if st.logprobs is not None and smp is not None:
                    st.logprobs.append(self._logprob_dict(smp))
                    st.cumulative_logprob += smp.logprob
                if st.detok is not None:
                    st.text += st.detok.add(tok)
            if u.finished:
                st.finish_reason = u.finish_reason
                st.stop_reason = u.stop_reason
                if st.detok is not None:
                    st.text += st.detok.flush()
            elif st.params.stop and st.detok is not None:
                self._check_stop_strings(st)
            changed[rs.request_id] = rs
        return self._emit(changed)

    def _check_stop_strings(self, st: _SeqState) -> None:
        text = st.text
        window_start = max(0, st.sent_text_len - max(len(s) for s in st.params.stop))
        for s in st.params.stop:
            i = text.find(s, window_start)
            if i >= 0:
                st.text = text[: i + len(s)] if st.params.include_stop_str_in_output else text[:i]
                st.finish_reason = "stop"
                st.stop_reason = s
                self.scheduler.finish_request(st.request.request_id, "stop", stop_reason=s)
                return

    def _logprob_dict(self, smp) -> dict:
        out = {}
        for tid, lp, rank in smp.top_logprobs:
            out[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        if smp.token_id not in out:
            out[smp.token_id] = Logprob(smp.logprob, smp.rank, self.tokenizer.decode([smp.token_id]))
        return out

    def _plp_dict(self, entry) -> dict:
        tid, lp, rank, top = entry
        out = {t: Logprob(l, r, self.tokenizer.decode([t])) for t, l, r in top}
        out.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
        return out

    def _emit(self, changed: dict) -> list:
        outs = []
        now = time.monotonic()
        for rid, rs in changed.items():
            comps = []
            for st in rs.seqs:
                hold = 0 if st.finish_reason else st.stop_buffer
                visible = len(st.text) - hold
                delta_text = st.text[st.sent_text_len:visible] if visible > st.sent_text_len else ""
                st.sent_text_len = max(st.sent_text_len, visible)
                delta_ids = st.token_ids[st.sent_tokens:]
                st.sent_tokens = len(st.token_ids)
                delta_lp = None
                if st.logprobs is not None:
                    delta_lp = st.logprobs[st.sent_logprobs:]
                    st.sent_logprobs = len(st.logprobs)
                comps.append(CompletionOutput(
                    index=st.index, text=st.text, token_ids=list(st.token_ids),
                    cumulative_logprob=st.cumulative_logprob, logprobs=st.logprobs,
                    finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                    delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_lp))
            finished = all(st.finish_reason is not None for st in rs.seqs)
            if finished:
                rs.metrics.finished_time = now
                self._reqs.pop(rid, None)
                for st in rs.seqs:
                    self._seq_of.pop(st.request.request_id, None)
            outs.append(RequestOutput(rid, rs.prompt, rs.prompt_token_ids, comps, finished,
                                      prompt_logprobs=rs.prompt_logprobs, metrics=rs.metrics, error=rs.error))
        return outs

    # ------------------------------------------------------------------------------------ metrics
    def metrics_snapshot(self) -> dict:
        st = self.kv.stats
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "num_preemptions": self.scheduler.num_preemptions_total,
            "prompt_tokens": self.stats["prompt_tokens"],
            "generation_tokens": self.stats["generation_tokens"],
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def close(self) -> None:
        """Frees the KV pool and model buffers; the engine cannot be used afterwards."""
        for rid in list(self._reqs):
            self.abort_request(rid)
        self.runner.close()
        self.runner = None
        self.model = None
