"""Attention over a vLLM-style paged KV cache: cache writes, decode attention, prefill/mixed attention.

Layouts (fixed; the engine relies on them)
-----------------------------------------
KV cache, per layer: ``k_cache`` and ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
C-contiguous, dtype float32 or float16 (f16 halves the bytes decode reads; all math is f32). The token at
global slot ``s`` lives at ``cache[s // block_size, s % block_size]`` (so slot ``s`` starts at element
``s * num_kv_heads * head_dim``).

``reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)``
    ``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]`` float32; the last axis contiguous, the token and
    head axes may have any stride (e.g. views into the fused ``qkv`` output ``[T, (H + 2*KVH) * D]``:
    ``qkv[:, H*D:(H+KVH)*D].reshape(T, KVH, D)``). ``slot_mapping``: int32 ``[num_tokens]``; token ``i`` is
    written to slot ``slot_mapping[i]``; ``-1`` skips the token (padding).

``paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, scale=..., ...)``
    One engine step over a batch mixing prefill chunks and decodes.
    ``q``: ``[num_tokens, num_heads, head_dim]`` float32 (token/head strides free, last axis contiguous);
    ``out``: same shape, float32 (allocated when not given; strides free like ``q``).
    ``query_start``: int32 ``[num_seqs + 1]``; sequence ``i``'s new tokens are rows
    ``query_start[i] .. query_start[i+1]-1`` (non-decreasing; a sequence with no new tokens is padding).
    ``seq_lens``: int32 ``[num_seqs]``, the total length (cached context + new tokens) of each sequence.
    ``block_table``: int32 ``[num_seqs, max_blocks_per_seq]`` (rows may be strided), physical block ids.
    Query token ``j`` of sequence ``i`` (``q_len = query_start[i+1] - query_start[i]``) sits at absolute
    position ``seq_lens[i] - q_len + j`` and attends causally to positions ``<=`` its own. Head ``h`` uses
    KV head ``h // (num_heads // num_kv_heads)`` (MHA, GQA and MQA).
    ``scale``: logits are ``scale * q.k``. ``softcap`` (0 = off): logits become ``softcap * tanh(logits /
    softcap)`` before masking and softmax (Gemma 2). ``sliding_window`` (0 = off): a query at position
    ``p`` sees only keys at ``p - sliding_window < pos <= p``, i.e. the last ``sliding_window`` positions
    including itself (HF ``sliding_window`` / vLLM ``window_size = (sliding_window - 1, 0)``).

Everything that changes from step to step (query_start, seq_lens, block_table, slot_mapping) is read by
the kernels from those int32 arrays; grid sizes depend only on ``num_tokens``, ``num_seqs`` and the
partition count, so a launch recorded with ``jk.capture()`` can be replayed after rewriting the arrays in
place (keep the same array objects and the same ``num_tokens`` / ``num_seqs``; pad with empty sequences).

Kernels
-------
- ``decode_kernel``: sequences with exactly one new token. One program per (sequence, context partition)
  handles *all* heads, blocks outer and KV heads inner: each cache block holds the K rows of every KV head
  of 16 tokens back to back, so every block is read once, front to back (per-KV-head programs read a third
  of each line run and measured ~1.7x slower: the hardware prefetcher pulls in the other heads' lines).
  The G query heads of a KV head share its K/V rows; their scores are row dot products folded with a
  butterfly into one vector of 16 scores; the softmax is online (running max, per-lane running sums) and
  the next block is prefetched into L2 while the current one is computed. A sequence whose key range
  exceeds PARTITION_BLOCKS blocks is split into partitions (flash-decoding: one program each, at most
  MAX_PARTITIONS) and ``merge_kernel`` combines their (max, sum, accumulator) states.
- ``prefill_kernel``: sequences with more than one new token (or every sequence, for a general step).
  One program per (tile of ``BQ`` query tokens of one sequence, KV head); the sequence of a tile is found
  by a binary search over ``query_start`` (vLLM's unified-attention trick), so the grid is
  ``(num_tokens // BQ + num_seqs, num_kv_heads)`` whatever the mix. Each token of the tile runs the same
  block step as decode (its G query heads against one K/V block at a time, causal and window masks) over
  the blocks of its own range, split and merged like a decode at its position; the blocks the tile's
  tokens share stay in L1/L2 between tokens.

Batch invariance: a query's floating-point operations depend only on its own position, window and the
cache contents, never on the batch, the partition axis of the launch, or which kernel ran it (decode or
prefill): partitions are decided from the query's own key range, and the merge's lane sums are fixed
trees whose padding lanes add exact identities. Tested with assert_array_equal.

Both kernels keep the per-head softmax state in a small workspace (L1-resident) rather than in loop-carried
registers: the code then does not grow with the number of heads (fast compiles on every tier) and odd
head counts do not produce odd-sized loop-carried vectors, which LLVM compiled to much slower code.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import elem_strides, empty_like_dev, host_copy, is_array, is_device, resolve_target, run
from .quant import q8_group, q8_store_blocks

NEG = -1.0e30          # "minus infinity" for masked logits: keeps exp(m_old - m_new) free of inf - inf
PARTITION_BLOCKS = 16  # a query's key range is split into partitions of this many blocks (256 tokens) ...
MAX_PARTITIONS = 16    # ... at most this many (longer ranges get longer partitions)


# ------------------------------------------------------------------------------------------ helpers
@jk.jit
def _load_chunks(ptr, n, row_stride, D, w):
    """A (BS, D) tile at ptr + n * row_stride + [0, D) as a tuple of D // w column chunks of shape (BS, w)."""
    j = jk.arange(0, w)
    out = ()
    for c in jk.static_range(D // w):
        out = out + (jk.load(ptr + n[:, None] * row_stride + c * w + j[None, :]).to(jk.f32),)
    return out


@jk.jit
def _chunk_dots(ks, qc, BS, w):
    """(BS,) dot products of the rows of a chunked tile ks (tuple of (BS, w)) with a chunked row qc.

    The chunk products are added vertically into one (BS, w) tile, whose w lanes are then folded pairwise
    in log2(w) steps: one (BS,) vector of results instead of BS horizontal reductions plus inserts, and
    only (BS, w)-sized shuffles (whole-row shuffles of a (BS, D) tile compile several times slower).
    """
    y = ks[0] * qc[0][None, :]
    for c in jk.static_range(1, len(ks)):
        y = jk.fma(ks[c], qc[c][None, :], y)
    half = w
    for _ in jk.static_range(w.bit_length() - 1):
        half = half // 2
        y = jk.sum(jk.reshape(y, (BS, 2, half)), axis=1)
    return jk.reshape(y, (BS,))


@jk.jit
def _row_max(x, R, C):
    """max over the last axis of an (R, C) tile (C a power of two) by pairwise vector maxima of halves;
    jk.max(x, axis=1) would reduce each row through a serial NaN-aware scalar chain."""
    half = C
    for _ in jk.static_range(C.bit_length() - 1):
        half = half // 2
        x = jk.max(jk.reshape(x, (R, 2, half)), axis=1)
    return jk.reshape(x, (R,))


@jk.jit
def _attend_block(qrow, q_hs, k_ptr, v_ptr, kv_stride, valid, st_m, st_l, st_acc, r0, scale, softcap,
                  G, D, BS, w, SOFTCAP):
    """One online-softmax step of G query heads (rows qrow + g * q_hs) against one block of BS keys whose
    K and V rows start at k_ptr / v_ptr, kv_stride elements apart; valid: (BS,) keys this query may see.

    The state of the G heads lives in workspace rows r0 .. r0 + G - 1: st_m (running max), st_l (BS
    per-lane running sums of exp, summed across lanes only at the end) and st_acc (D, running P @ V).
    A state that has seen no valid key yet is (NEG, 0, 0) and stays so on an all-masked block.

    Each head's scores are stored (into its st_l row, read back below) before the next head's K rows are
    loaded: the store may alias the cache, so LLVM reloads K from L1 per head instead of keeping the
    whole K tile live across the heads and spilling it to the stack.
    """
    n = jk.arange(0, BS)
    j = jk.arange(0, w)
    r = r0 + jk.arange(0, G)
    l_i = jk.load(st_l + r[:, None] * BS + n[None, :])
    for g in jk.static_range(G):
        qc = ()
        for c in jk.static_range(D // w):
            qc = qc + (jk.load(qrow + g * q_hs + c * w + j),)
        ks = _load_chunks(k_ptr, n, kv_stride, D, w)
        jk.store(st_l + (r0 + g) * BS + n, _chunk_dots(ks, qc, BS, w))
    _block_update(jk.load(st_l + r[:, None] * BS + n[None, :]), l_i, v_ptr, kv_stride, valid, st_m, st_l, st_acc,
                  r0, scale, softcap, G, D, BS, SOFTCAP)


@jk.jit
def _softmax_step(scores, valid, st_m, r, scale, softcap, G, BS, SOFTCAP):
    """The online-softmax statistics of one block for state rows r from the (G, BS) raw scores: (the new row
    maxima, the old state's factor alpha, the probabilities p); masked keys get p = 0. Shared by both block
    updates so they give the same bits."""
    s = scores * scale
    if SOFTCAP:
        s = softcap * jk.tanh(s / softcap)
    s = jk.where(valid[None, :], s, NEG)
    m_i = jk.load(st_m + r)
    m_new = jk.maximum(m_i, _row_max(s, G, BS))
    alpha = jk.exp(m_i - m_new)
    return m_new, alpha, jk.where(valid[None, :], jk.exp(s - m_new[:, None]), 0.0)


@jk.jit
def _block_update(scores, l_i, v_ptr, kv_stride, valid, st_m, st_l, st_acc, r0, scale, softcap, G, D, BS,
                  SOFTCAP):
    """The online-softmax update of _attend_block from the (G, BS) raw scores q.k of the block: shared by
    the per-token step and the prefill kernel's token groups (_group_scores), so both give the same bits."""
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    r = r0 + jk.arange(0, G)
    m_new, alpha, p = _softmax_step(scores, valid, st_m, r, scale, softcap, G, BS, SOFTCAP)
    vt = jk.load(v_ptr + n[:, None] * kv_stride + d[None, :]).to(jk.f32)
    acc = jk.dot(p, vt, jk.load(st_acc + r[:, None] * D + d[None, :]) * alpha[:, None])
    jk.store(st_m + r, m_new)
    jk.store(st_l + r[:, None] * BS + n[None, :], l_i * alpha[:, None] + p)
    jk.store(st_acc + r[:, None] * D + d[None, :], acc)


@jk.jit
def _block_update_chunks(scores, l_i, vf, ps, valid, st_m, st_l, st_acc, r0, scale, softcap, G, D, BS, w, SOFTCAP):
    """_block_update with the block's V as f32 rows at vf ((BS, D), contiguous) and the P @ V product one
    w-wide column chunk of the accumulator at a time: per output element the same operations as the dot of
    _block_update (p[0] * v[0], then FMAs over the keys in order, then + acc * alpha), so the same bits, with
    a chunk's G accumulators in registers and the probabilities broadcast from ps (G * BS floats of scratch)
    instead of the (G, D) accumulator tile spilled around every key."""
    n = jk.arange(0, BS)
    jw = jk.arange(0, w)
    r = r0 + jk.arange(0, G)
    m_new, alpha, p = _softmax_step(scores, valid, st_m, r, scale, softcap, G, BS, SOFTCAP)
    jk.store(ps + jk.arange(0, G)[:, None] * BS + n[None, :], p)
    jk.store(ps + G * BS + jk.arange(0, G), alpha)
    jk.store(st_m + r, m_new)
    jk.store(st_l + r[:, None] * BS + n[None, :], l_i * alpha[:, None] + p)
    CG = 2 if (D // w) % 2 == 0 else 1          # column chunks at a time: 2 * G independent FMA chains
    for c0 in jk.static_range(0, D // w, CG):
        acc = ()
        for c in jk.static_range(c0, c0 + CG):
            for g in jk.static_range(G):
                acc = acc + (jk.load(ps + g * BS) * jk.load(vf + c * w + jw),)
        for kk in jk.static_range(1, BS):
            nxt = ()
            for c in jk.static_range(c0, c0 + CG):
                vk = jk.load(vf + kk * D + c * w + jw)
                for g in jk.static_range(G):
                    nxt = nxt + (jk.fma(jk.load(ps + g * BS + kk), vk, acc[(c - c0) * G + g]),)
            acc = nxt
        for c in jk.static_range(c0, c0 + CG):
            for g in jk.static_range(G):
                row = st_acc + (r0 + g) * D + c * w + jw
                jk.store(row, acc[(c - c0) * G + g] + jk.load(row) * jk.load(ps + G * BS + g))


@jk.jit
def _transpose_block(k_ptr, kv_stride, kt, D, BS, w):
    """A block's (BS, D) K rows (f32 or f16) as f32 K^T (D, BS) at kt: the keys of a dimension contiguous."""
    jw = jk.arange(0, w)
    for kh in jk.static_range(BS // w):          # (w, w) sub-blocks: shuffles within registers
        for c in jk.static_range(D // w):
            x = jk.load(k_ptr + (kh * w + jw)[:, None] * kv_stride + (c * w + jw)[None, :]).to(jk.f32)
            jk.store(kt + (c * w + jw)[:, None] * BS + (kh * w + jw)[None, :], jk.trans(x))


@jk.jit
def _lane_scores(qrow, q_hs, kt, dst, part, G, D, BS, w):
    """The (G, BS) raw scores q.k of G query heads (rows qrow + g * q_hs) against a block whose K^T (D, BS)
    f32 is at kt, stored at dst + g * BS; the keys in the vector lanes. Each score is the exact arithmetic
    of _chunk_dots: lane j of w holds a product then FMAs over the D / w chunks in order (here the chain j
    of every head and key, fed by broadcasts of q's element c * w + j, each K^T row loaded once for the G
    heads; the chains go to `part`, G * w * BS floats of scratch), then lanes j and j + w / 2, ... are added
    pairwise (here whole chain vectors: no shuffles), so the bits equal the per-token step's."""
    KH = BS // w
    jw = jk.arange(0, w)
    for j in jk.static_range(w):
        acc = ()
        for kh in jk.static_range(KH):
            kv = jk.load(kt + j * BS + kh * w + jw)
            for g in jk.static_range(G):
                acc = acc + (jk.load(qrow + g * q_hs + j) * kv,)
        for c in jk.static_range(1, D // w):
            nxt = ()
            for kh in jk.static_range(KH):
                kv = jk.load(kt + (c * w + j) * BS + kh * w + jw)
                for g in jk.static_range(G):
                    nxt = nxt + (jk.fma(jk.load(qrow + g * q_hs + c * w + j), kv, acc[kh * G + g]),)
            acc = nxt
        for kh in jk.static_range(KH):
            for g in jk.static_range(G):
                jk.store(part + (g * w + j) * BS + kh * w + jw, acc[kh * G + g])
    n = jk.arange(0, BS)
    for g in jk.static_range(G):
        y = ()
        for j in jk.static_range(w):
            y = y + (jk.load(part + (g * w + j) * BS + n),)
        half = w
        for _ in jk.static_range(w.bit_length() - 1):
            half = half // 2
            nxt = ()
            for j in jk.static_range(half):
                nxt = nxt + (y[j] + y[j + half],)
            y = nxt
        jk.store(dst + g * BS + n, y[0])


@jk.jit
def _split(nb, PB, MAXP, SB=1):
    """(partitions, blocks per partition) for a key range of nb blocks: decided by the range alone, so a
    query's arithmetic never depends on the batch it runs in (nor on decode vs prefill kernel). SB (the flash
    kernels' blocks per online-softmax step): a partition is whole steps (its length rounded up to a multiple
    of SB, the count then recomputed: never more partitions than at SB = 1), so no step straddles two."""
    parts = jk.minimum((nb + PB - 1) // PB, MAXP)
    per = (nb + jk.maximum(parts, 1) - 1) // jk.maximum(parts, 1)
    if SB > 1:
        per = (per + SB - 1) // SB * SB
        parts = (nb + jk.maximum(per, 1) - 1) // jk.maximum(per, 1)
    return parts, per


@jk.jit
def _owner_seq(query_start, num_seqs, search_steps, key, BQ, TILED):
    """Binary search (search_steps >= log2(num_seqs + 1) steps) for the last sequence i with query_start[i] <= key
    (a token's owner), or with TILED query_start[i] // BQ + i <= key (the owner of prefill tile key, where each
    sequence's tokens start a new tile)."""
    lo_s = key * 0
    hi_s = num_seqs
    for _ in range(0, search_steps):
        mid = (lo_s + hi_s) // 2
        v = jk.load(query_start + mid)
        if TILED:
            v = v // BQ + mid
        go = v <= key
        lo_s = jk.where(go, mid, lo_s)
        hi_s = jk.where(go, hi_s, mid)
    return lo_s


@jk.jit
def _query_tile(query_start, seq_lens, num_seqs, search_steps, qb, BQ, SKIP_DECODE):
    """Query tile qb of a prefill grid (each sequence's tokens in tiles of BQ; grid num_tokens // BQ +
    num_seqs): the sequence owning it, by binary search for the last i with query_start[i] // BQ + i <= qb,
    and the tile's rows. Returns (seq, q0, q_len, seq_len, t0, n_rows, first_pos): the sequence's first
    token, query and total lengths, the tile's first row within the sequence, its row count (0 past the
    sequence's tokens, and for decodes with SKIP_DECODE) and the position of its first row."""
    seq = _owner_seq(query_start, num_seqs, search_steps, qb, BQ, True)
    q0 = jk.load(query_start + seq)
    q_len = jk.load(query_start + seq + 1) - q0
    seq_len = jk.load(seq_lens + seq)
    t0 = (qb - (q0 // BQ + seq)) * BQ
    n_rows = jk.minimum(jk.maximum(q_len - t0, 0), BQ)
    if SKIP_DECODE:
        n_rows = jk.where(q_len == 1, 0, n_rows)
    return seq, q0, q_len, seq_len, t0, n_rows, seq_len - q_len + t0


@jk.jit
def _init_state(st_m, st_l, st_acc, r, G, D, BS, mask):
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    jk.store(st_m + r, jk.full((G,), NEG, jk.f32), mask=mask)
    jk.store(st_l + r[:, None] * BS + n[None, :], jk.zeros((G, BS), jk.f32), mask=mask)
    jk.store(st_acc + r[:, None] * D + d[None, :], jk.zeros((G, D), jk.f32), mask=mask)


@jk.jit
def _finish_state(st_m, st_l, st_acc, r, G, D, BS, sink, SINKS):
    """(G, D) attention output of a single-partition state: acc / sum of the per-lane exp sums (plus, with
    SINKS, exp(sink - max): gpt-oss's per-head sink logit, which joins the softmax but has no value)."""
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    l_tot = jk.sum(jk.load(st_l + r[:, None] * BS + n[None, :]), axis=1)
    if SINKS:
        l_tot = l_tot + jk.exp(sink - jk.load(st_m + r))
    return jk.load(st_acc + r[:, None] * D + d[None, :]) / l_tot[:, None]


@jk.jit
def _merge_parts(st_m, st_l, st_acc, row0, stride, parts, NP, D, BS, sink, SINKS):
    """(D,) output of one query head from its partial states in rows row0 + p * stride, p < parts (rows
    up to NP must exist).

    NP is the lane count of the partition axis (>= parts, a power of two); lanes p >= parts contribute the
    exact identity (-0.0 to every sum), and the lane sums are fixed halving/pairwise trees, so the result
    does not depend on NP: the decode merge (NP = the launch's partition count) and the prefill kernel
    (NP = MAX_PARTITIONS) produce bit-identical outputs for the same partials."""
    pi = jk.arange(0, NP)
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    ok = pi < parts
    r = row0 + pi.to(jk.i64) * stride
    # rows past `parts` exist in the workspace but hold stale data: read them unmasked (masked loads
    # scalarise on SSE tiers) and select them away
    m = jk.where(ok, jk.load(st_m + r), NEG)
    l = jk.where(ok, jk.sum(jk.load(st_l + r[:, None] * BS + n[None, :]), axis=1), 0.0)
    acc = jk.load(st_acc + r[:, None] * D + d[None, :])
    wgt = jk.where(ok, jk.exp(m - jk.max(m, axis=0)), 0.0)
    num = jk.sum(jk.where(ok[:, None], wgt[:, None] * acc, -0.0), axis=0)
    den = jk.sum(jk.where(ok, wgt * l, -0.0), axis=0)
    if SINKS:
        den = den + jk.exp(sink - jk.max(m, axis=0))
    return num / den


@jk.jit
def _merge_rows(st_m, st_l, st_acc, row0, stride, parts, pad, NP, D, BS, sink, SINKS):
    """_merge_parts with the same operations per output element (so the same bits), shaped for CPU tiers: the
    (NP, D) products one (D,) row at a time, added in the pairwise tree that sum(axis=0) of an (NP, D) tile
    uses ((0 + 1) + (2 + 3)) + ...; the (NP,) vectors (maxima, sums, weights) as in _merge_parts. A partition
    p >= parts reads its accumulator row from row `pad` (all -0.0, the caller's), so its product is
    0.0 * -0.0 = -0.0, _merge_parts's select value, with no mask: _merge_parts's (NP, D) select with
    ok[:, None] compiled, in the prefill kernel, to masks rebuilt from scalar bits for every 8-lane vector
    (~9 instructions each; a scalar condition per row compiled the same way)."""
    pi = jk.arange(0, NP)
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    ok = pi < parts
    r = row0 + pi.to(jk.i64) * stride
    m = jk.where(ok, jk.load(st_m + r), NEG)
    l = jk.where(ok, jk.sum(jk.load(st_l + r[:, None] * BS + n[None, :]), axis=1), 0.0)
    mx = jk.max(m, axis=0)
    wgt = jk.where(ok, jk.exp(m - mx), 0.0)
    den = jk.sum(jk.where(ok, wgt * l, -0.0), axis=0)
    terms = ()
    for p in jk.static_range(NP):
        w_p = jk.sum(jk.where(pi == p, wgt, -0.0), axis=0)     # lane p exactly (w + -0.0 == w)
        row = jk.where(parts > p, row0 + p * stride, pad)
        terms = terms + (w_p * jk.load(st_acc + row * D + d),)
    k = NP
    for _ in jk.static_range(NP.bit_length() - 1):
        k = k // 2
        nxt = ()
        for i in jk.static_range(k):
            nxt = nxt + (terms[2 * i] + terms[2 * i + 1],)
        terms = nxt
    if SINKS:
        den = den + jk.exp(sink - mx)
    return terms[0] / den


@jk.jit
def _merge_store(dst, st_m, st_l, st_acc, row0, stride, parts, pad, MAXP, D, BS, sink, SINKS, MERGE):
    """Stores at dst the (D,) merge of a query head's parts >= 2 partition states (rows row0 + p * stride).
    MERGE 0: _merge_parts over MAXP lanes. MERGE 1 (CPU tiers): _merge_rows over the smallest power of two
    NP >= parts (a run-time branch per NP), `pad` a row of -0.0: the lanes NP .. MAXP - 1 would add only
    -0.0, so the bits are the same (see _merge_parts), without the loads and products of those lanes."""
    d = jk.arange(0, D)
    if MERGE == 0:
        jk.store(dst + d, _merge_parts(st_m, st_l, st_acc, row0, stride, parts, MAXP, D, BS, sink, SINKS))
    else:
        for i in jk.static_range(1, MAXP.bit_length()):
            NP = 1 << i
            if (parts <= NP) & (parts > NP // 2):
                jk.store(dst + d, _merge_rows(st_m, st_l, st_acc, row0, stride, parts, pad, NP, D, BS, sink,
                                              SINKS))


@jk.jit
def _vec_width(D):
    """Chunk width for head_dim D: the target's f32 lanes per vector register, halved until it divides D
    (GPUs have no vector registers in this sense: 4, a 16-byte access per thread)."""
    w = (jk.target.vector_bits or 128) // 32
    for _ in jk.static_range(8):
        if D % w != 0:
            w = w // 2
    return w


# ------------------------------------------------------------------------------------------ kernels
@jk.kernel
def reshape_and_cache_kernel(k, v, k_cache, v_cache, slot_mapping, k_ts, k_hs, v_ts, v_hs,
                             KVH: jk.constexpr, D: jk.constexpr):
    t = jk.program_id(0)
    slot = jk.load(slot_mapping + t)
    ok = slot >= 0
    dst = jk.maximum(slot, 0).to(jk.i64) * (KVH * D)
    hh = jk.arange(0, KVH)
    d = jk.arange(0, D)
    tt = t.to(jk.i64)
    kv = jk.load(k + tt * k_ts + hh[:, None] * k_hs + d[None, :])
    vv = jk.load(v + tt * v_ts + hh[:, None] * v_hs + d[None, :])
    jk.store(k_cache + dst + hh[:, None] * D + d[None, :], kv, mask=ok)
    jk.store(v_cache + dst + hh[:, None] * D + d[None, :], vv, mask=ok)


@jk.jit
def _partition_of(j, NUM_PARTS: jk.constexpr):
    """The partition that program j of a sequence's NUM_PARTS runs: j's bits reversed when NUM_PARTS is a power
    of two (contiguous halves, quarters, ... of the programs get every 2nd, 4th, ... partition), else j."""
    if NUM_PARTS & (NUM_PARTS - 1) == 0:
        part = j * 0
        for i in jk.static_range(NUM_PARTS.bit_length() - 1):
            part = (part << 1) | ((j >> i) & 1)
        return part
    return j


@jk.kernel
def decode_kernel(q, k_cache, v_cache, out, st_m, st_l, st_acc, query_start, seq_lens, block_table,
                  q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                  KVH: jk.constexpr, G: jk.constexpr, D: jk.constexpr, BS: jk.constexpr,
                  NUM_PARTS: jk.constexpr, PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr,
                  PREFETCH: jk.constexpr, SINKS: jk.constexpr, HSPLIT: jk.constexpr = False,
                  SKIP_IDLE: jk.constexpr = False):
    """Program (sequence, partition): every head of a q_len == 1 sequence over one partition of its blocks
    (HSPLIT: program (sequence, KV head, partition), one KV head's query heads each, grid axis 0 = KVH x
    NUM_PARTS: for batches of fewer sequences than pool threads, whose one partition would otherwise keep all
    but one thread waiting; a head's arithmetic is the same either way).

    The sequence's own key range decides its partitions (_split); programs past them do nothing, so
    NUM_PARTS (the grid) only bounds them. A single-partition sequence writes its output here, the others
    leave partial states for merge_kernel. Blocks are the outer loop and KV heads the inner one, so each
    cache block is read once, front to back; the per-head softmax state lives in the st_* workspace
    (L1-resident), which keeps the code size independent of the head count.
    """
    # grid (NUM_PARTS, sequences): the flat program id runs over one sequence's partitions, then the next
    # sequence's, so the CPU pool's contiguous thread chunks take whole sequences (with the sequence as axis 0,
    # a batch of short sequences, one partition each, had all its work in the first chunk: one thread).
    # Within a sequence the partitions are dealt in bit-reversed order (NUM_PARTS a power of two), so a
    # sequence's first k partitions, the ones with work, spread over the chunks too. Only which program
    # runs a (sequence, partition) changes, never its arithmetic.
    seq = jk.program_id(1)
    if HSPLIT:
        h0 = jk.program_id(0) // NUM_PARTS          # this program's KV head
        part = _partition_of(jk.program_id(0) % NUM_PARTS, NUM_PARTS)
        nh = 1
    else:
        h0 = 0
        part = _partition_of(jk.program_id(0), NUM_PARTS)
        nh = KVH
    H = KVH * G
    w = _vec_width(D)
    q0 = jk.load(query_start + seq)
    q_len = jk.load(query_start + seq + 1) - q0
    seq_len = jk.load(seq_lens + seq)
    active = (q_len == 1) & (seq_len > 0)
    qpos = seq_len - 1
    lo = jk.where(window > 0, jk.maximum(qpos - window + 1, 0), 0)
    start_blk = lo // BS
    nb = jk.where(active, (seq_len + BS - 1) // BS - start_blk, 0)
    parts, per = _split(nb, PB, MAXP)
    mine = part < parts
    b0 = start_blk + part * per
    b1 = jk.where(mine, jk.minimum(b0 + per, start_blk + nb), b0)
    slot = (seq * NUM_PARTS + part).to(jk.i64) * H
    if SKIP_IDLE:
        # a program past its sequence's partitions (most of a recorded graph's MAX_PARTITIONS axis) returns
        # here instead of running the masked-off state init and output store below: what it wrote was nothing
        if mine:
            _decode_program(q, k_cache, v_cache, out, st_m, st_l, st_acc, q_ts, q_hs, o_ts, o_hs, bt_stride,
                            scale, softcap, sinks, q0, q_len, seq_len, lo, seq, slot, h0, nh, b0, b1, parts, mine,
                            block_table, KVH, G, D, BS, w, SOFTCAP, PREFETCH, SINKS)
    else:
        _decode_program(q, k_cache, v_cache, out, st_m, st_l, st_acc, q_ts, q_hs, o_ts, o_hs, bt_stride, scale,
                        softcap, sinks, q0, q_len, seq_len, lo, seq, slot, h0, nh, b0, b1, parts, mine,
                        block_table, KVH, G, D, BS, w, SOFTCAP, PREFETCH, SINKS)


@jk.jit
def _decode_program(q, k_cache, v_cache, out, st_m, st_l, st_acc, q_ts, q_hs, o_ts, o_hs, bt_stride, scale,
                    softcap, sinks, q0, q_len, seq_len, lo, seq, slot, h0, nh, b0, b1, parts, mine, block_table,
                    KVH, G, D, BS, w, SOFTCAP, PREFETCH, SINKS):
    """decode_kernel's work for one (sequence, partition): blocks b0 .. b1 of KV heads h0 .. h0 + nh."""
    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    gi = jk.arange(0, G)
    for h in range(h0, h0 + nh):
        _init_state(st_m, st_l, st_acc, slot + h * G + gi, G, D, BS, mine)
    qrow = q + jk.maximum(jk.minimum(q0, q0 + q_len - 1), 0).to(jk.i64) * q_ts
    bt_row = block_table + seq.to(jk.i64) * bt_stride
    for b in range(b0, b1):
        base = jk.load(bt_row + b).to(jk.i64) * (BS * KVH * D)
        nxt = jk.load(bt_row + jk.minimum(b + 1, b1 - 1)).to(jk.i64) * (BS * KVH * D)
        pos = b * BS + n
        valid = (pos < seq_len) & (pos >= lo)
        for h in range(h0, h0 + nh):
            if PREFETCH:
                # the next block's rows of this head, into L2: spread over the heads (a burst of the whole
                # block stalls on miss buffers) and not into L1 (two blocks of f32 K+V do not fit there);
                # measured ~1.5x (f32) to ~1.8x (f16) on cold random block tables
                jk.prefetch(k_cache + nxt + h * D + n[:, None] * (KVH * D) + d[None, :], locality=2)
                jk.prefetch(v_cache + nxt + h * D + n[:, None] * (KVH * D) + d[None, :], locality=2)
            _attend_block(qrow + h * G * q_hs, q_hs, k_cache + base + h * D, v_cache + base + h * D, KVH * D,
                          valid, st_m, st_l, st_acc, slot + h * G, scale, softcap, G, D, BS, w, SOFTCAP)
    orow = out + q0.to(jk.i64) * o_ts
    for h in range(h0, h0 + nh):
        o = _finish_state(st_m, st_l, st_acc, slot + h * G + gi, G, D, BS, jk.load(sinks + h * G + gi), SINKS)
        jk.store(orow + (h * G + gi[:, None]) * o_hs + d[None, :], o, mask=mine & (parts == 1))


@jk.kernel
def merge_kernel(out, st_m, st_l, st_acc, query_start, seq_lens, o_ts, o_hs, window, sinks, qx, xd, xs, xd4, xs4,
                 H: jk.constexpr, D: jk.constexpr, BS: jk.constexpr, NUM_PARTS: jk.constexpr,
                 PB: jk.constexpr, MAXP: jk.constexpr, SINKS: jk.constexpr, SKIP_IDLE: jk.constexpr = False,
                 Q8G: jk.constexpr = 0, REP4: jk.constexpr = False):
    """Program (sequence, query head): combines the partial states of a decode sequence split in 2+.
    SKIP_IDLE: a sequence of one partition (or none) returns at once instead of reading all NUM_PARTS states
    and storing nothing.
    Q8G > 0: the head's output (merged here, or the decode kernel's for one partition) is also written
    quantised for the next GGUF linear, as quantize_q8 of the (tokens, H * D) output would in the layout of
    group Q8G (quant.q8_store_blocks; qx .. xs4 its arrays, REP4 the 4-fold scales): that launch is saved."""
    seq = jk.program_id(0)
    hq = jk.program_id(1)
    q0 = jk.load(query_start + seq)
    seq_len = jk.load(seq_lens + seq)
    active = (jk.load(query_start + seq + 1) - q0 == 1) & (seq_len > 0)
    lo = jk.where(window > 0, jk.maximum(seq_len - window, 0), 0)
    nb = jk.where(active, (seq_len + BS - 1) // BS - lo // BS, 0)
    parts, per = _split(nb, PB, MAXP)
    if Q8G > 0:
        if active:
            if parts > 1:
                _merge_program(out, st_m, st_l, st_acc, sinks, o_ts, o_hs, q0, seq, hq, parts, H, D, BS, NUM_PARTS,
                               SINKS)
            # the f32 head output read back (this program's own store, or the decode kernel's for one part)
            o = jk.load(out + q0.to(jk.i64) * o_ts + hq * o_hs + jk.arange(0, D))
            blk = (hq * (D // 32)).to(jk.i64) + jk.arange(0, D // 32)
            q8_store_blocks(jk.reshape(o, (D // 32, 32)), qx, xd, xs, xd4, xs4, q0.to(jk.i64), H * D // 32, blk,
                            blk >= 0, D // 32, Q8G, REP4)
    elif SKIP_IDLE:
        if parts > 1:
            _merge_program(out, st_m, st_l, st_acc, sinks, o_ts, o_hs, q0, seq, hq, parts, H, D, BS, NUM_PARTS,
                           SINKS)
    else:
        _merge_program(out, st_m, st_l, st_acc, sinks, o_ts, o_hs, q0, seq, hq, parts, H, D, BS, NUM_PARTS, SINKS)


@jk.jit
def _merge_program(out, st_m, st_l, st_acc, sinks, o_ts, o_hs, q0, seq, hq, parts, H, D, BS, NUM_PARTS, SINKS):
    o = _merge_parts(st_m, st_l, st_acc, seq.to(jk.i64) * NUM_PARTS * H + hq, H, parts, NUM_PARTS, D, BS,
                     jk.load(sinks + hq), SINKS)
    jk.store(out + q0.to(jk.i64) * o_ts + hq * o_hs + jk.arange(0, D), o, mask=parts > 1)


@jk.jit
def _balanced_tile(p0, n0, BALANCE):
    """The query tile that program p0 of a prefill grid's n0 runs. BALANCE: tiles in the order 0, n0 - 1, 1,
    n0 - 2, ...: a causal prompt's tiles cost in proportion to their position, and the CPU pool gives each
    thread a contiguous range of flat program ids (p0 + n0 * KV head), which in grid order left the thread
    holding the last tiles with ~1.17x the other's work (2 threads, one long prompt); in this order every
    range pairs early tiles with late ones. A KV head's tiles stay together (they read the same cache
    blocks). Only which program runs a tile changes, never its arithmetic."""
    if BALANCE:
        half = p0 // 2
        return jk.where(p0 % 2 == 0, half, n0 - 1 - half)
    return p0


@jk.kernel(do_not_specialize=('num_seqs', 'search_steps'))
def prefill_kernel(q, k_cache, v_cache, out, st_m, st_l, st_acc, query_start, seq_lens, block_table,
                   num_seqs, search_steps, q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks, tq_ws,
                   KVH: jk.constexpr, G: jk.constexpr, D: jk.constexpr, BS: jk.constexpr, BQ: jk.constexpr,
                   PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr, SKIP_DECODE: jk.constexpr,
                   SINKS: jk.constexpr, TQ: jk.constexpr = 0, BALANCE: jk.constexpr = False,
                   MERGE: jk.constexpr = 0):
    """Program (query tile of BQ tokens of one sequence, KV head; the tiles dealt to the programs by
    _balanced_tile): each token of the tile attends, for the
    G query heads of the KV head, to the blocks of its causal (and window) range, split into partitions
    and merged exactly as a decode of the same position would be (bit-identical results whichever kernel
    or batch a token lands in); the K/V blocks a tile shares stay in cache from one token to the next.
    The softmax state goes through the st_* workspace (L1-resident): as loop-carried values, odd-sized
    state vectors compiled to much slower code.

    TQ > 0 (CPU tiers): TQ consecutive tokens whose positions share a cache block (so the same key range and
    partitions; no sliding window) go through the blocks together: their scores for a block come from
    _group_scores (tokens in the vector lanes, the same arithmetic per score), then each token's softmax
    update is _block_update as in the per-token step. tq_ws: per program (G, D, TQ) transposed q and (TQ, G,
    BS) scores; the state rows hold TQ tokens."""
    qb = _balanced_tile(jk.program_id(0), jk.num_programs(0), BALANCE)
    h = jk.program_id(1)
    w = _vec_width(D)
    seq, q0, q_len, seq_len, t0, n_rows, first_pos = _query_tile(query_start, seq_lens, num_seqs, search_steps,
                                                                 qb, BQ, SKIP_DECODE)

    d = jk.arange(0, D)
    n = jk.arange(0, BS)
    gi = jk.arange(0, G)
    bt_row = block_table + seq.to(jk.i64) * bt_stride
    TS = max(TQ, 1)                                 # token slots of state rows a program has
    # state rows: token slot u, partition p, head g at r0 + u * MAXP * G + p * G + g; with MERGE one more
    # row, pad, of -0.0 (the accumulator _merge_rows reads for partitions that do not exist)
    r0 = (qb * KVH + h).to(jk.i64) * (MAXP * G * TS + MERGE)
    pad = r0 + MAXP * G * TS
    if MERGE:
        jk.store(st_acc + pad * D + d, jk.full((D,), -0.0, jk.f32))
    if TQ > 0:
        _prefill_groups(q, k_cache, v_cache, out, st_m, st_l, st_acc, tq_ws, bt_row, q0, t0, n_rows, first_pos,
                        window, qb, h, r0, pad, q_ts, q_hs, o_ts, o_hs, scale, softcap, sinks,
                        KVH, G, D, BS, PB, MAXP, SOFTCAP, SINKS, TQ, w, MERGE)
    g_done = _grouped_rows(n_rows, window, BS, TQ, w)
    for t in range(g_done, n_rows):
        tok = (q0 + t0 + t).to(jk.i64)
        qpos = first_pos + t
        lo = jk.where(window > 0, jk.maximum(qpos - window + 1, 0), 0)
        start_blk = lo // BS
        nb = qpos // BS + 1 - start_blk
        parts, per = _split(nb, PB, MAXP)           # the same split as a decode of this position
        qrow = q + tok * q_ts + h * G * q_hs
        for p in range(0, parts):
            rp = r0 + p * G
            _init_state(st_m, st_l, st_acc, rp + gi, G, D, BS, True)
            b0 = start_blk + p * per
            for b in range(b0, jk.minimum(b0 + per, start_blk + nb)):
                base = jk.load(bt_row + b).to(jk.i64) * (BS * KVH * D) + h * D
                pos = b * BS + n
                _attend_block(qrow, q_hs, k_cache + base, v_cache + base, KVH * D, (pos <= qpos) & (pos >= lo),
                              st_m, st_l, st_acc, rp, scale, softcap, G, D, BS, w, SOFTCAP)
        orow = out + tok * o_ts + h * G * o_hs
        if parts == 1:
            jk.store(orow + gi[:, None] * o_hs + d[None, :], _finish_state(st_m, st_l, st_acc, r0 + gi, G, D, BS,
                                                                           jk.load(sinks + h * G + gi), SINKS))
        else:
            for g in range(0, G):      # a run-time loop: one copy of the (MAXP, D) merge code
                _merge_store(orow + g * o_hs, st_m, st_l, st_acc, r0 + g, G, parts, pad, MAXP, D, BS,
                             jk.load(sinks + h * G + g), SINKS, MERGE)


@jk.jit
def _grouped_rows(n_rows, window, BS, TQ, w):
    """How many of a tile's rows _prefill_groups handles: all of them, or none with a sliding window (each
    token's key range starts elsewhere), TQ = 0, or blocks narrower than a vector of keys."""
    if TQ == 0 or BS % w != 0:
        return n_rows * 0
    return jk.where(window == 0, n_rows, 0)


@jk.jit
def _prefill_groups(q, k_cache, v_cache, out, st_m, st_l, st_acc, tq_ws, bt_row, q0, t0, n_rows, first_pos,
                    window, qb, h, r0, pad, q_ts, q_hs, o_ts, o_hs, scale, softcap, sinks,
                    KVH, G, D, BS, PB, MAXP, SOFTCAP, SINKS, TQ, w, MERGE):
    """prefill_kernel's token groups (see its TQ): the tile's rows in groups of at most TQ consecutive tokens
    whose positions lie in one cache block (a tile starting mid-block has one more group), so a group's
    tokens attend to the same blocks 0 .. position // BS with the same partitions, the last block masked per
    token. A block's K is transposed and its V converted to f32 once for the group (tq_ws: this program's
    scratch); each token's scores come from _lane_scores into its state's l rows (as _attend_block stores
    them) and its softmax update from _block_update_chunks: both the per-token step's bits."""
    d = jk.arange(0, D)
    n = jk.arange(0, BS)
    gi = jk.arange(0, G)
    # this program's scratch: K^T and V as f32, the probabilities and alphas, the score chains
    kt = tq_ws + (qb * KVH + h).to(jk.i64) * (2 * D * BS + G * BS + G + G * w * BS)
    vf = kt + D * BS
    ps = vf + D * BS
    part = ps + G * BS + G
    rows = _grouped_rows(n_rows, window, BS, TQ, w)
    fb = first_pos // BS
    nblk = jk.where(rows > 0, (first_pos + rows - 1) // BS - fb + 1, 0)
    for kb in range(0, nblk):
        r_lo = jk.maximum((fb + kb) * BS, first_pos) - first_pos      # the block's rows of the tile
        r_hi = jk.minimum((fb + kb + 1) * BS, first_pos + rows) - first_pos
        nb = fb + kb + 1
        parts, per = _split(nb, PB, MAXP)
        for sg in range(0, (r_hi - r_lo + TQ - 1) // TQ):
            s0 = r_lo + sg * TQ                         # the group's first row within the tile
            gsz = jk.minimum(TQ, r_hi - s0)
            qpos0 = first_pos + s0
            for p in range(0, parts):
                for u in range(0, gsz):
                    _init_state(st_m, st_l, st_acc, r0 + u * (MAXP * G) + p * G + gi, G, D, BS, True)
                b0 = p * per
                for b in range(b0, jk.minimum(b0 + per, nb)):
                    base = jk.load(bt_row + b).to(jk.i64) * (BS * KVH * D) + h * D
                    pos = b * BS + n
                    _transpose_block(k_cache + base, KVH * D, kt, D, BS, w)
                    jk.store(vf + n[:, None] * D + d[None, :],
                             jk.load(v_cache + base + n[:, None] * (KVH * D) + d[None, :]).to(jk.f32))
                    for u in range(0, gsz):
                        rp = r0 + u * (MAXP * G) + p * G
                        qrow = q + (q0 + t0 + s0 + u).to(jk.i64) * q_ts + h * G * q_hs
                        l_i = jk.load(st_l + (rp + gi)[:, None] * BS + n[None, :])
                        _lane_scores(qrow, q_hs, kt, st_l + rp * BS, part, G, D, BS, w)
                        _block_update_chunks(jk.load(st_l + (rp + gi)[:, None] * BS + n[None, :]), l_i, vf, ps,
                                             pos <= qpos0 + u, st_m, st_l, st_acc, rp, scale, softcap, G, D, BS,
                                             w, SOFTCAP)
            for u in range(0, gsz):
                ru = r0 + u * (MAXP * G)
                orow = out + (q0 + t0 + s0 + u).to(jk.i64) * o_ts + h * G * o_hs
                if parts == 1:
                    jk.store(orow + gi[:, None] * o_hs + d[None, :],
                             _finish_state(st_m, st_l, st_acc, ru + gi, G, D, BS, jk.load(sinks + h * G + gi),
                                           SINKS))
                else:
                    for g in range(0, G):
                        _merge_store(orow + g * o_hs, st_m, st_l, st_acc, ru + g, G, parts, pad, MAXP, D, BS,
                                     jk.load(sinks + h * G + g), SINKS, MERGE)


@jk.kernel(do_not_specialize=('num_seqs', 'search_steps'))
def token_attention_kernel(q, k_cache, v_cache, out, query_start, seq_lens, block_table, num_seqs, search_steps,
                           q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                           KVH: jk.constexpr, G: jk.constexpr, D: jk.constexpr, BS: jk.constexpr,
                           SOFTCAP: jk.constexpr, SINKS: jk.constexpr):
    """Program (query token, KV head): the token's G query heads over its whole key range, one cache block
    per loop step (scores and P @ V as `dot`s), the softmax state (G maxima, G sums, (G, D) accumulator)
    carried through the loop; decodes and prefill tokens alike, no partitions, no workspace. The Vulkan
    path (see `_vulkan_attention`): the decode/prefill kernels' 150+ barriers make Mesa's lavapipe (which
    compiles a compute shader into an LLVM coroutine, one suspend point per barrier) spend minutes
    compiling them; this one has a couple of dozen. A token's arithmetic depends only on its own position,
    window and the cache (batch invariant)."""
    tok = jk.program_id(0)
    kvh = jk.program_id(1)
    seq = _owner_seq(query_start, num_seqs, search_steps, tok, 1, False)       # the sequence owning token tok
    q0 = jk.load(query_start + seq)
    q_len = jk.load(query_start + seq + 1) - q0
    seq_len = jk.load(seq_lens + seq)
    active = (tok >= q0) & (tok < q0 + q_len)
    qpos = seq_len - q_len + (tok - q0)
    lo = jk.where(window > 0, jk.maximum(qpos - window + 1, 0), 0)
    b_lo = lo // BS
    b_hi = jk.where(active, qpos // BS + 1, b_lo)

    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    gi = jk.arange(0, G)
    qrows = tok.to(jk.i64) * q_ts + (kvh * G + gi[:, None]) * q_hs + d[None, :]
    qt = jk.load(q + qrows)
    kv_off = n[:, None] * (KVH * D) + d[None, :]
    bt_row = block_table + seq.to(jk.i64) * bt_stride
    m = jk.full((G,), NEG, jk.f32)
    l = jk.zeros((G,), jk.f32)
    acc = jk.zeros((G, D), jk.f32)
    for b in range(b_lo, b_hi):
        base = jk.load(bt_row + b).to(jk.i64) * (BS * KVH * D) + kvh * D
        pos = b * BS + n
        valid = ((pos <= qpos) & (pos >= lo))[None, :]
        s = jk.dot(qt, jk.trans(jk.load(k_cache + base + kv_off).to(jk.f32))) * scale
        if SOFTCAP:
            s = softcap * jk.tanh(s / softcap)
        s = jk.where(valid, s, NEG)
        m_new = jk.maximum(m, jk.max(s, axis=1))
        alpha = jk.exp(m - m_new)
        p = jk.where(valid, jk.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + jk.sum(p, axis=1)
        acc = jk.dot(p, jk.load(v_cache + base + kv_off).to(jk.f32), acc * alpha[:, None])
        m = m_new
    orows = tok.to(jk.i64) * o_ts + (kvh * G + gi[:, None]) * o_hs + d[None, :]
    if SINKS:
        l = l + jk.exp(jk.load(sinks + kvh * G + gi) - m)
    jk.store(out + orows, acc / l[:, None], mask=active)


# ------------------------------------------------------------------------------ GPU flash attention
# Decode (flash-decoding) and prefill/mixed (flash attention) kernels for GPUs. Both run every cache block
# through the same step (_flash_step: scores and P @ V as `dot`s, so on NVIDIA/AMD they run on the matrix
# units, online softmax in f32) and split a query's key range into the same partitions (_split of the
# query's own range, tuning.flash_partition_blocks blocks each) merged by the same fold in partition order: a token's
# output is bit-identical whether it is a decode (flash_decode_kernel + flash_merge_kernel) or a row of a
# prefill tile (flash_prefill_kernel), and whatever the batch or the chunking of its prompt.
@jk.jit
def _mm_qk(qt, kt, SPLIT):
    """(R, BS) scores q @ k^T of an f32 (R, D) query tile and a (BS, D) cache tile (f32 or f16). SPLIT (f32
    cache on a GPU with matrix units): K as f16 hi + lo, two dots whose 16-bit B runs on the matrix units
    (the lowering splits the f32 A into f16 hi + lo in turn): ~22 significant bits of each operand (f16
    rather than bf16 parts: 11 bits each instead of 8; K, V and q must fit f16's range, as in an f16 cache,
    and parts below 2^-14 keep an absolute precision of 2^-24)."""
    if SPLIT:
        kh = kt.to(jk.f16)
        kl = (kt - kh.to(jk.f32)).to(jk.f16)
        return jk.dot(qt, jk.trans(kl), jk.dot(qt, jk.trans(kh)))
    return jk.dot(qt, jk.trans(kt))


@jk.jit
def _mm_pv(p, vt, acc, SPLIT):
    """acc + p @ v for (R, BS) probabilities and a (BS, D) cache tile (V split as K is in _mm_qk)."""
    if SPLIT:
        vh = vt.to(jk.f16)
        vl = (vt - vh.to(jk.f32)).to(jk.f16)
        return jk.dot(p, vl, jk.dot(p, vh, acc))
    return jk.dot(p, vt, acc)


@jk.jit
def _flash_step(qt, kt, vt, valid, m, l, acc, scale, softcap, SOFTCAP, SPLIT, OPS16=False):
    """One online-softmax step of the (R, D) query rows against one cache block; valid: (1 or R, BS) keys
    each row may see. A block a row may not see at all leaves its state exactly as it was (alpha is 1, not
    exp(0), and p is 0), so tiles that cover more keys than a row needs give that row the same bits.
    OPS16 (GPU_FLASH_OPERANDS = "16bit"): the probabilities enter P @ V as f16 (the kernels round q to f16
    once), so each dot is one MMA chain per cache part instead of hi + lo (as FlashAttention computes).
    Exponentials by jk.exp_fast (NVIDIA: ex2.approx, the target's tuning.fast_exp; elsewhere exp): every flash kernel
    takes the same, so decode and prefill still agree bit for bit."""
    s = _mm_qk(qt, kt, SPLIT) * scale
    if SOFTCAP:
        s = softcap * jk.tanh(s / softcap)
    s = jk.where(valid, s, NEG)
    m_new = jk.maximum(m, jk.max(s, axis=1))
    alpha = jk.where(m_new == m, 1.0, jk.exp_fast(m - m_new))
    p = jk.where(valid, jk.exp_fast(s - m_new[:, None]), 0.0)
    l = l * alpha + jk.sum(p, axis=1)
    acc = _mm_pv(p.to(jk.f16) if OPS16 else p, vt, acc * alpha[:, None], SPLIT)
    return m_new, l, acc


@jk.jit
def _kv_tiles(k_cache, v_cache, bt_row, b, kv_off, kvh, ok, KVH, D, BS):
    """The (BS, D) K and V tiles of KV head kvh in the sequence's block b (loads masked off unless ok: b may
    then lie past the block table, so column 0 is read instead)."""
    base = jk.load(bt_row + jk.where(ok, b, 0)).to(jk.i64) * (BS * KVH * D) + kvh * D
    return (jk.load(k_cache + base + kv_off, mask=ok, other=0.0),
            jk.load(v_cache + base + kv_off, mask=ok, other=0.0))


@jk.jit
def _kv_offsets(n, d, KVH, D, BS, SB):
    """Element offsets of a step's (SB * BS, D) K / V tile inside its cache blocks (key n sits at row n % BS of
    block n // BS of the step)."""
    if SB == 1:
        return n[:, None] * (KVH * D) + d[None, :]
    return (n % BS)[:, None] * (KVH * D) + d[None, :]


@jk.jit
def _kv_step(k_cache, v_cache, bt_row, b, hi, kv_off, n, kvh, ok, KVH, D, BS, SB):
    """The (SB * BS, D) K and V tiles of the online-softmax step at block b: the sequence's blocks b .. b + SB - 1,
    those at or past hi (all of them unless ok) masked off, the block table's column 0 read in their place."""
    if SB == 1:
        return _kv_tiles(k_cache, v_cache, bt_row, b, kv_off, kvh, ok, KVH, D, BS)
    blk = b + n // BS
    live = ok & (blk < hi)
    # the step's SB block ids as scalar loads, picked per key row: index math on uniform values, which GPUs
    # recompute in the tile's layout (a loaded (SB * BS,) vector would be broadcast through shared memory)
    ids = jk.zeros((SB * BS,), jk.i32)
    for j in jk.static_range(SB):
        ids = jk.where(n // BS == j, jk.load(bt_row + jk.where(ok & (b + j < hi), b + j, 0)), ids)
    at = (ids.to(jk.i64) * (BS * KVH * D) + kvh * D)[:, None] + kv_off
    return (jk.load(k_cache + at, mask=live[:, None], other=0.0),
            jk.load(v_cache + at, mask=live[:, None], other=0.0))


@jk.jit
def _next_step(b, lo, hi, SB):
    """The block whose step the pipelined loads fetch during the step at b (steps of SB blocks from lo up to hi):
    the next step's, or at the last step its own again."""
    if SB == 1:
        return jk.minimum(b + 1, hi - 1)
    return jk.minimum(b + SB, hi - 1 - (hi - 1 - lo) % SB)


@jk.jit
def _flash_fold(M, L, ACC, m, l, acc):
    """The merged state (M, L, ACC) with one more partition's state (m, l, acc) folded in. Folding the first
    partition into the empty state (NEG, 0, 0) returns that partition's state exactly."""
    M2 = jk.maximum(M, m)
    a = jk.where(M2 == M, 1.0, jk.exp_fast(M - M2))
    b = jk.where(M2 == m, 1.0, jk.exp_fast(m - M2))
    return M2, L * a + l * b, ACC * a[:, None] + acc * b[:, None]


@jk.jit
def _flash_out(M, L, ACC, sink, SINKS):
    if SINKS:
        L = L + jk.exp_fast(sink - M)
    return ACC / L[:, None]


@jk.kernel
def flash_decode_kernel(q, k_cache, v_cache, out, ws_m, ws_l, ws_acc, query_start, seq_lens, block_table,
                        q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                        KVH: jk.constexpr, G: jk.constexpr, R: jk.constexpr, D: jk.constexpr, BS: jk.constexpr,
                        NUM_PARTS: jk.constexpr, PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr,
                        SINKS: jk.constexpr, SPLIT: jk.constexpr, PIPE: jk.constexpr = False,
                        OPS16: jk.constexpr = False, SB: jk.constexpr = 1):
    """Program (sequence, KV head, partition) of a q_len == 1 sequence: the G query heads of the KV head (R
    rows, padded to the matrix units' 16) over one partition of the key range, so K and V are read once
    for the group. The sequence's own length decides its partitions (_split); programs past them exit. A
    single-partition sequence writes its output here; otherwise the partition's (m, l, acc) go to the
    workspace for flash_merge_kernel. SB: cache blocks per online-softmax step (tuning.flash_step_blocks; the prefill
    kernel steps alike, so a token's bits agree; 1 with a sliding window)."""
    seq = jk.program_id(0)
    kvh = jk.program_id(1)
    part = jk.program_id(2)
    q0 = jk.load(query_start + seq)
    q_len = jk.load(query_start + seq + 1) - q0
    seq_len = jk.load(seq_lens + seq)
    active = (q_len == 1) & (seq_len > 0)
    qpos = seq_len - 1
    lo = jk.where(window > 0, jk.maximum(qpos - window + 1, 0), 0)
    start_blk = lo // BS
    nb = jk.where(active, (seq_len + BS - 1) // BS - start_blk, 0)
    parts, per = _split(nb, PB, MAXP, SB)
    mine = part < parts
    b0 = start_blk + part * per
    b1 = jk.where(mine, jk.minimum(b0 + per, start_blk + nb), b0)

    # programs past the sequence's partitions (most of the grid at short contexts) exit at once
    if mine:
        g = jk.arange(0, R)
        d = jk.arange(0, D)
        n = jk.arange(0, SB * BS)
        gm = (g < G) & mine
        tok = jk.maximum(q0, 0).to(jk.i64)
        qt = jk.load(q + tok * q_ts + (kvh * G + g[:, None]) * q_hs + d[None, :], mask=gm[:, None], other=0.0)
        if OPS16:
            qt = qt.to(jk.f16)
        kv_off = _kv_offsets(n, d, KVH, D, BS, SB)
        bt_row = block_table + seq.to(jk.i64) * bt_stride
        m = jk.full((R,), NEG, jk.f32)
        l = jk.zeros((R,), jk.f32)
        acc = jk.zeros((R, D), jk.f32)
        if PIPE:
            # software pipelining: the next step's K/V loads are issued before this step runs (the last step
            # reloads its own blocks), so they are in flight during its dots and barriers
            kt, vt = _kv_step(k_cache, v_cache, bt_row, b0, b1, kv_off, n, kvh, b0 < b1, KVH, D, BS, SB)
        for b in range(b0, b1, SB):
            if PIPE:
                kn, vn = _kv_step(k_cache, v_cache, bt_row, _next_step(b, b0, b1, SB), b1, kv_off, n, kvh, True,
                                  KVH, D, BS, SB)
            else:
                kt, vt = _kv_step(k_cache, v_cache, bt_row, b, b1, kv_off, n, kvh, True, KVH, D, BS, SB)
            pos = b * BS + n
            valid = ((pos < seq_len) & (pos >= lo))[None, :]
            m, l, acc = _flash_step(qt, kt, vt, valid, m, l, acc, scale, softcap, SOFTCAP, SPLIT, OPS16)
            if PIPE:
                kt = kn
                vt = vn
        single = parts == 1
        M, L, ACC = _flash_fold(jk.full((R,), NEG, jk.f32), jk.zeros((R,), jk.f32), jk.zeros((R, D), jk.f32), m, l, acc)
        o = _flash_out(M, L, ACC, jk.load(sinks + kvh * G + g, mask=g < G, other=0.0) if SINKS else 0.0, SINKS)
        jk.store(out + tok * o_ts + (kvh * G + g[:, None]) * o_hs + d[None, :], o, mask=(gm & single)[:, None])
        rows = ((seq * KVH + kvh) * NUM_PARTS + part).to(jk.i64) * G + g
        keep = gm & (parts > 1)
        jk.store(ws_m + rows, m, mask=keep)
        jk.store(ws_l + rows, l, mask=keep)
        jk.store(ws_acc + rows[:, None] * D + d[None, :], acc, mask=keep[:, None])


@jk.kernel
def flash_merge_kernel(out, ws_m, ws_l, ws_acc, query_start, seq_lens, o_ts, o_hs, window, sinks, qx, xd, xs, xd4,
                       xs4, KVH: jk.constexpr, G: jk.constexpr, GP: jk.constexpr, D: jk.constexpr, BS: jk.constexpr,
                       NUM_PARTS: jk.constexpr, PB: jk.constexpr, MAXP: jk.constexpr, SINKS: jk.constexpr,
                       SB: jk.constexpr = 1, Q8G: jk.constexpr = 0, REP4: jk.constexpr = False):
    """Program (sequence, KV head): folds the partition states of a decode split in 2+, in partition order.
    Q8G > 0: the group's head outputs are also written quantised for the next GGUF linear (as merge_kernel's
    Q8G: quantize_q8's layout of group Q8G and its bits; qx .. xs4 its arrays)."""
    seq = jk.program_id(0)
    kvh = jk.program_id(1)
    q0 = jk.load(query_start + seq)
    seq_len = jk.load(seq_lens + seq)
    active = (jk.load(query_start + seq + 1) - q0 == 1) & (seq_len > 0)
    lo = jk.where(window > 0, jk.maximum(seq_len - window, 0), 0)
    nb = jk.where(active, (seq_len + BS - 1) // BS - lo // BS, 0)
    parts, per = _split(nb, PB, MAXP, SB)
    if parts > 1:
        g = jk.arange(0, GP)
        d = jk.arange(0, D)
        gm = g < G
        M = jk.full((GP,), NEG, jk.f32)
        L = jk.zeros((GP,), jk.f32)
        ACC = jk.zeros((GP, D), jk.f32)
        row0 = (seq * KVH + kvh).to(jk.i64) * (NUM_PARTS * G)
        for p in range(0, jk.where(parts > 1, parts, 0)):
            rows = row0 + p * G + g
            M, L, ACC = _flash_fold(M, L, ACC, jk.load(ws_m + rows, mask=gm, other=NEG),
                                    jk.load(ws_l + rows, mask=gm, other=0.0),
                                    jk.load(ws_acc + rows[:, None] * D + d[None, :], mask=gm[:, None], other=0.0))
        o = _flash_out(M, L, ACC, jk.load(sinks + kvh * G + g, mask=gm, other=0.0) if SINKS else 0.0, SINKS)
        jk.store(out + jk.maximum(q0, 0).to(jk.i64) * o_ts + (kvh * G + g[:, None]) * o_hs + d[None, :], o,
                 mask=(gm & (parts > 1))[:, None])
    if Q8G > 0:
        # the group's head outputs read back as 32-blocks: this program's stores above (other threads of the
        # CTA wrote them: the barrier orders those stores before these loads) or, for one partition, the decode
        # kernel's; rows of heads one after another (o_hs = D, checked by the caller)
        jk.barrier()
        if active:
            idx = jk.arange(0, GP * (D // 32))
            ok = idx // (D // 32) < G
            blk = (kvh * G).to(jk.i64) * (D // 32) + idx
            v = jk.load(out + q0.to(jk.i64) * o_ts + blk[:, None] * 32 + jk.arange(0, 32)[None, :], mask=ok[:, None],
                        other=0.0)
            q8_store_blocks(v, qx, xd, xs, xd4, xs4, q0.to(jk.i64), KVH * G * D // 32, blk, ok, GP * (D // 32), Q8G,
                            REP4)


@jk.kernel(do_not_specialize=('num_seqs', 'search_steps'))
def flash_prefill_kernel(q, k_cache, v_cache, out, query_start, seq_lens, block_table, num_seqs, search_steps,
                         q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                         KVH: jk.constexpr, G: jk.constexpr, GP: jk.constexpr, BM: jk.constexpr, D: jk.constexpr,
                         BS: jk.constexpr, PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr,
                         SKIP_DECODE: jk.constexpr, SINKS: jk.constexpr, SPLIT: jk.constexpr,
                         PIPE: jk.constexpr = False, OPS16: jk.constexpr = False, FOLD_SKIP: jk.constexpr = False,
                         LONGEST_FIRST: jk.constexpr = False, SB: jk.constexpr = 1):
    """Program (tile of BM query tokens of one sequence, KV head): BM x GP rows (the tile's tokens times the
    G query heads of the KV head, padded to a power of two) against the cache blocks of the tile's causal
    (and window) range, one block per step. Each row keeps a partition state and a merged state: when a
    block starts a new partition of that row's own range (the split a decode at its position uses), the
    partition is folded in, as flash_merge_kernel does, so a row's bits equal a decode's at its position.
    The tile's sequence is found by a binary search over query_start (grid: num_tokens // BM + num_seqs).
    FOLD_SKIP (tuning.flash_fold_skip): the fold runs only in blocks where some row of the tile starts a partition
    (_tile_folds, a scalar test); elsewhere it would leave every row's state as it was, so the bits are the same.
    Grid (tiles, KV heads); LONGEST_FIRST (tuning.flash_longest_first): grid (KV heads, tiles), the tiles in reverse.
    GPUs start programs in grid order, x fastest, so the longest tiles (a causal prompt's last, which cover the most
    blocks) start first, each with all its KV heads, and the short ones fill in behind them (longest-first list
    scheduling: a 1,024-token prompt's 520 programs on 132 SMs take ~1.3x fewer step-waves than in tile order, by
    a count of steps). Which program runs a tile never changes its bits. SB: cache blocks per online-softmax step,
    as in flash_decode_kernel (> 1 only without a sliding window: every row's range then starts at block 0, so
    the steps and the partitions, whole steps, line up for all the tile's rows)."""
    if LONGEST_FIRST:
        kvh = jk.program_id(0)
        qb = jk.num_programs(1) - 1 - jk.program_id(1)
    else:
        qb = jk.program_id(0)
        kvh = jk.program_id(1)
    seq, q0, q_len, seq_len, t0, n_rows, first_pos = _query_tile(query_start, seq_lens, num_seqs, search_steps,
                                                                 qb, BM, SKIP_DECODE)

    # tiles past their sequence's tokens (and decodes, with SKIP_DECODE) exit at once
    if n_rows > 0:
        R = BM * GP
        t = jk.arange(0, BM)
        g = jk.arange(0, GP)
        d = jk.arange(0, D)
        n = jk.arange(0, SB * BS)
        tm = t < n_rows
        gm = g < G
        toks = (q0 + t0 + t).to(jk.i64)
        q3 = jk.load(q + toks[:, None, None] * q_ts + (kvh * G + g)[None, :, None] * q_hs + d[None, None, :],
                     mask=(tm[:, None] & gm[None, :])[:, :, None], other=0.0)
        qt = jk.reshape(q3, (R, D))
        if OPS16:
            qt = qt.to(jk.f16)
        # per row: its position, key range (start block, blocks) and partition split
        r = jk.arange(0, R)
        qpos = first_pos + r // GP
        lo = jk.where(window > 0, jk.maximum(qpos - window + 1, 0), 0)
        start = lo // BS
        nb = qpos // BS + 1 - start
        parts, per = _split(nb, PB, MAXP, SB)
        # the tile's blocks: from its first row's start to its last row's end
        b_lo = jk.where(window > 0, jk.maximum(first_pos - window + 1, 0), 0) // BS
        b_hi = jk.where(n_rows > 0, (first_pos + n_rows - 1) // BS + 1, b_lo)

        kv_off = _kv_offsets(n, d, KVH, D, BS, SB)
        bt_row = block_table + seq.to(jk.i64) * bt_stride
        m = jk.full((R,), NEG, jk.f32)
        l = jk.zeros((R,), jk.f32)
        acc = jk.zeros((R, D), jk.f32)
        M = jk.full((R,), NEG, jk.f32)
        L = jk.zeros((R,), jk.f32)
        ACC = jk.zeros((R, D), jk.f32)
        if PIPE:
            kt, vt = _kv_step(k_cache, v_cache, bt_row, b_lo, b_hi, kv_off, n, kvh, b_lo < b_hi, KVH, D, BS, SB)
        for b in range(b_lo, b_hi, SB):
            if PIPE:
                kn, vn = _kv_step(k_cache, v_cache, bt_row, _next_step(b, b_lo, b_hi, SB), b_hi, kv_off, n, kvh,
                                  True, KVH, D, BS, SB)
            else:
                kt, vt = _kv_step(k_cache, v_cache, bt_row, b, b_hi, kv_off, n, kvh, True, KVH, D, BS, SB)
            rel = b - start
            f = (rel > 0) & (rel < nb) & (rel % per == 0)
            if FOLD_SKIP:
                if _tile_folds(b, first_pos, n_rows, window, BS, BM, PB, MAXP, SB):
                    M, L, ACC, m, l, acc = _fold_rows(f, M, L, ACC, m, l, acc)
            else:
                M, L, ACC, m, l, acc = _fold_rows(f, M, L, ACC, m, l, acc)
            pos = b * BS + n
            valid = (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= lo[:, None])
            m, l, acc = _flash_step(qt, kt, vt, valid, m, l, acc, scale, softcap, SOFTCAP, SPLIT, OPS16)
            if PIPE:
                kt = kn
                vt = vn
        M, L, ACC = _flash_fold(M, L, ACC, m, l, acc)
        o = _flash_out(M, L, ACC, jk.load(sinks + kvh * G + r % GP, mask=(r % GP) < G, other=0.0) if SINKS else 0.0,
                       SINKS)
        jk.store(out + toks[:, None, None] * o_ts + (kvh * G + g)[None, :, None] * o_hs + d[None, None, :],
                 jk.reshape(o, (BM, GP, D)), mask=(tm[:, None] & gm[None, :])[:, :, None])


@jk.jit
def _fold_rows(f, M, L, ACC, m, l, acc):
    """The rows where f holds fold their partition state (m, l, acc) into the merged one (M, L, ACC) and start
    a new partition; the other rows keep both exactly as they were."""
    M2, L2, ACC2 = _flash_fold(M, L, ACC, m, l, acc)
    return (jk.where(f, M2, M), jk.where(f, L2, L), jk.where(f[:, None], ACC2, ACC),
            jk.where(f, NEG, m), jk.where(f, 0.0, l), jk.where(f[:, None], 0.0, acc))


@jk.jit
def _tile_folds(b, first_pos, n_rows, window, BS, BM, PB, MAXP, SB=1):
    """Whether block b starts a new partition (_split of the row's own range) for some row of a prefill tile whose
    tokens sit at positions first_pos .. first_pos + n_rows - 1: a scalar, from the few key-range lengths those
    positions have (at most BM // BS + 2). With a window the ranges start at different blocks: always true."""
    nb_lo = first_pos // BS + 1
    nb_hi = (first_pos + n_rows - 1) // BS + 1
    hit = window > 0
    for i in jk.static_range(BM // BS + 2):
        nbc = nb_lo + i
        parts, per = _split(nbc, PB, MAXP, SB)
        hit = hit | ((nbc <= nb_hi) & (b > 0) & (b < nbc) & (b % per == 0))
    return hit


# ------------------------------------------------------------------------------------- host wrappers
def _i32(a, what, ndim=1):
    if not is_array(a):
        raise TypeError(f"{what}: expected a numpy int32 array, got {type(a).__name__}")
    if a.dtype != np.int32:
        raise TypeError(f"{what}: expected dtype int32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D array, got shape {a.shape}")
    if ndim == 1 and a.size > 1 and a.strides[0] != 4:
        raise ValueError(f"{what}: must be contiguous (strides {a.strides})")
    return a


def _check_cache(k_cache, v_cache):
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not is_array(c):
            raise TypeError(f"{name}: expected a numpy array, got {type(c).__name__}")
        if c.ndim != 4:
            raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_dim], got shape {c.shape}")
        if c.dtype not in (np.float32, np.float16):
            raise TypeError(f"{name}: dtype {c.dtype} is not supported (float32 or float16)")
        if not c.flags.c_contiguous:
            raise ValueError(f"{name}: the cache must be C-contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype} differ")
    return k_cache.shape[1:]


def _bf16_arg(a):
    """A uint16 array (bf16 storage) as the kernels' bf16 pointer."""
    from jitkern.ir import bf16
    from jitkern.jit import Pointer, as_pointer
    if is_device(a):
        return as_pointer(a, bf16)
    return Pointer(a.__array_interface__["data"][0], bf16, a)


def _f32_out_only(st, path: str) -> None:
    if st.out16:
        raise ValueError(f"out: a 16-bit output (uint16 = bf16, float16) is written by the flash kernels only; the "
                         f"{path} path needs a float32 out")


def _heads_view(a, what, heads, head_dim, dtype=np.float32):
    """(token stride, head stride) in elements of a [T, heads, head_dim] array (or [T, heads*head_dim])."""
    if not is_array(a):
        raise TypeError(f"{what}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{what}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if a.ndim == 2 and a.shape[1] == heads * head_dim:
        ts, _ = elem_strides(a, what)
        return ts, head_dim
    if a.ndim != 3 or a.shape[1:] != (heads, head_dim):
        raise ValueError(f"{what}: expected shape [num_tokens, {heads}, {head_dim}], got {a.shape}")
    ts, hs, _ = elem_strides(a, what)
    return ts, hs


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, *, target=None) -> None:
    """Writes k, v [num_tokens, num_kv_heads, head_dim] (f32, strided rows ok) into the paged caches at
    slot_mapping[i] (int32; -1 skips the token). f16 caches get the values rounded to nearest even."""
    target = resolve_target(target, k_cache)
    bs, kvh, dim = _check_cache(k_cache, v_cache)
    slot_mapping = _i32(slot_mapping, "slot_mapping")
    T = slot_mapping.shape[0]
    k_ts, k_hs = _heads_view(k, "k", kvh, dim)
    v_ts, v_hs = _heads_view(v, "v", kvh, dim)
    if k.shape[0] != T or v.shape[0] != T:
        raise ValueError(f"k has {k.shape[0]} tokens, v {v.shape[0]}, slot_mapping {T}")
    run(reshape_and_cache_kernel, (T,), (k, v, k_cache, v_cache, slot_mapping, k_ts, k_hs, v_ts, v_hs),
        target=target, KVH=kvh, D=dim)


def decode_partitions(seq_lens, block_size: int = 16, sliding_window: int = 0,
                      partition_blocks: int = PARTITION_BLOCKS) -> np.ndarray:
    """Each sequence's own decode partition count (int array): its key range in blocks (the last
    sliding_window positions, or all of them) split into partition_blocks-block partitions (the CPU
    kernels' PARTITION_BLOCKS, or tuning.flash_partition_blocks for the GPU flash kernels), at most MAX_PARTITIONS.
    The kernels compute the same numbers from seq_lens; a launch needs a partition axis at least as long
    as the largest one."""
    seq_lens = np.asarray(seq_lens, np.int64)
    lo = np.maximum(seq_lens - sliding_window, 0) if sliding_window > 0 else np.zeros_like(seq_lens)
    nb = np.where(seq_lens > 0, -(-seq_lens // block_size) - lo // block_size, 0)
    return np.minimum(-(-nb // partition_blocks), MAX_PARTITIONS)


PREFILL_BLOCK_Q = 16     # query tokens per prefill program (per KV head)


class _Step:
    """The checked arguments of one attention call (shapes, strides, step arrays)."""

    def __init__(self, q, k_cache, v_cache, query_start, seq_lens, block_table, out, scale, sliding_window,
                 softcap, validate, host_step=None, sinks=None):
        self.bs, self.kvh, self.dim = _check_cache(k_cache, v_cache)
        if self.bs & (self.bs - 1):
            raise ValueError(f"k_cache: block_size {self.bs} must be a power of two")
        self.query_start = _i32(query_start, "query_start")
        self.seq_lens = _i32(seq_lens, "seq_lens")
        self.block_table = _i32(block_table, "block_table", 2)
        self.num_seqs = self.seq_lens.shape[0]
        # host values of query_start / seq_lens for the host-side reads (device arrays: the caller's host
        # copies in host_step, else a download)
        hq, hs = host_step if host_step is not None else (None, None)
        self.qs_host = host_copy(self.query_start, hq)
        self.sl_host = host_copy(self.seq_lens, hs)
        if self.query_start.shape[0] != self.num_seqs + 1:
            raise ValueError(f"query_start: expected {self.num_seqs + 1} entries (num_seqs + 1), "
                             f"got {self.query_start.shape[0]}")
        if self.block_table.shape[0] != self.num_seqs:
            raise ValueError(f"block_table: expected {self.num_seqs} rows, got {self.block_table.shape[0]}")
        if self.block_table.shape[1] > 1 and self.block_table.strides[1] != 4:
            raise ValueError("block_table: rows must be contiguous")
        self.bt_stride = self.block_table.strides[0] // 4
        if not is_array(q) or q.ndim not in (2, 3):
            raise ValueError("q: expected a [num_tokens, num_heads, head_dim] float32 array")
        self.T = q.shape[0]
        self.heads = q.shape[1] if q.ndim == 3 else q.shape[1] // self.dim
        if self.heads == 0 or self.heads % self.kvh:
            raise ValueError(f"num_heads {self.heads} is not a multiple of num_kv_heads {self.kvh}")
        self.G = self.heads // self.kvh
        self.q_ts, self.q_hs = _heads_view(q, "q", self.heads, self.dim)
        self.out = empty_like_dev(q, (self.T, self.heads, self.dim), np.float32) if out is None else out
        # a 16-bit out (uint16 storage = bf16, or float16): the flash kernels store their f32 results rounded to
        # nearest even, the bits a 16-bit consumer (the o projection's tensor-core linear) would round them to
        odt = getattr(self.out, "dtype", None)
        self.out16 = odt in (np.uint16, np.float16)
        self.o_ts, self.o_hs = _heads_view(self.out, "out", self.heads, self.dim,
                                           dtype=odt if self.out16 else np.float32)
        self.out_arg = _bf16_arg(self.out) if odt == np.uint16 else self.out
        if self.out.shape[0] != self.T:
            raise ValueError(f"out: expected {self.T} tokens, got {self.out.shape[0]}")
        self.scale, self.window, softcap = float(scale), int(sliding_window), float(softcap)
        if softcap < 0 or self.window < 0:
            raise ValueError(f"softcap ({softcap}) and sliding_window ({self.window}) must be >= 0")
        self.use_cap = softcap > 0.0
        self.cap = softcap if self.use_cap else 1.0
        # attention sinks: f32 [num_heads] (the kernels read a dummy row of `out` when there are none)
        self.use_sinks = sinks is not None
        if self.use_sinks and (not is_array(sinks) or sinks.dtype != np.float32 or sinks.shape != (self.heads,)
                               or (self.heads > 1 and sinks.strides[0] != 4)):
            raise ValueError(f"sinks: expected a contiguous float32 array of shape ({self.heads},) (one per query "
                             f"head), got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                             f"{getattr(sinks, 'shape', '')}")
        self.sinks = sinks if self.use_sinks else (q if self.out16 else self.out)
        self.empty = self.num_seqs == 0 or self.T == 0
        if validate and not self.empty:
            _validate_step(self.qs_host, self.sl_host, self.block_table, self.T, self.bs)


def _workspace(ws: dict, key: str, rows: int, bs: int, dim: int, like=None, touch: bool = False):
    """Softmax-state scratch (m, l, acc) for `rows` (query head x program) rows, kept in ws across calls
    (on the device `like` lives on). touch: host arrays are written once here (the decode workspace: see below).

    Grown, never shrunk: a call needing fewer rows gets the first rows of the arrays there (the kernels index
    rows from the start), so steps of every size, and the graphs recorded for them, share one set of arrays.
    (Arrays of the exact size each time left every recorded graph of another batch size holding its own,
    per layer: on CUDA the engine's decode graphs of 64 sequences' buckets held ~2.5 GB of them at the
    Llama-3-8B shape.) The engine sizes them for its largest steps at start (ModelRunner.reserve_buffers)."""
    dev = getattr(like, "device", None) if is_device(like) else None
    ent = ws.get(key)
    if ent is None or ent[0][0] < rows or ent[0][1:] != (bs, dim, dev):
        arrs = (empty_like_dev(like, rows, np.float32), empty_like_dev(like, rows * bs, np.float32),
                empty_like_dev(like, rows * dim, np.float32))
        if touch:
            for a in arrs:
                if isinstance(a, np.ndarray):
                    a.fill(0.0)
        ent = ws[key] = ((rows, bs, dim, dev),) + arrs
    if ent[0][0] == rows:
        return ent[1:]
    m, l, acc = ent[1:]
    return m[:rows], l[:rows * bs], acc[:rows * dim]


# The decode workspace's host pages are written once when it is allocated. Its rows for partitions past a
# sequence's own are only ever the target of masked-off stores (decode_kernel's _init_state / output store
# with mine false) and of loads, so a fresh np.empty left them never written (unmapped, or the shared zero
# page after a load), and every such AVX-512 masked store then took a slow assist (an order of magnitude on a
# c=16 decode launch with many idle programs), depending on whether the allocator handed back recycled pages.

# CPU tiers' choices (the target's tuning table, targets/tuning.py; _tuning(None): this host's tier's):
# decode_skip_idle: decode_kernel programs without work (past their sequence's partitions) return at once
# (SKIP_IDLE) instead of running masked-off stores, and merge_kernel's programs of sequences with one partition
# (the same outputs either way); prefill_token_group: prefill_kernel's token groups (0: every token alone): TQ
# tokens whose positions share a cache block compute their scores for a block together, the tokens in the vector
# lanes (bit-identical); prefill_balance: prefill_kernel's programs in _balanced_tile's order (threads get about
# equal work on a causal prompt; the same bits; off: grid order); prefill_merge: the partition merge, 1 =
# _merge_rows over the smallest power of two of partitions that holds the token's (run-time branch), 0 =
# _merge_parts over MAX_PARTITIONS lanes (the same bits); decode_head_split: decode_kernel with a program per KV
# head (HSPLIT) for batches of fewer sequences than the CPU pool's threads.


def _launch_prefill(st: _Step, q, k_cache, v_cache, ws: dict, block_q: int, skip_decode: bool, target):
    programs = st.T // block_q + st.num_seqs
    T = resolve_target(target, q)           # None: this host's CPU tier
    tu = _tuning(T)
    # token groups (prefill_kernel's TQ) on CPU tiers, for tiles that can hold one
    tq = min(tu.prefill_token_group, block_q) if T is None or T.is_cpu else 0
    merge = tu.prefill_merge if T is None or T.is_cpu else 0
    m, l, acc = _workspace(ws, "prefill", programs * st.kvh * (MAX_PARTITIONS * st.G * max(tq, 1) + merge), st.bs,
                           st.dim, like=q)
    if tq:
        n = programs * st.kvh * (2 * st.dim * st.bs + st.G * st.bs + st.G + st.G * 16 * st.bs)   # w <= 16
        if ws.get("prefill_tq") is None or ws["prefill_tq"].size < n:
            ws["prefill_tq"] = empty_like_dev(q, n, np.float32)
        tq_ws = ws["prefill_tq"]
    else:
        tq_ws = st.out
    run(prefill_kernel, (programs, st.kvh),
        (q, k_cache, v_cache, st.out, m, l, acc, st.query_start, st.seq_lens, st.block_table, st.num_seqs,
         int(st.num_seqs).bit_length(), st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window,
         st.cap, st.sinks, tq_ws),
        target=target, KVH=st.kvh, G=st.G, D=st.dim, BS=st.bs, BQ=block_q, PB=PARTITION_BLOCKS,
        MAXP=MAX_PARTITIONS, SOFTCAP=st.use_cap, SKIP_DECODE=skip_decode, SINKS=st.use_sinks, TQ=tq,
        BALANCE=tu.prefill_balance and (T is None or T.is_cpu), MERGE=merge)


# GPUs (CUDA, AMDGPU) run the flash kernels (flash_decode/merge/prefill_kernel); with the target's
# tuning.token_attention, token_attention_kernel (one program per (token, KV head), the whole key range in one
# loop: the path before the flash kernels, and the one shapes the flash tiles do not fit take). Vulkan always takes
# the token kernel (compile times on lavapipe, see _vulkan_attention).
# The flash kernels' launch choices on GPUs are the target's tuning table (targets/tuning.py, _tuning(target)):
# flash_partition_blocks (blocks per flash-decoding partition, at most MAX_PARTITIONS; decode and prefill split
# alike at any setting), flash_step_blocks, flash_warp_rows, flash_decode_pipeline, flash_decode_wide,
# flash_fold_skip, flash_longest_first.
# query rows (tokens x padded query heads of a KV head) per prefill program, D <= 128. H200 (session 14,
# perf/h200_decode_regs.sh, variant flash-16bit-rows32-w4 against 64 rows at 8 warps, same run): 32 rows at 4 warps
# 1.08x (B=1 S=1024 0.505 -> 0.466 ms, B=8 3.933 -> 3.650): two CTAs an SM instead of one (255 registers either
# way), the same warps resident, half as many at each barrier. A row's bits do not depend on the tile.
FLASH_ROWS = 32
# tuning.flash_warp_rows: the prefill kernel on CUDA launched with `warp_rows` (backends/gpu.py _mma_geometry):
# each warp owns whole rows of its tiles (with FLASH_WARP_ROWS_TILE's 64 rows at 8 warps, two warps a 16-row tile:
# the scores computed by both, P @ V's columns split between them), so the online softmax's row max / sum run on
# lane shuffles, its row values stay in registers, P @ V takes P from registers and its V tile is staged with K
# (fewer CTA barriers, no spills). The same bits (the row sum in the tile path's order).
FLASH_WARP_ROWS_TILE = (64, 8)      # (rows, warps) of the warp-rows prefill tile, D <= 128
# heads wider than 128 keep the tile they had before (32 rows at 8 warps; unmeasured at 4 warps, where the two
# (32, D) accumulators alone would take 128 registers a thread)
FLASH_ROWS_WIDE_HEADS = 32
FLASH_PREFILL_WARPS_WIDE_HEADS = 8
# tuning.flash_prefill_pipeline / flash_decode_pipeline: load the next cache block while the current one is
# computed (the prefill / decode kernel). The same bits either way.
# tuning.flash_fold_skip: the prefill tile's partition fold runs only in the blocks where some row needs it
# (flash_prefill_kernel FOLD_SKIP; the same bits). tuning.flash_longest_first: the prefill grid starts the longest
# (last) causal tiles first (flash_prefill_kernel LONGEST_FIRST; the same bits).
# the flash kernels' MMA operands: "f32" (q and the probabilities split into f16 hi + lo by the lowering: ~22
# significant bits, two chains per dot) or "16bit" (q and the probabilities rounded to f16 once: one chain per
# cache part, half the MMAs and A staging; FlashAttention's precision). Decode and prefill use the same setting
# (a token's bits stay the same either way it is computed).
GPU_FLASH_OPERANDS = "f32"
# warps per program of the decode and prefill kernels. ptxas (sm_90a, Llama-3-8B shape) gives the decode kernel
# 255 registers at 4 warps (2 CTAs / SM) and ~240 at 8 (1 CTA / SM); the 64-row prefill 255 with ~1-1.5 KB of
# spills at 8 warps, the 32-row one (FLASH_ROWS) 255 without spills at 4 (perf/bench_kernels_cuda.py
# --attn-variants sweeps these settings on the GPU)
FLASH_WARPS = (4, 4)
# decode launches of at least tuning.flash_decode_wide programs (sequences x KV heads x partition axis) run the
# decode kernel with FLASH_DECODE_WIDE_WARPS warps: its 16-row x 16-key score dot is then one MMA tile per warp (with
# 4, two warps sit out) and more programs fit an SM; small launches keep FLASH_WARPS[0]. A token's bits do not
# depend on the warps (every output is the same MMA chain; tests/ops/test_attention_flash.py checks it on the GPU)
FLASH_DECODE_WIDE_WARPS = 2
# a register cap (ptxas maxnreg) for the decode kernel on CUDA, None: none. ptxas (sm_90a, f16 cache, 2 warps)
# gives it 227 registers (4 CTAs = 8 warps an SM; Nsight Compute: occupancy limited by registers, the warps
# stalled on shared memory); 168 fits 6 CTAs with 96 B spilled, 128 fits 8 with 312 B. An A/B setting
# (perf/bench_kernels_cuda.py variants flash-16bit-dm168 / -dm128); the same bits at any cap.
FLASH_DECODE_MAXNREG = None
# ... and for the prefill kernel (ptxas, 16-bit operands: 255 registers at 32 rows / 4 warps; 16 rows at 4 warps
# capped at 168 spill 128 B and fit 3 CTAs an SM). An A/B setting: flash-16bit-rows16-w4-m168.
FLASH_PREFILL_MAXNREG = None
# tuning.flash_step_blocks: cache blocks per online-softmax step of the flash kernels (1, 2 or 4): a step of SB
# blocks is one (rows, SB * BS) score tile, its row max / sum and one P @ V, so SB times fewer steps (barriers,
# shared-memory round trips) per key range. Decode and prefill step alike (partitions are whole steps, _split), so
# a token's bits agree between them at any setting; other settings give other bits. Layers with a sliding window
# step by one block (their rows' ranges start at different blocks); the staging must fit (_flash_step_blocks).


def _tuning(target):
    """The launch choices for `target` (None: this host's CPU tier's)."""
    if target is None:
        from jitkern.runtime.cpu import runtime_target
        target = runtime_target()
    return target.tuning


def _token_path(target, st) -> bool:
    """Vulkan, tuning.token_attention, and GPU shapes the flash tiles do not fit (e.g. MLA's wide MQA rows) take
    the token kernel."""
    return target is not None and (target.costly_workgroups or (target.is_gpu and (
        target.tuning.token_attention or not _flash_fits(st))))


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _flash_smem(rows: int, D: int, BS: int) -> int:
    """Bytes of shared memory the GPU lowering stages for the flash kernels' dots on (rows, D) query tiles:
    the larger of q @ k^T (A as f16 hi + lo rows of D + 8, one K block, the (rows, BS) result) and P @ V."""
    qk = 2 * rows * (D + 8) * 2 + BS * (D + 8) * 2 + rows * BS * 4
    pv = 2 * rows * (BS + 8) * 2 + D * (BS + 8) * 2 + rows * D * 4
    return max(qk, pv)


_FLASH_SMEM_LIMIT = 47 * 1024     # under the 48 KiB of static shared memory (NVIDIA), with room for padding


def _flash_prefill_rows(G: int, D: int, BS: int) -> int:
    """Query rows per prefill program on a GPU: FLASH_ROWS (FLASH_ROWS_WIDE_HEADS for D > 128), halved until the
    staging fits, never fewer than the padded head group."""
    rows = max(FLASH_ROWS if D <= 128 else FLASH_ROWS_WIDE_HEADS, _pow2(G))
    while rows > _pow2(G) and _flash_smem(rows, D, BS) > _FLASH_SMEM_LIMIT:
        rows //= 2
    return rows


def _flash_step_blocks(st, step_blocks=None, target=None) -> int:
    """Cache blocks per online-softmax step for this step's shapes (tuning.flash_step_blocks, or step_blocks): a
    function of the head group, head size, block size and window alone (never of decode vs prefill or the tile a
    test asks for), halved until both kernels' default tiles fit the shared-memory staging; 1 with a sliding window."""
    sb = _tuning(target).flash_step_blocks if step_blocks is None else int(step_blocks)
    if sb not in (1, 2, 4):
        raise ValueError(f"step_blocks must be 1, 2 or 4, got {sb}")
    if sb == 1 or st.window > 0:
        return 1                    # (the default: nothing to fit, once per attention launch)
    rows = (max(16, _pow2(st.G)), _flash_prefill_rows(st.G, st.dim, st.bs))
    while sb > 1 and max(_flash_smem(r, st.dim, st.bs * sb) for r in rows) > _FLASH_SMEM_LIMIT:
        sb //= 2
    return sb


def _flash_fits(st) -> bool:
    # the tiles' shared-memory staging must fit; wider head groups / heads keep the token kernel
    GP = _pow2(st.G)
    return (st.dim % 8 == 0 and _flash_smem(max(16, GP), st.dim, st.bs) <= _FLASH_SMEM_LIMIT
            and _flash_smem(_flash_prefill_rows(st.G, st.dim, st.bs), st.dim, st.bs) <= _FLASH_SMEM_LIMIT)


def _flash_path(target, st) -> bool:
    return (target is not None and target.fast_workgroups and not target.tuning.token_attention
            and _flash_fits(st))


def writes_16bit_out(target, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether paged_attention on `target` runs the flash kernels for these shapes, so that its `out` may be
    16-bit (uint16 = bf16, float16: the results rounded to nearest even as they are stored)."""
    from types import SimpleNamespace
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return False
    return _flash_path(target, SimpleNamespace(G=num_heads // num_kv_heads, dim=head_dim, bs=block_size))


def partition_blocks_for(target) -> int:
    """Blocks per decode partition that paged_attention uses on `target` (GPUs on the flash kernels:
    tuning.flash_partition_blocks; elsewhere PARTITION_BLOCKS); decode_partitions(..., partition_blocks=this) gives the
    partition axis a step needs there (head groups too wide for the flash kernels fall back to the token
    kernel, which ignores partitions)."""
    flash = target is not None and target.fast_workgroups and not target.tuning.token_attention
    return target.tuning.flash_partition_blocks if flash else PARTITION_BLOCKS


def _flash_split(target, k_cache) -> bool:
    """Whether the flash kernels split f32 K/V into f16 hi + lo for the matrix units (GPUs that have them)."""
    return bool(target is not None and getattr(target, "mma", "") and k_cache.dtype == np.float32)


def _flash_launch(st: _Step, q, k_cache, v_cache, ws: dict, P: int, max_query_len: int, decode: bool,
                  block_m, split, target, pipeline=None, operands=None, step_blocks=None, q8=None):
    """The flash kernels over one step: decode (+ merge) for the q_len == 1 sequences and the prefill kernel
    for the others (decode=False: the prefill kernel for every sequence). operands: "f32" | "16bit" (None:
    GPU_FLASH_OPERANDS). q8: the Q8Activations the merge kernel also writes (_q8_in_merge), or None."""
    G, GP, D = st.G, _pow2(st.G), st.dim
    split = _flash_split(target, k_cache) if split is None else bool(split)
    mode = GPU_FLASH_OPERANDS if operands is None else operands
    if mode not in ("f32", "16bit"):
        what = "GPU_FLASH_OPERANDS" if operands is None else "operands"
        raise ValueError(f"{what} must be 'f32' or '16bit', got {mode!r}")
    tu = _tuning(target)
    PB = tu.flash_partition_blocks
    sb = _flash_step_blocks(st, step_blocks, target)
    common = dict(SOFTCAP=st.use_cap, SINKS=st.use_sinks, OPS16=mode == "16bit", **({"SB": sb} if sb > 1 else {}))
    gpu = target is not None and target.is_gpu
    pipe = (tu.flash_prefill_pipeline and gpu) if pipeline is None else bool(pipeline)
    dpipe = (tu.flash_decode_pipeline and gpu) if pipeline is None else bool(pipeline)
    wide = st.num_seqs * st.kvh * P >= tu.flash_decode_wide
    dw = dict(num_warps=FLASH_DECODE_WIDE_WARPS if wide else FLASH_WARPS[0], PIPE=dpipe) if gpu else dict(PIPE=dpipe)
    if FLASH_DECODE_MAXNREG and gpu and target.register_cap:
        dw["maxnreg"] = int(FLASH_DECODE_MAXNREG)
    pw = dict(num_warps=FLASH_WARPS[1] if D <= 128 else FLASH_PREFILL_WARPS_WIDE_HEADS, PIPE=pipe) if gpu else \
        dict(PIPE=pipe)
    if FLASH_PREFILL_MAXNREG and gpu and target.register_cap:
        pw["maxnreg"] = int(FLASH_PREFILL_MAXNREG)
    warp_rows = bool(tu.flash_warp_rows and gpu and target.lane_shuffles and D <= 128)
    if warp_rows:
        pw.update(warp_rows=True, num_warps=FLASH_WARP_ROWS_TILE[1])
        # the decode kernel's 16 rows shared by its 2 / 4 warps (each computes the scores, P @ V's columns
        # split): row statistics on shuffles there too (ptxas, sm_90a: 25 -> 12 bar.sync; 168 -> 150 registers
        # at 2 warps, 128 -> 72 at 4)
        dw["warp_rows"] = True
    if decode:
        m, l, acc = _workspace(ws, "flash", st.num_seqs * st.kvh * P * G, 1, D, like=q)
        run(flash_decode_kernel, (st.num_seqs, st.kvh, P),
            (q, k_cache, v_cache, st.out_arg, m, l, acc, st.query_start, st.seq_lens, st.block_table,
             st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window, st.cap, st.sinks),
            target=target, KVH=st.kvh, G=G, R=max(16, GP), D=D, BS=st.bs, NUM_PARTS=P, PB=PB,
            MAXP=MAX_PARTITIONS, SPLIT=split, **common, **dw)
        if P > 1:
            qa, qkw = _q8_merge_args(st, q8)
            run(flash_merge_kernel, (st.num_seqs, st.kvh),
                (st.out_arg, m, l, acc, st.query_start, st.seq_lens, st.o_ts, st.o_hs, st.window, st.sinks) + qa,
                target=target, KVH=st.kvh, G=G, GP=GP, D=D, BS=st.bs, NUM_PARTS=P, PB=PB,
                MAXP=MAX_PARTITIONS, SINKS=st.use_sinks, **({"SB": sb} if sb > 1 else {}), **qkw)
    if max_query_len > 1 or not decode:
        # (CPU tiers, which run these kernels only for tests: 16 rows, quicker to compile)
        rows = int(block_m) * GP if block_m else \
            (FLASH_WARP_ROWS_TILE[0] if warp_rows else _flash_prefill_rows(G, D, st.bs) if gpu else 16)
        if gpu and getattr(target, "mma", None):
            # fewer than 16 rows would take the dots off the matrix units (an MMA tile is 16 rows), and
            # their sums would no longer be the decode kernel's (which pads its head group to 16 rows)
            rows = max(rows, 16)
        bm = max(1, rows // GP)
        lf = bool(tu.flash_longest_first)
        tiles = st.T // bm + st.num_seqs
        run(flash_prefill_kernel, (st.kvh, tiles) if lf else (tiles, st.kvh),
            (q, k_cache, v_cache, st.out_arg, st.query_start, st.seq_lens, st.block_table, st.num_seqs,
             int(st.num_seqs).bit_length(), st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window,
             st.cap, st.sinks),
            target=target, KVH=st.kvh, G=G, GP=GP, BM=bm, D=D, BS=st.bs, PB=PB,
            MAXP=MAX_PARTITIONS, SKIP_DECODE=bool(decode), SPLIT=split, FOLD_SKIP=bool(tu.flash_fold_skip),
            **({"LONGEST_FIRST": True} if lf else {}), **common, **pw)
    return st.out


def flash_paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, *, scale: float,
                          sliding_window: int = 0, softcap: float = 0.0, out=None, max_query_len: int | None = None,
                          num_partitions: int | None = None, workspace: dict | None = None, decode: bool = True,
                          block_m: int | None = None, split: bool | None = None, pipeline: bool | None = None,
                          validate: bool = True, host_step=None, sinks=None, target=None, operands=None,
                          step_blocks: int | None = None, q8_out=None):
    """paged_attention through the GPU flash kernels, on any target (GPUs take this path from
    paged_attention; CPU tiers run it for tests). Arguments as for paged_attention, and:
    decode=False runs the prefill kernel for every sequence (decodes included: same bits as decode=True);
    block_m: query tokens per prefill program (default: FLASH_ROWS rows / the padded query-head group; on GPUs
    with matrix units at least 16 rows);
    split: K/V as f16 hi + lo for the matrix units (default: f32 cache on a target with them).
    pipeline: load the next cache block before computing the current one (default: the target's
    tuning.flash_prefill_pipeline / flash_decode_pipeline on GPUs, off on CPUs); the same bits either way.
    step_blocks: cache blocks per online-softmax step, 1, 2 or 4 (default tuning.flash_step_blocks; 1 with a sliding
    window; decode and prefill alike, so their bits agree at any setting).
    Decode partitions are tuning.flash_partition_blocks blocks (at most MAX_PARTITIONS, decided by each sequence's
    own range): num_partitions must cover decode_partitions(..., partition_blocks=that).
    The launch choices come from the target's tuning table: pass target=targets.tuned(t, ...) to try others."""
    target = resolve_target(target, q)
    st = _Step(q, k_cache, v_cache, query_start, seq_lens, block_table, out, scale, sliding_window, softcap,
               validate, host_step, sinks)
    if st.empty:
        return st.out
    if max_query_len is None:
        max_query_len = int(np.diff(st.qs_host).max())
    P = _partition_axis(st, num_partitions, validate, _tuning(target).flash_partition_blocks)
    q8 = _q8_in_merge(st, q8_out, P, max_query_len if decode else 2)
    _flash_launch(st, q, k_cache, v_cache, workspace if workspace is not None else {}, P, max_query_len,
                  decode, block_m, split, target, pipeline, operands, step_blocks, q8=q8)
    if q8_out is not None and q8 is None:
        _quantize_out(st, q8_out, target)
    return st.out


def _partition_axis(st: _Step, num_partitions, validate: bool, pb: int) -> int:
    if num_partitions is None or validate:
        decodes = np.diff(st.qs_host) == 1
        need = int(decode_partitions(st.sl_host[decodes], st.bs, st.window, pb).max()) if decodes.any() else 1
        if num_partitions is None:
            num_partitions = 1 << max(need - 1, 0).bit_length()
        elif int(num_partitions) < need:
            raise ValueError(f"num_partitions={num_partitions} is below the {need} partitions a sequence of this "
                             f"step needs (decode_partitions); use at least that, or MAX_PARTITIONS")
    P = int(num_partitions)
    if P < 1 or P > MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {MAX_PARTITIONS}], got {P}")
    return P


def _vulkan_attention(st: _Step, q, k_cache, v_cache, target):
    """Every token of the step through token_attention_kernel (grid: tokens x query heads). Vulkan runs this
    instead of the decode/merge/prefill kernels: those compile for minutes on lavapipe (see the kernel).
    Partition counts and workspaces do not apply; results are bit-identical whatever the batch."""
    run(token_attention_kernel, (st.T, st.kvh),
        (q, k_cache, v_cache, st.out, st.query_start, st.seq_lens, st.block_table, st.num_seqs,
         int(st.num_seqs).bit_length(), st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window,
         st.cap, st.sinks),
        target=target, KVH=st.kvh, G=st.G, D=st.dim, BS=st.bs, SOFTCAP=st.use_cap, SINKS=st.use_sinks)
    return st.out


def paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, *, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0, out=None, max_query_len: int | None = None,
                    num_partitions: int | None = None, workspace: dict | None = None, prefetch: bool = True,
                    validate: bool = True, host_step=None, sinks=None, target=None, operands=None, q8_out=None):
    """Attention for one engine step over a paged KV cache (layouts in the module docstring); returns out.

    q8_out: a engine.ops.quant.Q8Activations (arrays, layout, 4-fold scales) that also receives the output
    quantised as quantize_q8 would (the next GGUF linear's input), written by the merge kernel in decode-only
    steps (one launch fewer), else by quantize_q8 after the attention; out must be float32.

    sinks: f32 [num_heads] attention-sink logits (gpt-oss), or None: each head's softmax gets one more
    logit, sinks[h], that attends to nothing (out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h]))).
    operands: the GPU flash kernels' MMA inputs, "f32" (hi + lo) or "16bit" (q and probabilities in f16);
    None: GPU_FLASH_OPERANDS. No effect on CPU tiers' other kernels.

    max_query_len: the largest q_len of the step, when the caller knows it (else read from query_start).
    1 runs only the decode kernel; anything else runs the decode kernel for the q_len == 1 sequences and
    the prefill kernel for the others (both grids depend only on num_tokens / num_seqs).
    num_partitions: the decode launch's partition axis. Every sequence splits its own key range into
    decode_partitions(...) partitions (flash-decoding; decided by its length alone, so results are
    bit-identical whatever the batch); the axis must be at least the largest of them. None: computed from
    seq_lens (rounded up to a power of two); pass MAX_PARTITIONS for a jk.capture()d launch whose sequence
    lengths will grow.
    workspace: a dict holding the softmax-state scratch across calls (pass the same one to jk.capture()d
    calls: the recorded launches point at its arrays).
    prefetch: software-prefetch the next cache block in the decode kernel.
    validate: check query_start / seq_lens / block-table width (and num_partitions) on the host
    (O(num_seqs) numpy work); block ids themselves are trusted (an id >= num_blocks reads outside the cache).
    host_step: (query_start, seq_lens) host copies for the host-side reads when those arrays are GPU
    DeviceArrays (else they are downloaded each call).
    """
    target = resolve_target(target, q)
    st = _Step(q, k_cache, v_cache, query_start, seq_lens, block_table, out, scale, sliding_window, softcap,
               validate, host_step, sinks)
    if st.empty:
        return st.out
    if max_query_len is None:
        max_query_len = int(np.diff(st.qs_host).max())
    flash = _flash_path(target, st)
    P = _partition_axis(st, num_partitions, validate,
                        target.tuning.flash_partition_blocks if flash else PARTITION_BLOCKS)
    if _token_path(target, st):
        _f32_out_only(st, "token (Vulkan)")
        if q8_out is not None:
            _check_q8_out(st, q8_out)
        _vulkan_attention(st, q, k_cache, v_cache, target)
        if q8_out is not None:
            _quantize_out(st, q8_out, target)
        return st.out
    if not flash:
        _f32_out_only(st, f"{target.name if target is not None else 'CPU'} attention")
    ws = workspace if workspace is not None else {}
    if flash:
        q8 = _q8_in_merge(st, q8_out, P, max_query_len)
        _flash_launch(st, q, k_cache, v_cache, ws, P, max_query_len, True, None, None, target, operands=operands,
                      q8=q8)
        if q8_out is not None and q8 is None:
            _quantize_out(st, q8_out, target)
        return st.out
    m, l, acc = _workspace(ws, "decode", st.num_seqs * P * st.heads, st.bs, st.dim, like=q, touch=True)
    tu = _tuning(target)
    hsplit = _decode_head_split(st, tu)
    skip = {"SKIP_IDLE": True} if tu.decode_skip_idle and (target is None or target.is_cpu) else {}
    run(decode_kernel, (P * (st.kvh if hsplit else 1), st.num_seqs),
        (q, k_cache, v_cache, st.out, m, l, acc, st.query_start, st.seq_lens, st.block_table,
         st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window, st.cap, st.sinks),
        target=target, KVH=st.kvh, G=st.G, D=st.dim, BS=st.bs, NUM_PARTS=P, PB=PARTITION_BLOCKS,
        MAXP=MAX_PARTITIONS, SOFTCAP=st.use_cap, PREFETCH=bool(prefetch), SINKS=st.use_sinks,
        **({"HSPLIT": True} if hsplit else {}), **skip)
    q8 = _q8_in_merge(st, q8_out, P, max_query_len)
    if P > 1:
        qa, qkw = _q8_merge_args(st, q8)
        run(merge_kernel, (st.num_seqs, st.heads),
            (st.out, m, l, acc, st.query_start, st.seq_lens, st.o_ts, st.o_hs, st.window, st.sinks) + qa,
            target=target, H=st.heads, D=st.dim, BS=st.bs, NUM_PARTS=P, PB=PARTITION_BLOCKS, MAXP=MAX_PARTITIONS,
            SINKS=st.use_sinks, **skip, **qkw)
    if max_query_len > 1:
        _launch_prefill(st, q, k_cache, v_cache, ws, PREFILL_BLOCK_Q, True, target)
    if q8_out is not None and q8 is None:
        _quantize_out(st, q8_out, target)
    return st.out


def _check_q8_out(st, q8_out):
    """paged_attention's q8_out against the step: the arrays quantize_q8 would fill for the (tokens, heads *
    head_dim) output, which must be float32."""
    from .quant import Q8Activations
    T, K = st.out.shape[0], st.heads * st.dim
    if not isinstance(q8_out, Q8Activations):
        raise TypeError("q8_out: a engine.ops.quant.Q8Activations (the arrays quantize_q8 fills)")
    if st.out.dtype != np.float32:
        raise ValueError("q8_out: the attention output must be float32 to be quantised")
    if K % 32 or q8_out[0].shape != (T, K) or q8_out[1].shape != (T, K // 32):
        raise ValueError(f"q8_out: arrays for a ({T}, {K}) output (K a multiple of 32), got qx {q8_out[0].shape}")


def _q8_in_merge(st, q8_out, P: int, max_query_len: int):
    """q8_out where the merge kernel writes it: a decode-only step (every output row is a decode's, which the
    merge kernel sees), a merge launch (P > 1), head outputs of whole 32-blocks in a power-of-two count, rows
    of the output one after another; else None (the output is quantised after the attention)."""
    if q8_out is None:
        return None
    _check_q8_out(st, q8_out)
    nb = st.dim // 32
    ok = (max_query_len == 1 and P > 1 and st.dim % 32 == 0 and nb & (nb - 1) == 0 and st.o_hs == st.dim
          and st.o_ts == st.heads * st.dim)
    return q8_out if ok else None


def _q8_merge_args(st, q8):
    """The merge kernels' quantised-output arguments (qx, scales, sums, the 4-fold scales and sums) and
    constexprs for q8 (a Q8Activations, or None: unused arguments, Q8G left 0)."""
    if q8 is None:
        return (st.out_arg,) * 5, {}
    qa = (q8[0], q8[1], q8[2], q8[1] if q8.scales4 is None else q8.scales4, q8[2] if q8.sums4 is None else q8.sums4)
    return qa, {"Q8G": q8_group(q8.layout, st.heads * st.dim // 32), "REP4": q8.scales4 is not None}


def _quantize_out(st, q8_out, target):
    from .quant import quantize_q8
    T, K = st.out.shape[0], st.heads * st.dim
    rep4 = q8_out.scales4 is not None
    quantize_q8(st.out.reshape(T, K), out=tuple(q8_out[:3]), layout=q8_out.layout, rep4=rep4,
                out4=(q8_out.scales4, q8_out.sums4) if rep4 else None, target=target)


def _decode_head_split(st, tu) -> bool:
    """decode_kernel with a program per KV head (tuning.decode_head_split) for batches of fewer sequences than the
    CPU pool's threads (one sequence with 2 threads: its heads on both threads instead of one)."""
    if not tu.decode_head_split or st.kvh < 2:
        return False
    from jitkern.runtime.cpu_pool import get_pool
    return st.num_seqs < get_pool().num_threads


def _validate_step(query_start, seq_lens, block_table, num_tokens, block_size):
    q_lens = np.diff(query_start)
    if query_start[0] < 0 or (q_lens < 0).any() or int(query_start[-1]) > num_tokens:
        raise ValueError(f"query_start must be non-decreasing within [0, {num_tokens}], got {query_start}")
    bad = np.nonzero(seq_lens < q_lens)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} is shorter than its {int(q_lens[i])} new tokens")
    need = int(-(-int(seq_lens.max()) // block_size))
    if need > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns but a sequence of length "
                         f"{int(seq_lens.max())} needs {need} blocks of {block_size}")


def paged_prefill_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, *, scale: float,
                            sliding_window: int = 0, softcap: float = 0.0, out=None, block_q: int | None = None,
                            workspace: dict | None = None, validate: bool = True, host_step=None, sinks=None,
                            target=None):
    """The general (prefill) kernel alone over every sequence, decodes included; arguments as for
    paged_attention. block_q: query tokens per program (default PREFILL_BLOCK_Q)."""
    target = resolve_target(target, q)
    st = _Step(q, k_cache, v_cache, query_start, seq_lens, block_table, out, scale, sliding_window, softcap,
               validate, host_step, sinks)
    if not st.empty and _token_path(target, st):
        _f32_out_only(st, "token (Vulkan)")
        return _vulkan_attention(st, q, k_cache, v_cache, target)
    if not st.empty and _flash_path(target, st):
        return _flash_launch(st, q, k_cache, v_cache, workspace if workspace is not None else {}, 1, 2, False,
                             block_q, None, target)
    if not st.empty:
        _f32_out_only(st, "prefill")
        _launch_prefill(st, q, k_cache, v_cache, workspace if workspace is not None else {},
                        int(block_q or PREFILL_BLOCK_Q), False, target)
    return st.out
