"""The gunicorn worker of the server: gthread, with slow clients kept off the threads and JSON errors.

gunicorn's gthread worker hands a connection to a pool thread as soon as it is readable, and the thread
then reads the request head and body with blocking reads and no deadline: one byte every few seconds
holds a thread for as long as the client likes, and ~100 such clients (the pool size) left `/health`
unanswered for over a minute. This worker reads each request's head, and its body when the length is
known (Content-Length, or a chunked body whose framing it follows), in the event loop with
non-blocking reads. A request reaches a thread only once it is complete, so a slow client costs a
buffer in the event loop, never a thread. Deadlines: the head must arrive within JITKERN_HEAD_TIMEOUT_S
(10 s) of the connection becoming active, the body within JITKERN_BODY_TIMEOUT_S (60 s) after the head;
otherwise the client gets a 408 and the connection is closed. Sockets handed to a thread get
JITKERN_IO_TIMEOUT_S (30 s) per read or write, so a client that stops reading a stream is dropped (and
its generation aborted) instead of holding the thread.

A body over the limit is answered 413 without being read, and the response says "Connection: close".
Closing at once would leave the client's unsent body unread: the kernel answers it with a reset, and a
client still writing sees a broken pipe instead of the 413 (gunicorn's own close drains only 64 KiB, and
blocks the event loop while it does). Instead a closing connection lingers in the event loop: its write
side is shut (the client reads the response and then end of stream) and what the client still sends is
read and discarded, until the client closes, LINGER_IDLE_S pass without a byte, BODY_TIMEOUT_S pass in
all, or 4x the body limit (plus 1 MiB) has been discarded; then it is closed. No thread waits for it.

gunicorn's own error responses (a malformed request line or header, 414, 431, 417, a bad chunk size,
an unsupported transfer coding) are HTML; here they are OpenAI error objects, and every client mistake
is a 4xx (an unsupported transfer coding is a 400, not gunicorn's 501).
"""
from __future__ import annotations

import errno
import json
import re
import selectors
import socket
import ssl
import time
from collections import deque
from functools import partial
from http import HTTPStatus

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.workers import gthread

from server.settings import env_float, env_int

HEAD_TIMEOUT_S = env_float("JITKERN_HEAD_TIMEOUT_S", 10.0, low=0.1)
BODY_TIMEOUT_S = env_float("JITKERN_BODY_TIMEOUT_S", 60.0, low=0.1)
IO_TIMEOUT_S = env_float("JITKERN_IO_TIMEOUT_S", 30.0, low=0.1)
MAX_BODY_BYTES = env_int("JITKERN_MAX_BODY_BYTES", 32 << 20, low=1)
# A head larger than this goes to a thread as it is (gunicorn's parser then refuses it with 414 or 431).
MAX_HEAD_PREREAD = 64 << 10
# Bodies buffered in the event loop at one time, over all connections; past it, bodies are read by threads.
MAX_PREREAD_TOTAL = env_int("JITKERN_MAX_PREREAD_BYTES", 512 << 20, low=1)
RECV_CHUNK = 256 << 10
# A closing connection whose client sends nothing for this long is closed without waiting further.
LINGER_IDLE_S = 2.0
# At most this much of a refused body is read and discarded before the connection is closed.
LINGER_MAX_BYTES = 4 * MAX_BODY_BYTES + (1 << 20)

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


def error_response(status: int, message: str, code: str | None = None) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI error object; the connection closes after it."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                      ensure_ascii=True).encode("ascii")
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode("ascii")
    return head + body


def classify_error(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, message, code) for an exception that reached gunicorn's handle_error."""
    e = http_errors
    text = str(exc)[:300]
    if isinstance(exc, (e.InvalidResponseHeader, e.InvalidResponseHeaderName, e.ConfigurationProblem)) \
            or not isinstance(exc, (e.ParseException, ssl.SSLError)):
        return 500, "internal server error (the server log has the details)", None
    if isinstance(exc, e.LimitRequestLine):
        return 414, f"the request line is too long: {text}", "uri_too_long"
    if isinstance(exc, e.LimitRequestHeaders):
        return 431, f"the request headers are too large: {text}", "request_header_fields_too_large"
    if isinstance(exc, e.ExpectationFailed):
        return 417, f"expectation failed: {text}", "expectation_failed"
    if isinstance(exc, e.ForbiddenProxyRequest):
        return 403, "request forbidden", "forbidden"
    if isinstance(exc, e.UnsupportedTransferCoding):
        return 400, f"unsupported transfer coding: {text}", "unsupported_transfer_coding"
    if isinstance(exc, (e.InvalidChunkSize, e.ChunkMissingTerminator, e.InvalidChunkExtension)):
        return 400, f"malformed chunked body: {text}", "invalid_body"
    return 400, f"malformed HTTP request: {text}", "invalid_http_request"


