"""The CUDA engine's output overlap (LLMEngine overlap_output, issue 8): a step's output work (detokenisation,
stop strings, logprob dicts, RequestOutputs) runs in the next step() call, between launching that call's
forward pass and waiting for it.

On the fake CUDA device (tests/fake_cuda.py: host memory standing in for the GPU, CPU kernels), with a tiny
random llama: every request's whole stream of RequestOutputs (deltas, text, ids, logprobs, finish and stop
reasons) is the same with the overlap on and off: greedy and seeded sampling, stop strings that hit mid-stream
(found one step late with the overlap: the extra token is dropped), stop token ids (as EOS), max_tokens,
n = 2, requests finishing in different steps, aborts (also of a request a late stop string finished), and
streaming through engine.async_engine. The order of the work is checked too: the previous step's outputs are
built after the next step is launched and before it is waited for.
"""
import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.model_compare import random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.model_fixtures import tiny_model_dir
    return tiny_model_dir(tmp_path_factory, "tiny-llama-overlap", seed=21)[0]


@pytest.fixture()
def fake_cuda(monkeypatch):
    from tests.fake_cuda import install
    return install(monkeypatch)


def _engine(path, overlap, **kw):
    from engine.llm_engine import EngineArgs, LLMEngine
    args = dict(model=path, num_blocks=64, block_size=16, max_num_batched_tokens=64, device="cuda",
                overlap_output=overlap)
    args.update(kw)
    eng = LLMEngine(EngineArgs(**args))
    assert eng.overlap_output is overlap and eng.runner.device == "cuda"
    return eng


def _record(o):
    """Everything a user receives in one RequestOutput."""
    lp = lambda d: None if d is None else [{t: (v.logprob, v.rank, v.decoded_token) for t, v in e.items()}
                                           for e in d]
    return (o.finished, o.error, tuple(
        (c.index, c.text, tuple(c.token_ids), c.cumulative_logprob, lp(c.logprobs), c.finish_reason, c.stop_reason,
         c.delta_text, tuple(c.delta_token_ids), lp(c.delta_logprobs)) for c in o.outputs))


def _run(eng, requests, abort_at=None, after_abort=None):
    """Adds `requests` [(id, prompt, params)], steps until done; {id: [recorded outputs]}. abort_at: {step call:
    [ids]} aborted before that call; after_abort: {step call: [(id, prompt, params)]} added then."""
    streams = {}
    for rid, prompt, sp in requests:
        eng.add_request(rid, prompt, sp)
        streams[rid] = []
    calls = 0
    while eng.has_unfinished_requests():
        for rid in (abort_at or {}).get(calls, ()):
            eng.abort_request(rid)
        for rid, prompt, sp in (after_abort or {}).get(calls, ()):
            eng.add_request(rid, prompt, sp)
            streams.setdefault(rid, [])
        for o in eng.step():
            assert not (streams[o.request_id] and streams[o.request_id][-1][0]), f"output after the end: {o}"
            streams[o.request_id].append(_record(o))
        calls += 1
        assert calls < 500
    assert eng.kv.num_free_blocks == eng.num_blocks or eng.args.enable_prefix_caching
    assert not eng.scheduler.requests and eng._pending is None
    return streams


def _prompts(k, seed):
    return random_prompts(k, seed, hi=30)


def _scenario(tiny):
    """Requests that finish in different steps and ways, with stop strings / ids taken from a greedy probe run
    so that they hit mid-stream."""
    prompts = _prompts(7, seed=5)
    eng = _engine(tiny, False)
    try:
        probe = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
        outs = _run(eng, [(f"p{i}", p, probe) for i, p in enumerate(prompts[:3])])
    finally:
        eng.close()
    last = {rid: s[-1][2][0] for rid, s in outs.items()}     # (index, text, token_ids, ...)
    text1, ids1 = last["p1"][1], last["p1"][2]
    text2, ids2 = last["p2"][1], last["p2"][2]
    # a stop string that first appears at output token 5 of p1 (a token's text not seen before it)
    tok = eng.tokenizer
    stop = None
    for k in range(4, 12):
        piece = tok.decode([ids1[k]]).strip()
        if piece and piece not in tok.decode(list(ids1[:k])):
            stop = piece
            break
    assert stop is not None and stop in text1
    stop_id = ids2[6]
    assert stop_id not in ids2[:6]
    reqs = [
        ("greedy-12", prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        ("stop-str", prompts[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])),
        ("stop-str-incl", prompts[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True, logprobs=1)),
        ("stop-id", prompts[2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                               stop_token_ids=[stop_id])),
        ("eos", prompts[2], SamplingParams(max_tokens=20, temperature=0)),
        ("seeded", prompts[3], SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=7, logprobs=2)),
        ("seeded-n2", prompts[4], SamplingParams(max_tokens=7, n=2, temperature=1.0, seed=11)),
        ("unseeded", prompts[3], SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)),
        # unseeded, drawing from the engine's shared generator (top_k 1: greedy's tokens, so the stop string hits)
        ("stop-str-sampled", prompts[1], SamplingParams(max_tokens=20, temperature=0.7, top_k=1, ignore_eos=True,
                                                         stop=[stop])),
        ("greedy-3", prompts[5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)),
        ("plp", prompts[6], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1)),
    ]
    return reqs, stop, stop_id


