"""The lpm scheduling policy (SGLang's longest-prefix-match) and the scheduler's prefill cap while requests decode;
both checked against the scheduler-free reference of tests/test_scheduler.py, the server flags beside them."""
import random

import pytest

from engine.sampling_params import SamplingParams
from tests.test_scheduler import (VOCAB, check_against_reference, make_engine, random_workload, run,
                                  submit)


def _warm(sched, runner, prefix):
    submit(sched, [("warm", prefix + [9], SamplingParams(max_tokens=1, ignore_eos=True))])
    run(sched, runner)


@pytest.mark.parametrize("policy, first", [("fcfs", "cold"), ("lpm", "hot")])
def test_lpm_admits_the_request_with_the_warm_prefix_first(policy, first):
    sched, runner = make_engine(policy=policy, max_num_seqs=1, block_size=4)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]          # three blocks, cached by a finished request
    _warm(sched, runner, prefix)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    reqs = submit(sched, [("cold", [40, 41, 42, 43, 44, 45, 46, 47, 48], params),       # arrives first
                          ("hot", prefix + [30, 31], params)])
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == [first]
    if first == "hot":
        assert out.scheduled[0].start == 12                           # admitted after its cached prefix
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    check_against_reference(reqs, sched.config.max_model_len)       # same tokens whatever the order


def test_lpm_ties_and_long_queues_keep_fcfs_order():
    from engine.scheduler import LPM_MAX_QUEUE
    sched, runner = make_engine(policy="lpm", max_num_seqs=1, block_size=4, num_blocks=512, max_model_len=64)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    _warm(sched, runner, prefix)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    # more waiting than SGLang sorts: plain fcfs, the cold first arrival goes first
    work = [(f"c{i}", [20 + i % 40, 21, 22, 23, 24], params) for i in range(LPM_MAX_QUEUE)]
    submit(sched, work + [("hot", prefix + [1], params)])
    assert [s.req_id for s in sched.schedule().scheduled] == ["c0"]
    sched2, runner2 = make_engine(policy="lpm", max_num_seqs=1, block_size=4)
    _warm(sched2, runner2, prefix)
    submit(sched2, [("a", [30, 31, 32], params), ("b", [33, 34, 35], params), ("hot", prefix + [2], params)])
    order = []
    while sched2.has_unfinished():
        out = sched2.schedule()
        order += [s.req_id for s in out.scheduled if s.req_id not in order]
        sched2.update_from_output(out, runner2.execute(out))
    assert order == ["hot", "a", "b"]                               # equal (no) hits: arrival order


class _Fixed:
    def __init__(self, n):
        self.n = n

    def tokens(self):
        return self.n


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "priority"])
def test_random_workloads_match_the_reference_with_lpm_and_a_prefill_cap(policy):
    rng = random.Random(11)
    for trial in range(4):
        sched, runner = make_engine(policy=policy, num_blocks=48, budget=24, max_num_seqs=6)
        sched.prefill_budget = _Fixed(rng.choice([1, 3, 7]))
        reqs = submit(sched, random_workload(rng, 25, sched.config.max_model_len))

        def check(s, out):
            decoding = [x for x in out.scheduled if not x.is_prefill]
            if decoding:     # while someone decodes, prefill work stays within the cap
                assert sum(x.num_tokens for x in out.scheduled if x.is_prefill) <= s.prefill_budget.n
        run(sched, runner, on_step=check)
        check_against_reference(reqs, sched.config.max_model_len)


def test_decodes_run_every_step_while_a_long_prompt_prefills():
    sched, runner = make_engine(budget=32, max_model_len=200, num_blocks=128)
    sched.prefill_budget = _Fixed(4)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    reqs = submit(sched, [("s", [1, 2, 3], params)])
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    reqs += submit(sched, [("long", [rng % VOCAB + 1 for rng in range(150)], SamplingParams(max_tokens=2))])
    chunks = []

    def check(s, out):
        ids = {x.req_id: x for x in out.scheduled}
        if "long" in ids and ids["long"].is_prefill:
            assert "s" in ids or s.get_request("s") is None
            chunks.append(ids["long"].num_tokens)
    run(sched, runner, on_step=check)
    assert chunks[:5] == [4] * 5                                    # capped while "s" decodes (vs 29 uncapped)
    check_against_reference(reqs, sched.config.max_model_len)


def test_lpm_on_the_engine_keeps_greedy_outputs():
    from engine.llm import LLM
    prefix = list(range(300, 364))
    prompts = [prefix + [7, 8, 9], list(range(900, 940)), prefix + [11, 12]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    got = {}
    for policy in ("fcfs", "lpm"):
        m = LLM(scheduling_policy=policy, max_num_seqs=1)
        try:
            m.generate([prefix + [1]], sp)                          # the warm prefix
            got[policy] = [o.outputs[0].token_ids for o in m.generate(prompts, sp)]
        finally:
            m.close()
    assert got["lpm"] == got["fcfs"]


def test_server_flags():
    from server.cli import build_parser, gunicorn_command, main
    from server.settings import ServerSettings
    cfg = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5599", "topic": "t"}'
    args = build_parser().parse_args(["--scheduling-policy", "lpm", "--kv-events-config", cfg,
                                      "--itl-target-ms", "150"])
    s = ServerSettings.from_env(gunicorn_command(args)[1])
    assert (s.scheduling_policy, s.kv_events_config, s.itl_target_ms) == ("lpm", cfg, 150.0)
    kw = s.engine_kwargs()
    assert (kw["scheduling_policy"], kw["kv_events_config"], kw["itl_target_ms"]) == ("lpm", cfg, 150.0)
    for argv, needle in ((["--kv-events-config", '{"enable_kv_cache_events": true, "port": 1}'], "port"),
                         (["--kv-events-config", "{"], "not valid JSON"), (["--itl-target-ms", "-1"], ">= 0")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
