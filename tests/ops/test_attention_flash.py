"""The GPU flash attention kernels (flash_decode_kernel + flash_merge_kernel, flash_prefill_kernel) against the
float64 reference of tests/ops/test_attention.py, on every runnable CPU tier (flash_paged_attention runs
them on any target) and on the GPU (marked `gpu`), where paged_attention itself dispatches to them.

Shapes are small (head_dim 16/32) to keep CPU compiles short, with odd lengths, several decode partitions
(tuning.flash_partition_blocks = 4 blocks of 16: a 300-token context is 5 partitions), GQA ratios 1/3/5 (5 pads to 8
rows per group), block sizes 16 and 32, windows, softcap and sinks, f32 caches with and without the f16
hi + lo split the GPUs with matrix units use, and f16 caches. Tolerances as in test_attention.py (rtol 1e-4,
atol 2e-5): the split keeps ~22 significant bits of each operand (observed errors ~1e-6). The split
variants run on the highest CPU tier only (slow f16 conversions on SSE tiers).

CPU tiers: these kernels are the GPU's (GPU tile shapes; the engine runs the CPU kernels of test_attention.py on
CPU tiers), so their arithmetic is checked on one CPU tier, this host's highest, not on every tier: the `tier`
fixture below overrides conftest's. The per-tier lowering of the same DSL operations is covered by
tests/test_dsl.py and the CPU kernels' tests on every tier.

Batch invariance (assert_array_equal): a sequence's rows alone equal its rows in batches of other sizes
and orders, on partition axes of several lengths, with several prefill tile heights (block_m), and a token's
bits are the same as a decode (decode + merge kernels) or as a row of a prefill tile (decode=False).
"""
import numpy as np
import pytest

from engine.ops import attention as A
from targets import tuned

from .test_attention import BS, check, make_step, ref_paged_attention

# (seq_len, q_len): decodes of 1, 15, 16, 17, 300 (5 partitions), 70 (2), 600 (10); whole prompts of 15
# and 17 tokens; a 17-token chunk after 283 cached; 23 after 17; 10 after 600; an empty (padding) sequence
SEQS = [(1, 1), (15, 1), (300, 1), (15, 15), (16, 1), (0, 0), (17, 1), (300, 17), (17, 17), (40, 23), (70, 1),
        (600, 1), (610, 10)]


def _flash_tier_params():
    """conftest's all_tier_params() with the CPU tiers reduced to the highest runnable one; GPU and Vulkan as there."""
    from tests.conftest import all_tier_params, runnable_tiers
    cpu = runnable_tiers()
    return [p for p in all_tier_params() if p.values[0] not in cpu[:-1]]


@pytest.fixture(params=_flash_tier_params())
def tier(request):
    from targets import get_target
    return get_target(request.param)


def _flash(tier, q, kc, vc, qs, sl, bt, **kw):
    return A.flash_paged_attention(q, kc, vc, qs, sl, bt, target=tier, **kw)


def _skip_split_on_lower_tiers(tier, split):
    """The f16 hi + lo split runs on the GPU and on this host's highest CPU tier only (its f16 conversions
    compile slowly on the SSE tiers; the arithmetic is the same on every tier)."""
    from tests.conftest import runnable_tiers
    if split and not tier.is_gpu and tier.name != runnable_tiers()[-1]:
        pytest.skip("split: checked on the highest CPU tier and the GPU")


@pytest.mark.parametrize("dtype,split", [(np.float32, False), (np.float32, True), (np.float16, False)],
                         ids=["f32", "f32-split", "f16"])
def test_flash_matches_reference(tier, dtype, split):
    """GQA 3 (9 query / 3 KV heads, head_dim 32): mixed decodes and prefill chunks, windows 0 and 7, the
    default tile height and a 4-token one."""
    _skip_split_on_lower_tiers(tier, split)
    rng = np.random.default_rng(21)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 9, 3, 32, dtype)
    for window in (0, 7):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.17, window=window)
        for block_m in (None, 4):
            out = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.17, sliding_window=window, block_m=block_m,
                         split=split)
            check(out, want)


