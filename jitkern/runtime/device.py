"""The runtime's device interface, and the arrays that live on a device.

`Device` is what every GPU runtime implements (runtime/cuda.py, hip.py, vulkan.py, and the host-memory stand-in
that `jitkern build` and the tests use) and what the launch path, the ops and the engine call: memory (`alloc`,
`free`, `upload`, `download`, `copy`, `memset8`), `synchronize`, `activate`, the `target()` its code is compiled
for, `load_kernel` (a compiled kernel's artifacts -> what a launch needs) and the launch itself.

`StreamDevice` is the memory, module and launch API that CUDA's driver and HIP share call for call (one
non-blocking stream that every launch and copy goes to, stream-ordered pool allocations, modules loaded once
per image, launches with an array of the 8-byte parameter slots' addresses): a runtime names its calls in
`CALLS` and supplies `api()` and `check()`. `StreamGraph` is their stream-capture graph (frees of arrays
dropped during a capture wait for its end).

`DeviceArray` is the one array type of every GPU runtime: pointer, shape, byte strides, numpy dtype (uint16 =
bf16 storage) plus the jitkern element type kernels see, and its device; it only calls the device's memory
methods, so on Vulkan its pointer is a virtual address the device maps back to a buffer.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from .. import ir
from ..args import _NP_TO_DTYPE, Pointer


class Device:
    """A place kernels run. Runtimes implement the methods; `kind` names the runtime ("cuda", "hip",
    "vulkan") and `ordinal` the device among its kind."""
    kind = ""
    ordinal = 0

    def target(self):
        """The jitkern Target whose code runs here."""
        raise NotImplementedError

    def activate(self) -> None:
        """Makes this device current in the calling thread (where the runtime has such a notion)."""

    def synchronize(self) -> None:
        """Waits for everything issued to this device."""

    def mem_info(self):
        """(free, total) bytes of device memory, or None where the device cannot tell."""
        return None

    def time_calls(self, call, n: int, before=None, after=None) -> list:
        """Seconds each of `n` calls of `call` (launches on this device) takes, for jk.autotune: the host clock
        between device synchronisations (runtimes with device timers override it); `before` / `after` run
        around each call outside the timed span."""
        import time
        out = []
        for _ in range(n):
            if before is not None:
                before()
            self.synchronize()
            t0 = time.perf_counter()
            call()
            self.synchronize()
            out.append(time.perf_counter() - t0)
            if after is not None:
                after()
        return out

    # memory: addresses are ints (a device pointer, or a virtual address the device maps back)
    def alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        raise NotImplementedError

    def upload(self, dst: int, host: np.ndarray) -> None:
        raise NotImplementedError

    def download(self, host: np.ndarray, src: int) -> None:
        raise NotImplementedError

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        raise NotImplementedError

    def memset8(self, dst: int, value: int, nbytes: int) -> None:
        raise NotImplementedError

    # kernels
    def load_kernel(self, artifacts: dict, symbol: str, meta: dict):
        """What a launch needs from a compiled kernel's cache entry (`artifacts`, its launch `meta`)."""
        raise NotImplementedError


