"""Tiny random HF models per architecture, saved as safetensors checkpoints (nothing is downloaded)."""
from __future__ import annotations

import json
import os

VOCAB = 256


def _tokenizer_json(path: str, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over tokens t0..t{V-1} (enough for id-level tests and detokenisation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
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
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=1, bos_token_id=None)
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


def make_model_dir(arch: str, path: str, seed: int = 0, overrides: dict | None = None):
    """Builds a tiny random model of `arch` (config fields `overrides` changed), saves it under `path`; returns the
    HF model (float32, eval)."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = make_config(arch)
    for k, v in (overrides or {}).items():
        setattr(cfg, k, v)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random init of norms (HF initialises them to 1 / 0, which would hide a wrong norm formula)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer_json(path)
    return model
