"""Every architecture through the full paged engine against HF transformers (torch CPU, float32).

- logits: the engine's prompt logprobs (full vocabulary) equal log_softmax of transformers' logits;
- greedy: 32 tokens identical to transformers' greedy generate, alone and inside a mixed batch of 8
  requests of different lengths;
- prefix-cache hits give the same tokens as misses; preemption under a tiny pool loses nothing.
"""
import pytest

torch = pytest.importorskip("torch")

from engine.llm import LLM  # noqa: E402
from tests.model_compare import (  # noqa: E402
    check_greedy_matches_transformers,
    check_logits_match_transformers,
    greedy,
    hf_greedy,
    random_prompts,
)
from tests.model_fixtures import make_model_dir  # noqa: E402

ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", "gemma2", "granite", "olmo2"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model_dir(request.param, str(path))
    return request.param, str(path), hf


def test_logits_match_transformers(model):
    arch, path, hf = model
    check_logits_match_transformers(path, hf)


def test_greedy_matches_transformers_alone_and_in_a_batch(model):
    arch, path, hf = model
    check_greedy_matches_transformers(path, hf)


def test_preemption_under_a_tiny_pool_loses_nothing(tmp_path):
    path = str(tmp_path)
    hf = make_model_dir("llama", path)
    prompts = random_prompts(6, seed=3)
    want = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(path, num_blocks=10, block_size=8, max_num_batched_tokens=64, max_model_len=72)
    try:
        outs = greedy(llm, prompts, 24)
        assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to run dry"
    finally:
        llm.close()
    assert outs == want
