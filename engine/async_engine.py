"""A background engine thread with per-request queues: the front the server uses.

Many threads (one per HTTP request) call `submit()` (one prompt) or `submit_batch()` (the prompts of one
HTTP request, admitted together in one command, their outputs in one queue) and read the returned stream;
one engine thread owns the `LLMEngine`, batches everything that is in flight, and pushes each request's
`RequestOutput`s into its queue. `abort()` (e.g. on a client disconnect) frees the request's KV blocks at
the next step boundary.

Admission work that costs (tokenising, validating, building logit masks) runs in the caller's thread
through `LLMEngine.prepare_request`; the engine thread only registers the prepared request.

No caller can wait forever: if the engine thread stops (any cause), `dead` holds the cause, every stream
and every waiting command gets an `EngineDeadError`, and later calls raise it at once; a command the
engine thread does not take within `ENGINE_COMMAND_TIMEOUT_S` is withdrawn with an `EngineTimeoutError`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from engine import limits
from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger("engine.async")

_DONE = object()
# How often a waiter without a timeout looks whether the engine thread is still alive.
_LIVENESS_POLL_S = 0.5


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve this call (the server answers 503)."""


class EngineDeadError(EngineUnavailableError):
    """The engine thread has stopped; nothing will be served any more."""


class EngineTimeoutError(EngineUnavailableError):
    """The engine thread did not take a command in time (it is stuck in a step)."""


class RequestStream:
    """Iterator over one request's outputs (each a cumulative RequestOutput with deltas)."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        # one put per token and request: SimpleQueue's put and get are C, where Queue's Python-level lock and
        # condition cost about as much as the waiting thread's wake-up itself
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False

    def _put(self, item) -> None:
        self.queue.put(item)

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        return self.get()

    def get(self, timeout: Optional[float] = None) -> RequestOutput:
        """The next output; with a timeout, raises queue.Empty if none arrives in time."""
        if self.finished:
            raise StopIteration
        item = self.engine._wait_on(self.queue, timeout)
        if item is _DONE:
            self.finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)
            self.finished = True


class _GroupMember:
    """Where the engine thread delivers one request of a group: into the group's queue, tagged."""
    __slots__ = ("group", "index", "request_id")

    def __init__(self, group: "RequestGroupStream", index: int, request_id: str):
        self.group = group
        self.index = index
        self.request_id = request_id

    def _put(self, item) -> None:
        self.group.queue.put((self.index, item))


