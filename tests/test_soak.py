"""Bounded cost over time (issue 13): bursts of varied requests leave the engine as it was.

Ordinary traffic used to make the server permanently slower: every decode batch size recorded a graph that
was never evicted, each graph kept its argument arrays alive, and the address cache of
jitkern/runtime/launch.py swept all of them on every new array. Here a tiny random llama serves bursts of
2-32 requests with varied prompt and output lengths (greedy and seeded sampling, logit edits, stop strings,
n > 1, aborts) under deliberately small cache bounds, and after every burst:

- recorded graphs, address-cache entries and arrays held by graphs stay under their bounds;
- the KV pool is back to its initial free count, no request state is left, the prefix cache stays within
  the pool;
- memory allocated by the engine's and kernels' code (tracemalloc) stops growing after the warm-up bursts;
- a fixed probe gives the same tokens and does the same number of kernel launches as before the soak, and
  no kernel has more than a handful of specialisations (counts, not wall time: the host is shared).
"""
import gc
import time
import tracemalloc

import numpy as np
import pytest

from engine.llm_engine import EngineArgs, LLMEngine
from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir

MAX_GRAPHS = 6
ADDRESS_CACHE_MAX = 512
NUM_BURSTS = 24
PROBES = [[5, 17, 33, 2, 9], [7, 8, 9, 10, 11, 12, 13], [200, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny-llama-soak", seed=3)[0]


def kernel_plans() -> dict:
    """Launch plans memoised per live kernel (one per argument-type signature, divisibility hints and
    constexprs)."""
    from jitkern.jit import Kernel
    return {k: set(k._plans) for k in gc.get_objects() if isinstance(k, Kernel)}


# Plans the soak may add to one kernel: request data (top_k, lengths) reaches kernels only as run-time ints, whose
# specialisation is their width and divisibility by 16 (2 variants each for the <= 3 such ints of a kernel).
MAX_PLANS_PER_KERNEL = 8


# Memory allocated from the engine's and the kernels' code (threads left by other test modules do not count).
ENGINE_CODE = [tracemalloc.Filter(True, "*/engine/*"), tracemalloc.Filter(True, "*/jitkern/*")]


def engine_memory() -> int:
    return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(ENGINE_CODE).statistics("filename"))


def run_all(eng, abort_some=None) -> dict:
    final, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if abort_some and steps == 3:
            for rid in abort_some:
                eng.abort_request(rid)
        assert steps < 5000
    return final


def probe(eng, launch_module) -> tuple:
    """Greedy tokens of the probe prompts and the number of kernel launches they took (run eagerly, so the
    count does not depend on which graphs happen to be cached)."""
    calls = {"n": 0}
    real = launch_module.pack_args

    def counting(*a):
        calls["n"] += 1
        return real(*a)
    launch_module.pack_args = counting
    eng.runner.use_graphs = False
    try:
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
        for i, p in enumerate(PROBES):
            eng.add_request(f"probe{i}", p, sp.clone())
        final = run_all(eng)
    finally:
        launch_module.pack_args = real
        eng.runner.use_graphs = True
    return [final[f"probe{i}"].outputs[0].token_ids for i in range(len(PROBES))], calls["n"]


def burst(eng, rng, index: int, size: int, long_prompts: bool = False) -> None:
    aborted = []
    for j in range(size):
        rid = f"b{index}-{j}"
        plen = 60 if long_prompts else int(rng.integers(1, 60))
        prompt = rng.integers(3, 250, plen).tolist()
        kind = int(rng.integers(0, 5))
        kw = dict(max_tokens=int(rng.integers(1, 48)), ignore_eos=True, detokenize=kind == 3)
        if kind == 0:
            kw.update(temperature=0)
        elif kind == 1:
            kw.update(temperature=0.9, seed=int(rng.integers(0, 2**63)), top_k=int(rng.integers(1, 60)))
        elif kind == 2:
            kw.update(temperature=0.7, n=2, logit_bias={int(rng.integers(0, 256)): 2.0}, bad_words=["t7 t8"],
                      repetition_penalty=1.2)
        elif kind == 3:
            kw.update(temperature=0, stop=["t9"], min_tokens=1)
        else:
            kw.update(temperature=1.0, allowed_token_ids=rng.integers(2, 256, 40).tolist())
            aborted.append(rid)
        eng.add_request(rid, prompt, SamplingParams(**kw))
    run_all(eng, abort_some=aborted[: len(aborted) // 2])


def test_bursts_of_varied_requests_leave_every_cache_bounded(tiny, monkeypatch):
    import jitkern.runtime.launch as launch_module
    monkeypatch.setattr(launch_module, "ADDRESS_CACHE_MAX", ADDRESS_CACHE_MAX)
    eng = LLMEngine(EngineArgs(model=tiny, num_blocks=256, block_size=16, max_num_seqs=32,
                               max_num_batched_tokens=256))
    eng.runner.max_graphs = MAX_GRAPHS
    rng = np.random.default_rng(2026)
    try:
        initial_free = eng.kv.num_free_blocks
        plans_before = kernel_plans()                          # other tests may have specialised kernels too
        burst(eng, rng, -1, 32, long_prompts=True)            # buffers grow to their largest size here
        want_tokens, want_launches = probe(eng, launch_module)
        tracemalloc.start()
        traced, process = [], []
        t0 = time.monotonic()
        for b in range(NUM_BURSTS):
            burst(eng, rng, b, int(rng.integers(2, 33)))
            assert eng.runner.num_graphs <= MAX_GRAPHS
            assert len(launch_module._addr_cache) <= ADDRESS_CACHE_MAX
            assert eng.kv.num_free_blocks == initial_free and eng.kv.usage == 0
            assert not eng._reqs and not eng._seq_of and not eng.scheduler.requests
            assert not eng.kv._num_registered and eng.kv.pool.num_cached_blocks <= eng.kv.num_blocks
            gc.collect()                               # count live memory, not garbage awaiting the collector
            traced.append(engine_memory())
            process.append(tracemalloc.get_traced_memory()[0])
            if b == NUM_BURSTS // 3:
                snapshot = tracemalloc.take_snapshot().filter_traces(ENGINE_CODE)
        soak_s = time.monotonic() - t0
        warm = traced[NUM_BURSTS // 3]
        growth = max(traced[NUM_BURSTS // 3:]) - warm
        if growth >= 4 * 2**20:
            top = tracemalloc.take_snapshot().filter_traces(ENGINE_CODE).compare_to(snapshot, "lineno")[:8]
            pytest.fail(f"traced memory grew by {growth / 2**20:.1f} MiB after the warm-up bursts; largest "
                        "growth:\n" + "\n".join(str(t) for t in top))
        tracemalloc.stop()
        got_tokens, got_launches = probe(eng, launch_module)
        assert got_tokens == want_tokens
        assert got_launches == want_launches
        added = {getattr(k.fn, "__name__", repr(k)): len(p - plans_before.get(k, set()))
                 for k, p in kernel_plans().items()}
        crowded = {name: n for name, n in added.items() if n > MAX_PLANS_PER_KERNEL}
        assert not crowded, f"kernels specialised per request: {crowded}"
        print(f"soak: {NUM_BURSTS} bursts in {soak_s:.1f}s, engine memory {warm / 2**20:.1f} -> "
              f"{traced[-1] / 2**20:.1f} MiB (whole process {process[NUM_BURSTS // 3] / 2**20:.1f} -> "
              f"{process[-1] / 2**20:.1f} MiB), graphs {eng.runner.num_graphs}, "
              f"address cache {len(launch_module._addr_cache)}")
    finally:
        tracemalloc.stop()
        eng.close()


def test_address_cache_forgets_dead_arrays_and_stays_bounded(monkeypatch):
    import jitkern.runtime.launch as launch_module
    monkeypatch.setattr(launch_module, "ADDRESS_CACHE_MAX", 64)
    monkeypatch.setattr(launch_module, "_addr_cache", {})
    base = np.zeros(1000, np.float32)
    views = [base[i:] for i in range(200)]
    for i, v in enumerate(views):
        assert launch_module.array_address(v) == base.ctypes.data + 4 * i
        assert len(launch_module._addr_cache) <= 64
    assert launch_module.array_address(views[-1]) == views[-1].ctypes.data      # a hit
    del views, v
    assert len(launch_module._addr_cache) == 0                                  # entries die with their arrays
    a = np.ones(3)
    assert launch_module.array_address(a) == a.ctypes.data
    del a
    b = np.ones(3)                                # may reuse the id of `a`: never the stale address
    assert launch_module.array_address(b) == b.ctypes.data
