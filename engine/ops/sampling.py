"""Sampler helpers over logits [B, V] (V up to ~256k): greedy argmax, top-k, penalties, temperature, and
inverse-CDF sampling from probabilities or logits with host-supplied uniform random numbers.

Every kernel runs one program per row and reads per-step values (penalty tables, temperatures, random
numbers) from arrays, so a captured graph can be replayed after writing new values into them. Logits are
float32 here (the sampler works on f32 logits); rows may be row-strided views. NaN logits are skipped by
`argmax_rows` and `topk_rows` (numpy's argmax would return the NaN) and NaN probabilities count as zero
weight in `sample_from_probs`; elsewhere NaN results are unspecified.

How they compose into vLLM's sampling order (the engine's sampler decides; see vLLM v1 `Sampler`):
  logprobs of the raw logits (`softmax.log_softmax`) if requested -> `apply_penalties` ->
  greedy rows: `argmax_rows`; random rows: `apply_temperature` -> `topk_rows` (top-k, then top-p/min-p on
  the k sorted values on the host) -> `sample_from_probs`, or without top-k/top-p `sample_from_logits`.
"""
from __future__ import annotations

import numpy as np

import jitkern as jk
from ._hostargs import check_dtype, check_shape, empty_like_dev, narrow_tier, resolve_target, row_stride, run
from .softmax import row_max_sumexp

_BLOCK = 64           # streaming width over the vocabulary
_SCAN = 16            # chunk of the top-k compaction (its prefix count is a SCAN x SCAN tile)
_SORT = 64            # tile of the top-k rank sort (a SORT x SORT tile; half that on narrow tiers)
_CDF = 64             # chunk of the inverse-CDF search (its prefix sums: SCAN-wide pieces)
_KEY_NEG_INF = -2139095041     # order key of -inf (see _key_to_f32)


def _check_logits(logits, what):
    check_dtype(logits, np.float32, what)
    if logits.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D array [batch, vocab], got shape {logits.shape}")
    return row_stride(logits, what)


def _check_rows(a, B, dtype, what):
    check_dtype(a, dtype, what)
    if a.shape != (B,) or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a contiguous array of shape ({B},), got {a.shape}")


# ----------------------------------------------------------------------------------------------- argmax
@jk.kernel
def argmax_kernel(x, x_s, n, out, BLOCK: jk.constexpr):
    row = jk.program_id(0)
    xb = row.to(jk.i64) * x_s
    offs = jk.arange(0, BLOCK)
    bv = jk.full((BLOCK,), -float("inf"), jk.f32)
    bi = jk.zeros((BLOCK,), jk.i32)
    for c in range(0, n, BLOCK):
        cols = c + offs
        v = jk.load(x + xb + cols, mask=cols < n, other=-float("inf"))
        upd = v > bv                       # strict: each lane keeps its first maximum
        bv = jk.where(upd, v, bv)
        bi = jk.where(upd, cols, bi)
    best = jk.max(bv, axis=0)
    jk.store(out + row, jk.min(jk.where(bv == best, bi, 2147483647), axis=0))


def argmax_rows(logits: np.ndarray, out: np.ndarray | None = None, *, target=None) -> np.ndarray:
    """Index of the first maximum of each row of logits f32 [B, V] (as np.argmax(axis=1)) -> int32 [B]."""
    target = resolve_target(target, logits)
    xs = _check_logits(logits, "argmax_rows: logits")
    B, V = logits.shape
    if out is None:
        out = empty_like_dev(logits, B, np.int32)
    _check_rows(out, B, np.int32, "argmax_rows: out")
    if target is not None and target.is_gpu:
        # one CTA per row: 64-wide steps left most of its threads idle over ~2000 serial steps of a 128k
        # vocabulary (0.74 ms a row on the H200); the first maximum does not depend on the width
        run(argmax_kernel, (B,), (logits, xs, V, out), target, BLOCK=2048, num_warps=8)
    else:
        run(argmax_kernel, (B,), (logits, xs, V, out), target, BLOCK=_BLOCK)
    return out


