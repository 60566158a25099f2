"""Per-head matmuls for multi-head latent attention (engine/models/mla.py): one launch for all heads instead of
one `linear` per head.

- `head_linear(x, w, out)`: out[t, h, :] = w[h] @ x[t, h, :] for x [T, H, K] and w f32 [H, N, K] (the absorbed
  W_UK_h^T q_nope_h and W_UV_h o_latent_h); x and out may be strided views (any token / head strides, the last
  axis contiguous). Grid (T, H, column blocks).
- `copy_heads(src, dst)`: dst[t, h, :] = src[t, h, :] between strided [T, H, C] views (the roped q_pe next to
  the absorbed query). Grid (T,).

Batch invariance: a program computes one token's outputs; each output element is one BK-lane FMA chain over
K (the tail masked into the same chain) and one lane-sum tree, so its bits do not depend on T or on the other
tokens of the launch.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk

from ._hostargs import check_dtype, elem_strides, is_array, resolve_target, run

BN = 16          # output columns per program
BK = 32          # reduction lanes (fixed: part of every output's arithmetic)


@jk.kernel(do_not_specialize=("T",))
def _head_linear_kernel(x, x_ts, x_hs, w, out, o_ts, o_hs, K, N, T, BN: jk.constexpr, BK: jk.constexpr):
    t = jk.program_id(0)
    h = jk.program_id(1)
    nb = jk.program_id(2)
    n = nb * BN + jk.arange(0, BN)
    nm = n < N
    kk = jk.arange(0, BK)
    xrow = x + t.to(jk.i64) * x_ts + h.to(jk.i64) * x_hs
    wrow = w + h.to(jk.i64) * N * K
    acc = jk.zeros((BN, BK), jk.f32)
    for k0 in range(0, K, BK):
        km = (k0 + kk) < K
        xv = jk.load(xrow + k0 + kk, mask=km, other=0.0)
        wv = jk.load(wrow + n[:, None] * K + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc = jk.fma(wv, xv[None, :], acc)
    y = jk.sum(acc, axis=1)
    jk.store(out + t.to(jk.i64) * o_ts + h.to(jk.i64) * o_hs + n, y, mask=nm)


@jk.kernel(do_not_specialize=("T",))
def _copy_heads_kernel(src, s_ts, s_hs, dst, d_ts, d_hs, H, C, T, BC: jk.constexpr):
    t = jk.program_id(0)
    c = jk.arange(0, BC)
    cm = c < C
    for h in range(0, H):
        v = jk.load(src + t.to(jk.i64) * s_ts + h * s_hs + c, mask=cm, other=0.0)
        jk.store(dst + t.to(jk.i64) * d_ts + h * d_hs + c, v, mask=cm)


def _view3(a, what, shape=None):
    if not is_array(a) or a.ndim != 3:
        raise ValueError(f"{what}: expected a [tokens, heads, dim] array, got {getattr(a, 'shape', type(a).__name__)}")
    check_dtype(a, np.float32, what)
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    s0, s1, s2 = elem_strides(a, what)
    if s2 != 1 and a.shape[2] > 1:
        raise ValueError(f"{what}: the last axis must be contiguous")
    return s0, s1


def head_linear(x, w, out=None, *, target=None):
    """out[t, h, :] = w[h] @ x[t, h, :]: x f32 [T, H, K] (strided views ok), w f32 [H, N, K] contiguous;
    returns out f32 [T, H, N] (a strided view may be given)."""
    target = resolve_target(target, x)
    check_dtype(w, np.float32, "head_linear: w")
    if not is_array(w) or w.ndim != 3 or not w.flags.c_contiguous:
        raise ValueError(f"head_linear: w must be a contiguous [heads, N, K] array, got {getattr(w, 'shape', None)}")
    H, N, K = w.shape
    xs = _view3(x, "head_linear: x", (x.shape[0], H, K) if is_array(x) and x.ndim == 3 else None)
    T = x.shape[0]
    out = np.empty((T, H, N), np.float32) if out is None else out
    os_ = _view3(out, "head_linear: out", (T, H, N))
    if T and N:
        run(_head_linear_kernel, (T, H, -(-N // BN)), (x, xs[0], xs[1], w, out, os_[0], os_[1], K, N, T), target,
            BN=BN, BK=BK)
    return out


def copy_heads(src, dst, *, target=None):
    """dst[t, h, :] = src[t, h, :] for f32 [T, H, C] strided views."""
    target = resolve_target(target, src)
    ss = _view3(src, "copy_heads: src")
    ds = _view3(dst, "copy_heads: dst", src.shape)
    T, H, C = src.shape
    bc = 16
    while bc < C:
        bc *= 2
    if T and C:
        run(_copy_heads_kernel, (T,), (src, ss[0], ss[1], dst, ds[0], ds[1], H, C, T), target, BC=bc)
    return dst


__all__ = ["head_linear", "copy_heads"]
