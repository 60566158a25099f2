"""Fuzz / soak the OpenAI server with malformed and hostile requests over raw sockets.

    python -m perf.fuzz_server --url http://127.0.0.1:8000 --api-key KEY --duration 600

Every generated request is one of these categories (see CaseGenerator): auth bypass attempts (other
spellings of a protected target, wrong keys), bad content types, lone surrogates, deep JSON nesting,
bad chunked framing, huge or odd request ids, oversized fields, wrong JSON types, engine parameters
that once broke every stream, and raw socket garbage. What must hold, whatever the request:
- no response is a 5xx;
- every 4xx is an OpenAI error object `{"error": {"message", "type", "param", "code"}}` in JSON;
- an auth bypass attempt (or a body that must be refused) is never a 2xx;
- "canary" streams run the whole time, each complete (`[DONE]`, finish_reason "length") and equal to
  the canary's solo text;
- afterwards the engine holds no request and no KV block (read from /metrics).
The exit status is 1 if anything did not hold (each problem is printed with the request that caused it).
tests/test_server_fuzz.py runs a bounded version of this against the scripted model.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

CATEGORIES = ("auth", "content_type", "surrogate", "nesting", "chunking", "request_id", "oversized", "types",
              "engine_params", "garbage")

PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/models/{model}"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/server_info"),
             ("POST", "/reset_prefix_cache")]
FIELDS = ["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
          "logprobs", "echo", "logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "request_id", "user",
          "stream_options", "truncate_prompt_tokens", "priority", "stop_token_ids", "response_format",
          "prompt_logprobs", "presence_penalty", "repetition_penalty", "ignore_eos", "min_p"]
WRONG_VALUES = [None, True, False, 0, 1, -1, 1.5, -0.0, 1e308, 2 ** 70, -2 ** 70, "", "x", "1", [], [1], ["x"],
                [[1]], {}, {"a": 1}, [None], {"1": None}]


@dataclass
class Case:
    category: str
    raw: bytes
    forbid_success: bool = False      # a 2xx would mean a check was skipped (auth, media type, ...)
    half_close: bool = False          # send FIN after the bytes (the head may be incomplete: no answer due)
    note: str = ""

    def describe(self, limit: int = 300) -> str:
        text = repr(self.raw[:limit]) + ("..." if len(self.raw) > limit else "")
        return f"[{self.category}{': ' + self.note if self.note else ''}] {text}"


def http_bytes(method: str, target: str | bytes, headers: list, body: bytes | None = None,
               chunks: Optional[bytes] = None) -> bytes:
    """A request with `Connection: close`; `chunks` is a raw chunked body (Transfer-Encoding set here)."""
    target = target.encode("latin-1") if isinstance(target, str) else target
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: fuzz", b"Connection: close"]
    for k, v in headers:
        lines.append((k.encode("latin-1") if isinstance(k, str) else k) + b": " +
                     (v.encode("latin-1") if isinstance(v, str) else v))
    if chunks is not None:
        lines.append(b"Transfer-Encoding: chunked")
        payload = chunks
    elif body is not None:
        lines.append(b"Content-Length: " + str(len(body)).encode())
        payload = body
    else:
        payload = b""
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


class CaseGenerator:
    """Generated bad requests; `model` is the served model id, `api_key` the server's key (or None)."""

    def __init__(self, seed: int, api_key: Optional[str], model: str = "fake-model", max_model_len: int = 512,
                 categories=CATEGORIES):
        self.rng = random.Random(seed)
        self.key = api_key
        self.model = model
        self.max_model_len = max_model_len
        self.categories = list(categories)
        self._next = 0

    # ------------------------------------------------------------------ helpers
    def auth(self) -> list:
        return [("Authorization", f"Bearer {self.key}")] if self.key else []

    def json_headers(self) -> list:
        return self.auth() + [("Content-Type", "application/json")]

    def base_body(self, path: str) -> dict:
        if path == "/v1/chat/completions":
            return {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
        if path == "/tokenize":
            return {"prompt": "hello"}
        if path == "/detokenize":
            return {"tokens": [1, 2, 3]}
        return {"prompt": "hello", "max_tokens": 2}

    def post(self, path: str, body: bytes, headers: Optional[list] = None) -> bytes:
        return http_bytes("POST", path, self.json_headers() if headers is None else headers, body)

    def next_case(self) -> Case:
        category = self.categories[self._next % len(self.categories)]
        self._next += 1
        return getattr(self, "case_" + category)()

    # ------------------------------------------------------------------ categories
    def case_auth(self) -> Case:
        r = self.rng
        if not self.key:
            return self.case_garbage()
        method, path = r.choice(PROTECTED)
        path = path.replace("{model}", self.model)
        spell = r.choice([
            lambda p: p, lambda p: "/" + p, lambda p: p.replace("/", "//"), lambda p: "http://fuzz" + p,
            lambda p: "http://fuzz/" + p, lambda p: "HTTP://FUZZ" + p, lambda p: "https://evil.example" + p,
            lambda p: p + "/", lambda p: p + "?x=1", lambda p: "/." + p, lambda p: "/v1/.." + p,
            lambda p: p.replace("v", "%76", 1), lambda p: p.replace("/", "/%2F", 1), lambda p: p + "%00",
            lambda p: p + ";x", lambda p: p.upper(), lambda p: p + "#x", lambda p: "//" + p.lstrip("/"),
        ])
        key = self.key
        auth = r.choice([[], [("Authorization", "Bearer wrong")], [("Authorization", f"Basic {key}")],
                         [("Authorization", "Bearer")], [("Authorization", f"Bearer {key}x")],
                         [("Authorization", f"Bearer {key[:-1]}")], [("Authorization", f"Token {key}")],
                         [("X-Api-Key", key)], [("Authorization", f"Bearer {key}\x00")], [("Authorization", "")],
                         [("Authorization", f"Bearer {key.upper()}" if key.upper() != key else "Bearer no")]])
        headers = auth + [("Content-Type", "application/json")]
        body = json.dumps(self.base_body(path)).encode() if method == "POST" else None
        return Case("auth", http_bytes(method, spell(path), headers, body), forbid_success=True, note=path)

    def case_content_type(self) -> Case:
        r = self.rng
        path = r.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
        ctype = r.choice([None, "text/plain", "application/x-www-form-urlencoded", "text/json",
                          "multipart/form-data; boundary=----x", "application/json5", "application/jsonx",
                          "application/json; charset=latin-1", "application/json; charset=utf-16", "", "*/*",
                          "application/xml", "json", "application /json", "text/plain; charset=utf-8"])
        headers = self.auth() + ([("Content-Type", ctype)] if ctype is not None else [])
        body = json.dumps(self.base_body(path)).encode()
        if ctype and ctype.startswith("application/x-www-form"):
            body = b"prompt=hello&max_tokens=2"
        return Case("content_type", self.post(path, body, headers), forbid_success=True, note=str(ctype))

    def case_surrogate(self) -> Case:
        r = self.rng
        path = r.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"])
        body = self.base_body(path)
        marker = "@@SURROGATE@@"
        where = r.choice(["value", "key", "stop", "user", "request_id", "model"])
        if where == "value" and path == "/v1/chat/completions":
            body["messages"][0]["content"] = "a" + marker
        elif where == "value":
            body["prompt"] = marker + "b"
        elif where == "key":
            body[marker] = 1
        elif path == "/tokenize":
            body["prompt"] = marker
        else:
            body[where] = [marker] if where == "stop" else marker
        escape = r.choice(["\\ud800", "\\udfff", "\\uDBFF", "\\udc00x", "\\ud83d", "\\ude00\\ud83d"])
        raw = json.dumps(body).replace(marker, escape).encode()
        return Case("surrogate", self.post(path, raw), forbid_success=True, note=f"{where} {escape}")

    def case_nesting(self) -> Case:
        r = self.rng
        depth = r.choice([65, 100, 999, 1000, 1001, 5000, 50000, 200000])
        opener, closer = r.choice([("[", "]"), ('{"a":', "}"), ('[{"b":', "}]")])
        inner = opener * depth + "1" + closer * depth
        path = r.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"])
        field_ = r.choice(["metadata", "prompt", "messages", "logit_bias", "stop"])
        raw = "{" + json.dumps(field_) + ": " + inner + "}"
        if r.random() < 0.3:      # unbalanced
            raw = raw[:-depth // 2]
        return Case("nesting", self.post(path, raw.encode()), forbid_success=True, note=f"{field_} depth {depth}")

    def case_chunking(self) -> Case:
        r = self.rng
        body = json.dumps(self.base_body("/v1/completions")).encode()
        good = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        kind = r.choice(["bad_hex", "negative", "0x", "overflow", "longer_data", "no_crlf", "ext", "lf_only",
                         "both_lengths", "gzip", "chunked_gzip", "space_size", "empty_size", "plus", "trailer",
                         "valid_split"])
        headers = self.json_headers()
        if kind == "bad_hex":
            chunks = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        elif kind == "negative":
            chunks = b"-%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        elif kind == "0x":
            chunks = b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        elif kind == "overflow":
            chunks = b"f" * r.choice([17, 40, 2000]) + b"\r\n" + body + b"\r\n0\r\n\r\n"
        elif kind == "longer_data":
            chunks = b"%x\r\n%sEXTRA\r\n0\r\n\r\n" % (len(body), body)
        elif kind == "no_crlf":
            chunks = b"%x\r\n%s0\r\n\r\n" % (len(body), body)
        elif kind == "ext":
            chunks = b"%x;%s\r\n%s\r\n0\r\n\r\n" % (len(body), r.choice([b"a=\x01", b"=" * 3000, b"x y", b'a="'
                                                                          ]), body)
        elif kind == "lf_only":
            chunks = b"%x\n%s\n0\n\n" % (len(body), body)
        elif kind == "space_size":
            chunks = b" %x \r\n%s\r\n0\r\n\r\n" % (len(body), body)
        elif kind == "empty_size":
            chunks = b"\r\n" + body + b"\r\n0\r\n\r\n"
        elif kind == "plus":
            chunks = b"+%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        elif kind == "trailer":
            chunks = b"%x\r\n%s\r\n0\r\nX-T: \x00\r\n\r\n" % (len(body), body)
        elif kind == "valid_split":
            cut = r.randrange(1, len(body))
            chunks = b"%x\r\n%s\r\n%x;ext=1\r\n%s\r\n0\r\n\r\n" % (cut, body[:cut], len(body) - cut, body[cut:])
            return Case("chunking", http_bytes("POST", "/v1/completions", headers, chunks=chunks), note=kind)
        elif kind == "both_lengths":
            raw = http_bytes("POST", "/v1/completions", headers + [("Content-Length", str(len(good)))], chunks=good)
            return Case("chunking", raw, forbid_success=True, note=kind)
        else:   # transfer codings that cannot be decoded here
            coding = "gzip" if kind == "gzip" else "chunked, gzip"
            raw = http_bytes("POST", "/v1/completions", headers + [("Transfer-Encoding", coding)], body)
            return Case("chunking", raw, forbid_success=True, note=kind)
        raw = http_bytes("POST", "/v1/completions", headers, chunks=chunks)
        # A malformed framing must be refused (LF-only and padded sizes included: gunicorn is strict).
        return Case("chunking", raw, forbid_success=kind not in ("trailer", "space_size", "ext"), half_close=True,
                    note=kind)

    def case_request_id(self) -> Case:
        r = self.rng
        if r.random() < 0.25:
            # The X-Request-Id header is not read by the server; odd bytes in it must still not hurt.
            value = r.choice([b"\xff\xfe" * 10, b"a" * 7000, "caf\u00e9".encode(), b"x\x7f", b"id\tx"])
            body = json.dumps(self.base_body("/v1/completions")).encode()
            return Case("request_id", self.post("/v1/completions", body, self.json_headers() + [("X-Request-Id",
                                                                                                value)]),
                        note="header")
        rid = r.choice(["a" * r.choice([129, 1000, 100000]), "x\ny", "x\r\nX-Evil: 1", "nul\x00", "caf\u00e9",
                        "\u2028", "emoji\U0001F600", "sp ace", "\t", "", "\x7f", "id\u0085", "<script>",
                        "\x1b[31mred"])
        forbid = rid != "<script>"        # visible ASCII: a legal id
        body = dict(self.base_body("/v1/completions"), request_id=rid)
        return Case("request_id", self.post("/v1/completions", json.dumps(body).encode()), forbid_success=forbid,
                    note=f"len {len(rid)}")

    def case_oversized(self) -> Case:
        r = self.rng
        big = self.max_model_len * 64 + r.choice([1, 1000, 100000, 1_000_000])
        kind = r.choice(["prompt", "batch_prompt", "chat", "tokenize", "n", "logit_bias", "stop", "bad_words",
                         "allowed", "batch", "token_ids", "top_logprobs", "content_length", "stop_token_ids",
                         "messages", "max_tokens"])
        path, body, forbid = "/v1/completions", self.base_body("/v1/completions"), True
        if kind == "prompt":
            body["prompt"] = "x" * big
        elif kind == "batch_prompt":
            body["prompt"] = ["ok", "y" * big]
        elif kind == "chat":
            path, body = "/v1/chat/completions", self.base_body("/v1/chat/completions")
            body["messages"][0]["content"] = "z" * big
        elif kind == "messages":
            path, body = "/v1/chat/completions", self.base_body("/v1/chat/completions")
            body["messages"] = [{"role": "user", "content": "m" * 1000}] * r.choice([40, 400])
        elif kind == "tokenize":
            path, body = "/tokenize", {"prompt": "w" * big}
        elif kind == "n":
            body["n"] = r.choice([129, 10 ** 6, 2 ** 63])
        elif kind == "logit_bias":
            body["logit_bias"] = {str(i): 1 for i in range(r.choice([1025, 5000, 40000]))}
        elif kind == "stop":
            body["stop"] = ["s%d" % i for i in range(r.choice([65, 5000]))]
        elif kind == "bad_words":
            body["bad_words"] = ["b%d c" % i for i in range(r.choice([257, 5000, 50000]))]
        elif kind == "allowed":
            body["allowed_token_ids"] = list(range(r.choice([100000, 49153])))
        elif kind == "batch":
            body["prompt"] = ["p"] * r.choice([4097, 20000])
        elif kind == "token_ids":
            body["prompt"] = [1] * r.choice([513, 100000])
        elif kind == "top_logprobs":
            path, body = "/v1/chat/completions", self.base_body("/v1/chat/completions")
            body.update(logprobs=True, top_logprobs=r.choice([21, 10 ** 6]))
        elif kind == "stop_token_ids":
            body["stop_token_ids"] = list(range(r.choice([1025, 100000])))
        elif kind == "max_tokens":
            body["max_tokens"] = r.choice([10 ** 6, 2 ** 62])
            body["prompt"] = "p" * 50
            forbid = False            # a huge max_tokens means "up to the context"
        if kind == "content_length":
            headers = self.json_headers() + [("Content-Length", str(r.choice([10 ** 9, 10 ** 15, 2 ** 64])))]
            raw = b"\r\n".join([b"POST /v1/completions HTTP/1.1", b"Host: fuzz", b"Connection: close"] +
                               [f"{k}: {v}".encode() for k, v in headers]) + b"\r\n\r\n{}"
            return Case("oversized", raw, forbid_success=True, half_close=True, note=kind)
        return Case("oversized", self.post(path, json.dumps(body).encode()), forbid_success=forbid, note=kind)

    def case_types(self) -> Case:
        r = self.rng
        body = self.base_body("/v1/completions")
        for _ in range(r.choice([1, 1, 2, 3])):
            body[r.choice(FIELDS)] = r.choice(WRONG_VALUES)
        raw = json.dumps(body)
        if r.random() < 0.15:
            raw = raw.replace("2", r.choice(["NaN", "Infinity", "-Infinity", "1e999", "0x2", "02", "2.", ".2"]), 1)
        if r.random() < 0.1:
            raw = r.choice(["[]", "null", "1", '"str"', "{", '{"a":1,}', "{'a': 1}", "\ufeff{}", "{}" * 2])
        return Case("types", self.post("/v1/completions", raw.encode("utf-8")), note=raw[:80])

    def case_engine_params(self) -> Case:
        r = self.rng
        body = self.base_body("/v1/completions")
        body.update(r.choice([
            {"seed": -2}, {"seed": -(2 ** 63)}, {"repetition_penalty": 1e-39}, {"repetition_penalty": 1e39},
            {"allowed_token_ids": [2], "min_tokens": 2}, {"temperature": 1e-45}, {"top_k": -5}, {"top_p": 1e-300},
            {"min_p": 1.0}, {"logit_bias": {"0": 1e308}}, {"logit_bias": {"-1": 5}}, {"stop_token_ids": [2 ** 40]},
            {"min_tokens": 10 ** 9}, {"presence_penalty": -2.0, "frequency_penalty": 2.0},
            {"truncate_prompt_tokens": 10 ** 9}, {"logprobs": 20, "echo": True, "prompt_logprobs": 20},
            {"n": 4, "temperature": 0.0}, {"bad_words": [" " * 100]}, {"stop": ["\x00"]},
        ]))
        return Case("engine_params", self.post("/v1/completions", json.dumps(body).encode()), note=str(body)[:80])

    def case_garbage(self) -> Case:
        r = self.rng
        kind = r.choice(["bytes", "http2", "tls", "line", "headers", "method", "version", "nul", "long_header",
                         "many_headers", "obs_fold", "bare_cr", "space_name", "lower_method", "absolute_odd"])
        if kind == "bytes":
            raw = bytes(r.getrandbits(8) for _ in range(r.randrange(1, 600))) + b"\r\n\r\n"
        elif kind == "http2":
            raw = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 9
        elif kind == "tls":
            raw = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(r.getrandbits(8) for _ in range(64)) + \
                b"\r\n\r\n"
        elif kind == "line":
            raw = r.choice([b"GET\r\n\r\n", b"GET /health\r\n\r\n", b"GET  /health  HTTP/1.1\r\n\r\n",
                            b" GET /health HTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1 extra\r\n\r\n",
                            b"/health HTTP/1.1\r\n\r\n", b"\r\n\r\n"])
        elif kind == "headers":
            raw = b"GET /health HTTP/1.1\r\n" + bytes(r.getrandbits(8) for _ in range(r.randrange(1, 300))) + \
                b"\r\n\r\n"
        elif kind == "method":
            raw = r.choice([b"X" * 5000, b"G\x00T", b"GET\x7f", b"\xff\xfe"]) + b" /health HTTP/1.1\r\nHost: x\r\n\r\n"
        elif kind == "version":
            raw = b"GET /health " + r.choice([b"HTTP/9.9", b"HTTP/1", b"HTTP/1.1.1", b"FTP/1.0", b"HTTP/0.9",
                                              b"http/1.1"]) + b"\r\nHost: x\r\n\r\n"
        elif kind == "nul":
            raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"
        elif kind == "long_header":
            raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"v" * r.choice([9000, 70000]) + b"\r\n\r\n"
        elif kind == "many_headers":
            raw = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(r.choice([101, 3000]))) + \
                b"\r\n"
        elif kind == "obs_fold":
            raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  folded\r\n\r\n"
        elif kind == "bare_cr":
            raw = b"GET /health HTTP/1.1\rHost: x\r\n\r\n"
        elif kind == "space_name":
            raw = b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n"
        elif kind == "lower_method":
            raw = b"get /health HTTP/1.1\r\nHost: x\r\n\r\n"
        else:
            raw = b"GET " + r.choice([b"ftp://x/health", b"http://[::1/health", b"http:///health", b"*",
                                      b"http://x:99999/health", b"\\health"]) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        return Case("garbage", raw, half_close=True, note=kind)


# ====================================================================================== sending, checking

def exchange(host: str, port: int, raw: bytes, half_close: bool, timeout: float) -> bytes:
    """Sends `raw`; returns all the server sent until it closed (b"" for no answer)."""
    out = b""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass      # the server may answer (e.g. 413) and close before it has read everything
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def check_response(case: Case, raw: bytes) -> Optional[str]:
    """None if the response is acceptable for `case`, else what is wrong with it."""
    if not raw:
        # Closing without an answer is acceptable only where the request never completed.
        return None if case.half_close else "no response"
    head, _, body = raw.partition(b"\r\n\r\n")
    # Informational responses (100 Continue) come before the final one.
    while head.startswith(b"HTTP/1.1 1"):
        head, _, body = body.partition(b"\r\n\r\n")
    try:
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        return f"unparseable response {raw[:120]!r}"
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if status >= 500:
        return f"status {status}: {body[:300]!r}"
    if 200 <= status < 300:
        return f"a {status} for a request that must be refused" if case.forbid_success else None
    if status >= 400:
        if not headers.get("content-type", "").startswith("application/json"):
            return f"status {status} with content-type {headers.get('content-type')!r}: {body[:200]!r}"
        if "content-length" in headers:
            body = body[:int(headers["content-length"])]
        try:
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        except Exception:  # noqa: BLE001
            return f"status {status}: not an OpenAI error object: {body[:200]!r}"
    return None


@dataclass
class FuzzReport:
    sent: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)
    canaries: int = 0
    canary_problems: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{sum(self.sent.values())} requests in {self.seconds:.1f}s; by category: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.sent.items())),
                 "statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items(), key=str)),
                 f"canary streams completed: {self.canaries}",
                 f"problems: {len(self.problems) + len(self.canary_problems)}"]
        lines += [f"  {p}" for p in (self.problems + self.canary_problems)[:50]]
        return "\n".join(lines)


