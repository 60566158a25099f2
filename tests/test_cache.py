"""On-disk kernel cache (jitkern.cache): roundtrip, corruption handling, atomic concurrent writes."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from jitkern.cache import KernelCache, compiler_source_hash, default_cache_root, hash_key

TAG = "cpu-x86_64-avx2"


def _artifacts(seed: int, size: int = 4096) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {
        "kernel.o": rng.randbytes(size),
        "kernel.s": f"; asm for seed {seed}\n".encode() * 7,
        "kernel.ll": rng.randbytes(size // 3 + 1),
    }


META = {"kernel": "matmul", "target": "x86_64 avx2", "specialization": "f32,N=4096"}


def _only_entry_dir(cache: KernelCache, key: str) -> Path:
    path = cache.entry_path(TAG, key)
    assert path == cache.path / "v1" / TAG / key[:2] / key
    assert path.is_dir()
    return path


# ---------------------------------------------------------------------------------------------


def test_put_get_roundtrip_and_layout(tmp_path):
    cache = KernelCache(tmp_path)
    key = hash_key("matmul", (4096, 4096), "f32")
    arts = _artifacts(1)
    assert cache.get(TAG, key) is None
    cache.put(TAG, key, arts, META)

    fresh = KernelCache(tmp_path)  # no in-process copy: really read from disk
    entry = fresh.get(TAG, key)
    assert entry is not None
    assert dict(entry.artifacts) == arts
    assert entry.meta["kernel"] == "matmul" and entry.meta["specialization"] == "f32,N=4096"
    assert entry.meta["device_tag"] == TAG and entry.meta["key"] == key
    assert abs(entry.meta["created"] - time.time()) < 60
    path = _only_entry_dir(fresh, key)
    assert sorted(os.listdir(path)) == sorted(list(arts) + ["meta.json"])
    on_disk = json.loads((path / "meta.json").read_text())
    assert on_disk["artifacts"]["kernel.o"]["size"] == len(arts["kernel.o"])
    assert len(on_disk["artifacts"]["kernel.o"]["sha256"]) == 64
    assert (fresh.stats.hits, fresh.stats.misses, fresh.stats.corrupt) == (1, 0, 0)
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)


def test_in_process_hit_does_not_touch_disk(tmp_path):
    cache = KernelCache(tmp_path)
    key = hash_key("k", 1)
    cache.put(TAG, key, _artifacts(2), META)
    first = cache.get(TAG, key)
    # Deleting the files behind its back proves the second get is served from memory.
    for f in cache.entry_path(TAG, key).iterdir():
        f.unlink()
    second = cache.get(TAG, key)
    assert second is first
    assert cache.stats.memory_hits == 2 and cache.stats.hits == 2 and cache.stats.misses == 0
    with pytest.raises(TypeError):
        second.artifacts["kernel.o"] = b""  # read-only view: callers cannot poison the shared copy


def _put_then_fresh(tmp_path, seed=3):
    cache = KernelCache(tmp_path)
    key = hash_key("corrupt-me", seed)
    arts = _artifacts(seed)
    cache.put(TAG, key, arts, META)
    return KernelCache(tmp_path), key, cache.entry_path(TAG, key), arts


def _assert_rejected_and_deleted(cache: KernelCache, key: str, path: Path) -> None:
    assert cache.get(TAG, key) is None
    assert cache.stats.corrupt == 1 and cache.stats.misses == 1 and cache.stats.hits == 0
    assert not path.exists()
    assert cache.entries() == []
    # The caller rebuilds and stores again: works and is served afterwards.
    arts = _artifacts(99)
    cache.put(TAG, key, arts, META)
    assert dict(KernelCache(cache.path).get(TAG, key).artifacts) == arts


def test_truncated_artifact_is_detected_and_deleted(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    data = (path / "kernel.o").read_bytes()
    (path / "kernel.o").write_bytes(data[: len(data) // 2])
    _assert_rejected_and_deleted(cache, key, path)


def test_same_size_garbage_is_detected_by_sha(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    data = bytearray((path / "kernel.ll").read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    (path / "kernel.ll").write_bytes(bytes(data))
    _assert_rejected_and_deleted(cache, key, path)


def test_corrupted_meta_json(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    text = (path / "meta.json").read_text()
    (path / "meta.json").write_text(text[: len(text) // 2])
    _assert_rejected_and_deleted(cache, key, path)


def test_meta_json_without_artifact_table(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    (path / "meta.json").write_text(json.dumps({"kernel": "x"}))
    _assert_rejected_and_deleted(cache, key, path)


def test_missing_artifact_file(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    (path / "kernel.s").unlink()
    _assert_rejected_and_deleted(cache, key, path)


def test_entry_that_is_a_file(tmp_path):
    cache = KernelCache(tmp_path)
    key = hash_key("file-not-dir")
    path = cache.entry_path(TAG, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"junk")
    _assert_rejected_and_deleted(cache, key, path)


def test_put_over_a_damaged_entry_replaces_it(tmp_path):
    cache, key, path, arts = _put_then_fresh(tmp_path)
    (path / "kernel.o").write_bytes(b"x")
    writer = KernelCache(tmp_path)
    new = _artifacts(7)
    writer.put(TAG, key, new, META)
    assert dict(KernelCache(tmp_path).get(TAG, key).artifacts) == new


def test_clear_size_and_entries(tmp_path):
    cache = KernelCache(tmp_path)
    keys = [hash_key("k", i) for i in range(5)]
    for i, key in enumerate(keys):
        cache.put(TAG if i < 3 else "cuda-sm_90a", key, _artifacts(i), META)
    listed = cache.entries()
    assert sorted((e.device_tag, e.key) for e in listed) == sorted(
        [(TAG, k) for k in keys[:3]] + [("cuda-sm_90a", k) for k in keys[3:]]
    )
    total = cache.size_bytes()
    expected_payload = sum(sum(len(v) for v in _artifacts(i).values()) for i in range(5))
    assert expected_payload < total < expected_payload + 5 * 4096  # + five small meta.json
    assert total == sum(e.size_bytes for e in listed)
    cuda_size = cache.size_bytes("cuda-sm_90a")

    cache.clear("cuda-sm_90a")
    assert cache.get("cuda-sm_90a", keys[3]) is None  # memory copy dropped too
    assert cache.size_bytes() == total - cuda_size
    assert len(cache.entries()) == 3
    assert cache.get(TAG, keys[0]) is not None

    cache.clear()
    assert cache.entries() == [] and cache.size_bytes() == 0
    assert cache.get(TAG, keys[0]) is None


def test_env_root_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path / "envcache"))
    assert default_cache_root() == tmp_path / "envcache"
    cache = KernelCache()
    assert cache.path == tmp_path / "envcache"
    key = hash_key("env")
    cache.put(TAG, key, {"kernel.o": b"\x7fELF..."}, META)
    assert (tmp_path / "envcache" / "v1" / TAG / key[:2] / key / "kernel.o").is_file()

    monkeypatch.delenv("JITKERN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "jitkern"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "jitkern"


def test_bad_names_are_rejected(tmp_path):
    cache = KernelCache(tmp_path)
    key = hash_key("x")
    with pytest.raises(ValueError, match="device_tag"):
        cache.put("../escape", key, {"kernel.o": b""}, {})
    with pytest.raises(ValueError, match="key"):
        cache.get(TAG, "a/b")
    with pytest.raises(ValueError, match="artifact name"):
        cache.put(TAG, key, {"meta.json": b"{}"}, {})
    with pytest.raises(ValueError, match="artifact name"):
        cache.put(TAG, key, {"sub/kernel.o": b""}, {})
    with pytest.raises(ValueError, match="reserved"):
        cache.put(TAG, key, {"kernel.o": b""}, {"artifacts": {}})
    with pytest.raises(TypeError, match="JSON"):
        cache.put(TAG, key, {"kernel.o": b""}, {"kernel": object()})
    assert cache.entries() == []


def test_warm_get_timing(tmp_path):
    cache = KernelCache(tmp_path)
    key = hash_key("timing")
    arts = {"kernel.o": os.urandom(100 * 1024), "kernel.ll": os.urandom(2000)}
    cache.put(TAG, key, arts, META)
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        fresh = KernelCache(tmp_path)
        assert fresh.get(TAG, key) is not None
    disk_ms = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        cache.get(TAG, key)
    mem_us = (time.perf_counter() - t0) / reps * 1e6
    print(f"\n~100 KB entry: get from disk (page cache, verified) {disk_ms:.3f} ms; "
          f"in-process hit {mem_us:.2f} us")


# --- keys ------------------------------------------------------------------------------------


def test_hash_key_is_canonical_and_type_tagged():
    k = hash_key("matmul", {"b": 2, "a": [1, 2.5, None, True]}, b"\x00ir")
    assert k == hash_key("matmul", {"a": [1, 2.5, None, True], "b": 2}, b"\x00ir")  # dict order
    assert len(k) == 64 and int(k, 16) >= 0
    distinct = {
        hash_key("ab", "c"), hash_key("a", "bc"), hash_key(1), hash_key(1.0), hash_key("1"),
        hash_key(True), hash_key(b"1"), hash_key(None), hash_key(0.0), hash_key(-0.0),
        hash_key((1, 2)), hash_key((2, 1)), hash_key([[1], 2]), hash_key([1, [2]]),
        hash_key(1, 2), hash_key({"a": 1}), hash_key([("a", 1)]), hash_key(),
    }
    assert len(distinct) == 18  # hash_key(1, 2) (two parts) != hash_key((1, 2)) (one part)
    assert hash_key((1, 2)) == hash_key([1, 2])  # documented: tuples and lists hash alike
    with pytest.raises(TypeError, match="set"):
        hash_key({1, 2})


def test_compiler_source_hash_is_stable_and_memoised():
    h = compiler_source_hash()
    assert len(h) == 64 and h == compiler_source_hash()
    assert compiler_source_hash.cache_info().hits >= 1


# --- concurrency -----------------------------------------------------------------------------


def _writer_process(root: str, keys: list, rounds: int, seed: int) -> None:
    cache = KernelCache(root)
    for r in range(rounds):
        for i, key in enumerate(keys):
            # Same key -> same content, as in real use; large enough that writes take a while.
            cache.put(TAG, key, _artifacts(i, size=256 * 1024), {**META, "writer": seed})
        if r % 2:
            KernelCache(root).clear(TAG)  # churn: entries vanish and get re-created


def test_concurrent_writers_never_expose_partial_entries(tmp_path):
    keys = [hash_key("race", i) for i in range(6)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(str(tmp_path), keys, 6, s)) for s in (1, 2)]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs):
        for i, key in enumerate(keys):
            reader = KernelCache(tmp_path)  # no memory front: every get reads the disk
            entry = reader.get(TAG, key)
            if entry is not None:
                seen += 1
                assert dict(entry.artifacts) == _artifacts(i, size=256 * 1024)
            assert reader.stats.corrupt == 0
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # Afterwards: every entry present is complete and verifies; no temp dirs are left behind.
    final = KernelCache(tmp_path)
    for i, key in enumerate(keys):
        entry = final.get(TAG, key)
        if entry is not None:
            assert dict(entry.artifacts) == _artifacts(i, size=256 * 1024)
    assert final.stats.corrupt == 0
    leftovers = [p for p in (tmp_path / "v1").rglob("*") if p.name.startswith(("tmp.", "del."))]
    assert leftovers == []
    print(f"\nreader saw {seen} complete entries while two writers raced")


def test_concurrent_same_key_final_state(tmp_path):
    key = hash_key("one-key")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(str(tmp_path), [key], 1, s)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entry = KernelCache(tmp_path).get(TAG, key)
    assert entry is not None and dict(entry.artifacts) == _artifacts(0, size=256 * 1024)
    assert entry.meta["writer"] in (1, 2)
    assert len(KernelCache(tmp_path).entries()) == 1
