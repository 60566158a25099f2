"""FP8 (e4m3fn) weights kept compressed: y[M, N] = x[M, K] @ (W[N, K] * scales)^T with W one byte per weight.

API: `matmul_fp8(x, w, scale, out=None, target=None)`; `dequantize_fp8(w, scale)` (host reference, numpy);
`scale_kind(scale, N, K)`.

The layouts of FP8 checkpoints (what the scales look like; every one multiplies: w = fp8 value * scale):
- per-tensor: one f32 (compressed-tensors `weight_scale` of shape () / (1,), FBGEMM/vLLM "fp8" per-tensor);
- per-channel: one per output row, (N,) or (N, 1) (compressed-tensors channel strategy);
- block: one per 128 x 128 tile, (ceil(N / 128), ceil(K / 128)) (DeepSeek-V3 / Qwen3 FP8 `weight_scale_inv`:
  despite the name, also a multiplier); the last row / column of tiles may be partial.

e4m3fn (OCP FP8): sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
(m * 2^-9); no infinities, 0x7F / 0xFF are NaN (decoded here as +-480: checkpoints do not hold NaN).
The kernel decodes bytes through f16 bits (`_e4m3_div256`: the value / 256, exact, undone by one power-of-two
multiply per output or folded into the block scale).

Arithmetic (the same for every M, so batch invariant): a program owns BM tokens x R weight rows; K runs in
chunks of KB (128, else 64 or 32: K must be a multiple of 32); per chunk the products are summed into L = 16
lanes per (token, row), with block scales that chunk's partial sums are multiplied by the tile's scale and
added (one FMA per lane), else added; at the end the lanes are summed by a fixed tree and the per-tensor /
per-channel scale multiplies the result. Tiles of the last rows / tokens shift back to end at N / M.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from engine.ops._hostargs import empty_like_dev, is_array, is_device, resolve_target, run

__all__ = ["matmul_fp8", "dequantize_fp8", "scale_kind", "e4m3_to_f32_table"]

_L = 16           # accumulator lanes per (token, row)
_BLOCK = 128      # block-scale tile


@jk.jit
def _e4m3_div256(b):
    """e4m3 bytes -> their values / 256 as f32: the 7 exponent+mantissa bits moved under f16's (bias 15 vs 7:
    a factor 2^-8, exact) and the sign to bit 15; e4m3 subnormals land on f16 values that the f16 -> f32
    conversion widens exactly (F16C / the GPU's cvt), so no f32 denormal arises. 16-bit lanes: half the integer
    work of decoding into f32 bits."""
    h = b.to(jk.u16)
    return (((h & 127) << 7) | ((h & 128) << 8)).to(jk.f16, bitcast=True).to(jk.f32)


@jk.kernel(do_not_specialize=('M',))
def _fp8_kernel(x, w, ws, y, M, N, K, NKB, WS_S, BM: jk.constexpr, R: jk.constexpr, KB: jk.constexpr,
                SCALE: jk.constexpr):
    # SCALE: 0 per-tensor (ws[0]), 1 per-channel (ws[n]), 2 block (ws[(n // 128) * WS_S + k // 128])
    n0 = jk.minimum(jk.program_id(0) * R, N - R)
    m0 = jk.minimum(jk.program_id(1) * BM, M - BM)
    rows = (n0 + jk.arange(0, R)).to(jk.i64)
    toks = (m0 + jk.arange(0, BM)).to(jk.i64)
    K64 = K.to(jk.i64)
    acc = jk.zeros((BM, R, 16), jk.f32)
    for kb in range(0, NKB):
        k0 = kb.to(jk.i64) * KB
        wv = _e4m3_div256(jk.load(w + rows[:, None] * K64 + k0 + jk.arange(0, KB)[None, :]))       # (R, KB)
        xv = jk.load(x + toks[:, None] * K64 + k0 + jk.arange(0, KB)[None, :])                      # (BM, KB)
        p = jk.sum(jk.reshape(xv[:, None, :] * wv[None, :, :], (BM, R, KB // 16, 16)), axis=2)      # (BM, R, 16)
        if SCALE == 2:
            s = jk.load(ws + (rows // 128) * WS_S + k0 // 128)                                      # (R,)
            acc = jk.fma(p, jk.broadcast_to(s[None, :, None] * 256.0, (BM, R, 16)), acc)
        else:
            acc += p
    res = jk.sum(acc, axis=2)
    if SCALE != 2:
        res = res * 256.0                      # the decode's 2^-8 (exact: a power of two)
    if SCALE == 0:
        res = res * jk.load(ws + jk.zeros((1, 1), jk.i64))
    if SCALE == 1:
        res = res * jk.load(ws + rows)[None, :]
    jk.store(y + toks[:, None] * N + rows[None, :], res)


def scale_kind(scale, N: int, K: int) -> str:
    """'tensor', 'channel' or 'block' from the scale's shape (see the module doc); ValueError otherwise."""
    shp = tuple(np.shape(scale))
    if int(np.prod(shp, dtype=np.int64)) == 1 and len(shp) <= 2:
        return "tensor"           # one value (a (1, 1) block grid or a 1-row channel scale mean the same)
    if shp in ((N,), (N, 1)):
        return "channel"
    if shp == (-(-N // _BLOCK), -(-K // _BLOCK)):
        return "block"
    raise ValueError(f"fp8 scale of shape {shp} fits none of per-tensor (1,), per-channel ({N},) / ({N}, 1) or "
                     f"128x128 blocks ({-(-N // _BLOCK)}, {-(-K // _BLOCK)}) for a weight of {N} x {K}")


def _scale_f32(scale) -> np.ndarray:
    a = np.asarray(scale)
    if a.dtype == np.uint16:              # bf16 bit patterns (safetensors BF16 scales)
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def e4m3_to_f32_table() -> np.ndarray:
    """The 256 e4m3fn byte values as float32 (numpy, from the format's definition; 0x7F / 0xFF as +-480)."""
    u = np.arange(256)
    e, m = (u >> 3) & 15, u & 7
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(u & 128, -v, v).astype(np.float32)


def dequantize_fp8(w: np.ndarray, scale) -> np.ndarray:
    """float32 (N, K) values of an e4m3 weight (uint8 bytes) with its scales (host reference)."""
    w = np.asarray(w)
    N, K = w.shape
    s = _scale_f32(scale)
    v = e4m3_to_f32_table()[w]
    kind = scale_kind(s, N, K)
    if kind == "tensor":
        return v * s.reshape(())
    if kind == "channel":
        return v * s.reshape(N, 1)
    return v * np.repeat(np.repeat(s, _BLOCK, 0), _BLOCK, 1)[:N, :K]


def matmul_fp8(x, w, scale, out=None, target=None):
    """y = x @ dequantize_fp8(w, scale)^T for x float32 (M, K) or (K,), w the (N, K) e4m3 bytes (uint8, or a
    numpy float8 view of them), scale per-tensor / per-channel / 128x128-block (f32 or bf16 bits as uint16).
    Returns float32 (M, N) or (N,) (into `out` when given). K must be a multiple of 32."""
    target = resolve_target(target, x, w)
    if not is_array(w) or w.ndim != 2:
        raise ValueError(f"matmul_fp8: w must be a 2-D (N, K) array of e4m3 bytes, got {getattr(w, 'shape', w)}")
    if not is_device(w):
        w = np.asarray(w)
        if w.dtype != np.uint8:
            if w.dtype.itemsize != 1:
                raise TypeError(f"matmul_fp8: w must hold one byte per weight (uint8), got {w.dtype}")
            w = w.view(np.uint8)
        w = np.ascontiguousarray(w)
    elif w.dtype != np.uint8:
        raise TypeError(f"matmul_fp8: device w must be uint8, got {w.dtype}")
    N, K = (int(d) for d in w.shape)
    if not is_device(x):
        x = np.ascontiguousarray(np.asarray(x))
    if x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] != K:
        raise ValueError(f"matmul_fp8: x must be float32 (K,) or (M, K) with K={K}, got {x.dtype} {x.shape}")
    if K % 32:
        raise ValueError(f"matmul_fp8: K={K} must be a multiple of 32")
    kind = scale_kind(scale, N, K)
    ws = scale if is_device(scale) else _scale_f32(scale)
    M = 1 if x.ndim == 1 else int(x.shape[0])
    oshape = (N,) if x.ndim == 1 else (M, N)
    if out is None:
        out = empty_like_dev(x, oshape, np.float32)
    elif tuple(out.shape) != oshape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmul_fp8: out must be a contiguous float32 array of shape {oshape}")
    if M == 0 or N == 0:
        return out
    KB = 128 if K % 128 == 0 else 64 if K % 64 == 0 else 32
    R = 4 if N >= 4 else 1
    BM = 1 if M == 1 else 4 if M >= 4 else 2 if M >= 2 else 1
    wss = (-(-K // _BLOCK)) if kind == "block" else 0
    run(_fp8_kernel, (-(-N // R), -(-M // BM)), (x, w, ws, out, M, N, K, K // KB, wss), target, BM=BM, R=R, KB=KB,
        SCALE={"tensor": 0, "channel": 1, "block": 2}[kind])
    return out
