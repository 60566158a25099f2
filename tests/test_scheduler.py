"""Scheduler tests against a fake model that really goes through the paged KV cache.

The fake runner stores each computed token (and its position) in a flat "KV cache" at
the slot the scheduler gave it, and samples by reading the whole sequence back through
the block table: so wrong slot mappings, wrong prefix-cache hits or blocks overwritten
while shared change the sampled tokens and fail the comparison with a plain Python
reference generator that has no cache at all.
"""

import logging
import random

import pytest

from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sizing import (KVPoolTooSmallError, kv_block_bytes, num_blocks_for_memory,
                           resolve_max_model_len)

VOCAB = 64
EOS = 0


def next_token(seq):
    """Deterministic 'model': a hash of the whole sequence so far."""
    h = len(seq)
    for t in seq:
        h = (h * 1000003 + t + 7) % 2147483647
    return h % VOCAB


def reference_generate(prompt, params, max_model_len, eos=(EOS,), model=next_token):
    """What any correct scheduler must produce for one request, computed without one."""
    seq = list(prompt)
    out = []
    max_tokens = params.resolve_max_tokens(len(prompt), max_model_len)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    while True:
        t = model(seq)
        seq.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and t in stops:
            return out, "stop"
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return out, "length"


class FakeRunner:
    def __init__(self, kv: KVCacheManager, model=next_token):
        self.kv = kv
        self.bs = kv.block_size
        self.cache = [None] * (kv.num_blocks * kv.block_size)
        self.model = model

    def execute(self, out):
        # Like a layer: write all new K/V first, then attend.
        for s in out.scheduled:
            assert s.slot_mapping == [s.block_table[p // self.bs] * self.bs + p % self.bs for p in s.positions]
            assert s.token_ids == s.request.all_token_ids[s.start:s.end]
            for pos, tok, slot in zip(s.positions, s.token_ids, s.slot_mapping):
                # Only blocks owned by this request alone are ever written (an abort during
                # the step frees them early: harmless, they hold no cached prefix).
                block = self.kv.pool.blocks[slot // self.bs]
                if s.request.is_finished:
                    assert block.ref_cnt == 0 and block.block_hash is None
                else:
                    assert block.ref_cnt == 1
                self.cache[slot] = (pos, tok)
        sampled = {}
        for s in out.scheduled:
            if not s.sample:
                continue
            seq = []
            for p in range(s.end):
                pos, tok = self.cache[s.block_table[p // self.bs] * self.bs + p % self.bs]
                assert pos == p
                seq.append(tok)
            sampled[s.req_id] = [self.model(seq)]
        return sampled


def make_engine(num_blocks=64, block_size=4, max_model_len=96, budget=32, max_num_seqs=8, policy="fcfs",
                caching=True, model=next_token, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, hash_seed="test")
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=budget,
                          max_num_seqs=max_num_seqs, policy=policy, **kw)
    return Scheduler(cfg, kv), FakeRunner(kv, model)


def run(sched, runner, max_steps=20000, on_step=None):
    """Drive to completion; check per-step limits; return (finish order, step outputs)."""
    finished = []
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert out.num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
        assert len(out.scheduled) <= sched.config.max_num_seqs
        assert sched.num_running <= sched.config.max_num_seqs
        steps.append(out)
        if on_step:
            on_step(sched, out)
        for upd in sched.update_from_output(out, runner.execute(out)):
            if upd.finished:
                finished.append(upd.request)
        assert len(steps) < max_steps, "scheduler did not make progress"
    return finished, steps


def random_workload(rng, n, max_model_len, shared_prefixes=3):
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(shared_prefixes)]
    reqs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + \
                 [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 25))]
        prompt = prompt[: max_model_len - 1]
        max_tokens = rng.choice([1, 3, 8, 20, 40, 0])
        ignore_eos = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2])
        if max_tokens > 0:
            min_tokens = min(min_tokens, max_tokens)    # min_tokens > max_tokens is refused at construction
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def submit(sched, workload, eos=(EOS,), **kw):
    reqs = []
    for rid, prompt, params in workload:
        r = Request(rid, prompt, params.clone(), eos_token_ids=eos, **kw)
        sched.add_request(r)
        reqs.append(r)
    return reqs


