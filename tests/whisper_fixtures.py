"""A tiny random Whisper (WhisperForConditionalGeneration) saved as a safetensors checkpoint, with a word-level
tokenizer that has Whisper's special tokens, a generation_config.json as the openai/whisper-* repos write one
(languages, tasks, suppressed tokens) and a preprocessor_config.json with 2-second windows (nothing is
downloaded)."""
from __future__ import annotations

import json
import os

import numpy as np

VOCAB = 128
LANGS = ("en", "de", "fr")
# Whisper's order; <|notimestamps|> is the last id: transformers takes every id after it for a timestamp token
SPECIALS = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in LANGS] +
            ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
             "<|notimestamps|>"])
WORDS = VOCAB - len(SPECIALS)   # t0 .. t116 are ordinary words
IDS = {tok: WORDS + i for i, tok in enumerate(SPECIALS)}
EOS, SOT = IDS["<|endoftext|>"], IDS["<|startoftranscript|>"]
NO_TIMESTAMPS = IDS["<|notimestamps|>"]
SUPPRESS = [3, 4, 17, IDS["<|nospeech|>"], IDS["<|startoflm|>"]]
BEGIN_SUPPRESS = [5, EOS]
CHUNK_SECONDS = 2
MAX_SOURCE = CHUNK_SECONDS * 100 // 2            # 100 frames a second, halved by conv2's stride
MAX_TARGET = 64


def _tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(WORDS)}
    vocab.update(IDS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False}, f)


def generation_config() -> dict:
    return {"decoder_start_token_id": SOT, "eos_token_id": EOS, "pad_token_id": EOS, "bos_token_id": EOS,
            "is_multilingual": True, "lang_to_id": {f"<|{c}|>": IDS[f"<|{c}|>"] for c in LANGS},
            "task_to_id": {"transcribe": IDS["<|transcribe|>"], "translate": IDS["<|translate|>"]},
            "no_timestamps_token_id": NO_TIMESTAMPS, "suppress_tokens": SUPPRESS,
            "begin_suppress_tokens": BEGIN_SUPPRESS, "max_length": MAX_TARGET, "return_timestamps": False}


def make_whisper_dir(path: str, seed: int = 0, num_mel_bins: int = 80):
    """Builds and saves the tiny Whisper under `path`; returns the HF model (float32, eval)."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=num_mel_bins, d_model=64, encoder_layers=2,
                           encoder_attention_heads=4, decoder_layers=2, decoder_attention_heads=4,
                           encoder_ffn_dim=96, decoder_ffn_dim=96, max_source_positions=MAX_SOURCE,
                           max_target_positions=MAX_TARGET, decoder_start_token_id=SOT, eos_token_id=EOS,
                           pad_token_id=EOS, bos_token_id=EOS, suppress_tokens=None, begin_suppress_tokens=None)
    model = tf.WhisperForConditionalGeneration(cfg).eval()
    # random norms and larger weights than HF's init (0.02), so that a wrong formula anywhere moves the outputs
    # well past the tolerances; small token embeddings (tied to the output: large ones make every greedy step
    # repeat its input token) and large decoder positions, so that greedy tokens vary
    scale = {"decoder.embed_tokens": 0.05, "decoder.embed_positions": 0.5}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "encoder.embed_positions" not in name:        # (the encoder's are sinusoidal, as saved)
                p.copy_(torch.randn_like(p) * next((v for k, v in scale.items() if k in name), 0.25))
    model.generation_config = tf.GenerationConfig(**generation_config())
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation_config(), f)
    _tokenizer(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": num_mel_bins,
                   "sampling_rate": 16000, "hop_length": 160, "chunk_length": CHUNK_SECONDS, "n_fft": 400,
                   "n_samples": CHUNK_SECONDS * 16000, "nb_max_frames": CHUNK_SECONDS * 100,
                   "padding_value": 0.0, "return_attention_mask": False}, f)
    return model


def random_audio(seed: int, seconds: float, rate: int = 16000) -> np.ndarray:
    """Noise with a few tones, f32 in [-1, 1] (never silence: the features then vary across frames)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    a = 0.2 * rng.standard_normal(t.shape[0])
    for f in rng.uniform(100, 3000, 3):
        a += 0.3 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6.28))
    return np.clip(a, -1, 1).astype(np.float32)
