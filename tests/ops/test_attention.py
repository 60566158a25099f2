"""Paged attention ops against a float64 numpy reference, on every runnable CPU tier.

The reference gathers each sequence's contiguous K/V from its block table and computes
softmax(q k^T * scale [softcapped] + causal/window mask) v in float64. Block tables are shuffled,
non-contiguous block ids; unused table entries point at blocks full of other data, so reading past a
sequence's blocks shows up as a wrong result. Tolerances: f32 caches rtol 1e-4 / atol 2e-5 (the kernels
accumulate in f32 over up to 300 keys; observed errors ~1e-6); f16 caches hold exactly the values the
reference reads (the cache itself is the f16 data), so the same tolerance applies.
"""
import numpy as np
import pytest

import jitkern as jk
from engine.ops import attention as A
from targets import tuned

BS = 16

# (seq_len, q_len): decodes at total lengths 1, 15, 16, 17, 300, 600; whole prompts of 15/16/17 tokens; a
# 17-token chunk continuing a 283-token cached context; a chunk of 23 after 17 cached; a 10-token chunk after
# 600 (its queries' key ranges span 3 partitions); an empty (padding) sequence
MIXED = [(1, 1), (15, 1), (300, 1), (15, 15), (16, 1), (16, 16), (0, 0), (17, 1), (300, 17), (17, 17), (40, 23),
         (600, 1), (610, 10)]
DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (0, 0), (33, 1), (600, 1)]


def ref_paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, scale, window=0, softcap=0.0,
                        sinks=None):
    T, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    out = np.zeros((T, H, D))
    for i in range(len(seq_lens)):
        L, q0 = int(seq_lens[i]), int(query_start[i])
        ql = int(query_start[i + 1]) - q0
        if ql == 0:
            continue
        blocks = block_table[i, :-(-L // BS)]
        K = k_cache[blocks].reshape(-1, KVH, D)[:L].astype(np.float64)
        V = v_cache[blocks].reshape(-1, KVH, D)[:L].astype(np.float64)
        kpos = np.arange(L)
        for j in range(ql):
            p = L - ql + j
            ok = kpos <= p
            if window:
                ok &= kpos > p - window
            for h in range(H):
                s = K[:, h // G] @ q[q0 + j, h].astype(np.float64) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                s = np.where(ok, s, -np.inf)
                if sinks is None:
                    e = np.exp(s - s.max())
                    out[q0 + j, h] = (e / e.sum()) @ V[:, h // G]
                else:       # the sink logit joins the softmax (HF gpt-oss: concatenated, then dropped)
                    m = max(s.max(), float(sinks[h]))
                    e = np.exp(s - m)
                    out[q0 + j, h] = (e / (e.sum() + np.exp(float(sinks[h]) - m))) @ V[:, h // G]
    return out


def make_step(rng, seqs, H, KVH, D, dtype, extra_blocks=13):
    """A random step: caches with shuffled block ids, q, query_start, seq_lens, block_table."""
    need = [-(-L // BS) for L, _ in seqs]
    width = max(need) + 2
    num_blocks = sum(need) + extra_blocks
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.empty((len(seqs), width), np.int32)
    at = 0
    for i, nb in enumerate(need):
        table[i, :nb] = ids[at:at + nb]
        at += nb
        table[i, nb:] = rng.choice(ids[at:], width - nb)      # valid ids of blocks holding other data
    k_cache = rng.standard_normal((num_blocks, BS, KVH, D)).astype(dtype)
    v_cache = rng.standard_normal((num_blocks, BS, KVH, D)).astype(dtype)
    q_lens = [ql for _, ql in seqs]
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([L for L, _ in seqs], np.int32)
    q = rng.standard_normal((int(query_start[-1]), H, D)).astype(np.float32)
    return q, k_cache, v_cache, query_start, seq_lens, table


def check(out, want):
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_mixed_step_gqa(tier, dtype):
    """SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64): decodes and prefill chunks in one step,
    single-partition and split (flash-decoding) decode, with and without a sliding window."""
    rng = np.random.default_rng(1)
    q, kc, vc, qs, sl, bt = make_step(rng, MIXED, 9, 3, 64, dtype)
    for window in (0, 7):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window)
        for parts in (None, A.MAX_PARTITIONS):
            out = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window,
                                    num_partitions=parts, target=tier)
            check(out, want)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (5, 1, 64), (6, 2, 128)], ids=["mha", "mqa", "gqa128"])
def test_mixed_step_head_layouts(tier, heads, kv_heads, dim):
    rng = np.random.default_rng(2)
    q, kc, vc, qs, sl, bt = make_step(rng, MIXED, heads, kv_heads, dim, np.float32)
    scale = dim ** -0.5
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, scale)
    check(A.paged_attention(q, kc, vc, qs, sl, bt, scale=scale, target=tier), want)
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, scale, window=16)
    check(A.paged_attention(q, kc, vc, qs, sl, bt, scale=scale, sliding_window=16, target=tier), want)


def test_softcap(tier):
    rng = np.random.default_rng(3)
    q, kc, vc, qs, sl, bt = make_step(rng, MIXED, 9, 3, 64, np.float32)
    q *= 3.0                                            # large logits, so the cap matters
    for window in (0, 17):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window, softcap=5.0)
        assert np.abs(want - ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window)).max() > 0.05
        out = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, softcap=5.0,
                                target=tier)
        check(out, want)