@jk.kernel
def gather_rows_kernel(x, x_s, idx, out):
    # out[b] = x[b, idx[b]]: the value each row's chosen index holds (one program per row)
    b = jk.program_id(0)
    i = jk.load(idx + b)
    jk.store(out + b, jk.load(x + b.to(jk.i64) * x_s + i.to(jk.i64)))


def gather_rows(logits, idx, out=None, *, target=None):
    """logits f32 [B, V], idx int32 [B] (each in [0, V)) -> f32 [B] with out[b] = logits[b, idx[b]]."""
    target = resolve_target(target, logits)
    xs = _check_logits(logits, "gather_rows: logits")
    B, V = logits.shape
    _check_rows(idx, B, np.int32, "gather_rows: idx")
    if out is None:
        out = empty_like_dev(logits, B, np.float32)
    _check_rows(out, B, np.float32, "gather_rows: out")
    run(gather_rows_kernel, (B,), (logits, xs, idx, out), target)
    return out


# ------------------------------------------------------------------------------------------------ top-k
@jk.jit
def _key_to_f32(key):
    """The float whose order key is `key` (keys: f32 bits b -> b if b >= 0 else b ^ 0x7fffffff, an i32 order
    matching float order). Keys below -inf's map to -inf (every non-NaN value is >= them); keys above
    +inf's are NaN patterns, which no value is >= (so they count nothing, like keys above every value)."""
    bits = jk.where(key >= 0, key, key ^ 2147483647)
    f = bits.to(jk.f32, bitcast=True)
    return jk.where(key <= _KEY_NEG_INF, -float("inf"), f)


@jk.kernel(do_not_specialize=('k',))
def topk_kernel(x, x_s, n, k, ws_v, ws_i, out_v, out_i, BLOCK: jk.constexpr, SCAN: jk.constexpr,
                SORT: jk.constexpr):
    row = jk.program_id(0)
    xb = row.to(jk.i64) * x_s
    kb = row.to(jk.i64) * k
    offs = jk.arange(0, BLOCK)
    # 1) the k-th largest value t: a bitwise binary search over order keys, one counting pass per bit
    ans = 0                                   # key of the answer, offset by 2^31 (so unsigned order)
    for j in range(0, 32):
        cand = ans | (1 << (31 - j))
        t = _key_to_f32(cand ^ -2147483648)
        cnt = jk.zeros((BLOCK,), jk.i32)
        for c in range(0, n, BLOCK):
            cols = c + offs
            v = jk.load(x + xb + cols, mask=cols < n, other=float("nan"))
            cnt += (v >= t).to(jk.i32)
        ans = jk.where(jk.sum(cnt, axis=0) >= k, cand, ans)
    t = _key_to_f32(ans ^ -2147483648)
    # 2) compaction in index order: all values > t, then the first (k - #greater) values == t
    gcnt = jk.zeros((BLOCK,), jk.i32)
    for c in range(0, n, BLOCK):
        cols = c + offs
        v = jk.load(x + xb + cols, mask=cols < n, other=float("nan"))
        gcnt += (v > t).to(jk.i32)
    need_eq = k - jk.sum(gcnt, axis=0)
    si = jk.arange(0, SCAN)
    before = si[None, :] < si[:, None]        # before[i, j]: j precedes i
    n_sel = 0
    n_eq = 0
    for c in range(0, n, SCAN):
        cols = c + si
        v = jk.load(x + xb + cols, mask=cols < n, other=float("nan"))
        gt = v > t
        eq = v == t
        n_eq_c = jk.sum(eq.to(jk.i32), axis=0)
        if (jk.sum(gt.to(jk.i32), axis=0) > 0) | ((n_eq_c > 0) & (n_eq < need_eq)):
            eq_before = jk.sum(jk.where(before, eq.to(jk.i32)[None, :], 0), axis=1) + n_eq
            sel = gt | (eq & (eq_before < need_eq))
            seli = sel.to(jk.i32)
            pos = jk.sum(jk.where(before, seli[None, :], 0), axis=1) + n_sel
            jk.store(ws_v + kb + pos, v, mask=sel)
            jk.store(ws_i + kb + pos, cols, mask=sel)
            n_sel_next = n_sel + jk.sum(seli, axis=0)
        else:
            n_sel_next = n_sel
        n_sel = n_sel_next
        n_eq = n_eq + n_eq_c
    # only rows holding NaNs select fewer than k: pad with -inf and distinct negative indices (memory
    # safety, and distinct sort keys)
    ti = jk.arange(0, SORT)
    if n_sel < k:
        for i0 in range(0, k, SORT):
            ii = i0 + ti
            mp = (ii >= n_sel) & (ii < k)
            jk.store(ws_v + kb + ii, -float("inf"), mask=mp)
            jk.store(ws_i + kb + ii, -1 - ii, mask=mp)
    # 3) sort the k survivors: rank = #(larger, or equal with a smaller index); scatter to the rank
    for i0 in range(0, k, SORT):
        ii = i0 + ti
        mi = ii < k
        vi = jk.load(ws_v + kb + ii, mask=mi, other=0.0)
        xi = jk.load(ws_i + kb + ii, mask=mi, other=0)
        rank = jk.zeros((SORT,), jk.i32)
        for j0 in range(0, k, SORT):
            jj = j0 + ti
            mj = jj < k
            vj = jk.load(ws_v + kb + jj, mask=mj, other=0.0)
            xj = jk.load(ws_i + kb + jj, mask=mj, other=0)
            ahead = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (xj[None, :] < xi[:, None]))
            rank += jk.sum((ahead & mj[None, :]).to(jk.i32), axis=1)
        jk.store(out_v + kb + rank, vi, mask=mi)
        jk.store(out_i + kb + rank, xi, mask=mi)


