"""The quantised matmuls of one SmolLM2-135M decode step at concurrency M (default 16), on the CPU, timed in
thread CPU time on one thread (robust to other processes' load on a shared host; issue 12).

    .venv/bin/python perf/bench_decode_gemm_cpu.py [--m 16] [--rounds 7]

Shapes (N x K, launches per step) are those of the embedded Q4_1 GGUF: q/k/v 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536 (30 layers each, q4_1) and the tied q8_0 head 49152 x 576 (once). Weights are
random blocks with small f16 scales (speed does not depend on the values), activations quantised once
beforehand (as the engine shares one quantisation between the weights of one input). Each matmul is recorded as
a graph and replayed; the rows are interleaved round by round, best of --rounds kept.
Prints per shape ms / GOP/s and the step's total (ms of one thread's CPU time: about twice the wall time of a
2-thread step's matmuls on an idle host).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["JITKERN_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SHAPES = [("q4_1", 960, 576, 30), ("q4_1", 576, 576, 30), ("q4_1", 3072, 576, 30), ("q4_1", 576, 1536, 30),
          ("q8_0", 49152, 576, 1)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=16, help="tokens per step (decode concurrency)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    from engine.ops import quant
    from jitkern.runtime.cpu import runtime_target
    from jitkern.runtime.launch import capture
    rng = np.random.default_rng(0)
    M = args.m
    rows = []
    for qt, N, K, count in SHAPES:
        q = quant.QTYPES[qt]
        raw = rng.integers(0, 256, N * quant.row_bytes(qt, K), dtype=np.uint8)
        blocks = raw.reshape(-1, q.block_bytes)
        nsc = 2 if qt == "q4_1" else 1                      # f16 d (and m) at the start of each block
        blocks[:, :2 * nsc] = (rng.random((blocks.shape[0], nsc)) * 0.01).astype(np.float16).view(np.uint8)
        x = rng.standard_normal((M, K)).astype(np.float32)
        xq = quant.quantize_q8(x, layout=quant.act_layout(qt, M), rep4=M > 1)
        out = np.empty((M, N), np.float32)
        quant.matmul_q8(xq, raw, qt, N, K, out=out)        # compile
        with capture() as g:
            quant.matmul_q8(xq, raw, qt, N, K, out=out)
        reps = max(3, int(5e7 // (M * N * K)))
        rows.append([qt, N, K, count, g, reps, float("inf")])
    for _ in range(args.rounds):
        for r in rows:
            g, reps = r[4], r[5]
            t = time.thread_time()
            for _ in range(reps):
                g.replay()
            r[6] = min(r[6], (time.thread_time() - t) / reps)
    print(f"tier {runtime_target().name}, 1 thread, M = {M}, load average {os.getloadavg()[0]:.1f}")
    print("| weight | N x K | ms | GOP/s | per step ms |\n|---|---|---|---|---|")
    total = 0.0
    for qt, N, K, count, _, _, best in rows:
        total += best * count
        print(f"| {qt} | {N} x {K} | {best * 1e3:.3f} | {2 * M * N * K / best / 1e9:.1f} | {best * count * 1e3:.2f} |")
    print(f"| total | | | | {total * 1e3:.2f} |")


if __name__ == "__main__":
    main()
