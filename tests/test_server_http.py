"""The HTTP layer of a real gunicorn (server/http_worker.py) on the scripted model: slow clients never
hold the worker's threads, gunicorn's own errors are OpenAI JSON 4xx, and the API key holds whatever
form the request target takes.
"""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from tests.server_fakes import ServerProcess

THREADS = 4
KEY = "http-test-key"


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("fake", env={"JITKERN_THREADS": THREADS, "JITKERN_API_KEY": KEY,
                                        "JITKERN_HEAD_TIMEOUT_S": 2, "JITKERN_BODY_TIMEOUT_S": 4})
    try:
        server.wait_ready()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


def raw_exchange(srv, data: bytes, timeout: float = 10.0) -> bytes:
    """Sends `data`, returns everything the server sends until it closes (or `timeout`)."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def split_response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return status, headers, body


def assert_openai_error(raw: bytes, statuses) -> dict:
    assert raw, "no response"
    status, headers, body = split_response(raw)
    assert status in statuses, raw[:400]
    assert headers.get("content-type", "").startswith("application/json"), raw[:400]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def health_seconds(srv) -> float:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    return time.monotonic() - t0


def test_slow_clients_do_not_hold_the_threads(srv):
    """Slow clients, 4x the worker's threads, of every kind: /health still answers at once."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    partials = [
        b"GET /health HTTP/1.1\r\nHost: x\r\n",                                         # headers never end
        b"POST /v1/compl",                                                             # request line
        head + b"Content-Length: 1000\r\n\r\n{\"prompt\": ",                           # body too short
        head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n",                   # chunks stop
        head + b"Expect: 100-continue\r\nContent-Length: 100\r\n\r\n",                 # body never sent
        b"\r\n\r\n\r\nGET /health HT",                                                 # blank lines first
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHo",                # pipelined, cut
    ]
    socks = []
    try:
        for i in range(4 * THREADS):
            s = socket.create_connection((srv.host, srv.port), timeout=10)
            s.sendall(partials[i % len(partials)])
            socks.append(s)
        time.sleep(0.3)
        # One more byte now and then, as a slow-loris client does, and /health every time.
        for _ in range(3):
            for s in socks:
                s.sendall(b"X")
            assert health_seconds(srv) < 2.0
        # Past the head deadline (2 s), a client that never finished its headers gets a JSON 408.
        err = assert_openai_error(recv_all(socks[0], 10.0), (408,))
        assert err["code"] == "request_timeout"
        # The pipelined client got its first answer, then the 408 for the request it never finished.
        both = recv_all(socks[len(partials) - 1], 10.0)
        assert both.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in both, both[:300]
    finally:
        for s in socks:
            s.close()
    assert health_seconds(srv) < 2.0


def recv_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


GUNICORN_ERRORS = [
    # (raw request, statuses, code)
    (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", (414,), "uri_too_long"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", (431,), None),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 20000 + b"\r\n\r\n", (431, 400), None),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\n\r\n", (417,), "expectation_failed"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad\x01Name: y\r\n\r\n", (400,), "invalid_http_request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", (400,), "invalid_http_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", (400,), None),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
     (400,), None),
    (b"FOO\x7f /health HTTP/1.1\r\nHost: x\r\n\r\n", (400,), None),
    (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", (400,), None),
    (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", (400,), None),
]


@pytest.mark.parametrize("raw,statuses,code", GUNICORN_ERRORS, ids=[str(i) for i in range(len(GUNICORN_ERRORS))])
def test_gunicorn_errors_are_openai_json_4xx(srv, raw, statuses, code):
    err = assert_openai_error(raw_exchange(srv, raw), statuses)
    if code is not None:
        assert err["code"] == code, err


def test_invalid_chunk_size_is_400(srv):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + \
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    for body in (b"zz\r\nabc\r\n0\r\n\r\n", b"-5\r\nabcde\r\n0\r\n\r\n", b"5\r\nabcdefgh\r\n0\r\n\r\n",
                 b"ffffffffffffffffffffff\r\nab\r\n0\r\n\r\n"):
        err = assert_openai_error(raw_exchange(srv, head + body), (400, 413))
        assert "body" in err["message"] or "chunk" in err["message"].lower(), err
    good = json.dumps({"prompt": "chunked", "max_tokens": 2}).encode()
    body = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, good[:5], len(good) - 5, good[5:])
    status, _, payload = split_response(raw_exchange(srv, head + body))
    assert status == 200 and json.loads(payload)["choices"][0]["finish_reason"] == "length"


