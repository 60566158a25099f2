"""Logits processors (per request and engine-wide), logprobs_mode and logprob_token_ids on a tiny random llama.

Oracles: transformers' logits of the same checkpoint (float64 log-softmax) and numpy float64 references computed
from the engine's own raw logits (a raw_logits run with logprobs=-1); processors are checked by what they ban or
force, mixed batches against the same requests run alone."""
from __future__ import annotations

import numpy as np
import pytest

from engine.errors import InvalidRequestError
from engine.logits_process import (BatchSlots, LogitBiasLogitsProcessor, LogitsProcessor, MinPLogitsProcessor,
                                   MinTokensLogitsProcessor, MoveDirectionality)
from engine.sampling_params import SamplingParams

P1 = [5, 17, 33, 2, 9, 100, 44]
P2 = [7, 8, 9, 10, 11]
P3 = [200, 3, 3, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.model_fixtures import tiny_model_dir
    return tiny_model_dir(tmp_path_factory, "tiny-llama-logits", seed=21)


_ENGINES: dict = {}


def _llm(tiny, mode="raw_logprobs", **kw):
    from engine.llm import LLM
    key = (mode, tuple(kw.get("logits_processors") or ()))
    if key not in _ENGINES:
        _ENGINES[key] = LLM(tiny[0], num_blocks=128, block_size=16, max_num_batched_tokens=256, max_logprobs=-1,
                            logprobs_mode=mode, **kw)
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for llm in _ENGINES.values():
        llm.close()
    _ENGINES.clear()


def _hf_logprobs(hf, ids: list) -> np.ndarray:
    """float64 log-softmax of transformers' next-token logits after `ids`."""
    import torch
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


def _rank(row: np.ndarray, tok: int) -> int:
    return int(np.count_nonzero(row > row[tok])) + 1


def _vocab_rows(out) -> list:
    """Each position's full-vocabulary values (a logprobs=-1 run) as a dense float64 array."""
    rows = []
    for entry in out.outputs[0].logprobs:
        row = np.full(len(entry), np.nan)
        for t, lp in entry.items():
            row[t] = lp.logprob
        assert not np.isnan(row).any()
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ logprobs_mode
def test_raw_logprobs_and_token_ids_match_transformers(tiny):
    llm = _llm(tiny)
    ids = [3, 250, 17, 0, 99]
    out = llm.generate([P1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                            logprob_token_ids=ids))[0].outputs[0]
    raw = _vocab_rows(_llm(tiny, "raw_logits").generate(
        [P1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=-1))[0])
    for pos, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = _hf_logprobs(tiny[1], P1 + list(out.token_ids[:pos]))
        assert set(entry) == set(ids) | {tok}
        for t in set(ids) | {tok}:
            assert entry[t].logprob == pytest.approx(ref[t], abs=2e-4)
            # ranks over the whole vocabulary, from the engine's own logits (same float32 values: exact order)
            assert entry[t].rank == _rank(raw[pos], t)
        assert entry[tok].rank == 1                        # greedy


def _processed_ref(raw: np.ndarray, p: SamplingParams, mode: str) -> np.ndarray:
    """numpy float64: temperature, then the sampler's top-k -> top-p -> min-p cuts (cut tokens -inf)."""
    z = raw / p.temperature if p.temperature else raw.copy()
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if p.top_p < 1:
        cut = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
        order, probs = order[:cut], probs[:cut] / probs[:cut].sum()
    if p.min_p > 0:
        order = order[probs >= p.min_p * probs[0]]
    out = np.full_like(z, -np.inf)
    out[order] = z[order]
    if mode == "processed_logprobs":
        m = out[order].max()
        out[order] -= m + np.log(np.exp(out[order] - m).sum())
    return out


SAMPLED = dict(max_tokens=5, temperature=0.7, top_k=12, top_p=0.9, seed=7, ignore_eos=True, logprobs=-1)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logits", "processed_logprobs"])
@pytest.mark.parametrize("kw", [SAMPLED, dict(SAMPLED, top_k=0, top_p=1.0, min_p=0.5),
                                dict(max_tokens=4, temperature=0, ignore_eos=True, logprobs=-1)])
def test_modes_against_numpy_reference(tiny, mode, kw):
    p = SamplingParams(**kw)
    raw_out = _llm(tiny, "raw_logits").generate([P2], p.clone())[0]
    raw = _vocab_rows(raw_out)
    out = _llm(tiny, mode).generate([P2], p.clone())[0]
    # the mode changes what is reported, never what is sampled
    assert out.outputs[0].token_ids == raw_out.outputs[0].token_ids
    got = _vocab_rows(out)
    for pos, tok in enumerate(out.outputs[0].token_ids):
        if mode == "raw_logprobs":
            want = raw[pos] - (raw[pos].max() + np.log(np.exp(raw[pos] - raw[pos].max()).sum()))
        else:
            want = _processed_ref(raw[pos], p, mode)
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got[pos])), "masked tokens must read -inf, the rest finite"
        np.testing.assert_allclose(got[pos][finite], want[finite], rtol=0, atol=2e-4)
        assert out.outputs[0].logprobs[pos][tok].rank == _rank(got[pos], tok)
        if mode != "raw_logprobs" and p.temperature:
            assert 1 <= finite.sum() < len(want)           # the cuts removed tokens (else the test shows nothing)
            assert finite.sum() <= (p.top_k or len(want))


