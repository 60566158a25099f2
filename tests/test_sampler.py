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


# ------------------------------------------------------------------------------ one row never fails the batch

def _batch(params_list, logits, out_ids=None):
    reqs = []
    for i, p in enumerate(params_list):
        r = Request(f"r{i}", [5, 6, 7], p, eos_token_ids=(1,))
        for t in (out_ids or {}).get(i, ()):
            r.append_output_token(t)
        reqs.append(r)
    sched = SimpleNamespace(scheduled=[SimpleNamespace(req_id=r.request_id, request=r) for r in reqs])
    res = SimpleNamespace(logits=np.ascontiguousarray(logits, np.float32),
                          sample_rows={r.request_id: i for i, r in enumerate(reqs)}, prompt_rows={})
    return reqs, sched, res


class _BrokenEdits:
    def active(self, n):
        return True

    def apply(self, row, out_ids):
        raise RuntimeError("injected: broken logit edits")


def test_a_failing_row_gets_an_error_and_the_others_their_tokens():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((4, V)) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={3: 1.0}),
              SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0, logit_bias={9: 50.0})]
    reqs, sched, res = _batch(params, logits)
    reqs[1].logit_edits = _BrokenEdits()
    out = Sampler(V).sample(sched, res)
    assert out["r1"].token_id == -1 and "internal error" in out["r1"].error
    assert out["r0"].token_id == int(np.argmax(logits[0])) and out["r0"].error is None
    assert out["r3"].token_id == 9
    # the seeded row draws the same token as when sampled alone
    alone_reqs, alone_sched, alone_res = _batch([SamplingParams(temperature=0.8, seed=11)], logits[2:3])
    assert out["r2"].token_id == Sampler(V).sample(alone_sched, alone_res)["r0"].token_id


def test_rows_with_nothing_to_sample_or_nan_logits_fail_alone():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, V))
    logits[2, :] = np.nan                       # a broken model row
    # row 0: the only allowed token is the eos (1), which min_tokens masks for one more token
    params = [SamplingParams(temperature=0.5, allowed_token_ids=[1, 40], bad_words=[], min_tokens=2),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7)]
    reqs, sched, res = _batch(params, logits, out_ids={0: [40]})
    reqs[0].logit_edits = None
    from engine.logit_edits import LogitEdits
    edits = LogitEdits.build(params[0], vocab_size=V, eos_token_ids=(1,))
    edits.allowed_ids = np.array([1])           # narrowed after admission (what a later step can reach)
    reqs[0].logit_edits = edits
    out = Sampler(V).sample(sched, res)
    assert out["r0"].token_id == -1 and "no token can be generated at output position 1" in out["r0"].error
    assert out["r1"].token_id == int(np.argmax(logits[1]))
    assert out["r2"].token_id == -1 and "NaN" in out["r2"].error
