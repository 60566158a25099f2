"""How a CPU decode step's work divides over the kernel pool's threads: per launch of the recorded decode graph,
each thread's busy time (its chunk of programs) and the launch's span, in the graph's real order (weights and
KV cache as cold or warm as they are in a real step), summed per kernel (issue 12: 2-thread scaling at c=16).

    JITKERN_NUM_THREADS=2 .venv/bin/python perf/profile_threads_cpu.py [--concurrency 16] [--steps 8] [--rounds 20]

Every launch of the graph is replayed through a small JIT-compiled wrapper that reads the time-stamp counter
before and after calling the kernel on its thread's chunk (the pool's static split: thread t runs the t-th of
T contiguous chunks of the flat program ids) and stores the pair under that thread. --steps decode steps run
first (the context then is input-len + steps). Output: the best round's per-kernel table (span = first start
to last end over the threads; "lost" = span - mean busy: idle time waiting for the slowest thread, plus wake-up
latency), then the per-launch minimum over rounds (robust to other processes' time slices on a shared host).
A kernel whose chunks are unequal shows busy t0 != busy t1 (e.g. a grid whose programs with work all sit in
one chunk).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# wrap(args = [fn, kernel args, record ptr, n, T], begin, end): record[2t], record[2t + 1] = TSC before / after
_WRAP_IR = r"""
declare i64 @llvm.readcyclecounter()
define void @jk_timed(ptr %a, i64 %b, i64 %e) {
  %fn = load ptr, ptr %a, align 8
  %p1 = getelementptr i64, ptr %a, i64 1
  %ra = load ptr, ptr %p1, align 8
  %p2 = getelementptr i64, ptr %a, i64 2
  %rec = load ptr, ptr %p2, align 8
  %p3 = getelementptr i64, ptr %a, i64 3
  %n = load i64, ptr %p3, align 8
  %p4 = getelementptr i64, ptr %a, i64 4
  %T = load i64, ptr %p4, align 8
  %q = udiv i64 %n, %T
  %r = urem i64 %n, %T
  %q1 = add i64 %q, 1
  %thr = mul i64 %r, %q1
  %lo = icmp ult i64 %b, %thr
  %qs = select i1 %lo, i64 1, i64 %q
  %qd = select i1 %lo, i64 %q1, i64 %qs
  %off = sub i64 %b, %thr
  %bb = select i1 %lo, i64 %b, i64 %off
  %k = udiv i64 %bb, %qd
  %base = select i1 %lo, i64 0, i64 %r
  %t = add i64 %base, %k
  %t0 = call i64 @llvm.readcyclecounter()
  call void %fn(ptr %ra, i64 %b, i64 %e)
  %t1 = call i64 @llvm.readcyclecounter()
  %s0 = shl i64 %t, 1
  %g0 = getelementptr i64, ptr %rec, i64 %s0
  store i64 %t0, ptr %g0, align 8
  %s1 = add i64 %s0, 1
  %g1 = getelementptr i64, ptr %rec, i64 %s1
  store i64 %t1, ptr %g1, align 8
  ret void
}
define i64 @jk_tsc() {
  %t = call i64 @llvm.readcyclecounter()
  ret i64 %t
}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=37)
    ap.add_argument("--steps", type=int, default=8, help="decode steps before profiling (context = input + steps)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    import profile_decode_cpu
    labels = profile_decode_cpu._names()        # before the engine compiles anything
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    from jitkern.runtime.cpu_pool import NativeLibrary, get_pool
    lib = NativeLibrary(_WRAP_IR, ["jk_timed", "jk_tsc"], name="profile_threads")
    tsc = ctypes.CFUNCTYPE(ctypes.c_int64)(lib["jk_tsc"])
    eng = LLMEngine(EngineArgs(model=args.model, max_num_seqs=max(64, args.concurrency)))
    rng = np.random.default_rng(0)
    C = args.concurrency
    for i in range(C):
        eng.add_request(f"p{i}", [int(t) for t in rng.integers(0, eng.config.vocab_size, args.input_len)],
                        SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True,
                                       detokenize=False))
    for _ in range(max(2, args.steps)):
        eng.step()
    g = eng.runner._graphs[C][0]
    pool = get_pool()
    T = pool.num_threads
    ents = [(a, b, n) for a, b, n in g.entries if n > 0]
    L = len(ents)
    rec = np.zeros((L, 2 * T), np.int64)
    blocks = np.zeros((L, 5), np.int64)
    for i, (a, b, n) in enumerate(ents):
        blocks[i] = (a, b.__array_interface__["data"][0], rec[i].__array_interface__["data"][0], n, T)
    tasks = np.array([(lib["jk_timed"], blocks[i].__array_interface__["data"][0], n)
                      for i, (a, b, n) in enumerate(ents)], np.int64)
    c0, p0 = tsc(), time.perf_counter()
    time.sleep(0.2)
    ghz = (tsc() - c0) / (time.perf_counter() - p0) / 1e9
    walls, recs = [], []
    for _ in range(args.rounds):
        rec[:] = 0
        t = time.perf_counter()
        pool.launch_tasks(tasks)
        walls.append(time.perf_counter() - t)
        recs.append(rec.copy())
    R = np.stack(recs).astype(np.float64).reshape(args.rounds, L, T, 2) / (ghz * 1e6)     # ms
    ran = R[..., 1] > 0
    busy = np.where(ran, R[..., 1] - R[..., 0], 0.0)                                       # rounds x L x T
    start = np.where(ran, R[..., 0], np.inf).min(-1)
    end = np.where(ran, R[..., 1], -np.inf).max(-1)
    span = end - start
    labs = [labels.get(a, hex(a)) + f" [{n} programs]" for a, b, n in ents]
    print(f"load average {os.getloadavg()[0]:.2f}; {C} sequences at context {args.input_len + args.steps}; {T} "
          f"threads; {L} launches; graph replay best {1e3 * min(walls):.2f} ms, median "
          f"{1e3 * statistics.median(walls):.2f} ms ({args.rounds} rounds)")

    def table(title, sp, bu):
        agg = collections.defaultdict(lambda: [0, 0.0, np.zeros(T)])
        for j, lab in enumerate(labs):
            e = agg[lab]
            e[0] += 1
            e[1] += sp[j]
            e[2] += bu[j]
        tot_sp = sum(e[1] for e in agg.values())
        tot_bu = sum(e[2] for e in agg.values())
        print(f"\n{title}: span sum {tot_sp:.2f} ms; busy per thread " + " / ".join(f"{x:.2f}" for x in tot_bu) + " ms")
        print("| kernel | launches | span ms | busy ms per thread | lost ms (span - mean busy) |\n|---|---|---|---|---|")
        for lab, (c, s, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"| {lab} | {c} | {s:.3f} | " + " / ".join(f"{x:.3f}" for x in b) + f" | {s - b.mean():.3f} |")
    best = int(np.argmin(walls))
    table(f"best round ({1e3 * walls[best]:.2f} ms)", span[best], busy[best])
    table("per-launch minimum over rounds", span.min(0), busy.min(0))
    eng.close()


if __name__ == "__main__":
    main()
