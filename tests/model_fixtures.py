"""Tiny random HF models per architecture, saved as safetensors checkpoints (nothing is downloaded).

One table for every family the tests build: `make_config(arch)` (dense, mixture-of-experts, multi-head latent
attention, gpt-oss) and `make_model_dir(arch, path)`, which seeds torch, builds the model, redraws the weights
HF's init would leave uninformative (`init_weights`), saves it with a word-level tokenizer and returns it.
The comparisons against transformers are in tests/model_compare.py."""
from __future__ import annotations

import json
import os

VOCAB = 256

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MLA_ARCHS = ("deepseek_v2", "deepseek_v2-qlora", "deepseek_v3", "deepseek_v3-gguf")

# yarn with mscale == mscale_all_dim: what a GGUF can say (rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim)
V3_GGUF_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.3, "mscale_all_dim": 1.3, "beta_fast": 32, "beta_slow": 1}


def _tokenizer_json(path: str, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over tokens t0..t{V-1} (enough for id-level tests and detokenisation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab_map = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "t1", "add_bos_token": False,
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)


def make_config(arch: str):
    import transformers as tf
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": None}
    if arch in MOE_ARCHS:
        return _moe_config(arch, common)
    if arch in MLA_ARCHS:
        return _mla_config(arch, {**common, "num_key_value_heads": 4})
    if arch == "gpt_oss":
        return tf.GptOssConfig(**{**common, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=24, pad_token_id=0,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 128, "rope_theta": 150000.0})
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, rms_norm_eps=1e-5)
    if arch == "llama3-rope":
        return tf.LlamaConfig(**common, rope_theta=500000.0, rms_norm_eps=1e-5,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=24)
    if arch == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=16, sliding_window=24,
                                   query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                                   final_logit_softcapping=30.0, rope_local_base_freq=10000.0)
    if arch in ("gemma2", "gemma2-gguf"):
        # small soft-caps and larger random weights: both caps change the logits by ~0.6 (vs 2e-4 tolerance).
        # llama.cpp's Gemma 2 takes the query scale from head_dim (the file has no key for it): the GGUF
        # variant uses query_pre_attn_scalar == head_dim, as the released 2B/9B do
        return tf.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=16, sliding_window=24,
                               query_pre_attn_scalar=24 if arch == "gemma2" else 16, attn_logit_softcapping=2.0,
                               final_logit_softcapping=5.0, initializer_range=0.1)
    if arch == "granite":
        # multipliers far from 1 so that each one changes the logits
        return tf.GraniteConfig(**common, embedding_multiplier=6.0, residual_multiplier=0.4,
                                attention_multiplier=0.5, logits_scaling=0.25, rms_norm_eps=1e-5)
    if arch == "phi3":
        # LongRoPE over a partial rotary (Phi-4-mini style): pretrained context 128, extended to 512; the long
        # factors differ enough from the short ones to change every logit
        rot = 12
        return tf.Phi3Config(**common, pad_token_id=0, initializer_range=0.1, original_max_position_embeddings=128,
                             rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 128, "short_factor": [1.0 + 0.05 * i for i in range(rot // 2)],
            "long_factor": [1.0 + 1.5 * i for i in range(rot // 2)]})
    if arch == "olmo2":
        return tf.Olmo2Config(**common, pad_token_id=0, rms_norm_eps=1e-6)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                             eos_token_id=1, bos_token_id=1, activation_function="gelu_new")
    raise ValueError(arch)


def _moe_config(arch: str, common: dict):
    """Mixtral (renormalised top-2), Qwen2-MoE (softmax top-k without renormalisation, a sigmoid-gated shared
    expert, one dense layer via mlp_only_layers), Qwen3-MoE (norm_topk_prob, per-head q/k norms), OLMoE."""
    import transformers as tf
    if arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                                 norm_topk_prob=True, head_dim=16)
    return tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)


def _mla_config(arch: str, common: dict):
    """DeepSeek-V2 with a plain q_proj, softmax top-k routing with routed_scaling_factor and shared experts (layer 0
    dense via first_k_dense_replace); V2 with q_lora_rank and group_limited_greedy routing; V3 with yarn rope
    scaling (mscale / mscale_all_dim), interleaved rope and sigmoid group-limited routing; V3 with the yarn a
    GGUF can state (V3_GGUF_YARN)."""
    import transformers as tf
    common = {**common, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
              "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
              "initializer_range": 0.05}
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(**common, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                   routed_scaling_factor=1.5)
    if arch == "deepseek_v2-qlora":      # and group_limited_greedy routing: 6 experts in 3 groups, 1 eligible
        return tf.DeepseekV2Config(**common, q_lora_rank=20, n_routed_experts=6, num_experts_per_tok=2,
                                   topk_method="group_limited_greedy", n_group=3, topk_group=1)
    yarn = (dict(V3_GGUF_YARN) if arch == "deepseek_v3-gguf" else
            {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "mscale": 0.8, "mscale_all_dim": 1.2, "beta_fast": 32, "beta_slow": 1})
    return tf.DeepseekV3Config(**common, q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                               topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=yarn)


def init_weights(arch: str, model) -> None:
    """Redraws what HF's init would leave uninformative (call under torch.no_grad; the draws, in parameter order,
    are part of each model's identity). Every family: random norms (HF initialises them to 1 / 0, which would
    hide a wrong norm formula). MoE / MLA: router weights scaled up so that no token's top-k choice is a near tie
    (HF and the engine compute the router logits in a different order; a tie could pick different experts), and
    the score-correction bias drawn so that it changes which experts win. gpt-oss: sinks from well below to
    above the logits, biases large enough to matter, expert activations that reach the SwiGLU clamp."""
    import torch
    if arch == "gpt_oss":
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    elif arch in MOE_ARCHS or arch in MLA_ARCHS:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.mul_(60.0)
            elif "shared_expert_gate" in name:                 # Qwen2-MoE's sigmoid gate of the shared expert
                p.mul_(30.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    else:
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)


def save_tiny_model(cfg, path: str, seed: int = 0, init=None, auto_class: str = "AutoModelForCausalLM",
                    tokenizer: bool = True):
    """Seeds torch, builds `cfg` in float32 with transformers' `auto_class`, runs `init(model)` under no_grad,
    saves it (safetensors) under `path` with the word-level tokenizer (unless `tokenizer` is False: the caller
    writes its own); returns the model (eval mode)."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    model = getattr(tf, auto_class).from_config(cfg, dtype=torch.float32)
    if init is not None:
        with torch.no_grad():
            init(model)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        _tokenizer_json(path)
    return model


def make_model_dir(arch: str, path: str, seed: int = 0, overrides: dict | None = None, dtype=None):
    """Builds a tiny random model of `arch` (config fields `overrides` changed), saves it under `path`; returns the
    HF model (float32, eval). `dtype` (a torch dtype): the checkpoint is saved in it instead, and the model
    returned is the cast one."""
    cfg = make_config(arch)
    for k, v in (overrides or {}).items():
        setattr(cfg, k, v)
    model = save_tiny_model(cfg, path, seed, init=lambda m: init_weights(arch, m))
    if dtype is not None:
        model = model.to(dtype)
        model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_model_dir(tmp_path_factory, name: str, arch: str = "llama", seed: int = 0, **kw):
    """(path, HF model) of make_model_dir in a fresh temporary directory named `name`; skips the test without
    the oracle libraries it is built with (torch, transformers)."""
    import pytest
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp(name))
    return path, make_model_dir(arch, path, seed=seed, **kw)
