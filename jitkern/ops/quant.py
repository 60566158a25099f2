"""GGUF quantised matrix products: y[M, N] = x[M, K] @ W[N, K]^T with W in raw GGUF block bytes.

API: `matmul_q(x, weight_raw, qtype, N, K)`; `quantize_q8(x, layout=act_layout(qtype))` once + `matmul_q8(xq, ...)`
per weight when several weights share an input; `dequantize_rows(raw, qtype, rows_idx, K)` (embedding lookup);
`row_bytes`, `QTYPES`. qtypes: q8_0 q4_0 q4_1 q4_K q5_K q6_K.

LLM decode on a CPU is a bandwidth-bound GEMV over the weights, so the kernels follow ggml's plan:

1. The activations are quantised once per row (`quantize_q8`): blocks of 32 int8 values with an f32 scale
   d = max|x| / 127 and the f32 block sum s = d * sum(q) (what the formats with a min/offset need). One
   format serves every weight type; the K-quants (256-element super-blocks) use 8 of these 32-blocks per
   super-block, at least as precise as ggml's Q8_K (one scale per 256). For q4_0 / q4_1 weights the values
   are stored in the 'q4' layout (pairs of blocks interleaved by 16-value halves, see Q8Activations).
2. Per weight block the integer dot products run on `jk.dot4` (pmaddubsw + pmaddwd on x86: unsigned 4/5/6-bit
   weights times signed int8 activations directly; q8_0 / q6_K weights are signed: the sign trick). dot4
   leaves the partial sums of each group of 4 in vector lanes; they are converted to f32 and FMA'd with the
   block's combined scale (weight scale * activation scale, broadcast over its lanes) into an f32 accumulator,
   reduced horizontally once per row. Min/offset terms (q4_1's m, the K-quants' dmin * m, q4_0's -8 d) are
   FMA'd with the activation block sums.
3. GEMV (M = 1): a program runs 8 weight rows one after the other, each over its whole K with two vector
   registers' worth of blocks per step. Rows are not interleaved: each thread then reads one monotonic
   stream, which the hardware prefetchers follow (R rows in lockstep measured 3-5x less DRAM bandwidth).
   GEMM (M > 1, prefill): a program owns a tile of BM tokens x R rows, so every weight block loaded serves BM
   tokens (the weights are read M/BM times, not M times) and every activation block R rows (`gemv_tiles`).

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
(all checked against gguf.quants.dequantize in tests/ops/test_quant.py; dequantize_rows is bit-exact)

Edges without masks in the hot loops: the last tile of weight rows (tokens) is shifted back to end at N (M),
overlapping its neighbour, which recomputes and rewrites identical values; so tiles never exceed N (M). K
steps that do not divide the block count leave a remainder run by short tail loops.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import jitkern as jk
from jitkern.ops._hostargs import resolve_target, run

__all__ = ["QTYPES", "QType", "Q8Activations", "LAYOUTS", "act_layout", "quantize_q8", "matmul_q", "matmul_q8",
           "dequantize_rows", "row_bytes", "gemv_tiles"]


@dataclass(frozen=True)
class QType:
    name: str
    block_elems: int      # elements per (super-)block
    block_bytes: int      # bytes per (super-)block


QTYPES = {q.name: q for q in (QType("q8_0", 32, 34), QType("q4_0", 32, 18), QType("q4_1", 32, 20),
                              QType("q4_K", 256, 144), QType("q5_K", 256, 176), QType("q6_K", 256, 210))}


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


@jk.kernel
def _quantize_q8_kernel(x, qx, xd, xs, K, NBLK, BB: jk.constexpr, PAIRS: jk.constexpr):
    # program (row, chunk of BB 32-blocks); the last chunk of a row shifts back to end at the row's end.
    # PAIRS: the 'q4' layout, blocks 2j and 2j+1 stored as [2j lo 16, 2j+1 lo 16, 2j hi 16, 2j+1 hi 16]
    # (chunks of BB = even blocks over the pairs; the last block of an odd count stays as it is, done by the
    # first program of the row)
    row = jk.program_id(1).to(jk.i64)
    if PAIRS:
        b0 = jk.minimum(jk.program_id(0) * BB, NBLK - NBLK % 2 - BB).to(jk.i64)
    else:
        b0 = jk.minimum(jk.program_id(0) * BB, NBLK - BB).to(jk.i64)
    blk = b0 + jk.arange(0, BB)
    r, d, s = _q8_blocks(jk.load(x + row * K + blk[:, None] * 32 + jk.arange(0, 32)[None, :]))
    if PAIRS:
        pair = b0 // 2 + jk.arange(0, BB // 2)
        jk.store(qx + row * K + pair[:, None, None, None] * 64 + jk.arange(0, 2)[None, :, None, None] * 16
                 + jk.arange(0, 2)[None, None, :, None] * 32 + jk.arange(0, 16)[None, None, None, :],
                 jk.reshape(r.to(jk.i32).to(jk.i8), (BB // 2, 2, 2, 16)))
    else:
        jk.store(qx + row * K + blk[:, None] * 32 + jk.arange(0, 32)[None, :], r.to(jk.i32).to(jk.i8))
    jk.store(xd + row * NBLK + blk, d)
    jk.store(xs + row * NBLK + blk, s)
    if PAIRS:
        if (jk.program_id(0) == 0) & (NBLK % 2 == 1):
            last = (NBLK - 1).to(jk.i64) + jk.arange(0, 1)
            offs = row * K + last[:, None] * 32 + jk.arange(0, 32)[None, :]
            r1, d1, s1 = _q8_blocks(jk.load(x + offs))
            jk.store(qx + offs, r1.to(jk.i32).to(jk.i8))
            jk.store(xd + row * NBLK + last, d1)
            jk.store(xs + row * NBLK + last, s1)


LAYOUTS = ("natural", "q4")


def act_layout(qtype) -> str:
    """The activation layout `matmul_q8` needs for weights of this type ('q4' for q4_0 / q4_1)."""
    return "q4" if _qtype(qtype).name in ("q4_0", "q4_1") else "natural"


class Q8Activations(tuple):
    """(qx, scales, sums) as returned by `quantize_q8`, carrying the layout of qx in `.layout`:
    'natural' (each 32-block's values in order) or 'q4' (blocks 2j and 2j+1 interleaved by 16-value halves,
    [2j: 0-15, 2j+1: 0-15, 2j: 16-31, 2j+1: 16-31]; the last block of an odd count in order), which lets the
    q4_0 / q4_1 kernels load the activations that pair with one vector of nibble bytes contiguously."""

    layout = "natural"

    def __new__(cls, qx, scales, sums, layout="natural"):
        obj = super().__new__(cls, (qx, scales, sums))
        obj.layout = layout
        return obj


def quantize_q8(x: np.ndarray, out=None, target=None, layout: str = "natural") -> Q8Activations:
    """Quantises float32 activations (M, K) or (K,) (K a multiple of 32) into 32-element int8 blocks.

    Returns (qx int8 [..., K], scales f32 [..., K/32], sums f32 [..., K/32]) with, per block,
    d = max|x| / 127, q = round_half_even(x * (1/d)) clipped to [-127, 127] (q = 0 where d = 0), and
    sum = d * sum(q); qx in `layout` ('natural', or 'q4' for q4_0 / q4_1 weights: see Q8Activations and
    act_layout). `out` may give the three arrays to fill.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"quantize_q8: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"quantize_q8: x must be float32, got {x.dtype}")
    if x.ndim not in (1, 2):
        raise ValueError(f"quantize_q8: x must be (K,) or (M, K), got shape {x.shape}")
    x = np.ascontiguousarray(x)
    K = x.shape[-1]
    if K % 32 or K == 0:
        raise ValueError(f"quantize_q8: K={K} (x's last axis) must be a positive multiple of 32")
    lead = x.shape[:-1]
    nblk = K // 32
    if out is None:
        qx = np.empty(lead + (K,), np.int8)
        xd = np.empty(lead + (nblk,), np.float32)
        xs = np.empty(lead + (nblk,), np.float32)
    else:
        qx, xd, xs = out
        for a, shp, dt, nm in ((qx, lead + (K,), np.int8, "qx"), (xd, lead + (nblk,), np.float32, "scales"),
                               (xs, lead + (nblk,), np.float32, "sums")):
            if a.shape != shp or a.dtype != dt or not a.flags.c_contiguous:
                raise ValueError(f"quantize_q8: out {nm} must be a contiguous {np.dtype(dt)} array of shape {shp}, "
                                 f"got {a.dtype} {a.shape}")
    M = int(np.prod(lead)) if lead else 1
    pairs = layout == "q4" and nblk >= 2     # one block: both layouts are the same
    span = nblk - nblk % 2 if pairs else nblk
    bb = 2 if pairs else 1
    while bb * 2 <= min(span, 8):
        bb *= 2
    if M:
        run(_quantize_q8_kernel, (-(-span // bb), M), (x, qx, xd, xs, K, nblk), target, BB=bb, PAIRS=pairs)
    return Q8Activations(qx, xd, xs, layout)


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
    dmt = jk.trans(jk.reshape(dm, (R * S, 2)))
    first = jk.arange(0, 2)[:, None] == 0
    sc = jk.reshape(jk.sum(jk.where(first, dmt, -0.0), axis=0), (R, S, 1))
    m = jk.reshape(jk.sum(jk.where(first, -0.0, dmt), axis=0), (R, S))
    return q, sc, m, None


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


# ------------------------------------------------------------------------------------------- the product
@jk.jit
def _qstep(w, wh, xq, xd, xs, rows, toks, K64, rb, st, acc, accc, DEC: jk.constexpr, BM: jk.constexpr,
           R: jk.constexpr, S: jk.constexpr, LANES: jk.constexpr, XQ4: jk.constexpr):
    """One step over S 32-element sub-blocks (index st*S ...) of the BM x R tile: returns the updated
    accumulators acc (BM, R, LANES) (scaled integer dots, per lane) and accc (BM, R, S) (block-sum terms).
    XQ4: the activations are in the 'q4' layout (see Q8Activations)."""
    q, sc, c, _ = DEC(w, wh, rows, st, rb, R, S)
    xbase = toks * K64 + st * (S * 32)
    srow = toks[:, None] * (K64 // 32) + st * S + jk.arange(0, S)[None, :]
    if len(q.shape) == 4:
        # 'halves' layout (R, 2, S, 16): the activations likewise, (BM, 2, S, 16)
        if XQ4 and S % 2 == 0:
            # 'q4' activation layout: pairs of blocks stored as [lo, lo, hi, hi] (st * S is even here)
            offs = (xbase[:, None, None, None, None] + jk.arange(0, 2)[None, :, None, None, None] * 32
                    + jk.arange(0, S // 2)[None, None, :, None, None] * 64
                    + jk.arange(0, 2)[None, None, None, :, None] * 16 + jk.arange(0, 16)[None, None, None, None, :])
            xv = jk.reshape(jk.load(xq + offs), (BM, 2, S, 16))
        else:
            xv = jk.load(xq + xbase[:, None, None, None] + jk.arange(0, 2)[None, :, None, None] * 16
                         + jk.arange(0, S)[None, None, :, None] * 32 + jk.arange(0, 16)[None, None, None, :])
        p = jk.sum(jk.dot4(jk.broadcast_to(q[None, :, :, :, :], (BM, R, 2, S, 16)),
                           jk.broadcast_to(xv[:, None, :, :, :], (BM, R, 2, S, 16))), axis=2)
        L = 4
    else:
        xv = jk.load(xq + xbase[:, None, None] + jk.arange(0, S)[None, :, None] * 32
                     + jk.arange(0, 32)[None, None, :])                            # (BM, S, 32) i8
        p = jk.dot4(jk.broadcast_to(q[None, :, :, :], (BM, R, S, 32)),
                    jk.broadcast_to(xv[:, None, :, :], (BM, R, S, 32)))               # (BM, R, S, 8) i32
        L = 8
    # weight scale x activation scale, one per block (sc (R, S, 1)) or per group of 4 (sc (R, S, 8)),
    # multiplied before broadcasting over the lanes
    dx = jk.load((xd + srow)[:, :, None])                                              # (BM, S, 1)
    scale = jk.broadcast_to(sc[None, :, :, :] * dx[:, None, :, :], (BM, R, S, L))
    if S * L == LANES:
        acc = jk.fma(jk.reshape(p.to(jk.f32), (BM, R, LANES)), jk.reshape(scale, (BM, R, LANES)), acc)
    else:
        acc += jk.sum(p.to(jk.f32) * scale, axis=2)
    if c is not None:
        accc = jk.fma(c[None, :, :], jk.load(xs + srow)[:, None, :], accc)
    return acc, accc


@jk.kernel
def _qmatmul_kernel(w, wh, xq, xd, xs, y, M, N, K, NSTEP, RB, RS, DEC: jk.constexpr, BM: jk.constexpr,
                    R: jk.constexpr, S: jk.constexpr, LANES: jk.constexpr, TL: jk.constexpr, XQ4: jk.constexpr):
    # y[m, n] for BM tokens x RS * R weight rows: RS tiles of R rows one after the other (so a GEMV program
    # with R = 1 still reads one monotonic stream, and its fixed costs are shared by RS rows); grid (N tiles,
    # M tiles). NSTEP steps cover S 32-element sub-blocks each; RB is the weight row length in bytes; LANES
    # (TL) the f32 lanes of the main (tail) accumulator per (token, row). The sub-blocks left (32-element
    # formats, TL > 0) run two at a time while pairs remain in the 'q4' activation layout (XQ4), then one at
    # a time.
    n0 = jk.minimum(jk.program_id(0) * (RS * R), N - RS * R)
    m0 = jk.minimum(jk.program_id(1) * BM, M - BM)
    toks = (m0 + jk.arange(0, BM)).to(jk.i64)
    K64 = K.to(jk.i64)
    rb = RB.to(jk.i64)
    nb = K // 32
    for rt in range(0, RS):
        rows = (n0 + rt * R + jk.arange(0, R)).to(jk.i64)
        acc = jk.zeros((BM, R, LANES), jk.f32)
        accc = jk.zeros((BM, R, S), jk.f32)
        for st in range(0, NSTEP):
            acc, accc = _qstep(w, wh, xq, xd, xs, rows, toks, K64, rb, st.to(jk.i64), acc, accc, DEC, BM, R, S,
                               LANES, XQ4)
        res = jk.sum(acc, axis=2) + jk.sum(accc, axis=2)
        done = NSTEP * S
        if XQ4 and S > 2:
            acc2 = jk.zeros((BM, R, 2 * TL), jk.f32)
            accc2 = jk.zeros((BM, R, 2), jk.f32)
            for sp in range(done // 2, nb // 2):
                acc2, accc2 = _qstep(w, wh, xq, xd, xs, rows, toks, K64, rb, sp.to(jk.i64), acc2, accc2, DEC, BM, R,
                                     2, 2 * TL, XQ4)
            res = res + (jk.sum(acc2, axis=2) + jk.sum(accc2, axis=2))
            done = jk.maximum(done, nb - nb % 2)
        if S > 1 and TL > 0:
            acc1 = jk.zeros((BM, R, TL), jk.f32)
            accc1 = jk.zeros((BM, R, 1), jk.f32)
            for sb in range(done, nb):
                acc1, accc1 = _qstep(w, wh, xq, xd, xs, rows, toks, K64, rb, sb.to(jk.i64), acc1, accc1, DEC, BM, R,
                                     1, TL, XQ4)
            res = res + (jk.sum(acc1, axis=2) + jk.sum(accc1, axis=2))
        jk.store(y + toks[:, None] * N + rows[None, :], res)


_DECODERS = {"q8_0": _dec_q8_0, "q4_0": _dec_q4_0, "q4_1": _dec_q4_1, "q4_K": _dec_q4_K, "q5_K": _dec_q5_K,
             "q6_K": _dec_q6_K}


def _pow2_le(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def gemv_tiles(qtype, M: int, N: int, K: int, target=None) -> tuple:
    """(BM, R, S, LANES): tokens x weight rows per program, 32-element sub-blocks per main-loop step (the
    K // 32 % S left over run one at a time), accumulator lanes per (token, row)."""
    q = _qtype(qtype)
    if target is None:
        from jitkern.compiler import default_target
        target = default_target()
    vbytes = max(16, target.vector_bits // 8)
    regs = 2 if M == 1 else 1           # accumulator registers per (token, row)
    if q.block_elems == 256:
        S, L = 8, 8
    elif q.name in ("q4_0", "q4_1"):
        # one vector of nibble bytes holds the same half of vbytes/16 blocks; at least a pair of blocks per
        # step, as the 'q4' activation layout interleaves pairs
        S, L = max(2, regs * vbytes // 16), 4
    else:
        S, L = max(1, regs * vbytes // 32), 8
    while S > K // 32:
        S //= 2
    lanes = S * L if S * L <= regs * vbytes // 4 else L
    # M == 1 (GEMV, bandwidth-bound): one weight row per program, so every thread reads one monotonic stream
    # (R rows in lockstep are R interleaved streams, which the hardware prefetchers follow badly: 3-5x less
    # DRAM bandwidth on znver4), and two accumulator registers' worth of blocks per step.
    # M > 1 (GEMM, compute-bound): the largest token x row tile whose accumulators and operands fit the
    # register file (16 vector registers on AVX2 and below, 32 on AVX-512).
    if M == 1:
        BM, R = 1, 1
    elif q.block_elems == 256:
        BM, R = 4, 2
    elif vbytes >= 64 or q.name in ("q4_0", "q4_1"):
        BM, R = 4, 4
    elif vbytes >= 32:
        BM, R = 8, 2
    else:
        BM, R = 2, 2
    return _pow2_le(M, BM), _pow2_le(N, R), S, lanes


def _seq_tiles(M: int, N: int, R: int) -> int:
    """Row tiles one program runs one after the other: GEMV programs take 8 rows (a program's fixed costs,
    the program-id divisions and the final horizontal sums, are then small next to short rows' work);
    GEMM programs one tile (they are long anyway)."""
    if M > 1:
        return 1
    return max(1, min(8, N // R))


def _tail_lanes(q: QType) -> int:
    """Accumulator lanes of the one-sub-block tail loop (0: none, the K-quants step whole super-blocks)."""
    return 0 if q.block_elems == 256 else 4 if q.name in ("q4_0", "q4_1") else 8


def _weight_arg(raw, q: QType, N: int, K: int, what: str):
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{what}: the weight must be a numpy uint8 array of raw GGUF bytes, got {type(raw).__name__}")
    if raw.dtype != np.uint8:
        raise TypeError(f"{what}: the weight must hold raw GGUF bytes as uint8, got dtype {raw.dtype}")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{what}: the weight bytes must be contiguous")
    need = N * row_bytes(q, K)
    if raw.nbytes != need:
        raise ValueError(f"{what}: a {q.name} weight of N={N} rows x K={K} has {need} bytes, got {raw.nbytes}")
    return raw, jk.as_pointer(raw, "f16")


def matmul_q(x: np.ndarray, weight_raw: np.ndarray, qtype: str, N: int, K: int, out=None, target=None):
    """y = x @ dequantize(W)^T for x float32 (M, K) or (K,) and W a GGUF-quantised (N, K) weight given as its
    raw uint8 bytes. Returns y float32 (M, N) or (N,) (written into `out` when given).

    The activations are quantised on the way (`quantize_q8`); to share one quantisation between several
    weights with the same input (q/k/v, gate/up), call `quantize_q8` once and `matmul_q8` per weight."""
    q = _qtype(qtype)
    x = np.asarray(x)
    if x.ndim not in (1, 2) or x.shape[-1] != int(K):
        raise ValueError(f"matmul_q: x must be (K,) or (M, K) with K={K}, got shape {x.shape}")
    if x.size == 0:
        sc = np.zeros(x.shape[:-1] + (int(K) // 32,), np.float32)
        xq = Q8Activations(np.zeros(x.shape, np.int8), sc, sc, act_layout(q))
        return matmul_q8(xq, weight_raw, q, N, K, out=out, target=target)
    return matmul_q8(quantize_q8(x, target=target, layout=act_layout(q)), weight_raw, q, N, K, out=out,
                     target=target)


def matmul_q8(xq: tuple, weight_raw: np.ndarray, qtype: str, N: int, K: int, out=None, target=None):
    """matmul_q on activations already quantised by `quantize_q8(x, layout=act_layout(qtype))`:
    xq = (qx, scales, sums) (a plain tuple counts as the 'natural' layout)."""
    out, _ = _matmul_q8(xq, weight_raw, qtype, N, K, out, target)
    return out


def _matmul_q8(xq, weight_raw, qtype, N, K, out, target):
    """(out, the CompiledKernel that ran or None)."""
    q = _qtype(qtype)
    N, K = int(N), int(K)
    w, wh = _weight_arg(weight_raw, q, N, K, f"matmul_q({q.name})")
    layout = getattr(xq, "layout", "natural")
    if layout != act_layout(q) and K // 32 >= 2:
        raise ValueError(f"matmul_q8: {q.name} needs activations in the {act_layout(q)!r} layout, got {layout!r} "
                         f"(quantize_q8(x, layout=act_layout({q.name!r})))")
    qx, xd, xs = xq
    if qx.ndim not in (1, 2) or qx.shape[-1] != K or qx.dtype != np.int8:
        raise ValueError(f"matmul_q: x must be (K,) or (M, K) with K={K}, got shape {qx.shape}")
    M = 1 if qx.ndim == 1 else qx.shape[0]
    if xd.shape != qx.shape[:-1] + (K // 32,) or xs.shape != xd.shape:
        raise ValueError(f"matmul_q8: scales/sums must have shape {qx.shape[:-1] + (K // 32,)}, got {xd.shape} "
                         f"and {xs.shape}")
    oshape = (N,) if qx.ndim == 1 else (M, N)
    if out is None:
        out = np.empty(oshape, np.float32)
    elif out.shape != oshape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmul_q: out must be a contiguous float32 array of shape {oshape}, got {out.dtype} "
                         f"{out.shape}")
    if M == 0 or N == 0:
        return out, None
    BM, R, S, lanes = gemv_tiles(q, M, N, K, resolve_target(target))
    xq4 = layout == "q4" and K // 32 >= 2
    rs = _seq_tiles(M, N, R)
    ck = run(_qmatmul_kernel, (-(-N // (rs * R)), -(-M // BM)),
             (w, wh, qx, xd, xs, out, M, N, K, K // (32 * S), row_bytes(q, K), rs),
             target, DEC=_DECODERS[q.name], BM=BM, R=R, S=S, LANES=lanes, TL=_tail_lanes(q), XQ4=xq4)
    return out, ck


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
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or not raw.flags.c_contiguous:
        raise TypeError("dequantize_rows: raw must be a contiguous uint8 array of GGUF bytes")
    if raw.nbytes % rb:
        raise ValueError(f"dequantize_rows: {raw.nbytes} bytes is not a whole number of {q.name} rows of K={K} "
                         f"({rb} bytes each)")
    nrows = raw.nbytes // rb
    idx = np.ascontiguousarray(rows_idx, dtype=np.int32).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= nrows):
        raise IndexError(f"dequantize_rows: row index out of range [0, {nrows}): min {idx.min()}, max {idx.max()}")
    if out is None:
        out = np.empty((idx.size, K), np.float32)
    elif out.shape != (idx.size, K) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"dequantize_rows: out must be a contiguous float32 array of shape {(idx.size, K)}, got "
                         f"{out.dtype} {out.shape}")
    S = 8 if q.block_elems == 256 else 1
    run(_dequant_rows_kernel, (idx.size,), (raw, jk.as_pointer(raw, "f16"), idx, out, K, K // (32 * S), rb),
        target, DEC=_DECODERS[q.name], S=S)
    return out
