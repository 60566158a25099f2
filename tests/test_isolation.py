"""One request never fails or stalls another (issue 13, "Isolation").

On a tiny random llama: hostile parameters are refused at admission naming the field; a failure that only
one request's processing triggers (logit edits, the model step, output processing, a row with nothing left
to sample) fails that request alone while the others finish with the tokens they get alone; aborting frees
the KV blocks of running, waiting and preempted requests. (The async front: tests/test_async_engine.py.)
"""
import numpy as np
import pytest

from engine import limits
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineArgs, LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir

P1 = [5, 17, 33, 2, 9, 100, 44]
P2 = [7, 8, 9, 10, 11]
P3 = [200, 3, 150, 77]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-isolation", seed=11)[0]


@pytest.fixture(scope="module")
def engine(tiny):
    eng = LLMEngine(EngineArgs(model=tiny, num_blocks=128, block_size=16, max_num_batched_tokens=128))
    yield eng
    eng.close()


def run_all(eng) -> dict:
    final = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert not eng.has_unfinished_requests()
    return final


def solo(eng, prompt, params) -> list:
    eng.add_request("solo", prompt, params.clone())
    return run_all(eng)["solo"].outputs[0].token_ids


GOOD = [("g1", P1, dict(max_tokens=10, temperature=0, ignore_eos=True)),
        ("g2", P2, dict(max_tokens=12, temperature=0.9, seed=123, ignore_eos=True, logit_bias={9: 1.5})),
        ("g3", P3, dict(max_tokens=8, temperature=0.8, top_k=20, seed=7, ignore_eos=True,
                        repetition_penalty=1.3))]


def good_alone(eng) -> dict:
    return {rid: solo(eng, p, SamplingParams(detokenize=False, **kw)) for rid, p, kw in GOOD}


def add_good(eng):
    for rid, p, kw in GOOD:
        eng.add_request(rid, p, SamplingParams(detokenize=False, **kw))


@pytest.mark.parametrize("kwargs,param", [
    (dict(seed=-2), "seed"),
    (dict(repetition_penalty=1e-39), "repetition_penalty"),
    (dict(allowed_token_ids=[1], min_tokens=2), "allowed_token_ids"),     # 1 is the eos of the tiny model
    (dict(bad_words=["\ud800"]), "bad_words"),
    (dict(bad_words=["x"] * 100_000), "bad_words"),
    (dict(allowed_token_ids=[4], bad_words=["t4"]), "bad_words"),
    (dict(stop_token_ids=[1000]), "stop_token_ids"),
    (dict(logit_bias={256: 1.0}), "logit_bias"),
])
def test_hostile_parameters_are_refused_at_admission_and_others_go_on(engine, kwargs, param):
    alone = good_alone(engine)
    add_good(engine)
    engine.step()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", P1, SamplingParams(max_tokens=4, temperature=1.0, **kwargs))
    assert e.value.param == param and isinstance(e.value, ValueError)
    assert "bad" not in engine._reqs
    final = run_all(engine)
    assert {rid: final[rid].outputs[0].token_ids for rid, _, _ in GOOD} == alone
    assert all(final[rid].error is None for rid, _, _ in GOOD)


def check_only_bad_failed(eng, alone, final, free_before):
    bad = final["bad"]
    assert bad.finished and bad.error and bad.outputs[0].finish_reason == "error"
    assert "internal error" in bad.error or "no token" in bad.error
    assert {rid: final[rid].outputs[0].token_ids for rid, _, _ in GOOD} == alone
    assert all(final[rid].outputs[0].finish_reason == "length" for rid, _, _ in GOOD)
    assert eng.kv.num_free_blocks == free_before and eng.scheduler.num_running == 0


def test_logit_edit_failure_of_one_request(engine, monkeypatch):
    alone = good_alone(engine)
    free_before = engine.kv.num_free_blocks
    real = engine.sampler._edits

    def edits(req):
        if req.request_id == "bad" and req.output_token_ids:
            raise RuntimeError("injected: logit edits of one request")
        return real(req)
    monkeypatch.setattr(engine.sampler, "_edits", edits)
    add_good(engine)
    engine.add_request("bad", P2, SamplingParams(max_tokens=10, logit_bias={3: 1.0}, detokenize=False))
    check_only_bad_failed(engine, alone, run_all(engine), free_before)


def test_model_step_failure_triggered_by_one_request(engine, monkeypatch):
    """The batch's forward raises whenever the bad request is in it: each request is re-run alone."""
    alone = good_alone(engine)
    free_before = engine.kv.num_free_blocks
    real = engine.runner.execute

    def execute(sched):
        if any(s.req_id == "bad" and s.request.output_token_ids for s in sched.scheduled):
            raise RuntimeError("injected: a kernel failed on the bad request")
        return real(sched)
    monkeypatch.setattr(engine.runner, "execute", execute)
    add_good(engine)
    engine.add_request("bad", P2, SamplingParams(max_tokens=10, detokenize=False))
    check_only_bad_failed(engine, alone, run_all(engine), free_before)


