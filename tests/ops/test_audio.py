"""The audio encoders' ops (engine/ops/audio.py): the 1-D frame unfolding against a float64 numpy reference on
every runnable tier, and unfold + matmul against torch's conv1d."""
import zlib

import numpy as np
import pytest

from engine.ops.audio import unfold1d, unfold1d_frames

from .ref_basic import as_f64, stored


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


def unfold1d_ref(x, K, stride, pad, channels_first=True):
    """[T, C * K] rows: row t holds x[c, t * stride + k - pad] for c, then k; zeros outside the signal."""
    x = as_f64(x)
    if not channels_first:
        x = x.T
    C, L = x.shape
    T = (L + 2 * pad - K) // stride + 1
    padded = np.zeros((C, L + 2 * pad + K), np.float64)
    padded[:, pad:pad + L] = x
    out = np.empty((T, C, K), np.float64)
    for t in range(T):
        out[t] = padded[:, t * stride:t * stride + K]
    return out.reshape(T, C * K)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("C,L,K,stride,pad,first", [(80, 37, 3, 1, 1, True), (48, 37, 3, 2, 1, False),
                                                     (5, 9, 4, 3, 0, True), (130, 16, 3, 2, 1, False)])
def test_unfold1d(tier, dtype, C, L, K, stride, pad, first):
    rng = _rng(tier, "unfold1d", dtype, C, L, K, stride, pad, first)
    shape = (C, L) if first else (L, C)
    buf = stored(rng.standard_normal((shape[0], shape[1] + 3)), dtype)
    x = buf[:, 3:]                                        # a row-strided view
    got = unfold1d(x, K, stride=stride, pad=pad, channels_first=first, target=tier)
    want = unfold1d_ref(x, K, stride, pad, first)
    assert got.shape == want.shape == (unfold1d_frames(L, K, stride, pad), C * K)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(as_f64(got), want)      # a gather: the values themselves


def test_unfold1d_then_matmul_is_torch_conv1d():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 40)).astype(np.float32)
    w = rng.standard_normal((7, 12, 3)).astype(np.float32)
    for stride in (1, 2):
        want = torch.nn.functional.conv1d(torch.from_numpy(x)[None], torch.from_numpy(w), stride=stride,
                                          padding=1)[0].T.numpy()
        got = unfold1d(x, 3, stride=stride, pad=1).astype(np.float64) @ w.reshape(7, -1).T.astype(np.float64)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_unfold1d_errors():
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="fewer than one window"):
        unfold1d(x, 3)
    with pytest.raises(ValueError, match="2-D"):
        unfold1d(np.zeros(4, np.float32), 3)
    with pytest.raises(ValueError, match="kernel_size"):
        unfold1d(x, 0)
