"""Wall-clock A/B of the 2-thread c=16 changes of 2026-12-02 (issue 12) in one engine, the variants alternating
round by round: "before" = the attention module at 06c0a37 (decode grid (sequences, partitions)) swapped in and
token-major GEMMs (QMM_ROWS_OUTER off); "after" = the tree's code. `split`: the CPU pool's static split ("before")
against its dynamic split (CpuPool.dynamic, "after"), the tree's kernels in both; `heads`: decode attention
without (before) and with (after) the per-KV-head programs for batches smaller than the thread count
(the CPU tier's tuning.decode_head_split; use --concurrency 1); `flag`: any module attribute, --flag module.attr set to the first of
--values (before) and to the second (after), e.g. `flag --flag engine.ops.quant.QMM_TILE_OVERRIDE --values None
"(8, 4)"` (Python literals). Decode tok/s of C (default 16) random 37-token prompts from
the moment every request has its first token; greedy tokens compared between variants.

    .venv/bin/python perf/ab_c16_threads_cpu.py [both|attn|rows|split|heads] [--rounds 5] [--output-len 128]
        [--threads 2] [--concurrency 16] [--flag module.attr --values A B]

Needs git (reads the old module with `git show`). Wall clock: on a shared host, note the load it prints.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="?", default="both", choices=("both", "attn", "rows", "split", "heads",
                                                                      "flag"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--flag", help="module.attribute for `flag`")
    ap.add_argument("--values", nargs=2, metavar=("BEFORE", "AFTER"), help="Python literals for `flag`")
    args = ap.parse_args(argv)
    if args.which == "flag" and not (args.flag and args.values):
        ap.error("flag needs --flag module.attr and --values BEFORE AFTER")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    import ab_engine_cpu
    # after that import: ab_engine_cpu sets 1 kernel thread for its own scripts (before this, every run of this
    # script had 1 thread whatever --threads said); the pool starts at the first launch and reads it then
    os.environ["JITKERN_NUM_THREADS"] = str(args.threads)
    import engine.ops.attention as A
    import engine.ops.quant as Q
    C, OUT = args.concurrency, args.output_len
    ours, prompts = ab_engine_cpu.open_engine(str(C), OUT)
    src = subprocess.run(["git", "-C", ROOT, "show", "06c0a37:engine/ops/attention.py"], capture_output=True,
                         text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_attention.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("engine.ops._old_attention", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    new_attention = A.paged_attention

    def old_attention(*a, operands=None, **k):      # the old module predates the operands= argument
        return old.paged_attention(*a, **k)

    from jitkern.runtime.cpu_pool import get_pool
    if args.which == "flag":
        import ast
        fmod, fattr = args.flag.rsplit(".", 1)
        fmod = importlib.import_module(fmod)
        if not hasattr(fmod, fattr):
            raise SystemExit(f"{args.flag}: no such attribute")
        fvals = [ast.literal_eval(v) for v in args.values]

    def _head_split(on):
        # the runtime CPU tier's tuning table with decode_head_split set (targets/tuning.py)
        from jitkern.runtime import cpu as runtime_cpu
        from targets import tuned
        runtime_cpu._target = tuned(runtime_cpu._target or runtime_cpu.runtime_target(), decode_head_split=on)

    def before():
        if args.which == "flag":
            setattr(fmod, fattr, fvals[0])
            return
        if args.which in ("both", "attn"):
            A.paged_attention = old_attention
        if args.which in ("both", "rows"):
            Q.QMM_ROWS_OUTER = False
        if args.which == "split":
            get_pool().dynamic = False
        if args.which == "heads":
            _head_split(False)

    def after():
        if args.which == "flag":
            setattr(fmod, fattr, fvals[1])
            return
        A.paged_attention = new_attention
        Q.QMM_ROWS_OUTER = True
        if args.which == "split":
            get_pool().dynamic = True
        _head_split(True)

    def wave():
        return ab_engine_cpu._wave(ours, prompts, C, OUT, clock=time.perf_counter)

    variants = {"before": before, "after": after}
    names = list(variants)
    res, toks = {n: [] for n in names}, {}
    for r in range(args.rounds + 1):                 # round 0 warms up (compiles, records graphs)
        for n in (names if r % 2 == 0 else names[::-1]):
            variants[n]()
            ours.engine.runner._graphs.clear()
            load = os.getloadavg()[0]
            tps, toks[n] = wave()
            if r > 0:
                res[n].append((tps, load))
        if r > 0:
            print(f"round {r}: " + ", ".join(f"{n} {res[n][-1][0]:.1f} tok/s (load {res[n][-1][1]:.2f})"
                                             for n in names), flush=True)
    after()
    if get_pool().num_threads != args.threads:
        raise SystemExit(f"the kernel pool ran {get_pool().num_threads} threads, not --threads {args.threads}")
    xa, xb = [v for v, _ in res["before"]], [v for v, _ in res["after"]]
    print(f"c={C} decode tok/s ({args.which}; wall, {args.threads} threads, {OUT} output tokens): before best / median "
          f"{max(xa):.1f} / {statistics.median(xa):.1f}; after {max(xb):.1f} / {statistics.median(xb):.1f}; ratio "
          f"best {max(xb) / max(xa):.3f}, median {statistics.median(xb) / statistics.median(xa):.3f}")
    print(f"greedy sequences identical before vs after: {sum(p == q for p, q in zip(toks['before'], toks['after']))}/{C}")
    ours.close()


if __name__ == "__main__":
    main()
