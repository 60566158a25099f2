"""The host's memory bandwidth at each thread count: STREAM-style loops in jitkern's DSL on the CPU tiers, and the
same loops in C through the system compiler as a cross-check.

    .venv/bin/python perf/bandwidth_cpu.py [--threads 1,2] [--mib 512] [--reps 7] [--tiers native,avx2]
        [--kernels read,copy,add,triad] [--no-c] [--json out.json]

Kernels, on float32 arrays of --mib MiB each (far larger than the last-level cache), bytes counted as STREAM
counts them (what the loop asks for; a write-allocate cache reads a written line first, which is not counted):

    read    s += a[i]                4 B/element   what a decode step does to its weights
    copy    c[i] = a[i]              8 B/element
    add     a[i] += b[i]            12 B/element   in place
    triad   a[i] = b[i] + q * c[i]  12 B/element

Each thread streams one contiguous part of the arrays (jitkern: one program per thread, the pool's static split;
C: OpenMP `schedule(static)`), which is how the engine's GEMV programs walk their weight rows. Reported per kernel
and thread count: the best and the median GB/s over --reps timed runs (after one untimed run), jitkern on each
--tiers tier this host can run, and C (`cc -O3 -march=native -fopenmp`, OMP_WAIT_POLICY=passive so its threads
do not spin while jitkern runs). The runs of the two alternate, so load from other processes hits both alike.

Used by perf/bench.py: every CPU decode number there is printed beside the bytes a decode step reads and the
percentage of the `read` bandwidth measured here at the same thread count (`read_bandwidth`,
`decode_bytes_per_token`).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

KERNELS = {"read": 4, "copy": 8, "add": 12, "triad": 12}     # bytes per element, as STREAM counts them


def _int_list(text):
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return vals


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--threads", type=_int_list, default=None,
                    help="thread counts, e.g. 1,2 (default: 1 and JITKERN_NUM_THREADS or the physical cores)")
    ap.add_argument("--mib", type=int, default=512, help="MiB per array (default 512)")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per kernel, thread count and system")
    ap.add_argument("--tiers", default="native",
                    help="jitkern CPU tiers, comma-separated (native = the tier the engine picks on this host)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"any of {','.join(KERNELS)}")
    ap.add_argument("--no-c", action="store_true", help="skip the C cross-check")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    bad = [k for k in args.kernels.split(",") if k not in KERNELS]
    if bad:
        ap.error(f"--kernels: unknown kernel {bad[0]!r} (choose from {', '.join(KERNELS)})")
    if args.mib < 1 or args.reps < 1:
        ap.error("--mib and --reps must be >= 1")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if ARGS.threads:
        os.environ.setdefault("JITKERN_NUM_THREADS", str(max(ARGS.threads)))    # before the pool starts
os.environ.setdefault("OMP_WAIT_POLICY", "passive")       # before libgomp loads: idle C threads must not spin

import numpy as np  # noqa: E402

import jitkern as jk  # noqa: E402

BLOCK = 64          # one tile = four 64-byte lines; U tiles per step are independent loads in flight
UNROLL = 4


@jk.kernel
def _read(a, out, n_per, BLOCK: jk.constexpr, U: jk.constexpr):
    base = jk.program_id(0).to(jk.i64) * n_per
    acc = jk.zeros((BLOCK,), jk.f32)
    for i in range(0, n_per, BLOCK * U):
        for u in jk.static_range(U):
            acc += jk.load(a + base + i + u * BLOCK + jk.arange(0, BLOCK))
    jk.store(out + jk.program_id(0), jk.sum(acc))


@jk.kernel
def _copy(a, c, n_per, BLOCK: jk.constexpr, U: jk.constexpr):
    base = jk.program_id(0).to(jk.i64) * n_per
    for i in range(0, n_per, BLOCK * U):
        for u in jk.static_range(U):
            offs = base + i + u * BLOCK + jk.arange(0, BLOCK)
            jk.store(c + offs, jk.load(a + offs))


@jk.kernel
def _add(a, b, n_per, BLOCK: jk.constexpr, U: jk.constexpr):
    base = jk.program_id(0).to(jk.i64) * n_per
    for i in range(0, n_per, BLOCK * U):
        for u in jk.static_range(U):
            offs = base + i + u * BLOCK + jk.arange(0, BLOCK)
            jk.store(a + offs, jk.load(a + offs) + jk.load(b + offs))


@jk.kernel
def _triad(a, b, c, q, n_per, BLOCK: jk.constexpr, U: jk.constexpr):
    base = jk.program_id(0).to(jk.i64) * n_per
    for i in range(0, n_per, BLOCK * U):
        for u in jk.static_range(U):
            offs = base + i + u * BLOCK + jk.arange(0, BLOCK)
            jk.store(a + offs, jk.load(b + offs) + q * jk.load(c + offs))


_C_SOURCE = r"""
#include <stddef.h>
float bw_read(const float *a, long n, int t) {
    float s = 0.0f;
    #pragma omp parallel for simd num_threads(t) schedule(static) reduction(+:s)
    for (long i = 0; i < n; i++) s += a[i];
    return s;
}
void bw_copy(const float *a, float *c, long n, int t) {
    #pragma omp parallel for simd num_threads(t) schedule(static)
    for (long i = 0; i < n; i++) c[i] = a[i];
}
void bw_add(float *a, const float *b, long n, int t) {
    #pragma omp parallel for simd num_threads(t) schedule(static)
    for (long i = 0; i < n; i++) a[i] += b[i];
}
void bw_triad(float *a, const float *b, const float *c, float q, long n, int t) {
    #pragma omp parallel for simd num_threads(t) schedule(static)
    for (long i = 0; i < n; i++) a[i] = b[i] + q * c[i];
}
"""


def compile_c_probe():
    """The C loops as a ctypes library, or (None, why) when no C compiler with OpenMP is at hand."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    d = tempfile.mkdtemp(prefix="jitkern-bw-")
    src, lib = os.path.join(d, "bw.c"), os.path.join(d, "bw.so")
    with open(src, "w") as f:
        f.write(_C_SOURCE)
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", lib]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"{' '.join(cmd)} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    so = ctypes.CDLL(lib)
    fp, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    so.bw_read.argtypes, so.bw_read.restype = [fp, n, i], ctypes.c_float
    so.bw_copy.argtypes = [fp, fp, n, i]
    so.bw_add.argtypes = [fp, fp, n, i]
    so.bw_triad.argtypes = [fp, fp, fp, ctypes.c_float, n, i]
    return so, cc