class StreamDevice(Device):
    """The memory, module and launch API shared by CUDA's driver and HIP. Subclasses set `CALLS` (the API's
    function for each role), `api()` (the bindings module), `check(result, call)` (raise on an error, else the
    values), `stream`, and may override `_bind()` (run before each call: CUDA makes its context current),
    `_module_data`, `_check_shared` and `_configure` (module loading's per-API steps)."""
    CALLS = {"alloc": "", "free": "", "upload": "", "download": "", "copy": "", "memset8": "",
             "module_load": "", "get_function": "", "launch": ""}
    LAUNCH_EXTRA = None        # the launch call's `extra` argument
    stream = None

    def api(self):
        raise NotImplementedError

    def check(self, res, call: str):
        raise NotImplementedError

    def _bind(self) -> None:
        pass

    def _init_modules(self) -> None:
        self._modules = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ memory
    def alloc(self, nbytes: int) -> int:
        self._bind()
        call = self.CALLS["alloc"]
        p = self.check(getattr(self.api(), call)(max(int(nbytes), 1), self.stream), f"{call}({nbytes} bytes)")
        return int(p)

    def free(self, ptr: int) -> None:
        try:
            self._bind()
            getattr(self.api(), self.CALLS["free"])(ptr, self.stream)
        except Exception:           # noqa: BLE001 - interpreter shutdown
            pass

    def upload(self, dst: int, host: np.ndarray) -> None:
        self._bind()
        host = np.ascontiguousarray(host)
        call = self.CALLS["upload"]
        self.check(getattr(self.api(), call)(dst, host.ctypes.data, host.nbytes, self.stream), call)
        self.synchronize()          # the host buffer may go away once we return

    def download(self, host: np.ndarray, src: int) -> None:
        self._bind()
        call = self.CALLS["download"]
        self.check(getattr(self.api(), call)(host.ctypes.data, src, host.nbytes, self.stream), call)
        self.synchronize()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._bind()
        call = self.CALLS["copy"]
        self.check(getattr(self.api(), call)(dst, src, nbytes, self.stream), call)

    def memset8(self, dst: int, value: int, nbytes: int) -> None:
        self._bind()
        call = self.CALLS["memset8"]
        self.check(getattr(self.api(), call)(dst, value & 0xFF, nbytes, self.stream), call)

    # ----------------------------------------------------------------------------------- modules
    def _check_shared(self, symbol: str, shared_bytes: int) -> None:
        """Refuse a kernel whose shared memory the device cannot give (before loading it)."""

    def _module_data(self, image: bytes) -> bytes:
        return image

    def _configure(self, fn, shared_bytes: int) -> None:
        """Per-function settings after loading (CUDA: the dynamic shared memory opt-in)."""

    def load_function(self, image: bytes, symbol: str, shared_bytes: int = 0):
        """Loads a module image once per image and returns (module, function) of `symbol`."""
        self._check_shared(symbol, shared_bytes)
        self._bind()
        api = self.api()
        load, get = self.CALLS["module_load"], self.CALLS["get_function"]
        with self._lock:
            key = (hash(image), len(image), symbol)
            hit = self._modules.get(key)
            if hit is not None:
                return hit
            mod = self.check(getattr(api, load)(self._module_data(image)), f"{load}({symbol})")
            fn = self.check(getattr(api, get)(mod, symbol.encode()), f"{get}({symbol})")
            self._configure(fn, shared_bytes)
            self._modules[key] = (mod, fn)
            return mod, fn

    def launch(self, fn, grid, num_threads: int, shared_bytes: int, slots: np.ndarray) -> None:
        """Launches with one 8-byte slot per kernel parameter (pointer, i64 or f64 bits); kernelParams is an
        array of the slots' addresses, as cuLaunchKernel and hipModuleLaunchKernel take them."""
        self._bind()
        n = len(slots)
        ptrs = (ctypes.c_void_p * max(n, 1))()
        base = slots.ctypes.data
        for i in range(n):
            ptrs[i] = base + 8 * i
        call = self.CALLS["launch"]
        self.check(getattr(self.api(), call)(fn, grid[0], grid[1], grid[2], num_threads, 1, 1, shared_bytes,
                                             self.stream, ctypes.addressof(ptrs), self.LAUNCH_EXTRA), call)


class StreamGraph:
    """Launches recorded by stream capture on a StreamDevice; `replay()` runs them as one graph launch.
    Subclasses implement `_begin()`, `_end()` (ends the capture, returns the instantiated graph's
    (graph, exec)) and `_replay()`; `keep` holds the device arrays a recorded launch reads."""

    def __init__(self, device):
        self.device = device
        self.graph = None
        self.exec = None
        self.nodes = 0
        self.capturing = False
        self._keep = []

    def begin(self) -> None:
        self._begin()
        self.capturing = True
        _capturing[0] += 1             # DeviceArray frees wait for the end (_Allocation)

    def end(self) -> None:
        self.capturing = False
        _capturing[0] = max(_capturing[0] - 1, 0)
        try:
            self.graph, self.exec = self._end()
        finally:
            _flush_deferred_frees()

    def keep(self, values) -> None:
        self._keep.append(tuple(v for v in values if isinstance(v, DeviceArray)))

    def replay(self) -> None:
        self._replay()

    def __len__(self):
        return self.nodes

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> tuple:
        raise NotImplementedError

    def _replay(self) -> None:
        raise NotImplementedError


# The device of arrays made without one, a function: runtime/cuda.py installs its get_device (CUDA device 0, looked
# up at each call so that a stand-in device answers) when it is imported, so that this base module, which the
# CUDA runtime builds on, does not import it back; jitkern.runtime.cuda is where such arrays are made.
default_device = None


def _default_device():
    if default_device is None:
        raise RuntimeError("a device array made without a device before the CUDA runtime was imported: pass "
                           "device=, or make it through jitkern.runtime.cuda")
    return default_device()


# ---------------------------------------------------------------------------------------- arrays
_NP_OF = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i8": np.int8, "u8": np.uint8,
          "i16": np.int16, "u16": np.uint16, "i32": np.int32, "u32": np.uint32, "i64": np.int64, "i1": np.uint8}


