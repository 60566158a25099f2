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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
