"""GGUF quantised matrix products: y[M, N] = x[M, K] @ W[N, K]^T with W in raw GGUF block bytes.

API: `matmul_q(x, weight_raw, qtype, N, K)`; `quantize_q8(x, layout=act_layout(qtype))` once + `matmul_q8(xq, ...)`
per weight when several weights share an input; `dequantize_rows(raw, qtype, rows_idx, K)` (embedding lookup);
`row_bytes`, `QTYPES`, `qmm_tiles` / `qmm_step` (the 32-element formats' tiles). qtypes: q8_0 q4_0 q4_1 q5_0
q5_1 iq4_nl mxfp4 (32-element blocks, `_qmm_kernel`), q2_K q3_K q4_K q5_K q6_K iq4_xs (256-element super-blocks,
`_kq_kernel`); on CUDA all of them on `_qmv_gpu_kernel`.

Decode is a bandwidth-bound GEMV over the weights, prefill and batched decode a compute-bound GEMM; both
follow ggml's plan for the arithmetic:

1. The activations are quantised once per row (`quantize_q8`): blocks of 32 int8 values with an f32 scale
   d = max|x| / 127 and the f32 block sum s = d * sum(q) (what the formats with a min/offset need). One
   format serves every weight type; the K-quants (256-element super-blocks) use 8 of these 32-blocks per
   super-block, at least as precise as ggml's Q8_K (one scale per 256). For q4_0 / q4_1 weights the values
   are stored in the 'q4' / 'q4x4' layout (groups of 2 / 4 blocks interleaved by 16-value halves, see
   Q8Activations), so the activations that meet one vector of nibble bytes are one contiguous load.
2. The integer dot products run on `jk.dot4` (pmaddubsw + pmaddwd on x86: unsigned 4-bit weights times signed
   int8 activations directly, the two 16-value halves of a q4 block added in int16 first (dot4's axis form);
   q8_0 / the K-quants as ggml, q8_0 with the sign trick).
3. q8_0 / q4_0 / q4_1 (`_qmm_kernel`, every M): the lanes dot4 leaves per block are summed to one exact i32
   per (token, row, block) first; with 4 rows per tile that is a 4x4 transpose-and-add inside each 128-bit
   lane (unpacks, which Zen 4 issues beside its multipliers, unlike cross-lane permutes; for the 4-bit types
   its first step on the int16 pair sums, so one pmaddwd widens two rows), leaving registers of 4 blocks x 4
   rows. The float work then runs on those dense registers: per (token, row, block) one
   product of the weight and activation scales, one FMA of the converted dot and one FMA of the block-sum
   term (q4_1's m, q4_0's -8 d) into an accumulator lane per block of the step, summed by a fixed halving
   tree at the end. A program owns BM tokens x R rows (16 x 4 on AVX-512, 8 x 4 on AVX2 with each step run as
   two halves: every weight block loaded serves BM tokens, every activation block 4 rows; q8_0 on 256- and 512-bit
   tiers in the 'halves' order too), or for M = 1 one row at a time, 8 rows one after
   the other (each thread reads one monotonic stream, which the hardware prefetchers follow; R rows in
   lockstep measured 3-5x less DRAM bandwidth). K is a compile-time constant (token rows are constant
   offsets, the K loop and its leftover pair / single block are fixed).
   Batch invariance: the integer dots are exact and the float operations of an output depend only on the
   tier's step S (`qmm_step`) and K, never on M or the tile, so a row's result is bit-identical alone or in
   any batch (tests/ops/test_quant.py checks it).
4. On CUDA targets every type runs on `_qmv_gpu_kernel` instead, for every M: a CTA's threads over (row, lane,
   word), lanes over a row's 32-element blocks (the K-quants' sub-blocks), the block dots in `jk.dp4a` (PTX dp4a)
   against the activations in the 'natural' layout (16-byte loads), no repeated scales, a decoder per type
   (`_qmv_decode`) giving packed quant words, scales and offsets; batch invariant the same way (the float
   operations of an output follow from K and the type alone). See the comment above the kernel.
5. The K-quants on the CPU tiers (`_kq_kernel`, one super-block per step): the scaled dots of 8 lanes per
   sub-block summed over the sub-blocks, min terms FMA'd with the activation block sums; GEMV programs as above,
   GEMM tiles 4 x 2; the same arithmetic for every tile shape.

Weight layout (ggml-common.h; rows are K/block_elems consecutive blocks, row r of an (N, K) tensor starts at
byte r * row_bytes). A decoder turns a step's blocks into small integers q (natural element order, or for
q4_0 / q4_1 the 'halves' order (R, 2, S, 16): one vector holds the same 16-value half of several blocks, so
one and / one shift + and unpacks the nibbles of two blocks on AVX2), f32 scales per block (per group of 4
for q6_K's 16-element scales) and, where the format has one, the coefficient c of the activation block sum
(sum_k w x = sum_blocks scale * dx * dot(q, qx) + c * s):

  q8_0  (34 B / 32):  f16 d, 32 x int8;                    w = d * q
  q4_0  (18 B / 32):  f16 d, 16 B nibbles;                 w = d * (q - 8)      c = -8 d
  q4_1  (20 B / 32):  f16 d, f16 m, 16 B nibbles;          w = d * q + m        c = m
        (for q4_0 / q4_1, byte j holds element j in its low nibble and element j + 16 in its high nibble)
  q4_K  (144 B / 256): f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles; per 64-element chunk j the
        low nibbles of bytes [32j, 32j+32) are sub-block 2j, the high nibbles sub-block 2j+1;
        w = d * sc[s] * q - dmin * m[s]  (sc, m unpacked as ggml's get_scale_min_k4)
  q5_K  (176 B / 256): f16 d, f16 dmin, 12 B scales/mins, 32 B high bits qh, 128 B nibbles; element i of
        sub-block s gets bit s of qh[i] as its 5th bit; otherwise as q4_K
  q6_K  (210 B / 256): 128 B low nibbles ql, 64 B high 2-bit pairs qh, 16 x int8 scales, f16 d;
        element e of half h (128 elements): low 4 bits from ql[64h + e % 64] >> 4*(e // 64), high 2 bits
        from qh[32h + e % 32] >> 2*(e // 32); w = d * scale[e // 16] * (q - 32)
  q5_0  (22 B / 32):  f16 d, 32-bit mask qh (bit i: element i's 5th bit), 16 B nibbles (q4_0's order);
        w = d * (q - 16)     c = -16 d      (q5_1, 24 B: f16 d, f16 m, qh, nibbles; w = d * q + m, c = m)
  iq4_nl (18 B / 32): f16 d, 16 B nibbles (q4_0's order) indexing ggml's kvalues_iq4nl grid (int8, -127..113):
        w = d * kvalues[q]   (the lookup is a tree of selects on the nibble's bits)
  mxfp4 (17 B / 32):  e8m0 exponent e, 16 B nibbles (q4_0's order) indexing the doubled e2m1 grid (0..12, bit 3
        the sign); w = 2^(e - 128) * kvalues[q]
  q2_K  (84 B / 256): 16 B scales (per 16 elements: low nibble scale, high nibble min), 64 B 2-bit quants
        (32-element group 4h + j: (qs[32h + i] >> 2j) & 3), f16 d, f16 dmin; w = d * sc * q - dmin * m, the
        min per 16 elements against the activations' 16-element sums (dot4 with ones; c has shape (R, 8, 2))
  q3_K  (110 B / 256): 32 B high-bit mask (group s: bit s of hmask[i]), 64 B 2-bit quants (as q2_K), 12 B of
        16 6-bit scales (bias 32), f16 d; q = low 2 bits - 4 where the mask bit is clear; w = d * (sc - 32) * q
  iq4_xs (136 B / 256): f16 d, u16 scales_h, 4 B scales_l, 128 B nibbles (16 per 32-element sub-block);
        sub-block s: w = d * (ls - 32) * kvalues[q], ls = 4 bits of scales_l[s // 2] | 2 bits of scales_h >> 2s
(all checked against gguf.quants.dequantize in tests/ops/test_quant.py; dequantize_rows is bit-exact)

Edges without masks in the hot loops: the last tile of weight rows (tokens) is shifted back to end at N (M),
overlapping its neighbour, which recomputes and rewrites identical values; so tiles never exceed N (M).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import jitkern as jk
from engine.ops._hostargs import device_scratch, empty_like_dev, is_array, is_device, resolve_target, run

__all__ = ["QTYPES", "QType", "Q8Activations", "LAYOUTS", "act_layout", "quantize_q8", "matmul_q", "matmul_q8",
           "dequantize_rows", "row_bytes", "qmm_tiles", "qmm_step"]


@dataclass(frozen=True)
class QType:
    name: str
    block_elems: int      # elements per (super-)block
    block_bytes: int      # bytes per (super-)block


QTYPES = {q.name: q for q in (QType("q8_0", 32, 34), QType("q4_0", 32, 18), QType("q4_1", 32, 20),
                              QType("q4_K", 256, 144), QType("q5_K", 256, 176), QType("q6_K", 256, 210),
                              QType("q5_0", 32, 22), QType("q5_1", 32, 24), QType("iq4_nl", 32, 18),
                              QType("q2_K", 256, 84), QType("q3_K", 256, 110), QType("iq4_xs", 256, 136),
                              QType("mxfp4", 32, 17))}


def _qtype(qtype) -> QType:
    if isinstance(qtype, QType):
        return qtype
    q = QTYPES.get(str(qtype)) or {k.lower(): v for k, v in QTYPES.items()}.get(str(qtype).lower())
    if q is None:
        raise ValueError(f"qtype {qtype!r} is not supported; supported: {', '.join(QTYPES)}")
    return q


def row_bytes(qtype, K: int) -> int:
    """Bytes of one weight row of K elements."""
    q = _qtype(qtype)
    if K <= 0 or K % q.block_elems:
        raise ValueError(f"K={K} must be a positive multiple of {q.block_elems} for {q.name}")
    return K // q.block_elems * q.block_bytes


# --------------------------------------------------------------------------------- activation quantisation
@jk.jit
def _q8_blocks(v):
    """(q f32 integer values, d, d * sum(q)) of a (B, 32) f32 tile of 32-element blocks."""
    amax = jk.max(jk.abs(v), axis=1)
    d = amax / 127.0
    inv = jk.where(d > 0.0, 1.0 / jk.where(d > 0.0, d, 1.0), 0.0)
    t = v * inv[:, None]
    # round half to even (as ggml's AVX2 path, _mm256_round_ps nearest): adding and removing 1.5 * 2^23
    # leaves the integer nearest to t (ties to even) for |t| < 2^22; |t| <= 127 (+ a few ulp) here
    r = (t + 12582912.0) - 12582912.0
    r = jk.minimum(jk.maximum(r, -127.0), 127.0)
    return r, d, d * jk.sum(r, axis=1)


@jk.jit
def _store_grouped(qx, off, r, NG: jk.constexpr, G: jk.constexpr):
    """Stores the int8 values r of NG * G consecutive 32-blocks (a (NG * G, 32) f32 tile of integers) at qx + off
    in groups of G blocks interleaved by 16-value halves: [b0 0-15, .., bG-1 0-15, b0 16-31, .., bG-1 16-31]
    (G = 1: element order)."""
    jk.store(qx + off + jk.arange(0, NG)[:, None, None, None] * (G * 32) + jk.arange(0, G)[None, :, None, None] * 16
             + jk.arange(0, 2)[None, None, :, None] * (G * 16) + jk.arange(0, 16)[None, None, None, :],
             jk.reshape(r.to(jk.i32).to(jk.i8), (NG, G, 2, 16)))


@jk.jit
def _store_scales(xd, xs, xd4, xs4, row, nblk, blk, d, s, NB: jk.constexpr, REP4: jk.constexpr):
    """Stores the scales d and sums s of NB blocks (indices blk) of a row, and with REP4 each repeated 4 times."""
    jk.store(xd + row * nblk + blk, d)
    jk.store(xs + row * nblk + blk, s)
    if REP4:
        o4 = row * nblk * 4 + blk[:, None] * 4 + jk.arange(0, 4)[None, :]
        jk.store(xd4 + o4, jk.broadcast_to(d[:, None], (NB, 4)))
        jk.store(xs4 + o4, jk.broadcast_to(s[:, None], (NB, 4)))


@jk.jit
def _quantize_tail(x, qx, xd, xs, xd4, xs4, row, K, b0, NBT: jk.constexpr, REP4: jk.constexpr):
    """Quantises the NBT blocks from block b0 of a row as one group of NBT (the leftovers of a grouped layout)."""
    blk = b0.to(jk.i64) + jk.arange(0, NBT)
    r, d, s = _q8_blocks(jk.load(x + row * K + blk[:, None] * 32 + jk.arange(0, 32)[None, :]))
    _store_grouped(qx, row * K + b0.to(jk.i64) * 32, r, 1, NBT)
    _store_scales(xd, xs, xd4, xs4, row, K // 32, blk, d, s, NBT, REP4)


@jk.jit
def q8_store_blocks(v, qx, xd, xs, xd4, xs4, row, nblk, blk, ok, NB: jk.constexpr, G: jk.constexpr,
                    REP4: jk.constexpr):
    """Quantises the (NB, 32) f32 tile v, the 32-blocks `blk` (NB,) of row `row` of a (rows, nblk * 32)
    activation, into quantize_q8's arrays (qx in the layout of group G: Q8Activations; scales, sums and with
    REP4 their 4-fold copies), storing the blocks where `ok` (NB,). Each block lands where quantize_q8 puts it
    whichever program quantises it, with the same arithmetic (_q8_blocks): a kernel that produces some blocks
    of a row (an attention head's output) can write them quantised, with quantize_q8's bits."""
    r, d, s = _q8_blocks(v)
    span = nblk - nblk % G
    grouped = blk < span
    # a block of the whole groups: the group's 16-value halves of its G blocks, G * 16 apart; of the grouped
    # layouts' leftovers a pair (G = 4, 2 or 3 left) is a group of 2, and an odd last block is in order
    if G > 2:
        pair = (blk >= span) & (blk - span < 2) & (nblk - span >= 2)
        base = jk.where(grouped, (blk // G) * (G * 32) + (blk % G) * 16,
                        jk.where(pair, span * 32 + (blk - span) * 16, blk * 32))
        half = jk.where(grouped, G * 16, jk.where(pair, 32, 16))
    else:
        base = jk.where(grouped, (blk // G) * (G * 32) + (blk % G) * 16, blk * 32)
        half = jk.where(grouped, G * 16, 16)
    offs = base[:, None, None] + jk.arange(0, 2)[None, :, None] * half[:, None, None] + jk.arange(0, 16)[None, None, :]
    jk.store(qx + row * nblk * 32 + offs, jk.reshape(r.to(jk.i32).to(jk.i8), (NB, 2, 16)), mask=ok[:, None, None])
    jk.store(xd + row * nblk + blk, d, mask=ok)
    jk.store(xs + row * nblk + blk, s, mask=ok)
    if REP4:
        o4 = row * nblk * 4 + blk[:, None] * 4 + jk.arange(0, 4)[None, :]
        jk.store(xd4 + o4, jk.broadcast_to(d[:, None], (NB, 4)), mask=ok[:, None])
        jk.store(xs4 + o4, jk.broadcast_to(s[:, None], (NB, 4)), mask=ok[:, None])


def q8_group(layout: str, nblk: int) -> int:
    """The group size G of `layout` for rows of nblk 32-blocks (q8_store_blocks' G)."""
    return _eff_group(layout, nblk)


@jk.kernel
def _quantize_q8_kernel(x, qx, xd, xs, xd4, xs4, K, NBLK, BB: jk.constexpr, G: jk.constexpr, REP4: jk.constexpr):
    # program (row, chunk of BB 32-blocks); the last chunk of a row shifts back to end at the row's end.
    # G > 1: the grouped layouts ('q4': G = 2, 'q4x4': G = 4; see Q8Activations): chunks of BB (a multiple of
    # G) blocks cover the NBLK - NBLK % G blocks in whole groups; the first program of the row does the rest
    # (a pair, then a single block, each as its own group)
    row = jk.program_id(1).to(jk.i64)
    b0 = jk.minimum(jk.program_id(0) * BB, NBLK - NBLK % G - BB).to(jk.i64)
    blk = b0 + jk.arange(0, BB)
    r, d, s = _q8_blocks(jk.load(x + row * K + blk[:, None] * 32 + jk.arange(0, 32)[None, :]))
    _store_grouped(qx, row * K + b0 * 32, r, BB // G, G)
    _store_scales(xd, xs, xd4, xs4, row, NBLK, blk, d, s, BB, REP4)
    if G > 1:
        rest = NBLK % G
        if (jk.program_id(0) == 0) & (rest > 0):
            if G > 2:
                if rest >= 2:
                    _quantize_tail(x, qx, xd, xs, xd4, xs4, row, K, NBLK - rest, 2, REP4)
            if rest % 2 == 1:
                _quantize_tail(x, qx, xd, xs, xd4, xs4, row, K, NBLK - 1, 1, REP4)


LAYOUTS = ("natural", "q4", "q4x4")
_GROUP = {"natural": 1, "q4": 2, "q4x4": 4}


def _eff_group(layout: str, nblk: int) -> int:
    """The group size a layout really has for rows of nblk blocks (fewer blocks than a group: the grouped
    layouts coincide with the smaller ones)."""
    g = _GROUP[layout]
    while g > nblk:
        g //= 2
    return g


def act_layout(qtype, M: int = 1, target=None) -> str:
    """The activation layout `matmul_q8` needs for weights of this type on `target`: for q4_0 / q4_1 'q4'
    ('q4x4' where the kernel steps over 4 blocks), for q8_0 'q4x4' on 512-bit tiers and 'q4' on 256-bit ones
    (`_q8_halves`), else 'natural'. The same for every M (`M` is accepted for callers that pass it)."""
    q = _qtype(qtype)
    T = resolve_target(target)
    if _gpu_qmv(q, T):
        return "natural"
    if q.name in ("q4_0", "q4_1") or (q.name == "q8_0" and _q8_halves(T)):
        return {4: "q4x4", 2: "q4", 1: "natural"}[qmm_step(q, T)]
    return "natural"


def _q8_halves(target) -> bool:
    """Whether q8_0 runs in the 'halves' order (`_dec_q8_0_halves`): on 512-bit tiers, where a block's two
    halves would otherwise meet across 128-bit lanes (+17% at M = 16), and on 256-bit ones, where one vector
    then holds the same half of 2 blocks and the halves' dot products add lane by lane instead of across the
    two 128-bit lanes (SmolLM2's 49152 x 576 head on znver3, 1 thread: 21.9 -> 15.9 ms at M = 16, 4.1 -> 3.4 ms
    at M = 1). GPUs (vector_bits 0) and 128-bit tiers keep the natural order."""
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    return target.vector_bits >= 256


class Q8Activations(tuple):
    """(qx, scales, sums) as returned by `quantize_q8`, carrying the layout of qx in `.layout`:
    'natural' (each 32-block's values in order), 'q4' (blocks 2j and 2j+1 interleaved by 16-value halves,
    [2j: 0-15, 2j+1: 0-15, 2j: 16-31, 2j+1: 16-31]; the last block of an odd count in order) or 'q4x4' (groups
    of 4 blocks likewise, [4j: 0-15, .., 4j+3: 0-15, 4j: 16-31, .., 4j+3: 16-31]; of the last K/32 % 4 blocks
    a pair as in 'q4', then an odd last block in order), which let the q4_0 / q4_1 kernels load the activations
    that pair with one vector of nibble bytes (the same half of 2 or 4 blocks) with one contiguous load.
    `.scales4` / `.sums4` (or None): scales and sums with each block's value repeated 4 times, [..., K/32 * 4],
    the lanes of the q8_0 / q4_0 / q4_1 kernel's 4-row registers (quantize_q8(..., rep4=True))."""

    layout = "natural"
    scales4 = sums4 = None

    def __new__(cls, qx, scales, sums, layout="natural", scales4=None, sums4=None):
        obj = super().__new__(cls, (qx, scales, sums))
        obj.layout = layout
        obj.scales4, obj.sums4 = scales4, sums4
        return obj


def quantize_q8(x: np.ndarray, out=None, target=None, layout: str = "natural", rep4: bool = False,
                out4=None) -> Q8Activations:
    """Quantises float32 activations (M, K) or (K,) (K a multiple of 32) into 32-element int8 blocks.

    Returns (qx int8 [..., K], scales f32 [..., K/32], sums f32 [..., K/32]) with, per block,
    d = max|x| / 127, q = round_half_even(x * (1/d)) clipped to [-127, 127] (q = 0 where d = 0), and
    sum = d * sum(q); qx in `layout` ('natural', or 'q4' for q4_0 / q4_1 weights: see Q8Activations and
    act_layout). `out` may give the three arrays to fill. rep4: also the scales and sums with every block's value
    repeated 4 times (`.scales4`, `.sums4`; what matmul_q8 uses for M > 1, else it repeats them on the host);
    `out4` may give those two arrays.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"quantize_q8: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    target = resolve_target(target, x)
    if not is_device(x):
        x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"quantize_q8: x must be float32, got {x.dtype}")
    if x.ndim not in (1, 2):
        raise ValueError(f"quantize_q8: x must be (K,) or (M, K), got shape {x.shape}")
    if is_device(x):
        if not x.flags.c_contiguous:
            raise ValueError("quantize_q8: a device x must be contiguous")
    else:
        x = np.ascontiguousarray(x)
    K = x.shape[-1]
    if K % 32 or K == 0:
        raise ValueError(f"quantize_q8: K={K} (x's last axis) must be a positive multiple of 32")
    lead = x.shape[:-1]
    nblk = K // 32
    if out is None:
        qx = empty_like_dev(x, lead + (K,), np.int8)
        xd = empty_like_dev(x, lead + (nblk,), np.float32)
        xs = empty_like_dev(x, lead + (nblk,), np.float32)
    else:
        qx, xd, xs = out
        for a, shp, dt, nm in ((qx, lead + (K,), np.int8, "qx"), (xd, lead + (nblk,), np.float32, "scales"),
                               (xs, lead + (nblk,), np.float32, "sums")):
            if a.shape != shp or a.dtype != dt or not a.flags.c_contiguous:
                raise ValueError(f"quantize_q8: out {nm} must be a contiguous {np.dtype(dt)} array of shape {shp}, "
                                 f"got {a.dtype} {a.shape}")
    M = int(np.prod(lead)) if lead else 1
    g = _eff_group(layout, nblk)
    span = nblk - nblk % g
    bb = g
    while bb * 2 <= min(span, 8):
        bb *= 2
    xd4 = xs4 = None
    if rep4 and out4 is not None:
        xd4, xs4 = out4
        if xd4.shape != lead + (nblk * 4,) or xs4.shape != xd4.shape:
            raise ValueError(f"quantize_q8: out4 arrays must have shape {lead + (nblk * 4,)}")
    elif rep4:
        xd4 = empty_like_dev(x, lead + (nblk * 4,), np.float32)
        xs4 = empty_like_dev(x, lead + (nblk * 4,), np.float32)
    if M:
        run(_quantize_q8_kernel, (-(-span // bb), M), (x, qx, xd, xs, xd if xd4 is None else xd4,
                                                       xs if xs4 is None else xs4, K, nblk),
            target, BB=bb, G=g, REP4=rep4)
    return Q8Activations(qx, xd, xs, layout, xd4, xs4)


# ------------------------------------------------------------------------------------ weight block decoders
# Each decoder gets the weight bytes `w` (u8) and the same memory as f16 `wh`, the (R,) i64 weight rows, the
# step index `st` (which S 32-element sub-blocks of every row), the row length in bytes `rb`, and returns
#   q   (R, S, 32) u8 or i8  quantised values in element order,
#   sc  (R, S, 1)  f32       weight scale of each sub-block (or (R, S, 8): of each group of 4 elements),
#   c   (R, S)     f32       coefficient of the activation block sum (or None),
#   QOFF int                 for q4_0: w = sc * (q - QOFF), with -QOFF * sc already in c; dequantisation applies
#                            it to q instead, reproducing ggml's rounding exactly (else None).
@jk.jit
def _nibbles(w, offs, R: jk.constexpr, C: jk.constexpr, N: jk.constexpr):
    """Bytes at offs[r, c] + (0..N) as (R, C, 1, N); low nibbles then high nibbles along axis 2."""
    b = jk.load(w + offs[:, :, None, None] + jk.arange(0, N)[None, None, None, :])
    b = jk.broadcast_to(b, (R, C, 2, N))
    hi = jk.arange(0, 2)[None, None, :, None] == 1
    return jk.where(hi, b >> 4, b & 15)


@jk.jit
def _dec_q8_0(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 34
    q = jk.load(w + base[:, :, None] + 2 + jk.arange(0, 32)[None, None, :]).to(jk.i8, bitcast=True)
    sc = jk.load((wh + rows[:, None] * (rb // 2) + blk[None, :] * 17)[:, :, None]).to(jk.f32)
    return q, sc, None, None


@jk.jit
def _dec_q8_0_halves(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    """q8_0 in the 'halves' order (R, 2, S, 16) (the q4 types' order: one vector holds the same 16-value half of
    S blocks), so the two halves' dot products meet in the same 128-bit lanes and add there."""
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 34
    q = jk.load(w + base[:, None, :, None] + 2 + jk.arange(0, 2)[None, :, None, None] * 16
                + jk.arange(0, 16)[None, None, None, :]).to(jk.i8, bitcast=True)
    sc = jk.load((wh + rows[:, None] * (rb // 2) + blk[None, :] * 17)[:, :, None]).to(jk.f32)
    return q, sc, None, None


@jk.jit
def _nibble_halves(w, offs, R: jk.constexpr, S: jk.constexpr):
    """q4_0 / q4_1 quants of blocks at byte offsets offs (R, S) in the 'halves' layout (R, 2, S, 16):
    [:, 0] the low nibbles (elements 0..15 of each block), [:, 1] the high nibbles (elements 16..31). With
    S > 1 one register holds the same half of S blocks, so a 32-byte vector of nibble bytes (two blocks on
    AVX2) is unpacked by one and, one shift + and, instead of per block."""
    b = jk.load(w + offs[:, None, :, None] + jk.arange(0, 16)[None, None, None, :])
    b = jk.broadcast_to(b, (R, 2, S, 16))
    hi = jk.arange(0, 2)[None, :, None, None] == 1
    return jk.where(hi, b >> 4, b & 15)


@jk.jit
def _dec_q4_0(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 18
    q = _nibble_halves(w, base + 2, R, S)
    sc = jk.load((wh + rows[:, None] * (rb // 2) + blk[None, :] * 9)[:, :, None]).to(jk.f32)
    # sum(d (q - 8) x) = d * dot(q, x) - 8 d * sum(x): the -8 rides on the activation block sums
    return q, sc, jk.reshape(sc, (R, S)) * -8.0, 8


@jk.jit
def _dec_q4_1(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 20
    q = _nibble_halves(w, base + 4, R, S)
    hoff = rows[:, None] * (rb // 2) + blk[None, :] * 10
    # d and m are adjacent: one 4-byte load per block, split into two vectors by a transpose (the selects
    # against -0.0 fold away, leaving a shuffle)
    dm = jk.load((wh + hoff)[:, :, None] + jk.arange(0, 2)[None, None, :]).to(jk.f32)     # (R, S, 2)
    sc, m = _scale_min(dm, R, S)
    return q, sc, m, None


@jk.jit
def _scale_min(dm, R: jk.constexpr, S: jk.constexpr):
    """q4_1's (R, S, 1) scales and (R, S) mins from its (d, m) pairs ((R, S, 2) or (R, 2 S) in pair order)."""
    dmt = jk.trans(jk.reshape(dm, (R * S, 2)))
    first = jk.arange(0, 2)[:, None] == 0
    sc = jk.reshape(jk.sum(jk.where(first, dmt, -0.0), axis=0), (R, S, 1))
    m = jk.reshape(jk.sum(jk.where(first, -0.0, dmt), axis=0), (R, S))
    return sc, m


# The 'split' layout of a q4_0 / q4_1 / q8_0 weight (`split_blocks`): the same bytes regrouped into two planes, every
# row's quants back to back (K/2 or K bytes a row, `w` then points at the first) and after them every block's f16
# scale (q4_1: scale, min), `wh` pointing at the first. A step's S blocks of one row are then one contiguous load
# of quants and one of scales, where the GGUF blocks (18 / 20 / 34 bytes) took a load per block and inserts to
# gather them. The decoders return exactly what the GGUF-layout ones do (same values, same order), so a split
# weight gives the same bits. `rb` is the quant bytes of a row here.
@jk.jit
def _split_nibble_halves(w, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    b = jk.load(w + rows[:, None] * rb + st * (S * 16) + jk.arange(0, S * 16)[None, :])
    b = jk.broadcast_to(jk.reshape(b, (R, 1, S, 16)), (R, 2, S, 16))
    hi = jk.arange(0, 2)[None, :, None, None] == 1
    return jk.where(hi, b >> 4, b & 15)


@jk.jit
def _dec_q4_0_split(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    q = _split_nibble_halves(w, rows, st, rb, R, S)
    sc = jk.load(wh + rows[:, None] * (rb // 16) + st * S + jk.arange(0, S)[None, :]).to(jk.f32)   # (R, S)
    return q, jk.reshape(sc, (R, S, 1)), sc * -8.0, 8


@jk.jit
def _dec_q4_1_split(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    q = _split_nibble_halves(w, rows, st, rb, R, S)
    dm = jk.load(wh + rows[:, None] * (rb // 8) + st * (2 * S) + jk.arange(0, 2 * S)[None, :]).to(jk.f32)
    sc, m = _scale_min(dm, R, S)
    return q, sc, m, None


@jk.jit
def _dec_q8_0_halves_split(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # a step's S blocks' 32 quants each are S * 32 contiguous bytes (one load), put in the halves order by a shuffle
    b = jk.load(w + rows[:, None] * rb + st * (S * 32) + jk.arange(0, S * 32)[None, :])
    q = jk.trans(jk.reshape(b, (R, S, 2, 16)), (0, 2, 1, 3)).to(jk.i8, bitcast=True)
    sc = jk.load(wh + rows[:, None] * (rb // 32) + st * S + jk.arange(0, S)[None, :]).to(jk.f32)
    return q, jk.reshape(sc, (R, S, 1)), None, None


@jk.jit
def _k_scales(w, wh, base, hbase, R: jk.constexpr):
    """(d * sc, dmin * m) for the 8 sub-blocks of a q4_K / q5_K super-block, each (R, 8) f32."""
    s = jk.arange(0, 8)[None, :]
    a = jk.load(w + base[:, None] + 4 + s)        # scales[s]
    b = jk.load(w + base[:, None] + 8 + s)        # scales[s + 4]
    c = jk.load(w + base[:, None] + s)            # scales[s - 4] (for s >= 4)
    low = s < 4
    sc = jk.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = jk.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    d = jk.load((wh + hbase)[:, None]).to(jk.f32)
    dmin = jk.load((wh + hbase + 1)[:, None]).to(jk.f32)
    return d * sc.to(jk.f32), dmin * mn.to(jk.f32)


@jk.jit
def _dec_q4_K(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    base = rows * rb + st * 144
    ds, dm = _k_scales(w, wh, base, rows * (rb // 2) + st * 72, R)
    q = jk.reshape(_nibbles(w, base[:, None] + 16 + jk.arange(0, 4).to(jk.i64)[None, :] * 32, R, 4, 32),
                   (R, 8, 32))
    return q, ds[:, :, None], -dm, None


@jk.jit
def _dec_q5_K(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    base = rows * rb + st * 176
    ds, dm = _k_scales(w, wh, base, rows * (rb // 2) + st * 88, R)
    lo = jk.reshape(_nibbles(w, base[:, None] + 48 + jk.arange(0, 4).to(jk.i64)[None, :] * 32, R, 4, 32),
                    (R, 8, 32))
    qh = jk.load(w + base[:, None, None] + 16 + jk.arange(0, 32)[None, None, :])
    bit = (jk.full((1, 8, 1), 1, jk.u8) << jk.arange(0, 8)[None, :, None].to(jk.u8))
    q = lo | jk.where((jk.broadcast_to(qh, (R, 8, 32)) & bit) != 0, jk.full((1, 1, 1), 16, jk.u8),
                      jk.full((1, 1, 1), 0, jk.u8))
    return q, ds[:, :, None], -dm, None


@jk.jit
def _dec_q6_K(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    base = rows * rb + st * 210
    # low 4 bits: (R, half h, nibble, 32-byte half of the 64 bytes, 32) -> sub-block 4h + 2*nibble + half
    b = jk.load(w + base[:, None, None, None, None] + jk.arange(0, 2)[None, :, None, None, None] * 64
                + jk.arange(0, 2)[None, None, None, :, None] * 32 + jk.arange(0, 32)[None, None, None, None, :])
    b = jk.broadcast_to(b, (R, 2, 2, 2, 32))
    nib = jk.arange(0, 2)[None, None, :, None, None] == 1
    ql = jk.reshape(jk.where(nib, b >> 4, b & 15), (R, 2, 4, 32))
    # high 2 bits of sub-block u of half h: (qh[32h + i] >> 2u) & 3, moved to bits 4..5
    h = jk.broadcast_to(jk.load(w + base[:, None, None, None] + 128 + jk.arange(0, 2)[None, :, None, None] * 32
                                + jk.arange(0, 32)[None, None, None, :]), (R, 2, 4, 32))
    u = jk.arange(0, 4)[None, None, :, None]
    hb = jk.where(u == 0, h << 4, jk.where(u == 1, h << 2, jk.where(u == 2, h, h >> 2))) & 48
    q = jk.reshape((ql | hb).to(jk.i8, bitcast=True) - 32, (R, 8, 32))
    sc16 = jk.load(w + base[:, None] + 192 + jk.arange(0, 16)[None, :]).to(jk.i8, bitcast=True).to(jk.f32)
    d = jk.load((wh + rows * (rb // 2) + st * 105 + 104)[:, None]).to(jk.f32)
    sc = jk.reshape(jk.broadcast_to(jk.reshape(sc16 * d, (R, 8, 2, 1)), (R, 8, 2, 4)), (R, 8, 8))
    return q, sc, None, None


# ---- Q5_0, Q5_1, IQ4_NL (32-element blocks, natural element order) and Q2_K, Q3_K, IQ4_XS (256-element
# super-blocks); layouts as in ggml-common.h, checked against gguf.quants.dequantize in tests/ops/test_quant.py
@jk.jit
def _nib32(w, offs, R: jk.constexpr, S: jk.constexpr):
    """The 32 nibbles of the 16 bytes at byte offsets offs (R, S) in element order (byte j: element j in its low
    nibble, j + 16 in its high nibble), (R, S, 32) u8."""
    return jk.reshape(_nibbles(w, offs, R, S, 16), (R, S, 32))


@jk.jit
def _bit4_32(w, offs, R: jk.constexpr, S: jk.constexpr):
    """Bit i of the little-endian 32-bit mask at byte offsets offs (R, S) moved to bit 4 (16 or 0), (R, S, 32)
    u8 (q5_0 / q5_1's fifth bits)."""
    b = jk.reshape(jk.load(w + offs[:, :, None] + jk.arange(0, 4)[None, None, :]), (R, S, 4, 1))
    b = jk.broadcast_to(b, (R, S, 4, 8))
    bit = jk.full((1, 1, 1, 1), 1, jk.u8) << jk.arange(0, 8)[None, None, None, :].to(jk.u8)
    v = jk.where((b & bit) != 0, jk.full((1, 1, 1, 1), 16, jk.u8), jk.full((1, 1, 1, 1), 0, jk.u8))
    return jk.reshape(v, (R, S, 32))


@jk.jit
def _dec_q5_0(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 22 B: f16 d, 4 B fifth bits qh, 16 B nibbles; w = d * (q - 16)
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 22
    q = _nib32(w, base + 6, R, S) | _bit4_32(w, base + 2, R, S)
    sc = jk.load((wh + rows[:, None] * (rb // 2) + blk[None, :] * 11)[:, :, None]).to(jk.f32)
    return q, sc, jk.reshape(sc, (R, S)) * -16.0, 16


@jk.jit
def _dec_q5_1(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 24 B: f16 d, f16 m, 4 B fifth bits qh, 16 B nibbles; w = d * q + m
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 24
    q = _nib32(w, base + 8, R, S) | _bit4_32(w, base + 4, R, S)
    hoff = rows[:, None] * (rb // 2) + blk[None, :] * 12
    sc = jk.load((wh + hoff)[:, :, None]).to(jk.f32)
    m = jk.load(wh + hoff + 1).to(jk.f32)
    return q, sc, m, None


@jk.jit
def _c8(v: jk.constexpr):
    return jk.full((1, 1, 1), v, jk.i8)


@jk.jit
def _iq4_values(n):
    """kvalues_iq4nl[n] (ggml's non-linear 4-bit grid) of a 3-D u8 tile of nibbles, as i8: a tree of selects on
    the four bits (no table gathers; the same on every target)."""
    b0 = (n & 1) != 0
    b1 = (n & 2) != 0
    b2 = (n & 4) != 0
    v0 = jk.where(b1, jk.where(b0, _c8(-65), _c8(-83)), jk.where(b0, _c8(-104), _c8(-127)))
    v1 = jk.where(b1, jk.where(b0, _c8(-10), _c8(-22)), jk.where(b0, _c8(-35), _c8(-49)))
    v2 = jk.where(b1, jk.where(b0, _c8(38), _c8(25)), jk.where(b0, _c8(13), _c8(1)))
    v3 = jk.where(b1, jk.where(b0, _c8(113), _c8(89)), jk.where(b0, _c8(69), _c8(53)))
    return jk.where((n & 8) != 0, jk.where(b2, v3, v2), jk.where(b2, v1, v0))


@jk.jit
def _dec_iq4_nl(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 18 B: f16 d, 16 B nibbles (q4_0's order) indexing kvalues_iq4nl; w = d * kvalues[q]
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 18
    q = _iq4_values(_nib32(w, base + 2, R, S))
    sc = jk.load((wh + rows[:, None] * (rb // 2) + blk[None, :] * 9)[:, :, None]).to(jk.f32)
    return q, sc, None, None


@jk.jit
def _mxfp4_values(n):
    """ggml's kvalues_mxfp4 (e2m1 values doubled: 0 1 2 3 4 6 8 12, bit 3 the sign) of a 3-D u8 tile of
    nibbles, as i8 (selects on the bits, as _iq4_values)."""
    b0 = (n & 1) != 0
    b1 = (n & 2) != 0
    lo = jk.where(b1, jk.where(b0, _c8(3), _c8(2)), jk.where(b0, _c8(1), _c8(0)))
    hi = jk.where(b1, jk.where(b0, _c8(12), _c8(8)), jk.where(b0, _c8(6), _c8(4)))
    m = jk.where((n & 4) != 0, hi, lo)
    return jk.where((n & 8) != 0, -m, m)


@jk.jit
def _dec_mxfp4(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 17 B: e8m0 exponent e, 16 B nibbles (q4_0's order) indexing kvalues_mxfp4; w = d * kvalues[q] with
    # d = ggml_e8m0_to_fp32_half(e) = 2^(e - 128) (f32 bits 0x00200000 << e for e < 2, else (e - 1) << 23)
    blk = st * S + jk.arange(0, S).to(jk.i64)
    base = rows[:, None] * rb + blk[None, :] * 17
    q = _mxfp4_values(_nib32(w, base + 1, R, S))
    e = jk.load(w + base).to(jk.i32)
    bits = jk.where(e < 2, jk.where(e == 0, 2097152, 4194304), (e - 1) << 23)
    return q, bits.to(jk.f32, bitcast=True)[:, :, None], None, None


@jk.jit
def _crumbs(w, offs, R: jk.constexpr):
    """The 2-bit fields of the 64 bytes at offs (R,) in q2_K / q3_K order, (R, 8, 32) u8: group s = 4 h + j (32
    elements) holds (b[32 h + i] >> 2 j) & 3 (constant shifts: x86 has no per-lane byte shifts)."""
    b = jk.load(w + offs[:, None, None, None] + jk.arange(0, 2)[None, :, None, None] * 32
                + jk.arange(0, 32)[None, None, None, :])
    b = jk.broadcast_to(b, (R, 2, 4, 32))
    j = jk.arange(0, 4)[None, None, :, None]
    v = jk.where(j == 0, b, jk.where(j == 1, b >> 2, jk.where(j == 2, b >> 4, b >> 6))) & 3
    return jk.reshape(v, (R, 8, 32))


@jk.jit
def _per16(v, R: jk.constexpr):
    """(R, 16) values of 16-element sub-blocks -> (R, 8, 8): one per group of 4 elements (dot4's lanes)."""
    return jk.reshape(jk.broadcast_to(jk.reshape(v, (R, 8, 2, 1)), (R, 8, 2, 4)), (R, 8, 8))


@jk.jit
def _dec_q2_K(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 84 B: 16 B scales (low nibble scale, high nibble min, per 16 elements), 64 B 2-bit quants, f16 d, f16 dmin;
    # w = d * (sc & 15) * q - dmin * (sc >> 4); the min rides on the activations' 16-element sums (c (R, 8, 2))
    base = rows * rb + st * 84
    q = _crumbs(w, base + 16, R)
    s16 = jk.load(w + base[:, None] + jk.arange(0, 16)[None, :])
    hb = rows * (rb // 2) + st * 42
    d = jk.load((wh + hb + 40)[:, None]).to(jk.f32)
    dmin = jk.load((wh + hb + 41)[:, None]).to(jk.f32)
    dl = d * (s16 & 15).to(jk.f32)
    ml = dmin * (s16 >> 4).to(jk.f32)
    return q, _per16(dl, R), jk.reshape(-ml, (R, 8, 2)), None


@jk.jit
def _dec_q3_K(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 110 B: 32 B high-bit mask, 64 B 2-bit quants, 12 B 6-bit scales (16 of them, bias 32), f16 d;
    # q = low 2 bits - 4 where the mask bit is clear; w = d * (scale - 32) * q
    base = rows * rb + st * 110
    ql = _crumbs(w, base + 32, R)
    hm = jk.broadcast_to(jk.reshape(jk.load(w + base[:, None] + jk.arange(0, 32)[None, :]), (R, 1, 32)), (R, 8, 32))
    bit = jk.full((1, 1, 1), 1, jk.u8) << jk.arange(0, 8)[None, :, None].to(jk.u8)
    q = jk.where((hm & bit) != 0, ql, ql - 4).to(jk.i8, bitcast=True)
    # scale k: low 4 bits (b[k % 8] >> 4 (k // 8)) & 15, high 2 bits (b[8 + k % 4] >> 2 (k // 4)) & 3
    a = jk.broadcast_to(jk.reshape(jk.load(w + base[:, None] + 96 + jk.arange(0, 8)[None, :]), (R, 1, 8)), (R, 2, 8))
    lo = jk.reshape(jk.where(jk.arange(0, 2)[None, :, None] == 1, a >> 4, a & 15), (R, 16))
    h = jk.broadcast_to(jk.reshape(jk.load(w + base[:, None] + 104 + jk.arange(0, 4)[None, :]), (R, 1, 4)), (R, 4, 4))
    u = jk.arange(0, 4)[None, :, None]
    hi = jk.reshape(jk.where(u == 0, h, jk.where(u == 1, h >> 2, jk.where(u == 2, h >> 4, h >> 6))) & 3, (R, 16))
    sc = ((lo | (hi << 4)).to(jk.i8, bitcast=True) - 32).to(jk.f32)
    d = jk.load((wh + rows * (rb // 2) + st * 55 + 54)[:, None]).to(jk.f32)
    return q, _per16(d * sc, R), None, None


@jk.jit
def _dec_iq4_xs(w, wh, rows, st, rb, R: jk.constexpr, S: jk.constexpr):
    # 136 B: f16 d, u16 scales_h, 4 B scales_l, 128 B nibbles (16 per 32-element sub-block, q4_0's order)
    # indexing kvalues_iq4nl; sub-block s: w = d * (ls - 32) * kvalues[q], ls = 4 bits of scales_l[s // 2]
    # (low nibble for even s) | 2 bits (scales_h >> 2 s) << 4
    base = rows * rb + st * 136
    q = _iq4_values(jk.reshape(_nibbles(w, base[:, None] + 8 + jk.arange(0, 8).to(jk.i64)[None, :] * 16, R, 8, 16),
                               (R, 8, 32)))
    sl = jk.broadcast_to(jk.reshape(jk.load(w + base[:, None] + 4 + jk.arange(0, 4)[None, :]), (R, 4, 1)), (R, 4, 2))
    lo = jk.reshape(jk.where(jk.arange(0, 2)[None, None, :] == 1, sl >> 4, sl & 15), (R, 8))
    sh = jk.broadcast_to(jk.reshape(jk.load(w + base[:, None] + 2 + jk.arange(0, 2)[None, :]), (R, 2, 1)), (R, 2, 4))
    u = jk.arange(0, 4)[None, None, :]
    hi = jk.reshape(jk.where(u == 0, sh, jk.where(u == 1, sh >> 2, jk.where(u == 2, sh >> 4, sh >> 6))) & 3, (R, 8))
    sc = ((lo | (hi << 4)).to(jk.i8, bitcast=True) - 32).to(jk.f32)
    d = jk.load((wh + rows * (rb // 2) + st * 68)[:, None]).to(jk.f32)
    return q, (d * sc)[:, :, None], None, None

# ------------------------------------------------------------------------------------- K-quants (256 blocks)
@jk.jit
def _kq_step(w, wh, xq, xd, xs, rows, toks, K64, rb, st, acc, accc, DEC: jk.constexpr, BM: jk.constexpr,
             R: jk.constexpr):
    """One super-block (8 sub-blocks of 32, index st) of the BM x R tile: acc (BM, R, 8) gets the scaled
    integer dots (8 lanes per sub-block, summed over the sub-blocks), accc (BM, R, 8) the block-sum terms."""
    q, sc, c, _ = DEC(w, wh, rows, st, rb, R, 8)
    xbase = toks * K64 + st * 256
    srow = toks[:, None] * (K64 // 32) + st * 8 + jk.arange(0, 8)[None, :]
    xv = jk.load(xq + xbase[:, None, None] + jk.arange(0, 8)[None, :, None] * 32
                 + jk.arange(0, 32)[None, None, :])                                # (BM, 8, 32) i8
    p = jk.dot4(jk.broadcast_to(q[None, :, :, :], (BM, R, 8, 32)),
                jk.broadcast_to(xv[:, None, :, :], (BM, R, 8, 32)))                   # (BM, R, 8, 8) i32
    # weight scale x activation scale, one per sub-block (sc (R, 8, 1)) or per group of 4 (q6_K: (R, 8, 8)),
    # multiplied before broadcasting over the lanes
    dx = jk.load((xd + srow)[:, :, None])                                              # (BM, 8, 1)
    scale = jk.broadcast_to(sc[None, :, :, :] * dx[:, None, :, :], (BM, R, 8, 8))
    acc += jk.sum(p.to(jk.f32) * scale, axis=2)
    if c is not None:
        if len(c.shape) == 3:
            # q2_K: a min per 16 elements (c (R, 8, 2)) against the activations' 16-element integer sums (dot4
            # with ones: exact), scaled by the block's dx; the two halves' products added in a fixed order
            s16 = jk.sum(jk.reshape(jk.dot4(jk.full((BM, 8, 32), 1, jk.u8), xv), (BM, 8, 2, 4)), axis=3)
            xs16 = s16.to(jk.f32) * dx                                                      # (BM, 8, 2)
            accc += jk.sum(c[None, :, :, :] * xs16[:, None, :, :], axis=3)
        else:
            accc = jk.fma(c[None, :, :], jk.load(xs + srow)[:, None, :], accc)
    return acc, accc


@jk.kernel(do_not_specialize=('M',))
def _kq_kernel(w, wh, xq, xd, xs, y, M, N, K, NSTEP, RB, RS, DEC: jk.constexpr, BM: jk.constexpr,
               R: jk.constexpr):
    # y[m, n] for BM tokens x RS * R weight rows: RS tiles of R rows one after the other (so a GEMV program
    # with R = 1 still reads one monotonic stream, and its fixed costs are shared by RS rows); grid (N tiles,
    # M tiles); NSTEP super-blocks per row of RB bytes. The same per-output arithmetic for every tile shape.
    n0 = jk.minimum(jk.program_id(0) * (RS * R), N - RS * R)
    m0 = jk.minimum(jk.program_id(1) * BM, M - BM)
    toks = (m0 + jk.arange(0, BM)).to(jk.i64)
    K64 = K.to(jk.i64)
    rb = RB.to(jk.i64)
    for rt in range(0, RS):
        rows = (n0 + rt * R + jk.arange(0, R)).to(jk.i64)
        acc = jk.zeros((BM, R, 8), jk.f32)
        accc = jk.zeros((BM, R, 8), jk.f32)
        for st in range(0, NSTEP):
            acc, accc = _kq_step(w, wh, xq, xd, xs, rows, toks, K64, rb, st.to(jk.i64), acc, accc, DEC, BM, R)
        jk.store(y + toks[:, None] * N + rows[None, :], jk.sum(acc, axis=2) + jk.sum(accc, axis=2))


def _kq_tiles(M: int, N: int) -> tuple:
    """(BM, R, RS) of the K-quant kernel: a GEMV program (M = 1) runs 8 single rows one after the other (one
    monotonic weight stream per thread: R rows in lockstep are R interleaved streams, which the hardware
    prefetchers follow badly, 3-5x less DRAM bandwidth on znver4); a GEMM program a 4 x 2 tile."""
    if M == 1:
        return 1, 1, max(1, min(8, N))
    return _pow2_le(M, 4), _pow2_le(N, 2), 1


# ------------------------------------------------------------- 32-element formats: one kernel for every M
@jk.jit
def _block_dots(q, x, BM: jk.constexpr, R: jk.constexpr, S: jk.constexpr, RI: jk.constexpr,
                TT: jk.constexpr = False, ROUTE: jk.constexpr = 0):
    """The integer dot of every (token, row, block) of a step, (BM, R // RI, S, RI) i32 (row = RI * rq + ri).

    q: the decoder's quants, (R, 2, S, 16) 'halves' or (R, S, 32); x: (BM, S * 32) int8 activations. dot4
    leaves 4 lanes per block (8 for q8_0, whose two 128-bit halves are added first); the sums over them are
    exact, so their order is free: with RI = 4 they are unpack-and-add steps across 4 rows' registers (a 4x4
    transpose-and-add inside every 128-bit lane), in-lane shuffles that Zen 4 runs beside its multipliers,
    where cross-lane permutes compete with them; for the 4-bit types the first of those steps runs on the
    int16 pair sums, before widening (`jk.madd`), so one pmaddwd widens two rows.
    TT (R = RI = 1, BM a multiple of 4): (BM // 4, S, 4) with 4 tokens per block in the lanes instead (the
    reduction stays inside 128-bit lanes; summed per token it needed cross-lane permutes).
    ROUTE (4-bit halves with RI = 4, the GEMM): 0 the tier's default (dot4 on VNNI / SDOT tiers, madd
    elsewhere), 1 the madd route, 2 the dot4 route (`QMM_GEMM_DOT_ROUTE`; the same exact integer dots)."""
    RQ = R // RI
    # VNNI tiers: dot4 is one vpdpbusd per vector that also adds the two halves (exact i32, no int16 stage to
    # share), so the madd route below would only add instructions; the integer dots are the same exact values.
    # Likewise on arm64 with SDOT/USDOT (madd has no arm64 instruction: it took the generic widening path)
    vnni = jk.target.has("avx512vnni") or jk.target.has("avxvnni") or jk.target.has("dotprod")
    if len(q.shape) == 4 and q.dtype == jk.u8 and RI == 4 and (ROUTE == 1 or (ROUTE == 0 and not vnni)):
        # int16 pair sums of both halves added (4 products of 4-bit x int8 per lane), then lanes j and j + 4 of
        # 2 rows' registers interleaved by dwords and added (8 products, still inside int16: 15240 at most), so
        # one pmaddwd widens 2 rows (half the pmaddwd of dot4); the second level adds the rows' pairs of i32
        p16 = jk.sum(jk.madd(jk.broadcast_to(q[None, :, :, :, :], (BM, R, 2, S, 16)),
                             jk.broadcast_to(jk.reshape(x, (BM, 1, 2, S, 16)), (BM, R, 2, S, 16))), axis=2)
        # axes (t, rq, rr, r1, b, jh, dw, w): row 4 rq + 2 rr + r1, int16 lane 4 jh + 2 dw + w
        p8 = jk.reshape(p16, (BM, RQ, 2, 2, S, 2, 2, 2))
        s0 = jk.sum(jk.trans(p8, (0, 1, 2, 4, 5, 6, 3, 7)), axis=4)     # unpack lo/hi dwords: (t,rq,rr,b,dw,r1,w)
        s1 = jk.reshape(jk.madd(s0, jk.full((BM, RQ, 2, S, 2, 2, 2), 1, jk.i16)), (BM, RQ, 2, S, 2, 2))
        s2 = jk.sum(jk.trans(s1, (0, 1, 3, 4, 2, 5)), axis=3)          # unpack lo/hi qwords: (t, rq, b, rr, r1)
        return jk.reshape(s2, (BM, RQ, S, 4))
    if len(q.shape) == 4 and q.dtype == jk.u8:
        # both halves in one int16 sum (4 products of 4-bit x int8 per pair: inside dot4's axis contract)
        p = jk.dot4(jk.broadcast_to(q[None, :, :, :, :], (BM, R, 2, S, 16)),
                    jk.broadcast_to(jk.reshape(x, (BM, 1, 2, S, 16)), (BM, R, 2, S, 16)), axis=2)
    elif len(q.shape) == 4:
        # 8-bit weights: the halves' pair sums may fill int16 already, so they meet after widening (i32)
        p = jk.sum(jk.dot4(jk.broadcast_to(q[None, :, :, :, :], (BM, R, 2, S, 16)),
                           jk.broadcast_to(jk.reshape(x, (BM, 1, 2, S, 16)), (BM, R, 2, S, 16))), axis=2)
    else:
        p8 = jk.dot4(jk.broadcast_to(q[None, :, :, :], (BM, R, S, 32)),
                     jk.broadcast_to(jk.reshape(x, (BM, 1, S, 32)), (BM, R, S, 32)))
        p = jk.sum(jk.reshape(p8, (BM, R, S, 2, 4)), axis=3)
    if RI == 1 and TT:
        # one weight row (R = 1), BM = 4 TQ tokens: the same transpose-and-add across 4 tokens' registers,
        # axes (tq, tr, t1, b, jh, jl): token 4 tq + 2 tr + t1 -> (TQ, S, 4) with the tokens in the lanes
        p7 = jk.reshape(p, (BM // 4, 2, 2, S, 2, 2))
        s1 = jk.sum(jk.trans(p7, (0, 1, 3, 4, 5, 2)), axis=3)      # unpack lo/hi dwords: (tq, tr, b, jl, t1)
        s2 = jk.sum(jk.trans(s1, (0, 2, 3, 1, 4)), axis=2)         # unpack lo/hi qwords: (tq, b, tr, t1)
        return jk.reshape(s2, (BM // 4, S, 4))
    if RI == 1:
        return jk.reshape(jk.sum(p, axis=3), (BM, RQ, S, 1))
    # axes (t, rq, rr, r1, b, jh, jl): row 4 rq + 2 rr + r1, lane 2 jh + jl
    p7 = jk.reshape(p, (BM, RQ, 2, 2, S, 2, 2))
    s1 = jk.sum(jk.trans(p7, (0, 1, 2, 4, 5, 6, 3)), axis=4)       # unpack lo/hi dwords: (t, rq, rr, b, jl, r1)
    s2 = jk.sum(jk.trans(s1, (0, 1, 3, 4, 2, 5)), axis=3)          # unpack lo/hi qwords: (t, rq, b, rr, r1)
    return jk.reshape(s2, (BM, RQ, S, 4))


@jk.jit
def _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st, acc, DEC: jk.constexpr, RB: jk.constexpr,
              BM: jk.constexpr, R: jk.constexpr, S: jk.constexpr, RI: jk.constexpr, H: jk.constexpr = 0,
              HS: jk.constexpr = 0, FOLD: jk.constexpr = False, TT: jk.constexpr = False,
              ROUTE: jk.constexpr = 0):
    """acc (BM, R // RI, S, RI) f32 += the S blocks from block st * S: per (token, row, block) one FMA of the
    exact integer dot with the scale product, then one FMA of the block-sum term (q4_1's m, q4_0's -8 d).
    xd, xs: the activation block scales / sums, with RI = 4 repeated 4 times (Q8Activations.scales4): the lanes
    of a (token, 4 rows) register as they are, no shuffle per token.
    HS > 0: only the S blocks at H * S of a step of HS blocks in a 'halves'-grouped activation layout (a split
    step, the same operations per block as the whole one).
    FOLD: acc is (BM, R // RI, S // 2, RI): the first S // 2 blocks' two FMAs into it, then the last S // 2 blocks'
    (what two split half steps with HS = S do to one accumulator, from one decode of the whole step).
    TT (R = RI = 1): acc is (BM // 4, 1, S, 4), tokens in the lanes (`_block_dots`); the same FMAs per output."""
    RQ = R // RI
    if HS:
        q, sc, c, _ = DEC(w, wh, rows, st * (HS // S) + H, RB, R, S)
        x = jk.reshape(jk.load(xq + xrow[:, None, None] + st * (HS * 32) + H * (S * 16)
                               + jk.arange(0, 2)[None, :, None] * (HS * 16) + jk.arange(0, S * 16)[None, None, :]),
                       (BM, S * 32))
        b0 = st * HS + H * S
    else:
        q, sc, c, _ = DEC(w, wh, rows, st, RB, R, S)
        x = jk.load(xq + xrow[:, None] + st * (S * 32) + jk.arange(0, S * 32)[None, :])
        b0 = st * S
    if TT:
        pt = jk.reshape(_block_dots(q, x, BM, R, S, RI, True).to(jk.f32), (BM // 4, 1, S, 4))
        tshape = (BM // 4, 1, S, 4)
        tblk = srow[:, None] + b0 + jk.arange(0, S)[None, :]                                   # (BM, S)
        swt = jk.broadcast_to(jk.reshape(sc, (1, 1, S, 1)), tshape)
        dxt = jk.reshape(jk.trans(jk.reshape(jk.load(xd + tblk), (BM // 4, 4, S)), (0, 2, 1)), tshape)
        acc = jk.fma(pt, swt * dxt, acc)
        if c is not None:
            sxt = jk.reshape(jk.trans(jk.reshape(jk.load(xs + tblk), (BM // 4, 4, S)), (0, 2, 1)), tshape)
            acc = jk.fma(jk.broadcast_to(jk.reshape(c, (1, 1, S, 1)), tshape), sxt, acc)
        return acc
    pb = _block_dots(q, x, BM, R, S, RI, ROUTE=ROUTE).to(jk.f32)
    blk = srow[:, None] * RI + b0 * RI + jk.arange(0, S * RI)[None, :]                      # (BM, S * RI)
    shape = (BM, RQ, S, RI)
    sw = jk.trans(jk.reshape(sc, (RQ, RI, S)), (0, 2, 1))                                  # (RQ, S, RI)
    dx = jk.reshape(jk.load(xd + blk), (BM, 1, S, RI))
    if FOLD:
        scale = jk.broadcast_to(sw[None, :, :, :], shape) * jk.broadcast_to(dx, shape)
        if c is not None:
            cw = jk.broadcast_to(jk.trans(jk.reshape(c, (RQ, RI, S)), (0, 2, 1))[None, :, :, :], shape)
            sx = jk.broadcast_to(jk.reshape(jk.load(xs + blk), (BM, 1, S, RI)), shape)
        for h in jk.static_range(2):
            acc = jk.fma(_half_blocks(pb, h, BM, RQ, S, RI), _half_blocks(scale, h, BM, RQ, S, RI), acc)
            if c is not None:
                acc = jk.fma(_half_blocks(cw, h, BM, RQ, S, RI), _half_blocks(sx, h, BM, RQ, S, RI), acc)
        return acc
    return _scale_fmas(pb, sw, dx, c, xs, blk, acc, BM, RQ, S, RI)


@jk.jit
def _scale_fmas(pb, sw, dx, c, xs, blk, acc, BM: jk.constexpr, RQ: jk.constexpr, S: jk.constexpr,
                RI: jk.constexpr):
    """acc + the block dots pb times the weight x activation scales (sw, dx), + c x the activations' block sums
    (xs at blk) where the format has an offset: _qmm_step's plain (no FOLD) ending, shared with the token-group
    path."""
    shape = (BM, RQ, S, RI)
    acc = jk.fma(pb, jk.broadcast_to(sw[None, :, :, :], shape) * jk.broadcast_to(dx, shape), acc)
    if c is not None:
        cw = jk.trans(jk.reshape(c, (RQ, RI, S)), (0, 2, 1))
        acc = jk.fma(jk.broadcast_to(cw[None, :, :, :], shape),
                     jk.broadcast_to(jk.reshape(jk.load(xs + blk), (BM, 1, S, RI)), shape), acc)
    return acc


@jk.jit
def _qmm_group_fmas(q, sc, c, xq, xd, xs, toks, K: jk.constexpr, b0, acc, BM: jk.constexpr, R: jk.constexpr,
                    S: jk.constexpr, RI: jk.constexpr, ROUTE: jk.constexpr = 0):
    """_qmm_step's default path (no HS / FOLD / TT) for the BM tokens `toks` on weights decoded by the caller
    (q, sc, c of blocks b0 .. b0 + S): the same loads, integer dots and FMAs per output (TG: the kernel decodes
    a step's weights once and runs this per group of tokens)."""
    RQ = R // RI
    x = jk.load(xq + (toks * K)[:, None] + b0 * 32 + jk.arange(0, S * 32)[None, :])
    pb = _block_dots(q, x, BM, R, S, RI, ROUTE=ROUTE).to(jk.f32)
    blk = (toks * (K // 32))[:, None] * RI + b0 * RI + jk.arange(0, S * RI)[None, :]
    sw = jk.trans(jk.reshape(sc, (RQ, RI, S)), (0, 2, 1))
    dx = jk.reshape(jk.load(xd + blk), (BM, 1, S, RI))
    return _scale_fmas(pb, sw, dx, c, xs, blk, acc, BM, RQ, S, RI)


@jk.jit
def _half_blocks(v, h: jk.constexpr, BM: jk.constexpr, RQ: jk.constexpr, S: jk.constexpr, RI: jk.constexpr):
    """Blocks [h * S/2, (h + 1) * S/2) of a (BM, RQ, S, RI) f32 tile: the other half replaced by -0.0 and added
    (x + -0.0 == x exactly; the select and add fold to a shuffle)."""
    v5 = jk.reshape(v, (BM, RQ, 2, S // 2, RI))
    return jk.sum(jk.where(jk.arange(0, 2)[None, None, :, None, None] == h, v5, -0.0), axis=2)


@jk.jit
def _block_sum(v, BM: jk.constexpr, RQ: jk.constexpr, S: jk.constexpr, RI: jk.constexpr, LOGS: jk.constexpr):
    """(BM, RQ, S, RI) -> (BM, RQ, RI): the upper half of the block lanes added to the lower half, LOGS times
    (a fixed tree for every tile shape, as batch invariance needs)."""
    for i in jk.static_range(LOGS):
        v = jk.sum(jk.reshape(v, (BM, RQ, 2, S >> (i + 1), RI)), axis=2)
    return jk.reshape(v, (BM, RQ, RI))


@jk.kernel(do_not_specialize=('M0', 'M'))
def _qmm_kernel(w, wh, xq, xd, xs, y, M0, M, N, K: jk.constexpr, DEC: jk.constexpr, RB: jk.constexpr,
                BM: jk.constexpr, R: jk.constexpr, RI: jk.constexpr, RS: jk.constexpr, S: jk.constexpr,
                LOGS: jk.constexpr, PAIR_TAIL: jk.constexpr, ONE_TAIL: jk.constexpr, SPLIT: jk.constexpr = False,
                FOLD: jk.constexpr = False, TT: jk.constexpr = False, PF: jk.constexpr = 0,
                PFL: jk.constexpr = 2, ROWS_OUTER: jk.constexpr = False, ROUTE: jk.constexpr = 0,
                TG: jk.constexpr = 0):
    # y[m, n] for BM tokens x RS tiles of R weight rows, run one after the other (a GEMV program, BM = R = 1,
    # reads one monotonic weight stream); grid (N / (RS R), M / BM) over tokens M0 .. M0 + M, the last tile of
    # each axis shifted back to end at N (M0 + M). K is a compile-time constant: token rows are constant offsets from one pointer, the
    # K loop and its leftovers (a pair of blocks, then one block) are fixed. Every output gets the same
    # float operations whatever BM, R, RS (the integer dots are exact; lanes, FMAs and trees depend on S and
    # K only), so a row's result does not depend on the batch. PF > 0: each row tile first prefetches the
    # weight rows PF bytes ahead (locality PFL; `_gemv_prefetch`), a hint that changes no arithmetic.
    # ROWS_OUTER (`_rows_outer`): the flat program id f = p0 + g0 p1 runs row tile f // g1, token tile f % g1,
    # so the CPU pool's contiguous thread chunks split the weight rows (each tile's rows read by one thread, its
    # token tiles back to back from L1) instead of the tokens (every thread streaming every row). The same
    # programs run, in another order: the arithmetic of each output does not change.
    if ROWS_OUTER:
        f = jk.program_id(0) + jk.num_programs(0) * jk.program_id(1)
        prow = f // jk.num_programs(1)
        ptok = f - prow * jk.num_programs(1)
    else:
        prow = jk.program_id(0)
        ptok = jk.program_id(1)
    n0 = jk.minimum(prow * (RS * R), N - RS * R)
    m0 = M0 + jk.minimum(ptok * BM, M - BM)
    toks = (m0 + jk.arange(0, BM)).to(jk.i64)
    NB = K // 32
    RQ = R // RI
    xrow = toks * K
    srow = toks * NB
    for rt in range(0, RS):
        rows = (n0 + rt * R + jk.arange(0, R)).to(jk.i64)
        if PF > 0:
            jk.prefetch(w + rows[:, None] * RB + PF + jk.arange(0, RB)[None, :], locality=PFL)
        if TT:
            # one weight row, tokens in the lanes (`_token_lanes`): the same FMAs and tree per output as below
            TQ = BM // 4
            acc = jk.zeros((TQ, 1, S, 4), jk.f32)
            for st in range(0, NB // S):
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R, S, RI,
                                TT=True)
            rt4 = _block_sum(acc, TQ, 1, S, 4, LOGS)
            if PAIR_TAIL:
                acc2 = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, (NB // S * S) // 2,
                                 jk.zeros((TQ, 1, 2, 4), jk.f32), DEC, RB, BM, R, 2, RI, TT=True)
                rt4 += _block_sum(acc2, TQ, 1, 2, 4, 1)
            if ONE_TAIL:
                acc1 = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, NB - 1, jk.zeros((TQ, 1, 1, 4), jk.f32), DEC,
                                 RB, BM, R, 1, RI, TT=True)
                rt4 += jk.reshape(acc1, (TQ, 1, 4))
            jk.store(y + toks[:, None] * N + rows[None, :], jk.reshape(rt4, (BM, R)))
        elif SPLIT and FOLD:
            # FOLD (`_fold_lanes`): 2 accumulator lanes per output, not S; the halves of a step go into the same
            # lanes in turn (half the accumulator registers of the split step below: no spills on AVX2)
            acc = jk.zeros((BM, RQ, S // 2, RI), jk.f32)
            for st in range(0, NB // S):
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R, S // 2,
                                RI, 0, S, ROUTE=ROUTE)
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R,
                                S // 2, RI, 1, S, ROUTE=ROUTE)
            res = _block_sum(acc, BM, RQ, S // 2, RI, LOGS - 1)
        elif SPLIT:
            # each step as two halves with their own accumulators (fewer weight registers live at once); the
            # first level of the block tree adds them, as it adds the halves of one accumulator
            acc = jk.zeros((BM, RQ, S // 2, RI), jk.f32)
            acc_h = jk.zeros((BM, RQ, S // 2, RI), jk.f32)
            for st in range(0, NB // S):
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R, S // 2,
                                RI, 0, S, ROUTE=ROUTE)
                acc_h = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc_h, DEC, RB, BM, R,
                                  S // 2, RI, 1, S, ROUTE=ROUTE)
            res = _block_sum(acc + acc_h, BM, RQ, S // 2, RI, LOGS - 1)
        elif FOLD:
            # the same arithmetic as SPLIT and FOLD from whole steps (GEMV): each step's dots folded into 2 lanes
            acc = jk.zeros((BM, RQ, S // 2, RI), jk.f32)
            for st in range(0, NB // S):
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R, S, RI,
                                FOLD=True, ROUTE=ROUTE)
            res = _block_sum(acc, BM, RQ, S // 2, RI, LOGS - 1)
        elif TG:
            # the tile's tokens in groups of TG (`_token_group`): a step's weights decoded once, then each group's
            # dots, lane sums and FMAs in turn, so only one group's (TG, R) integer dots are live at a time (the
            # whole tile's were, and spilled); per output the same operations as the path below
            accs = ()
            for g in jk.static_range(BM // TG):
                accs = accs + (jk.zeros((TG, RQ, S, RI), jk.f32),)
            for st in range(0, NB // S):
                q, sc, c, _ = DEC(w, wh, rows, st.to(jk.i64), RB, R, S)
                nxt = ()
                for g in jk.static_range(BM // TG):
                    tg = (m0 + g * TG + jk.arange(0, TG)).to(jk.i64)
                    nxt = nxt + (_qmm_group_fmas(q, sc, c, xq, xd, xs, tg, K, st.to(jk.i64) * S, accs[g], TG, R,
                                                 S, RI, ROUTE),)
                accs = nxt
            for g in jk.static_range(BM // TG):
                tg = (m0 + g * TG + jk.arange(0, TG)).to(jk.i64)
                rg = _block_sum(accs[g], TG, RQ, S, RI, LOGS)
                if PAIR_TAIL:
                    acc2 = _qmm_step(w, wh, xq, xd, xs, rows, tg * K, tg * NB, (NB // S * S) // 2,
                                     jk.zeros((TG, RQ, 2, RI), jk.f32), DEC, RB, TG, R, 2, RI, ROUTE=ROUTE)
                    rg += _block_sum(acc2, TG, RQ, 2, RI, 1)
                if ONE_TAIL:
                    acc1 = _qmm_step(w, wh, xq, xd, xs, rows, tg * K, tg * NB, NB - 1,
                                     jk.zeros((TG, RQ, 1, RI), jk.f32), DEC, RB, TG, R, 1, RI, ROUTE=ROUTE)
                    rg += jk.reshape(acc1, (TG, RQ, RI))
                jk.store(y + tg[:, None] * N + rows[None, :], jk.reshape(rg, (TG, R)))
        else:
            acc = jk.zeros((BM, RQ, S, RI), jk.f32)
            for st in range(0, NB // S):
                acc = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, st.to(jk.i64), acc, DEC, RB, BM, R, S, RI,
                                ROUTE=ROUTE)
            res = _block_sum(acc, BM, RQ, S, RI, LOGS)
        if not TT and not TG:
            if PAIR_TAIL:
                acc2 = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, (NB // S * S) // 2,
                                 jk.zeros((BM, RQ, 2, RI), jk.f32), DEC, RB, BM, R, 2, RI, ROUTE=ROUTE)
                res += _block_sum(acc2, BM, RQ, 2, RI, 1)
            if ONE_TAIL:
                acc1 = _qmm_step(w, wh, xq, xd, xs, rows, xrow, srow, NB - 1, jk.zeros((BM, RQ, 1, RI), jk.f32),
                                 DEC, RB, BM, R, 1, RI, ROUTE=ROUTE)
                res += jk.reshape(acc1, (BM, RQ, RI))
            jk.store(y + toks[:, None] * N + rows[None, :], jk.reshape(res, (BM, R)))


_QMM_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4")


def _qmm_kernel_for(q: QType) -> bool:
    return q.name in _QMM_TYPES


def _split_steps(q: QType, M: int, S: int, target) -> bool:
    """GEMM programs on 256-bit tiers run each 4-block q4 step as two 2-block halves: the 4 rows' weights of a
    whole step fill the 16 registers, the halves' do not (+6-14% on AVX2; slower with 32 registers)."""
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    return M > 1 and S == 4 and q.name in ("q4_0", "q4_1") and target.vector_bits == 256


def _fold_lanes(q: QType, S: int, target) -> bool:
    """q4_0 / q4_1 on 256-bit tiers: 2 float accumulator lanes per output instead of one per block of the 4-block
    step (blocks 4s, 4s+1 then 4s+2, 4s+3 into lanes 0, 1), for every M (the GEMM's split halves and the GEMV's
    whole steps do the same FMAs). The 8 x 4 GEMM tile's accumulators then take 8 of the 16 ymm registers, not
    16 (the split step spilled ~150 values per step)."""
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    return S == 4 and q.name in ("q4_0", "q4_1") and target.is_cpu and target.vector_bits == 256


def _token_lanes(q: QType, R: int, BM: int, target) -> bool:
    """GEMM tiles of one weight row (q8_0 on 256-bit tiers: the 49152 x 576 head) with BM a multiple of 4 put 4
    tokens' block dots in the lanes of a register (`_block_dots` TT): the lanes' sums stay in-lane instead of
    the cross-lane permutes that summing each token's lanes took (the head's step loop was bound by them on the
    one port that runs them; SmolLM2's head at M = 16 on znver3, 1 thread: 16.0 -> 13.4 ms, the same bits). The
    float work per output is the same as the GEMV's (q8_0 only: the q4 types' FOLD lanes have no TT form)."""
    return q.name == "q8_0" and R == 1 and BM % 4 == 0 and _TOKEN_LANES and (target is None or target.is_cpu)


_TOKEN_LANES = True


def _gemm_route(RI: int, target) -> dict:
    """{'ROUTE': 1 | 2} for `_qmm_kernel` when QMM_GEMM_DOT_ROUTE forces the integer-dot route of the 4-bit GEMM
    (RI = 4 tiles, `_block_dots`) on a CPU tier, else {} (the tier's default; the kernel's specialisation and
    cache entries stay as they were)."""
    if QMM_GEMM_DOT_ROUTE is None or RI != 4 or (target is not None and not target.is_cpu):
        return {}
    if QMM_GEMM_DOT_ROUTE not in ("madd", "dot4"):
        raise ValueError(f"quant.QMM_GEMM_DOT_ROUTE must be None, 'madd' or 'dot4', got {QMM_GEMM_DOT_ROUTE!r}")
    return {"ROUTE": 1 if QMM_GEMM_DOT_ROUTE == "madd" else 2}


# The integer-dot route of the q4_0 / q4_1 (4-bit halves) GEMM, M > 1 (benchmarks: perf/ab_tiers_cpu.py
# --routes): None = the tier's default, vpdpbusd (dot4) on the VNNI tiers, pmaddubsw + pmaddwd with the rows'
# int16 pair sums added before widening (madd: one pmaddwd widens 2 rows) elsewhere; "madd" / "dot4" force one
# route on every CPU tier (madd has no arm64 instruction: it takes the generic widening path there). The dots
# are exact either way, so the outputs are the same bits (tests/test_vnni.py).
QMM_GEMM_DOT_ROUTE = None


def _token_group(q: QType, bm: int, R: int, target) -> dict:
    """{'TG': tokens per group} for `_qmm_kernel` GEMM tiles on 512-bit VNNI tiers (QMM_TOKEN_GROUP; the tile's
    weights decoded once per step, its tokens' dots and FMAs a group at a time), else {} (the kernel's
    specialisations and cache entries as before)."""
    tg = QMM_TOKEN_GROUP
    if not tg or bm <= tg or bm % tg or R % 4 or q.name not in ("q4_0", "q4_1"):
        return {}
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    if not (target.is_cpu and target.vector_bits >= 512 and target.has("avx512vnni")):
        return {}
    return {"TG": tg}


QMM_TOKEN_GROUP = 4


def _rows_outer(mn: int, bm: int, K: int, target) -> bool:
    """CPU launches of more than one token tile whose quantised activations (K int8 + the 4x repeated scales and
    sums, ~2K bytes a token) fit in L1 with room to spare order their programs rows-major (`_qmm_kernel`
    ROWS_OUTER): each pool thread takes a range of weight rows for every token, and a row tile's weights are
    read once from memory and then from L1 for the next token tile (token-major, a 1 MB weight was streamed
    once per token tile: SmolLM2's gate/up at M = 16, 1 thread, 18.8 -> 15.2 ms a step; with K = 1536 the 16
    tokens' activations do not fit in L1 and rows-major was slower, 10.5 -> 11.8 ms). Only the order in which
    the same programs run changes, never an output's arithmetic."""
    return QMM_ROWS_OUTER and mn > bm and mn * K * 2 <= QMM_ROWS_OUTER_L1_BYTES and (target is None or target.is_cpu)


QMM_ROWS_OUTER_L1_BYTES = 24 * 1024


# set False to run token-major program order (benchmarks: perf/ab_engine_cpu.py variants)
QMM_ROWS_OUTER = True


def _qmm_decoder(q: QType, target, split: bool = False):
    if split:
        return {"q4_0": _dec_q4_0_split, "q4_1": _dec_q4_1_split}.get(q.name) or (
            _dec_q8_0_halves_split if _q8_halves(target) else None) or _no_split_decoder(q, target)
    return _dec_q8_0_halves if q.name == "q8_0" and _q8_halves(target) else _DECODERS[q.name]


def _no_split_decoder(q: QType, target):
    raise ValueError(f"matmul_q8: no split-layout decoder for {q.name} on {getattr(target, 'name', 'this CPU')} (the split layout is for "
                     f"tiers of 256-bit vectors and wider)")


def qmm_step(qtype, target=None) -> int:
    """Blocks per K step of the 32-element-format kernel on this tier (fixed per tier and type, never per M:
    the lanes and order of every output's float sums follow from it)."""
    q = _qtype(qtype)
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    vbytes = max(16, target.vector_bits // 8)
    if q.name in ("q4_0", "q4_1"):
        # the same half of 4 blocks in one 512-bit vector (two 256-bit ones on AVX2: fewer instructions per
        # byte for the bandwidth-bound GEMV than one); two blocks on 128-bit tiers
        return 4 if vbytes >= 32 else 2
    return max(1, vbytes // 16)               # q8_0: two vectors' worth of 32-byte blocks


def qmm_tiles(qtype, M: int, N: int, K: int, target=None) -> tuple:
    """(BM, R, RS, S) of the 32-element-format kernel: tokens x weight rows per tile, row tiles per program,
    blocks per step (S shrinks for K below one step; it depends on K and the tier only)."""
    q = _qtype(qtype)
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    S = qmm_step(q, target)
    vbytes = max(16, target.vector_bits // 8)
    while S > 1 and S > K // 32:
        S //= 2
    if target.costly_workgroups and N >= 16:
        # lavapipe runs a workgroup as one coroutine per 8 invocations: per-program overhead dominates, so
        # 16 rows per program (GEMV 9x, 12-token GEMM 2.8x faster there than the tiles below; 4 x 32 would
        # exceed its 32 KiB of workgroup memory). The outputs do not depend on the tile (batch invariant).
        return min(4, M), 16, 1, S
    if M == 1:
        R = gemv_rows(q, N, K, target)
        return 1, R, max(1, min(8 // R, N // R)), S
    BM = 16 if vbytes >= 64 else 8 if vbytes >= 32 else 4
    if vbytes >= 64 and target.has("avx512vnni"):
        # VNNI's dot4 keeps one i32 vector per (token, row) live until the 4-row transpose-and-add, and LLVM
        # schedules every token's vpdpbusd before the adds: 16 x 4 tiles spilled ~4x more than 8 x 4 (stack
        # accesses in the kernel 300 vs 86). znver5, avx512-vnni, M = 16, 1 thread (perf/ab_quant_cpu.py
        # ... 16 "" "tile=8x4"): q4_1 3072 x 576 0.25-0.34 -> 0.18-0.21 ms, 576 x 1536 0.13 -> 0.09 ms, the
        # q8_0 49152 x 576 head 3.9-4.6 -> 3.5 ms; the madd tiers (avx512) lose nothing at 16
        BM = 8

    # q8_0 on 256-bit tiers: one weight row per tile. With 4 rows the tile's 32-byte blocks and the token
    # accumulators overflow the 16 ymm registers (SmolLM2's 49152 x 576 head, 1 thread: M = 2 / 4 / 64 took
    # 14.7 / 17.8 / 204 ms with R = 4, 5.3 / 9.8 / 175 ms with R = 1; GEMV 3.9 ms). Small-M GEMMs are what
    # speculative decoding's verification steps run on the head.
    R = 1 if N < 4 or (q.name == "q8_0" and vbytes == 32) else 4
    if QMM_TILE_OVERRIDE is not None:
        BM, R = QMM_TILE_OVERRIDE
    return min(BM, M), R, 1, S


def gemv_rows(qtype, N: int, K: int, target) -> int:
    """Weight rows a CPU GEMV (M = 1) tile of the 32-element formats takes in lockstep: 4 (the GEMM's tile, its
    4-row transpose-and-add, which sums 4 rows' integer dots for the price of one row's) where the tuning table's
    `cpu_gemv_rows` says 4 and a row is at most `cpu_gemv_rows_max_bytes` long, else 1 (one row at a time: one
    monotonic weight stream per thread; 4 long rows in lockstep are 4 streams, which the prefetchers follow
    worse). The outputs are the same bits either way (every output gets the same float operations whatever R)."""
    q = _qtype(qtype)
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    tn = target.tuning
    if (not target.is_cpu or N < 4 or tn.cpu_gemv_rows < 4 or row_bytes(q, K) > tn.cpu_gemv_rows_max_bytes
            or (q.name == "q8_0" and target.vector_bits == 256)):
        return 1
    return 4


def q8_rep4(qtype, M: int, N: int, K: int, target, device: bool = False) -> bool:
    """Whether the int8 activations of an M-row input to this weight need quantize_q8's 4x repeated scales and
    sums (rep4): the 4-row tiles read them (every M > 1 tile, and the GEMV where `gemv_rows` is 4); device
    arrays always carry them."""
    q = _qtype(qtype)
    if not _qmm_kernel_for(q) or _gpu_qmv(q, target):
        return False
    return M > 1 or device or gemv_rows(q, N, K, target) >= 4


def _gemv_prefetch(M: int, rb: int, target) -> dict:
    """The CPU GEMV's (M = 1) software prefetch: every row prefetches the row GEMV_PREFETCH_ROWS rows ahead (its
    thread's stream). The hardware prefetchers alone left the core waiting on DRAM: on znver3, 1 thread, a q4_1
    196608 x 576 GEMV from DRAM ran at ~7.5 GB/s (and no faster with a tile that is 1.3x faster in cache) while
    a plain read stream reaches ~14 GB/s; 16 rows ahead into L2 made it 1.2-1.4x faster, the q8_0 49152 x 576
    head 1.25-1.5x (perf/ab_quant_cpu.py QTYPE N K 1 "pf=0" ""), SmolLM2 decode at c=1 1.19x / 1.24x
    (median / best tok/s per CPU-second, perf/ab_gemv_prefetch_cpu.py). No effect on the results: the same
    operations run (tests/ops/test_quant.py)."""
    if M != 1 or not GEMV_PREFETCH_ROWS:
        return {}
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    if not target.is_cpu:
        return {}
    return {"PF": GEMV_PREFETCH_ROWS * rb, "PFL": GEMV_PREFETCH_LOCALITY}


# rows ahead the CPU GEMV prefetches (0: none) and the prefetch locality (LLVM's: 2 = into L2 and out)
GEMV_PREFETCH_ROWS = 16
GEMV_PREFETCH_LOCALITY = 2

# (BM, R) for every M > 1 launch instead of the defaults above: for benchmarks that compare tile shapes (BM a
# power of two, R 1 or a multiple of 4); the outputs do not change with it
QMM_TILE_OVERRIDE = None


def _token_launches(M: int, BM: int) -> list:
    """[(first token, tokens, tile)] covering M tokens with power-of-two tiles of at most BM (other sizes make
    LLVM scalarise the kernel's shuffles): whole tiles of BM, then the rest in one tile of the next power of
    two ending at M (overlapping tokens already done, recomputed identically), or, while fewer than BM tokens
    are left from the start, halving tiles. M = 37, BM = 16: 32 + 8 (ending at 37) = 40 token rows of work
    instead of 48 for three tiles of 16."""
    out = []
    start = 0
    while start < M:
        left = M - start
        if left >= BM:
            n = left // BM * BM
            out.append((start, n, BM))
            start += n
            continue
        p = 1
        while p < left:
            p *= 2
        if p <= M:                   # one tile of p ending at M
            out.append((M - p, p, p))
            break
        p //= 2                      # M < p: a tile of p // 2 from here, then the rest
        out.append((start, p, p))
        start += p
    return out


_DECODERS = {"q8_0": _dec_q8_0, "q4_0": _dec_q4_0, "q4_1": _dec_q4_1, "q4_K": _dec_q4_K, "q5_K": _dec_q5_K,
             "q6_K": _dec_q6_K, "q5_0": _dec_q5_0, "q5_1": _dec_q5_1, "iq4_nl": _dec_iq4_nl, "q2_K": _dec_q2_K,
             "q3_K": _dec_q3_K, "iq4_xs": _dec_iq4_xs, "mxfp4": _dec_mxfp4}


def _pow2_le(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


# bytes of a block's scale(s) at its start; the rest are its quants
_SPLIT_SCALE_BYTES = {"q4_0": 2, "q4_1": 4, "q8_0": 2}


class SplitBlocks(np.ndarray):
    """A q4_0 / q4_1 / q8_0 weight's bytes in the 'split' layout (see `_dec_q4_1_split`): all rows' quants, then all
    blocks' scales; `quant_bytes` is the size of the first plane. The same nbytes as the GGUF blocks."""
    quant_bytes: int = 0

    def __array_finalize__(self, obj):
        self.quant_bytes = getattr(obj, "quant_bytes", 0)

    def __reduce__(self):
        # the planes' boundary travels with the bytes (ndarray's own pickling would drop it)
        fn, args, state = super().__reduce__()
        return fn, args, (state, self.quant_bytes)

    def __setstate__(self, state):
        nd_state, self.quant_bytes = state
        super().__setstate__(nd_state)


def split_blocks(raw: np.ndarray, qtype: str, N: int, K: int) -> SplitBlocks:
    """The GGUF blocks of an (N, K) q4_0 / q4_1 / q8_0 weight regrouped into the split layout (one copy)."""
    q = _qtype(qtype)
    if q.name not in _SPLIT_SCALE_BYTES:
        raise ValueError(f"split_blocks: {q.name} has no split layout (only {', '.join(_SPLIT_SCALE_BYTES)})")
    w, _ = _weight_arg(raw, q, N, K, "split_blocks")
    sb = _SPLIT_SCALE_BYTES[q.name]
    blocks = w.reshape(N, K // 32, q.block_bytes)
    out = np.empty(w.nbytes, np.uint8).view(SplitBlocks)
    qb = N * (K // 32) * (q.block_bytes - sb)
    out[:qb].reshape(N, K // 32, q.block_bytes - sb)[...] = blocks[:, :, sb:]
    out[qb:].reshape(N, K // 32, sb)[...] = blocks[:, :, :sb]
    out.quant_bytes = qb
    return out


def split_layout_for(qtype, target) -> bool:
    """Whether `Linear` weights of this type take the split layout on `target` (CPU tiers, tuning
    `cpu_split_blocks`): the kernels then load a step's quants and scales contiguously."""
    q = _qtype(qtype)
    return bool(target is not None and target.is_cpu and target.tuning.cpu_split_blocks
                and q.name in _SPLIT_SCALE_BYTES and (q.name != "q8_0" or _q8_halves(target)))


def _weight_arg(raw, q: QType, N: int, K: int, what: str):
    if not is_array(raw):
        raise TypeError(f"{what}: the weight must be a numpy uint8 array of raw GGUF bytes, got {type(raw).__name__}")
    if raw.dtype != np.uint8:
        raise TypeError(f"{what}: the weight must hold raw GGUF bytes as uint8, got dtype {raw.dtype}")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{what}: the weight bytes must be contiguous")
    need = N * row_bytes(q, K)
    if raw.nbytes != need:
        raise ValueError(f"{what}: a {q.name} weight of N={N} rows x K={K} has {need} bytes, got {raw.nbytes}")
    if isinstance(raw, SplitBlocks):
        if q.name not in _SPLIT_SCALE_BYTES or raw.quant_bytes != N * (K // 32) * (q.block_bytes -
                                                                                   _SPLIT_SCALE_BYTES[q.name]):
            raise ValueError(f"{what}: a split-layout weight that is not a {q.name} weight of N={N} x K={K}")
        planes = np.asarray(raw).reshape(-1)
        return planes[:raw.quant_bytes], planes[raw.quant_bytes:].view(np.float16)
    return raw, jk.as_pointer(raw, "f16")


def matmul_q(x: np.ndarray, weight_raw: np.ndarray, qtype: str, N: int, K: int, out=None, target=None):
    """y = x @ dequantize(W)^T for x float32 (M, K) or (K,) and W a GGUF-quantised (N, K) weight given as its
    raw uint8 bytes. Returns y float32 (M, N) or (N,) (written into `out` when given).

    The activations are quantised on the way (`quantize_q8`); to share one quantisation between several
    weights with the same input (q/k/v, gate/up), call `quantize_q8` once and `matmul_q8` per weight."""
    q = _qtype(qtype)
    target = resolve_target(target, x, weight_raw)
    if not is_device(x):
        x = np.asarray(x)
    if x.ndim not in (1, 2) or x.shape[-1] != int(K):
        raise ValueError(f"matmul_q: x must be (K,) or (M, K) with K={K}, got shape {x.shape}")
    if x.size == 0:
        sc = np.zeros(x.shape[:-1] + (int(K) // 32,), np.float32)
        xq = Q8Activations(np.zeros(x.shape, np.int8), sc, sc, act_layout(q, 0, target))
        return matmul_q8(xq, weight_raw, q, N, K, out=out, target=target)
    M = 1 if x.ndim == 1 else x.shape[0]
    rep4 = q8_rep4(q, M, int(N), int(K), target, is_device(x))
    out8 = out4 = None
    if is_device(x):
        # device arrays: reused scratch (no allocation per call, stable addresses for CUDA graphs), and always
        # the repeated scales (the host np.repeat fallback cannot run on device arrays)
        lead, nb = x.shape[:-1], int(K) // 32
        out8 = (device_scratch(x, "q8.qx", x.shape, np.int8), device_scratch(x, "q8.d", lead + (nb,), np.float32),
                device_scratch(x, "q8.s", lead + (nb,), np.float32))
        if rep4:
            out4 = (device_scratch(x, "q8.d4", lead + (4 * nb,), np.float32),
                    device_scratch(x, "q8.s4", lead + (4 * nb,), np.float32))
    xq = quantize_q8(x, out=out8, target=target, layout=act_layout(q, M, target), rep4=rep4, out4=out4)
    return matmul_q8(xq, weight_raw, q, N, K, out=out, target=target)


def matmul_q8(xq: tuple, weight_raw: np.ndarray, qtype: str, N: int, K: int, out=None, target=None):
    """matmul_q on activations already quantised by `quantize_q8(x, layout=act_layout(qtype))`:
    xq = (qx, scales, sums) (a plain tuple counts as the 'natural' layout)."""
    out, _ = _matmul_q8(xq, weight_raw, qtype, N, K, out, target)
    return out


def _matmul_q8(xq, weight_raw, qtype, N, K, out, target):
    """(out, the CompiledKernel that ran or None)."""
    q = _qtype(qtype)
    N, K = int(N), int(K)
    target = resolve_target(target, weight_raw)
    w, wh = _weight_arg(weight_raw, q, N, K, f"matmul_q({q.name})")
    layout = getattr(xq, "layout", "natural")
    qx, xd, xs = xq
    if qx.ndim not in (1, 2) or qx.shape[-1] != K or qx.dtype != np.int8:
        raise ValueError(f"matmul_q: x must be (K,) or (M, K) with K={K}, got shape {qx.shape}")
    M = 1 if qx.ndim == 1 else qx.shape[0]
    if xd.shape != qx.shape[:-1] + (K // 32,) or xs.shape != xd.shape:
        raise ValueError(f"matmul_q8: scales/sums must have shape {qx.shape[:-1] + (K // 32,)}, got {xd.shape} "
                         f"and {xs.shape}")
    oshape = (N,) if qx.ndim == 1 else (M, N)
    if out is None:
        out = empty_like_dev(qx, oshape, np.float32)
    elif out.shape != oshape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmul_q: out must be a contiguous float32 array of shape {oshape}, got {out.dtype} "
                         f"{out.shape}")
    need = act_layout(q, M, target)
    if _eff_group(layout, K // 32) != _eff_group(need, K // 32):
        raise ValueError(f"matmul_q8: {q.name} needs activations in the {need!r} layout here, got {layout!r} "
                         f"(quantize_q8(x, layout=act_layout({q.name!r}, M, target)))")
    if M == 0 or N == 0:
        return out, None
    T = resolve_target(target)
    if _gpu_qmv(q, T):
        return out, _matmul_qmv(q, w, qx, xd, xs, out, M, N, K, T)
    if _qmm_kernel_for(q):
        split = isinstance(weight_raw, SplitBlocks)
        if split and T is not None and not T.is_cpu:
            raise ValueError(f"matmul_q8: a split-layout {q.name} weight runs on the CPU tiers only, not {T.name}")
        rb = K // 32 * (q.block_bytes - _SPLIT_SCALE_BYTES[q.name]) if split else row_bytes(q, K)
        BM, R, RS, S = qmm_tiles(q, M, N, K, T)
        nb = K // 32
        rest = nb - nb // S * S
        RI = min(R, 4)
        if RI == 4:
            xd4, xs4 = getattr(xq, "scales4", None), getattr(xq, "sums4", None)
            if xd4 is None or xs4 is None:
                if is_device(xd):
                    raise ValueError("matmul_q8: device activations need quantize_q8(..., rep4=True) here")
                xd4, xs4 = np.repeat(xd, 4, axis=-1), np.repeat(xs, 4, axis=-1)
            xd, xs = xd4, xs4
        for m0, mn, bm in _token_launches(M, BM):
            ck = run(_qmm_kernel, (-(-N // (RS * R)), -(-mn // bm)), (w, wh, qx, xd, xs, out, m0, mn, N), target,
                     K=K, DEC=_qmm_decoder(q, T, split), RB=rb, BM=bm, R=R, RI=RI, RS=RS, S=S,
                     LOGS=S.bit_length() - 1, PAIR_TAIL=rest >= 2, ONE_TAIL=rest % 2 == 1,
                     SPLIT=_split_steps(q, M, S, T), FOLD=_fold_lanes(q, S, T), TT=_token_lanes(q, R, bm, T),
                     ROWS_OUTER=_rows_outer(mn, bm, K, T), **_gemv_prefetch(M, rb, T),
                     **_gemm_route(RI, T), **_token_group(q, bm, R, T))
        return out, ck
    BM, R, RS = _kq_tiles(M, N)
    ck = run(_kq_kernel, (-(-N // (RS * R)), -(-M // BM)),
             (w, wh, qx, xd, xs, out, M, N, K, K // 256, row_bytes(q, K), RS), target, DEC=_DECODERS[q.name],
             BM=BM, R=R)
    return out, ck


# ------------------------------------------------------- GPU: warps over rows, lanes over blocks, dp4a dots
# The CPU-shaped kernels run one program per 8 rows at M = 1 with serial K loops over tiles of a block or two, and
# their dot4 goes through shared memory on a GPU. This kernel is shaped for the GPU: a CTA of `warps` warps owns R
# weight rows and deals them (R, L) positions x 4 words, one position a thread: lane l of a row takes the row's
# 32-element blocks l, l + L, ... (for the 256-element super-block types: sub-blocks, so consecutive lanes read
# consecutive sub-blocks of a super-block and consecutive super-blocks: coalesced), each block's quants as
# 32-bit words of packed bytes against the int8 activations' words (quantize_q8's 'natural' layout: 16-byte
# vector loads) in jk.dp4a (PTX dp4a: exact i32), word j of a lane with the block's words j and j + 4 (elements
# 4j..4j+3 and 16+4j..16+4j+3). A decoder per type (_qmv_decode) turns a block into those words (unsigned
# bytes, or signed where the format's zero point is not a per-32 constant: q6_K's -32, q3_K's -4, the iq4 / mxfp4
# grids), its scales and offsets:
#   one scale per 32 elements (q8_0, q4_*, q5_*, q4_K / q5_K's d * sc, iq4_*, mxfp4): dot = dp4a(a) + dp4a(b);
#   one integer scale per 16 elements (q6_K, q3_K, q2_K): dot = sa * dp4a(a) + sb * dp4a(b), exact in i32
#     (|dot| < 2^23, so its f32 conversion is exact too), the super-block's d the float scale;
#   an offset per 32 elements (q4_0's -8 d, q5_0's -16 d, q4_1 / q5_1's m, q4_K / q5_K's -dmin * m) as c times
#     the activation block sum s (quantize_q8's d_x * sum(q)), on word 0;
#   q2_K's mins per 16 elements against the activations' 16-element integer sums (dp4a with ones), scaled by
#     -dmin * d_x.
# Per (token, row) the float work is fixed by K and the type alone: per block and word one FMA of the exact integer
# dot with d_w * d_x into the lane's word accumulator, one FMA of c * s (word 0; an exact zero elsewhere) or of
# q2_K's min term, then the 4 words of each lane summed, then the L lanes in order (the GPU lowering's reductions
# fold in an order fixed by the reduced length). Neither the batch, the token tile BM, R nor the grid changes a
# row's operations: batch invariant.
@jk.jit
def _u32_at(w8, w16, w32, off, A: jk.constexpr):
    """The little-endian 32-bit words at byte offsets `off` (multiples of A: 4, 2 or 1) as u32, by loads of A
    bytes (a format's fields are only as aligned as its block size: q6_K's 210 B and q3_K's 110 B are 2-byte
    aligned, mxfp4's 17 B not at all)."""
    if A == 4:
        return jk.load(w32 + (off >> 2))
    if A == 2:
        h = off >> 1
        return jk.load(w16 + h).to(jk.u32) | (jk.load(w16 + h + 1).to(jk.u32) << 16)
    return (jk.load(w8 + off).to(jk.u32) | (jk.load(w8 + off + 1).to(jk.u32) << 8)
            | (jk.load(w8 + off + 2).to(jk.u32) << 16) | (jk.load(w8 + off + 3).to(jk.u32) << 24))


@jk.jit
def _bits_to_bytes(m, sh):
    """Bits sh..sh+3 of the u32 masks m, bit k moved to bit 4 of byte k (q5_0 / q5_1's fifth bits): the multiply
    places bit k at bit 8k (the four shifted copies of a 4-bit value cannot carry into each other)."""
    return ((((m >> sh) & 15) * 0x204081) & 0x01010101) << 4


@jk.jit
def _signed_bytes(v, bias: jk.constexpr):
    """v - bias per byte as i32 words of signed bytes, for u32 words of bytes in [0, 127 + bias]: byte + (128 -
    bias) stays below 256 (no carry into the next byte), and flipping bit 7 takes the 128 back off in two's
    complement."""
    return ((v + (128 - bias) * 0x01010101) ^ 0x80808080).to(jk.i32, bitcast=True)


@jk.jit
def _lut16(v, MX: jk.constexpr):
    """table[n] of the u32 words v of nibble bytes n (0..15) as i32 words of signed bytes: kvalues_iq4nl, or with MX
    kvalues_mxfp4 (the doubled e2m1 grid), each packed little-endian in four u32 constants (entries 4i..4i+3 in
    the i-th): per byte two selects on bits 3 and 2 of n and a shift by its bits 0-1 (no table in memory)."""
    if MX:              # 0 1 2 3 | 4 6 8 12 | 0 -1 -2 -3 | -4 -6 -8 -12
        t0, t1 = jk.full((1, 1, 1), 0x03020100, jk.u32), jk.full((1, 1, 1), 0x0C080604, jk.u32)
        t2, t3 = jk.full((1, 1, 1), 0xFDFEFF00, jk.u32), jk.full((1, 1, 1), 0xF4F8FAFC, jk.u32)
    else:               # -127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113
        t0, t1 = jk.full((1, 1, 1), 0xBFAD9881, jk.u32), jk.full((1, 1, 1), 0xF6EADDCF, jk.u32)
        t2, t3 = jk.full((1, 1, 1), 0x26190D01, jk.u32), jk.full((1, 1, 1), 0x71594535, jk.u32)
    out = v & 0
    for k in jk.static_range(4):
        n = (v >> (8 * k)) & 15
        t = jk.where((n & 8) != 0, jk.where((n & 4) != 0, t3, t2), jk.where((n & 4) != 0, t1, t0))
        out = out | (((t >> ((n & 3) * 8)) & 255) << (8 * k))
    return out.to(jk.i32, bitcast=True)


@jk.jit
def _kq_scale_min(w8, base, s):
    """q4_K / q5_K's 6-bit scale and min of sub-blocks s (ggml's get_scale_min_k4) from the 12 bytes at base + 4,
    as i32."""
    a = jk.load(w8 + base + 4 + s).to(jk.i32)          # scales[s]
    b = jk.load(w8 + base + 8 + s).to(jk.i32)          # scales[s + 4]
    c = jk.load(w8 + base + s).to(jk.i32)              # scales[s - 4] (for s >= 4)
    low = s < 4
    return (jk.where(low, a & 63, (b & 15) | ((c >> 6) << 4)),
            jk.where(low, b & 63, (b >> 4) | ((a >> 6) << 4)))


@jk.jit
def _q3_scale(w8, base, k):
    """q3_K's scale k (0..15, bias 32 removed) of the 12 bytes at base + 96, as i32: low 4 bits
    (b[k % 8] >> 4 (k // 8)) & 15, high 2 bits (b[8 + k % 4] >> 2 (k // 4)) & 3."""
    lo = (jk.load(w8 + base + 96 + (k & 7)).to(jk.i32) >> ((k >> 3) * 4)) & 15
    hi = (jk.load(w8 + base + 104 + (k & 3)).to(jk.i32) >> ((k >> 2) * 2)) & 3
    return (lo | (hi << 4)) - 32


@jk.jit
def _qmv_decode(w8, w16, w32, wh, rows, b, ok, RB: jk.constexpr, QT: jk.constexpr):
    """Block b (R, L, 4) (in range; `ok` false where a lane is past the row: its scales and offsets are then exact
    zeros) of rows `rows` (i64), for word j = arange(4) of a lane: (wa, wb, sa, sb, dw, c, ma, mb, dm) with
    wa / wb the u32 (unsigned bytes) or i32 (signed bytes) words that meet activation words j and j + 4;
    sa / sb the i32 integer scales of the two 16-element halves, or None; dw the f32 weight scale; c the f32
    coefficient of the activation block sum (on word 0, zero elsewhere), or None; ma / mb / dm q2_K's integer
    mins of the halves and its f32 -dmin, else None. QT: _QMV_TYPES. Layouts: the comment at the top."""
    j = jk.arange(0, 4)[None, None, :]
    first = (j == 0) & ok
    sa = None
    sb = None
    c = None
    ma = None
    mb = None
    dm = None
    if QT <= 2 or QT == 6 or QT == 7 or QT == 8 or QT == 12:
        # 32-element blocks: block b at byte b * BB of its row; byte i of the 16 nibble bytes holds element i in
        # its low nibble and element 16 + i in its high nibble, so word j's low nibbles meet activation word j,
        # its high nibbles word j + 4
        if QT == 0:         # q8_0 (34 B: f16 d, 32 x i8)
            base = rows * RB + b * 34
            wa = _u32_at(w8, w16, w32, base + 2 + 4 * j, 2).to(jk.i32, bitcast=True)
            wb = _u32_at(w8, w16, w32, base + 18 + 4 * j, 2).to(jk.i32, bitcast=True)
            d = jk.load(wh + (base >> 1)).to(jk.f32)
        if QT == 1:         # q4_0 (18 B: f16 d, 16 B nibbles); sum_k d (q - 8) x = d dot(q, x) - 8 d sum(x)
            base = rows * RB + b * 18
            v = _u32_at(w8, w16, w32, base + 2 + 4 * j, 2)
            wa, wb = v & 0x0F0F0F0F, (v >> 4) & 0x0F0F0F0F
            d = jk.load(wh + (base >> 1)).to(jk.f32)
            c = jk.where(first, d * -8.0, 0.0)
        if QT == 2:         # q4_1 (20 B: f16 d, f16 m, 16 B nibbles)
            base = rows * RB + b * 20
            v = _u32_at(w8, w16, w32, base + 4 + 4 * j, 4)
            wa, wb = v & 0x0F0F0F0F, (v >> 4) & 0x0F0F0F0F
            d = jk.load(wh + (base >> 1)).to(jk.f32)
            c = jk.where(first, jk.load(wh + (base >> 1) + 1).to(jk.f32), 0.0)
        if QT == 6 or QT == 7:
            # q5_0 (22 B: f16 d, 32-bit mask qh, nibbles; w = d (q - 16)), q5_1 (24 B: f16 d, f16 m, qh, nibbles;
            # w = d q + m): bit i of qh is element i's fifth bit
            BB = 22 if QT == 6 else 24
            base = rows * RB + b * BB
            qh = _u32_at(w8, w16, w32, base + BB - 20, 2 if QT == 6 else 4)
            v = _u32_at(w8, w16, w32, base + BB - 16 + 4 * j, 2 if QT == 6 else 4)
            sh = (4 * j).to(jk.u32)
            wa = (v & 0x0F0F0F0F) | _bits_to_bytes(qh, sh)
            wb = ((v >> 4) & 0x0F0F0F0F) | _bits_to_bytes(qh, sh + 16)
            d = jk.load(wh + (base >> 1)).to(jk.f32)
            if QT == 6:
                c = jk.where(first, d * -16.0, 0.0)
            else:
                c = jk.where(first, jk.load(wh + (base >> 1) + 1).to(jk.f32), 0.0)
        if QT == 8:         # iq4_nl (18 B: f16 d, nibbles indexing kvalues_iq4nl)
            base = rows * RB + b * 18
            v = _u32_at(w8, w16, w32, base + 2 + 4 * j, 2)
            wa = _lut16(v & 0x0F0F0F0F, False)
            wb = _lut16((v >> 4) & 0x0F0F0F0F, False)
            d = jk.load(wh + (base >> 1)).to(jk.f32)
        if QT == 12:        # mxfp4 (17 B: e8m0 exponent e, nibbles indexing the doubled e2m1 grid)
            base = rows * RB + b * 17
            v = _u32_at(w8, w16, w32, base + 1 + 4 * j, 1)
            wa = _lut16(v & 0x0F0F0F0F, True)
            wb = _lut16((v >> 4) & 0x0F0F0F0F, True)
            # d = 2^(e - 128): f32 bits 0x00200000 << e for e < 2, else (e - 1) << 23 (ggml_e8m0_to_fp32_half)
            e = jk.load(w8 + base).to(jk.i32)
            d = jk.where(e < 2, jk.where(e == 0, 2097152, 4194304), (e - 1) << 23).to(jk.f32, bitcast=True)
        return wa, wb, sa, sb, jk.where(ok, d, 0.0), c, ma, mb, dm
    # 256-element super-blocks: block b is sub-block s = b % 8 of super-block b // 8
    s = b & 7
    h = s >> 2                       # q6_K / q2_K / q3_K: the 128-element half of the super-block
    u = (s & 3).to(jk.u32)           # ... and the 32-element group within it
    if QT == 3 or QT == 4:
        # q4_K (144 B: f16 d, f16 dmin, 12 B scales / mins, 128 B nibbles), q5_K (176 B: ..., 32 B qh, then the
        # nibbles): sub-block s in the low (even s) or high nibbles of bytes 32 (s // 2) + i; w = d sc q - dmin m
        BB = 144 if QT == 3 else 176
        base = rows * RB + (b >> 3) * BB
        # the nibbles' words indexed in words, not bytes >> 2: the offsets then show they are 16-byte aligned
        # (block sizes and field offsets multiples of 16), and a lane's 4 words load as one vector
        q = rows * (RB // 4) + (b >> 3) * (BB // 4) + (BB - 128) // 4 + (s >> 1) * 8 + j
        nib = ((s & 1) * 4).to(jk.u32)
        wa = (jk.load(w32 + q) >> nib) & 0x0F0F0F0F
        wb = (jk.load(w32 + q + 4) >> nib) & 0x0F0F0F0F
        if QT == 4:                  # element i's fifth bit: bit s of qh[i] (bytes 16..47, words 4..11)
            qh = rows * (RB // 4) + (b >> 3) * (BB // 4) + 4 + j
            wa = wa | (((jk.load(w32 + qh) >> s.to(jk.u32)) & 0x01010101) << 4)
            wb = wb | (((jk.load(w32 + qh + 4) >> s.to(jk.u32)) & 0x01010101) << 4)
        sc, m = _kq_scale_min(w8, base, s)
        dw = jk.where(ok, jk.load(wh + (base >> 1)).to(jk.f32) * sc.to(jk.f32), 0.0)
        c = jk.where(first, -(jk.load(wh + (base >> 1) + 1).to(jk.f32) * m.to(jk.f32)), 0.0)
        return wa, wb, sa, sb, dw, c, ma, mb, dm
    if QT == 5:
        # q6_K (210 B: 128 B low nibbles ql, 64 B high 2-bit pairs qh, 16 x i8 scales, f16 d): group u of half h
        # takes ql[64h + 32 (u % 2) + i] >> 4 (u // 2) and qh[32h + i] >> 2u; q - 32 as signed bytes; a scale
        # per 16 elements
        base = rows * RB + (b >> 3) * 210
        ql = base + h * 64 + (s & 1) * 32 + 4 * j
        qh = base + 128 + h * 32 + 4 * j
        nib = (u >> 1) * 4
        wa = _signed_bytes(((_u32_at(w8, w16, w32, ql, 2) >> nib) & 0x0F0F0F0F)
                           | (((_u32_at(w8, w16, w32, qh, 2) >> (2 * u)) & 0x03030303) << 4), 32)
        wb = _signed_bytes(((_u32_at(w8, w16, w32, ql + 16, 2) >> nib) & 0x0F0F0F0F)
                           | (((_u32_at(w8, w16, w32, qh + 16, 2) >> (2 * u)) & 0x03030303) << 4), 32)
        sa = jk.load(w8 + base + 192 + 2 * s).to(jk.i8, bitcast=True).to(jk.i32)
        sb = jk.load(w8 + base + 193 + 2 * s).to(jk.i8, bitcast=True).to(jk.i32)
        return wa, wb, sa, sb, jk.where(ok, jk.load(wh + (base >> 1) + 104).to(jk.f32), 0.0), c, ma, mb, dm
    if QT == 9:
        # q2_K (84 B: 16 B scales (low nibble scale, high nibble min, per 16 elements), 64 B 2-bit quants
        # (group u of half h: (qs[32h + i] >> 2u) & 3), f16 d, f16 dmin); w = d sc q - dmin m
        base = rows * RB + (b >> 3) * 84
        q = base + 16 + h * 32 + 4 * j
        wa = (_u32_at(w8, w16, w32, q, 4) >> (2 * u)) & 0x03030303
        wb = (_u32_at(w8, w16, w32, q + 16, 4) >> (2 * u)) & 0x03030303
        s0 = jk.load(w8 + base + 2 * s).to(jk.i32)
        s1 = jk.load(w8 + base + 2 * s + 1).to(jk.i32)
        sa, sb, ma, mb = s0 & 15, s1 & 15, s0 >> 4, s1 >> 4
        dm = jk.where(ok, -jk.load(wh + (base >> 1) + 41).to(jk.f32), 0.0)
        return wa, wb, sa, sb, jk.where(ok, jk.load(wh + (base >> 1) + 40).to(jk.f32), 0.0), c, ma, mb, dm
    if QT == 10:
        # q3_K (110 B: 32 B high-bit mask, 64 B 2-bit quants as q2_K's, 12 B of 16 6-bit scales, f16 d):
        # q = low 2 bits + 4 * (bit s of hmask[i]) - 4, as signed bytes
        base = rows * RB + (b >> 3) * 110
        q = base + 32 + h * 32 + 4 * j
        su = s.to(jk.u32)
        wa = _signed_bytes(((_u32_at(w8, w16, w32, q, 2) >> (2 * u)) & 0x03030303)
                           | (((_u32_at(w8, w16, w32, base + 4 * j, 2) >> su) & 0x01010101) << 2), 4)
        wb = _signed_bytes(((_u32_at(w8, w16, w32, q + 16, 2) >> (2 * u)) & 0x03030303)
                           | (((_u32_at(w8, w16, w32, base + 16 + 4 * j, 2) >> su) & 0x01010101) << 2), 4)
        sa = _q3_scale(w8, base, 2 * s)
        sb = _q3_scale(w8, base, 2 * s + 1)
        return wa, wb, sa, sb, jk.where(ok, jk.load(wh + (base >> 1) + 54).to(jk.f32), 0.0), c, ma, mb, dm
    # QT == 11: iq4_xs (136 B: f16 d, u16 scales_h, 4 B scales_l, 16 nibble bytes a sub-block in q4_0's order
    # indexing kvalues_iq4nl); w = d (ls - 32) kvalues[q], ls = 4 bits of scales_l[s // 2] | 2 bits of
    # scales_h >> 2s
    base = rows * RB + (b >> 3) * 136
    v = _u32_at(w8, w16, w32, base + 8 + s * 16 + 4 * j, 4)
    wa = _lut16(v & 0x0F0F0F0F, False)
    wb = _lut16((v >> 4) & 0x0F0F0F0F, False)
    lo = (jk.load(w8 + base + 4 + (s >> 1)).to(jk.i32) >> ((s & 1) * 4)) & 15
    hi = (jk.load(w16 + (base >> 1) + 1).to(jk.i32) >> (2 * s)) & 3
    ls = (lo | (hi << 4)) - 32
    return wa, wb, sa, sb, jk.where(ok, jk.load(wh + (base >> 1)).to(jk.f32) * ls.to(jk.f32), 0.0), c, ma, mb, dm


@jk.kernel(do_not_specialize=('M',))
def _qmv_gpu_kernel(w8, w16, w32, wh, xw, xd, xs, y, M, N, K: jk.constexpr, QT: jk.constexpr, RB: jk.constexpr,
                    R: jk.constexpr, L: jk.constexpr, BM: jk.constexpr):
    # program (R rows from program_id(0) * R, BM tokens from program_id(1) * BM, the last token tile shifted back
    # to end at M: overlapping tokens are recomputed with the same operations); QT: _QMV_TYPES.
    # Lanes past a row's last block (K / 32 not a multiple of L) read the last block again (no masks, no
    # branches) with a zero weight scale and offset, which adds exact zeros; only the activations' vector loads
    # are masked (a predicated 16-byte load).
    NB = K // 32
    n0 = jk.program_id(0) * R
    t0 = jk.minimum(jk.program_id(1) * BM, M - BM)
    # (R, L, 4) index tiles by broadcasts (constant along the word axis, so the activations' 4 words of a
    # lane are one aligned 16-byte load with one mask bit)
    rows = jk.broadcast_to(jk.minimum(n0 + jk.arange(0, R), N - 1).to(jk.i64)[:, None, None], (R, L, 4))
    j = jk.arange(0, 4)[None, None, :]
    ones = jk.full((1, 1, 4), 0x01010101, jk.u32)
    accs = ()
    for t in jk.static_range(BM):
        accs = accs + (jk.zeros((R, L, 4), jk.f32),)
    for s in range(0, (NB + L - 1) // L):
        b = jk.broadcast_to(s * L + jk.arange(0, L)[None, :, None], (R, L, 4))
        ok = b < NB
        wa, wb, sa, sb, dw, c, ma, mb, dm = _qmv_decode(w8, w16, w32, wh, rows, jk.minimum(b, NB - 1), ok, RB, QT)
        nxt = ()
        for t in jk.static_range(BM):
            tok = (t0 + t).to(jk.i64)
            xo = tok * (K // 4) + b * 8 + j
            xa = jk.load(xw + xo, mask=ok, other=0)
            xb = jk.load(xw + xo + 4, mask=ok, other=0)
            if sa is None:
                dot = jk.dp4a(wa, xa, jk.dp4a(wb, xb, 0))
            else:
                dot = sa * jk.dp4a(wa, xa, 0) + sb * jk.dp4a(wb, xb, 0)
            blk = tok * NB + jk.minimum(b, NB - 1)
            dx = jk.load(xd + blk)
            acc = jk.fma(dot.to(jk.f32), dw * dx, accs[t])
            if c is not None:
                acc = jk.fma(c, jk.load(xs + blk), acc)
            if dm is not None:
                mins = ma * jk.dp4a(ones, xa, 0) + mb * jk.dp4a(ones, xb, 0)
                acc = jk.fma(mins.to(jk.f32), dm * dx, acc)
            nxt = nxt + (acc,)
        accs = nxt
    orow = n0 + jk.arange(0, R)
    for t in jk.static_range(BM):
        # the 4 word accumulators of each lane, then the L lanes, each in an order fixed by its length
        res = jk.sum(jk.sum(accs[t], axis=2), axis=1)
        jk.store(y + (t0 + t).to(jk.i64) * N + orow, res, mask=orow < N)


_QMV_TYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_K": 3, "q5_K": 4, "q6_K": 5, "q5_0": 6, "q5_1": 7, "iq4_nl": 8,
              "q2_K": 9, "q3_K": 10, "iq4_xs": 11, "mxfp4": 12}


def _gpu_qmv(q: QType, target) -> bool:
    """Whether GGUF linears of type q run on `_qmv_gpu_kernel` on `target`: on CUDA targets every type (it replaced
    the CPU-shaped _qmm_kernel / _kq_kernel there: faster at every q4_0 shape the kernel benchmark printed, and the
    Q4_1 model with its Q8_0 head decodes several times faster end to end: docs/BENCHMARKS.md)."""
    return target is not None and target.gpu_quant_linear and q.name in _QMV_TYPES


def qmv_tiles(qtype, M: int, N: int, K: int, target=None) -> tuple:
    """(R, L, BM, num_warps) of `_qmv_gpu_kernel`: L lanes a row (a power of two from 4 up to the target's
    tuning.quant_gemv_lanes and K / 32, from K alone: it fixes every row's order of operations), R = 32 * warps / L
    rows a CTA (tuning.quant_gemv_warps), BM tokens a program (a power of two up to tuning.quant_gemv_tokens that is
    at most M). The same for every type: 32 lanes and 4 warps were measured on q4_0 / q4_1 (docs/BENCHMARKS.md),
    the other types take them untested."""
    tn = target.tuning if target is not None else None
    nb = K // 32
    L = 4
    while L < (tn.quant_gemv_lanes if tn else 32) and L * 2 <= nb:
        L *= 2
    warps = tn.quant_gemv_warps if tn else 4
    BM = 1
    cap = tn.quant_gemv_tokens if tn else 8
    while BM * 2 <= min(M, cap):
        BM *= 2
    return max(1, 32 * warps // L), L, BM, warps


def _matmul_qmv(q: QType, w, qx, xd, xs, out, M: int, N: int, K: int, target):
    R, L, BM, warps = qmv_tiles(q, M, N, K, target)
    return run(_qmv_gpu_kernel, (-(-N // R), -(-M // BM)),
               (w, jk.as_pointer(w, "u16"), jk.as_pointer(w, "u32"), jk.as_pointer(w, "f16"), jk.as_pointer(qx, "i32"),
                xd, xs, out, M, N), target, K=K, QT=_QMV_TYPES[q.name], RB=row_bytes(q, K), R=R, L=L, BM=BM,
               num_warps=warps)


# ------------------------------------------------------------------------------------------ dequantisation
@jk.kernel
def _dequant_rows_kernel(w, wh, idx, out, K, NSTEP, RB, DEC: jk.constexpr, S: jk.constexpr):
    # out[i, :] = dequantised W[idx[i], :]; one program per output row, S 32-element sub-blocks per step
    i = jk.program_id(0).to(jk.i64)
    rows = jk.load(idx + i).to(jk.i64) + jk.arange(0, 1).to(jk.i64)
    orow = out + i * K.to(jk.i64) + jk.arange(0, S)[None, :, None] * 32 + jk.arange(0, 32)[None, None, :]
    for st0 in range(0, NSTEP):
        st = st0.to(jk.i64)
        q, sc, c, QOFF = DEC(w, wh, rows, st, RB.to(jk.i64), 1, S)
        v = jk.reshape(q, (1, S, 32)).to(jk.f32)      # S == 1 for the 'halves' layout: element order
        scale = jk.reshape(jk.broadcast_to(jk.broadcast_to(sc, (1, S, 8))[:, :, :, None], (1, S, 8, 4)), (1, S, 32))
        if QOFF is not None:
            val = (v - QOFF) * scale
        else:
            val = v * scale
            if c is not None:
                if len(c.shape) == 3:        # one offset per 16 elements (q2_K's mins)
                    val = val + jk.reshape(jk.broadcast_to(c[:, :, :, None], (1, S, 2, 16)), (1, S, 32))
                else:
                    val = val + c[:, :, None]
        jk.store(orow + st * (S * 32), val)


def dequantize_rows(raw: np.ndarray, qtype: str, rows_idx: np.ndarray, K: int, out: np.ndarray = None,
                    target=None) -> np.ndarray:
    """out[i] = dequantize(W[rows_idx[i]]) (float32, (len(rows_idx), K)): the embedding lookup of a quantised
    token_embd. `raw` holds all rows' GGUF bytes; rows_idx is int32 (indices are not range-checked here
    beyond the host check below)."""
    q = _qtype(qtype)
    K = int(K)
    rb = row_bytes(q, K)
    target = resolve_target(target, raw)
    if not is_array(raw) or raw.dtype != np.uint8 or not raw.flags.c_contiguous:
        raise TypeError("dequantize_rows: raw must be a contiguous uint8 array of GGUF bytes")
    if isinstance(raw, SplitBlocks):
        raise TypeError("dequantize_rows: takes GGUF blocks, not a split-layout weight (keep the embedding's own)")
    if raw.nbytes % rb:
        raise ValueError(f"dequantize_rows: {raw.nbytes} bytes is not a whole number of {q.name} rows of K={K} "
                         f"({rb} bytes each)")
    nrows = raw.nbytes // rb
    if is_device(rows_idx):
        # device indices: not range-checked on the host (the engine checks token ids when it takes them)
        if rows_idx.dtype != np.int32 or not rows_idx.flags.c_contiguous:
            raise TypeError("dequantize_rows: device rows_idx must be a contiguous int32 array")
        idx = rows_idx.reshape(-1)
    else:
        idx = np.ascontiguousarray(rows_idx, dtype=np.int32).reshape(-1)
    if idx.size and not is_device(idx) and (idx.min() < 0 or idx.max() >= nrows):
        raise IndexError(f"dequantize_rows: row index out of range [0, {nrows}): min {idx.min()}, max {idx.max()}")
    if out is None:
        out = empty_like_dev(raw, (idx.size, K), np.float32)
    elif out.shape != (idx.size, K) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"dequantize_rows: out must be a contiguous float32 array of shape {(idx.size, K)}, got "
                         f"{out.dtype} {out.shape}")
    S = 8 if q.block_elems == 256 else 1
    run(_dequant_rows_kernel, (idx.size,), (raw, jk.as_pointer(raw, "f16"), idx, out, K, K // (32 * S), rb),
        target, DEC=_DECODERS[q.name], S=S)
    return out
