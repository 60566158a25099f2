"""Structured outputs (engine/structured_outputs.py + the sampler's masks) on a realistic vocabulary.

The model is a tiny random Llama carrying the embedded SmolLM2's 49152-token tokenizer
(tests/structured_fixtures.py): its outputs are arbitrary, so every check is a property of the output
(json.loads + jsonschema validation, re.fullmatch, choice membership), never a hard-coded text.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured_outputs import (StructuredOutputsParams, allowed_from_bitmask, apply_bitmask,
                                       build_ll_tokenizer, fill_masks)

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "pets", "ok"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,4})?"
CHOICES = ["red", "green", "blue sky", "naïve ☕"]
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]{0,2}'
GBNF_RE = r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2})*\)"


def check_output(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(GBNF_RE, text), text


def constraint(kind: str) -> dict:
    return {"json": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": REGEX},
            "choice": {"choice": CHOICES}, "grammar": {"grammar": GBNF}}[kind]


# ------------------------------------------------------------------------------------------ validation

@pytest.mark.parametrize("value, param, words", [
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json", "no-such-type"),
    ({"json": [1, 2]}, "structured_outputs.json", "must be an object"),
    ({"json": {"type": "string", "pattern": "(x"}}, "structured_outputs.json", "unclosed group"),
    ({"grammar": 'root ::= "a" missing'}, "structured_outputs.grammar", "missing"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", "undefined_rule"),
    ({"choice": []}, "structured_outputs.choice", "empty"),
    ({"choice": ["a", 3]}, "structured_outputs.choice", "choice[1]"),
    ({"regex": "x" * 200_000}, "structured_outputs.regex", "at most"),
    ({}, "structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"jsn": {}}, "structured_outputs.jsn", "unknown"),
])
def test_bad_constraints_name_the_field(value, param, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs=value)
    assert e.value.param == param
    assert words in str(e.value)


def test_source_names_the_request_field_and_good_constraints_compile():
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(regex="[z-a]", source="guided_regex")
    assert e.value.param == "guided_regex"
    for kind in ("json", "json_object", "regex", "choice", "grammar"):
        p = SamplingParams(structured_outputs=constraint(kind))
        assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.kind == kind
        assert p.clone().structured_outputs == p.structured_outputs
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs="json")
    assert e.value.param == "structured_outputs"


def test_deep_and_pathological_constraints_compile_fast_without_crashing():
    """A chain of 3200 Lark rules (under the size cap) overflows an 8 MiB stack inside llguidance's compiler:
    compiles run on a big-stack thread, so this is fine (a crash here takes the test process down). A regex
    whose DFA would be exponential is compiled lazily: quick."""
    import time
    from engine.structured_outputs import MAX_SPEC_CHARS
    n = 3200      # on the main thread's 8 MiB stack this grammar segfaults in llguidance 1.9
    g = "start: a0\n" + "\n".join(f'a{i}: "x" a{i + 1}?' for i in range(n)) + f'\na{n}: "y"'
    assert len(g) <= MAX_SPEC_CHARS
    t0 = time.perf_counter()
    assert StructuredOutputsParams(grammar=g).llg_grammar
    StructuredOutputsParams(regex="(a|b)*a(a|b){40}")
    StructuredOutputsParams(regex="(a|b){1000}{1000}")
    assert time.perf_counter() - t0 < 10
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(grammar=g + "\n" + "r: \"x\"\n" * 2000)
    assert e.value.param == "structured_outputs.grammar" and "at most" in str(e.value)


# ------------------------------------------------------------------------------------------ tokenizer & masks

@pytest.fixture(scope="module")
def gguf_tokenizer():
    from tests.server_fakes import smollm2_tokenizer
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def json_dir_tokenizer(tmp_path_factory):
    from engine.tokenizer import Tokenizer
    from tests.structured_fixtures import write_smollm2_tokenizer
    path = tmp_path_factory.mktemp("smollm2-tokenizer-json")
    write_smollm2_tokenizer(str(path))
    return Tokenizer.from_pretrained_dir(str(path))


@pytest.mark.parametrize("which", ["gguf", "tokenizer_json"])
def test_ll_tokenizer_accepts_our_tokenization(which, gguf_tokenizer, json_dir_tokenizer):
    """The llguidance tokenizer built from ours agrees with it: a valid document encoded by OUR tokenizer is
    consumed token by token, and every token was allowed by the mask just before it (the oracle)."""
    import llguidance as llg
    tok = gguf_tokenizer if which == "gguf" else json_dir_tokenizer
    V = 49152
    lt = build_ll_tokenizer(tok, V, [tok.eos_token_id])
    doc = json.dumps({"name": "Zoë ☕", "age": 42, "pets": ["dog", "fish"], "ok": True}, ensure_ascii=False)
    so = StructuredOutputsParams(json=SCHEMA)
    m = llg.LLMatcher(lt, so.llg_grammar)
    ids = tok.encode(doc, add_special_tokens=False)
    assert len(ids) > 10
    from engine.structured_outputs import GrammarState
    state = GrammarState(m, lt.vocab_size)
    for t in ids:
        allowed = allowed_from_bitmask(fill_masks(None, [state])[0], V)
        assert allowed[t], tok.decode([t])
        assert state.accept(t), state.error
    allowed = allowed_from_bitmask(fill_masks(None, [state])[0], V)
    assert allowed[tok.eos_token_id] and allowed.sum() == 1
    assert lt.decode_str(ids) == doc


def test_apply_bitmask_matches_the_reference(gguf_tokenizer):
    """apply_bitmask (unpackbits) equals llguidance's own numpy reference on random masks and logits."""
    import llguidance.numpy as lln
    rng = np.random.default_rng(0)
    for V in (49152, 1000, 37):
        words = (V + 31) // 32
        mask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        logits = rng.standard_normal((3, V)).astype(np.float32)
        ref = logits.copy()
        lln.apply_token_bitmask_inplace(ref, mask)
        got = logits.copy()
        for i in range(3):
            apply_bitmask(got[i], mask[i])
        np.testing.assert_array_equal(got, ref)


