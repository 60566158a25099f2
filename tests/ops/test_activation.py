"""Gated activations, tanh GELU, residual adds, copies/conversions, scaling and soft-capping against float64
numpy on every runnable tier. Tolerances: ref_basic.RTOL of the output dtype relative to |result| (+ the
inputs' magnitude for sums, where results may cancel)."""
import zlib

import numpy as np
import pytest

from engine.ops.activation import (add, add_inplace, copy, gelu_tanh, gelu_tanh_and_mul, scale_inplace,
                                    silu_and_mul, softcap_inplace)

from .ref_basic import as_f64, assert_close, from_bf16, gelu_tanh_ref, silu_ref, stored, to_bf16


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("op", ["silu", "gelu"])
def test_act_and_mul(tier, op, dtype):
    rng = _rng(tier, op, dtype)
    T, I = 5, 577
    buf = stored(rng.standard_normal((T, 2 * I + 9)) * 4, dtype)
    gu = buf[:, 9:]                                     # row-strided view
    g, u = as_f64(gu[:, :I]), as_f64(gu[:, I:])
    f = silu_and_mul if op == "silu" else gelu_tanh_and_mul
    act = silu_ref if op == "silu" else gelu_tanh_ref
    out = f(gu, target=tier)
    assert out.shape == (T, I) and out.dtype == gu.dtype
    want = act(g) * u
    # silu: relative error ~ a few f32 ulps; gelu's 1 + tanh(z) cancels for negative gate values, leaving
    # an absolute error of ~|g| * eps(1) / 2, i.e. 0.05 * |g| * |u| * rtol(f32) is ~16x that
    scale = np.abs(want) + 0.05 * np.abs(g) * np.abs(u)
    assert_close(out, want, dtype, op, scale=scale)
    # into a strided out, f32 out from half inputs
    obuf = np.full((T, I + 3), 7.0, np.float32)
    f(gu, out=obuf[:, 3:], target=tier)
    assert_close(obuf[:, 3:], want, "f32", op, scale=scale)      # f32 out: no output rounding
    assert (obuf[:, :3] == 7.0).all()


def test_silu_extremes(tier):
    # exp overflow/underflow ends: silu(-100) = -0, silu(100) = 100, no NaN
    g = np.array([[-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 88.0]], np.float32)
    gu = np.concatenate([g, np.ones_like(g)], axis=1)
    out = silu_and_mul(gu, target=tier)
    assert np.isfinite(out).all()
    assert np.allclose(out, silu_ref(g), rtol=1e-6, atol=1e-30)


def test_gelu_tanh_matches_torch(tier):
    torch = pytest.importorskip("torch")
    x = _rng(tier, "gelu").standard_normal((3, 1000)).astype(np.float32) * 5
    ref = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    y = gelu_tanh(x, target=tier)
    assert np.allclose(y, ref, rtol=2e-6, atol=2e-6)
    flat = x.reshape(-1).copy()
    gelu_tanh(flat, out=flat, target=tier)          # 1-D, in place
    assert np.array_equal(flat, y.reshape(-1))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_add_and_add_inplace(tier, dtype):
    rng = _rng(tier, "add", dtype)
    a = stored(rng.standard_normal((7, 577)), dtype)
    bbuf = stored(rng.standard_normal((7, 600)), dtype)
    b = bbuf[:, 23:]
    want = as_f64(a) + as_f64(b)
    scale = np.abs(as_f64(a)) + np.abs(as_f64(b))
    assert_close(add(a, b, target=tier), want, dtype, "add", scale=scale)
    add_inplace(a, b, target=tier)
    assert_close(a, want, dtype, "add_inplace", scale=scale)


def test_add_broadcast_bias_rows(tier):
    # a stride-0 row view (a bias repeated over rows), as the engine passes it
    rng = _rng(tier, "bias")
    y = rng.standard_normal((6, 333)).astype(np.float32)
    bias = rng.standard_normal(333).astype(np.float32)
    rows = np.lib.stride_tricks.as_strided(bias, shape=(6, 333), strides=(0, 4))
    want = y + bias
    add(y, rows, out=y, target=tier)
    assert np.array_equal(y, want)                  # one f32 add: exact


def test_copy_conversions_are_exactly_rounded(tier):
    rng = _rng(tier, "copy")
    x = (rng.standard_normal((5, 301)) * 1000).astype(np.float32)
    x[0, :4] = [1e-6, 6e-8, 3e38, -2.5e-5]
    h = np.empty(x.shape, np.float16)
    copy(x[:, :], h, target=tier)
    with np.errstate(over="ignore"):
        assert np.array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
    b = np.empty(x.shape, np.uint16)
    copy(x, b, target=tier)
    assert np.array_equal(b, to_bf16(x))
    back = np.empty(x.shape, np.float32)
    copy(b, back, target=tier)
    assert np.array_equal(back, from_bf16(b))


