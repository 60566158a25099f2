"""Paged KV block pool with reference counts and automatic prefix caching.

Model (vLLM V1's block_pool.py / kv_cache_manager.py, nano-vllm's block_manager.py):

* The KV cache is `num_blocks` blocks of `block_size` token slots. A request owns a block
  table (`request.block_ids`); token at position p lives in slot
  `block_ids[p // block_size] * block_size + p % block_size`.
* A *full* block whose KV has been written is registered under a chained hash
  `H(parent_hash, tokens of the block, extra keys)`, so equal hashes mean equal whole
  prefixes. A later request whose prompt starts with the same blocks reuses them
  (reference count + 1) instead of recomputing.
* Freed blocks go back to a free queue but keep their hash, so they can still be hit
  until the space is needed. Allocation takes from the head of the queue: blocks that
  hold no cached prefix first, then cached blocks least-recently freed first (LRU).
  A request's blocks are freed tail first, so a sequence's last blocks (the least
  likely to be shared) are evicted before its first ones.
* Never the whole prompt is served from cache: at least the last token is computed so
  the model produces logits to sample from (vLLM's `num_tokens - 1` cap).

Hashes are sha256, rooted in a seed read from `JITKERN_PREFIX_CACHING_HASH_SEED`
(default "0"), so they are identical across processes and runs (vLLM randomises its
root unless PYTHONHASHSEED is set; vllm.cpp chose a fixed default, as we do).

No block is reserved: ids 0..num_blocks-1 are all usable (no null block is needed
because there is no sliding-window attention here).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.request import Request

HASH_SEED_ENV = "JITKERN_PREFIX_CACHING_HASH_SEED"
DEFAULT_HASH_SEED = "0"


def root_hash(seed: str | None = None) -> bytes:
    """Parent hash of a request's first block."""
    if seed is None:
        seed = os.environ.get(HASH_SEED_ENV, DEFAULT_HASH_SEED)
    return hashlib.sha256(b"jitkern-prefix-root\0" + str(seed).encode()).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: sha256(parent, token count, tokens as int64 LE, extras)."""
    h = hashlib.sha256()
    h.update(parent_hash)
    h.update(struct.pack("<q", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        # repr of a tuple of str/int is deterministic across processes.
        h.update(b"\0extra\0" + repr(tuple(extra_keys)).encode())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Blocks, their reference counts, the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Ordered free queue: the head is evicted/allocated first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # engine.kv_events.KVEventRecorder when KV-cache events are on: told of every eviction and reset
        self.events = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including ones that still hold a cached prefix."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the cache (they may be free or shared)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self._free[bid]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[int]:
        """Pop `count` blocks off the free queue, evicting their cached hashes."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        out = []
        for _ in range(count):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == bid:
                    del self._cached[block.block_hash]
                    if self.events is not None:
                        self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(bid)
        return out

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, given in the order they should be evicted.

        A block reaching zero references joins the queue: at the tail if it holds a cached
        prefix (LRU), at the head if not (it is worth nothing, reuse it first).
        """
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[bid] = None
                if block.block_hash is None:
                    self._free.move_to_end(bid, last=False)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, written block. Returns False if the hash already has a block."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            # Another request computed the same prefix concurrently; keep the first copy,
            # this one stays uncached and is reused as plain space when freed.
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Blocks in use stay valid for their owners."""
        for bid in self._cached.values():
            self.blocks[bid].block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        # Former cached free blocks are now plain space; order does not matter any more.