def test_attention_sinks(tier):
    """gpt-oss attention sinks on every path (single- and multi-partition decode, prefill chunks, the general
    kernel alone), with and without a window; sinks from well below to well above the logits (a sink that
    dominates shrinks the output towards 0). The decode path and the general kernel agree bit for bit, and a
    sequence alone gives the same bits as in the batch."""
    rng = np.random.default_rng(11)
    H, KVH = 8, 2
    q, kc, vc, qs, sl, bt = make_step(rng, MIXED, H, KVH, 64, np.float32)
    sinks = (np.linspace(-4.0, 8.0, H) + rng.standard_normal(H)).astype(np.float32)
    for window in (0, 17):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window, sinks=sinks)
        assert np.abs(want - ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window)).max() > 0.05
        outs = []
        for parts in (None, A.MAX_PARTITIONS):
            outs.append(A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, sinks=sinks,
                                          num_partitions=parts, target=tier))
            check(outs[-1], want)
        np.testing.assert_array_equal(outs[0], outs[1])
        gen = A.paged_prefill_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, sinks=sinks,
                                        target=tier)
        np.testing.assert_array_equal(gen, outs[0])
        for i in (11, 12, 8):      # a 3-partition decode, a chunk after 600 cached, a 17-token chunk: alone
            alone = A.paged_attention(q[qs[i]:qs[i + 1]], kc, vc, np.array([0, qs[i + 1] - qs[i]], np.int32),
                                      sl[i:i + 1], np.ascontiguousarray(bt[i:i + 1]), scale=0.125,
                                      sliding_window=window, sinks=sinks, target=tier)
            np.testing.assert_array_equal(alone, outs[0][qs[i]:qs[i + 1]])
    with pytest.raises(ValueError, match="sinks"):
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, sinks=sinks[:3], target=tier)


def test_decode_partition_axis(tier):
    """Pure decode steps (the fast path alone): sequences split into their own partitions (1 to 3 here),
    launched on partition axes of several lengths (programs past a sequence's partitions do nothing)."""
    rng = np.random.default_rng(4)
    q, kc, vc, qs, sl, bt = make_step(rng, DECODES, 9, 3, 64, np.float16)
    assert list(A.decode_partitions(sl, BS)) == [1, 1, 1, 1, 2, 0, 1, 3]
    need = int(A.decode_partitions(sl, BS, partition_blocks=A.partition_blocks_for(tier)).max())   # GPUs: 10
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125)
    outs = []
    for parts in (None, need, need + 1, A.MAX_PARTITIONS):
        out = np.full_like(q, np.nan)
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, max_query_len=1, num_partitions=parts,
                          target=tier)
        check(out, want)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    with pytest.raises(ValueError, match=f"num_partitions={need - 1} is below the {need} partitions"):
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, num_partitions=need - 1, target=tier)


