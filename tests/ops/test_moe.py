"""Mixture-of-experts ops (engine/ops/moe.py) against float64 numpy on every runnable tier: top-k routing in
each normalisation, the host grouping, the routed-experts MLP (f32/f16/bf16 expert weights, odd sizes, masked
tails) and the weighted combine with a gated shared expert; batch invariance (each token alone vs in batches
of several sizes: bit-identical). Tolerances: 2e-5 relative (f32 accumulation over K <= 133) of the
output's scale."""
import zlib

import numpy as np
import pytest

from engine.ops.moe import (SOFTMAX_TOPK, TOPK_SOFTMAX, combine_experts, group_by_expert, moe_mlp, route_topk)

from .ref_basic import stored, as_f64


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


def _route_ref(logits, E, K, norm, mode):
    lg = logits[:, :E].astype(np.float64)
    if mode == SOFTMAX_TOPK:
        p = np.exp(lg - lg.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = np.argsort(-p, axis=1, kind="stable")[:, :K]
        w = np.take_along_axis(p, ids, 1)
        if norm:
            w = w / w.sum(1, keepdims=True)
    else:
        ids = np.argsort(-lg, axis=1, kind="stable")[:, :K]
        v = np.take_along_axis(lg, ids, 1)
        w = np.exp(v - v[:, :1])
        w /= w.sum(1, keepdims=True)
    return ids, w


@pytest.mark.parametrize("E,K,norm,mode", [(8, 2, True, SOFTMAX_TOPK), (5, 3, False, SOFTMAX_TOPK),
                                           (60, 4, False, SOFTMAX_TOPK), (7, 1, True, SOFTMAX_TOPK),
                                           (32, 4, False, TOPK_SOFTMAX)])
def test_route_topk(tier, E, K, norm, mode):
    rng = _rng(tier, E, K, norm, mode)
    T = 13
    buf = rng.standard_normal((T, E + 3)).astype(np.float32) * 2
    logits = buf[:, :E + 1]                      # row-strided view, one extra column (a shared-expert gate)
    ids, w = route_topk(logits, E, K, norm=norm, mode=mode, target=tier)
    want_ids, want_w = _route_ref(logits, E, K, norm, mode)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)


def test_group_by_expert_covers_every_pair_once():
    rng = np.random.default_rng(0)
    E, K, T = 6, 2, 11
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    for bm in (1, 2, 3):
        tok, pos, te, ts, tl = group_by_expert(ids, E, bm)
        assert (tl >= 1).all() and (tl <= bm).all()
        seen = np.zeros(T * K, int)
        for e, s, n in zip(te, ts, tl):
            for p in range(s, s + n):
                seen[p] += 1
                assert ids.reshape(-1)[np.flatnonzero(pos.reshape(-1) == p)[0]] == e
        assert (seen == 1).all()
        # the pair of (t, j) belongs to token t
        assert (tok[pos] == np.arange(T)[:, None]).all()


