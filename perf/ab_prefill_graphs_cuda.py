"""A/B of the CUDA prefill graphs (engine/prefill_graphs.py) in one engine: a prompt's prefill step (max_tokens=1)
replayed as a graph vs run eagerly (the runner's PrefillGraphs.cuda_max_tokens set to 0, as
JITKERN_CUDA_GRAPH_MAX_TOKENS=0 does), alternating round by round
on fresh prompts (no prefix-cache hits), per prompt length. Prints the median / best request latency of each.

    python3 perf/ab_prefill_graphs_cuda.py --make llama3-8b --layers 8 [--lens 16,37,128,300] [--rounds 7]
    python3 perf/ab_prefill_graphs_cuda.py --model DIR
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a transformers folder")
    ap.add_argument("--make", default=None, help="write a random model of this shape first "
                                                 "(perf/peers/make_random_model.py)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lens", default="16,37,128,300", help="comma-separated prompt lengths")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    import numpy as np

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    with tempfile.TemporaryDirectory(prefix="jk-abpg-") as tmp:
        model = a.model
        if a.make:
            from perf.peers.make_random_model import write_model
            model = os.path.join(tmp, "model")
            write_model(model, a.make, a.layers, device="cpu" if a.device == "cpu" else a.device)
        if not model:
            raise SystemExit("give --model DIR or --make SHAPE")
        lens = [int(x) for x in a.lens.split(",")]
        llm = LLM(model, device=a.device, block_size=16, max_num_seqs=4, max_model_len=max(lens) + 32,
                  enable_prefix_caching=False, kv_cache_dtype="f16")
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
        vocab = llm.engine.config.vocab_size
        rng = np.random.default_rng(0)
        runner = llm.engine.runner
        modes = {"graph": runner.prefill_graphs.cuda_max_tokens, "eager": 0}
        times = {(n, m): [] for n in lens for m in modes}
        try:
            for rnd in range(a.rounds + 1):                  # round 0: warm-up (compiles, records the graphs)
                order = list(modes) if rnd % 2 else list(modes)[::-1]
                for n in lens:
                    for m in order:
                        runner.prefill_graphs.cuda_max_tokens = modes[m]
                        prompt = rng.integers(2, min(vocab, 30000), n).tolist()
                        before = runner.prefill_graphs.replays
                        t0 = time.perf_counter()
                        llm.generate([prompt], sp)
                        dt = time.perf_counter() - t0
                        replayed = runner.prefill_graphs.replays > before
                        if replayed != (m == "graph"):
                            print(f"  note: {n} tokens, mode {m}: graph replayed = {replayed}")
                        if rnd:
                            times[(n, m)].append(dt * 1e3)
        finally:
            llm.close()
        print(f"prefill request latency, ms (max_tokens=1, {a.rounds} rounds, fresh prompts; "
              f"load average {os.getloadavg()[0]:.1f})")
        print(f"{'tokens':>7} {'graph median':>13} {'best':>7} {'eager median':>13} {'best':>7} {'eager/graph':>12}")
        for n in lens:
            g, e = times[(n, "graph")], times[(n, "eager")]
            print(f"{n:7d} {statistics.median(g):13.2f} {min(g):7.2f} {statistics.median(e):13.2f} {min(e):7.2f} "
                  f"{statistics.median(e) / statistics.median(g):11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
