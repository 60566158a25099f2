"""Launching a kernel: specialise, fetch the compiled code, pack the argument block, run the grid.

The hot path is a dict lookup keyed by cheap per-argument type tokens (array dtype number, int width,
float) plus the constexpr values; only a miss goes through `Kernel.specialize` and the compiler.
"""
from __future__ import annotations

import itertools
import struct
import sys
import threading
import weakref

import numpy as np

from ..args import LAUNCH_OPTIONS, Pointer

_pack_d = struct.Struct("<d")
_unpack_q = struct.Struct("<q")


def _f64_bits(x: float) -> int:
    return _unpack_q.unpack(_pack_d.pack(x))[0]


# Data addresses memoised per live array object (numpy's own accessors cost ~1 us). An entry leaves when
# its array dies (weakref callback: no sweeps), and past ADDRESS_CACHE_MAX entries the oldest quarter is
# dropped (insertion order), so the cache is bounded however many arrays stay alive (e.g. held by graphs).
ADDRESS_CACHE_MAX = 8192
_addr_cache: dict = {}


class _AddressRef(weakref.ref):
    __slots__ = ("key", "address")


def _forget_address(ref: _AddressRef) -> None:
    # runs when the array dies (any thread); the slot may already hold a newer array with the same id
    if _addr_cache.get(ref.key) is ref:
        _addr_cache.pop(ref.key, None)