def np_dtype_of(d: ir.DType):
    return np.dtype(_NP_OF[d.name])


class _Allocation:
    __slots__ = ("device", "ptr", "nbytes", "__weakref__")

    def __init__(self, device: Device, nbytes: int):
        self.device = device
        self.nbytes = nbytes
        self.ptr = device.alloc(nbytes)

    def __del__(self):
        if self.ptr:
            if _capturing is None:          # interpreter shutdown: the module's globals are gone, so is the context
                return
            if _capturing[0]:
                # a free issued into a stream capture would be recorded into the graph (and repeated at every
                # replay): hold it until the capture ends
                _deferred_frees.append((self.device, self.ptr))
            else:
                self.device.free(self.ptr)
            self.ptr = 0


_capturing = [0]          # stream captures in progress (frees wait for their end)
_deferred_frees: list = []


def _flush_deferred_frees() -> None:
    while _deferred_frees and not _capturing[0]:
        dev, ptr = _deferred_frees.pop()
        dev.free(ptr)


class _Flags:
    __slots__ = ("c_contiguous", "writeable")

    def __init__(self, c_contiguous: bool):
        self.c_contiguous = c_contiguous
        self.writeable = True


def _c_strides(shape, itemsize: int) -> tuple:
    st, acc = [], itemsize
    for s in reversed(shape):
        st.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(st))


