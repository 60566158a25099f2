"""Summarise Nsight Compute's per-instruction source page (CSV, from
`ncu -i REPORT --page source --csv --print-source sass`; REPORT e.g. from `ncu --set full --import-source no
-k regex:flash_prefill --launch-skip 1 --launch-count 1 -o REPORT python3 perf/ncu_probe.py --linear-m 1`):
per kernel the stall reasons over all samples, the instructions with the most samples (their top stall reasons)
and those with the most excess shared-memory wavefronts (bank conflicts); or, with --range, every instruction
between two addresses (a loop body) with its samples and execution count. Needs no GPU.

    python3 perf/ncu_sass_summary.py flash_prefill.sass.csv [--top 40]
    python3 perf/ncu_sass_summary.py flash_prefill.sass.csv --range bb700 bba40

It finds e.g. bank-conflicted shared-memory stores and rolled-up loops.
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys


def kernels(path: str) -> list:
    """[{name, hdr, rows}] of the CSV's kernels (a file may hold several: one "Kernel Name" line each)."""
    out, cur = [], None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                cur = {"name": r[1], "hdr": None, "rows": []}
                out.append(cur)
            elif r[0] == "Address" and cur is not None:
                cur["hdr"] = r
            elif cur is not None and cur["hdr"] is not None and r[0].startswith("0x"):
                cur["rows"].append(dict(zip(cur["hdr"], r)))
    return out


def _int(x) -> int:
    try:
        return int(float(x or 0))
    except ValueError:
        return 0


def summary(k: dict, top: int) -> None:
    rows = k["rows"]
    stalls = [h for h in k["hdr"] if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_int(x["Warp Stall Sampling (All Samples)"]) for x in rows) or 1
    agg = collections.Counter()
    for x in rows:
        for s in stalls:
            agg[s] += _int(x[s])
    print(f"== {k['name']}: {len(rows)} instructions, {total} samples")
    print("   " + ", ".join(f"{s[6:]} {v / total * 100:.1f}%" for s, v in agg.most_common(10)))
    print(f"-- the {top} instructions with the most samples (address, samples, executions, top stalls)")
    for x in sorted(rows, key=lambda x: -_int(x["Warp Stall Sampling (All Samples)"]))[:top]:
        st = sorted(((s[6:], _int(x[s])) for s in stalls if _int(x[s])), key=lambda t: -t[1])[:3]
        print(f"  {x['Address'][-5:]} {_int(x['Warp Stall Sampling (All Samples)']):6d} "
              f"{_int(x['Instructions Executed']):9d}  {x['Source'].strip()[:64]:64s} {dict(st)}")
    exc = sorted(rows, key=lambda x: -_int(x.get("L1 Wavefronts Shared Excessive")))
    exc = [x for x in exc if _int(x.get("L1 Wavefronts Shared Excessive"))][:12]
    if exc:
        print("-- shared-memory instructions with excess wavefronts (bank conflicts): excess / ideal")
        for x in exc:
            print(f"  {x['Address'][-5:]} {_int(x['L1 Wavefronts Shared Excessive']):9d} / "
                  f"{_int(x['L1 Wavefronts Shared Ideal']):9d}  {x['Source'].strip()[:70]}")


def address_range(k: dict, lo: int, hi: int) -> None:
    print(f"== {k['name']}: instructions {lo:x}..{hi:x} (low 20 bits of the address)")
    for x in k["rows"]:
        a = int(x["Address"], 16) & 0xfffff
        if lo <= a <= hi:
            print(f"  {a:05x} {_int(x['Warp Stall Sampling (All Samples)']):6d} {_int(x['Instructions Executed']):9d}"
                  f"  {x['Source'].strip()[:90]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu's source page as CSV (--page source --csv --print-source sass)")
    ap.add_argument("--top", type=int, default=40, help="instructions listed by samples (default 40)")
    ap.add_argument("--range", nargs=2, metavar=("LO", "HI"), default=None,
                    help="list the instructions between these hex addresses (low 20 bits) instead")
    args = ap.parse_args(argv)
    try:
        ks = kernels(args.csv)
    except OSError as e:
        print(f"{args.csv}: cannot read it ({e.strerror or e})", file=sys.stderr)
        return 2
    if args.range:
        try:
            int(args.range[0], 16), int(args.range[1], 16)
        except ValueError:
            ap.error(f"--range: expected two hex addresses, got {args.range}")
    if not ks:
        print(f"{args.csv}: no kernel in it (expected ncu's --page source --csv output)", file=sys.stderr)
        return 2
    for k in ks:
        if args.range:
            address_range(k, int(args.range[0], 16), int(args.range[1], 16))
        else:
            summary(k, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
