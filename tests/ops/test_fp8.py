"""FP8 e4m3 weights kept compressed (engine/ops/fp8.py) against float references, on every tier.

Oracles: torch.float8_e4m3fn decodes every byte (the format's definition in numpy, `e4m3_to_f32_table`, must
equal it); the weights' float values are that decode times the scales (per-tensor, per-channel, 128 x 128
blocks with partial edge tiles); y is compared with x @ W^T in float64.
Tolerance: the kernel accumulates in f32 (16 lanes per chunk, then the chunks), so
|err| <= 1e-5 * sum_k |x_k W_nk| + 1e-30 (a few hundred f32 roundings of partial sums, each <= 2^-24 relative).
"""
import numpy as np
import pytest

from engine.ops import fp8 as F


def _weight(rng, N, K):
    w = rng.integers(0, 256, (N, K), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C          # no NaN encodings (checkpoints hold none)
    return w


def _scales(rng, kind, N, K):
    if kind == "tensor":
        return np.array([rng.uniform(0.001, 0.01)], np.float32)
    if kind == "channel":
        return rng.uniform(0.001, 0.01, (N, 1)).astype(np.float32)
    return rng.uniform(0.001, 0.01, (-(-N // 128), -(-K // 128))).astype(np.float32)


def test_e4m3_table_matches_torch():
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(np.arange(256, dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()
    got = F.e4m3_to_f32_table()
    finite = ~np.isnan(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_matmul_fp8(tier, kind):
    rng = np.random.default_rng(["tensor", "channel", "block"].index(kind))
    for N, K in ((37, 256), (130, 288), (3, 96)):          # 288 / 130: partial 128-tiles; 96: 32-wide chunks
        w = _weight(rng, N, K)
        s = _scales(rng, kind, N, K)
        assert F.scale_kind(s, N, K) == ("tensor" if s.size == 1 else kind)
        wd = F.dequantize_fp8(w, s).astype(np.float64)
        for M in (1, 3, 5, 17):
            x = rng.standard_normal((M, K)).astype(np.float32)
            y = F.matmul_fp8(x if M > 1 else x[0], w, s, target=tier).reshape(M, N)
            ref = x.astype(np.float64) @ wd.T
            tol = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(wd).T) + 1e-30
            err = np.abs(y - ref)
            assert (err <= tol).all(), f"{kind} N={N} K={K} M={M}: worst ratio {(err / tol).max():.3g}"


def test_dequantize_fp8_matches_torch_per_block():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    w = _weight(rng, 130, 288)
    s = _scales(rng, "block", 130, 288)
    wt = torch.from_numpy(w).view(torch.float8_e4m3fn).float()
    st = torch.from_numpy(s).repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :288]
    np.testing.assert_array_equal(F.dequantize_fp8(w, s), (wt * st).numpy())


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_matmul_fp8_batch_invariant(tier, kind):
    rng = np.random.default_rng(11)
    N, K = 41, 384
    w = _weight(rng, N, K)
    s = _scales(rng, kind, N, K)
    x = rng.standard_normal((17, K)).astype(np.float32)
    alone = np.stack([F.matmul_fp8(x[i], w, s, target=tier) for i in range(17)])
    for M in (2, 3, 5, 16, 17):
        np.testing.assert_array_equal(F.matmul_fp8(x[:M], w, s, target=tier), alone[:M], err_msg=f"M={M}")


def test_fp8_errors_name_the_problem():
    w = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="fits none"):
        F.matmul_fp8(np.zeros(64, np.float32), w, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="K=48"):
        F.matmul_fp8(np.zeros(48, np.float32), np.zeros((4, 48), np.uint8), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="x must be float32"):
        F.matmul_fp8(np.zeros(32, np.float32), w, np.ones(1, np.float32))


def test_fp8_kernel_compiles_for_the_gpu_lowering(tmp_path, monkeypatch):
    """No GPU needed: the GEMV and GEMM specialisations of every scale kind compile for sm_90a (ptxas cubins)."""
    from jitkern.backends.nvptx import find_ptxas
    from jitkern.compiler import compile_kernel, reset_kernel_cache
    from targets import get_target
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine (install the [cuda] extra)")
    launches = []
    real_run = F.run
    monkeypatch.setattr(F, "run", lambda kernel, grid, args, target=None, **kw: (
        launches.append((kernel, args, kw)), real_run(kernel, grid, args, target, **kw))[1])
    rng = np.random.default_rng(12)
    for kind in ("tensor", "channel", "block"):
        w, s = _weight(rng, 9, 256), _scales(rng, kind, 9, 256)
        F.matmul_fp8(rng.standard_normal(256).astype(np.float32), w, s)
        F.matmul_fp8(rng.standard_normal((5, 256)).astype(np.float32), w, s)
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    reset_kernel_cache()
    try:
        for kernel, args, kw in launches:
            params, consts, _ = kernel.specialize(args, kw)
            ck = compile_kernel(kernel, params, consts, get_target("sm_90a"), load=False)
            assert ck.artifacts["kernel.cubin"][:4] == b"\x7fELF"
    finally:
        reset_kernel_cache()
