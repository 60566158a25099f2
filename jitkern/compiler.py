"""The compile driver: specialisation -> IR -> LLVM IR -> (isolated) object code -> cache -> loaded kernel.

Stages and artifacts (each kept in the cache entry): `kernel.jkir` (our IR, printed), `kernel.ll` (LLVM
IR from the lowering), then the target family's artifacts (`kernel.o` on CPUs; PTX and cubin, code objects,
SPIR-V on GPUs). Everything that depends on the family (lowering, toolchain, artifacts, loading) is its backend
object's (backends/base.py, `backend_of(target)`). The cache key covers the compiler's own sources and
llvmlite/LLVM versions, the kernel's source and every jit function it calls, the specialisation (argument types
and constexpr values), the target with its features, and the backend's options.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from . import ir
from .backends import backend_of
from .cache import KernelCache, compiler_source_hash, hash_key
from .frontend import Traceable, trace

_lock = threading.RLock()
_cache = None
_memo: dict = {}          # (kernel id, spec, target name) -> CompiledKernel


def kernel_cache() -> KernelCache:
    global _cache
    if _cache is None:
        _cache = KernelCache()
    return _cache


def reset_kernel_cache() -> None:
    """Forget the in-process state (used by tests that point JITKERN_CACHE_DIR elsewhere)."""
    global _cache
    with _lock:
        _cache = None
        _memo.clear()


@dataclass
class CompiledKernel:
    name: str
    symbol: str
    target: object
    params: list
    constexprs: dict
    address: int = 0
    artifacts: dict = field(default_factory=dict)
    from_cache: bool = False
    compile_seconds: float = 0.0
    launch_meta: dict = field(default_factory=dict)     # GPU: num_threads, shared_bytes
    loaded: object = None                               # GPU: the runtime's loaded function

    def ptx(self) -> str:
        return self.artifacts.get("kernel.ptx", b"").decode()

    def asm(self) -> str:
        """The target's assembly: x86/arm64 assembly on CPUs, PTX on CUDA targets."""
        return self.artifacts.get("kernel.s", self.artifacts.get("kernel.ptx", b"")).decode()


def _constexpr_repr(v) -> str:
    if isinstance(v, Traceable):
        return f"jit:{v.__qualname__}:{v.cache_key}"
    if isinstance(v, ir.DType):
        return f"dtype:{v.name}"
    if callable(v):
        return f"callable:{getattr(v, '__qualname__', repr(v))}"
    return repr(v)


def spec_string(params, consts) -> str:
    p = ",".join(f"{n}:{t}" for n, t in params)
    c = ",".join(f"{k}={_constexpr_repr(v)}" for k, v in consts.items())
    return f"({p})[{c}]"


def default_target():
    from .runtime.cpu import runtime_target
    return runtime_target()


def build_ir(kernel, params, consts, target) -> ir.Function:
    import hashlib
    spec = spec_string(params, consts)
    symbol = f"{kernel.__name__}_{hashlib.sha256((kernel.cache_key + spec + target.name).encode()).hexdigest()[:12]}"
    return trace(kernel, params, consts, target, symbol)


def lower(fn: ir.Function, target) -> str:
    return lower_with_meta(fn, target)[0]


def lower_with_meta(fn: ir.Function, target) -> tuple:
    """(LLVM IR text, launch metadata) for one traced kernel."""
    return backend_of(target).lower(fn, target)


def _toolchain_key(target) -> tuple:
    """What the target's backend adds to the cache key: tools outside LLVM and the target's tuning choices
    (targets/tuning.py) that shape the artifacts (backends/base.py Options)."""
    return backend_of(target).options(target).key()


def compile_kernel(kernel, params, consts, target=None, *, load=True, emit=("obj",)) -> CompiledKernel:
    """Compiles (or fetches from the caches) one specialisation of `kernel` for `target`."""
    target = target or default_target()
    spec = spec_string(params, consts)
    mkey = (id(kernel), spec, target.name, emit, _toolchain_key(target))     # what the disk key holds beyond these
    hit = _memo.get(mkey)
    if hit is not None and (hit.address or not load):
        return hit
    with _lock:
        hit = _memo.get(mkey)
        if hit is not None and (hit.address or not load):
            return hit
        t0 = time.perf_counter()
        backend = backend_of(target)
        emit = backend.cache_emit(emit)
        key = hash_key("jitkern-kernel", compiler_source_hash(python=backend.python_in_key), kernel.__qualname__,
                       kernel.cache_key, spec, target.key(), sorted(emit), mkey[-1])
        cache = kernel_cache()
        entry = None if os.environ.get("JITKERN_ALWAYS_COMPILE") else cache.get(target.device_tag, key)
        describe = f"kernel {kernel.__name__} {spec} for target {target.name}"
        if entry is not None:
            artifacts = dict(entry.artifacts)
            symbol = entry.meta["symbol"]
            launch_meta = entry.meta.get("launch", {})
            from_cache = True
        else:
            fn = build_ir(kernel, params, consts, target)
            symbol = fn.name
            artifacts, extra = backend.compile(fn, target, emit, describe, kernel.__name__, spec)
            launch_meta = extra.get("launch", {})
            cache.put(target.device_tag, key, artifacts,
                      {"kernel": kernel.__qualname__, "symbol": symbol, "target": target.name, "spec": spec, **extra})
            from_cache = False
        ck = CompiledKernel(kernel.__name__, symbol, target, params, consts, artifacts=artifacts,
                            from_cache=from_cache, launch_meta=launch_meta)
        if load:
            backend.load(ck, describe, spec)
        ck.compile_seconds = time.perf_counter() - t0
        _memo[mkey] = ck
        return ck
