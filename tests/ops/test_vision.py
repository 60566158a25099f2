"""The vision encoders' ops (engine/ops/vision.py): quick GELU and the row scatter, against float64 numpy
references on every runnable tier."""
import zlib

import numpy as np
import pytest

from engine.ops.vision import quick_gelu, scatter_rows

from .ref_basic import as_f64, assert_close, stored


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


def quick_gelu_ref(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-1.702 * x))


def scatter_rows_ref(src, rows, out):
    out = np.array(as_f64(out), np.float64)
    out[np.asarray(rows)] = as_f64(src)
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_quick_gelu(tier, dtype):
    rng = _rng(tier, "quick_gelu", dtype)
    buf = stored(rng.standard_normal((4, 300 + 5)) * 6, dtype)
    x = buf[:, 5:]                                      # row-strided view
    want = quick_gelu_ref(as_f64(x))
    out = quick_gelu(x, target=tier)
    # 1 + exp(-1.702 x) is exact enough; only the stored rounding and exp's ulps remain
    assert_close(out, want, dtype, "quick_gelu", scale=np.abs(want) + 1e-3 * np.abs(as_f64(x)))


def test_quick_gelu_extremes_and_torch(tier):
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.array([-200.0, -60.0, -1e-3, 0.0, 1e-3, 60.0, 200.0], np.float32),
                        _rng(tier, "qg-torch").standard_normal(993).astype(np.float32) * 5])
    y = quick_gelu(x.copy(), target=tier)
    assert np.isfinite(y).all()
    ref = (torch.from_numpy(x) * torch.sigmoid(1.702 * torch.from_numpy(x))).numpy()
    assert np.allclose(y, ref, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_scatter_rows(tier, dtype):
    rng = _rng(tier, "scatter", dtype)
    T, R, n = 23, 9, 70
    rows = rng.permutation(T)[:R].astype(np.int32)
    sbuf = stored(rng.standard_normal((R, n + 3)), "f32")
    src = sbuf[:, 3:]                                   # row-strided source
    out = stored(rng.standard_normal((T, n)), dtype)
    want = scatter_rows_ref(src, rows, out)
    got = scatter_rows(src, rows, out, target=tier)
    assert got is out
    assert_close(out, want, dtype, "scatter_rows")
    untouched = np.setdiff1d(np.arange(T), rows)
    assert np.array_equal(as_f64(out)[untouched], want[untouched])


def test_scatter_rows_checks(tier):
    out = np.zeros((4, 8), np.float32)
    src = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="outside"):
        scatter_rows(src, np.array([0, 4], np.int32), out, target=tier)
    with pytest.raises(ValueError, match="distinct"):
        scatter_rows(src, np.array([1, 1], np.int32), out, target=tier)
    with pytest.raises(ValueError, match="columns"):
        scatter_rows(np.ones((2, 7), np.float32), np.array([0, 1], np.int32), out, target=tier)
    scatter_rows(src[:0], np.zeros(0, np.int32), out, target=tier)      # nothing to do
    assert not out.any()
