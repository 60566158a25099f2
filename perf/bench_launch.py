"""Microbenchmark: per-launch overhead of the native CPU pool on an empty kernel.

    .venv/bin/python perf/bench_launch.py [--threads 2] [--reps 31] [--batch 2000]

Rows (median over --reps batches of --batch launches, in microseconds per launch):
  ctypes floor        calling the empty kernel straight through a ctypes CFUNCTYPE
  inline              CpuPool(1).launch: no workers, the kernel runs in the caller
  pool, grid 1        CpuPool(T).launch with num_programs=1 (runs on the caller only)
  pool, grid G        CpuPool(T).launch with G programs: every thread gets a chunk
  tasks x100          CpuPool(T).launch_tasks with 100 tasks, per task (barrier after each)
  tasks_ptr x100      same through launch_tasks_ptr (cached table address)
  python threads      a pool of Python threads (lock hand-off, ctypes kernel call)
The last line prints how many times slower the Python-thread pool is.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jitkern.runtime.cpu_pool import CpuPool, NativeLibrary, physical_core_count  # noqa: E402

EMPTY_IR = """
define void @empty(ptr %args, i64 %b, i64 %e) {
  ret void
}
"""
KERNEL_CTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


class PythonThreadPool:
    """Baseline: T-1 Python worker threads woken per launch through lock hand-off
    (the cheapest blocking primitive CPython has); the caller runs chunk 0."""

    def __init__(self, nthreads: int):
        self.n = nthreads
        self.start_locks = [threading.Lock() for _ in range(nthreads - 1)]
        self.done_locks = [threading.Lock() for _ in range(nthreads - 1)]
        for lk in self.start_locks + self.done_locks:
            lk.acquire()
        self.job = None
        self.stop = False
        self.threads = [threading.Thread(target=self._work, args=(i + 1,), daemon=True)
                        for i in range(nthreads - 1)]
        for t in self.threads:
            t.start()

    def _chunk(self, tid, n):
        q, r = divmod(n, self.n)
        b = tid * q + min(tid, r)
        return b, b + q + (1 if tid < r else 0)

    def _work(self, tid):
        start, done = self.start_locks[tid - 1], self.done_locks[tid - 1]
        while True:
            start.acquire()
            if self.stop:
                return
            fn, args, n = self.job
            b, e = self._chunk(tid, n)
            if b < e:
                fn(args, b, e)
            done.release()

    def launch(self, fn, args, n):
        self.job = (fn, args, n)
        for lk in self.start_locks:
            lk.release()
        b, e = self._chunk(0, n)
        if b < e:
            fn(args, b, e)
        for lk in self.done_locks:
            lk.acquire()

    def close(self):
        self.stop = True
        for lk in self.start_locks:
            lk.release()
        for t in self.threads:
            t.join()


def per_call_us(fn, reps, batch):
    """Median over `reps` batches of the time per call of fn(batch)."""
    fn(min(batch, 200))  # warm up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(batch)
        samples.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="pool threads incl. caller (default 2)")
    ap.add_argument("--grid", type=int, default=1024, help="programs per launch (default 1024)")
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--batch", type=int, default=2000, help="launches per timed batch")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    opts = ap.parse_args(argv)
    T, G = opts.threads, opts.grid

    lib = NativeLibrary(EMPTY_IR, ["empty"], name="bench_empty")
    fn = lib["empty"]
    args = np.array([G, 1, 1], dtype=np.int64)
    ap_ = args.ctypes.data
    results = {}

    cfn = KERNEL_CTYPE(fn)

    def ctypes_floor(n):
        for _ in range(n):
            cfn(ap_, 0, G)
    results["ctypes floor"] = (1, per_call_us(ctypes_floor, opts.reps, opts.batch))

    def bench_launch(pool, grid):
        launch = pool.launch

        def run(n):
            for _ in range(n):
                launch(fn, ap_, grid)
        return per_call_us(run, opts.reps, opts.batch)

    with CpuPool(1) as p1:
        results["inline"] = (1, bench_launch(p1, G))

    ntasks = 100
    tasks = np.array([(fn, ap_, G)] * ntasks, dtype=np.int64)
    with CpuPool(T) as pool:
        results["pool, grid 1"] = (T, bench_launch(pool, 1))
        results[f"pool, grid {G}"] = (T, bench_launch(pool, G))

        def run_tasks(n):
            for _ in range(n):
                pool.launch_tasks(tasks)
        tb = max(1, opts.batch // ntasks)
        results[f"tasks x{ntasks} (per task)"] = (
            T, per_call_us(run_tasks, opts.reps, tb) / ntasks)

        addr = tasks.ctypes.data
        lt = pool.launch_tasks_ptr

        def run_ptr(n):
            for _ in range(n):
                lt(addr, ntasks)
        results[f"tasks_ptr x{ntasks} (per task)"] = (
            T, per_call_us(run_ptr, opts.reps, tb) / ntasks)

    py = PythonThreadPool(T)
    try:
        def run_py(n):
            for _ in range(n):
                py.launch(cfn, ap_, G)
        results[f"python threads, grid {G}"] = (
            T, per_call_us(run_py, opts.reps, max(1, opts.batch // 10)))
    finally:
        py.close()

    print(f"# host: {os.cpu_count()} logical CPUs, {physical_core_count()} physical cores; "
          f"median of {opts.reps} batches")
    print(f"{'case':34s} {'threads':>7s} {'us/launch':>10s}")
    for name, (t, us) in results.items():
        print(f"{name:34s} {t:7d} {us:10.3f}")
    native = results[f"pool, grid {G}"][1]
    python = results[f"python threads, grid {G}"][1]
    print(f"python-threads / native pool ({T} threads, grid {G}): {python / native:.1f}x")
    if opts.json:
        print(json.dumps({k: {"threads": t, "us": us} for k, (t, us) in results.items()}))


if __name__ == "__main__":
    main()