def topk_rows(logits: np.ndarray, k: int, out_values: np.ndarray | None = None,
              out_indices: np.ndarray | None = None, *, workspace: tuple | None = None,
              target=None) -> tuple[np.ndarray, np.ndarray]:
    """The k largest entries of each row of logits f32 [B, V], sorted descending: (values f32 [B, k],
    indices int32 [B, k]). Ties are ordered (and cut at the k-th place) by the smaller index first, i.e. the
    result equals `np.lexsort((arange(V), -row))[:k]` per row (-0.0 and +0.0 count as equal). -inf entries
    are ordinary values (they come last). 1 <= k <= V; meant for k up to ~1024. NaN entries are never
    selected; a row with fewer than k non-NaN entries is padded with -inf values at negative indices.

    Algorithm (O(V) per row, no full sort): a 32-step bitwise binary search over the floats' order keys
    finds the k-th largest value t (one vectorised counting pass per step); one pass compacts the entries
    > t and the first needed entries == t into `workspace` (f32 [B, k], int32 [B, k]; allocated when not
    given); a k x k rank count sorts them into the outputs.
    """
    xs = _check_logits(logits, "topk_rows: logits")
    B, V = logits.shape
    k = int(k)
    if not 1 <= k <= V:
        raise ValueError(f"topk_rows: k must be in [1, {V}] (the vocabulary size), got {k}")
    if out_values is None:
        out_values = np.empty((B, k), np.float32)
    if out_indices is None:
        out_indices = np.empty((B, k), np.int32)
    for a, dt, what in ((out_values, np.float32, "out_values"), (out_indices, np.int32, "out_indices")):
        check_dtype(a, dt, f"topk_rows: {what}")
        check_shape(a, (B, k), f"topk_rows: {what}")
        if not a.flags.c_contiguous:
            raise ValueError(f"topk_rows: {what} must be contiguous")
    if workspace is None:
        workspace = (np.empty((B, k), np.float32), np.empty((B, k), np.int32))
    wv, wi = workspace
    check_dtype(wv, np.float32, "topk_rows: workspace[0]")
    check_dtype(wi, np.int32, "topk_rows: workspace[1]")
    if wv.size < B * k or wi.size < B * k or not (wv.flags.c_contiguous and wi.flags.c_contiguous):
        raise ValueError(f"topk_rows: workspace arrays must be contiguous with at least {B * k} elements")
    run(topk_kernel, (B,), (logits, xs, V, k, wv, wi, out_values, out_indices), target,
        BLOCK=_BLOCK, SCAN=_SCAN, SORT=_SORT // 2 if narrow_tier(target) else _SORT)
    return out_values, out_indices


# -------------------------------------------------------------------------------- penalties, temperature
@jk.kernel(do_not_specialize=('S',))
def penalties_kernel(x, x_s, n, ids, cnts, S, rep, pres, freq, BLOCK: jk.constexpr):
    row = jk.program_id(0)
    r = jk.load(rep + row)
    p = jk.load(pres + row)
    f = jk.load(freq + row)
    xb = row.to(jk.i64) * x_s
    sb = row.to(jk.i64) * S
    if (r != 1.0) | (p != 0.0) | (f != 0.0):
        offs = jk.arange(0, BLOCK)
        for c in range(0, S, BLOCK):
            j = c + offs
            mj = j < S
            tok = jk.load(ids + sb + j, mask=mj, other=-1)
            valid = (tok >= 0) & (tok < n)
            cnt = jk.load(cnts + sb + j, mask=mj, other=0).to(jk.f32)
            ptr = x + xb + jk.where(valid, tok, 0)
            lg = jk.load(ptr, mask=valid, other=0.0)
            lg = jk.where(lg > 0.0, lg / r, lg * r)
            lg = lg - f * cnt - p * jk.where(cnt > 0.0, 1.0, 0.0)
            jk.store(ptr, lg, mask=valid)


def penalty_tables(prompt_ids, output_ids, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host helper building `apply_penalties`' inputs from per-row token lists.

    `prompt_ids`, `output_ids`: sequences (one per row) of token-id sequences. Returns (token_ids int32
    [B, S], output_counts int32 [B, S]): per row, each distinct token seen in the prompt or the output once
    (ascending), with how many times it occurs in the output; padded with id -1 / count 0. S is `width`
    if given (ValueError if a row needs more), else the widest row (at least 1).
    """
    if len(prompt_ids) != len(output_ids):
        raise ValueError(f"penalty_tables: {len(prompt_ids)} prompt rows but {len(output_ids)} output rows")
    rows = []
    for p, o in zip(prompt_ids, output_ids):
        p = np.asarray(p, dtype=np.int64).ravel()
        o = np.asarray(o, dtype=np.int64).ravel()
        seen = np.union1d(p, o)
        if len(o):
            ou, oc = np.unique(o, return_counts=True)
            counts = np.zeros(len(seen), np.int64)
            counts[np.searchsorted(seen, ou)] = oc
        else:
            counts = np.zeros(len(seen), np.int64)
        rows.append((seen, counts))
    S = max([len(s) for s, _ in rows] + [1])
    if width is not None:
        if S > width:
            raise ValueError(f"penalty_tables: a row has {S} distinct tokens, more than width={width}")
        S = int(width)
    ids = np.full((len(rows), S), -1, np.int32)
    cnt = np.zeros((len(rows), S), np.int32)
    for b, (s, c) in enumerate(rows):
        ids[b, :len(s)] = s
        cnt[b, :len(s)] = c
    return ids, cnt


def apply_penalties(logits: np.ndarray, token_ids: np.ndarray, output_counts: np.ndarray,
                    repetition: np.ndarray, presence: np.ndarray, frequency: np.ndarray, *,
                    target=None) -> np.ndarray:
    """vLLM's penalties, in place on logits f32 [B, V], in vLLM's order:
      1. repetition: every token seen in the prompt or the output: logit / r if logit > 0 else logit * r;
      2. frequency: logit -= f * (count of the token in the output);
      3. presence:  logit -= p * (1 if the token occurs in the output).
    Inputs (see `penalty_tables`): token_ids int32 [B, S] (distinct ids per row, padded with -1; ids
    outside [0, V) are skipped), output_counts int32 [B, S], and per-row float32 [B] repetition (1 = off),
    presence (0 = off), frequency (0 = off). Cost is O(S) per row, and a row with all three off does
    nothing. Returns logits.
    """
    xs = _check_logits(logits, "apply_penalties: logits")
    B, V = logits.shape
    for a, what in ((token_ids, "token_ids"), (output_counts, "output_counts")):
        check_dtype(a, np.int32, f"apply_penalties: {what}")
        if a.ndim != 2 or a.shape[0] != B or not a.flags.c_contiguous:
            raise ValueError(f"apply_penalties: {what} must be a contiguous int32 [{B}, S] array, got {a.shape}")
    if output_counts.shape != token_ids.shape:
        raise ValueError(f"apply_penalties: output_counts {output_counts.shape} != token_ids {token_ids.shape}")
    for a, what in ((repetition, "repetition"), (presence, "presence"), (frequency, "frequency")):
        _check_rows(a, B, np.float32, f"apply_penalties: {what}")
    S = token_ids.shape[1]
    if S:
        run(penalties_kernel, (B,), (logits, xs, V, token_ids, output_counts, S, repetition, presence, frequency),
            target, BLOCK=64)
    return logits


@jk.kernel
def temperature_kernel(x, x_s, n, temp, BLOCK: jk.constexpr):
    row = jk.program_id(0)
    tv = jk.load(temp + row)
    xb = row.to(jk.i64) * x_s
    if (tv >= 1e-5) & (tv != 1.0):
        offs = jk.arange(0, BLOCK)
        for c in range(0, n, BLOCK):
            cols = c + offs
            m = cols < n
            jk.store(x + xb + cols, jk.load(x + xb + cols, mask=m, other=0.0) / tv, mask=m)


def apply_temperature(logits: np.ndarray, temperature: np.ndarray, *, target=None) -> np.ndarray:
    """logits[b] /= temperature[b] in place (float32 [B]); rows with temperature < 1e-5 (greedy) are left
    as they are, as vLLM does. Returns logits."""
    xs = _check_logits(logits, "apply_temperature: logits")
    B, V = logits.shape
    _check_rows(temperature, B, np.float32, "apply_temperature: temperature")
    run(temperature_kernel, (B,), (logits, xs, V, temperature), target, BLOCK=_BLOCK)
    return logits


# ------------------------------------------------------------------------------------ inverse-CDF sampling
@jk.jit
def _weights(x, xb, cols, n, m, FROM_LOGITS: jk.constexpr):
    if FROM_LOGITS:
        v = jk.load(x + xb + cols, mask=cols < n, other=-float("inf")).to(jk.f32)
        w = jk.exp(v - m)
    else:
        v = jk.load(x + xb + cols, mask=cols < n, other=0.0).to(jk.f32)
        w = v
    return jk.where(w > 0.0, w, 0.0)      # also zeroes NaN and negative entries


@jk.kernel
def sample_kernel(x, x_s, n, u, out, FROM_LOGITS: jk.constexpr, C: jk.constexpr, SUB: jk.constexpr):
    row = jk.program_id(0)
    xb = row.to(jk.i64) * x_s
    offs = jk.arange(0, C)
    if FROM_LOGITS:
        m, unused = row_max_sumexp(x, xb, n, C)
        m = jk.where(m == -float("inf"), 0.0, m)
    else:
        m = 0.0
    # pass 1: total weight and the last index with positive weight
    tot = jk.zeros((C,), jk.f32)
    lastv = jk.full((C,), -1, jk.i32)
    for c in range(0, n, C):
        cols = c + offs
        w = _weights(x, xb, cols, n, m, FROM_LOGITS)
        tot += w
        lastv = jk.maximum(lastv, jk.where(w > 0.0, cols, -1))
    total = jk.sum(tot, axis=0)
    last = jk.max(lastv, axis=0)
    target = jk.load(u + row) * total
    # pass 2: the first chunk whose running sum passes the target
    run_sum = 0.0
    found = -1
    base = 0.0
    for c in range(0, n, C):
        cols = c + offs
        cs = jk.sum(_weights(x, xb, cols, n, m, FROM_LOGITS), axis=0)
        hit = (found < 0) & (run_sum + cs > target)
        found = jk.where(hit, c, found)
        base = jk.where(hit, run_sum, base)
        run_sum = run_sum + cs
    # pass 3: inside that chunk, the first index whose inclusive prefix sum passes the target (prefix sums
    # over SUB-wide pieces: a SUB x SUB tile each)
    so = jk.arange(0, SUB)
    upto = so[None, :] <= so[:, None]
    res = last
    if found >= 0:
        first = 2147483647
        lastc = -1
        acc = base
        for piece in jk.static_range(C // SUB):
            cols = found + piece * SUB + so
            w = _weights(x, xb, cols, n, m, FROM_LOGITS)
            pref = jk.sum(jk.where(upto, w[None, :], 0.0), axis=1) + acc
            first = jk.minimum(first, jk.min(jk.where(pref > target, cols, 2147483647), axis=0))
            lastc = jk.maximum(lastc, jk.max(jk.where(w > 0.0, cols, -1), axis=0))
            acc = acc + jk.sum(w, axis=0)
        # summation-order rounding can leave the in-chunk sums just short of the target: take the
        # chunk's last positive entry then
        res2 = jk.where(first == 2147483647, lastc, first)
    else:
        res2 = res
    jk.store(out + row, res2)


def _sample(name, from_logits, x, uniform, out, target):
    xs = _check_logits(x, f"{name}: {'logits' if from_logits else 'probs'}")
    B, V = x.shape
    _check_rows(uniform, B, np.float32, f"{name}: uniform")
    if out is None:
        out = np.empty(B, np.int32)
    _check_rows(out, B, np.int32, f"{name}: out")
    run(sample_kernel, (B,), (x, xs, V, uniform, out), target, FROM_LOGITS=from_logits, C=_CDF, SUB=_SCAN)
    return out


def sample_from_probs(probs: np.ndarray, uniform: np.ndarray, out: np.ndarray | None = None, *,
                      target=None) -> np.ndarray:
    """Inverse-CDF sampling: for each row of probs f32 [B, K] (non-negative weights, need not sum to 1;
    negative and NaN entries count as 0) and uniform f32 [B] in [0, 1), the first index i with
    cumsum(probs)[i] > uniform * sum(probs) -> int32 [B]. Never picks a zero-weight entry; a row whose
    weights are all zero gives -1. Typical use: `probs` = the top-k probabilities from `topk_rows` (after
    top-p / min-p masking), the result indexing into that row's top-k indices."""
    return _sample("sample_from_probs", False, probs, uniform, out, target)


def sample_from_logits(logits: np.ndarray, uniform: np.ndarray, out: np.ndarray | None = None, *,
                       target=None) -> np.ndarray:
    """Samples from softmax(logits) over the full row (no top-k / top-p): the inverse CDF of
    exp(logits - max) at uniform * sum, as `sample_from_probs`. Apply `apply_temperature` first.
    Entries at -inf are never picked; a row that is all -inf gives -1."""
    return _sample("sample_from_logits", True, logits, uniform, out, target)


__all__ = ["argmax_rows", "topk_rows", "penalty_tables", "apply_penalties", "apply_temperature",
           "sample_from_probs", "sample_from_logits"]
