"""One generation request as the scheduler sees it (vLLM V1's `Request`).

A request is a single sequence: `n > 1` is fanned out into n requests by the layer
above (as vLLM's frontend does), each with its own request id.

Token bookkeeping follows vLLM V1: `all_token_ids` = prompt + outputs; every token
except the most recently sampled one has its KV written once `num_computed_tokens`
catches up, so a step computes tokens [num_computed_tokens, num_tokens) (or a chunk of
them) and samples a new token only when that range reaches `num_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after its KV blocks were taken away
    FINISHED_STOPPED = 3  # eos / stop token (or a stop string, via finish_request)
    FINISHED_LENGTH = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # client went away / abort_request
    FINISHED_ERROR = 6  # cannot ever be scheduled (does not fit the KV pool alone)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# OpenAI `finish_reason` strings, as vLLM maps its statuses.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_STATUS_BY_REASON = {reason: status for status, reason in FINISH_REASONS.items()}


def status_for_finish_reason(reason: str) -> RequestStatus:
    try:
        return _STATUS_BY_REASON[reason]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}; expected one of "
                         f"{sorted(_STATUS_BY_REASON)}") from None


@dataclass(eq=False)  # identity semantics: requests are compared/hashed by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" policy
    # Primary eos id (config.json) plus secondary ones (generation_config.json).
    # ignore_eos suppresses all of them; sampling_params.stop_token_ids still stop.
    eos_token_ids: tuple[int, ...] = ()
    # Mixed into the first block's hash so tenants can opt out of sharing a prefix.
    cache_salt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of all_token_ids, extended lazily by the KV manager.
    block_hashes: list[bytes] = field(default_factory=list)
    max_tokens: int | None = None  # resolved by the scheduler at admission
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it finished with FINISHED_ERROR
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    # engine.logit_edits.LogitEdits prepared at admission (None: the sampler builds them when needed)
    logit_edits: object = None
    # Speculative decoding (engine.spec_decode): draft tokens to verify in the next step, set before
    # schedule() and cleared after it; they are never part of all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    # engine.structured_outputs.GrammarState when sampling_params.structured_outputs is set (own per sequence)
    grammar: object = None
    # engine.lora.LoRAAdapter this request runs with (None: the base model)
    lora: object = None
    # engine.multimodal.ImageInput of each image in the prompt (their placeholder ranges, hashes, features)
    mm_inputs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self._rng = None

    # ----------------------------------------------------------------- tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only by convention: use append_output_token."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt tokens (a resumed request also recomputes its outputs)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    # ----------------------------------------------------------------- stopping

    @property
    def stop_token_set(self) -> frozenset[int]:
        """Token ids that end generation now (eos unless ignore_eos, plus stop_token_ids)."""
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)

    @property
    def min_tokens_mask_ids(self) -> frozenset[int]:
        """Ids the sampler must mask while fewer than min_tokens were generated.

        Includes eos even under ignore_eos (as vLLM's all_stop_token_ids does), so
        min_tokens can never be met by emitting an end token early.
        """
        return frozenset(set(self.sampling_params.stop_token_ids) | set(self.eos_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    # ----------------------------------------------------------------- randomness

    @property
    def seed(self) -> int | None:
        return self.sampling_params.seed

    def rng(self):
        """Per-request numpy Generator when a seed was given, else None (use the batch RNG).

        Created once and kept across steps (and across preemption: recomputing the KV does
        not re-sample old tokens), so a seeded request draws the same stream no matter
        which other requests share its batches.
        """
        if self.sampling_params.seed is None:
            return None
        if self._rng is None:
            import numpy as np

            self._rng = np.random.Generator(np.random.PCG64(self.sampling_params.seed))
        return self._rng

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)})")
