"""KV-cache events (engine/kv_events.py): vLLM's wire format, and a live ZMQ stream checked against the prefix
cache's own state (stored hashes, evictions, resets, kv_cache_report_mode)."""
import time

import pytest

from engine.errors import InvalidRequestError
from engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig,
                              KVEventsConfigError, decode_batch, encode_batch, external_hash)
from engine.sampling_params import SamplingParams


def _vllm_structs():
    """vLLM's msgspec definitions of the events (the array_like, tagged form), as the independent encoder."""
    msgspec = pytest.importorskip("msgspec")
    from typing import Any, Optional, Union

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class VStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[Union[bytes, int]]
        parent_block_hash: Optional[Union[bytes, int]]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]

    class VRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[Union[bytes, int]]
        medium: Optional[str]

    class VCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class VBatch(EventBatch):
        events: list[Union[VStored, VRemoved, VCleared]]

    return msgspec, VBatch, VStored, VRemoved, VCleared


@pytest.mark.parametrize("as_int", [True, False])
def test_encoding_is_byte_identical_to_vllms_msgspec_structs(as_int):
    msgspec, VBatch, VStored, VRemoved, VCleared = _vllm_structs()
    digests = [bytes(range(i, i + 32)) for i in (0, 7, 200)]
    h = [external_hash(d, as_int) for d in digests]
    if as_int:
        assert h[2] == int.from_bytes(digests[2][-8:], "big") and h[2] >= 1 << 63   # uint64 range is covered
    tokens = list(range(0, 70000, 2200))[:32]       # fixint, uint8, uint16 and uint32 forms
    ts = time.time()
    ours = KVEventBatch(ts, [BlockStored(h[:2], None, tokens, 16), BlockStored(h[2:], h[1], tokens[:16], 16,
                                                                                lora_id=3, medium=None),
                             BlockRemoved([h[0]]), AllBlocksCleared()], data_parallel_rank=0)
    theirs = VBatch(ts=ts, events=[VStored(h[:2], None, tokens, 16, None, "GPU"), VStored(h[2:], h[1], tokens[:16],
                                                                                          16, 3, None),
                                   VRemoved([h[0]], "GPU"), VCleared()], data_parallel_rank=0)
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)
    # and vLLM's decoder reads ours back
    back = msgspec.msgpack.Decoder(VBatch).decode(encode_batch(ours))
    assert [type(e).__name__ for e in back.events] == ["VStored", "VStored", "VRemoved", "VCleared"]
    assert back.events[1].parent_block_hash == h[1] and back.data_parallel_rank == 0
    # an unset rank is still written (nil): omit_defaults leaves array_like structs whole
    assert encode_batch(KVEventBatch(ts, [])) == msgspec.msgpack.encode(VBatch(ts=ts, events=[]))


def test_config_parsing():
    assert KVEventsConfig.parse(None) is None
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert cfg.publisher == "zmq" and cfg.enabled and cfg.replay_endpoint is None    # vLLM resolves an unset one
    assert KVEventsConfig.parse({}).publisher == "null"
    for bad, words in (("{not json", "not valid JSON"), ('{"enable_kv_cache_events": true, "port": 1}', "port"),
                       ('{"publisher": "kafka"}', "kafka"), ('[1]', "JSON object"),
                       ('{"enable_kv_cache_events": "yes"}', "true or false"), ('{"hwm": 0}', "hwm")):
        with pytest.raises(KVEventsConfigError, match=words) as e:
            KVEventsConfig.parse(bad)
        assert "\n" not in str(e.value)


def test_bad_config_fails_before_the_model_loads():
    from engine.llm_engine import EngineArgs, LLMEngine
    t = time.perf_counter()
    with pytest.raises(KVEventsConfigError, match="unknown key"):
        LLMEngine(EngineArgs(model="/nonexistent/model", kv_events_config={"enable": True}))
    assert time.perf_counter() - t < 5


class _Subscriber:
    def __init__(self, endpoint, topic):
        zmq = pytest.importorskip("zmq")
        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.seq = -1
        self.batches = []

    def drain(self, settle=0.3):
        deadline = time.time() + settle
        while time.time() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                seq = int.from_bytes(seq, "big")
                assert seq == self.seq + 1, "sequence numbers run 0, 1, 2, ... without a gap"
                self.seq = seq
                self.batches.append(decode_batch(payload))
                deadline = time.time() + settle
        out = [b for b in self.batches]
        self.batches = []
        return out


