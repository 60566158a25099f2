"""Data parallelism (engine.data_parallel): N replicas behind one LLM / server.

One DP=2 engine (two replica processes of a tiny random llama) serves the module; the fault test, which kills
a replica, runs last. The Ray tests start a local Ray cluster and are marked slow:
    python -m pytest -q -p no:xdist tests/test_data_parallel.py -m slow
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir

BS = 16
# two "system prompts" of 3 full blocks each, then a per-request tail
SYS_A = [10 + (i * 7) % 200 for i in range(3 * BS)]
SYS_B = [20 + (i * 11) % 200 for i in range(3 * BS)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, detokenize=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-dp", seed=11)[0]


ENGINE_KW = dict(num_blocks=96, block_size=BS, max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def dp2(tiny):
    from engine import LLM
    llm = LLM(tiny, data_parallel_size=2, **ENGINE_KW)
    yield llm
    llm.close()


def _prompts():
    return [[5 + i, 17, 33, 2 + i, 9, 100 + i] for i in range(6)] + [SYS_A + [3, 4 + i] for i in range(2)]


def test_greedy_texts_identical_dp2_vs_dp1(tiny, dp2):
    from engine import LLM
    with LLM(tiny, **ENGINE_KW) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(_prompts(), GREEDY)]
    got = [o.outputs[0].token_ids for o in dp2.generate(_prompts(), GREEDY)]
    assert got == ref
    routed = [r.routed for r in dp2.engine.replicas]
    assert all(n > 0 for n in routed), routed           # both replicas served part of the batch


def test_bad_data_parallel_arguments_are_refused(tiny):
    from engine import LLM
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny, data_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(tiny, distributed_executor_backend="mpi")


def test_core_sets_split_evenly():
    from engine.data_parallel import core_sets
    assert core_sets(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert core_sets(3, [0, 1]) == [None, None, None]


def test_replicas_are_separate_processes_on_disjoint_cores(dp2):
    eng = dp2.engine
    pids = {r.transport.pid() for r in eng.replicas}
    assert len(pids) == 2 and os.getpid() not in pids
    sets = [r.transport.cpus for r in eng.replicas]
    if len(os.sched_getaffinity(0)) >= 2:
        assert all(sets) and not set(sets[0]) & set(sets[1])
        for r in eng.replicas:
            assert os.sched_getaffinity(r.transport.pid()) == set(r.transport.cpus)


def _run(eng, rid, prompt, max_tokens=4):
    s = eng.submit(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False))
    last = None
    for last in s:
        pass
    return last


def test_prefix_aware_routing_follows_the_cached_prefix(dp2):
    eng = dp2.engine
    assert eng.routing == "prefix"
    assert eng.reset_prefix_cache()
    time.sleep(0.3)                                 # the AllBlocksCleared events reach the router
    # the first request of each system prompt, in flight together: load puts them on different replicas
    sa = eng.submit("a0", SYS_A + [1, 2], SamplingParams(max_tokens=4, temperature=0, detokenize=False))
    sb = eng.submit("b0", SYS_B + [1, 2], SamplingParams(max_tokens=4, temperature=0, detokenize=False))
    # the route log, not the live owner map: a request that already finished has left the map
    routed = {r: rank for r, rank, _ in eng.route_log}
    by_rank = {r.rank: r for r in eng.replicas}
    owner_a, owner_b = by_rank[routed["a0"]], by_rank[routed["b0"]]
    assert owner_a is not owner_b
    for s in (sa, sb):
        for _ in s:
            pass
    before = eng.metrics_snapshot()["replicas"]
    for i in range(4):
        for sys_prompt, name, owner in ((SYS_A, "a", owner_a), (SYS_B, "b", owner_b)):
            rid = f"{name}{i + 1}"
            s = eng.submit(rid, sys_prompt + [50 + i, 60 + i], SamplingParams(max_tokens=3, temperature=0,
                                                                              detokenize=False))
            routed = {r: (rank, n) for r, rank, n in eng.route_log}[rid]
            assert routed == (owner.rank, 3), f"{rid} went to replica {routed}"
            for _ in s:
                pass
    after = eng.metrics_snapshot()["replicas"]
    for owner in (owner_a, owner_b):
        hits = after[owner.rank]["prefix_cache_hits"] - before[owner.rank]["prefix_cache_hits"]
        assert hits == 4 * 3 * BS, (owner.rank, hits)     # every follow-up reused its system prompt's 3 blocks
    # the routing came from the replicas' KV-cache events, not only from what was routed: both prefixes'
    # block hashes are in the owners' reported sets and not in the other's
    ha, hb = eng._block_hashes(SYS_A + [0]), eng._block_hashes(SYS_B + [0])
    assert set(ha) <= owner_a.cached and not set(ha) & owner_b.cached
    assert set(hb) <= owner_b.cached and not set(hb) & owner_a.cached


def test_events_drive_the_router_index(dp2):
    eng = dp2.engine
    assert eng.reset_prefix_cache()
    deadline = time.monotonic() + 5
    while any(r.cached for r in eng.replicas) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(r.cached for r in eng.replicas)       # AllBlocksCleared emptied both
    rep = eng.replicas[1]
    eng._call_on(rep, _noop, ())                          # (the replica is up and answering)
    prompt = SYS_B + [7, 7]
    out = eng.call_all(_generate_locally, prompt)         # computed on both replicas outside the router
    assert all(out.values())
    deadline = time.monotonic() + 5
    hashes = set(eng._block_hashes(prompt))
    while not all(hashes <= r.cached for r in eng.replicas) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(hashes <= r.cached for r in eng.replicas)  # learned from BlockStored events alone


def _noop(engine):
    return True


def _generate_locally(engine, prompt):
    engine.add_request("local", prompt, SamplingParams(max_tokens=1, temperature=0, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    return True


@pytest.fixture(scope="module")
def dp_server(dp2):
    import falcon.testing

    from server.app import create_app
    from server.settings import ServerSettings
    app = create_app(engine=dp2.engine, settings=ServerSettings(log_requests=False, warmup=False))
    yield app, falcon.testing.TestClient(app)


def test_server_completion_stream_and_metrics(dp2, dp_server):
    app, client = dp_server
    prompt = [5, 17, 33, 2, 9, 100]
    r = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json["choices"][0]["text"]
    r = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                      "stream": True})
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    m = client.simulate_get("/metrics").text
    lines = [ln for ln in m.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    per = {ln.split('engine="')[1][0]: float(ln.split()[-1]) for ln in lines if "engine=" in ln}
    total = [float(ln.split()[-1]) for ln in lines if "engine=" not in ln]
    assert set(per) == {"0", "1"} and total == [sum(per.values())], lines
    assert "jitkern:dp_replica_up" in m
    assert client.simulate_get("/health").status_code == 200
    saved = [r.state for r in dp2.engine.replicas]
    try:
        for r in dp2.engine.replicas:
            r.state = "down"                         # every replica restarting: not ready, and a 503 to submit
        assert client.simulate_get("/health").status_code == 503
        r = client.simulate_post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 503 and "no data-parallel replica is serving" in r.json["error"]["message"]
    finally:
        for r, st in zip(dp2.engine.replicas, saved):
            r.state = st


def test_abort_reaches_the_owning_replica(dp2, dp_server):
    eng = dp2.engine
    s = eng.submit("ab", [30, 31, 32], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                                                       detokenize=False))
    next(s)
    owner = eng._owner["ab"]
    s.abort()
    deadline = time.monotonic() + 10
    while owner.load and time.monotonic() < deadline:
        time.sleep(0.02)
    assert owner.load == 0
    snap = eng.metrics_snapshot()["replicas"][owner.rank]
    assert snap["num_requests_running"] == 0 and snap["num_requests_waiting"] == 0
    # (the server aborts a stream whose client went away through the same RequestStream.abort); a streamed
    # request on the pool after the abort runs to [DONE]
    app, client = dp_server
    r = client.simulate_post("/v1/completions", json={"prompt": [30, 31], "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_killed_replica_fails_its_requests_and_comes_back(dp2, dp_server):
    from engine.data_parallel import ReplicaDeadError
    eng = dp2.engine
    app, client = dp_server
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False)
    streams = [eng.submit(f"k{i}", [30 + i, 31, 32, 33 + i], long) for i in range(4)]
    for s in streams:
        next(s)                                          # all running
    victim = eng._owner["k0"]
    assert sum(1 for i in range(4) if eng._owner[f"k{i}"] is victim) in (1, 2, 3)
    other = next(r for r in eng.replicas if r is not victim)
    # one HTTP request on the victim too: it must end as a 503 JSON error naming the replica
    http = {}

    def post():
        http["r"] = client.simulate_post("/v1/completions", json={"prompt": [40, 41, 42], "max_tokens": 400,
                                                                  "temperature": 0, "ignore_eos": True})
    owner_of = {i: eng._owner[f"k{i}"] for i in range(4)}
    victim_load = victim.load
    t = threading.Thread(target=post)
    t.start()
    deadline = time.monotonic() + 10
    while victim.load == victim_load and other.load < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(victim.transport.pid(), signal.SIGKILL)
    t0 = time.monotonic()
    outcome = {}
    for i, s in enumerate(streams):
        try:
            for _ in s:
                pass
            outcome[i] = "done"
        except ReplicaDeadError as e:
            assert f"replica {victim.rank} died" in str(e)
            outcome[i] = "failed"
    assert time.monotonic() - t0 < 60
    # the victim's requests failed naming it; the survivor's ran to their end
    assert outcome == {i: "failed" if owner_of[i] is victim else "done" for i in range(4)}, outcome
    t.join(60)
    r = http["r"]
    if r.status_code != 200:                            # (it may have been routed to the survivor)
        assert r.status_code == 503 and f"replica {victim.rank}" in r.json["error"]["message"], r.text
    # the survivor keeps serving while the victim restarts, and the victim comes back and takes load
    assert _run(eng, "after-1", [7, 8, 9]).finished
    deadline = time.monotonic() + 90
    while victim.state != "up" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim.state == "up" and victim.restarts == 1
    routed = victim.routed
    for i in range(4):
        assert _run(eng, f"after-{i + 2}", [7, 8, 9 + i]).finished
    assert victim.routed > routed
    m = client.simulate_get("/metrics").text
    restarts = [ln for ln in m.splitlines() if ln.startswith("jitkern:dp_replica_restarts_total")
                and f'engine="{victim.rank}"' in ln]
    assert restarts and float(restarts[0].split()[-1]) == 1.0, restarts


# ------------------------------------------------------------------------------------------ Ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_replicas_match_and_restart(tiny):
    ray = pytest.importorskip("ray")
    from engine import LLM
    from engine.data_parallel import ReplicaDeadError
    try:
        with LLM(tiny, **ENGINE_KW) as one:
            ref = [o.outputs[0].token_ids for o in one.generate(_prompts(), GREEDY)]
        with LLM(tiny, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW) as llm:
            eng = llm.engine
            assert eng.backend == "ray"
            got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
            assert got == ref
            pids = {r.transport.pid() for r in eng.replicas}
            assert len(pids) == 2
            s = eng.submit("rk", [30, 31, 32], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                                                               detokenize=False))
            next(s)
            victim = eng._owner["rk"]
            os.kill(victim.transport.pid(), signal.SIGKILL)
            with pytest.raises(ReplicaDeadError, match=f"replica {victim.rank} died"):
                for _ in s:
                    pass
            deadline = time.monotonic() + 120
            while victim.state != "up" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert victim.state == "up"
            assert victim.transport.pid() not in pids       # Ray restarted the actor
    finally:
        ray.shutdown()
