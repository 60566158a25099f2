import os
import random
import subprocess
import sys

import pytest

from engine.kv_cache_manager import (HASH_SEED_ENV, BlockPool, KVCacheManager, hash_block_tokens,
                                     root_hash)
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens, **kw):
    return Request(request_id=rid, prompt_token_ids=list(tokens), **kw)


def admit(kv, req):
    """Admit a request the way the scheduler does: hits first, then room for the rest."""
    hits, n_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return hits, n_hit


def check_invariants(kv, live_requests):
    pool = kv.pool
    refs = {}
    for r in live_requests:
        for b in r.block_ids:
            refs[b] = refs.get(b, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
    free = pool.free_queue()
    assert len(free) == len(set(free))
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for h, bid in pool._cached.items():
        assert pool.blocks[bid].block_hash == h
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool._cached.get(block.block_hash) == block.block_id


def test_hash_is_chained_and_deterministic():
    rng = random.Random(1)
    a = [rng.randrange(1000) for _ in range(3 * BS)]
    kv1 = KVCacheManager(16, BS, hash_seed="7")
    kv2 = KVCacheManager(16, BS, hash_seed="7")
    h1 = kv1.update_block_hashes(make_request("a", a))
    h2 = kv2.update_block_hashes(make_request("b", a))
    assert h1 == h2 and len(h1) == 3 and len(set(h1)) == 3
    # Changing a token of block 0 changes every later hash (the chain), block 2 alone only itself.
    b = list(a)
    b[1] += 1
    hb = kv1.update_block_hashes(make_request("c", b))
    assert all(x != y for x, y in zip(h1, hb))
    c = list(a)
    c[-1] += 1
    hc = kv1.update_block_hashes(make_request("d", c))
    assert hc[:2] == h1[:2] and hc[2] != h1[2]
    # Another seed, another root; a cache salt changes the chain too.
    assert KVCacheManager(16, BS, hash_seed="8").update_block_hashes(make_request("e", a)) != h1
    assert kv1.update_block_hashes(make_request("f", a, cache_salt="tenant"))[0] != h1[0]
    # Partial trailing block is not hashed.
    assert len(kv1.update_block_hashes(make_request("g", a + [1, 2]))) == 3


def test_hash_same_across_processes(monkeypatch):
    monkeypatch.setenv(HASH_SEED_ENV, "1234")
    tokens = [5, 9, 300, 2]
    here = hash_block_tokens(root_hash(), tokens, (("cache_salt", "x"),)).hex()
    code = ("from engine.kv_cache_manager import hash_block_tokens, root_hash;"
            "print(hash_block_tokens(root_hash(), [5, 9, 300, 2], (('cache_salt', 'x'),)).hex())")
    env = dict(os.environ, PYTHONHASHSEED="random")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           cwd=os.path.dirname(os.path.dirname(__file__)), check=True).stdout.strip()
    assert here == there
    monkeypatch.setenv(HASH_SEED_ENV, "999")
    assert hash_block_tokens(root_hash(), tokens).hex() != hash_block_tokens(root_hash("1234"), tokens).hex()


def test_prefix_hit_shares_blocks_and_counts():
    rng = random.Random(2)
    kv = KVCacheManager(32, BS)
    shared = [rng.randrange(1000) for _ in range(3 * BS)]
    a = make_request("a", shared + [rng.randrange(1000) for _ in range(5)])
    hits, n = admit(kv, a)
    assert hits == [] and n == 0
    assert kv.stats.queries == a.num_tokens and kv.stats.hits == 0
    b = make_request("b", shared + [rng.randrange(1000) for _ in range(7)])
    hits, n = admit(kv, b)
    assert n == 3 * BS and hits == a.block_ids[:3]
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    for bid in hits:
        assert kv.pool.blocks[bid].ref_cnt == 2
    assert kv.stats.queries == a.num_tokens + b.num_tokens and kv.stats.hits == 3 * BS
    check_invariants(kv, [a, b])
    # Free one owner: shared blocks stay in use (ref 1), not in the free queue.
    kv.free(a)
    for bid in hits:
        assert kv.pool.blocks[bid].ref_cnt == 1 and bid not in kv.pool.free_queue()
    check_invariants(kv, [b])
    b_blocks = list(b.block_ids)
    kv.free(b)
    check_invariants(kv, [])
    assert kv.usage == 0.0
    # Freed blocks keep their hashes: a third request still hits all 3 shared blocks + b's 4th.
    c = make_request("c", b.prompt_token_ids + [1])
    hits, n = kv.get_computed_blocks(c)
    assert n == 4 * BS and hits == b_blocks[:4]


def test_never_the_whole_prompt():
    kv = KVCacheManager(16, BS)
    tokens = list(range(100, 100 + 2 * BS))
    a = make_request("a", tokens)
    admit(kv, a)
    kv.free(a)
    again = make_request("b", tokens)  # exactly two full cached blocks
    hits, n = kv.get_computed_blocks(again)
    assert n == BS and len(hits) == 1  # the last block must be recomputed for the last token
    longer = make_request("c", tokens + [7])
    assert kv.get_computed_blocks(longer)[1] == 2 * BS


