"""Tool calls and reasoning: the parsers on scripted outputs, and the server through the official `openai`
client (over WSGI, in process) on a fake model that plays back a given text.

Every parser is checked two ways: fed the whole text at once (what a non-streamed response does) and
fed in pieces of every size (what streaming does) -- the two must give the same message, and the
expected content / calls are read off the script, not typed twice.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from server.chat_output import ChatOutputProcessor, ChatOutputSpec, SpecialStripper
from server.reasoning import detect_reasoning_parser
from server.tool_parsers import collect, detect_tool_parser, make_tool_parser


def _feed_whole(parser_name, text, max_calls=None):
    p = make_tool_parser(parser_name, max_calls)
    whole = collect(p.parse_whole(text))
    p = make_tool_parser(parser_name, max_calls)
    streamed = collect(p.feed(text) + p.finish())
    # Fed as a stream, a call announced early stays a call; seen whole, only valid calls are calls.
    assert (streamed[0], [c["function"] for c in streamed[1]]) == (whole[0], [c["function"] for c in whole[1]]) \
        or not whole[1]
    return whole


def _feed_pieces(parser_name, text, sizes, max_calls=None):
    p = make_tool_parser(parser_name, max_calls)
    events, i = [], 0
    while i < len(text):
        k = sizes[len(events) % len(sizes)] if sizes else 1
        events += p.feed(text[i:i + k])
        i += k
    return collect(events + p.finish()), events


def _strip_ids(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _check_split_invariance(parser_name, text, max_calls=None):
    whole = _feed_whole(parser_name, text, max_calls)
    rng = random.Random(len(text))
    for sizes in ([1], [2], [3, 1, 7], [rng.randint(1, 9) for _ in range(20)]):
        (content, calls), _ = _feed_pieces(parser_name, text, sizes, max_calls)
        assert content == whole[0], (sizes, content, whole[0])
        assert [c["function"] for c in calls] == [c["function"] for c in whole[1]], sizes
    return whole


HERMES = ('Let me look that up.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": [1, 2], "note": "a } and </tool"}}\n</tool_call>\n<tool_call>\n{"name": "search", '
          '"arguments": {}}\n</tool_call>')


def test_hermes_calls_content_and_split_invariance():
    content, calls = _check_split_invariance("hermes", HERMES)
    assert content.strip() == "Let me look that up."
    assert _strip_ids(calls) == [("get_weather", {"city": "Paris", "days": [1, 2], "note": "a } and </tool"}),
                                 ("search", {})]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_streams_name_first_then_argument_fragments():
    (_, calls), events = _feed_pieces("hermes", HERMES, [1])
    kinds = [e[0] for e in events if e[0] != "content"]
    assert kinds[0] == "call"
    first_args = [e for e in events if e[0] == "args" and e[1] == 0]
    assert len(first_args) > 5, "arguments must stream in fragments, not in one piece at the end"
    # The name is announced before the block's JSON is complete.
    pos_call = next(i for i, e in enumerate(events) if e[0] == "call")
    assert pos_call < events.index(first_args[-1])


def test_hermes_bad_json_is_content_and_unclosed_block_at_end_is_parsed():
    text = "x <tool_call>{not json}</tool_call> y"
    assert _check_split_invariance("hermes", text) == (text, [])
    content, calls = _check_split_invariance("hermes", 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content == "ok " and _strip_ids(calls) == [("f", {"a": 1})]
    # A lone "<" or a partial marker at the very end is content, not lost.
    assert _check_split_invariance("hermes", "a < b <tool_") == ("a < b <tool_", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = _check_split_invariance("hermes", HERMES, max_calls=1)
    assert _strip_ids(calls) == [("get_weather", {"city": "Paris", "days": [1, 2], "note": "a } and </tool"})]


def test_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "time", "parameters": {}}'
    content, calls = _check_split_invariance("llama3_json", text)
    assert content == "" and _strip_ids(calls) == [("get_weather", {"city": "Oslo"}), ("time", {})]
    content, calls = _check_split_invariance("llama3_json", ' {"name": "f", "arguments": {"x": [1, {"y": 2}]}}')
    assert _strip_ids(calls) == [("f", {"x": [1, {"y": 2}]})]
    plain = "The answer is {probably} 42."
    assert _check_split_invariance("llama3_json", plain) == (plain, [])


def test_mistral_both_formats_and_ids():
    text = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"x": 3}}]'
    content, calls = _check_split_invariance("mistral", text)
    assert content == "Sure. " and _strip_ids(calls) == [("add", {"a": 1, "b": 2}), ("neg", {"x": 3})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)   # Mistral templates require this
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    content, calls = _check_split_invariance("mistral", v11)
    assert content == "" and _strip_ids(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert _check_split_invariance("mistral", "no calls [here]") == ("no calls [here]", [])


def test_pythonic_parses_literals_with_ast_never_eval():
    text = '[get_weather(city="Paris", days=3), search(q=\'x, y\', tags=["a", (1, 2)], exact=True, limit=None)]'
    content, calls = _check_split_invariance("pythonic", text)
    assert content == ""
    assert _strip_ids(calls) == [("get_weather", {"city": "Paris", "days": 3}),
                                 ("search", {"q": "x, y", "tags": ["a", [1, 2]], "exact": True, "limit": None})]
    wrapped = '<|python_start|>[ns.tool(a=-1.5)]<|python_end|>'
    assert _strip_ids(_check_split_invariance("pythonic", wrapped)[1]) == [("ns.tool", {"a": -1.5})]
    # Not literals / positional arguments: not calls (and nothing is evaluated).
    evil = "[f(x=__import__('os').system('false'))]"
    assert _check_split_invariance("pythonic", evil) == (evil, [])
    assert _check_split_invariance("pythonic", "[1] is a footnote") == ("[1] is a footnote", [])
    assert _check_split_invariance("pythonic", "[g(1)]") == ("[g(1)]", [])


def _process(spec, text, sizes=None):
    proc = ChatOutputProcessor(spec)
    if sizes is None:
        return proc.message(text)
    deltas, i, n = [], 0, 0
    while i < len(text):
        k = sizes[n % len(sizes)]
        deltas.append(proc.delta(text[i:i + k]))
        i, n = i + k, n + 1
    deltas.append(proc.delta("", final=True))
    msg = {"content": "", "reasoning_content": "", "calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            entry = msg["calls"].setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                assert entry["name"] is None and c["type"] == "function"
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"].get("arguments", "")
    return msg


REASONING_CASES = [
    # (parser, prompt text, output, expected reasoning, expected content)
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Thinking hard.</think>\n\nThe answer.", "Thinking hard.", "The answer."),
    ("deepseek_r1", "x", "<think>r</think>c", "r", "c"),
    ("deepseek_r1", "x", "never closed", "never closed", ""),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nstep 1\n</think>\n\nDone.", "\nstep 1\n", "Done."),
    ("qwen3", "<|im_start|>assistant\n", "Just an answer with </think> in it.", "",
     "Just an answer with </think> in it."),
    ("think_auto", "<|im_start|>assistant\n<think>\n", "r1 r2</think>c1", "r1 r2", "c1"),
    ("think_auto", "<|im_start|>assistant\n", "  <thin", "", "  <thin"),
]


@pytest.mark.parametrize("parser,prompt,output,reasoning,content", REASONING_CASES)
def test_reasoning_parsers(parser, prompt, output, reasoning, content):
    spec = ChatOutputSpec(reasoning_parser=parser, prompt_text=prompt)
    msg = _process(spec, output)
    assert msg["content"] == content and (msg["reasoning_content"] or "") == reasoning
    for sizes in ([1], [2, 5], [4]):
        streamed = _process(spec, output, sizes)
        assert streamed["content"] == content and streamed["reasoning_content"] == reasoning


def test_qwen3_with_thinking_off_parses_no_reasoning():
    spec = ChatOutputSpec(reasoning_parser="qwen3", template_kwargs={"enable_thinking": False})
    assert _process(spec, "<think>x</think>y")["content"] == "<think>x</think>y"


def test_reasoning_then_tool_call_and_special_strings_stripped():
    specials = ("<|im_end|>", "<|endoftext|>")
    spec = ChatOutputSpec(reasoning_parser="qwen3", tool_mode="auto", tool_parser="hermes",
                          special_strings=specials)
    text = ('<think>I should call it.</think>\n<tool_call>\n{"name": "f", "arguments": {"q": "<|im_end|>?"}}'
            '\n</tool_call><|im_end|>')
    msg = _process(spec, text)
    assert msg["reasoning_content"] == "I should call it."
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("f", {"q": "<|im_end|>?"})]
    streamed = _process(spec, text, [1])
    assert streamed["reasoning_content"] == "I should call it." and streamed["content"].strip() == ""
    assert json.loads(streamed["calls"][0]["arguments"]) == {"q": "<|im_end|>?"}


def test_special_stripper_holds_back_partial_specials():
    s = SpecialStripper(("<|im_end|>",))
    out = "".join(s.feed(c) for c in "a<|im_e") + "".join(s.feed(c) for c in "nd|>b<|x") + s.feed("", final=True)
    assert out == "ab<|x"


def test_auto_detection_from_templates():
    assert detect_tool_parser("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_tool_parser("{{ messages }}") == "hermes"
    assert detect_reasoning_parser("{{ '<think>\\n' }}") == "think_auto"
    assert detect_reasoning_parser("{{ messages }}") is None


# ============================================================================ through the server

# A Qwen2.5-style template (written for this test): tools in the system turn, assistant tool calls as
# <tool_call> JSON, tool results in <tool_response>, and enable_thinking gating an empty think block.
TEMPLATE = """
{%- if tools %}<|im_start|>system
Tools:{% for t in tools %}
{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

FRAMING = ["<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]


@pytest.fixture(scope="module")
def special_tokenizer():
    """The SmolLM2 tokenizer with the framing markers added as *special* tokens and the template above."""
    import tokenizers

    from engine.tokenizer import Tokenizer
    from tests.server_fakes import smollm2_tokenizer
    base = smollm2_tokenizer()
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in FRAMING])
    return Tokenizer(backend, source="test", bos_token=base.bos_token, eos_token=base.eos_token,
                     chat_template=TEMPLATE)


