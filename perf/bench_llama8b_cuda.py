"""Decode tok/s of the engine on a random Llama-3-8B-shape bf16 model (nothing downloaded): the weights are
random bf16 written as a safetensors checkpoint in a temporary folder, with a word-level tokenizer.

    python perf/bench_llama8b_cuda.py [--layers 32] [--tokens 16] [--device cuda] [--small]

--layers below 32 keeps the run short (every layer has the full Llama-3-8B shape: hidden 4096, 32 heads, 8 KV
heads, MLP 14336, vocab 128256); the printed figure is measured, not scaled. --small makes a tiny model to
check the script itself on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_model(path: str, layers: int, small: bool, seed: int = 0) -> dict:
    from tests.model_fixtures import _tokenizer_json
    H, I, V, NH, KVH = (64, 96, 256, 4, 2) if small else (4096, 14336, 128256, 32, 8)
    D = H // NH
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": layers, "num_attention_heads": NH, "num_key_value_heads": KVH,
           "vocab_size": V, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 1, "bos_token_id": None}
    rng = np.random.default_rng(seed)

    def bf16(shape, scale):
        # random f32 -> bf16 bits (truncation is fine for random weights)
        return (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32).__rshift__(16) \
            .astype(np.uint16)
    t = {"model.embed_tokens.weight": bf16((V, H), 0.02), "lm_head.weight": bf16((V, H), 0.02),
         "model.norm.weight": bf16((H,), 0.1) + np.uint16(0x3F80)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.full(H, 0x3F80, np.uint16)
        t[p + "post_attention_layernorm.weight"] = np.full(H, 0x3F80, np.uint16)
        t[p + "self_attn.q_proj.weight"] = bf16((NH * D, H), 0.02)
        t[p + "self_attn.k_proj.weight"] = bf16((KVH * D, H), 0.02)
        t[p + "self_attn.v_proj.weight"] = bf16((KVH * D, H), 0.02)
        t[p + "self_attn.o_proj.weight"] = bf16((H, NH * D), 0.02)
        t[p + "mlp.gate_proj.weight"] = bf16((I, H), 0.02)
        t[p + "mlp.up_proj.weight"] = bf16((I, H), 0.02)
        t[p + "mlp.down_proj.weight"] = bf16((H, I), 0.02)
    # safetensors with BF16 tensors written directly (numpy has no bf16: the arrays hold the bits)
    header, off = {}, 0
    for name, a in t.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in t.values():
            f.write(np.ascontiguousarray(a).tobytes())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    _tokenizer_json(path, V)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, the real model's)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens to time (default 16)")
    ap.add_argument("--device", default="cuda", help="engine device (default cuda)")
    ap.add_argument("--small", action="store_true", help="a tiny model (checks the script on a CPU)")
    args = ap.parse_args(argv)
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    with tempfile.TemporaryDirectory(prefix="jk-llama8b-") as d:
        t0 = time.perf_counter()
        write_model(d, args.layers, args.small)
        t1 = time.perf_counter()
        llm = LLM(d, device=args.device, num_blocks=256, block_size=16, max_num_seqs=4, max_model_len=1024)
        t2 = time.perf_counter()
        prompt = [list(range(5, 37))]
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False)
        llm.generate(prompt, sp)                                      # warm-up: compiles, graphs
        sp = SamplingParams(max_tokens=args.tokens + 1, temperature=0, ignore_eos=True, detokenize=False)
        t3 = time.perf_counter()
        out = llm.generate(prompt, sp)
        t4 = time.perf_counter()
        # the first of the tokens comes from the prefill; the rest are decode steps
        n = len(out[0].outputs[0].token_ids)
        print(f"random Llama-3-8B-shape bf16, {args.layers} layers, device {args.device}: write {t1 - t0:.1f} s, "
              f"load {t2 - t1:.1f} s, generate {n} tokens (32-token prompt) in {t4 - t3:.2f} s -> "
              f"{(n - 1) / (t4 - t3):.2f} tok/s including one prefill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
