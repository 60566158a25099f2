"""Dense matrix products: `linear` (y = x @ w^T + bias, the transformer projection), `matmul` (a @ b).

API: `linear(x, w, bias=None, out=None, target=None, w_dtype=None)` on weights as stored ([N, K]; f32, f16,
or bf16 as uint16 storage with w_dtype='bf16' / a jk.Pointer); `pack_weight(w) -> PackedWeight` once (model
load) + `linear_packed(x, packed, bias=None, out=None)`; `matmul(a, b, out=None)` for plain f32 a[M,K] @ b[K,N].
All accumulate and return f32.

Three kernels:

- `_gemv_kernel` (linear, M <= GEMV_MAX_M: decode): a program takes 8 weight rows *one after the other*, each
  over its whole K against BM <= 4 tokens, with U x V-lane accumulators per token. Decode is bandwidth-bound
  and its weights come from DRAM; a thread that reads one monotonic stream gets ~2x the DRAM bandwidth of
  one that reads 8 rows in lockstep (measured on znver4, f16: 10 -> 23 GB/s per core), at a 5-15% cost
  when the weights sit in L2/L3.
- `_rows_kernel` (linear, larger M), the *dot-product* form for weights as stored: a program owns a
  (BM, BN) block of y and keeps a (BM, BN, V) accumulator that it reduces over lanes once at the end; every
  load is a full contiguous vector and each weight is read once per BM tokens.
- `_gemm_kernel` (linear_packed, matmul), the *outer-product* register-blocked microkernel on weights packed
  into column panels: panel p holds columns [p*BN, (p+1)*BN) of B = w^T as K contiguous rows of BN values
  (zero-padded past N). Per k it loads one row of the panel (BN/V vectors) and broadcasts one value of x per
  output row straight from memory (vbroadcastss / an FMA memory operand), keeping a (BM, BN) accumulator in
  registers: BM*BN/V FMAs per BM + BN/V loads, no shuffles. The panel is read contiguously, which also
  avoids the cache-set conflicts of a power-of-two row stride in plain row-major B (2x at N = 512).
  Tiles (`_gemm_shape`, measured single-thread at n = 1024): 8 x 32 on AVX-512 (16 of 32 zmm), 6 x 16 on
  AVX2 (12 of 16 ymm; 6 rows = a 4-row plus a 2-row accumulator, since LLVM legalises only power-of-two
  vectors well), 4 x 16 on SSE2/portable (mul + add). It runs at ~1 zmm FMA per cycle (~106 GFLOP/s per
  znver4 core, numpy/OpenBLAS's speed); SSE2 at ~37 (4 lanes, no FMA).

Edges without masks in the hot loops: the last block of tokens (and of weight rows) is shifted back to end
at M (N) and overlaps its neighbour, which recomputes and rewrites identical values; so blocks never exceed
M (N) and the wrappers pick them accordingly. K tails run in short separate loops or one masked step.
Packed panels are zero-padded, so their loads need no mask; only the last panel's store is masked.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import jitkern as jk
from jitkern.ir import bf16 as _BF16
from jitkern.jit import Pointer, as_pointer
from engine.ops._hostargs import device_scratch, empty_like_dev, is_array, is_device, resolve_target
from jitkern.runtime.cpu import runtime_target
from jitkern.runtime.launch import launch
from targets import get_target

__all__ = ["linear", "linear_packed", "matmul", "pack_weight", "PackedWeight", "last_compiled", "GEMV_MAX_M"]


# ---------------------------------------------------------------------------------------------- kernels
@jk.jit
def _panel_step(a, panel, rows, k, lda, cols, acc, BN: jk.constexpr):
    """acc[i, :] += a[rows[i], k] * panel[k, :] (one rank-1 update of the register tile)."""
    bv = jk.load(jk.broadcast_to(panel + k * BN + cols[None, :], acc.shape)).to(jk.f32)
    av = jk.load(jk.broadcast_to(a + rows[:, None] * lda + k, acc.shape))
    return jk.fma(av, bv, acc)


@jk.kernel(do_not_specialize=('M',))
def _gemm_kernel(a, bp, bias, c, M, N, K, lda, ldc, HAS_BIAS: jk.constexpr, BM1: jk.constexpr,
                 BM2: jk.constexpr, BN: jk.constexpr, BK: jk.constexpr):
    # c[M, N] = a[M, K] @ B (+ bias); B given as packed panels `bp` (see module docs). Grid (row blocks,
    # column panels); the row block of BM1 + BM2 rows is split into two accumulators (BM2 may be 0).
    BM = BM1 + BM2
    pm = jk.program_id(0)
    pn = jk.program_id(1)
    row0 = jk.minimum(pm * BM, M - BM).to(jk.i64)     # the last block overlaps its neighbour
    K64 = K.to(jk.i64)
    lda64 = lda.to(jk.i64)
    cols = jk.arange(0, BN).to(jk.i64)
    panel = bp + pn.to(jk.i64) * K64 * BN
    rows1 = row0 + jk.arange(0, BM1).to(jk.i64)
    acc1 = jk.zeros((BM1, BN), jk.f32)
    if BM2 > 0:
        rows2 = row0 + BM1 + jk.arange(0, BM2).to(jk.i64)
        acc2 = jk.zeros((BM2, BN), jk.f32)
    kmain = K - K % BK
    for k in range(0, kmain, BK):
        k64 = k.to(jk.i64)
        for kk in jk.static_range(BK):
            acc1 = _panel_step(a, panel, rows1, k64 + kk, lda64, cols, acc1, BN)
            if BM2 > 0:
                acc2 = _panel_step(a, panel, rows2, k64 + kk, lda64, cols, acc2, BN)
    for k in range(kmain, K, 1):
        k64 = k.to(jk.i64)
        acc1 = _panel_step(a, panel, rows1, k64, lda64, cols, acc1, BN)
        if BM2 > 0:
            acc2 = _panel_step(a, panel, rows2, k64, lda64, cols, acc2, BN)
    gcols = pn.to(jk.i64) * BN + cols
    if HAS_BIAS:
        bv = jk.load(bias + gcols, mask=gcols < N, other=0.0).to(jk.f32)
        acc1 = acc1 + bv[None, :]
        if BM2 > 0:
            acc2 = acc2 + bv[None, :]
    ldc64 = ldc.to(jk.i64)
    if (pn + 1) * BN <= N:
        jk.store(c + rows1[:, None] * ldc64 + gcols[None, :], acc1)
        if BM2 > 0:
            jk.store(c + rows2[:, None] * ldc64 + gcols[None, :], acc2)
    else:
        jk.store(c + rows1[:, None] * ldc64 + gcols[None, :], acc1,
                 mask=jk.broadcast_to((gcols < N)[None, :], (BM1, BN)))
        if BM2 > 0:
            jk.store(c + rows2[:, None] * ldc64 + gcols[None, :], acc2,
                     mask=jk.broadcast_to((gcols < N)[None, :], (BM2, BN)))


@jk.kernel
def _pack_kernel(src, dst, N, K, ld, TRANS: jk.constexpr, BN: jk.constexpr, KB: jk.constexpr):
    # dst[p, k, j] = B[k, p*BN + j] (0 past N), B = src^T for TRANS (src is w[N, K]) else src (b[K, N]).
    # Interior tiles take an unmasked path: AVX2 has no 16-bit masked loads/stores (they become branches).
    pn = jk.program_id(0)
    pk = jk.program_id(1)
    cols = pn * BN + jk.arange(0, BN)
    ks = pk * KB + jk.arange(0, KB)
    out = dst + pn.to(jk.i64) * K * BN + ks[:, None].to(jk.i64) * BN + jk.arange(0, BN)[None, :]
    if TRANS:
        src_tile = src + cols[:, None].to(jk.i64) * ld + ks[None, :]
    else:
        src_tile = src + ks[:, None].to(jk.i64) * ld + cols[None, :]
    if (pn + 1) * BN <= N and (pk + 1) * KB <= K:
        t = jk.load(src_tile)
        if TRANS:
            t = jk.trans(t)
        jk.store(out, t)
    else:
        if TRANS:
            t = jk.trans(jk.load(src_tile, mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0))
        else:
            t = jk.load(src_tile, mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        jk.store(out, t, mask=jk.broadcast_to(ks[:, None] < K, (KB, BN)))


@jk.kernel(do_not_specialize=('M',))
def _gemv_kernel(x, w, bias, y, M, N, K, ldx, ldy, HAS_BIAS: jk.constexpr, BM: jk.constexpr, R: jk.constexpr,
                 V: jk.constexpr, U: jk.constexpr):
    # y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few tokens (M <= ~4: decode): a program takes R weight rows
    # *one after the other*, each over its whole K against BM tokens, so a thread reads the weights as one
    # monotonic stream (R rows in lockstep are R short streams that the prefetchers follow badly: about 2x less
    # DRAM bandwidth measured on znver4). U x V lanes per token and step keep U FMA chains in flight.
    pm = jk.program_id(0)
    pn = jk.program_id(1)
    row0 = jk.minimum(pm * BM, M - BM).to(jk.i64)     # last blocks overlap their neighbours
    n0 = jk.minimum(pn * R, N - R).to(jk.i64)
    K64 = K.to(jk.i64)
    toks = row0 + jk.arange(0, BM).to(jk.i64)
    ldy64 = ldy.to(jk.i64)
    xrow1 = x + toks[:, None] * ldx.to(jk.i64)
    kv = jk.arange(0, V)[None, :]
    kvec = K - K % V
    for r in range(0, R, 1):
        n = n0 + r
        wrow = w + n * K64
        # The same arithmetic per output as _rows_kernel (one V-lane FMA chain over K, the masked tail into
        # the same chain, one lane-sum tree): a token's result does not depend on how many tokens share the
        # launch (batch invariance). U is kept in the signature for the tile table but is 1.
        acc = jk.zeros((BM, V), jk.f32)
        for k in range(0, kvec, V):
            acc = jk.fma(jk.load(xrow1 + k + kv), jk.load(wrow + k + kv).to(jk.f32), acc)
        if kvec < K:
            m = (kvec + kv) < K
            acc = jk.fma(jk.load(xrow1 + kvec + kv, mask=jk.broadcast_to(m, (BM, V)), other=0.0),
                         jk.load(wrow + kvec + kv, mask=m, other=0.0).to(jk.f32), acc)
        s = jk.sum(acc, axis=1)
        if HAS_BIAS:
            s = s + jk.load(bias + n).to(jk.f32)
        jk.store(y + toks * ldy64 + n, s)


@jk.kernel(do_not_specialize=('M',))
def _rows_kernel(x, w, bias, y, M, N, K, ldx, ldy, HAS_BIAS: jk.constexpr, BM: jk.constexpr,
                 BN: jk.constexpr, V: jk.constexpr):
    # y[M, N] = x[M, K] @ w[N, K]^T (+ bias), dot-product form; grid (row blocks, column blocks).
    pm = jk.program_id(0)
    pn = jk.program_id(1)
    row0 = jk.minimum(pm * BM, M - BM).to(jk.i64)     # last blocks overlap their neighbours
    n0 = jk.minimum(pn * BN, N - BN).to(jk.i64)
    K64 = K.to(jk.i64)
    rows = row0 + jk.arange(0, BM).to(jk.i64)
    wrows = n0 + jk.arange(0, BN).to(jk.i64)
    kv = jk.arange(0, V)
    xrow = x + rows[:, None] * ldx.to(jk.i64)
    wrow = w + wrows[:, None] * K64
    acc = jk.zeros((BM, BN, V), jk.f32)
    kmain = K - K % V
    for k in range(0, kmain, V):
        xv = jk.load(xrow + (k + kv)[None, :])
        wv = jk.load(wrow + (k + kv)[None, :]).to(jk.f32)
        acc = jk.fma(xv[:, None, :], wv[None, :, :], acc)
    if kmain < K:
        m = (kmain + kv) < K
        xv = jk.load(xrow + (kmain + kv)[None, :], mask=jk.broadcast_to(m[None, :], (BM, V)), other=0.0)
        wv = jk.load(wrow + (kmain + kv)[None, :], mask=jk.broadcast_to(m[None, :], (BN, V)), other=0.0)
        acc = jk.fma(xv[:, None, :], wv.to(jk.f32)[None, :, :], acc)
    out = jk.sum(acc, axis=2)
    if HAS_BIAS:
        out = out + jk.load(bias + wrows).to(jk.f32)[None, :]
    jk.store(y + rows[:, None] * ldy.to(jk.i64) + wrows[None, :], out)


@jk.kernel(do_not_specialize=("M",))
def _gpu_linear_kernel(x, w, bias, y, M, N, K, ldx, ldy, HAS_BIAS: jk.constexpr, BN: jk.constexpr,
                       BK: jk.constexpr, EVEN: jk.constexpr = False):
    # GPUs: y[t, n0:n0+BN] for one token t per program row, grid (M, N / BN). The BN weight rows stream in
    # (BN, BK) tiles, contiguous along K (16-byte accesses), FMAs into a (BN, BK) f32 accumulator, one fixed
    # reduction at the end: a token's arithmetic is the same whatever M is (batch invariant, one kernel for
    # decode and prefill). EVEN (N % BN == 0 and K % BK == 0) drops the masks: plain loads that LLVM may
    # schedule and deduplicate freely.
    t = jk.program_id(0).to(jk.i64)
    rows = jk.program_id(1) * BN + jk.arange(0, BN)
    rm = rows < N
    kk = jk.arange(0, BK)
    xrow = x + t * ldx.to(jk.i64)
    wrows = w + rows.to(jk.i64)[:, None] * K.to(jk.i64)
    acc = jk.zeros((BN, BK), jk.f32)
    for k in range(0, K, BK):
        # x is loaded straight into the (BN, BK) tile's layout (every row's lanes read the same addresses,
        # served by L1) rather than loaded once and broadcast: a broadcast of loaded data is a layout change
        # through shared memory, two barriers per step
        xp = xrow + (k + kk)[None, :] + (rows * 0)[:, None]
        if EVEN:
            xv = jk.load(xp)
            wv = jk.load(wrows + (k + kk)[None, :]).to(jk.f32)
        else:
            km = (k + kk) < K
            xv = jk.load(xp, mask=km[None, :] & (rows >= 0)[:, None], other=0.0)
            wv = jk.load(wrows + (k + kk)[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(jk.f32)
        acc = jk.fma(wv, xv, acc)
    s = jk.sum(acc, axis=1)
    if HAS_BIAS:
        s = s + jk.load(bias + rows, mask=rm, other=0.0).to(jk.f32)
    jk.store(y + t * ldy.to(jk.i64) + rows, s, mask=rm)


@jk.kernel(do_not_specialize=("M", "xmap", "wmap"))
def _gpu_linear_mma_kernel(x, w, bias, y, M, N, K, ldx, ldy, xmap, wmap, HAS_BIAS: jk.constexpr, BM: jk.constexpr,
                           BN: jk.constexpr, BK: jk.constexpr, EVEN: jk.constexpr = False,
                           SPLIT: jk.constexpr = 1, ACT16: jk.constexpr = 0, SERIAL: jk.constexpr = False,
                           PREFETCH: jk.constexpr = 1, CHAIN: jk.constexpr = False):
    # GPUs with matrix units: y[BM tokens, BN outputs] per program, grid (M / BM, N / BN, SPLIT).
    # `dot(x, trans(w))` runs as MMAs: w's (BN, BK) rows go to shared memory as they are (the lowering folds
    # the transpose), f32 x as two 16-bit parts (hi + lo, ~16 significant bits). A token's row of MMAs and
    # the K order do not depend on the other rows, so a token's result is the same whatever M is (batch
    # invariant; M = 1 pads the tile with masked rows). SPLIT > 1 (EVEN only; chosen from N and K alone):
    # program z sums the z-th of SPLIT equal K ranges into its own (M, N) slab of y (row stride ldy), and
    # _gpu_splitk_sum_kernel adds the slabs in order: more programs in flight for narrow N at decode.
    # SERIAL (with SPLIT > 1; grid (M / BM, N / BN)): the program computes the SPLIT slabs one after the other and
    # adds them in the sum kernel's order, ((slab 0 + slab 1) + ...) + bias, then stores y: the same bits with no
    # slabs written to and read back from memory (prefill sizes, where the tiles alone fill the GPU). CHAIN (with
    # SERIAL): one copy chain runs through all the slabs (_mma_serial_chain), the same dots in the same order.
    # ACT16 (GPU_LINEAR_ACTIVATIONS = "16bit"): x rounded to the weights' 16-bit type (1 bf16, 2 f16) first, one
    # MMA chain instead of the hi and lo chains (half the MMAs and A staging; 8 or 11 significant bits of x,
    # as vLLM / cuBLAS bf16 inference computes). PREFETCH (1 or 2; EVEN, every K range of 2+ steps): how many
    # steps ahead the K loop loads its tiles (2 with num_stages=3: three cp.async buffers; the same dots in the
    # same order). xmap / wmap (i64): the global addresses of x's and w's tensor maps where the launch has the
    # `tma` option (_tma_maps: the K loop's tiles are their boxes), else 0 and unused.
    t0 = jk.program_id(0) * BM
    r0 = jk.program_id(1) * BN
    tok = t0 + jk.arange(0, BM)
    rows = r0 + jk.arange(0, BN)
    tm = tok < M
    rm = rows < N
    kk = jk.arange(0, BK)
    xrows = x + tok.to(jk.i64)[:, None] * ldx.to(jk.i64)
    wrows = w + rows.to(jk.i64)[:, None] * K.to(jk.i64)
    if EVEN:
        if SPLIT > 1:
            KR = (K // (SPLIT * BK)) * BK           # a multiple of BK: the axis analysis keeps 16-byte loads
            if SERIAL and CHAIN:
                xm = tm[:, None] & (kk >= 0)[None, :]
                acc = _mma_serial_chain(xrows, wrows, xm, kk, KR, BM, BN, BK, ACT16, PREFETCH, xmap, wmap, t0, r0,
                                        SPLIT)
            elif SERIAL:
                xm = tm[:, None] & (kk >= 0)[None, :]
                # -0.0 + s == s for every s (+0.0 and -0.0 too): the sum starts exactly at slab 0, as the sum
                # kernel's; one K loop in the code (its shared-memory staging allocated once)
                acc = jk.full((BM, BN), -0.0, jk.f32)
                for z in range(0, SPLIT):
                    acc = acc + _mma_k_range(xrows, wrows, xm, kk, z * KR, KR, BM, BN, BK, ACT16, PREFETCH,
                                             xmap, wmap, t0, r0)
            else:
                k0 = jk.program_id(2) * KR
                xm = tm[:, None] & (kk >= 0)[None, :]
                acc = _mma_k_range(xrows, wrows, xm, kk, k0, KR, BM, BN, BK, ACT16, PREFETCH, xmap, wmap, t0, r0)
        else:
            xm = tm[:, None] & (kk >= 0)[None, :]
            acc = _mma_k_range(xrows, wrows, xm, kk, 0, K, BM, BN, BK, ACT16, PREFETCH, xmap, wmap, t0, r0)
    else:
        acc = jk.zeros((BM, BN), jk.f32)
        for k in range(0, K, BK):
            km = (k + kk) < K
            xv = jk.load(xrows + (k + kk)[None, :], mask=tm[:, None] & km[None, :], other=0.0)
            wv = jk.load(wrows + (k + kk)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
    if SPLIT > 1 and not SERIAL:
        y = y + jk.program_id(2).to(jk.i64) * M.to(jk.i64) * ldy.to(jk.i64)
    elif HAS_BIAS:
        acc = acc + jk.load(bias + rows, mask=rm, other=0.0).to(jk.f32)[None, :]
    jk.store(y + tok.to(jk.i64)[:, None] * ldy.to(jk.i64) + rows[None, :], acc, mask=tm[:, None] & rm[None, :])


@jk.kernel(do_not_specialize=("M",))
def _gpu_gated_linear_kernel(x, w, gu, y, M, N2, K, ldx, ldg, ldy, ACT: jk.constexpr, BM: jk.constexpr,
                             BN: jk.constexpr, BK: jk.constexpr, ACT16: jk.constexpr):
    # gu[t, :] = x[t] @ w^T (w = [w_gate; w_up], N2 rows each, gu in 16-bit storage: the f32 sums rounded as they
    # are stored) and y[t, j] = ACT(gu[t, j]) * gu[t, N2 + j], j < N2, in one launch. A program's (BM, BN) tile takes
    # BN / 2 gate rows and the up rows of the same outputs, so its one dot (one x staging a K step, as the
    # linear's) holds both halves of its outputs; they go to gu (each column the same MMA chain in K order as
    # _gpu_linear_mma_kernel's unsplit tile: the linear's bits), and after a CTA barrier (which orders the CTA's
    # global stores before its loads) the program reads them back, from L1 / L2, for the activation: the bits of
    # the linear into 16-bit gu then act_and_mul_kernel, without the second launch. Grid (M / BM, N2 / (BN / 2)).
    t0 = jk.program_id(0) * BM
    r0 = jk.program_id(1) * (BN // 2)
    tok = t0 + jk.arange(0, BM)
    j = jk.arange(0, BN)
    rows = jk.where(j < BN // 2, r0 + j, N2 + r0 + j - BN // 2)      # gate rows, then the same outputs' up rows
    tm = tok < M
    kk = jk.arange(0, BK)
    xm = tm[:, None] & (kk >= 0)[None, :]
    xrows = x + tok.to(jk.i64)[:, None] * ldx.to(jk.i64)
    wrows = w + rows.to(jk.i64)[:, None] * K.to(jk.i64)
    acc = _mma_k_range(xrows, wrows, xm, kk, 0, K, BM, BN, BK, ACT16, 1, 0, 0, t0, r0)
    grow = gu + tok.to(jk.i64)[:, None] * ldg.to(jk.i64)
    jk.store(grow + rows[None, :], acc, mask=tm[:, None])
    jk.barrier()
    h = r0 + jk.arange(0, BN // 2)
    g = jk.load(grow + h[None, :], mask=tm[:, None], other=0.0).to(jk.f32)
    u = jk.load(grow + N2 + h[None, :], mask=tm[:, None], other=0.0).to(jk.f32)
    jk.store(y + tok.to(jk.i64)[:, None] * ldy.to(jk.i64) + h[None, :], ACT(g) * u, mask=tm[:, None])


@jk.jit
def _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0):
    """The (x, w) tiles of the K step at k: x's (BM, BK) and w's (BN, BK), also the boxes at (t0, k) / (r0, k) of
    the tensor maps xmap / wmap (jk.tma: launched with `tma`, sm_90a copies them by TMA)."""
    return (jk.tma(jk.load(xrows + (k + kk)[None, :], mask=xm, other=0.0), xmap, t0, k),
            jk.tma(jk.load(wrows + (k + kk)[None, :]), wmap, r0, k))


@jk.jit
def _mma_serial_chain(xrows, wrows, xm, kk, KR, BM, BN, BK, ACT16, PREFETCH, xmap, wmap, t0, r0, SPLIT):
    """The serial split's sum ((slab 0 + slab 1) + ...) over SPLIT slabs of KR (a multiple of BK; of 2 BK or more
    with PREFETCH 2), each slab's dots from zero as _mma_k_range's, but with one prefetch chain through all of
    them: the slab loop carries the tiles, so the last steps of a slab load the next slab's first tiles and its
    copies never drain (the lowering's async analysis follows a chain through a loop that only passes it to
    an inner one, and into the loop after it). The last slab's loop stops loading where K ends."""
    run = jk.full((BM, BN), -0.0, jk.f32)        # (-0.0 + s == s: the sum starts exactly at slab 0)
    xv, wv = _k_tiles(xrows, wrows, xm, kk, 0, xmap, wmap, t0, r0)
    if PREFETCH == 2:
        xv1, wv1 = _k_tiles(xrows, wrows, xm, kk, BK, xmap, wmap, t0, r0)
        for z in range(0, SPLIT - 1):
            acc = jk.zeros((BM, BN), jk.f32)
            for k in range(z * KR + 2 * BK, z * KR + KR + 2 * BK, BK):
                xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
                acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
                xv, wv, xv1, wv1 = xv1, wv1, xn, wn
            run = run + acc
        acc = jk.zeros((BM, BN), jk.f32)
        for k in range((SPLIT - 1) * KR + 2 * BK, SPLIT * KR, BK):
            xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
            acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
            xv, wv, xv1, wv1 = xv1, wv1, xn, wn
        acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
        return run + jk.dot(_act16(xv1, ACT16), jk.trans(wv1), acc)
    for z in range(0, SPLIT - 1):
        acc = jk.zeros((BM, BN), jk.f32)
        for k in range(z * KR + BK, z * KR + KR + BK, BK):
            xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
            acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
            xv, wv = xn, wn
        run = run + acc
    acc = jk.zeros((BM, BN), jk.f32)
    for k in range((SPLIT - 1) * KR + BK, SPLIT * KR, BK):
        xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
        acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
        xv, wv = xn, wn
    return run + jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)


