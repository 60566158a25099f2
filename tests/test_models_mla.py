"""DeepSeek-V2 / V3 (multi-head latent attention, engine/models/mla.py) through the full paged engine against HF
transformers (torch CPU, float32), with the checks of tests/test_models.py: full-vocab prompt logprobs under
chunked prefill; 32 greedy tokens alone and in a mixed batch of 8 (batch invariance: every request's text equals
transformers' solo text); prefix-cache hits.

Variants: V2 with a plain q_proj, softmax top-k routing with routed_scaling_factor and shared experts (layer 0
dense via first_k_dense_replace); V2 with q_lora_rank (q_a_proj -> q_a_layernorm -> q_b_proj); V3 with yarn rope
scaling (mscale / mscale_all_dim: both the cos/sin tables and the softmax scale change), interleaved rope and
sigmoid group-limited routing with a score-correction bias. Router weights are scaled up so no token's top-k is
a near tie. The compressed cache is checked to hold kv_lora + rope floats per token and layer.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import test_models as tm  # noqa: E402
from tests.model_fixtures import VOCAB, _tokenizer_json  # noqa: E402

ARCHS = ["deepseek_v2", "deepseek_v2-qlora", "deepseek_v3"]


def make_mla_config(arch: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, moe_intermediate_size=32,
                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=24, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, initializer_range=0.05)
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(**common, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                   routed_scaling_factor=1.5)
    if arch == "deepseek_v2-qlora":
        return tf.DeepseekV2Config(**{**common, "first_k_dense_replace": 2}, q_lora_rank=20, n_routed_experts=4,
                                   num_experts_per_tok=2)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(**common, q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                   topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 128, "mscale": 0.8,
                                                    "mscale_all_dim": 1.2, "beta_fast": 32, "beta_slow": 1})
    raise ValueError(arch)


def make_mla_model_dir(arch: str, path: str, seed: int = 0):
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(make_mla_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(60.0)                                  # clear routing margins
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)        # the bias changes which experts win
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer_json(path)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def mla_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_mla_model_dir(request.param, str(path))
    return request.param, str(path), hf


def test_mla_logits_match_transformers(mla_model):
    tm.test_logits_match_transformers(mla_model)


def test_mla_greedy_matches_transformers_alone_and_in_a_batch(mla_model):
    tm.test_greedy_matches_transformers_alone_and_in_a_batch(mla_model)


def test_mla_cache_is_compressed(mla_model):
    from engine.llm import LLM
    arch, path, hf = mla_model
    llm = LLM(path, num_blocks=8, block_size=16)
    try:
        m = llm.engine.model
        assert len(m.k_caches) == 2 and m.v_caches is m.k_caches
        assert m.k_caches[0].shape == (8, 16, 1, 24 + 8)          # kv_lora_rank + qk_rope_head_dim per token
    finally:
        llm.close()
