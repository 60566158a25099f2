"""Row softmax / log-softmax over wide rows (vocab 49153, -inf entries, f16/bf16 inputs, strided rows) against
float64 numpy on every runnable tier. Tolerances: softmax |err| <= 1e-6 * row max + 2e-6 * p (exp is ~2 ulp,
sums in f32); log_softmax |err| <= 2e-6 * (1 + |x - max|)."""
import zlib

import numpy as np
import pytest

from engine.ops.softmax import log_softmax, softmax

from .ref_basic import as_f64, stored


def _ref(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(-1, keepdims=True)
    return e / s, x - m - np.log(s)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("V", [49153, 100, 7])
def test_softmax_and_log_softmax(tier, dtype, V):
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/{dtype}/{V}".encode()))
    B = 3
    buf = stored(rng.standard_normal((B, V + 11)) * 4 + 2, dtype)
    x = buf[:, 11:]                                             # row-strided view
    x64 = as_f64(x).copy()
    if V > 10:
        masked = rng.random((B, V)) < 0.3
        x64[masked] = -np.inf
        x[...] = stored(x64, dtype)
    p_ref, lp_ref = _ref(x64)
    p = softmax(x, target=tier)
    lp = log_softmax(x, target=tier)
    assert p.dtype == np.float32 and lp.dtype == np.float32 and p.shape == (B, V)
    assert np.all(np.abs(p - p_ref) <= 1e-6 * p_ref.max(-1, keepdims=True) + 2e-6 * p_ref)
    assert np.allclose(p.sum(-1), 1.0, atol=1e-5)
    fin = np.isfinite(lp_ref)
    assert np.array_equal(np.isfinite(lp), fin) and (lp[~fin] == -np.inf).all() and (p[~fin] == 0).all()
    d = x64 - x64.max(-1, keepdims=True)
    assert np.all(np.abs(lp[fin] - lp_ref[fin]) <= 2e-6 * (1 + np.abs(d[fin])))


def test_softmax_extremes(tier):
    x = np.array([[1e30, 0.0, -1e30, 3.0], [-np.inf, -np.inf, 5.0, -np.inf], [88.0, 88.0, -100.0, 0.0]],
                 np.float32)
    p = softmax(x, target=tier)
    lp = log_softmax(x, target=tier)
    p_ref, lp_ref = _ref(x)
    assert np.allclose(p, p_ref, atol=1e-7)
    fin = np.isfinite(lp_ref)
    assert np.allclose(lp[fin], lp_ref[fin], atol=1e-5) and (lp[~fin] == -np.inf).all()
    out = x.copy()
    softmax(out, out=out, target=tier)                          # in place
    assert np.array_equal(out, p)
