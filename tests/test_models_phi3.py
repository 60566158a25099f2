"""Phi-3 (fused qkv_proj / gate_up_proj, LongRoPE over a partial rotary) against HF transformers, from
safetensors and from a llama.cpp-style GGUF (tests/gguf_export.py: attn_qkv, ffn_up with 2 x intermediate
rows, rope_factors_long/short tensors, phi3.rope.scaling.attn_factor / original_context_length).

transformers picks LongRoPE's factors per forward call: short while the longest position is within the
pretrained context (128 here), long past it. The engine picks one set for every sequence from its context
limit (as vLLM and llama.cpp do, so cached keys never mix the sets). Both regimes are compared where
transformers is consistent with that: max_model_len 128 with sequences that stay within 128 tokens (short
factors), and the default limit (512) with prompts longer than 128 tokens (long factors from the first
token on, in transformers' one-shot prefill and in every decode step).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.llm import LLM  # noqa: E402
from tests.gguf_export import write_gguf  # noqa: E402
from tests.model_compare import (FLOAT_TOL, greedy, hf_greedy, hf_logprobs, prompt_logprobs,  # noqa: E402
                                 random_prompts, solo_and_batch)
from tests.model_fixtures import make_model_dir  # noqa: E402

ORIG = 128


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    hf = make_model_dir("phi3", str(d / "hf"))
    gguf_path = write_gguf(hf, str(d / "model.gguf"))
    return hf, {"safetensors": str(d / "hf"), "gguf": gguf_path}


def _run(path, max_model_len, logit_prompt, prompts):
    llm = LLM(path, num_blocks=96, block_size=16, max_num_batched_tokens=48, max_logprobs=-1,
              max_model_len=max_model_len)
    try:
        got = prompt_logprobs(llm, logit_prompt)
        solo, batch = solo_and_batch(llm, prompts, 32)
    finally:
        llm.close()
    return got, solo, batch


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("regime", ["short", "long"])
def test_phi3_longrope_matches_transformers(phi3, fmt, regime):
    hf, paths = phi3
    if regime == "short":        # every sequence within the pretrained context: short factors
        max_model_len, logit_prompt = ORIG, random_prompts(1, seed=1, lo=60, hi=90)[0]
        prompts = random_prompts(4, seed=2, lo=3, hi=60)
        assert max(map(len, prompts)) + 32 <= ORIG
    else:                        # prompts past the pretrained context: long factors throughout
        max_model_len, logit_prompt = None, random_prompts(1, seed=3, lo=140, hi=170)[0]
        prompts = random_prompts(4, seed=4, lo=ORIG + 1, hi=170)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    got, solo, batch = _run(paths[fmt], max_model_len, logit_prompt, prompts)
    np.testing.assert_allclose(got, hf_logprobs(hf, logit_prompt)[:-1], **FLOAT_TOL)
    assert solo == want[0]
    assert batch == want


def test_phi3_factor_sets_differ(phi3):
    # the test above can fail: the long factors change transformers' logits for a prompt past 128 tokens
    hf, _ = phi3
    prompt = random_prompts(1, seed=3, lo=140, hi=170)[0]
    ref = hf_logprobs(hf, prompt)[:-1]
    rp = hf.config.rope_parameters
    saved = rp["long_factor"]
    try:
        rp["long_factor"] = rp["short_factor"]
        hf.model.rotary_emb.long_inv_freq = None
        other = hf_logprobs(hf, prompt)[:-1]
    finally:
        rp["long_factor"] = saved
        hf.model.rotary_emb.long_inv_freq = None
    assert np.abs(ref - other).max() > 1e-2


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("regime", ["short", "long"])
def test_phi3_longrope_on_a_device(phi3, backend, regime, monkeypatch):
    """The LongRoPE pick (set_max_model_len, after the weights went to the device: the short set is uploaded
    then) on device arrays (`fake`: host memory with CPU kernels, tests/fake_cuda.py)."""
    hf, paths = phi3
    if backend == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    prompts = (random_prompts(3, seed=2, lo=3, hi=60) if regime == "short" else
               random_prompts(3, seed=4, lo=ORIG + 1, hi=170))
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(paths["safetensors"], device="cuda", num_blocks=96, block_size=16, max_num_batched_tokens=64,
              max_model_len=ORIG if regime == "short" else None)
    try:
        assert greedy(llm, prompts, 12) == want
    finally:
        llm.close()
