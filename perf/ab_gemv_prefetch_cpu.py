"""Engine decode with the CPU GEMV's software prefetch off / on in one process (jitkern.ops.quant
GEMV_PREFETCH_ROWS): 1 thread, decode tokens per second of the engine thread's CPU time (robust to other
processes' load), rounds alternating the order, decode graphs re-recorded at each switch; checks that the
greedy tokens are identical both ways.

    .venv/bin/python perf/ab_gemv_prefetch_cpu.py [--rounds 4] [--concurrency 1] [--output-len 64] [--rows 16]
"""
import os, sys, time, statistics, argparse
os.environ["JITKERN_NUM_THREADS"] = "1"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT); sys.path.insert(0, os.path.join(_ROOT, "perf"))
import numpy as np
import bench
from jitkern.ops import quant
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--concurrency", default="1")
ap.add_argument("--output-len", type=int, default=64)
ap.add_argument("--rows", type=int, default=quant.GEMV_PREFETCH_ROWS or 16, help="the 'on' prefetch distance")
a = ap.parse_args()
conc = [int(c) for c in a.concurrency.split(",")]
args = bench._parse(["--concurrency", a.concurrency, "--output-len", str(a.output_len)])
ours = bench.OursRunner(args)
eng = ours.engine
runner = eng.runner
rng = np.random.default_rng(0)
prompts = [rng.integers(0, ours.vocab_size, 37).tolist() for _ in range(max(conc))]
cfgs = {"off": 0, "on": a.rows}


def use(rows):
    quant.GEMV_PREFETCH_ROWS = rows
    runner._graphs.clear()


def wave(c):
    ps = ours._params(a.output_len)
    ids = []
    for i in range(c):
        rid = f"ab-{time.monotonic_ns()}-{i}"
        eng.add_request(rid, list(prompts[i]), ps)
        ids.append(rid)
    got, t0, n0 = {}, None, 0
    while len([r for r in ids if got.get(r, (0, False))[1]]) < c:
        if t0 is None and len(got) == c and all(v[0] >= 1 for v in got.values()):
            t0 = time.thread_time(); n0 = sum(v[0] for v in got.values())
        for o in eng.step():
            got[o.request_id] = (len(o.outputs[0].token_ids), o.finished, list(o.outputs[0].token_ids))
    dt = time.thread_time() - t0
    return (sum(v[0] for v in got.values()) - n0) / dt, [got[r][2] for r in ids]


res, toks = {}, {}
for r in range(a.rounds + 1):          # round 0: warm-up (compiles, records graphs)
    order = ("off", "on") if r % 2 == 0 else ("on", "off")
    for name in order:
        use(cfgs[name])
        for c in conc:
            tps, tk = wave(c)
            if r > 0:
                res.setdefault((name, c), []).append(tps)
            toks[(name, c)] = tk
    if r > 0:
        print(f"round {r} load {os.getloadavg()[0]:.1f}: " + ", ".join(f"{k[0]} c={k[1]} {v[-1]:.1f}"
                                                                      for k, v in sorted(res.items())), flush=True)
for c in conc:
    o, n = res[("off", c)], res[("on", c)]
    print(f"c={c} (decode tok/s per CPU-second, 1 thread): prefetch off best/median {max(o):.1f} / "
          f"{statistics.median(o):.1f}; on ({a.rows} rows) {max(n):.1f} / {statistics.median(n):.1f}; "
          f"ratio best {max(n) / max(o):.3f}, median {statistics.median(n) / statistics.median(o):.3f}")
    same = sum(x == y for x, y in zip(toks[("off", c)], toks[("on", c)]))
    print(f"  greedy sequences identical off vs on: {same}/{c}")
ours.close()