class Arrays:
    """Three float32 arrays of `nbytes` each (only `a` with read_only: the `read` kernel's), filled with random values
    (first touch by this thread)."""

    def __init__(self, nbytes: int, seed: int = 0, read_only: bool = False):
        n = nbytes // 4
        rng = np.random.default_rng(seed)
        self.a = rng.random(n, dtype=np.float32)
        self.b, self.c = (None, None) if read_only else (rng.random(n, dtype=np.float32) for _ in range(2))
        self.out = np.zeros(64, np.float32)
        self.n = n

    def elements(self, threads: int) -> int:
        """Elements a run on `threads` threads covers: whole unrolled steps per thread (both systems the same)."""
        return self.n // threads // (BLOCK * UNROLL) * (BLOCK * UNROLL) * threads

    def jitkern_call(self, kernel: str, threads: int, tier=None):
        from jitkern.runtime.launch import launch
        n_per = self.elements(threads) // threads
        a, b, c = self.a, self.b, self.c
        fn, args = {"read": (_read, (a, self.out, n_per)), "copy": (_copy, (a, c, n_per)),
                    "add": (_add, (a, b, n_per)), "triad": (_triad, (a, b, c, 0.5, n_per))}[kernel]
        consts = {"BLOCK": BLOCK, "U": UNROLL}
        return lambda: launch(fn, (threads,), args, consts, target=tier)

    def c_call(self, so, kernel: str, threads: int):
        pa, pb, pc = (None if x is None else x.ctypes.data for x in (self.a, self.b, self.c))
        n = self.elements(threads)
        if kernel == "read":
            return lambda: so.bw_read(pa, n, threads)
        if kernel == "copy":
            return lambda: so.bw_copy(pa, pc, n, threads)
        if kernel == "add":
            return lambda: so.bw_add(pa, pb, n, threads)
        return lambda: so.bw_triad(pa, pb, pc, 0.5, n, threads)


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(calls: dict, nbytes: int, reps: int) -> dict:
    """{name: [GB/s per run]} for callables that each move `nbytes`, taken in turns (one untimed run each)."""
    for fn in calls.values():
        fn()
    out = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            out[name].append(nbytes / _time_once(fn) / 1e9)
            time.sleep(0.005)     # let the previous system's threads go idle before the next one runs
    return out


