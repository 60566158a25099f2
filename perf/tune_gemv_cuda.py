"""Tile sweep of the GPU dense linear (`_gpu_linear_kernel`) at decode shapes, against the device-to-device
copy bandwidth and torch's bf16 linear (cuBLAS) measured in the same run.

    python3 perf/tune_gemv_cuda.py [--configs fma,16,256,4 mma,32,64,64,4,0 ...] [--m 1,16,64] [--smoke]

Every row is timed as a CUDA graph of R launches that cycle through enough weight copies (>= 256 MiB) that
no launch finds its weights in L2, as in a real decode step. GB/s counts the weight bytes (plus x and y).
Each config's result is checked against numpy on the first shape.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import jitkern as jk

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.ops.ref_basic import from_bf16, to_bf16  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
# ("fma", BN, BK, warps): _gpu_linear_kernel; ("mma", BM, BN, BK, warps): _gpu_linear_mma_kernel (("wg", ...): its
# dots as warpgroup MMAs)
CONFIGS = [("fma", 8, 256, 2), ("fma", 4, 512, 4), ("mma", 16, 64, 64, 4), ("mma", 16, 32, 128, 4),
           ("mma", 16, 16, 256, 4), ("mma", 16, 128, 64, 4), ("mma", 32, 64, 64, 4), ("mma", 64, 64, 32, 4),
           ("mma", 16, 64, 128, 8)]


def _best(fn, sync, reps=5):
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=None,
                    help="fma,BN,BK,warps or mma,BM,BN,BK,warps[,SPLIT] (SPLIT 0: the engine's for the shape); "
                         "wg,... as mma with the dots as warpgroup MMAs (tuning.linear_wgmma, sm_90a); mma and wg take the "
                         "slab path (each K slab a program, then the sum kernel) at every M; wgs,... as wg with the K "
                         "split's slabs summed inside each program (SERIAL)")
    ap.add_argument("--m", default="1", help="comma-separated token counts (default 1)")
    ap.add_argument("--launches", type=int, default=40, help="launches per timed graph")
    ap.add_argument("--all-shapes", action="store_true", help="M > 256 on every shape (slow)")
    ap.add_argument("--smoke", action="store_true", help="one small shape, two configs")
    ap.add_argument("--shapes", nargs="*", default=None, metavar="NxK",
                    help="only these weight shapes (default: the Llama-3-8B projections and head), e.g. 28672x4096")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="register cap of the tensor-core linear (matmul.GPU_LINEAR_MAXNREG; e.g. 168, 128)")
    ap.add_argument("--x16", action="store_true",
                    help="x handed over in bf16 (linear's x_dtype='bf16': half the bytes of x; implies --activations "
                         "16bit, the same bits)")
    ap.add_argument("--activations", choices=("f32", "16bit"), default=None,
                    help="A operand of the tensor-core linear (matmul.GPU_LINEAR_ACTIVATIONS): f32 split hi + lo, "
                         "or rounded to the weights' 16-bit type (one MMA chain)")
    ap.add_argument("--serial-maxnreg", type=int, default=None,
                    help="register cap of the linear's launches that sum a split K in-program "
                         "(tuning.serial_maxnreg; 0: none)")
    args = ap.parse_args(argv)
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes]
        except ValueError:
            shapes = []
        if not shapes or any(len(sh) != 2 or min(sh) <= 0 for sh in shapes):
            ap.error(f"--shapes: expected NxK pairs of positive integers (e.g. 28672x4096), got {args.shapes}")
    from engine.ops import matmul
    choices = {}            # the device target's tuning entries (targets/tuning.py) changed for the runs
    if args.serial_maxnreg is not None:
        choices["serial_maxnreg"] = args.serial_maxnreg or None
    if args.maxnreg:
        matmul.GPU_LINEAR_MAXNREG = args.maxnreg
    if args.x16:
        args.activations = "16bit"
    if args.activations:
        matmul.GPU_LINEAR_ACTIVATIONS = args.activations
        print(f"tensor-core linear activations: {args.activations}")
    from jitkern.runtime import cuda
    import torch
    dev = cuda.get_device()
    base_target = dev.target()

    def use(**more):
        from targets import tuned
        t = tuned(base_target, **choices, **more)
        dev.target = lambda: t          # every launch on this device's arrays compiles with these choices
    configs = [(c.split(",")[0],) + tuple(int(v) for v in c.split(",")[1:]) for c in args.configs] \
        if args.configs else CONFIGS
    if args.smoke:
        shapes, configs = [(4096, 4096)], configs[:2]
    ms = [int(v) for v in args.m.split(",")]
    rng = np.random.default_rng(0)

    nb = 1 << 30
    a, b = cuda.DeviceArray.empty(nb // 4, np.float32), cuda.DeviceArray.empty(nb // 4, np.float32)
    t = _best(lambda: [dev.copy(b.ptr, a.ptr, nb) for _ in range(5)], dev.synchronize) / 5
    copy_gbs = 2 * nb / t / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write) -- the ceiling")
    a = b = None                # free the 2 GiB before the weights

    for (N, K) in shapes:
        wbytes = N * K * 2
        copies = max(1, -(-(256 << 20) // wbytes))
        host_w = to_bf16(rng.standard_normal((N, K), dtype=np.float32) * 0.05)
        ws = [cuda.to_device(host_w) for _ in range(copies)]
        tws = [torch.from_numpy(host_w.view(np.int16)).cuda().view(torch.bfloat16) for _ in range(copies)]
        for M in ms:
            if M > 256 and N * K > 6144 * 4096 and not args.all_shapes:
                continue
            host_x = rng.standard_normal((M, K), dtype=np.float32)
            x = cuda.to_device(to_bf16(host_x) if args.x16 else host_x)
            xkw = {"x_dtype": "bf16"} if args.x16 else {}
            xbytes = M * K * (2 if args.x16 else 4)
            y = cuda.DeviceArray.empty((M, N), np.float32)
            L = args.launches if M <= 64 else max(3, args.launches // 4) if M <= 256 else 3
            rows = []
            ref = None
            if (N, K) == shapes[0]:
                # 16-bit activations: the oracle takes x rounded to bf16 too (the kernel's A operand)
                xr = from_bf16(to_bf16(host_x)) if matmul.GPU_LINEAR_ACTIVATIONS == "16bit" else host_x
                ref = xr.astype(np.float64) @ from_bf16(host_w).astype(np.float64).T
            for cfg in configs:
                if cfg[0] == "fma" and M > 64:
                    continue                  # re-reads the weights per token: minutes at prefill sizes
                # wgs: wg with a split K's slabs summed inside each program (tuning.serial_split_m)
                use(linear_wgmma=cfg[0] in ("wg", "wgs"), serial_split_m=0 if cfg[0] == "wgs" else 1 << 62)
                if cfg[0] in ("mma", "wg", "wgs"):
                    # a 5th entry of 0: the engine's K split for this shape (gpu_linear_mma_tile's)
                    matmul.GPU_LINEAR_MMA_TILE = "auto"
                    split = matmul.gpu_linear_mma_tile(N, K)[4] if len(cfg) > 5 and cfg[5] == 0 else None
                    matmul.GPU_LINEAR_MMA_TILE = cfg[1:5] + (split,) if split else cfg[1:]
                else:
                    matmul.GPU_LINEAR_MMA_TILE, matmul.GPU_LINEAR_TILE = None, cfg[1:]
                matmul.linear(x, ws[0], out=y, w_dtype="bf16", **xkw)      # compile + load outside the capture
                for wc in ws[1:]:
                    # (and, with tuning.linear_tma, each weight copy's tensor map: none is made inside a capture)
                    matmul.linear(x, wc, out=y, w_dtype="bf16", **xkw)
                dev.synchronize()
                if ref is not None:
                    err = float(np.max(np.abs(y.numpy() - ref)) / (np.max(np.abs(ref)) + 1e-30))
                    if err > (1e-4 if cfg[0] == "fma" else 3e-4):
                        print(f"  WRONG RESULT for config {cfg}: max rel err {err:.2e}")
                with jk.capture() as g:
                    for i in range(L):
                        matmul.linear(x, ws[i % copies], out=y, w_dtype="bf16", **xkw)
                t = _best(g.replay, dev.synchronize) / L
                gbs = (wbytes + xbytes + M * N * 4) / t / 1e9
                rows.append((cfg, t, gbs))
            tx = torch.from_numpy(host_x).cuda().to(torch.bfloat16)
            ty = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
            torch.matmul(tx, tws[0].T, out=ty)
            torch.cuda.synchronize()
            tg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tg):
                for i in range(L):
                    torch.matmul(tx, tws[i % copies].T, out=ty)
            tt = _best(tg.replay, torch.cuda.synchronize) / L
            tgbs = (wbytes + M * K * 2 + M * N * 2) / tt / 1e9
            print(f"N={N} K={K} M={M}: cuBLAS (torch bf16) {tt * 1e6:.1f} us {tgbs:.0f} GB/s "
                  f"({tgbs / copy_gbs:.2f} of copy), {2.0 * M * N * K / tt / 1e12:.1f} TFLOP/s")
            flops = 2.0 * M * N * K
            for cfg, t, gbs in sorted(rows, key=lambda r: r[1]):
                print(f"  {cfg}: {t * 1e6:.1f} us {gbs:.0f} GB/s = {gbs / copy_gbs:.2f} of copy, "
                      f"{flops / t / 1e12:.1f} TFLOP/s, {tt / t:.2f}x cuBLAS")
        del ws, tws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
