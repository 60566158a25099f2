"""Random-weight checkpoints with real model shapes (nothing downloaded), for the H200 end-to-end benchmarks.

    python perf/peers/make_random_model.py SHAPE OUT_DIR [--layers N] [--device cuda] [--seed 0] [--smoke]

SHAPE: llama3-8b (Llama-3-8B: hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab 128256), qwen3-8b
(hidden 4096, 36 layers, 32/8 heads, head_dim 128, MLP 12288, vocab 151936, q/k norms), smollm2-135m
(hidden 576, 30 layers, 9/3 heads, MLP 1536, vocab 49152, tied embeddings). --layers N keeps the first N
decoder layers (every layer keeps its full shape). --smoke: a tiny model of the same family (2 layers,
hidden 64) to check the pipeline in seconds.

The folder gets what transformers, the gpt-fast-style peer and the engine all read: config.json (written by
the transformers config class), model.safetensors (bf16; streamed one tensor at a time: weights are drawn on
`--device` with torch, copied to the host and written, so a 16 GB checkpoint never sits in host memory at
once), tokenizer.json (a word-level `tokenizers` vocabulary "t0".."t{V-1}" with the model's vocabulary size:
enough for id-level benchmarks and detokenisation) and tokenizer_config.json (eos "t1").
Tensor names and shapes come from the transformers model class itself, built on the meta device.
Values: N(0, 0.02) for projections and embeddings (transformers' initializer_range), 1 + N(0, 0.05) for norm
weights, N(0, 0.02) for biases.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = ("llama3-8b", "qwen3-8b", "smollm2-135m")
EOS_ID = 1


def make_config(shape: str, layers: int | None = None, smoke: bool = False):
    """The transformers config of `shape` (optionally truncated to `layers`; `smoke`: tiny dims)."""
    import transformers as tf
    if shape == "llama3-8b":
        kw = dict(cls=tf.LlamaConfig, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    elif shape == "qwen3-8b":
        kw = dict(cls=tf.Qwen3Config, vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    elif shape == "smollm2-135m":
        kw = dict(cls=tf.LlamaConfig, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                  rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    if smoke:
        kw.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
        if "head_dim" in kw:
            kw["head_dim"] = 16
    if layers is not None:
        if not 1 <= layers <= kw["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {kw['num_hidden_layers']}] for {shape}, got {layers}")
        kw["num_hidden_layers"] = layers
    cls = kw.pop("cls")
    cfg = cls(**kw, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=None)
    cfg.architectures = ["Qwen3ForCausalLM" if cls is tf.Qwen3Config else "LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    return cfg


def tensor_specs(cfg) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor a transformers checkpoint of `cfg` holds, in the model's order."""
    import torch
    import transformers as tf
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    specs = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    if cfg.tie_word_embeddings:
        specs = [s for s in specs if s[0] != "lm_head.weight"]     # transformers does not save the tied copy
    return specs


def write_tokenizer(folder: str, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")           # joins the words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": f"t{EOS_ID}", "add_bos_token": False,
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)


def _value(name: str, shape: tuple, gen, device):
    import torch
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if "norm" in name:
        t.mul_(0.05).add_(1.0)
    else:
        t.mul_(0.02)
    return t.to(torch.bfloat16)


def write_model(folder: str, shape: str, layers: int | None = None, device: str = "cpu", seed: int = 0,
                smoke: bool = False, quiet: bool = False):
    """Writes the random checkpoint of `shape` into `folder` (created); returns the transformers config."""
    import numpy as np
    import torch
    os.makedirs(folder, exist_ok=True)
    cfg = make_config(shape, layers, smoke)
    specs = tensor_specs(cfg)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shp in specs:
        n = 2 * int(np.prod(shp, dtype=np.int64))
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    gen = torch.Generator(device=device)
    t0 = time.perf_counter()
    last, done = t0, 0
    path = os.path.join(folder, "model.safetensors")
    with open(path + ".partial", "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for i, (name, shp) in enumerate(specs):
            gen.manual_seed(seed * 100003 + i)
            host = _value(name, shp, gen, device).cpu().contiguous()
            f.write(memoryview(host.view(torch.uint8).numpy()))
            done += 2 * host.numel()
            now = time.perf_counter()
            if not quiet and (now - last > 5 or i == len(specs) - 1):
                print(f"  {done / 1e9:6.2f} / {off / 1e9:.2f} GB written ({done / 1e9 / (now - t0):.2f} GB/s)",
                      flush=True)
                last = now
    os.replace(path + ".partial", path)
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()            # the caller may go on to load models on this GPU
    cfg.save_pretrained(folder)
    write_tokenizer(folder, cfg.vocab_size)
    if not quiet:
        print(f"{shape}{' (smoke)' if smoke else ''}, {cfg.num_hidden_layers} layers, {off / 1e9:.2f} GB -> {folder} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    ap.add_argument("--device", default=None, help="where torch draws the weights (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny model of the same family")
    args = ap.parse_args(argv)
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        write_model(args.out_dir, args.shape, args.layers, device, args.seed, args.smoke)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    raise SystemExit(main())
