"""Write a tiny HF model (tests/model_fixtures.py) as a GGUF the way llama.cpp's convert_hf_to_gguf.py does:
the `gguf` package's own HF -> GGUF tensor-name map (gguf.get_tensor_name_map), llama.cpp's metadata keys,
and the converter's per-architecture weight edits:

- llama / granite: Q/K rows permuted for rope on adjacent pairs (the converter's LlamaModel.permute);
- gemma2 / gemma3: RMSNorm weights stored as 1 + w (HF keeps the offset w);
- phi3: LongRoPE factors as the global f32 tensors rope_factors_long / rope_factors_short, plus
  {arch}.rope.scaling.attn_factor and .original_context_length;
- granite: {arch}.embedding_scale / residual_scale / attention.scale / logit_scale;
- gemma2: {arch}.attn_logit_softcapping / final_logit_softcapping / attention.sliding_window.

Tensors are written in float32 (the comparison is then exact up to the kernels' rounding), or with every
2-D weight quantised by the gguf package (`qtype`, e.g. "Q8_0"; `roundtrip_hf` gives the HF model the same
quantised-then-dequantised weights, the oracle for such a file: the quantisation blocks run along rows,
so the converter's row permutation commutes with it).
"""
from __future__ import annotations

import math

import numpy as np

GGUF_ARCH = {"llama": "llama", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "granite": "granite",
             "olmo2": "olmo2", "gpt_oss": "gpt-oss"}
_PERMUTED = ("llama", "granite")
_NORM_PLUS_ONE = ("gemma2", "gemma3")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF row i (first half of a head) -> GGUF row 2i, HF row i + d/2 -> GGUF row 2i + 1
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip_hf(hf_model, qtype: str) -> None:
    """Replace every 2-D weight of the HF model by its quantised-then-dequantised value (in place)."""
    import gguf
    import torch
    from gguf.quants import dequantize, quantize

    qt = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 2 and name.endswith("weight"):
                a = p.detach().float().numpy()
                p.copy_(torch.from_numpy(np.asarray(dequantize(quantize(a, qt), qt), np.float32).reshape(a.shape)))


def write_gguf(hf_model, path: str, vocab: int = 256, qtype: str | None = None, mxfp4_experts=None) -> str:
    """`mxfp4_experts` (gpt-oss): {hf name of gate_up_proj / down_proj: (blocks, scales)} in HF's MXFP4 layout,
    written as llama.cpp's converter does (GptOssModel.repack_mxfp4: nibbles reordered to block_mxfp4, the
    interleaved gate/up rows split) instead of the float experts."""
    import gguf

    cfg = hf_model.config
    arch = GGUF_ARCH[cfg.model_type]
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    H, L = cfg.num_attention_heads, cfg.num_hidden_layers
    KVH = cfg.num_key_value_heads or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    w.add_block_count(L)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rp.get("rope_theta", 10000.0))
    rot = int(D * rp.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    w.add_vocab_size(vocab)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gpt-oss":            # the converter's GptOssModel.set_gguf_parameters
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp.get("original_max_position_embeddings", 4096))
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    extra = {}
    if arch == "phi3" and rp.get("rope_type") == "longrope":
        orig = rp.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / orig
        # the converter's attention factor (HF's default when attention_factor is not given)
        attn = rp.get("attention_factor") or (1.0 if scale <= 1.0 else
                                              math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_rope_scaling_attn_factors(attn)
        w.add_rope_scaling_orig_ctx_len(orig)
        extra["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        extra["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
    # a word-level vocabulary t0..t{V-1} (ids are what the tests compare)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(vocab - 1)] + ["t1t2"])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["t1 t2"])
    w.add_eos_token_id(1)

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, t in hf_model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        if "rotary_emb" in hf_name:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "gpt-oss" and ".mlp.experts." in hf_name:
            for name, arr, raw in _gpt_oss_experts(hf_name, a, mxfp4_experts or {}):
                w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType.MXFP4 if raw else None)
            continue
        if hf_name.endswith("self_attn.sinks"):
            w.add_tensor(name_map.get_name(hf_name) + ".weight", np.ascontiguousarray(a, np.float32))
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = name_map.get_name(base)
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name} in the gguf package's {arch} map")
        name = f"{name}.{suffix}"
        if arch in _PERMUTED and name.endswith("attn_q.weight"):
            a = _permute(a, H)
        elif arch in _PERMUTED and name.endswith("attn_k.weight"):
            a = _permute(a, KVH)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            a = a + 1.0
        a = np.ascontiguousarray(a, np.float32)
        if qtype is not None and a.ndim == 2:
            from gguf.quants import quantize
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)
    for name, a in extra.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mxfp4_gguf_layout(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    # the converter's transform_nibble_layout + concat: HF byte j = elements (2j, 2j+1) as (low, high) nibble,
    # block_mxfp4 byte j = elements (j, j + 16); the e8m0 byte first
    codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate((scales[..., None].astype(np.uint8), qs), axis=-1)
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], out.shape[-2] * 17))


def _gpt_oss_experts(hf_name, a, mxfp4):
    """(gguf name, array, is raw MXFP4) for one HF gpt-oss expert tensor (the converter's modify_tensors /
    generate_extra_tensors): gate_up_proj [E, H, 2I] -> ffn_gate_exps / ffn_up_exps [E, I, H] (even / odd
    rows of the transpose), biases likewise, down_proj [E, I, H] -> ffn_down_exps [E, H, I]."""
    import gguf
    i = int(hf_name.split(".")[2])
    T = gguf.TENSOR_NAMES
    gate, up, down = (T[k].format(bid=i) for k in (gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP,
                                                 gguf.MODEL_TENSOR.FFN_DOWN_EXP))
    f32 = lambda x: np.ascontiguousarray(x, np.float32)  # noqa: E731
    if hf_name.endswith("gate_up_proj_bias"):
        return [(gate + ".bias", f32(a[..., 0::2]), False), (up + ".bias", f32(a[..., 1::2]), False)]
    if hf_name.endswith("down_proj_bias"):
        return [(down + ".bias", f32(a), False)]
    if hf_name.endswith("gate_up_proj"):
        if hf_name in mxfp4:
            q = _mxfp4_gguf_layout(*mxfp4[hf_name])          # rows [E, 2I] already the output features
            return [(gate + ".weight", np.ascontiguousarray(q[:, 0::2]), True),
                    (up + ".weight", np.ascontiguousarray(q[:, 1::2]), True)]
        t = a.swapaxes(1, 2)
        return [(gate + ".weight", f32(t[:, 0::2]), False), (up + ".weight", f32(t[:, 1::2]), False)]
    if hf_name.endswith("down_proj"):
        if hf_name in mxfp4:
            return [(down + ".weight", _mxfp4_gguf_layout(*mxfp4[hf_name]), True)]
        return [(down + ".weight", f32(a.swapaxes(1, 2)), False)]
    raise KeyError(f"unexpected gpt-oss expert tensor {hf_name}")