@pytest.fixture(scope="module")
def evented(tmp_path_factory):
    pytest.importorskip("zmq")
    from engine.llm_engine import EngineArgs, LLMEngine
    endpoint = f"ipc://{tmp_path_factory.mktemp('kvev')}/events.sock"
    eng = LLMEngine(EngineArgs(num_blocks=24, block_size=16, max_num_seqs=4,
                               kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                 "endpoint": endpoint, "topic": "kv@test"}))
    sub = _Subscriber(endpoint, "kv@test")
    time.sleep(0.5)             # (a SUB that joins late misses what was sent before)
    steps = {"n": 0}
    orig = eng.step

    def counting_step():
        steps["n"] += 1
        return orig()
    eng.step = counting_step
    yield eng, sub, steps
    eng.close()


def _run(eng, reqs):
    for rid, prompt, sp in reqs:
        eng.add_request(rid, prompt, sp)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_events_follow_the_prefix_cache(evented):
    eng, sub, steps = evented
    bs = 16
    to_int = lambda h: external_hash(h)        # noqa: E731
    model: set = set()                          # the cache as the event stream describes it
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    prefix = list(range(1000, 1048))            # three full blocks shared by both prompts
    a, b = prefix + [5, 6, 7, 8, 9], prefix + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]

    def apply(batches):
        stored = []
        for batch in batches:
            assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 60
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.block_size == bs and len(ev.token_ids) == bs * len(ev.block_hashes)
                    assert ev.medium == "GPU" and ev.lora_id is None
                    assert ev.parent_block_hash is None or ev.parent_block_hash in model
                    model.update(ev.block_hashes)
                    stored.append(ev)
                elif isinstance(ev, BlockRemoved):
                    assert set(ev.block_hashes) <= model
                    model.difference_update(ev.block_hashes)
                else:
                    model.clear()
        assert model == {to_int(h) for h in eng.kv.pool._cached}, "the stream and the cache agree"
        return stored

    n0 = steps["n"]
    _run(eng, [("a", a, sp)])
    batches = sub.drain()
    assert 0 < len(batches) <= steps["n"] - n0, "at most one batch per step"
    stored = apply(batches)
    # the prompt's three full blocks, with their tokens, in one event chained from the root
    first = stored[0]
    assert first.parent_block_hash is None and first.token_ids == a[:48]
    want = [to_int(h) for h in eng.kv.update_block_hashes(_req(eng, a))[:3]]
    assert first.block_hashes == want

    # b shares the prefix: incremental mode reports only its own new block
    _run(eng, [("b", b, sp)])
    stored = apply(sub.drain())
    assert stored and all(h not in want for ev in stored for h in ev.block_hashes)
    assert stored[0].parent_block_hash == want[2] and stored[0].token_ids == b[48:64]

    # full mode re-reports the reused prefix (parent None, the prefix's tokens)
    c = prefix + [30, 31]
    _run(eng, [("c", c, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False,
                                      extra_args={"kv_cache_report_mode": "full"}))])
    stored = apply(sub.drain())
    assert stored[0].block_hashes == want and stored[0].parent_block_hash is None and stored[0].token_ids == prefix

    # a pool of 24 blocks cannot keep everything: new prompts evict, and each eviction is a BlockRemoved
    others = [(f"x{i}", list(range(2000 + 100 * i, 2000 + 100 * i + 90)), sp) for i in range(4)]
    _run(eng, others)
    batches = sub.drain()
    removed = [h for bt in batches for ev in bt.events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert removed, "evictions were reported"
    apply(batches)

    # /reset_prefix_cache: AllBlocksCleared at once, without a step
    n = steps["n"]
    assert eng.reset_prefix_cache()
    batches = sub.drain()
    assert steps["n"] == n and len(batches) == 1
    assert [type(e) for e in batches[0].events] == [AllBlocksCleared]
    apply(batches)
    assert not model and not eng.kv.pool._cached


def _req(eng, tokens):
    from engine.request import Request
    return Request("probe", list(tokens), SamplingParams())


def test_report_mode_is_checked(evented):
    eng = evented[0]
    with pytest.raises(InvalidRequestError, match="kv_cache_report_mode") as e:
        eng.add_request("bad", [1, 2, 3], SamplingParams(extra_args={"kv_cache_report_mode": "everything"}))
    assert e.value.param == "extra_args"


def test_events_off_record_nothing():
    """Without a config the cache keeps no recorder (the hot paths test one attribute)."""
    from engine.kv_cache_manager import KVCacheManager
    assert KVCacheManager(8, 16).events is None