@pytest.mark.parametrize("heads,kv_heads,dim", [(5, 1, 32), (4, 4, 16), (8, 2, 16)], ids=["mqa5", "mha", "gqa4"])
def test_flash_head_groups(tier, heads, kv_heads, dim):
    """A group of 5 query heads (padded to 8 rows), MHA, GQA 4, through paged_attention's own dispatch on a
    GPU (flash_paged_attention on CPU tiers)."""
    rng = np.random.default_rng(22)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, heads, kv_heads, dim, np.float32)
    scale = dim ** -0.5
    run = A.paged_attention if tier.is_gpu else A.flash_paged_attention
    for window in (0, 16):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, scale, window=window)
        check(run(q, kc, vc, qs, sl, bt, scale=scale, sliding_window=window, target=tier), want)


def test_flash_block_size_32(tier, monkeypatch):
    """Cache blocks of 32 tokens (the kernels step one block at a time; partitions are 4 blocks of 32)."""
    from . import test_attention as T
    rng = np.random.default_rng(23)
    monkeypatch.setattr(T, "BS", 32)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 6, 2, 16, np.float32)
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25)
    assert kc.shape[1] == 32
    out = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=2)
    check(out, want)
    np.testing.assert_array_equal(_flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=2, decode=False), out)


def test_flash_softcap_and_sinks(tier):
    rng = np.random.default_rng(24)
    H, KVH = 6, 2
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, H, KVH, 16, np.float32)
    q *= 3.0
    sinks = (np.linspace(-4.0, 8.0, H) + rng.standard_normal(H)).astype(np.float32)
    for window in (0, 17):
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window, softcap=5.0, sinks=sinks)
        assert np.abs(want - ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window)).max() > 0.05
        out = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=window, softcap=5.0, sinks=sinks,
                     block_m=4)
        check(out, want)
        gen = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=window, softcap=5.0, sinks=sinks,
                     block_m=4, decode=False)
        np.testing.assert_array_equal(gen, out)


@pytest.mark.parametrize("split", [False, True], ids=["plain", "split"])
def test_flash_batch_invariance(tier, split):
    """Rows alone = rows in other batches (sizes, orders, partition axes, tile heights); a decode's bits =
    the same token as the last row of a prefill chunk; the prefill kernel alone = the decode path."""
    _skip_split_on_lower_tiers(tier, split)
    rng = np.random.default_rng(25)
    H, KVH, D = 9, 3, 16
    seqs = [(600, 1), (17, 17), (300, 1), (610, 10), (16, 1), (40, 23), (1, 1), (300, 17), (70, 1)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, np.float32)
    kw = dict(scale=0.25, split=split)
    for window in (0, 100):
        full = _flash(tier, q, kc, vc, qs, sl, bt, sliding_window=window, block_m=4, **kw)
        check(full, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window))
        rows = [full[qs[i]:qs[i + 1]] for i in range(len(seqs))]
        for pick, bm in (([3], 2), ([0], 4), ([8], 4), ([5, 1], 8), ([7, 0, 2], 2), ([2, 4, 0, 6, 1], 4)):
            sub_q = np.concatenate([q[qs[i]:qs[i + 1]] for i in pick])
            sub_qs = np.concatenate([[0], np.cumsum([seqs[i][1] for i in pick])]).astype(np.int32)
            out = _flash(tier, sub_q, kc, vc, sub_qs, sl[pick], np.ascontiguousarray(bt[pick]), sliding_window=window,
                         num_partitions=A.MAX_PARTITIONS if len(pick) > 2 else None, block_m=bm, **kw)
            for k, i in enumerate(pick):
                np.testing.assert_array_equal(out[sub_qs[k]:sub_qs[k + 1]], rows[i])
        # the last token of the 17-token chunk ending at position 299 (seq 7) as a decode of 300 tokens
        dec = _flash(tier, q[qs[8] - 1:qs[8]], kc, vc, np.array([0, 1], np.int32), np.array([300], np.int32),
                     np.ascontiguousarray(bt[7:8]), sliding_window=window, **kw)
        np.testing.assert_array_equal(dec[0], full[qs[8] - 1])
        # the prefill kernel alone over every sequence, decodes included
        gen = _flash(tier, q, kc, vc, qs, sl, bt, sliding_window=window, block_m=8, decode=False, **kw)
        np.testing.assert_array_equal(gen, full)


