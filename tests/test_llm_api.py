"""vLLM's LLM API habits: prompt forms, chat over lists of conversations, get_tokenizer, constructor arguments,
generation_config.json defaults; beam search against transformers' beam search on a tiny random model."""
import json
import logging
import math

import pytest

from engine.beam_search import BeamSearchParams, beam_search_score
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-api", seed=11)


@pytest.fixture(scope="module")
def llm(tiny):
    m = LLM(tiny[0], num_blocks=256, block_size=16, max_num_batched_tokens=256, max_logprobs=-1)
    yield m
    m.close()


P1 = [5, 17, 33, 2, 9, 100, 44]
P2 = [7, 8, 9, 10, 11]


def _greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_generate_accepts_vllm_prompt_forms(llm):
    ref = [o.outputs[0].token_ids for o in llm.generate([P1, P2], _greedy())]
    text = "t5 t17 t33"
    ref_text = llm.generate(text, _greedy())[0].outputs[0].token_ids
    one = llm.generate({"prompt_token_ids": P1}, _greedy())
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref[0]
    mixed = llm.generate([{"prompt_token_ids": P2}, {"prompt": text}, P1, text], _greedy())
    assert [o.outputs[0].token_ids for o in mixed] == [ref[1], ref_text, ref[0], ref_text]
    assert mixed[1].prompt == text
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "x"}, _greedy())


def test_chat_takes_one_or_many_conversations(llm):
    conv1 = [{"role": "user", "content": "t5 t6 t7"}]
    conv2 = [{"role": "user", "content": "t9 t10"}]
    one = llm.chat(conv1, _greedy())
    assert isinstance(one, list) and len(one) == 1
    many = llm.chat([conv1, conv2], _greedy())
    assert len(many) == 2
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    ids2 = llm.get_tokenizer().encode_chat(conv2, add_generation_prompt=True)
    assert many[1].prompt_token_ids == ids2
    assert llm.get_tokenizer() is llm.tokenizer


def test_constructor_arguments(tiny, caplog):
    path = tiny[0]
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(path, tensor_parallel_size=2, num_blocks=16)
    with pytest.raises(ValueError, match="quantization"):
        LLM(path, quantization="awq", num_blocks=16)
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int3", num_blocks=16)
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(path, no_such_argument=1, num_blocks=16)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 1.5"):
        LLM(path, gpu_memory_utilization=1.5, num_blocks=16)
    with caplog.at_level(logging.INFO, logger="engine"):
        m = LLM(path, dtype="bfloat16", tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=64,
                seed=3, enforce_eager=True, trust_remote_code=True, tokenizer=path, num_blocks=32)
    try:
        assert "trust_remote_code" in caplog.text
        assert m.engine.args.gpu_memory_utilization == 0.5          # mapped (it sizes the KV cache on CUDA)
        assert m.engine.max_model_len == 64
        assert m.engine.args.seed == 3
        assert m.engine.args.use_graphs is False and m.engine.runner.use_graphs is False
        out = m.generate([P1], _greedy(4))[0]
        assert m.engine.runner.num_graphs == 0 and len(out.outputs[0].token_ids) == 4
    finally:
        m.close()


def test_generation_config_defaults(tiny, tmp_path):
    import shutil
    src = tiny[0]
    d = tmp_path / "with-gencfg"
    shutil.copytree(src, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7, "top_p": 0.5,
                                                          "repetition_penalty": 1.3, "max_new_tokens": 5,
                                                          "do_sample": True}))
    m = LLM(str(d), num_blocks=64)
    try:
        sp = m.get_default_sampling_params()
        assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_tokens) == (0.0, 7, 0.5, 1.3, 5)
        out = m.generate([P1])[0].outputs[0]          # unset params: generation_config's (greedy, 5 tokens)
        assert len(out.token_ids) <= 5
        ref = m.generate([P1], SamplingParams(temperature=0, top_k=7, top_p=0.5, repetition_penalty=1.3,
                                               max_tokens=5))[0].outputs[0]
        assert out.token_ids == ref.token_ids
    finally:
        m.close()
    m = LLM(str(d), num_blocks=64, generation_config="vllm")
    try:
        sp = m.get_default_sampling_params()
        assert (sp.temperature, sp.top_k, sp.max_tokens) == (1.0, 0, 16)
    finally:
        m.close()


# ------------------------------------------------------------------------------------------ beam search

