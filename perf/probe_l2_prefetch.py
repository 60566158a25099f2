"""Probe (H200): can a c=1 decode step hide the narrow GEMVs' weight reads behind its latency-bound kernels?

A c=1 decode step spends ~16 us a layer in kernels that use a few SMs and almost no bandwidth (rope + cache,
flash decode, merge; the norms), then reads the o projection's 33.5 MB. This times, in CUDA graphs:
  cold      spin (a few CTAs busy for ~the attention's time) then the GEMV on weights not in L2;
  prefetch  the same, with an L2 prefetch of the GEMV's weights on a forked stream alongside the spin;
  warm      the GEMV alone on weights it read just before (the bound for what a prefetch can give);
  spin      the spin alone.
GEMV: torch.matmul (cuBLAS) at M = 1, bf16. Weights rotate through copies totalling >= 512 MiB, so `cold`
never finds them in L2. Prints us per iteration and (cold - prefetch) = what a step would save.

    python3 perf/probe_l2_prefetch.py [--shapes 4096x4096 6144x4096 ...] [--spin-us 16] [--ctas 32]
"""
from __future__ import annotations

import argparse

import cupy as cp
import torch

_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
extern "C" __global__ void prefetch_l2(const char* p, long long nbytes, int mode) {
    long long stride = (long long)gridDim.x * blockDim.x * 128;
    for (long long o = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 128; o < nbytes; o += stride) {
        if (mode == 0) {
            asm volatile("prefetch.global.L2 [%0];" :: "l"(p + o));
        } else {
            asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + o));
        }
    }
}
extern "C" __global__ void bulk_prefetch_l2(const char* p, long long nbytes, int chunk) {
    // one thread a CTA: cp.async.bulk.prefetch.L2 of `chunk` bytes (a multiple of 16) at a time
    for (long long o = (long long)blockIdx.x * chunk; o < nbytes; o += (long long)gridDim.x * chunk) {
        long long n = nbytes - o < chunk ? nbytes - o : chunk;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + o), "r"((unsigned)n));
    }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "6144x4096", "4096x14336", "28672x4096"])
    ap.add_argument("--spin-us", type=float, default=16.0)
    ap.add_argument("--ctas", type=int, default=32, help="CTAs of the spin kernel (the attention's programs)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--prefetch-mb", type=float, default=40.0, help="at most this many MB prefetched a GEMV")
    args = ap.parse_args()
    dev = torch.device("cuda")
    mod = cp.RawModule(code=_SRC, options=("-arch=sm_90",))
    spin, pf, bpf = (mod.get_function(n) for n in ("spin", "prefetch_l2", "bulk_prefetch_l2"))
    clock_hz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    cycles = int(args.spin_us * 1e-6 * clock_hz)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"SMs {sms}, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB, spin {args.spin_us} us "
          f"({cycles} cycles) on {args.ctas} CTAs")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        pbytes = min(nbytes, int(args.prefetch_mb * (1 << 20)))

        def run(variant, i):
            w = ws[0] if variant == "warm" else ws[i % copies]
            main_s = torch.cuda.current_stream()
            cs = cp.cuda.ExternalStream(main_s.cuda_stream)
            if variant == "spin":
                spin((args.ctas,), (32,), (cp.int64(cycles),), stream=cs)
                return
            if variant.startswith("prefetch"):
                side.wait_stream(main_s)
                ss = cp.cuda.ExternalStream(side.cuda_stream)
                if variant == "prefetch_bulk":
                    bpf((sms,), (1,), (cp.intp(w.data_ptr()), cp.int64(pbytes), cp.int32(64 << 10)), stream=ss)
                else:
                    mode = 1 if variant == "prefetch_last" else 0
                    pf((sms,), (256,), (cp.intp(w.data_ptr()), cp.int64(pbytes), cp.int32(mode)), stream=ss)
            if variant != "warm":
                spin((args.ctas,), (32,), (cp.int64(cycles),), stream=cs)
            if variant.startswith("prefetch"):
                main_s.wait_stream(side)
            torch.matmul(x, w.T, out=y)

        res = {}
        for variant in ("spin", "cold", "prefetch", "prefetch_last", "prefetch_bulk", "warm"):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(3):
                    run(variant, i)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(args.iters):
                    run(variant, i)
            best = None
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                t = e0.elapsed_time(e1) * 1e3 / args.iters
                best = t if best is None else min(best, t)
            res[variant] = best
        gemv_cold = res["cold"] - res["spin"]
        line = ", ".join(f"{k} {v:.1f}" for k, v in res.items())
        print(f"{shape} ({nbytes / 1e6:.1f} MB, prefetch {pbytes / 1e6:.1f} MB): us/iter {line}; "
              f"GEMV after spin cold {gemv_cold:.1f}, with prefetch {res['prefetch'] - res['spin']:.1f} / "
              f"{res['prefetch_last'] - res['spin']:.1f} / bulk {res['prefetch_bulk'] - res['spin']:.1f}, "
              f"warm alone {res['warm']:.1f}", flush=True)
        del ws


if __name__ == "__main__":
    main()