@pytest.mark.parametrize("storage", [np.uint16, np.float16], ids=["bf16", "f16"])
def test_flash_16bit_out(tier, storage):
    """A 16-bit `out` (uint16 = bf16, float16; the engine's o projection input, decoder.GPU_X16_ATTN): the decode,
    merge and prefill kernels store their f32 results rounded to nearest even, bit for bit the f32 result
    rounded (what the tensor-core linear would round it to); strided rows too. Paths that are not the flash
    kernels refuse it in one line naming `out`."""
    from tests.ops.ref_basic import to_bf16
    rng = np.random.default_rng(31)
    H, KVH, D = 6, 2, 16
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, H, KVH, D, np.float32)
    T = q.shape[0]
    full = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=4)
    want = to_bf16(full) if storage == np.uint16 else full.astype(np.float16)
    wide = np.zeros((T, H, D + 8), storage)                   # rows 8 elements apart beyond the heads
    for out in (np.zeros((T, H, D), storage), wide[:, :, :D]):
        got = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=4, out=out)
        assert got is out
        np.testing.assert_array_equal(got, want)
    assert not wide[:, :, D:].any()
    if not tier.is_gpu:
        with pytest.raises(ValueError, match="out: a 16-bit output"):
            A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.25, out=np.zeros((T, H, D), storage), target=tier)


@pytest.mark.parametrize("dtype,split", [(np.float16, False), (np.float32, True)], ids=["f16", "f32-split"])
def test_flash_16bit_operands(tier, dtype, split, monkeypatch):
    """GPU_FLASH_OPERANDS = "16bit": q and the probabilities enter the dots as f16. Within f16's rounding of
    the reference (and measurably apart from the f32 setting: the rounding is applied); a decode's bits = the
    same token as the last row of a prefill chunk; the prefill kernel alone = the decode path; rows alone =
    batched."""
    _skip_split_on_lower_tiers(tier, split)
    rng = np.random.default_rng(29)
    seqs = [(600, 1), (17, 17), (300, 1), (610, 10), (16, 1), (40, 23), (1, 1), (300, 17), (70, 1)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, 9, 3, 16, dtype)
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25)
    f32 = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=4, split=split)
    monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", "16bit")
    full = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=4, split=split)
    err16, err32 = np.abs(full - want).max(), np.abs(f32 - want).max()
    assert err16 < 3e-3 * np.abs(want).max(), err16
    assert err16 > 4 * err32, (err16, err32)
    dec = _flash(tier, q[qs[8] - 1:qs[8]], kc, vc, np.array([0, 1], np.int32), np.array([300], np.int32),
                 np.ascontiguousarray(bt[7:8]), scale=0.25, split=split)
    np.testing.assert_array_equal(dec[0], full[qs[8] - 1])
    np.testing.assert_array_equal(_flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=8, decode=False,
                                         split=split), full)
    pick = [5, 2, 0]
    sub_q = np.concatenate([q[qs[i]:qs[i + 1]] for i in pick])
    sub_qs = np.concatenate([[0], np.cumsum([seqs[i][1] for i in pick])]).astype(np.int32)
    out = _flash(tier, sub_q, kc, vc, sub_qs, sl[pick], np.ascontiguousarray(bt[pick]), scale=0.25, block_m=2,
                 num_partitions=A.MAX_PARTITIONS, split=split)
    for k, i in enumerate(pick):
        np.testing.assert_array_equal(out[sub_qs[k]:sub_qs[k + 1]], full[qs[i]:qs[i + 1]])
    monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", "f16")
    with pytest.raises(ValueError, match="GPU_FLASH_OPERANDS"):
        _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25)