class _Served:
    def __init__(self, tokenizer, **settings):
        import httpx2
        import openai

        from server.app import create_app
        from server.settings import ServerSettings
        from tests.server_fakes import make_async_engine
        engine = make_async_engine()
        fake = engine.engine
        fake.tokenizer = tokenizer
        fake.config.vocab_size = fake.scheduler.config.vocab_size = tokenizer.backend.get_vocab_size()
        fake.offset = lambda prompt_ids, index=0: 0          # every output plays the script from its start
        self.fake = fake
        self.app = create_app(engine=engine, settings=ServerSettings(log_requests=False, **settings))
        http = httpx2.Client(transport=httpx2.WSGITransport(app=self.app), base_url="http://testserver")
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)

    def script(self, text: str) -> None:
        tok = self.fake.tokenizer
        self.fake.script = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    def close(self):
        self.app.close()


@pytest.fixture(scope="module")
def served(special_tokenizer):
    made = {}

    def get(**settings):
        key = tuple(sorted(settings.items()))
        if key not in made:
            made[key] = _Served(special_tokenizer, **settings)
        return made[key]
    yield get
    for s in made.values():
        s.close()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

SCRIPTS = {
    "hermes": ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call><tool_call>{"name": "search", "arguments": {"q": "caf\u00e9 \u2615"}}</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "search", "parameters": {"q": "caf\u00e9 \u2615"}}'),
    "mistral": ('I will check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "search", "arguments": {"q": "caf\u00e9 \u2615"}}]'),
    "pythonic": '[get_weather(city="Paris", days=2), search(q="caf\u00e9 \u2615")]',
}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "caf\u00e9 \u2615"})]


