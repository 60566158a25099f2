"""Where a prefill's wall time goes beyond its kernels (H200): an 8-layer Llama-3-8B-shape random model, a prompt
of --prompt-len tokens with max_tokens=1, timed --repeats times (min / median), then one run under cProfile (the
host functions by own time and cumulative time) and one with CUDA events around it (device busy vs wall).

    python3 perf/probe_prefill_wall.py --layers 8 --prompt-len 1024

When a prefill's wall grows while its kernels (perf/profile_engine_cuda.py --cupti) shrink, this finds out
which host work is not hidden behind the GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--smoke", action="store_true",
                    help="the fake device (host memory, CPU kernels) and a tiny model: the host path only")
    args = ap.parse_args()
    if args.smoke:
        import pytest
        from tests import fake_cuda
        fake_cuda.install(pytest.MonkeyPatch())
    import numpy as np
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from jitkern.runtime import cuda
    from perf.peers.make_random_model import write_model
    dev = cuda.get_device()
    with tempfile.TemporaryDirectory(prefix="jk-wall-") as d:
        write_model(d, "llama3-8b", layers=args.layers, device="cpu" if args.smoke else "cuda", quiet=True,
                    smoke=args.smoke)
        rng = np.random.default_rng(0)
        llm = LLM(model=d, device="cuda", use_graphs=True)
        vocab = llm.engine.config.vocab_size
        sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def prompt():
            return rng.integers(10, min(1000, vocab), args.prompt_len).tolist()
        t0 = time.perf_counter()
        llm.generate([prompt()], sp1)
        print(f"warm-up (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate([prompt()], sp1)
            walls.append(time.perf_counter() - t0)
        print(f"prefill of {args.prompt_len} tokens, {args.layers} layers: wall min {min(walls) * 1e3:.1f} ms, "
              f"median {statistics.median(walls) * 1e3:.1f} ms, all {[round(w * 1e3, 1) for w in walls]}", flush=True)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        llm.generate([prompt()], sp1)
        prof.disable()
        print(f"under cProfile: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
        dev.synchronize()
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
