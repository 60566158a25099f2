"""Benchmark: GGUF quantised GEMV (decode) and GEMM (prefill) against this machine's memory bandwidth and numpy.

    .venv/bin/python perf/bench_gemv.py [--threads 2] [--qtypes q8_0,q4_1] [--tiers avx512,avx2,sse2,portable]
        [--shapes 576x576,1536x576,576x1536,49152x576] [--reps 9] [--prefill-m 512] [--json out.json]

Shapes are N x K = (out features, in features) of SmolLM2-135M: q/o (576x576), gate/up (1536x576), down
(576x1536), tied lm_head (49152x576). numpy's BLAS gets the same thread count (OPENBLAS_NUM_THREADS etc. are
set before numpy is imported) and JITKERN_NUM_THREADS is set to --threads unless already set; the pool's
actual thread count is printed.

1. Memory bandwidth: a jitkern streaming-read kernel (sum of a 256 MB f32 array, all threads) and numpy's
   copy (2 x bytes per copy: read + write, numpy is single-threaded), both median of --reps.
2. GEMV rows (M = 1), per shape, qtype and tier (the tier printed is the one in the CompiledKernel that ran):
     call us   the Python call on pre-quantised activations (argument checks + launch + kernel)
     hot us    the launch recorded with jk.capture() and replayed (kernel + ~1 us): one weight matrix reused,
               so small ones stay in L2/L3
     cold us   replays over enough copies of the weight (> 192 MB) that every call streams it from DRAM:
               the realistic decode case (a model's weights do not fit in the caches)
     GB/s      weight bytes / cold time
     bw GB/s   the streaming-read probe, re-measured in every timing round of this row (rounds alternate probe
               and GEMV, so both see the same load from other processes on a shared host)
     %bw       median over the rounds of GEMV GB/s / probe GB/s of the same round
     GFLOP/s   2*N*K / cold time;  vs best  cold-time speed-up over the best *other* tier (> 1: this is faster)
   plus per shape: quantize_q8 of the activation row (paid once per input, shared by q/k/v or gate/up), numpy
   f32 (W @ x on dequantised f32 weights, 4x-8x the bytes, cold), and jitkern's f32 `linear` GEMV (cold) with
   its time ratio to numpy (< 1: faster).
3. Prefill GEMM: M = --prefill-m tokens at N x K = 576 x 1536 (the down projection), tokens/s including the
   activation quantisation, against numpy's f32 x @ W^T on the dequantised weights (BLAS sgemm).

--gemm (instead of 1-3): the quantised matmul for M > 1 (prefill, batched decode) at the embedded model's shapes
(SmolLM2-135M, 30 layers: per layer N x K = 960 x 576 fused qkv, 576 x 576 o, 3072 x 576 fused gate_up,
576 x 1536 down, all q4_1; the tied LM head 49152 x 576 q8_0), on --gemm-tiers, for M in --gemm-m:

    .venv/bin/python perf/bench_gemv.py --gemm [--gemm-m 16,37,128,512] [--gemm-tiers avx512,avx2]
        [--prefill 37,512] [--prefill-runs 5] [--threads 2]

  per shape: GOP/s (2 M N K / time) of the kernel alone (pre-quantised activations, captured launches
  replayed, median of --reps), and per M the four layer matmuls together: ms per layer including one
  activation quantisation per matmul (as the engine calls matmul_q), GOP/s, and "30-layer tok/s" = M / (30 x
  that time), the matmul-only ceiling of the model's throughput; the LM head at the same M (batched decode:
  one logits row per sequence). Then the whole-model prefill through the engine
  (engine.llm_engine.LLMEngine(EngineArgs(max_num_batched_tokens=2048)), prefix caching off so every round
  computes): a random prompt of each --prefill length with SamplingParams(max_tokens=1, temperature=0,
  detokenize=False), best and median of --prefill-runs after a warm-up, on the runtime tier
  (JITKERN_CPU_TIER). The load average is printed before every part (a shared host: a busy second core
  halves the 2-thread numbers).
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
    ap.add_argument("--qtypes", default="q8_0,q4_1")
    ap.add_argument("--tiers", default="avx512,avx2,sse2,portable")
    ap.add_argument("--shapes", default="576x576,1536x576,576x1536,49152x576")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prefill-m", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gemm", action="store_true", help="the M > 1 benchmark at the model's shapes (see above)")
    ap.add_argument("--gemm-m", default="16,37,128,512")
    ap.add_argument("--gemm-tiers", default="avx512,avx2")
    ap.add_argument("--prefill", default="37,512", help="--gemm: whole-model prefill lengths ('' to skip)")
    ap.add_argument("--prefill-runs", type=int, default=5)
    return ap.parse_args()


ARGS = _parse()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)          # before numpy is imported
os.environ.setdefault("JITKERN_NUM_THREADS", str(ARGS.threads))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import jitkern as jk  # noqa: E402
import targets  # noqa: E402
from targets.cpu import can_run  # noqa: E402
from engine.ops import quant as Q  # noqa: E402
from jitkern.runtime.cpu_pool import get_pool  # noqa: E402

COLD_BYTES = 192e6


def timeit(fn, reps, min_batch_s=0.02):
    """Median seconds per call over `reps` batches (a batch repeats fn until it lasts >= min_batch_s)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_batch_s / one))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    time.sleep(0.01)      # let spinning pool threads go to sleep before the other side runs
    return statistics.median(out)