def test_batch_invariance(tier):
    """Every output row is bit-identical whether its sequence runs alone or in batches of other sizes and
    orders, and whether a query runs as a decode (decode kernel) or as the last token of a prefill chunk
    (prefill kernel): the split of a key range depends on the query's own position only."""
    rng = np.random.default_rng(9)
    H, KVH, D = 9, 3, 64
    seqs = [(600, 1), (17, 17), (300, 1), (610, 10), (16, 1), (40, 23), (1, 1), (300, 17)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, np.float32)
    for window in (0, 300):
        full = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, target=tier)
        rows = [full[qs[i]:qs[i + 1]] for i in range(len(seqs))]
        for pick in ([3], [0], [6], [5, 1], [7, 0, 2], [2, 4, 0, 6, 1]):     # alone, then other batches
            sub_q = np.concatenate([q[qs[i]:qs[i + 1]] for i in pick])
            sub_qs = np.concatenate([[0], np.cumsum([seqs[i][1] for i in pick])]).astype(np.int32)
            out = A.paged_attention(sub_q, kc, vc, sub_qs, sl[pick], np.ascontiguousarray(bt[pick]), scale=0.125,
                                    sliding_window=window, num_partitions=A.MAX_PARTITIONS if len(pick) > 2 else None,
                                    target=tier)
            for k, i in enumerate(pick):
                np.testing.assert_array_equal(out[sub_qs[k]:sub_qs[k + 1]], rows[i])
        # the last token of the 17-token chunk at position 299 (seq 7) as a decode of a 300-token sequence
        dec = A.paged_attention(q[qs[8] - 1:qs[8]], kc, vc, np.array([0, 1], np.int32), np.array([300], np.int32),
                                np.ascontiguousarray(bt[7:8]), scale=0.125, sliding_window=window, target=tier)
        np.testing.assert_array_equal(dec[0], full[qs[8] - 1])
        # and the general kernel alone (decodes included) agrees bit for bit with the decode path
        gen = A.paged_prefill_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, target=tier)
        np.testing.assert_array_equal(gen, full)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_prefill_token_groups_are_bit_identical_to_single_tokens(tier, dtype):
    """CPU tiers run a prefill tile's tokens in groups of tuning.prefill_token_group whose positions share a cache
    block (K^T of a block once per group, scores with the keys in the vector lanes, P @ V a column chunk at
    a time), and deal the tiles in _balanced_tile's order: every row equals the kernel with groups off and
    in grid order, and the decode of that position, bit for bit: whole prompts (partitions from 256 tokens),
    chunks starting mid-block (a group per block the tile touches), sinks, softcap, groups smaller than a
    tile, head_dim 48; a sliding window runs every token alone."""
    if getattr(tier, "is_gpu", False):
        pytest.skip("token groups are a CPU-tier path")
    rng = np.random.default_rng(21)
    seqs = [(700, 700), (300, 37), (45, 29), (5, 5)]
    for H, KVH, D, tq, kws in ((9, 3, 64, 16, ("", "sinks", "window")), (8, 2, 48, 8, ("softcap",))):
        q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, dtype)
        sinks = rng.standard_normal(H).astype(np.float32)
        grouped_t = tuned(tier, prefill_token_group=tq)
        alone_t = tuned(tier, prefill_token_group=0, prefill_balance=False)
        every = {"": dict(), "sinks": dict(sinks=sinks), "softcap": dict(softcap=2.5),
                 "window": dict(sliding_window=100)}
        for kw in (every[k] for k in kws):
            what = f"H={H} KVH={KVH} D={D} TQ={tq} {kw}"
            grouped = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, target=grouped_t, **kw)
            alone = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, target=alone_t, **kw)
            np.testing.assert_array_equal(grouped, alone, err_msg=what)
            if not kw:
                check(grouped, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))
            for i, row in ((0, 8), (0, 300), (0, 699), (1, 20), (2, 3)):     # rows inside groups, as decodes
                L, ql = seqs[i]
                pos = L - ql + row
                dec = A.paged_attention(q[qs[i] + row:qs[i] + row + 1], kc, vc, np.array([0, 1], np.int32),
                                        np.array([pos + 1], np.int32), np.ascontiguousarray(bt[i:i + 1]),
                                        scale=0.125, target=tier, **kw)
                np.testing.assert_array_equal(dec[0], grouped[qs[i] + row], err_msg=f"{what} seq {i} row {row}")