class RequestGroupStream:
    """The outputs of several requests admitted together (the prompts of one HTTP request), in arrival
    order through one queue: `get()` returns (prompt index, RequestOutput); StopIteration once every
    request has ended. No thread per prompt."""

    def __init__(self, engine: "AsyncEngine", request_ids: list):
        self.engine = engine
        self.request_ids = list(request_ids)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.members = [_GroupMember(self, i, rid) for i, rid in enumerate(self.request_ids)]
        self._open = set(range(len(self.request_ids)))

    @property
    def finished(self) -> bool:
        return not self._open

    def __iter__(self):
        return self

    def __next__(self) -> tuple:
        return self.get()

    def get(self, timeout: Optional[float] = None) -> tuple:
        """(index, output); with a timeout, raises queue.Empty if none arrives in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._open:
                raise StopIteration
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            index, item = self.engine._wait_on(self.queue, left)
            if item is _DONE:
                self._open.discard(index)
                continue
            if isinstance(item, BaseException):
                self._open.discard(index)
                raise item
            if item.finished:
                self._open.discard(index)
            return index, item

    def abort(self) -> None:
        if self._open:
            self.engine.abort_many([self.request_ids[i] for i in sorted(self._open)])
            self._open.clear()


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None, **kwargs):
        self.engine = engine or LLMEngine(args or EngineArgs(**kwargs))
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict = {}         # request id -> RequestStream or _GroupMember (engine thread only)
        self._wake = threading.Event()
        self._stop = False
        self._dead: Optional[BaseException] = None
        self.command_timeout_s = limits.ENGINE_COMMAND_TIMEOUT_S
        self.step_count = 0
        self._thread = threading.Thread(target=self._loop, name="jitkern-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- client side
    @property
    def dead(self) -> Optional[BaseException]:
        """Why the engine thread stopped, or None while it runs."""
        return self._dead

    def submit(self, request_id: str, prompt, params, *, priority: int = 0, lora_request=None) -> RequestStream:
        """Adds a request; raises the engine's validation error (InvalidRequestError) synchronously."""
        self._check_alive()
        prep = self.engine.prepare_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
        stream = RequestStream(self, request_id)
        self._command("add", ([prep], [stream]))
        return stream

    def submit_batch(self, requests: list, *, priority: int = 0, lora_request=None) -> RequestGroupStream:
        """Adds several requests, given as (request id, prompt, params), in one engine command: all of them
        or (on an InvalidRequestError for any) none. Their outputs come through one RequestGroupStream."""
        self._check_alive()
        limits.check_batch(requests)
        preps = [self.engine.prepare_request(rid, prompt, params, priority=priority, lora_request=lora_request)
                 for rid, prompt, params in requests]
        group = RequestGroupStream(self, [rid for rid, _, _ in requests])
        self._command("add", (preps, group.members))
        return group

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list) -> None:
        self._cmds.put(("abort", list(request_ids), None))
        self._wake.set()

    def call(self, fn, *args):
        """Runs fn(engine, *args) on the engine thread (between steps) and returns its result."""
        return self._command("call", (fn, args))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops accepting work, lets in-flight requests finish (up to timeout), then stops the thread."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            # stuck in a step: the thread cannot be stopped, but nobody may keep waiting on it
            self._die(EngineDeadError("the server is shutting down"))

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        cause = self._dead
        if isinstance(cause, EngineDeadError):
            return cause
        return EngineDeadError(f"the engine thread stopped: {cause}")

    def _command(self, kind: str, payload):
        """Hands a command to the engine thread and waits for its result, never forever."""
        self._check_alive()
        fut: Future = Future()
        self._cmds.put((kind, payload, fut))
        self._wake.set()
        deadline = time.monotonic() + self.command_timeout_s
        while True:
            try:
                return fut.result(timeout=_LIVENESS_POLL_S)
            except FutureTimeout:
                pass
            if self._dead is not None or not self._thread.is_alive():
                if fut.cancel() or not fut.done():
                    raise self._dead_error() if self._dead is not None else EngineDeadError(
                        "the engine thread stopped")
            elif time.monotonic() > deadline and fut.cancel():
                raise EngineTimeoutError(
                    f"the engine did not take the {kind!r} command within {self.command_timeout_s:g} s")

    def _wait_on(self, q: queue.Queue, timeout: Optional[float]):
        """q.get(timeout) that, without a timeout, still notices an engine thread that has stopped."""
        if timeout is not None:
            return q.get(timeout=timeout)
        while True:
            try:
                return q.get(timeout=_LIVENESS_POLL_S)
            except queue.Empty:
                if self._dead is not None or not self._thread.is_alive():
                    try:
                        return q.get_nowait()     # what was delivered before it stopped comes first
                    except queue.Empty:
                        raise self._dead_error() if self._dead is not None else EngineDeadError(
                            "the engine thread stopped") from None

    # ------------------------------------------------------------------------------- engine side
    def _drain(self) -> None:
        while True:
            try:
                kind, payload, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue                           # the caller gave up waiting
            try:
                if kind == "add":
                    self._add(*payload)
                    fut.set_result(True)
                elif kind == "abort":
                    for rid in payload:
                        self.engine.abort_request(rid)
                        sink = self._streams.pop(rid, None)
                        if sink is not None:
                            sink._put(_DONE)
                elif kind == "call":
                    fn, args = payload
                    fut.set_result(fn(self.engine, *args))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("engine command %r failed", kind)

    def _add(self, preps: list, sinks: list) -> None:
        added = []
        try:
            for prep in preps:
                self.engine.add_prepared(prep)
                added.append(prep.request_id)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        for prep, sink in zip(preps, sinks):
            self._streams[prep.request_id] = sink

    def _loop(self) -> None:
        cause: Optional[BaseException] = None
        try:
            while not self._stop:
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    outs = self.engine.step()
                    self.step_count += 1
                except Exception as e:  # noqa: BLE001 - not attributable to a request (the engine isolates those)
                    log.error("engine step failed: %s\n%s", e, traceback.format_exc())
                    err = RuntimeError(f"internal engine error: {e}")
                    for rid, sink in list(self._streams.items()):
                        self.engine.abort_request(rid)
                        sink._put(err)
                    self._streams.clear()
                    continue
                for out in outs:
                    sink = self._streams.get(out.request_id)
                    if sink is None:
                        continue
                    sink._put(out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - recorded as the cause, every waiter is told
            log.critical("the engine thread stopped: %s\n%s", e, traceback.format_exc())
            cause = e
        finally:
            self._die(cause if cause is not None else EngineDeadError("the engine was shut down"))

    def _die(self, cause: BaseException) -> None:
        """Marks the engine dead and wakes every waiter (streams and commands) with an EngineDeadError."""
        if self._dead is None:
            self._dead = cause
        err = self._dead_error()
        while True:
            try:
                _, _, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        for rid, sink in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be what broke
                pass
            sink._put(err)
        self._streams.clear()
