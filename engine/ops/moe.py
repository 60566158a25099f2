"""Mixture-of-experts ops: top-k routing, the routed-experts MLP over tokens grouped by expert, and the
weighted combine. Entry point for model code: `moe_mlp` (or the pieces: `route_topk`, `routed_experts`,
`group_by_expert_dev`, `expert_gate_up`, `expert_down`, `combine_experts`).

Pipeline for T tokens, E experts, top-k K (every step a DSL kernel, no host work: a step replays from a
recorded graph; grids depend on T only):

1. `route_topk(logits)` -> (ids [T, K] int32, weights [T, K] f32): one program per token; the model's
   normalisation: SOFTMAX_TOPK (softmax over all E, then the K largest; Qwen2/3-MoE, OLMoE), with NORM the K
   weights divided by their sum (Mixtral, Qwen3-MoE with norm_topk_prob); TOPK_SOFTMAX (the K largest
   logits, then a softmax over those K: gpt-oss). Ties pick the lower expert id (as torch.topk on CPU).
2. `group_by_expert_dev(ids, E, BM)` (one kernel; `group_by_expert` is the same in numpy, for host-side
   callers; decode-sized steps skip grouping, each pair its own tile: see `routed_experts`): the T*K pairs
   stably sorted by expert (within an expert by token, then slot), per-expert segments cut into tiles of at
   most BM pairs: (pair token [P], position of pair (t, j) in that order [T, K], tile expert/start/length).
3. the pairs' input rows gathered (`embedding` over the activations), then `expert_gate_up`: one launch over
   (tile, column block): act[p] = silu(x[p] @ Wg[e]^T) * (x[p] @ Wu[e]^T) for the pairs p of the tile, and
   `expert_down`: y[p] = act[p] @ Wd[e]^T (one launch likewise).
4. `combine_experts`: out[t] = sum_j w[t, j] * y[pos[t, j]] in the token's own top-k order (j = 0, 1, ...),
   plus an optional gated shared expert sigmoid(g[t]) * s[t] (Qwen2-MoE) added last.

Batch invariance: every output element of the expert kernels is one V-lane FMA chain over K (the tail
masked into the same chain) and one lane-sum tree, whatever tile or batch the pair sits in; rows of a tile
past its length are masked (their loads read zeros, their stores are dropped), never shifted onto other
rows. The combine order is the token's own top-k order. So a token's output bits do not depend on which
other tokens share the step.

Weights: an expert tensor is [E, N, K] (f32, f16, or uint16 holding bf16), experts contiguous; the gate/up
form is [E, 2*I, H] (gate rows first, as HF's fused gate_up_proj and as vLLM's w13) or two [E, I, H] arrays.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import check_dtype, fptr, is_array, is_device, launch_target, resolve_target, run

SOFTMAX_TOPK = 0
TOPK_SOFTMAX = 1


# ---------------------------------------------------------------------------------------------- routing
@jk.kernel(do_not_specialize=("T",))
def _route_kernel(logits, ld, E, T, ids, wts, K: jk.constexpr, KB: jk.constexpr, EB: jk.constexpr, MODE: jk.constexpr,
                  NORM: jk.constexpr):
    t = jk.program_id(0)
    offs = jk.arange(0, EB)
    valid = offs < E
    v = jk.load(logits + t.to(jk.i64) * ld + offs, mask=valid, other=-float("inf")).to(jk.f32)
    if MODE == 0:
        m = jk.max(v, axis=0)
        e = jk.where(valid, jk.exp(v - m), 0.0)
        p = e / jk.sum(e, axis=0)
        cur = jk.where(valid, p, -1.0)
    else:
        cur = v
    kk = jk.arange(0, KB)
    selw = jk.zeros((KB,), jk.f32)
    seli = jk.zeros((KB,), jk.i32)
    for j in jk.static_range(K):
        best = jk.max(cur, axis=0)
        i = jk.min(jk.where(cur == best, offs, 2147483647), axis=0)
        selw = jk.where(kk == j, best, selw)
        seli = jk.where(kk == j, i, seli)
        cur = jk.where(offs == i, -float("inf"), cur)
    km = kk < K
    if MODE == 1:
        # softmax over the K selected logits (slot 0 holds their maximum)
        top = jk.max(jk.where(km, selw, -float("inf")), axis=0)
        selw = jk.where(km, jk.exp(selw - top), 0.0)
    if NORM or MODE == 1:
        selw = selw / jk.sum(jk.where(km, selw, 0.0), axis=0)
    jk.store(ids + t * K + kk, seli, mask=km)
    jk.store(wts + t * K + kk, selw, mask=km)


def route_topk(logits: np.ndarray, num_experts: int, top_k: int, *, norm: bool = False, mode: int = SOFTMAX_TOPK,
               ids: np.ndarray | None = None, weights: np.ndarray | None = None, target=None):
    """Top-k routing of router logits f32 [T, >= num_experts] (the first num_experts columns; rows may be
    strided) -> (ids int32 [T, K], weights f32 [T, K]); see the module docs for `mode` and `norm`."""
    target = resolve_target(target, logits)
    check_dtype(logits, np.float32, "route_topk: logits")
    if logits.ndim != 2 or logits.shape[1] < num_experts or logits.strides[1] != 4:
        raise ValueError(f"route_topk: logits must be [T, >= {num_experts}] with contiguous rows, got "
                         f"{logits.shape}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route_topk: top_k must be in [1, {num_experts}], got {top_k}")
    T = logits.shape[0]
    ids = np.empty((T, top_k), np.int32) if ids is None else ids
    weights = np.empty((T, top_k), np.float32) if weights is None else weights
    EB = 16
    while EB < num_experts:
        EB *= 2
    run(_route_kernel, (T,), (logits, logits.strides[0] // 4, int(num_experts), T, ids, weights), target,
        K=int(top_k), KB=max(2, 1 << (int(top_k) - 1).bit_length()), EB=EB, MODE=int(mode), NORM=bool(norm))
    return ids, weights


# --------------------------------------------------------------------------------------------- grouping
def group_by_expert(ids: np.ndarray, num_experts: int, block_m: int):
    """Host-side grouping of the (token, slot) pairs of ids int32 [T, K] by expert (numpy, no per-token loop).

    Returns (pair_token int32 [P], pair_pos int32 [T, K], tile_expert, tile_start, tile_len int32 [n_tiles]):
    pair p (in expert order) belongs to token pair_token[p]; pair (t, j) sits at pair_pos[t, j]; tile i
    covers pairs [tile_start[i], tile_start[i] + tile_len[i]) of expert tile_expert[i], tile_len <= block_m.
    """
    T, K = ids.shape
    flat = ids.reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"group_by_expert: expert id outside [0, {num_experts})")
    order = np.argsort(flat, kind="stable").astype(np.int32)
    pair_token = order // K
    pair_pos = np.empty(flat.size, np.int32)
    pair_pos[order] = np.arange(flat.size, dtype=np.int32)
    counts = np.bincount(flat, minlength=num_experts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ntiles = -(-counts // block_m)
    tile_expert = np.repeat(np.arange(num_experts, dtype=np.int32), ntiles)
    first_tile = np.concatenate(([0], np.cumsum(ntiles)[:-1]))
    within = np.arange(tile_expert.size) - first_tile[tile_expert]
    tile_start = (starts[tile_expert] + within * block_m).astype(np.int32)
    tile_end = starts[tile_expert] + counts[tile_expert]
    tile_len = np.minimum(block_m, tile_end - tile_start).astype(np.int32)
    return pair_token.astype(np.int32), pair_pos.reshape(T, K), tile_expert, tile_start, tile_len


@jk.kernel(do_not_specialize=("P", "max_tiles"))
def _group_kernel(ids, P, E, max_tiles, counts, starts, pair_token, pair_pos, tile_expert, tile_start, tile_len,
                  K: jk.constexpr, BM: jk.constexpr):
    # One program: a stable counting sort of the P = T*K (token, slot) pairs by expert, then per-expert tiles
    # of at most BM pairs; tiles past the last are written with length 0 (the expert kernels skip them).
    for e in range(0, E, 1):
        jk.store(counts + e, 0)
    for p in range(0, P, 1):
        e = jk.load(ids + p)
        c = jk.load(counts + e)
        jk.store(pair_pos + p, c)              # rank within the expert, made absolute below
        jk.store(counts + e, c + 1)
    run = 0
    nt = 0
    for e in range(0, E, 1):
        c = jk.load(counts + e)
        jk.store(starts + e, run)
        n = (c + BM - 1) // BM
        for i in range(0, n, 1):
            jk.store(tile_expert + nt + i, e)
            jk.store(tile_start + nt + i, run + i * BM)
            jk.store(tile_len + nt + i, jk.minimum(c - i * BM, BM))
        nt = nt + n
        run = run + c
    for i in range(nt, max_tiles, 1):
        jk.store(tile_expert + i, 0)
        jk.store(tile_start + i, 0)
        jk.store(tile_len + i, 0)
    for p in range(0, P, 1):
        e = jk.load(ids + p)
        q = jk.load(starts + e) + jk.load(pair_pos + p)
        jk.store(pair_pos + p, q)
        jk.store(pair_token + q, p // K)


def max_tiles(P: int, E: int, block_m: int) -> int:
    """An upper bound on the tiles of P pairs over E experts: sum ceil(c_e / BM) <= P / BM + min(E, P)."""
    return -(-P // block_m) + min(E, P)


def group_by_expert_dev(ids, num_experts, block_m, scratch=None, target=None):
    """`group_by_expert` as one kernel (no host work: graph-capturable): the same pair order and tiles, plus
    empty (length 0) tiles up to `max_tiles` so the expert kernels' grid depends only on T. Returns
    (pair_token, pair_pos [T, K], tile_expert, tile_start, tile_len), int32."""
    T, K = ids.shape
    P = T * K
    E = int(num_experts)
    MT = max_tiles(P, E, block_m)
    get = scratch or (lambda name, shape, dtype=np.int32: np.empty(shape, dtype))
    counts, starts = get("moe.g.counts", (E,), np.int32), get("moe.g.starts", (E,), np.int32)
    pair_token, pair_pos = get("moe.g.tok", (P,), np.int32), get("moe.g.pos", (T, K), np.int32)
    te, ts, tl = (get(f"moe.g.{n}", (MT,), np.int32) for n in ("te", "ts", "tl"))
    run(_group_kernel, (1,), (ids, P, E, MT, counts, starts, pair_token, pair_pos, te, ts, tl), target,
        K=int(K), BM=int(block_m))
    return pair_token, pair_pos, te, ts, tl


# ------------------------------------------------------------------------------------- expert matmuls
@jk.jit
def silu_mul(g, u):
    """SwiGLU (Mixtral, Qwen-MoE, OLMoE): silu(gate) * up."""
    return g / (1.0 + jk.exp(-g)) * u


@jk.jit
def swiglu_oai(g, u):
    """gpt-oss's clamped SwiGLU (alpha 1.702, limit 7): (clamp(u, -7, 7) + 1) * g' * sigmoid(1.702 g'),
    g' = min(g, 7)."""
    g = jk.minimum(g, 7.0)
    u = jk.maximum(jk.minimum(u, 7.0), -7.0)
    return (u + 1.0) * (g * jk.sigmoid(1.702 * g))


ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}      # the ACT constexpr of _expert_linear_kernel


