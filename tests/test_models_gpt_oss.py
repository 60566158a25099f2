"""gpt-oss (attention sinks, alternating sliding window, biased q/k/v/o, YaRN rope without truncation, MoE
with a biased router, softmax over the top-k logits, interleaved gate/up experts with biases and the clamped
SwiGLU) against HF transformers on a tiny random model with float experts: full-vocab logprobs (chunked
prefill) and 32 greedy tokens alone and in a batch. Sinks and biases are drawn large enough to matter."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.model_fixtures import VOCAB, _tokenizer_json  # noqa: E402
from tests.test_models import _hf_greedy, _prompts  # noqa: E402


def _config():
    return tf.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=24, max_position_embeddings=512,
                           tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=0,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 128,
                                            "rope_theta": 150000.0})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)          # sinks from well below to above the logits
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.3)          # expert activations reach the SwiGLU clamp
    hf.eval()
    hf.save_pretrained(path, safe_serialization=True)
    _tokenizer_json(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt_oss"
    return path, hf


def test_gpt_oss_matches_transformers(gpt_oss):
    path, hf = gpt_oss
    prompt = _prompts(1, seed=1)[0] + list(range(5, 35))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    prompts = _prompts(6, seed=2)
    want = [_hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=16, max_logprobs=-1)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1,
                                                    detokenize=False))[0]
        sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
        solo = llm.generate([prompts[0]], sp)[0].outputs[0].token_ids
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    finally:
        llm.close()
    plp = out.prompt_logprobs
    got = np.array([[plp[i][t].logprob for t in range(VOCAB)] for i in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref[:-1], atol=2e-4, rtol=1e-4)
    assert solo == want[0]
    assert batch == want


def test_gpt_oss_sinks_matter(gpt_oss):
    # the comparison above can fail: without the sinks transformers' logits move by far more than its tolerance
    path, hf = gpt_oss
    prompt = _prompts(1, seed=1)[0] + list(range(5, 35))
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
    prompts = _prompts(4, seed=7)
    want = [_hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(path, device="cuda", num_blocks=64, block_size=16, max_num_batched_tokens=64)
    try:
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
        assert llm.generate([prompts[0]], sp)[0].outputs[0].token_ids == want[0]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    finally:
        llm.close()
