"""A/B on the CPU: the GGUF o projection's int8 input written by the attention's merge kernel
(`paged_attention(q8_out=)`, DecoderLM._attn_q8) against a separate quantize_q8 launch, embedded SmolLM2.

    .venv/bin/python perf/ab_attn_q8_cpu.py [--rounds 4] [--tokens 48] [--batch 1 16]

One engine; per batch size, rounds alternate the two modes (recorded graphs dropped at each switch, a short
warm-up re-records them), each timing --tokens greedy tokens for every request. Prints each mode's tok/s per
round, the medians and fold / quantize.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the two modes (default 4)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens a request per timed call (default 48)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    a = ap.parse_args()
    import numpy as np

    from engine.llm import LLM
    from engine.models.decoder import DecoderLM
    from engine.sampling_params import SamplingParams
    real = DecoderLM._attn_q8
    llm = LLM(None, max_num_seqs=max(a.batch))
    rng = np.random.default_rng(0)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    sp = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True, detokenize=False)
    try:
        for B in a.batch:
            prompts = [rng.integers(100, 40000, 16).tolist() for _ in range(B)]
            res = {"fold": [], "quantize": []}
            for _ in range(a.rounds):
                for mode in res:
                    DecoderLM._attn_q8 = real if mode == "fold" else (lambda self, *args: None)
                    llm.engine.runner._graphs.clear()
                    llm.generate(prompts, warm)
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp)
                    res[mode].append(B * a.tokens / (time.perf_counter() - t0))
            med = {m: statistics.median(v) for m, v in res.items()}
            for m, v in res.items():
                print(f"batch {B:3d} {m:9s} median {med[m]:8.1f} tok/s  rounds {[round(x, 1) for x in v]}")
            print(f"batch {B:3d} fold / quantize {med['fold'] / med['quantize']:.3f}")
    finally:
        DecoderLM._attn_q8 = real
        llm.close()


if __name__ == "__main__":
    main()
