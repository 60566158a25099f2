"""Engine decode with the CPU GEMV's software prefetch off / on in one process (engine.ops.quant
GEMV_PREFETCH_ROWS): 1 thread, decode tokens per second of the engine thread's CPU time (robust to other
processes' load), rounds alternating the order, decode graphs re-recorded at each switch; checks that the
greedy tokens are identical both ways (harness: perf/ab_engine_cpu.py).

    .venv/bin/python perf/ab_gemv_prefetch_cpu.py [--rounds 4] [--concurrency 1] [--output-len 64] [--rows 16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_engine_cpu import open_engine, run_ab  # noqa: E402  (sets 1 kernel thread before jitkern loads)

from engine.ops import quant  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--concurrency", default="1")
ap.add_argument("--output-len", type=int, default=64)
ap.add_argument("--rows", type=int, default=quant.GEMV_PREFETCH_ROWS or 16, help="the 'on' prefetch distance")
a = ap.parse_args()
ours, prompts = open_engine(a.concurrency, a.output_len)
run_ab(ours, prompts, {"off": lambda: setattr(quant, "GEMV_PREFETCH_ROWS", 0),
                       "on": lambda: setattr(quant, "GEMV_PREFETCH_ROWS", a.rows)},
       [int(c) for c in a.concurrency.split(",")], a.rounds, a.output_len, label=f" ({a.rows} rows)")
ours.close()
