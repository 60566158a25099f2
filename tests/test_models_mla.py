"""DeepSeek-V2 / V3 (multi-head latent attention, engine/models/mla.py) through the full paged engine against HF
transformers (torch CPU, float32), with the checks of tests/test_models.py: full-vocab prompt logprobs under
chunked prefill; 32 greedy tokens alone and in a mixed batch of 8 (batch invariance: every request's text equals
transformers' solo text); prefix-cache hits.

Variants (tests/model_fixtures.py): V2 with a plain q_proj, softmax top-k routing with routed_scaling_factor and shared experts (layer 0
dense via first_k_dense_replace); V2 with q_lora_rank (q_a_proj -> q_a_layernorm -> q_b_proj) and
group_limited_greedy routing; V3 with yarn rope
scaling (mscale / mscale_all_dim: both the cos/sin tables and the softmax scale change), interleaved rope and
sigmoid group-limited routing with a score-correction bias. Router weights are scaled up so no token's top-k is
a near tie. The compressed cache is checked to hold kv_lora + rope floats per token and layer.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.model_compare import check_greedy_matches_transformers, check_logits_match_transformers  # noqa: E402
from tests.model_fixtures import VOCAB, make_model_dir  # noqa: E402

ARCHS = ["deepseek_v2", "deepseek_v2-qlora", "deepseek_v3"]


@pytest.fixture(scope="module", params=ARCHS)
def mla_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model_dir(request.param, str(path))
    return request.param, str(path), hf


def test_mla_logits_match_transformers(mla_model):
    check_logits_match_transformers(*mla_model[1:])


def test_mla_greedy_matches_transformers_alone_and_in_a_batch(mla_model):
    check_greedy_matches_transformers(*mla_model[1:])


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


# ------------------------------------------------------------------------------------------------- GGUF
def write_deepseek2_gguf(hf, path, split_kv_b: bool, mtp: bool = False):
    """The HF model under llama.cpp's deepseek2 tensor names and metadata keys, as convert_hf_to_gguf.py writes
    them: split_kv_b=True is the MLA-aware converter (attn_k_b [H, kv_lora, nope] = per-head kv_b rows
    transposed, attn_v_b [H, v, kv_lora]; key_length = kv_lora + rope, key_length_mla / value_length_mla the
    per-head sizes), False the classic one (attn_kv_b; key_length = qk_nope + qk_rope, value_length = v).
    mtp: one more block (a perturbed copy of the last) counted in block_count as a multi-token-prediction layer
    (nextn_predict_layers 1), which the engine must not run."""
    import gguf
    c = hf.config
    ga = "deepseek2"
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    H, L, nh = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    nope, rope, vd, kvl = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    E = c.n_routed_experts
    w = gguf.GGUFWriter(str(path), ga)
    u32 = lambda k, v: w.add_uint32(f"{ga}.{k}", int(v))  # noqa: E731
    for k, v in (("block_count", L + int(mtp)), ("nextn_predict_layers", int(mtp)), ("context_length", c.max_position_embeddings), ("embedding_length", H),
                 ("feed_forward_length", c.intermediate_size), ("attention.head_count", nh),
                 ("attention.head_count_kv", 1 if split_kv_b else nh), ("attention.kv_lora_rank", kvl),
                 ("rope.dimension_count", rope), ("vocab_size", VOCAB), ("leading_dense_block_count",
                                                                         c.first_k_dense_replace),
                 ("expert_count", E), ("expert_used_count", c.num_experts_per_tok),
                 ("expert_shared_count", c.n_shared_experts), ("expert_feed_forward_length", c.moe_intermediate_size)):
        u32(k, v)
    if c.q_lora_rank:
        u32("attention.q_lora_rank", c.q_lora_rank)
    if split_kv_b:
        u32("attention.key_length", kvl + rope)
        u32("attention.value_length", kvl)
        u32("attention.key_length_mla", nope + rope)
        u32("attention.value_length_mla", vd)
    else:
        u32("attention.key_length", nope + rope)
        u32("attention.value_length", vd)
    w.add_float32(f"{ga}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    w.add_float32(f"{ga}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{ga}.expert_weights_scale", float(c.routed_scaling_factor))
    v3 = c.model_type == "deepseek_v3"
    if v3:
        w.add_bool(f"{ga}.expert_weights_norm", bool(c.norm_topk_prob))
        u32("expert_gating_func", 2)
        u32("expert_group_count", c.n_group)
        u32("expert_group_used_count", c.topk_group)
        rp = c.rope_parameters
        w.add_string(f"{ga}.rope.scaling.type", "yarn")
        w.add_float32(f"{ga}.rope.scaling.factor", float(rp["factor"]))
        u32("rope.scaling.original_context_length", rp["original_max_position_embeddings"])
        w.add_float32(f"{ga}.rope.scaling.yarn_log_multiplier", 0.1 * float(rp["mscale_all_dim"]))
    else:
        u32("expert_gating_func", 1)
        if c.n_group:                    # convert_hf_to_gguf.py copies n_group / topk_group for any model
            u32("expert_group_count", c.n_group)
            u32("expert_group_used_count", c.topk_group)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(1)
    add = lambda n, a: w.add_tensor(n, np.ascontiguousarray(a, np.float32))  # noqa: E731
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    if mtp:
        for k in [k for k in sd if k.startswith(f"model.layers.{L - 1}.")]:
            sd[k.replace(f"layers.{L - 1}.", f"layers.{L}.")] = sd[k] * 1.5 + 0.1
    for i in range(L + int(mtp)):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        if c.q_lora_rank:
            add(b + "attn_q_a.weight", sd[a + "q_a_proj.weight"])
            add(b + "attn_q_a_norm.weight", sd[a + "q_a_layernorm.weight"])
            add(b + "attn_q_b.weight", sd[a + "q_b_proj.weight"])
        else:
            add(b + "attn_q.weight", sd[a + "q_proj.weight"])
        add(b + "attn_kv_a_mqa.weight", sd[a + "kv_a_proj_with_mqa.weight"])
        add(b + "attn_kv_a_norm.weight", sd[a + "kv_a_layernorm.weight"])
        kv_b = sd[a + "kv_b_proj.weight"]
        if split_kv_b:
            kv3 = kv_b.reshape(nh, nope + vd, kvl)
            add(b + "attn_k_b.weight", kv3[:, :nope].transpose(0, 2, 1))
            add(b + "attn_v_b.weight", kv3[:, nope:])
        else:
            add(b + "attn_kv_b.weight", kv_b)
        add(b + "attn_output.weight", sd[a + "o_proj.weight"])
        add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        if m + "gate.weight" not in sd:
            for n in ("gate", "up", "down"):
                add(b + f"ffn_{n}.weight", sd[m + f"{n}_proj.weight"])
            continue
        add(b + "ffn_gate_inp.weight", sd[m + "gate.weight"])
        if m + "gate.e_score_correction_bias" in sd:
            add(b + "exp_probs_b.bias", sd[m + "gate.e_score_correction_bias"])
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        inter = gu.shape[1] // 2
        add(b + "ffn_gate_exps.weight", gu[:, :inter])
        add(b + "ffn_up_exps.weight", gu[:, inter:])
        add(b + "ffn_down_exps.weight", dn)
        for n in ("gate", "up", "down"):
            add(b + f"ffn_{n}_shexp.weight", sd[m + f"shared_experts.{n}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch,split_kv_b", [("deepseek_v2", False), ("deepseek_v2-qlora", True),
                                             ("deepseek_v3-gguf", True)])
def test_mla_gguf_matches_transformers(arch, split_kv_b, tmp_path):
    hf = make_model_dir(arch, str(tmp_path / "hf"))
    # V3: with a multi-token-prediction block counted in block_count (newer converters), not to be run
    path = write_deepseek2_gguf(hf, tmp_path / f"{arch}.gguf", split_kv_b, mtp=arch == "deepseek_v3-gguf")
    check_logits_match_transformers(path, hf)


def test_mla_safetensors_with_mtp_layer_matches_transformers(tmp_path):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers extra layers after num_hidden_layers (the MTP
    module); transformers ignores them and so must the engine (loading, not running them)."""
    import json
    from safetensors.numpy import load_file, save_file
    hf = make_model_dir("deepseek_v3", str(tmp_path))
    st = tmp_path / "model.safetensors"
    sd = load_file(str(st))
    for k in [k for k in sd if k.startswith("model.layers.1.")]:
        sd[k.replace("layers.1.", "layers.2.")] = sd[k] * 1.5 + 0.1
    sd["model.layers.2.eh_proj.weight"] = np.ones((64, 128), np.float32)
    save_file(sd, str(st), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    check_logits_match_transformers(str(tmp_path), hf)


def test_mla_device_auto_stays_on_cpu_and_cuda_is_refused(mla_model, monkeypatch):
    """MLA is CPU-only: --device auto on a GPU host must still load it (on the CPU); an explicit cuda is refused
    naming the setting. A GPU host is simulated by making auto resolve to cuda."""
    import engine.device
    from engine.errors import ModelLoadError
    from engine.loader import load_checkpoint
    from engine.models import build_model
    real = engine.device.resolve_device
    monkeypatch.setattr(engine.device, "resolve_device",
                        lambda s: "cuda" if (s or "auto").strip().lower() in ("auto", "cuda") else real(s))
    ckpt = load_checkpoint(mla_model[1])
    assert build_model(ckpt, device="auto").device == "cpu"
    with pytest.raises(ModelLoadError, match="CPU only"):
        build_model(ckpt, device="cuda")