def test_processed_mode_sees_processors_raw_does_not(tiny):
    banned = 250

    def ban(output_ids, logits):
        logits[banned] = -np.inf
        return logits

    p = dict(max_tokens=3, temperature=0, ignore_eos=True, logprob_token_ids=[banned, 4])
    raw = _llm(tiny).generate([P3], SamplingParams(**p, logits_processors=[ban]))[0].outputs[0]
    proc = _llm(tiny, "processed_logprobs").generate([P3], SamplingParams(**p, logits_processors=[ban]))[0].outputs[0]
    assert raw.token_ids == proc.token_ids
    for r, q in zip(raw.logprobs, proc.logprobs):
        assert np.isfinite(r[banned].logprob) and q[banned].logprob == -np.inf
        # greedy: only the banned token's mass leaves the normalisation
        assert q[4].logprob == pytest.approx(r[4].logprob - np.log1p(-np.exp(r[banned].logprob)), abs=1e-5)


# ------------------------------------------------------------------------------------------ processors
def test_banned_tokens_are_never_sampled(tiny):
    llm = _llm(tiny)
    greedy = llm.generate([P1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    ban_set = set(greedy)

    def ban(output_ids, logits):
        logits[list(ban_set)] = -np.inf
        return logits

    got = llm.generate([P1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                            logits_processors=[ban]))[0].outputs[0].token_ids
    assert len(got) == 6 and not ban_set & set(got)
    # sampled, and the 3-argument form: the lower half of the vocabulary and the prompt's tokens are banned

    def low_half(prompt_ids, output_ids, logits):
        logits[: logits.shape[0] // 2] = -np.inf
        logits[prompt_ids] = -np.inf
        return logits

    outs = llm.generate([P1, P2, P3] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True,
                                                          logits_processors=[low_half]) for s in range(12)])
    for o in outs:
        toks = o.outputs[0].token_ids
        assert len(toks) == 8 and min(toks) >= 128 and not set(toks) & set(o.prompt_token_ids), toks
    plain = llm.generate([P1] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True)
                                   for s in range(4)])
    assert any(min(o.outputs[0].token_ids) < 128 for o in plain)     # the ban is what keeps them out


def test_raising_processor_fails_only_its_request(tiny):
    llm = _llm(tiny)

    def boom_at_two(output_ids, logits):
        if len(output_ids) == 2:
            raise RuntimeError("refusing position 2")
        return logits

    def wrong_shape(output_ids, logits):
        return logits[:10]

    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logits_processors=[boom_at_two]),
              SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logits_processors=[wrong_shape])]
    outs = llm.generate([P1, P2, P3, P1], params)
    solo = [llm.generate([pr], p)[0] for pr, p in zip([P1, P3], [params[0], params[2]])]
    assert outs[1].outputs[0].finish_reason == "error"
    assert "boom_at_two" in outs[1].error and "refusing position 2" in outs[1].error
    assert len(outs[1].outputs[0].token_ids) == 2          # the tokens before it raised were delivered
    assert outs[3].outputs[0].finish_reason == "error" and "wrong_shape" in outs[3].error
    assert "\n" not in outs[1].error and "\n" not in outs[3].error
    for o, s in zip([outs[0], outs[2]], solo):
        assert o.error is None and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == s.outputs[0].token_ids


def test_mixed_batch_equals_solo_runs(tiny):
    llm = _llm(tiny)

    def penalise_last(output_ids, logits):
        if output_ids:
            logits[output_ids[-1]] -= 3.0
        return logits

    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logits_processors=[penalise_last]),
              SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True, logprobs=3,
                             logits_processors=[penalise_last]),
              SamplingParams(max_tokens=6, temperature=0.9, seed=12, ignore_eos=True, top_k=5),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprob_token_ids=[1, 2, 3])]
    prompts = [P1, P2, P3, P1, P2]
    batch = llm.generate(prompts, [p.clone() for p in params])
    for pr, p, b in zip(prompts, params, batch):
        s = llm.generate([pr], p.clone())[0].outputs[0]
        assert b.outputs[0].token_ids == s.token_ids
        assert b.outputs[0].logprobs == s.logprobs


