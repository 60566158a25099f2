"""The OpenAI server app in-process (Falcon's test client) on the real engine front with a scripted model.

The fake model (tests/server_fakes.py) plays back a known token script rotated by the prompt, so
every expected text is computed here from the tokenizer, not hard-coded. What is under test is the
server: request parsing and validation, response and SSE shapes, usage, logprobs formats, stop
handling through the engine, auth, limits, disconnects, drain, metrics and logging.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import falcon.testing
import pytest

from server.app import create_app
from server.protocol import ServingContext, parse_chat_request
from server.settings import ServerSettings, SettingsError
from tests.server_fakes import FakeLLMEngine, make_async_engine


# ------------------------------------------------------------------------------------------ helpers

def parse_sse(text: str):
    """(list of JSON events, number of comment frames, saw [DONE] last). Checks the framing strictly."""
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    frames = text[:-2].split("\n\n")
    events, comments, done = [], 0, False
    for i, frame in enumerate(frames):
        assert not done, "nothing may follow data: [DONE]"
        if frame.startswith(":"):
            comments += 1
            continue
        assert frame.startswith("data: "), frame
        assert "\n" not in frame, "one data line per event"
        payload = frame[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        events.append(json.loads(payload))
    return events, comments, done


def make_server(**settings_kwargs):
    fake_kwargs = settings_kwargs.pop("fake", {})
    engine = make_async_engine(**fake_kwargs)
    settings = ServerSettings(**settings_kwargs)
    app = create_app(engine=engine, settings=settings)
    return app, falcon.testing.TestClient(app)


@pytest.fixture(scope="module")
def server():
    app, client = make_server(log_requests=False)
    yield app, client
    app.close()


@pytest.fixture(scope="module")
def client(server):
    return server[1]


@pytest.fixture(scope="module")
def fake(server) -> FakeLLMEngine:
    return server[0].state.engine.engine


@pytest.fixture(scope="module")
def tok(fake):
    return fake.tokenizer


def expected_text(fake, prompt_ids, count, index=0):
    return fake.tokenizer.decode(fake.expected_tokens(prompt_ids, count, index), skip_special_tokens=True)


def chat_ids(tok, messages):
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True), add_special_tokens=False)


def engine_idle(app, timeout=3.0) -> dict:
    """Waits until the engine holds no request; returns its metrics snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = app.state.engine.call(lambda e: dict(e.metrics_snapshot(), n=e.num_requests))
        if snap["n"] == 0 or time.monotonic() > deadline:
            return snap
        time.sleep(0.02)


def prompt_reaching(fake, tok, needle: str, within: int = 20) -> str:
    """A prompt whose playback contains `needle` within `within` tokens (and no EOS before it)."""
    for i in range(200):
        p = f"prompt number {i}"
        text = tok.decode(fake.expected_tokens(tok.encode(p), within), skip_special_tokens=False)
        if needle in text and "<|im_end|>" not in text.split(needle)[0]:
            return p
    raise AssertionError(f"no prompt reaches {needle!r}")


# ------------------------------------------------------------------------------------------ completions

def test_completion_text_usage_and_shape(client, fake, tok):
    prompt = "The capital of France is"
    r = client.simulate_post("/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 9})
    assert r.status_code == 200, r.text
    body = r.json
    ids = tok.encode(prompt)
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-") and r.headers["x-request-id"] == body["id"]
    (choice,) = body["choices"]
    assert choice["text"] == expected_text(fake, ids, 9)
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 9, "total_tokens": len(ids) + 9}


def test_completion_token_prompt_echo_and_token_ids(client, fake, tok):
    ids = tok.encode("Echo me, please")
    r = client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "echo": True,
                                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json["choices"][0]
    assert choice["text"] == "Echo me, please" + expected_text(fake, ids, 5)
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == fake.expected_tokens(ids, 5)


