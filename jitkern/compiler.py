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
    launch_meta: dict = field(default_factory=dict)     # GPU: num_threads, shared_bytes
    loaded: object = None                               # GPU: the runtime's loaded function

    def ptx(self) -> str:
        return self.artifacts.get("kernel.ptx", b"").decode()

    def asm(self) -> str:
        """The target's assembly: x86/arm64 assembly on CPUs, PTX on CUDA targets."""
        return self.artifacts.get("kernel.s", self.artifacts.get("kernel.ptx", b"")).decode()


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
    return lower_with_meta(fn, target)[0]


def lower_with_meta(fn: ir.Function, target) -> tuple:
    """(LLVM IR text, launch metadata) for one traced kernel."""
    if target.is_cpu:
        from .backends.cpu import lower_to_llvm
        return lower_to_llvm(fn, target), {}
    if target.is_hip:
        from .backends.amdgpu import lower_to_amdgpu
        return lower_to_amdgpu(fn, target)
    if target.is_cuda:
        from .backends.nvptx import lower_to_nvptx
        return lower_to_nvptx(fn, target)
    if target.is_vulkan:
        from .backends.spirv import lower_to_spirv
        return lower_to_spirv(fn, target)
    raise CompileError(f"no lowering for {target.backend} targets yet (target {target.name})",
                       kernel=fn.name, target=target.name)


def _toolchain_key(target) -> tuple:
    """Tools outside LLVM and the target's tuning choices (targets/tuning.py) that shape the artifacts and belong
    in the key. CUDA entries leave ptxas out: the
    PTX (from our LLVM, in the key) is the artifact of record and the cubin ptxas made from it is recorded in
    the entry's meta; a cubin any driver refuses falls back to that PTX (runtime/cuda.py), so a cache filled
    by `jitkern build` with one ptxas loads with no compile where another ptxas (or none) is installed."""
    if target.is_hip:
        from .backends.amdgpu import find_lld, lld_version
        return ("ld.lld", lld_version(find_lld())) + target.tuning.choices_key(target)
    return target.tuning.choices_key(target)


def _compile_hip(fn, target, describe, kernel_name, spec) -> tuple:
    """LLVM IR -> relocatable AMDGPU object (isolated LLVM) -> code object (ld.lld; backends/amdgpu.py)."""
    llvm_ir, meta = lower_with_meta(fn, target)
    from .backends.amdgpu import link_code_object
    from .isolate import compile_llvm_ir
    try:
        obj = compile_llvm_ir(llvm_ir, triple=target.triple, cpu=target.cpu, features=target.feature_string,
                              opt=3, emit=("obj",), describe=describe, kernel=kernel_name,
                              specialization=spec)["obj"]
    except CompileError as e:
        if e.target is None:
            e.target = target.name
        raise
    return {"kernel.jkir": ir.format_function(fn).encode(), "kernel.ll": llvm_ir.encode(), "kernel.o": obj,
            "kernel.hsaco": link_code_object(obj, target=target.name, describe=describe)}, meta


def _compile_gpu(fn, target, describe, kernel_name, spec) -> tuple:
    """LLVM IR -> PTX (isolated LLVM) -> cubin (ptxas, when present). Returns (artifacts, meta)."""
    if target.is_hip:
        return _compile_hip(fn, target, describe, kernel_name, spec)
    llvm_ir, meta = lower_with_meta(fn, target)
    from .isolate import compile_llvm_ir
    if target.is_vulkan:
        # LLVM IR -> SPIR-V (the SPIR-V backend's "object" is the module binary; isolated: LLVM asserts abort)
        from .backends.spirv import compile_module
        return {"kernel.jkir": ir.format_function(fn).encode(), "kernel.ll": llvm_ir.encode(),
                "kernel.spv": compile_module(llvm_ir, target, describe, kernel_name, spec)}, meta
    try:
        out = compile_llvm_ir(llvm_ir, triple=target.triple, cpu=target.cpu, features=target.feature_string,
                              opt=3, emit=("asm",), describe=describe, kernel=kernel_name, specialization=spec)
    except CompileError as e:
        if e.target is None:
            e.target = target.name
        raise
    ptx = out["asm"]
    artifacts = {"kernel.jkir": ir.format_function(fn).encode(), "kernel.ll": llvm_ir.encode(), "kernel.ptx": ptx}
    from .backends.nvptx import find_ptxas, ptx_to_cubin
    if find_ptxas() is not None and not os.environ.get("JITKERN_NO_PTXAS"):
        artifacts["kernel.cubin"] = ptx_to_cubin(ptx, target.cpu, describe=describe)
    return artifacts, meta


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
        if target.is_gpu:
            emit = ("gpu",)
        key = hash_key("jitkern-kernel", compiler_source_hash(python=not target.is_gpu), kernel.__qualname__, kernel.cache_key, spec,
                       target.key(), sorted(emit), _toolchain_key(target))
        cache = kernel_cache()
        entry = None if os.environ.get("JITKERN_ALWAYS_COMPILE") else cache.get(target.device_tag, key)
        launch_meta = {}
        if entry is not None:
            artifacts = dict(entry.artifacts)
            symbol = entry.meta["symbol"]
            launch_meta = entry.meta.get("launch", {})
            from_cache = True
        elif target.is_gpu:
            fn = build_ir(kernel, params, consts, target)
            symbol = fn.name
            describe = f"kernel {kernel.__name__} {spec} for target {target.name}"
            artifacts, launch_meta = _compile_gpu(fn, target, describe, kernel.__name__, spec)
            meta = {"kernel": kernel.__qualname__, "symbol": symbol, "target": target.name, "spec": spec,
                    "launch": launch_meta}
            if target.is_cuda:
                from .backends.nvptx import find_ptxas, ptxas_version
                meta["ptxas"] = "none" if "kernel.cubin" not in artifacts else ptxas_version(find_ptxas())
            cache.put(target.device_tag, key, artifacts, meta)
            from_cache = False
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
                            from_cache=from_cache, launch_meta=launch_meta)
        if load and target.is_cuda:
            from .runtime.cuda import load_kernel
            ck.loaded = load_kernel(artifacts, symbol, launch_meta)
            ck.address = id(ck.loaded)
        elif load and target.is_hip:
            from .runtime.hip import load_kernel as load_hip_kernel
            ck.loaded = load_hip_kernel(artifacts, symbol, launch_meta)
            ck.address = id(ck.loaded)
        elif load and target.is_vulkan:
            from .runtime.vulkan import load_kernel as load_vulkan_kernel
            ck.loaded = load_vulkan_kernel(artifacts, symbol, launch_meta)
            ck.address = id(ck.loaded)
        elif load and "kernel.o" in artifacts:
            from .runtime.cpu import load_object
            try:
                ck.address = load_object(artifacts["kernel.o"], symbol,
                                         describe=f"kernel {kernel.__name__} {spec} for target {target.name}")
            except CompileError as e:
                e.kernel, e.specialization, e.target = kernel.__name__, spec, target.name
                raise
        ck.compile_seconds = time.perf_counter() - t0
        _memo[mkey] = ck
        return ck