class DeviceArray:
    """An array in GPU memory, numpy-like enough for the op wrappers.

    `dtype` is a numpy dtype with the engine's convention (float32, float16, uint16 = bf16 storage, int32 ...);
    `elem` is the jitkern element type a kernel sees (bf16 for arrays made with dtype="bf16", else the numpy
    dtype's); `strides` are in bytes as numpy's. Integer indices and slices on any axis (step > 0) give views
    sharing memory (e.g. `qkv[:, :q_size]`); `reshape` needs a C-contiguous array; `as_strided` builds any
    view (stride 0 broadcasts included). Views keep the allocation alive.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "elem", "device", "_alloc", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, device: Device, alloc=None, strides=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        if isinstance(dtype, ir.DType):
            self.elem = dtype
            self.dtype = np_dtype_of(dtype)
        else:
            self.dtype = np.dtype(dtype)
            self.elem = _as_dtype(self.dtype)
        self.strides = _c_strides(self.shape, self.dtype.itemsize) if strides is None else \
            tuple(int(s) for s in strides)
        self.device = device
        self._alloc = alloc

    # construction
    @classmethod
    def empty(cls, shape, dtype, device: Device | None = None) -> "DeviceArray":
        """`dtype`: a numpy dtype, a jitkern dtype or its name ("bf16": uint16 storage, bf16 to kernels)."""
        device = device or _default_device()
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        d = _as_dtype(dtype) if isinstance(dtype, (str, ir.DType)) else np.dtype(dtype)
        itemsize = d.itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        a = _Allocation(device, nbytes)
        return cls(a.ptr, shape, d, device, a)

    @classmethod
    def from_numpy(cls, host: np.ndarray, dtype=None, device: Device | None = None) -> "DeviceArray":
        """Uploads `host`; `dtype` reinterprets its bytes (e.g. uint16 storage as bf16)."""
        host = np.ascontiguousarray(host)
        if dtype is not None:
            d = _as_dtype(dtype)
        else:
            if host.dtype not in _NP_TO_DTYPE:
                raise TypeError(f"arrays of dtype {host.dtype} cannot go to the GPU")
            d = host.dtype
        if d.itemsize != host.dtype.itemsize:
            raise TypeError(f"cannot view {host.dtype} data as {d}")
        out = cls.empty(host.shape, d, device)
        if host.nbytes:
            out.device.upload(out.ptr, host)
        return out

    @classmethod
    def zeros(cls, shape, dtype, device=None) -> "DeviceArray":
        out = cls.empty(shape, dtype, device)
        if out.nbytes:
            out.device.memset8(out.ptr, 0, out.nbytes)
        return out

    # properties
    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return all(st == c for s, st, c in zip(self.shape, self.strides, _c_strides(self.shape, self.itemsize))
                   if s > 1)

    @property
    def flags(self) -> _Flags:
        return _Flags(self.is_contiguous)

    @property
    def T(self):
        raise TypeError("device arrays have no transpose view; transpose on the host before uploading")

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        el = f", elem={self.elem}" if self.elem.name != _as_dtype(self.dtype).name else ""
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}{el}, device=cuda:{self.device.ordinal})"

    def __array__(self, *a, **k):
        # an implicit host copy would hide writes that never reach the device: make it explicit
        raise TypeError("a DeviceArray is not a numpy array: call .numpy() for a host copy")

    def _view(self, ptr, shape, strides, elem=None) -> "DeviceArray":
        out = DeviceArray(ptr, shape, self.dtype, self.device, self._alloc or self, strides)
        out.elem = elem or self.elem
        return out

    def _span(self) -> tuple:
        """(lowest byte offset, byte count) this view touches (strides >= 0)."""
        if self.size == 0:
            return 0, 0
        return 0, sum((s - 1) * st for s, st in zip(self.shape, self.strides)) + self.itemsize

    # transfers
    def numpy(self) -> np.ndarray:
        """A host copy (bf16 arrays come back as uint16 bits)."""
        if self.is_contiguous:
            out = np.empty(self.shape, self.dtype)
            if out.nbytes:
                self.device.download(out, self.ptr)
            return out
        _, n = self._span()
        raw = np.empty(n, np.uint8)
        self.device.download(raw, self.ptr)
        return np.ndarray(self.shape, self.dtype, buffer=raw, strides=self.strides).copy()

    def copy_from_numpy(self, host) -> None:
        """Writes `host` (same shape, cast to this dtype when it differs) into this array or view."""
        host = np.asarray(host)
        if host.shape != self.shape and host.size == self.size and self.is_contiguous:
            host = host.reshape(self.shape)
        if host.shape != self.shape:
            raise ValueError(f"copy of shape {host.shape} into a device array of shape {self.shape}")
        if host.dtype != self.dtype:
            host = host.astype(self.dtype)
        if not self.size:
            return
        if self.is_contiguous:
            self.device.upload(self.ptr, np.ascontiguousarray(host))
            return
        # a strided view: read its span, patch the view's elements, write the span back (in stream order)
        _, n = self._span()
        raw = np.empty(n, np.uint8)
        self.device.download(raw, self.ptr)
        np.ndarray(self.shape, self.dtype, buffer=raw, strides=self.strides)[...] = host
        self.device.upload(self.ptr, raw)

    def fill_zero(self) -> "DeviceArray":
        if not self.is_contiguous:
            raise ValueError("fill_zero needs a contiguous device array")
        if self.nbytes:
            self.device.memset8(self.ptr, 0, self.nbytes)
        return self

    # views
    def view(self, dtype) -> "DeviceArray":
        """The same bytes as another dtype: numpy dtypes change `dtype` (and `elem`); a jitkern dtype or its
        name ("bf16") changes the kernel element type over the same storage. Item sizes may differ on a
        contiguous last axis (as numpy)."""
        if isinstance(dtype, (str, ir.DType)):
            d = _as_dtype(dtype)
            nd, el = np_dtype_of(d), d
        else:
            nd = np.dtype(dtype)
            el = _as_dtype(nd)
        if nd.itemsize == self.itemsize:
            return self._view(self.ptr, self.shape, self.strides, el)._with_dtype(nd)
        if not self.ndim or (self.shape[-1] > 1 and self.strides[-1] != self.itemsize) or \
                (self.shape[-1] * self.itemsize) % nd.itemsize:
            raise TypeError(f"cannot view {self.dtype} {self.shape} as {nd}")
        last = self.shape[-1] * self.itemsize // nd.itemsize
        return self._view(self.ptr, self.shape[:-1] + (last,), self.strides[:-1] + (nd.itemsize,), el)._with_dtype(nd)

    def _with_dtype(self, nd) -> "DeviceArray":
        self.dtype = np.dtype(nd)
        return self

    def with_elem(self, elem) -> "DeviceArray":
        """The same array with another kernel element type (what `jk.as_pointer(a, "bf16")` gives)."""
        return self._view(self.ptr, self.shape, self.strides, _as_dtype(elem))

    def reshape(self, *shape) -> "DeviceArray":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        if int(np.prod(shape)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        if not self.is_contiguous:
            raise ValueError(f"reshape of a non-contiguous device array {self.shape} (strides {self.strides})")
        return self._view(self.ptr, shape, None)

    def as_strided(self, shape, strides) -> "DeviceArray":
        """A view with any shape and byte strides over this array's memory (as numpy's as_strided: unchecked)."""
        return self._view(self.ptr, tuple(shape), tuple(strides))

    def __getitem__(self, key) -> "DeviceArray":
        """Integer and slice (step > 0) indices on any axis, Ellipsis: views sharing memory."""
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"{len(key)} indices for a {self.ndim}-D device array")
        ptr, shape, strides = self.ptr, [], []
        for ax, k in enumerate(key):
            n, st = self.shape[ax], self.strides[ax]
            if isinstance(k, (int, np.integer)):
                i = int(k) + (n if k < 0 else 0)
                if not 0 <= i < n:
                    raise IndexError(f"index {k} out of range for axis {ax} of size {n}")
                ptr += i * st
            elif isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step <= 0:
                    raise IndexError("device arrays take slices with a positive step only")
                cnt = max(0, -(-(stop - start) // step))
                ptr += start * st if cnt else 0
                shape.append(cnt)
                strides.append(st * step)
            else:
                raise IndexError(f"device arrays take ints and slices as indices, got {k!r}")
        shape += self.shape[len(key):]
        strides += self.strides[len(key):]
        return self._view(ptr, shape, strides)


def _as_dtype(d) -> ir.DType:
    if isinstance(d, ir.DType):
        return d
    if isinstance(d, str) and d in ir.DTYPES:
        return ir.DTYPES[d]
    try:
        return _NP_TO_DTYPE[np.dtype(d)]
    except (KeyError, TypeError):
        raise TypeError(f"dtype {d!r} has no jitkern element type") from None


def is_device_array(x) -> bool:
    return isinstance(x, DeviceArray)


def to_device(x, dtype=None, device=None) -> DeviceArray:
    return x if isinstance(x, DeviceArray) else DeviceArray.from_numpy(x, dtype, device)


# ------------------------------------------------------------------------------------------ launch
class LoadedKernel:
    """What a launch needs: a stream device's function, threads per CTA (workgroup) and dynamic shared memory."""
    __slots__ = ("fn", "num_threads", "shared_bytes", "module")

    def __init__(self, module, fn, num_threads, shared_bytes):
        self.module, self.fn, self.num_threads, self.shared_bytes = module, fn, num_threads, shared_bytes