def test_prefill_kernel_handles_every_sequence(tier):
    """paged_prefill_attention runs the general kernel alone, decodes included."""
    rng = np.random.default_rng(5)
    q, kc, vc, qs, sl, bt = make_step(rng, MIXED, 9, 3, 64, np.float32)
    for window in (0, 5):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125, window=window)
        check(A.paged_prefill_attention(q, kc, vc, qs, sl, bt, scale=0.125, sliding_window=window, target=tier),
              want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_reshape_and_cache_from_fused_qkv(tier, dtype):
    """New K/V rows taken as strided views of a fused qkv output are written at their slots (-1 skipped),
    then attention reads q from the same fused buffer and writes a strided out view."""
    rng = np.random.default_rng(6)
    H, KVH, D = 9, 3, 64
    seqs = [(17, 17), (300, 5), (16, 1), (33, 1)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, dtype)
    T = q.shape[0]
    qkv = rng.standard_normal((T + 1, (H + 2 * KVH) * D + 8)).astype(np.float32)[1:]   # rows padded: strided
    k_new = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D)
    v_new = qkv[:, (H + KVH) * D:(H + 2 * KVH) * D].reshape(T, KVH, D)
    slots = []
    for i, (L, ql) in enumerate(seqs):
        for p in range(L - ql, L):
            slots.append(bt[i, p // BS] * BS + p % BS)
    slots = np.array(slots, np.int32)
    slots[3] = -1                                       # a skipped token keeps the old cache contents
    kc_before, vc_before = kc.copy(), vc.copy()
    A.reshape_and_cache(k_new, v_new, kc, vc, slots, target=tier)
    want_k, want_v = kc_before.reshape(-1, KVH, D).copy(), vc_before.reshape(-1, KVH, D).copy()
    keep = slots >= 0
    want_k[slots[keep]] = k_new[keep].astype(dtype)     # numpy's f16 rounding: round to nearest even
    want_v[slots[keep]] = v_new[keep].astype(dtype)
    np.testing.assert_array_equal(kc.reshape(-1, KVH, D), want_k)
    np.testing.assert_array_equal(vc.reshape(-1, KVH, D), want_v)

    qv = qkv[:, :H * D].reshape(T, H, D)
    out_buf = np.full((T, H * D + 5), np.nan, np.float32)
    out = out_buf[:, :H * D].reshape(T, H, D)
    A.paged_attention(qv, kc, vc, qs, sl, bt, scale=0.125, out=out, target=tier)
    check(out, ref_paged_attention(np.ascontiguousarray(qv), kc, vc, qs, sl, bt, 0.125))
    assert np.isnan(out_buf[:, H * D:]).all()


def test_capture_replay_with_new_step_arrays(tier):
    """The launches of a step recorded once replay correctly after the step arrays change in place."""
    if tier.is_gpu:
        pytest.skip("replays that read host arrays changed in place are the CPU graph's contract; CUDA graphs "
                    "replay device arrays (tests/test_cuda_runtime.py)")
    rng = np.random.default_rng(7)
    q, kc, vc, qs, sl, bt = make_step(rng, [(300, 1), (40, 1), (17, 1), (5, 1)], 9, 3, 64, np.float32)
    out = np.zeros_like(q)
    ws = {}
    with jk.capture() as graph:
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, max_query_len=1,
                          num_partitions=A.MAX_PARTITIONS, workspace=ws, target=tier)
    assert len(graph) == 2 and not out.any()
    graph.replay()
    check(out, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))
    sl[:] = [301, 12, 18, 0]                          # next step: contexts grow, one sequence finished
    qs[:] = [0, 1, 2, 3, 3]
    bt[:] = np.roll(bt, 1, axis=0)
    q[:] = rng.standard_normal(q.shape)
    out[:] = 0
    graph.replay()
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125)
    check(out[:3], want[:3])
    assert not out[3].any()                           # the finished (empty) sequence wrote nothing


