"""The SSE fast paths of server/serving.py: the precomputed text frame is byte-identical to the general JSON
path, and outputs that queue up behind a slow handler go out in one write with the same bytes."""
from __future__ import annotations

import random
from types import SimpleNamespace

import json

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from server.serving import _END, _TIMEOUT, Generation

TEXTS = ["", " hello", "Ünïcödé ✓ 日本語 🙂", 'quote " backslash \\ slash /', "tab\tnew\nline\r\x00\x01\x1f\x7f",
         "\u2028\u2029 separators", "\ud800 lone surrogate", "<|im_end|> {\"json\": [1, 2]}"]


def _generation(chat: bool, include_usage: bool, continuous: bool = False, model: str = "SmolLM2-135M",
                request_id: str | None = None, n: int = 1) -> Generation:
    state = SimpleNamespace(served_model_name=model, metrics=None, tokenizer=None, token_strings=None,
                            settings=SimpleNamespace(sse_ping_s=0.0, log_requests=False, log_outputs=False))
    req = SimpleNamespace(endpoint="chat" if chat else "completions", request_id=request_id,
                          params=SimpleNamespace(n=n), prompts=[SimpleNamespace(token_ids=[1, 2, 3], text="p")],
                          chat_output=None, include_usage=include_usage, continuous_usage_stats=continuous,
                          logprobs=None, return_token_ids=False, echo=False, echo_text="", stream=True)
    return Generation(state, req, {})


def _random_text(rng: random.Random) -> str:
    pool = [chr(c) for c in range(0, 0x80)] + list("éü✓日本🙂\u2028") + ["\ud800"]
    return "".join(rng.choice(pool) for _ in range(rng.randrange(0, 12)))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["SmolLM2-135M", "modèle \"quoted\" ✓"])
def test_text_frame_is_byte_identical_to_the_json_path(chat, include_usage, model):
    g = _generation(chat, include_usage, model=model, request_id="req-1", n=3)
    rng = random.Random(7)
    texts = TEXTS + [_random_text(rng) for _ in range(200)]
    fast_used = 0
    for i, text in enumerate(texts):
        ci = i % 3
        general = g._chunk([g._stream_choice(ci, text, [5], None, None, None)])
        fast = g._text_frame(ci, text)
        if "\ud800" in text:
            assert fast is None, "a lone surrogate must take the general (ASCII-escaped) path"
        else:
            assert fast == general, (text, fast, general)
            fast_used += 1
    assert fast_used > 100


def test_text_frame_not_used_where_the_shape_differs():
    assert _generation(False, True, continuous=True)._text_frame(0, "x") is None
    assert _generation(True, False, model="bad \ud800 name")._text_frame(0, "x") is None


class _QueuedEvents:
    """Events as a handler finds them after falling behind: all already queued, then the end."""

    def __init__(self, outs):
        self.items = list(outs)
        self.polls = []

    def next(self, timeout):
        self.polls.append(timeout)
        return self.items.pop(0) if self.items else _END

    def abort(self):
        pass


def _outputs(pieces):
    outs, text, ids = [], "", []
    for k, piece in enumerate(pieces):
        text += piece
        ids.append(100 + k)
        last = k == len(pieces) - 1
        comp = CompletionOutput(index=0, text=text, token_ids=list(ids), finish_reason="length" if last else None,
                                delta_text=piece, delta_token_ids=[ids[-1]])
        outs.append((0, RequestOutput("r", "p", [1, 2, 3], [comp], finished=last)))
    return outs


@pytest.mark.parametrize("chat", [False, True])
def test_queued_outputs_go_out_as_one_chunk_with_their_deltas_joined(chat, monkeypatch):
    pieces = [" a", "é", " \"b\"", "", " c"]
    # The reference: one output at a time (the handler never behind), each frame written on its own.
    g1 = _generation(chat, True, request_id="same")
    ev1 = _QueuedEvents([])
    g1.events, g1.state.register = ev1, None
    writes1 = []
    pending = _outputs(pieces)
    monkeypatch.setattr(g1, "_wait", lambda deadline: pending.pop(0) if pending else _END)
    monkeypatch.setattr(g1.events, "next", lambda timeout: _TIMEOUT)
    g1.state.unregister = lambda g: None
    for frame in g1.stream():
        writes1.append(frame)
    # Behind: everything already queued when the handler wakes.
    g2 = _generation(chat, True, request_id="same")
    g2.created = g1.created
    queued = _outputs(pieces)
    first = queued.pop(0)
    g2.events = _QueuedEvents(queued)
    g2.state.unregister = lambda g: None
    waits = [first]
    monkeypatch.setattr(g2, "_wait", lambda deadline: waits.pop(0) if waits else _END)
    writes2 = list(g2.stream())
    # vLLM's way: what queued up while the handler was behind goes out as one chunk, the deltas joined
    def events(writes):
        return [json.loads(d) for w in writes for d in w.decode().split("data: ")[1:] if d.strip() != "[DONE]"]

    def text_of(evs):
        key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
        return "".join(key(c) for e in evs for c in e["choices"])
    ev1, ev2 = events(writes1), events(writes2)
    assert text_of(ev2) == text_of(ev1) == "".join(pieces)
    finish = [c["finish_reason"] for e in ev2 for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"]
    texts = [e for e in ev2 if text_of([e])]
    assert len(texts) == 1 and len(ev2) < len(ev1)        # every queued piece in the first (and only) text chunk
    assert [e["id"] for e in ev2] == [ev1[0]["id"]] * len(ev2)
    assert all(t == 0 for t in g2.events.polls), "draining the queue must never block"