def test_batch_sampling_kernel_failure_triggered_by_one_request(engine, monkeypatch):
    """A batched sampling kernel raises when the bad request's row is in it; seeded requests keep their
    tokens although the step was sampled twice (uniforms are drawn once per step)."""
    import engine.ops.sampling as sampling
    alone = good_alone(engine)
    free_before = engine.kv.num_free_blocks
    real = sampling.apply_temperature
    bad_temperature = np.float32(1.7)

    def apply_temperature(x, temps):
        if np.any(np.asarray(temps) == bad_temperature):
            raise FloatingPointError("injected: temperature kernel")
        return real(x, temps)
    monkeypatch.setattr(sampling, "apply_temperature", apply_temperature)
    add_good(engine)
    engine.add_request("bad", P2, SamplingParams(max_tokens=10, temperature=1.7, detokenize=False))
    check_only_bad_failed(engine, alone, run_all(engine), free_before)


def test_output_processing_failure_of_one_request(engine):
    sp = dict(max_tokens=10, temperature=0, ignore_eos=True)
    alone = {rid: solo(engine, p, SamplingParams(**sp)) for rid, p in (("g1", P1), ("g2", P2))}
    free_before = engine.kv.num_free_blocks
    for rid, p in (("g1", P1), ("g2", P2), ("bad", P3)):
        engine.add_request(rid, p, SamplingParams(**sp))
    engine.step()
    st = engine._reqs["bad"].seqs[0]

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: detokenizer")
    st.detok.add = broken
    final = run_all(engine)
    assert final["bad"].outputs[0].finish_reason == "error" and "internal error" in final["bad"].error
    assert {rid: final[rid].outputs[0].token_ids for rid in ("g1", "g2")} == alone
    assert engine.kv.num_free_blocks == free_before


def test_a_row_with_nothing_left_to_sample_fails_that_request_alone(engine):
    """Multi-token bad words can mask the last allowed token only later in the output (not at admission)."""
    alone = good_alone(engine)
    free_before = engine.kv.num_free_blocks
    add_good(engine)
    # the word-level tokenizer: "t5 t6" is [5, 6]; after a 5, both allowed tokens are banned
    engine.add_request("bad", P2, SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=[5, 6],
                                                 logit_bias={5: 100}, bad_words=["t5 t6", "t5 t5"],
                                                 detokenize=False))
    final = run_all(engine)
    check_only_bad_failed(engine, alone, final, free_before)
    assert "no token can be generated at output position 1" in final["bad"].error
    assert final["bad"].outputs[0].token_ids == [5]


def test_bad_words_are_prepared_at_admission_in_linear_time(engine, monkeypatch):
    words = [f"t{i} t{i + 1}" for i in range(limits.MAX_BAD_WORDS - 1)] + ["t250"]
    calls = {"n": 0}
    real = engine.tokenizer.encode

    def encode(text, add_special_tokens=True):
        calls["n"] += 1
        return real(text, add_special_tokens=add_special_tokens)
    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    prep = engine.prepare_request("bw", P1, SamplingParams(max_tokens=5, temperature=0, bad_words=words,
                                                           detokenize=False))
    assert calls["n"] == 2 * len(words) + 0       # each word and its spaced form, nothing more
    edits = prep.seqs[0].request.logit_edits
    assert edits is not None and list(edits.banned_ids) == [250]
    assert sum(len(v) for v in edits.bad_sequences.values()) == len(words) - 1
    calls["n"] = 0
    engine.add_prepared(prep)
    out = run_all(engine)["bw"].outputs[0].token_ids
    assert calls["n"] == 0                        # nothing is tokenised on the engine's side of a step
    assert 250 not in out
    assert all(not (a == i and b == i + 1) for a, b in zip(out, out[1:]) for i in range(limits.MAX_BAD_WORDS - 1))
    assert not hasattr(engine.sampler, "_bad_words_cache")


def test_abort_frees_blocks_of_running_waiting_and_preempted_requests(tiny):
    eng = LLMEngine(EngineArgs(model=tiny, num_blocks=12, block_size=16, max_num_batched_tokens=64,
                               max_num_seqs=3, enable_prefix_caching=False))
    try:
        initial = eng.kv.num_free_blocks
        rng = np.random.default_rng(0)
        for i in range(5):
            eng.add_request(f"r{i}", rng.integers(3, 250, 40).tolist(),
                            SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, detokenize=False))
        statuses = {}
        for _ in range(400):
            eng.step()
            statuses = {rid: eng.scheduler.get_request(rid).status for rid in eng._reqs}
            if RequestStatus.PREEMPTED in statuses.values() and RequestStatus.RUNNING in statuses.values():
                break
        kinds = set(statuses.values())
        assert {RequestStatus.PREEMPTED, RequestStatus.RUNNING} <= kinds, statuses
        assert eng.kv.num_free_blocks < initial
        for rid in sorted(statuses, key=lambda r: statuses[r]):
            assert eng.abort_request(rid)
        assert eng.kv.num_free_blocks == initial and eng.kv.usage == 0
        assert not eng.has_unfinished_requests() and eng.scheduler.num_waiting == 0
    finally:
        eng.close()