def _same_bits_with_switch(tier, switch, dtype, split, ops, seed, monkeypatch):
    """The flash kernels with the tuning entry `switch` (targets/tuning.py, read by the GPU lowering) off and on:
    decodes, prefill tiles and windows give the same bits, and match the float64 reference within 16-bit
    rounding."""
    if not tier.fast_workgroups:
        pytest.skip("MMA fragments exist on CUDA/HIP GPUs only")
    monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", ops)
    rng = np.random.default_rng(seed)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 8, 2, 32, dtype)
    for window in (0, 40):
        outs = []
        for on in (False, True):
            outs.append(_flash(tuned(tier, **{switch: on}), q, kc, vc, qs, sl, bt, scale=0.25,
                               sliding_window=window, block_m=8, split=split))
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window)
        assert np.abs(outs[1] - want).max() < 3e-3 * np.abs(want).max()
        np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("dtype,split,ops", [(np.float16, False, "16bit"), (np.float32, True, "16bit"),
                                              (np.float16, False, "f32")], ids=["f16", "f32-split", "f16-f32ops"])
def test_flash_fragment_ops_give_the_same_bits(tier, dtype, split, ops, monkeypatch):
    """The online-softmax accumulator and scores kept in the MMA registers (backends/gpu_fragments.py FragV:
    `acc * alpha[:, None]`, the prefill tile's partition fold, dot(p, v, acc) adding acc after the MMA chain as
    the tile path does) against the tile path (tuning.frag_ops off), with 16-bit operands (where the fragment path
    applies) and f32 ones (where it does not: p is split in hi + lo)."""
    _same_bits_with_switch(tier, "frag_ops", dtype, split, ops, 33, monkeypatch)


@pytest.mark.parametrize("switch", ["row_slots", "pin_operands"])
@pytest.mark.parametrize("dtype,split", [(np.float16, False), (np.float32, True)], ids=["f16", "f32-split"])
def test_flash_row_slots_give_the_same_bits(tier, dtype, split, switch, monkeypatch):
    """tuning.row_slots: the row vectors the online softmax broadcasts into the accumulator
    registers (new maxima, alpha, the prefill fold's factors) are staged where they are computed and read
    after one shared barrier. tuning.pin_operands: the query tile is staged once before
    the block loop instead of every block. The values read are the same either way (16-bit operands, where
    the fragment path applies)."""
    _same_bits_with_switch(tier, switch, dtype, split, "16bit", 35, monkeypatch)


@pytest.mark.parametrize("case", ["f16-bm4", "f16-bm8", "f16-bm16", "gqa5-bm4", "f32-split-bm8", "staged-a-bm8",
                                  "own-v-bm8"])
def test_flash_warp_rows_give_the_same_bits(tier, case, monkeypatch):
    """tuning.flash_warp_rows (CUDA): the prefill kernel launched with `warp_rows`, each
    warp holding whole rows of its MMA tiles (at 4 warps: 16-row tiles shared by 4 warps, 32 rows by 2 - the
    scores computed by each, P @ V's columns split between them - or 64 rows, one tile a warp), so the online
    softmax's row max / sum run on lane shuffles and its row values stay in registers. Against the reference, and
    the bits of the tile path: the row sum adds in its order. Decodes, prefill tiles, chunks, windows, GQA 5
    (8 padded rows a token) and an f32 cache split in hi + lo (two MMA chains: no warp rows, the same result); a
    token's bits as a decode equal its bits as a prefill row (decode=False). P @ V takes P's fragments from the
    score registers (tuning.a_from_rows), or stages it ("staged-a"); its V tile is staged with K by the
    scores' dot (tuning.costage), or by itself ("own-v")."""
    if not tier.lane_shuffles:
        pytest.skip("warp-owned rows: CUDA (lane shuffles in the NVPTX lowering)")
    tier = tuned(tier, a_from_rows=not case.startswith("staged"), costage=not case.startswith("own-v"))
    dtype, H = (np.float32, 8) if case.startswith("f32") else (np.float16, 10 if case.startswith("gqa5") else 8)
    block_m = int(case.rsplit("bm", 1)[1])
    monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", "16bit")
    rng = np.random.default_rng(61 + block_m + H)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, H, 2, 32, dtype)
    for window in (0, 40):
        outs = []
        for on in (False, True):
            outs.append(_flash(tuned(tier, flash_warp_rows=on), q, kc, vc, qs, sl, bt, scale=0.25,
                               sliding_window=window, block_m=block_m, split=dtype == np.float32))
        outs.append(_flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=window, block_m=block_m,
                           split=dtype == np.float32, decode=False))
        want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window)
        assert np.abs(outs[1] - want).max() < 3e-3 * np.abs(want).max()
        np.testing.assert_array_equal(outs[1], outs[0])
        np.testing.assert_array_equal(outs[2], outs[0])