def test_prompt_logprobs_skips_cache_and_disabled_cache_never_hits():
    kv = KVCacheManager(16, BS)
    tokens = list(range(3 * BS))
    admit(kv, make_request("a", tokens))
    r = make_request("b", tokens + [1], sampling_params=SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(r) == ([], 0)
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    admit(off, make_request("a", tokens))
    assert off.get_computed_blocks(make_request("b", tokens + [1])) == ([], 0)
    assert off.pool.num_cached_blocks == 0


def test_lru_eviction_order():
    kv = KVCacheManager(6, BS)
    reqs = [make_request(n, [i * 100 + j for j in range(2 * BS)]) for i, n in enumerate("abc")]
    for r in reqs:
        admit(kv, r)
    assert kv.num_free_blocks == 0
    ids = {r.request_id: list(r.block_ids) for r in reqs}
    for r in reqs:  # freed in order a, b, c; each tail first
        kv.free(r)
    assert kv.pool.free_queue() == [ids["a"][1], ids["a"][0], ids["b"][1], ids["b"][0],
                                    ids["c"][1], ids["c"][0]]
    # Taking 3 blocks evicts a's two and b's last; b's first block and all of c still hit.
    filler = make_request("x", [7] * (3 * BS - 1))
    assert kv.allocate_slots(filler, filler.num_tokens) is not None
    probe = {n: kv.get_computed_blocks(make_request("p" + n, r.prompt_token_ids + [1]))[1]
             for n, r in zip("abc", reqs)}
    assert probe == {"a": 0, "b": BS, "c": 2 * BS}
    check_invariants(kv, [filler])


def test_uncached_free_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(4, BS)
    cached = make_request("c", list(range(2 * BS)))
    admit(kv, cached)
    partial = make_request("p", [9, 9, 9])  # one partial block: never cached
    admit(kv, partial)
    partial_block = partial.block_ids[0]
    kv.free(cached)
    kv.free(partial)
    queue = kv.pool.free_queue()
    assert queue[0] == partial_block  # worthless block first, cached ones last
    assert [kv.pool.blocks[b].block_hash is not None for b in queue] == [False, False, True, True]
    # Allocating two blocks (the partial one + the never-used one) leaves both cached blocks intact.
    r = make_request("r", [1] * (2 * BS - 1))
    assert kv.allocate_slots(r, r.num_tokens) is not None
    assert kv.get_computed_blocks(make_request("q", list(range(2 * BS)) + [5]))[1] == 2 * BS


def test_allocate_returns_none_when_dry_and_changes_nothing():
    kv = KVCacheManager(5, BS)
    a = make_request("a", list(range(3 * BS)))
    admit(kv, a)
    kv.free(a)  # 3 cached free blocks + 2 never used
    c = make_request("c", [50] * (3 * BS))
    assert kv.allocate_slots(c, c.num_tokens) is not None  # 2 never-used + a's last block (evicted)
    b = make_request("b", list(range(3 * BS)) + [1, 2])
    assert kv.get_computed_blocks(b)[1] == 2 * BS
    before = ([blk.ref_cnt for blk in kv.pool.blocks], kv.pool.free_queue(), dict(kv.pool._cached),
              list(b.block_ids), kv.stats.queries)
    hits, n = kv.get_computed_blocks(b)
    # Whatever survived, asking for more than the pool has must fail without side effects.
    assert kv.allocate_slots(b, 10 * BS, hits) is None
    after = ([blk.ref_cnt for blk in kv.pool.blocks], kv.pool.free_queue(), dict(kv.pool._cached),
             list(b.block_ids), kv.stats.queries)
    assert before == after


def test_hits_on_free_blocks_count_against_free_space():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(3 * BS)))
    admit(kv, a)
    kv.free(a)
    other = make_request("o", [1])
    assert kv.allocate_slots(other, 1) is not None  # takes the never-used block
    b = make_request("b", list(range(3 * BS)) + [1, 2, 3, 4, 5])  # hits 3 (all free), needs 2 more
    hits, n = kv.get_computed_blocks(b)
    assert len(hits) == 3
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None  # 3 free in total, 5 needed
    assert kv.num_free_blocks == 3
    check_invariants(kv, [other])


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(2 * BS + 1)))
    admit(kv, a)
    b = make_request("b", list(range(2 * BS)) + [3])
    assert kv.get_computed_blocks(b)[1] == 2 * BS
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
    kv.free(a)  # a still owned its blocks; freeing them after a reset is fine
    check_invariants(kv, [])


def test_slot_mapping():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    kv.allocate_slots(r, 10)
    slots = kv.slot_mapping(r, 3, 10)
    assert slots == [r.block_ids[p // BS] * BS + p % BS for p in range(3, 10)]
    assert len(set(slots)) == 7


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(4, 20), BS)
    live: list[Request] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 4) * BS)] for _ in range(4)]
    for step in range(300):
        op = rng.random()
        if op < 0.5:
            tokens = rng.choice(prefixes)[: rng.randint(1, 16)] + [rng.randrange(50) for _ in range(rng.randint(0, 9))]
            r = make_request(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - n, hits) is not None:
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
                live.append(r)
                # Every block table maps the request's tokens: hit blocks hold identical prefixes.
                assert len(r.block_ids) == -(-r.num_tokens // BS)
        elif op < 0.75 and live:
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
        elif live:
            r = rng.choice(live)
            extra = rng.randint(1, 6)
            if kv.allocate_slots(r, extra) is not None:
                for _ in range(extra):
                    r.append_output_token(rng.randrange(50))
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
        check_invariants(kv, live)
        assert 0.0 <= kv.usage <= 1.0
    for r in live:
        kv.free(r)
    check_invariants(kv, [])
    assert kv.usage == 0.0


def test_block_pool_rejects_bad_sizes_and_double_free():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
    pool = BlockPool(2, 4)
    (bid,) = pool.allocate(1)
    pool.free_blocks([bid])
    with pytest.raises(RuntimeError, match="freed"):
        pool.free_blocks([bid])
