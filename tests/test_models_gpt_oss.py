"""gpt-oss (attention sinks, alternating sliding window, biased q/k/v/o, YaRN rope without truncation, MoE
with a biased router, softmax over the top-k logits, interleaved gate/up experts with biases and the clamped
SwiGLU) against HF transformers on a tiny random model with float experts: full-vocab logprobs (chunked
prefill) and 32 greedy tokens alone and in a batch. Sinks and biases are drawn large enough to matter
(tests/model_fixtures.py)."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.model_compare import (check_device_greedy_matches_transformers,  # noqa: E402
                                 check_logits_and_greedy_match_transformers, logit_prompt, random_prompts)
from tests.model_fixtures import make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    hf = make_model_dir("gpt_oss", path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt_oss"
    return path, hf


def test_gpt_oss_matches_transformers(gpt_oss):
    check_logits_and_greedy_match_transformers(*gpt_oss, n_prompts=6)


def test_gpt_oss_sinks_matter(gpt_oss):
    # the comparison above can fail: without the sinks transformers' logits move by far more than its tolerance
    path, hf = gpt_oss
    prompt = logit_prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
        saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        try:
            for layer in hf.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
            other = hf(torch.tensor([prompt])).logits[0].numpy()
        finally:
            for layer, s in zip(hf.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert np.abs(ref - other).max() > 1e-2


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpt_oss_on_a_device_matches_transformers(gpt_oss, backend, monkeypatch):
    """device="cuda": sinks, expert biases and the rest on device arrays (`fake`: that plumbing on host
    memory with CPU kernels, tests/fake_cuda.py)."""
    path, hf = gpt_oss
    if backend == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    check_device_greedy_matches_transformers(path, hf, random_prompts(4, seed=7))
