"""Fairness: a long prompt arriving while streams decode must not freeze them (engine.scheduler.PrefillBudget).

The server's default (usage_context "openai_api_server", off CUDA) caps each step's prefill tokens from measured
step times so a step takes about itl_target_ms (200). Before, a 2048-token chunk ran in one step and every stream
waited for it: seconds on 2 cores."""
import time

import pytest

from engine.scheduler import PrefillBudget
from engine.sampling_params import SamplingParams


def test_prefill_budget_converges_on_the_target():
    """Against a simulated device (step = d + p * c, c rising with depth) the budget settles where a step takes
    the target, follows the rising cost, and never leaves [floor, ceiling]."""
    b = PrefillBudget(0.2, 2048)
    assert b.tokens() == 64                              # nothing measured yet: a small first chunk
    d, c = 0.05, 0.002
    for _ in range(40):
        p = b.tokens()
        b.observe(d + p * c, p)
    assert abs((d + b.tokens() * c) - 0.2) < 0.01        # settles at the target: (0.2 - 0.05) / 0.002 = 75
    c = 0.02                                             # deeper in the prompt: 10x costlier per token
    for _ in range(20):
        p = b.tokens()
        b.observe(d + p * c, p)
    assert abs((d + b.tokens() * c) - 0.2) < 0.03 and b.tokens() in (6, 7, 8)
    b.observe(0.05, 0)                                   # a decode-only step teaches nothing
    assert b.tokens() in (6, 7, 8)
    for _ in range(30):
        b.observe(5.0, max(1, b.tokens()))               # decodes alone past the target: the floor, never 0
    assert b.tokens() == 1
    fast = PrefillBudget(0.2, 512)
    for _ in range(20):
        fast.observe(0.01, fast.tokens())
    assert fast.tokens() == 512                          # never above max_num_batched_tokens
    with pytest.raises(ValueError):
        PrefillBudget(0, 10)


def _itl_during_long_prefill(itl_target_ms, n_long):
    from engine.llm_engine import EngineArgs, LLMEngine
    eng = LLMEngine(EngineArgs(usage_context="openai_api_server", itl_target_ms=itl_target_ms, max_num_seqs=8))
    try:
        assert eng.args.max_num_batched_tokens == 2048
        sp = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True, detokenize=False)
        for i in range(4):
            eng.add_request(f"s{i}", [100 + i] * 12, sp)
        for _ in range(4):
            eng.step()                                   # the streams are decoding
        eng.add_request("long", list(range(1000, 1000 + n_long)),
                        SamplingParams(max_tokens=2, temperature=0, detokenize=False))
        last = {f"s{i}": time.perf_counter() for i in range(4)}
        gaps, long_tokens = [], None
        t0 = time.perf_counter()
        while long_tokens is None and time.perf_counter() - t0 < 120:
            for o in eng.step():
                now = time.perf_counter()
                if o.request_id == "long":
                    if o.finished:
                        long_tokens = o.outputs[0].token_ids
                elif o.outputs[0].delta_token_ids:
                    gaps.append(now - last[o.request_id])
                    last[o.request_id] = now
        return sorted(gaps), long_tokens
    finally:
        eng.close()


@pytest.mark.timeout(300)
def _long_prompt_alone(n_long):
    """The long prompt's greedy tokens on the unbounded path (itl_target_ms=0: one 2000-token step), alone."""
    from engine.llm_engine import EngineArgs, LLMEngine
    eng = LLMEngine(EngineArgs(usage_context="openai_api_server", itl_target_ms=0, max_num_seqs=8))
    try:
        eng.add_request("long", list(range(1000, 1000 + n_long)),
                        SamplingParams(max_tokens=2, temperature=0, detokenize=False))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    return o.outputs[0].token_ids
    finally:
        eng.close()


def test_running_streams_keep_flowing_during_a_long_prefill():
    gaps, long_tokens = _itl_during_long_prefill(None, 2000)
    # served, with the greedy tokens the unbounded path gives (computed on this CPU tier: the tiers' sums may
    # round differently, each is batch- and chunking-invariant)
    assert long_tokens == _long_prompt_alone(2000)
    p99 = gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]
    # target 200 ms; 2 s leaves room for a loaded 2-core machine. One 2000-token step (itl_target_ms=0, the
    # old behaviour) takes 4-7 s there.
    assert p99 < 2.0, f"ITL p99 {p99:.2f}s, max {gaps[-1]:.2f}s over {len(gaps)} tokens"
