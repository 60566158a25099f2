"""Ops the audio encoders need beyond the decoder's: the frame unfolding that turns a 1-D convolution into one
matmul (Whisper's two convolutions over the log-mel frames: engine/models/whisper.py).

    conv1d(x, W, stride, pad)[t, o] = sum_{c, k} W[o, c, k] * x[c, t * stride + k - pad]
                                    = (unfold1d(x, K, stride, pad) @ W.reshape(O, C * K)^T)[t, o]

so the arithmetic is the engine's dense linear; this kernel only gathers, with zeros where a tap falls outside
the signal. The input may be channels-first ([C, L], the log-mel spectrogram) or time-first ([L, C], the
output of the previous matmul): the kernel takes the two strides.

Arrays float32, float16 or uint16 (= bf16); the output holds the input's values rounded once to its dtype.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import block_for, check_shape, empty_like_dev, fptr, has_half, is_array, resolve_target, row_stride, run

_BLOCK = 256


@jk.kernel
def unfold1d_kernel(x, x_cs, x_ts, out, o_s, L, n, stride, pad, K: jk.constexpr, BLOCK: jk.constexpr):
    """out[t, c * K + k] = x[c * x_cs + (t * stride + k - pad) * x_ts], 0 where t * stride + k - pad is outside
    [0, L); n = C * K. Grid (T, cdiv(n, BLOCK))."""
    t = jk.program_id(0)
    i = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = i < n
    c = i // K
    j = t * stride + (i - c * K) - pad
    ok = m & (j >= 0) & (j < L)
    src = c.to(jk.i64) * x_cs + jk.where(ok, j, 0).to(jk.i64) * x_ts
    v = jk.load(x + src, mask=ok, other=0.0).to(jk.f32)
    jk.store(out + t.to(jk.i64) * o_s + i, v, mask=m)


def unfold1d_frames(length: int, kernel_size: int, stride: int, pad: int) -> int:
    """Output frames of a 1-D convolution over `length` samples (torch's Conv1d formula, dilation 1)."""
    return (length + 2 * pad - kernel_size) // stride + 1


def unfold1d(x: np.ndarray, kernel_size: int, *, stride: int = 1, pad: int = 0, channels_first: bool = True,
             out: np.ndarray | None = None, target=None) -> np.ndarray:
    """The convolution's input windows as matmul rows: [T, C * kernel_size] in (channel, tap) order, the order of
    a torch Conv1d weight [O, C, K] reshaped to [O, C * K]. x is [C, L] (channels_first) or [L, C]; its strides
    are free as long as the last axis is contiguous. T = unfold1d_frames(L, kernel_size, stride, pad)."""
    target = resolve_target(target, x)
    if not is_array(x) or x.ndim != 2:
        raise ValueError(f"unfold1d: x must be a 2-D array, got {getattr(x, 'shape', type(x).__name__)}")
    if kernel_size < 1 or stride < 1 or pad < 0:
        raise ValueError(f"unfold1d: kernel_size {kernel_size} and stride {stride} must be >= 1, pad {pad} >= 0")
    fptr(x, "unfold1d: x")
    rs = row_stride(x, "unfold1d: x")
    C, L = x.shape if channels_first else x.shape[::-1]
    x_cs, x_ts = (rs, 1) if channels_first else (1, rs)
    T = unfold1d_frames(L, kernel_size, stride, pad)
    if T < 1:
        raise ValueError(f"unfold1d: {L} samples are fewer than one window of {kernel_size} (pad {pad})")
    n = C * kernel_size
    if out is None:
        out = empty_like_dev(x, (T, n), x.dtype)
    check_shape(out, (T, n), "unfold1d: out")
    os_ = row_stride(out, "unfold1d: out")
    B = block_for(n, _BLOCK, target, has_half(x, out))
    run(unfold1d_kernel, (T, jk.cdiv(n, B)),
        (fptr(x, "unfold1d: x"), x_cs, x_ts, fptr(out, "unfold1d: out"), os_, L, n, stride, pad),
        target, K=int(kernel_size), BLOCK=B)
    return out


__all__ = ["unfold1d", "unfold1d_frames"]
