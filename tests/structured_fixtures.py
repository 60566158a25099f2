"""A tiny random Llama with the embedded SmolLM2's real tokenizer (49152-token byte-level BPE), for structured
outputs: the grammars meet a realistic vocabulary (multi-character tokens that straddle JSON syntax, byte
tokens), while the model is small enough that a step costs milliseconds. Its random logits make it pick
odd tokens, which is what a mask has to hold against. Nothing is downloaded."""
from __future__ import annotations

import json
import os

SMOLLM2_VOCAB = 49152


def smollm2_gguf_path() -> str:
    from engine.default_model import default_model_path
    return str(default_model_path())


def write_smollm2_tokenizer(path: str) -> None:
    """tokenizer.json + tokenizer_config.json of the embedded SmolLM2 (its GGUF vocabulary rebuilt by our
    loader), so the checkpoint directory exercises the tokenizer.json path."""
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_file(smollm2_gguf_path())
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": tok.eos_token, "add_bos_token": False,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}, f)
    return tok


def make_constrained_model_dir(path: str, seed: int = 0) -> str:
    import transformers as tf

    from tests.model_fixtures import save_tiny_model
    os.makedirs(path, exist_ok=True)
    tok = write_smollm2_tokenizer(path)
    cfg = tf.LlamaConfig(vocab_size=SMOLLM2_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         rope_theta=10000.0, rms_norm_eps=1e-5)
    # logits spread wide enough that greedy and sampled picks differ from step to step
    save_tiny_model(cfg, path, seed, init=lambda m: m.get_input_embeddings().weight.normal_(0, 1.0), tokenizer=False)
    return path