def test_errors_name_the_bad_argument():
    rng = np.random.default_rng(8)
    q, kc, vc, qs, sl, bt = make_step(rng, [(20, 1)], 9, 3, 64, np.float32)
    with pytest.raises(TypeError, match="block_table"):
        A.paged_attention(q, kc, vc, qs, sl, bt.astype(np.int64), scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        A.paged_attention(q[:, :8], kc, vc, qs, sl, bt, scale=1.0)
    with pytest.raises(ValueError, match="block_table has 2 columns"):
        A.paged_attention(q, kc, vc, qs, np.array([40], np.int32), bt[:, :2], scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        A.paged_attention(q, kc, vc, np.array([0, 1], np.int32), np.array([0], np.int32), bt, scale=1.0)
    with pytest.raises(TypeError, match="v_cache"):
        A.paged_attention(q, kc, vc.astype(np.float64), qs, sl, bt, scale=1.0)
    with pytest.raises(ValueError, match="num_partitions"):
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=1.0, num_partitions=A.MAX_PARTITIONS + 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        A.reshape_and_cache(q[:, :3], q[:, :3], kc, vc, np.zeros(5, np.int32))


def _run_programs(entry, begin, end):
    """Programs [begin, end) of a recorded CPU launch (what one thread of the pool runs)."""
    import ctypes
    addr, block, _ = entry
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(addr)(
        block.__array_interface__["data"][0], begin, end)


def _record_decode_step(tier, q, kc, vc, qs, sl, bt, P):
    """A decode step's attention recorded, not run: (out filled with NaN, the workspace, the graph)."""
    out = np.full_like(q, np.nan)
    ws = {}
    with jk.capture() as graph:
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, max_query_len=1, num_partitions=P,
                          workspace=ws, target=tier)
    return out, ws, graph


def test_decode_grid_splits_work_over_thread_chunks(tier):
    """The CPU pool gives each thread a contiguous chunk of the flat program ids. A batch of short decodes
    (one partition each) must put whole sequences in each chunk, and one long sequence's partitions must
    spread over the chunks (bit-reversed order): run the two halves of the grid separately and check which
    outputs / partial states each half wrote, then that the halves together give the reference. (The grid
    without the per-KV-head split, which batches of fewer sequences than threads take: see below.)"""
    if tier.is_gpu:
        pytest.skip("thread chunks of the CPU pool")
    tier = tuned(tier, decode_head_split=False)
    rng = np.random.default_rng(21)
    H, KVH, D, P = 9, 3, 64, A.MAX_PARTITIONS
    seqs = [(int(L), 1) for L in rng.integers(20, 200, 6)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, np.float32)
    out, ws, graph = _record_decode_step(tier, q, kc, vc, qs, sl, bt, P)
    dec = graph.entries[0]
    n = dec[2]
    assert n == P * len(seqs)
    _run_programs(dec, 0, n // 2)                      # thread 0 of 2: the first 3 sequences, whole
    assert not np.isnan(out[:3]).any() and np.isnan(out[3:]).all()
    _run_programs(dec, n // 2, n)
    check(out, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))
    # one sequence of 4 partitions (4 x 256 keys) on a 16-partition axis: each half runs 2 of them
    q, kc, vc, qs, sl, bt = make_step(rng, [(1000, 1)], H, KVH, D, np.float32)
    assert list(A.decode_partitions(sl, BS)) == [4]
    out, ws, graph = _record_decode_step(tier, q, kc, vc, qs, sl, bt, P)
    dec, merge = graph.entries
    m = ws["decode"][1].reshape(P, H)                  # each partition's running max per head
    m[:] = np.nan
    _run_programs(dec, 0, P // 2)
    assert [p for p in range(4) if not np.isnan(m[p]).any()] == [0, 2]
    _run_programs(dec, P // 2, P)
    assert not np.isnan(m[:4]).any()
    _run_programs(merge, 0, merge[2])
    check(out, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))


def test_decode_head_split_spreads_one_sequence_over_threads(tier, monkeypatch):
    """Fewer sequences than pool threads: decode_kernel runs a program per (KV head, partition) (HSPLIT), so
    one short sequence's heads land in different thread chunks (the first half of the grid: KV heads 0 and 1 of
    3, the second: head 2), with the same bits as the grid of whole-sequence programs, for a short context (one
    partition, written directly) and a long one (partitions + merge)."""
    if tier.is_gpu:
        pytest.skip("thread chunks of the CPU pool")
    from jitkern.runtime.cpu_pool import CpuPool
    pool = CpuPool(4)
    monkeypatch.setattr("jitkern.runtime.cpu_pool._pool", pool)     # 1 sequence < 4 threads
    try:
        _check_head_split(tier)
    finally:
        pool.close()


def _check_head_split(tier):
    rng = np.random.default_rng(23)
    H, KVH, D, P = 9, 3, 64, A.MAX_PARTITIONS
    for ctx in (150, 1000):
        q, kc, vc, qs, sl, bt = make_step(rng, [(ctx, 1)], H, KVH, D, np.float32)
        want = {}
        for split in (False, True):
            out, _, graph = _record_decode_step(tuned(tier, decode_head_split=split), q, kc, vc, qs, sl, bt, P)
            dec = graph.entries[0]
            assert dec[2] == P * (KVH if split else 1)
            if split and ctx == 150:
                _run_programs(dec, 0, dec[2] // 2)
                assert not np.isnan(out[:, :6]).any() and np.isnan(out[:, 6:]).all()
                _run_programs(dec, dec[2] // 2, dec[2])
            else:
                graph.replay()
            want[split] = out.copy()
        np.testing.assert_array_equal(want[True], want[False])
        check(want[True], ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))


@pytest.mark.parametrize("tq", [16, 0], ids=["groups", "alone"])
def test_prefill_merge_rows_is_bit_identical(tier, tq):
    """CPU tiers merge a prefill token's partitions with _merge_rows over the smallest power of two that holds
    them (tuning.prefill_merge = 1; partitions that do not exist read a row of -0.0): every row equals
    _merge_parts over MAX_PARTITIONS lanes (prefill_merge = 0) and the decode of its position, bit for bit,
    for 2 .. 16 partitions (contexts of 300 to 4,100 tokens: NP 2, 4, 8 and 16, full and padded), with
    groups and per token, with sinks and a sliding window."""
    if getattr(tier, "is_gpu", False):
        pytest.skip("the row merge is a CPU-tier path")
    rng = np.random.default_rng(33)
    seqs = [(4100, 20), (2100, 7), (3000, 33), (1500, 30), (700, 17), (300, 5)]   # partitions 16, 9, 12, 6, 3, 2
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, 9, 3, 64, np.float16)
    sinks = rng.standard_normal(9).astype(np.float32)
    tier = tuned(tier, prefill_token_group=tq)
    for kw in (dict(), dict(sinks=sinks), dict(sliding_window=2500)):
        rows = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, target=tuned(tier, prefill_merge=1), **kw)
        lanes = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, target=tuned(tier, prefill_merge=0), **kw)
        np.testing.assert_array_equal(rows, lanes, err_msg=str(kw))
        if not kw:
            check(rows, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))
        for i, row in ((0, 19), (1, 0), (2, 17), (3, 29), (4, 8), (5, 4)):
            pos = seqs[i][0] - seqs[i][1] + row
            dec = A.paged_attention(q[qs[i] + row:qs[i] + row + 1], kc, vc, np.array([0, 1], np.int32),
                                    np.array([pos + 1], np.int32), np.ascontiguousarray(bt[i:i + 1]), scale=0.125,
                                    target=tier, **kw)
            np.testing.assert_array_equal(dec[0], rows[qs[i] + row], err_msg=f"{kw} seq {i} row {row}")


