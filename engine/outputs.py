"""What the engine gives back per request and step (shaped like vLLM's RequestOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    # per generated token: {token_id: Logprob} (the sampled token plus the top-N)
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None        # "stop" | "length" | "abort" | "error"
    stop_reason: object = None                 # the stop token id or stop string
    # what this step added (for streaming)
    delta_text: str = ""
    delta_token_ids: list = field(default_factory=list)
    delta_logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list                               # list[CompletionOutput], one per n
    finished: bool = False
    prompt_logprobs: Optional[list] = None      # [None, {id: Logprob}, ...] per prompt token
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