# ------------------------------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.structured_fixtures import make_constrained_model_dir
    return make_constrained_model_dir(str(tmp_path_factory.mktemp("constrained-llama")))


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine.llm import LLM
    m = LLM(model_dir, num_blocks=512, block_size=16, max_num_batched_tokens=256)
    yield m
    m.engine.close()


@pytest.fixture(scope="module")
def llm_jf(model_dir):
    from engine.llm import LLM
    m = LLM(model_dir, num_blocks=512, block_size=16, max_num_batched_tokens=256, enable_jump_forward=True)
    yield m
    m.engine.close()


KINDS = ["json", "json_object", "regex", "choice", "grammar"]
FREE_PROMPT = "Once upon a time"


def _mixed_batch(llm, temperature: float, seed0: int):
    prompts, params, kinds = [], [], []
    for i, kind in enumerate(KINDS):
        prompts.append(f"Answer number {i}:")
        params.append(SamplingParams(max_tokens=160, temperature=temperature, seed=seed0 + i,
                                     structured_outputs=constraint(kind)))
        kinds.append(kind)
        if i % 2 == 0:   # free requests interleaved with the constrained ones
            prompts.append(FREE_PROMPT)
            params.append(SamplingParams(max_tokens=24, temperature=temperature, seed=seed0 + 100, ignore_eos=True))
            kinds.append(None)
    return prompts, params, kinds, llm.generate(prompts, params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_are_valid_in_a_mixed_batch(llm, temperature):
    prompts, params, kinds, outs = _mixed_batch(llm, temperature, seed0=11)
    solo = llm.generate([FREE_PROMPT], SamplingParams(max_tokens=24, temperature=temperature, seed=111,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    seen = 0
    for kind, out in zip(kinds, outs):
        c = out.outputs[0]
        if kind is None:
            assert c.token_ids == solo, "a free request in a constrained batch must get its solo tokens"
            continue
        if kind == "json_object" and c.finish_reason == "length":
            # "any object" is unbounded (a random model can stay inside one string forever): then the text is
            # a prefix that a fresh matcher of the same constraint accepts token by token
            assert c.text.startswith("{") and _accepted_by_fresh_matcher(llm, constraint(kind), c.token_ids)
            continue
        assert c.finish_reason == "stop", (kind, c.text)
        check_output(kind, c.text)
        seen += 1
    assert seen >= len(KINDS) - 1


def _accepted_by_fresh_matcher(llm, value: dict, token_ids) -> bool:
    so = StructuredOutputsParams.from_value(value)
    state = llm.engine.grammar_compiler.matcher(so)
    return all(state.accept(t) for t in token_ids)


def test_sampled_outputs_vary_and_stay_valid(llm):
    """At temperature 1 with different seeds the choices differ (the mask is not a fixed answer)."""
    outs = llm.generate(["Pick:"] * 12, [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                         structured_outputs={"choice": CHOICES}) for s in range(12)])
    texts = [o.outputs[0].text for o in outs]
    for t in texts:
        check_output("choice", t)
    assert len(set(texts)) > 1


def test_n_sequences_each_have_their_own_grammar(llm):
    out = llm.generate(["Code:"], SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=5,
                                                 structured_outputs={"regex": REGEX}))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        check_output("regex", c.text)
        assert c.finish_reason == "stop"


def test_unconstrained_batch_never_computes_masks(llm, monkeypatch):
    import engine.structured_outputs as so

    def boom(*a, **k):
        raise AssertionError("masks computed for an unconstrained batch")
    monkeypatch.setattr(so, "fill_masks", boom)
    out = llm.generate(["a", "b"], SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 4 or o.outputs[0].finish_reason == "stop" for o in out)


def test_jump_forward_appends_forced_tokens_without_a_step_each(llm_jf, llm):
    """A schema with long fixed keys: with jump-forward the engine takes fewer steps than it emits tokens,
    and the output stays valid."""
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                               "another_quite_long_property_name": {"enum": ["x", "y"]}},
              "required": ["a_rather_long_property_name", "another_quite_long_property_name"],
              "additionalProperties": False}
    for m, jf in ((llm_jf, True), (llm, False)):
        eng = m.engine
        p = SamplingParams(max_tokens=100, temperature=0, structured_outputs={"json": schema, "disable_any_whitespace": True})
        eng.add_request("jf", "JSON:", p)
        steps, final = 0, None
        while eng.has_unfinished_requests():
            steps += 1
            for o in eng.step():
                if o.finished:
                    final = o
        c = final.outputs[0]
        obj = json.loads(c.text)
        jsonschema.validate(obj, schema)
        assert c.finish_reason == "stop"
        if jf:
            assert steps < len(c.token_ids) / 2, (steps, len(c.token_ids))
        else:
            assert steps >= len(c.token_ids)