def _moe_ref(x, ids, w, wgu, wd, shared=None, sgate=None):
    x = x.astype(np.float64)
    I = wd.shape[2]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g = wgu[e, :I] @ x[t]
            u = wgu[e, I:] @ x[t]
            out[t] += w[t, j] * (wd[e] @ (g / (1 + np.exp(-g)) * u))
        if shared is not None:
            out[t] += (1 / (1 + np.exp(-sgate[t, 0])) if sgate is not None else 1.0) * shared[t]
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_moe_mlp_matches_numpy_and_is_batch_invariant(tier, dtype):
    rng = _rng(tier, "moe", dtype)
    E, K, H, I, T = 6, 2, 37, 21, 9              # odd sizes: masked K tails, overlapping column blocks
    wgu = stored(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H), dtype)
    wd = stored(rng.standard_normal((E, H, I)) / np.sqrt(I), dtype)
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E + 1)).astype(np.float32)
    shared = rng.standard_normal((T, H)).astype(np.float32)
    out = moe_mlp(x, logits, wgu, wd, K, norm=True, shared=shared, shared_gate=logits[:, E:], target=tier)
    ids, w = route_topk(logits, E, K, norm=True, target=tier)
    want = _moe_ref(x, ids, as_f64(w), as_f64(wgu), as_f64(wd), shared, logits[:, E:].astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # batch invariance: each token alone, and in batches of other sizes and compositions, gives the same bits
    for t in range(T):
        one = moe_mlp(x[t:t + 1], logits[t:t + 1], wgu, wd, K, norm=True, shared=shared[t:t + 1],
                      shared_gate=logits[t:t + 1, E:], target=tier)
        np.testing.assert_array_equal(one[0], out[t])
    perm = rng.permutation(T)[:5]
    part = moe_mlp(x[perm], logits[perm], wgu, wd, K, norm=True, shared=shared[perm],
                   shared_gate=np.ascontiguousarray(logits[perm, E:]), target=tier)
    np.testing.assert_array_equal(part, out[perm])


def test_combine_without_shared_and_ungated(tier):
    rng = _rng(tier, "combine")
    T, K, P, H = 4, 3, 12, 70
    y = rng.standard_normal((P, H)).astype(np.float32)
    pos = rng.permutation(P).astype(np.int32).reshape(T, K)
    w = rng.random((T, K)).astype(np.float32)
    sh = rng.standard_normal((T, H)).astype(np.float32)
    want = np.einsum("tk,tkh->th", w.astype(np.float64), y[pos].astype(np.float64))
    np.testing.assert_allclose(combine_experts(y, pos, w, target=tier), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(combine_experts(y, pos, w, shared=sh, target=tier), want + sh, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    w = np.zeros((4, 6, 5), np.float32)
    with pytest.raises(ValueError, match="w_down"):
        moe_mlp(np.ones((2, 5), np.float32), np.ones((2, 4), np.float32), w, np.zeros((4, 5, 2), np.float32), 2)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(np.ones((2, 4), np.float32), 4, 5)


def test_separate_gate_and_up_arrays_equal_the_fused_form(tier):
    """GGUF keeps ffn_gate_exps and ffn_up_exps apart: the same bits as the fused [E, 2I, H] weight."""
    rng = _rng(tier, "split")
    E, K, H, I, T = 5, 2, 19, 11, 6
    wgu = rng.standard_normal((E, 2 * I, H)).astype(np.float16)
    wd = rng.standard_normal((E, H, I)).astype(np.float16)
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    fused = moe_mlp(x, logits, wgu, wd, K, target=tier)
    split = moe_mlp(x, logits, np.ascontiguousarray(wgu[:, :I]), wd, K, w_up=np.ascontiguousarray(wgu[:, I:]),
                    target=tier)
    np.testing.assert_array_equal(fused, split)


def test_gpt_oss_style_experts(tier):
    """The options gpt-oss needs: top-k on logits then softmax over the k, interleaved gate/up rows with biases,
    the clamped SwiGLU (alpha 1.702, limit 7), a down bias."""
    rng = _rng(tier, "oss")
    E, K, H, I, T = 8, 4, 24, 10, 7
    wgu = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.6      # large enough to reach the clamps
    wd = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    bgu = rng.standard_normal((E, 2 * I)).astype(np.float32)
    bd = rng.standard_normal((E, H)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    out = moe_mlp(x, logits, wgu, wd, K, mode=TOPK_SOFTMAX, act="swiglu_oai", interleaved=True, gate_up_bias=bgu,
                  down_bias=bd, target=tier)
    ids, w = _route_ref(logits, E, K, False, TOPK_SOFTMAX)
    want = np.zeros((T, H))
    saw_clamp = False
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            gu = wgu[e].astype(np.float64) @ x[t] + bgu[e]
            g, u = gu[0::2], gu[1::2]
            saw_clamp |= bool((g > 7).any() or (np.abs(u) > 7).any())
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            a = (u + 1) * g / (1 + np.exp(-1.702 * g))
            want[t] += w[t, j] * (wd[e] @ a + bd[e])
    assert saw_clamp
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("direct", [True, False])
def test_direct_path_equals_grouped_and_replays_in_a_graph(tier, direct):
    """The ungrouped path (decode) and the kernel-grouped path give the host-grouped path's bits; recorded once
    into a jk.capture() graph, each replays with new activations and new routing written into the same arrays."""
    import jitkern as jk
    from engine.ops.moe import route_topk, routed_experts, expert_gate_up, expert_down
    if tier.is_gpu:
        pytest.skip("CPU graphs")
    rng = _rng(tier, "direct")
    E, K, H, I, T = 6, 2, 29, 13, 5
    wgu = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    ids0, w0 = route_topk(logits, E, K, target=tier)
    grouped = routed_experts(x, ids0, w0, lambda a, t, bm, o: expert_gate_up(a, wgu, t, bm, o, target=tier),
                             lambda a, t, bm, o: expert_down(a, wd, t, bm, o, target=tier), E, I, host_tiles=True,
                             direct=False, target=tier)
    ids = np.empty((T, K), np.int32)
    w = np.empty((T, K), np.float32)
    out = np.empty((T, H), np.float32)
    bufs = {}

    def get(name, shape, dtype=np.float32):
        if name not in bufs:
            bufs[name] = np.empty(shape, dtype)
        return bufs[name]

    def step():
        route_topk(logits, E, K, ids=ids, weights=w, target=tier)
        routed_experts(x, ids, w, lambda a, t, bm, o: expert_gate_up(a, wgu, t, bm, o, target=tier),
                       lambda a, t, bm, o: expert_down(a, wd, t, bm, o, target=tier), E, I, out=out, scratch=get,
                       direct=direct, target=tier)
    step()
    np.testing.assert_array_equal(out, grouped)
    with jk.capture() as g:
        step()
    x[...] = rng.standard_normal((T, H))
    logits[...] = rng.standard_normal((T, E))
    out[...] = np.nan
    g.replay()
    np.testing.assert_array_equal(out, moe_mlp(x, logits, wgu, wd, K, target=tier))


def test_group_kernel_equals_numpy_grouping(tier):
    from engine.ops.moe import group_by_expert_dev
    if tier.is_gpu:
        pytest.skip("host-memory scalar loop check on CPU tiers")
    rng = _rng(tier, "group")
    for T, K, E, bm in [(1, 2, 8, 1), (7, 2, 5, 2), (33, 4, 16, 2), (5, 3, 3, 3), (40, 2, 2, 2)]:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
        want = group_by_expert(ids, E, bm)
        got = group_by_expert_dev(ids, E, bm, target=tier)
        n = len(want[2])
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        for w, g in zip(want[2:], got[2:]):
            np.testing.assert_array_equal(g[:n], w)
        assert (got[4][n:] == 0).all()


def _route_sigmoid_ref(logits, bias, E, K, ng, tg, norm, scale, softmax=False):
    """DeepSeek-V3's router (HF DeepseekV3TopkRouter) in float64 numpy; softmax: V2's group_limited_greedy."""
    lg = logits[:, :E].astype(np.float64)
    if softmax:
        s = np.exp(lg - lg.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
        ch = s.copy()
    else:
        s = 1.0 / (1.0 + np.exp(-lg))
        ch = s + bias.astype(np.float64)
    if ng > 1:
        g = ch.reshape(len(ch), ng, E // ng)
        gs = g.max(2) if softmax else -np.sort(-g, axis=2)[:, :, :2].sum(2)
        keep = np.argsort(-gs, axis=1, kind="stable")[:, :tg]
        mask = np.zeros((len(ch), ng), bool)
        np.put_along_axis(mask, keep, True, 1)
        ch = np.where(np.repeat(mask, E // ng, axis=1), ch, -np.inf)
    ids = np.argsort(-ch, axis=1, kind="stable")[:, :K]
    w = np.take_along_axis(s, ids, 1)
    if norm:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    return ids, w * scale


@pytest.mark.parametrize("E,K,ng,tg,norm", [(8, 2, 4, 2, True), (12, 3, 3, 1, True), (16, 4, 1, 1, False),
                                            (64, 8, 8, 4, True), (10, 1, 5, 5, False)])
def test_route_sigmoid_group(tier, E, K, ng, tg, norm):
    from engine.ops.moe import route_sigmoid_group
    rng = _rng(tier, "sigmoid", E, K, ng, tg, norm)
    T = 11
    buf = rng.standard_normal((T, E + 2)).astype(np.float32) * 3
    logits = buf[:, :E]                          # row-strided view
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32)
    ids, w = route_sigmoid_group(logits, bias, E, K, n_group=ng, topk_group=tg, norm=norm, scale=2.5, target=tier)
    want_ids, want_w = _route_sigmoid_ref(logits, bias, E, K, ng, tg, norm, 2.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)
    for t in range(T):                           # batch invariance: each token alone
        i1, w1 = route_sigmoid_group(logits[t:t + 1], bias, E, K, n_group=ng, topk_group=tg, norm=norm, scale=2.5,
                                     target=tier)
        np.testing.assert_array_equal(i1, ids[t:t + 1])
        np.testing.assert_array_equal(w1, w[t:t + 1])
    with pytest.raises(ValueError, match="n_group"):
        route_sigmoid_group(logits, bias, E, K, n_group=3 if E % 3 else 7, topk_group=1)


@pytest.mark.parametrize("E,K,ng,tg", [(8, 3, 4, 2), (12, 3, 3, 1), (64, 6, 8, 3)])   # K > tg: limiting matters
def test_route_softmax_group_limited(tier, E, K, ng, tg):
    """DeepSeek-V2's group_limited_greedy: softmax scores, groups ranked by their best score, no renormalisation."""
    from engine.ops.moe import route_sigmoid_group
    rng = _rng(tier, "softmax-group", E, K, ng, tg)
    logits = (rng.standard_normal((9, E)) * 3).astype(np.float32)
    zero = np.zeros(E, np.float32)
    ids, w = route_sigmoid_group(logits, zero, E, K, n_group=ng, topk_group=tg, norm=False, scale=1.5, softmax=True,
                                 target=tier)
    want_ids, want_w = _route_sigmoid_ref(logits, zero, E, K, ng, tg, False, 1.5, softmax=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)
    plain, _ = route_sigmoid_group(logits, zero, E, K, n_group=1, topk_group=1, norm=False, softmax=True, target=tier)
    assert (plain != ids).any(), "group limiting should change some choices at these sizes"