def test_scale_and_softcap(tier):
    rng = _rng(tier, "scale")
    x = (rng.standard_normal((4, 1000)) * 60).astype(np.float32)
    y = x.copy()
    scale_inplace(y, 0.125, target=tier)
    assert np.array_equal(y, x * np.float32(0.125))          # power-of-two scale: exact
    z = x.copy()
    softcap_inplace(z, 30.0, target=tier)
    want = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    assert np.allclose(z, want, rtol=3e-6, atol=3e-6)
    assert np.abs(z).max() <= 30.0
    with pytest.raises(ValueError, match="cap"):
        softcap_inplace(z, 0.0)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(np.ones((3, 5), np.float32))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(np.ones((3, 8), np.float32), out=np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="add: b"):
        add(np.ones((3, 8), np.float32), np.ones((3, 7), np.float32))


def test_gelu_erf_matches_float64(tier):
    """Exact GELU (BERT's "gelu") vs 0.5 x (1 + erf(x / sqrt 2)) in float64, odd sizes, in place."""
    import math
    from engine.ops.activation import gelu
    x = _rng(tier, "gelu-erf").standard_normal((3, 1003)).astype(np.float32) * 4
    ref = 0.5 * x.astype(np.float64) * (1 + np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2)))
    y = gelu(x, target=tier)
    assert np.allclose(y, ref, rtol=3e-6, atol=3e-6), np.max(np.abs(y - ref))
    assert not np.allclose(y, gelu_tanh(x, target=tier), rtol=1e-7, atol=1e-7)   # not the tanh form
    flat = x.reshape(-1).copy()
    gelu(flat, out=flat, target=tier)
    assert np.array_equal(flat, y.reshape(-1))


# ------------------------------------------------------------ gated activation fused with the int8 quantisation
@pytest.mark.parametrize("I", [1536, 1504, 96, 32])          # 1504: 47 blocks (q4x4 leftovers: a pair + one)
@pytest.mark.parametrize("layout", ["natural", "q4", "q4x4"])
@pytest.mark.parametrize("op", ["silu", "gelu"])
def test_act_and_mul_q8_is_act_then_quantize(tier, I, layout, op):
    """act_and_mul_q8 gives bit for bit quantize_q8(silu_and_mul(gu)) (the engine's unfused path) on a
    row-strided input; dequantised values within half a step of the float64 activation; rows alone equal the
    rows in the batch."""
    from engine.ops.activation import act_and_mul_q8
    from engine.ops.quant import quantize_q8
    rng = _rng(tier, "q8", I, layout, op)
    T = 5
    buf = (rng.standard_normal((T, 2 * I + 7)) * 3).astype(np.float32)
    gu = buf[:, 7:]
    unfused = (silu_and_mul if op == "silu" else gelu_tanh_and_mul)(gu, target=tier)
    ref = quantize_q8(unfused, layout=layout, rep4=True, target=tier)

    def fused(rows, rep4):
        n = rows.stop - rows.start
        o8 = (np.full((n, I), 99, np.int8), np.full((n, I // 32), np.nan, np.float32),
              np.full((n, I // 32), np.nan, np.float32))
        o4 = (np.full((n, I // 8), np.nan, np.float32), np.full((n, I // 8), np.nan, np.float32)) if rep4 else None
        got = act_and_mul_q8(gu[rows], o8, gelu=op == "gelu", layout=layout, out4=o4, target=tier)
        assert got.layout == layout
        return list(got) + ([got.scales4, got.sums4] if rep4 else [])

    full = fused(slice(0, T), True)
    for a, b in zip(list(ref) + [ref.scales4, ref.sums4], full):
        np.testing.assert_array_equal(a, b)
    # the split of a row over programs (GPUs: 8 blocks a program) never changes a value
    import engine.ops.activation as act_mod
    for bpp in (4, 8):
        act_mod.ACT_Q8_BLOCKS_PER_PROGRAM = bpp
        try:
            split = fused(slice(0, T), True)
        finally:
            act_mod.ACT_Q8_BLOCKS_PER_PROGRAM = None
        for a, b in zip(full, split):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(ref, fused(slice(0, T), False)):
        np.testing.assert_array_equal(a, b)
    for t in (0, 3):
        for a, b in zip(fused(slice(t, t + 1), True), full):
            np.testing.assert_array_equal(a[0], b[t])
    g, u = as_f64(gu[:, :I]), as_f64(gu[:, I:])
    act64 = (silu_ref(g) if op == "silu" else gelu_tanh_ref(g)) * u
    if layout == "natural":
        d = np.repeat(ref[1], 32, axis=1).astype(np.float64)
        assert np.all(np.abs(ref[0] * d - act64) <= 0.5 * d + 1e-5 * np.abs(act64) + 1e-6)


def test_act_and_mul_q8_bad_arguments_name_the_field():
    from engine.ops.activation import act_and_mul_q8
    o8 = (np.zeros((2, 32), np.int8), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        act_and_mul_q8(np.ones((2, 80), np.float32), o8)
    with pytest.raises(ValueError, match="out qx"):
        act_and_mul_q8(np.ones((2, 64), np.float32), (np.zeros((2, 33), np.int8),) + o8[1:])
