"""Decode tok/s of the engine on a random Llama-3-8B-shape bf16 model (nothing downloaded): the weights are
random bf16 written as a safetensors checkpoint in a temporary folder, with a word-level tokenizer
(perf/peers/make_random_model.py, which perf/bench_e2e_cuda.py also uses: that one adds the peers).

    python perf/bench_llama8b_cuda.py [--layers 32] [--tokens 16] [--device cuda] [--small]

--layers below 32 keeps the run short (every layer has the full Llama-3-8B shape: hidden 4096, 32 heads, 8 KV
heads, MLP 14336, vocab 128256); the printed figure is measured, not scaled. --small makes a tiny model to
check the script itself on a CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_model(path: str, layers: int, small: bool, seed: int = 0, device: str = "cpu"):
    """The random Llama-3-8B-shape checkpoint (perf/peers/make_random_model.py; `small`: its tiny smoke dims)."""
    from perf.peers.make_random_model import write_model as write
    return write(path, "llama3-8b", layers=min(layers, 2) if small else layers, device=device, seed=seed,
                 smoke=small)


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
        # weights drawn where the engine runs (torch on the GPU is fast), streamed to the file one at a time
        write_model(d, args.layers, args.small, device="cuda" if args.device == "cuda" else "cpu")
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
