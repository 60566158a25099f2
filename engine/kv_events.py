"""KV-cache events: what the prefix cache stored, evicted and cleared, published per engine step (vLLM's
vllm/distributed/kv_events.py, `--kv-events-config`).

Events are off unless a KVEventsConfig with enable_kv_cache_events is given. With events on, the KV cache
manager queues BlockStored / BlockRemoved / AllBlocksCleared as the prefix cache changes, and each engine step
(plus a /reset_prefix_cache between steps) publishes at most one KVEventBatch with what was queued.

Wire format. vLLM encodes these with msgspec as tagged, array_like structs with omit_defaults, so a subscriber
that decodes vLLM's stream decodes ours:

    KVEventBatch      [ts: float64, [event, ...], data_parallel_rank: int | nil]
    BlockStored       ["BlockStored", [hash, ...], parent_hash | nil, [token_id, ...], block_size, lora_id | nil,
                       medium | nil]
    BlockRemoved      ["BlockRemoved", [hash, ...], medium | nil]
    AllBlocksCleared  ["AllBlocksCleared"]

(the tag is the class name, first in the array; omit_defaults leaves array_like structs whole, so every field
is written; the publisher sets data_parallel_rank, 0 here: one engine, no data parallelism). msgpack-python's
packer writes the same bytes msgspec does for these types (smallest int forms, float64, str8/bin8), which
tests/test_kv_events.py checks against msgspec.

Block hashes: vLLM sends the low 64 bits of its sha256 block hash as an unsigned int (the last 8 bytes read
big-endian) unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, which sends the whole digest as bytes; we read the
same variable and convert our sha256 hashes (engine/kv_cache_manager.py) the same way. medium is "GPU" as in
vLLM, whose primary KV pool always reports MEDIUM_GPU whatever device holds it; lora_id is the request's adapter id (engine.lora), nil for the base model.

Per request, SamplingParams.extra_args["kv_cache_report_mode"] is "incremental" (default: only blocks the
request newly stored) or "full" (also a BlockStored for the cached blocks it reused when admitted, so a
prefix-aware router learns this engine holds that prefix). It changes nothing while events are off.

Transport (publisher): "zmq" is a PUB socket (bind for an endpoint with "*", "::", ipc:// or inproc://, else
connect) sending multipart (topic, sequence number as 8 bytes big-endian, payload) from a background thread,
with an optional ROUTER replay_endpoint that re-sends buffered batches from a requested sequence number; "null"
drops them. pyzmq and msgpack are imported only when events are on (the `kv-events` extra).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Optional, Union

log = logging.getLogger("engine")

MEDIUM_GPU = "GPU"
REPORT_MODE_KEY = "kv_cache_report_mode"
REPORT_MODES = ("incremental", "full")
PUBLISHERS = ("null", "zmq")


class KVEventsConfigError(ValueError):
    """A --kv-events-config that cannot be honoured (one line naming the key)."""


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig. publisher None resolves as vLLM does: "zmq" when events are on, else "null"."""
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise KVEventsConfigError(f"--kv-events-config: enable_kv_cache_events must be true or false, got "
                                      f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise KVEventsConfigError(f"--kv-events-config: publisher {self.publisher!r} is not one of "
                                      f"{', '.join(PUBLISHERS)}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise KVEventsConfigError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise KVEventsConfigError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVEventsConfigError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events

    @classmethod
    def parse(cls, value: Union[None, str, dict, "KVEventsConfig"]) -> Optional["KVEventsConfig"]:
        """A JSON string, a dict or a KVEventsConfig (None stays None); KVEventsConfigError for anything else."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise KVEventsConfigError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise KVEventsConfigError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KVEventsConfigError(f"--kv-events-config: unknown key(s) {', '.join(unknown)} (known: "
                                      f"{', '.join(sorted(known))})")
        return cls(**value)


def check_report_mode(extra_args) -> str:
    """The request's kv_cache_report_mode ("incremental" when absent); ValueError naming it when invalid."""
    if extra_args is None:
        return "incremental"
    if not isinstance(extra_args, dict):
        raise ValueError("extra_args must be a mapping of strings")
    mode = extra_args.get(REPORT_MODE_KEY, "incremental")
    if mode not in REPORT_MODES:
        raise ValueError(f"extra_args.{REPORT_MODE_KEY} must be one of {', '.join(REPORT_MODES)}, got {mode!r}")
    return mode


def _int_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", "false", "False")


def external_hash(block_hash: bytes, as_int: bool = True):
    """vLLM's maybe_convert_block_hash: the last 8 bytes big-endian as an unsigned int, or the digest itself."""
    return int.from_bytes(block_hash[-8:], "big") if as_int else bytes(block_hash)


# ------------------------------------------------------------------------------------------ events
@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU

    def wire(self) -> list:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium]


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: Optional[str] = MEDIUM_GPU

    def wire(self) -> list:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass
class AllBlocksCleared:
    def wire(self) -> list:
        return ["AllBlocksCleared"]


@dataclass
class KVEventBatch:
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None

    def wire(self) -> list:
        # (omit_defaults drops nothing from an array_like struct: an unset rank is written as nil)
        return [float(self.ts), [e.wire() for e in self.events], self.data_parallel_rank]


def encode_batch(batch: KVEventBatch) -> bytes:
    import msgpack
    return msgpack.packb(batch.wire(), use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The inverse of encode_batch (for subscribers and tests)."""
    import msgpack
    raw = msgpack.unpackb(payload, raw=False)
    events = []
    for ev in raw[1]:
        tag, rest = ev[0], ev[1:]
        events.append({"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                       "AllBlocksCleared": AllBlocksCleared}[tag](*rest))
    return KVEventBatch(raw[0], events, raw[2])


# ------------------------------------------------------------------------------------------ recording
class KVEventRecorder:
    """Queues the prefix cache's events between two publishes (the KV cache manager calls it)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.as_int = _int_hashes()
        self.events: list = []

    def stored(self, hashes: list, parent: Optional[bytes], token_ids: list, lora_id: Optional[int] = None) -> None:
        if hashes:
            self.events.append(BlockStored([external_hash(h, self.as_int) for h in hashes],
                                           external_hash(parent, self.as_int) if parent is not None else None,
                                           list(token_ids), self.block_size, lora_id))

    def removed(self, block_hash: bytes) -> None:
        self.events.append(BlockRemoved([external_hash(block_hash, self.as_int)]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        out, self.events = self.events, []
        return out


# ------------------------------------------------------------------------------------------ publishers
class NullEventPublisher:
    def publish(self, batch: KVEventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """PUB socket (+ optional ROUTER for replay) served by one thread; publish() only queues."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        try:
            import msgpack  # noqa: F401 - fail here, not in the thread
            import zmq
        except ImportError as e:
            raise KVEventsConfigError(f"--kv-events-config publisher zmq needs pyzmq and msgpack ({e}); install "
                                      "the 'kv-events' extra: pip install 'jitkern[kv-events]'") from None
        self._zmq = zmq
        self.rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        ep = config.endpoint
        try:
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self._pub.bind(ep)
            else:
                self._pub.connect(ep)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = ep if self._replay is None else config.replay_endpoint
            raise KVEventsConfigError(f"--kv-events-config: cannot open {where}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kv-events-publisher")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            log.warning("KV-cache events: the publish queue is full; a batch was dropped")

    def _loop(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - replay is best effort; publishing goes on
                    log.exception("KV-cache events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                seq = next(self._seq)
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                log.exception("KV-cache events: publishing a batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV-cache events: invalid replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def shutdown(self) -> None:
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._close_sockets()


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0):
    if config.publisher == "zmq":
        return ZmqEventPublisher(config, data_parallel_rank)
    return NullEventPublisher()


def new_batch(events: list) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=events)