# ------------------------------------------------------------------------------------------ engine-wide
class ForceFirstPromptToken(LogitsProcessor):
    """Every row may only produce its request's first prompt token: wrong slot bookkeeping shows as a token
    of another request."""

    def __init__(self, engine_config, device, is_pin_memory):
        self.first = {}
        self.sizes = []

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.first.pop(i, None)
        for i, params, prompt_ids, output_ids in batch_update.added:
            self.first[i] = prompt_ids[0]
        for a, b, how in batch_update.moved:
            assert how == MoveDirectionality.UNIDIRECTIONAL
            self.first[b] = self.first.pop(a)
        assert sorted(self.first) == list(range(batch_update.batch_size))

    def apply(self, logits):
        self.sizes.append(logits.shape[0])
        for i, t in self.first.items():
            keep = logits[i, t]
            logits[i] = -np.inf
            logits[i, t] = keep
        return logits


def test_engine_wide_processor_tracks_the_batch(tiny):
    llm = _llm(tiny, logits_processors=[ForceFirstPromptToken])
    proc = llm.engine.sampler.logits_processors[0]
    assert llm.engine.runner.device_greedy is False          # it may change a greedy pick: host path only
    prompts = [P1, P2, P3, [77, 1, 2], [150, 9]]
    lens = [2, 7, 4, 9, 3]                                   # requests leave at different steps: holes, moves
    params = [SamplingParams(max_tokens=n, temperature=0 if i % 2 else 1.0, seed=i, ignore_eos=True)
              for i, n in enumerate(lens)]
    outs = llm.generate(prompts, params)
    for pr, n, o in zip(prompts, lens, outs):
        assert o.outputs[0].token_ids == [pr[0]] * n
    assert max(proc.sizes) == 5 and min(proc.sizes) == 1


def test_engine_processor_refused_with_speculative_decoding(tiny):
    from engine.llm import LLM
    with pytest.raises(ValueError, match="logits_processors cannot be combined with speculative_config"):
        LLM(tiny[0], num_blocks=64, logits_processors=[ForceFirstPromptToken],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="logprobs_mode='nope'"):
        LLM(tiny[0], num_blocks=64, logprobs_mode="nope")


def test_batch_slots_follow_vllm_order():
    class R:
        def __init__(self, n):
            self.sampling_params, self.prompt_token_ids, self.output_token_ids = n, [n], []

    a, b, c, d = R("a"), R("b"), R("c"), R("d")
    slots = BatchSlots()
    upd, order = slots.update([a, b, c])
    assert [x[0] for x in upd.added] == [0, 1, 2] and order == [0, 1, 2]
    assert slots.update([a, b, c]) == (None, [0, 1, 2])
    upd, order = slots.update([c, d])         # a, b leave: d takes slot 0, c moves from 2 to 1
    assert upd.removed == [0, 1] and [x[0] for x in upd.added] == [0]
    assert upd.moved == [(2, 1, MoveDirectionality.UNIDIRECTIONAL)] and upd.batch_size == 2
    assert order == [1, 0]                     # slot 0 is d (position 1 of the list), slot 1 is c


def test_builtin_processors_on_the_interface_match_the_sampler():
    from engine.logit_edits import LogitEdits
    from engine.logits_process import BatchUpdate, EngineConfigView
    V = 64
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, V)).astype(np.float32)
    ps = [SamplingParams(logit_bias={3: 2.5, 9: -100}, min_tokens=2, stop_token_ids=[5]),
          SamplingParams(min_p=0.3), SamplingParams()]
    outs = [[], [1], []]
    cfg = EngineConfigView(V, 8, eos_token_ids=(1,))
    upd = BatchUpdate(3, added=[(i, p, [0], o) for i, (p, o) in enumerate(zip(ps, outs))])
    got = rows.copy()
    for cls in (LogitBiasLogitsProcessor, MinTokensLogitsProcessor):
        proc = cls(cfg, "cpu", False)
        proc.update_state(upd)
        got = proc.apply(got)
    want = rows.copy()
    LogitEdits.build(ps[0], vocab_size=V, eos_token_ids=(1,)).apply(want[0], [])
    np.testing.assert_array_equal(got, want)
    mp = MinPLogitsProcessor(cfg, "cpu", False)
    mp.update_state(upd)
    assert mp.is_argmax_invariant() and not LogitBiasLogitsProcessor(cfg, "cpu", False).is_argmax_invariant()
    got = mp.apply(rows.copy())
    p = np.exp(rows[1].astype(np.float64) - rows[1].max())
    np.testing.assert_array_equal(np.isfinite(got[1]), p / p.sum() >= 0.3 * (p / p.sum()).max())
    np.testing.assert_array_equal(got[[0, 2]], rows[[0, 2]])


