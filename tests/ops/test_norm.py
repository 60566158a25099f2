"""RMSNorm (plain, fused residual add, Gemma offset, per-head) and LayerNorm against float64 numpy, on every
runnable CPU tier. Tolerances: ref_basic.RTOL per output dtype, relative to each element's magnitude."""
import zlib

import numpy as np
import pytest

from engine.ops.norm import layer_norm, rms_norm, rms_norm_heads

from .ref_basic import as_f64, assert_close, layer_norm_ref, rms_norm_ref, stored


def _rng(tier, salt):
    return np.random.default_rng(zlib.crc32(f"{tier.name}/{salt}".encode()))


@pytest.mark.parametrize("T,n", [(5, 577), (3, 8192), (1, 16), (4, 4097)])
def test_rms_norm_f32(tier, T, n):
    rng = _rng(tier, n)
    x = rng.standard_normal((T, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    y = rms_norm(x, w, 1e-6, target=tier)
    assert y.dtype == np.float32 and y.shape == (T, n)
    assert_close(y, rms_norm_ref(x, w, 1e-6), "f32", "rms_norm", scale=np.abs(rms_norm_ref(x, np.abs(w) + 1, 1e-6)))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_rms_norm_fused_residual_strided_offset(tier, dtype):
    """vLLM fused_add_rms_norm: residual += x (written back), out = norm(residual) * (w + 1); x and residual
    are row-strided views; out is x itself."""
    rng = _rng(tier, dtype)
    T, n = 7, 577
    xbuf = stored(rng.standard_normal((T, n + 40)), dtype)
    rbuf = stored(rng.standard_normal((T, n + 13)) * 2, dtype)
    x, r = xbuf[:, 3:3 + n], rbuf[:, :n]
    w = stored(rng.standard_normal(n) * 0.1, dtype)
    x0, r0 = as_f64(x).copy(), as_f64(r).copy()
    keep = (as_f64(xbuf[:, :3]).copy(), as_f64(xbuf[:, 3 + n:]).copy())
    out = rms_norm(x, w, 1e-5, out=x, residual=r, weight_offset=1.0, target=tier)
    assert out is x
    s = stored(x0 + r0, dtype)                 # the sum as stored in the residual's dtype
    assert np.array_equal(as_f64(r), as_f64(s)) or dtype == "f32" and np.allclose(as_f64(r), x0 + r0, rtol=1e-6)
    ref = rms_norm_ref(as_f64(r), as_f64(w), 1e-5, 1.0)
    assert_close(x, ref, dtype, "fused rms_norm", scale=np.abs(rms_norm_ref(as_f64(r), np.abs(as_f64(w)) + 1, 1e-5)))
    assert np.array_equal(as_f64(xbuf[:, :3]), keep[0]) and np.array_equal(as_f64(xbuf[:, 3 + n:]), keep[1])


def test_rms_norm_mixed_dtypes(tier):
    """f16 activations with a bf16 weight and an f32 output."""
    rng = _rng(tier, "mixed")
    x = stored(rng.standard_normal((3, 300)), "f16")
    w = stored(rng.standard_normal(300), "bf16")
    out = np.empty((3, 300), np.float32)
    rms_norm(x, w, 1e-6, out=out, target=tier)
    ref = rms_norm_ref(as_f64(x), as_f64(w), 1e-6)
    assert_close(out, ref, "f32", "mixed", scale=np.abs(rms_norm_ref(as_f64(x), np.abs(as_f64(w)) + 1, 1e-6)))


@pytest.mark.parametrize("D", [128, 80])
def test_rms_norm_heads_in_qkv_view(tier, D):
    rng = _rng(tier, D)
    T, H, KVH = 6, 5, 2
    qkv = rng.standard_normal((T, (H + 2 * KVH) * D)).astype(np.float32)
    ref_all = qkv.astype(np.float64).copy()
    k = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D)
    assert not k.flags.c_contiguous or T == 1
    w = rng.standard_normal(D).astype(np.float32)
    rms_norm_heads(k, w, 1e-6, weight_offset=0.5, target=tier)
    k0 = ref_all[:, H * D:(H + KVH) * D].reshape(T, KVH, D)
    ref_k = rms_norm_ref(k0, w, 1e-6, 0.5)
    assert_close(k, ref_k, "f32", "rms_norm_heads", scale=np.abs(rms_norm_ref(k0, np.abs(w) + 1, 1e-6)))
    # everything outside k is untouched
    mask = np.ones(qkv.shape, bool)
    mask[:, H * D:(H + KVH) * D] = False
    assert np.array_equal(qkv[mask], ref_all[mask].astype(np.float32))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [768, 577])
