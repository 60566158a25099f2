"""Sampler helpers against numpy on every runnable tier: argmax (first maximum), top-k (sorted, ties by
index), vLLM's penalties, temperature, inverse-CDF sampling from probabilities and from logits (exact
boundary checks plus a frequency test)."""
import zlib

import numpy as np
import pytest

import jitkern as jk
from engine.ops.sampling import (apply_penalties, apply_temperature, argmax_rows, penalty_tables,
                                  sample_from_logits, sample_from_probs, topk_rows)

from .ref_basic import penalties_ref, topk_ref


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


def test_argmax_rows(tier):
    rng = _rng(tier, "argmax")
    B, V = 5, 49153
    buf = (rng.standard_normal((B, V + 3)) * 3).astype(np.float32)
    x = buf[:, 3:]
    x[1, [10, 40000, 49152]] = 50.0                    # ties: the first one wins
    x[2, :] = -np.inf
    x[3, 49152] = 1e9                                  # in the tail chunk
    x[4, :] = 2.5                                      # all equal
    got = argmax_rows(x, target=tier)
    assert got.dtype == np.int32
    assert np.array_equal(got, x.argmax(1))
    assert got[1] == 10 and got[2] == 0 and got[3] == 49152 and got[4] == 0



def test_gather_rows(tier):
    from engine.ops.sampling import gather_rows
    rng = _rng(tier, "gather")
    B, V = 7, 4099
    buf = rng.standard_normal((B, V + 5)).astype(np.float32)
    x = buf[:, 5:]                                     # row-strided view
    idx = rng.integers(0, V, B).astype(np.int32)
    idx[0], idx[1] = 0, V - 1
    x[2, idx[2]] = np.nan
    got = gather_rows(x, idx, target=tier)
    ref = x[np.arange(B), idx]
    np.testing.assert_array_equal(got, ref)            # NaN where the row holds one
    with pytest.raises(ValueError, match="gather_rows: idx"):
        gather_rows(x, idx[:3], target=tier)


