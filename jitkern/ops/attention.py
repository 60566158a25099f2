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
from ._hostargs import elem_strides, empty_like_dev, host_copy, is_array, resolve_target, run

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
    d = jk.arange(0, D)
    j = jk.arange(0, w)
    r = r0 + jk.arange(0, G)
    l_i = jk.load(st_l + r[:, None] * BS + n[None, :])
    for g in jk.static_range(G):
        qc = ()
        for c in jk.static_range(D // w):
            qc = qc + (jk.load(qrow + g * q_hs + c * w + j),)
        ks = _load_chunks(k_ptr, n, kv_stride, D, w)
        jk.store(st_l + (r0 + g) * BS + n, _chunk_dots(ks, qc, BS, w))
    s = jk.load(st_l + r[:, None] * BS + n[None, :]) * scale
    if SOFTCAP:
        s = softcap * jk.tanh(s / softcap)
    s = jk.where(valid[None, :], s, NEG)
    m_i = jk.load(st_m + r)
    m_new = jk.maximum(m_i, _row_max(s, G, BS))
    alpha = jk.exp(m_i - m_new)
    p = jk.where(valid[None, :], jk.exp(s - m_new[:, None]), 0.0)
    vt = jk.load(v_ptr + n[:, None] * kv_stride + d[None, :]).to(jk.f32)
    acc = jk.dot(p, vt, jk.load(st_acc + r[:, None] * D + d[None, :]) * alpha[:, None])
    jk.store(st_m + r, m_new)
    jk.store(st_l + r[:, None] * BS + n[None, :], l_i * alpha[:, None] + p)
    jk.store(st_acc + r[:, None] * D + d[None, :], acc)


@jk.jit
def _split(nb, PB, MAXP):
    """(partitions, blocks per partition) for a key range of nb blocks: decided by the range alone, so a
    query's arithmetic never depends on the batch it runs in (nor on decode vs prefill kernel)."""
    parts = jk.minimum((nb + PB - 1) // PB, MAXP)
    per = (nb + jk.maximum(parts, 1) - 1) // jk.maximum(parts, 1)
    return parts, per


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


@jk.kernel
def decode_kernel(q, k_cache, v_cache, out, st_m, st_l, st_acc, query_start, seq_lens, block_table,
                  q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                  KVH: jk.constexpr, G: jk.constexpr, D: jk.constexpr, BS: jk.constexpr,
                  NUM_PARTS: jk.constexpr, PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr,
                  PREFETCH: jk.constexpr, SINKS: jk.constexpr):
    """Program (sequence, partition): every head of a q_len == 1 sequence over one partition of its blocks.

    The sequence's own key range decides its partitions (_split); programs past them do nothing, so
    NUM_PARTS (the grid) only bounds them. A single-partition sequence writes its output here, the others
    leave partial states for merge_kernel. Blocks are the outer loop and KV heads the inner one, so each
    cache block is read once, front to back; the per-head softmax state lives in the st_* workspace
    (L1-resident), which keeps the code size independent of the head count.
    """
    seq = jk.program_id(0)
    part = jk.program_id(1)
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

    n = jk.arange(0, BS)
    d = jk.arange(0, D)
    gi = jk.arange(0, G)
    slot = (seq * NUM_PARTS + part).to(jk.i64) * H
    for h in range(0, KVH):
        _init_state(st_m, st_l, st_acc, slot + h * G + gi, G, D, BS, mine)
    qrow = q + jk.maximum(jk.minimum(q0, q0 + q_len - 1), 0).to(jk.i64) * q_ts
    bt_row = block_table + seq.to(jk.i64) * bt_stride
    for b in range(b0, b1):
        base = jk.load(bt_row + b).to(jk.i64) * (BS * KVH * D)
        nxt = jk.load(bt_row + jk.minimum(b + 1, b1 - 1)).to(jk.i64) * (BS * KVH * D)
        pos = b * BS + n
        valid = (pos < seq_len) & (pos >= lo)
        for h in range(0, KVH):
            if PREFETCH:
                # the next block's rows of this head, into L2: spread over the heads (a burst of the whole
                # block stalls on miss buffers) and not into L1 (two blocks of f32 K+V do not fit there);
                # measured ~1.5x (f32) to ~1.8x (f16) on cold random block tables
                jk.prefetch(k_cache + nxt + h * D + n[:, None] * (KVH * D) + d[None, :], locality=2)
                jk.prefetch(v_cache + nxt + h * D + n[:, None] * (KVH * D) + d[None, :], locality=2)
            _attend_block(qrow + h * G * q_hs, q_hs, k_cache + base + h * D, v_cache + base + h * D, KVH * D,
                          valid, st_m, st_l, st_acc, slot + h * G, scale, softcap, G, D, BS, w, SOFTCAP)
    orow = out + q0.to(jk.i64) * o_ts
    for h in range(0, KVH):
        o = _finish_state(st_m, st_l, st_acc, slot + h * G + gi, G, D, BS, jk.load(sinks + h * G + gi), SINKS)
        jk.store(orow + (h * G + gi[:, None]) * o_hs + d[None, :], o, mask=mine & (parts == 1))


@jk.kernel
def merge_kernel(out, st_m, st_l, st_acc, query_start, seq_lens, o_ts, o_hs, window, sinks,
                 H: jk.constexpr, D: jk.constexpr, BS: jk.constexpr, NUM_PARTS: jk.constexpr,
                 PB: jk.constexpr, MAXP: jk.constexpr, SINKS: jk.constexpr):
    """Program (sequence, query head): combines the partial states of a decode sequence split in 2+."""
    seq = jk.program_id(0)
    hq = jk.program_id(1)
    q0 = jk.load(query_start + seq)
    seq_len = jk.load(seq_lens + seq)
    active = (jk.load(query_start + seq + 1) - q0 == 1) & (seq_len > 0)
    lo = jk.where(window > 0, jk.maximum(seq_len - window, 0), 0)
    nb = jk.where(active, (seq_len + BS - 1) // BS - lo // BS, 0)
    parts, per = _split(nb, PB, MAXP)
    o = _merge_parts(st_m, st_l, st_acc, seq.to(jk.i64) * NUM_PARTS * H + hq, H, parts, NUM_PARTS, D, BS,
                     jk.load(sinks + hq), SINKS)
    jk.store(out + q0.to(jk.i64) * o_ts + hq * o_hs + jk.arange(0, D), o, mask=parts > 1)


@jk.kernel(do_not_specialize=('num_seqs', 'search_steps'))
def prefill_kernel(q, k_cache, v_cache, out, st_m, st_l, st_acc, query_start, seq_lens, block_table,
                   num_seqs, search_steps, q_ts, q_hs, o_ts, o_hs, bt_stride, scale, window, softcap, sinks,
                   KVH: jk.constexpr, G: jk.constexpr, D: jk.constexpr, BS: jk.constexpr, BQ: jk.constexpr,
                   PB: jk.constexpr, MAXP: jk.constexpr, SOFTCAP: jk.constexpr, SKIP_DECODE: jk.constexpr,
                   SINKS: jk.constexpr):
    """Program (query tile of BQ tokens of one sequence, KV head): each token of the tile attends, for the
    G query heads of the KV head, to the blocks of its causal (and window) range, split into partitions
    and merged exactly as a decode of the same position would be (bit-identical results whichever kernel
    or batch a token lands in); the K/V blocks a tile shares stay in cache from one token to the next.
    The softmax state goes through the st_* workspace (L1-resident): as loop-carried values, odd-sized
    state vectors compiled to much slower code."""
    qb = jk.program_id(0)
    h = jk.program_id(1)
    w = _vec_width(D)
    # the sequence owning query tile qb: the last i with query_start[i] // BQ + i <= qb
    lo_s = qb * 0
    hi_s = num_seqs
    for _ in range(0, search_steps):
        mid = (lo_s + hi_s) // 2
        go = jk.load(query_start + mid) // BQ + mid <= qb
        lo_s = jk.where(go, mid, lo_s)
        hi_s = jk.where(go, hi_s, mid)
    seq = lo_s
    q0 = jk.load(query_start + seq)
    q_len = jk.load(query_start + seq + 1) - q0
    seq_len = jk.load(seq_lens + seq)
    t0 = (qb - (q0 // BQ + seq)) * BQ
    n_rows = jk.minimum(jk.maximum(q_len - t0, 0), BQ)
    if SKIP_DECODE:
        n_rows = jk.where(q_len == 1, 0, n_rows)
    first_pos = seq_len - q_len + t0

    d = jk.arange(0, D)
    n = jk.arange(0, BS)
    gi = jk.arange(0, G)
    bt_row = block_table + seq.to(jk.i64) * bt_stride
    r0 = (qb * KVH + h).to(jk.i64) * (MAXP * G)     # this program's state rows: partition p, head g at
    for t in range(0, n_rows):                       # r0 + p * G + g
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
                jk.store(orow + g * o_hs + d, _merge_parts(st_m, st_l, st_acc, r0 + g, G, parts, MAXP, D, BS,
                                                           jk.load(sinks + h * G + g), SINKS))


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
    # the sequence owning token tok: the last i with query_start[i] <= tok
    lo_s = tok * 0
    hi_s = num_seqs
    for _ in range(0, search_steps):
        mid = (lo_s + hi_s) // 2
        go = jk.load(query_start + mid) <= tok
        lo_s = jk.where(go, mid, lo_s)
        hi_s = jk.where(go, hi_s, mid)
    seq = lo_s
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


def decode_partitions(seq_lens, block_size: int = 16, sliding_window: int = 0) -> np.ndarray:
    """Each sequence's own decode partition count (int array): its key range in blocks (the last
    sliding_window positions, or all of them) split into PARTITION_BLOCKS-block partitions, at most
    MAX_PARTITIONS. The kernels compute the same numbers from seq_lens; a launch needs a partition axis
    at least as long as the largest one."""
    seq_lens = np.asarray(seq_lens, np.int64)
    lo = np.maximum(seq_lens - sliding_window, 0) if sliding_window > 0 else np.zeros_like(seq_lens)
    nb = np.where(seq_lens > 0, -(-seq_lens // block_size) - lo // block_size, 0)
    return np.minimum(-(-nb // PARTITION_BLOCKS), MAX_PARTITIONS)


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
        self.o_ts, self.o_hs = _heads_view(self.out, "out", self.heads, self.dim)
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
        self.sinks = sinks if self.use_sinks else self.out
        self.empty = self.num_seqs == 0 or self.T == 0
        if validate and not self.empty:
            _validate_step(self.qs_host, self.sl_host, self.block_table, self.T, self.bs)


def _workspace(ws: dict, key: str, rows: int, bs: int, dim: int, like=None):
    """Softmax-state scratch (m, l, acc) for `rows` (query head x program) rows, kept in ws across calls
    (on the device `like` lives on)."""
    if ws.get(key) is None or ws[key][0] != (rows, bs, dim):
        ws[key] = ((rows, bs, dim), empty_like_dev(like, rows, np.float32), empty_like_dev(like, rows * bs, np.float32),
                   empty_like_dev(like, rows * dim, np.float32))
    return ws[key][1:]


def _launch_prefill(st: _Step, q, k_cache, v_cache, ws: dict, block_q: int, skip_decode: bool, target):
    programs = st.T // block_q + st.num_seqs
    m, l, acc = _workspace(ws, "prefill", programs * MAX_PARTITIONS * st.heads, st.bs, st.dim, like=q)
    run(prefill_kernel, (programs, st.kvh),
        (q, k_cache, v_cache, st.out, m, l, acc, st.query_start, st.seq_lens, st.block_table, st.num_seqs,
         int(st.num_seqs).bit_length(), st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window,
         st.cap, st.sinks),
        target=target, KVH=st.kvh, G=st.G, D=st.dim, BS=st.bs, BQ=block_q, PB=PARTITION_BLOCKS,
        MAXP=MAX_PARTITIONS, SOFTCAP=st.use_cap, SKIP_DECODE=skip_decode, SINKS=st.use_sinks)


# CUDA GPUs take the token kernel too: the decode kernel's CPU-shaped loop (one program per sequence walking
# every KV head with its softmax state in a workspace, a barrier per access) took ~830 us per layer for one
# 128-token sequence on an H200; a program per (token, KV head) with the state in registers parallelises
# over heads and tokens. (A flash-decoding GPU kernel split over the key range is the next step.)
GPU_TOKEN_ATTENTION = True


def _token_path(target) -> bool:
    return target is not None and (target.is_vulkan or (target.is_gpu and GPU_TOKEN_ATTENTION))


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
                    validate: bool = True, host_step=None, sinks=None, target=None):
    """Attention for one engine step over a paged KV cache (layouts in the module docstring); returns out.

    sinks: f32 [num_heads] attention-sink logits (gpt-oss), or None: each head's softmax gets one more
    logit, sinks[h], that attends to nothing (out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h]))).

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
    if num_partitions is None or validate:
        decodes = np.diff(st.qs_host) == 1
        need = int(decode_partitions(st.sl_host[decodes], st.bs, st.window).max()) if decodes.any() else 1
        if num_partitions is None:
            num_partitions = 1 << max(need - 1, 0).bit_length()
        elif int(num_partitions) < need:
            raise ValueError(f"num_partitions={num_partitions} is below the {need} partitions a sequence of this "
                             f"step needs (decode_partitions); use at least that, or MAX_PARTITIONS")
    P = int(num_partitions)
    if P < 1 or P > MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {MAX_PARTITIONS}], got {P}")
    if _token_path(target):
        return _vulkan_attention(st, q, k_cache, v_cache, target)
    ws = workspace if workspace is not None else {}
    m, l, acc = _workspace(ws, "decode", st.num_seqs * P * st.heads, st.bs, st.dim, like=q)
    run(decode_kernel, (st.num_seqs, P),
        (q, k_cache, v_cache, st.out, m, l, acc, st.query_start, st.seq_lens, st.block_table,
         st.q_ts, st.q_hs, st.o_ts, st.o_hs, st.bt_stride, st.scale, st.window, st.cap, st.sinks),
        target=target, KVH=st.kvh, G=st.G, D=st.dim, BS=st.bs, NUM_PARTS=P, PB=PARTITION_BLOCKS,
        MAXP=MAX_PARTITIONS, SOFTCAP=st.use_cap, PREFETCH=bool(prefetch), SINKS=st.use_sinks)
    if P > 1:
        run(merge_kernel, (st.num_seqs, st.heads),
            (st.out, m, l, acc, st.query_start, st.seq_lens, st.o_ts, st.o_hs, st.window, st.sinks),
            target=target, H=st.heads, D=st.dim, BS=st.bs, NUM_PARTS=P, PB=PARTITION_BLOCKS, MAXP=MAX_PARTITIONS,
            SINKS=st.use_sinks)
    if max_query_len > 1:
        _launch_prefill(st, q, k_cache, v_cache, ws, PREFILL_BLOCK_Q, True, target)
    return st.out


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
    if not st.empty and _token_path(target):
        return _vulkan_attention(st, q, k_cache, v_cache, target)
    if not st.empty:
        _launch_prefill(st, q, k_cache, v_cache, workspace if workspace is not None else {},
                        int(block_q or PREFILL_BLOCK_Q), False, target)
    return st.out
