"""Token embedding lookup (gather of table rows) for float tables.

Quantised (GGUF) tables are dequantised row-wise by `engine.ops.quant.dequantize_rows`; this module
handles f32 / f16 / bf16 (uint16 storage) tables.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import (block_for, check_dtype, check_shape, empty_like_dev, fptr, has_half, is_array, is_device,
                        resolve_target, row_stride, run)

_BLOCK = 256


@jk.kernel
def embedding_kernel(ids, table, vocab, hidden, out, o_s, scale, HAS_SCALE: jk.constexpr, BLOCK: jk.constexpr):
    """out[t, :] = table[ids[t], :] (* scale); ids outside [0, vocab) give zero rows. Grid (T, cdiv(hidden, BLOCK))."""
    t = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < hidden
    tok = jk.load(ids + t)
    valid = (tok >= 0) & (tok < vocab)
    row = jk.where(valid, tok, 0).to(jk.i64)
    v = jk.load(table + row * hidden + cols, mask=m & valid, other=0.0).to(jk.f32)
    if HAS_SCALE:
        v = v * scale
    jk.store(out + t.to(jk.i64) * o_s + cols, v, mask=m)


def embedding(ids: np.ndarray, table: np.ndarray, out: np.ndarray | None = None, *, scale: float | None = None,
              out_dtype=np.float32, check_ids: bool = True, target=None) -> np.ndarray:
    """out[t] = table[ids[t]] * scale for ids int32 [T] and a contiguous table [vocab, hidden] of float32,
    float16 or uint16 (= bf16). `scale` multiplies in f32 (Gemma: sqrt(hidden); note HF Gemma first rounds
    that normaliser to the activation dtype, so pass the rounded value to match it bit for bit).
    `out` [T, hidden] (row-strided views accepted) defaults to `out_dtype` (float32). Ids outside
    [0, vocab) raise ValueError when `check_ids` (host check); the kernel writes zero rows for them anyway.
    """
    target = resolve_target(target, table, ids)
    check_dtype(ids, np.int32, "embedding: ids")
    if ids.ndim != 1 or not ids.flags.c_contiguous:
        raise ValueError(f"embedding: ids must be a contiguous 1-D int32 array, got shape {ids.shape}")
    if not is_array(table) or table.ndim != 2 or not table.flags.c_contiguous:
        raise ValueError(f"embedding: table must be a contiguous 2-D array [vocab, hidden], got "
                         f"{getattr(table, 'shape', type(table).__name__)}")
    V, Hd = table.shape
    T = ids.shape[0]
    if check_ids and T and not is_device(ids) and (int(ids.min()) < 0 or int(ids.max()) >= V):
        bad = ids[(ids < 0) | (ids >= V)]
        raise ValueError(f"embedding: token id {int(bad[0])} is outside the vocabulary [0, {V})")
    if out is None:
        out = empty_like_dev(table, (T, Hd), out_dtype)
    check_shape(out, (T, Hd), "embedding: out")
    os_ = row_stride(out, "embedding: out")
    B = block_for(Hd, _BLOCK, target, has_half(table, out))
    run(embedding_kernel, (T, jk.cdiv(Hd, B)),
        (ids, fptr(table, "embedding: table"), V, Hd, fptr(out, "embedding: out"), os_,
         float(scale) if scale is not None else 1.0),
        target, HAS_SCALE=scale is not None, BLOCK=B)
    return out


__all__ = ["embedding"]