@pytest.mark.parametrize("V,k", [(49153, 1), (49153, 50), (49153, 1024), (300, 300), (37, 5)])
def test_topk_rows(tier, V, k):
    rng = _rng(tier, "topk", V, k)
    B = 3
    x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    x[1, rng.integers(0, V, V // 3)] = -np.inf                          # masked logits
    x[2] = np.round(x[2] * 2) / 2                                      # many ties
    vals, idx = topk_rows(x, k, target=tier)
    assert vals.shape == (B, k) and idx.shape == (B, k) and idx.dtype == np.int32
    for b in range(B):
        want = topk_ref(x[b], k)
        assert np.array_equal(idx[b], want), (b, idx[b][:10], want[:10])
        assert np.array_equal(vals[b], x[b, want])


def test_topk_edge_rows(tier):
    V, k = 1000, 20
    x = np.full((4, V), -np.inf, np.float32)
    x[0, [5, 700]] = [1.0, 2.0]                        # fewer finite values than k: -inf ones follow by index
    x[1] = 0.0
    x[1, 999] = -0.0                                   # -0.0 == +0.0: index order
    x[2] = np.linspace(-1, 1, V, dtype=np.float32)[::-1]
    x[3, :] = np.float32(3.0)
    x[3, 500:] = np.nan                                # NaNs are never selected
    vals, idx = topk_rows(x, k, target=tier)
    for b in range(3):
        assert np.array_equal(idx[b], topk_ref(x[b], k)), b
    assert np.array_equal(idx[3], np.arange(k)) and (vals[3] == 3.0).all()
    y = np.full((1, 30), np.nan, np.float32)
    y[0, 4] = 1.0
    v, i = topk_rows(y, 3, target=tier)                # padded: -inf at negative indices
    assert i[0, 0] == 4 and v[0, 0] == 1.0 and (i[0, 1:] < 0).all() and (v[0, 1:] == -np.inf).all()
    with pytest.raises(ValueError, match="k must be"):
        topk_rows(x, 0)


def test_penalty_tables_and_apply_penalties(tier):
    rng = _rng(tier, "pen")
    B, V = 4, 5003
    x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    prompts = [rng.integers(0, V, 50), rng.integers(0, V, 7), [], rng.integers(0, V, 300)]
    outputs = [rng.integers(0, 60, 40), [], rng.integers(0, V, 9), rng.integers(0, V, 20)]
    rep = np.array([1.3, 1.0, 0.8, 1.1], np.float32)
    pres = np.array([0.5, 0.7, 0.0, -0.4], np.float32)
    freq = np.array([0.25, 0.0, 0.0, 1.5], np.float32)
    ids, cnt = penalty_tables(prompts, outputs)
    assert ids.dtype == np.int32 and cnt.dtype == np.int32
    for b in range(B):
        seen = np.union1d(np.asarray(prompts[b], np.int64), np.asarray(outputs[b], np.int64))
        assert np.array_equal(ids[b, :len(seen)], seen) and (ids[b, len(seen):] == -1).all()
        assert np.array_equal(cnt[b, :len(seen)], np.bincount(np.asarray(outputs[b], np.int64),
                                                              minlength=V)[seen])
    want = penalties_ref(x, prompts, outputs, rep.astype(np.float64), pres.astype(np.float64),
                         freq.astype(np.float64))
    got = apply_penalties(x.copy(), ids, cnt, rep, pres, freq, target=tier)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-5)
    # row 1: no output tokens, repetition 1.0, presence only on output tokens -> untouched
    assert np.array_equal(got[1], x[1])
    # a row with every penalty off is untouched even with a table
    off = apply_penalties(x.copy(), ids, cnt, np.ones(B, np.float32), np.zeros(B, np.float32),
                          np.zeros(B, np.float32), target=tier)
    assert np.array_equal(off, x)
    with pytest.raises(ValueError, match="width"):
        penalty_tables([[1, 2, 3]], [[4]], width=2)


def test_penalties_match_vllm_formula_in_torch():
    """The reference above, restated as vLLM writes it (torch ops on masks and bin counts)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    B, V = 2, 300
    x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    prompts, outputs = [rng.integers(0, V, 30), rng.integers(0, V, 5)], [rng.integers(0, V, 12), []]
    rep, pres, freq = (np.array(v, np.float32) for v in ([1.2, 0.9], [0.3, 0.1], [0.2, 0.5]))
    t = torch.from_numpy(x.copy())
    pm = torch.zeros(B, V, dtype=torch.bool)
    oc = torch.zeros(B, V)
    for b in range(B):
        pm[b, torch.as_tensor(np.asarray(prompts[b], np.int64))] = True
        oc[b] = torch.bincount(torch.as_tensor(np.asarray(outputs[b], np.int64)), minlength=V).float()
    om = oc > 0
    pen = torch.where(pm | om, torch.from_numpy(rep)[:, None].repeat(1, V), 1.0)
    t = torch.where(t > 0, t / pen, t * pen)
    t -= torch.from_numpy(freq)[:, None] * oc
    t -= torch.from_numpy(pres)[:, None] * om
    ids, cnt = penalty_tables(prompts, outputs, width=64)
    got = apply_penalties(x.copy(), ids, cnt, rep, pres, freq)
    assert np.allclose(got, t.numpy(), rtol=1e-6, atol=1e-6)


def test_apply_temperature(tier):
    rng = _rng(tier, "temp")
    x = (rng.standard_normal((4, 1001)) * 3).astype(np.float32)
    t = np.array([0.7, 0.0, 1.0, 2.5], np.float32)
    got = apply_temperature(x.copy(), t, target=tier)
    # division: exact on every tier (Vulkan too: the SPIR-V hooks divide f32 in f64, IEEE's quotient on any
    # driver, where OpFDiv may be 2.5 ULP off); the 3-ULP form before could not pass: assert_array_max_ulp
    # returns the ULP differences, never None
    close = np.array_equal
    assert close(got[0], x[0] / np.float32(0.7))
    assert np.array_equal(got[1], x[1]) and np.array_equal(got[2], x[2])      # greedy row, T = 1
    assert close(got[3], x[3] / np.float32(2.5))


def _check_inverse_cdf(w, u, got):
    """got[b] is a valid inverse-CDF pick: positive weight and cdf[i-1] <= u*total <= cdf[i] up to rounding."""
    for b in range(w.shape[0]):
        wb = np.where(w[b] > 0, w[b].astype(np.float64), 0.0)
        if wb.sum() == 0:
            assert got[b] == -1
            continue
        i = int(got[b])
        assert 0 <= i < w.shape[1] and wb[i] > 0, (b, i)
        cdf = np.cumsum(wb)
        tgt = float(u[b]) * cdf[-1]
        slack = 1e-5 * cdf[-1]
        assert (cdf[i - 1] if i else 0.0) <= tgt + slack and cdf[i] >= tgt - slack, (b, i, tgt, cdf[i])


def test_sample_from_probs_boundaries(tier):
    rng = _rng(tier, "probs")
    B, K = 6, 1024
    p = rng.random((B, K)).astype(np.float32) ** 4
    p[1, ::2] = 0.0                                    # zero weights are never picked
    p[2, :] = 0.0                                      # nothing to pick -> -1
    p[3, :1000] = 0.0                                  # mass only at the end
    p[4, :] = 0.0
    p[4, 7] = 3.0                                      # a single choice
    u = rng.random(B).astype(np.float32)
    u[5] = np.nextafter(np.float32(1.0), np.float32(0.0))     # the top end
    got = sample_from_probs(p, u, target=tier)
    assert got.dtype == np.int32
    _check_inverse_cdf(p, u, got)
    assert got[4] == 7


def test_sample_from_probs_frequencies(tier):
    rng = _rng(tier, "freq")
    K, N = 37, 4000
    p = rng.random(K).astype(np.float32)
    p[[3, 20]] = 0.0
    probs = np.repeat(p[None], N, axis=0)
    u = rng.random(N).astype(np.float32)
    got = sample_from_probs(probs, u, target=tier)
    _check_inverse_cdf(probs[:50], u[:50], got[:50])
    counts = np.bincount(got, minlength=K)
    assert counts[3] == 0 and counts[20] == 0
    expect = N * p / p.sum()
    chi2 = (((counts - expect) ** 2) / np.maximum(expect, 1e-9))[expect > 0].sum()
    assert chi2 < 90, chi2                             # 34 dof: p ~ 1e-6 to exceed


def test_sample_from_logits(tier):
    rng = _rng(tier, "logits")
    B, V = 5, 49153
    x = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    x[1, rng.integers(0, V, 40000)] = -np.inf
    x[2, :] = -np.inf
    x[3, 12345] = 60.0                                # dominant token
    u = rng.random(B).astype(np.float32)
    got = sample_from_logits(x, u, target=tier)
    with np.errstate(invalid="ignore"):
        w = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    w[2] = 0.0
    _check_inverse_cdf(w, u, got)
    assert got[2] == -1 and got[3] == 12345


def test_sampler_replay_reads_new_arrays():
    """Uniforms, temperatures and penalty tables are read from arrays: a captured graph replays with new values."""
    rng = np.random.default_rng(21)
    B, V = 2, 500
    x0 = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    x = x0.copy()
    u = np.zeros(B, np.float32)
    t = np.ones(B, np.float32)
    ids = np.full((B, 8), -1, np.int32)
    cnt = np.zeros((B, 8), np.int32)
    rep, pres, freq = np.ones(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32)
    out = np.empty(B, np.int32)
    with jk.capture() as g:
        apply_penalties(x, ids, cnt, rep, pres, freq)
        apply_temperature(x, t)
        sample_from_logits(x, u, out=out)
    ids[0, :2], cnt[0, :2], pres[0] = [3, 4], [1, 0], 0.5
    t[:] = [0.5, 2.0]
    u[:] = [0.25, 0.75]
    g.replay()
    want = penalties_ref(x0, [[4], []], [[3], []], np.ones(B), pres.astype(np.float64), np.zeros(B))
    want = want / t[:, None]
    assert np.allclose(x, want, rtol=1e-6, atol=1e-6)
    w = np.exp(want - want.max(1, keepdims=True))
    _check_inverse_cdf(w, u, out)
