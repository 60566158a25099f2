"""Where a CPU decode step at concurrency C goes: host-side phases of LLMEngine.step and per-kernel time of the
recorded decode graph (issue 12).

    .venv/bin/python perf/profile_decode_cpu.py [--concurrency 16] [--input-len 37] [--steps 40] [--reps 20]
        [--model M]

1. C random prompts (seed 0) are prefilled; then --steps decode steps run through LLMEngine.step with the
   engine's phases timed (schedule, model runner prepare + graph replay, sampling, output processing).
2. The decode graph of batch C is replayed launch by launch (each launch --reps times in one native call, 3 such calls: best and median),
   grouped by kernel name and its constexprs that tell kernels apart (qmm tile, K, N): the sum is close to
   one replay's time, minus the barriers.
Output: two tables on stdout. The host is shared: run it more than once.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _names():
    """address -> label of every kernel compiled from now on (the graph stores addresses only)."""
    import jitkern.compiler as comp
    labels = {}
    orig = comp.compile_kernel

    def compile_kernel(kernel, params, consts, target):
        ck = orig(kernel, params, consts, target)
        keep = {k: v for k, v in consts.items() if k in ("BM", "R", "K", "S", "SPLIT", "BLOCK", "BLOCK_N")}
        dec = consts.get("DEC")
        lab = ck.name + (f"[{getattr(dec, '__name__', dec)}]" if dec is not None else "")
        if keep:
            lab += "(" + ",".join(f"{k}={v}" for k, v in keep.items()) + ")"
        labels[ck.address] = lab
        return ck
    comp.compile_kernel = compile_kernel
    return labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=37)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill graph of one --input-len prompt (per-kernel table only) instead of decode")
    ap.add_argument("--host-only", action="store_true",
                    help="replace the decode graph's replay by nothing and time --steps engine steps (thread CPU and "
                         "wall): the host-side cost per step (tokens are then picked from stale logits)")
    args = ap.parse_args(argv)
    labels = _names()             # before the engine compiles anything
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(model=args.model, max_num_seqs=max(64, args.concurrency)))
    rng = np.random.default_rng(0)
    V = eng.config.vocab_size
    C = args.concurrency
    for i in range(C):
        eng.add_request(f"p{i}", [int(t) for t in rng.integers(0, V, args.input_len)],
                        SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True, detokenize=False))
    runner = eng.runner
    if args.prefill:
        # the step that prefills the prompt(s) replays a graph keyed ("prefill", padded T, padded S)
        eng.step()
        keys = [k for k in runner._graphs if isinstance(k, tuple) and k[0] == "prefill"]
        if not keys:
            raise SystemExit("no prefill graph was recorded (graphs off, or the step ran eagerly)")
        g = runner._graphs[keys[-1]][0]
        reps = []
        for _ in range(10):
            t = time.perf_counter()
            g.replay()
            reps.append(time.perf_counter() - t)
        print(f"load average {os.getloadavg()[0]:.2f}; prefill graph {keys[-1]} of {C} x {args.input_len} tokens: "
              f"replay best {1e3 * min(reps):.2f} ms, median {1e3 * statistics.median(reps):.2f} ms")
        _per_launch(g, labels, args.reps)
        eng.close()
        return
    # prefill + a few decode steps (records the graph)
    for _ in range(8):
        eng.step()
    if args.host_only:
        g = runner._graphs[C][0]
        g.replay = lambda: None
        t, w = time.thread_time(), time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        print(f"load average {os.getloadavg()[0]:.2f}; {C} sequences; host side per decode step (graph replay "
              f"stubbed): {1e3 * (time.thread_time() - t) / args.steps:.3f} ms thread CPU, "
              f"{1e3 * (time.perf_counter() - w) / args.steps:.3f} ms wall")
        eng.close()
        return
    sched_t, exec_t, total_t = [], [], []
    orig_sched, orig_exec = eng.scheduler.schedule, runner.execute

    def sched():
        t = time.perf_counter()
        r = orig_sched()
        sched_t.append(time.perf_counter() - t)
        return r

    def execute(s):
        t = time.perf_counter()
        r = orig_exec(s)
        exec_t.append(time.perf_counter() - t)
        return r
    eng.scheduler.schedule, runner.execute = sched, execute
    replay_t = []
    g = runner._graphs[C][0]
    orig_replay = g.replay

    def replay():
        t = time.perf_counter()
        orig_replay()
        replay_t.append(time.perf_counter() - t)
    g.replay = replay
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        total_t.append(time.perf_counter() - t)
    g.replay = orig_replay
    med = statistics.median
    print(f"load average {os.getloadavg()[0]:.2f}; {C} sequences, {args.steps} decode steps")
    print("| phase | median ms | best ms |\n|---|---|---|")
    for name, xs in (("step (all)", total_t), ("schedule", sched_t), ("runner.execute", exec_t),
                     ("  graph replay", replay_t)):
        print(f"| {name} | {1e3 * med(xs):.2f} | {1e3 * min(xs):.2f} |")
    rest = [a - b for a, b in zip(total_t, exec_t)]
    rest = [a - b for a, b in zip(rest, sched_t)]
    prep = [a - b for a, b in zip(exec_t, replay_t)]
    print(f"| runner prepare (execute - replay) | {1e3 * med(prep):.2f} | {1e3 * min(prep):.2f} |")
    print(f"| sampling + output processing (step - schedule - execute) | {1e3 * med(rest):.2f} | {1e3 * min(rest):.2f} |")
    reps = []
    for _ in range(10):
        t = time.perf_counter()
        g.replay()
        reps.append(time.perf_counter() - t)
    print(f"| graph replay alone, 10 times | {1e3 * med(reps):.2f} | {1e3 * min(reps):.2f} |")

    _per_launch(g, labels, args.reps)
    eng.close()


def _per_launch(g, labels, nreps):
    """Each launch of graph g replayed nreps times in one native call: best / median per kernel label."""
    med = statistics.median
    from jitkern.runtime.cpu_pool import get_pool
    pool = get_pool()
    per = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for addr, block, n in g.entries:
        if n <= 0:
            continue
        ba = block.__array_interface__["data"][0]
        # the launch repeated --reps times in one native call (barriers between, as in a replay): the pool's
        # wake-up is paid once, not per launch
        tasks = np.array([(addr, ba, n)] * nreps, dtype=np.int64).reshape(-1, 3)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            pool.launch_tasks(tasks)
            ts.append((time.perf_counter() - t) / nreps)
        lab = labels.get(addr, hex(addr))
        e = per[lab]
        e[0] += min(ts)
        e[1] += med(ts)
        e[2] += 1
    tb = sum(v[0] for v in per.values())
    tm = sum(v[1] for v in per.values())
    print(f"\nper kernel, launches replayed one by one ({len(g.entries)} launches; sum best {1e3 * tb:.2f} ms, "
          f"sum median {1e3 * tm:.2f} ms)")
    print("| kernel | launches | best ms | median ms | share of best |\n|---|---|---|---|---|")
    for lab, (b, m, c) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"| {lab} | {c} | {1e3 * b:.3f} | {1e3 * m:.3f} | {100 * b / tb:.1f}% |")


if __name__ == "__main__":
    main()
