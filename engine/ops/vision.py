"""Ops the vision encoders need beyond the decoder's: CLIP's quick GELU, and the row scatter that puts image
features into a prefill's token embeddings (engine/models/llava.py).

Arrays as in engine.ops.activation: float32, float16 or uint16 (= bf16), math in f32 and rounded once when
stored; 2-D arrays may be row-strided views (last axis contiguous).
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import (block_for, check_dtype, check_shape, fptr, has_half, is_array, is_device, resolve_target,
                        row_stride, run)
from .activation import _unary

_BLOCK = 256


@jk.jit
def _quick_gelu_a(x, alpha):
    # CLIP's "quick_gelu": x * sigmoid(1.702 x), written with exp so that large |x| saturate to x and 0
    # (exp(-1.702 x) overflows to inf for x < -52: x / inf = -0, the torch result)
    return x / (1.0 + jk.exp(-1.702 * x))


def quick_gelu(x: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """x * sigmoid(1.702 x) elementwise (CLIP's "quick_gelu") on a 1-D or 2-D array; `out` may be `x`."""
    return _unary("quick_gelu", _quick_gelu_a, x, out, 0.0, target)


@jk.kernel
def scatter_rows_kernel(src, s_s, rows, out, o_s, n, BLOCK: jk.constexpr):
    """out[rows[i], :] = src[i, :]; grid (R, cdiv(n, BLOCK)). Rows are distinct, so programs never race."""
    i = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < n
    r = jk.load(rows + i).to(jk.i64)
    v = jk.load(src + i.to(jk.i64) * s_s + cols, mask=m, other=0.0).to(jk.f32)
    jk.store(out + r * o_s + cols, v, mask=m)


def scatter_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray, *, target=None) -> np.ndarray:
    """out[rows[i]] = src[i] for src [R, n], rows int32 [R] (distinct, each in [0, len(out))) and out [T, n]
    (row-strided views accepted; dtypes may differ, values are rounded to out's). The rows of `out` not named
    keep their values. Returns out."""
    target = resolve_target(target, out)
    check_dtype(rows, np.int32, "scatter_rows: rows")
    for a, nm in ((src, "src"), (out, "out")):
        if not is_array(a) or a.ndim != 2:
            raise ValueError(f"scatter_rows: {nm} must be a 2-D array, got {getattr(a, 'shape', type(a).__name__)}")
    if rows.ndim != 1 or not rows.flags.c_contiguous:
        raise ValueError(f"scatter_rows: rows must be a contiguous 1-D int32 array, got shape {rows.shape}")
    R, n = src.shape
    check_shape(rows, (R,), "scatter_rows: rows")
    if out.shape[1] != n:
        raise ValueError(f"scatter_rows: out has {out.shape[1]} columns, src {n}")
    if R and not is_device(rows):
        T = out.shape[0]
        if int(rows.min()) < 0 or int(rows.max()) >= T:
            bad = rows[(rows < 0) | (rows >= T)]
            raise ValueError(f"scatter_rows: row {int(bad[0])} is outside out's {T} rows")
        if len(np.unique(rows)) != R:
            raise ValueError("scatter_rows: rows must be distinct")
    if R == 0:
        return out
    B = block_for(n, _BLOCK, target, has_half(src, out))
    run(scatter_rows_kernel, (R, jk.cdiv(n, B)),
        (fptr(src, "scatter_rows: src"), row_stride(src, "scatter_rows: src"), rows, fptr(out, "scatter_rows: out"),
         row_stride(out, "scatter_rows: out"), n),
        target, BLOCK=B)
    return out


__all__ = ["quick_gelu", "scatter_rows"]
