"""Every architecture through the full paged engine against HF transformers (torch CPU, float32).

- logits: the engine's prompt logprobs (full vocabulary) equal log_softmax of transformers' logits;
- greedy: 32 tokens identical to transformers' greedy generate, alone and inside a mixed batch of 8
  requests of different lengths;
- prefix-cache hits give the same tokens as misses; preemption under a tiny pool loses nothing.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.model_fixtures import make_model_dir  # noqa: E402

ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", "gemma2", "granite", "olmo2"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model_dir(request.param, str(path))
    return request.param, str(path), hf


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def _prompts(k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, int(rng.integers(3, 40))).tolist() for _ in range(k)]


def test_logits_match_transformers(model):
    arch, path, hf = model
    prompt = _prompts(1, seed=1)[0] + list(range(5, 35))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=16, max_logprobs=-1)  # chunked prefill
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1,
                                                    detokenize=False))[0]
    finally:
        llm.close()
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    got = np.array([[plp[i][t].logprob for t in range(256)] for i in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref[:-1], atol=2e-4, rtol=1e-4)


def test_greedy_matches_transformers_alone_and_in_a_batch(model):
    arch, path, hf = model
    prompts = _prompts(8, seed=2)
    want = [_hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=64)
    try:
        sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
        solo = llm.generate([prompts[0]], sp)[0].outputs[0].token_ids
        assert solo == want[0]
        batch = llm.generate(prompts, sp)
        for o, w in zip(batch, want):
            assert o.outputs[0].token_ids == w
        # prefix caching: the same prompts again hit the cache and give the same tokens
        before = llm.engine.kv.stats.hits
        again = llm.generate(prompts, sp)
        assert llm.engine.kv.stats.hits > before
        assert [o.outputs[0].token_ids for o in again] == want
    finally:
        llm.close()


def test_preemption_under_a_tiny_pool_loses_nothing(tmp_path):
    path = str(tmp_path)
    hf = make_model_dir("llama", path)
    prompts = _prompts(6, seed=3)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    want = [_hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(path, num_blocks=10, block_size=8, max_num_batched_tokens=64, max_model_len=72)
    try:
        outs = llm.generate(prompts, sp)
        assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to run dry"
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == want
