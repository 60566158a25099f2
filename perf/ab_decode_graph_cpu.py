"""A/B of a module flag on the CPU decode graph: the c=C graph recorded with the flag off and with it on, in one
engine, then the two replayed alternately; per kernel, each pool thread's busy time and the launch spans
(perf/profile_threads_cpu.py's wrapper). For flags that change how kernels run but not what they compute
(program order, tiles, prefetches): both graphs replay on the same engine buffers.

    JITKERN_NUM_THREADS=2 .venv/bin/python perf/ab_decode_graph_cpu.py engine.ops.quant.QMM_ROWS_OUTER \
        [--concurrency 16] [--steps 60] [--rounds 30] [--values A B]

--values A B: Python literals for the two variants instead of False / True, e.g.
`engine.ops.quant.QMM_TILE_OVERRIDE --values None "(8, 4)"`.

The off graph is recorded after --steps decode steps and the on graph after --steps more, so both replay at
context input-len + 2 x steps. Output per variant: the plain graph's best / median replay, the sum over
launches of each launch's minimum span and busy times over rounds (robust to other processes' time slices),
and per kernel the per-round busy time (mean over threads) median / best and span median / best.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("flag", help="module.attribute to set False (A) and True (B), e.g. engine.ops.quant.QMM_ROWS_OUTER")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=37)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--values", nargs=2, default=None, metavar=("A", "B"),
                    help="Python literals for the two variants (default False True)")
    args = ap.parse_args(argv)
    import ast
    vals = tuple(ast.literal_eval(v) for v in args.values) if args.values else (False, True)
    import profile_decode_cpu
    import profile_threads_cpu
    labels = profile_decode_cpu._names()
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    from jitkern.runtime.cpu_pool import NativeLibrary, get_pool
    modname, attr = args.flag.rsplit(".", 1)
    mod = importlib.import_module(modname)
    if not hasattr(mod, attr):
        raise SystemExit(f"{modname} has no attribute {attr!r}")
    orig = getattr(mod, attr)
    lib = NativeLibrary(profile_threads_cpu._WRAP_IR, ["jk_timed", "jk_tsc"], name="ab_decode_graph")
    eng = LLMEngine(EngineArgs(max_num_seqs=max(64, args.concurrency)))
    rng = np.random.default_rng(0)
    C = args.concurrency
    for i in range(C):
        eng.add_request(f"p{i}", [int(t) for t in rng.integers(0, eng.config.vocab_size, args.input_len)],
                        SamplingParams(max_tokens=2 * args.steps + 64, temperature=0.0, ignore_eos=True,
                                       detokenize=False))
    graphs = {}
    for i, val in enumerate(vals):
        setattr(mod, attr, val)
        eng.runner._graphs.clear()
        for _ in range(max(2, args.steps)):
            eng.step()
        graphs[i] = eng.runner._graphs[C][0]
    setattr(mod, attr, orig)
    pool = get_pool()
    T = pool.num_threads
    tsc = ctypes.CFUNCTYPE(ctypes.c_int64)(lib["jk_tsc"])
    c0, p0 = tsc(), time.perf_counter()
    time.sleep(0.2)
    ghz = (tsc() - c0) / (time.perf_counter() - p0) / 1e9

    def prep(g):
        ents = [(a, b, n) for a, b, n in g.entries if n > 0]
        rec = np.zeros((len(ents), 2 * T), np.int64)
        blocks = np.zeros((len(ents), 5), np.int64)
        for i, (a, b, n) in enumerate(ents):
            blocks[i] = (a, b.__array_interface__["data"][0], rec[i].__array_interface__["data"][0], n, T)
        timed = np.array([(lib["jk_timed"], blocks[i].__array_interface__["data"][0], n)
                          for i, (a, b, n) in enumerate(ents)], np.int64)
        plain = np.array([(a, b.__array_interface__["data"][0], n) for a, b, n in ents], np.int64)
        return {"ents": ents, "rec": rec, "blocks": blocks, "timed": timed, "plain": plain, "walls": [], "recs": []}
    V = {k: prep(g) for k, g in graphs.items()}
    for r in range(args.rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            v = V[k]
            t = time.perf_counter()
            pool.launch_tasks(v["plain"])
            v["walls"].append(time.perf_counter() - t)
            v["rec"][:] = 0
            pool.launch_tasks(v["timed"])
            v["recs"].append(v["rec"].copy())
    print(f"load average {os.getloadavg()[0]:.2f}; {C} sequences at context {args.input_len + 2 * args.steps}; {T} "
          f"threads; {args.rounds} rounds alternating")
    for k in (0, 1):
        v = V[k]
        L = len(v["ents"])
        R = np.stack(v["recs"]).astype(np.float64).reshape(args.rounds, L, T, 2) / (ghz * 1e6)
        ran = R[..., 1] > 0
        busy = np.where(ran, R[..., 1] - R[..., 0], 0.0)
        span = np.where(ran, R[..., 1], -np.inf).max(-1) - np.where(ran, R[..., 0], np.inf).min(-1)
        print(f"\n{attr}={vals[k]!r}: plain graph best {1e3 * min(v['walls']):.2f} ms, median "
              f"{1e3 * statistics.median(v['walls']):.2f} ms; per-launch minimum: span sum {span.min(0).sum():.2f} ms, "
              "busy per thread " + " / ".join(f"{x:.2f}" for x in busy.min(0).sum(0)) + " ms")
        labs = [labels.get(a, hex(a)) + f" [{n} programs]" for a, b, n in v["ents"]]
        rows = []
        for lab in sorted(set(labs)):
            idx = [j for j, x in enumerate(labs) if x == lab]
            per_round = busy[:, idx, :].sum(1).mean(-1)
            sp = span[:, idx].sum(1)
            rows.append((np.median(sp), lab, len(idx), per_round, sp))
        print("| kernel | launches | busy per round median / best ms | span median / best ms |\n|---|---|---|---|")
        for _, lab, c, pr, sp in sorted(rows, key=lambda x: -x[0]):
            print(f"| {lab} | {c} | {np.median(pr):.3f} / {pr.min():.3f} | {np.median(sp):.3f} / {sp.min():.3f} |")
    eng.close()


if __name__ == "__main__":
    main()
