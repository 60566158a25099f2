"""A request's outputs between processes as deltas: what crosses a process boundary each step is what the step
added, and the receiving side rebuilds the same cumulative RequestOutput the engine made.

An engine in another process (a data-parallel replica, or the server's engine process) emits one RequestOutput
per request and step, each carrying the whole text, token ids and logprobs so far plus the prompt and its ids:
pickled as they are, a step of 64 requests at 128 tokens in is ~50 kB and takes more time to pickle and unpickle
than the step's Python does elsewhere. A delta message carries the step's new text, ids and logprobs, the
scalars, and the metrics' fields; the prompt and its ids once, with the request's first output.

Cumulative fields travel whole only when they are not the concatenation of the deltas sent: the text while the
engine holds back characters that may start a stop string (its `text` then runs ahead of the deltas), and ids or
logprobs if the engine ever rewrites them. Encoder and decoder keep the same running state, so the rebuilt output
equals the engine's field for field.

Most messages are a streaming token of a plain request: one completion, no logprobs, not finished, only the
metrics' last_token_time new. Those travel as (delta text, delta ids, last_token_time, cumulative logprob), a
quarter of the objects to pickle and unpickle of the general form, which matters in the receiving process: it
handles every token of every request.
"""
from __future__ import annotations

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class _SentCompletion:
    __slots__ = ("text", "n_ids", "n_lps")

    def __init__(self):
        self.text = ""
        self.n_ids = 0
        self.n_lps = 0


class OutputEncoder:
    """One request's outputs, on the engine's side: `encode(out)` gives the message body for `out`."""
    __slots__ = ("_sent_head", "_n_prompt_lps", "_comps", "_mt")

    def __init__(self):
        self._sent_head = False
        self._n_prompt_lps = 0
        self._comps: dict = {}
        self._mt = None

    def encode(self, out: RequestOutput) -> tuple:
        short = self._short(out)
        if short is not None:
            return short
        head = None
        if not self._sent_head:
            head = (out.prompt, out.prompt_token_ids)
            self._sent_head = True
        plp = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) != self._n_prompt_lps:
            plp = out.prompt_logprobs
            self._n_prompt_lps = len(plp)
        comps = []
        for c in out.outputs:
            s = self._comps.get(c.index)
            if s is None:
                s = self._comps[c.index] = _SentCompletion()
            s.text += c.delta_text
            s.n_ids += len(c.delta_token_ids)
            dlp = c.delta_logprobs
            if dlp is not None:
                s.n_lps += len(dlp)
            full_text = None if c.text == s.text else c.text
            full_ids = None if len(c.token_ids) == s.n_ids else list(c.token_ids)
            if full_ids is not None:
                s.n_ids = len(full_ids)
            full_lps = None
            if c.logprobs is not None and len(c.logprobs) != s.n_lps:
                full_lps = list(c.logprobs)
                s.n_lps = len(full_lps)
            comps.append((c.index, c.delta_text, c.delta_token_ids, dlp, c.finish_reason, c.stop_reason,
                          c.cumulative_logprob, c.logprobs is not None, full_text, full_ids, full_lps))
        m = out.metrics
        mt = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                     m.finished_time, m.num_cached_tokens)
        self._mt = mt
        return (head, plp, out.finished, out.error, mt, comps)

    def _short(self, out: RequestOutput):
        """The 4-tuple form of a plain streaming step (see the module's docstring), or None."""
        m, mt = out.metrics, self._mt
        if (not self._sent_head or out.finished or out.error is not None or len(out.outputs) != 1 or m is None
                or mt is None or out.prompt_logprobs is not None):
            return None
        c = out.outputs[0]
        s = self._comps.get(c.index)
        if (c.index != 0 or s is None or c.logprobs is not None or c.finish_reason is not None
                or c.stop_reason is not None or len(c.token_ids) != s.n_ids + len(c.delta_token_ids)
                or len(c.text) != len(s.text) + len(c.delta_text) or m.arrival_time != mt[0]
                or m.first_scheduled_time != mt[1] or m.first_token_time != mt[2] or m.finished_time != mt[4]
                or m.num_cached_tokens != mt[5]):
            return None
        new_text = s.text + c.delta_text
        if new_text != c.text:
            return None
        s.text = new_text
        s.n_ids += len(c.delta_token_ids)
        self._mt = mt[:3] + (m.last_token_time,) + mt[4:]
        return (c.delta_text, c.delta_token_ids, m.last_token_time, c.cumulative_logprob)


class _Completion:
    __slots__ = ("index", "text", "ids", "lps")

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.ids: list = []
        self.lps: list = []


class OutputDecoder:
    """One request's outputs, on the receiving side: `decode(request_id, body)` rebuilds the RequestOutput."""
    __slots__ = ("_prompt", "_prompt_ids", "_prompt_lps", "_metrics", "_comps")

    def __init__(self):
        self._prompt = None
        self._prompt_ids: list = []
        self._prompt_lps = None
        self._metrics = None
        self._comps: dict = {}

    def decode(self, request_id: str, body: tuple) -> RequestOutput:
        if len(body) == 4:
            return self._decode_short(request_id, body)
        head, plp, finished, error, metrics, comps = body
        if head is not None:
            self._prompt, self._prompt_ids = head
        if plp is not None:
            self._prompt_lps = plp
        if metrics is not None:
            if self._metrics is None:
                self._metrics = RequestMetrics(*metrics)
            else:
                m = self._metrics
                (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
                 m.num_cached_tokens) = metrics
        outputs = []
        for (index, dtext, dids, dlps, finish, stop, cum_lp, has_lps, full_text, full_ids, full_lps) in comps:
            c = self._comps.get(index)
            if c is None:
                c = self._comps[index] = _Completion(index)
            c.text += dtext
            if full_ids is not None:
                c.ids = full_ids
            else:
                c.ids.extend(dids)
            if full_lps is not None:
                c.lps = full_lps
            elif dlps is not None:
                c.lps.extend(dlps)
            outputs.append(CompletionOutput(
                index=index, text=c.text if full_text is None else full_text, token_ids=list(c.ids),
                cumulative_logprob=cum_lp, logprobs=c.lps if has_lps else None, finish_reason=finish,
                stop_reason=stop, delta_text=dtext, delta_token_ids=dids, delta_logprobs=dlps))
        return RequestOutput(request_id, self._prompt, self._prompt_ids, outputs, finished,
                             prompt_logprobs=self._prompt_lps, metrics=self._metrics, error=error)

    def _decode_short(self, request_id: str, body: tuple) -> RequestOutput:
        dtext, dids, last_token_time, cum_lp = body
        c = self._comps[0]
        c.text += dtext
        c.ids.extend(dids)
        self._metrics.last_token_time = last_token_time
        return RequestOutput(request_id, self._prompt, self._prompt_ids, [CompletionOutput(
            index=0, text=c.text, token_ids=list(c.ids), cumulative_logprob=cum_lp, logprobs=None, finish_reason=None,
            stop_reason=None, delta_text=dtext, delta_token_ids=dids, delta_logprobs=None)], False,
            prompt_logprobs=self._prompt_lps, metrics=self._metrics, error=None)
