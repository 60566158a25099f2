"""Structured outputs through the OpenAI server: every spelling of the constraint (OpenAI's response_format,
vLLM's structured_outputs and guided_*, llama.cpp's grammar / json_schema), on both endpoints, with the
official `openai` client against a real gunicorn server running the real engine on a tiny random Llama with
the embedded SmolLM2 tokenizer (tests/structured_fixtures.py). Outputs are checked by property (jsonschema,
re.fullmatch, choice membership); bad constraints must be 400s naming the field.
"""
from __future__ import annotations

import json
import re
import threading

import pytest

import openai

from server.errors import APIError
from server.protocol import ServingContext, parse_chat_request, parse_completion_request
from tests.server_fakes import ServerProcess, smollm2_tokenizer

jsonschema = pytest.importorskip("jsonschema")

API_KEY = "so-test-key"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
                         "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 2}},
          "required": ["city", "population", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3} times"
CHOICES = ["positive", "negative", "neutral"]
GBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c]{1,4}'
GBNF_RE = r"\[[a-c]{1,4}(,[a-c]{1,4}){0,3}\]"


# ------------------------------------------------------------------------------------------ parsing (no server)

@pytest.fixture(scope="module")
def ctx():
    return ServingContext(tokenizer=smollm2_tokenizer(), max_model_len=512, vocab_size=49152)


@pytest.mark.parametrize("extra, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json"),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"structured_outputs": {"json": SCHEMA}}, "json"),
    ({"structured_outputs": {"grammar": GBNF}}, "grammar"),
    ({"guided_json": json.dumps(SCHEMA)}, "json"),
    ({"guided_regex": REGEX}, "regex"),
    ({"guided_choice": CHOICES}, "choice"),
    ({"guided_grammar": GBNF, "guided_decoding_backend": "llguidance"}, "grammar"),
    ({"grammar": GBNF}, "grammar"),
    ({"json_schema": SCHEMA}, "json"),
])
def test_every_spelling_becomes_the_engine_constraint(ctx, extra, kind):
    for parse, base in ((parse_completion_request, {"prompt": "hi"}),
                        (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]})):
        req = parse({**base, **extra}, ctx)
        so = req.params.structured_outputs
        assert (so.kind if so is not None else None) == kind


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_regex": "([a-z]+"}, "guided_regex", "unclosed"),
    ({"guided_regex": 5}, "guided_regex", "string"),
    ({"guided_choice": "a"}, "guided_choice", "array"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"grammar": 'root ::= "a" undefined'}, "grammar", "undefined"),
    ({"structured_outputs": {"regex": "(", "choice": None}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammer": "x"}}, "structured_outputs.grammer", "unknown"),
    ({"structured_outputs": "json"}, "structured_outputs", "object"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
])
def test_bad_constraints_are_400_naming_the_field(ctx, extra, param, words):
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "hi", **extra}, ctx)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert words in e.value.message


# ------------------------------------------------------------------------------------------ a real server

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.structured_fixtures import make_constrained_model_dir
    path = make_constrained_model_dir(str(tmp_path_factory.mktemp("constrained-llama")))
    server = ServerProcess("tiny-constrained", env={"JITKERN_API_KEY": API_KEY, "JITKERN_MODEL": path,
                                                    "JITKERN_MAX_MODEL_LEN": 512, "JITKERN_NUM_BLOCKS": 256,
                                                    "JITKERN_MAX_NUM_SEQS": 16})
    try:
        server.wait_ready()
    except RuntimeError as e:
        server.kill()
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


MSG = [{"role": "user", "content": "Describe a city."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema(client, model, temperature):
    r = client.chat.completions.create(
        model=model, messages=MSG, temperature=temperature, seed=3, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_stream_json_schema_and_json_object(client, model):
    stream = client.chat.completions.create(
        model=model, messages=MSG, temperature=1.0, seed=5, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    r = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=300,
                                       response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":       # "any object" is unbounded: a random model may fill max_tokens
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_guided_fields_in_a_concurrent_mixed_batch(client, model, temperature):
    """Constrained and free requests at once: each constrained output is valid, the free request's text equals
    its solo text (temperature 0) or its own seeded text (temperature 1)."""
    def free():
        return client.completions.create(model=model, prompt="The weather today", max_tokens=20, temperature=temperature,
                                         seed=7, extra_body={"ignore_eos": True}).choices[0].text
    solo = free()
    jobs = {
        "regex": dict(extra_body={"guided_regex": REGEX}),
        "choice": dict(extra_body={"guided_choice": CHOICES}),
        "so_choice": dict(extra_body={"structured_outputs": {"choice": CHOICES}}),
        "grammar": dict(extra_body={"grammar": GBNF}),
        "guided_grammar": dict(extra_body={"guided_grammar": GBNF}),
        "json": dict(extra_body={"guided_json": SCHEMA}),
        "so_json": dict(extra_body={"structured_outputs": {"json": SCHEMA}}),
    }
    results, errors = {}, []

    def run(name, kw):
        try:
            if name == "free":
                results[name] = free()
                return
            r = client.completions.create(model=model, prompt=f"Task {name}:", max_tokens=200,
                                          temperature=temperature, seed=11, **kw)
            results[name] = (r.choices[0].text, r.choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((name, e))
    threads = [threading.Thread(target=run, args=(n, kw)) for n, kw in list(jobs.items()) + [("free", {})]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results.pop("free") == solo
    for name, (text, finish) in results.items():
        assert finish == "stop", (name, text)
        if "regex" in name:
            assert re.fullmatch(REGEX, text), text
        elif "choice" in name:
            assert text in CHOICES, text
        elif "grammar" in name:
            assert re.fullmatch(GBNF_RE, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_schema_is_a_400_through_the_client(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=MSG, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert e.value.status_code == 400
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex" and "unclosed" in e.value.body["message"]
    # the server is still fine afterwards
    r = client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_choice": CHOICES})
    assert r.choices[0].text in CHOICES