def _pages_written(a) -> bool:
    """Every page of host array a is mapped exclusively to this process (/proc/self/pagemap bit 56): written,
    not unmapped and not the shared zero page that a read of a never-written page maps."""
    import os
    import struct
    ps = os.sysconf("SC_PAGE_SIZE")
    addr = a.__array_interface__["data"][0]
    first, last = addr // ps, (addr + a.nbytes - 1) // ps
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        ent = struct.unpack(f"{last - first + 1}Q", f.read((last - first + 1) * 8))
    return all((e >> 56) & 1 for e in ent)


def test_decode_workspace_pages_are_written_at_allocation():
    """The decode workspace's rows past a sequence's partitions only ever see masked-off stores, which take a
    slow path on pages never written: its pages are written when it is allocated, and the outputs are right."""
    import os
    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("no /proc/self/pagemap")
    rng = np.random.default_rng(9)
    q, kc, vc, qs, sl, bt = make_step(rng, [(101, 1)] * 16, 9, 3, 64, np.float16)
    ws = {}
    out = np.full_like(q, np.nan)
    A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, max_query_len=1,
                      num_partitions=A.MAX_PARTITIONS, workspace=ws)
    assert all(_pages_written(a) for a in ws["decode"][1:])
    check(out, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))


def test_decode_idle_programs_skip_and_same_bits(tier):
    """CPU decode programs past their sequence's partitions, and merge programs of sequences with one partition,
    return at once (tuning.decode_skip_idle): outputs equal the kernels without the skip bit for bit, on a partition axis
    of MAX_PARTITIONS with 0 to 3 partitions a sequence (so some sequences are merged and some are not)."""
    rng = np.random.default_rng(11)
    q, kc, vc, qs, sl, bt = make_step(rng, DECODES, 9, 3, 64, np.float16)
    outs = []
    for skip in (False, True):
        out = np.full_like(q, np.nan)
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, max_query_len=1,
                          num_partitions=A.MAX_PARTITIONS, target=tuned(tier, decode_skip_idle=skip))
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])
    check(outs[1], ref_paged_attention(q, kc, vc, qs, sl, bt, 0.125))