_pack_d = np.dtype("<f8")


def pack_slots(values) -> np.ndarray:
    slots = np.empty(len(values), np.uint64)
    for i, v in enumerate(values):
        if isinstance(v, DeviceArray):
            slots[i] = v.ptr
        elif isinstance(v, (float, np.floating)):
            slots[i] = np.array([float(v)], _pack_d).view(np.uint64)[0]
        elif isinstance(v, (bool, np.bool_)):
            slots[i] = int(v)
        elif isinstance(v, (int, np.integer)):
            slots[i] = int(v) & 0xFFFFFFFFFFFFFFFF
        elif isinstance(v, np.ndarray):
            raise TypeError("a host (numpy) array was passed to a GPU kernel: upload it with "
                            "jitkern.runtime.cuda.to_device first")
        else:
            raise TypeError(f"cannot pass {type(v).__name__} to a GPU kernel")
    return slots


# ------------------------------------------------------------------------- host arrays in a GPU launch
def has_host_arrays(args) -> bool:
    """Whether a GPU launch was given host (numpy / Pointer) arguments: its runtime stages them (run_staged)."""
    return any(isinstance(a, (np.ndarray, Pointer)) for a in args)


def run_staged(dev, args, run, what: str = "a GPU launch", error=TypeError):
    """Host (numpy / Pointer-over-numpy) arguments through device memory: each distinct root buffer goes to
    `dev` whole (views keep their offsets and strides, aliasing between arguments stays), `run(device_args)`
    launches, and every writeable buffer comes back (a kernel may write any of them). Returns run's result.
    Shared by the GPU runtimes' staged launches."""
    staged, dargs = {}, []

    def stage(arr: np.ndarray, address: int, dtype, shape):
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous:
            root = arr = np.ascontiguousarray(arr)
            address = arr.ctypes.data
        key = id(root)
        if key not in staged:
            staged[key] = (root, DeviceArray.from_numpy(root.reshape(-1).view(np.uint8), device=dev))
        d = staged[key][1]
        return DeviceArray(d.ptr + (address - root.ctypes.data), shape, dtype, dev, d)

    for a in args:
        if isinstance(a, Pointer):
            host = a.keepalive
            if not isinstance(host, np.ndarray):
                raise error(f"{what} cannot take a raw host Pointer; pass a DeviceArray")
            dargs.append(stage(host, a.address, a.dtype, (host.nbytes // a.dtype.itemsize,)))
        elif isinstance(a, np.ndarray):
            dargs.append(stage(a, a.ctypes.data, _NP_TO_DTYPE[a.dtype], a.shape))
        else:
            dargs.append(a)
    out = run(dargs)
    dev.synchronize()
    for root, d in staged.values():
        if root.flags.writeable:
            root.reshape(-1).view(np.uint8)[...] = d.numpy()
    return out