class _RequestScan:
    """How much of a request has arrived: its head, then (when the length is known) its body."""

    def __init__(self):
        self.buf = bytearray()
        self.head_end = -1           # offset of the body once the head is complete
        self.body_len = None         # Content-Length, when the body is read here
        self.chunked = False         # a chunked body whose framing is followed here
        self.chunk_pos = 0           # offset (in buf) of the next chunk-size line
        self.done = False            # complete: hand to a thread
        self.expects_continue = False    # the client waits for "100 Continue" before it sends the body
        self.oversize = False        # a body over the limit: the app answers 413 without reading it

    def feed(self, data: bytes, max_body: int) -> None:
        self.buf += data
        if self.head_end < 0:
            # Blank lines before a request line are allowed (RFC 9112 2.2) and are not the end of a head.
            start = len(self.buf) - len(self.buf.lstrip(b"\r\n"))
            m = _HEAD_END.search(self.buf, start) if start < len(self.buf) else None
            if m is None:
                if len(self.buf) > MAX_HEAD_PREREAD:
                    self.done = True
                return
            self.head_end = m.end()
            self._plan_body(bytes(self.buf[:m.start()]), max_body)
            if self.done:
                return
        if self.body_len is not None:
            self.done = len(self.buf) - self.head_end >= self.body_len
        elif self.chunked:
            self._scan_chunks(max_body)

    def _plan_body(self, head: bytes, max_body: int) -> None:
        lengths, codings, expect = [], [], False
        for line in head.split(b"\n")[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name = name.strip().lower()
            if name == b"content-length":
                lengths.append(value.strip())
            elif name == b"transfer-encoding":
                codings.append(value.strip().lower())
            elif name == b"expect":
                expect = value.strip().lower() == b"100-continue" and not expect
                if not expect:
                    self.done = True         # an expectation gunicorn refuses (417), or two of them
                    return
        self.expects_continue = expect
        if codings:
            if codings == [b"chunked"] and not lengths:
                self.chunked = True
                self.chunk_pos = self.head_end
            else:
                self.done = True             # gunicorn's parser judges the odd cases
        elif len(lengths) == 1 and lengths[0].isdigit() and int(lengths[0]) <= max_body:
            self.body_len = int(lengths[0])
        else:
            self.oversize = len(lengths) == 1 and lengths[0].isdigit()
            self.done = True                 # no body, or one the app refuses unread (413)

    def _scan_chunks(self, max_body: int) -> None:
        buf = self.buf
        while True:
            if self.chunk_pos - self.head_end > max_body + (64 << 10):
                self.done = self.oversize = True     # too large: the app answers 413
                return
            eol = buf.find(b"\r\n", self.chunk_pos)
            if eol < 0:
                if len(buf) - self.chunk_pos > 1024:
                    self.done = True         # a chunk-size line this long is malformed: let the parser say so
                return
            size_text = bytes(buf[self.chunk_pos:eol]).split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size_text) or int(size_text, 16) > max_body:
                self.done = True             # an invalid chunk size (or a huge one): answered at once
                self.oversize = bool(_HEX.fullmatch(size_text))
                return
            size = int(size_text, 16)
            if size == 0:
                # Trailers, if any, then an empty line.
                if buf.startswith(b"\r\n", eol + 2) or buf.find(b"\r\n\r\n", eol) >= 0:
                    self.done = True
                return
            nxt = eol + 2 + size + 2
            if nxt > len(buf):
                return
            self.chunk_pos = nxt


