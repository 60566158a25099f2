"""Benchmark: every GGUF type jitkern computes on its compressed blocks, GEMV (decode) and GEMM (prefill /
batched decode) at the default model's shapes (SmolLM2-135M).

    .venv/bin/python perf/bench_quant_types.py [--threads 2] [--qtypes q8_0,...] [--gemm-m 64] [--reps 7]

Shapes (N x K): the down projection 576 x 1536 for every type (K = 1536 is a whole number of 256-element
super-blocks), and gate/up 1536 x 576 for the 32-element types (K = 576 is not: llama.cpp's presets fall back
to q5_0 / q8_0 / iq4_nl there). Weights: random blocks (gguf.quants.quantize where it can, else random bytes
with sane f16 scales; speed does not depend on the values). Activations are quantised once beforehand
(`quantize_q8`, shared by q/k/v or gate/up in the engine), so the rows time the matmul kernel alone:

  GEMV cold   M = 1; one captured launch per copy of the weight, copies together > 192 MB, replayed, so every
              call streams its weight from DRAM (the decode case); GB/s = weight bytes / time, GOP/s = 2 N K / time
  GEMM        M = --gemm-m tokens on one weight (hot in the caches); GOP/s = 2 M N K / time

Printed with the CPU tier that ran, the thread count and a streaming-read bandwidth probe (a jitkern kernel
summing 256 MB) for scale. The host is shared: numbers move with other processes' load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--threads", type=int, default=int(os.environ.get("JITKERN_NUM_THREADS", "2")))
ap.add_argument("--qtypes", default="q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,mxfp4,q2_K,q3_K,q4_K,q5_K,q6_K,iq4_xs,fp8-channel,"
                                    "fp8-block", help="GGUF types, and fp8-tensor / fp8-channel / fp8-block "
                                                      "(engine/ops/fp8.py: e4m3 bytes, f32 activations)")
ap.add_argument("--gemm-m", type=int, default=64)
ap.add_argument("--reps", type=int, default=7)
ARGS = ap.parse_args()
os.environ.setdefault("JITKERN_NUM_THREADS", str(ARGS.threads))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import jitkern as jk  # noqa: E402
from jitkern.compiler import default_target  # noqa: E402
from engine.ops import quant as Q  # noqa: E402

COLD_BYTES = 192e6
_F16_FIELDS = {"q2_K": (80, 82), "q3_K": (108,), "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "iq4_nl": (0,),
               "iq4_xs": (0,)}


def make_weight(qtype, N, K, rng):
    import gguf
    import gguf.quants as gq
    gt = gguf.GGMLQuantizationType[qtype.upper()]
    if qtype in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"):
        return np.ascontiguousarray(gq.quantize(rng.standard_normal((N, K), dtype=np.float32), gt))
    q = Q.QTYPES[qtype]
    raw = rng.integers(0, 256, (N, K // q.block_elems, q.block_bytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        raw[:, :, off:off + 2] = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16).view(
            np.uint8).reshape(raw.shape[:2] + (2,))
    return np.ascontiguousarray(raw.reshape(N, -1))


def timeit(fn, reps):
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@jk.kernel
def _stream_sum(x, out, n_per, BLOCK: jk.constexpr):
    base = jk.program_id(0).to(jk.i64) * n_per
    acc = jk.zeros((BLOCK,), jk.f32)
    for i in range(0, n_per, BLOCK):
        acc += jk.load(x + base + i + jk.arange(0, BLOCK))
    jk.store(out + jk.program_id(0), jk.sum(acc))


def bandwidth_gbs(reps) -> float:
    x = np.random.default_rng(1).random((256 << 20) // 4, dtype=np.float32)
    out = np.zeros(64, np.float32)
    return x.nbytes / timeit(lambda: _stream_sum[(64,)](x, out, x.size // 64, BLOCK=256), reps) / 1e9


def fp8_row(qtype, N, K, rng):
    from engine.ops.fp8 import matmul_fp8
    kind = qtype.split("-")[1]
    w = rng.integers(0, 256, (N, K), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    s = {"tensor": np.ones(1, np.float32), "channel": np.ones(N, np.float32),
         "block": np.ones((-(-N // 128), -(-K // 128)), np.float32)}[kind]
    x1 = rng.standard_normal(K).astype(np.float32)
    out1 = np.empty(N, np.float32)
    copies = [w] + [w.copy() for _ in range(max(1, int(COLD_BYTES // w.nbytes)))]
    with jk.capture() as g:
        for c in copies:
            matmul_fp8(x1, c, s, out=out1)
    t1 = timeit(g.replay, ARGS.reps) / len(copies)
    M = ARGS.gemm_m
    xm = rng.standard_normal((M, K)).astype(np.float32)
    outm = np.empty((M, N), np.float32)
    with jk.capture() as gm:
        matmul_fp8(xm, w, s, out=outm)
    tm = timeit(lambda: [gm.replay() for _ in range(10)], ARGS.reps) / 10
    print(f"| {qtype} | {N} x {K} | 8 | {default_target().name} | {t1 * 1e6:.1f} | {w.nbytes / t1 / 1e9:.1f} | "
          f"{2 * N * K / t1 / 1e9:.1f} | {2 * M * N * K / tm / 1e9:.1f} |", flush=True)


def row(qtype, N, K, rng):
    if qtype.startswith("fp8"):
        return fp8_row(qtype, N, K, rng)
    raw = make_weight(qtype, N, K, rng)
    T = default_target()
    x1 = rng.standard_normal(K).astype(np.float32)
    xq1 = Q.quantize_q8(x1, layout=Q.act_layout(qtype, 1))
    out1 = np.empty(N, np.float32)
    copies = [raw] + [raw.copy() for _ in range(max(1, int(COLD_BYTES // raw.nbytes)))]
    with jk.capture() as g:
        for w in copies:
            Q.matmul_q8(xq1, w, qtype, N, K, out=out1)
    t1 = timeit(g.replay, ARGS.reps) / len(copies)
    M = ARGS.gemm_m
    xm = rng.standard_normal((M, K)).astype(np.float32)
    xqm = Q.quantize_q8(xm, layout=Q.act_layout(qtype, M), rep4=True)
    outm = np.empty((M, N), np.float32)
    with jk.capture() as gm:
        Q.matmul_q8(xqm, raw, qtype, N, K, out=outm)
    tm = timeit(lambda: [gm.replay() for _ in range(10)], ARGS.reps) / 10
    bpw = Q.QTYPES[qtype].block_bytes * 8 / Q.QTYPES[qtype].block_elems
    print(f"| {qtype} | {N} x {K} | {bpw:.4g} | {T.name} | {t1 * 1e6:.1f} | {raw.nbytes / t1 / 1e9:.1f} | "
          f"{2 * N * K / t1 / 1e9:.1f} | {2 * M * N * K / tm / 1e9:.1f} |", flush=True)


def main():
    rng = np.random.default_rng(0)
    print(f"threads {os.environ['JITKERN_NUM_THREADS']}, tier {default_target().name}, streaming read "
          f"{bandwidth_gbs(ARGS.reps):.1f} GB/s, load average {os.getloadavg()[0]:.2f}")
    print(f"| qtype | N x K | bits/weight | tier | GEMV cold us | GEMV GB/s | GEMV GOP/s | GEMM M={ARGS.gemm_m} GOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for qt in [q for q in ARGS.qtypes.split(",") if q]:
        row(qt, 576, 1536, rng)
        if not qt.startswith("fp8") and Q.QTYPES[qt].block_elems == 32:
            row(qt, 1536, 576, rng)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
