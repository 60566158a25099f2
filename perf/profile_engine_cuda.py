"""Where a decode step's GPU time goes: the engine on a random Llama-3-8B-shape model with decode graphs off
and JITKERN_GPU_PROFILE=1 (each launch timed between synchronisations), per kernel, at concurrency 1 and 64.

    JITKERN_GPU_PROFILE=1 python3 perf/profile_engine_cuda.py [--layers 4] [--tokens 16]
    python3 perf/profile_engine_cuda.py --host [--layers 8] [--tokens 64] [--concurrency 1 64]

Also prints the wall time per step with graphs on for the same batch, so host overhead shows as the difference
between that and the sum of the kernels. --host: graphs on only; per concurrency the decode step's wall time,
the GPU time of its recorded graph replayed back to back (what a step would take if the host never made the
GPU wait) and a cProfile of the host side of the decode steps (top functions by own time).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--attention", choices=("token", "flash"), default=None,
                    help="GPU attention kernels: token_attention_kernel (one program per token and KV head) or the "
                         "flash decode/merge/prefill kernels (default: the op's, flash)")
    ap.add_argument("--host", action="store_true", help="host overhead: graph replay time vs step wall time, cProfile")
    args = ap.parse_args(argv)
    if args.host:
        return _host(args)
    os.environ.setdefault("JITKERN_GPU_PROFILE", "1")
    from jitkern.runtime import gpu_profile
    from jitkern.ops import attention
    if args.attention:
        attention.GPU_TOKEN_ATTENTION = args.attention == "token"
        attention.GPU_FLASH_ATTENTION = args.attention == "flash"
    gpu_profile.ENABLED = True
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from perf.peers.make_random_model import write_model
    import numpy as np
    with tempfile.TemporaryDirectory(prefix="jk-prof-") as d:
        write_model(d, "llama3-8b", layers=args.layers, device="cuda", quiet=True)
        rng = np.random.default_rng(0)
        for graphs in (False, True):
            llm = LLM(model=d, device="cuda", use_graphs=graphs)
            for c in args.concurrency:
                prompts = [rng.integers(10, 1000, 128).tolist() for _ in range(c)]
                sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                llm.generate(prompts, sp)                       # warm-up: compiles, graphs
                gpu_profile.reset()
                sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(prompts, sp1)
                t_prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                llm.generate(prompts, sp)
                wall = time.perf_counter() - t0
                step = (wall - t_prefill) / max(1, args.tokens - 1)
                print(f"\n=== graphs={'on' if graphs else 'off'} concurrency {c}: {args.layers} layers, prefill "
                      f"{t_prefill * 1e3:.1f} ms, decode step {step * 1e3:.2f} ms "
                      f"({c / step:.0f} tok/s)", flush=True)
                if not graphs:
                    print(gpu_profile.report(), flush=True)
            del llm
    return 0


def _host(args) -> int:
    import cProfile
    import pstats
    import numpy as np
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from jitkern.runtime import cuda
    from perf.peers.make_random_model import write_model
    dev = cuda.get_device()
    with tempfile.TemporaryDirectory(prefix="jk-prof-") as d:
        write_model(d, "llama3-8b", layers=args.layers, device="cuda", quiet=True)
        rng = np.random.default_rng(0)
        llm = LLM(model=d, device="cuda", use_graphs=True)
        runner = llm.engine.runner
        for c in args.concurrency:
            prompts = [rng.integers(10, 1000, 128).tolist() for _ in range(c)]
            sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, sp)                       # warm-up: compiles, records the graphs
            sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, sp1)
            t_prefill = time.perf_counter() - t0
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            llm.generate(prompts, sp)
            prof.disable()
            wall = time.perf_counter() - t0
            step = (wall - t_prefill) / max(1, args.tokens - 1)
            # the decode graph of this batch size, replayed back to back: the GPU's own time per step
            g = None
            for key, ent in runner._graphs.items():
                if (key[0] if isinstance(key, tuple) else key) >= c:
                    g = ent[0]
                    break
            gpu = float("nan")
            if g is not None:
                g.replay()
                dev.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    g.replay()
                dev.synchronize()
                gpu = (time.perf_counter() - t0) / 20
            print(f"\n=== concurrency {c}, {args.layers} layers: decode step {step * 1e3:.3f} ms wall, its graph "
                  f"{gpu * 1e3:.3f} ms back to back: host adds {(step - gpu) * 1e3:.3f} ms a step "
                  f"({(step - gpu) / step:.0%}); graphs {list(runner._graphs)}", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
