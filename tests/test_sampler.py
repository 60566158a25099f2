"""The sampler's distributions against exact numpy ones (thousands of draws, generous statistical bounds)."""
from types import SimpleNamespace

import numpy as np
import pytest

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

V = 300


def _draws(params, logits, n=3000, out_ids=()):
    s = Sampler(V, seed=0)
    counts = np.zeros(V)
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", [5, 6, 7], params.clone(), eos_token_ids=(1,))
        for t in out_ids:
            r.append_output_token(t)
        reqs.append(r)
    B = 250
    for b0 in range(0, n, B):
        chunk = reqs[b0:b0 + B]
        sched = SimpleNamespace(scheduled=[SimpleNamespace(req_id=r.request_id, request=r) for r in chunk])
        res = SimpleNamespace(logits=np.tile(logits, (len(chunk), 1)).astype(np.float32),
                              sample_rows={r.request_id: i for i, r in enumerate(chunk)}, prompt_rows={})
        for rid, smp in s.sample(sched, res).items():
            counts[smp.token_id] += 1
    return counts / n


def _ref(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    if top_p < 1:
        cut = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:cut], p[:cut] / p[:cut].sum()
    if min_p:
        keep = p >= min_p * p[0]
        order, p = order[keep], p[keep] / p[keep].sum()
    out = np.zeros(V)
    out[order] = p
    return out


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=10),
                                dict(temperature=1.0, top_p=0.8), dict(temperature=1.3, top_k=40, top_p=0.9),
                                dict(temperature=1.0, min_p=0.2)])
def test_distribution_matches(kw):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(V) * 2.0
    n = 20000
    got = _draws(SamplingParams(max_tokens=1, **kw), logits, n=n)
    want = _ref(logits, **kw)
    assert (got[want == 0] == 0).all(), "a truncated-away token was sampled"
    # total variation distance against its sampling noise: E|f - p| ~ sqrt(2 p / (pi n)) per category

    bound = 2.5 * 0.5 * np.sqrt(2 / (np.pi * n)) * np.sqrt(want).sum()
    assert 0.5 * np.abs(got - want).sum() < bound
    # and the bound has power: a 30% different temperature is far outside it
    wrong = _ref(logits, **{**kw, "temperature": kw.get("temperature", 1.0) * 1.3})
    assert 0.5 * np.abs(wrong - want).sum() > 2 * bound


def test_penalties_change_the_greedy_choice():
    logits = np.zeros(V)
    logits[10], logits[11] = 5.0, 4.0
    got = _draws(SamplingParams(max_tokens=1, temperature=0, presence_penalty=2.0), logits, n=1, out_ids=[10])
    assert got[11] == 1
    got = _draws(SamplingParams(max_tokens=1, temperature=0, repetition_penalty=2.0), logits, n=1, out_ids=[10])
    assert got[11] == 1       # 5/2 < 4