@jk.kernel
def _expert_linear_kernel(x, ldx, w, w_es, u, u_es, u_off, bias, b_es, b_uoff, out, ldo, tile_expert, tile_start,
                          tile_len, N, K, GATED: jk.constexpr, ACT: jk.constexpr, RS: jk.constexpr,
                          HAS_BIAS: jk.constexpr, BM: jk.constexpr, BN: jk.constexpr, V: jk.constexpr):
    # Grid (tiles, cdiv(N, BN)). Tile i: pairs rows [s, s + L) (L <= BM) of x, expert e = tile_expert[i].
    # GATED: out[p, n] = silu(x[p] . w[e, n]) * (x[p] . u[e, n]) (u's expert e starts at u + e*u_es + u_off:
    # the second half of a fused [E, 2N, K] gate/up or its own array); else out[p, n] = x[p] . w[e, n].
    # RS: weight rows per output (2: gpt-oss's interleaved gate/up rows, u_off = one row); ACT the gated
    # activation (ACTIVATIONS: 0 silu_mul, 1 swiglu_oai); HAS_BIAS: + bias[e, n*RS] (+ bias[e, n*RS + b_uoff]
    # for up) before the activation.
    tile = jk.program_id(0)
    e = jk.load(tile_expert + tile).to(jk.i64)
    s = jk.load(tile_start + tile).to(jk.i64)
    L = jk.load(tile_len + tile)
    if L > 0:                                   # tiles past the last (group_by_expert_dev) are empty
        ri = jk.arange(0, BM)
        rm = ri < L
        n0 = jk.minimum(jk.program_id(1) * BN, N - BN).to(jk.i64)     # the last block overlaps its neighbour
        K64 = K.to(jk.i64)
        rows = s + ri.to(jk.i64)
        wrows = n0 + jk.arange(0, BN).to(jk.i64)
        kv = jk.arange(0, V)
        xrow = x + rows[:, None] * ldx.to(jk.i64)
        wbase = w + e * w_es
        wrow = wbase + (wrows * RS)[:, None] * K64
        acc = jk.zeros((BM, BN, V), jk.f32)
        if GATED:
            urow = u + e * u_es + u_off + (wrows * RS)[:, None] * K64
            accu = jk.zeros((BM, BN, V), jk.f32)
        xmask = jk.broadcast_to(rm[:, None], (BM, V))
        kmain = K - K % V
        for k in range(0, kmain, V):
            xv = jk.load(xrow + (k + kv)[None, :], mask=xmask, other=0.0)
            wv = jk.load(wrow + (k + kv)[None, :]).to(jk.f32)
            acc = jk.fma(xv[:, None, :], wv[None, :, :], acc)
            if GATED:
                uv = jk.load(urow + (k + kv)[None, :]).to(jk.f32)
                accu = jk.fma(xv[:, None, :], uv[None, :, :], accu)
        if kmain < K:
            km = (kmain + kv) < K
            xv = jk.load(xrow + (kmain + kv)[None, :], mask=xmask & km[None, :], other=0.0)
            wm = jk.broadcast_to(km[None, :], (BN, V))
            wv = jk.load(wrow + (kmain + kv)[None, :], mask=wm, other=0.0).to(jk.f32)
            acc = jk.fma(xv[:, None, :], wv[None, :, :], acc)
            if GATED:
                uv = jk.load(urow + (kmain + kv)[None, :], mask=wm, other=0.0).to(jk.f32)
                accu = jk.fma(xv[:, None, :], uv[None, :, :], accu)
        res = jk.sum(acc, axis=2)
        if HAS_BIAS:
            res = res + jk.load(bias + e * b_es + wrows * RS).to(jk.f32)[None, :]
        if GATED:
            resu = jk.sum(accu, axis=2)
            if HAS_BIAS:
                resu = resu + jk.load(bias + e * b_es + b_uoff + wrows * RS).to(jk.f32)[None, :]
            if ACT == 0:
                res = silu_mul(res, resu)
            else:
                res = swiglu_oai(res, resu)
        jk.store(out + rows[:, None] * ldo.to(jk.i64) + wrows[None, :], res,
                 mask=jk.broadcast_to(rm[:, None], (BM, BN)))