@jk.jit
def _mma_k_range(xrows, wrows, xm, kk, k0, KR, BM, BN, BK, ACT16, PREFETCH, xmap, wmap, t0, r0):
    """The (BM, BN) tile's dots over K in [k0, k0 + KR) (EVEN: KR a multiple of BK, and of 2 BK or more with
    PREFETCH 2), from zero. Software pipelining: the tiles of the step PREFETCH ahead are loaded before this
    step's dot, so their global loads are in flight while the dot stages shared memory and runs its MMAs (same
    arithmetic order). The tiles are also the boxes at (t0, k) / (r0, k) of the tensor maps xmap / wmap (jk.tma:
    launched with `tma`, sm_90a copies them by TMA; the maps are _tma_maps')."""
    acc = jk.zeros((BM, BN), jk.f32)
    xv, wv = _k_tiles(xrows, wrows, xm, kk, k0, xmap, wmap, t0, r0)
    if PREFETCH == 2:
        xv1, wv1 = _k_tiles(xrows, wrows, xm, kk, k0 + BK, xmap, wmap, t0, r0)
        for k in range(k0 + 2 * BK, k0 + KR, BK):
            xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
            acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
            xv, wv, xv1, wv1 = xv1, wv1, xn, wn
        acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
        return jk.dot(_act16(xv1, ACT16), jk.trans(wv1), acc)
    for k in range(k0 + BK, k0 + KR, BK):
        xn, wn = _k_tiles(xrows, wrows, xm, kk, k, xmap, wmap, t0, r0)
        acc = jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)
        xv, wv = xn, wn
    return jk.dot(_act16(xv, ACT16), jk.trans(wv), acc)