def read_bandwidth(threads: int | None = None, mib: int = 256, reps: int = 5) -> float:
    """Best GB/s of the jitkern `read` kernel on `threads` threads (default: the pool's), on the native tier: the
    denominator of perf/bench.py's "% of the measured bandwidth"."""
    from jitkern.runtime.cpu_pool import get_pool
    threads = threads or get_pool().num_threads
    arr = Arrays(mib << 20, read_only=True)
    gbs = measure({"read": arr.jitkern_call("read", threads)}, arr.elements(threads) * KERNELS["read"], reps)["read"]
    return max(gbs)


def decode_bytes_per_token(model_path, context_tokens: float = 0.0) -> dict:
    """Bytes one decode token of one sequence reads, from the checkpoint's own tensor sizes: every weight but the
    token embedding (of which one row is read), the embedding again when the head is tied to it, and the KV
    cache of `context_tokens` earlier tokens (2 bytes an element: the f16 cache). Returns
    {"weights": ..., "kv": ..., "total": ...}."""
    from engine.loader import load_checkpoint
    ck = load_checkpoint(model_path, load_tokenizer=False, check_shapes=False)
    embed_names = {"token_embd.weight", "model.embed_tokens.weight"}
    head_names = {"output.weight", "lm_head.weight"}
    weights = 0
    embed = 0
    for name, t in ck.tensors.items():
        if name in embed_names:
            embed = t.nbytes
            weights += t.nbytes // max(1, t.shape[0] if t.shape[0] > t.shape[-1] else t.shape[-1])
        else:
            weights += t.nbytes
    if not any(n in ck.tensors for n in head_names):
        weights += embed                     # tied: the head reads the whole embedding matrix
    cfg = ck.config
    kv = int(context_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2)
    return {"weights": int(weights), "kv": kv, "total": int(weights) + kv}


def main(args) -> int:
    from jitkern.runtime.cpu_pool import get_pool
    import targets
    from targets.cpu import can_run

    pool = get_pool()
    threads = args.threads or sorted({1, pool.num_threads})
    if max(threads) > pool.num_threads:
        print(f"error: --threads {max(threads)} is more than the kernel pool's {pool.num_threads} threads "
              f"(JITKERN_NUM_THREADS was set before this run)", file=sys.stderr)
        return 2
    tiers = []
    for name in args.tiers.split(","):
        if name == "native":
            tiers.append(None)
            continue
        try:
            t = targets.get_target(name)
        except targets.UnknownTargetError as e:
            print(f"error: --tiers: {e}", file=sys.stderr)
            return 2
        if not t.is_cpu:
            print(f"error: --tiers: {name} is not a CPU tier", file=sys.stderr)
            return 2
        if can_run(t):
            tiers.append(t)
        else:
            print(f"# tier {name}: this host cannot run it (skipped)")
    so, cc = (None, "skipped (--no-c)") if args.no_c else compile_c_probe()
    print(f"# load average at the start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"{args.mib} MiB arrays; jitkern pool {pool.num_threads} threads; C: {cc if so else cc}")
    arr = Arrays(args.mib << 20)
    rows = []
    for kernel in args.kernels.split(","):
        for t in threads:
            calls = {}
            for tier in tiers:
                calls[f"jitkern {tier.name if tier else 'native'}"] = arr.jitkern_call(kernel, t, tier)
            if so is not None:
                calls["C"] = arr.c_call(so, kernel, t)
            res = measure(calls, arr.elements(t) * KERNELS[kernel], args.reps)
            for name, gbs in res.items():
                rows.append(dict(kernel=kernel, threads=t, system=name, best_gbs=max(gbs),
                                 median_gbs=statistics.median(gbs), runs=gbs))
    print(f"\n{'kernel':7s} {'threads':>7s} {'system':18s} {'best GB/s':>10s} {'median':>8s} {'vs C (best)':>11s}")
    for r in rows:
        c = next((x for x in rows if x["kernel"] == r["kernel"] and x["threads"] == r["threads"]
                  and x["system"] == "C"), None)
        ratio = f"{r['best_gbs'] / c['best_gbs']:.2f}x" if c and r is not c else ""
        print(f"{r['kernel']:7s} {r['threads']:>7d} {r['system']:18s} {r['best_gbs']:>10.1f} "
              f"{r['median_gbs']:>8.1f} {ratio:>11s}")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mib=args.mib, reps=args.reps, compiler=cc, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