@pytest.mark.parametrize("block_m", [8, 16])
def test_flash_fold_skip_gives_the_same_bits(tier, block_m):
    """tuning.flash_fold_skip: the prefill tile's partition fold runs only in the blocks
    where _tile_folds finds a row starting a partition (on GPUs its accumulators stay in the MMA registers
    through the run-time `if`): the same bits as folding (a no-op for the other rows) every block, for
    prompts across many partitions, chunks starting mid-prompt, decodes in the same step and a window."""
    rng = np.random.default_rng(37 + block_m)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 8, 2, 32, np.float16)
    for window in (0, 40):
        outs = []
        for on in (False, True):
            outs.append(_flash(tuned(tier, flash_fold_skip=on), q, kc, vc, qs, sl, bt, scale=0.25,
                               sliding_window=window, block_m=block_m, decode=False))
        check(outs[1], ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window))
        np.testing.assert_array_equal(outs[1], outs[0])


def test_flash_longest_first_gives_the_same_bits(tier):
    """tuning.flash_longest_first: the prefill grid is (KV heads, tiles) with
    the tiles in reverse, so the longest causal tiles start first; every tile still runs once, with the same
    arithmetic: the same bits as tile order, for prompts, chunks starting mid-prompt and decodes in one step."""
    rng = np.random.default_rng(41)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 8, 2, 32, np.float16)
    outs = []
    for on in (False, True):
        outs.append(_flash(tuned(tier, flash_longest_first=on), q, kc, vc, qs, sl, bt, scale=0.25, block_m=8,
                           decode=False))
    check(outs[1], ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_flash_pipelined_loads_give_the_same_bits(tier):
    """The software-pipelined block loop (next block's K/V loaded before the current step: the GPU default)
    against the plain loop, decodes and chunks, with a window that skips blocks."""
    rng = np.random.default_rng(28)
    q, kc, vc, qs, sl, bt = make_step(rng, SEQS, 6, 2, 16, np.float32)
    for window in (0, 40):
        plain = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=window, block_m=4, pipeline=False)
        check(plain, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=window))
        piped = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=window, block_m=4, pipeline=True)
        np.testing.assert_array_equal(piped, plain)


def test_flash_decode_warps_give_the_same_bits(tier):
    """The decode kernel takes FLASH_DECODE_WIDE_WARPS warps for launches of tuning.flash_decode_wide programs
    and more, FLASH_WARPS[0] otherwise: a token's bits must not depend on which (GPU only: CPU tiers have no warps)."""
    if not tier.fast_workgroups:
        pytest.skip("warps per program exist on CUDA/HIP GPUs only")
    rng = np.random.default_rng(27)
    for dtype in (np.float32, np.float16):
        q, kc, vc, qs, sl, bt = make_step(rng, [(s, 1) for s, _ in SEQS if s], 8, 2, 32, dtype)
        outs = []
        for programs in (1 << 30, 0):            # never / always the wide setting
            outs.append(_flash(tuned(tier, flash_decode_wide=programs), q, kc, vc, qs, sl, bt, scale=0.25,
                               max_query_len=1, num_partitions=A.MAX_PARTITIONS))
        check(outs[0], ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25))
        np.testing.assert_array_equal(outs[1], outs[0])