@jk.jit
def _act16(x, ACT16):
    """x as the tensor-core linear's A operand: f32 (ACT16 = 0), rounded to bf16 (1) or f16 (2)."""
    if ACT16 == 1:
        return x.to(jk.bf16)
    if ACT16 == 2:
        return x.to(jk.f16)
    return x


@jk.kernel(do_not_specialize=("M",))
def _gpu_splitk_sum_kernel(parts, bias, y, M, N, ldy, HAS_BIAS: jk.constexpr, SPLIT: jk.constexpr,
                           BLOCK: jk.constexpr):
    # y[t, :] = ((parts[0, t] + parts[1, t]) + ...) + bias: the split-K slabs in a fixed order, one token row
    # per program row (the same adds whatever M is)
    t = jk.program_id(0).to(jk.i64)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    cm = cols < N
    slab = M.to(jk.i64) * N.to(jk.i64)
    acc = jk.load(parts + t * N.to(jk.i64) + cols, mask=cm, other=0.0)
    for z in jk.static_range(1, SPLIT):
        acc = acc + jk.load(parts + z * slab + t * N.to(jk.i64) + cols, mask=cm, other=0.0)
    if HAS_BIAS:
        acc = acc + jk.load(bias + cols, mask=cm, other=0.0).to(jk.f32)
    jk.store(y + t * ldy.to(jk.i64) + cols, acc, mask=cm)


