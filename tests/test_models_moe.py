"""Mixture-of-experts architectures through the full paged engine against HF transformers (torch CPU, float32),
with the same checks as tests/test_models.py (full-vocab prompt logprobs; 32 greedy tokens alone and in a
mixed batch of 8; prefix-cache hits): Mixtral (renormalised top-2), Qwen2-MoE (softmax top-k without
renormalisation, a sigmoid-gated shared expert, one dense layer via mlp_only_layers), Qwen3-MoE
(norm_topk_prob, per-head q/k norms), OLMoE (full-width q/k norms). The same weights written to GGUF with
llama.cpp's tensor names and metadata keys load and match too; GGUF Q8_0 experts match their dequantised
F32 twin and stay batch invariant.

Router weights are scaled up (tests/model_fixtures.py) so that no token's top-k choice is a near tie (HF and the engine compute the
router logits in a different order; a tie could pick different experts)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.llm import LLM  # noqa: E402
from tests.model_compare import (check_device_greedy_matches_transformers,  # noqa: E402
                                 check_greedy_matches_transformers, check_logits_match_transformers,
                                 engine_prompt_logprobs, greedy, logit_prompt, random_prompts)
from tests.model_fixtures import MOE_ARCHS, VOCAB, make_model_dir  # noqa: E402

ARCHS = list(MOE_ARCHS)


@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model_dir(request.param, str(path))
    return request.param, str(path), hf


def test_moe_logits_match_transformers(moe_model):
    check_logits_match_transformers(*moe_model[1:])


def test_moe_greedy_matches_transformers_alone_and_in_a_batch(moe_model):
    check_greedy_matches_transformers(*moe_model[1:])


# ------------------------------------------------------------------------------------------------- GGUF
_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def _permute(w, n_heads):
    """llama.cpp's converter permutation of Q/K rows for arch "llama" (HF halves -> adjacent rope pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(arch, hf, path, expert_qtype=None, replace=None):
    """The HF model's weights under llama.cpp's GGUF names and metadata keys (what convert_hf_to_gguf.py writes
    for these architectures); experts stacked into ffn_*_exps. expert_qtype: quantise the expert tensors."""
    import gguf
    cfg = hf.config
    ga = _GGUF_ARCH[arch]
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w = gguf.GGUFWriter(str(path), ga)
    w.add_uint32(f"{ga}.block_count", L)
    w.add_uint32(f"{ga}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{ga}.embedding_length", H)
    w.add_uint32(f"{ga}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{ga}.attention.head_count", nh)
    w.add_uint32(f"{ga}.attention.head_count_kv", nkv)
    hd = getattr(cfg, "head_dim", None) or H // nh
    w.add_uint32(f"{ga}.attention.key_length", hd)
    w.add_uint32(f"{ga}.attention.value_length", hd)
    w.add_float32(f"{ga}.rope.freq_base", float(cfg.rope_parameters["rope_theta"] if getattr(
        cfg, "rope_parameters", None) else cfg.rope_theta))
    w.add_float32(f"{ga}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{ga}.vocab_size", VOCAB)
    w.add_uint32(f"{ga}.expert_count", E)
    w.add_uint32(f"{ga}.expert_used_count", cfg.num_experts_per_tok)
    if arch in ("qwen2_moe", "qwen3_moe"):
        w.add_uint32(f"{ga}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        w.add_uint32(f"{ga}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    if arch == "qwen3_moe":
        w.add_bool(f"{ga}.expert_weights_norm", bool(cfg.norm_topk_prob))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    toks = ["a", "b", "ab"] + [f"t{i}" for i in range(3, VOCAB)]     # ids only matter here
    w.add_token_list(toks)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(1)

    def add(name, arr, quant=False):
        arr = np.ascontiguousarray((replace or {}).get(name, arr), np.float32)
        if quant and expert_qtype is not None:
            q = gguf.quants.quantize(arr, expert_qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=expert_qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if ga == "llama":
            q, k = _permute(q, nh), _permute(k, nkv)
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for b in ("q", "k", "v"):
            if p + f"self_attn.{b}_proj.bias" in sd:
                add(f"blk.{i}.attn_{b}.bias", sd[p + f"self_attn.{b}_proj.bias"])
        for n in ("q_norm", "k_norm"):
            if p + f"self_attn.{n}.weight" in sd:
                add(f"blk.{i}.attn_{n}.weight", sd[p + f"self_attn.{n}.weight"])
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if p + "block_sparse_moe.gate.weight" in sd:           # transformers < 5 module names
            pre, (g, u, d) = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            pre, (g, u, d) = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        if pre + "gate.weight" not in sd:                        # a dense layer (mlp_only_layers)
            for n, hn in (("gate", g), ("up", u), ("down", d)):
                add(f"blk.{i}.ffn_{n}.weight", sd[pre + hn + ".weight"])
            continue
        add(f"blk.{i}.ffn_gate_inp.weight", sd[pre + "gate.weight"])
        if pre + "experts.0." + g + ".weight" in sd:
            for n, hn in (("gate", g), ("up", u), ("down", d)):
                add(f"blk.{i}.ffn_{n}_exps.weight",
                    np.stack([sd[pre + f"experts.{e}.{hn}.weight"] for e in range(E)]), quant=True)
        else:                                                     # transformers' fused 3-D expert tensors
            gu, dn = sd[pre + "experts.gate_up_proj"], sd[pre + "experts.down_proj"]
            I = gu.shape[1] // 2
            add(f"blk.{i}.ffn_gate_exps.weight", gu[:, :I], quant=True)
            add(f"blk.{i}.ffn_up_exps.weight", gu[:, I:], quant=True)
            add(f"blk.{i}.ffn_down_exps.weight", dn, quant=True)
        if pre + "shared_expert.gate_proj.weight" in sd:
            for n in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{n}_shexp.weight", sd[pre + f"shared_expert.{n}_proj.weight"])
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[pre + "shared_expert_gate.weight"].reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_moe_gguf_matches_transformers(moe_model, tmp_path):
    arch, _, hf = moe_model
    path = write_moe_gguf(arch, hf, tmp_path / f"{arch}.gguf")
    check_logits_match_transformers(path, hf)


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_moe_gguf_q8_0_experts(arch, tmp_path):
    """Q8_0 experts (the quantised matmul kernels per expert segment) against the same GGUF with the experts
    dequantised to F32 by the gguf package, and greedy tokens alone vs in a batch (batch invariance)."""
    import gguf
    from gguf.quants import dequantize
    hf = make_model_dir(arch, str(tmp_path / "hf"))
    qpath = write_moe_gguf(arch, hf, tmp_path / "q8.gguf", expert_qtype=gguf.GGMLQuantizationType.Q8_0)
    # the twin: every expert tensor replaced by its values dequantised by the gguf package
    reader = gguf.GGUFReader(qpath)
    deq = {t.name: dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors
           if t.tensor_type == gguf.GGMLQuantizationType.Q8_0}
    assert deq and all("_exps" in n for n in deq)
    fpath = write_moe_gguf(arch, hf, tmp_path / "f32.gguf", replace=deq)
    prompt = logit_prompt()
    got, want = engine_prompt_logprobs(qpath, prompt), engine_prompt_logprobs(fpath, prompt)
    # the activations are quantised to 8 bits on the way (as llama.cpp does): ~1e-2 on log-probabilities
    np.testing.assert_allclose(got, want, atol=3e-2)
    prompts = random_prompts(6, seed=4)
    llm = LLM(qpath, num_blocks=128, block_size=16, max_num_batched_tokens=64)
    try:
        solo = [greedy(llm, [p], 16)[0] for p in prompts[:3]]
        batch = greedy(llm, prompts, 16)
    finally:
        llm.close()
    assert batch[:3] == solo


def test_moe_config_errors_are_named(tmp_path):
    from engine.errors import ModelLoadError
    from engine.loader import load_checkpoint
    from engine.models import build_model
    import json
    hf = make_model_dir("qwen3_moe", str(tmp_path))
    cfgp = tmp_path / "config.json"
    c = json.loads(cfgp.read_text())
    c["num_experts_per_tok"] = 9
    cfgp.write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match="experts per token") as ei:
        build_model(load_checkpoint(tmp_path))
    assert ei.value.key == "num_experts_per_tok"
    del hf


def test_moe_gguf_problems_are_named(tmp_path):
    """A GGUF whose layer has a router but a mis-shaped expert tensor, or sigmoid expert gating (DeepSeek-V3
    style, not supported), fails at load naming the tensor / key."""
    import gguf
    from engine.errors import ModelLoadError
    from engine.loader import load_checkpoint
    from engine.models import build_model
    hf = make_model_dir("qwen3_moe", str(tmp_path / "hf"))
    good = write_moe_gguf("qwen3_moe", hf, tmp_path / "good.gguf")
    reader = gguf.GGUFReader(good)
    E, I, H = 6, 40, 64
    bad = {"blk.1.ffn_down_exps.weight": np.zeros((E, H, I - 8), np.float32)}
    with pytest.raises(ModelLoadError, match="blk.1.ffn_down_exps.weight"):
        build_model(load_checkpoint(write_moe_gguf("qwen3_moe", hf, tmp_path / "bad.gguf", replace=bad),
                                    load_tokenizer=False))
    del reader
    # sigmoid gating: the same file with qwen3moe.expert_gating_func = 2
    path = tmp_path / "sig.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    r = gguf.GGUFReader(good)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        v = field.contents()
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, v)
        else:
            w.add_key_value(key, v, vt)
    w.add_uint32("qwen3moe.expert_gating_func", 2)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape.tolist())]))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="gating") as ei:
        build_model(load_checkpoint(path, load_tokenizer=False))
    assert ei.value.key == "qwen3moe.expert_gating_func"


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_moe_on_a_device_matches_transformers(moe_model, backend, monkeypatch):
    """device="cuda": router, grouping, experts and combine on device arrays (weights uploaded once), decode
    from recorded graphs; `fake` runs that plumbing on host memory with CPU kernels (tests/fake_cuda.py)."""
    arch, path, hf = moe_model
    if backend == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    check_device_greedy_matches_transformers(path, hf, random_prompts(5, seed=7))