def _status_of(raw: bytes):
    try:
        return int(raw.split(b" ", 2)[1]) if raw else "none"
    except (IndexError, ValueError):
        return "?"


class Canary:
    """Streams one fixed greedy completion over and over; each run must equal the solo text."""

    def __init__(self, host: str, port: int, api_key: Optional[str], max_tokens: int = 48):
        self.host, self.port, self.key = host, port, api_key
        self.body = {"prompt": "The canary sings a long and steady song", "max_tokens": max_tokens,
                     "temperature": 0.0, "ignore_eos": True}
        self.expected: Optional[str] = None
        self.done = 0
        self.problems: list = []

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        return h

    def solo(self) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(self.body), headers=self._headers())
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"the canary's solo request failed: {resp.status} {payload[:300]!r}")
        return json.loads(payload)["choices"][0]["text"]

    def stream_once(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(dict(self.body, stream=True)),
                         headers=self._headers())
            resp = conn.getresponse()
            raw = resp.read().decode("utf-8")
        except Exception as e:  # noqa: BLE001
            self.problems.append(f"canary stream failed: {type(e).__name__}: {e}")
            return
        finally:
            conn.close()
        if resp.status != 200:
            self.problems.append(f"canary stream status {resp.status}: {raw[:200]!r}")
            return
        frames = [f[len("data: "):] for f in raw.split("\n\n") if f.startswith("data: ")]
        if not frames or frames[-1] != "[DONE]":
            self.problems.append(f"canary stream did not end with [DONE]: {raw[-200:]!r}")
            return
        events = [json.loads(f) for f in frames[:-1]]
        if any("error" in e for e in events):
            self.problems.append(f"canary stream carried an error: {raw[-300:]!r}")
            return
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        if finish != ["length"] or text != self.expected:
            self.problems.append(f"canary stream differs from its solo run: finish {finish}, {text!r} != "
                                 f"{self.expected!r}")
            return
        self.done += 1

    def run_until(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.stream_once()


def run_fuzz(host: str, port: int, api_key: Optional[str], *, cases: Optional[int] = None,
             duration: Optional[float] = None, concurrency: int = 8, seed: int = 0, timeout: float = 30.0,
             categories=CATEGORIES, model: Optional[str] = None, max_model_len: Optional[int] = None,
             canary_tokens: int = 48, progress=None) -> FuzzReport:
    """Sends generated bad requests (`cases` of them, or for `duration` seconds) while canary streams run."""
    if model is None or max_model_len is None:
        card = _model_card(host, port, api_key)
        model = model or card["id"]
        max_model_len = max_model_len or int(card.get("max_model_len") or 2048)
    report = FuzzReport()
    gen = CaseGenerator(seed, api_key, model=model, max_model_len=max_model_len, categories=categories)
    gen_lock = threading.Lock()
    canary = Canary(host, port, api_key, canary_tokens)
    canary.expected = canary.solo()
    stop = threading.Event()
    canary_thread = threading.Thread(target=canary.run_until, args=(stop,), daemon=True, name="fuzz-canary")
    canary_thread.start()
    t0 = time.monotonic()
    counter = [0]

    def more() -> Optional[Case]:
        with gen_lock:
            if cases is not None and counter[0] >= cases:
                return None
            if duration is not None and time.monotonic() - t0 >= duration:
                return None
            counter[0] += 1
            return gen.next_case()

    def worker():
        while True:
            case = more()
            if case is None:
                return
            try:
                raw = exchange(host, port, case.raw, case.half_close, timeout)
                problem = check_response(case, raw)
            except OSError as e:
                raw, problem = b"", f"could not connect/send: {e}"
            with gen_lock:
                report.sent[case.category] += 1
                report.statuses[_status_of(raw)] += 1
                if problem:
                    report.problems.append(f"{problem} <- {case.describe()}")
                if progress is not None:
                    progress(1)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(worker) for _ in range(concurrency)]:
                f.result()
        # At least one canary must have run alongside the fuzz; let the current one finish.
        while canary.done + len(canary.problems) == 0 and canary_thread.is_alive():
            time.sleep(0.05)
    finally:
        stop.set()
        canary_thread.join(120)
    report.seconds = time.monotonic() - t0
    report.canaries = canary.done
    report.canary_problems = list(canary.problems)
    leftover = engine_leftovers(host, port)
    if leftover:
        report.problems.append(leftover)
    return report


