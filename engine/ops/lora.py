"""Multi-LoRA low-rank products over a batch whose tokens use different adapters (punica's SGMV, as vLLM's).

For a linear y = x W^T and adapters held in slots s = 0..L-1 (A[s]: [R, K], B[s]: [N, R], the adapter's scale
folded into B as vLLM's LoRA weights do), each token t with slot s(t) >= 0 gets

    y[t] += (x[t] @ A[s(t)]^T) @ B[s(t)]^T          (tokens with s(t) = -1: no adapter, y unchanged)

in two launches of one segmented kernel (`sgmv`):
- shrink: v[t, :R] = x[t] @ A[s(t)]^T             (`lora_shrink`)
- expand: y[t, :N] += v[t] @ B[s(t)]^T            (`lora_expand`)

Segments: `lora_tiles(token_slots, block_m)` cuts the runs of consecutive tokens that share a slot into tiles of
at most BM tokens ((slot, first token, length) per tile; tokens without an adapter get no tile). A program takes
one tile and BN output columns and reads its adapter's rows once for the tile's tokens, so the requests of one
adapter in a decode step (consecutive in the flat batch) share their weight reads, as punica's segments do.

Arithmetic per output: one V-lane FMA chain over the reduction axis (its tail masked into the same chain) and one
lane-sum tree; tile rows past a tile's length and columns past N are masked, never shifted onto neighbours (the
expand adds in place: an overlapped column would be added twice). So a token's delta does not depend on which
other tokens share the step. Several projections fused in one linear (q/k/v, gate/up) take one stacked A
([S*R, K]: each projection's R rows) and one B whose projection rows have nonzeros only in that projection's R
columns: the same two launches.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import check_dtype, fptr, launch_target, resolve_target, run

__all__ = ["sgmv", "lora_tiles", "lora_shrink", "lora_expand", "lora_apply"]

# tokens per tile: a decode step's requests of one adapter, or a prompt's chunk in blocks of 8
BLOCK_M = 8


@jk.kernel
def _sgmv_kernel(x, ldx, w, w_es, y, ldy, tile_slot, tile_start, tile_len, N, K, ADD: jk.constexpr,
                 BM: jk.constexpr, BN: jk.constexpr, V: jk.constexpr):
    # Grid (tiles, cdiv(N, BN)). Tile i: rows [s, s + L) (L <= BM) of x and y, slot e = tile_slot[i];
    # y[r, n] = x[r] . w[e, n] (ADD: y[r, n] + x[r] . w[e, n]) for the tile's rows r and this program's columns n.
    tile = jk.program_id(0)
    e = jk.load(tile_slot + tile).to(jk.i64)
    s = jk.load(tile_start + tile).to(jk.i64)
    L = jk.load(tile_len + tile)
    ri = jk.arange(0, BM)
    rm = ri < L
    cols = jk.program_id(1).to(jk.i64) * BN + jk.arange(0, BN).to(jk.i64)
    cm = cols < N
    K64 = K.to(jk.i64)
    rows = s + ri.to(jk.i64)
    kv = jk.arange(0, V)
    xrow = x + rows[:, None] * ldx.to(jk.i64)
    wrow = w + e * w_es + jk.where(cm, cols, 0)[:, None] * K64      # masked columns read row 0 (ignored)
    xmask = jk.broadcast_to(rm[:, None], (BM, V))
    acc = jk.zeros((BM, BN, V), jk.f32)
    kmain = K - K % V
    for k in range(0, kmain, V):
        xv = jk.load(xrow + (k + kv)[None, :], mask=xmask, other=0.0)
        wv = jk.load(wrow + (k + kv)[None, :]).to(jk.f32)
        acc = jk.fma(xv[:, None, :], wv[None, :, :], acc)
    if kmain < K:
        km = (kmain + kv) < K
        xv = jk.load(xrow + (kmain + kv)[None, :], mask=xmask & km[None, :], other=0.0)
        wv = jk.load(wrow + (kmain + kv)[None, :], mask=jk.broadcast_to(km[None, :], (BN, V)), other=0.0)
        acc = jk.fma(xv[:, None, :], wv.to(jk.f32)[None, :, :], acc)
    res = jk.sum(acc, axis=2)
    yp = y + rows[:, None] * ldy.to(jk.i64) + cols[None, :]
    m = jk.broadcast_to(rm[:, None], (BM, BN)) & jk.broadcast_to(cm[None, :], (BM, BN))
    if ADD:
        res = jk.load(yp, mask=m, other=0.0) + res
    jk.store(yp, res, mask=m)


def lora_tiles(token_slots: np.ndarray, block_m: int = BLOCK_M) -> tuple:
    """(tile_slot, tile_start, tile_len) int32 arrays: the runs of consecutive tokens with the same slot >= 0,
    each cut into tiles of at most block_m tokens, in token order."""
    s = np.asarray(token_slots, np.int64).ravel()
    if s.size == 0:
        z = np.zeros(0, np.int32)
        return z, z, z
    cut = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [s.size]))
    keep = s[starts] >= 0
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        z = np.zeros(0, np.int32)
        return z, z, z
    counts = -(-(ends - starts) // block_m)
    run_of = np.repeat(np.arange(starts.size), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    t_start = starts[run_of] + within * block_m
    t_len = np.minimum(ends[run_of] - t_start, block_m)
    return s[t_start].astype(np.int32), t_start.astype(np.int32), t_len.astype(np.int32)


def _tiles_for(target, n: int) -> tuple:
    """(BN, V): output columns per program and FMA lanes. A GPU program (a CTA of 128 threads) takes V = 32 lanes
    of the reduction axis: a warp reads 128 contiguous bytes of a weight row per step."""
    t = launch_target(target)
    V = 32 if t.fast_workgroups else max(4, t.vector_bits // 32)
    BN = 8 if t.has("avx512f") else 4
    while BN > 1 and BN // 2 >= n:
        BN //= 2
    return BN, V


def _rows_arg(a, cols: int, what: str) -> int:
    check_dtype(a, np.float32, what)
    if a.ndim != 2 or a.shape[1] != cols or (a.shape[1] > 1 and a.strides[1] != 4):
        raise ValueError(f"{what}: expected float32 [tokens, {cols}] with contiguous rows, got {a.shape}")
    return a.strides[0] // 4 if a.shape[0] > 1 else cols


def sgmv(x, w, tiles, out, *, add: bool = False, block_m: int = BLOCK_M, target=None):
    """out[t] (+)= x[t] @ w[slot]^T for every token t of every tile (w: [slots, N, K] f32/f16/bf16 as uint16,
    contiguous; x f32 [T, K], out f32 [T, N], both with contiguous rows). Tokens outside the tiles are left as
    they are. Returns out."""
    tile_slot, tile_start, tile_len = tiles
    if w.ndim != 3 or not w.flags.c_contiguous:
        raise ValueError(f"sgmv: w must be a C-contiguous [slots, N, K] array, got {w.shape}")
    _, N, K = w.shape
    ldx = _rows_arg(x, K, "sgmv: x")
    ldy = _rows_arg(out, N, "sgmv: out")
    if x.shape[0] != out.shape[0]:
        raise ValueError(f"sgmv: x has {x.shape[0]} rows, out {out.shape[0]}")
    target = resolve_target(target, x)
    BN, V = _tiles_for(target, N)
    run(_sgmv_kernel, (len(tile_slot), jk.cdiv(N, BN)),
        (x, ldx, fptr(w, "sgmv: w"), N * K, out, ldy, tile_slot, tile_start, tile_len, N, K),
        target, ADD=bool(add), BM=int(block_m), BN=BN, V=V)
    return out


def lora_shrink(x, a, tiles, out, *, block_m: int = BLOCK_M, target=None):
    """v[t] = x[t] @ a[slot]^T (a: [slots, R, K]); rows of tokens without an adapter are not written."""
    return sgmv(x, a, tiles, out, add=False, block_m=block_m, target=target)


def lora_expand(v, b, tiles, y, *, block_m: int = BLOCK_M, target=None):
    """y[t] += v[t] @ b[slot]^T (b: [slots, N, R], the adapter's scale folded in)."""
    return sgmv(v, b, tiles, y, add=True, block_m=block_m, target=target)


def lora_apply(x, a, b, tiles, y, v, *, block_m: int = BLOCK_M, target=None):
    """y[t] += (x[t] @ a[slot]^T) @ b[slot]^T for the tiles' tokens; v: f32 [T, R] scratch. Returns y."""
    if len(tiles[0]) == 0:
        return y
    lora_shrink(x, a, tiles, v, block_m=block_m, target=target)
    return lora_expand(v, b, tiles, y, block_m=block_m, target=target)
