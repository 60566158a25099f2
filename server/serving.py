"""Running one parsed generation request on the engine: a JSON response or an SSE stream.

One HTTP request becomes one engine request per prompt (a batch of prompts fans out); `n` choices
per prompt are the engine's business. The handler thread waits on the engine's per-request queues
with a short timeout, so that while it waits it can send SSE keepalive comments and notice a client
that went away (then the engine requests are aborted and their KV blocks freed).
"""
from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import InvalidRequestError
from engine.outputs import merge_deltas
from server.errors import APIError, bad_request
from server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from server.protocol import GenerationRequest

log = logging.getLogger("jitkern.server")

_END = object()
_TIMEOUT = object()
# How often a waiting handler looks at its client's socket.
POLL_S = 0.25
DONE_FRAME = b"data: [DONE]\n\n"
# A JSON string the way dumps() writes it (no ASCII escaping), for the text of a precomputed chunk.
_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
KEEPALIVE_FRAME = b": keepalive\n\n"


def dumps(obj) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate somewhere (it has no UTF-8 form): \u escapes are still valid JSON.
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def sse_frame(obj) -> bytes:
    # One JSON document per event: a multi-byte character can never straddle two events.
    return b"data: " + dumps(obj) + b"\n\n"


def client_gone(environ: dict) -> bool:
    """True when the peer has closed its connection (an orderly FIN or a reset); never blocks."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        # Poll first: a socket with a timeout (the worker sets one) waits for readability inside recv()
        # whatever the flags say, so recv alone could block for the whole timeout.
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
        if not poller.poll(0):
            return False
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except (ConnectionError, TimeoutError):
        return True
    except (OSError, ValueError):   # e.g. a TLS socket refuses MSG_PEEK: assume still there
        return False
    return data == b""


def truncate_for_log(value, limit: int) -> str:
    """`value` for a log line: cut to `limit` characters, then escaped (repr), so that a newline or a
    control character in client text can never start a forged log line."""
    if isinstance(value, str):
        if limit is not None and len(value) > limit:
            return repr(value[:limit]) + f"...[{len(value) - limit} more chars]"
        return repr(value)
    text = repr(value)      # lists (a batch of prompts, outputs) and numbers: repr escapes their strings
    if limit is not None and len(text) > limit:
        return text[:limit] + f"...[{len(text) - limit} more chars]"
    return text


class StreamEvents:
    """The outputs of a request with one prompt (one engine stream)."""

    def __init__(self, stream):
        self.stream = stream

    def next(self, timeout: float):
        """(prompt index, RequestOutput), or _TIMEOUT, or _END once the stream has ended."""
        try:
            return 0, self.stream.get(timeout=timeout)
        except queue.Empty:
            return _TIMEOUT
        except StopIteration:
            return _END

    def abort(self) -> None:
        try:
            self.stream.abort()
        except Exception as e:  # noqa: BLE001
            log.warning("abort of %s failed: %s", getattr(self.stream, "request_id", "?"), e)


class GroupEvents:
    """The outputs of a request with several prompts, admitted together by the engine's `submit_batch`: one
    queue for all of them, in arrival order, as (prompt index, RequestOutput)."""

    def __init__(self, group):
        self.group = group

    def next(self, timeout: float):
        try:
            return self.group.get(timeout=timeout)
        except queue.Empty:
            return _TIMEOUT
        except StopIteration:
            return _END

    def abort(self) -> None:
        try:
            self.group.abort()
        except Exception as e:  # noqa: BLE001
            log.warning("abort of %s failed: %s", self.group.request_ids, e)


@dataclass
class _PromptProgress:
    token_ids: list
    text: Optional[str]
    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_generated: int = 0
    last_output: object = None
    finished: bool = False


@dataclass
class _ChoiceProgress:
    started: bool = False          # role chunk / echo already sent
    finished: bool = False
    finish_reason: Optional[str] = None
    num_tokens: int = 0
    text_offset: int = 0
    token_ids: list = field(default_factory=list)


class Generation:
    """One generation request in flight, from submission to its last byte."""

    def __init__(self, state, req: GenerationRequest, environ: dict):
        self.state = state
        self.req = req
        self.environ = environ
        self.chat = req.endpoint == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = req.request_id or f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.served_model_name
        self.n = req.params.n
        now = time.monotonic()
        self.prompts = [_PromptProgress(p.token_ids, p.text, now) for p in req.prompts]
        self.choices = [_ChoiceProgress() for _ in range(len(req.prompts) * self.n)]
        # Chat output parsing (tool calls, reasoning): one processor per choice.
        self.parsers = None
        if self.chat and req.chat_output is not None:
            from server.chat_output import ChatOutputProcessor
            self.parsers = [ChatOutputProcessor(req.chat_output) for _ in self.choices]
        self.events = None               # StreamEvents or GroupEvents once submitted
        self.engine_ids: list = []
        self.closed = False
        self._lock = threading.Lock()
        self.aborted_by_server = False
        self._last_check = time.monotonic()
        self._frame_template = None      # (head, tail) bytes of a text chunk, False when not used (_text_frame)

    # ----------------------------------------------------------------------------------- lifecycle
    def submit(self) -> None:
        engine = self.state.engine
        prompts = self.req.prompts
        lora = self.state.lora.request_for(self.req.model) if getattr(self.state, "lora", None) else None
        lkw = {"lora_request": lora} if lora is not None else {}       # a request naming a LoRA adapter
        try:
            if lora is not None and self.req.beam is not None:
                raise bad_request("use_beam_search is not available with a LoRA adapter", param="model")
            if self.req.beam is not None:          # use_beam_search: server.beam runs the search
                from server.beam import BeamEvents
                self.events = BeamEvents(self.state, self.id, prompts, self.req.beam, n=self.req.params.n)
                self.engine_ids = [self.id]
            elif len(prompts) == 1:
                prompt = list(prompts[0].token_ids)
                if prompts[0].images:           # image_url parts: the engine expands and encodes them
                    prompt = {"prompt_token_ids": prompt, "multi_modal_data": {"image": prompts[0].images}}
                stream = engine.submit(self.id, prompt, self.req.params.clone(), priority=self.req.priority, **lkw)
                self.engine_ids = [self.id]
                self.events = StreamEvents(stream)
            else:
                # All prompts of the request in one engine command: all admitted, or none.
                rids = [f"{self.id}-{i}" for i in range(len(prompts))]
                group = engine.submit_batch([(rid, list(p.token_ids), self.req.params.clone())
                                             for rid, p in zip(rids, prompts)], priority=self.req.priority, **lkw)
                self.engine_ids = rids
                self.events = GroupEvents(group)
        except InvalidRequestError as e:
            param = e.param
            if self.chat and param in ("prompt", "multi_modal_data"):
                param = "messages"
            raise bad_request(e.message, param=param) from None
        self.state.register(self)
        self._log_request()

    def abort(self) -> None:
        """Ends the engine requests (client gone, or the server is draining)."""
        if self.events is not None:
            self.events.abort()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        unfinished = [p for p in self.prompts if not p.finished]
        if unfinished and self.events is not None:
            self.events.abort()
            now = time.monotonic()
            for p in unfinished:
                self._observe_finish(p, "abort", now)
        self.state.unregister(self)
        if self.events is not None:
            self._log_output()

    # ----------------------------------------------------------------------------------- events
    def _wait(self, deadline_ping: Optional[float]):
        """Next engine event; _TIMEOUT when a keepalive is due. Raises _ClientGone when the client left."""
        while True:
            now = time.monotonic()
            if now - self._last_check >= POLL_S:
                # Looked at on a clock, not only when idle: tokens may keep coming for a client long gone.
                self._last_check = now
                if client_gone(self.environ):
                    raise _ClientGone()
            timeout = POLL_S if deadline_ping is None else max(0.0, min(POLL_S, deadline_ping - now))
            ev = self.events.next(timeout)
            if ev is not _TIMEOUT:
                return ev
            if deadline_ping is not None and time.monotonic() >= deadline_ping:
                return _TIMEOUT

    def _on_output(self, pidx: int, out) -> None:
        now = time.monotonic()
        p = self.prompts[pidx]
        p.last_output = out
        if len(out.prompt_token_ids) != len(p.token_ids) and self.req.prompts[pidx].images:
            p.token_ids = list(out.prompt_token_ids)    # image tokens expanded by the engine: usage counts them
        new = sum(len(c.delta_token_ids) for c in out.outputs)
        metrics = self.state.metrics
        if new:
            if p.first_token is None:
                p.first_token = now
                if metrics is not None:
                    metrics.ttft.observe(now - p.arrival)
            elif metrics is not None:
                metrics.itl.observe(now - p.last_token)
            p.last_token = now
            p.num_generated += new
        if out.finished and not p.finished:
            reasons = [c.finish_reason for c in out.outputs]
            self._observe_finish(p, reasons[0] if reasons else "stop", now)
            if getattr(out, "error", None) or "error" in reasons:
                raise APIError(f"the engine could not run request {out.request_id}: "
                               f"{getattr(out, 'error', None) or 'engine error'}", status=500)

    def _observe_finish(self, p: _PromptProgress, reason: str, now: float) -> None:
        p.finished = True
        if self.state.metrics is not None:
            self.state.metrics.request_finished(reason, arrival=p.arrival, first_token=p.first_token, finished=now,
                                                num_prompt_tokens=len(p.token_ids), num_generation_tokens=p.num_generated)

    def usage(self) -> dict:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def _prompt_text(self, pidx: int) -> str:
        p = self.prompts[pidx]
        if p.text is None:
            p.text = self.state.tokenizer.decode(p.token_ids)
        return p.text

    # ----------------------------------------------------------------------------------- JSON
    def run_to_completion(self) -> dict:
        try:
            while True:
                ev = self._wait(None)
                if ev is _END:
                    break
                pidx, out = ev
                self._on_output(pidx, out)
                for comp in out.outputs:
                    ch = self.choices[pidx * self.n + comp.index]
                    ch.num_tokens = len(comp.token_ids)
                    if comp.finish_reason is not None:
                        ch.finished, ch.finish_reason = True, comp.finish_reason
                if all(p.finished for p in self.prompts):
                    break
            return self._final_body()
        except _ClientGone:
            log.info("request %s: client disconnected; aborted", self.id)
            raise
        finally:
            self.close()

    def _final_body(self) -> dict:
        req = self.req
        choices = []
        for pidx, p in enumerate(self.prompts):
            out = p.last_output
            comps = sorted(out.outputs, key=lambda c: c.index) if out is not None else []
            by_index = {c.index: c for c in comps}
            for j in range(self.n):
                comp = by_index.get(j)
                ci = pidx * self.n + j
                text = comp.text if comp is not None else ""
                token_ids = list(comp.token_ids) if comp is not None else []
                lps = list(comp.logprobs or []) if comp is not None else []
                finish = (comp.finish_reason if comp is not None else None) or "abort"
                stop_reason = comp.stop_reason if comp is not None else None
                if self.chat:
                    message = {"role": "assistant", "content": req.echo_text + text}
                    if self.parsers is not None:
                        message = self.parsers[ci].message(text, req.echo_text)
                        finish = self.parsers[ci].finish_reason(finish)
                    choice = {"index": ci, "message": message,
                              "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
                    if req.logprobs is not None:
                        choice["logprobs"] = chat_logprobs(token_ids, lps, req.logprobs, self.state.token_strings,
                                                           as_ids=req.return_tokens_as_token_ids)
                else:
                    prefix = self._prompt_text(pidx) if req.echo else ""
                    choice = {"index": ci, "text": prefix + text, "logprobs": None, "finish_reason": finish,
                              "stop_reason": stop_reason}
                    if req.logprobs is not None:
                        ids, entries = token_ids, lps
                        if req.echo_logprobs:
                            plp = (out.prompt_logprobs if out is not None else None) or [None] * len(p.token_ids)
                            ids, entries = list(p.token_ids) + ids, list(plp) + entries
                        choice["logprobs"] = completion_logprobs(ids, entries, req.logprobs, self.state.token_strings,
                                                                 as_ids=req.return_tokens_as_token_ids)
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs if out else None)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(p.token_ids)
                    choice["token_ids"] = token_ids
                choices.append(choice)
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.chat and req.prompt_logprobs is not None:
            out = self.prompts[0].last_output
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs if out else None)
        return body

    # ----------------------------------------------------------------------------------- SSE
    def _text_frame(self, ci: int, content: str) -> Optional[bytes]:
        """The SSE frame of a plain text piece (no finish, logprobs or token ids), byte for byte what
        `_chunk([_stream_choice(...)])` gives, from a head and tail built once per request: the JSON of the
        whole body is the per-token cost that dominates a handler thread at high concurrency. None when this
        request's chunks are not of that shape (continuous usage stats) or the text needs the ASCII fallback."""
        tmpl = self._frame_template
        if tmpl is None:
            if self.req.include_usage and self.req.continuous_usage_stats:
                self._frame_template = False
                return None
            try:       # '{"id":...,"choices":[' ("]}" cut off)
                head = _TEXT_ENCODER.encode({"id": self.id, "object": "chat.completion.chunk" if self.chat else
                                             "text_completion", "created": self.created, "model": self.model,
                                             "choices": []}).encode("utf-8")[:-2]
            except UnicodeEncodeError:      # dumps() would escape every body of this request
                self._frame_template = False
                return None
            tail = b'],"usage":null}\n\n' if self.req.include_usage else b"]}\n\n"
            tmpl = self._frame_template = (b"data: " + head, tail)
        elif tmpl is False:
            return None
        try:
            text = _TEXT_ENCODER.encode(content).encode("utf-8")
        except UnicodeEncodeError:          # a lone surrogate: the general path escapes the whole body
            return None
        if self.chat:
            choice = b'{"index":%d,"delta":{"content":%b},"logprobs":null,"finish_reason":null}' % (ci, text)
        else:
            choice = b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":null}' % (ci, text)
        return tmpl[0] + choice + tmpl[1]

    def _chunk(self, choices: list, usage_now: bool = False) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            body["usage"] = self.usage() if (usage_now or self.req.continuous_usage_stats) else None
        return sse_frame(body)

    def _stream_choice(self, ci: int, text: str, token_ids: list, entries, finish, stop_reason,
                       delta: Optional[dict] = None) -> dict:
        req = self.req
        if self.chat and self.parsers is not None:
            if delta is None:
                delta = self.parsers[ci].delta(text, final=finish is not None)
            finish = self.parsers[ci].finish_reason(finish)
        if self.chat:
            if delta is None:
                delta = {"content": text} if (text or finish is None) else {}
            choice = {"index": ci, "delta": delta, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None and token_ids:
                choice["logprobs"] = chat_logprobs(token_ids, entries, req.logprobs, self.state.token_strings,
                                                   as_ids=req.return_tokens_as_token_ids)
        else:
            choice = {"index": ci, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None and token_ids:
                ch = self.choices[ci]
                choice["logprobs"] = completion_logprobs(token_ids, entries, req.logprobs, self.state.token_strings,
                                                         as_ids=req.return_tokens_as_token_ids,
                                                         text_offset=ch.text_offset)
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _stream_output(self, pidx: int, out):
        req = self.req
        for comp in sorted(out.outputs, key=lambda c: c.index):
            ci = pidx * self.n + comp.index
            ch = self.choices[ci]
            if ch.finished:
                continue
            text = comp.delta_text
            ids = list(comp.delta_token_ids)
            entries = list(comp.delta_logprobs or [None] * len(ids)) if req.logprobs is not None else None
            ch.num_tokens += len(ids)
            if not ch.started and not self.chat:
                ch.started = True
                if req.echo:
                    text = self._prompt_text(pidx) + text
                    if req.echo_logprobs:
                        plp = out.prompt_logprobs or [None] * len(self.prompts[pidx].token_ids)
                        ids = list(self.prompts[pidx].token_ids) + ids
                        entries = list(plp) + entries
            finish = comp.finish_reason
            delta = None
            if self.parsers is not None:
                # Parsers may hold text back (a marker still arriving): an empty delta sends nothing.
                delta = self.parsers[ci].delta(text, final=finish is not None)
                if not delta and finish is None and not (req.logprobs is not None and ids):
                    continue
            elif not text and finish is None and not (req.logprobs is not None and ids):
                continue
            if finish is not None:
                ch.finished, ch.finish_reason = True, finish
            frame = None
            if finish is None and req.logprobs is None and not req.return_token_ids:
                if delta is None:
                    frame = self._text_frame(ci, text)
                elif len(delta) == 1 and type(delta.get("content")) is str:
                    frame = self._text_frame(ci, delta["content"])
            yield frame or self._chunk([self._stream_choice(ci, text, ids, entries, finish, comp.stop_reason, delta)])
            ch.text_offset += len(text)

    def stream(self):
        """The SSE body: chunks, then (with include_usage) a usage chunk, then `data: [DONE]`."""
        req = self.req
        ping = self.state.settings.sse_ping_s
        try:
            if self.chat:
                for ci, ch in enumerate(self.choices):
                    ch.started = True
                    first = {"index": ci, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield self._chunk([first])
                    if req.echo_text:
                        yield self._chunk([{"index": ci, "delta": {"content": req.echo_text}, "logprobs": None,
                                            "finish_reason": None}])
            last_write = time.monotonic()
            while True:
                ev = self._wait(last_write + ping if ping > 0 else None)
                if ev is _TIMEOUT:
                    yield KEEPALIVE_FRAME
                    last_write = time.monotonic()
                    continue
                if ev is _END:
                    break
                # Outputs that queued up while this thread waited (for the interpreter lock, the socket) go out
                # as one chunk per choice, their deltas joined, as vLLM's streaming does: a reader that falls
                # behind costs one chunk per wake-up instead of one per token, so it catches up.
                merged: dict = {}
                ended = False
                try:
                    while True:
                        pidx, out = ev
                        self._on_output(pidx, out)
                        prev = merged.get(pidx)
                        merged[pidx] = out if prev is None else merge_deltas(prev, out)
                        if all(p.finished for p in self.prompts):
                            ended = True
                            break
                        ev = self.events.next(0)
                        if ev is _TIMEOUT:
                            break
                        if ev is _END:
                            ended = True
                            break
                except Exception:
                    frames = [f for pi, o in merged.items() for f in self._stream_output(pi, o)]
                    if frames:              # what was due before the failure still goes out first
                        yield b"".join(frames)
                    raise
                frames = [f for pi, o in merged.items() for f in self._stream_output(pi, o)]
                if frames:
                    yield frames[0] if len(frames) == 1 else b"".join(frames)
                    last_write = time.monotonic()
                if ended:
                    break
            # Streams that ended without finishing were aborted (server shutdown): end their choices cleanly.
            for ci, ch in enumerate(self.choices):
                if not ch.finished:
                    ch.finished, ch.finish_reason = True, "abort"
                    yield self._chunk([self._stream_choice(ci, "", [], [], "abort", None)])
            if req.include_usage:
                body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
                yield sse_frame(body)
            yield DONE_FRAME
        except _ClientGone:
            log.info("request %s: client disconnected; aborted", self.id)
        except APIError as e:
            log.error("request %s failed mid-stream: %r", self.id, e.message)
            yield sse_frame(e.to_dict())
            yield DONE_FRAME
        except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not a dropped connection
            public = getattr(e, "public_message", None)     # a data-parallel replica died: say which
            if public:
                log.error("request %s failed mid-stream: %s", self.id, public)
            else:
                log.exception("request %s failed mid-stream", self.id)
            yield sse_frame(APIError(public or "internal error while generating (the server log has the details)",
                                     status=503 if public else 500).to_dict())
            yield DONE_FRAME
        finally:
            self.close()

    # ----------------------------------------------------------------------------------- logging
    def _log_request(self) -> None:
        s = self.state.settings
        if not s.log_requests:
            return
        p = self.req.params
        params = {k: getattr(p, k) for k in ("n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop",
                                                "logprobs")}
        ids = [t for p_ in self.prompts for t in p_.token_ids]
        log.info("request %s (%s%s): prompt: %s, params: %s, prompt tokens: %d", self.id, self.req.endpoint,
                 ", stream" if self.req.stream else "",
                 truncate_for_log(self.req.log_summary.get("prompt"), s.max_log_len), params, len(ids))

    def _log_output(self) -> None:
        s = self.state.settings
        if not s.log_outputs:
            return
        texts = []
        for p in self.prompts:
            out = p.last_output
            if out is not None:
                texts.extend(c.text for c in out.outputs)
        reasons = [c.finish_reason for c in self.choices]
        log.info("response %s: output: %s, finish_reason: %s, usage: %s", self.id,
                 truncate_for_log(texts if len(texts) != 1 else texts[0], s.max_log_len), reasons, self.usage())


class _ClientGone(Exception):
    pass


ClientGone = _ClientGone


class SSEBody:
    """The WSGI response iterable of a stream. Its close() (which gunicorn calls when the client is gone,
    even before the first chunk) ends the generation, so an abandoned request never keeps its KV blocks."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self._gen = generation.stream()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._gen)

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self.generation.close()