@dataclass
class PrefixCacheStats:
    """Cumulative counters in tokens, like vLLM's vllm:prefix_cache_queries/_hits."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: str | None = None, kv_events: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.root_hash = root_hash(hash_seed)
        self.stats = PrefixCacheStats()
        # request_id -> how many of its leading blocks are registered in the cache
        self._num_registered: dict[str, int] = {}
        # KV-cache events (engine.kv_events): None while off, so the hot paths pay one attribute test
        self.events = None
        if kv_events:
            from engine.kv_events import KVEventRecorder
            self.events = self.pool.events = KVEventRecorder(block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------- hashing

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        parent = hashes[-1] if hashes else self.root_hash
        for i in range(len(hashes), len(tokens) // bs):
            extra = (("cache_salt", request.cache_salt),) if i == 0 and request.cache_salt else ()
            if request.lora is not None:    # KV computed under an adapter is that adapter's (as vLLM keys it)
                extra += (("lora", request.lora.key),)
            for im in request.mm_inputs:    # a block holding image tokens is that image's (vLLM's mm_hashes)
                if im.offset < (i + 1) * bs and im.end > i * bs:
                    extra += (("mm", im.hash, im.offset),)
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra)
            hashes.append(parent)
        return hashes

    # ----------------------------------------------------------------- lookup / allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that has no blocks yet: (block ids, tokens).

        Full blocks only, and at most num_tokens - 1 tokens so the last one is computed.
        Requests asking for prompt_logprobs skip the cache: they need logits for every
        prompt position (vLLM's skip_reading_prefix_cache).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            bid = self.pool.get_cached_block(block_hash)
            if bid is None:
                break
            hit.append(bid)
        return hit, len(hit) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        new_computed_blocks: prefix-cache hits from get_computed_blocks, only for a request
        being admitted (no blocks yet); they are referenced and put first in its table.
        Returns the newly allocated block ids (possibly empty), or None, changing nothing,
        when the pool cannot supply them.
        """
        if not new_computed_blocks and request.block_ids and \
                cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) <= len(request.block_ids):
            return []          # (a running request's step within its blocks: most decode steps; a fast path)
        hits = new_computed_blocks or []
        if hits and (request.block_ids or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id}: prefix hits given for a request that already "
                             f"has {len(request.block_ids)} blocks")
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(hits)
        needed = max(needed, 0)
        # A hit on a free cached block takes that block off the free queue too.
        hits_from_free = sum(1 for bid in hits if self.pool.blocks[bid].ref_cnt == 0)
        if needed + hits_from_free > self.pool.num_free_blocks:
            return None
        admitting = not request.block_ids and request.num_computed_tokens == 0
        # Reference the hits before allocating so the allocation cannot evict them.
        self.pool.touch(hits)
        request.block_ids.extend(hits)
        new_blocks = self.pool.allocate(needed)
        request.block_ids.extend(new_blocks)
        if admitting:
            self._num_registered[request.request_id] = len(hits)
            extra = getattr(request.sampling_params, "extra_args", None)
            if hits and self.events is not None and extra and extra.get("kv_cache_report_mode") == "full":
                # "full": re-report the reused prefix, so a router learns this engine holds it
                self.events.stored(request.block_hashes[:len(hits)], None,
                                   request.all_token_ids[:len(hits) * self.block_size], _lora_id(request))
            if self.enable_prefix_caching:
                self.stats.requests += 1
                self.stats.queries += request.num_tokens
                self.stats.hits += len(hits) * self.block_size
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is written (call after a step)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= start:
            return
        hashes = self.update_block_hashes(request)
        events = self.events
        run: list[int] = []          # (events) indices of a contiguous run of newly registered blocks
        for i in range(start, num_full):
            bid = request.block_ids[i]
            new = events is not None and self.pool.blocks[bid].block_hash is None \
                and self.pool.get_cached_block(hashes[i]) is None
            self.pool.cache_block(bid, hashes[i])
            if events is None:
                continue
            if new:
                run.append(i)
            elif run:               # (a block another request registered first is no new store: report none)
                self._report_stored(request, hashes, run)
                run = []
        if run:
            self._report_stored(request, hashes, run)
        self._num_registered[request.request_id] = num_full

    def _report_stored(self, request: Request, hashes: list[bytes], run: list[int]) -> None:
        bs = self.block_size
        first, last = run[0], run[-1] + 1
        self.events.stored(hashes[first:last], hashes[first - 1] if first else None,
                           request.all_token_ids[first * bs:last * bs], _lora_id(request))

    def free(self, request: Request) -> None:
        """Give back a request's blocks, tail first; cached ones stay hit-able until evicted."""
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (requests in flight keep their blocks). Always succeeds."""
        self.pool.reset_prefix_cache()
        self.stats.resets += 1
        return True

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Global KV slot of each position in [start, end)."""
        bs = self.block_size
        table = request.block_ids
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


def _lora_id(request: Request):
    """The adapter id a KV event reports for the request's blocks (vLLM's lora_id), None for the base model."""
    return request.lora.int_id if request.lora is not None else None
