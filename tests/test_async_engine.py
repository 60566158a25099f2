"""The async front (issue 13): no caller waits forever, a batch of prompts is one command and one queue.

A dead engine thread wakes every stream and command with EngineDeadError and records its cause; a stuck one
times commands out (EngineTimeoutError) and withdraws them; `submit_batch` admits all prompts or none,
bounds n x prompts, and delivers through one queue without a thread per prompt.
"""
import threading
import time

import pytest

from engine import limits
from engine.async_engine import (AsyncEngine, EngineDeadError, EngineTimeoutError,
                                 RequestGroupStream)
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineArgs
from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir

P1 = [5, 17, 33, 2, 9, 100, 44]
P2 = [7, 8, 9, 10, 11]
P3 = [200, 3, 150, 77]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-async", seed=11)[0]


@pytest.fixture()
def async_engine(tiny):
    eng = AsyncEngine(EngineArgs(model=tiny, num_blocks=128, block_size=16, max_num_batched_tokens=128))
    yield eng
    eng.shutdown(timeout=1)


def test_engine_thread_death_wakes_every_waiter(async_engine):
    eng = async_engine
    stream = eng.submit("long", P1, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                                                   detokenize=False))
    next(stream)

    class Fatal(BaseException):
        pass

    def step():
        raise Fatal("injected: the engine thread dies")
    eng.engine.step = step
    with pytest.raises(EngineDeadError):
        for _ in stream:
            pass
    deadline = time.monotonic() + 10
    while eng.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(eng.dead, Fatal)
    with pytest.raises(EngineDeadError):
        eng.submit("after", P1, SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError):
        eng.call(lambda e: e.num_requests)


def test_a_stuck_engine_times_out_callers(async_engine):
    eng = async_engine
    release = threading.Event()
    real = eng.engine.step

    def stuck_step():
        release.wait(30)
        return real()
    eng.engine.step = stuck_step
    eng.command_timeout_s = 1.0
    try:
        eng.submit("s", P1, SamplingParams(max_tokens=3, temperature=0, detokenize=False))
    except EngineTimeoutError:
        pass                                     # it may already be inside the stuck step
    t0 = time.monotonic()
    with pytest.raises(EngineTimeoutError):
        eng.call(lambda e: e.num_requests)
    assert time.monotonic() - t0 < 10
    release.set()
    eng.engine.step = real
    assert eng.call(lambda e: True) is True       # the withdrawn command never ran; the engine goes on


def test_submit_batch_is_one_command_with_one_queue(async_engine):
    eng = async_engine
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    want = [[o for o in eng.submit(f"solo{i}", p, sp.clone())][-1].outputs[0].token_ids
            for i, p in enumerate((P1, P2, P3))]
    threads = threading.active_count()
    group = eng.submit_batch([(f"b{i}", p, sp.clone()) for i, p in enumerate((P1, P2, P3))])
    assert isinstance(group, RequestGroupStream)
    assert threading.active_count() == threads
    last = {}
    for index, out in group:
        last[index] = out
    assert [last[i].outputs[0].token_ids for i in range(3)] == want
    # all or nothing: a bad prompt in the batch admits none of them
    with pytest.raises(InvalidRequestError) as e:
        eng.submit_batch([("ok", P1, sp.clone()), ("bad", [10_000], sp.clone())])
    assert e.value.param == "prompt"
    assert eng.call(lambda e: e.num_requests) == 0
    too_many = limits.MAX_SEQUENCES_PER_REQUEST // 4 + 1
    with pytest.raises(InvalidRequestError) as e:
        eng.submit_batch([(f"m{i}", P1, SamplingParams(n=4, max_tokens=1)) for i in range(too_many)])
    assert e.value.param == "n"
    # abort of a group frees everything
    group = eng.submit_batch([(f"a{i}", p, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True,
                                                          detokenize=False)) for i, p in enumerate((P1, P2))])
    group.get(timeout=30)
    group.abort()
    deadline = time.monotonic() + 10
    while eng.call(lambda e: e.num_requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.call(lambda e: (e.num_requests, e.kv.usage)) == (0, 0)
