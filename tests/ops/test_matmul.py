"""engine.ops.matmul (linear, pack_weight + linear_packed, matmul) against numpy float64 references, on every
CPU tier this host can run.

Tolerances, per weight dtype:
- f32, f16, bf16 weights alike: f16 and bf16 values are exactly representable in f32, so the reference is the
  float64 product of the *same* (exactly widened) weights, and the only error left is the f32 accumulation.
  The test bound is the standard one for a length-K dot product in f32 plus one rounding for the bias:
      |y - ref| <= (K + 2) * 2**-24 * (|x| @ |w|^T + |bias|)       (elementwise)
  It holds for the sequential FMA chain (outer-product kernel) and for the lane-split sums + reduction tree
  (dot-product kernel). A dropped or doubled k term (an error of ~|x_k w_nk| ~ 0.5) exceeds it by far.
Inputs are fresh standard-normal values; sizes include odd N and K (37, 45, 129), aligned ones (64, 128), M in
{1, 3, 5, 64, 67} (GEMV, fewer rows than a tile, exact and ragged tiles), with and without bias.
"""
import numpy as np
import pytest

import jitkern as jk
from engine.ops import matmul as mm

U32 = 2.0 ** -24
SHAPES_NK = [(37, 45), (45, 129), (64, 128), (129, 37)]
MS = [1, 3, 5, 64, 67]      # 1, 3, 5: the sequential-row GEMV kernel (5 overlaps a 4-token block)
WDTYPES = ["f32", "f16", "bf16"]


def _weights(rng, N, K, wdt):
    """(array passed to the op, the same values widened to float64)."""
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    if wdt == "f32":
        return w32, w32.astype(np.float64)
    if wdt == "f16":
        w16 = w32.astype(np.float16)
        return w16, w16.astype(np.float64)
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)          # bf16: the top 16 bits
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _check(y, x, w64, bias):
    x64 = x.astype(np.float64)
    ref = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    if bias is not None:
        ref = ref + bias
        mag = mag + np.abs(bias)
    K = x.shape[-1]
    tol = (K + 2) * U32 * mag + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert y.shape == ref.shape
    assert np.isfinite(y).all()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"


def _cases():
    i = 0
    for N, K in SHAPES_NK:
        for M in MS:
            i += 1
            yield M, N, K, i % 2 == 0        # bias on every other case


@pytest.mark.parametrize("wdt", WDTYPES)
def test_linear(tier, wdt):
    rng = np.random.default_rng(100 + WDTYPES.index(wdt))
    for M, N, K, with_bias in _cases():
        x = rng.standard_normal((M, K)).astype(np.float32)
        w, w64 = _weights(rng, N, K, wdt)
        bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
        mm._LAST.clear()
        y = mm.linear(x, w, bias, target=tier, w_dtype=wdt)
        gpu_name = "_gpu_linear_mma_kernel" if tier.mma in ("mma.sync", "wgmma", "tcgen05") and \
            wdt in ("f16", "bf16") and K % 16 == 0 else "_gpu_linear_kernel"
        ran = mm.last_compiled(gpu_name if tier.is_gpu else
                               "_gemv_kernel" if M <= mm.GEMV_MAX_M else "_rows_kernel")
        assert ran is not None and ran.target.name == tier.name
        assert ran.constexprs["HAS_BIAS"] == with_bias
        _check(y, x, w64, bias)


@pytest.mark.parametrize("wdt", WDTYPES)
def test_linear_packed(tier, wdt):
    rng = np.random.default_rng(200 + WDTYPES.index(wdt))
    for M, N, K, with_bias in _cases():
        x = rng.standard_normal((M, K)).astype(np.float32)
        w, w64 = _weights(rng, N, K, wdt)
        bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
        pw = mm.pack_weight(w, w_dtype=wdt, target=tier)
        assert pw.dtype == wdt and pw.data.dtype == w.dtype and (pw.N, pw.K) == (N, K)
        y = mm.linear_packed(x, pw, bias, target=tier)
        assert mm.last_compiled("_gemm_kernel").target.name == tier.name
        _check(y, x, w64, bias)


def test_matmul(tier):
    rng = np.random.default_rng(300)
    for M, K, N in [(1, 1, 1), (3, 45, 37), (67, 129, 45), (64, 128, 64), (5, 301, 70), (9, 7, 33)]:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        c = mm.matmul(a, b, target=tier)
        assert mm.last_compiled("_gemm_kernel").target.name == tier.name
        _check(c, a, b.T.astype(np.float64), None)


