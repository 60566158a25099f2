"""Decode ms/step of a tiny mixture-of-experts model vs a dense model of the same active size (nothing
downloaded: random bf16 safetensors checkpoints in a temporary folder, a word-level tokenizer).

    python perf/bench_moe.py [--hidden 768] [--layers 4] [--experts 8] [--top-k 2] [--batch 1] [--tokens 24]

MoE: Mixtral layout, `experts` experts of MLP width `hidden` with top-k routing. Dense: Llama with MLP width
top_k * hidden, so a token multiplies the same number of MLP weights in both (the MoE adds its router, E x H).
Both models share the attention shapes. The figure is (time of N + 1 tokens - time of 1 token) / N, so the
prefill and the first step's compiles drop out; dense runs once with decode graphs (its default) and once
without (the MoE path cannot replay graphs: it groups tokens by expert on the host between kernels).
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


def _write(path, cfg, tensors):
    from tests.model_fixtures import _tokenizer_json
    header, off = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    _tokenizer_json(path, cfg["vocab_size"])


def write_models(moe_dir, dense_dir, H, layers, E, K, V=4096, NH=None, seed=0):
    rng = np.random.default_rng(seed)
    NH = NH or max(1, H // 64)
    KVH = max(1, NH // 4)
    D = H // NH

    def bf16(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32).__rshift__(16).astype(np.uint16)
    common = {"hidden_size": H, "num_hidden_layers": layers, "num_attention_heads": NH, "num_key_value_heads": KVH,
              "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 1, "bos_token_id": None}
    base = {"model.embed_tokens.weight": bf16((V, H), 0.02), "lm_head.weight": bf16((V, H), 0.02),
            "model.norm.weight": np.full(H, 0x3F80, np.uint16)}
    moe, dense = dict(base), dict(base)
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = {p + "input_layernorm.weight": np.full(H, 0x3F80, np.uint16),
                p + "post_attention_layernorm.weight": np.full(H, 0x3F80, np.uint16),
                p + "self_attn.q_proj.weight": bf16((NH * D, H), 0.02),
                p + "self_attn.k_proj.weight": bf16((KVH * D, H), 0.02),
                p + "self_attn.v_proj.weight": bf16((KVH * D, H), 0.02),
                p + "self_attn.o_proj.weight": bf16((H, NH * D), 0.02)}
        moe.update(attn)
        dense.update(attn)
        moe[p + "block_sparse_moe.gate.weight"] = bf16((E, H), 0.5)
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            moe[q + "w1.weight"] = bf16((H, H), 0.02)
            moe[q + "w3.weight"] = bf16((H, H), 0.02)
            moe[q + "w2.weight"] = bf16((H, H), 0.02)
        dense[p + "mlp.gate_proj.weight"] = bf16((K * H, H), 0.02)
        dense[p + "mlp.up_proj.weight"] = bf16((K * H, H), 0.02)
        dense[p + "mlp.down_proj.weight"] = bf16((H, K * H), 0.02)
    _write(moe_dir, {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "intermediate_size": H, "num_local_experts": E, "num_experts_per_tok": K,
                     "sliding_window": None}, moe)
    _write(dense_dir, {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "intermediate_size": K * H}, dense)


def ms_per_step(path, batch, tokens, use_graphs=True):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(path, num_blocks=256, block_size=16, max_num_seqs=max(batch, 1), max_model_len=1024,
              use_graphs=use_graphs)
    try:
        prompts = [list(range(5 + b, 37 + b)) for b in range(batch)]

        def run(n):
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            return time.perf_counter() - t0
        run(3)                               # warm-up: compiles every kernel specialisation
        one = min(run(1) for _ in range(2))
        full = min(run(tokens + 1) for _ in range(2))
        return (full - one) / tokens * 1e3
    finally:
        llm.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="concurrent sequences (decode tokens per step)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps timed")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jk-moe-") as d:
        md, dd = os.path.join(d, "moe"), os.path.join(d, "dense")
        os.makedirs(md)
        os.makedirs(dd)
        write_models(md, dd, args.hidden, args.layers, args.experts, args.top_k)
        moe = ms_per_step(md, args.batch, args.tokens)
        dense = ms_per_step(dd, args.batch, args.tokens)
        dense_ng = ms_per_step(dd, args.batch, args.tokens, use_graphs=False)
    H, E, K = args.hidden, args.experts, args.top_k
    act = 3 * K * H * H * 2 * args.layers / 2**20
    print(f"hidden {H}, {args.layers} layers, bf16, batch {args.batch}: MoE {E} experts top-{K} (MLP weights "
          f"{3 * E * H * H * 2 * args.layers / 2**20:.0f} MiB, active {act:.0f} MiB per token) "
          f"{moe:.2f} ms/step; dense MLP {K * H} (same active {act:.0f} MiB) {dense:.2f} ms/step with decode "
          f"graphs, {dense_ng:.2f} ms/step without; MoE/dense = {moe / dense:.2f} ({moe / dense_ng:.2f} without "
          f"graphs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