def test_bad_tokenizer_or_impossible_request_is_an_error_not_a_crash(llm):
    """allowed_token_ids that exclude everything the grammar allows: the request fails alone, by name."""
    tok = llm.tokenizer
    bad = tok.encode("zzz", add_special_tokens=False)[:1]
    outs = llm.generate(["x", "y"], [SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=bad,
                                                     structured_outputs={"choice": ["red"]}),
                                     SamplingParams(max_tokens=5, temperature=0)])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason in ("length", "stop")


def test_prefetched_masks_give_the_same_tokens_as_masks_computed_in_the_step(llm):
    """The next mask is computed in the background while the forward pass runs; turning that off must not
    change a single token (greedy and seeded sampling, several constrained requests at once)."""
    def run():
        return [o.outputs[0].token_ids for o in llm.generate(
            [f"Q{i}:" for i in range(4)],
            [SamplingParams(max_tokens=120, temperature=t, seed=21, structured_outputs=constraint(k))
             for t, k in ((0.0, "json"), (1.0, "json"), (1.0, "grammar"), (0.0, "regex"))])]
    llm.engine.sampler.prefetch_masks = True
    try:
        with_prefetch = run()
    finally:
        llm.engine.sampler.prefetch_masks = False
    without = run()
    assert with_prefetch == without
    assert all(len(t) > 3 for t in with_prefetch)


@pytest.mark.slow
def test_embedded_smollm2_gguf_follows_schema_regex_and_choice():
    """The real embedded model (GGUF vocabulary, Q4_1 weights) under each kind of constraint, greedy and
    sampled, with a free request alongside that must keep its solo text."""
    from engine.llm import LLM
    llm = LLM(None, num_blocks=256, block_size=16, max_num_seqs=8)
    try:
        tok = llm.tokenizer
        chat = tok.render_chat([{"role": "user", "content": "Describe a person as JSON."}], add_generation_prompt=True)
        free = SamplingParams(max_tokens=16, temperature=0)
        solo = llm.generate([chat], free)[0].outputs[0].token_ids
        outs = llm.generate([chat, chat, "Code:", "The sky is", chat], [
            SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json": SCHEMA}),
            SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured_outputs={"json": SCHEMA}),
            SamplingParams(max_tokens=40, temperature=0.8, seed=2, structured_outputs={"regex": REGEX}),
            SamplingParams(max_tokens=20, temperature=0, structured_outputs={"choice": CHOICES}),
            free])
        for kind, o in zip(("json", "json", "regex", "choice"), outs):
            assert o.outputs[0].finish_reason == "stop", (kind, o.outputs[0].text)
            check_output(kind, o.outputs[0].text)
        assert outs[4].outputs[0].token_ids == solo
    finally:
        llm.engine.close()