def test_layer_norm(tier, n, bias):
    rng = _rng(tier, (n, bias))
    T = 5
    xb = (rng.standard_normal((T, n + 7)) * 2 + 0.7).astype(np.float32)
    x = xb[:, 7:]
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    y = layer_norm(x, w, b, 1e-5, target=tier)
    ref = layer_norm_ref(x, w, b, 1e-5)
    # x - mean cancels: the error scale is (|x| + |mean|) / std * |w| (+ |b|)
    x64 = x.astype(np.float64)
    mu, sd = x64.mean(-1, keepdims=True), x64.std(-1, keepdims=True)
    scale = (np.abs(x64) + np.abs(mu)) / sd * (np.abs(w) + 1e-3) + (np.abs(b) if bias else 0)
    assert_close(y, ref, "f32", "layer_norm", scale=scale)


def test_layer_norm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 333)).astype(np.float32)
    w, b = rng.standard_normal(333).astype(np.float32), rng.standard_normal(333).astype(np.float32)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (333,), torch.from_numpy(w), torch.from_numpy(b),
                                         1e-5).numpy()
    assert np.allclose(layer_norm(x, w, b, 1e-5), ref, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_field():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, np.ones(8, np.float32), 1e-6, residual=np.ones((3, 8), np.float32))
    with pytest.raises(TypeError, match="float64"):
        rms_norm(x.astype(np.float64), np.ones(8, np.float32), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(np.ones((8, 2), np.float32).T, np.ones(8, np.float32), 1e-6)


# ------------------------------------------------------------------ RMSNorm fused with the int8 quantisation
def _q8_out(T, n, rep4):
    o8 = (np.full((T, n), 99, np.int8), np.full((T, n // 32), np.nan, np.float32),
          np.full((T, n // 32), np.nan, np.float32))
    o4 = (np.full((T, n // 8), np.nan, np.float32), np.full((T, n // 8), np.nan, np.float32)) if rep4 else None
    return o8, o4


def _q8_arrays(xq):
    return list(xq) + ([xq.scales4, xq.sums4] if xq.scales4 is not None else [])


@pytest.mark.parametrize("n", [576, 1504, 96, 32])           # 1504: 47 blocks (q4x4 leftovers: a pair + one)
@pytest.mark.parametrize("layout", ["natural", "q4", "q4x4"])
@pytest.mark.parametrize("mode", ["plain", "residual", "first"])
def test_rms_norm_q8_is_norm_then_quantize(tier, n, layout, mode):
    """rms_norm_q8 gives bit for bit quantize_q8(rms_norm(...)) (the engine's unfused path), with the residual
    stream updated as rms_norm does (residual += x; `first`: residual = x); the dequantised values are within
    half a quantisation step of the float64 norm; every row alone equals the row in the batch."""
    from engine.ops.norm import rms_norm_q8
    from engine.ops.quant import quantize_q8
    rng = _rng(tier, f"q8/{n}/{layout}/{mode}")
    T = 5
    x = (rng.standard_normal((T, n)) * 2).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    r0 = rng.standard_normal((T, n)).astype(np.float32)
    r_ref = r0.copy()
    if mode == "plain":
        y = rms_norm(x, w, 1e-5, weight_offset=0.25, target=tier)
    elif mode == "residual":
        y = rms_norm(x, w, 1e-5, out=np.empty_like(x), residual=r_ref, weight_offset=0.25, target=tier)
    else:
        r_ref[...] = x
        y = rms_norm(r_ref, w, 1e-5, weight_offset=0.25, target=tier)
    ref = quantize_q8(y, layout=layout, rep4=True, target=tier)
    for rep4 in (True, False):
        o8, o4 = _q8_out(T, n, rep4)
        r = r0.copy()
        got = rms_norm_q8(x, w, 1e-5, o8, layout=layout, out4=o4, residual=None if mode == "plain" else r,
                          residual_copy=mode == "first", weight_offset=0.25, target=tier)
        assert got.layout == layout
        for a, b in zip(_q8_arrays(ref), _q8_arrays(got)):
            np.testing.assert_array_equal(a, b)
        if mode != "plain":
            np.testing.assert_array_equal(r, r_ref)
    # the oracle: per block, q * d is the float64 norm to within half a step d (plus f32 rounding)
    src = x if mode != "residual" else x.astype(np.float64) + r0
    ref64 = rms_norm_ref(as_f64(src), as_f64(w), 1e-5, 0.25)
    qx, d = ref[0].astype(np.float64), np.repeat(ref[1], 32, axis=1).astype(np.float64)
    if layout == "natural":
        deq = qx * d
        assert np.all(np.abs(deq - ref64) <= 0.5 * d + 1e-5 * np.abs(ref64) + 1e-6)
    # batch invariance: each row alone
    for t in (0, T - 1):
        o8, o4 = _q8_out(1, n, True)
        r = r0[t:t + 1].copy()
        one = rms_norm_q8(x[t:t + 1], w, 1e-5, o8, layout=layout, out4=o4,
                          residual=None if mode == "plain" else r, residual_copy=mode == "first",
                          weight_offset=0.25, target=tier)
        for a, b in zip(_q8_arrays(one), _q8_arrays(ref)):
            np.testing.assert_array_equal(a[0], b[t])


def test_rms_norm_q8_bad_arguments_name_the_field():
    from engine.ops.norm import rms_norm_q8
    x = np.ones((2, 64), np.float32)
    w = np.ones(64, np.float32)
    o8, _ = _q8_out(2, 64, False)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_q8(np.ones((2, 40), np.float32), np.ones(40, np.float32), 1e-6, o8)
    with pytest.raises(ValueError, match="out scales"):
        rms_norm_q8(x, w, 1e-6, (o8[0], o8[1][:, :1], o8[2]))
    with pytest.raises(ValueError, match="layout"):
        rms_norm_q8(x, w, 1e-6, o8, layout="q8")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_rms_norm_residual_copy_is_copy_then_norm(tier, dtype):
    """rms_norm(x, residual=r, residual_copy=True): r = x (rounded to r's dtype), out = norm(r), bit for bit as
    copy + rms_norm (a first layer's residual stream in one launch)."""
    from engine.ops.activation import copy
    rng = _rng(tier, f"rescopy/{dtype}")
    T, n = 4, 577
    x = stored(rng.standard_normal((T, n)) * 2, "f32")
    w = stored(rng.standard_normal(n), dtype)
    r1 = stored(rng.standard_normal((T, n)), dtype)
    r2 = r1.copy()
    copy(x, out=r1, target=tier)
    want = rms_norm(r1, w, 1e-5, out=np.empty_like(x), weight_offset=1.0, target=tier)
    got = rms_norm(x, w, 1e-5, out=np.empty_like(x), residual=r2, residual_copy=True, weight_offset=1.0, target=tier)
    np.testing.assert_array_equal(r2, r1)
    np.testing.assert_array_equal(got, want)
    assert_close(got, rms_norm_ref(as_f64(r1), as_f64(w), 1e-5, 1.0), "f32", "residual_copy",
                 scale=np.abs(rms_norm_ref(as_f64(r1), np.abs(as_f64(w)) + 1, 1e-5)))