class Bandwidth:
    """The streaming-read probe of perf/bandwidth_cpu.py (one contiguous part of a 256 MB f32 array per pool thread),
    timed here per round."""

    def __init__(self, nbytes=256 << 20):
        from perf.bandwidth_cpu import Arrays
        arr = Arrays(nbytes, seed=1, read_only=True)
        threads = get_pool().num_threads
        self.x = arr.a
        self._run = arr.jitkern_call("read", threads)
        self.nbytes = arr.elements(threads) * 4

    def read_gbs(self, reps) -> float:
        return self.nbytes / timeit(self._run, reps, min_batch_s=0.0) / 1e9

    def read_gbs_once(self) -> float:
        t0 = time.perf_counter()
        self._run()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def numpy_copy_gbs(self, reps) -> float:
        y = np.empty_like(self.x)
        return 2 * self.x.nbytes / timeit(lambda: np.copyto(y, self.x), reps, min_batch_s=0.0) / 1e9


@jk.kernel
def _spin(x, out, n):
    # a pure-compute program (a dependent FMA chain): how many of them run at once shows how many cores
    # the pool really gets on a shared host
    acc = jk.load(x + jk.arange(0, 8))
    b = jk.load(x + 8 + jk.arange(0, 8))
    for i in range(0, n):
        acc = jk.fma(acc, b, b)
    jk.store(out + jk.program_id(0) * 8 + jk.arange(0, 8), acc)


def effective_cores(threads: int) -> float:
    """Time of 1 spin program / time of `threads` spin programs launched together (ideal: threads)."""
    x = np.full(16, 0.5, np.float32)
    out = np.zeros(8 * threads, np.float32)
    n = 2_000_000
    _spin[(1,)](x, out, 10)
    t1 = timeit(lambda: _spin[(1,)](x, out, n), 5, min_batch_s=0.0)
    tn = timeit(lambda: _spin[(threads,)](x, out, n), 5, min_batch_s=0.0)
    return threads * t1 / tn


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
        return "; ".join(f"{d.get('internal_api')} {d.get('version')} threads={d.get('num_threads')}"
                         for d in threadpool_info() if d.get("user_api") == "blas")
    except Exception:
        return "threadpoolctl not installed"