class _RequestDeadlineSocket:
    """The socket as the request parser sees it: reads end at the request's deadline, and a read that
    times out ends the request as a client that went away (gunicorn closes it quietly)."""

    def __init__(self, sock):
        self._sock = sock
        self.deadline = float("inf")

    def recv(self, size, *args):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise http_errors.NoMoreData(b"")
        current = self._sock.gettimeout()      # gunicorn's body drain sets a shorter one: keep it
        self._sock.settimeout(min(IO_TIMEOUT_S, remaining, current or IO_TIMEOUT_S))
        try:
            return self._sock.recv(size, *args)
        except (socket.timeout, TimeoutError):
            raise http_errors.NoMoreData(b"") from None
        finally:
            self._sock.settimeout(current)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class ServerConn(gthread.TConn):
    """A gthread connection that may carry bytes already read by the event loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scan = None
        self.deadline = 0.0
        self.pending_bytes = b""
        self.oversize = False        # this request's body is over the limit (see _RequestScan.oversize)
        self.linger_left = 0         # bytes still discarded while the connection lingers before closing
        self.linger_end = 0.0

    def init(self):
        super().init()
        if self.pending_bytes:
            self.parser.unreader.unread(self.pending_bytes)
            self.pending_bytes = b""
        # Blocking from here on (the thread's reads and writes), but never for longer than this at once.
        self.sock.settimeout(IO_TIMEOUT_S)
        # What the thread still reads of this request (a head or body the event loop could not follow)
        # has to arrive by the same deadlines.
        unreader = getattr(self.parser, "unreader", None)
        if unreader is not None and hasattr(unreader, "sock"):
            if not isinstance(unreader.sock, _RequestDeadlineSocket):
                unreader.sock = _RequestDeadlineSocket(unreader.sock)
            unreader.sock.deadline = time.monotonic() + HEAD_TIMEOUT_S + BODY_TIMEOUT_S


class ServerWorker(gthread.ThreadWorker):
    """gthread with request heads and bodies read in the event loop (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reading_conns: deque = deque()
        self.preread_bytes = 0
        self.lingering_conns: set = set()

    # ------------------------------------------------------------------------ connections in
    def accept(self, listener):
        if self.cfg.is_ssl:
            return super().accept(listener)
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = ServerConn(self.cfg, client_sock, client_addr, listener.getsockname())
        self._start_reading(conn)

    def on_client_socket_readable(self, conn, client):
        # A kept-alive connection has a new request: read it here too, not in a thread.
        if self.cfg.is_ssl or not isinstance(conn, ServerConn):
            return super().on_client_socket_readable(conn, client)
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._start_reading(conn)
        self._on_readable(conn, client)

    def _start_reading(self, conn: ServerConn) -> None:
        conn.sock.setblocking(False)
        conn.scan = _RequestScan()
        conn.deadline = time.monotonic() + HEAD_TIMEOUT_S
        self.reading_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def handle_request(self, req, conn):
        if getattr(conn, "oversize", False):
            # The app refuses the body unread (413): the response says the connection closes, and the close
            # lingers (see the module docstring) so that the client can finish sending and read it.
            conn.oversize = False
            req.must_close = True
        return super().handle_request(req, conn)

    def finish_request(self, conn, fs):
        if isinstance(conn, ServerConn) and not self.cfg.is_ssl and not conn.is_http2 and not fs.cancelled() \
                and fs.exception() is None and fs.result() is False:
            self._linger(conn)
            return
        # Pipelined bytes after a request (read along with it) are the start of the next one: read the rest
        # of it here as well, not in a thread.
        if isinstance(conn, ServerConn) and self.alive and not fs.cancelled() and fs.exception() is None \
                and fs.result() is True and conn.parser is not None and not conn.is_http2 \
                and hasattr(conn.parser.unreader, "take_buffered"):
            leftover = conn.parser.unreader.take_buffered()
            if leftover:
                self._start_reading(conn)
                self._feed(conn, leftover)
                return
        super().finish_request(conn, fs)

    def _on_readable(self, conn: ServerConn, client) -> None:
        if conn.scan is None:
            return
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        self._feed(conn, data)

    def _feed(self, conn: ServerConn, data: bytes) -> None:
        scan = conn.scan
        had_head = scan.head_end >= 0
        before = len(scan.buf)
        scan.feed(data, MAX_BODY_BYTES)
        self.preread_bytes += len(scan.buf) - before
        if scan.head_end >= 0 and not had_head and not scan.done:
            conn.deadline = time.monotonic() + BODY_TIMEOUT_S
            self._requeue(conn)
            if scan.expects_continue:
                # gunicorn would send this once the app reads the body; the body is read here instead.
                # (A second "100 Continue" from gunicorn later is allowed: clients skip 1xx responses.)
                try:
                    conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                except OSError:
                    pass
        if scan.done or self.preread_bytes > MAX_PREREAD_TOTAL:
            self._hand_to_thread(conn)

    def _requeue(self, conn: ServerConn) -> None:
        # reading_conns stays ordered by deadline: a connection whose deadline moved goes to the back.
        try:
            self.reading_conns.remove(conn)
        except ValueError:
            pass
        self.reading_conns.append(conn)

    def _stop_reading(self, conn: ServerConn) -> bytes:
        try:
            self.poller.unregister(conn.sock)
        except (OSError, KeyError, ValueError):
            pass
        try:
            self.reading_conns.remove(conn)
        except ValueError:
            pass
        data = bytes(conn.scan.buf) if conn.scan is not None else b""
        self.preread_bytes -= len(data)
        conn.scan = None
        return data

    def _hand_to_thread(self, conn: ServerConn) -> None:
        conn.oversize = conn.scan.oversize
        conn.pending_bytes = self._stop_reading(conn)
        conn.data_ready = True
        conn.sock.setblocking(True)
        self.enqueue_req(conn)

    def _drop(self, conn: ServerConn, response: bytes | None = None) -> None:
        self._stop_reading(conn)
        if response is not None:
            try:
                conn.sock.send(response)       # non-blocking, best effort: the client may not read
            except OSError:
                pass
        self.nr_conns -= 1
        conn.close()

    # ------------------------------------------------------------------------ closing
    def _linger(self, conn: ServerConn) -> None:
        """Close `conn` once the client has stopped sending (see the module docstring)."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:                      # already gone
            self.nr_conns -= 1
            conn.close()
            return
        now = time.monotonic()
        conn.linger_left = LINGER_MAX_BYTES
        conn.linger_end = now + BODY_TIMEOUT_S
        conn.deadline = min(now + LINGER_IDLE_S, conn.linger_end)
        self.lingering_conns.add(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_linger_readable, conn))

    def _on_linger_readable(self, conn: ServerConn, client) -> None:
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        conn.linger_left -= len(data)
        if not data or conn.linger_left <= 0:
            self._end_linger(conn)
            return
        conn.deadline = min(time.monotonic() + LINGER_IDLE_S, conn.linger_end)

    def _end_linger(self, conn: ServerConn) -> None:
        if conn not in self.lingering_conns:
            return
        self.lingering_conns.discard(conn)
        try:
            self.poller.unregister(conn.sock)
        except (OSError, KeyError, ValueError):
            pass
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c in self.lingering_conns if not self.alive or c.deadline <= now]:
            self._end_linger(conn)
        if not self.alive:
            # Stopping: connections that have not started a request are closed now, like idle kept-alive ones.
            for conn in [c for c in self.reading_conns if c.scan is not None and not c.scan.buf]:
                self._drop(conn)
        while self.reading_conns and self.reading_conns[0].deadline <= now:
            conn = self.reading_conns[0]
            part = "body" if conn.scan is not None and conn.scan.head_end >= 0 else "headers"
            limit = BODY_TIMEOUT_S if part == "body" else HEAD_TIMEOUT_S
            self._drop(conn, error_response(408, f"the request {part} did not arrive within {limit:g} s",
                                            "request_timeout"))

    # ------------------------------------------------------------------------ errors
    def handle_error(self, req, client, addr, exc):
        status, message, code = classify_error(exc)
        ip = (addr or ("", -1))[0]
        if status >= 500:
            self.log.exception("Error handling request from ip=%s", ip)
        else:
            self.log.warning("Invalid request from ip=%s: %r", ip, str(exc)[:300])
        try:
            util.write_nonblock(client, error_response(status, message, code))
        except Exception:  # noqa: BLE001 - the client may be gone
            self.log.debug("Failed to send error message.")