@pytest.mark.parametrize("layout", ["natural", "q4x4"])
def test_q8_out_is_quantize_q8_of_the_output(tier, layout, monkeypatch):
    """paged_attention(q8_out=): the output also written quantised for a GGUF o projection, as quantize_q8 of
    the f32 output (bit for bit, in the linear's layout, with and without the 4-fold scales). Decode-only steps
    on a partition axis > 1 write it from the merge kernel (CPU tiers; the flash merge on GPUs): no quantize_q8
    launch; other steps, and Vulkan's token kernel, quantise after the attention."""
    from engine.ops import quant as Q
    rng = np.random.default_rng(31)
    quantised_after = []
    real = A._quantize_out
    monkeypatch.setattr(A, "_quantize_out", lambda *a: (quantised_after.append(1), real(*a)))
    for seqs, mql, parts in ((DECODES, 1, A.MAX_PARTITIONS), (DECODES, 1, None), (MIXED, None, A.MAX_PARTITIONS)):
        q, kc, vc, qs, sl, bt = make_step(rng, seqs, 9, 3, 64, np.float16)
        T, K = q.shape[0], 9 * 64
        want = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, num_partitions=parts, max_query_len=mql,
                                 target=tier)
        for rep4 in (False, True):
            ref = Q.quantize_q8(np.ascontiguousarray(want.reshape(T, K)), layout=layout, rep4=rep4, target=tier)
            got = Q.Q8Activations(np.full((T, K), 77, np.int8), np.full((T, K // 32), np.nan, np.float32),
                                  np.full((T, K // 32), np.nan, np.float32), layout,
                                  *([np.full((T, K // 8), np.nan, np.float32) for _ in range(2)] if rep4 else []))
            del quantised_after[:]
            out = A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, num_partitions=parts, max_query_len=mql,
                                    target=tier, q8_out=got)
            np.testing.assert_array_equal(out, want)
            for g, w in zip(list(got) + ([got.scales4, got.sums4] if rep4 else []),
                            list(ref) + ([ref.scales4, ref.sums4] if rep4 else [])):
                np.testing.assert_array_equal(g, w, err_msg=f"{len(seqs)} seqs, parts {parts}, rep4 {rep4}")
            # (DECODES splits up to 3 ways: P > 1 either way; Vulkan's token kernel has no merge)
            in_merge = mql == 1 and not tier.costly_workgroups
            assert quantised_after == ([] if in_merge else [1])
    with pytest.raises(ValueError, match="q8_out: arrays for a"):
        A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, target=tier,
                          q8_out=Q.Q8Activations(np.zeros((T, 64), np.int8), np.zeros((T, 2), np.float32),
                                                 np.zeros((T, 2), np.float32)))


def test_workspace_grows_and_smaller_steps_share_it(tier):
    """The softmax-state workspace is grown, never shrunk: a smaller step after a larger one runs on the first
    rows of the same arrays (so graphs recorded for other batch sizes share them) and gives the same results
    as on a fresh workspace."""
    if tier.costly_workgroups:
        pytest.skip("Vulkan's token kernel keeps no workspace")
    rng = np.random.default_rng(41)
    q, kc, vc, qs, sl, bt = make_step(rng, DECODES, 9, 3, 64, np.float16)
    ws = {}
    A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, max_query_len=1, num_partitions=A.MAX_PARTITIONS,
                      workspace=ws, target=tier)
    held = {k: tuple(id(a) for a in v[1:]) for k, v in ws.items()}
    n = 3                                                        # the first 3 sequences alone
    q3, qs3, sl3, bt3 = q[:int(qs[n])], qs[:n + 1], sl[:n], bt[:n]
    want = A.paged_attention(q3, kc, vc, qs3, sl3, bt3, scale=0.125, max_query_len=1,
                             num_partitions=A.MAX_PARTITIONS, workspace={}, target=tier)
    got = A.paged_attention(q3, kc, vc, qs3, sl3, bt3, scale=0.125, max_query_len=1,
                            num_partitions=A.MAX_PARTITIONS, workspace=ws, target=tier)
    np.testing.assert_array_equal(got, want)
    assert held and {k: tuple(id(a) for a in v[1:]) for k, v in ws.items()} == held