def test_completion_batch_of_prompts_with_n(client, fake, tok):
    prompts = ["first prompt", "second one"]
    r = client.simulate_post("/v1/completions", json={"prompt": prompts, "n": 2, "temperature": 0.7,
                                                      "max_tokens": 4})
    assert r.status_code == 200, r.text
    choices = r.json["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        p, j = divmod(c["index"], 2)
        assert c["text"] == expected_text(fake, tok.encode(prompts[p]), 4, j)
    assert len({c["text"] for c in choices}) == 4
    assert r.json["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    assert r.json["usage"]["completion_tokens"] == 16


def test_batch_of_prompts_is_admitted_in_one_command_without_threads(server, client, fake, tok):
    before = {t.name for t in threading.enumerate()}
    r = client.simulate_post("/v1/completions", json={"prompt": ["one", "two", "three"], "max_tokens": 4,
                                                      "stream": True})
    events, _, done = parse_sse(r.text)
    assert done and sorted({c["index"] for e in events for c in e["choices"]}) == [0, 1, 2]
    assert not [t for t in threading.enumerate() if t.name.startswith("jitkern-forward") and t.name not in before]
    # One bad prompt (an out-of-vocabulary id) refuses the whole request: nothing is left in the engine.
    r = client.simulate_post("/v1/completions", json={"prompt": [[1, 2], [3, 10 ** 9]], "max_tokens": 4})
    assert r.status_code == 400 and r.json["error"]["param"] == "prompt"
    assert engine_idle(server[0])["n"] == 0


def test_a_dead_engine_is_503_not_500():
    app, client = make_server(log_requests=False)
    try:
        app.state.engine.shutdown(timeout=2.0)
        r = client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert r.json["error"]["type"] == "server_error" and "unavailable" in r.json["error"]["message"]
        assert client.simulate_get("/health").status_code == 503
    finally:
        app.close()


def test_completion_stream_matches_json_and_never_splits_utf8(client, fake, tok):
    prompt = prompt_reaching(fake, tok, "☕", within=12)
    body = {"prompt": prompt, "max_tokens": 12}
    whole = client.simulate_post("/v1/completions", json=body).json["choices"][0]["text"]
    assert "☕" in whole
    r = client.simulate_post("/v1/completions", json=dict(body, stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events, _, done = parse_sse(r.text)
    assert done
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == whole
    assert all("\ufffd" not in t for t in texts), texts
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert all("usage" not in e for e in events)


def test_stream_include_usage(client, tok):
    r = client.simulate_post("/v1/completions", json={"prompt": "usage please", "max_tokens": 6, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    events, _, done = parse_sse(r.text)
    assert done
    *chunks, last = events
    assert last["choices"] == []
    n_prompt = len(tok.encode("usage please"))
    assert last["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 6, "total_tokens": n_prompt + 6}
    assert chunks and all(c["usage"] is None for c in chunks)


def test_stream_continuous_usage(client):
    r = client.simulate_post("/v1/completions", json={"prompt": "usage please", "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}})
    events, _, _ = parse_sse(r.text)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4


def test_completion_logprobs_shape(client, fake, tok):
    # An ASCII stretch of the script: there each token's own text is a piece of the output text.
    prompt = prompt_reaching(fake, tok, "one two", within=5)
    r = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "logprobs": 3})
    lp = r.json["choices"][0]["logprobs"]
    text = r.json["choices"][0]["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for tokstr, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value == pytest.approx(-0.25)
        assert 1 <= len(top) <= 4 and top[tokstr] == pytest.approx(-0.25)


def test_completion_echo_with_logprobs_scores_the_prompt(client, tok):
    ids = tok.encode("score this prompt")
    r = client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "logprobs": 1, "echo": True})
    lp = r.json["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == pytest.approx(-1.5)


def test_prompt_logprobs(client, tok):
    ids = tok.encode("prompt logprobs here")
    r = client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
    plp = r.json["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert entry[str(tid)]["logprob"] == pytest.approx(-1.5) and entry[str(tid)]["rank"] == 2


def test_tokens_as_token_ids(client):
    r = client.simulate_post("/v1/completions", json={"prompt": "ids", "max_tokens": 3, "logprobs": 0,
                                                      "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.json["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]


def test_stop_string(client, fake, tok):
    prompt = prompt_reaching(fake, tok, "STOP")
    full = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 20}).json
    text = full["choices"][0]["text"]
    r = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stop": ["zzz", "STOP"]})
    c = r.json["choices"][0]
    assert c["text"] == text[:text.index("STOP")]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == "STOP"
    # Streaming never shows a prefix of the stop string that later turns out to stop the stream.
    s = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stop": "STOP",
                                                      "stream": True})
    events, _, _ = parse_sse(s.text)
    assert "".join(e["choices"][0]["text"] for e in events) == c["text"]
    assert events[-1]["choices"][0]["stop_reason"] == "STOP"
    with_stop = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stop": "STOP",
                                                              "include_stop_str_in_output": True}).json
    assert with_stop["choices"][0]["text"] == text[:text.index("STOP") + 4]


def test_stop_token_ids(client, fake, tok):
    ids = tok.encode("stop on a token")
    expected = fake.expected_tokens(ids, 6)
    target = expected[3]
    r = client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "stop_token_ids": [target]})
    c = r.json["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == target
    assert r.json["usage"]["completion_tokens"] == expected.index(target) + 1


def test_non_positive_max_tokens_means_unset(client, fake, tok):
    # Unset: the playback runs to the script's EOS (finish "stop", stop_reason None), past the default 16.
    for value in (0, -1, None):
        r = client.simulate_post("/v1/completions", json={"prompt": "go on", "max_tokens": value})
        assert r.status_code == 200, r.text
        c = r.json["choices"][0]
        if value is None:
            assert r.json["usage"]["completion_tokens"] == 16    # the completions default
        else:
            assert c["finish_reason"] == "stop" and c["stop_reason"] is None
            assert r.json["usage"]["completion_tokens"] > 16


# ------------------------------------------------------------------------------------------ chat

def test_chat_json(client, fake, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.simulate_post("/v1/chat/completions", json={"model": "fake-model", "messages": messages,
                                                           "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json
    ids = chat_ids(tok, messages)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": expected_text(fake, ids, 7)}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 7


def test_chat_content_parts_and_max_completion_tokens_precedence(client, fake, tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                                                           "max_completion_tokens": 3, "max_tokens": 10})
    assert r.status_code == 200, r.text
    ids = chat_ids(tok, [{"role": "user", "content": "Hello\nworld"}])
    assert r.json["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3, "total_tokens": len(ids) + 3}
    assert r.json["choices"][0]["message"]["content"] == expected_text(fake, ids, 3)


def test_chat_stream_shape_and_usage(client, fake, tok):
    messages = [{"role": "user", "content": "stream to me"}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "stream": True,
                                                           "stream_options": {"include_usage": True}})
    events, _, done = parse_sse(r.text)
    assert done
    first, *middle, last_choice, usage = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last_choice["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == expected_text(fake, chat_ids(tok, messages), 8)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert len({e["id"] for e in events}) == 1


def test_chat_stream_n_choices(client, fake, tok):
    messages = [{"role": "user", "content": "three ways"}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "stream": True,
                                                           "n": 3, "temperature": 0.9, "seed": 7})
    events, _, done = parse_sse(r.text)
    assert done
    ids = chat_ids(tok, messages)
    for j in range(3):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == j]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == expected_text(fake, ids, 5, j)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


def chat_reaching(fake, tok, needle: str, within: int) -> list:
    for i in range(300):
        messages = [{"role": "user", "content": f"question {i}"}]
        text = tok.decode(fake.expected_tokens(chat_ids(tok, messages), within), skip_special_tokens=False)
        if needle in text and "<|im_end|>" not in text:
            return messages
    raise AssertionError(f"no chat reaches {needle!r}")


def test_chat_logprobs(client, fake, tok):
    messages = chat_reaching(fake, tok, "☕", 6)
    r = client.simulate_post("/v1/chat/completions", json={"messages": messages,
                                                           "max_tokens": 6, "logprobs": True, "top_logprobs": 2})
    c = r.json["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == 6 and "☕" in c["message"]["content"]
    # The raw token bytes rebuild the text exactly, even where a token is part of a character.
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == c["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["logprob"] == pytest.approx(-0.25)
    r0 = client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "lp"}],
                                                            "max_tokens": 2, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in r0.json["choices"][0]["logprobs"]["content"])


def test_chat_echo_and_continue_final_message(client, tok):
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "echo": True,
                                                           "continue_final_message": True,
                                                           "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["message"]["content"].startswith("Once upon a")
    ctx = ServingContext(tok, 512, 49152)
    req = parse_chat_request({"messages": messages, "continue_final_message": True,
                              "add_generation_prompt": False}, ctx)
    assert req.prompts[0].text.endswith("<|im_start|>assistant\nOnce upon a")
    assert req.prompts[0].token_ids == tok.encode(req.prompts[0].text, add_special_tokens=False)


def test_chat_tools_shown_with_tool_choice_none(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather?"}],
                                                           "tools": tools, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------ bad requests

LONG = "word " * 600     # > max_model_len (512) tokens

BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, param or None, substring of the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", b"", 400, None, "empty"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    ("/v1/completions", b"\xff\xfe", 400, None, "UTF-8"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": ["a", [1]]}, 400, "prompt", "mixture"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt", "out of range"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "512"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p", "min_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, 400, "n", "greedy"),
    ("/v1/completions", {"prompt": "x", "n": True}, 400, "n", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -2}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 70}, 400, "seed", "64 bits"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop[0]", "string"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "empty"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "empty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "x"}}, 400, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "object"),
    ("/v1/completions", {"prompt": "x", "bad_words": [""]}, 400, "bad_words", "bad_words"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "nope"}}, 400, "guided_json", "nope"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format.type", "xml"),
    ("/v1/completions", {"prompt": "x", "suffix": "tail"}, 400, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, 400, "stream", "beam"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                              "stream": True}, 400, "stream", "beam"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs", "stream"),
    ("/v1/completions", {"prompt": "x", "priority": 3}, 400, "priority", "priority"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "at least"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/v1/completions", {"prompt": "x", "model": 7}, 400, "model", "string"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "array"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "does not take image input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "512"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
     400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs",
     "boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools", "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     "'g'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
     400, "tool_choice", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400,
     "tool_choice", "needs 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "yes",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "parallel_tool_calls", "boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages[0].tool_calls[0].function.arguments", "JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}},
     400, "chat_template_kwargs", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message", "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400,
     "chat_template", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model", "nope"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
    ("/detokenize", {"tokens": [1, -5]}, 400, "tokens", "out of range"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "array"),
]


