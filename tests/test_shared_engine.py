"""One engine process shared by several front ends (engine.data_parallel.SharedEngine, the server's
`--api-server-count`): each front end's greedy tokens equal the engine's own, a front end that leaves has its
running requests aborted while the others go on, and a killed engine process fails the running requests with
an error naming it, is restarted by its owner and serves the front ends again, which reconnect by themselves."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir

ENGINE_KW = dict(num_blocks=96, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0, detokenize=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-shared", seed=13)[0]


@pytest.fixture(scope="module")
def shared(tiny):
    from engine.data_parallel import DataParallelEngine, SharedEngine
    from engine.llm_engine import EngineArgs
    eng = SharedEngine(EngineArgs(model=tiny, **ENGINE_KW))
    fronts = [DataParallelEngine(EngineArgs(model=tiny, **ENGINE_KW), attach=eng.attach) for _ in range(2)]
    yield eng, fronts
    for f in fronts:
        f.close()
    eng.stop()


def _prompts(k):
    return [[5 + i + k, 17, 33, 2 + i, 9, 100 + i + k] for i in range(4)]


def _collect(front, tag, prompts, params=GREEDY):
    streams = [front.submit(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    out = []
    for s in streams:
        last = None
        for o in s:
            last = o
        out.append(last.outputs[0].token_ids)
    return out


def test_front_ends_share_one_engine_and_match_it_alone(tiny, shared):
    from engine.llm_engine import EngineArgs, LLMEngine
    eng, fronts = shared
    assert {f.replicas[0].transport.pid() for f in fronts} == {eng.proc.pid}
    ref_engine = LLMEngine(EngineArgs(model=tiny, **ENGINE_KW))
    try:
        want = {}
        for k in range(2):
            for i, p in enumerate(_prompts(k)):
                ref_engine.add_request(f"{k}-{i}", p, GREEDY)
        while ref_engine.has_unfinished_requests():
            for o in ref_engine.step():
                if o.finished:
                    want[o.request_id] = o.outputs[0].token_ids
    finally:
        ref_engine.close()
    got: dict = {}

    def run(k):
        got[k] = _collect(fronts[k], f"share{k}", _prompts(k))
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k in range(2):
        assert got[k] == [want[f"{k}-{i}"] for i in range(4)]


def test_a_front_end_that_leaves_has_its_requests_aborted(tiny, shared):
    from engine.data_parallel import DataParallelEngine
    from engine.llm_engine import EngineArgs
    eng, fronts = shared
    leaving = DataParallelEngine(EngineArgs(model=tiny, **ENGINE_KW), attach=eng.attach)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False)
    stream = leaving.submit("leaver", [3, 4, 5, 6], long)
    next(iter(stream))                              # running in the engine
    leaving.close()

    def running():
        return fronts[0].metrics_snapshot()["num_requests_running"]
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
    # the others still serve
    assert len(_collect(fronts[1], "after-leave", _prompts(0))[0]) == GREEDY.max_tokens


def test_a_killed_engine_fails_running_requests_and_comes_back(tiny, shared):
    from engine.async_engine import EngineUnavailableError
    eng, fronts = shared
    pid = eng.proc.pid
    long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True, detokenize=False)
    stream = fronts[0].submit("doomed", [7, 8, 9], long)
    next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailableError, match="engine process"):
        for _ in stream:
            pass
    deadline = time.monotonic() + 120
    while (eng.proc.pid == pid or any(f.replicas[0].state != "up" for f in fronts)) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert eng.restarts == 1 and eng.proc.pid != pid
    for k, f in enumerate(fronts):
        assert f.replicas[0].state == "up"
        assert len(_collect(f, f"back{k}", _prompts(k))[0]) == GREEDY.max_tokens
