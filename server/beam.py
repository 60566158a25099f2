"""`use_beam_search` on /v1/completions: vLLM's beam search (engine.beam_search) over the engine front.

Each search step submits every live beam of every prompt as a one-token request with 2 x beam_width logprobs
(AsyncEngine.submit_batch: the beams share their prompt's KV blocks through the prefix cache and batch with
other clients' requests), so a long search never holds the engine thread. The width is `best_of` when given,
else `n`; the best `n` beams become the choices (text without the prompt; a final end-of-sequence token ends
the text and gives finish_reason "stop", else "length"). Not with stream=true, echo, stop strings or
structured outputs (400 naming the field).
"""
from __future__ import annotations

import operator

import queue
import threading
from typing import Optional

from engine import limits
from engine.beam_search import BeamSearchParams, beam_search
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from server.errors import bad_request


def beam_params(f, ctx, params, best_of: Optional[int], stream: bool, echo: bool) -> BeamSearchParams:
    if stream:
        raise bad_request("beam search returns whole sequences: 'stream' must be false with use_beam_search",
                          param="stream")
    if echo:
        raise bad_request("'echo' is not available with use_beam_search", param="echo")
    if params.stop:
        raise bad_request("'stop' strings are not applied by beam search (vLLM's semantics): leave them unset",
                          param="stop")
    if params.structured_outputs is not None:
        raise bad_request("structured outputs are not available with use_beam_search", param="use_beam_search")
    n = f.int("n", 1)
    if n < 1 or n > limits.MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"'n' must be in [1, {limits.MAX_SEQUENCES_PER_REQUEST}], got {n}", param="n")
    params.n = n                       # the number of choices (not an engine request's n)
    width = n if best_of is None else best_of
    if best_of is not None and best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least n ({n})", param="best_of")
    if ctx.max_logprobs is not None and 0 <= ctx.max_logprobs < 2 * width:
        raise bad_request(f"a beam width of {width} needs {2 * width} logprobs per step; this server allows "
                          f"{ctx.max_logprobs} (--max-logprobs)", param="best_of" if best_of is not None else "n")
    if width > limits.MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"beam width {width} is larger than {limits.MAX_SEQUENCES_PER_REQUEST}", param="n")
    try:
        return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens or ctx.max_model_len,
                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                length_penalty=f.number("length_penalty", 1.0))
    except InvalidRequestError as e:
        raise bad_request(e.message, param=e.param) from None


_END = object()


class BeamEvents:
    """The Generation's event source for a beam search: runs the search on its own thread, then hands out one
    finished RequestOutput per prompt (prompt index, output) in the shape the completions body expects."""

    def __init__(self, state, gen_id: str, prompts: list, params: BeamSearchParams, n: Optional[int] = None):
        self.state = state
        self.id = gen_id
        self.prompts = prompts
        self.params = params
        self.q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._group = None
        self._step = 0
        self.n = n                       # choices per prompt: the best n of the beam_width beams
        self._thread = threading.Thread(target=self._run, name=f"beam-{gen_id}", daemon=True)
        self._thread.start()

    def _generate(self, prompt_lists: list, sp) -> list:
        engine = self.state.engine
        outs = [None] * len(prompt_lists)
        chunk = limits.MAX_SEQUENCES_PER_REQUEST
        self._step += 1
        for c0 in range(0, len(prompt_lists), chunk):
            if self._stop.is_set():
                raise _Stopped()
            reqs = [(f"{self.id}-beam{self._step}-{c0 + i}", ids, sp.clone())
                    for i, ids in enumerate(prompt_lists[c0:c0 + chunk])]
            group = self._group = engine.submit_batch(reqs)
            while True:
                try:
                    idx, out = group.get()
                except StopIteration:
                    break
                if out.finished:
                    if getattr(out, "error", None):
                        raise RuntimeError(f"the engine could not run a beam: {out.error}")
                    outs[c0 + idx] = out
            self._group = None
            if self._stop.is_set():
                raise _Stopped()
        return outs

    def _run(self) -> None:
        try:
            results = beam_search(self._generate, self.state.tokenizer, [list(p.token_ids) for p in self.prompts],
                                  self.params, eos_token_ids=self._eos(), max_model_len=self.state.max_model_len,
                                  should_stop=self._stop.is_set, decode_prompt=False)
        except _Stopped:
            self.q.put(_END)
            return
        except BaseException as e:  # noqa: BLE001 - handed to the request's thread
            self.q.put(e)
            return
        for pidx, (p, res) in enumerate(zip(self.prompts, results)):
            comps = []
            for j, b in enumerate(res.sequences[: self.n or len(res.sequences)]):
                gen = b.generated_tokens
                comps.append(CompletionOutput(index=j, text=b.text, token_ids=list(gen),
                                              cumulative_logprob=b.cum_logprob, logprobs=list(b.logprobs),
                                              finish_reason=b.finish_reason, stop_reason=b.stop_reason,
                                              delta_token_ids=list(gen)))
            self.q.put((pidx, RequestOutput(f"{self.id}-{pidx}", p.text, list(p.token_ids), comps, True)))
        self.q.put(_END)

    def _eos(self):
        return tuple(self.state.engine.call(operator.attrgetter("stop_ids")))    # (pickles: data parallelism)

    def next(self, timeout: float):
        from server.serving import _END as END, _TIMEOUT
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            return _TIMEOUT
        if item is _END:
            return END
        if isinstance(item, InvalidRequestError):
            raise bad_request(item.message, param=item.param)
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        self._stop.set()
        g = self._group
        if g is not None:
            try:
                g.abort()
            except Exception:  # noqa: BLE001
                pass


class _Stopped(Exception):
    pass