def test_api_key_holds_for_every_spelling_of_the_target(srv):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    post = b"Host: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body)
    targets = [b"/v1/completions", b"//v1/completions", b"http://x/v1/completions", b"http://x//v1/completions",
               b"/v1//completions", b"/v1/./completions", b"/v1/../v1/completions", b"/%761/completions",
               b"/v1/completions?x=1", b"/v1/completions#frag"]
    for target in targets:
        status, _, _ = split_response(raw_exchange(srv, b"POST " + target + b" HTTP/1.1\r\n" + post))
        assert status in (400, 401, 404), (target, status)
    for target in (b"//v1/models", b"http://x/v1/models", b"/server_info", b"//server_info", b"/tokenize",
                   b"http://x/reset_prefix_cache"):
        method = b"POST " if b"tokenize" in target or b"reset" in target else b"GET "
        status, _, _ = split_response(raw_exchange(srv, method + target + b" HTTP/1.1\r\n" + post))
        assert status in (400, 401, 404, 405), (target, status)
    # The right key on an absolute-form target is served.
    status, _, _ = split_response(raw_exchange(
        srv, b"POST http://x/v1/completions HTTP/1.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n" + post))
    assert status == 200


def _exchange_one(srv, method: str, target: str, extra: str = "") -> bytes:
    return raw_exchange(srv, f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode())


@pytest.mark.parametrize("target", ["/health", "/v1/models", "/metrics", "/", "/version"])
def test_head_answers_like_get_without_a_body(srv, target):
    auth = f"Authorization: Bearer {KEY}\r\n"
    get_raw = _exchange_one(srv, "GET", target, auth)
    head_raw = _exchange_one(srv, "HEAD", target, auth)
    get_status, get_headers, get_body = split_response(get_raw)
    head_status, head_headers, _ = split_response(head_raw)
    assert get_status == 200, get_raw[:300]
    assert head_status == get_status, head_raw[:300]
    # Nothing at all after the blank line: the server sent the head only, even though Content-Length is set.
    assert head_raw.endswith(b"\r\n\r\n") and head_raw.count(b"\r\n\r\n") == 1, head_raw[-200:]
    assert head_headers.get("content-type") == get_headers.get("content-type")
    if "content-length" in head_headers:
        if target in ("/metrics",):      # counters move between the two requests; the length need not match
            assert int(head_headers["content-length"]) > 0
        else:
            assert int(head_headers["content-length"]) == len(get_body)


def test_head_on_a_post_only_route_is_405_with_allow(srv):
    raw = _exchange_one(srv, "HEAD", "/v1/completions", f"Authorization: Bearer {KEY}\r\n")
    status, headers, _ = split_response(raw)
    assert status == 405, raw[:300]
    assert "POST" in headers.get("allow", "") and "HEAD" not in headers.get("allow", ""), headers
    assert raw.endswith(b"\r\n\r\n"), raw[-200:]


SMALL_LIMIT = 10_000


@pytest.fixture(scope="module")
def small_srv():
    server = ServerProcess("fake", env={"JITKERN_THREADS": THREADS, "JITKERN_MAX_BODY_BYTES": SMALL_LIMIT})
    try:
        server.wait_ready()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


def _send_body_in_chunks(srv, total: int, chunked: bool) -> tuple[int, bytes, str | None]:
    """Sends a POST with a `total`-byte body in 64 KiB pieces, then reads until the server closes.
    Returns (bytes sent, what came back, the send error if any)."""
    te = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{te}\r\n\r\n".encode()
    piece = b"x" * 65536
    sent, error = 0, None
    with socket.create_connection((srv.host, srv.port), timeout=20) as s:
        s.sendall(head)
        try:
            while sent < total:
                part = piece[:total - sent]
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent += len(part)
                time.sleep(0.001)      # a client writing as it goes, not one buffer
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError as e:
            error = repr(e)
        return sent, recv_all(s, 20.0), error


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_read_to_the_end_and_gets_its_413(small_srv, chunked):
    total = 80 * SMALL_LIMIT        # far past gunicorn's own 64 KiB drain, within the linger budget
    sent, raw, error = _send_body_in_chunks(small_srv, total, chunked)
    assert error is None and sent == total, (error, sent)
    err = assert_openai_error(raw, (413,))
    assert err["code"] == "request_too_large" and str(SMALL_LIMIT) in err["message"], err
    _, headers, body = split_response(raw)
    assert headers.get("connection", "").lower() == "close"
    assert len(body) == int(headers["content-length"])
    assert health_seconds(small_srv) < 2.0


def test_a_refused_body_is_discarded_only_up_to_a_bound(small_srv):
    # Past 4x the limit (+1 MiB) the server stops reading and closes: the client cannot keep it busy.
    t0 = time.monotonic()
    sent, _, error = _send_body_in_chunks(small_srv, 64 << 20, chunked=False)
    assert error is not None and sent < 16 << 20, (error, sent)
    assert time.monotonic() - t0 < 15
    assert health_seconds(small_srv) < 2.0
