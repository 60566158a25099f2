"""A plain Triton matmul, the second GEMM peer of perf/bench_kernels_cuda.py: y[M, N] = x[M, K] @ w[N, K]^T
(the projection layout: weights as stored, [out, in]), bf16/f16 in, f32 accumulation, output in x's dtype.

The standard tiled kernel: one program per (BLOCK_M, BLOCK_N) output tile, programs grouped GROUP_M tiles
deep along M so neighbouring programs share weight tiles in L2, a K loop of masked tl.dot's (Triton
pipelines the loads over `num_stages`), no split-K. Autotuned per (M, N, K) over a few configurations, the
usual large tiles for big M and small-M tiles for decode-like shapes (tl.dot needs each tile side >= 16).
Triton is imported lazily: `matmul` raises ImportError where it is missing.
"""
from __future__ import annotations

_KERNEL = None


def _configs(triton):
    cfg = []
    for bm, bn, bk, stages, warps in ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
                                      (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
                                      (16, 128, 128, 4, 4), (16, 64, 256, 3, 4), (32, 128, 128, 4, 4)):
        cfg.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                 num_stages=stages, num_warps=warps))
    return cfg


def _build():
    import triton
    import triton.language as tl

    def bench(fn, quantiles):
        # shorter than the default 25 ms warm-up + 100 ms of reps per config: 30 shapes x 9 configs fit a lease
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    @triton.autotune(configs=_configs(triton), key=["M", "N", "K"], do_bench=bench)
    @triton.jit
    def matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles walk the same column tiles together (L2 reuse of w)
        group = GROUP_M * tiles_n
        first_m = (pid // group) * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        w_tile = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]        # (BLOCK_K, BLOCK_N) of w^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_left = K - k
            a = tl.load(x_tile, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
            b = tl.load(w_tile, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
            acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return triton, matmul_kernel


def kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    return _KERNEL[1]


def matmul(x, w, out=None):
    """x [M, K] @ w [N, K]^T -> [M, N] (torch tensors on one device, rows contiguous)."""
    import torch
    k = kernel()
    triton = _KERNEL[0]
    M, K = x.shape
    N, K2 = w.shape
    if K != K2:
        raise ValueError(f"x has K={K} but w has K={K2}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need contiguous rows")
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    k[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0))
    return y


def best_config(M: int, N: int, K: int) -> str:
    """The autotuner's choice for a shape already run (for the benchmark's 'which variant ran' column)."""
    k = kernel()
    for key, cfg in getattr(k, "cache", {}).items():
        if tuple(key[:3]) == (M, N, K):
            kw = cfg.kwargs
            return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{cfg.num_stages} w{cfg.num_warps}"
    return "?"
