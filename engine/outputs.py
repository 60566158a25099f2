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


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones of a request: `newer`'s cumulative fields, with each
    completion's delta the two deltas joined (vLLM's streaming merges the same way the outputs a slow reader
    has not taken yet)."""
    before = {c.index: c for c in older.outputs}
    comps = []
    for c in newer.outputs:
        o = before.pop(c.index, None)
        if o is None or not (o.delta_text or o.delta_token_ids):
            comps.append(c)
            continue
        lps = c.delta_logprobs if o.delta_logprobs is None else \
            o.delta_logprobs + (c.delta_logprobs if c.delta_logprobs is not None else [])
        comps.append(CompletionOutput(
            index=c.index, text=c.text, token_ids=c.token_ids, cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            delta_text=o.delta_text + c.delta_text, delta_token_ids=list(o.delta_token_ids) + list(c.delta_token_ids),
            delta_logprobs=lps))
    comps.extend(before.values())
    comps.sort(key=lambda c: c.index)
    return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids, comps, newer.finished,
                         prompt_logprobs=newer.prompt_logprobs, metrics=newer.metrics, error=newer.error)