def test_flash_partition_axis(tier):
    """Decode partitions are tuning.flash_partition_blocks blocks, at most MAX_PARTITIONS, decided by each sequence's
    own length: axes of several lengths give the same bits; too short an axis is refused by name."""
    rng = np.random.default_rng(26)
    seqs = [(1, 1), (64, 1), (65, 1), (300, 1), (0, 0), (1100, 1), (2000, 1)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, 4, 2, 16, np.float16)
    PB = tier.tuning.flash_partition_blocks
    parts = A.decode_partitions(sl, BS, partition_blocks=PB)
    blocks = [-(-s // BS) for s, _ in seqs]
    assert list(parts) == [min(-(-nb // PB), A.MAX_PARTITIONS) for nb in blocks]
    if PB == 4:
        assert list(parts) == [1, 1, 2, 5, 0, 16, 16]      # 69 and 125 blocks: 16 longer partitions
    want = ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25)
    outs = [_flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, max_query_len=1, num_partitions=p)
            for p in (None, 16)]
    check(outs[0], want)
    np.testing.assert_array_equal(outs[1], outs[0])
    with pytest.raises(ValueError, match="num_partitions=8 is below the 16 partitions"):
        _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, num_partitions=8)


def test_gpu_dispatch_compiles_flash_kernels_for_sm_90a(monkeypatch):
    """paged_attention on a CUDA target launches the flash kernels (decode + merge for decodes, prefill for
    the chunks), their PTX has tensor-core MMAs for f16 caches and for split f32 caches, and the A/B flag
    tuning.token_attention puts the GPU back on token_attention_kernel; CPU tiers keep the CPU kernels."""
    from jitkern.runtime.launch import compile_only
    from targets import get_target
    sm90 = get_target("sm_90a")
    rng = np.random.default_rng(27)

    def compiled(dtype, target):
        q, kc, vc, qs, sl, bt = make_step(rng, [(300, 1), (40, 23)], 8, 2, 32, dtype)
        with compile_only(target=target) as co:
            A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.2, num_partitions=A.MAX_PARTITIONS, target=target)
        assert not co.errors
        return {ck.name: ck for ck in co.compiled}

    mmas = {}
    # (MMA counts of the PTX compare like for like at one-block steps: longer steps unroll their dots apart)
    sm90 = tuned(sm90, flash_step_blocks=1)
    for operands in ("f32", "16bit"):            # (the engine's dtype auto runs "16bit" on 16-bit checkpoints)
        monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", operands)
        for dtype in (np.float16, np.float32):
            cks = compiled(dtype, sm90)
            assert set(cks) == {"flash_decode_kernel", "flash_merge_kernel", "flash_prefill_kernel"}
            for name in ("flash_decode_kernel", "flash_prefill_kernel"):
                ptx = cks[name].artifacts["kernel.ptx"]
                ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
                assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx, name
                assert "ldmatrix.sync.aligned" in ptx, name
                mmas[(operands, dtype, name)] = ptx.count("mma.sync.aligned")
    for name in ("flash_decode_kernel", "flash_prefill_kernel"):
        # f16 q / probabilities: one MMA chain per cache part instead of hi + lo
        assert mmas[("16bit", np.float16, name)] < mmas[("f32", np.float16, name)], mmas
    monkeypatch.setattr(A, "GPU_FLASH_OPERANDS", "f32")
    assert set(compiled(np.float32, tuned(sm90, token_attention=True))) == {"token_attention_kernel"}
    from targets import cpu_tier_names
    cpu = get_target(cpu_tier_names()[0])
    assert set(compiled(np.float32, cpu)) <= {"decode_kernel", "merge_kernel", "prefill_kernel"}


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_paged_attention_on_device_arrays_alone_equals_batched(backend, monkeypatch):
    """paged_attention on device arrays (the engine's call: MAX_PARTITIONS axis, host_step) takes the flash
    kernels; each sequence's rows alone are bit-identical to its rows in the batch. `fake`: the host-memory
    device claiming sm_90a (tests/fake_cuda.py: each launch is compiled for sm_90a, then run on the CPU;
    16-row prefill tiles keep the CPU compiles short); `cuda`: a real GPU."""
    from jitkern.runtime import cuda
    if backend == "fake":
        monkeypatch.setenv("JITKERN_FAKE_CUDA_TARGET", "sm_90a")
        monkeypatch.setattr(A, "FLASH_ROWS", 16)
        from tests.fake_cuda import install
        install(monkeypatch)
    elif not cuda.is_available():
        pytest.skip("no CUDA device here")
    launched = set()
    run = A.run

    def spy(kernel, grid, args, target=None, **kw):
        launched.add(kernel.__name__)
        return run(kernel, grid, args, target=target, **kw)
    monkeypatch.setattr(A, "run", spy)
    rng = np.random.default_rng(29)
    seqs = [(300, 1), (40, 23), (17, 1), (70, 1), (19, 19)]
    H, KVH, D = 8, 2, 32
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, np.float32)
    dkc, dvc = cuda.DeviceArray.from_numpy(kc), cuda.DeviceArray.from_numpy(vc)

    def attend(rows):
        sub_q = np.concatenate([q[qs[i]:qs[i + 1]] for i in rows])
        sub_qs = np.concatenate([[0], np.cumsum([seqs[i][1] for i in rows])]).astype(np.int32)
        sub_sl, sub_bt = sl[rows], np.ascontiguousarray(bt[rows])
        out = A.paged_attention(cuda.DeviceArray.from_numpy(sub_q), dkc, dvc, cuda.DeviceArray.from_numpy(sub_qs),
                                cuda.DeviceArray.from_numpy(sub_sl), cuda.DeviceArray.from_numpy(sub_bt),
                                scale=0.2, num_partitions=A.MAX_PARTITIONS, workspace={},
                                host_step=(sub_qs, sub_sl))
        return out.numpy(), sub_qs
    full, _ = attend(list(range(len(seqs))))
    check(full, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.2))
    assert launched == {"flash_decode_kernel", "flash_merge_kernel", "flash_prefill_kernel"}
    for rows in ([0], [1], [3, 2], [4, 0]):
        out, sub_qs = attend(rows)
        for k, i in enumerate(rows):
            np.testing.assert_array_equal(out[sub_qs[k]:sub_qs[k + 1]], full[qs[i]:qs[i + 1]])
    # the engine's 16-bit out (decoder.GPU_X16_ATTN): the same rows rounded to bf16 as they are stored
    from tests.ops.ref_basic import to_bf16
    o16 = cuda.DeviceArray.zeros((q.shape[0], H, D), np.uint16)
    got = A.paged_attention(cuda.DeviceArray.from_numpy(q), dkc, dvc, cuda.DeviceArray.from_numpy(qs),
                            cuda.DeviceArray.from_numpy(sl), cuda.DeviceArray.from_numpy(bt), scale=0.2,
                            num_partitions=A.MAX_PARTITIONS, workspace={}, host_step=(qs, sl), out=o16)
    assert got is o16
    np.testing.assert_array_equal(o16.numpy(), to_bf16(full))


