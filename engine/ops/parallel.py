"""Ops of tensor parallelism (engine/parallel): the vocabulary-parallel id mapping.

A rank of a vocabulary-parallel embedding owns table rows [v0, v1) plus one zero row after them; each token
id becomes its row in that slice, or the zero row when another rank owns it (the all-reduce that follows
then adds exactly one non-zero row per token). A kernel rather than host numpy so it runs on device ids and
inside recorded graphs (v0 / v1 are fixed per rank; the token count changes per step).
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import check_dtype, empty_like_dev, is_array, run

_BLOCK = 256


@jk.kernel(do_not_specialize=("n",))
def vocab_local_ids_kernel(ids, out, n, v0, v1, BLOCK: jk.constexpr):
    """out[i] = ids[i] - v0 if v0 <= ids[i] < v1 else v1 - v0. Grid (cdiv(n, BLOCK),)."""
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    t = jk.load(ids + offs, mask=m, other=0).to(jk.i64)
    inside = (t >= v0) & (t < v1)
    loc = jk.where(inside, t - v0, v1 - v0)
    jk.store(out + offs, loc.to(jk.i32), mask=m)


def vocab_local_ids(ids, v0: int, v1: int, out=None, *, target=None):
    """Rows of the vocabulary slice [v0, v1) for int32 token ids [T] (ids outside -> v1 - v0, the zero row)."""
    check_dtype(ids, np.int32, "vocab_local_ids: ids")
    if not is_array(ids) or ids.ndim != 1 or not ids.flags.c_contiguous:
        raise ValueError("vocab_local_ids: ids must be a contiguous 1-D int32 array")
    if not 0 <= v0 <= v1:
        raise ValueError(f"vocab_local_ids: bad slice [{v0}, {v1})")
    n = ids.shape[0]
    if out is None:
        out = empty_like_dev(ids, (n,), np.int32)
    check_dtype(out, np.int32, "vocab_local_ids: out")
    if tuple(out.shape) != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"vocab_local_ids: out must be a contiguous int32 array of shape ({n},)")
    run(vocab_local_ids_kernel, (jk.cdiv(n, _BLOCK),), (ids, out, n, int(v0), int(v1)), target, BLOCK=_BLOCK)
    return out
