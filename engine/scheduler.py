"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Modelled on vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py): there is no separate
"prefill phase" and "decode phase", only one token budget per step
(`max_num_batched_tokens`). Each step:

1. Running requests, in admission order, get their pending tokens: 1 for a decode, or
   the next prefill chunk, as far as the budget lasts. If the pool cannot give a request
   the blocks it needs, another running request is preempted (fcfs: the latest admitted;
   priority: the one with the largest (priority, arrival_time)) until it fits, possibly
   itself. A preempted request loses its blocks (cached full blocks stay in the prefix
   cache), goes back to the *front* of the waiting queue with num_computed_tokens = 0,
   and later recomputes prompt + outputs so far (recompute, not swap).
2. If nobody was preempted this step, waiting requests are admitted in policy order
   (fcfs: arrival; priority: lower value first, then arrival; lpm: longest cached prefix
   first, see below) while the budget and `max_num_seqs` allow, each starting after its
   longest cached prefix. The first chunk of a long prompt may be smaller than the prompt
   (chunked prefill).

Prefill budget (fairness). A step's time is what every running stream waits for its next
token. When at least one running request is decoding, the step's prefill tokens (prompt
chunks, recomputation after preemption, new admissions) are capped by `prefill_budget`
(a PrefillBudget that follows measured step times towards an inter-token-latency target;
None: no cap beyond max_num_batched_tokens), and the decodes' tokens are reserved out of
max_num_batched_tokens first, so a long prompt is cut into chunks small enough to keep
the streams flowing. With no decode running nobody waits on the step: the full budget.