@pytest.mark.parametrize("sb", [2, 4])
def test_flash_step_blocks(tier, sb):
    """tuning.flash_step_blocks (step_blocks=): online-softmax steps of sb cache blocks, the
    partitions whole steps. Against the reference; not the bits of one-block steps (the step is in the
    arithmetic); a token's bits the same as a decode, as the last row of a prefill chunk and from the prefill
    kernel alone over a step with decodes (contexts of 1 to 2,000 tokens: partial last steps, partitions longer
    than tuning.flash_partition_blocks past MAX_PARTITIONS); with a sliding window the kernels step by one block:
    the bits of step_blocks=1."""
    if sb == 4 and not tier.is_gpu:
        pytest.skip("4-block steps: on the GPU (the same code as 2 with another constant; slow CPU compiles)")
    rng = np.random.default_rng(51 + sb)
    seqs = SEQS + [(1100, 1), (2000, 1), (1030, 40)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, 4, 2, 16, np.float16)
    kw = dict(scale=0.25, step_blocks=sb)
    full = _flash(tier, q, kc, vc, qs, sl, bt, block_m=8, **kw)
    check(full, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25))
    assert not np.array_equal(full, _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, block_m=8, step_blocks=1))
    np.testing.assert_array_equal(_flash(tier, q, kc, vc, qs, sl, bt, block_m=8, decode=False, **kw), full)
    last = len(seqs) - 1                 # the 40-token chunk ending at position 1029, its last token as a decode
    dec = _flash(tier, q[qs[last + 1] - 1:qs[last + 1]], kc, vc, np.array([0, 1], np.int32),
                 np.array([1030], np.int32), np.ascontiguousarray(bt[last:]), **kw)
    np.testing.assert_array_equal(dec[0], full[qs[last + 1] - 1])
    windowed = _flash(tier, q, kc, vc, qs, sl, bt, sliding_window=40, block_m=8, **kw)
    check(windowed, ref_paged_attention(q, kc, vc, qs, sl, bt, 0.25, window=40))
    np.testing.assert_array_equal(windowed, _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, sliding_window=40,
                                                   block_m=8, step_blocks=1))
    with pytest.raises(ValueError, match="step_blocks must be 1, 2 or 4, got 3"):
        _flash(tier, q, kc, vc, qs, sl, bt, scale=0.25, step_blocks=3)


