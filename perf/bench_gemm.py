"""Benchmark: jitkern dense matmul / linear against numpy (OpenBLAS) in one process, on the same inputs.

    JITKERN_NUM_THREADS=2 .venv/bin/python perf/bench_gemm.py [--threads 2] [--sizes 512,1024,2048]
        [--tiers avx512,avx2,sse2,portable] [--reps 9] [--no-gemv] [--no-gemm] [--json out.json]
    .venv/bin/python perf/bench_gemm.py --threads 1 --cpu-time      # on a busy shared host

numpy's BLAS gets the same thread count: this script sets OPENBLAS_NUM_THREADS (and OMP/MKL) to --threads
*before* importing numpy, and JITKERN_NUM_THREADS to the same value unless already set.

GEMM rows (square f32 C = A @ B, every runnable tier; the tier printed is the one in the CompiledKernel that
ran): `matmul` (packs B into panels on every call, included in the time), `linear_packed` (B pre-packed
once, as for model weights: the kernel alone), median seconds, GFLOP/s, and time ratio to numpy's A @ B
measured in the same run (ratio < 1: faster than numpy).
GEMV rows (M = 1, SmolLM2-135M projection shapes N x K, weights f32/f16/bf16): `linear` reading the
weights as stored, in GB/s of weight bytes. "call": the Python call (argument checks + launch, ~10-20 us of
fixed cost); "graph": the same launch recorded with jk.capture() and replayed (what the engine's decode
graph pays: the kernel plus ~1 us), one weight matrix reused (it stays in L2/L3); "cold": replaying launches
over enough copies of the matrix to exceed the last-level cache (DRAM bandwidth). numpy's w @ x on f32
weights is given for reference, hot and cold (numpy has no bf16, and its f16 matmul is not BLAS).
Timing: each figure is the median of --reps batches of >= 20 ms; the batches of all candidates of one size
(numpy and every tier/op) run round-robin, so drifts in the host's load hit them alike, with a sleep after
each batch (300 ms after numpy's, whose OpenBLAS workers busy-wait ~2^28 cycles before sleeping; 5 ms after
jitkern's) so that one side's spinning worker threads do not steal the next one's cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("JITKERN_NUM_THREADS", "2")))
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--tiers", default="avx512,avx2,sse2,portable")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-gemv", action="store_true")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with process CPU seconds instead of wall time (needs --threads 1): robust against "
                         "other processes on a shared host")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1 (with more threads CPU time counts spinning workers)")
    return args


ARGS = _parse()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)          # before numpy is imported
os.environ.setdefault("JITKERN_NUM_THREADS", str(ARGS.threads))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import jitkern as jk  # noqa: E402
import targets  # noqa: E402
from targets.cpu import can_run  # noqa: E402
from engine.ops import matmul as mm  # noqa: E402


clock = time.process_time if ARGS.cpu_time else time.perf_counter


def calibrate(fn, min_batch_s=0.02) -> int:
    """Calls per timed batch so that a batch lasts about min_batch_s (after two warm-up calls)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, int(min_batch_s / max(time.perf_counter() - t0, 1e-7)))


def measure(cands: dict, reps: int) -> dict:
    """Median seconds per call of each candidate. Batches run round-robin over the candidates (`reps` rounds),
    so slow drifts in the host's load hit all of them alike, with a short sleep after each batch so that one
    side's spinning worker threads (jitkern's pool, OpenBLAS) do not steal the next one's cores."""
    inner = {k: calibrate(fn) for k, fn in cands.items()}
    times = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            t0 = clock()
            for _ in range(inner[k]):
                fn()
            times[k].append((clock() - t0) / inner[k])
            # OpenBLAS workers busy-wait ~2^28 cycles after a call before sleeping; jitkern's pool 200 us
            time.sleep(0.3 if k == "numpy" else 0.005)
    return {k: statistics.median(v) for k, v in times.items()}


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
        return "; ".join(f"{d.get('internal_api')} {d.get('version')} threads={d.get('num_threads')} "
                         f"arch={d.get('architecture')}" for d in threadpool_info() if d.get("user_api") == "blas")
    except Exception:
        return "threadpoolctl not installed"


