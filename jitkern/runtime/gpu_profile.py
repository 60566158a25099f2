"""Per-kernel GPU time, for finding where a decode step goes (JITKERN_GPU_PROFILE=1).

Each GPU launch outside graph capture is bracketed by device synchronisations and timed on the host, so the
figure is the kernel's device time plus a few microseconds of synchronisation; launches inside `jk.capture()`
are not timed (run the engine with decode graphs off, e.g. `EngineArgs(use_graphs=False)`). The table (calls,
total ms, mean us per kernel, sorted by total) goes to stderr at exit.
"""
from __future__ import annotations

import atexit
import os
import sys
import time

ENABLED = os.environ.get("JITKERN_GPU_PROFILE", "") not in ("", "0")
_totals: dict = {}


def timed(dev, name: str, launch) -> None:
    dev.synchronize()
    t0 = time.perf_counter()
    launch()
    dev.synchronize()
    dt = time.perf_counter() - t0
    n, tot = _totals.get(name, (0, 0.0))
    _totals[name] = (n + 1, tot + dt)


def report(out=None) -> str:
    rows = sorted(_totals.items(), key=lambda kv: -kv[1][1])
    total = sum(t for _, (_, t) in rows) or 1e-30
    lines = [f"{'kernel':40s} {'calls':>7s} {'total ms':>10s} {'mean us':>9s} {'share':>6s}"]
    for name, (n, t) in rows:
        lines.append(f"{name:40s} {n:7d} {t * 1e3:10.2f} {t / n * 1e6:9.1f} {t / total:6.1%}")
    text = "\n".join(lines)
    if out is not None:
        print(text, file=out)
    return text


def reset() -> None:
    _totals.clear()


if ENABLED:
    atexit.register(lambda: report(sys.stderr) if _totals else None)