@pytest.mark.parametrize("layout,heads,kv_heads,dim", [("natural", 6, 2, 32), ("q4x4", 9, 3, 64), ("q4", 5, 1, 32)],
                         ids=["natural-g3", "q4x4-smollm2", "q4-g5"])
def test_flash_merge_writes_the_q8_input(tier, layout, heads, kv_heads, dim):
    """flash_paged_attention(q8_out=): in a decode-only step the flash merge kernel also writes the output
    quantised for a GGUF o projection (its head group's rows read back after a CTA barrier, or the decode
    kernel's for one partition), bit for bit quantize_q8 of the f32 output, the 4-fold scales too; the f32
    output unchanged. Padded head groups (G = 3, 5) mask their spare rows."""
    from engine.ops import quant as Q
    rng = np.random.default_rng(37)
    seqs = [(1, 1), (15, 1), (300, 1), (0, 0), (70, 1), (600, 1), (17, 1)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, heads, kv_heads, dim, np.float16)
    T, K = q.shape[0], heads * dim
    want = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.2, num_partitions=A.MAX_PARTITIONS, max_query_len=1)
    for rep4 in (False, True):
        ref = Q.quantize_q8(np.ascontiguousarray(want.reshape(T, K)), layout=layout, rep4=rep4, target=tier)
        got = Q.Q8Activations(np.full((T, K), 77, np.int8), np.full((T, K // 32), np.nan, np.float32),
                              np.full((T, K // 32), np.nan, np.float32), layout,
                              *([np.full((T, K // 8), np.nan, np.float32) for _ in range(2)] if rep4 else []))
        out = _flash(tier, q, kc, vc, qs, sl, bt, scale=0.2, num_partitions=A.MAX_PARTITIONS, max_query_len=1,
                     q8_out=got)
        np.testing.assert_array_equal(out, want)
        for g, w in zip(list(got) + ([got.scales4, got.sums4] if rep4 else []),
                        list(ref) + ([ref.scales4, ref.sums4] if rep4 else [])):
            np.testing.assert_array_equal(g, w, err_msg=f"rep4 {rep4}")