@pytest.mark.parametrize("path,body,status,param,needle", BAD_REQUESTS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else sorted(b)}"[:60] for i, (_, b, *_r) in
                              enumerate(BAD_REQUESTS)])
def test_bad_request_table(client, path, body, status, param, needle):
    if isinstance(body, bytes):
        r = client.simulate_post(path, body=body, headers={"content-type": "application/json"})
    else:
        r = client.simulate_post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert needle.lower() in err["message"].lower(), err["message"]
    assert err["type"] == "invalid_request_error"


def test_prompt_too_long_names_both_lengths(client, tok):
    r = client.simulate_post("/v1/completions", json={"prompt": LONG})
    n = len(tok.encode(LONG))
    assert f"{n} input tokens" in r.json["error"]["message"] and "512 tokens" in r.json["error"]["message"]
    assert r.json["error"]["code"] == "context_length_exceeded"


def test_huge_prompts_are_refused_before_tokenising(client, tok):
    """max_model_len 512 -> at most 512 * 64 characters; an 8 MiB prompt is refused at once, by field."""
    huge = "x" * (8 << 20)
    cases = [("/v1/completions", {"prompt": huge}, "prompt"),
             ("/v1/completions", {"prompt": ["fine", huge]}, "prompt[1]"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 20000}] * 2}, "messages"),
             ("/tokenize", {"prompt": huge}, "prompt"),
             ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages")]
    for path, body, param in cases:
        t0 = time.perf_counter()
        r = client.simulate_post(path, json=body)
        took = time.perf_counter() - t0
        assert r.status_code == 400, (path, param, r.text[:200])
        err = r.json["error"]
        assert err["param"] == param and err["code"] == "context_length_exceeded", err
        assert "32768" in err["message"]
        assert took < 5.0, f"{path} {param}: {took:.1f}s (tokenised before the length check?)"
    # Just under the bound is tokenised and then refused by its token count.
    r = client.simulate_post("/v1/completions", json={"prompt": "word " * 6000})
    assert r.status_code == 400 and "input tokens" in r.json["error"]["message"]


def test_tokenising_releases_the_gil(tok):
    """encode_texts (what the request threads call) must let other threads run while it tokenises."""
    from server.protocol import encode_texts
    ctx = ServingContext(tok, 512, 49152)
    text = "hello world, this is a test of the tokenizer. " * 6000
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    try:
        t0 = time.perf_counter()
        (ids,) = encode_texts(ctx, [text], False)
        took = time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
    assert ids == tok.encode(text, add_special_tokens=False)
    # Holding the GIL in native code for `took` seconds would allow a handful of ticks at most.
    assert took < 0.05 or ticks[0] >= 10, (took, ticks[0])


SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\uDBFF"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": "x", "bad_words": ["\\ud800"]}', "bad_words[0]"),
    ("/v1/completions", '{"prompt": "x", "request_id": "\\ud800"}', "request_id"),
    ("/v1/completions", '{"prompt": "x", "\\ud800": 1}', "'\\ud800'"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_BODIES, ids=[p for *_, p in SURROGATE_BODIES])
def test_lone_surrogates_are_400_naming_the_field(client, path, raw, param):
    r = client.simulate_post(path, body=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode", err
    # A surrogate pair is one character, not an error.
    ok = client.simulate_post("/v1/completions", body='{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}',
                              headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("depth", [65, 900, 1000, 5000, 100000])
def test_deeply_nested_json_is_400(client, depth):
    for opener, closer in (("[", "]"), ('{"a":', "}")):
        raw = '{"prompt": "x", "metadata": ' + opener * depth + "1" + closer * depth + "}"
        r = client.simulate_post("/v1/completions", body=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert r.json["error"]["code"] == "invalid_json" and "nested" in r.json["error"]["message"]
    raw = '{"prompt": "x", "max_tokens": 1, "metadata": ' + "[" * 60 + "1" + "]" * 60 + "}"
    assert client.simulate_post("/v1/completions", body=raw,
                                headers={"content-type": "application/json"}).status_code == 200


def test_healthy_after_bad_requests(server, client):
    for path, body, *_ in BAD_REQUESTS[:10]:
        client.simulate_post(path, body=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert client.simulate_get("/health").status_code == 200
    r = client.simulate_post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
    assert r.status_code == 200
    assert engine_idle(server[0])["n"] == 0


def test_routes_and_methods(client):
    r = client.simulate_get("/v1/nothing-here")
    assert r.status_code == 404 and r.json["error"]["message"].startswith("Not found")
    r = client.simulate_get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json
    assert client.simulate_get("/v1/models/fake-model").json["id"] == "fake-model"
    assert client.simulate_get("/v1/models/other").status_code == 404


def test_truncate_prompt_tokens(client, fake, tok):
    ids = tok.encode(LONG)
    r = client.simulate_post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 10, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json["usage"]["prompt_tokens"] == 10
    assert r.json["choices"][0]["text"] == expected_text(fake, ids[-10:], 2)


def test_unknown_but_harmless_fields_are_accepted(client):
    r = client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "me", "metadata": None,
                                                      "guided_json": None, "best_of": 1})
    assert r.status_code == 200, r.text


def test_priority_with_priority_policy():
    app, client = make_server(scheduling_policy="priority", log_requests=False,
                              fake={"scheduling_policy": "priority"})
    try:
        r = client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": -5})
        assert r.status_code == 200, r.text
    finally:
        app.close()


def test_duplicate_request_id_is_400(client):
    body = {"prompt": "x", "max_tokens": 1, "request_id": "fixed-id-1"}
    assert client.simulate_post("/v1/completions", json=body).status_code == 200
    # Finished requests free their id; a concurrent duplicate is refused.
    body_long = dict(body, request_id="fixed-id-2", max_tokens=200, stream=True, ignore_eos=True)
    env = falcon.testing.create_environ(path="/v1/completions", method="POST", body=json.dumps(body_long),
                                        headers={"content-type": "application/json"})
    app = client.app
    it = app(env, lambda *a: None)
    next(iter(it))
    try:
        r = client.simulate_post("/v1/completions", json=dict(body, request_id="fixed-id-2"))
        assert r.status_code == 400 and r.json["error"]["param"] == "request_id"
    finally:
        it.close()


# ------------------------------------------------------------------------------------------ auth and limits

def test_api_key_on_v1_routes():
    app, client = make_server(api_key="s3cret", log_requests=False)
    try:
        r = client.simulate_get("/v1/models")
        assert r.status_code == 401 and r.json["error"]["code"] == "invalid_api_key"
        assert r.headers.get("www-authenticate") == "Bearer"
        assert client.simulate_get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.simulate_get("/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        r = client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                 headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert client.simulate_post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert client.simulate_get("/health").status_code == 200          # public
        assert client.simulate_get("/v1/nope").status_code in (401, 404)  # never served
    finally:
        app.close()


# Every route but the public ones (liveness, version, metrics) needs the key, whatever the path's spelling.
PROTECTED = [("GET", "/v1/models"), ("GET", "/v1/models/fake-model"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
             ("GET", "/server_info"), ("POST", "/reset_prefix_cache")]


def test_api_key_is_checked_on_the_resolved_route_not_the_path():
    app, client = make_server(api_key="s3cret", log_requests=False)
    bodies = {"/v1/completions": {"prompt": "x", "max_tokens": 1}, "/tokenize": {"prompt": "x"},
              "/detokenize": {"tokens": [1]},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}
    try:
        for method, path in PROTECTED:
            for spelling in (path, "/" + path, path.replace("/", "//"), path + "/", path.upper()):
                r = client.simulate_request(method, spelling, json=bodies.get(path))
                assert r.status_code in (401, 404), (method, spelling, r.status_code, r.text)
                assert r.json["error"]["type"] == "invalid_request_error"
            good = client.simulate_request(method, path, json=bodies.get(path),
                                           headers={"Authorization": "Bearer s3cret"})
            assert good.status_code == 200, (method, path, good.text)
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert client.simulate_get(path).status_code == 200, path
        assert engine_idle(app)["n"] == 0
    finally:
        app.close()


def test_json_content_type_is_required_on_bodies():
    app, client = make_server(log_requests=False)
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    try:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            for ctype in (None, "text/plain", "application/x-www-form-urlencoded",
                          "multipart/form-data; boundary=x", "application/jsonx", "application/json; charset=latin-1"):
                headers = {"content-type": ctype} if ctype else {}
                r = client.simulate_post(path, body=body, headers=headers)
                assert r.status_code == 415, (path, ctype, r.text)
                err = r.json["error"]
                assert err["code"] == "unsupported_media_type" and err["param"] == "Content-Type"
                assert "application/json" in err["message"]
        for ctype in ("application/json", "Application/JSON; charset=utf-8", 'application/json;charset="UTF-8"'):
            r = client.simulate_post("/v1/completions", body=body, headers={"content-type": ctype})
            assert r.status_code == 200, (ctype, r.text)
    finally:
        app.close()


def test_body_size_limit():
    app, client = make_server(max_body_bytes=2000, log_requests=False)
    try:
        r = client.simulate_post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413
        assert r.json["error"]["code"] == "request_too_large" and "2000" in r.json["error"]["message"]
        assert client.simulate_post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        app.close()


# ------------------------------------------------------------------------------------------ lifecycle

def _start_stream(app, body):
    env = falcon.testing.create_environ(path="/v1/completions", method="POST", body=json.dumps(body),
                                        headers={"content-type": "application/json"})
    status = {}
    it = app(env, lambda s, h: status.update(status=s, headers=h))
    return it, status, env


def test_closing_a_stream_aborts_and_frees_blocks():
    app, _ = make_server(log_requests=False, fake={"step_delay": 0.01})
    try:
        it, status, _ = _start_stream(app, {"prompt": "a long story " * 20, "max_tokens": 300, "stream": True,
                                             "ignore_eos": True})
        assert status["status"].startswith("200")
        chunks = iter(it)
        for _ in range(3):
            assert next(chunks).startswith(b"data: ")
        busy = app.state.engine.call(lambda e: e.metrics_snapshot())
        assert busy["kv_cache_usage"] > 0 and busy["num_requests_running"] == 1
        it.close()          # what gunicorn does when writing to a gone client fails
        snap = engine_idle(app)
        assert snap["n"] == 0 and snap["kv_cache_usage"] == 0.0 and snap["num_requests_running"] == 0
        assert app.state.num_active == 0
    finally:
        app.close()


@pytest.mark.parametrize("stream", [True, False])
def test_failure_sending_the_response_aborts_and_frees_blocks(stream):
    """What gunicorn does when it cannot send the status line or headers (a header value it refuses, a
    client gone): start_response raises. The admitted generation must end and free its KV blocks."""
    app, _ = make_server(log_requests=False, fake={"step_delay": 0.01})
    try:
        # 400 steps of 10 ms: an orphan would still be running when engine_idle gives up after 1 s.
        body = {"prompt": "a long story " * 20, "max_tokens": 400, "stream": stream, "ignore_eos": True}
        env = falcon.testing.create_environ(path="/v1/completions", method="POST", body=json.dumps(body),
                                            headers={"content-type": "application/json"})

        def refusing_start_response(status, headers, exc_info=None):
            raise ValueError("cannot send this header")

        with pytest.raises(ValueError):
            it = app(env, refusing_start_response)
            for _ in it:          # a server iterates (and closes) what it got; nothing must come of it
                pass
        snap = engine_idle(app, timeout=1.0)
        assert snap["n"] == 0 and snap["kv_cache_usage"] == 0.0 and snap["num_requests_running"] == 0
        assert app.state.num_active == 0
        assert app.state.engine.call(lambda e: e.kv.num_free_blocks) == app.state.num_blocks
    finally:
        app.close()


def test_stream_closed_before_first_chunk_still_aborts():
    app, _ = make_server(log_requests=False, fake={"step_delay": 0.01})
    try:
        it, _, _ = _start_stream(app, {"prompt": "never read", "max_tokens": 300, "stream": True, "ignore_eos": True})
        it.close()
        assert engine_idle(app)["n"] == 0
    finally:
        app.close()


def test_client_gone_while_waiting_is_noticed_without_writes():
    """A non-streaming request whose client hangs up is aborted, though nothing is written to it."""
    app, _ = make_server(log_requests=False, fake={"step_delay": 0.02})
    ours, theirs = socket.socketpair()
    try:
        env = falcon.testing.create_environ(path="/v1/completions", method="POST",
                                            body=json.dumps({"prompt": "slow", "max_tokens": 400, "ignore_eos": True}),
                                            headers={"content-type": "application/json"})
        env["gunicorn.socket"] = ours
        done = threading.Event()
        threading.Thread(target=lambda: (app(env, lambda *a: None), done.set()), daemon=True).start()
        time.sleep(0.3)
        assert not done.is_set()
        theirs.close()
        t0 = time.monotonic()
        assert done.wait(3.0), "the handler did not notice the disconnect"
        assert time.monotonic() - t0 < 2.0     # 400 tokens at 20 ms would take 8 s
        assert engine_idle(app)["n"] == 0
    finally:
        ours.close()
        app.close()


def test_client_gone_check_never_blocks_on_a_socket_with_a_timeout():
    """The gunicorn worker gives sockets a read/write timeout; the disconnect check must stay instant."""
    from server.serving import client_gone
    a, b = socket.socketpair()
    try:
        a.settimeout(5.0)
        t0 = time.perf_counter()
        assert client_gone({"gunicorn.socket": a}) is False
        assert time.perf_counter() - t0 < 0.5
        b.sendall(b"x")           # readable with data: still there
        assert client_gone({"gunicorn.socket": a}) is False
        b.close()
        a.recv(1)
        assert client_gone({"gunicorn.socket": a}) is True
    finally:
        a.close()


def test_keepalive_comments_while_waiting():
    app, client = make_server(log_requests=False, sse_ping_s=0.1, fake={"prefill_delay": 0.5})
    try:
        r = client.simulate_post("/v1/completions", json={"prompt": "wait for it", "max_tokens": 2, "stream": True})
        events, comments, done = parse_sse(r.text)
        assert comments >= 2 and done and len(events) >= 1
        assert r.text.index(": keepalive") < r.text.index("data: ")
    finally:
        app.close()


def test_drain_ends_streams_cleanly_and_refuses_new_work():
    app, client = make_server(log_requests=False, fake={"step_delay": 0.01})
    try:
        it, _, _ = _start_stream(app, {"prompt": "long", "max_tokens": 400, "stream": True, "ignore_eos": True,
                                       "stream_options": {"include_usage": True}})
        chunks = iter(it)
        first = next(chunks)
        app.state.begin_drain(timeout=0.2)
        r = client.simulate_post("/v1/completions", json={"prompt": "new", "max_tokens": 1})
        assert r.status_code == 503 and r.json["error"]["code"] == "shutting_down"
        assert client.simulate_get("/health").status_code == 503
        rest = b"".join(chunks)
        events, _, done = parse_sse((first + rest).decode())
        assert done
        finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert [e["choices"][0]["finish_reason"] for e in finals] == ["abort"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] < 400
        assert engine_idle(app)["n"] == 0
    finally:
        app.close()


def test_engine_failure_mid_stream_is_an_error_event_then_done(server, client, caplog):
    app = server[0]
    app.state.engine.call(lambda e: setattr(e, "fail_steps", 1))
    with caplog.at_level(logging.ERROR, logger="jitkern.server"):
        r = client.simulate_post("/v1/completions", json={"prompt": "boom", "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events, _, done = parse_sse(r.text)
    assert done and "error" in events[-1]
    # The client learns that the server failed; the details (exception, message) are in the log only.
    err = events[-1]["error"]
    assert err["type"] == "server_error" and "internal error" in err["message"]
    assert "injected" not in err["message"] and "RuntimeError" not in err["message"]
    assert "injected model failure" in caplog.text
    app.state.engine.call(lambda e: setattr(e, "fail_steps", 1))
    r = client.simulate_post("/v1/completions", json={"prompt": "boom", "max_tokens": 5})
    assert r.status_code == 500 and r.json["error"]["type"] == "server_error"
    assert "injected" not in r.json["error"]["message"] and "RuntimeError" not in r.json["error"]["message"]
    assert client.simulate_post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------ utility routes

def test_tokenize_detokenize(client, tok):
    r = client.simulate_post("/tokenize", json={"prompt": "Hello ☕ world", "return_token_strs": True})
    body = r.json
    assert body["tokens"] == tok.encode("Hello ☕ world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    assert client.simulate_post("/detokenize", json={"tokens": body["tokens"]}).json == {"prompt": "Hello ☕ world"}
    messages = [{"role": "user", "content": "hi"}]
    r = client.simulate_post("/tokenize", json={"messages": messages})
    assert r.json["tokens"] == chat_ids(tok, messages)


def test_health_ping_version_server_info(client):
    assert client.simulate_get("/health").status_code == 200
    assert client.simulate_get("/ping").status_code == 200
    assert client.simulate_post("/ping").status_code == 200
    assert client.simulate_get("/version").json["version"]
    info = client.simulate_get("/server_info").json
    assert info["vllm_config"]["max_model_len"] == 512 and info["vllm_config"]["served_model_name"] == "fake-model"
    models = client.simulate_get("/v1/models").json
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == 512


def test_server_info_hides_the_api_key():
    app, client = make_server(api_key="topsecret", log_requests=False)
    try:
        assert "topsecret" not in client.simulate_get("/server_info").text
    finally:
        app.close()


def test_reset_prefix_cache(client):
    r = client.simulate_post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json == {"success": True}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_names_and_counts(client, tok):
    before = client.simulate_get("/metrics").text
    ids = tok.encode("count my tokens please")
    # The same prompt twice: the second reuses the first's cached prompt blocks? (too short for a full block:
    # the counters must still move).
    for _ in range(2):
        assert client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 4}).status_code == 200
    r = client.simulate_get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:request_prompt_tokens_count"):
        _metric(text, name)
    assert _metric(text, "vllm:generation_tokens_total") - _metric(before, "vllm:generation_tokens_total") == 8
    assert _metric(text, "vllm:prompt_tokens_total") > _metric(before, "vllm:prompt_tokens_total")
    assert _metric(text, "vllm:e2e_request_latency_seconds_count") - \
        _metric(before, "vllm:e2e_request_latency_seconds_count") == 2
    assert _metric(text, "vllm:inter_token_latency_seconds_count") - \
        _metric(before, "vllm:inter_token_latency_seconds_count") == 6
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"}' in text


def test_prefix_cache_hits_counted(client, tok):
    ids = tok.encode("a shared prefix that is long enough to fill more than one sixteen token block " * 2)
    before = client.simulate_get("/metrics").text
    for _ in range(2):
        client.simulate_post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
    after = client.simulate_get("/metrics").text
    assert _metric(after, "vllm:prefix_cache_hits_total") - _metric(before, "vllm:prefix_cache_hits_total") >= 16


def test_metrics_can_be_disabled():
    app, client = make_server(enable_metrics=False, log_requests=False)
    try:
        assert client.simulate_get("/metrics").status_code == 404
    finally:
        app.close()


# ------------------------------------------------------------------------------------------ logging

def test_request_logging_truncates_prompts_and_outputs(caplog):
    app, client = make_server(log_requests=True, log_outputs=True, max_log_len=12)
    try:
        with caplog.at_level(logging.INFO, logger="jitkern.server"):
            client.simulate_post("/v1/completions", json={"prompt": "0123456789abcdefghijXYZ", "max_tokens": 20})
        lines = [r.getMessage() for r in caplog.records if r.name == "jitkern.server"]
        req_line = next(line for line in lines if line.startswith("request "))
        assert "'0123456789ab'...[11 more chars]" in req_line and "XYZ" not in req_line
        out_line = next(line for line in lines if line.startswith("response "))
        assert "more chars]" in out_line and "finish_reason" in out_line
    finally:
        app.close()


def test_logged_prompts_and_outputs_are_escaped_so_no_line_can_be_forged(caplog):
    app, client = make_server(log_requests=True, log_outputs=True, max_log_len=40)
    forged = "hi\n2026-01-01 00:00:00 INFO jitkern.server: request admin-1\r\x1b[2J\u2028"
    try:
        with caplog.at_level(logging.INFO, logger="jitkern.server"):
            r = client.simulate_post("/v1/completions", json={"prompt": forged, "max_tokens": 3})
            assert r.status_code == 200
            r = client.simulate_post("/v1/completions", json={"prompt": [forged, "x\ny"], "max_tokens": 1})
            assert r.status_code == 200
            client.simulate_post("/v1/completions\n%0aFORGED", json={"prompt": "x"})
        lines = [r.getMessage() for r in caplog.records if r.name == "jitkern.server"]
        assert [line for line in lines if line.startswith("request ")], lines
        for line in lines:
            assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line, line
        req_line = next(line for line in lines if line.startswith("request "))
        assert repr(forged[:40]) in req_line and "more chars]" in req_line
    finally:
        app.close()


@pytest.mark.parametrize("request_id,ok", [
    ("a" * 128, True), ("req-1:abc/DEF_~.+=@", True), ("a" * 129, False), ("line\nbreak", False),
    ("sp ace", False), ("caf\u00e9", False), ("\ud800", False), ("tab\t", False), ("", False), ("\x7f", False),
])
def test_request_id_length_and_charset(client, request_id, ok):
    body = json.dumps({"prompt": "x", "max_tokens": 1, "request_id": request_id})   # ASCII: \\ud800 escaped
    r = client.simulate_post("/v1/completions", body=body, headers={"content-type": "application/json"})
    if ok:
        assert r.status_code == 200 and r.headers["x-request-id"] == request_id == r.json["id"]
    else:
        assert r.status_code == 400, r.text
        assert r.json["error"]["param"] == "request_id"


def test_request_logging_off():
    app, client = make_server(log_requests=False)
    try:
        handler_records = []

        class H(logging.Handler):
            def emit(self, record):
                handler_records.append(record.getMessage())

        h = H()
        logging.getLogger("jitkern.server").addHandler(h)
        try:
            client.simulate_post("/v1/completions", json={"prompt": "quiet", "max_tokens": 1})
        finally:
            logging.getLogger("jitkern.server").removeHandler(h)
        assert not [m for m in handler_records if m.startswith("request ")]
    finally:
        app.close()


# ------------------------------------------------------------------------------------------ settings and CLI

def test_settings_from_env_and_errors():
    s = ServerSettings.from_env({"JITKERN_MODEL": "/m", "JITKERN_BLOCK_SIZE": "32", "JITKERN_API_KEY": "k",
                                 "JITKERN_ENABLE_PREFIX_CACHING": "off", "JITKERN_MAX_MODEL_LEN": "0",
                                 "JITKERN_SSE_PING_S": "0"})
    assert (s.model, s.block_size, s.api_key, s.enable_prefix_caching, s.max_model_len, s.sse_ping_s) == \
        ("/m", 32, "k", False, None, 0.0)
    assert s.engine_kwargs() == {"model": "/m", "block_size": 32, "enable_prefix_caching": False,
                                 "scheduling_policy": "fcfs", "usage_context": "openai_api_server"}
    assert ServerSettings.from_env(s.to_env()) == s
    for env, name in [({"JITKERN_BLOCK_SIZE": "abc"}, "JITKERN_BLOCK_SIZE"),
                      ({"JITKERN_NUM_BLOCKS": "0"}, "JITKERN_NUM_BLOCKS"),
                      ({"JITKERN_SCHEDULING_POLICY": "lifo"}, "JITKERN_SCHEDULING_POLICY"),
                      ({"JITKERN_ENABLE_METRICS": "maybe"}, "JITKERN_ENABLE_METRICS")]:
        with pytest.raises(SettingsError, match=name):
            ServerSettings.from_env(env)


def test_dtype_setting_reaches_the_engine():
    """vLLM's --dtype: float32 / float become the engine's dtype="float32" (f32 matrix-unit inputs on a GPU), the
    16-bit spellings and auto leave the engine's default; anything else is refused naming the variable; the CLI
    flag travels to the worker through the environment."""
    from server.cli import build_parser, gunicorn_command
    assert ServerSettings.from_env({"JITKERN_DTYPE": "float32"}).engine_kwargs()["dtype"] == "float32"
    assert ServerSettings.from_env({"JITKERN_DTYPE": "float"}).engine_kwargs()["dtype"] == "float32"
    for text in ("auto", "bfloat16", "half"):
        assert "dtype" not in ServerSettings.from_env({"JITKERN_DTYPE": text}).engine_kwargs()
    with pytest.raises(SettingsError, match="JITKERN_DTYPE"):
        ServerSettings.from_env({"JITKERN_DTYPE": "int8"})
    _, env = gunicorn_command(build_parser().parse_args(["--dtype", "float32"]))
    assert ServerSettings.from_env(env).engine_kwargs()["dtype"] == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "fp8"])


def test_device_and_gpu_memory_utilization_reach_the_engine(capsys):
    """--device and --gpu-memory-utilization travel through JITKERN_DEVICE / JITKERN_GPU_MEMORY_UTILIZATION to the
    engine's arguments (with vLLM's server usage context, for its GPU batch defaults); a bad value is exit 2 naming
    the flag, or a SettingsError naming the variable."""
    from server.cli import build_parser, gunicorn_command, main
    _, env = gunicorn_command(build_parser().parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.5"]))
    assert env["JITKERN_DEVICE"] == "cuda" and env["JITKERN_GPU_MEMORY_UTILIZATION"] == "0.5"
    kw = ServerSettings.from_env(env).engine_kwargs()
    assert (kw["device"], kw["gpu_memory_utilization"], kw["usage_context"]) == ("cuda", 0.5, "openai_api_server")
    _, env = gunicorn_command(build_parser().parse_args([]))
    assert "JITKERN_DEVICE" not in env and "JITKERN_GPU_MEMORY_UTILIZATION" not in env
    kw = ServerSettings.from_env(env).engine_kwargs()
    assert "device" not in kw and "gpu_memory_utilization" not in kw       # the engine's auto and 0.9
    assert ServerSettings.from_env({"JITKERN_GPU_MEMORY_UTILIZATION": "1"}).gpu_memory_utilization == 1.0
    for argv, needle in [(["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
                         (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                         (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
                         (["--gpu-memory-utilization", "x"], "--gpu-memory-utilization"),
                         (["--device", "tpu"], "--device")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]        # (argparse's usage lines come first)
        assert last.startswith(f"python -m server: error: argument {needle}") and "Traceback" not in err
    for env, name in [({"JITKERN_GPU_MEMORY_UTILIZATION": "0"}, "JITKERN_GPU_MEMORY_UTILIZATION"),
                      ({"JITKERN_GPU_MEMORY_UTILIZATION": "2"}, "JITKERN_GPU_MEMORY_UTILIZATION"),
                      ({"JITKERN_GPU_MEMORY_UTILIZATION": "lots"}, "JITKERN_GPU_MEMORY_UTILIZATION"),
                      ({"JITKERN_DEVICE": "tpu"}, "JITKERN_DEVICE")]:
        with pytest.raises(SettingsError, match=name):
            ServerSettings.from_env(env)


def test_gunicorn_threads_follow_the_device_default(monkeypatch):
    """Without JITKERN_MAX_NUM_SEQS the threads cover the engine's default batch: 64 on the CPU, 256 where CUDA
    may be picked."""
    import importlib

    import server.gunicorn_conf as conf
    monkeypatch.delenv("JITKERN_MAX_NUM_SEQS", raising=False)
    monkeypatch.delenv("JITKERN_THREADS", raising=False)
    try:
        monkeypatch.setenv("JITKERN_DEVICE", "cpu")
        assert importlib.reload(conf).threads == 96
        monkeypatch.setenv("JITKERN_DEVICE", "auto")
        assert importlib.reload(conf).threads == 288
    finally:
        monkeypatch.undo()
        importlib.reload(conf)


def test_cli_flags_become_gunicorn_command():
    from server.cli import build_parser, gunicorn_command
    args = build_parser().parse_args([
        "--model", "/models/x", "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "mine",
        "--tokenizer-config", "/t.json", "--block-size", "32", "--num-blocks", "256", "--max-model-len", "4096",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching",
        "--scheduling-policy", "priority", "--disable-log-requests", "--enable-log-outputs", "--max-log-len", "80",
        "--disable-metrics", "--api-key", "k", "-v", "--trust-remote-code"])
    argv, env = gunicorn_command(args)
    assert argv[1:] == ["-m", "gunicorn", "--config", "python:server.gunicorn_conf", "server.app"]
    s = ServerSettings.from_env(env)
    assert (s.model, s.served_model_name, s.tokenizer_config, s.block_size, s.num_blocks, s.max_model_len,
            s.max_num_seqs, s.max_num_batched_tokens, s.enable_prefix_caching, s.scheduling_policy,
            s.log_requests, s.log_outputs, s.max_log_len, s.enable_metrics, s.api_key, s.verbose) == \
        ("/models/x", "mine", "/t.json", 32, 256, 4096, 16, 1024, False, "priority", False, True, 80, False,
         "k", True)
    assert env["JITKERN_HOST"] == "127.0.0.1" and env["JITKERN_PORT"] == "8123"


def test_cli_rejects_bad_flags(capsys):
    from server.cli import main
    for argv, needle in [(["--port", "99999"], "--port"), (["--block-size", "0"], "--block-size"),
                         (["--scheduling-policy", "lifo"], "--scheduling-policy"),
                         (["--model", "/no/such/model"], "/no/such/model"), (["--tensor-parallel-size", "2"],
                                                                             "tensor_parallel_size=2")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_gunicorn_conf_reads_env(monkeypatch):
    import importlib

    import server.gunicorn_conf as conf
    monkeypatch.setenv("JITKERN_HOST", "::1")
    monkeypatch.setenv("JITKERN_PORT", "9001")
    monkeypatch.setenv("JITKERN_MAX_NUM_SEQS", "100")
    monkeypatch.setenv("JITKERN_GRACEFUL_TIMEOUT", "12")
    conf = importlib.reload(conf)
    try:
        assert conf.bind == ["[::1]:9001"] and conf.workers == 1 and conf.worker_class == "server.http_worker.ServerWorker"
        assert conf.threads == 132 and conf.timeout == 0 and conf.graceful_timeout == 12 and not conf.preload_app
    finally:
        monkeypatch.undo()
        importlib.reload(conf)
