"""The CUDA runtime on cuda-python's driver bindings (`cuda.bindings.driver`, the `[cuda]` extra).

Imported lazily: `import jitkern` and every CPU path work without cuda-python or a GPU. What lives here:
- `CudaDevice`: the primary context of one GPU, one stream that every jitkern launch and copy goes to,
  and the driver's default memory pool kept warm (release threshold at its maximum), so `cuMemAllocAsync` /
  `cuMemFreeAsync` on that stream act as a caching allocator;
- `DeviceArray`: pointer, shape, byte strides, numpy dtype (uint16 = bf16 storage, as the engine) plus the
  jitkern element type kernels see, and device; the type every op accepts on a GPU (`from_numpy`, `numpy()`,
  `empty`, `zeros`, `view`, `reshape`, int/slice indexing on any axis giving strided views);
- module loading (cubin, or PTX through the driver's JIT when no ptxas made a cubin) and launches with the
  parameters packed once per launch into 8-byte slots (the same slots as the CPU ABI);
- `CudaGraph`: `jk.capture()` on a GPU is stream capture; `replay()` is one `cuGraphLaunch`.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .. import ir
from ..errors import JitkernError


class CudaError(JitkernError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


class CudaUnavailable(CudaError):
    """No usable CUDA driver / device / cuda-python here."""


_driver = None
# The CUDA context current in each thread (the driver keeps one per thread): a thread that did not create
# the device (the server's engine thread, a user's worker thread) starts with none, and context-bound calls
# (cuModuleLoadData, cuMemGetInfo, graph instantiation) then fail with CUDA_ERROR_INVALID_CONTEXT.
_thread_ctx = threading.local()


def driver():
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise CudaUnavailable(f"cuda-python is not installed ({e}); install jitkern[cuda]") from None
        _driver = cu
    return _driver


def check(res, call: str):
    """cuda-python returns (CUresult, *values): raise on an error, else return the values."""
    err = res[0]
    if int(err) != 0:
        cu = driver()
        try:
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            detail = f"{name.decode()}: {text.decode()}"
        except Exception:          # noqa: BLE001 - the error message itself must not fail
            detail = f"error {int(err)}"
        raise CudaError(f"{call} failed: {detail}")
    vals = res[1:]
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


# --------------------------------------------------------------------------------------------- device
class CudaDevice:
    def __init__(self, ordinal: int = 0):
        cu = driver()
        try:
            check(cu.cuInit(0), "cuInit")
        except CudaError as e:
            raise CudaUnavailable(f"no usable CUDA driver: {e}") from None
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise CudaUnavailable(f"CUDA device {ordinal} asked for, {count} present")
        self.ordinal = ordinal
        self.dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self.activate()
        A = cu.CUdevice_attribute
        self.cc = (check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "attr"),
                   check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "attr"))
        self.name = check(cu.cuDeviceGetName(64, self.dev), "cuDeviceGetName").split(b"\0")[0].decode()
        self.num_sms = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev), "attr")
        self.driver_version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.stream_handle = int(self.stream)
        pool = check(cu.cuDeviceGetDefaultMemPool(self.dev), "cuDeviceGetDefaultMemPool")
        # keep freed blocks in the pool (default threshold 0 returns them to the OS at every sync)
        check(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                       cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)), "cuMemPoolSetAttribute")
        self._modules = {}
        self._lock = threading.Lock()

    @property
    def target_name(self) -> str:
        """The jitkern target that runs here: sm_90a on Hopper (the arch-specific ISA), else sm_XY."""
        major, minor = self.cc
        name = f"sm_{major}{minor}"
        if (major, minor) in ((9, 0), (10, 0)):
            name += "a"
        return name

    def target(self):
        from targets import get_target
        from targets.base import UnknownTargetError
        try:
            return get_target(self.target_name)
        except UnknownTargetError:
            raise CudaUnavailable(f"{self.name} is compute capability {self.cc[0]}.{self.cc[1]}, which jitkern "
                                  f"has no target for") from None

    def activate(self) -> None:
        """Makes this device's context current in the calling thread (every driver call below does it first:
        one thread-local read when it already is)."""
        if getattr(_thread_ctx, "ctx", None) is not self.ctx:
            check(driver().cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            _thread_ctx.ctx = self.ctx

    def synchronize(self) -> None:
        self.activate()
        check(driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def mem_info(self) -> tuple:
        """(free, total) bytes of device memory, the driver's view (other processes' use included)."""
        self.activate()
        free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # ------------------------------------------------------------------------------------ memory
    def alloc(self, nbytes: int) -> int:
        self.activate()
        cu = driver()
        p = check(cu.cuMemAllocAsync(max(int(nbytes), 1), self.stream), f"cuMemAllocAsync({nbytes} bytes)")
        return int(p)

    def free(self, ptr: int) -> None:
        try:
            self.activate()
            driver().cuMemFreeAsync(ptr, self.stream)
        except Exception:           # noqa: BLE001 - interpreter shutdown
            pass

    def upload(self, dst: int, host: np.ndarray) -> None:
        self.activate()
        host = np.ascontiguousarray(host)
        check(driver().cuMemcpyHtoDAsync(dst, host.ctypes.data, host.nbytes, self.stream), "cuMemcpyHtoDAsync")
        self.synchronize()          # the host buffer may go away once we return

    def download(self, host: np.ndarray, src: int) -> None:
        self.activate()
        check(driver().cuMemcpyDtoHAsync(host.ctypes.data, src, host.nbytes, self.stream), "cuMemcpyDtoHAsync")
        self.synchronize()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.activate()
        check(driver().cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def memset8(self, dst: int, value: int, nbytes: int) -> None:
        self.activate()
        check(driver().cuMemsetD8Async(dst, value & 0xFF, nbytes, self.stream), "cuMemsetD8Async")

    # ----------------------------------------------------------------------------------- modules
    def load_function(self, image: bytes, symbol: str, shared_bytes: int = 0):
        """Loads a cubin (or PTX text) once per image and returns the CUfunction of `symbol`."""
        self.activate()
        cu = driver()
        with self._lock:
            key = (hash(image), len(image), symbol)
            hit = self._modules.get(key)
            if hit is not None:
                return hit
            data = image if not image.lstrip().startswith(b"//") else image + b"\0"     # PTX needs a NUL
            mod = check(cu.cuModuleLoadData(data), f"cuModuleLoadData({symbol})")
            fn = check(cu.cuModuleGetFunction(mod, symbol.encode()), f"cuModuleGetFunction({symbol})")
            if shared_bytes > 48 * 1024:
                check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            int(shared_bytes)), "cuFuncSetAttribute(max dynamic shared memory)")
            self._modules[key] = (mod, fn)
            return mod, fn

    def launch(self, fn, grid, num_threads: int, shared_bytes: int, slots: np.ndarray) -> None:
        """Launches with one 8-byte slot per kernel parameter (pointer, i64 or f64 bits)."""
        self.activate()
        n = len(slots)
        ptrs = (ctypes.c_void_p * max(n, 1))()
        base = slots.ctypes.data
        for i in range(n):
            ptrs[i] = base + 8 * i
        check(driver().cuLaunchKernel(fn, grid[0], grid[1], grid[2], num_threads, 1, 1, shared_bytes, self.stream,
                                      ctypes.addressof(ptrs), 0), "cuLaunchKernel")


_devices: dict = {}
_dev_lock = threading.Lock()


def get_device(ordinal: int = 0) -> CudaDevice:
    d = _devices.get(ordinal)
    if d is None:
        with _dev_lock:
            d = _devices.get(ordinal)
            if d is None:
                d = _devices[ordinal] = CudaDevice(ordinal)
    return d


class HostMemoryDevice:
    """A stand-in CUDA device whose memory is host memory and whose target is `target`: `jitkern build
    --target sm_XX` runs the engine's CUDA path on it under compile-only launches, so the cache gets exactly
    the specialisations (tiles, argument alignment) a real GPU's engine asks for. Nothing runs on it."""
    ordinal = 0

    def __init__(self, target, poison: int = 0):
        self._target = target
        if target is not None:
            self.name = f"host memory standing in for {target.name}"
        self._bufs: dict = {}
        self._poison = poison          # fill of new allocations (tests poison them: device memory is not zeroed)
        self.allocated = 0
        self._sizes: dict = {}
        self._in_use = 0
        self._held = 0                 # the most ever in use at once: what a CUDA memory pool keeps mapped
        self._memory = None            # (total, bytes used outside this device's allocations): set_memory

    def set_memory(self, total: int, free: int) -> None:
        """Make mem_info answer (free, total) now, as a card of `total` bytes with `free` of them free; later
        allocations lower the free bytes as CudaDevice's memory pool does: freed memory stays held (the pool
        keeps it for reuse), so free only falls by the peak in use. Without it mem_info answers None (no
        memory to size a KV cache by: the engine keeps its fixed budget)."""
        if not 0 <= free <= total:
            raise ValueError(f"free ({free}) must be between 0 and total ({total}) bytes")
        self._memory = (int(total), int(total) - int(free) - self._held)

    def mem_info(self):
        """(free, total) bytes once set_memory was called, else None."""
        if self._memory is None:
            return None
        total, elsewhere = self._memory
        return max(total - elsewhere - self._held, 0), total

    def target(self):
        return self._target

    def alloc(self, nbytes: int) -> int:
        # aligned like the driver's allocations (256 bytes), so pointer-alignment specialisations match
        buf = np.full(max(int(nbytes), 1) + 256, self._poison, np.uint8)
        addr = buf.ctypes.data
        ptr = addr + (-addr % 256)
        self._bufs[ptr] = buf
        self.allocated += int(nbytes)
        self._sizes[ptr] = int(nbytes)
        self._in_use += int(nbytes)
        self._held = max(self._held, self._in_use)
        return ptr

    def free(self, ptr: int) -> None:
        self._bufs.pop(ptr, None)
        self._in_use -= self._sizes.pop(ptr, 0)

    def upload(self, dst: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        ctypes.memmove(dst, host.ctypes.data, host.nbytes)

    def download(self, host: np.ndarray, src: int) -> None:
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def memset8(self, dst: int, value: int, nbytes: int) -> None:
        ctypes.memset(dst, value & 0xFF, nbytes)

    def synchronize(self) -> None:
        pass

    def activate(self) -> None:
        pass


class standing_in:
    """Context manager: `get_device(0)` answers with `device` (a HostMemoryDevice) until exit."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.prev = _devices.get(0)
        _devices[0] = self.device
        return self.device

    def __exit__(self, *exc):
        if self.prev is None:
            _devices.pop(0, None)
        else:
            _devices[0] = self.prev
        return False


def is_available() -> bool:
    """True when cuda-python is installed and a CUDA device answers (never raises)."""
    try:
        get_device(0)
        return True
    except Exception:       # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------- arrays
_NP_OF = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i8": np.int8, "u8": np.uint8,
          "i16": np.int16, "u16": np.uint16, "i32": np.int32, "u32": np.uint32, "i64": np.int64, "i1": np.uint8}


def np_dtype_of(d: ir.DType):
    return np.dtype(_NP_OF[d.name])


class _Allocation:
    __slots__ = ("device", "ptr", "nbytes", "__weakref__")

    def __init__(self, device: CudaDevice, nbytes: int):
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

    def __init__(self, ptr: int, shape, dtype, device: CudaDevice, alloc=None, strides=None):
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
    def empty(cls, shape, dtype, device: CudaDevice | None = None) -> "DeviceArray":
        """`dtype`: a numpy dtype, a jitkern dtype or its name ("bf16": uint16 storage, bf16 to kernels)."""
        device = device or get_device()
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        d = _as_dtype(dtype) if isinstance(dtype, (str, ir.DType)) else np.dtype(dtype)
        itemsize = d.itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        a = _Allocation(device, nbytes)
        return cls(a.ptr, shape, d, device, a)

    @classmethod
    def from_numpy(cls, host: np.ndarray, dtype=None, device: CudaDevice | None = None) -> "DeviceArray":
        """Uploads `host`; `dtype` reinterprets its bytes (e.g. uint16 storage as bf16)."""
        from ..jit import _NP_TO_DTYPE
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
    from ..jit import _NP_TO_DTYPE
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
    """What a launch needs: the CUfunction, threads per CTA and dynamic shared memory."""
    __slots__ = ("fn", "num_threads", "shared_bytes", "module")

    def __init__(self, module, fn, num_threads, shared_bytes):
        self.module, self.fn, self.num_threads, self.shared_bytes = module, fn, num_threads, shared_bytes


def load_kernel(artifacts: dict, symbol: str, meta: dict, device: CudaDevice | None = None) -> LoadedKernel:
    device = device or get_device()
    cubin = artifacts.get("kernel.cubin")
    try:
        if cubin is None:
            raise CudaError("no cubin")
        mod, fn = device.load_function(cubin, symbol, meta.get("shared_bytes", 0))
    except CudaError:
        # no cubin, or one this driver refuses (made by a newer ptxas): the driver JITs the PTX
        mod, fn = device.load_function(artifacts["kernel.ptx"], symbol, meta.get("shared_bytes", 0))
    return LoadedKernel(mod, fn, meta["num_threads"], meta.get("shared_bytes", 0))


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


class CudaGraph:
    """Launches recorded by stream capture; `replay()` runs them as one graph launch."""

    def __init__(self, device: CudaDevice):
        self.device = device
        self.graph = None
        self.exec = None
        self.nodes = 0
        self.capturing = False
        self._keep = []

    def begin(self) -> None:
        self.device.activate()
        cu = driver()
        check(cu.cuStreamBeginCapture(self.device.stream,
                                      cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        self.capturing = True
        _capturing[0] += 1

    def end(self) -> None:
        self.device.activate()
        cu = driver()
        self.capturing = False
        _capturing[0] = max(_capturing[0] - 1, 0)
        try:
            self.graph = check(cu.cuStreamEndCapture(self.device.stream), "cuStreamEndCapture")
            self.exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        finally:
            _flush_deferred_frees()

    def keep(self, values) -> None:
        self._keep.append(tuple(v for v in values if isinstance(v, (DeviceArray, TensorMap))))

    def replay(self) -> None:
        self.device.activate()
        check(driver().cuGraphLaunch(self.exec, self.device.stream), "cuGraphLaunch")

    def __len__(self):
        return self.nodes


_live_graphs = weakref.WeakSet()


# ------------------------------------------------------------------------------------------- tensor maps
_TMAP_LIMIT = 4096          # tensor maps kept on the device (128 bytes each), least recently used dropped
_tmaps: dict = {}
_tmap_lock = threading.Lock()
_encode_tiled = []


def _encode_fn():
    """libcuda's cuTensorMapEncodeTiled through ctypes: the C signature, with the enum values read from
    cuda-bindings (its own wrapper wants cuuint32_t / cuuint64_t objects for every array element)."""
    if not _encode_tiled:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int]
        _encode_tiled.append(fn)
    return _encode_tiled[0]


class TensorMap(int):
    """A tensor map's global address as a kernel argument (an int), holding the device memory it lives in:
    a graph that recorded a launch with it keeps it (CudaGraph.keep), so the cache dropping it cannot free
    memory a replay still reads."""

    def __new__(cls, store: "DeviceArray"):
        obj = super().__new__(cls, store.ptr)
        obj.store = store
        return obj


def tensor_map_2d(ptr: int, rows: int, cols: int, row_bytes: int, box_rows: int, box_cols: int,
                  dtype: str, device: CudaDevice | None = None) -> TensorMap | None:
    """The CUtensorMap (cuTensorMapEncodeTiled) of the row-major (rows, cols) 16-bit matrix ("bf16" / "f16") at
    device address `ptr` with rows `row_bytes` apart, as a TensorMap (its global address): boxes of (box_rows,
    box_cols) elements, 128-byte swizzle (box_cols * 2 must be 128), elements past the last row or column read
    as zero. The kernel reads it from global memory (jk.tma). A map depends on those arguments only, so maps are
    cached by them (the least recently used of _TMAP_LIMIT dropped). Inside a stream capture only a cached map
    is returned (making one uploads it), else None: callers take their other path there (the engine's
    captures follow an eager run of the same step, which made the maps)."""
    key = (int(ptr), rows, cols, row_bytes, box_rows, box_cols, dtype)
    with _tmap_lock:
        hit = _tmaps.pop(key, None)
        if hit is not None:
            _tmaps[key] = hit
            return hit
    if _capturing[0]:
        return None
    if box_cols * 2 != 128 or ptr % 16 or row_bytes % 16 or not 0 < box_rows <= 256 or rows < 1 or cols < 1:
        raise ValueError(f"tensor_map_2d: unsupported map (ptr % 16 = {ptr % 16}, row_bytes {row_bytes}, "
                         f"box {box_rows} x {box_cols}, matrix {rows} x {cols})")
    cu = driver()
    types = {"bf16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             "f16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}
    buf = ctypes.create_string_buffer(128 + 64)
    at = (ctypes.addressof(buf) + 63) // 64 * 64          # CUtensorMap is 64-byte aligned
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    err = _encode_fn()(at, int(types[dtype]), 2, ptr, u64x2(cols, rows), (ctypes.c_uint64 * 1)(row_bytes),
                       u32x2(box_cols, box_rows), u32x2(1, 1),
                       int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
                       int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B),
                       int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B),
                       int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    if err != 0:
        raise CudaError(f"cuTensorMapEncodeTiled failed: CUresult {err} (matrix {rows} x {cols}, box "
                        f"{box_rows} x {box_cols})")
    host = np.frombuffer(ctypes.string_at(at, 128), np.uint8).copy()
    tm = TensorMap(DeviceArray.from_numpy(host, device=device))
    if tm % 64:
        raise CudaError(f"tensor_map_2d: the map's memory is not 64-byte aligned ({tm:#x})")
    with _tmap_lock:
        _tmaps[key] = tm
        while len(_tmaps) > _TMAP_LIMIT:
            _tmaps.pop(next(iter(_tmaps)))
    return tm