def _model_card(host: str, port: int, api_key: Optional[str]) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"GET /v1/models: {resp.status} {data[:200]!r} (is --api-key right?)")
    return json.loads(data)["data"][0]


def engine_leftovers(host: str, port: int, wait_s: float = 10.0) -> Optional[str]:
    """None once /metrics shows no running or waiting request and an empty KV cache (within wait_s)."""
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        try:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            text = resp.read().decode()
            conn.close()
        except OSError as e:
            return f"/metrics unreachable after the fuzz: {e}"
        if resp.status != 200:
            return None       # metrics disabled: nothing to check
        values = {}
        for line in text.splitlines():
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    values[name] = float(line.rsplit(" ", 1)[1])
        if values and all(v == 0 for v in values.values()):
            return None
        last = ", ".join(f"{k} {v}" for k, v in values.items())
        if time.monotonic() > deadline:
            return f"the engine still holds work after the fuzz: {last}"
        time.sleep(0.2)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.fuzz_server", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Checks: no 5xx, OpenAI error objects for every 4xx, no 2xx for requests "
                                       "that must be refused, canary streams intact, no engine work left over.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--api-key", help="the server's --api-key (auth bypass attempts need it to be set)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to fuzz (default %(default)s)")
    p.add_argument("--cases", type=int, help="send this many requests instead of running for --duration")
    p.add_argument("--concurrency", type=int, default=8, help="parallel connections (default %(default)s)")
    p.add_argument("--seed", type=int, default=int(time.time()), help="generator seed (default: the time)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for one response")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated subset of: "
                   + ", ".join(CATEGORIES))
    p.add_argument("--json", help="write the report (counts, problems) to this file")
    args = p.parse_args(argv)
    cats = [c.strip() for c in args.categories.split(",") if c.strip()]
    bad = [c for c in cats if c not in CATEGORIES]
    if bad:
        p.error(f"--categories: unknown {bad[0]!r} (known: {', '.join(CATEGORIES)})")
    url = urlsplit(args.url)
    if url.scheme != "http" or not url.hostname:
        p.error(f"--url {args.url!r}: expected http://host:port")
    host, port = url.hostname, url.port or 80
    print(f"fuzzing {args.url} with seed {args.seed} ...", file=sys.stderr)
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.cases, unit="req", disable=None)
        progress = bar.update
    except ImportError:  # noqa: F841
        bar, progress = None, None
    try:
        report = run_fuzz(host, port, args.api_key, cases=args.cases,
                          duration=None if args.cases else args.duration, concurrency=args.concurrency,
                          seed=args.seed, timeout=args.timeout, categories=cats, progress=progress)
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "sent": dict(report.sent), "statuses": {str(k): v for k, v in
                                                                                 report.statuses.items()},
                       "canaries": report.canaries, "problems": report.problems + report.canary_problems,
                       "seconds": report.seconds}, f, indent=1)
    return 1 if report.problems or report.canary_problems else 0


if __name__ == "__main__":
    sys.exit(main())