def main():
    rng = np.random.default_rng(0)
    tiers = [targets.get_target(t) for t in ARGS.tiers.split(",") if t]
    runnable = [t for t in tiers if can_run(t)]
    skipped = [t.name for t in tiers if not can_run(t)]
    print(f"# load average at the start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"# timing: {'process CPU time' if ARGS.cpu_time else 'wall clock'}")
    print(f"# threads={ARGS.threads} (JITKERN_NUM_THREADS={os.environ['JITKERN_NUM_THREADS']}, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}), numpy {np.__version__}: {blas_info()}")
    if skipped:
        print(f"# tiers this host cannot run (skipped): {', '.join(skipped)}")
    results = []
    if not ARGS.no_gemm:
        print(f"{'op':14s} {'size':>6s} {'tier':9s} {'ms':>9s} {'GFLOP/s':>8s} {'numpy ms':>9s} {'np GF/s':>8s} "
              f"{'ratio':>6s}")
        for n in [int(s) for s in ARGS.sizes.split(",") if s]:
            a = rng.standard_normal((n, n), dtype=np.float32)
            b = rng.standard_normal((n, n), dtype=np.float32)
            c = np.empty((n, n), np.float32)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            flop = 2.0 * n ** 3
            cands, ran, errs = {"numpy": lambda: np.matmul(a, b, out=c)}, {}, {}
            for T in runnable:
                BN = mm._panel_width(T)
                packed = mm.PackedWeight(mm._pack(b, "f32", n, n, n, False, BN, T), n, n, BN, "f32")
                for op, fn in (("matmul", lambda T=T: mm.matmul(a, b, out=c, target=T)),
                               ("linear_packed", lambda T=T, p=packed: mm._gemm(a, p, None, c, T))):
                    c[:] = np.nan
                    fn()
                    errs[op, T.name] = float(np.abs(c - ref).max() / np.abs(ref).max())
                    ran[op, T.name] = mm.last_compiled("_gemm_kernel").target.name
                    cands[op, T.name] = fn
            t = measure(cands, ARGS.reps)
            t_np = t.pop("numpy")
            for (op, name), sec in t.items():
                err = errs[op, name]
                bad = "" if err < 1e-4 else f"  BAD rel err {err:.1e}"
                print(f"{op:14s} {n:6d} {ran[op, name]:9s} {sec * 1e3:9.3f} {flop / sec / 1e9:8.1f} {t_np * 1e3:9.3f} "
                      f"{flop / t_np / 1e9:8.1f} {sec / t_np:6.2f}{bad}", flush=True)
                results.append(dict(kind="gemm", op=op, n=n, tier=ran[op, name], s=sec, gflops=flop / sec / 1e9,
                                    numpy_s=t_np, ratio=sec / t_np, rel_err=err))
    if not ARGS.no_gemv:
        print(f"\n{'GEMV M=1':10s} {'N x K':>9s} {'w':4s} {'tier':9s} {'call us':>8s} {'GB/s':>5s} {'graph us':>8s} "
              f"{'GB/s':>5s} {'cold us':>8s} {'GB/s':>5s} {'np f32 us':>9s} {'GB/s':>5s} {'np cold':>8s} {'GB/s':>5s}")
        for N, K in ((576, 576), (1536, 576), (576, 1536)):
            x = rng.standard_normal(K, dtype=np.float32)
            w32 = rng.standard_normal((N, K), dtype=np.float32)
            y = np.empty(N, np.float32)
            np_cold = [w32.copy() for _ in range(max(2, int(96e6 // w32.nbytes)))]
            it = iter(range(10 ** 12))
            t_np_cold = measure({"np": lambda: np.matmul(np_cold[next(it) % len(np_cold)], x, out=y)}, ARGS.reps)["np"]
            del np_cold
            for wd in ("f32", "f16", "bf16"):
                if wd == "f32":
                    w = w32
                elif wd == "f16":
                    w = w32.astype(np.float16)
                else:
                    w = (w32.view(np.uint32) >> 16).astype(np.uint16)
                wf = w.astype(np.float32) if wd != "bf16" else (w.astype(np.uint32) << 16).view(np.float32)
                ref = wf.astype(np.float64) @ x
                copies = max(2, int(96e6 // w.nbytes))     # more bytes than any L3 this is likely to run on
                cold = [w.copy() for _ in range(copies)]
                cands, ran, errs, graphs = {"numpy": lambda: np.matmul(w32, x, out=y)}, {}, {}, []
                for T in runnable:
                    call = (lambda T=T: mm.linear(x, w, out=y, target=T, w_dtype=wd))
                    y[:] = np.nan
                    call()
                    errs[T.name] = float(np.abs(y - ref).max() / np.abs(ref).max())
                    ran[T.name] = mm.last_compiled("_gemv_kernel").target.name
                    # kernel time without the Python call path: launches recorded once, replayed natively
                    with jk.capture() as g_hot:
                        for _ in range(50):
                            call()
                    with jk.capture() as g_cold:
                        for cw in cold:
                            mm.linear(x, cw, out=y, target=T, w_dtype=wd)
                    graphs.append((g_hot, g_cold))
                    cands["call", T.name] = call
                    cands["hot", T.name] = g_hot.replay
                    cands["cold", T.name] = g_cold.replay
                t = measure(cands, ARGS.reps)
                t_np = t["numpy"]
                gb = w.nbytes / 1e9
                for T in runnable:
                    tc, th, tk = t["call", T.name], t["hot", T.name] / 50, t["cold", T.name] / copies
                    err = errs[T.name]
                    print(f"{'linear':10s} {f'{N}x{K}':>9s} {wd:4s} {ran[T.name]:9s} {tc * 1e6:8.1f} {gb / tc:5.1f} "
                          f"{th * 1e6:8.1f} {gb / th:5.1f} {tk * 1e6:8.1f} {gb / tk:5.1f} "
                          f"{t_np * 1e6:9.1f} {w32.nbytes / 1e9 / t_np:5.1f} "
                          f"{t_np_cold * 1e6:8.1f} {w32.nbytes / 1e9 / t_np_cold:5.1f}"
                          + ("" if err < 1e-4 else f"  BAD rel err {err:.1e}"), flush=True)
                    results.append(dict(kind="gemv", N=N, K=K, w=wd, tier=ran[T.name], call_s=tc, graph_hot_s=th,
                                        graph_cold_s=tk, numpy_f32_s=t_np, numpy_f32_cold_s=t_np_cold, rel_err=err))
                del cold, graphs
    print(f"# load average at the end: {os.getloadavg()[0]:.2f} (other processes on this host skew the timings)")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
