"""Rotary position embeddings: the in-place kernel on q/k and the host-side cos/sin cache.

The cache follows vLLM's RotaryEmbedding: `cache[pos] = [cos(pos * inv_freq) * s, sin(pos * inv_freq) * s]`
([max_pos, rotary_dim], f32), where inv_freq and the attention scaling s come from the rope scaling config
as HF transformers' `modeling_rope_utils` computes them (float32 arithmetic, like HF and vLLM).

Layouts: NeoX style rotates (x[i], x[i + rotary_dim/2]) (HF `rotate_half`, most safetensors checkpoints);
GPT-J style rotates adjacent pairs (x[2i], x[2i+1]) (GGUF llama-family checkpoints, whose Q/K rows were
permuted for this convention). Dimensions past rotary_dim are left untouched (partial rotary).
"""
from __future__ import annotations

import math

import numpy as np

import jitkern as jk
from ._hostargs import check_dtype, elem_strides, fptr, is_array, is_device, pow2_at_least, resolve_target, run
from .norm import _row_in


@jk.jit
def _rotate_neox(base, i, m, c, s, HALF: jk.constexpr):
    x1 = jk.load(base + i, mask=m, other=0.0).to(jk.f32)
    x2 = jk.load(base + HALF + i, mask=m, other=0.0).to(jk.f32)
    jk.store(base + i, x1 * c - x2 * s, mask=m)
    jk.store(base + HALF + i, x2 * c + x1 * s, mask=m)


@jk.jit
def _rotate_gptj(base, j, m, even, c2, s2):
    # out[2i] = x[2i] c_i - x[2i+1] s_i, out[2i+1] = x[2i+1] c_i + x[2i] s_i, with c2/s2 the per-lane
    # cos and signed sin; the partner x[j ^ 1] comes from two shifted contiguous loads (no gather)
    x = jk.load(base + j, mask=m, other=0.0).to(jk.f32)
    nxt = jk.load(base + j + 1, mask=m & even, other=0.0).to(jk.f32)
    prv = jk.load(base + j - 1, mask=m & (j >= 1) & (even == 0), other=0.0).to(jk.f32)
    jk.store(base + j, x * c2 + jk.where(even, nxt, prv) * s2, mask=m)


