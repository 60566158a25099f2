"""On-disk kernel cache, one namespace per device.

Layout::

    <root>/v1/<device_tag>/<key[:2]>/<key>/
        kernel.o, kernel.s, kernel.ll, kernel.jkir, ...   (artifacts, any safe file names)
        meta.json    caller's meta (kernel, target, specialization, ...) + "created" +
                     "artifacts": {name: {"size": int, "sha256": hex}}

<root> is the constructor argument, else $JITKERN_CACHE_DIR, else $XDG_CACHE_HOME/jitkern, else
~/.cache/jitkern.

Writes are atomic: an entry is assembled in ``tmp.<pid>.<uuid>`` next to its final place and
renamed into place in one step; if another process got there first, ours is discarded (same key,
same content). Readers therefore see a whole entry or none. On read every artifact's size and
sha256 are checked against meta.json; a damaged entry is deleted and reported as a miss, so the
caller simply rebuilds. An in-process dict in front of the disk makes repeated gets free.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional

__all__ = [
    "CacheEntry",
    "CacheStats",
    "EntryInfo",
    "KernelCache",
    "compiler_source_hash",
    "default_cache_root",
    "hash_key",
]

LAYOUT_VERSION = "v1"
META_FILE = "meta.json"
# meta.json keys the cache owns; the caller's meta may not use them.
_RESERVED_META = ("artifacts", "device_tag", "key", "format")
log = logging.getLogger(__name__)
_TMP_PREFIX = "tmp."
_TRASH_PREFIX = "del."
# device tags and keys become path components: keep them boring.
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def default_cache_root() -> Path:
    from .env import cache_dir   # the one reader of JITKERN_* settings ($JITKERN_CACHE_DIR, XDG, ~/.cache)
    return cache_dir()


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------


def _encode(value: Any, out: list) -> None:
    # Type tag + length prefix for everything variable-sized: no two different values share an
    # encoding (no separator ambiguity such as ("ab", "c") vs ("a", "bc")).
    if value is None:
        out.append(b"N")
    elif value is True:
        out.append(b"T")
    elif value is False:
        out.append(b"F")
    elif isinstance(value, int):
        digits = str(int(value)).encode()
        out.append(b"i%d:" % len(digits) + digits)
    elif isinstance(value, float):
        text = float(value).hex().encode()  # exact and canonical (keeps -0.0 apart from 0.0)
        out.append(b"f%d:" % len(text) + text)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out.append(b"s%d:" % len(raw) + raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out.append(b"b%d:" % len(raw) + raw)
    elif isinstance(value, (tuple, list)):
        out.append(b"l%d:" % len(value))
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        items = []
        for k, v in value.items():
            kparts: list = []
            _encode(k, kparts)
            vparts: list = []
            _encode(v, vparts)
            items.append((b"".join(kparts), b"".join(vparts)))
        items.sort()
        if len({k for k, _ in items}) != len(items):
            raise TypeError("hash_key: dict has keys with identical encodings (e.g. 1 and 1.0?)")
        out.append(b"d%d:" % len(items))
        for k, v in items:
            out.append(k)
            out.append(v)
    else:
        raise TypeError(
            f"hash_key: cannot hash a value of type {type(value).__name__} ({value!r:.80}); "
            "use str/bytes/int/float/bool/None/tuple/list/dict"
        )


def hash_key(*parts: Any) -> str:
    """sha256 hex digest over a canonical encoding of ``parts``.

    Accepts nested str, bytes, int, float, bool, None, tuple, list and dict. The encoding is
    type-tagged (1 != 1.0 != "1" != True) and order-sensitive for the parts themselves and for
    tuples/lists (a tuple and a list with the same items hash the same); dict keys are sorted, so
    dict insertion order does not matter.
    """
    out: list = [b"jitkern-key-v1\0"]
    _encode(list(parts), out)
    return hashlib.sha256(b"".join(out)).hexdigest()


@functools.lru_cache(maxsize=2)
def compiler_source_hash(python: bool = True) -> str:
    """sha256 over everything that decides what the compiler emits (memoised per process).

    Covers the source files (.py, .c, .h, .ll) of the ``jitkern`` and ``targets`` packages (sorted
    relative paths + contents), the llvmlite version, ``llvmlite.binding.llvm_version_info`` and,
    unless ``python=False``, the Python major.minor. GPU artifacts (PTX, cubins, code objects) do not
    depend on the Python that made them, so a cache filled by `jitkern build` on one machine loads on a
    GPU machine with another Python.
    """
    import importlib.util
    import sys

    import llvmlite
    import llvmlite.binding as llvm

    h = hashlib.sha256(b"jitkern-compiler-v1\0")
    for package in ("jitkern", "targets"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            h.update(f"missing:{package}\0".encode())
            continue
        for location in spec.submodule_search_locations:
            base = Path(location)
            files = sorted(
                p
                for p in base.rglob("*")
                if p.suffix in (".py", ".c", ".h", ".ll")
                and p.is_file()
                and "__pycache__" not in p.parts
            )
            for p in files:
                rel = f"{package}/{p.relative_to(base).as_posix()}".encode()
                data = p.read_bytes()
                h.update(struct.pack("!Q", len(rel)) + rel + struct.pack("!Q", len(data)) + data)
    h.update(f"llvmlite={llvmlite.__version__}\0".encode())
    h.update(f"llvm={tuple(llvm.llvm_version_info)}\0".encode())
    if python:
        h.update(f"python={sys.version_info[0]}.{sys.version_info[1]}\0".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """A verified cache entry. ``artifacts`` and ``meta`` are read-only views."""

    device_tag: str
    key: str
    artifacts: Mapping[str, bytes]
    meta: Mapping[str, Any]
    path: Path


@dataclass
class CacheStats:
    """Counters of one KernelCache. ``misses`` counts every get that returned None; ``corrupt``
    counts the subset that found a damaged entry (and deleted it). ``memory_hits`` is the subset of
    ``hits`` served from the in-process dict."""

    hits: int = 0
    memory_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    lost_races: int = 0


class EntryInfo(NamedTuple):
    device_tag: str
    key: str
    path: Path
    size_bytes: int


def _check_component(what: str, value: str) -> None:
    if (
        not isinstance(value, str)
        or not _COMPONENT_RE.match(value)
        or value.startswith((_TMP_PREFIX, _TRASH_PREFIX))
        or len(value) > 200
    ):
        raise ValueError(
            f"cache {what} {value!r} is not a safe path component "
            "(letters, digits, '.', '_', '+', '-'; not starting with 'tmp.'/'del.')"
        )


def _check_key(key: str) -> None:
    _check_component("key", key)
    if len(key) < 3:
        raise ValueError(f"cache key {key!r} is too short (use hash_key(...))")


class _Corrupt(Exception):
    identity: Optional[tuple] = None  # the damaged directory's (inode, ctime), when known


def _identity(path: Path) -> tuple:
    # A rename into place gives a new ctime, so (inode, ctime) tells a replaced entry apart even
    # when the file system reuses the inode number.
    st = os.stat(path)
    return (st.st_ino, st.st_ctime_ns)


class KernelCache:
    """Per-device kernel cache on disk with an in-process front dict. Thread-safe."""

    def __init__(self, root: "str | os.PathLike[str] | None" = None) -> None:
        self._root = Path(root).expanduser() if root is not None else default_cache_root()
        self._base = self._root / LAYOUT_VERSION
        self._memory: dict[tuple[str, str], CacheEntry] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def path(self) -> Path:
        """The cache root (entries live under ``path / "v1"``)."""
        return self._root

    def entry_path(self, device_tag: str, key: str) -> Path:
        _check_component("device_tag", device_tag)
        _check_key(key)
        return self._base / device_tag / key[:2] / key

    # -- read --

    def get(self, device_tag: str, key: str) -> Optional[CacheEntry]:
        """The verified entry, or None (missing, or damaged -- then it is deleted)."""
        mem_key = (device_tag, key)
        entry = self._memory.get(mem_key)
        if entry is not None:
            with self._lock:
                self.stats.hits += 1
                self.stats.memory_hits += 1
            return entry
        final = self.entry_path(device_tag, key)
        try:
            entry = self._load_consistent(device_tag, key, final)
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
            return None
        except _Corrupt as exc:
            log.warning("kernel cache: damaged entry %s (%s); deleted, will rebuild", final, exc)
            self._discard(final, exc.identity)
            with self._lock:
                self.stats.misses += 1
                self.stats.corrupt += 1
            return None
        with self._lock:
            self._memory[mem_key] = entry
            self.stats.hits += 1
        return entry

    def _load_consistent(self, device_tag: str, key: str, final: Path) -> CacheEntry:
        """_load, telling real damage apart from an entry removed/replaced while we read it
        (clear() or a corrupt-entry cleanup in another process): the latter is a plain miss."""
        for _attempt in range(3):
            before = _identity(final)  # FileNotFoundError -> miss
            try:
                return self._load(device_tag, key, final)
            except _Corrupt as exc:
                try:
                    after = _identity(final)
                except FileNotFoundError:
                    raise FileNotFoundError(str(final)) from None
                if after == before:
                    exc.identity = before
                    raise
                # replaced while we read: read the new one
        raise FileNotFoundError(str(final))

    def _load(self, device_tag: str, key: str, final: Path) -> CacheEntry:
        try:
            meta_bytes = (final / META_FILE).read_bytes()
        except FileNotFoundError:
            if final.exists():
                raise _Corrupt("meta.json missing") from None
            raise
        except NotADirectoryError:
            raise _Corrupt("entry is not a directory") from None
        try:
            meta = json.loads(meta_bytes)
            listed = meta["artifacts"]
            if not isinstance(listed, dict):
                raise TypeError("artifacts is not an object")
            expected = {
                name: (int(info["size"]), str(info["sha256"])) for name, info in listed.items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Corrupt(f"meta.json unreadable: {exc}") from None
        artifacts: dict[str, bytes] = {}
        for name, (size, digest) in expected.items():
            try:
                _check_artifact_name(name)
                data = (final / name).read_bytes()
            except (OSError, ValueError) as exc:
                raise _Corrupt(f"artifact {name!r}: {exc}") from None
            if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                raise _Corrupt(f"artifact {name!r} does not match meta.json")
            artifacts[name] = data
        return CacheEntry(
            device_tag=device_tag,
            key=key,
            artifacts=MappingProxyType(artifacts),
            meta=MappingProxyType(meta),
            path=final,
        )

    # -- write --

    def put(
        self, device_tag: str, key: str, artifacts: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> None:
        """Store an entry atomically. If the key already exists on disk, the existing entry wins."""
        final = self.entry_path(device_tag, key)
        blobs: dict[str, bytes] = {}
        for name, data in artifacts.items():
            _check_artifact_name(name)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"cache artifact {name!r} must be bytes, got {type(data).__name__}")
            blobs[name] = bytes(data)
        clash = [k for k in _RESERVED_META if k in meta]
        if clash:
            raise ValueError(f"cache meta may not set reserved key(s) {clash}")
        full_meta: dict[str, Any] = {"format": 1, "device_tag": device_tag, "key": key}
        full_meta.update(meta)
        full_meta.setdefault("created", time.time())
        full_meta["artifacts"] = {
            name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in blobs.items()
        }
        try:
            meta_text = json.dumps(full_meta, indent=1, sort_keys=True)
        except TypeError as exc:
            raise TypeError(f"cache meta for {device_tag}/{key} is not JSON-serialisable: {exc}") from None

        parent = final.parent
        for _attempt in range(3):
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, FileNotFoundError):
                # clear() in another process renamed the parent away between mkdir's attempt and its
                # is-a-directory check (pathlib then re-raises FileExistsError): retry with a fresh parent
                continue
            tmp = parent / f"{_TMP_PREFIX}{os.getpid()}.{uuid.uuid4().hex}"
            try:
                tmp.mkdir()
                for name, data in blobs.items():
                    (tmp / name).write_bytes(data)
                (tmp / META_FILE).write_text(meta_text)
                os.rename(tmp, final)  # atomic: readers see all of it or nothing
                break
            except FileNotFoundError:
                # clear() removed the parent under us: retry with a fresh parent.
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            # The final dir exists: another writer won (same key, hence same content) -- unless
            # what is there is damaged, in which case it goes and we try again.
            try:
                self._load_consistent(device_tag, key, final)
            except FileNotFoundError:
                continue  # vanished meanwhile: retry
            except _Corrupt as exc:
                self._discard(final, exc.identity)
                continue
            with self._lock:
                self.stats.lost_races += 1
            break
        entry = CacheEntry(
            device_tag=device_tag,
            key=key,
            artifacts=MappingProxyType(blobs),
            meta=MappingProxyType(json.loads(meta_text)),
            path=final,
        )
        with self._lock:
            self._memory[(device_tag, key)] = entry
            self.stats.writes += 1

    # -- housekeeping --

    def _discard(self, directory: Path, identity: Optional[tuple] = None) -> None:
        """Remove a directory atomically from readers' view: rename away, then delete.
        With ``identity``, only if it is still that directory (not a fresh replacement)."""
        if identity is not None:
            try:
                if _identity(directory) != identity:
                    return
            except FileNotFoundError:
                return
        trash = directory.parent / f"{_TRASH_PREFIX}{os.getpid()}.{uuid.uuid4().hex}"
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = directory
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)

    def entries(self, device_tag: Optional[str] = None) -> list[EntryInfo]:
        """Complete entries on disk (temp and half-deleted dirs are skipped)."""
        out: list[EntryInfo] = []
        if not self._base.is_dir():
            return out
        tags = [device_tag] if device_tag is not None else sorted(os.listdir(self._base))
        for tag in tags:
            if tag.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                continue
            tag_dir = self._base / tag
            if not tag_dir.is_dir():
                continue
            for shard in sorted(os.listdir(tag_dir)):
                shard_dir = tag_dir / shard
                if not shard_dir.is_dir():
                    continue
                for key in sorted(os.listdir(shard_dir)):
                    if key.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                        continue
                    entry_dir = shard_dir / key
                    if entry_dir.is_dir():
                        out.append(EntryInfo(tag, key, entry_dir, _tree_size(entry_dir)))
        return out

    def size_bytes(self, device_tag: Optional[str] = None) -> int:
        """Bytes on disk under the cache (or one device), temp dirs included."""
        base = self._base / device_tag if device_tag is not None else self._base
        return _tree_size(base) if base.is_dir() else 0

    def clear(self, device_tag: Optional[str] = None) -> None:
        """Delete every entry (or one device's) from disk and from the in-process dict."""
        if device_tag is not None:
            _check_component("device_tag", device_tag)
        with self._lock:
            if device_tag is None:
                self._memory.clear()
            else:
                for k in [k for k in self._memory if k[0] == device_tag]:
                    del self._memory[k]
        if not self._base.is_dir():
            return
        if device_tag is not None:
            self._discard(self._base / device_tag)
            return
        for name in os.listdir(self._base):
            self._discard(self._base / name)


def _check_artifact_name(name: str) -> None:
    if not isinstance(name, str) or name == META_FILE or not _COMPONENT_RE.match(name):
        raise ValueError(
            f"cache artifact name {name!r} must be a plain file name (not {META_FILE!r})"
        )


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total