def _stream(client, **kwargs):
    """(content, reasoning, {index: call}, finish_reason, chunks) from a streamed chat completion."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # The first delta of a call carries its id, type and name.
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or "",
                                   "fragments": 1}
            else:
                assert tc.id is None and not tc.function.name, "id and name come only in a call's first delta"
                calls[tc.index]["arguments"] += tc.function.arguments or ""
                calls[tc.index]["fragments"] += 1
        if ch.finish_reason:
            finish = ch.finish_reason
    return content, reasoning, calls, finish, chunks


@pytest.mark.parametrize("parser", list(SCRIPTS))
def test_tool_calls_through_the_openai_client(served, parser):
    s = served(tool_call_parser=parser)
    s.script(SCRIPTS[parser])
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
    assert all(c.type == "function" for c in calls)
    if parser == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    else:
        assert all(c.id.startswith("call_") for c in calls)
    expected_content = "I will check." if parser in ("hermes", "mistral") else None
    assert choice.message.content == expected_content

    content, _, scalls, finish, chunks = _stream(s.client, model="fake-model", messages=ASK, tools=TOOLS,
                                                 max_tokens=200)
    assert finish == "tool_calls"
    assert content == (expected_content or "")
    assert [(scalls[i]["name"], json.loads(scalls[i]["arguments"])) for i in sorted(scalls)] == EXPECTED_CALLS
    if parser != "pythonic":          # JSON dialects stream the arguments as they are generated
        assert scalls[0]["fragments"] > 2


def test_each_choice_has_its_own_parser_and_a_cut_call_keeps_length(served):
    s = served(tool_call_parser="hermes")
    s.script(SCRIPTS["hermes"])
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, n=3, temperature=0.8,
                                         max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == EXPECTED_CALLS
    by_choice = {}
    for chunk in s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, n=3,
                                                  temperature=0.8, max_tokens=200, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                by_choice.setdefault(ch.index, []).append((tc.index, tc.function.name, tc.function.arguments))
    for j in range(3):
        names = [name for _, name, _ in by_choice[j] if name]
        assert names == ["get_weather", "search"], by_choice[j]
    # max_tokens ends the output inside the first call: no 500, finish_reason "length", the call as far as it got.
    tok = s.fake.tokenizer
    head = SCRIPTS["hermes"].split('"days"')[0]
    cut = len(tok.encode(head, add_special_tokens=False))
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, max_tokens=cut)
    # Not streamed: a call that does not parse stays content (vLLM's behaviour); streamed, it was announced.
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == tok.decode(s.fake.script[:cut], skip_special_tokens=True)
    assert '"name": "get_weather"' in r.choices[0].message.content
    content, _, calls, finish, _ = _stream(s.client, model="fake-model", messages=ASK, tools=TOOLS, max_tokens=cut)
    assert finish == "length" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"].startswith('{"city": "Paris"')


def test_tool_choice_none_and_parser_none_leave_the_text_alone(served):
    s = served(tool_call_parser="hermes")
    s.script(SCRIPTS["hermes"])
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, tool_choice="none",
                                         max_tokens=200)
    # No parsing, and the default skip_special_tokens drops the (special) framing tokens, as without tools.
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == SCRIPTS["hermes"].replace("<tool_call>", "").replace("</tool_call>", "")
    import openai
    off = served(tool_call_parser="none")
    with pytest.raises(openai.BadRequestError) as e:
        off.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, max_tokens=5)
    assert e.value.body["param"] == "tool_choice"


def test_parallel_tool_calls_false_through_the_server(served):
    s = served(tool_call_parser="hermes")
    s.script(SCRIPTS["hermes"])
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                         max_tokens=200)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_framing_special_tokens_reach_the_parsers_and_specials_are_stripped(served, special_tokenizer):
    s = served(tool_call_parser="hermes", reasoning_parser="qwen3")
    text = '<think>Need weather.</think>\n\nChecking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    s.script(text)
    ids = special_tokenizer.encode(text, add_special_tokens=False)
    assert special_tokenizer.token_to_id("<think>") in ids            # really one special token each
    assert "<think>" not in special_tokenizer.decode(ids, skip_special_tokens=True)
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, max_tokens=200)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Need weather." and msg.content == "Checking."
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    content, reasoning, calls, finish, _ = _stream(s.client, model="fake-model", messages=ASK, tools=TOOLS,
                                                   max_tokens=200)
    assert (content, reasoning, finish) == ("Checking.", "Need weather.", "tool_calls")
    # Without tools and asked to keep special tokens: the tool call and the end-of-turn token are content.
    r = s.client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}],
                                         max_tokens=200, extra_body={"skip_special_tokens": False})
    assert r.choices[0].message.content == text.split("\n\n", 1)[1] + special_tokenizer.eos_token
    assert r.choices[0].message.reasoning_content == "Need weather."


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "think_auto"])
def test_reasoning_content_through_the_openai_client(served, parser):
    s = served(reasoning_parser=parser, tool_call_parser="none")
    s.script("<think>First, think.\nThen more.</think>\n\nThe answer is 4.")
    r = s.client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2+2?"}],
                                         max_tokens=100)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == \
        ("First, think.\nThen more.", "The answer is 4.", "stop")
    content, reasoning, _, finish, chunks = _stream(s.client, model="fake-model", max_tokens=100,
                                                    messages=[{"role": "user", "content": "2+2?"}])
    assert (reasoning, content, finish) == ("First, think.\nThen more.", "The answer is 4.", "stop")
    assert sum(1 for c in chunks if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)) > 1
    r = s.client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2+2?"}],
                                         max_tokens=100, extra_body={"include_reasoning": False})
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content == "The answer is 4."


def test_enable_thinking_flag_and_chat_template_kwargs(served):
    from server.protocol import parse_chat_request
    on = served(reasoning_parser="qwen3", enable_thinking=False)
    ctx = on.app.state.ctx
    closed = "<think>\n\n</think>"
    assert closed in parse_chat_request({"messages": ASK}, ctx).prompts[0].text
    req = parse_chat_request({"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}, ctx)
    assert closed not in req.prompts[0].text
    plain = served(reasoning_parser="qwen3")
    assert closed not in parse_chat_request({"messages": ASK}, plain.app.state.ctx).prompts[0].text
    # With thinking off (template kwarg false), qwen3 leaves the output alone.
    on.script("<think>x</think>y")
    r = on.client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=50,
                                          extra_body={"skip_special_tokens": False})
    assert r.choices[0].message.content.startswith("<think>x</think>y")


def test_tools_and_tool_history_are_rendered_through_the_template(served):
    from server.protocol import parse_chat_request
    s = served(tool_call_parser="hermes")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    text = parse_chat_request({"messages": history, "tools": TOOLS}, s.app.state.ctx).prompts[0].text
    assert json.dumps(TOOLS[0]) in text.replace("\n", "") or '"name": "get_weather"' in text
    for t in TOOLS:
        assert t["function"]["name"] in text.split("<|im_end|>")[0]       # the tools are in the system turn
    # The arguments string went back to the template as an object (tojson of a dict, not of a string).
    assert '"arguments": {"city": "Paris", "days": 2}' in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    r = s.client.chat.completions.create(model="fake-model", messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_auto_parsers_are_resolved_from_the_served_template(served):
    ctx = served(tool_call_parser="auto", reasoning_parser="auto").app.state.ctx
    assert (ctx.tool_parser, ctx.reasoning_parser) == ("hermes", "think_auto")
    ctx = served(tool_call_parser="none", reasoning_parser="none").app.state.ctx
    assert (ctx.tool_parser, ctx.reasoning_parser) == (None, None)


def test_settings_and_cli_flags():
    from server.cli import build_parser, settings_from_args
    from server.settings import ServerSettings, SettingsError
    args = build_parser().parse_args(["--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek_r1",
                                      "--enable-thinking"])
    st = settings_from_args(args)
    assert (st.tool_call_parser, st.reasoning_parser, st.enable_thinking) == ("pythonic", "deepseek_r1", True)
    env = st.to_env()
    assert ServerSettings.from_env(env).reasoning_parser == "deepseek_r1"
    assert ServerSettings.from_env(env).enable_thinking is True
    with pytest.raises(SettingsError, match="JITKERN_TOOL_CALL_PARSER"):
        ServerSettings.from_env({"JITKERN_TOOL_CALL_PARSER": "hermes2"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "nope"])
    assert settings_from_args(build_parser().parse_args([])).tool_call_parser == "auto"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_required_and_named_tool_choice_are_constrained_and_parsed(served):
    import jsonschema
    import openai

    from server.protocol import parse_chat_request
    s = served(tool_call_parser="hermes")
    ctx = s.app.state.ctx
    # A named function: the output is constrained to that function's parameters schema.
    req = parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": NAMED}, ctx)
    assert req.params.structured_outputs.json == TOOLS[0]["function"]["parameters"]
    # "required": an array of {name, parameters}, each one of the tools; one element without parallel calls.
    req = parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                              "parallel_tool_calls": False}, ctx)
    schema = req.params.structured_outputs.json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 1}}],
                [{"name": "search", "parameters": {}}, {"name": "search", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # The (fake) model plays a constrained output; the server turns it into calls.
    s.script('{"city": "Paris", "days": 2}')
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=100)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == EXPECTED_CALLS[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
    _, _, calls, finish, _ = _stream(s.client, model="fake-model", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                     max_tokens=100)
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["fragments"] > 2
    assert json.loads(calls[0]["arguments"]) == EXPECTED_CALLS[0][1]
    s.script('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
             '{"name": "search", "parameters": {"q": "caf\u00e9 \u2615"}}]')
    r = s.client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=200)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert got == EXPECTED_CALLS and r.choices[0].message.content is None
    _, _, calls, finish, _ = _stream(s.client, model="fake-model", messages=ASK, tools=TOOLS,
                                     tool_choice="required", max_tokens=200)
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == EXPECTED_CALLS
    # A tool whose parameters are not a usable schema: 400 naming it; so is a second constraint.
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model="fake-model", messages=ASK, tools=bad_tools, max_tokens=5,
                                         tool_choice={"type": "function", "function": {"name": "f"}})
    assert e.value.body["param"] == "tools[0].function.parameters"


@pytest.mark.slow
def test_named_tool_choice_end_to_end_on_the_embedded_model():
    """The embedded SmolLM2 (135M, no tool training, a template without tools) still produces a valid call
    when the tool is named: the output is held to the function's parameters schema token by token."""
    import httpx2
    import jsonschema
    import openai

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    schema = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": schema}}]
    app = create_app(engine=AsyncEngine(EngineArgs(max_model_len=512, num_blocks=64, block_size=16)),
                     settings=ServerSettings(log_requests=False))
    try:
        http = httpx2.Client(transport=httpx2.WSGITransport(app=app), base_url="http://testserver")
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
        model = client.models.list().data[0].id
        kwargs = dict(model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      temperature=0, max_tokens=64)
        r = client.chat.completions.create(**kwargs)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls", r
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schema)
        _, _, calls, finish, _ = _stream(client, **kwargs)
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == args          # greedy: the same call streamed
    finally:
        app.close()
