"""A/B of the 32-element quantised matmul's CPU variants in one process (issue 12): each configuration's launch
recorded as a graph, replayed alternately round by round (ROUNDS, default 7), one thread's CPU time, best kept.

    .venv/bin/python perf/ab_quant_cpu.py QTYPE N K M CFG [CFG ...]
    e.g. perf/ab_quant_cpu.py q8_0 49152 576 16 "halves=0,tt=0" "tt=0" ""

CFG: comma-separated switches, empty = the current defaults: halves=0/1 (q8_0 'halves' order, `_q8_halves`),
fold=0/1 (2 float lanes for q4 on 256-bit tiers, `_fold_lanes`), tt=0/1 (tokens in the lanes for one-row
q8_0 tiles, `_TOKEN_LANES`), tile=BMxR (QMM_TILE_OVERRIDE), pf=ROWS
(the M = 1 GEMV's prefetch distance in rows, 0 = off: GEMV_PREFETCH_ROWS), pfl=0..3 (its locality),
route=madd/dot4 (the 4-bit GEMM's integer-dot route, QMM_GEMM_DOT_ROUTE), tg=N (tokens per group of the VNNI
GEMM tiles, 0 = off: QMM_TOKEN_GROUP). Prints ms, GOP/s and the largest difference from
the first configuration's output (0 where only the integer route changed)."""
import os, sys, time
os.environ.setdefault("JITKERN_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from engine.ops import quant
from jitkern.runtime.launch import capture
qt, N, K, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfgs = sys.argv[5:]
rng = np.random.default_rng(0)
q = quant.QTYPES[qt]
raw = rng.integers(0, 255, N * quant.row_bytes(qt, K), dtype=np.uint8)
blocks = raw.reshape(-1, q.block_bytes)
nb = 4 if qt == "q4_1" else 2
blocks[:, :nb] = (rng.random((blocks.shape[0], nb // 2)) * 0.01).astype(np.float16).view(np.uint8)
x = rng.standard_normal((M, K)).astype(np.float32)
orig_halves = quant._q8_halves
orig_fold = quant._fold_lanes
orig_pf = (quant.GEMV_PREFETCH_ROWS, quant.GEMV_PREFETCH_LOCALITY)
orig_tg = quant.QMM_TOKEN_GROUP
def setcfg(c):
    d = dict(kv.split("=") for kv in c.split(",") if kv)
    quant._TOKEN_LANES = d.get("tt", "1") == "1"
    quant._fold_lanes = (lambda *a: d["fold"] == "1") if "fold" in d else orig_fold
    quant._q8_halves = (lambda t: d["halves"] == "1") if "halves" in d else orig_halves
    quant.QMM_TILE_OVERRIDE = tuple(int(v) for v in d["tile"].split("x")) if "tile" in d else None
    quant.GEMV_PREFETCH_ROWS = int(d["pf"]) if "pf" in d else orig_pf[0]
    quant.GEMV_PREFETCH_LOCALITY = int(d["pfl"]) if "pfl" in d else orig_pf[1]
    quant.QMM_GEMM_DOT_ROUTE = d.get("route")
    quant.QMM_TOKEN_GROUP = int(d["tg"]) if "tg" in d else orig_tg
graphs = []
for c in cfgs:
    setcfg(c)
    xq = quant.quantize_q8(x, layout=quant.act_layout(qt, M), rep4=True)
    out = np.empty((M, N), np.float32)
    quant.matmul_q8(xq, raw, qt, N, K, out=out)
    with capture() as g:
        quant.matmul_q8(xq, raw, qt, N, K, out=out)
    graphs.append((g, out))
reps = max(3, int(5e7 // (M * N * K)))
best = [1e9] * len(cfgs)
for _ in range(int(os.environ.get("ROUNDS", "7"))):
    for i, (g, _) in enumerate(graphs):
        t = time.thread_time()
        for _ in range(reps):
            g.replay()
        best[i] = min(best[i], (time.thread_time() - t) / reps)
for c, b, (g, out) in zip(cfgs, best, graphs):
    print(f"{qt} N={N} K={K} M={M} [{c}]: {b*1e3:.3f} ms {2*M*N*K/b/1e9:.1f} GOP/s  maxdiff vs first {np.abs(out - graphs[0][1]).max():.3g}")