def check_against_reference(reqs, max_model_len):
    for r in reqs:
        tokens, reason = reference_generate(r.prompt_token_ids, r.sampling_params, max_model_len)
        assert r.output_token_ids == tokens, r
        assert r.finish_reason == reason, r


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_blocks,budget,max_num_seqs", [
    (200, 512, 64),  # roomy: everything at once
    (200, 7, 4),  # tiny budget: prompts are chunked over many steps
    (26, 16, 8),  # tiny pool: preemption by recompute
])
def test_random_workloads_match_reference(seed, num_blocks, budget, max_num_seqs):
    rng = random.Random(seed)
    max_model_len = 96
    sched, runner = make_engine(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len)
    reqs = submit(sched, random_workload(rng, 30, max_model_len))
    finished, steps = run(sched, runner)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    check_against_reference(reqs, max_model_len)
    assert sched.kv.usage == 0.0
    assert not sched.running and not sched.num_waiting and not sched.requests


def test_tiny_pool_preempts_and_still_matches_big_pool():
    rng = random.Random(5)
    max_model_len = 96
    workload = random_workload(rng, 24, max_model_len)
    results = {}
    for num_blocks in (400, 25):
        sched, runner = make_engine(num_blocks=num_blocks, budget=64, max_num_seqs=16,
                                    max_model_len=max_model_len)
        reqs = submit(sched, workload)
        run(sched, runner)
        results[num_blocks] = ({r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs},
                               sched.num_preemptions_total)
    assert results[400][0] == results[25][0]
    assert results[400][1] == 0
    assert results[25][1] > 0  # the small pool really had to preempt
    assert all(reason in ("stop", "length") for _, reason in results[25][0].values())


def test_preempted_request_goes_to_front_and_recomputes():
    sched, runner = make_engine(num_blocks=6, block_size=4, budget=64, max_num_seqs=4, max_model_len=24)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a, b = submit(sched, [("a", [1, 2, 3, 4, 5, 6], params), ("b", [7, 8, 9, 10, 11, 12], params)])
    seen = []

    def on_step(s, out):
        if out.preempted_req_ids:
            seen.append((list(out.preempted_req_ids), [r.request_id for r in s.waiting]))

    run(sched, runner, on_step=on_step)
    assert seen and seen[0][0] == ["b"] and seen[0][1][0] == "b"  # latest admitted goes, to the front
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    check_against_reference([a, b], 24)


# --------------------------------------------------------------------------- prefix caching


def test_prefix_cache_hits_and_identical_results():
    rng = random.Random(9)
    shared = [rng.randrange(1, VOCAB) for _ in range(21)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    sched, runner = make_engine(num_blocks=64, block_size=4)
    (first,) = submit(sched, [("first", shared + [5, 6], params)])
    run(sched, runner)
    assert sched.kv.stats.hits == 0 and first.num_cached_tokens == 0
    queries_before = sched.kv.stats.queries
    (second,) = submit(sched, [("second", shared + [9, 9, 9], params)])
    out = sched.schedule()
    # 21 shared tokens = 5 full blocks of 4: computation starts after them.
    assert out.scheduled[0].start == 20 and second.num_cached_tokens == 20
    cached_first = [sched.kv.pool.get_cached_block(h) for h in first.block_hashes[:5]]
    assert None not in cached_first and out.scheduled[0].block_table[:5] == cached_first
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    assert sched.kv.stats.hits == 20
    assert sched.kv.stats.queries == queries_before + second.num_prompt_tokens
    check_against_reference([first, second], 96)
    # Same outputs as with the cache off.
    off, off_runner = make_engine(num_blocks=64, block_size=4, caching=False)
    again = submit(off, [("second", shared + [9, 9, 9], params)])
    run(off, off_runner)
    assert again[0].output_token_ids == second.output_token_ids and off.kv.stats.hits == 0


def test_concurrent_shared_prefix_shares_blocks():
    shared = list(range(1, 17))  # 4 full blocks
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sched, runner = make_engine(num_blocks=64, block_size=4, budget=64)
    (a,) = submit(sched, [("a", shared + [20], params)])
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    (b,) = submit(sched, [("b", shared + [30, 31], params)])
    out = sched.schedule()
    assert a.block_ids[:4] == b.block_ids[:4]
    for bid in a.block_ids[:4]:
        assert sched.kv.pool.blocks[bid].ref_cnt == 2
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    check_against_reference([a, b], 96)


def test_generated_tokens_are_cached_too():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    sched, runner = make_engine(num_blocks=64, block_size=4)
    (a,) = submit(sched, [("a", [3, 1, 4], params)])
    run(sched, runner)
    follow_up = a.prompt_token_ids + a.output_token_ids + [2]  # a multi-turn continuation
    (b,) = submit(sched, [("b", follow_up, params)])
    out = sched.schedule()
    # a computed 3 prompt + 11 output tokens (the last output never goes through the model):
    # 3 full blocks, all cached, all reusable by the continuation.
    assert out.scheduled[0].start == 12
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    check_against_reference([b], 96)


# --------------------------------------------------------------------------- budget and limits


def test_chunked_prefill_respects_budget():
    sched, runner = make_engine(num_blocks=128, block_size=4, budget=10, max_num_seqs=8, max_model_len=128)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    long_prompt = [random.Random(3).randrange(1, VOCAB) for _ in range(57)]
    reqs = submit(sched, [("long", long_prompt, params), ("short", [5, 6, 7], params)])
    finished, steps = run(sched, runner)
    chunks = [s for out in steps for s in out.scheduled if s.req_id == "long" and s.start < 57]
    assert len(chunks) >= 6 and not any(c.sample for c in chunks[:-1]) and chunks[-1].sample
    assert chunks[-1].completes_prompt and not chunks[0].completes_prompt
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    assert all(out.num_scheduled_tokens <= 10 for out in steps)
    assert max(out.num_scheduled_tokens for out in steps) == 10  # the budget is used, not wasted
    check_against_reference(reqs, 128)


def test_long_prefill_threshold_caps_chunks():
    sched, runner = make_engine(budget=64, long_prefill_token_threshold=8)
    reqs = submit(sched, [("a", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))])
    _, steps = run(sched, runner)
    assert all(s.num_tokens <= 8 for out in steps for s in out.scheduled)
    check_against_reference(reqs, 96)