def test_pack_layout_and_padding():
    # panel p holds columns [p*BN, (p+1)*BN) of w^T as K rows of BN values, zeros past N
    rng = np.random.default_rng(400)
    N, K = 37, 45
    w = rng.standard_normal((N, K)).astype(np.float32)
    pw = mm.pack_weight(w, block_n=16)
    panels = -(-N // 16)
    want = np.zeros((panels * 16, K), np.float32)
    want[:N] = w
    want = want.reshape(panels, 16, K).transpose(0, 2, 1).ravel()
    np.testing.assert_array_equal(pw.data, want)


def test_out_views_and_vector_input():
    rng = np.random.default_rng(500)
    N, K = 45, 129
    w = rng.standard_normal((N, K)).astype(np.float32)
    w64 = w.astype(np.float64)
    pw = mm.pack_weight(w)
    # 1-D x gives 1-D y, written into `out` and returned
    x = rng.standard_normal(K).astype(np.float32)
    out = np.full(N, np.nan, np.float32)
    for fn in (lambda o: mm.linear(x, w, out=o), lambda o: mm.linear_packed(x, pw, out=o)):
        out[:] = np.nan
        r = fn(out)
        assert r is out
        _check(out[None, :], x[None, :], w64, None)
    # x with a row stride larger than K (a column slice of a wider array); out rows inside a wider array
    big = rng.standard_normal((67, K + 11)).astype(np.float32)
    xs = big[:, 3:3 + K]
    canvas = np.full((67, N + 5), 7.0, np.float32)
    for fn in (lambda o: mm.linear(xs, w, out=o), lambda o: mm.linear_packed(xs, pw, out=o)):
        canvas[:] = 7.0
        fn(canvas[:, 2:2 + N])
        _check(canvas[:, 2:2 + N], xs, w64, None)
        assert (canvas[:, :2] == 7.0).all() and (canvas[:, 2 + N:] == 7.0).all()
    # matmul into out, b given as a transposed view (not C-contiguous)
    a = rng.standard_normal((13, K)).astype(np.float32)
    c = np.empty((13, N), np.float32)
    assert mm.matmul(a, w.T, out=c) is c
    _check(c, a, w64, None)


def test_bf16_as_pointer():
    rng = np.random.default_rng(600)
    N, K = 37, 129
    _, w64 = _weights(rng, N, K, "bf16")
    bits = (w64.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((3, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    p = jk.as_pointer(bits, "bf16")
    _check(mm.linear(x, p, bias), x, w64, bias)
    pw = mm.pack_weight(p)
    assert pw.dtype == "bf16"
    _check(mm.linear_packed(x, pw, bias), x, w64, bias)


def test_large_k_uses_both_loops():
    # K well past the unrolled main loop and the vector width, with a tail of every residue
    rng = np.random.default_rng(700)
    for K in (1023, 1026):
        x = rng.standard_normal((5, K)).astype(np.float32)
        w = rng.standard_normal((19, K)).astype(np.float32)
        _check(mm.linear(x, w), x, w.astype(np.float64), None)
        _check(mm.linear_packed(x, mm.pack_weight(w)), x, w.astype(np.float64), None)


@pytest.mark.parametrize("odt", ["bf16", "f16"])
def test_linear_16bit_out_rounds_the_f32_result(tier, odt):
    """`out` in 16-bit storage (uint16 = bf16, float16): the kernels store the f32 result rounded once (nearest
    even), through every kernel the token count picks; K = 0 gives the bias rounded. The reference is the f32
    result of the same call, rounded by numpy."""
    from tests.ops.ref_basic import to_bf16
    rng = np.random.default_rng(7)
    rnd = to_bf16 if odt == "bf16" else (lambda a: a.astype(np.float16))
    st = np.uint16 if odt == "bf16" else np.float16
    for M, N, K, with_bias in _cases():
        x = rng.standard_normal((M, K)).astype(np.float32)
        w, _ = _weights(rng, N, K, "bf16")
        bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
        y32 = mm.linear(x, w, bias, target=tier, w_dtype="bf16")
        out = np.empty((M, N), st)
        assert mm.linear(x, w, bias, out=out, target=tier, w_dtype="bf16") is out
        np.testing.assert_array_equal(out, rnd(y32), err_msg=f"M={M} N={N} K={K}")
    out = np.empty((3, 5), st)
    b = rng.standard_normal(5).astype(np.float32)
    mm.linear(np.zeros((3, 0), np.float32), np.zeros((5, 0), np.float32), b, out=out, target=tier)
    np.testing.assert_array_equal(out, np.broadcast_to(rnd(b), (3, 5)))
    with pytest.raises(ValueError, match="out: expected a float32 \\(or uint16"):
        mm.linear(x, w, out=np.empty((M, N), np.int16), target=tier, w_dtype="bf16")


def test_bad_arguments_name_the_field():
    x = np.ones((2, 8), np.float32)
    w = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="x: has 7 columns"):
        mm.linear(np.ones((2, 7), np.float32), w)
    with pytest.raises(ValueError, match="x: expected float32"):
        mm.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="w: dtype int32"):
        mm.linear(x, w.astype(np.int32))
    with pytest.raises(ValueError, match="w_dtype"):
        mm.linear(x, w, w_dtype="f8")
    with pytest.raises(ValueError, match="w: w_dtype='bf16' needs uint16"):
        mm.linear(x, w, w_dtype="bf16")
    with pytest.raises(ValueError, match="bias"):
        mm.linear(x, w, bias=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="out"):
        mm.linear(x, w, out=np.empty((2, 5), np.float32))
    with pytest.raises(ValueError, match="packed"):
        mm.linear_packed(x, w)
    with pytest.raises(ValueError, match="inner sizes differ"):
        mm.matmul(x, np.ones((7, 3), np.float32))
    with pytest.raises(ValueError, match="b: expected a 2-D float32"):
        mm.matmul(x, np.ones((8, 3), np.float16))


@pytest.mark.parametrize("wdt", ["f32", "f16"])
def test_linear_is_batch_invariant(tier, wdt):
    """A token's output is bit-identical whether it is multiplied alone (GEMV path) or inside a batch of
    any size (tile kernels): the engine's greedy tokens must not depend on what else is batched."""
    rng = np.random.default_rng(11)
    N, K = 67, 301
    w = rng.standard_normal((N, K)).astype(np.float32 if wdt == "f32" else np.float16)
    x = rng.standard_normal((40, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    alone = np.stack([mm.linear(x[i:i + 1], w, bias=b, target=tier)[0] for i in range(40)])
    for m in (2, 3, 5, 8, 17, 40):
        got = mm.linear(x[:m], w, bias=b, target=tier)
        np.testing.assert_array_equal(got, alone[:m], err_msg=f"batch of {m}")
