"""First GPU numbers: memory-bound jitkern kernels on a CUDA device against the driver's own device-to-device
copy measured in the same run (the bandwidth ceiling), printing which variant ran.

    python perf/bench_cuda.py [--mib 1024] [--repeat 20]

Rows: `copy` (a 1-D tile copy, 16-byte vector accesses when the analysis proves them), `copy-gather` (the
same kernel with a length that is not a multiple of 16: per-element predicated accesses), `row-sumsq` (a
row reduction through shared memory, rms-norm's core), each as GB/s (bytes read + written) and as a ratio
of the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import jitkern as jk


@jk.kernel
def _copy(x, out, n, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, jk.load(x + offs, mask=m), mask=m)


@jk.kernel
def _row_sumsq(x, out, N: jk.constexpr):
    row = jk.program_id(0)
    v = jk.load(x + row * N + jk.arange(0, N))
    jk.store(out + row, jk.sum(v * v, axis=0))


@jk.kernel
def _gemm_bf16(x, w, y, M, N, K, BM: jk.constexpr, BN: jk.constexpr, BK: jk.constexpr):
    # y[M, N] = x[M, K] @ w[N, K]^T, bf16 in, f32 out: jk.dot of 16-bit tiles (the matrix units on GPUs)
    rm = jk.program_id(0) * BM + jk.arange(0, BM)
    rn = jk.program_id(1) * BN + jk.arange(0, BN)
    acc = jk.zeros((BM, BN), jk.f32)
    for k in range(0, K, BK):
        rk = k + jk.arange(0, BK)
        a = jk.load(x + rm[:, None] * K + rk[None, :])
        b = jk.load(w + rn[None, :] * K + rk[:, None])
        acc = jk.dot(a, b, acc)
    jk.store(y + rm[:, None] * N + rn[None, :], acc)


def _time(fn, dev, repeat):
    fn()
    dev.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        dev.synchronize()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="buffer size in MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=20, help="launches per timing (default 20)")
    ap.add_argument("--no-gemm", action="store_true", help="skip the bf16 GEMM rows (they need torch)")
    args = ap.parse_args(argv)
    from jitkern.runtime import cuda
    dev = cuda.get_device()
    n = args.mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n, dtype=np.float32)
    x = cuda.DeviceArray.from_numpy(host)
    out = cuda.DeviceArray.empty(n, np.float32)
    nbytes = 2 * n * 4
    t_ref = _time(lambda: dev.copy(out.ptr, x.ptr, n * 4), dev, args.repeat)
    ref_gbs = nbytes / t_ref / 1e9
    rows = [("cuMemcpyDtoD (ceiling)", ref_gbs)]
    B = 4096
    for nw in (4, 8):
        t = _time(lambda: _copy[(jk.cdiv(n, B),)](x, out, n, BLOCK=B, num_warps=nw), dev, args.repeat)
        rows.append((f"copy BLOCK={B} num_warps={nw}", nbytes / t / 1e9))
    assert np.array_equal(out.numpy()[:1000], host[:1000])
    n_odd = n - 3
    t = _time(lambda: _copy[(jk.cdiv(n_odd, B),)](x, out, n_odd, BLOCK=B, num_warps=8), dev, args.repeat)
    rows.append(("copy-gather (n % 16 != 0)", 2 * n_odd * 4 / t / 1e9))
    N = 4096
    M = n // N
    rs = cuda.DeviceArray.empty(M, np.float32)
    t = _time(lambda: _row_sumsq[(M,)](x, rs, N=N, num_warps=4), dev, args.repeat)
    rows.append((f"row-sumsq N={N}", M * N * 4 / t / 1e9))
    ref = (host[:N * 8].reshape(8, N).astype(np.float64) ** 2).sum(1)
    np.testing.assert_allclose(rs.numpy()[:8], ref, rtol=1e-4)
    print(f"{'kernel':<34} {'GB/s':>8} {'of copy':>8}")
    for name, gbs in rows:
        print(f"{name:<34} {gbs:8.0f} {gbs / ref_gbs:8.2f}")
    if not args.no_gemm:
        _gemm_rows(dev, args.repeat)
    return 0


def _gemm_rows(dev, repeat):
    """bf16 GEMM through jk.dot (mma.sync) against torch.matmul (cuBLAS) on the same shapes, same run."""
    from jitkern.runtime import cuda
    try:
        import torch
    except ImportError:
        print("torch missing: no GEMM peer")
        return
    print(f"{'bf16 GEMM (M, N, K)':<24} {'jitkern TFLOP/s':>16} {'cuBLAS TFLOP/s':>15} {'ratio':>6}  max rel err")
    for M, N, K in ((256, 4096, 4096), (2048, 4096, 4096)):
        xt = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = cuda.DeviceArray.from_numpy(xt.view(torch.int16).cpu().numpy().view(np.uint16), dtype="bf16")
        w = cuda.DeviceArray.from_numpy(wt.view(torch.int16).cpu().numpy().view(np.uint16), dtype="bf16")
        y = cuda.DeviceArray.empty((M, N), np.float32)
        BM, BN, BK = 64, 64, 32
        grid = (M // BM, N // BN)
        t = _time(lambda: _gemm_bf16[grid](x, w, y, M, N, K, BM=BM, BN=BN, BK=BK, num_warps=4), dev, repeat)
        ref = (xt.float() @ wt.float().T)
        err = float((torch.from_numpy(y.numpy()).cuda() - ref).abs().max() / ref.abs().max())
        for _ in range(3):                       # warm up cuBLAS (handle creation, heuristics)
            torch.matmul(xt, wt.T)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            torch.matmul(xt, wt.T)
        torch.cuda.synchronize()
        tt = (time.perf_counter() - t0) / repeat
        fl = 2 * M * N * K
        print(f"{str((M, N, K)):<24} {fl / t / 1e12:16.1f} {fl / tt / 1e12:15.1f} {tt / t:6.3f}  {err:.2e}")


if __name__ == "__main__":
    raise SystemExit(main())
