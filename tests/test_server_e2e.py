"""End to end: a real `gunicorn server.app` on a free loopback port, driven by the official `openai` client.

Every test runs against two backends: "fake" (the scripted model of tests/server_fakes.py: fast, checks
the serving machinery) and "smollm2" (the embedded SmolLM2 through the real engine: the product). The
smollm2 server is started for real; if the engine cannot load or generate, these tests FAIL with the
server log's tail -- they are never skipped.

Properties are checked without hard-coded outputs: streaming equals non-streaming, 32 concurrent
streams equal their solo greedy text, a stop string cuts the solo text where it first occurs, greedy
logprobs put the sampled token at rank 1, and so on.
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest

import openai  # `make install-test`; a missing client is a failure here, not a skip

from tests.server_fakes import ServerProcess, metrics_value

API_KEY = "e2e-test-key"
MAX_MODEL_LEN = 512
MAX_BODY = 200_000
BACKENDS = [pytest.param("fake", id="fake"), pytest.param("smollm2", id="smollm2", marks=pytest.mark.slow)]
SERVER_ENV = {"JITKERN_API_KEY": API_KEY, "JITKERN_MAX_MODEL_LEN": MAX_MODEL_LEN, "JITKERN_MAX_BODY_BYTES": MAX_BODY,
              "JITKERN_MAX_NUM_SEQS": 40, "JITKERN_MAX_LOG_LEN": 80}


def start(backend: str, env: dict | None = None, **kwargs) -> ServerProcess:
    server = ServerProcess(backend, env=dict(SERVER_ENV, **(env or {})), **kwargs)
    try:
        return server.wait_ready()
    except RuntimeError as e:
        server.kill()
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module", params=BACKENDS)
def srv(request):
    server = start(request.param)
    yield server
    server.close()


def client_for(srv, **kwargs):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def client(srv):
    return client_for(srv)


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def http_request(srv, method, path, body=None, headers=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
    hdrs = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    hdrs.update(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={k: v for k, v in hdrs.items() if v is not None})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload


def get_metrics(srv) -> str:
    status, payload = http_request(srv, "GET", "/metrics")
    assert status == 200
    return payload.decode()


GREEDY = dict(temperature=0.0)


# ------------------------------------------------------------------------------------------ basics

def test_completions_and_chat(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, **GREEDY)
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=8, **GREEDY)
    assert c.choices[0].message.role == "assistant" and isinstance(c.choices[0].message.content, str)
    assert c.model == model and c.id.startswith("chatcmpl-")


def test_streaming_equals_non_streaming_with_usage(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, **GREEDY)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices(client, model):
    r = client.completions.create(model=model, prompt="My favourite food is", max_tokens=6, n=3, temperature=1.0,
                                  seed=1234)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 18
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=1.0, seed=5, stream=True)
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1]


def test_greedy_logprobs(client, model):
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=6, logprobs=3,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and 3 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-4)
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five."}],
                                       max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)
        assert e.token == e.top_logprobs[0].token and e.bytes == e.top_logprobs[0].bytes


def test_stop_strings(client, model):
    kwargs = dict(model=model, prompt="The first ten letters of the alphabet are", max_tokens=16,
                  extra_body={"ignore_eos": True}, **GREEDY)
    text = client.completions.create(**kwargs).choices[0].text
    # A stop string that first occurs mid-way: the stopped text is the solo text up to it.
    words = [w for w in text.split() if len(w) >= 2]
    assert words, f"no usable word in {text!r}"
    stop = words[len(words) // 2]
    cut = text.index(stop)
    r = client.completions.create(stop=[stop], **kwargs)
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    s = client.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in s) == text[:cut]


# ------------------------------------------------------------------------------------------ concurrency

PROMPTS = ["The weather today is", "In 1492, Columbus", "def fibonacci(n):", "My cat likes to",
           "The best way to learn", "Water boils at", "Once upon a time, a", "The meaning of life"]


def test_32_concurrent_streams_equal_solo_greedy(srv, model):
    solo_client = client_for(srv)
    kwargs = dict(model=model, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    solo = {p: solo_client.completions.create(prompt=p, **kwargs).choices[0].text for p in PROMPTS}
    results, errors = {}, []
    barrier = threading.Barrier(32)

    def worker(i):
        try:
            c = client_for(srv)
            prompt = PROMPTS[i % len(PROMPTS)]
            barrier.wait(60)
            chunks = list(c.completions.create(prompt=prompt, stream=True, **kwargs))
            results[i] = (prompt, "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {type(e).__name__}: {e}")

    running = []
    stop_watch = threading.Event()

    def watch():
        # The one engine batches the 32 HTTP threads: /metrics sees many requests running at once.
        while not stop_watch.is_set():
            running.append(metrics_value(get_metrics(srv), "vllm:num_requests_running"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    stop_watch.set()
    watcher.join(30)
    assert not errors, errors
    assert max(running) >= 8, f"never more than {max(running)} requests in a batch"
    assert len(results) == 32
    for i, (prompt, text, finish) in sorted(results.items()):
        assert text == solo[prompt], f"stream {i} ({prompt!r}) differs from its solo greedy text"
        assert finish == "length"


# ------------------------------------------------------------------------------------------ bad requests

def test_bad_request_table_then_healthy(srv, client, model):
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    cases = [
        # (body or raw bytes, path, status, param, needle)
        (b"{oops", "/v1/completions", 400, None, "JSON"),
        ({"model": model, "prompt": "x", "temperature": "warm"}, "/v1/completions", 400, "temperature", "number"),
        ({"model": model, "prompt": "x", "top_p": 7}, "/v1/completions", 400, "top_p", "top_p"),
        ({"model": model, "prompt": "x", "n": -1}, "/v1/completions", 400, "n", "n"),
        ({"model": model, "prompt": "x", "logprobs": 1000}, "/v1/completions", 400, "logprobs", "logprobs"),
        ({"model": model, "prompt": "x", "mystery_field": 1}, "/v1/completions", 400, "mystery_field", "unknown"),
        ({"model": model, "prompt": "x", "response_format": {"type": "json_schema"}}, "/v1/completions", 400,
         "response_format.json_schema", "object"),
        ({"model": model, "prompt": long_prompt}, "/v1/completions", 400, "prompt", str(MAX_MODEL_LEN)),
        ({"model": model, "messages": [{"role": "user", "content": long_prompt}]}, "/v1/chat/completions", 400,
         "messages", str(MAX_MODEL_LEN)),
        ({"model": model, "messages": [{"role": "robot", "content": "x"}]}, "/v1/chat/completions", 400,
         "messages[0].role", "robot"),
        ({"model": "not-our-model", "prompt": "x"}, "/v1/completions", 404, "model", "not-our-model"),
        ({"model": model, "prompt": "y" * (MAX_BODY + 10)}, "/v1/completions", 413, None, str(MAX_BODY)),
    ]
    for body, path, status, param, needle in cases:
        raw = body if isinstance(body, bytes) else None
        got, payload = http_request(srv, "POST", path, body=None if raw else body, raw=raw)
        err = json.loads(payload)["error"]
        assert (got, err["param"]) == (status, param), (body if raw else list(body), payload[:300])
        assert needle.lower() in err["message"].lower(), err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    # 401: no key, a wrong key, and the official client with a wrong key.
    for headers in ({"Authorization": None}, {"Authorization": "Bearer nope"}):
        got, payload = http_request(srv, "GET", "/v1/models", headers=headers)
        assert got == 401 and json.loads(payload)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    # The official client maps them to its exceptions and the error body names the field.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=9)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="x")
    # Still healthy, still generating.
    assert http_request(srv, "GET", "/health", headers={"Authorization": None})[0] == 200
    assert client.completions.create(model=model, prompt="Still there?", max_tokens=3).usage.completion_tokens >= 1


# ------------------------------------------------------------------------------------------ disconnect

def test_disconnect_frees_blocks(srv, model):
    before = get_metrics(srv)
    assert metrics_value(before, "vllm:num_requests_running") == 0
    base_usage = metrics_value(before, "vllm:kv_cache_usage_perc")
    sock = socket.create_connection((srv.host, srv.port), timeout=120)
    body = json.dumps({"model": model, "prompt": "Write a very long story about the sea. " * 4, "max_tokens": 400,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 3:
        data = sock.recv(4096)
        assert data, "the server closed the stream early"
        received += data
    busy = get_metrics(srv)
    assert metrics_value(busy, "vllm:num_requests_running") == 1
    assert metrics_value(busy, "vllm:kv_cache_usage_perc") > base_usage
    sock.close()
    deadline = time.monotonic() + 30
    while True:
        now = get_metrics(srv)
        if metrics_value(now, "vllm:num_requests_running") == 0 and \
                metrics_value(now, "vllm:kv_cache_usage_perc") == base_usage:
            break
        assert time.monotonic() < deadline, "the disconnected request still holds its blocks:\n" + now[:2000]
        time.sleep(0.2)
    assert metrics_value(now, "vllm:generation_tokens_total") - metrics_value(busy, "vllm:generation_tokens_total") \
        < 400


# ------------------------------------------------------------------------------------------ utility routes

def test_utility_routes(srv, client, model):
    status, payload = http_request(srv, "POST", "/tokenize", {"model": model, "prompt": "Hello world"})
    tokens = json.loads(payload)["tokens"]
    assert status == 200 and json.loads(payload)["count"] == len(tokens) > 0
    status, payload = http_request(srv, "POST", "/detokenize", {"model": model, "tokens": tokens})
    assert json.loads(payload)["prompt"] == "Hello world"
    for path in ("/health", "/ping", "/version", "/server_info"):
        assert http_request(srv, "GET", path)[0] == 200, path
    assert http_request(srv, "POST", "/ping")[0] == 200
    assert json.loads(http_request(srv, "POST", "/reset_prefix_cache")[1]) == {"success": True}
    text = get_metrics(srv)
    for name in ("vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        metrics_value(text, name)
    assert metrics_value(text, "vllm:time_to_first_token_seconds_count") > 0
    (card,) = client.models.list().data
    assert card.id == model and card.model_extra.get("max_model_len") == MAX_MODEL_LEN


# ------------------------------------------------------------------------------------------ SIGTERM

def _sse_lines(resp):
    """Yields the SSE payloads of an http.client response as they arrive."""
    buf = b""
    while True:
        data = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not data:
            return
        buf += data
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            if frame.startswith(b"data: "):
                yield frame[6:].decode()


def _open_stream(server, body):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_during_stream_finishes_it(backend):
    server = start(backend)
    try:
        conn, resp = _open_stream(server, {"prompt": "Tell me about the moon.", "max_tokens": 24, "stream": True,
                                           "ignore_eos": True, "temperature": 0})
        lines = _sse_lines(resp)
        first = next(lines)
        assert json.loads(first)["choices"]
        server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        finals = [json.loads(x)["choices"][0]["finish_reason"] for x in [first] + rest[:-1]]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        conn.close()
        assert server.terminate(60) == 0, server.log_tail()
        with pytest.raises(OSError):
            socket.create_connection((server.host, server.port), timeout=2).close()
    finally:
        server.close()


def test_sigterm_ends_streams_longer_than_the_drain_cleanly():
    server = start("fake", env={"JITKERN_DRAIN_TIMEOUT_S": "0.5", "JITKERN_FAKE_STEP_DELAY": "0.02"})
    try:
        conn, resp = _open_stream(server, {"prompt": "endless", "max_tokens": 400, "stream": True, "ignore_eos": True})
        lines = _sse_lines(resp)
        next(lines)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
        assert time.monotonic() - t0 < 5
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert server.terminate(30) == 0
    finally:
        server.close()


# ------------------------------------------------------------------------------------------ process-level (fake)

def test_python_m_server_flags():
    server = ServerProcess("fake", cli_args=["--served-model-name", "my-model", "--api-key", "k2", "--max-model-len",
                                             "300", "--block-size", "16", "--num-blocks", "40",
                                             "--disable-log-requests"])
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="k2", max_retries=0)
        (card,) = c.models.list().data
        assert card.id == "my-model" and card.model_extra["max_model_len"] == 300
        assert c.completions.create(model="my-model", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="bad", max_retries=0).models.list()
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("GET", "/server_info")
        assert conn.getresponse().status == 401      # behind the key like every non-public route
        conn.close()
        info = json.loads(_get(server, "/server_info", {"Authorization": "Bearer k2"}))
        assert info["vllm_config"]["num_blocks"] == 40 and "k2" not in json.dumps(info)
    finally:
        server.close()


def _get(server, path, headers=None) -> bytes:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    data = conn.getresponse().read()
    conn.close()
    return data


def test_keepalive_comments_reach_the_client():
    server = start("fake", env={"JITKERN_SSE_PING_S": "0.2", "JITKERN_FAKE_PREFILL_DELAY": "1.0"})
    try:
        conn, resp = _open_stream(server, {"prompt": "slow start", "max_tokens": 3, "stream": True})
        raw = resp.read().decode()
        assert raw.count(": keepalive\n\n") >= 3 and raw.endswith("data: [DONE]\n\n")
        c = client_for(server)
        chunks = list(c.completions.create(model="fake-model", prompt="slow start", max_tokens=3, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        server.close()


@pytest.mark.parametrize("env,needle", [
    ({"JITKERN_ENGINE_FACTORY": "tests.server_fakes:no_such_factory"}, "could not start the engine"),
    ({"JITKERN_BLOCK_SIZE": "big"}, "JITKERN_BLOCK_SIZE"),
    # a model that fails every step: the warm-up request ends in an error, so the server must not say ready
    ({"JITKERN_FAKE_FAIL_STEPS": "1000000"}, "the warm-up generation failed: RuntimeError: injected model failure"),
])
def test_boot_failure_is_one_clear_line(env, needle):
    server = ServerProcess("fake", env=env, boot_timeout=60)
    try:
        with pytest.raises(RuntimeError, match="exited with status"):
            server.wait_ready()
        log = server.log_text()
        # the one line says why; a request that the engine failed keeps its traceback in the log (above it)
        assert needle in log and "ready in" not in log, log
        assert "Traceback" not in log or "warm-up" in needle, log
        assert server.proc.returncode != 0
    finally:
        server.close()


@pytest.mark.slow
def test_unloadable_model_is_one_clear_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    server = ServerProcess("smollm2", env={"JITKERN_MODEL": str(bad)}, boot_timeout=120)
    try:
        with pytest.raises(RuntimeError, match="exited with status"):
            server.wait_ready()
        log = server.log_text()
        assert "could not start the engine" in log and str(bad) in log and "Traceback" not in log, log
    finally:
        server.close()
