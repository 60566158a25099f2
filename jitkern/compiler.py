"""The compile driver: specialisation -> IR -> LLVM IR -> (isolated) object code -> cache -> loaded kernel.

Stages and artifacts (each kept in the cache entry): `kernel.jkir` (our IR, printed), `kernel.ll` (LLVM
IR from the lowering), `kernel.o` (the object the runtime loads). The cache key covers the compiler's own
sources and llvmlite/LLVM versions, the kernel's source and every jit function it calls, the
specialisation (argument types and constexpr values) and the target with its features.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from . import ir
from .cache import KernelCache, compiler_source_hash, hash_key
from .errors import CompileError
from .frontend import trace

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

    def asm(self) -> str:
        return self.artifacts.get("kernel.s", b"").decode()


def _constexpr_repr(v) -> str:
    from .jit import JitFunction
    if isinstance(v, JitFunction):
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
    if target.is_cpu:
        from .backends.cpu import lower_to_llvm
        return lower_to_llvm(fn, target)
    raise CompileError(f"no lowering for {target.backend} targets yet (target {target.name})",
                       kernel=fn.name, target=target.name)


def compile_kernel(kernel, params, consts, target=None, *, load=True, emit=("obj",)) -> CompiledKernel:
    """Compiles (or fetches from the caches) one specialisation of `kernel` for `target`."""
    target = target or default_target()
    spec = spec_string(params, consts)
    mkey = (id(kernel), spec, target.name, emit)
    hit = _memo.get(mkey)
    if hit is not None and (hit.address or not load):
        return hit
    with _lock:
        hit = _memo.get(mkey)
        if hit is not None and (hit.address or not load):
            return hit
        t0 = time.perf_counter()
        key = hash_key("jitkern-kernel", compiler_source_hash(), kernel.__qualname__, kernel.cache_key, spec,
                       target.key(), sorted(emit))
        cache = kernel_cache()
        entry = None if os.environ.get("JITKERN_ALWAYS_COMPILE") else cache.get(target.device_tag, key)
        if entry is not None:
            artifacts = dict(entry.artifacts)
            symbol = entry.meta["symbol"]
            from_cache = True
        else:
            fn = build_ir(kernel, params, consts, target)
            symbol = fn.name
            llvm_ir = lower(fn, target)
            describe = f"kernel {kernel.__name__} {spec} for target {target.name}"
            from .isolate import compile_llvm_ir
            try:
                out = compile_llvm_ir(llvm_ir, triple=target.triple, cpu=target.cpu, features=target.feature_string,
                                      opt=3, emit=tuple(emit), describe=describe, kernel=kernel.__name__,
                                      specialization=spec)
            except CompileError as e:
                if e.target is None:
                    e.target = target.name
                raise
            artifacts = {"kernel.jkir": ir.format_function(fn).encode(), "kernel.ll": llvm_ir.encode()}
            names = {"obj": "kernel.o", "asm": "kernel.s", "opt_ll": "kernel.opt.ll"}
            for k, v in out.items():
                artifacts[names[k]] = v
            cache.put(target.device_tag, key, artifacts,
                      {"kernel": kernel.__qualname__, "symbol": symbol, "target": target.name, "spec": spec})
            from_cache = False
        ck = CompiledKernel(kernel.__name__, symbol, target, params, consts, artifacts=artifacts,
                            from_cache=from_cache)
        if load and "kernel.o" in artifacts:
            from .runtime.cpu import load_object
            ck.address = load_object(artifacts["kernel.o"], symbol)
        ck.compile_seconds = time.perf_counter() - t0
        _memo[mkey] = ck
        return ck
