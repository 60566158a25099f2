"""Engine decode before / after issue 12's CPU changes in one process (1 thread, decode tokens per second of the
engine thread's CPU time, robust to other processes' load): 'old' switches them off (q8_0 natural order on
256-bit tiers, 4 float lanes for q4, per-token lane sums in the head, the argmax as its own launch), 'new' is
the default; rounds alternate the order, decode graphs re-recorded at each switch.

    .venv/bin/python perf/ab_decode_cpu.py [--rounds 4] [--concurrency 1,16] [--output-len 64]
"""
import os, sys, time, statistics, argparse
os.environ["JITKERN_NUM_THREADS"] = "1"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT); sys.path.insert(0, os.path.join(_ROOT, "perf"))
import numpy as np
import bench
from jitkern.ops import quant
from jitkern.compiler import default_target
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--concurrency", default="16")
ap.add_argument("--output-len", type=int, default=64)
a = ap.parse_args()
conc = [int(c) for c in a.concurrency.split(",")]
args = bench._parse(["--concurrency", a.concurrency, "--output-len", str(a.output_len)])
ours = bench.OursRunner(args)
eng = ours.engine
runner = eng.runner
rng = np.random.default_rng(0)
V = ours.vocab_size
prompts = [rng.integers(0, V, 37).tolist() for _ in range(max(conc))]
new_f = (quant._q8_halves, quant._fold_lanes, runner._record_greedy)
def old_halves(t):
    return (t or default_target()).vector_bits >= 512
old_f = (old_halves, lambda *x: False, lambda *x: None)
def use(f):
    quant._q8_halves, quant._fold_lanes, runner._record_greedy = f
    quant._TOKEN_LANES = f is new_f
    runner._graphs.clear()
def wave(c):
    ps = ours._params(a.output_len)
    ids = []
    for i in range(c):
        rid = f"ab-{time.monotonic_ns()}-{i}"
        eng.add_request(rid, list(prompts[i]), ps)
        ids.append(rid)
    got = {}
    t0 = None
    n = 0
    while len([r for r in ids if got.get(r, (0, False))[1]]) < c:
        if t0 is None and len(got) == c and all(v[0] >= 1 for v in got.values()):
            t0 = time.thread_time(); n0 = sum(v[0] for v in got.values())
        for o in eng.step():
            got[o.request_id] = (len(o.outputs[0].token_ids), o.finished, list(o.outputs[0].token_ids))
    dt = time.thread_time() - t0
    n = sum(v[0] for v in got.values()) - n0
    return n / dt, [got[r][2] for r in ids]
res = {}
toks = {}
for r in range(a.rounds + 1):
    order = (("old", old_f), ("new", new_f)) if r % 2 == 0 else (("new", new_f), ("old", old_f))
    for name, f in order:
        use(f)
        for c in conc:
            tps, tk = wave(c)
            if r > 0:
                res.setdefault((name, c), []).append(tps)
            toks[(name, c)] = tk
    if r > 0:
        print(f"round {r} load {os.getloadavg()[0]:.1f}: " + ", ".join(f"{k[0]} c={k[1]} {v[-1]:.1f}" for k, v in sorted(res.items())), flush=True)
for c in conc:
    o, nw = res[("old", c)], res[("new", c)]
    print(f"c={c} (CPU tok/s, 1 thread): old best/median {max(o):.1f} / {statistics.median(o):.1f}; new {max(nw):.1f} / {statistics.median(nw):.1f}; ratio best {max(nw)/max(o):.3f}")
    print(f"  greedy sequences identical old vs new: {sum(x == y for x, y in zip(toks[('old', c)], toks[('new', c)]))}/{c}")
ours.close()
