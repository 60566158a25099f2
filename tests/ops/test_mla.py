"""Per-head matmuls of multi-head latent attention (engine/ops/mla.py) against float64 numpy on every runnable
tier: odd sizes (K and N not multiples of the block sizes), strided views in and out, and batch invariance
(each token alone vs in the batch: bit-identical). Tolerance: 2e-5 relative to the output's scale (f32
accumulation over K <= 133)."""
import zlib

import numpy as np
import pytest

from engine.ops.mla import copy_heads, head_linear


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


@pytest.mark.parametrize("T,H,N,K", [(1, 1, 5, 3), (7, 3, 40, 24), (5, 4, 12, 133), (9, 2, 17, 33)])
def test_head_linear(tier, T, H, N, K):
    rng = _rng(tier, T, H, N, K)
    big = rng.standard_normal((T, H, K + 5)).astype(np.float32)
    x = big[:, :, 2:K + 2]                                    # strided view
    w = rng.standard_normal((H, N, K)).astype(np.float32)
    obuf = np.full((T, H, N + 3), np.nan, np.float32)
    out = obuf[:, :, 1:N + 1]
    head_linear(x, w, out, target=tier)
    ref = np.einsum("thk,hnk->thn", x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert np.isnan(obuf[:, :, 0]).all() and np.isnan(obuf[:, :, N + 1:]).all()     # nothing outside the view
    for t in range(T):
        one = head_linear(x[t:t + 1], w, target=tier)
        np.testing.assert_array_equal(one[0], out[t])


def test_head_linear_rejects_bad_shapes(tier):
    w = np.zeros((2, 4, 3), np.float32)
    with pytest.raises(ValueError, match="head_linear: x"):
        head_linear(np.zeros((5, 2, 4), np.float32), w, target=tier)
    with pytest.raises(ValueError, match="head_linear: w"):
        head_linear(np.zeros((5, 2, 3), np.float32), w[:, :, :2], target=tier)


@pytest.mark.parametrize("T,H,C", [(3, 4, 8), (6, 5, 37)])
def test_copy_heads(tier, T, H, C):
    rng = _rng(tier, "copy", T, H, C)
    src = rng.standard_normal((T, H, C + 4)).astype(np.float32)[:, :, 4:]
    buf = np.zeros((T, H, C + 7), np.float32)
    dst = buf[:, :, 7:]
    copy_heads(src, dst, target=tier)
    np.testing.assert_array_equal(dst, src)
    assert (buf[:, :, :7] == 0).all()
