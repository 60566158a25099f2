"""Elementwise ops: gated MLP activations (vLLM's SiluAndMul / GeluAndMul(approximate="tanh") layout),
the tanh GELU (GPT-2's "gelu_new"), residual adds, copies/dtype conversion, scaling and soft-capping.

All math runs in f32 and is rounded once when stored; arrays may be float32, float16 or uint16 (= bf16),
and 2-D arrays may be row-strided views (last axis contiguous).
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import (block_for, check_shape, empty_like_dev, fptr, has_half, is_array, launch_target,
                        resolve_target, row_stride, run)

_BLOCK = 128
GPU_ELEMENTWISE_BLOCK = 1024     # act_and_mul's program width on GPUs

from .quant import Q8Activations, _eff_group, _q8_blocks, _store_grouped, _store_scales  # noqa: E402


@jk.jit
def silu(x):
    return x / (1.0 + jk.exp(-x))


@jk.jit
def gelu_tanh_f(x):
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as torch's gelu(approximate="tanh")
    return 0.5 * x * (1.0 + jk.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@jk.kernel
def act_and_mul_kernel(gu, gu_s, gu_ps, out, o_s, n, ACT: jk.constexpr, BLOCK: jk.constexpr,
                       PARTS: jk.constexpr = 1):
    """out[t, j] = ACT(gu[t, j]) * gu[t, n + j]; grid (T, cdiv(n, BLOCK)). PARTS > 1: gu is a split-K linear's
    slabs gu_ps elements apart, added in slab order first (matmul.SplitK: its sum kernel's bits)."""
    t = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < n
    base = gu + t.to(jk.i64) * gu_s
    g = jk.load(base + cols, mask=m, other=0.0).to(jk.f32)
    u = jk.load(base + n + cols, mask=m, other=0.0).to(jk.f32)
    for z in jk.static_range(1, PARTS):
        g = g + jk.load(base + z * gu_ps.to(jk.i64) + cols, mask=m, other=0.0)
        u = u + jk.load(base + z * gu_ps.to(jk.i64) + n + cols, mask=m, other=0.0)
    jk.store(out + t.to(jk.i64) * o_s + cols, ACT(g) * u, mask=m)


@jk.jit
def _act_mul_q8_group(base, n, ACT: jk.constexpr, qx, xd, xs, xd4, xs4, row, nblk, b0, NB: jk.constexpr,
                      REP4: jk.constexpr, NG: jk.constexpr = 1):
    """ACT(gate) * up of the NB 32-blocks of a row from block b0, stored quantised as one group of NB blocks (NG = NB:
    as NB blocks in element order, the 'natural' layout)."""
    blk = b0.to(jk.i64) + jk.arange(0, NB)
    cols = blk[:, None] * 32 + jk.arange(0, 32)[None, :]
    g = jk.load(base + cols).to(jk.f32)
    u = jk.load(base + n + cols).to(jk.f32)
    r, d, s = _q8_blocks(ACT(g) * u)
    _store_grouped(qx, row * n + b0.to(jk.i64) * 32, r, NG, NB // NG)
    _store_scales(xd, xs, xd4, xs4, row, nblk, blk, d, s, NB, REP4)


@jk.kernel
def act_and_mul_q8_kernel(gu, gu_s, qx, xd, xs, xd4, xs4, n, nblk, ACT: jk.constexpr, G: jk.constexpr,
                          GP: jk.constexpr, REP4: jk.constexpr, NAT: jk.constexpr = 0):
    """ACT(gate) * up straight into quantize_q8's int8 blocks; program (row, j) does groups [j GP, (j+1) GP) of
    G 32-blocks, the last program of a row also the grouped layouts' leftovers (as quantize_q8: a pair, then a
    single block). Every block is quantised on its own values, so the split never changes a result.
    NAT > 0 (the 'natural' layout on GPUs): program (row, j) does blocks [j NAT, (j+1) NAT) as one (NAT, 32)
    tile spread over the CTA (the last program of a row shifted back to end at nblk, rewriting its neighbour's
    blocks with the same bits), not NAT one-block steps of 32 active threads."""
    row = jk.program_id(0).to(jk.i64)
    j = jk.program_id(1)
    base = gu + row * gu_s
    if NAT > 0:
        _act_mul_q8_group(base, n, ACT, qx, xd, xs, xd4, xs4, row, nblk, jk.minimum(j * NAT, nblk - NAT), NAT, REP4,
                          NAT)
    else:
        ng = nblk // G
        for gi in range(j * GP, jk.minimum(j * GP + GP, ng)):
            _act_mul_q8_group(base, n, ACT, qx, xd, xs, xd4, xs4, row, nblk, gi * G, G, REP4)
        if G > 1:
            if j == jk.num_programs(1) - 1:
                if G > 2:
                    if nblk % G >= 2:
                        _act_mul_q8_group(base, n, ACT, qx, xd, xs, xd4, xs4, row, nblk, nblk - nblk % G, 2, REP4)
                if nblk % 2 == 1:
                    _act_mul_q8_group(base, n, ACT, qx, xd, xs, xd4, xs4, row, nblk, nblk - 1, 1, REP4)


@jk.jit
def _gelu_tanh_a(x, alpha):
    return gelu_tanh_f(x)


@jk.jit
def erf_f(x):
    """erf for float32 as a rational function of x^2 on [-4, 4] (erf is +-1 to f32 precision beyond): the
    coefficients of Eigen's/XLA's float erf (generic_fast_erf_float). The CPU backend has no erf intrinsic."""
    x = jk.minimum(jk.maximum(x, -4.0), 4.0)
    x2 = x * x
    p = x2 * -2.72614225801306e-10 + 2.77068142495902e-08
    p = p * x2 + -2.10102402082508e-06
    p = p * x2 + -5.69250639462346e-05
    p = p * x2 + -7.34990630326855e-04
    p = p * x2 + -2.95459980854025e-03
    p = p * x2 + -1.60960333262415e-02
    q = x2 * -1.45660718464996e-05 + -2.13374055278905e-04
    q = q * x2 + -1.68282697438203e-03
    q = q * x2 + -7.37332916720468e-03
    q = q * x2 + -1.42647390514189e-02
    return x * p / q


@jk.jit
def _gelu_erf_a(x, alpha):
    # exact GELU (BERT's "gelu", torch's default): 0.5 x (1 + erf(x / sqrt(2)))
    return 0.5 * x * (1.0 + erf_f(x * 0.7071067811865476))


@jk.jit
def _copy_a(x, alpha):
    return x


@jk.jit
def _scale_a(x, alpha):
    return x * alpha


@jk.jit
def _softcap_a(x, alpha):
    # cap * tanh(x / cap), alpha = cap
    return alpha * jk.tanh(x / alpha)


@jk.kernel
def unary_kernel(x, x_s, out, o_s, n, alpha, ACT: jk.constexpr, BLOCK: jk.constexpr):
    """out = ACT(x, alpha) elementwise over rows; grid (R, cdiv(n, BLOCK))."""
    t = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < n
    v = jk.load(x + t.to(jk.i64) * x_s + cols, mask=m, other=0.0).to(jk.f32)
    jk.store(out + t.to(jk.i64) * o_s + cols, ACT(v, alpha), mask=m)


@jk.kernel
def add_kernel(a, a_s, b, b_s, out, o_s, n, BLOCK: jk.constexpr):
    t = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < n
    av = jk.load(a + t.to(jk.i64) * a_s + cols, mask=m, other=0.0).to(jk.f32)
    bv = jk.load(b + t.to(jk.i64) * b_s + cols, mask=m, other=0.0).to(jk.f32)
    jk.store(out + t.to(jk.i64) * o_s + cols, av + bv, mask=m)


def _as_rows(a: np.ndarray, what: str):
    """A 1-D or 2-D array as (rows, cols, row stride, pointer); 1-D arrays are one row."""
    if not is_array(a):
        raise TypeError(f"{what}: expected a numpy array, got {type(a).__name__}")
    if a.ndim == 1:
        if a.shape[0] > 1 and a.strides[0] != a.itemsize:
            raise ValueError(f"{what}: a 1-D array must be contiguous")
        return 1, a.shape[0], a.shape[0], fptr(a, what)
    if a.ndim != 2:
        raise ValueError(f"{what}: expected a 1-D or 2-D array, got shape {a.shape}")
    return a.shape[0], a.shape[1], row_stride(a, what), fptr(a, what)


def _act_and_mul(name, act, gate_up, out, target):
    from .matmul import SplitK
    parts, ps = 1, 0
    if isinstance(gate_up, SplitK):
        # a split-K linear's slabs: summed in the kernel in slab order (its sum kernel's bits)
        parts, (R0, N0) = gate_up.S, gate_up.shape
        ps = R0 * N0
        gate_up = gate_up.parts.reshape(parts * R0, N0)[:R0]
    target = resolve_target(target, gate_up)
    R, n2, gs, gp = _as_rows(gate_up, f"{name}: gate_up")
    if gate_up.ndim != 2 or n2 % 2:
        raise ValueError(f"{name}: gate_up must be [tokens, 2 * intermediate], got {gate_up.shape}")
    n = n2 // 2
    if out is None:
        out = empty_like_dev(gate_up, (R, n), gate_up.dtype)
    check_shape(out, (R, n), f"{name}: out")
    _, _, os_, op = _as_rows(out, f"{name}: out")
    B = block_for(n, _BLOCK, target, has_half(gate_up, out))
    if launch_target(target).is_gpu:
        # elementwise: 1024-wide programs (8 elements a thread) spread a decode step's one row over the SMs;
        # the row-reduction width (4096) gave Llama-3-8B's 14336-wide row 4 programs, 5.3 us on the H200
        B = min(B, GPU_ELEMENTWISE_BLOCK)
    run(act_and_mul_kernel, (R, jk.cdiv(n, B)), (gp, gs, ps, op, os_, n), target, ACT=act, BLOCK=B,
        **({"PARTS": parts} if parts > 1 else {}))
    return out


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """out = silu(gate) * up for gate_up [T, 2*I] holding gate in its first I columns and up in the last I
    (vLLM's merged gate_up_proj layout). silu(x) = x / (1 + exp(-x)). Returns out [T, I]."""
    return _act_and_mul("silu_and_mul", silu, gate_up, out, target)


ACT_Q8_BLOCKS_PER_PROGRAM = None     # override of act_and_mul_q8's blocks per program (results never depend on it)
GPU_Q8_TILE_BLOCKS = 8              # GPUs, natural layout: 32-blocks a program quantises as one tile (any gives the same bits)


def _pow2_le(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def act_and_mul_q8(gate_up: np.ndarray, out: tuple, *, gelu: bool = False, layout: str = "natural",
                   out4: tuple | None = None, target=None) -> Q8Activations:
    """`silu_and_mul` (or with `gelu` `gelu_tanh_and_mul`) fused with `quantize_q8`: gate_up [T, 2*I] (I a
    multiple of 32) -> out = (qx int8 [T, I], scales f32 [T, I/32], sums f32 [T, I/32]) in `layout`, and the
    repeated scales into `out4` = (scales4, sums4) [T, I/8] when given. Bit-identical to
    quantize_q8(silu_and_mul(gate_up)) (the product is rounded to f32 as that stores it); one launch instead of
    two. Returns a Q8Activations for matmul_q8 (the down projection)."""
    name = "act_and_mul_q8"
    target = resolve_target(target, gate_up)
    R, n2, gs, gp = _as_rows(gate_up, f"{name}: gate_up")
    if gate_up.ndim != 2 or n2 % 64:
        raise ValueError(f"{name}: gate_up must be [tokens, 2 * intermediate] with intermediate a multiple of 32, "
                         f"got {gate_up.shape}")
    n = n2 // 2
    nblk = n // 32
    qx, xd, xs = out
    for a, shp, dt, nm in ((qx, (R, n), np.int8, "qx"), (xd, (R, nblk), np.float32, "scales"),
                           (xs, (R, nblk), np.float32, "sums")):
        if not is_array(a) or a.shape != shp or a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError(f"{name}: out {nm} must be a contiguous {np.dtype(dt)} array of shape {shp}")
    xd4 = xs4 = None
    if out4 is not None:
        xd4, xs4 = out4
        for a, nm in ((xd4, "scales4"), (xs4, "sums4")):
            if not is_array(a) or a.shape != (R, 4 * nblk) or a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(f"{name}: out4 {nm} must be a contiguous float32 array of shape {(R, 4 * nblk)}")
    from .quant import LAYOUTS
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    G = _eff_group(layout, nblk)
    t = launch_target(target)
    # CUDA/HIP: 8 blocks (256 values) a CTA, a row's groups in parallel; CPUs (and lavapipe, where a program
    # costs more than this work): one program a row, so a decode step's single row never waits for a second
    # thread to wake (a multi-program launch on a busy 2-core host measured milliseconds, a single one ~2 us)
    GP = max(1, 8 // G) if t.fast_workgroups else max(1, nblk // G)
    if ACT_Q8_BLOCKS_PER_PROGRAM is not None:          # tests: the GPU split on a CPU tier
        GP = max(1, ACT_Q8_BLOCKS_PER_PROGRAM // G)
    nat = {}
    if G == 1 and t.fast_workgroups and nblk >= 2:
        # the natural layout on a GPU: a program's blocks as one tile over the CTA's threads
        nat = {"NAT": _pow2_le(nblk, GPU_Q8_TILE_BLOCKS)}
        GP = nat["NAT"]
    run(act_and_mul_q8_kernel, (R, max(1, -(-(nblk // G) // GP))),
        (gp, gs, qx, xd, xs, xd if xd4 is None else xd4, xs if xs4 is None else xs4, n, nblk),
        target, ACT=gelu_tanh_f if gelu else silu, G=G, GP=GP, REP4=xd4 is not None, **nat)
    return Q8Activations(qx, xd, xs, layout, xd4, xs4)


def gelu_tanh_and_mul(gate_up: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """out = gelu_tanh(gate) * up (Gemma's GeGLU, vLLM's GeluAndMul(approximate="tanh")); layout as
    `silu_and_mul`."""
    return _act_and_mul("gelu_tanh_and_mul", gelu_tanh_f, gate_up, out, target)


def _unary(name, act, x, out, alpha, target):
    target = resolve_target(target, x)
    R, n, xs, xp = _as_rows(x, f"{name}: x")
    if out is None:
        out = empty_like_dev(x, x.shape, x.dtype)
    check_shape(out, x.shape, f"{name}: out")
    _, _, os_, op = _as_rows(out, f"{name}: out")
    B = block_for(n, _BLOCK, target, has_half(x, out))
    run(unary_kernel, (R, jk.cdiv(n, B)), (xp, xs, op, os_, n, float(alpha)), target, ACT=act, BLOCK=B)
    return out


def gelu_tanh(x: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) elementwise (GPT-2's gelu_new) on a 1-D or 2-D array;
    `out` may be `x`."""
    return _unary("gelu_tanh", _gelu_tanh_a, x, out, 0.0, target)


def gelu(x: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """Exact GELU 0.5 x (1 + erf(x / sqrt(2))) elementwise (BERT's "gelu") on a 1-D or 2-D array; `out` may
    be `x`."""
    return _unary("gelu", _gelu_erf_a, x, out, 0.0, target)


def copy(x: np.ndarray, out: np.ndarray, *, target=None) -> np.ndarray:
    """out[...] = x for 1-D or 2-D arrays of one shape (row-strided views; converts between float32,
    float16 and uint16 = bf16, rounding to nearest even)."""
    return _unary("copy", _copy_a, x, out, 0.0, target)


def scale_inplace(x: np.ndarray, alpha: float, *, target=None) -> np.ndarray:
    """x *= alpha (f32 math); returns x."""
    return _unary("scale_inplace", _scale_a, x, x, alpha, target)


def softcap_inplace(x: np.ndarray, cap: float, *, target=None) -> np.ndarray:
    """x = cap * tanh(x / cap) in place (Gemma 2's attention / final-logit soft-capping); returns x."""
    if not cap > 0:
        raise ValueError(f"softcap_inplace: cap must be positive, got {cap}")
    return _unary("softcap_inplace", _softcap_a, x, x, cap, target)


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """out = a + b for 1-D or 2-D arrays of one shape (row-strided views accepted; dtypes may differ, the
    sum is computed in f32 and rounded to out's dtype). `out` may alias `a` or `b`. Returns out."""
    target = resolve_target(target, a)
    R, n, as_, ap = _as_rows(a, "add: a")
    check_shape(b, a.shape, "add: b")
    _, _, bs, bp = _as_rows(b, "add: b")
    if out is None:
        out = empty_like_dev(a, a.shape, a.dtype)
    check_shape(out, a.shape, "add: out")
    _, _, os_, op = _as_rows(out, "add: out")
    B = block_for(n, _BLOCK, target, has_half(a, b, out))
    run(add_kernel, (R, jk.cdiv(n, B)), (ap, as_, bp, bs, op, os_, n), target, BLOCK=B)
    return out


def add_inplace(a: np.ndarray, b: np.ndarray, *, target=None) -> np.ndarray:
    """a += b (residual update); returns a."""
    return add(a, b, a, target=target)


__all__ = ["silu_and_mul", "gelu_tanh_and_mul", "act_and_mul_q8", "gelu_tanh", "add", "add_inplace", "copy", "scale_inplace",
           "softcap_inplace", "silu", "gelu_tanh_f"]