def test_max_num_seqs_respected():
    sched, runner = make_engine(num_blocks=200, budget=512, max_num_seqs=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = submit(sched, [(f"r{i}", [i + 1, 2, 3], params) for i in range(10)])
    _, steps = run(sched, runner)
    assert max(len(out.scheduled) for out in steps) == 3
    check_against_reference(reqs, 96)


def test_decode_steps_are_one_token():
    sched, runner = make_engine()
    reqs = submit(sched, [("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))])
    _, steps = run(sched, runner)
    assert [(s.start, s.num_tokens, s.is_prefill, s.sample) for out in steps for s in out.scheduled] == \
        [(0, 5, True, True), (5, 1, False, True), (6, 1, False, True), (7, 1, False, True)]
    check_against_reference(reqs, 96)


# --------------------------------------------------------------------------- policies


def test_priority_policy_order():
    sched, runner = make_engine(policy="priority", max_num_seqs=1, budget=64)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    specs = [("p5a", 5), ("p1a", 1), ("p5b", 5), ("p0", 0), ("p1b", 1)]
    for i, (rid, prio) in enumerate(specs):
        sched.add_request(Request(rid, [i + 1, 2], params.clone(), priority=prio, arrival_time=float(i)))
    finished, _ = run(sched, runner)
    assert [r.request_id for r in finished] == ["p0", "p1a", "p1b", "p5a", "p5b"]


def test_fcfs_policy_order():
    sched, runner = make_engine(policy="fcfs", max_num_seqs=1, budget=64)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, prio in enumerate([5, 1, 0]):
        sched.add_request(Request(f"r{i}", [i + 1, 2], params.clone(), priority=prio, arrival_time=float(i)))
    finished, _ = run(sched, runner)
    assert [r.request_id for r in finished] == ["r0", "r1", "r2"]


def test_priority_preempts_lowest_priority():
    sched, runner = make_engine(policy="priority", num_blocks=8, block_size=4, budget=64, max_num_seqs=4,
                                max_model_len=32)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    reqs = []
    for i, (rid, prio) in enumerate([("low", 9), ("high", 0), ("mid", 4)]):
        r = Request(rid, [i + 1] * 6, params.clone(), priority=prio, arrival_time=float(i))
        sched.add_request(r)
        reqs.append(r)
    victims = []
    run(sched, runner, on_step=lambda s, out: victims.extend(out.preempted_req_ids))
    assert victims and victims[0] == "low"
    assert "high" not in victims
    check_against_reference(reqs, 32)


def test_bad_policy_rejected():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(max_model_len=10, policy="lifo")


# --------------------------------------------------------------------------- abort / finish


def test_abort_frees_blocks_running_and_waiting():
    sched, runner = make_engine(num_blocks=64, budget=16, max_num_seqs=2)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    reqs = submit(sched, [(f"r{i}", list(range(1 + i, 20 + i)), params) for i in range(4)])
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.kv.usage > 0 and sched.num_waiting == 2
    # Abort one request while its step is in flight: its result must be dropped.
    out = sched.schedule()
    assert sched.abort_request("r0") is True
    sampled = runner.execute(out)
    updates = sched.update_from_output(out, sampled)
    assert all(u.req_id != "r0" for u in updates)
    assert reqs[0].status == RequestStatus.FINISHED_ABORTED and reqs[0].finish_reason == "abort"
    assert reqs[0].block_ids == []
    for rid in ("r1", "r2", "r3"):
        assert sched.abort_request(rid)
    assert sched.abort_request("r1") is False and sched.abort_request("nope") is False
    assert sched.kv.usage == 0.0
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_cached_blocks > 0  # computed full blocks stay cached for reuse
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"r0", "r1", "r2", "r3"}


def test_finish_request_for_stop_strings():
    sched, runner = make_engine()
    (r,) = submit(sched, [("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))])
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.finish_request("a", "stop", stop_reason="###")
    assert r.finish_reason == "stop" and r.stop_reason == "###" and sched.kv.usage == 0
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish_request("a", "bogus")


# --------------------------------------------------------------------------- stop rules


def test_max_tokens_unset_runs_to_context():
    for mt in (None, 0, -1):
        sched, runner = make_engine(max_model_len=40)
        (r,) = submit(sched, [("a", list(range(1, 11)), SamplingParams(max_tokens=mt, ignore_eos=True))])
        run(sched, runner)
        assert r.max_tokens == 30
        assert r.num_output_tokens == 30 and r.num_tokens == 40 and r.finish_reason == "length"


def test_max_tokens_beyond_context_stops_at_context():
    sched, runner = make_engine(max_model_len=20)
    (r,) = submit(sched, [("a", [1] * 15, SamplingParams(max_tokens=100, ignore_eos=True))])
    run(sched, runner)
    assert r.num_tokens == 20 and r.finish_reason == "length"


def always(token):
    return lambda seq: token


def test_min_tokens_masks_eos_until_reached():
    sched, runner = make_engine(model=always(EOS))
    (r,) = submit(sched, [("a", [1, 2], SamplingParams(max_tokens=20, min_tokens=5))])
    run(sched, runner)
    assert r.output_token_ids == [EOS] * 5 and r.finish_reason == "stop" and r.stop_reason is None
    sched, runner = make_engine(model=always(EOS))
    (r,) = submit(sched, [("a", [1, 2], SamplingParams(max_tokens=20))])
    run(sched, runner)
    assert r.output_token_ids == [EOS] and r.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens_but_stop_ids_still_stop():
    sched, runner = make_engine(model=always(EOS))
    (r,) = submit(sched, [("a", [1, 2], SamplingParams(max_tokens=7, ignore_eos=True))])
    run(sched, runner)
    assert r.output_token_ids == [EOS] * 7 and r.finish_reason == "length"
    sched, runner = make_engine(model=always(13))
    (r,) = submit(sched, [("a", [1, 2], SamplingParams(max_tokens=7, ignore_eos=True, stop_token_ids=[13]))])
    run(sched, runner)
    assert r.output_token_ids == [13] and r.finish_reason == "stop" and r.stop_reason == 13


def test_secondary_eos_ids_stop_unless_ignored():
    sched, runner = make_engine(model=always(50))
    (r,) = submit(sched, [("a", [1], SamplingParams(max_tokens=5))], eos=(EOS, 50))
    run(sched, runner)
    assert r.output_token_ids == [50] and r.finish_reason == "stop"
    assert r.min_tokens_mask_ids == {EOS, 50}


def test_multiple_sampled_tokens_truncate_at_stop():
    sched, runner = make_engine()
    (r,) = submit(sched, [("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[9]))])
    out = sched.schedule()
    upd = sched.update_from_output(out, {"a": [4, 9, 5]})
    assert r.output_token_ids == [4, 9] and upd[0].finished and upd[0].new_token_ids == [4, 9]


def test_missing_sample_is_an_error_without_side_effects():
    sched, runner = make_engine()
    (r,) = submit(sched, [("a", [1, 2, 3], SamplingParams(max_tokens=10))])
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})
    assert r.output_token_ids == []


# --------------------------------------------------------------------------- fit and admission


def test_request_that_cannot_fit_alone_finishes_with_error():
    # Pool: 4 blocks x 4 = 16 tokens, but the scheduler was told max_model_len 64 (no sizing check).
    sched, runner = make_engine(num_blocks=4, block_size=4, max_model_len=64, budget=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    big, small = submit(sched, [("big", list(range(1, 21)), params),
                                ("small", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))])
    grows = submit(sched, [("grows", [5, 6, 7, 8, 9, 10], params)])[0]
    finished, _ = run(sched, runner, max_steps=500)
    assert big.finish_reason == "error" and "--num-blocks" in big.error and "20 tokens" in big.error
    assert small.finish_reason == "length" and small.num_output_tokens == 4
    # 'grows' fits at first, then outgrows the whole pool while decoding: error, not a hang.
    assert grows.finish_reason == "error" and grows.num_output_tokens >= 10
    assert grows.output_token_ids == reference_generate(grows.prompt_token_ids, params, 64)[0][:grows.num_output_tokens]
    assert sched.kv.usage == 0.0


def test_admission_rejects_prompt_at_or_past_max_model_len():
    sched, _ = make_engine(max_model_len=32)
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("a", list(range(32))))
    assert info.value.param == "prompt"
    assert "32 tokens long" in str(info.value) and "max_model_len) is 32" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("b", list(range(40))))
    assert "40" in str(info.value) and "32" in str(info.value)
    sched.add_request(Request("c", list(range(31))))  # 31 < 32 is fine
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("c", [1]))
    assert info.value.param == "request_id"
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("d", []))
    assert info.value.param == "prompt"
    assert not sched.get_request("a") and sched.num_waiting == 1


def test_admission_validates_params_when_vocab_known():
    sched, _ = make_engine(vocab_size=VOCAB)
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("a", [1, 2], SamplingParams(top_p=0.0)))
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(Request("b", [1, VOCAB]))
    assert info.value.param == "prompt"


# --------------------------------------------------------------------------- sizing


def test_sizing_refuses_pool_smaller_than_max_model_len():
    with pytest.raises(KVPoolTooSmallError) as info:
        resolve_max_model_len(num_blocks=256, block_size=32, max_model_len=10000, model_max_len=32768)
    msg = str(info.value)
    for needle in ("10000", "256 blocks", "8192 tokens", "313 blocks", "--num-blocks", "--max-model-len",
                   "--block-size"):
        assert needle in msg, needle
    ok = resolve_max_model_len(256, 32, max_model_len=8192, model_max_len=32768)
    assert ok.max_model_len == 8192 and not ok.auto_fitted


def test_sizing_refuses_beyond_model_context():
    with pytest.raises(ValueError, match="max_position_embeddings = 4096"):
        resolve_max_model_len(1000, 32, max_model_len=5000, model_max_len=4096)


def test_sizing_auto_fits_and_logs(caplog):
    with caplog.at_level(logging.INFO, logger="engine.sizing"):
        s = resolve_max_model_len(256, 32, None, model_max_len=40960)
    assert s.max_model_len == 8192 and s.auto_fitted
    assert "auto-fitted to 8192" in caplog.text and "--num-blocks" in caplog.text
    s = resolve_max_model_len(1000, 32, 0, model_max_len=4096)
    assert s.max_model_len == 4096 and not s.auto_fitted


def test_blocks_from_memory_budget():
    per_block = kv_block_bytes(num_layers=28, num_kv_heads=8, head_dim=128, block_size=32, dtype_bytes=2)
    assert per_block == 2 * 28 * 8 * 128 * 32 * 2
    assert num_blocks_for_memory(per_block * 100 + per_block - 1, per_block) == 100
    with pytest.raises(KVPoolTooSmallError, match="--kv-cache-memory"):
        num_blocks_for_memory(per_block - 1, per_block)
    with pytest.raises(ValueError, match="head_dim"):
        kv_block_bytes(28, 8, 0, 32, 2)