def test_outputs_with_the_overlap_equal_without(tiny, fake_cuda, monkeypatch):
    from engine.scheduler import Scheduler
    reqs, stop, stop_id = _scenario(tiny)
    late = []             # stop strings found while the request's next step was already running
    real = Scheduler.finish_request

    def finish_request(self, req_id, reason="stop", stop_reason=None):
        r = self.requests.get(req_id)
        if r is not None and reason == "stop":
            late.append((req_id, r.num_computed_tokens == r.num_tokens))
        return real(self, req_id, reason, stop_reason)
    monkeypatch.setattr(Scheduler, "finish_request", finish_request)
    got, lates = {}, {}
    for overlap in (False, True):
        late.clear()
        eng = _engine(tiny, overlap)
        try:
            got[overlap] = _run(eng, reqs)
            if overlap:
                assert eng.runner.num_graphs > 0          # decode steps replayed graphs (their picks read late)
        finally:
            eng.close()
        lates[overlap] = sorted(late)
    assert got[True] == got[False]
    # both stop-string requests were finished by the output work: after their step without the overlap, while
    # their next step ran with it (that step's token dropped)
    # (the unseeded requests get the same tokens: a request finished while its step ran draws nothing)
    assert lates == {False: [("stop-str", False), ("stop-str-incl", False), ("stop-str-sampled", False)],
                     True: [("stop-str", True), ("stop-str-incl", True), ("stop-str-sampled", True)]}
    final = {rid: s[-1][2] for rid, s in got[True].items()}
    # the scenario covers what it says: a stop string mid-stream, a stop id, max_tokens
    assert final["stop-str"][0][5] == "stop" and final["stop-str"][0][6] == stop
    assert len(final["stop-str"][0][2]) < 20 and stop not in final["stop-str"][0][1]
    assert final["stop-str-incl"][0][1].endswith(stop)
    assert final["stop-id"][0][5] == "stop" and final["stop-id"][0][6] == stop_id
    assert final["greedy-12"][0][5] == "length" and len(final["greedy-12"][0][2]) == 12
    assert len(final["seeded-n2"]) == 2
    assert len(final["unseeded"][0][2]) == 12
    # streaming: several deltas per request, and their concatenation is the final text
    for rid, stream in got[True].items():
        for idx in range(len(stream[-1][2])):
            assert "".join(r[2][idx][7] for r in stream) == stream[-1][2][idx][1], rid
    assert len(got[True]["greedy-12"]) >= 6


def test_alone_equals_batched_with_the_overlap(tiny, fake_cuda):
    """Requests finishing in different steps next to each other give each its solo stream (batch invariance
    with late stop strings freeing slots one step later than without the overlap)."""
    reqs, _, _ = _scenario(tiny)
    eng = _engine(tiny, True)
    try:
        batched = _run(eng, reqs)
        for rid, prompt, sp in reqs[:4]:
            alone = _run(eng, [(rid, prompt, sp)])
            assert alone[rid] == batched[rid], rid
    finally:
        eng.close()