def _lanes(target) -> int:
    return max(4, launch_target(target).vector_bits // 32)


def _tiles(target, gated: bool, n: int):
    """(BN, V): weight rows per program; BM (pairs per tile) is the caller's (group_by_expert's block_m)."""
    V = _lanes(target)
    BN = 4 if launch_target(target).has("avx512f") else (2 if gated else 4)
    while BN > n:
        BN //= 2
    return BN, V


def _weight(w, what):
    if not is_array(w) or w.ndim != 3 or not w.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous [experts, N, K] array, got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    return fptr(w, what)


def _expert_linear(xs, w, w_up, out, tiles, gated, block_m, target, what, bias=None, act="silu",
                   interleaved=False):
    tile_expert, tile_start, tile_len = tiles
    E, N2, K = w.shape
    RS = 1
    if gated and w_up is None:          # fused [E, 2N, K]: gate rows then up rows, or interleaved (gpt-oss)
        if N2 % 2:
            raise ValueError(f"{what}: a fused gate/up weight needs an even row count, got {N2}")
        N = N2 // 2
        u, u_es, u_off = w, N2 * K, N * K
        if interleaved:
            RS, u_off = 2, K
    elif interleaved:
        raise ValueError(f"{what}: interleaved gate/up rows need the fused [E, 2I, H] weight")
    elif gated:
        if w_up.shape != w.shape or w_up.dtype != w.dtype:
            raise ValueError(f"{what}: up weight {w_up.dtype} {w_up.shape} differs from the gate weight "
                             f"{w.dtype} {w.shape}")
        N = N2
        u, u_es, u_off = w_up, N2 * K, 0
    else:
        N = N2
        u, u_es, u_off = w, 0, 0
    check_dtype(xs, np.float32, f"{what}: x")
    if xs.ndim != 2 or xs.shape[1] != K or xs.strides[1] != 4:
        raise ValueError(f"{what}: x must be [pairs, {K}] float32 with contiguous rows, got {xs.shape}")
    P = xs.shape[0]
    if out is None:
        from ._hostargs import empty_like_dev
        out = empty_like_dev(xs, (P, N), np.float32)
    if out.shape != (P, N) or out.dtype != np.float32 or out.strides[1] != 4:
        raise ValueError(f"{what}: out must be float32 [{P}, {N}] with contiguous rows, got {out.dtype} {out.shape}")
    if act not in ACTIVATIONS:
        raise ValueError(f"{what}: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    b_es = b_uoff = 0
    if bias is not None:
        nb = 2 * N if gated and w_up is None else N
        if bias.shape != (E, nb) or bias.dtype != np.float32 or not bias.flags.c_contiguous:
            raise ValueError(f"{what}: bias must be a contiguous float32 [{E}, {nb}] array, got {bias.dtype} "
                             f"{bias.shape}")
        if gated and w_up is not None:
            raise ValueError(f"{what}: a bias needs the fused gate/up weight")
        b_es = nb
        b_uoff = (1 if interleaved else N) if gated else 0
    BN, V = _tiles(target, gated, N)
    run(_expert_linear_kernel, (len(tile_expert), jk.cdiv(N, BN)),
        (xs, xs.strides[0] // 4 if P > 1 else K, _weight(w, what), N2 * K, _weight(u, what), u_es, u_off,
         bias if bias is not None else out, b_es, b_uoff,
         out, out.strides[0] // 4 if P > 1 else N, tile_expert, tile_start, tile_len, N, K),
        target, GATED=bool(gated), ACT=ACTIVATIONS[act], RS=RS, HAS_BIAS=bias is not None, BM=int(block_m), BN=BN,
        V=V)
    return out


def expert_gate_up(xs, w_gate_up, tiles, block_m, out=None, *, w_up=None, bias=None, act="silu", interleaved=False,
                   target=None):
    """act[p] = ACT(xs[p] @ Wg[e]^T, xs[p] @ Wu[e]^T) for each pair p of each tile (e = the tile's expert);
    ACT "silu": silu(g) * u, "swiglu_oai": gpt-oss's clamped form. Weights: w_gate_up [E, 2*I, H] (gate rows
    first; `interleaved`: gate/up rows alternate, as gpt-oss stores them), or the gate [E, I, H] with `w_up`
    [E, I, H]. `bias` f32 [E, 2*I] in the weight's row order (fused form only). `tiles` = (tile_expert,
    tile_start, tile_len) from group_by_expert with the same block_m. Returns act f32 [P, I]."""
    target = resolve_target(target, xs)
    return _expert_linear(xs, w_gate_up, w_up, out, tiles, True, block_m, launch_target(target), "expert_gate_up",
                          bias=bias, act=act, interleaved=interleaved)


def expert_down(act, w_down, tiles, block_m, out=None, *, bias=None, target=None):
    """y[p] = act[p] @ Wd[e]^T (+ bias[e]) per pair (w_down [E, H, I], bias f32 [E, H]); returns y f32 [P, H]."""
    target = resolve_target(target, act)
    return _expert_linear(act, w_down, None, out, tiles, False, block_m, launch_target(target), "expert_down",
                          bias=bias)


# ---------------------------------------------------------------------------------------------- combine
@jk.kernel
def _combine_kernel(y, ldy, pos, wts, shared, lds, sgate, ldg, out, ldo, N, K: jk.constexpr,
                    SHARED: jk.constexpr, GATE: jk.constexpr, BLOCK: jk.constexpr):
    t = jk.program_id(0)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < N
    acc = jk.zeros((BLOCK,), jk.f32)
    for j in jk.static_range(K):
        p = jk.load(pos + t * K + j).to(jk.i64)
        wj = jk.load(wts + t * K + j)
        acc = acc + wj * jk.load(y + p * ldy + cols, mask=m, other=0.0)
    if SHARED:
        sv = jk.load(shared + t.to(jk.i64) * lds + cols, mask=m, other=0.0)
        if GATE:
            g = jk.load(sgate + t.to(jk.i64) * ldg)
            sv = jk.sigmoid(g) * sv
        acc = acc + sv
    jk.store(out + t.to(jk.i64) * ldo + cols, acc, mask=m)


def combine_experts(y, pair_pos, weights, out=None, *, shared=None, shared_gate=None, target=None):
    """out[t] = sum_j weights[t, j] * y[pair_pos[t, j]] (j in order), + sigmoid(shared_gate[t, 0]) * shared[t]
    when given (shared_gate None: + shared[t]). y f32 [P, H]; returns out f32 [T, H] (rows may be strided)."""
    target = resolve_target(target, y)
    T, K = pair_pos.shape
    H = y.shape[1]
    if out is None:
        from ._hostargs import empty_like_dev
        out = empty_like_dev(y, (T, H), np.float32)
    for a, what in ((y, "y"), (out, "out")):
        if a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != H or a.strides[1] != 4:
            raise ValueError(f"combine_experts: {what} must be float32 [*, {H}] with contiguous rows")
    if out.shape[0] != T:
        raise ValueError(f"combine_experts: out has {out.shape[0]} rows, expected {T}")
    check_dtype(pair_pos, np.int32, "combine_experts: pair_pos")
    check_dtype(weights, np.float32, "combine_experts: weights")
    if shared is not None and (shared.shape != (T, H) or shared.dtype != np.float32 or shared.strides[1] != 4):
        raise ValueError(f"combine_experts: shared must be float32 [{T}, {H}] with contiguous rows")
    if shared_gate is not None and (shared_gate.ndim != 2 or shared_gate.shape[0] != T
                                    or shared_gate.dtype != np.float32):
        raise ValueError(f"combine_experts: shared_gate must be float32 [{T}, >= 1]")
    BLOCK = 64
    ld = lambda a: a.strides[0] // 4 if a.shape[0] > 1 else a.shape[1]  # noqa: E731
    run(_combine_kernel, (T, jk.cdiv(H, BLOCK)),
        (y, ld(y), pair_pos if is_device(pair_pos) else np.ascontiguousarray(pair_pos),
         weights if is_device(weights) else np.ascontiguousarray(weights),
         shared if shared is not None else y, ld(shared) if shared is not None else 0,
         shared_gate if shared_gate is not None else y, ld(shared_gate) if shared_gate is not None else 0,
         out, ld(out), H),
        target, K=int(K), SHARED=shared is not None, GATE=shared_gate is not None, BLOCK=BLOCK)
    return out


def moe_mlp(x, router_logits, w_gate_up, w_down, top_k, *, w_up=None, norm=False, mode=SOFTMAX_TOPK, out=None,
            shared=None, shared_gate=None, gate_up_bias=None, down_bias=None, act="silu", interleaved=False,
            scratch=None, target=None):
    """The routed-experts MLP (steps 1-4 of the module docs) for x f32 [T, H] and its router logits f32
    [T, >= E]: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the token's top-k experts
    e = ids[t, j] (+ the shared term, see `combine_experts`). w_gate_up [E, 2*I, H] (or the gate [E, I, H]
    with `w_up` [E, I, H]), w_down [E, H, I]. gpt-oss: mode=TOPK_SOFTMAX, act="swiglu_oai", interleaved=True
    and the expert biases gate_up_bias [E, 2*I] / down_bias [E, H].
    `scratch(name, shape, dtype)` supplies reusable buffers (default: fresh arrays). Returns out f32 [T, H]."""
    target = resolve_target(target, x)
    E = w_gate_up.shape[0]
    I = w_gate_up.shape[1] if w_up is not None else w_gate_up.shape[1] // 2
    if w_down.ndim != 3 or w_down.shape[0] != E or w_down.shape[2] != I:
        raise ValueError(f"moe_mlp: w_down {getattr(w_down, 'shape', None)} does not match the gate/up weights "
                         f"{w_gate_up.shape} (expected [{E}, H, {I}])")
    T, H = x.shape
    get = scratch or (lambda name, shape, dtype=np.float32: np.empty(shape, dtype))
    ids, wts = route_topk(router_logits, E, top_k, norm=norm, mode=mode, ids=get("moe.ids", (T, top_k), np.int32),
                          weights=get("moe.w", (T, top_k), np.float32), target=target)
    return routed_experts(x, ids, wts, lambda xs, tiles, bm, o: expert_gate_up(xs, w_gate_up, tiles, bm, o,
                                                                                   w_up=w_up, bias=gate_up_bias,
                                                                                   act=act, interleaved=interleaved,
                                                                                   target=target),
                          lambda a, tiles, bm, o: expert_down(a, w_down, tiles, bm, o, bias=down_bias,
                                                              target=target),
                          E, I, out=out, shared=shared, shared_gate=shared_gate, scratch=get, target=target)


DIRECT_MAX_TOKENS = 2      # up to here the pairs run ungrouped (see routed_experts)
_direct_tables: dict = {}


def capturing() -> bool:
    """Whether launches are being recorded into a jk.capture() graph (they do not run: no host work may read
    their results)."""
    from jitkern.runtime import launch as _launch_mod
    return getattr(_launch_mod._capture, "graph", None) is not None


def direct_pairs(T: int, K: int, like=None):
    """The ungrouped pair tables for T tokens and top-k K: pair p = (t, j) = (p // K, p % K) is its own tile of
    one row. Cached per (T, K) (and device, when `like` is a device array): stable addresses, as recorded
    graphs need."""
    dev = like.device if is_device(like) else None
    key = (int(T), int(K), id(dev))
    tab = _direct_tables.get(key)
    if tab is None:
        P = T * K
        ar = np.arange(P, dtype=np.int32)
        tab = (ar // K, ar.reshape(T, K), ar, np.ones(P, np.int32))
        if dev is not None:
            from jitkern.runtime.device import DeviceArray
            tab = tuple(DeviceArray.from_numpy(a, device=dev) for a in tab)
        _direct_tables[key] = (tab, dev)
        return tab
    return tab[0]


def routed_experts(x, ids, wts, gate_up_fn, down_fn, num_experts, inter, *, out=None, shared=None, shared_gate=None,
                   scratch=None, direct=None, host_tiles=False, target=None):
    """Steps 2-4 with the expert matmuls given as callables (dense: expert_gate_up / expert_down; quantised
    experts: see engine.models.moe): gate_up_fn(xs [P, H], tiles, block_m, out [P, I]) and
    down_fn(act [P, I], tiles, block_m, out [P, H]) over the pairs grouped by expert.

    Grouping: `group_by_expert_dev` (one kernel; tiles padded with empty ones to a count fixed by T), so a step
    is all kernels with grids fixed by T and replays from a recorded graph with new routing. `host_tiles`:
    numpy's `group_by_expert` instead (callables that read the tiles on the host, e.g. the quantised experts'
    per-expert loop). `direct` (default: T <= DIRECT_MAX_TOKENS): no grouping at all, every pair is its own
    one-row tile whose expert the kernels read from `ids`. Grouping only adds weight reuse between tokens that
    share an expert; each output row's arithmetic is the same every way, so all give the same bits."""
    from .embedding import embedding
    T, H = x.shape
    K = ids.shape[1]
    P = T * K
    get = scratch or (lambda name, shape, dtype=np.float32: np.empty(shape, dtype))
    if out is None:
        out = np.empty((T, H), np.float32)
    if T == 0:
        return out
    if direct is None:
        direct = T <= DIRECT_MAX_TOKENS
    if not ids.flags.c_contiguous:
        raise ValueError("routed_experts: ids must be a contiguous [T, K] int32 array")
    if direct:
        pair_token, pair_pos, ar, ones = direct_pairs(T, K, like=ids)
        block_m = 1
        tiles = [ids.reshape(-1), ar, ones]
    elif host_tiles:
        if is_device(ids):
            raise ValueError("routed_experts: host-side tiles need host arrays")
        if capturing():
            raise RuntimeError("routed_experts: host-side tiles cannot be recorded into a graph")
        counts_max = int(np.bincount(ids.reshape(-1), minlength=num_experts).max())
        block_m = 1 if counts_max == 1 else 2
        pair_token, pair_pos, *tiles = group_by_expert(ids, num_experts, block_m)
    else:
        block_m = 2      # fixed (a graph's grids may not follow the routing)
        pair_token, pair_pos, *tiles = group_by_expert_dev(ids, num_experts, block_m, scratch=get, target=target)
    xs = get("moe.xs", (P, H))
    embedding(pair_token, x if x.flags.c_contiguous else np.ascontiguousarray(x), out=xs, check_ids=False,
              target=target)
    act = gate_up_fn(xs, tiles, block_m, get("moe.act", (P, inter)))
    y = down_fn(act, tiles, block_m, get("moe.y", (P, H)))
    return combine_experts(y, pair_pos, wts, out=out, shared=shared, shared_gate=shared_gate, target=target)


__all__ = ["routed_experts", "route_topk", "group_by_expert", "group_by_expert_dev", "max_tiles", "expert_gate_up",
           "expert_down", "combine_experts", "moe_mlp", "direct_pairs", "capturing", "silu_mul", "swiglu_oai",
           "SOFTMAX_TOPK", "TOPK_SOFTMAX", "ACTIVATIONS", "DIRECT_MAX_TOKENS"]


# ------------------------------------------------------------------------- DeepSeek-V3 (sigmoid) routing
SIGMOID_GROUP_TOPK = 2       # MoESpec.mode for route_sigmoid_group (DeepSeek-V3's noaux_tc router)


@jk.kernel(do_not_specialize=("T",))
def _route_sigmoid_kernel(logits, ld, bias, E, T, ids, wts, scale, K: jk.constexpr, KB: jk.constexpr,
                          EB: jk.constexpr, NG: jk.constexpr, GB: jk.constexpr, GS: jk.constexpr, TG: jk.constexpr,
                          NORM: jk.constexpr, SOFTMAX: jk.constexpr):
    t = jk.program_id(0)
    offs = jk.arange(0, EB)
    valid = offs < E
    if SOFTMAX:
        v = jk.load(logits + t.to(jk.i64) * ld + offs, mask=valid, other=-float("inf")).to(jk.f32)
        m = jk.max(v, axis=0)
        e = jk.where(valid, jk.exp(v - m), 0.0)
        sc = e / jk.sum(e, axis=0)
        ch = jk.where(valid, sc, -float("inf"))
    else:
        v = jk.load(logits + t.to(jk.i64) * ld + offs, mask=valid, other=0.0).to(jk.f32)
        sc = jk.sigmoid(v)
        ch = jk.where(valid, sc + jk.load(bias + offs, mask=valid, other=0.0), -float("inf"))
    if NG > 1:
        # group score: the sum of its two best choice scores (sigmoid, V3) or its best score (softmax, V2's
        # group_limited_greedy); only the TG best groups stay eligible
        grp = offs // GS
        ga = jk.arange(0, GB)
        gsv = jk.where(ga < NG, 0.0, -float("inf"))
        for g in jk.static_range(NG):
            cg = jk.where(grp == g, ch, -float("inf"))
            b1 = jk.max(cg, axis=0)
            i1 = jk.min(jk.where(cg == b1, offs, 2147483647), axis=0)
            if SOFTMAX:
                gsv = jk.where(ga == g, b1, gsv)
            else:
                b2 = jk.max(jk.where(offs == i1, -float("inf"), cg), axis=0)
                gsv = jk.where(ga == g, b1 + b2, gsv)
        keep = jk.zeros((EB,), jk.i32)
        for j in jk.static_range(TG):
            gb = jk.max(gsv, axis=0)
            gi = jk.min(jk.where(gsv == gb, ga, 2147483647), axis=0)
            keep = jk.where(grp == gi, 1, keep)
            gsv = jk.where(ga == gi, -float("inf"), gsv)
        ch = jk.where(keep == 1, ch, -float("inf"))
    kk = jk.arange(0, KB)
    selw = jk.zeros((KB,), jk.f32)
    seli = jk.zeros((KB,), jk.i32)
    for j in jk.static_range(K):
        best = jk.max(ch, axis=0)
        i = jk.min(jk.where(ch == best, offs, 2147483647), axis=0)
        w = jk.sum(jk.where(offs == i, sc, 0.0), axis=0)
        selw = jk.where(kk == j, w, selw)
        seli = jk.where(kk == j, i, seli)
        ch = jk.where(offs == i, -float("inf"), ch)
    km = kk < K
    if NORM:
        selw = selw / (jk.sum(jk.where(km, selw, 0.0), axis=0) + 1e-20)
    jk.store(ids + t * K + kk, seli, mask=km)
    jk.store(wts + t * K + kk, selw * scale, mask=km)


def route_sigmoid_group(logits: np.ndarray, bias: np.ndarray, num_experts: int, top_k: int, *, n_group: int = 1,
                        topk_group: int = 1, norm: bool = True, scale: float = 1.0, ids: np.ndarray | None = None,
                        weights: np.ndarray | None = None, softmax: bool = False, target=None):
    """DeepSeek-V3 routing of router logits f32 [T, >= E] (HF DeepseekV3TopkRouter): s = sigmoid(logits);
    choice = s + bias (e_score_correction_bias, f32 [E]); with n_group > 1 the experts form n_group equal groups
    scored by the sum of their two best choices and only the topk_group best groups stay eligible; the K best
    eligible choices are picked, their weights are s (not s + bias), divided by their sum (+1e-20) when `norm`,
    times `scale` (routed_scaling_factor). Ties pick the lower id. Returns (ids int32 [T, K], weights f32 [T, K]).
    softmax=True is DeepSeek-V2's group_limited_greedy instead: s = softmax(logits) over the E experts, no bias
    (pass zeros), a group scores its best s; the rest as above (V2 passes norm=False)."""
    target = resolve_target(target, logits)
    check_dtype(logits, np.float32, "route_sigmoid_group: logits")
    check_dtype(bias, np.float32, "route_sigmoid_group: bias")
    E = int(num_experts)
    if logits.ndim != 2 or logits.shape[1] < E or logits.strides[1] != 4:
        raise ValueError(f"route_sigmoid_group: logits must be [T, >= {E}] with contiguous rows, got {logits.shape}")
    if bias.shape != (E,):
        raise ValueError(f"route_sigmoid_group: bias must be [{E}], got {bias.shape}")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group or (n_group > 1 and E // n_group < 2):
        raise ValueError(f"route_sigmoid_group: n_group {n_group} / topk_group {topk_group} do not fit {E} experts "
                         "(equal groups of at least 2)")
    if not 1 <= top_k <= E or top_k > topk_group * (E // n_group):
        raise ValueError(f"route_sigmoid_group: top_k must be in [1, {E}] and at most the experts of the "
                         f"{topk_group} eligible groups, got {top_k}")
    T = logits.shape[0]
    ids = np.empty((T, top_k), np.int32) if ids is None else ids
    weights = np.empty((T, top_k), np.float32) if weights is None else weights
    EB = 16
    while EB < E:
        EB *= 2
    run(_route_sigmoid_kernel, (T,), (logits, logits.strides[0] // 4, bias, E, T, ids, weights, float(scale)), target,
        K=int(top_k), KB=max(2, 1 << (int(top_k) - 1).bit_length()), EB=EB, NG=int(n_group),
        GB=max(2, 1 << (int(n_group) - 1).bit_length()), GS=E // int(n_group), TG=int(topk_group), NORM=bool(norm),
        SOFTMAX=bool(softmax))
    return ids, weights


__all__ += ["route_sigmoid_group", "SIGMOID_GROUP_TOPK"]


# ------------------------------------------------------- per-expert biases (quantised-expert path, gpt-oss)
@jk.kernel
def _expert_bias_kernel(y, ldy, pe, bias, b_es, out, ldo, N, GATED: jk.constexpr, ACT: jk.constexpr,
                        BLOCK: jk.constexpr):
    # grid (P, cdiv(N, BLOCK)); e = pe[p]. GATED: out[p, n] = ACT(y[p, n] + bias[e, n], y[p, N + n] +
    # bias[e, N + n]) (y holds gate columns then up columns); else out[p, n] = y[p, n] + bias[e, n].
    p = jk.program_id(0).to(jk.i64)
    cols = jk.program_id(1) * BLOCK + jk.arange(0, BLOCK)
    m = cols < N
    e = jk.load(pe + p).to(jk.i64)
    row = y + p * ldy.to(jk.i64)
    brow = bias + e * b_es
    g = jk.load(row + cols, mask=m, other=0.0) + jk.load(brow + cols, mask=m, other=0.0)
    if GATED:
        u = jk.load(row + N + cols, mask=m, other=0.0) + jk.load(brow + N + cols, mask=m, other=0.0)
        if ACT == 0:
            g = silu_mul(g, u)
        else:
            g = swiglu_oai(g, u)
    jk.store(out + p * ldo.to(jk.i64) + cols, g, mask=m)


def expert_bias_act(y, pair_expert, bias, out=None, *, gated=True, act="swiglu_oai", target=None):
    """Per-pair expert biases after matmuls that do not add them (the quantised experts' matmul_q):
    gated: y f32 [P, 2*I] (gate columns then up columns), bias f32 [E, 2*I] (gate then up) ->
    out [P, I] = ACT(gate + bias_g[e], up + bias_u[e]) with e = pair_expert[p]; not gated: y [P, N], bias
    [E, N] -> out = y + bias[e] (out may be y). Elementwise, so batch invariant."""
    target = resolve_target(target, y)
    P, W = y.shape
    N = W // 2 if gated else W
    E = bias.shape[0]
    if act not in ACTIVATIONS:
        raise ValueError(f"expert_bias_act: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if y.dtype != np.float32 or y.strides[1] != 4 or (gated and W % 2):
        raise ValueError(f"expert_bias_act: y must be float32 [P, {'2*I' if gated else 'N'}] with contiguous rows, "
                         f"got {y.dtype} {y.shape}")
    if bias.shape != (E, W) or bias.dtype != np.float32 or not bias.flags.c_contiguous:
        raise ValueError(f"expert_bias_act: bias must be a contiguous float32 [E, {W}] array, got {bias.dtype} "
                         f"{bias.shape}")
    check_dtype(pair_expert, np.int32, "expert_bias_act: pair_expert")
    if pair_expert.shape != (P,):
        raise ValueError(f"expert_bias_act: pair_expert must be [{P}], got {pair_expert.shape}")
    if out is None:
        out = np.empty((P, N), np.float32)
    if out.shape != (P, N) or out.dtype != np.float32 or out.strides[1] != 4:
        raise ValueError(f"expert_bias_act: out must be float32 [{P}, {N}] with contiguous rows")
    if P == 0:
        return out
    BLOCK = 64
    run(_expert_bias_kernel, (P, jk.cdiv(N, BLOCK)),
        (y, y.strides[0] // 4 if P > 1 else W, pair_expert, bias, W, out, out.strides[0] // 4 if P > 1 else N, N),
        target, GATED=bool(gated), ACT=ACTIVATIONS[act], BLOCK=BLOCK)
    return out


__all__ += ["expert_bias_act"]
