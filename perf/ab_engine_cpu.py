"""The shared harness of the CPU engine A/B scripts (perf/ab_decode_cpu.py, perf/ab_gemv_prefetch_cpu.py): the
embedded model's engine with 1 kernel thread, decode tokens per second of the engine thread's CPU time (robust
to other processes' load), rounds alternating the order of the variants (round 0 warms up: compiles, records
graphs), decode graphs re-recorded at each switch, and a check that the greedy tokens agree.

A script passes its variants as {name: callable that switches the engine to it} (two of them), the
concurrencies and the rounds; `run_ab` prints one line a round and the best / median per variant.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ["JITKERN_NUM_THREADS"] = "1"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "perf"))

import numpy as np  # noqa: E402

import bench  # noqa: E402


def open_engine(concurrency: str, output_len: int):
    """bench.py's runner of our engine (the embedded model) and 37-token random prompts for each request."""
    ours = bench.OursRunner(bench._parse(["--concurrency", concurrency, "--output-len", str(output_len)]))
    rng = np.random.default_rng(0)
    n = max(int(c) for c in concurrency.split(","))
    return ours, [rng.integers(0, ours.vocab_size, 37).tolist() for _ in range(n)]


def _wave(ours, prompts, c: int, output_len: int, clock=time.thread_time):
    """c requests at once to the end: (decode tokens per second of `clock` (default: this thread's CPU time;
    time.perf_counter for wall clock), each request's tokens)."""
    eng = ours.engine
    ps = ours._params(output_len)
    ids = []
    for i in range(c):
        rid = f"ab-{time.monotonic_ns()}-{i}"
        eng.add_request(rid, list(prompts[i]), ps)
        ids.append(rid)
    got, t0, n0 = {}, None, 0
    while len([r for r in ids if got.get(r, (0, False))[1]]) < c:
        if t0 is None and len(got) == c and all(v[0] >= 1 for v in got.values()):
            t0 = clock()                       # every request past its prompt: decode from here
            n0 = sum(v[0] for v in got.values())
        for o in eng.step():
            got[o.request_id] = (len(o.outputs[0].token_ids), o.finished, list(o.outputs[0].token_ids))
    return (sum(v[0] for v in got.values()) - n0) / (clock() - t0), [got[r][2] for r in ids]


def run_ab(ours, prompts, variants: dict, conc, rounds: int, output_len: int, label: str = "") -> dict:
    """Alternates the two variants over rounds; prints per round and a summary; returns {(name, c): [tok/s]}."""
    names = list(variants)
    res, toks = {}, {}
    for r in range(rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            variants[name]()
            ours.engine.runner._graphs.clear()
            for c in conc:
                tps, tk = _wave(ours, prompts, c, output_len)
                if r > 0:
                    res.setdefault((name, c), []).append(tps)
                toks[(name, c)] = tk
        if r > 0:
            print(f"round {r} load {os.getloadavg()[0]:.1f}: " + ", ".join(
                f"{k[0]} c={k[1]} {v[-1]:.1f}" for k, v in sorted(res.items())), flush=True)
    a, b = names
    for c in conc:
        x, y = res[(a, c)], res[(b, c)]
        print(f"c={c} (decode tok/s per CPU-second, 1 thread): {a} best/median {max(x):.1f} / "
              f"{statistics.median(x):.1f}; {b}{label} {max(y):.1f} / {statistics.median(y):.1f}; "
              f"ratio best {max(y) / max(x):.3f}, median {statistics.median(y) / statistics.median(x):.3f}")
        same = sum(p == q for p, q in zip(toks[(a, c)], toks[(b, c)]))
        print(f"  greedy sequences identical {a} vs {b}: {same}/{c}")
    return res