def _hf_beam(hf, prompt, beams, max_new, length_penalty):
    import torch
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), num_beams=beams, num_return_sequences=beams, do_sample=False,
                        max_new_tokens=max_new, min_new_tokens=max_new, early_stopping=True, eos_token_id=None,
                        pad_token_id=0, length_penalty=length_penalty, output_scores=True,
                        return_dict_in_generate=True)
    return [s[len(prompt):].tolist() for s in g.sequences], g.sequences_scores.tolist()


@pytest.mark.parametrize("beams,max_new,lp", [(2, 5, 1.0), (4, 6, 0.0), (3, 4, 2.0)])
def test_beam_search_matches_transformers(llm, tiny, beams, max_new, lp):
    """ignore_eos and fixed-length beams: the case where vLLM's and transformers' beam searches agree (see
    engine/beam_search.py for where they differ). transformers' score = sum logprobs / new_tokens ** lp."""
    _, hf = tiny
    hf.generation_config.eos_token_id = None
    for prompt in (P1, P2):
        ref_seqs, ref_scores = _hf_beam(hf, prompt, beams, max_new, lp)
        out = llm.beam_search([{"prompt_token_ids": prompt}],
                              BeamSearchParams(beam_width=beams, max_tokens=max_new, ignore_eos=True,
                                               length_penalty=lp))[0]
        got = [s.tokens[len(prompt):] for s in out.sequences]
        assert got[0] == ref_seqs[0]
        assert got == ref_seqs                      # all beams, same order
        for s, ref in zip(out.sequences, ref_scores):
            assert abs(s.cum_logprob - ref * max_new ** lp) < 2e-3
            assert s.tokens[:len(prompt)] == prompt and len(s.logprobs) == max_new


def test_beam_width_one_is_greedy(llm):
    greedy = llm.generate([P1], _greedy(6))[0].outputs[0]
    out = llm.beam_search([P1], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0].sequences[0]
    assert out.tokens[len(P1):] == greedy.token_ids


def test_beam_search_eos_and_length_penalty(llm):
    eos = set(llm.engine.stop_ids)
    assert eos
    out = llm.beam_search([P2], BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=0.5))[0]
    assert len(out.sequences) == 4
    scores = [beam_search_score(s.tokens, s.cum_logprob, eos, 0.5) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for s in out.sequences:
        gen = s.tokens[len(P2):]
        assert not any(t in eos for t in gen[:-1])     # a beam ends at its first EOS
        assert s.finish_reason == ("stop" if gen[-1] in eos else "length")
        assert math.isclose(s.cum_logprob, sum(d[t].logprob for d, t in zip(s.logprobs, gen)), abs_tol=1e-5)
    # the score formula: vLLM counts the prompt and drops a final EOS
    assert beam_search_score([1, 2, 3, 9], -2.0, {9}, 1.0) == pytest.approx(-2.0 / 3)
    assert beam_search_score([1, 2, 3, 4], -2.0, {9}, 2.0) == pytest.approx(-2.0 / 16)


def test_beam_search_params_validate():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=float("nan"))


def test_a_closed_llm_says_so(tiny):
    from engine import LLMClosedError
    m = LLM(tiny[0], num_blocks=64, block_size=16, max_num_batched_tokens=256)
    assert not m.closed and m.llm_engine is m.engine
    ref = m.generate([P1], _greedy(2))[0].outputs[0].token_ids
    assert len(ref) == 2
    m.close()
    m.close()          # twice is harmless
    assert m.closed
    calls = {
        "generate": lambda: m.generate([P1], _greedy(2)),
        "chat": lambda: m.chat([{"role": "user", "content": "t5"}], _greedy(2)),
        "stream": lambda: list(m.stream("t5 t6", _greedy(2))),
        "beam_search": lambda: m.beam_search(["t5"], BeamSearchParams(beam_width=2, max_tokens=2)),
        "embed": lambda: m.embed(["t5"]),
        "get_tokenizer": m.get_tokenizer,
        "get_default_sampling_params": m.get_default_sampling_params,
    }
    for name, call in calls.items():
        with pytest.raises(LLMClosedError) as info:
            call()
        assert isinstance(info.value, RuntimeError), name
        assert str(info.value) == "this LLM was closed (llm.close()); create a new one", name
    # A `with` block closes it too.
    with LLM(tiny[0], num_blocks=64, block_size=16, max_num_batched_tokens=256) as m2:
        assert m2.generate([P1], _greedy(2))[0].outputs[0].token_ids == ref
    with pytest.raises(LLMClosedError):
        m2.generate([P1], _greedy(2))
