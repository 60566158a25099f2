"""Register pressure of the GPU lowering's NVIDIA kernels (ptxas, no GPU needed) and the address arithmetic
behind it: chunk pointers as one pointer plus uniform steps (GpuLowering._chunk_steps), shared-memory
offsets as a thread part plus constants (_flat_coords), the `maxnreg` launch option."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jitkern import ir
from jitkern.backends.emitter import LV, PT, Aff
from jitkern.backends.gpu import GpuLowering
from jitkern.backends.nvptx import find_ptxas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("shape", [(64, 128), (16, 128), (32, 64), (2, 1024), (4, 2048), (8, 4), (16, 8, 32)])
@pytest.mark.parametrize("T", [32, 128, 256])
def test_chunk_steps_match_the_layouts_offsets(shape, T):
    """The step between a thread's consecutive chunks, from the affine form's strides, equals the difference
    of the two chunks' offsets computed from the layout (chunk c of thread t starts at flat element
    (c * T + t) * V), for every thread, rows shorter or longer than the threads' chunk span."""
    low = object.__new__(GpuLowering)
    low.T = T
    V = GpuLowering.vec(shape)
    R = low.lanes(shape)
    strides = tuple(1 if i == len(shape) - 1 else 1000 * (i + 1) + 7 for i in range(len(shape)))
    p = PT("%base", ir.f32, LV("%offs", "i64", R, shape, Aff(0, strides)), shape)
    steps = low._chunk_steps(p, shape, V)
    if R // V < 2:
        assert steps is None
        return

    def offset(e):
        out = 0
        for ax in range(len(shape)):
            inner = 1
            for d in shape[ax + 1:]:
                inner *= d
            c = e // inner if ax == 0 else (e // inner) % shape[ax]
            out += c * strides[ax]
        return out
    assert steps is not None and len(steps) == R // V - 1
    for t in range(T):
        for c in range(1, R // V):
            want = offset((c * T + t) * V) - offset(((c - 1) * T + t) * V)
            assert int(steps[c - 1]) == want, (t, c)


def test_chunk_steps_need_an_affine_form_and_power_of_two_sizes():
    low = object.__new__(GpuLowering)
    low.T = 128
    shape = (48, 128)
    R = low.lanes(shape)
    assert low._chunk_steps(PT("%b", ir.f32, LV("%o", "i64", R, shape, Aff(0, (128, 1))), shape), shape, 4) is None
    shape = (64, 128)
    R = low.lanes(shape)
    assert low._chunk_steps(PT("%b", ir.f32, LV("%o", "i64", R, shape, None), shape), shape, 4) is None


LINEAR_SIG = ("x=*f32:16,w=*bf16:16,bias=*f32:16,y=*f32:16,M=i32,N=i32:16,K=i32:16,ldx=i32:16,ldy=i32:16,"
              "xmap=i64,wmap=i64")


def _linear_ptx(BM, BN, BK, extra=(), warps=4, split=2, sig=None, target=None):
    """The tensor-core linear's PTX for `target` (default sm_90a; a targets.tuned copy tries other choices)."""
    from jitkern.cli import parse_sig
    from jitkern.compiler import compile_kernel
    from engine.ops.matmul import _gpu_linear_mma_kernel
    from targets import get_target
    consts = ["HAS_BIAS=False", f"BM={BM}", f"BN={BN}", f"BK={BK}", "EVEN=True", f"SPLIT={split}",
              f"num_warps={warps}", *extra]
    params, cx = parse_sig(_gpu_linear_mma_kernel, sig or LINEAR_SIG, consts)
    ck = compile_kernel(_gpu_linear_mma_kernel, params, cx, target or get_target("sm_90a"), load=False)
    return ck.artifacts["kernel.ptx"].decode()


def _ptxas_usage(ptx: str, tmp_path) -> tuple:
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([find_ptxas(), "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = [int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr).groups()]
    return regs, sum(spills)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("tile", [(16, 64, 128), (32, 64, 64)])
def test_dense_linear_tiles_fit_three_ctas_per_sm(tile, tmp_path):
    """The bf16 linear's decode tile and the former tall tile (4 warps) in at most 168 registers a thread without spills
    (3 CTAs of 128 threads per SM; 255 before the chunk-pointer, shared-offset and K-loop changes), so more
    weight bytes are in flight at decode."""
    regs, spilled = _ptxas_usage(_linear_ptx(*tile), tmp_path)
    assert regs <= 168 and spilled == 0, (regs, spilled)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_engine_linear_tiles_assemble_without_spills(tmp_path):
    """Every tile the engine's linear picks on sm_90a by token count (decode, tall, mid, big: matmul._mma_tile_for)
    assembles with ptxas and spills nothing, with f32 and 16-bit activations (no GPU needed; on the GPU they are checked for equal bits)."""
    from engine.ops import matmul as mm
    from targets import get_target
    T = get_target("sm_90a")
    ms = (1, mm.GPU_LINEAR_WIDE_M, mm.GPU_LINEAR_MID_M, mm.GPU_LINEAR_BIG_M)
    tiles = {mm._mma_tile_for(T, 4096, 4096, M) for M in ms} | {mm._mma_tile_for(T, 28672, 4096, M) for M in ms}
    assert len(tiles) == 7, tiles           # decode / tall / mid / big (narrow: split 4), decode / tall / mid (unsplit)
    for t in sorted(tiles):
        for act in ("ACT16=0", "ACT16=1"):
            regs, spilled = _ptxas_usage(_linear_ptx(*t[:3], extra=(act,), warps=t[3], split=t[4]), tmp_path)
            assert spilled == 0, (t, act, regs, spilled)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("swizzle,pipe", [(0, False), (128, False), (128, True)])
def test_wgmma_linear_tiles_assemble(tmp_path, swizzle, pipe):
    """The `wgmma` launch option turns every engine tile's dots into warpgroup MMAs (m64nNk16 with N = the
    tile's tokens; one per K step of 16, 64-row weight block and activation part, in both dots of the
    pipelined K loop), behind the async-proxy fence, and ptxas takes them for sm_90a. No spills with 16-bit
    activations; with f32 ones (hi and lo accumulators) the big tile is over 255 registers and spills (~170
    bytes, not asserted)."""
    from engine.ops import matmul as mm
    from targets import get_target, tuned
    T = tuned(get_target("sm_90a"), wgmma_swizzle=swizzle, wgmma_pipe=pipe)     # (both in the compile cache key)
    ms = (1, mm.GPU_LINEAR_WIDE_M, mm.GPU_LINEAR_MID_M, mm.GPU_LINEAR_BIG_M)
    tiles = {mm._mma_tile_for(T, 4096, 4096, M) for M in ms} | {mm._mma_tile_for(T, 28672, 4096, M) for M in ms}
    for t in sorted(tiles):
        BM, BN, BK, W, S = t
        for act in (0, 1):
            ptx = _linear_ptx(BM, BN, BK, extra=(f"ACT16={act}", "wgmma=1"), warps=W, split=S, target=T)
            n_mma = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{BM}k16\.f32\.bf16\.bf16 ", ptx))
            assert n_mma == 2 * (BK // 16) * (BN // 64 // (W // 4)) * (2 if act == 0 else 1), (t, act, n_mma)
            assert "fence.proxy.async.shared::cta" in ptx and "wgmma.wait_group.sync.aligned 0" in ptx
            # pipelined: the loop's dot commits without waiting; dots wait for all but the latest group first
            assert ("wgmma.wait_group.sync.aligned 1" in ptx) == pipe
            assert "mma.sync" not in ptx
            # 128-byte swizzled atoms need a 1024-byte aligned shared window
            assert f".extern .shared .align {1024 if swizzle else 16} .b8 __jk_smem[]" in ptx
            regs, spilled = _ptxas_usage(ptx, tmp_path)
            if act == 1:
                assert spilled == 0, (t, regs, spilled)
    assert "wgmma" not in _linear_ptx(16, 64, 128)          # off unless the kernel is launched with it


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_maxnreg_launch_option_caps_registers(tmp_path):
    """`maxnreg` (a launch option: in the specialisation, so in the cache key) becomes PTX .maxnreg."""
    ptx = _linear_ptx(16, 64, 128, ["maxnreg=96"])
    assert re.search(r"^\.maxnreg 96$", ptx, re.M)
    regs, _ = _ptxas_usage(ptx, tmp_path)
    assert regs <= 96
    assert ".maxnreg" not in _linear_ptx(16, 64, 128)


def test_ldmatrix_lanes_give_the_mma_fragments():
    """NVIDIA's ldmatrix: lanes 8j..8j+7 address the rows of matrix j and lane l receives, of each matrix, row
    l // 4's elements 2 (l % 4), +1. With the rows / k offsets NvptxHooks.ldmatrix_lanes gives (relative to a
    unit's tile origin and K step), matrix j of the A step is exactly register a_j of mma_layout and matrix j
    of the B step register b_j, for every lane (numpy model: no GPU needed)."""
    from jitkern.backends.nvptx import NvptxHooks
    from targets import get_target
    h = NvptxHooks(get_target("sm_90a"))
    lanes = np.arange(32)
    lay = h.mma_layout(lanes, "bf16")
    ld = h.ldmatrix_lanes(lanes)
    for side, count in (("a", 4), ("b", 2)):
        rows, ks = (np.broadcast_to(np.asarray(x), (32,)) for x in ld[side])
        assert rows.max() < (16 if side == "a" else 8) and ks.max() <= 8 and (ks % 8 == 0).all()
        for j in range(count):
            src = 8 * j + lanes // 4                     # the lane that addressed this lane's row of matrix j
            want_row, want_k = (np.broadcast_to(np.asarray(x), (32,)) for x in lay[side][j])
            np.testing.assert_array_equal(rows[src], want_row, err_msg=f"{side}{j} rows")
            np.testing.assert_array_equal(ks[src] + 2 * (lanes % 4), want_k, err_msg=f"{side}{j} k")


def test_ldmatrix_trans_gives_the_b_fragments_of_a_k_n_tile():
    """LDMATRIX_TRANS: a (k, n) B operand staged in its own row order (row k at k * NP) is read by ldmatrix .trans
    with lanes 0-15 addressing rows k = lane & 15 (A's ldmatrix rows) of the step, at the unit's 8 columns; .trans
    hands lane l, of matrix j, the pair of rows 2 (l % 4), +1 at column l // 4 of that matrix. Modelled in numpy on
    a staged (16, 32) tile of distinct values: every lane's two registers hold exactly the B elements mma_layout
    names for b0 / b1 (k pairs adjacent) of each 8-column unit, the registers the transposed staging's plain
    ldmatrix gave before."""
    from jitkern.backends.nvptx import NvptxHooks
    from targets import get_target
    h = NvptxHooks(get_target("sm_90a"))
    lanes = np.arange(32)
    lay = h.mma_layout(lanes, "bf16")
    la_row = np.broadcast_to(np.asarray(h.ldmatrix_lanes(lanes)["a"][0]), (32,))   # the .trans address rows
    K, N = 16, 32
    NP = N + 8
    B = np.arange(K * N).reshape(K, N) + 1000                       # B[k, n], distinct
    smem = np.full(K * NP, -1)
    for kk in range(K):
        smem[kk * NP:kk * NP + N] = B[kk]                           # row order, padded rows
    for ni in range(N // 8):
        addr = la_row * NP + ni * 8                                 # element address each lane gives
        assert (la_row < 16).all()
        for j in range(2):
            got = np.empty((32, 2), np.int64)
            for ln in lanes:
                rows = [addr[8 * j + 2 * (ln % 4)], addr[8 * j + 2 * (ln % 4) + 1]]   # the lanes that addressed them
                got[ln] = [smem[r + ln // 4] for r in rows]
            n_want, k_want = (np.broadcast_to(np.asarray(x), (32,)) for x in lay["b"][j])
            np.testing.assert_array_equal(got[:, 0], B[k_want, ni * 8 + n_want], err_msg=f"unit {ni} b{j} low")
            np.testing.assert_array_equal(got[:, 1], B[k_want + 1, ni * 8 + n_want], err_msg=f"unit {ni} b{j} high")


def test_flash_v_tile_by_ldmatrix_trans(tmp_path):
    """The flash prefill's P @ V (B = the (keys, D) V tile, not a transpose) at the engine's constants: with
    tuning.ldmatrix_trans (default) V is staged with vector stores and read by ldmatrix .trans, no 16-bit shared
    store left in the kernel; without it V is staged transposed element by element (st.shared.b16 / u16) and the
    cache key changes. ptxas takes both (where installed); bits: tests/ops/test_attention_flash.py on the GPU."""
    from jitkern.compiler import _toolchain_key
    from targets import get_target, tuned
    out, keys = [], []
    for on in (True, False):
        T = tuned(get_target("sm_90a"), ldmatrix_trans=on)
        keys.append(_toolchain_key(T))
        ptx = _warp_rows_prefill_ptx(target=T)
        out.append((len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x\d\.trans", ptx)),
                    len(re.findall(r"st\.shared\.(?:u16|b16)", ptx))))
        if find_ptxas() is not None:
            _ptxas_usage(ptx, tmp_path)
    (trans_on, st16_on), (trans_off, st16_off) = out
    assert trans_on > 0 and st16_on == 0, out
    assert trans_off == 0 and st16_off >= 8, out
    assert keys[1] == ("no-ldmatrix-trans",) + keys[0]


def test_flash_pin_regs_reads_the_query_fragments_once(tmp_path):
    """tuning.pin_regs: the flash prefill's pinned query tile is read into the scores' A fragment
    registers once, before the block loop: every ldmatrix.x4 of the kernel precedes its first MMA (without it they
    sit among the loop's MMAs), as many as before, and the cache key says so. ptxas takes it without spills (where
    installed). Bits: the same fragments; tests/ops/test_attention_flash.py on the GPU with the switch."""
    from jitkern.compiler import _toolchain_key
    from targets import get_target, tuned
    out, keys = [], []
    for on in (False, True):
        T = tuned(get_target("sm_90a"), pin_regs=on)
        keys.append(_toolchain_key(T))
        ptx = _warp_rows_prefill_ptx(target=T)
        lines = ptx.split("\n")
        x4 = [i for i, ln in enumerate(lines) if "ldmatrix.sync.aligned.m8n8.x4" in ln]
        first_mma = min(i for i, ln in enumerate(lines) if "mma.sync" in ln)
        out.append((len(x4), sum(i > first_mma for i in x4)))
        if on and find_ptxas() is not None:
            assert _ptxas_usage(ptx, tmp_path)[1] == 0
    (n_off, after_off), (n_on, after_on) = out
    assert n_on == n_off > 0 and after_off > 0 and after_on == 0, out
    assert keys[1] == keys[0][:keys[0].index("pin-operands") + 1] + ("pin-regs",) + \
        keys[0][keys[0].index("pin-operands") + 1:]


def test_dense_linear_fragments_by_ldmatrix():
    """The tensor-core linear's K loop takes its fragments with ldmatrix (one x4 per A part and unit row, one
    x2 per unit column) instead of 32-bit shared loads; tuning.ldmatrix off restores the loads and changes the
    cache key."""
    from jitkern.compiler import _toolchain_key
    from targets import get_target, tuned
    ptx = _linear_ptx(64, 256, 64, extra=("ACT16=1",), warps=8)
    with_ldm = (len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4", ptx)),
                len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x2", ptx)), len(re.findall(r"ld\.shared", ptx)))
    key = _toolchain_key(get_target("sm_90a"))
    T0 = tuned(get_target("sm_90a"), ldmatrix=False)
    assert _toolchain_key(T0) == ("no-ldmatrix",) + key
    ptx0 = _linear_ptx(64, 256, 64, extra=("ACT16=1",), warps=8, target=T0)
    assert "ldmatrix" not in ptx0
    assert with_ldm[0] > 0 and with_ldm[1] > 0
    assert with_ldm[2] + 3 * with_ldm[0] + with_ldm[1] <= len(re.findall(r"ld\.shared", ptx0)), with_ldm


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_cp_async_linear_tiles(tmp_path):
    """num_stages=2 (the engine launches its linear tiles of GPU_LINEAR_ASYNC_MIN_BM+ tokens so; tuning.cp_async
    False turns it off): the tensor-core linear's prefetched tiles go global -> shared memory by cp.async straight
    into the dot's staging rows, two buffers, one 8-byte copy per chunk of 4 elements (the
    prologue's and the loop's), waited for before each dot (all but the step's own groups in the loop, all
    after it). With bf16 x both operands are copied: no tile is held in registers, so ptxas needs far fewer,
    and the buffers share shared memory with the C tile written after the last dot. With f32 x only the
    weights are (x is rounded to bf16 on the way; about as many registers as without). Off: no cp.async."""
    from engine.ops import matmul as mm
    from targets import get_target, tuned
    T = get_target("sm_90a")
    ms = (1, mm.GPU_LINEAR_WIDE_M, mm.GPU_LINEAR_MID_M, mm.GPU_LINEAR_BIG_M)
    tiles = {mm._mma_tile_for(T, 4096, 4096, M) for M in ms} | {mm._mma_tile_for(T, 28672, 4096, M) for M in ms}
    sig16 = LINEAR_SIG.replace("x=*f32:16", "x=*bf16:16")
    assert sig16 != LINEAR_SIG
    for t in sorted(tiles):
        BM, BN, BK, W, S = t
        threads = 32 * W
        for x16 in (True, False):
            sig = sig16 if x16 else LINEAR_SIG
            # the default (tuning.cp_async None): per launch (num_stages)
            off = _linear_ptx(BM, BN, BK, extra=("ACT16=1",), warps=W, split=S, sig=sig)
            on = _linear_ptx(BM, BN, BK, extra=("ACT16=1", "num_stages=2"), warps=W, split=S, sig=sig)
            never = _linear_ptx(BM, BN, BK, extra=("ACT16=1", "num_stages=2"), warps=W, split=S, sig=sig,
                                target=tuned(T, cp_async=False))          # (wins over the option)
            assert "cp.async" not in off and "cp.async" not in never
            assert ("num_stages" in mm._mma_regs(T, BM)) == (BM >= mm.GPU_LINEAR_ASYNC_MIN_BM)
            rows = BM + BN if x16 else BN
            copies = len(re.findall(r"cp\.async\.ca\.shared\.global \[", on))
            assert copies == 2 * rows * BK // (4 * threads), (t, x16, copies)
            assert len(re.findall(r"cp\.async\.commit_group", on)) == (4 if x16 else 2)
            assert re.search(r"cp\.async\.wait_group\s+0;", on) and re.search(r"cp\.async\.wait_group\s+\d;", on)
            regs_on, spill_on = _ptxas_usage(on, tmp_path)
            regs_off, _ = _ptxas_usage(off, tmp_path)
            assert spill_on == 0 and (regs_on < regs_off or not x16), (t, x16, regs_on, regs_off)


# the engine's flash prefill launch on sm_90a for a Llama-3-8B-shape layer (f16 cache, 16-bit operands)
FLASH_PREFILL_SIG = ("q=*f32:16,k_cache=*f16:16,v_cache=*f16:16,out=*f32:16,query_start=*i32:16,seq_lens=*i32,"
                     "block_table=*i32,num_seqs=i32,search_steps=i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
                     "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
FLASH_COMMON = ["KVH=8", "G=4", "D=128", "PB=4", "MAXP=16", "SOFTCAP=False", "SINKS=False", "SPLIT=False",
                "PIPE=True", "BS=16", "OPS16=True"]
FLASH_PREFILL_CONSTS = ["num_warps=8", "GP=4", "BM=16", "SKIP_DECODE=True"]


def _warp_rows_prefill_ptx(warp_rows=True, target=None) -> str:
    """The flash prefill's sm_90a PTX at the engine's Llama-3-8B constants and its warp-rows tile
    (A.FLASH_WARP_ROWS_TILE), launched with `warp_rows` or not, with `target`'s tuning (default sm_90a's)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from engine.ops import attention as A
    from targets import get_target
    k = load_kernel("engine.ops.attention:flash_prefill_kernel")
    rows, warps = A.FLASH_WARP_ROWS_TILE
    extra = [f"num_warps={warps}", "GP=4", f"BM={rows // 4}", "SKIP_DECODE=True", "FOLD_SKIP=True",
             "LONGEST_FIRST=True"] + (["warp_rows=True"] if warp_rows else [])
    params, cx = parse_sig(k, FLASH_PREFILL_SIG, FLASH_COMMON + extra)
    return compile_kernel(k, params, cx, target or get_target("sm_90a"), load=False).artifacts["kernel.ptx"].decode()


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_flash_fold_skip_keeps_the_fold_in_registers(tmp_path):
    """FOLD_SKIP (tuning.flash_fold_skip): the prefill tile's partition fold sits in a run-time branch whose
    results (the merged and partition accumulators) stay in the MMA registers through the `if`
    (FragmentOps.op_if): the block loop stores no more to shared memory than without it, and the fold's
    barriers are inside the branch, so blocks where no row folds skip them. ptxas takes it."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    k = load_kernel("engine.ops.attention:flash_prefill_kernel")
    stores, branch_barriers = [], []
    for skip in (False, True):
        params, cx = parse_sig(k, FLASH_PREFILL_SIG, FLASH_COMMON + FLASH_PREFILL_CONSTS + [f"FOLD_SKIP={skip}"])
        art = compile_kernel(k, params, cx, get_target("sm_90a"), load=False).artifacts
        ll = art["kernel.ll"].decode()
        stores.append(_block_loop_smem_stores(ll))
        lines = ll.split("\n")
        labels = [(i, ln.split(":")[0]) for i, ln in enumerate(lines) if re.match(r"^(then|endif)\d+:", ln)]
        # the innermost then-block holding barriers and no MMA: the fold
        n = 0
        for i, lab in labels:
            if lab.startswith("then"):
                end = next(j for j, lb in labels if lb == f"endif{int(lab[4:]) + 2}")  # (then, else, endif)
                seg = lines[i:end]
                if not any("mma" in x for x in seg):
                    n = max(n, sum("barrier" in x for x in seg))
        branch_barriers.append(n)
        _ptxas_usage(art["kernel.ptx"].decode(), tmp_path)
    assert stores[1] == stores[0], stores
    assert branch_barriers[0] == 0 and branch_barriers[1] >= 2, branch_barriers


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_flash_row_slots_share_barriers(tmp_path):
    """tuning.row_slots: the flash kernels' row broadcasts into the accumulator registers share barriers (fewer
    bar.sync in the PTX than without); tuning.pin_operands: the query tile is staged once, before the block loop
    (fewer shared stores in the loop). ptxas takes the kernels either way (16-bit operands: the engine's)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target, tuned
    dsig = ("q=*f32:16,k_cache=*f16:16,v_cache=*f16:16,out=*f32:16,ws_m=*f32:16,ws_l=*f32:16,ws_acc=*f32:16,"
            "query_start=*i32:16,seq_lens=*i32,block_table=*i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
            "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
    psig, common = FLASH_PREFILL_SIG, FLASH_COMMON
    cases = [("flash_decode_kernel", dsig, ["num_warps=2", "R=16", "NUM_PARTS=16"]),
             ("flash_prefill_kernel", psig, FLASH_PREFILL_CONSTS)]
    for name, sig, extra in cases:
        k = load_kernel(f"engine.ops.attention:{name}")
        counts, stores = [], []
        for switch in (None, "row_slots", "pin_operands"):
            T = tuned(get_target("sm_90a"), row_slots=switch == "row_slots", pin_operands=switch == "pin_operands")
            params, cx = parse_sig(k, sig, common + extra)
            art = compile_kernel(k, params, cx, T, load=False).artifacts
            ptx = art["kernel.ptx"].decode()
            counts.append(len(re.findall(r"\bbar(rier)?\.sync", ptx)))
            stores.append(_block_loop_smem_stores(art["kernel.ll"].decode()))
            _ptxas_usage(ptx, tmp_path)
        assert counts[1] < counts[0], (name, counts)
        # pinned: the query tile (R x 128 f16) is staged before the block loop, not in it
        assert stores[2] < stores[0] == stores[1], (name, stores)


def _block_loop_smem_stores(ll: str) -> int:
    """Shared-memory stores in the body of the loop that holds the MMAs (between its for_body and for_exit)."""
    lines = ll.split("\n")
    labels = [(i, ln.split(":")[0]) for i, ln in enumerate(lines) if re.match(r"^for_(body|exit)\d+:", ln)]
    best = None
    for i, lab in labels:
        if not lab.startswith("for_body"):
            continue
        n = int(lab[len("for_body"):])
        end = next((j for j, lb in labels if lb == f"for_exit{n + 1}"), None)
        if end is None:
            continue
        seg = lines[i:end]
        if any("mma.sync" in x for x in seg) and (best is None or end - i > best[1] - best[0]):
            best = (i, end)
    assert best is not None
    return sum(1 for x in lines[best[0]:best[1]] if re.search(r"store .*addrspace\(3\)", x))


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("swizzle", [0, 128])
def test_wgmma_linear_tiles_with_cp_async(tmp_path, swizzle):
    """`wgmma` with num_stages=2 (the engine's options for tiles of 64+ tokens under tuning.linear_wgmma): the K loop's
    tiles are copied by cp.async straight into the warpgroup MMAs' core-matrix (or 128-byte swizzled) staging,
    waited for and fenced for the async proxy before the MMAs read them in place; with bf16 x no tile is held
    in registers (no spills, fewer registers than without cp.async)."""
    from engine.ops import matmul as mm
    from targets import get_target, tuned
    T = tuned(get_target("sm_90a"), wgmma_swizzle=swizzle)
    tiles = {mm._mma_tile_for(T, N, 4096, M, act16=1) for N in (4096, 28672)
             for M in (mm.GPU_LINEAR_MID_M, mm.GPU_LINEAR_BIG_M, mm.GPU_LINEAR_HUGE_M)}
    assert tuple(mm.GPU_LINEAR_HUGE_TILE[:4]) + (4,) in tiles
    sig16 = LINEAR_SIG.replace("x=*f32:16", "x=*bf16:16")
    for t in sorted(tiles):
        BM, BN, BK, W, S = t
        assert BM >= mm.GPU_LINEAR_ASYNC_MIN_BM
        on = _linear_ptx(BM, BN, BK, extra=("ACT16=1", "wgmma=1", "num_stages=2"), warps=W, split=S, sig=sig16,
                         target=T)
        off = _linear_ptx(BM, BN, BK, extra=("ACT16=1", "wgmma=1"), warps=W, split=S, sig=sig16, target=T)
        copies = len(re.findall(r"cp\.async\.ca\.shared\.global \[", on))
        assert copies == 2 * (BM + BN) * BK // (4 * 32 * W), (t, copies)
        n_mma = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{BM}k16\.f32\.bf16\.bf16 ", on))
        assert n_mma == 2 * (BK // 16) * (BN // 64 // (W // 4)), (t, n_mma)
        assert "fence.proxy.async.shared::cta" in on and "mma.sync" not in on and "cp.async" not in off
        regs_on, spill_on = _ptxas_usage(on, tmp_path)
        regs_off, _ = _ptxas_usage(off, tmp_path)
        assert spill_on == 0 and regs_on < regs_off, (t, regs_on, regs_off)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("wgmma", [True, False])
def test_linear_prefetch_2_chain_uses_three_buffers(tmp_path, wgmma):
    """PREFETCH=2 with num_stages=3 (tuning.linear_prefetch 2): the K loop's prefetch-2 chains (x and w) are
    copied by cp.async into three buffers each, in turn: the copies of two steps at the prologue and one in the
    loop; the loop's dot waits until at most 4 groups are pending (its own step's 2 and the next step's 2), the
    first dot after the loop until 2 (the last step's), the last one until none. No spills with bf16 x (the
    huge tile: 108 registers; the last two dots chain in one set of accumulator registers)."""
    from engine.ops import matmul as mm
    sig16 = LINEAR_SIG.replace("x=*f32:16", "x=*bf16:16")
    BM, BN, BK, W = mm.GPU_LINEAR_HUGE_TILE if wgmma else mm.GPU_LINEAR_MID_TILE
    opts = ("ACT16=1",) + (("wgmma=1",) if wgmma else ())
    p1 = _linear_ptx(BM, BN, BK, extra=opts + ("num_stages=2",), warps=W, split=4, sig=sig16)
    p2 = _linear_ptx(BM, BN, BK, extra=opts + ("num_stages=3", "PREFETCH=2"), warps=W, split=4, sig=sig16)
    per_step = 2 * (BM + BN) * BK // (4 * 32 * W) // 2          # copies a step, x and w (one 8-byte copy per 4)
    assert len(re.findall(r"cp\.async\.ca\.shared\.global \[", p1)) == 2 * per_step
    assert len(re.findall(r"cp\.async\.ca\.shared\.global \[", p2)) == 3 * per_step
    assert re.findall(r"cp\.async\.wait_group\s+(\d+);", p1) == ["2", "0"]
    assert re.findall(r"cp\.async\.wait_group\s+(\d+);", p2) == ["4", "2", "0"]
    assert len(re.findall(r"cp\.async\.commit_group", p2)) == 6
    if wgmma:
        # every warpgroup MMA accumulates into one register set: the loop's, then the two dots after it (a
        # second set would be the last dot from zero, added afterwards: other bits than PREFETCH 1)
        accs = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+ \{([^}]*)\}", p2))
        assert len(accs) == 1, len(accs)
    regs, spilled = _ptxas_usage(p2, tmp_path)
    assert spilled == 0, (regs, spilled)
    if wgmma:
        assert regs <= 128, regs


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("serial", [False, True])
def test_linear_tma_tiles(tmp_path, serial):
    """The `tma` launch option (tuning.linear_tma) on the engine's wgmma tiles: the K loop's x and w tiles are
    jk.tma boxes, so one thread arms a buffer's mbarrier and issues one bulk tensor copy per 64-element atom
    (two at the chain's first step, two a loop step), every thread waits on the barrier's phase, and no
    cp.async or per-thread copy remains; a chain starts its barriers over (inval + init), the kernel once at
    entry. No spills, and fewer registers than cp.async's address math needs. Prefetch-2 chains too (three
    buffers and barriers a chain)."""
    from engine.ops import matmul as mm
    sig16 = LINEAR_SIG.replace("x=*f32:16", "x=*bf16:16")
    ser = ("SERIAL=True",) if serial else ()
    for BM, BN, BK, W in (mm.GPU_LINEAR_HUGE_TILE, (64, 128, 64, 8), (64, 256, 64, 8)):
        opts = ("ACT16=1", "wgmma=1", "num_stages=2") + ser
        on = _linear_ptx(BM, BN, BK, extra=opts + ("tma=1",), warps=W, split=4, sig=sig16)
        off = _linear_ptx(BM, BN, BK, extra=opts, warps=W, split=4, sig=sig16)
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier", on)) == 4
        assert len(re.findall(r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);", on)) == 4
        assert set(re.findall(r"expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);", on)) == \
            {str(BM * BK * 2), str(BN * BK * 2)}
        assert len(re.findall(r"mbarrier\.try_wait\.parity", on)) == 4          # x and w, loop and last dot
        assert on.count("mbarrier.inval") == 4 and on.count("mbarrier.init") == 8
        assert "cp.async.ca" not in on and "cp.async.ca" in off and "mbarrier" not in off
        regs_on, spill_on = _ptxas_usage(on, tmp_path)
        regs_off, _ = _ptxas_usage(off, tmp_path)
        assert spill_on == 0 and regs_on < regs_off, ((BM, BN), regs_on, regs_off)
    # prefetch-2 chains (three buffers): two steps' copies at the chain's start, one step's a loop step; each
    # dot waits only on its own tiles' barriers (x and w: in the loop, then the two dots after it)
    BM, BN, BK, W = mm.GPU_LINEAR_HUGE_TILE
    p2 = _linear_ptx(BM, BN, BK, extra=("ACT16=1", "wgmma=1", "num_stages=3", "PREFETCH=2", "tma=1") + ser,
                     warps=W, split=4, sig=sig16)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", p2)) == 6 and "cp.async.ca" not in p2
    assert len(re.findall(r"mbarrier\.try_wait\.parity", p2)) == 6
    assert p2.count("mbarrier.inval") == 6 and p2.count("mbarrier.init") == 12
    assert "rem.u32" in p2 or "mul.hi.u32" in p2          # seq % 3 and seq / 3
    assert _ptxas_usage(p2, tmp_path)[1] == 0


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("prefetch", [1, 2])
def test_linear_tma_pipe(tmp_path, prefetch):
    """tuning.tma_pipe on the TMA-fed huge tile: a K loop step waits on its tiles' mbarriers, runs its
    warpgroup MMAs with no fence or CTA barrier before them, commits them and waits only for the previous
    step's group (wait_group 1), then one CTA barrier, then issues its copies (into the buffer that group
    read): one CTA barrier a step (two without the switch). After the loop the last dot waits for every group.
    No spills, no more registers."""
    from engine.ops import matmul as mm
    from targets import get_target, tuned
    sig16 = LINEAR_SIG.replace("x=*f32:16", "x=*bf16:16")
    BM, BN, BK, W = mm.GPU_LINEAR_HUGE_TILE
    opts = ("ACT16=1", "wgmma=1", "tma=1") + (("num_stages=2",) if prefetch == 1 else ("num_stages=3", "PREFETCH=2"))
    ptx = {}
    for pipe in (False, True):
        ptx[pipe] = _linear_ptx(BM, BN, BK, extra=opts, warps=W, split=4, sig=sig16,
                                target=tuned(get_target("sm_90a"), tma_pipe=pipe))

    def loop_body(p):
        m = re.search(r"^(\$L__BB\d+_\d+):$(.*?)bra(?:\.uni)?\s+\1;", p, re.S | re.M)
        assert m, "no loop"
        return m.group(2)
    on, off = loop_body(ptx[True]), loop_body(ptx[False])
    assert on.count("bar.sync") == 1 and off.count("bar.sync") == 2, (on.count("bar.sync"), off.count("bar.sync"))
    assert "wgmma.wait_group.sync.aligned 1;" in on and "wgmma.wait_group.sync.aligned 0;" not in on
    assert "fence.proxy.async" not in on
    assert on.index("wgmma.commit_group") < on.index("bar.sync") < on.index("cp.async.bulk.tensor")
    assert on.count("cp.async.bulk.tensor") == 2 and off.count("cp.async.bulk.tensor") == 2
    assert "wgmma.wait_group.sync.aligned 0;" in ptx[True]          # the last dot, after the loop
    regs_on, spill_on = _ptxas_usage(ptx[True], tmp_path)
    regs_off, _ = _ptxas_usage(ptx[False], tmp_path)
    assert spill_on == 0 and regs_on <= regs_off, (regs_on, regs_off)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_tma_probe_assembles_and_models_the_wgmma_staging():
    """perf/probe_tma.py (the TMA probe for the H200): its 128-byte swizzle model is probe_wgmma's validated sw128
    layout, and its mbarrier + cp.async.bulk.tensor kernels assemble for sm_90a."""
    for flag, expect in (("--self-check", "is probe_wgmma's sw128 layout"), ("--ptxas-only", "two phases: PTX")):
        r = subprocess.run([sys.executable, "perf/probe_tma.py", flag], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and expect in r.stdout, (flag, r.stdout, r.stderr[-2000:])


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_flash_reduce_direct_and_longest_first_assemble(tmp_path):
    """tuning.reduce_direct: the flash kernels' short row reductions fold straight from the
    staged row, so the PTX has fewer bar.sync than the two-pass form; with the prefill's LONGEST_FIRST grid too,
    ptxas takes both kernels (16-bit operands: the engine's)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target, tuned
    dsig = ("q=*f32:16,k_cache=*f16:16,v_cache=*f16:16,out=*f32:16,ws_m=*f32:16,ws_l=*f32:16,ws_acc=*f32:16,"
            "query_start=*i32:16,seq_lens=*i32,block_table=*i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
            "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
    cases = [("flash_decode_kernel", dsig, ["num_warps=4", "R=16", "NUM_PARTS=16"]),
             ("flash_prefill_kernel", FLASH_PREFILL_SIG, FLASH_PREFILL_CONSTS + ["LONGEST_FIRST=True"])]
    for name, sig, extra in cases:
        k = load_kernel(f"engine.ops.attention:{name}")
        counts = []
        for direct in (False, True):
            params, cx = parse_sig(k, sig, FLASH_COMMON + extra)
            T = tuned(get_target("sm_90a"), reduce_direct=direct)
            ptx = compile_kernel(k, params, cx, T, load=False).artifacts["kernel.ptx"].decode()
            counts.append(len(re.findall(r"\bbar(rier)?\.sync", ptx)))
            _ptxas_usage(ptx, tmp_path)
        assert counts[1] < counts[0], (name, counts)


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
@pytest.mark.parametrize("sb", [2, 4])
def test_flash_step_blocks_assemble(tmp_path, sb):
    """tuning.flash_step_blocks (an A/B setting): the flash decode, merge and prefill kernels with
    online-softmax steps of sb cache blocks compile for sm_90a and ptxas takes them (16-bit operands, the engine's
    Llama-3-8B constants). Their speed and bits are for the GPU (tests/ops/test_attention_flash.py -k step_blocks)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    dsig = ("q=*f32:16,k_cache=*f16:16,v_cache=*f16:16,out=*f32:16,ws_m=*f32:16,ws_l=*f32:16,ws_acc=*f32:16,"
            "query_start=*i32:16,seq_lens=*i32,block_table=*i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
            "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
    msig = FLASH_MERGE_SIG
    decode = ["num_warps=4", "R=16", "NUM_PARTS=16", "PIPE=False"]
    cases = [("flash_decode_kernel", dsig, decode),
             ("flash_prefill_kernel", FLASH_PREFILL_SIG, FLASH_PREFILL_CONSTS + ["LONGEST_FIRST=True", "FOLD_SKIP=True"]),
             ("flash_merge_kernel", msig, ["KVH=8", "G=4", "GP=4", "D=128", "BS=16", "NUM_PARTS=16", "PB=4", "MAXP=16",
                                          "SINKS=False"])]
    for name, sig, extra in cases:
        k = load_kernel(f"engine.ops.attention:{name}")
        common = [] if name == "flash_merge_kernel" else \
            [c for c in FLASH_COMMON if not any(c.split("=")[0] == e.split("=")[0] for e in extra)]
        params, cx = parse_sig(k, sig, common + extra + [f"SB={sb}"])
        ptx = compile_kernel(k, params, cx, get_target("sm_90a"), load=False).artifacts["kernel.ptx"].decode()
        _ptxas_usage(ptx, tmp_path)


# flash_merge_kernel's arguments as the engine passes them (the quantised-output arrays: unused unless Q8G > 0)
FLASH_MERGE_SIG = ("out=*f32:16,ws_m=*f32:16,ws_l=*f32:16,ws_acc=*f32:16,query_start=*i32:16,seq_lens=*i32,o_ts=i32:16,"
                   "o_hs=i32:16,window=i32:16,sinks=*f32:16,qx=*f32:16,xd=*f32:16,xs=*f32:16,xd4=*f32:16,xs4=*f32:16")


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_flash_merge_q8_output_assembles(tmp_path):
    """flash_merge_kernel writing a GGUF o projection's int8 input (Q8G, SmolLM2's constants: 3 KV heads of 3
    query heads padded to 4 rows, head_dim 64, the device's natural layout with 4-fold scales): ptxas takes it
    without spills, and the read-back of the group's rows follows a CTA barrier. Its bits: tests/ops/
    test_attention_flash.py -k q8 (CPU, lavapipe; on the GPU, -m gpu)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    k = load_kernel("engine.ops.attention:flash_merge_kernel")
    sig = FLASH_MERGE_SIG.replace("qx=*f32:16", "qx=*i8:16")
    params, cx = parse_sig(k, sig, ["KVH=3", "G=3", "GP=4", "D=64", "BS=16", "NUM_PARTS=16", "PB=4", "MAXP=16",
                                    "SINKS=False", "Q8G=1", "REP4=True"])
    ptx = compile_kernel(k, params, cx, get_target("sm_90a"), load=False).artifacts["kernel.ptx"].decode()
    assert re.search(r"\bbar(rier)?\.sync", ptx)
    regs, spilled = _ptxas_usage(ptx, tmp_path)
    assert spilled == 0, (regs, spilled)


def test_warp_rows_register_layout():
    """The row pattern the warp-owned rows lowering reads off the NVIDIA m16n8k16 accumulator layout (numpy lanes
    through the same mma_layout the code uses): two row classes (c0, c1 on row lane // 4, c2, c3 eight below),
    four lanes to a row, and a row's 8 columns of a tile in order at (lane % 4, register): (0, c0), (0, c1),
    (1, c0), ... The row sum hands its running value along that order, so it adds in the tile path's order."""
    from jitkern.backends.gpu import GpuLowering
    from jitkern.backends.nvptx import NvptxHooks
    from targets import get_target
    t = get_target("sm_90a")
    low = GpuLowering.__new__(GpuLowering)
    low.target, low.hooks = t, NvptxHooks(t)
    info = low._row_info()
    assert info["H"] == 2 and info["Q"] == 4 and info["cls"] == [0, 0, 1, 1]
    assert info["order"][0] == [(q, j) for q in range(4) for j in (0, 1)]
    assert info["order"][1] == [(q, j) for q in range(4) for j in (2, 3)]


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra)")
def test_flash_prefill_warp_rows_assemble(tmp_path):
    """tuning.flash_warp_rows' prefill tile (32 rows at 4 warps, launched with `warp_rows`: two warps a 16-row
    tile, the scores in both, P @ V's columns split) at the engine's Llama-3-8B constants: the online softmax's
    row max and row sum are lane shuffles (shfl in the PTX) instead of shared-memory round trips, P @ V takes P
    from the score registers and its V tile is staged with K (under a quarter of the default tile's bar.sync), and
    ptxas takes it without spills. Its bits are for the GPU
    (tests/ops/test_attention_flash.py -k warp_rows)."""
    out = []
    for on in (False, True):
        ptx = _warp_rows_prefill_ptx(warp_rows=on)
        out.append((len(re.findall(r"\bbar(rier)?\.sync", ptx)), ptx.count("shfl.sync"), _ptxas_usage(ptx, tmp_path)))
    (bars0, shfl0, _), (bars1, shfl1, (regs, spills)) = out
    assert shfl0 == 0 and shfl1 > 0, out
    assert 4 * bars1 < bars0, out
    assert spills == 0, out


def test_exp_fast_lowers_to_ex2():
    """jk.exp_fast on sm_90a with tuning.fast_exp: a multiply and ex2.approx.ftz an element, not
    exp's Cody-Waite polynomial; without it, the polynomial (no ex2)."""
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target, tuned
    from tests.test_dsl import _exp_fast
    k = load_kernel("tests.test_dsl:_unary")
    out = []
    for on in (False, True):
        params, cx = parse_sig(k, "x=*f32:16,out=*f32:16,n=i32", ["BLOCK=128", "F=0"])
        cx["F"] = _exp_fast
        ck = compile_kernel(k, params, cx, tuned(get_target("sm_90a"), fast_exp=on), load=False)
        ptx = ck.artifacts["kernel.ptx"].decode()
        out.append(ptx.count("ex2.approx"))
    assert out[0] == 0 and out[1] > 0, out


@pytest.mark.parametrize("prefetch", [1, 2])
def test_serial_chain_sums_in_registers_and_shares_the_copy_buffers(prefetch):
    """The engine's serial split at prefill sizes (a narrow weight, K split in 4, the huge tile on warpgroup MMAs
    fed by TMA), compiled for sm_90a (no ptxas needed): with the copy chain through the slabs (tuning.serial_chain)
    every tile is a TMA copy (no global loads), the slabs' running sum stays in the MMA registers (tuning.wg_sums:
    one C tile in shared memory, at the end) and that tile shares the copy buffers, so the kernel needs no more
    shared memory than the restarting form (without the register sums: more than one CTA an SM can hold)."""
    from engine.ops import matmul as mm
    from jitkern.runtime.launch import compile_only
    from targets import get_target, tuned
    T0 = tuned(get_target("sm_90a"), linear_prefetch=prefetch)
    rng = np.random.default_rng(5)
    M, N, K = T0.tuning.serial_split_m, 4096, 4096
    x = rng.integers(0, 1 << 14, (M, K), dtype=np.uint16)
    w = rng.integers(0, 1 << 14, (N, K), dtype=np.uint16)
    got = {}
    for chain, sums in ((False, False), (False, True), (True, True), (True, False)):
        T = tuned(T0, serial_chain=chain, wg_sums=sums)
        with compile_only(target=T) as co:
            mm.linear(x, w, w_dtype="bf16", target=T, x_dtype="bf16")
        assert not co.errors, co.errors
        ck = co.compiled[-1]
        assert ck.name == "_gpu_linear_mma_kernel" and ck.constexprs["SERIAL"] and ck.constexprs["CHAIN"] == chain
        assert ck.constexprs.get("tma") == 1 and ck.constexprs.get("PREFETCH", 1) == prefetch
        ptx = ck.artifacts["kernel.ptx"]
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        assert "ld.global" not in ptx and "cp.async.bulk.tensor" in ptx
        # C tiles through shared memory: the stores of one after each slab's loop, or of one at the end
        got[(chain, sums)] = (ck.launch_meta["shared_bytes"], ptx.count("st.shared"),
                              ptx.count("mbarrier.init"))
    base = got[(False, False)]
    assert got[(False, True)][0] <= base[0] and got[(True, True)][0] <= base[0], got
    assert got[(True, False)][0] > base[0], got          # (what the register sums avoid)
    assert got[(True, True)][1] <= got[(False, False)][1] < got[(True, False)][1], got
    # the chain arms its barriers once: at the kernel's start and at its first copy, as the restarting form
    # does in its code (there at every slab, at run time)
    assert got[(True, True)][2] == base[2], got


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra; the [test] extra brings it)")
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rope_cache_tile_kernel_assembles_without_spills(tmp_path, neox):
    """tuning.rope_tiles: rope_and_cache of a step past ROPE_CACHE_PER_HEAD_MAX_T tokens on sm_90a (Llama-3-8B's
    heads, f16 cache) compiles to rope_cache_tile_kernel, which ptxas assembles without spills; off, the head loop."""
    from engine.ops import rope as R
    from jitkern.runtime.launch import compile_only
    from targets import get_target, tuned
    T, H, KVH, D = R.ROPE_CACHE_PER_HEAD_MAX_T + 44, 32, 8, 128
    qkv = np.zeros((T, (H + 2 * KVH) * D), np.float32)
    q, k, v = (qkv[:, c:c + n * D].reshape(T, n, D) for c, n in ((0, H), (H * D, KVH), ((H + KVH) * D, KVH)))
    kc = np.zeros((32, 16, KVH, D), np.float16)
    cache = R.rope_cos_sin_cache(D, D, 4096, 500000.0)
    names = {}
    for tiles in (False, True):
        gpu = tuned(get_target("sm_90a"), rope_tiles=tiles)
        with compile_only(target=gpu) as co:
            R.rope_and_cache(q, k, v, np.arange(T, dtype=np.int32), cache, D, D, neox, kc, kc.copy(),
                             np.arange(T, dtype=np.int32) % 512, target=gpu)
        assert not co.errors, co.errors
        ck = co.compiled[-1]
        names[tiles] = ck.name
        if tiles:
            ptx = ck.artifacts["kernel.ptx"]
            _, spills = _ptxas_usage(ptx.decode() if isinstance(ptx, bytes) else ptx, tmp_path)
            assert spills == 0
    assert names == {False: "rope_cache_kernel", True: "rope_cache_tile_kernel"}, names


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (the [cuda] extra; the [test] extra brings it)")
def test_16bit_out_linear_and_gated_kernel_assemble_without_spills(tmp_path):
    """The engine's gate/up projection with a bf16 output (tuning.gate_up16) at every tile the step size picks on
    sm_90a (decode, big, huge, XL; TMA from 64 tokens) and the one gated kernel (matmul.gated_linear, decode
    sizes) compile for sm_90a and ptxas assembles them without spills; the gated kernel stores the 16-bit gate_up,
    has one CTA barrier more than the linear's after its K loop and reads gate_up back."""
    from engine.ops import matmul as mm
    from jitkern.runtime.launch import compile_only
    from targets import get_target
    T = get_target("sm_90a")
    N, K = 28672, 4096
    w = np.zeros((N, K), np.uint16)
    seen = set()
    for M in (1, 16, 64, 256, mm.GPU_LINEAR_XL_M):
        x = np.zeros((M, K), np.uint16)
        with compile_only(target=T) as co:
            mm.linear(x, w, w_dtype="bf16", x_dtype="bf16", out=np.zeros((M, N), np.uint16), target=T)
            if M <= mm.GPU_GATED_MAX_M:
                mm.gated_linear(x, w, np.zeros((M, N // 2), np.uint16), np.zeros((M, N), np.uint16),
                                w_dtype="bf16", target=T)
        assert not co.errors, co.errors
        for ck in co.compiled:
            ptx = ck.artifacts["kernel.ptx"]
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            key = (ck.name, ck.constexprs.get("BM"))
            if key in seen:
                continue
            seen.add(key)
            _, spilled = _ptxas_usage(ptx, tmp_path)
            assert spilled == 0, (key, spilled)
            if ck.name == "_gpu_gated_linear_kernel":
                assert "st.global" in ptx and ptx.count("bar.sync") >= 1
    assert ("_gpu_gated_linear_kernel", 16) in seen
    assert {bm for name, bm in seen if name == "_gpu_linear_mma_kernel"} >= {16, 64, 128, 256}, seen