# GPU tiles of the dense linear: weight rows per program, K elements per step, warps per program
GPU_LINEAR_TILE = (16, 256, 4)
# with matrix units (16-bit weights, K % 16 == 0): tokens, weight rows, K per step, warps per program, chosen
# from (N, K) only (never M: batch invariance) by gpu_linear_mma_tile; a fixed tuple overrides (perf/ tuning),
# None keeps the FMA kernel above on every GPU. H200 sweep: perf/tune_gemv_cuda.py, docs/BENCHMARKS.md.
GPU_LINEAR_MMA_TILE = "auto"
# matrix units the tensor-core linear runs on: NVIDIA mma.sync (m16n8k16; sm_90a/sm_100a use it too), AMD MFMA
# (gfx90a/gfx942) and WMMA (gfx1100), 16x16x16 (backends/amdgpu.py mma_layout; tests/test_amdgpu.py)
_LINEAR_MMA_UNITS = ("mma.sync", "wgmma", "tcgen05", "mfma", "wmma")


def _mma_tile_for(T, N: int, K: int, M: int = 1, act16: int = 0) -> tuple:
    """gpu_linear_mma_tile(N, K) for target T: on WMMA (gfx1100, wave32) K steps of at most 64, since 128 with
    4 waves of 32 spills ~300 bytes of VGPRs per thread to scratch (LLVM 22; 64 does not). From
    GPU_LINEAR_WIDE_M tokens on NVIDIA, the taller GPU_LINEAR_WIDE_TILE (from GPU_LINEAR_BIG_M tokens
    GPU_LINEAR_BIG_TILE, and with 16-bit activations (act16, _act16_for's) on warpgroup MMAs from
    GPU_LINEAR_HUGE_M GPU_LINEAR_HUGE_TILE, from GPU_LINEAR_XL_M GPU_LINEAR_XL_TILE where K is not split) where
    it gives the same bits: all tiles keep their accumulators in
    the MMA registers across the K loop (every warp a whole number of 16x8 tiles), so each output is the same
    chain of 16-deep MMA steps in K order, hi and lo chains apart, whatever the tile's height, width, warps or
    K step, and wgmma gives the bits mma.sync does (perf/probe_wgmma.py on the H200); the K split (SPLIT) must
    be the same and taken by all (tests/test_device_arrays.py checks rows of the tiles bit for bit on the
    GPU)."""
    tile = tuple(gpu_linear_mma_tile(N, K))
    if T.mma == "wmma" and tile[2] > 64:
        tile = tile[:2] + (64,) + tile[3:]
    if GPU_LINEAR_MMA_TILE == "auto" and GPU_LINEAR_WIDE_TILE and M >= GPU_LINEAR_WIDE_M \
            and T.mma in ("mma.sync", "wgmma", "tcgen05"):
        S = tile[4] if len(tile) > 4 else 1
        tiers = [GPU_LINEAR_WIDE_TILE]
        # (the big tile's f32 hi + lo accumulators fit 255 registers only with a split K loop: unsplit, ptxas
        # spills 84 bytes, so unsplit weights with f32 activations keep the mid tile)
        big_ok = S > 1 or bool(act16)
        if GPU_LINEAR_MID_TILE and M >= GPU_LINEAR_MID_M:
            tiers.append(GPU_LINEAR_BIG_TILE if N >= GPU_LINEAR_MID_WIDE_N and big_ok else GPU_LINEAR_MID_TILE)
        if GPU_LINEAR_BIG_TILE and M >= GPU_LINEAR_BIG_M and big_ok:
            tiers.append(GPU_LINEAR_BIG_TILE)
        if GPU_LINEAR_HUGE_TILE and M >= GPU_LINEAR_HUGE_M and _wgmma_for(T, GPU_LINEAR_HUGE_TILE[0], act16):
            tiers.append(GPU_LINEAR_HUGE_TILE)
            if GPU_LINEAR_XL_TILE and M >= GPU_LINEAR_XL_M and S == 1 \
                    and _wgmma_for(T, GPU_LINEAR_XL_TILE[0], act16):
                tiers.append(GPU_LINEAR_XL_TILE)
        for t in reversed(tiers):
            wide = tuple(t[:4]) + (S,)    # the same K split as the decode tile: the same bits
            if _takes_same_path(tile, wide, N, K) \
                    and all((u[0] // 16) * (u[1] // 8) % u[3] == 0 for u in (tile, wide)):
                return wide
    return tile


def _takes_same_path(a: tuple, b: tuple, N: int, K: int) -> bool:
    """Both tiles EVEN (no masks) and both taking the K split, or neither."""
    def path(t):
        S = t[4] if len(t) > 4 else 1
        even = N % t[1] == 0 and K % t[2] == 0
        return even, S > 1 and even and K % (S * t[2]) == 0
    return path(a)[0] and path(b) == path(a)


# the taller tile for prefill-sized launches and the token count from which linear() takes it. H200 sweep
# (perf/tune_gemv_cuda.py --m 16,32,64,256,2048, every Llama-3-8B projection): (32, 128, 64, 4) is the fastest
# swept tile from M = 32 on every shape (M = 32: 0.63-0.77x cuBLAS against 0.46-0.62x for the decode tile,
# which reads the weights once per 16 tokens; M = 256: 92-105 TFLOP/s against 75-82 for (32, 64, 64, 4)); at
# M = 16 the decode tile stays ahead (0.79-0.96x cuBLAS)
GPU_LINEAR_WIDE_TILE = (32, 128, 64, 4)   # its K split (5th entry) is always the decode tile's
GPU_LINEAR_WIDE_M = 17
# from GPU_LINEAR_BIG_M tokens a larger tile still (8 warps, each 4 x 4 MMA tiles: fewer shared-memory fragment
# loads per MMA). H200 sweep (perf/tune_gemv_cuda.py --m 64,256,2048): at M = 256 and 2048, 117-142 TFLOP/s
# against 92-114 for GPU_LINEAR_WIDE_TILE on o_proj, gate_up and down; at M = 64 slower on narrow weights
# (o_proj 34.6 us vs 25.8: too few programs), faster on gate_up (129 vs 153)
GPU_LINEAR_BIG_TILE = (64, 256, 64, 8)
GPU_LINEAR_BIG_M = 128
# from GPU_LINEAR_MID_M tokens: 64-row tiles, GPU_LINEAR_MID_TILE (8 warps of 2 x 4 MMA tiles) for weights
# narrower than GPU_LINEAR_MID_WIDE_N rows, the big tile for wider ones. H200 with 16-bit activations
# (perf/tune_gemv_cuda.py --activations 16bit --m 64; us, (32, 128, 64, 4) in brackets): o_proj 21.5 [22.8],
# down 60.6 [64.8] with (64, 128, 64, 8); qkv 29.5 [31.0], gate_up 100.7 [123.1], lm_head 402 [497] with the big
# tile: a Llama-3-8B layer's linears 212 us at M = 64 against 242
GPU_LINEAR_MID_TILE = (64, 128, 64, 8)
# from GPU_LINEAR_HUGE_M tokens, where the tile runs on warpgroup MMAs (_wgmma_for): 128 tokens x 128 weight rows,
# two warpgroups of 64 rows. H200 with bf16 x, cp.async and wgmma (perf/tune_gemv_cuda.py --x16, BENCHMARKS.md
# session 10), us at M = 128 / 256 against the (64, 256) tile on wgmma: o_proj 24.1 / 34.5 vs 24.3 / 40.1, qkv
# 35.2 / 52.9 vs 41.3 / 60.6, gate_up 112.9 / 182.3 vs 137.4 / 223.5, down 57.3 / 81.3 vs 59.4 / 102.1, lm_head
# 433 / 793 vs 514 / 963; at M = 2048 within 1% of (128, 256, 64, 8), at M = 64 slower (too few programs)
GPU_LINEAR_HUGE_TILE = (128, 128, 64, 8)
GPU_LINEAR_HUGE_M = 128
# from GPU_LINEAR_XL_M tokens, for weights whose K is not split (two accumulators of its 128 registers a thread, the
# serial split's, would not fit): 256 tokens x 128 weight rows, each warpgroup one m64n256k16 chain. H200 (session
# 17, perf/h200_gemm_tiles.sh, bf16 x, TMA, same run as cuBLAS): gate_up 0.91x at M = 1024 and 2048 against 0.83 /
# 0.82x for GPU_LINEAR_HUGE_TILE without a split; the head 0.92x at 1024 (either tile), 0.81x at 2048 (0.78x); at
# M = 256 no better than the huge tile (0.88 vs 0.87x gate_up, 0.81 vs 0.85x the head). 154 registers (ptxas).
GPU_LINEAR_XL_TILE = (256, 128, 64, 8)
GPU_LINEAR_XL_M = 1024
GPU_LINEAR_MID_M = 48
GPU_LINEAR_MID_WIDE_N = 6144


def gpu_linear_mma_tile(N: int, K: int) -> tuple:
    """(BM, BN, BK, warps[, SPLIT]) of the tensor-core linear for an (N, K) weight (never M: batch
    invariance)."""
    if GPU_LINEAR_MMA_TILE != "auto":
        return GPU_LINEAR_MMA_TILE
    # H200 sweep (perf/tune_gemv_cuda.py, docs/BENCHMARKS.md): K split in 2 doubles the programs in flight
    # at decode sizes; this tile is the best or within ~6% of the best swept one on every Llama-3-8B
    # projection shape at M = 1, 16 and 64. Narrow weights (fewer than GPU_SPLITK4_MAX_TILES column tiles)
    # split K in 4: at M = 1 on the H200, 4096x4096 17.9 -> 13.9 us, 6144x4096 23.5 -> 21.1, 4096x14336
    # 54.0 -> 39.4 (one program per SM was too few bytes in flight); wide ones gain nothing.
    # Wide weights (at least GPU_NOSPLIT_MIN_TILES column tiles: gate_up, the head) do not split K (H200, session
    # 17, perf/h200_wide_nosplit.sh, same run: split 1 against 2 at M = 1 gate_up 57.7 vs 59.2 us, the head 238.5
    # vs 243.8; at M = 16 59.6 vs 62.3 and 244.3 vs 259.8; at prefill sizes no slabs or serial restarts, M = 256
    # gate_up 0.87x cuBLAS against 0.65x, M = 1024 0.91x on GPU_LINEAR_XL_TILE against 0.76x).
    BN, BK = GPU_LINEAR_DECODE_TILE[1], GPU_LINEAR_DECODE_TILE[2]
    if N // BN >= GPU_NOSPLIT_MIN_TILES:
        split = 1
    else:
        split = 4 if N // BN < GPU_SPLITK4_MAX_TILES and K % (4 * BK) == 0 else 2
    return tuple(GPU_LINEAR_DECODE_TILE) + (split,)


# the tensor-core linear's decode tile (tokens, weight rows, K per step, warps); its K split comes from N and K
GPU_LINEAR_DECODE_TILE = (16, 64, 128, 4)
# column tiles below which gpu_linear_mma_tile splits K in 4 rather than 2 (a function of N only)
GPU_SPLITK4_MAX_TILES = 200
# column tiles from which gpu_linear_mma_tile does not split K at all (a function of N only)
GPU_NOSPLIT_MIN_TILES = 200


# registers a thread of the tensor-core linear may use on NVIDIA (the `maxnreg` launch option, so in the cache
# key; None: ptxas decides). A tuning knob (perf/tune_gemv_cuda.py --maxnreg): 168 = 3 CTAs of 128 threads an SM;
# ptxas spills what does not fit. Registers do not change the arithmetic (same bits).
GPU_LINEAR_MAXNREG = None


# The tensor-core linear's dots run as warpgroup MMAs (sm_90a, `wgmma` launch option; backends/nvidia/wgmma.py) for
# tiles of T.tuning.linear_wgmma_min_bm tokens and more where T.tuning.linear_wgmma (targets/tuning.py): a token's
# row has the same bits as under mma.sync, and the tiles fed by cp.async / TMA run faster on them.


def _wgmma_for(T, BM: int, act16: int) -> bool:
    """Whether the tensor-core linear's tile of BM tokens runs on warpgroup MMAs on target T: with 16-bit
    activations only (f32 ones keep hi and lo accumulators, which spill the 64-row tiles under wgmma)."""
    return bool(T.tuning.linear_wgmma and act16 and T.mma == "wgmma"
                and BM >= T.tuning.linear_wgmma_min_bm)


def _mma_regs(T, BM: int = 0, act16: int = 0, serial: bool = False, steps: int = 0) -> dict:
    """Launch options of the tensor-core linear with a tile of BM tokens (act16: _act16_for's; serial: SERIAL;
    steps: the K steps of a program's K range, EVEN launches only): `maxnreg`, `wgmma`, `num_stages`, and the
    PREFETCH constexpr (2 with T.tuning.linear_prefetch = 2 where cp.async feeds warpgroup MMAs and the range has
    2+ steps)."""
    cap = T.tuning.serial_maxnreg if serial and T.tuning.serial_maxnreg else GPU_LINEAR_MAXNREG
    out = {"maxnreg": int(cap)} if cap and T.register_cap else {}
    if _wgmma_for(T, BM, act16):
        out["wgmma"] = 1
    if GPU_LINEAR_ASYNC_MIN_BM and T.async_copy and BM >= GPU_LINEAR_ASYNC_MIN_BM:
        out["num_stages"] = 2
        # (wgmma tiles only: their last two dots chain in the accumulator registers like the loop's; mma.sync
        # adds a dot handed to the next one as a tile value, other bits than PREFETCH 1's)
        if T.tuning.linear_prefetch == 2 and steps >= 2 and "wgmma" in out:
            out["num_stages"], out["PREFETCH"] = 3, 2
    return out


# T.tuning.linear_prefetch = 2: the TMA-fed tiles' K loops load the tiles two steps ahead into three buffers
# (PREFETCH = 2, num_stages=3: a prefetch-2 chain, backends/nvidia/staging.py), so two steps of MMAs cover the copies'
# latency instead of one; the same dots in the same order (the last two dots chain in the accumulator registers,
# gpu.py _keep_frag; wgmma tiles only). On cp.async it was slower, so with T.tuning.linear_tma it applies to TMA
# launches only (_tma_maps). T.tuning.linear_tma: the wgmma tiles' K loops fed by the tensor memory accelerator (one
# bulk copy per tile a step, issued by one thread and completed on an mbarrier, instead of every thread's cp.async
# address math and copies; the same staging, so the same bits).


_COMPILE_ONLY_MAP = 1 << 40       # a tensor map argument's stand-in under compile_only (never launched)


def _tma_maps(T, opts: dict, x2, w, M: int, N: int, K: int, ldx: int, BM: int, BN: int, BK: int, x_dtype: str,
              w_dtype: str) -> tuple:
    """(x's tensor map, w's) as kernel arguments: global addresses where the launch `opts` (_mma_regs') run
    wgmma on cp.async staging, T.tuning.linear_tma is on, x is already 16-bit and both matrices are on a CUDA device
    with 16-byte aligned rows and the maps exist or can be made (then opts gets `tma`); else (0, 0). x's map has M
    rows (TMA reads the rows past them as zeros, as the kernel's mask does); boxes of (BM or BN) rows x 64
    elements, the staging's 128-byte swizzle atoms. With T.tuning.linear_tma on, prefetch-2 chains (PREFETCH 2) are
    for TMA launches only: a launch left on cp.async goes back to PREFETCH 1 (on cp.async prefetch 2 was slower
    at every shape on the H200, BENCHMARKS.md session 11)."""
    maps = _tma_maps_for(T, opts, x2, w, M, N, K, ldx, BM, BN, BK, x_dtype, w_dtype)
    if T.tuning.linear_tma and "tma" not in opts and opts.get("PREFETCH") == 2:
        del opts["PREFETCH"]
        opts["num_stages"] = 2
    return maps


def _tma_maps_for(T, opts: dict, x2, w, M: int, N: int, K: int, ldx: int, BM: int, BN: int, BK: int, x_dtype: str,
                  w_dtype: str) -> tuple:
    """_tma_maps' maps and `tma` option, before its prefetch rule."""
    if not (T.tuning.linear_tma and T.async_copy == "tma" and opts.get("wgmma")
            and opts.get("num_stages") in (2, 3) and BK % 64 == 0
            and x_dtype in ("bf16", "f16") and x_dtype == w_dtype):
        return 0, 0
    if (ldx * 2) % 16 or (K * 2) % 16 or tuple(w.strides) != (K * 2, 2) or x2.strides[-1] != 2:
        return 0, 0
    from jitkern.runtime import cuda as _cuda
    from jitkern.runtime import launch as _launch_mod
    if getattr(_launch_mod._capture, "compile_only", None) is not None:
        # `jitkern build` (compile-only launches on a stand-in device): the kernel a GPU would run here, with
        # arguments of a map's type and alignment (an i64 multiple of 64); nothing is launched
        opts["tma"] = 1
        return _COMPILE_ONLY_MAP, _COMPILE_ONLY_MAP
    if not (isinstance(x2, _cuda.DeviceArray) and isinstance(w, _cuda.DeviceArray)
            and isinstance(x2.device, _cuda.CudaDevice) and isinstance(w.device, _cuda.CudaDevice)) \
            or x2.ptr % 16 or w.ptr % 16:
        return 0, 0
    xmap = _cuda.tensor_map_2d(x2.ptr, M, K, ldx * 2, BM, 64, x_dtype, x2.device)
    wmap = _cuda.tensor_map_2d(w.ptr, N, K, K * 2, BN, 64, w_dtype, w.device)
    if xmap is None or wmap is None:
        return 0, 0         # inside a stream capture, a map not made before it: cp.async (the same bits)
    opts["tma"] = 1
    return xmap, wmap


# Tiles of at least this many tokens are launched with num_stages=2: their K loop's x and weight tiles go
# global -> shared memory by cp.async into two buffers (backends/nvidia/staging.py) instead of through
# registers. H200 (BENCHMARKS.md session 9): the (64, 256, 64, 8) tile 1.06-1.12x at M = 64-1024 (128 instead of
# 176 registers with bf16 x, its buffers sharing shared memory with the C tile: two CTAs an SM); the M = 1 decode
# tile 0.84-0.95x, so it keeps the register path. Same bits either way (the staged values are the same). 0 = never.
GPU_LINEAR_ASYNC_MIN_BM = 64


# the tensor-core linear's A operand: "f32" (x split into 16-bit hi + lo parts by the lowering: ~16 significant
# bits, two MMA chains) or "16bit" (x rounded to the weights' bf16 / f16: one chain, half the MMAs and A staging,
# the precision vLLM and cuBLAS bf16 inference compute at). Part of the kernel's specialisation.
GPU_LINEAR_ACTIVATIONS = "f32"


def _act16_for(dt: str, activations=None) -> int:
    mode = GPU_LINEAR_ACTIVATIONS if activations is None else activations
    if mode not in ("f32", "16bit"):
        what = "GPU_LINEAR_ACTIVATIONS" if activations is None else "activations"
        raise ValueError(f"{what} must be 'f32' or '16bit', got {mode!r}")
    return 0 if mode == "f32" else (1 if dt == "bf16" else 2)


# split-K slabs are computed for at most this many tokens per launch (bounds the workspace)
GPU_SPLITK_MAX_M = 1024
# From T.tuning.serial_split_m tokens the tensor-core linear sums a split K's slabs inside each program (SERIAL: the
# same bits, no slabs through memory and no sum kernel; below it each slab is a program of its own, more programs in
# flight), under the register cap T.tuning.serial_maxnreg (two CTAs an SM), with one copy chain through the slabs
# where T.tuning.serial_chain (_mma_serial_chain: no pipeline drain and restart at each slab; the same dots in the
# same order).


# --------------------------------------------------------------------------------------------- helpers
_WEIGHT_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


def _target(target):
    if target is None:
        return runtime_target()
    if isinstance(target, str):
        return get_target(target)
    return target


_LAST: dict = {}


def _launch(kernel, grid, args, consts, target):
    ck = launch(kernel, grid, args, consts, target=target)
    if ck is not None:                  # None: a dry launch (runtime.launch.dry_launches)
        _LAST[kernel.__name__] = ck
    return ck


def last_compiled(kernel_name: str):
    """The CompiledKernel of the latest launch of `kernel_name` from this module (its `.target` is the tier
    that ran): "_gemm_kernel" (matmul, linear_packed), "_gemv_kernel" (linear, M <= GEMV_MAX_M), "_rows_kernel"
    (linear, larger M), "_gpu_linear_kernel" (linear on a GPU, every M), "_gpu_linear_mma_kernel" (linear on a GPU
    with matrix units, 16-bit weights, every M), "_pack_kernel"."""
    return _LAST.get(kernel_name)


def _lanes(target) -> int:
    return max(4, target.vector_bits // 32)


def _as_weight(w, w_dtype, name="w"):
    """(2-D storage array, dtype name, kernel argument) for a weight given as an array or a jk.Pointer."""
    if isinstance(w, Pointer):
        arr = w.keepalive
        if not isinstance(arr, np.ndarray) or arr.ndim != 2:
            raise ValueError(f"{name}: a jk.Pointer weight must wrap its 2-D array (use jk.as_pointer(arr, ...))")
        dt = w.dtype.name
        if dt not in _WEIGHT_DTYPES or np.dtype(_WEIGHT_DTYPES[dt]).itemsize != arr.itemsize:
            raise ValueError(f"{name}: weights must be f32, f16 or bf16, got a {dt} pointer over {arr.dtype}")
        if not arr.flags.c_contiguous or w.address != arr.ctypes.data:
            raise ValueError(f"{name}: the pointer must address a C-contiguous array from its start")
        return arr, dt, w
    if not is_array(w) or w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D numpy array, got {type(w).__name__}"
                         f"{'' if not isinstance(w, np.ndarray) else f' of shape {w.shape}'}")
    if w_dtype is None:
        w_dtype = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(w.dtype)
        if w_dtype is None:
            raise ValueError(f"{name}: dtype {w.dtype} is not a weight type (float32, float16, or uint16 storage "
                             f"with w_dtype='bf16')")
    if w_dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"w_dtype must be one of {sorted(_WEIGHT_DTYPES)}, got {w_dtype!r}")
    if w.dtype != np.dtype(_WEIGHT_DTYPES[w_dtype]):
        raise ValueError(f"{name}: w_dtype={w_dtype!r} needs {np.dtype(_WEIGHT_DTYPES[w_dtype])} storage, "
                         f"got {w.dtype}")
    if not w.flags.c_contiguous:
        if is_device(w):
            raise ValueError(f"{name}: a device weight must be C-contiguous")
        w = np.ascontiguousarray(w)
    return w, w_dtype, (_bf16_pointer(w) if w_dtype == "bf16" else w)


def _bf16_pointer(arr: np.ndarray) -> Pointer:
    if is_device(arr):
        return as_pointer(arr, _BF16)
    return Pointer(arr.__array_interface__["data"][0], _BF16, arr)


_X_STORAGE = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}


