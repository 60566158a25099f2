"""A background engine thread with per-request queues: the front the server uses.

Many threads (one per HTTP request) call `submit()` and iterate the returned `RequestStream`; one
engine thread owns the `LLMEngine`, batches everything that is in flight, and pushes each request's
`RequestOutput`s into its queue. `abort()` (e.g. on a client disconnect) frees the request's KV blocks
at the next step boundary.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Optional

from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger("engine.async")

_DONE = object()


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """Iterator over one request's outputs (each a cumulative RequestOutput with deltas)."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: queue.Queue = queue.Queue()
        self.finished = False

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        return self.get()

    def get(self, timeout: Optional[float] = None) -> RequestOutput:
        """The next output; with a timeout, raises queue.Empty if none arrives in time."""
        if self.finished:
            raise StopIteration
        item = self.queue.get(timeout=timeout)
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


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None, **kwargs):
        self.engine = engine or LLMEngine(args or EngineArgs(**kwargs))
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._dead: Optional[BaseException] = None
        self.step_count = 0
        self._thread = threading.Thread(target=self._loop, name="jitkern-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- client side
    def submit(self, request_id: str, prompt, params, *, priority: int = 0) -> RequestStream:
        """Adds a request; raises the engine's validation error (InvalidRequestError) synchronously."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread stopped: {self._dead}")
        stream = RequestStream(self, request_id)
        fut: Future = Future()
        self._cmds.put(("add", (request_id, prompt, params, priority, stream), fut))
        self._wake.set()
        fut.result()
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))
        self._wake.set()

    def call(self, fn, *args):
        """Runs fn(engine, *args) on the engine thread (between steps) and returns its result."""
        fut: Future = Future()
        self._cmds.put(("call", (fn, args), fut))
        self._wake.set()
        return fut.result()

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
        for rid, s in list(self._streams.items()):
            s.queue.put(EngineDeadError("the server is shutting down"))

    # ------------------------------------------------------------------------------- engine side
    def _drain(self) -> None:
        while True:
            try:
                kind, payload, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    rid, prompt, params, priority, stream = payload
                    self.engine.add_request(rid, prompt, params, priority=priority)
                    self._streams[rid] = stream
                    fut.set_result(True)
                elif kind == "abort":
                    if self.engine.abort_request(payload):
                        pass
                    s = self._streams.pop(payload, None)
                    if s is not None:
                        s.queue.put(_DONE)
                elif kind == "call":
                    fn, args = payload
                    fut.set_result(fn(self.engine, *args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if fut is not None:
                    fut.set_exception(e)

    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
                self.step_count += 1
            except BaseException as e:  # noqa: BLE001
                log.error("engine step failed: %s\n%s", e, traceback.format_exc())
                err = RuntimeError(f"internal engine error: {e}")
                for rid, s in list(self._streams.items()):
                    self.engine.abort_request(rid)
                    s.queue.put(err)
                self._streams.clear()
                continue
            for out in outs:
                s = self._streams.get(out.request_id)
                if s is None:
                    continue
                s.queue.put(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
