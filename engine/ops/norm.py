"""Normalisation ops: RMSNorm (plain, fused residual add, Gemma's (1 + w) weights, per-head q/k norm) and
LayerNorm.

Numerics: statistics and the normalised value are computed in f32 whatever the storage dtype; the result
is rounded once when stored. (HF's LlamaRMSNorm rounds x * rsqrt(...) to the input dtype before the
weight multiply; for f16/bf16 activations the two differ by at most one rounding of the output.)
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import (block_for, check_shape, elem_strides, empty_like_dev, fptr, has_half, is_array, launch_target,
                        resolve_target, row_stride, run)

_MAX_BLOCK = 128      # rows wider than this loop over chunks (wider tiles measured slower)
GPU_Q8_TILE_BLOCKS = 16   # GPUs, natural layout: 32-blocks rms_norm_q8 quantises as one tile (any gives the same bits)

from .quant import Q8Activations, _eff_group, _q8_blocks, _store_grouped, _store_scales  # noqa: E402


@jk.jit
def _row_in(x, xb, x_ps, cols, m, PARTS):
    """A row chunk of x as f32; PARTS > 1: the sum of PARTS slabs x_ps elements apart, in slab order."""
    v = jk.load(x + xb + cols, mask=m, other=0.0).to(jk.f32)
    for z in jk.static_range(1, PARTS):
        v = v + jk.load(x + z * x_ps.to(jk.i64) + xb + cols, mask=m, other=0.0)
    return v


@jk.kernel
def rms_norm_kernel(x, x_s0, x_s1, x_ps, w, out, o_s0, o_s1, res, r_s0, r_s1, n, eps, w_off,
                    HAS_RES: jk.constexpr, BLOCK: jk.constexpr, RES_COPY: jk.constexpr = False,
                    ONE: jk.constexpr = False, PARTS: jk.constexpr = 1, RES_F32: jk.constexpr = False):
    """One program per row (grid (R0, R1)): row (p0, p1) starts at base + p0*s0 + p1*s1. HAS_RES: residual += x,
    the sum normalised; with RES_COPY residual = x instead (a first layer's residual stream). ONE (n <= BLOCK):
    the row is one tile kept in registers for the second pass (the same arithmetic without the second pass's
    loads: a GPU's 4096-wide row otherwise waits on two more dependent global round trips). PARTS > 1: x is a
    split-K linear's slabs, x_ps elements apart, added in order first (matmul.SplitK: its sum kernel's bits).
    RES_F32: the residual is f32, so the sum as stored is the sum itself and is not read back (a dependent global
    round trip fewer; the same bits)."""
    p0 = jk.program_id(0)
    p1 = jk.program_id(1)
    xb = p0.to(jk.i64) * x_s0 + p1.to(jk.i64) * x_s1
    ob = p0.to(jk.i64) * o_s0 + p1.to(jk.i64) * o_s1
    rb = p0.to(jk.i64) * r_s0 + p1.to(jk.i64) * r_s1
    offs = jk.arange(0, BLOCK)
    if ONE:
        m = offs < n
        wv = jk.load(w + offs, mask=m, other=0.0).to(jk.f32) + w_off
        v = _row_in(x, xb, x_ps, offs, m, PARTS)
        if HAS_RES:
            if not RES_COPY:
                v = v + jk.load(res + rb + offs, mask=m, other=0.0).to(jk.f32)
            jk.store(res + rb + offs, v, mask=m)
            if not RES_F32:
                v = jk.load(res + rb + offs, mask=m, other=0.0).to(jk.f32)     # the sum as stored (its dtype)
        inv = jk.rsqrt(jk.sum(v * v, axis=0) / n + eps)
        jk.store(out + ob + offs, v * inv * wv, mask=m)
    else:
        acc = jk.zeros((BLOCK,), jk.f32)
        for c in range(0, n, BLOCK):
            cols = c + offs
            m = cols < n
            v = _row_in(x, xb, x_ps, cols, m, PARTS)
            if HAS_RES:
                if not RES_COPY:
                    v = v + jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
                jk.store(res + rb + cols, v, mask=m)
                if not RES_F32:
                    # normalise the sum as stored (rounded to the residual's dtype), as vLLM does
                    v = jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
            acc += v * v
        inv = jk.rsqrt(jk.sum(acc, axis=0) / n + eps)
        for c in range(0, n, BLOCK):
            cols = c + offs
            m = cols < n
            if HAS_RES:
                v = jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
            else:
                v = _row_in(x, xb, x_ps, cols, m, PARTS)
            wv = jk.load(w + cols, mask=m, other=0.0).to(jk.f32) + w_off
            jk.store(out + ob + cols, v * inv * wv, mask=m)


def _one_tile(n: int, block: int) -> dict:
    """rms_norm_kernel's BLOCK, with ONE where a row fits one tile."""
    return dict(BLOCK=block, **({"ONE": True} if n <= block else {}))


@jk.kernel
def layer_norm_kernel(x, x_s, w, b, out, o_s, n, eps, HAS_BIAS: jk.constexpr, BLOCK: jk.constexpr):
    row = jk.program_id(0)
    xb = row.to(jk.i64) * x_s
    ob = row.to(jk.i64) * o_s
    offs = jk.arange(0, BLOCK)
    acc = jk.zeros((BLOCK,), jk.f32)
    for c in range(0, n, BLOCK):
        cols = c + offs
        acc += jk.load(x + xb + cols, mask=cols < n, other=0.0).to(jk.f32)
    mean = jk.sum(acc, axis=0) / n
    acc2 = jk.zeros((BLOCK,), jk.f32)
    for c in range(0, n, BLOCK):
        cols = c + offs
        m = cols < n
        d = jk.load(x + xb + cols, mask=m, other=0.0).to(jk.f32) - mean
        d = jk.where(m, d, 0.0)
        acc2 += d * d
    inv = jk.rsqrt(jk.sum(acc2, axis=0) / n + eps)
    for c in range(0, n, BLOCK):
        cols = c + offs
        m = cols < n
        y = (jk.load(x + xb + cols, mask=m, other=0.0).to(jk.f32) - mean) * inv
        y = y * jk.load(w + cols, mask=m, other=0.0).to(jk.f32)
        if HAS_BIAS:
            y = y + jk.load(b + cols, mask=m, other=0.0).to(jk.f32)
        jk.store(out + ob + cols, y, mask=m)


@jk.jit
def _norm_q8_group(src, sb, w, w_off, inv, qx, xd, xs, xd4, xs4, row, n, nblk, b0, NB: jk.constexpr,
                   REP4: jk.constexpr, NG: jk.constexpr = 1):
    """Normalises the NB 32-blocks of a row from block b0 (y = v * inv * (w + w_off), as rms_norm_kernel) and
    stores them quantised as one group of NB blocks (quantize_q8's layouts; NG = NB: as NB blocks in element
    order, the 'natural' layout)."""
    blk = b0.to(jk.i64) + jk.arange(0, NB)
    cols = blk[:, None] * 32 + jk.arange(0, 32)[None, :]
    v = jk.load(src + sb + cols).to(jk.f32)
    wv = jk.load(w + cols).to(jk.f32) + w_off
    r, d, s = _q8_blocks(v * inv * wv)
    _store_grouped(qx, row * n + b0.to(jk.i64) * 32, r, NG, NB // NG)
    _store_scales(xd, xs, xd4, xs4, row, nblk, blk, d, s, NB, REP4)


@jk.kernel
def rms_norm_q8_kernel(x, x_s, w, res, r_s, qx, xd, xs, xd4, xs4, n, nblk, eps, w_off, RES: jk.constexpr,
                       BLOCK: jk.constexpr, G: jk.constexpr, REP4: jk.constexpr, NAT: jk.constexpr = 0):
    """RMSNorm of one row (program) straight into quantize_q8's int8 blocks: the statistics exactly as
    rms_norm_kernel (same chunks, same tree), then per group of G 32-blocks the normalised f32 values, which
    are the values rms_norm would store, quantised as _quantize_q8_kernel does. RES: 0 none, 1 residual += x
    (normalise the sum), 2 residual = x (the first layer's copy). NAT > 0 (the 'natural' layout on GPUs): the
    row's blocks NAT at a time as one (NAT, 32) tile spread over the CTA (the last tile shifted back to end at
    nblk, rewriting blocks with the same bits: each block is quantised on its own values), not one 32-value
    block a step."""
    row = jk.program_id(0).to(jk.i64)
    xb = row * x_s
    rb = row * r_s
    offs = jk.arange(0, BLOCK)
    acc = jk.zeros((BLOCK,), jk.f32)
    for c in range(0, n, BLOCK):
        cols = c + offs
        m = cols < n
        v = jk.load(x + xb + cols, mask=m, other=0.0).to(jk.f32)
        if RES == 1:
            v = v + jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
            jk.store(res + rb + cols, v, mask=m)
            v = jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
        if RES == 2:
            jk.store(res + rb + cols, v, mask=m)
            v = jk.load(res + rb + cols, mask=m, other=0.0).to(jk.f32)
        acc += v * v
    inv = jk.rsqrt(jk.sum(acc, axis=0) / n + eps)
    src = x
    sb = xb
    if RES != 0:
        src = res
        sb = rb
    if NAT > 0:
        for g in range(0, (nblk + NAT - 1) // NAT):
            _norm_q8_group(src, sb, w, w_off, inv, qx, xd, xs, xd4, xs4, row, n, nblk,
                           jk.minimum(g * NAT, nblk - NAT), NAT, REP4, NAT)
    else:
        for g in range(0, nblk // G):
            _norm_q8_group(src, sb, w, w_off, inv, qx, xd, xs, xd4, xs4, row, n, nblk, g * G, G, REP4)
        # a grouped layout's leftover blocks: a pair, then a single block, each its own group (as quantize_q8)
        if G > 2:
            if nblk % G >= 2:
                _norm_q8_group(src, sb, w, w_off, inv, qx, xd, xs, xd4, xs4, row, n, nblk, nblk - nblk % G, 2, REP4)
        if G > 1:
            if nblk % 2 == 1:
                _norm_q8_group(src, sb, w, w_off, inv, qx, xd, xs, xd4, xs4, row, n, nblk, nblk - 1, 1, REP4)


def _check_weight(weight, n, what):
    if not is_array(weight) or weight.ndim != 1 or weight.shape[0] != n:
        raise ValueError(f"{what}: expected a 1-D array of {n} elements, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not weight.flags.c_contiguous:
        raise ValueError(f"{what}: must be contiguous")
    return fptr(weight, what)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None, *,
             residual: np.ndarray | None = None, weight_offset: float = 0.0, residual_copy: bool = False,
             target=None) -> np.ndarray:
    """RMSNorm over the last axis of `x` [T, N]: y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset).

    `weight_offset=1.0` gives Gemma's (1 + w) weights. With `residual` [T, N] given this is vLLM's
    fused_add_rms_norm: residual += x (the sum is written back into `residual`, rounded to its dtype), then
    the sum is normalised into `out`; with `residual_copy` residual = x instead (then normalised as stored: one
    launch for a first layer's copy + norm). `x`, `out` and `residual` may be row-strided views (last axis
    contiguous); `out` may be `x` itself. Dtypes: float32, float16, uint16 (= bf16) for each array
    independently. Returns `out` (allocated like `x` when not given).
    """
    from .matmul import SplitK
    parts = 1
    if isinstance(x, SplitK):
        # a split-K linear's slabs: summed here in slab order (its sum kernel's bits), then as below
        parts, x = x.S, x.parts
        T, n = x.shape[1:]
        x_ps = T * n
        x = x.reshape(parts * T, n)[:T]
    target = resolve_target(target, x)
    if not is_array(x) or x.ndim != 2:
        raise ValueError(f"rms_norm: x must be a 2-D array [tokens, hidden], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    T, n = x.shape
    if parts == 1:
        x_ps = 0
    xs = row_stride(x, "rms_norm: x")
    wp = _check_weight(weight, n, "rms_norm: weight")
    if out is None:
        out = empty_like_dev(x, (T, n), x.dtype)
    check_shape(out, (T, n), "rms_norm: out")
    os_ = row_stride(out, "rms_norm: out")
    if residual is not None:
        check_shape(residual, (T, n), "rms_norm: residual")
        rs = row_stride(residual, "rms_norm: residual")
        rp = fptr(residual, "rms_norm: residual")
    else:
        rs, rp = 0, fptr(x, "rms_norm: x")
    block = block_for(n, _MAX_BLOCK, target, has_half(x, weight, out, residual))
    run(rms_norm_kernel, (T, 1), (fptr(x, "rms_norm: x"), xs, 0, x_ps, wp, fptr(out, "rms_norm: out"), os_, 0,
                                  rp, rs, 0, n, float(eps), float(weight_offset)),
        target, HAS_RES=residual is not None, **({"RES_COPY": True} if residual is not None and residual_copy else {}),
        **({"RES_F32": True} if residual is not None and residual.dtype == np.float32 else {}),
        **_one_tile(n, block), **({"PARTS": parts} if parts > 1 else {}))
    return out


def rms_norm_heads(x: np.ndarray, weight: np.ndarray, eps: float, *, weight_offset: float = 0.0,
                   target=None) -> np.ndarray:
    """Per-head RMSNorm in place (Qwen3 / Gemma3 q_norm, k_norm): x [T, H, D] normalised over D with one
    `weight` [D] shared by all heads. `x` may be a strided view (e.g. the q or k part of a fused qkv output
    reshaped to [T, H, D]) as long as D is contiguous. Returns `x`.
    """
    target = resolve_target(target, x)
    if not is_array(x) or x.ndim != 3:
        raise ValueError(f"rms_norm_heads: x must be a 3-D array [tokens, heads, head_dim], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    T, H, D = x.shape
    s0, s1, _ = elem_strides(x, "rms_norm_heads: x")
    wp = _check_weight(weight, D, "rms_norm_heads: weight")
    xp = fptr(x, "rms_norm_heads: x")
    run(rms_norm_kernel, (T, H), (xp, s0, s1, 0, wp, xp, s0, s1, xp, 0, 0, D, float(eps), float(weight_offset)),
        target, HAS_RES=False, **_one_tile(D, block_for(D, _MAX_BLOCK, target, has_half(x, weight))))
    return x


def rms_norm_q8(x: np.ndarray, weight: np.ndarray, eps: float, out: tuple, *, layout: str = "natural",
                out4: tuple | None = None, residual: np.ndarray | None = None, residual_copy: bool = False,
                weight_offset: float = 0.0, target=None) -> Q8Activations:
    """`rms_norm` fused with `quantize_q8`: x [T, N] (N a multiple of 32) normalised and quantised into
    out = (qx int8 [T, N], scales f32 [T, N/32], sums f32 [T, N/32]) in `layout` (engine.ops.quant.act_layout
    of the weight the result feeds), with `out4` = (scales4, sums4) [T, N/8] the repeated scales (quantize_q8's
    rep4) when given. The result is bit-identical to quantize_q8(rms_norm(x, ...)): one launch instead of two,
    and the normalised row never goes through memory. `residual` as in rms_norm (residual += x, the sum
    normalised); with `residual_copy` instead residual = x (a first layer's residual stream). Returns a
    Q8Activations for matmul_q8."""
    target = resolve_target(target, x)
    if not is_array(x) or x.ndim != 2:
        raise ValueError(f"rms_norm_q8: x must be a 2-D array [tokens, hidden], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    T, n = x.shape
    if n % 32 or n == 0:
        raise ValueError(f"rms_norm_q8: the row length {n} must be a positive multiple of 32")
    xs_ = row_stride(x, "rms_norm_q8: x")
    wp = _check_weight(weight, n, "rms_norm_q8: weight")
    nblk = n // 32
    qx, xd, xs = out
    for a, shp, dt, nm in ((qx, (T, n), np.int8, "qx"), (xd, (T, nblk), np.float32, "scales"),
                           (xs, (T, nblk), np.float32, "sums")):
        if not is_array(a) or a.shape != shp or a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError(f"rms_norm_q8: out {nm} must be a contiguous {np.dtype(dt)} array of shape {shp}")
    xd4 = xs4 = None
    if out4 is not None:
        xd4, xs4 = out4
        for a, nm in ((xd4, "scales4"), (xs4, "sums4")):
            if not is_array(a) or a.shape != (T, 4 * nblk) or a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(f"rms_norm_q8: out4 {nm} must be a contiguous float32 array of shape {(T, 4 * nblk)}")
    if residual is not None:
        check_shape(residual, (T, n), "rms_norm_q8: residual")
        rs, rp = row_stride(residual, "rms_norm_q8: residual"), fptr(residual, "rms_norm_q8: residual")
    else:
        rs, rp = 0, fptr(x, "rms_norm_q8: x")
    from .quant import LAYOUTS
    if layout not in LAYOUTS:
        raise ValueError(f"rms_norm_q8: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    G = _eff_group(layout, nblk)
    nat = {}
    if G == 1 and nblk >= 2 and launch_target(target).fast_workgroups:
        # the natural layout on a GPU: the row's blocks as tiles over the CTA's threads
        nat["NAT"] = 1
        while nat["NAT"] * 2 <= min(nblk, GPU_Q8_TILE_BLOCKS):
            nat["NAT"] *= 2
    run(rms_norm_q8_kernel, (T,), (fptr(x, "rms_norm_q8: x"), xs_, wp, rp, rs, qx, xd, xs,
                                   xd if xd4 is None else xd4, xs if xs4 is None else xs4, n, nblk, float(eps),
                                   float(weight_offset)),
        target, RES=0 if residual is None else (2 if residual_copy else 1), G=G, REP4=xd4 is not None, **nat,
        # the statistics' chunking exactly as rms_norm picks it (same tree: bit-identical results)
        BLOCK=block_for(n, _MAX_BLOCK, target, has_half(x, weight, x, residual)))
    return Q8Activations(qx, xd, xs, layout, xd4, xs4)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float,
               out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """LayerNorm over the last axis of `x` [T, N] (GPT-2): (x - mean) / sqrt(var + eps) * weight + bias,
    with the biased variance (as torch). Statistics in f32 (two passes: mean, then centred variance).
    `bias=None` skips the bias. Row-strided views accepted; `out` may be `x`. Returns `out`.
    """
    target = resolve_target(target, x)
    if not is_array(x) or x.ndim != 2:
        raise ValueError(f"layer_norm: x must be a 2-D array [tokens, hidden], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    T, n = x.shape
    xs = row_stride(x, "layer_norm: x")
    wp = _check_weight(weight, n, "layer_norm: weight")
    bp = _check_weight(bias, n, "layer_norm: bias") if bias is not None else wp
    if out is None:
        out = empty_like_dev(x, (T, n), x.dtype)
    check_shape(out, (T, n), "layer_norm: out")
    os_ = row_stride(out, "layer_norm: out")
    run(layer_norm_kernel, (T,), (fptr(x, "layer_norm: x"), xs, wp, bp, fptr(out, "layer_norm: out"), os_, n,
                                  float(eps)),
        target, HAS_BIAS=bias is not None, BLOCK=block_for(n, _MAX_BLOCK, target, has_half(x, weight, bias, out)))
    return out


__all__ = ["rms_norm", "rms_norm_heads", "rms_norm_q8", "layer_norm"]
