"""Engine decode before / after issue 12's CPU changes in one process (1 thread, decode tokens per second of the
engine thread's CPU time, robust to other processes' load): 'old' switches them off (q8_0 natural order on
256-bit tiers, 4 float lanes for q4, per-token lane sums in the head, the argmax as its own launch), 'new' is
the default; rounds alternate the order, decode graphs re-recorded at each switch (harness:
perf/ab_engine_cpu.py).

    .venv/bin/python perf/ab_decode_cpu.py [--rounds 4] [--concurrency 1,16] [--output-len 64]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_engine_cpu import open_engine, run_ab  # noqa: E402  (sets 1 kernel thread before jitkern loads)

from jitkern.compiler import default_target  # noqa: E402
from engine.ops import quant  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--concurrency", default="16")
ap.add_argument("--output-len", type=int, default=64)
a = ap.parse_args()
ours, prompts = open_engine(a.concurrency, a.output_len)
runner = ours.engine.runner
new_f = (quant._q8_halves, quant._fold_lanes, runner._record_greedy)
old_f = (lambda t: (t or default_target()).vector_bits >= 512, lambda *x: False, lambda *x: None)


def use(f):
    quant._q8_halves, quant._fold_lanes, runner._record_greedy = f
    quant._TOKEN_LANES = f is new_f


run_ab(ours, prompts, {"old": lambda: use(old_f), "new": lambda: use(new_f)},
       [int(c) for c in a.concurrency.split(",")], a.rounds, a.output_len)
ours.close()