@jk.kernel
def rope_kernel(q, q_st, q_sh, n_q, k, k_st, k_sh, n_k, positions, cache, max_pos,
                HALF: jk.constexpr, NEOX: jk.constexpr, BLOCK: jk.constexpr):
    """One program per token: rotates its n_q query heads and n_k key heads in place.
    NeoX: BLOCK covers HALF lanes; GPT-J: BLOCK covers the 2*HALF rotated lanes."""
    t = jk.program_id(0)
    pos = jk.load(positions + t)
    pos = jk.minimum(jk.maximum(pos, 0), max_pos - 1)     # memory safety; the wrapper checks the range
    cb = cache + pos.to(jk.i64) * (2 * HALF)
    i = jk.arange(0, BLOCK)
    if NEOX:
        m = i < HALF
        c = jk.load(cb + i, mask=m, other=0.0)
        s = jk.load(cb + HALF + i, mask=m, other=0.0)
        for h in range(0, n_q):
            _rotate_neox(q + t.to(jk.i64) * q_st + h * q_sh, i, m, c, s, HALF)
        for h in range(0, n_k):
            _rotate_neox(k + t.to(jk.i64) * k_st + h * k_sh, i, m, c, s, HALF)
    else:
        m = i < 2 * HALF
        even = (i % 2) == 0
        c2 = jk.load(cb + i // 2, mask=m, other=0.0)
        s2 = jk.load(cb + HALF + i // 2, mask=m, other=0.0)
        s2 = jk.where(even, -s2, s2)
        for h in range(0, n_q):
            _rotate_gptj(q + t.to(jk.i64) * q_st + h * q_sh, i, m, even, c2, s2)
        for h in range(0, n_k):
            _rotate_gptj(k + t.to(jk.i64) * k_st + h * k_sh, i, m, even, c2, s2)


@jk.jit
def _rot_neox_to(src, dst, i, m, c, s, HALF: jk.constexpr, ps, PARTS):
    x1 = _row_in(src, 0, ps, i, m, PARTS)
    x2 = _row_in(src, 0, ps, HALF + i, m, PARTS)
    jk.store(dst + i, x1 * c - x2 * s, mask=m)
    jk.store(dst + HALF + i, x2 * c + x1 * s, mask=m)


@jk.jit
def _rot_gptj_to(src, dst, j, m, even, c2, s2, ps, PARTS):
    x = _row_in(src, 0, ps, j, m, PARTS)
    nxt = _row_in(src, 0, ps, j + 1, m & even, PARTS)
    prv = _row_in(src, 0, ps, j - 1, m & (j >= 1) & (even == 0), PARTS)
    jk.store(dst + j, x * c2 + jk.where(even, nxt, prv) * s2, mask=m)


@jk.jit
def _rope_coeffs(positions, t, cache, max_pos, i, HALF, NEOX):
    """Token t's rotation coefficients over lanes i: (lane mask, cos, sin, even lanes). NeoX: lane j < HALF
    pairs (j, j + HALF); GPT-J: lane j of the 2 * HALF rotated ones, sin negated on even lanes."""
    pos = jk.load(positions + t)
    pos = jk.minimum(jk.maximum(pos, 0), max_pos - 1)     # memory safety; the wrapper checks the range
    cb = cache + pos.to(jk.i64) * (2 * HALF)
    if NEOX:
        m = i < HALF
        even = m                                          # (unused by the NeoX rotation)
        c = jk.load(cb + i, mask=m, other=0.0)
        s = jk.load(cb + HALF + i, mask=m, other=0.0)
    else:
        m = i < 2 * HALF
        even = (i % 2) == 0
        c = jk.load(cb + i // 2, mask=m, other=0.0)
        s = jk.load(cb + HALF + i // 2, mask=m, other=0.0)
        s = jk.where(even, -s, s)
    return m, c, s, even


@jk.jit
def _rot_to(src, dst, i, m, c, s, even, HALF, NEOX, ps, PARTS):
    """One head's rotation from src to dst with _rope_coeffs's (mask, cos, sin, even); PARTS > 1: src holds
    split-K slabs ps elements apart (norm._row_in: the sum kernel's bits)."""
    if NEOX:
        _rot_neox_to(src, dst, i, m, c, s, HALF, ps, PARTS)
    else:
        _rot_gptj_to(src, dst, i, m, even, c, s, ps, PARTS)


ROPE_CACHE_PER_HEAD_MAX_T = 256


@jk.kernel
def rope_cache_head_kernel(q, q_st, q_sh, n_q, k, k_st, k_sh, v, v_st, v_sh, n_k, positions, cache, max_pos,
                           k_cache, v_cache, slot_mapping, qo, ps, HALF: jk.constexpr, NEOX: jk.constexpr,
                           BLOCK: jk.constexpr, D: jk.constexpr, BD: jk.constexpr, TAIL: jk.constexpr,
                           PARTS: jk.constexpr = 1):
    """rope_cache_kernel with grid (tokens, n_q + n_k) for GPUs: program (t, h) rotates query head h < n_q
    into qo (q itself where there are no slabs: in place), else rotates key head h - n_q and copies value head
    h - n_q into the caches (the other kind's loads and stores masked off); the same arithmetic per element. A
    token's heads run side by side instead of one after another: one program looping over Llama-3-8B's 48 heads
    took ~12 us of dependent loads on the H200 at one token.
    PARTS > 1: q, k and v are views of a split-K qkv projection's first slab, the others ps elements apart
    (matmul.SplitK), summed in slab order as they are read (the sum kernel's bits); qo (q's strides) gets the
    rotated query heads, their unrotated tail (TAIL) too: the split-K sum kernel's launch and its round trip of
    q, k and v fewer."""
    t = jk.program_id(0)
    h = jk.program_id(1)
    tt = t.to(jk.i64)
    slot = jk.load(slot_mapping + t)
    isq = h < n_q
    ok = (h >= n_q) & (slot >= 0)
    hq = jk.minimum(h, n_q - 1)
    hk = jk.minimum(jk.maximum(h - n_q, 0), n_k - 1)
    dst = jk.maximum(slot, 0).to(jk.i64) * (n_k * D) + hk * D
    qh = q + tt * q_st + hq * q_sh
    qoh = qo + tt * q_st + hq * q_sh
    kh = k + tt * k_st + hk * k_sh
    i = jk.arange(0, BLOCK)
    dd = jk.arange(0, BD)
    dm = dd < D
    m, c, s, even = _rope_coeffs(positions, t, cache, max_pos, i, HALF, NEOX)
    _rot_to(qh, qoh, i, m & isq, c, s, even, HALF, NEOX, ps, PARTS)
    _rot_to(kh, k_cache + dst, i, m & ok, c, s, even, HALF, NEOX, ps, PARTS)
    if TAIL:
        tc = 2 * HALF + dd
        tm = (tc < D) & ok
        jk.store(k_cache + dst + tc, _row_in(kh, 0, ps, tc, tm, PARTS), mask=tm)
        if PARTS > 1:
            qtm = (tc < D) & isq
            jk.store(qoh + tc, _row_in(qh, 0, ps, tc, qtm, PARTS), mask=qtm)
    jk.store(v_cache + dst + dd, _row_in(v + tt * v_st + hk * v_sh, 0, ps, dd, dm & ok, PARTS), mask=dm & ok)


@jk.kernel
def rope_cache_kernel(q, q_st, q_sh, n_q, k, k_st, k_sh, v, v_st, v_sh, n_k, positions, cache, max_pos,
                      k_cache, v_cache, slot_mapping, HALF: jk.constexpr, NEOX: jk.constexpr, BLOCK: jk.constexpr,
                      D: jk.constexpr, BD: jk.constexpr, TAIL: jk.constexpr):
    """One program per token: rotates its n_q query heads in place (as rope_kernel) and writes its n_k key
    heads rotated, and its value heads, into the paged caches at slot_mapping[t] (-1: no cache write), as
    rope_kernel followed by reshape_and_cache_kernel would (the same f32 arithmetic, rounded once to the cache
    dtype). Dimensions past the rotary ones (TAIL: HALF * 2 < D) are copied unrotated. The key rows in `k`
    are left as they were (nothing reads them after this).
    GPUs run rope_cache_head_kernel instead (the same arithmetic, one program per token and head)."""
    t = jk.program_id(0)
    tt = t.to(jk.i64)
    slot = jk.load(slot_mapping + t)
    ok = slot >= 0
    dst = jk.maximum(slot, 0).to(jk.i64) * (n_k * D)
    i = jk.arange(0, BLOCK)
    dd = jk.arange(0, BD)
    dm = dd < D
    m, c, s, even = _rope_coeffs(positions, t, cache, max_pos, i, HALF, NEOX)
    for h in range(0, n_q):
        qh = q + tt * q_st + h * q_sh
        _rot_to(qh, qh, i, m, c, s, even, HALF, NEOX, 0, 1)
    for h in range(0, n_k):
        _rot_to(k + tt * k_st + h * k_sh, k_cache + dst + h * D, i, m & ok, c, s, even, HALF, NEOX, 0, 1)
    for h in range(0, n_k):
        if TAIL:
            tc = 2 * HALF + dd
            tm = (tc < D) & ok
            jk.store(k_cache + dst + h * D + tc, jk.load(k + tt * k_st + h * k_sh + tc, mask=tc < D, other=0.0),
                     mask=tm)
        jk.store(v_cache + dst + h * D + dd, jk.load(v + tt * v_st + h * v_sh + dd, mask=dm, other=0.0),
                 mask=dm & ok)


@jk.kernel
def rope_cache_tile_kernel(q, q_st, q_sh, n_q, k, k_st, k_sh, v, v_st, v_sh, n_k, positions, cache, max_pos,
                           k_cache, v_cache, slot_mapping, HALF: jk.constexpr, NEOX: jk.constexpr,
                           BLOCK: jk.constexpr, D: jk.constexpr, BD: jk.constexpr, TAIL: jk.constexpr,
                           HQ: jk.constexpr, HK: jk.constexpr):
    """rope_cache_kernel with a token's heads as one (heads, lanes) tile each for q, k and v instead of a loop
    over them (GPUs from ROPE_CACHE_PER_HEAD_MAX_T tokens, tuning.rope_tiles): all of a token's loads are issued
    before its stores, where the loop's next head waited on the stores of the one before (they might alias). The
    same arithmetic per element. HQ / HK: n_q / n_k rounded up to a power of two (rows past them masked)."""
    t = jk.program_id(0)
    tt = t.to(jk.i64)
    slot = jk.load(slot_mapping + t)
    ok = slot >= 0
    dst = jk.maximum(slot, 0).to(jk.i64) * (n_k * D)
    i = jk.arange(0, BLOCK)
    dd = jk.arange(0, BD)
    m, c, s, even = _rope_coeffs(positions, t, cache, max_pos, i, HALF, NEOX)
    li, lm, lc, ls, le = i[None, :], m[None, :], c[None, :], s[None, :], even[None, :]
    hq = jk.arange(0, HQ)
    hk = jk.arange(0, HK)
    qrows = q + tt * q_st + hq.to(jk.i64)[:, None] * q_sh
    _rot_to(qrows, qrows, li, (hq < n_q)[:, None] & lm, lc, ls, le, HALF, NEOX, 0, 1)
    kin = (hk < n_k)[:, None]
    kok = kin & ok
    krows = k + tt * k_st + hk.to(jk.i64)[:, None] * k_sh
    kdst = k_cache + dst + hk.to(jk.i64)[:, None] * D
    _rot_to(krows, kdst, li, kok & lm, lc, ls, le, HALF, NEOX, 0, 1)
    if TAIL:
        tc = (2 * HALF + dd)[None, :]
        jk.store(kdst + tc, jk.load(krows + tc, mask=(tc < D) & kin, other=0.0), mask=(tc < D) & kok)
    dc = dd[None, :]
    dm = dc < D
    vrows = v + tt * v_st + hk.to(jk.i64)[:, None] * v_sh
    jk.store(v_cache + dst + hk.to(jk.i64)[:, None] * D + dc, jk.load(vrows + dc, mask=dm & kin, other=0.0),
             mask=dm & kok)


# rope_and_cache on GPUs from ROPE_CACHE_PER_HEAD_MAX_T tokens runs rope_cache_tile_kernel instead of
# rope_cache_kernel where the target's tuning.rope_tiles (targets/tuning.py): the head loop's loads wait on the
# previous head's stores (they might alias), the tile kernel issues a token's loads first.


def _heads_view(a, T, D, what):
    if not is_array(a) or a.ndim != 3 or a.shape[0] != T or a.shape[2] != D:
        raise ValueError(f"{what}: expected an array [{T}, heads, {D}], got {getattr(a, 'shape', type(a).__name__)}")
    s0, s1, _ = elem_strides(a, what)
    return s0, s1


def rope(q: np.ndarray, k: np.ndarray | None, positions: np.ndarray, cos_sin_cache: np.ndarray,
         head_dim: int, rotary_dim: int, is_neox: bool, *, check_positions: bool = True, target=None) -> None:
    """Applies rotary embeddings in place to q [T, H, head_dim] and k [T, KVH, head_dim].

    q and k may be strided views into a fused qkv output (e.g. `qkv[:, :H*D].reshape(T, H, D)`; each head's
    head_dim elements contiguous). `k=None` rotates q only. `positions` int32 [T] is read by the kernel (so
    a captured graph replays with new positions). `cos_sin_cache` f32 [max_pos, rotary_dim] holds cos in
    its first half and sin in its second half per position (see `rope_cos_sin_cache`). Positions outside
    [0, max_pos) raise ValueError when `check_positions` (a cheap host check; the kernel clamps them
    regardless, for memory safety). q/k dtypes: float32, float16, uint16 (= bf16); math in f32.
    """
    target = resolve_target(target, q)
    if not is_array(q) or q.ndim != 3:
        raise ValueError(f"rope: q must be [tokens, heads, head_dim], got {getattr(q, 'shape', type(q).__name__)}")
    T = q.shape[0]
    if q.shape[2] != head_dim:
        raise ValueError(f"rope: q's last axis is {q.shape[2]}, head_dim is {head_dim}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rope: rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    qs0, qs1 = _heads_view(q, T, head_dim, "rope: q")
    if k is not None:
        ks0, ks1 = _heads_view(k, T, head_dim, "rope: k")
        n_k = k.shape[1]
    else:
        k, ks0, ks1, n_k = q, 0, 0, 0
    check_dtype(positions, np.int32, "rope: positions")
    if positions.shape != (T,) or not positions.flags.c_contiguous:
        raise ValueError(f"rope: positions must be a contiguous int32 array of shape ({T},), got {positions.shape}")
    check_dtype(cos_sin_cache, np.float32, "rope: cos_sin_cache")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != rotary_dim or not cos_sin_cache.flags.c_contiguous:
        raise ValueError(f"rope: cos_sin_cache must be a contiguous [max_pos, {rotary_dim}] array, "
                         f"got {cos_sin_cache.shape}")
    max_pos = cos_sin_cache.shape[0]
    if check_positions and T and not is_device(positions) and (int(positions.min()) < 0 or int(positions.max()) >= max_pos):
        raise ValueError(f"rope: positions must lie in [0, {max_pos}) (the cos/sin cache length); got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    half = rotary_dim // 2
    run(rope_kernel, (T,), (fptr(q, "rope: q"), qs0, qs1, q.shape[1], fptr(k, "rope: k"), ks0, ks1, n_k,
                           positions, cos_sin_cache, max_pos),
        target, HALF=half, NEOX=bool(is_neox), BLOCK=pow2_at_least(half if is_neox else rotary_dim, 16))


def rope_and_cache(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, cos_sin_cache: np.ndarray,
                   head_dim: int, rotary_dim: int, is_neox: bool, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray, *, check_positions: bool = True, target=None, q_out=None,
                   parts: int = 1, part_stride: int = 0) -> None:
    """`rope(q, k, ...)` and `reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)` in one launch: q [T, H,
    head_dim] is rotated in place; k [T, KVH, head_dim] rotated and v [T, KVH, head_dim] go into the paged caches
    [num_blocks, block_size, KVH, head_dim] (float32 or float16, rounded to nearest even) at slot_mapping[t]
    (int32; -1 skips the token). The caches get exactly what the two ops give; k itself is not modified. q, k, v
    may be strided views of a fused qkv output; positions / cos_sin_cache as in `rope`.
    parts > 1 (GPUs, at most ROPE_CACHE_PER_HEAD_MAX_T tokens: `takes_split_k`): q, k and v are views of the first
    of `parts` split-K slabs of the qkv projection, `part_stride` elements apart (matmul.SplitK), summed in slab
    order as they are read (the bits its sum kernel would store); the rotated q (all of its head_dim) goes to
    q_out, an array of q's shape and strides."""
    from .attention import _check_cache, _i32
    target = resolve_target(target, q)
    if not is_array(q) or q.ndim != 3:
        raise ValueError(f"rope_and_cache: q must be [tokens, heads, head_dim], got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    T = q.shape[0]
    if q.shape[2] != head_dim:
        raise ValueError(f"rope_and_cache: q's last axis is {q.shape[2]}, head_dim is {head_dim}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rope_and_cache: rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    qs0, qs1 = _heads_view(q, T, head_dim, "rope_and_cache: q")
    ks0, ks1 = _heads_view(k, T, head_dim, "rope_and_cache: k")
    vs0, vs1 = _heads_view(v, T, head_dim, "rope_and_cache: v")
    for a, nm in ((q, "q"), (k, "k"), (v, "v")):
        if a.dtype != np.float32:
            raise TypeError(f"rope_and_cache: {nm} must be float32, got {a.dtype}")
    bs, kvh, dim = _check_cache(k_cache, v_cache)
    if k.shape[1] != kvh or v.shape[1] != kvh or dim != head_dim:
        raise ValueError(f"rope_and_cache: k {k.shape} / v {v.shape} do not match the cache's [.., {kvh}, {dim}]")
    slot_mapping = _i32(slot_mapping, "rope_and_cache: slot_mapping")
    if slot_mapping.shape[0] != T:
        raise ValueError(f"rope_and_cache: slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    check_dtype(positions, np.int32, "rope_and_cache: positions")
    if positions.shape != (T,) or not positions.flags.c_contiguous:
        raise ValueError(f"rope_and_cache: positions must be a contiguous int32 array of shape ({T},), got "
                         f"{positions.shape}")
    check_dtype(cos_sin_cache, np.float32, "rope_and_cache: cos_sin_cache")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != rotary_dim or not cos_sin_cache.flags.c_contiguous:
        raise ValueError(f"rope_and_cache: cos_sin_cache must be a contiguous [max_pos, {rotary_dim}] array, "
                         f"got {cos_sin_cache.shape}")
    max_pos = cos_sin_cache.shape[0]
    if check_positions and T and not is_device(positions) and (int(positions.min()) < 0 or
                                                                int(positions.max()) >= max_pos):
        raise ValueError(f"rope_and_cache: positions must lie in [0, {max_pos}) (the cos/sin cache length); got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    half = rotary_dim // 2
    # per head on GPUs up to ROPE_CACHE_PER_HEAD_MAX_T tokens (decode steps, short prefills); longer steps have
    # programs enough per token: H200, Llama-3-8B shape, 8 layers: 64 tokens 112 -> 51 us, 1024 tokens 266 -> 634 us
    per_head = takes_split_k(T, target)
    parts = int(parts)
    if parts < 1:
        raise ValueError(f"rope_and_cache: parts must be 1 or more (split-K slabs), got {parts}")
    if parts > 1:
        if not per_head:
            raise ValueError(f"rope_and_cache: split-K slabs are read on GPUs for at most "
                             f"{ROPE_CACHE_PER_HEAD_MAX_T} tokens (takes_split_k); got {T} tokens on {target}")
        if q_out is None or tuple(q_out.shape) != tuple(q.shape) or \
                _heads_view(q_out, T, head_dim, "rope_and_cache: q_out") != (qs0, qs1):
            raise ValueError("rope_and_cache: with parts > 1, q_out must be an array of q's shape and strides")
        if q_out.dtype != np.float32:
            raise TypeError(f"rope_and_cache: q_out must be float32, got {q_out.dtype}")
        if int(part_stride) <= 0:
            raise ValueError(f"rope_and_cache: part_stride must be positive with parts > 1, got {part_stride}")
    elif q_out is not None and q_out is not q:
        raise ValueError("rope_and_cache: q_out is for split-K slabs (parts > 1); q is rotated in place")
    qo = fptr(q_out if parts > 1 else q, "q_out")
    if per_head:
        run(rope_cache_head_kernel, (T, q.shape[1] + kvh),
            (fptr(q, "q"), qs0, qs1, q.shape[1], fptr(k, "k"), ks0, ks1, fptr(v, "v"), vs0, vs1, kvh, positions,
             cos_sin_cache, max_pos, k_cache, v_cache, slot_mapping, qo, int(part_stride) if parts > 1 else 0),
            target, HALF=half, NEOX=bool(is_neox), BLOCK=pow2_at_least(half if is_neox else rotary_dim, 16),
            D=head_dim, BD=pow2_at_least(head_dim, 16), TAIL=rotary_dim < head_dim,
            **({"PARTS": parts} if parts > 1 else {}))
        return
    tiles = target is not None and target.fast_workgroups and target.tuning.rope_tiles
    run(rope_cache_tile_kernel if tiles else rope_cache_kernel, (T,),
        (fptr(q, "q"), qs0, qs1, q.shape[1], fptr(k, "k"), ks0, ks1, fptr(v, "v"), vs0, vs1,
         kvh, positions, cos_sin_cache, max_pos, k_cache, v_cache, slot_mapping),
        target, HALF=half, NEOX=bool(is_neox), BLOCK=pow2_at_least(half if is_neox else rotary_dim, 16),
        D=head_dim, BD=pow2_at_least(head_dim, 16), TAIL=rotary_dim < head_dim,
        **({"HQ": pow2_at_least(q.shape[1], 1), "HK": pow2_at_least(kvh, 1)} if tiles else {}))


def takes_split_k(T: int, target=None) -> bool:
    """Whether rope_and_cache reads a split-K qkv projection's slabs (parts > 1) for a step of T tokens on
    `target` (resolved): its per-head GPU kernel does."""
    return bool(target is not None and target.is_gpu and T <= ROPE_CACHE_PER_HEAD_MAX_T)


# ------------------------------------------------------------------------------------ host-side cache
_F32 = np.float32


def _pow_f32(base: float, exps: np.ndarray) -> np.ndarray:
    """float32 base ** exps as torch computes it: numpy's float32 power is often an ulp off, so evaluate in
    float64 and round once (bit-identical to torch for most exponents, within an ulp otherwise)."""
    return (np.float64(_F32(base)) ** exps.astype(np.float64)).astype(_F32)


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all in float32
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(_F32) / _F32(dim)
    return (_F32(1.0) / _pow_f32(base, exps)).astype(_F32)


def _get(scaling: dict, key: str, what: str):
    if key not in scaling or scaling[key] is None:
        raise ValueError(f"rope scaling '{what}': missing required field '{key}' (got {sorted(scaling)})")
    return scaling[key]


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None,
                  max_position_embeddings: int | None = None, *, seq_len: int | None = None
                  ) -> tuple[np.ndarray, float]:
    """(inv_freq f32 [rotary_dim // 2], attention_scaling) for a rope scaling config, as HF transformers'
    rope init functions compute them. `scaling` is the config's rope_scaling / rope_parameters dict (type
    under "rope_type" or "type"); None or type "default" means plain RoPE. Supported: default, linear,
    llama3, yarn, longrope (Phi-3; "su" is its older name). `max_position_embeddings` is used by yarn and
    longrope configs without a `factor`. LongRoPE uses its long factors when `seq_len` >
    original_max_position_embeddings, else its short ones (HF's `seq_len` argument).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    kind = "default"
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    dim = rotary_dim
    if kind == "default":
        return _base_inv_freq(base, dim), 1.0
    if kind == "linear":
        factor = float(_get(scaling, "factor", kind))
        return (_base_inv_freq(base, dim) / _F32(factor)).astype(_F32), 1.0
    if kind == "llama3":
        inv = _base_inv_freq(base, dim)
        factor = _F32(_get(scaling, "factor", kind))
        lo = _F32(_get(scaling, "low_freq_factor", kind))
        hi = _F32(_get(scaling, "high_freq_factor", kind))
        old = _get(scaling, "original_max_position_embeddings", kind)
        low_wl = old / float(lo)
        high_wl = old / float(hi)
        wavelen = (_F32(2 * math.pi) / inv).astype(_F32)
        inv_l = np.where(wavelen > low_wl, inv / factor, inv).astype(_F32)
        smooth = ((_F32(old) / wavelen - lo) / (hi - lo)).astype(_F32)
        smoothed = ((_F32(1) - smooth) * inv_l / factor + smooth * inv_l).astype(_F32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, inv_l).astype(_F32), 1.0
    if kind == "yarn":
        factor = scaling.get("factor")
        orig = _get(scaling, "original_max_position_embeddings", kind)
        if factor is None:
            if max_position_embeddings is None:
                raise ValueError("rope scaling 'yarn' without 'factor' needs max_position_embeddings")
            factor = max_position_embeddings / orig
        factor = float(factor)
        attn = scaling.get("attention_factor")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attn is None:
            attn = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all)) if mscale and mscale_all \
                else get_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1
        truncate = scaling.get("truncate", True)

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = _pow_f32(base, np.arange(0, dim, 2).astype(_F32) / _F32(dim))
        extra = (_F32(1.0) / pos_freqs).astype(_F32)
        inter = (_F32(1.0) / (_F32(factor) * pos_freqs)).astype(_F32)
        ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1).astype(_F32)
        ef = (_F32(1) - ramp).astype(_F32)
        return (inter * (_F32(1) - ef) + extra * ef).astype(_F32), float(attn)
    if kind in ("longrope", "su"):
        short = np.asarray(_get(scaling, "short_factor", kind), dtype=_F32).reshape(-1)
        long_ = np.asarray(_get(scaling, "long_factor", kind), dtype=_F32).reshape(-1)
        orig = int(_get(scaling, "original_max_position_embeddings", kind))
        for name, f in (("short_factor", short), ("long_factor", long_)):
            if f.shape != (dim // 2,):
                raise ValueError(f"rope scaling 'longrope': '{name}' has {f.shape[0]} entries, expected rotary_dim/2 "
                                 f"= {dim // 2}")
        factor = scaling.get("factor")
        if factor is None:       # Phi-3: the ratio of the extended to the pretrained context
            factor = (max_position_embeddings or orig) / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = long_ if (seq_len and seq_len > orig) else short
        exps = np.arange(0, dim, 2, dtype=np.int64).astype(_F32) / _F32(dim)
        return (_F32(1.0) / (ext * _pow_f32(base, exps))).astype(_F32), float(attn)
    raise ValueError(f"rope scaling type '{kind}' is not supported (supported: default, linear, llama3, yarn, "
                     f"longrope)")


def rope_cos_sin_cache(head_dim: int, rotary_dim: int, max_pos: int, base: float,
                       scaling: dict | None = None, *, max_position_embeddings: int | None = None,
                       seq_len: int | None = None) -> np.ndarray:
    """The f32 [max_pos, rotary_dim] cos/sin cache for `rope` (host-side, at model init).

    Row p is [cos(p * inv_freq) * s, sin(p * inv_freq) * s] with inv_freq and the attention scaling s from
    `rope_inv_freq`. The angle p * inv_freq is rounded to f32 as in HF/vLLM (which compute it in float32);
    cos/sin are then evaluated in float64 and rounded (within an ulp of torch's float32 cos/sin).
    """
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rope: rotary_dim {rotary_dim} must be in (0, head_dim={head_dim}]")
    inv, attn = rope_inv_freq(rotary_dim, base, scaling, max_position_embeddings, seq_len=seq_len)
    ang = (np.arange(max_pos, dtype=_F32)[:, None] * inv[None, :]).astype(_F32).astype(np.float64)
    cache = np.empty((max_pos, rotary_dim), _F32)
    half = rotary_dim // 2
    cache[:, :half] = np.cos(ang) * attn
    cache[:, half:] = np.sin(ang) * attn
    return cache


__all__ = ["rope", "rope_and_cache", "rope_cos_sin_cache", "rope_inv_freq"]
