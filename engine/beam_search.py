"""Beam search with vLLM's semantics (`LLM.beam_search`, `use_beam_search` on /v1/completions).

As vLLM's V1 implementation (vllm/entrypoints/llm.py `beam_search`, vllm/beam_search.py), read as facts:
- every live beam runs as its own one-token request (prompt = the beam's tokens; the prefix cache shares the
  common prefix) with `logprobs = 2 * beam_width`, max_tokens 1 and the search's temperature;
- each beam is extended by each of its returned top tokens (cumulative logprob += the token's logprob, the
  raw logprob of the model's distribution); an extension ending in an end-of-sequence token (unless
  ignore_eos) becomes a finished hypothesis, the others are candidates;
- the candidates are sorted by score and the best `beam_width` live on, for exactly `max_tokens` steps
  (no early stop: finished hypotheses only accumulate);
- at the end the live beams join the finished ones and the best `beam_width` by score are returned;
- score = cumulative logprob / len(tokens) ** length_penalty, where tokens include the *prompt* and a final
  end-of-sequence token is not counted (vLLM's get_beam_search_score).
Differences from HF transformers' beam search (documented in docs/SERVER.md): transformers normalises by the
generated length only, adds a finished hypothesis only when it ranks within the best num_beams of that step,
and can stop early; with ignore_eos (or no EOS reached) and equal-length beams the two pick the same sequences.
End-of-sequence ids: every id the engine stops on (config + generation_config.json), where vLLM uses the
tokenizer's one eos_token_id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an integer >= 1, got {self.beam_width!r}", "beam_width")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1 for beam search, got {self.max_tokens!r}",
                                      "max_tokens")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp or abs(lp) == float("inf"):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {lp!r}", "length_penalty")


@dataclass
class BeamSearchSequence:
    tokens: list                                 # prompt + generated tokens (as vLLM)
    logprobs: list = field(default_factory=list)  # per generated token: {token id: Logprob}
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None          # "stop" (EOS) | "length"
    stop_reason: object = None
    num_prompt_tokens: int = 0

    @property
    def generated_tokens(self) -> list:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list                              # the best beam_width BeamSearchSequence, best first


def beam_search_score(tokens: list, cum_logprob: float, eos_token_ids, length_penalty: float) -> float:
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cum_logprob / (max(seq_len, 1) ** length_penalty)


def beam_search(generate: Callable, tokenizer, prompts: list, params: BeamSearchParams, *, eos_token_ids=(),
                max_model_len: Optional[int] = None, should_stop: Optional[Callable] = None,
                decode_prompt: bool = True) -> list:
    """One BeamSearchOutput per prompt (str or token ids). `generate(list of token-id lists, SamplingParams)`
    returns RequestOutputs in order (LLM.generate, or the server's engine front). `decode_prompt`: the text
    covers prompt + generated tokens (vLLM's LLM.beam_search) or the generated tokens only (its server)."""
    eos = frozenset(int(t) for t in (eos_token_ids or ()))
    bw = params.beam_width
    step_params = SamplingParams(logprobs=2 * bw, max_tokens=1, temperature=params.temperature, detokenize=False)

    def key(b: BeamSearchSequence) -> float:
        return beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)

    starts = []
    for p in prompts:
        ids = tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        starts.append(ids)
    live = [[BeamSearchSequence(list(ids), num_prompt_tokens=len(ids))] for ids in starts]
    done = [[] for _ in starts]
    for step in range(params.max_tokens):
        if should_stop is not None and should_stop():
            break
        flat = [(i, b) for i, beams in enumerate(live) for b in beams
                if max_model_len is None or len(b.tokens) < max_model_len]
        if not flat:
            break
        outs = generate([b.tokens for _, b in flat], step_params)
        cands = [[] for _ in starts]
        for (i, beam), out in zip(flat, outs):
            comp = out.outputs[0]
            if not comp.logprobs:
                continue
            for tok, lp in comp.logprobs[0].items():
                nb = BeamSearchSequence(beam.tokens + [int(tok)], beam.logprobs + [comp.logprobs[0]],
                                        beam.cum_logprob + float(lp.logprob), num_prompt_tokens=beam.num_prompt_tokens)
                if int(tok) in eos and not params.ignore_eos:
                    nb.finish_reason, nb.stop_reason = "stop", int(tok)
                    done[i].append(nb)
                else:
                    cands[i].append(nb)
        for i in range(len(starts)):
            live[i] = sorted(cands[i], key=key, reverse=True)[:bw]
    results = []
    for i in range(len(starts)):
        for b in live[i]:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(done[i] + live[i], key=key, reverse=True)[:bw]
        for b in best:
            toks = b.tokens if decode_prompt else b.generated_tokens
            if b.finish_reason == "stop" and not params.include_stop_str_in_output and not decode_prompt:
                toks = toks[:-1]
            b.text = tokenizer.decode(toks)
        results.append(BeamSearchOutput(best))
    return results