def make_weight(qtype, N, K, rng):
    """Raw GGUF bytes of a random weight and its dequantised f32 copy."""
    import gguf
    import gguf.quants as gq
    gt = getattr(gguf.GGMLQuantizationType, qtype.upper())
    if Q.QTYPES[qtype].block_elems == 32:
        raw = gq.quantize(rng.standard_normal((N, K), dtype=np.float32), gt)
    else:     # the gguf package cannot quantise K-quants: random blocks with sane f16 scales
        q = Q.QTYPES[qtype]
        raw = rng.integers(0, 256, (N, K // 256, q.block_bytes), dtype=np.uint8)
        for off in ((0, 2) if qtype in ("q4_K", "q5_K") else (208,)):
            raw[:, :, off:off + 2] = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16).view(
                np.uint8).reshape(raw.shape[:2] + (2,))
        raw = raw.reshape(N, -1)
    raw = np.ascontiguousarray(raw)
    return raw, gq.dequantize(raw, gt).reshape(N, K).astype(np.float32)


def cold_time(launch_one, items, reps) -> float:
    """Seconds per launch, replaying one captured launch per item (items together exceed the LLC)."""
    with jk.capture() as g:
        for it in items:
            launch_one(it)
    return timeit(g.replay, reps, min_batch_s=0.0) / len(items)


def cold_vs_bandwidth(launch_one, items, nbytes, bw: "Bandwidth", reps):
    """(median s per launch, median probe GB/s, median of per-round GEMV/probe bandwidth ratios): each round
    times the streaming-read probe and then the replay, so both see the same load from other processes."""
    with jk.capture() as g:
        for it in items:
            launch_one(it)
    g.replay()
    ts, bws, ratios = [], [], []
    for _ in range(reps):
        b = bw.read_gbs_once()
        t0 = time.perf_counter()
        g.replay()
        t = (time.perf_counter() - t0) / len(items)
        ts.append(t)
        bws.append(b)
        ratios.append(nbytes / t / 1e9 / b)
    time.sleep(0.01)
    return statistics.median(ts), statistics.median(bws), statistics.median(ratios)


def main():
    rng = np.random.default_rng(0)
    tiers = [targets.get_target(t) for t in ARGS.tiers.split(",") if t]
    runnable = [t for t in tiers if can_run(t)]
    skipped = [t.name for t in tiers if not can_run(t)]
    pool = get_pool()
    print(f"# load average at the start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs "
          f"(other processes on this host skew the timings)")
    print(f"# jitkern pool threads={pool.num_threads} (JITKERN_NUM_THREADS={os.environ['JITKERN_NUM_THREADS']}), "
          f"numpy {np.__version__}: {blas_info()}")
    if skipped:
        print(f"# tiers this host cannot run (skipped): {', '.join(skipped)}")
    eff = effective_cores(pool.num_threads)
    print(f"# effective parallelism: {pool.num_threads} compute-only programs ran {eff:.2f}x as fast as one "
          f"(ideal {pool.num_threads}.00; less means other processes hold the cores)")
    bw = Bandwidth()
    bw_read = bw.read_gbs(ARGS.reps)
    bw_copy = bw.numpy_copy_gbs(ARGS.reps)
    print(f"memory bandwidth: jitkern streaming read {bw_read:.1f} GB/s ({pool.num_threads} threads), "
          f"numpy copy {bw_copy:.1f} GB/s (read + write, 1 thread)")
    results = [dict(kind="bandwidth", jitkern_read_gbs=bw_read, numpy_copy_gbs=bw_copy, threads=pool.num_threads,
                    effective_cores=eff)]
    qtypes = [q for q in ARGS.qtypes.split(",") if q]

    print(f"\n{'GEMV M=1':9s} {'N x K':>10s} {'tier':9s} {'call us':>8s} {'hot us':>8s} {'cold us':>8s} {'GB/s':>6s} "
          f"{'bw GB/s':>7s} {'%bw':>5s} {'GFLOP/s':>7s} {'vs best':>7s}")
    for shape in ARGS.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        x = rng.standard_normal(K, dtype=np.float32)
        xq0 = Q.quantize_q8(x)
        t_quant = timeit(lambda: Q.quantize_q8(x, out=xq0), ARGS.reps)
        y = np.empty(N, np.float32)
        w32 = None
        rows = []
        for qt in qtypes:
            xq = None
            raw, wd = make_weight(qt, N, K, rng)
            w32 = wd if w32 is None else w32
            cold = [raw.copy() for _ in range(max(2, int(COLD_BYTES // raw.nbytes)))]
            ref = (xq0[0].reshape(-1, 32) * xq0[1][:, None]).reshape(-1).astype(np.float64) @ wd.T.astype(np.float64)
            per_tier = []
            for T in runnable:
                xq = Q.quantize_q8(x, layout=_layout(qt, 1, T), target=T)
                _, ck = Q._matmul_q8(xq, raw, qt, N, K, y, T)
                err = float(np.abs(y - ref).max() / np.abs(ref).max())
                t_call = timeit(lambda: Q.matmul_q8(xq, raw, qt, N, K, out=y, target=T), ARGS.reps)
                t_hot = cold_time(lambda w: Q.matmul_q8(xq, w, qt, N, K, out=y, target=T), [raw] * 50, ARGS.reps)
                t_cold, bw_now, frac = cold_vs_bandwidth(lambda w: Q.matmul_q8(xq, w, qt, N, K, out=y, target=T),
                                                         cold, raw.nbytes, bw, ARGS.reps)
                per_tier.append(dict(kind="gemv", qtype=qt, N=N, K=K, tier=ck.target.name, call_s=t_call,
                                     hot_s=t_hot, cold_s=t_cold, bw_gbs=bw_now, bw_fraction=frac, bytes=raw.nbytes,
                                     rel_err=err, threads=pool.num_threads))
            for r in per_tier:
                others = [o["cold_s"] for o in per_tier if o is not r]
                r["vs_best_other"] = (min(others) / r["cold_s"]) if others else float("nan")
                gbs = r["bytes"] / r["cold_s"] / 1e9
                print(f"{qt:9s} {shape:>10s} {r['tier']:9s} {r['call_s'] * 1e6:8.1f} {r['hot_s'] * 1e6:8.1f} "
                      f"{r['cold_s'] * 1e6:8.1f} {gbs:6.1f} {r['bw_gbs']:7.1f} {100 * r['bw_fraction']:5.0f} "
                      f"{2 * N * K / r['cold_s'] / 1e9:7.1f} {r['vs_best_other']:7.2f}"
                      + ("" if r["rel_err"] < 1e-5 else f"  BAD rel err {r['rel_err']:.1e}"), flush=True)
            rows += per_tier
            del cold
        # f32 references: numpy (BLAS sgemv) and jitkern's dense `linear`, both on DRAM-cold weights
        cold32 = [w32.copy() for _ in range(max(2, int(COLD_BYTES // w32.nbytes)))]
        it = iter(range(1 << 62))
        t_np = timeit(lambda: np.matmul(cold32[next(it) % len(cold32)], x, out=y), ARGS.reps)
        f32_line = f"numpy f32 {t_np * 1e6:.1f} us ({w32.nbytes / t_np / 1e9:.1f} GB/s)"
        res = dict(kind="gemv_ref", N=N, K=K, quantize_s=t_quant, numpy_f32_cold_s=t_np)
        try:
            from engine.ops import matmul as mm
            t_lin = cold_time(lambda w: mm.linear(x, w, out=y), cold32, ARGS.reps)
            f32_line += (f", jitkern f32 linear {t_lin * 1e6:.1f} us ({w32.nbytes / t_lin / 1e9:.1f} GB/s, "
                         f"ratio to numpy {t_lin / t_np:.2f})")
            res["jitkern_f32_cold_s"] = t_lin
        except ImportError:
            pass
        del cold32
        best_q = {qt: min(r["cold_s"] for r in rows if r["qtype"] == qt) for qt in qtypes}
        print(f"{'':9s} {shape:>10s} quantize_q8 {t_quant * 1e6:.1f} us; {f32_line}; best quantised vs numpy f32: "
              + ", ".join(f"{qt} {t_np / t:.1f}x" for qt, t in best_q.items()), flush=True)
        results += rows + [res]

    M = ARGS.prefill_m
    if M > 0:
        N, K = 576, 1536
        print(f"\nprefill GEMM M={M} at N x K = {N}x{K} (tokens/s, activation quantisation included)")
        x = rng.standard_normal((M, K), dtype=np.float32)
        y = np.empty((M, N), np.float32)
        w32 = None
        for qt in qtypes:
            raw, wd = make_weight(qt, N, K, rng)
            w32 = wd if w32 is None else w32
            ref = x.astype(np.float64) @ wd.T.astype(np.float64)
            t_np = timeit(lambda: np.matmul(x, wd.T, out=y), ARGS.reps)
            for T in runnable:
                xq = Q.quantize_q8(x, target=T, layout=_layout(qt, M, T))
                _, ck = Q._matmul_q8(xq, raw, qt, N, K, y, T)
                err = float(np.abs(y - ref).max() / np.abs(ref).max())
                t = timeit(lambda: Q.matmul_q(x, raw, qt, N, K, out=y, target=T), ARGS.reps)
                tk = timeit(lambda: Q.matmul_q8(xq, raw, qt, N, K, out=y, target=T), ARGS.reps)
                print(f"{qt:9s} {ck.target.name:9s} {M / t:9.0f} tok/s ({2 * M * N * K / t / 1e9:6.1f} GFLOP/s; "
                      f"kernel alone {2 * M * N * K / tk / 1e9:6.1f} GFLOP/s)  numpy f32 {M / t_np:9.0f} tok/s "
                      f"({2 * M * N * K / t_np / 1e9:6.1f} GFLOP/s)  ratio {t_np / t:5.2f}x"
                      + ("" if err < 2e-2 else f"  BAD rel err {err:.1e}"), flush=True)
                results.append(dict(kind="prefill", qtype=qt, M=M, N=N, K=K, tier=ck.target.name, s=t, kernel_s=tk,
                                    numpy_f32_s=t_np, rel_err=err))
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(results, f, indent=1)


def _layout(qt, M, T):
    """The activation layout of qtype qt for M rows on tier T (older quant modules took the qtype only)."""
    try:
        return Q.act_layout(qt, M, T)
    except TypeError:
        return Q.act_layout(qt)


LAYER_SHAPES = [("qkv", 960, 576, "q4_1"), ("o", 576, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"),
                ("down", 576, 1536, "q4_1")]
HEAD_SHAPE = ("lm_head", 49152, 576, "q8_0")
N_LAYERS = 30


def _replay_time(launch, reps, min_s=0.05):
    """Median seconds per launch: launches recorded with jk.capture() (enough for >= min_s per replay)."""
    launch()
    t0 = time.perf_counter()
    launch()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(min_s / one)))
    with jk.capture() as g:
        for _ in range(n):
            launch()
    g.replay()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.replay()
        ts.append((time.perf_counter() - t0) / n)
    time.sleep(0.01)
    return statistics.median(ts)


def gemm_main():
    rng = np.random.default_rng(0)
    pool = get_pool()
    tiers = [targets.get_target(t) for t in ARGS.gemm_tiers.split(",") if t]
    runnable = [t for t in tiers if can_run(t)]
    skipped = [t.name for t in tiers if not can_run(t)]
    print(f"# jitkern pool threads={pool.num_threads}; tiers this host cannot run: {', '.join(skipped) or 'none'}")
    print(f"# effective parallelism: {effective_cores(pool.num_threads):.2f} of {pool.num_threads} "
          f"(compute-only probe; less means other processes hold the cores)")
    weights = {name: make_weight(qt, N, K, rng)[0] for name, N, K, qt in LAYER_SHAPES + [HEAD_SHAPE]}
    results = []
    ms = [int(v) for v in ARGS.gemm_m.split(",") if v]
    for T in runnable:
        print(f"\n# tier {T.name}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"{'M':>5s} " + " ".join(f"{n + ' ' + str(N) + 'x' + str(K):>18s}" for n, N, K, _ in
                                      LAYER_SHAPES + [HEAD_SHAPE])
              + f" {'layer ms':>9s} {'layer GOP/s':>11s} {'30-layer tok/s':>14s}")
        for M in ms:
            cells, layer_s, layer_ops = [], 0.0, 0
            for name, N, K, qt in LAYER_SHAPES + [HEAD_SHAPE]:
                raw = weights[name]
                x = rng.standard_normal((M, K), dtype=np.float32)
                y = np.empty((M, N), np.float32)
                xq = Q.quantize_q8(x, layout=_layout(qt, M, T), target=T)
                t_k = _replay_time(lambda: Q.matmul_q8(xq, raw, qt, N, K, out=y, target=T), ARGS.reps)
                t_q = _replay_time(lambda: Q.quantize_q8(x, out=tuple(xq), layout=xq.layout, target=T), ARGS.reps)
                ops = 2 * M * N * K
                cells.append(f"{ops / t_k / 1e9:11.1f} GOP/s")
                if name != HEAD_SHAPE[0]:
                    layer_s += t_k + t_q
                    layer_ops += ops
                results.append(dict(kind="gemm", tier=T.name, M=M, N=N, K=K, qtype=qt, name=name, kernel_s=t_k,
                                    quantize_s=t_q, threads=pool.num_threads))
            print(f"{M:5d} " + " ".join(f"{c:>18s}" for c in cells)
                  + f" {layer_s * 1e3:9.3f} {layer_ops / layer_s / 1e9:11.1f} {M / (N_LAYERS * layer_s):14.0f}",
                  flush=True)
    if ARGS.prefill:
        results += engine_prefill([int(v) for v in ARGS.prefill.split(",") if v])
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(results, f, indent=1)


def engine_prefill(lengths):
    """Whole-model prefill through the engine: best and median seconds per prompt of each length."""
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    from jitkern.runtime.cpu import runtime_target
    eng = LLMEngine(EngineArgs(max_num_batched_tokens=2048, enable_prefix_caching=False))
    vocab = eng.config.vocab_size
    rng = np.random.default_rng(1)
    counter = iter(range(1 << 30))

    def one(n):
        ids = rng.integers(0, vocab, n).tolist()
        eng.add_request(f"p{next(counter)}", ids, SamplingParams(max_tokens=1, temperature=0, detokenize=False))
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t0

    print(f"\n# whole-model prefill (engine, tier {runtime_target().name}, "
          f"{os.environ['JITKERN_NUM_THREADS']} threads), load average {os.getloadavg()[0]:.2f}")
    out = []
    for n in lengths:
        one(n)                                  # warm-up: compiles and first-touch
        ts = [one(n) for _ in range(ARGS.prefill_runs)]
        best, med = min(ts), statistics.median(ts)
        print(f"prefill {n:5d} tokens: best {best * 1e3:8.1f} ms ({n / best:6.0f} tok/s), median {med * 1e3:8.1f} ms "
              f"({n / med:6.0f} tok/s) over {len(ts)} runs; load average {os.getloadavg()[0]:.2f}", flush=True)
        out.append(dict(kind="engine_prefill", tokens=n, best_s=best, median_s=med, runs=ts))
    return out


if __name__ == "__main__":
    if ARGS.gemm:
        gemm_main()
    else:
        main()
