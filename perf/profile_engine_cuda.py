"""Where a decode step's GPU time goes: the engine on a random Llama-3-8B-shape model with decode graphs off
and JITKERN_GPU_PROFILE=1 (each launch timed between synchronisations), per kernel, at concurrency 1 and 64.

    JITKERN_GPU_PROFILE=1 python3 perf/profile_engine_cuda.py [--layers 4] [--tokens 16]
    python3 perf/profile_engine_cuda.py --host [--layers 8] [--tokens 64] [--concurrency 1 64] [--overlap off on]
                                          [--repeats 3] [--profile] [--smoke]
    python3 perf/profile_engine_cuda.py --cupti [--layers 8] [--concurrency 1 64] [--prompt-len 1024]

Also prints the wall time per step with graphs on for the same batch, so host overhead shows as the difference
between that and the sum of the kernels. --host: graphs on only; per concurrency the decode step's wall time,
the GPU time of its recorded graph replayed back to back (what a step would take if the host never made the
GPU wait), with LLMEngine's overlap_output off and on (a step's output work done while the GPU runs the next
step) in the same run, interleaved, and the engine's decode tok/s for each (a decode step: the median wall
time of LLMEngine.step() calls in the steady state); --profile adds a cProfile of the
host side of the decode steps (top functions by own time). --smoke: the fake device and a tiny model (CPU).
--cupti: graphs on, no synchronisation between kernels: each concurrency's recorded decode graph replayed under
torch.profiler (CUPTI sees every kernel, whoever launched it), and one --prompt-len prefill; per kernel name its
launches and device time per step, so the table is what a real step spends (needs torch with CUDA). The prefill's
unprofiled wall time is printed too (min and median of --wall-repeats; only in this mode).
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
    ap.add_argument("--overlap", nargs="+", choices=("off", "on"), default=["off", "on"],
                    help="--host: LLMEngine overlap_output modes to time in the same run (default both)")
    ap.add_argument("--repeats", type=int, default=3, help="--host: timed runs per mode (interleaved; median)")
    ap.add_argument("--profile", action="store_true", help="--host: also a cProfile of one more decode run")
    ap.add_argument("--cupti", action="store_true",
                    help="graphs on: per-kernel device time of a replayed decode graph and of a prefill (torch.profiler)")
    ap.add_argument("--prompt-len", type=int, default=1024, help="--cupti: the prefill's prompt length")
    ap.add_argument("--wall-repeats", type=int, default=5,
                    help="--cupti: unprofiled prefills timed (fresh random prompts; min and median printed)")
    ap.add_argument("--smoke", action="store_true",
                    help="--host on the fake CUDA device (tests/fake_cuda.py) with a tiny model: checks the script")
    args = ap.parse_args(argv)
    if args.host:
        return _host(args)
    if args.cupti:
        return _cupti(args)
    os.environ.setdefault("JITKERN_GPU_PROFILE", "1")
    from jitkern.runtime import gpu_profile
    if args.attention == "token":
        # the device target's tuning table with every attention step on the token kernel (targets/tuning.py)
        from jitkern.runtime import cuda
        from targets import tuned
        dev = cuda.get_device()
        t = tuned(dev.target(), token_attention=True)
        dev.target = lambda: t
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
    import itertools
    import pstats
    import statistics
    import numpy as np
    if args.smoke:                       # the fake device (host memory, CPU kernels) and a tiny model: plumbing only
        import pytest
        from tests import fake_cuda
        fake_cuda.install(pytest.MonkeyPatch())
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from jitkern.runtime import cuda
    from perf.peers.make_random_model import write_model
    dev = cuda.get_device()
    modes = [m == "on" for m in args.overlap]
    with tempfile.TemporaryDirectory(prefix="jk-prof-") as d:
        write_model(d, "llama3-8b", layers=args.layers, device="cpu" if args.smoke else "cuda", quiet=True,
                    smoke=args.smoke)
        rng = np.random.default_rng(0)
        llm = LLM(model=d, device="cuda", use_graphs=True)
        eng, runner = llm.engine, llm.engine.runner
        default_overlap = eng.overlap_output
        vocab = eng.config.vocab_size
        summary = []
        for c in args.concurrency:
            prompts = [rng.integers(10, min(1000, vocab), 128).tolist() for _ in range(c)]
            sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            counter = itertools.count()
            llm.generate(prompts, sp)                       # warm-up: compiles, records the graphs

            def timed(overlap, profile=None):
                """Decode step seconds: the median wall time of the engine's step() calls in the steady state (the
                calls after the prefill's and before the last two); and each request's greedy tokens."""
                eng.overlap_output = overlap
                ids = [f"t{next(counter)}" for _ in prompts]
                for rid, p in zip(ids, prompts):
                    eng.add_request(rid, p, sp)
                calls, final = [], {}
                if profile is not None:
                    profile.enable()
                while eng.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outs = eng.step()
                    calls.append(time.perf_counter() - t0)
                    final.update({o.request_id: list(o.outputs[0].token_ids) for o in outs if o.finished})
                if profile is not None:
                    profile.disable()
                steady = calls[2:-2] or calls
                return statistics.median(steady), [final[r] for r in ids]

            steps = {m: [] for m in modes}
            tokens = {}
            for _ in range(args.repeats):                   # interleaved: drifts (clocks, heat) hit both modes
                for m in modes:
                    t, tokens[m] = timed(m)
                    steps[m].append(t)
            eng.overlap_output = default_overlap
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
            same = len(set(json.dumps(v) for v in tokens.values())) == 1
            print(f"\n=== concurrency {c}, {args.layers} layers: its decode graph {gpu * 1e3:.3f} ms back to back; "
                  f"graphs {list(runner._graphs)}; greedy tokens equal across modes: {same}", flush=True)
            for m in modes:
                step = statistics.median(steps[m])
                line = (f"concurrency {c:3d} overlap {'on ' if m else 'off'}: decode step {step * 1e3:.3f} ms "
                        f"(median of runs {[round(x * 1e3, 3) for x in steps[m]]}), {c / step:.0f} tok/s, host adds "
                        f"{(step - gpu) * 1e3:.3f} ms a step ({(step - gpu) / step:.0%})")
                print(line, flush=True)
                summary.append(line)
            if args.profile:
                prof = cProfile.Profile()
                timed(modes[-1], prof)
                print(f"cProfile of the decode run, overlap {'on' if modes[-1] else 'off'} (top 25 by own time):")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        print("\n=== summary (engine decode tok/s, overlap_output off vs on)")
        print("\n".join(summary), flush=True)
        llm.close()
    return 0


def _kernel_table(prof, per: int, title: str) -> None:
    """Kernel rows of a torch.profiler run: name (the specialisation hash cut), launches and device us per `per`."""
    rows = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        name = re.sub(r"_[0-9a-f]{8,}$", "", e.name)
        n, t = rows.get(name, (0, 0.0))
        rows[name] = (n + 1, t + e.time_range.elapsed_us())
    total = sum(t for _, t in rows.values()) / per
    launches = sum(n for n, _ in rows.values()) / per
    print(f"\n=== {title}: {total:.1f} us of kernels, {launches:.0f} launches")
    for name, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t / per:9.1f} us {t / per / max(total, 1e-9):6.1%} {n / per:6.1f}x  {name[:110]}")


def _cupti(args) -> int:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from jitkern.runtime import cuda
    from perf.peers.make_random_model import write_model
    dev = cuda.get_device()
    torch.cuda.init()
    with tempfile.TemporaryDirectory(prefix="jk-prof-") as d:
        write_model(d, "llama3-8b", layers=args.layers, device="cuda", quiet=True)
        rng = np.random.default_rng(0)
        llm = LLM(model=d, device="cuda", use_graphs=True)
        runner = llm.engine.runner
        vocab = llm.engine.config.vocab_size
        for c in args.concurrency:
            prompts = [rng.integers(10, min(1000, vocab), 128).tolist() for _ in range(c)]
            llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            g = None
            for key, ent in runner._graphs.items():
                if not (isinstance(key, tuple) and isinstance(key[0], str)) and \
                        (key[0] if isinstance(key, tuple) else key) >= c:
                    g = ent[0]
                    break
            if g is None:
                print(f"concurrency {c}: no decode graph recorded ({list(runner._graphs)})")
                continue
            reps = 10
            g.replay()
            dev.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    g.replay()
                dev.synchronize()
            _kernel_table(prof, reps, f"decode step, concurrency {c}, {args.layers} layers (graph replay)")
        prompt = rng.integers(10, min(1000, vocab), args.prompt_len).tolist()
        sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], sp1)                           # warm-up: compiles this token count's kernels
        walls = []
        for _ in range(max(1, args.wall_repeats)):
            # (one sample is not enough: single-shot walls can disagree with the kernel sums)
            t0 = time.perf_counter()
            llm.generate([rng.integers(10, min(1000, vocab), args.prompt_len).tolist()], sp1)
            walls.append(time.perf_counter() - t0)
        walls.sort()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([rng.integers(10, min(1000, vocab), args.prompt_len).tolist()], sp1)
            dev.synchronize()
        print(f"\nprefill of {args.prompt_len} tokens, {args.layers} layers: {walls[0] * 1e3:.1f} ms wall min, "
              f"{walls[len(walls) // 2] * 1e3:.1f} median of {len(walls)} (unprofiled)")
        _kernel_table(prof, 1, f"prefill of {args.prompt_len} tokens")
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