def array_address(a: np.ndarray) -> int:
    """Data address of an array; memoised per live array object (numpy's own accessors cost ~1 us)."""
    key = id(a)
    ref = _addr_cache.get(key)
    if ref is not None and ref() is a:
        return ref.address
    addr = a.__array_interface__["data"][0]
    if len(_addr_cache) >= ADDRESS_CACHE_MAX:
        for k in list(itertools.islice(_addr_cache, ADDRESS_CACHE_MAX // 4)):
            _addr_cache.pop(k, None)
    ref = _AddressRef(a, _forget_address)
    ref.key, ref.address = key, addr
    _addr_cache[key] = ref
    return addr


def pack_args(grid3, values) -> np.ndarray:
    """The argument block of the CPU ABI: grid sizes, then one 8-byte slot per run-time parameter."""
    slots = [grid3[0], grid3[1], grid3[2]]
    for v in values:
        if type(v) is np.ndarray:
            slots.append(array_address(v))
        elif isinstance(v, np.ndarray):
            slots.append(v.__array_interface__["data"][0])
        elif isinstance(v, Pointer):
            slots.append(v.address)
        elif isinstance(v, (float, np.floating)):
            slots.append(_f64_bits(float(v)))
        else:
            slots.append(int(v))
    return np.array(slots, dtype=np.int64)


def normalize_grid(grid, meta) -> tuple:
    if callable(grid):
        grid = grid(meta)
    if isinstance(grid, int):
        grid = (grid,)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if len(grid) != 3 or any(g < 0 for g in grid):
        raise ValueError(f"bad grid {grid}")
    return grid


def _token(v):
    """A cheap, hashable stand-in for an argument's specialisation."""
    if isinstance(v, np.ndarray):
        return v.dtype.num
    if isinstance(v, Pointer):
        # (16-byte alignment: a GPU specialisation hint, jit.spec_hints, as for device arrays)
        return ("ptr", v.dtype.name, v.address % 16 == 0)
    if type(v).__name__ == "DeviceArray":
        # the kernel element type (bf16 over uint16 storage included) and 16-byte alignment (specialised on)
        return ("dev", v.elem.name, v.ptr % 16 == 0)
    if isinstance(v, bool):
        return "b"
    if isinstance(v, (int, np.integer)):
        # divisibility by 16 is part of a GPU specialisation (vector accesses); harmless on the CPU
        return ("i" if -2**31 <= v < 2**31 else "l", v % 16 == 0)
    if isinstance(v, (float, np.floating)):
        return "f"
    return type(v)


class _Plan:
    __slots__ = ("ck", "runtime_idx")

    def __init__(self, ck, runtime_idx):
        self.ck = ck
        self.runtime_idx = runtime_idx


def resolve(kernel, args, kwargs, target=None):
    """(compiled kernel, run-time argument values, constexpr dict) for a call, memoised per type signature."""
    from ..compiler import compile_kernel
    cx = kernel.constexpr_names
    cxp = kernel._cx_positions
    toks = tuple([_token(a) if i not in cxp else a for i, a in enumerate(args)]) if cxp else \
        tuple([_token(a) for a in args])
    key = (toks, tuple(kwargs.items()) if kwargs else (), target)
    try:
        plan = kernel._plans[key]
    except (KeyError, TypeError):
        params, consts, values = kernel.specialize(args, kwargs, target)
        ck = compile_kernel(kernel, params, consts, target)
        # memoised when every run-time parameter came positionally and the keywords are constexprs or launch
        # options: constexprs left at their defaults included (the key holds what was passed; the defaults are
        # the kernel's own), so calls that omit them (rms_norm's RES_COPY, the flash kernels' switches) do not
        # specialise again on every launch
        idx = tuple(i for i, p in enumerate(kernel.params) if p.name not in cx)
        if (not idx or idx[-1] < len(args)) and all(k in cx or k in LAUNCH_OPTIONS for k in kwargs) and \
                not any(p.name in kwargs for p in kernel.params[:len(args)]):
            plan = _Plan(ck, idx)
            try:
                kernel._plans[key] = plan
            except TypeError:
                pass
        return ck, values, consts
    return plan.ck, [args[i] for i in plan.runtime_idx], None


_pool = None
_capture = threading.local()


class Graph:
    """A recorded sequence of launches replayed in one native call (like a CUDA graph).

    While `jitkern.capture()` is active, launches are recorded instead of run: the kernel, its packed
    argument block (array addresses and scalar values as they were at capture time) and its grid.
    `replay()` runs them in order with a barrier between consecutive launches. Anything that changes
    between replays must therefore live in arrays that the kernels read (positions, lengths, tables).
    """

    def __init__(self):
        self.entries = []         # (fn address, args block, num programs)
        self._tasks = None
        self._keep = []
        self.cuda = None          # a CudaGraph when the captured launches ran on a GPU
        self.vulkan = None        # a runtime.vulkan.VulkanGraph when they were Vulkan dispatches

    def add(self, address: int, block: np.ndarray, n: int, keep=()) -> None:
        self.entries.append((address, block, n))
        self._keep.append(keep)
        self._tasks = None

    def replay(self) -> None:
        global _pool
        if self.cuda is not None:
            self.cuda.replay()
            if not self.entries:
                return
        if self.vulkan is not None:
            self.vulkan.replay()
            if not self.entries:
                return
        if _pool is None or _pool.closed:
            from .cpu_pool import get_pool
            _pool = get_pool()
        if self._tasks is None:
            self._tasks = np.array([(a, b.__array_interface__["data"][0], n) for a, b, n in self.entries if n > 0],
                                   dtype=np.int64).reshape(-1, 3)
        if len(self._tasks):
            _pool.launch_tasks(self._tasks)

    def __len__(self):
        return len(self.entries) + (len(self.vulkan) if self.vulkan is not None else 0)


class capture:
    """Context manager recording launches on this thread into a `Graph`."""

    def __init__(self, graph: Graph | None = None):
        self.graph = graph or Graph()

    def __enter__(self) -> Graph:
        self.prev = getattr(_capture, "graph", None)
        _capture.graph = self.graph
        return self.graph

    def __exit__(self, *exc):
        _capture.graph = self.prev
        if self.graph.cuda is not None and self.graph.cuda.capturing:
            self.graph.cuda.end()
        return False


class compile_only:
    """Context manager: launches on this thread compile (for `target`, default the runtime tier) and
    record what they compiled, but run nothing. `jitkern build` drives a model's warm-up through it."""

    def __init__(self, target=None, on_compile=None):
        self.target = target
        self.on_compile = on_compile
        self.compiled = []
        self.errors = []          # (kernel name, exception) of compiles that failed
        # a specialisation that failed is not compiled again: the warm-up driving the build keeps stepping
        # after a failed request, and every later launch of that kernel would otherwise repeat the compile
        self._failed = {}         # (id(kernel), spec, target name) -> exception

    def __enter__(self):
        self.prev = getattr(_capture, "compile_only", None)
        _capture.compile_only = self
        return self

    def __exit__(self, *exc):
        _capture.compile_only = self.prev
        return False


class dry_launches:
    """Context manager: launches on this thread do nothing at all (no compile, no run) and return None. The
    engine drives a forward pass through it to size its activation buffers for the largest steps at start
    (ModelRunner.reserve_buffers): only the host code between launches runs, and the buffers it asks for are
    allocated, never read or written by a kernel."""

    def __enter__(self):
        self.prev = getattr(_capture, "dry", False)
        _capture.dry = True
        return self

    def __exit__(self, *exc):
        _capture.dry = self.prev
        return False


def launches_are_dry() -> bool:
    """Whether this thread is inside `dry_launches` (stand-in launchers, like the tests' fake device, ask)."""
    return getattr(_capture, "dry", False)


def _compile_only_target(co, target, args):
    """The target a compile-only launch builds for: where the launch would run. Building for a GPU, a launch
    on host arrays alone (the sampler's kernels on logits copied back) runs on this host's CPU tier, so that
    is what it compiles for (the tier of the machine that builds: build on the machine that serves, or force
    its tier with JITKERN_CPU_TIER); everything else compiles for the build's target."""
    if co.target is None or not getattr(co.target, "is_gpu", False):
        return co.target
    if target is None:
        target = _device_target(args)
    if target is None:
        from .cpu import runtime_target
        return runtime_target()
    # a launch for a tuned copy of the build's target (targets.tuned) builds with its choices
    return target if getattr(target, "name", None) == co.target.name else co.target


def _compile_only_launch(co, kernel, args, kwargs, target=None, record_errors=True):
    """Compiles one launch's specialisation for `co`; record_errors=False leaves a failure out of `co.errors` (an
    autotuned kernel's configs may fail one by one: jk.autotune records a failure only when every config fails)."""
    from ..compiler import compile_kernel
    target = co.target if target is None else target
    from ..compiler import spec_string
    params, consts, _ = kernel.specialize(args, kwargs, target)
    key = (id(kernel), spec_string(params, consts), getattr(target, "name", None))
    if key in co._failed:
        raise co._failed[key]
    try:
        ck = compile_kernel(kernel, params, consts, target, load=False)
    except Exception as e:
        # kept here too: the engine driving the build fails just the request whose step raised, so the
        # error would otherwise never reach `jitkern build`
        if record_errors:
            co.errors.append((kernel.__name__, e))
        co._failed[key] = e
        raise
    co.compiled.append(ck)
    if co.on_compile is not None:
        co.on_compile(ck)
    return ck


def _device_target(args):
    """The GPU target of the first device array among the arguments (as Triton does), else None. Until the
    device-array module is imported no argument can be one, so CPU launches skip the scan."""
    mod = sys.modules.get("jitkern.runtime.device")
    if mod is None:
        return None
    device_array = mod.DeviceArray
    for a in args:
        if type(a) is device_array:
            return a.device.target()
    return None


def resolve_launch(kernel, grid, args, kwargs, target):
    """(compiled kernel, run-time argument values, 3-D grid) of a GPU launch; the grid is None when it is empty.
    The GPU runtimes' launch_args start here (through Kernel.resolve_launch)."""
    ck, values, consts = resolve(kernel, args, kwargs, target)
    if callable(grid):
        grid = grid(consts if consts is not None else dict(kwargs))
    g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    return ck, values, (g if g[0] * g[1] * g[2] else None)


def launch(kernel, grid, args, kwargs, target=None):
    if getattr(_capture, "dry", False):
        return None
    co = getattr(_capture, "compile_only", None)
    if co is not None:
        return _compile_only_launch(co, kernel, args, kwargs, _compile_only_target(co, target, args))
    if target is None:
        target = _device_target(args)
    if target is not None and target.is_gpu:
        # the target family's runtime (runtime/cuda.py, hip.py, vulkan.py): device arrays, or host arrays staged
        # through device memory; inside jk.capture() the launch goes into the runtime's graph
        from ..backends import backend_of
        return backend_of(target).runtime().launch_args(kernel, grid, args, kwargs, target,
                                                        getattr(_capture, "graph", None))
    global _pool
    if _pool is None or _pool.closed:
        from .cpu_pool import get_pool
        _pool = get_pool()
    ck, values, consts = resolve(kernel, args, kwargs, target)
    if callable(grid):
        grid = grid(consts if consts is not None else dict(kwargs))
    if isinstance(grid, int):
        g = (grid, 1, 1)
    else:
        g = tuple(grid) + (1,) * (3 - len(grid))
    n = g[0] * g[1] * g[2]
    block = pack_args(g, values)
    graph = getattr(_capture, "graph", None)
    if graph is not None:
        graph.add(ck.address, block, n, keep=tuple(v for v in values if isinstance(v, (np.ndarray, Pointer))))
        return ck
    if n > 0:
        _pool.launch(ck.address, block.__array_interface__["data"][0], n)
    return ck
