"""A bounded fuzz of a real gunicorn on loopback (the scripted model): about a thousand generated bad
requests of every category in perf/fuzz_server.py (auth bypass spellings, content types, lone
surrogates, deep nesting, bad chunking, odd request ids, oversized fields, wrong types, engine
parameters that once broke every stream, raw socket garbage), while canary streams run.

Asserts: no 5xx; every 4xx is an OpenAI error object in JSON; no request that must be refused is
served; every canary stream is complete and equal to its solo text; afterwards the engine holds no
request and no KV block. The seed is fixed (JITKERN_FUZZ_SEED overrides it) so a failure reproduces;
`python -m perf.fuzz_server` runs the same generator for as long as you like.
"""
from __future__ import annotations

import os

import pytest

from perf.fuzz_server import CATEGORIES, CaseGenerator, check_response, run_fuzz, Case
from tests.server_fakes import ServerProcess

KEY = "fuzz-test-key"
NUM_CASES = int(os.environ.get("JITKERN_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("JITKERN_FUZZ_SEED", "20261201"))


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("fake", env={"JITKERN_API_KEY": KEY, "JITKERN_HEAD_TIMEOUT_S": 3,
                                        "JITKERN_BODY_TIMEOUT_S": 3, "JITKERN_MAX_MODEL_LEN": 512,
                                        "JITKERN_LOG_REQUESTS": 0})
    try:
        server.wait_ready()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


def test_fuzz_never_a_5xx_always_openai_errors_and_streams_unharmed(srv):
    report = run_fuzz(srv.host, srv.port, KEY, cases=NUM_CASES, concurrency=8, seed=SEED, timeout=30.0)
    print(report.summary())
    assert not report.problems, report.summary()
    assert not report.canary_problems, report.summary()
    assert report.canaries >= 1
    assert set(report.sent) == set(CATEGORIES) and min(report.sent.values()) >= NUM_CASES // len(CATEGORIES) - 1
    assert not [s for s in report.statuses if isinstance(s, int) and s >= 500], report.statuses
    # The server is still healthy, and the log has no traceback from a request.
    log = srv.log_text()
    assert "Traceback" not in log, log[log.find("Traceback") - 500:][:3000]


def test_the_checker_catches_what_it_must():
    """The fuzz's oracle itself: a 5xx, HTML errors, a served bypass and garbled error objects fail."""
    plain = Case("types", b"")
    assert check_response(plain, b"") == "no response"
    assert check_response(Case("garbage", b"", half_close=True), b"") is None
    ok_json = b'HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n\r\n' \
              b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}'
    assert check_response(plain, ok_json) is None
    assert "500" in check_response(plain, b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    assert "content-type" in check_response(plain, b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<h1>")
    assert "OpenAI" in check_response(plain, b'HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\r\n{"e":1}')
    served = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}"
    assert check_response(Case("auth", b"", forbid_success=True), served)
    assert check_response(plain, served) is None
    # Every category generates requests, deterministically for a seed.
    a, b = CaseGenerator(7, KEY), CaseGenerator(7, KEY)
    cases = [a.next_case() for _ in range(3 * len(CATEGORIES))]
    assert [c.raw for c in cases] == [b.next_case().raw for _ in range(3 * len(CATEGORIES))]
    assert {c.category for c in cases} == set(CATEGORIES)