lpm (SGLang's longest-prefix-match, cache-aware policy): before admitting, the waiting
queue is ordered by the number of prompt tokens found in the prefix cache, longest first;
ties keep fcfs order (preempted requests first, then arrival). As SGLang does, the sort is
skipped (plain fcfs) when more than LPM_MAX_QUEUE requests wait, where matching every one
each step costs more than it saves. Preemption picks its victim as fcfs does.

A request that cannot fit the whole pool even alone is finished with
FINISHED_ERROR ("error") and a message, instead of waiting forever.

The model runner computes, for each ScheduledRequest, the tokens at positions
[start, end), writes their K/V at `slot_mapping`, and samples a token from the last
position only when `sample` is true. `update_from_output` then appends sampled tokens
and applies the stop rules; stop *strings* are the detokenizer's job, which reports them
with `finish_request(req_id, "stop", stop_reason=the_string)`.

Full blocks are registered in the prefix cache when a step's output comes back, not when
the step is scheduled: the KV is only known to be written then, whatever order the runner
processes requests in.

Calling protocol: schedule(), run the step, update_from_output(), repeat; never two
schedule() calls without an update in between. abort_request/finish_request may come at
any time, also while a step runs: the request's blocks are freed at once, which is safe
because nothing can allocate them before the next schedule(), and blocks still being
written hold no cached prefix (an aborted request's blocks are never registered).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, status_for_finish_reason

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority", "lpm")
# lpm orders the waiting queue by cached prefix only up to this many waiting requests (SGLang's 128)
LPM_MAX_QUEUE = 128


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Cap on one request's prefill chunk so one long prompt cannot take the whole step
    # (vLLM's long_prefill_token_threshold); 0 = no cap beyond the budget.
    long_prefill_token_threshold: int = 0
    # When set, admission validates sampling params and prompt ids against it.
    vocab_size: int | None = None
    max_logprobs: int | None = None
    # LoRA: requests of at most this many distinct adapters run at a time (engine.lora's slots); 0: no adapters
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({self.max_model_len}), or a long prompt could never be scheduled; "
                "raise --max-num-batched-tokens or enable chunked prefill")


class PrefillBudget:
    """Prefill tokens per step that keep a step near `target_s`, from measured step times.

    A step with p prefill tokens takes about d + p * c (d: the decodes' share, c: the cost of one chunk token,
    which rises with the prompt's depth: attention reads every earlier position). Neither is measured directly;
    after each step that prefilled, the budget is scaled by sqrt(target_s / step time), at most x2 / x0.5 per
    step. Its fixed point is a step of exactly target_s whatever d and c are, it follows c as the prompt gets
    deeper, and the square root damps step-to-step noise (no stale estimate of d, which cannot be measured
    while a prompt prefills in every step). A slow step shrinks the budget from the tokens it actually ran, a
    fast one grows it from the larger of the budget and those tokens. The budget stays between `floor` (a
    prompt always advances, even when decodes alone take the target) and `ceiling` (max_num_batched_tokens);
    the floor is 1 token: deep in a long prompt one chunk token's attention can cost ~25 ms on 2 CPU cores
    (SmolLM2-135M at 7000 tokens), so a block-sized floor would already miss the target by 2x. Before any
    measurement it gives `initial`, a first chunk cheap on any device this runs on.
    """

    def __init__(self, target_s: float, ceiling: int, floor: int = 1, initial: int = 64):
        if not target_s > 0:
            raise ValueError(f"the step-time target must be > 0 seconds, got {target_s!r}")
        self.target_s = float(target_s)
        self.ceiling = max(int(ceiling), 1)
        self.floor = max(1, min(int(floor), self.ceiling))
        self.budget = float(max(self.floor, min(int(initial), self.ceiling)))

    def tokens(self) -> int:
        return int(self.budget)

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        """One step's wall time and how many prefill tokens it computed (decode-only steps teach nothing)."""
        if seconds <= 0 or prefill_tokens <= 0:
            return
        ratio = min(2.0, max(0.5, (self.target_s / seconds) ** 0.5))
        base = min(self.budget, prefill_tokens) if ratio < 1 else max(self.budget, prefill_tokens)
        self.budget = float(max(self.floor, min(self.ceiling, base * ratio)))


@dataclass
class ScheduledRequest:
    """What the runner computes for one request this step."""

    request: Request
    token_ids: list[int]  # the tokens at positions start..end-1
    start: int  # == num_computed_tokens before the step (first position computed)
    block_table: list[int]  # the request's whole block table after allocation
    slot_mapping: list[int]  # global KV slot per computed token: block_id*block_size + offset
    sample: bool  # end reaches num_tokens: sample a new token from the last position
    is_prefill: bool  # False only for a plain decode (one token: the one sampled last step)
    # Speculative decoding: the draft tokens at the end of token_ids (positions num_tokens..end-1), to verify.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_computed_tokens_before(self) -> int:
        return self.start

    @property
    def positions(self) -> range:
        return range(self.start, self.end)

    @property
    def completes_prompt(self) -> bool:
        """This chunk computes the last prompt token (the first sample of a fresh request)."""
        return self.start < self.request.num_prompt_tokens <= self.end


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished (any reason) since the previous schedule(): the runner may drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Finished with an error by this schedule() call (cannot fit the KV pool).
    errored: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def by_id(self) -> dict[str, ScheduledRequest]:
        return {s.req_id: s for s in self.scheduled}


@dataclass
class RequestUpdate:
    """What one request got from a step (returned by update_from_output)."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None

    @property
    def req_id(self) -> str:
        return self.request.request_id


class _WaitingQueue:
    """fcfs, lpm: a deque (preempted requests go back to the front). priority: a heap."""

    def __init__(self, policy: str):
        self.policy = "fcfs" if policy == "lpm" else policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self._removed: set[int] = set()  # ids of heap entries removed lazily
        self._entry_of: dict[int, int] = {}  # id(request) -> tiebreak of its live heap entry

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._entry_of)

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._deque.appendleft if front else self._deque.append)(request)
        else:
            # (priority, arrival) already puts a preempted request back ahead of later arrivals.
            tb = next(self._tiebreak)
            self._entry_of[id(request)] = tb
            heapq.heappush(self._heap, (request.priority, request.arrival_time, tb, request))

    def _clean(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def peek(self) -> Request | None:
        if self.policy == "fcfs":
            return self._deque[0] if self._deque else None
        self._clean()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._deque.popleft()
        self._clean()
        _, _, tb, request = heapq.heappop(self._heap)
        del self._entry_of[id(request)]
        return request

    def remove(self, request: Request) -> bool:
        if self.policy == "fcfs":
            try:
                self._deque.remove(request)
                return True
            except ValueError:
                return False
        tb = self._entry_of.pop(id(request), None)
        if tb is None:
            return False
        self._removed.add(tb)
        return True

    def sort_deque(self, key) -> None:
        """lpm: reorder the deque by key (a stable sort: equal keys keep their order)."""
        self._deque = deque(sorted(self._deque, key=key))

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(list(self._deque))
        return iter([entry[3] for entry in sorted(self._heap) if entry[2] not in self._removed])


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv = kv_cache
        self.block_size = kv_cache.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._finished_since_schedule: set[str] = set()
        self._errored_pending: list[Request] = []
        # PrefillBudget (or anything with .tokens()) capping prefill tokens while requests decode; None: no cap
        self.prefill_budget = None
        # Counters for metrics.
        self.num_preemptions_total = 0
        self.num_steps = 0

    # ----------------------------------------------------------------- admission

    def add_request(self, request: Request) -> None:
        """Validate and queue a request. Raises InvalidRequestError (param names the field)."""
        max_len = self.config.max_model_len
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use.", "request_id")
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise InvalidRequestError("The prompt cannot be empty.", "prompt")
        if n_prompt >= max_len:
            # vLLM's _validate_prompt_len: at or past max_model_len leaves no room to generate.
            raise InvalidRequestError(
                f"The prompt is {n_prompt} tokens long, but this model's maximum context length "
                f"(max_model_len) is {max_len} tokens; the prompt must be shorter than {max_len} tokens "
                f"so there is room to generate.", "prompt", n_prompt)
        if self.config.vocab_size is not None:
            request.sampling_params.validate(self.config.vocab_size, self.config.max_logprobs)
            vocab = self.config.vocab_size
            bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id(s) {bad[:8]} out of vocabulary (size {vocab}).", "prompt", bad[:8])
        if request.num_output_tokens:
            raise InvalidRequestError("a new request cannot carry output tokens.", "request")
        request.max_tokens = request.sampling_params.resolve_max_tokens(n_prompt, max_len)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_request(self, req_id: str) -> bool:
        """Finish a request as aborted and free its blocks. False if unknown or already done."""
        return self.finish_request(req_id, "abort")

    def finish_request(self, req_id: str, reason: str = "stop", stop_reason: int | str | None = None) -> bool:
        """Finish a request from outside the step loop (stop string found, abort, ...)."""
        status = status_for_finish_reason(reason)
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finish(request, status)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_schedule.add(request.request_id)

    # ----------------------------------------------------------------- queries

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._errored_pending)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    # ----------------------------------------------------------------- the step

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push(request, front=True)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Lowest priority (largest value), latest arrival; ties: latest admitted.
            best = None
            for index, r in enumerate(self.running):
                key = (r.priority, r.arrival_time, index)
                if best is None or key > best[0]:
                    best = (key, r)
            return best[1]
        return self.running[-1]

    def _chunk(self, num_new_tokens: int, budget: int) -> int:
        if self.config.long_prefill_token_threshold and num_new_tokens > 1:
            num_new_tokens = min(num_new_tokens, self.config.long_prefill_token_threshold)
        return min(num_new_tokens, budget)

    def _does_not_fit_message(self, request: Request) -> str:
        need = self.kv.blocks_needed(request.num_tokens)
        return (f"request {request.request_id} needs {request.num_tokens} tokens of KV cache = {need} blocks of "
                f"{self.block_size}, but the whole pool is {self.kv.num_blocks} blocks "
                f"({self.kv.num_blocks * self.block_size} tokens); raise --num-blocks or lower --max-model-len")

    def _is_decoding(self, request: Request) -> bool:
        """Only its last sampled token (and drafts) to compute: a stream that waits on every step."""
        return request.num_computed_tokens >= request.num_prompt_tokens and \
            request.num_tokens - request.num_computed_tokens <= 1

    def _order_lpm(self) -> None:
        """lpm: waiting requests with the longest cached prefix first (ties: fcfs order)."""
        if not 1 < len(self.waiting) <= LPM_MAX_QUEUE or not self.kv.enable_prefix_caching:
            return
        hit = {id(r): self.kv.get_computed_blocks(r)[1] for r in self.waiting}
        self.waiting.sort_deque(key=lambda r: -hit[id(r)])

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # request -> number of tokens scheduled this step
        planned: dict[int, tuple[Request, int]] = {}
        preempted: list[Request] = []
        # Prefill tokens this step may still take: capped only while some running request decodes, and never
        # more than what the decodes leave of the token budget (decode-first).
        prefill_left = budget
        if self.prefill_budget is not None:
            decoding = [r for r in self.running if self._is_decoding(r)]
            if decoding:
                need = sum(1 + len(r.spec_token_ids) for r in decoding)
                prefill_left = max(0, min(self.prefill_budget.tokens(), budget - need))

        # 1. Running requests.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # (+ draft tokens to verify, when speculative decoding proposed some: engine.spec_decode)
            pending = request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens
            is_prefill = not self._is_decoding(request)
            num_new = self._chunk(pending, min(budget, prefill_left) if is_prefill else budget)
            if num_new <= 0:
                index += 1
                continue
            while True:
                if self.kv.allocate_slots(request, num_new) is not None:
                    break
                victim = self._pick_victim()
                victim_pos = self.running.index(victim)
                self.running.pop(victim_pos)
                if id(victim) in planned:
                    # Only possible under the priority policy: un-schedule it.
                    n_victim = planned.pop(id(victim))[1]
                    budget += n_victim
                    if not self._is_decoding(victim):
                        prefill_left += n_victim
                if victim_pos < index:
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # it preempted itself; self.running[index] is now the next one
            planned[id(request)] = (request, num_new)
            budget -= num_new
            if is_prefill:
                prefill_left -= num_new
            index += 1

        # 2. Waiting requests (not in a step that had to preempt: the pool is tight).
        if not preempted:
            if self.config.policy == "lpm":
                self._order_lpm()
            budget = min(budget, prefill_left)          # (admissions are all prefill)
            while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting.peek()
                if self.config.max_loras and request.lora is not None and self._lora_slots_full(request.lora):
                    break                   # its adapter waits for a slot: one of the running adapters to finish
                if self.kv.blocks_needed(request.num_tokens) > self.kv.num_blocks:
                    self.waiting.pop()
                    self._error(request, self._does_not_fit_message(request))
                    continue
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                pending = request.num_tokens - num_hit_tokens
                if not self.config.enable_chunked_prefill and pending > budget:
                    break
                num_new = self._chunk(pending, budget)
                if self.kv.allocate_slots(request, num_new, hits) is None:
                    if not self.running:
                        # The whole pool is free (apart from evictable cache) and it still does
                        # not fit: it never will. Should be unreachable given the check above.
                        self.waiting.pop()
                        self._error(request, self._does_not_fit_message(request))
                        continue
                    break
                self.waiting.pop()
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                planned[id(request)] = (request, num_new)
                budget -= num_new

        # 3. Build the output in running order and advance num_computed_tokens.
        out = SchedulerOutput(preempted_req_ids=[r.request_id for r in preempted])
        for request in self.running:
            entry = planned.get(id(request))
            if entry is None:
                continue
            num_new = entry[1]
            start = request.num_computed_tokens
            end = start + num_new
            spec = request.spec_token_ids[: end - request.num_tokens] if end > request.num_tokens else []
            out.scheduled.append(ScheduledRequest(
                request=request,
                token_ids=request.all_token_ids[start:end] + spec,
                start=start,
                block_table=list(request.block_ids),
                slot_mapping=self.kv.slot_mapping(request, start, end),
                sample=end >= request.num_tokens,
                # A decode computes exactly the one token sampled last step (plus drafts to verify);
                # anything else (prompt chunks, recomputing outputs after preemption) is a prefill.
                is_prefill=not (start >= request.num_prompt_tokens and num_new == 1 + len(spec)
                                and end == request.num_tokens + len(spec)),
                spec_token_ids=spec,
            ))
            out.num_scheduled_tokens += num_new
            request.num_computed_tokens = end
        out.finished_req_ids = self._finished_since_schedule
        self._finished_since_schedule = set()
        out.errored = self._errored_pending
        self._errored_pending = []
        self.num_steps += 1
        return out

    def _lora_slots_full(self, adapter) -> bool:
        running = {id(r.lora) for r in self.running if r.lora is not None}
        return id(adapter) not in running and len(running) >= self.config.max_loras

    def _error(self, request: Request, message: str) -> None:
        logger.error("%s", message)
        request.error = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._errored_pending.append(request)

    # ----------------------------------------------------------------- after the step

    def update_from_output(self, sched_out: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[RequestUpdate]:
        """Append sampled tokens, apply stop rules, free finished requests.

        sampled_token_ids: req_id -> tokens sampled this step (normally one) for every
        scheduled request with `sample` true; others are ignored. Requests aborted since
        schedule() are skipped. Returns one RequestUpdate per request that got tokens or
        finished (including the ones schedule() finished with an error).
        """
        live = [s for s in sched_out.scheduled
                if not s.request.is_finished and s.request.request_id in self.requests]
        # Check the runner's answer before changing anything.
        for sched in live:
            if sched.sample and not sampled_token_ids.get(sched.req_id):
                raise ValueError(f"runner returned no sampled token for request {sched.req_id}, "
                                 "which was scheduled to sample")
        updates: list[RequestUpdate] = [
            RequestUpdate(r, [], True, r.finish_reason, r.stop_reason) for r in sched_out.errored]
        for sched in live:
            request = sched.request  # requests aborted while the step ran were filtered out
            if request.status != RequestStatus.RUNNING:
                continue
            if sched.spec_token_ids:
                # Speculative decoding: the KV of rejected drafts is garbage; only the sequence length rolls
                # back (their slots are overwritten next step). The runner returned accepted drafts + 1.
                got = len(sampled_token_ids.get(request.request_id) or ())
                request.num_computed_tokens -= len(sched.spec_token_ids) + 1 - got
            else:
                # The step's KV is written now: register the newly full blocks.
                self.kv.cache_computed_blocks(request)
            if not sched.sample:
                continue
            tokens = sampled_token_ids[request.request_id]
            new_tokens: list[int] = []
            status = None
            for token in tokens:
                request.append_output_token(int(token))
                new_tokens.append(int(token))
                status = self._check_stop(request)
                if status is not None:
                    break
            if sched.spec_token_ids and status is None:
                self.kv.cache_computed_blocks(request)   # the accepted drafts are in all_token_ids now
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append(RequestUpdate(request, new_tokens, status is not None,
                                         request.finish_reason, request.stop_reason))
        return updates

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Stop rules after appending one token (vLLM's check_stop, plus a hard context cap).

        Stop tokens only count once min_tokens outputs exist; eos only without ignore_eos.
        max_model_len always applies: the sequence cannot grow past the context.
        """
        last = request.output_token_ids[-1]
        params = request.sampling_params
        if request.grammar is not None and request.grammar.finished_at(request.num_output_tokens):
            return RequestStatus.FINISHED_STOPPED   # structured outputs: nothing more may follow
        if request.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                request.stop_reason = last  # vLLM reports the stop token id; eos gives None
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ----------------------------------------------------------------- misc

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def iter_requests(self) -> Iterable[Request]:
        return iter(list(self.requests.values()))