# ------------------------------------------------------------------------------------------ validation
def test_sampling_params_validation_names_the_field():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprob_token_ids=list(range(129)))
    assert e.value.param == "logprob_token_ids" and "128" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprob_token_ids=[1, 2], logprobs=5)
    assert e.value.param == "logprob_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprob_token_ids=[1, 300]).validate(vocab_size=256, max_logprobs=20)
    assert e.value.param == "logprob_token_ids" and "300" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logits_processors=[lambda o, x: x, "not callable"])
    assert e.value.param == "logits_processors"
    p = SamplingParams(logprob_token_ids=list(range(100)))
    assert p.logprobs == 100
    p.validate(vocab_size=256, max_logprobs=20)          # the ids' own bound, not --max-logprobs
    state = []
    fn = lambda o, x: state.append(1) or x              # noqa: E731
    assert SamplingParams(logits_processors=[fn]).clone().logits_processors[0] is fn


# ------------------------------------------------------------------------------------------ server
def test_server_logprob_token_ids_and_logprobs_mode(tiny):
    import falcon.testing

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs, LLMEngine
    from server.app import create_app
    from server.settings import ServerSettings
    eng = LLMEngine(EngineArgs(model=tiny[0], num_blocks=64, max_num_batched_tokens=256, logprobs_mode="raw_logits"))
    app = create_app(engine=AsyncEngine(engine=eng), settings=ServerSettings(warmup=False, log_requests=False))
    try:
        c = falcon.testing.TestClient(app)
        ids = [3, 40, 41]
        r = c.simulate_post("/v1/completions", json={"prompt": P1, "max_tokens": 2, "temperature": 0,
                                                      "logprob_token_ids": ids, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        lp = r.json["choices"][0]["logprobs"]
        raw = _vocab_rows(_llm(tiny, "raw_logits").generate(
            [P1], SamplingParams(max_tokens=2, temperature=0, logprobs=-1))[0])
        for pos, top in enumerate(lp["top_logprobs"]):
            assert {f"token_id:{t}" for t in ids} <= set(top)
            for t in ids:
                assert top[f"token_id:{t}"] == pytest.approx(raw[pos][t], abs=1e-5)   # raw logits, not logprobs
        r = c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2, "logprobs": True,
                                                          "logprob_token_ids": ids})
        assert r.status_code == 200, r.text
        content = r.json["choices"][0]["logprobs"]["content"]
        assert len(content) == 2 and all(len(e["top_logprobs"]) >= 3 for e in content)
        for body, why in [({"logprob_token_ids": list(range(129))}, "128"),
                          ({"logprob_token_ids": [1, 10 ** 6]}, "1000000"),
                          ({"logprob_token_ids": [1, 2], "logprobs": 5}, "logprobs"),
                          ({"logprob_token_ids": "3"}, "array")]:
            r = c.simulate_post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json["error"]["param"].startswith("logprob_token_ids") and why in r.json["error"]["message"]
        r = c.simulate_post("/v1/completions", json={"prompt": "hi", "logits_processors": ["x"]})
        assert r.status_code == 400 and r.json["error"]["param"] == "logits_processors"
    finally:
        app.close()


def test_logprobs_mode_settings_and_flags():
    from server.cli import build_parser, settings_from_args
    from server.settings import ServerSettings, SettingsError
    s = ServerSettings.from_env({"JITKERN_LOGPROBS_MODE": "processed_logits"})
    assert s.engine_kwargs()["logprobs_mode"] == "processed_logits"
    assert ServerSettings.from_env(s.to_env()) == s
    with pytest.raises(SettingsError, match="JITKERN_LOGPROBS_MODE"):
        ServerSettings.from_env({"JITKERN_LOGPROBS_MODE": "logits"})
    args = build_parser().parse_args(["--logprobs-mode", "raw_logits"])
    assert settings_from_args(args).engine_kwargs()["logprobs_mode"] == "raw_logits"
    assert "logprobs_mode" not in settings_from_args(build_parser().parse_args([])).engine_kwargs()
    from engine.cli import build_parser as engine_parser
    assert engine_parser().parse_args(["--prompt", "x", "--logprobs-mode", "processed_logprobs"]).logprobs_mode \
        == "processed_logprobs"