def _as_x(x, K, name="x", x_dtype="f32"):
    if not is_array(x):
        raise ValueError(f"{name}: expected a numpy array, got {type(x).__name__}")
    if x_dtype not in _X_STORAGE:
        raise ValueError(f"x_dtype must be one of {sorted(_X_STORAGE)}, got {x_dtype!r}")
    if x.dtype != np.dtype(_X_STORAGE[x_dtype]):
        raise ValueError(f"{name}: expected {np.dtype(_X_STORAGE[x_dtype])}"
                         f"{' storage for x_dtype=' + repr(x_dtype) if x_dtype != 'f32' else ''}, got {x.dtype}")
    es = x.dtype.itemsize
    squeeze = x.ndim == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if x2.ndim != 2:
        raise ValueError(f"{name}: expected a 1-D or 2-D array, got shape {x.shape}")
    if x2.shape[1] != K:
        raise ValueError(f"{name}: has {x2.shape[1]} columns but the weight has K={K}")
    if x2.strides[1] != es or x2.strides[0] % es or x2.strides[0] < es * K:
        if is_device(x2):
            raise ValueError(f"{name}: a device array needs contiguous rows (strides {x2.strides})")
        x2 = np.ascontiguousarray(x2)
    return x2, squeeze


def _x_arg(x2, x_dtype):
    """The kernel argument of x rows (bf16 storage as a bf16 pointer)."""
    return _bf16_pointer(x2) if x_dtype == "bf16" else x2


_OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16), np.dtype(np.float16))


def _out(out, M, N, squeeze, name="out", like=None, half_ok=False):
    """The [M, N] view the kernels write (rows contiguous, any row stride): float32, or with half_ok 16-bit
    storage too (uint16 = bf16, float16), which the kernels' stores round the f32 result to, once."""
    if out is None:
        return empty_like_dev(like, (M, N), np.float32)
    shape = (N,) if squeeze else (M, N)
    if not is_array(out) or out.dtype not in (_OUT_DTYPES if half_ok else _OUT_DTYPES[:1]) or out.shape != shape:
        raise ValueError(f"{name}: expected a float32{' (or uint16 = bf16, float16)' if half_ok else ''} array of "
                         f"shape {shape}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    es = out.itemsize
    if out.strides[-1] != es or (not squeeze and (out.strides[0] % es or out.strides[0] < es * N)):
        raise ValueError(f"{name}: rows must be contiguous (strides {out.strides})")
    return out.reshape(1, N) if squeeze else out


def _y_arg(o2):
    """The kernel argument of y rows (uint16 storage as a bf16 pointer)."""
    return _bf16_pointer(o2) if o2.dtype == np.uint16 else o2


def _fill_rows(o2, b):
    """o2[:] = b (or 0) in o2's storage: the result of a K = 0 linear (16-bit storage: the f32 rows rounded by
    activation.copy, as the kernels' stores round)."""
    if o2.dtype == np.float32:
        o2[...] = 0.0 if b is None else b[None, :]
        return
    from .activation import copy
    rows = empty_like_dev(o2, o2.shape, np.float32)
    _fill_rows(rows, b)
    copy(rows, out=o2)


def _as_bias(bias, N):
    if bias is None:
        return None
    if not is_array(bias) or bias.shape != (N,):
        raise ValueError(f"bias: expected an array of shape ({N},), got {getattr(bias, 'shape', type(bias).__name__)}")
    if is_device(bias):
        if bias.dtype != np.float32 or not bias.flags.c_contiguous:
            raise ValueError("bias: a device bias must be a contiguous float32 array")
        return bias
    if bias.dtype != np.float32:
        bias = bias.astype(np.float32)
    return np.ascontiguousarray(bias)


def _split_rows(m: int, cap: int) -> tuple:
    """(BM1, BM2): BM1 a power of two, BM2 a power of two or 0, BM1 + BM2 <= min(m, cap) as large as possible."""
    best = (1, 0)
    p = 1
    while p <= cap:
        for q in [0] + [1 << i for i in range(p.bit_length())]:
            if q <= p and p + q <= min(m, cap) and (p + q > sum(best) or (p + q == sum(best) and q == 0)):
                best = (p, q)
        p <<= 1
    return best


def _gemm_shape(target) -> tuple:
    """(panel width BN, most rows BM) of the outer-product tile: BM * BN / V accumulator registers plus BN / V
    for the panel row and one broadcast must fit the register file (measured, single thread, n = 1024)."""
    if target.has("avx512f"):
        return 32, 8        # 16 of 32 zmm; 12 x 32 (24 zmm) and 4 x 64 measured slower
    if target.has("fma") or target.arch == "aarch64":
        return 16, 6        # 12 of 16 ymm (4 + 2 rows); 8 x 16 spills, 4 x 16 is 12% slower
    return 16, 4            # SSE2 / portable x86: mul + add, 16 of 16 xmm measured best (4 x 8: -13%)


def _gemm_rows(target, BN) -> int:
    """Row cap for a panel width (a PackedWeight packed for another tier may have another BN)."""
    bn, bm = _gemm_shape(target)
    return max(1, bm * bn // BN)


# ------------------------------------------------------------------------------------------ packed B
@dataclass
class PackedWeight:
    """Weights repacked into column panels for the outer-product kernel (see the module docs).

    `data` is a flat array (float32/float16, or uint16 holding bf16) of N_pad/BN panels x K rows x BN.
    """
    data: np.ndarray
    N: int
    K: int
    BN: int
    dtype: str          # "f32" | "f16" | "bf16"

    def arg(self):
        return _bf16_pointer(self.data) if self.dtype == "bf16" else self.data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _panel_width(target) -> int:
    return _gemm_shape(target)[0]


def _pack(src_arg, src_dtype, N, K, ld, trans, BN, target):
    np_dt = _WEIGHT_DTYPES[src_dtype]
    panels = -(-N // BN)
    data = np.empty(panels * K * BN, np_dt)
    dst = _bf16_pointer(data) if src_dtype == "bf16" else data
    KB = 16
    if K > 0 and panels > 0:
        _launch(_pack_kernel, (panels, -(-K // KB)), (src_arg, dst, N, K, ld),
                dict(TRANS=trans, BN=BN, KB=KB), target)
    return data


def pack_weight(w, w_dtype=None, target=None, block_n=None) -> PackedWeight:
    """Repacks a linear layer's weight w[N, K] (f32, f16, or bf16 as uint16 with w_dtype='bf16', or a
    jk.Pointer) into column panels for `linear_packed`; do it once at model load. The dtype is kept."""
    T = _target(target)
    arr, dt, arg = _as_weight(w, w_dtype)
    N, K = arr.shape
    BN = int(block_n or _panel_width(T))
    return PackedWeight(_pack(arg, dt, N, K, K, True, BN, T), N, K, BN, dt)


def _gemm(x2, packed: PackedWeight, bias, o2, T):
    M, K = x2.shape
    N = packed.N
    if M == 0 or N == 0:
        return
    if K == 0:
        o2[...] = 0.0 if bias is None else bias[None, :]
        return
    BM1, BM2 = _split_rows(M, _gemm_rows(T, packed.BN))
    BM = BM1 + BM2
    grid = (-(-M // BM), -(-N // packed.BN))
    _launch(_gemm_kernel, grid,
            (x2, packed.arg(), bias if bias is not None else o2, o2, M, N, K, x2.strides[0] // 4, o2.strides[0] // 4),
            dict(HAS_BIAS=bias is not None, BM1=BM1, BM2=BM2, BN=packed.BN, BK=4), T)


# -------------------------------------------------------------------------------------------- public
def linear_packed(x, packed: PackedWeight, bias=None, out=None, target=None):
    """y = x @ w^T (+ bias) with w pre-packed by `pack_weight`; x float32 [M, K] or [K]; returns float32."""
    T = _target(target)
    if not isinstance(packed, PackedWeight):
        raise ValueError(f"packed: expected a PackedWeight from pack_weight(), got {type(packed).__name__}")
    x2, squeeze = _as_x(x, packed.K)
    M, N = x2.shape[0], packed.N
    o2 = _out(out, M, N, squeeze)
    _gemm(x2, packed, _as_bias(bias, N), o2, T)
    if out is not None:
        return out
    return o2.reshape(N) if squeeze else o2


GEMV_MAX_M = 7      # up to here `linear` uses the sequential-row kernel; from 8 tokens on the dot-product tile


def _gemv_tiles(M, N, target):
    """(BM, R, V, U) of the sequential-row kernel: 8 rows per program, 4 (M = 1) or 2 vectors per token and
    step; BM tokens (2 for M = 2, 3: M = 3 overlaps, 4 for M = 4..7)."""
    V = _lanes(target)
    BM = 1 if M == 1 else 2 if M < 4 else 4
    R = min(8, N)
    return BM, R, V, 4 if BM == 1 else 2


def _rows_tiles(M, N, target):
    """(BM, BN, V) of the dot-product kernel: a 2 x 8 tile of accumulator vectors with 32 registers, 2 x 4
    with 16 (V = the tier's f32 lanes)."""
    V = _lanes(target)
    BM, BN = (2, 8) if target.has("avx512f") else (2, 4)
    while BM > M:
        BM //= 2
    while BN > N:
        BN //= 2
    return BM, BN, V


class SplitK:
    """The [M, N] f32 result of a split-K linear whose ordered sum was left to its consumer (`linear(...,
    fold_sum=True)`): y = ((parts[0] + parts[1]) + ...) + parts[S - 1], exactly what _gpu_splitk_sum_kernel would
    store. rms_norm and act_and_mul take it as their input and add the slabs in that order (one launch and one
    round trip of y fewer). The slabs live in the linears' shared split-K workspace: consume before the next
    split linear runs."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts                  # (S, M, N) float32, contiguous

    @property
    def S(self) -> int:
        return self.parts.shape[0]

    @property
    def shape(self) -> tuple:
        return tuple(self.parts.shape[1:])

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def sum_into(self, out):
        """The ordered sum into `out` [M, N] f32 (rows contiguous): what the linear would have written."""
        S, (M, N) = self.S, self.shape
        o2 = _out(out, M, N, False)
        T = _target(resolve_target(None, self.parts))
        _launch(_gpu_splitk_sum_kernel, (M, -(-N // 256)),
                (self.parts.reshape(S * M, N), o2, o2, M, N, o2.strides[0] // 4),
                dict(HAS_BIAS=False, SPLIT=S, BLOCK=256, num_warps=2), T)
        return out


def _linear_splitk(x2, warg, b, o2, M, N, K, BM, BN, BK, NW, S, T, act16=0, x_dtype="f32", fold=False, w_arr=None,
                   w_dtype=""):
    """The tensor-core linear with K split S ways: slabs into a reused workspace, then their ordered sum.
    Tokens go in chunks of GPU_SPLITK_MAX_M (each token's arithmetic is the same in any chunk). fold (one chunk,
    no bias): the sum is left to the consumer, returned as SplitK."""
    es = x2.dtype.itemsize
    for m0 in range(0, M, GPU_SPLITK_MAX_M):
        m1 = min(M, m0 + GPU_SPLITK_MAX_M)
        mc = m1 - m0
        xc, oc = (x2, o2) if (m0, m1) == (0, M) else (x2[m0:m1], o2[m0:m1])
        yc = _y_arg(oc)
        parts = device_scratch(x2, "linear_splitk", (S * mc, N), np.float32) if is_device(x2) \
            else np.empty((S * mc, N), np.float32)
        opts = _mma_regs(T, BM, act16, steps=K // (S * BK))
        maps = _tma_maps(T, opts, xc, w_arr, mc, N, K, xc.strides[0] // es, BM, BN, BK, x_dtype, w_dtype)
        _launch(_gpu_linear_mma_kernel, (-(-mc // BM), -(-N // BN), S),
                (_x_arg(xc, x_dtype), warg, yc, parts, mc, N, K, xc.strides[0] // es, N) + maps,
                dict(HAS_BIAS=False, BM=BM, BN=BN, BK=BK, EVEN=True, SPLIT=S, num_warps=NW, ACT16=act16, **opts), T)
        if fold:
            return SplitK(parts.reshape(S, mc, N))
        _launch(_gpu_splitk_sum_kernel, (mc, -(-N // 256)),
                (parts, b if b is not None else yc, yc, mc, N, oc.strides[0] // oc.itemsize),
                dict(HAS_BIAS=b is not None, SPLIT=S, BLOCK=256, num_warps=2), T)


def takes_16bit_x(w_dtype: str, K: int, target=None) -> bool:
    """Whether `linear` on `target` takes x already in the weights' 16-bit type (x_dtype=w_dtype): the
    tensor-core GPU path (16-bit weights, K a multiple of 16)."""
    T = _target(target)
    return bool(T.is_gpu and GPU_LINEAR_MMA_TILE and T.mma in _LINEAR_MMA_UNITS and w_dtype in ("bf16", "f16")
                and K % 16 == 0)


def linear(x, w, bias=None, out=None, target=None, w_dtype=None, activations=None, x_dtype="f32",
           fold_sum=False):
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with f32 accumulation and output.

    x: float32 [M, K] (or [K], giving [N]). w: float32 or float16 [N, K], uint16 [N, K] holding bf16 with
    w_dtype='bf16', or a jk.Pointer over such an array (jk.as_pointer(w_u16, 'bf16')). Reads w as stored:
    up to GEMV_MAX_M tokens with the sequential-row kernel (M = 1 streams the weights once, as one monotonic
    stream per thread), more with the dot-product tile kernel (the weights once per 2 tokens); on a GPU one
    kernel for every M (a token per program row, 16-byte weight reads: batch invariant). For GEMMs with
    large M (prefill), `pack_weight` once + `linear_packed` is faster. `out`: an optional float32 array of the
    result's shape (rows may be strided). `activations` ("f32" | "16bit", default GPU_LINEAR_ACTIVATIONS): the
    A operand of the tensor-core kernel on GPUs with matrix units (16-bit weights); elsewhere no effect.
    `x_dtype` "bf16" (uint16 storage) / "f16": x already in the weights' 16-bit type, for that kernel only: the
    same result as f32 x with activations "16bit" (which rounds x to that type first), from half the bytes of x.
    `fold_sum`: where the GPU kernel splits K (and M <= GPU_SPLITK_MAX_M, no bias), return a SplitK (the slabs,
    `out` untouched) for a consumer that sums them itself (rms_norm, act_and_mul); elsewhere the result as usual.
    """
    T = _target(resolve_target(target, x, w))
    arr, dt, warg = _as_weight(w, w_dtype)
    N, K = arr.shape
    x2, squeeze = _as_x(x, K, x_dtype=x_dtype)
    es = x2.dtype.itemsize
    tensor_cores = takes_16bit_x(dt, K, T)
    if x_dtype != "f32":
        if not tensor_cores or x_dtype != dt:
            raise ValueError(f"x_dtype={x_dtype!r} needs the tensor-core GPU linear with {x_dtype} weights "
                             f"(here: {dt} weights on {T.name})")
        activations = "16bit"
    M = x2.shape[0]
    o2 = _out(out, M, N, squeeze, like=x2, half_ok=True)
    b = _as_bias(bias, N)
    if M and N:
        if K == 0:
            _fill_rows(o2, b)
        else:
            y = _y_arg(o2)
            args = (_x_arg(x2, x_dtype), warg, b if b is not None else y, y, M, N, K, x2.strides[0] // es,
                    o2.strides[0] // o2.itemsize)
            if tensor_cores:
                act16 = _act16_for(dt, activations)
                tile = _mma_tile_for(T, N, K, M, act16)
                BM, BN, BK, NW = tile[:4]
                S = tile[4] if len(tile) > 4 else 1
                even = N % BN == 0 and K % BK == 0
                if S > 1 and even and K % (S * BK) == 0 and M >= T.tuning.serial_split_m:
                    opts = _mma_regs(T, BM, act16, serial=True, steps=K // (S * BK))
                    maps = _tma_maps(T, opts, x2, arr, M, N, K, x2.strides[0] // es, BM, BN, BK, x_dtype, dt)
                    _launch(_gpu_linear_mma_kernel, (-(-M // BM), -(-N // BN)), args + maps,
                            dict(HAS_BIAS=b is not None, BM=BM, BN=BN, BK=BK, EVEN=True, SPLIT=S, SERIAL=True,
                                 CHAIN=T.tuning.serial_chain, num_warps=NW, ACT16=act16, **opts), T)
                elif S > 1 and even and K % (S * BK) == 0:
                    fold = bool(fold_sum and b is None and not squeeze and M <= GPU_SPLITK_MAX_M and is_device(x2))
                    r = _linear_splitk(x2, warg, b, o2, M, N, K, BM, BN, BK, NW, S, T, act16, x_dtype, fold, arr, dt)
                    if fold:
                        return r
                else:
                    opts = _mma_regs(T, BM, act16, steps=K // BK if even else 0)
                    maps = _tma_maps(T, opts, x2, arr, M, N, K, x2.strides[0] // es, BM, BN, BK, x_dtype, dt) \
                        if even else (0, 0)
                    _launch(_gpu_linear_mma_kernel, (-(-M // BM), -(-N // BN)), args + maps,
                            dict(HAS_BIAS=b is not None, BM=BM, BN=BN, BK=BK, EVEN=even, num_warps=NW,
                                 ACT16=act16, **opts), T)
            elif T.is_gpu:
                BN, BK, NW = GPU_LINEAR_TILE
                _launch(_gpu_linear_kernel, (M, -(-N // BN)), args,
                        dict(HAS_BIAS=b is not None, BN=BN, BK=BK, EVEN=N % BN == 0 and K % BK == 0,
                             num_warps=NW), T)
            elif M <= GEMV_MAX_M:
                BM, R, V, U = _gemv_tiles(M, N, T)
                _launch(_gemv_kernel, (-(-M // BM), -(-N // R)), args,
                        dict(HAS_BIAS=b is not None, BM=BM, R=R, V=V, U=U), T)
            else:
                BM, BN, V = _rows_tiles(M, N, T)
                _launch(_rows_kernel, (-(-M // BM), -(-N // BN)), args,
                        dict(HAS_BIAS=b is not None, BM=BM, BN=BN, V=V), T)
    if out is not None:
        return out
    return o2.reshape(N) if squeeze else o2


# the most tokens gated_linear takes: the decode tile's (below GPU_LINEAR_WIDE_M the 16-token tile; from there the
# taller tiles, whose wgmma / TMA forms read x through tensor maps and keep gate_up + act_and_mul)
GPU_GATED_MAX_M = GPU_LINEAR_WIDE_M - 1


def gated_tile(w_dtype: str, N: int, K: int, M: int, x_dtype: str, target=None):
    """The (BM, BN, BK, warps) tile `gated_linear` runs for an M-token step of an [N, K] gate_up weight (w_dtype
    weights, x_dtype x), or None where it does not apply: a GPU with matrix units, 16-bit x of the weights' type,
    M <= GPU_GATED_MAX_M, and the tile `linear` would take there unsplit and dividing N / 2 and K (then its
    outputs are that linear's bits)."""
    T = _target(target)
    if not (T.is_gpu and 0 < M <= GPU_GATED_MAX_M and x_dtype == w_dtype and takes_16bit_x(w_dtype, K, T)) \
            or N % 2:
        return None
    tile = _mma_tile_for(T, N, K, M, _act16_for(w_dtype, "16bit"))
    BM, BN, BK, NW = tile[:4]
    if (len(tile) > 4 and tile[4] != 1) or BN % 2 or (N // 2) % (BN // 2) or K % BK:
        return None
    return BM, BN, BK, NW


def gated_linear(x, w, out, gate_up, *, act: str = "silu", w_dtype=None, x_dtype="bf16", target=None):
    """out[M, N/2] = act(x @ w_gate^T) * (x @ w_up^T) for a merged gate_up weight w [N, K] (gate rows first, vLLM's
    layout), each projection rounded to out's 16-bit type first: bit for bit `linear(x, w, out=gate_up)` into the
    16-bit gate_up [M, N] then `silu_and_mul` / `gelu_tanh_and_mul` of it, in one launch (gate_up is written too,
    as that linear would). act: "silu" or "gelu_tanh". Only where `gated_tile` gives a tile (decode-sized steps on
    GPUs with matrix units); out and gate_up: uint16 (bf16) or float16 of the weights' type, rows contiguous."""
    from .activation import gelu_tanh_f, silu
    fn = {"silu": silu, "gelu_tanh": gelu_tanh_f}.get(act)
    if fn is None:
        raise ValueError(f"gated_linear: act must be 'silu' or 'gelu_tanh', got {act!r}")
    T = _target(resolve_target(target, x, w))
    arr, dt, warg = _as_weight(w, w_dtype)
    N, K = arr.shape
    x2, squeeze = _as_x(x, K, x_dtype=x_dtype)
    M = x2.shape[0]
    tile = gated_tile(dt, N, K, M, x_dtype, T)
    if tile is None:
        raise ValueError(f"gated_linear: no gated tile for {M} tokens of a {dt} [{N}, {K}] weight on {T.name} "
                         f"(x {x_dtype}; see gated_tile)")
    want = np.dtype(_X_STORAGE[dt])
    for name, a, n in (("out", out, N // 2), ("gate_up", gate_up, N)):
        if not is_array(a) or a.dtype != want:
            raise ValueError(f"gated_linear: {name} must be a {want} array (the weights' 16-bit storage), got "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
    o2 = _out(out, M, N // 2, False, "gated_linear: out", half_ok=True)
    g2 = _out(gate_up, M, N, False, "gated_linear: gate_up", half_ok=True)
    BM, BN, BK, NW = tile
    _launch(_gpu_gated_linear_kernel, (-(-M // BM), (N // 2) // (BN // 2)),
            (_x_arg(x2, x_dtype), warg, _y_arg(g2), _y_arg(o2), M, N // 2, K, x2.strides[0] // x2.itemsize,
             g2.strides[0] // g2.itemsize, o2.strides[0] // o2.itemsize),
            dict(ACT=fn, BM=BM, BN=BN, BK=BK, ACT16=_act16_for(dt, "16bit"), num_warps=NW), T)
    return out


def matmul(a, b, out=None, target=None):
    """c[M, N] = a[M, K] @ b[K, N], float32 in and out (packs b into panels, then the outer-product kernel)."""
    T = _target(target)
    for name, v in (("a", a), ("b", b)):
        if not isinstance(v, np.ndarray) or v.ndim != 2 or v.dtype != np.float32:
            raise ValueError(f"{name}: expected a 2-D float32 array, got "
                             f"{getattr(v, 'dtype', type(v).__name__)} {getattr(v, 'shape', '')}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {a.shape} but b is {b.shape} (inner sizes differ)")
    K, N = b.shape
    a2, _ = _as_x(a, K, "a")
    M = a2.shape[0]
    o2 = _out(out, M, N, False)
    if M and N:
        if K == 0:
            o2[...] = 0.0
        else:
            bc = b if b.strides[1] == 4 and b.strides[0] % 4 == 0 else np.ascontiguousarray(b)
            BN = _panel_width(T)
            packed = PackedWeight(_pack(bc, "f32", N, K, bc.strides[0] // 4, False, BN, T), N, K, BN, "f32")
            _gemm(a2, packed, None, o2, T)
    return out if out is not None else o2