def test_aborts_with_the_overlap(tiny, fake_cuda):
    """An abort between steps (while the previous step's outputs wait to be built) drops them: the aborted
    request gets a prefix of its stream and nothing after the abort; its id can be used again at once; the
    other requests' streams are unchanged, and every KV block comes back."""
    reqs, _, _ = _scenario(tiny)
    keep = [r for r in reqs if r[0] != "greedy-12"]
    again = ("greedy-12", _prompts(1, seed=99)[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ref = {}
    eng = _engine(tiny, False, enable_prefix_caching=False)
    try:
        ref = _run(eng, reqs)
        ref_again = _run(eng, [again])["greedy-12"]
    finally:
        eng.close()
    for overlap in (True, False):
        eng = _engine(tiny, overlap, enable_prefix_caching=False)
        try:
            # greedy-12 aborted before step call 4 (with the overlap: while its step-3 outputs wait to be built),
            # then its id used again by a new request at once
            got = _run(eng, reqs, abort_at={4: ["greedy-12"]}, after_abort={4: [again]})
        finally:
            eng.close()
        stream = got["greedy-12"]
        n_before = len(stream) - len(ref_again)
        assert stream[n_before:] == ref_again, overlap
        assert 1 <= n_before < len(ref["greedy-12"]) and stream[:n_before] == ref["greedy-12"][:n_before], overlap
        for rid, _, _ in keep:
            assert got[rid] == ref[rid], (overlap, rid)


def test_previous_outputs_are_built_while_the_step_runs(tiny, fake_cuda, monkeypatch):
    """With the overlap the previous step's output work runs between ModelRunner.launch and finish of the
    next step (so a GPU does not wait on it); without it, after finish."""
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    events = []
    for name in ("launch", "finish"):
        real = getattr(ModelRunner, name)
        monkeypatch.setattr(ModelRunner, name, lambda self, *a, _r=real, _n=name: (events.append(_n), _r(self, *a))[1])
    real_out = LLMEngine._finish_outputs
    monkeypatch.setattr(LLMEngine, "_finish_outputs", lambda self, *a: (events.append("outputs"), real_out(self, *a))[1])
    eng = _engine(tiny, True)
    try:
        _run(eng, [("a", [3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))])
    finally:
        eng.close()
    # step 1 (prefill): nothing pending; steps 2..5: outputs of the previous step between launch and finish;
    # a last call that schedules nothing builds the last step's outputs
    assert events == ["launch", "finish"] + ["launch", "outputs", "finish"] * 4 + ["outputs"]


def test_streaming_through_the_async_engine(tiny, fake_cuda):
    from engine.async_engine import AsyncEngine
    reqs, _, _ = _scenario(tiny)
    # (requests are admitted while the engine thread runs: unseeded ones would draw in a timing-dependent order)
    reqs = [r for r in reqs if r[2].temperature == 0 or r[2].seed is not None]
    got = {}
    for overlap in (False, True):
        ae = AsyncEngine(engine=_engine(tiny, overlap))
        try:
            streams = {rid: ae.submit(rid, prompt, sp) for rid, prompt, sp in reqs}
            got[overlap] = {rid: [_record(o) for o in s] for rid, s in streams.items()}
        finally:
            ae.shutdown(timeout=5)
    # outputs per request are the same; (how many steps a delta covers depends on when requests were admitted
    # in the engine thread, so compare the final output and the concatenated deltas)
    for rid in got[False]:
        a, b = got[False][rid], got[True][rid]
        assert a[-1][:2] == b[-1][:2] and [c[:7] for c in a[-1][2]] == [c[:7] for c in b[-1][2]], rid
        for idx in range(len(a[-1][2])):
            assert "".join(r[2][idx][7] for r in b) == b[-1][2][idx][1]
            assert sum((list(r[2][idx][8]) for r in b), []) == list(b[-1][2][idx][2])


def test_the_switch(tiny, fake_cuda, monkeypatch):
    """Auto: on for device cuda, off on the CPU; JITKERN_OVERLAP_OUTPUT overrides auto; vLLM's
    disable_async_output_proc turns it off."""
    from engine.llm import LLM
    from engine.llm_engine import EngineArgs, LLMEngine
    monkeypatch.delenv("JITKERN_OVERLAP_OUTPUT", raising=False)
    cases = [({"device": "cuda"}, None, True), ({"device": "cpu"}, None, False), ({"device": "cuda"}, "0", False),
             ({"device": "cpu"}, "1", True)]
    for kw, env, want in cases:
        if env is None:
            monkeypatch.delenv("JITKERN_OVERLAP_OUTPUT", raising=False)
        else:
            monkeypatch.setenv("JITKERN_OVERLAP_OUTPUT", env)
        eng = LLMEngine(EngineArgs(model=tiny, num_blocks=16, block_size=16, **kw))
        try:
            assert eng.overlap_output is want, (kw, env)
        finally:
            eng.close()
    monkeypatch.setenv("JITKERN_OVERLAP_OUTPUT", "yes")
    with pytest.raises(ValueError, match="JITKERN_OVERLAP_OUTPUT"):
        LLMEngine(EngineArgs(model=tiny, num_blocks=16, block_size=16, device="cuda"))
    monkeypatch.delenv("JITKERN_OVERLAP_OUTPUT")
    llm = LLM(tiny, num_blocks=16, block_size=16, device="cuda", disable_async_output_proc=True)
    try:
        assert llm.engine.overlap_output is False
    finally:
        llm.close()


def test_device_greedy_rows_nan_rows_fail_alone():
    """The host side of a device-greedy step (on the GPU's critical path, so vectorised): each row's picked id
    as a Python int, and a row whose picked logit is not finite (a NaN row) fails alone."""
    from types import SimpleNamespace

    from engine.sampler import Sampler
    rng = np.random.default_rng(3)
    R = 7
    tokens = rng.integers(0, 50000, R).astype(np.int32)
    values = rng.standard_normal(R).astype(np.float32)
    values[4] = np.nan
    values[1] = np.inf
    rows = rng.permutation(R)
    rids = [f"r{i}" for i in range(R)]
    res = SimpleNamespace(sample_rows={rid: int(r) for rid, r in zip(rids, rows)}, greedy_tokens=tokens,
                          greedy_values=values)
    out = Sampler._device_greedy_rows(res, rids[::-1])
    assert list(out) == rids[::-1]
    for rid, r in zip(rids, rows):
        if r in (1, 4):
            assert out[rid].token_id == -1 and "NaN" in out[rid].error
        else:
            assert out[rid].error is None and out[rid].token_id == int(tokens[r]) and type(out[rid].token_id) is int


def test_preemption_with_the_overlap(tiny, fake_cuda):
    """A KV pool too small for the batch: requests are preempted (recompute) while their previous step's outputs
    wait to be built, and late stop strings finish requests that may be waiting again; the same streams."""
    reqs, _, _ = _scenario(tiny)
    long = [(f"long-{i}", p[:15], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts(12, seed=8)) if len(p) >= 15][:4]
    assert len(long) == 4
    reqs = long[:2] + reqs + long[2:]
    got, preempted = {}, {}
    for overlap in (False, True):
        eng = _engine(tiny, overlap, num_blocks=14)
        try:
            got[overlap] = _run(eng, reqs)
            preempted[overlap] = eng.scheduler.num_preemptions_total
        finally:
            eng.close()
    assert preempted[False] > 0 and preempted[True] > 0
    # A late stop string frees its blocks one step later, so the scheduler may preempt differently for a step:
    # every n = 1 stream is still the same (one token per output), a request of n = 2 gets the same tokens per
    # sequence and the same final output, but which output carries which sequence's delta can differ; unseeded
    # requests draw from the shared generator in batch order (another batch: other draws) and are left out.
    for rid, sp in ((r[0], r[2]) for r in reqs):
        a, b = got[False][rid], got[True][rid]
        if sp.n == 1 and (sp.temperature == 0 or sp.seed is not None or sp.top_k == 1):
            assert a == b, rid
        elif sp.seed is not None:
            assert a[-1] == b[-1], rid
            for idx in range(sp.n):
                assert [t for r in a for t in r[2][idx][8]] == [t for r in b for t in r[2][idx][8]]


def test_a_replaced_execute_still_runs_every_step(tiny, fake_cuda, monkeypatch):
    """Tests inject failures and perf tools time steps by replacing ModelRunner.execute (on the instance or the
    class): with the overlap on, the engine then runs every step through it (no overlap, same outputs)."""
    from engine.model_runner import ModelRunner
    reqs = [("a", [3, 4, 5, 6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
            ("b", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    eng = _engine(tiny, True)
    try:
        want = _run(eng, reqs)
        calls = []
        real = eng.runner.execute
        eng.runner.execute = lambda sched: (calls.append(len(sched.scheduled)), real(sched))[1]
        assert _run(eng, reqs) == want and calls and len(calls) >= 6
        del eng.runner.execute
        calls.clear()
        real_cls = ModelRunner.execute
        monkeypatch.setattr(ModelRunner, "execute", lambda self, sched: (calls.append(1), real_cls(self, sched))[1])
        assert _run(eng, reqs) == want and len(calls) >= 6
    finally:
        eng.close()


def test_a_failing_launch_fails_only_its_request(tiny, fake_cuda, monkeypatch):
    """A step whose launch raises (with the previous step's outputs still to build): those outputs are built
    and returned, the requests are re-run one by one, only the request at fault ends with an error."""
    from engine.model_runner import ModelRunner
    good = [("a", [3, 4, 5, 6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
            ("b", [7, 8, 9], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    eng = _engine(tiny, True)
    try:
        want = _run(eng, good)
        real = ModelRunner.launch

        def launch(self, sched):
            if any(s.req_id == "bad" and s.request.output_token_ids for s in sched.scheduled):
                raise RuntimeError("injected: a kernel failed on the bad request")
            return real(self, sched)
        monkeypatch.setattr(ModelRunner, "launch", launch)
        got = _run(eng, good + [("bad", [11, 12, 13], SamplingParams(max_tokens=6, temperature=0,
                                                                      ignore_eos=True))])
    finally:
        eng.close()
    assert got["a"] == want["a"] and got["b"] == want["b"]
    bad = got["bad"][-1]
    assert bad[0] and bad[1] and bad[2][0][5] == "error" and len(bad[2][0][2]) == 1
