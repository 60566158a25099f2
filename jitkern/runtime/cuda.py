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

from ..errors import JitkernError
from . import device as _device_module
from .device import (Device, DeviceArray, LoadedKernel, StreamDevice, StreamGraph, _Allocation, _as_dtype,  # noqa: F401
                     _capturing, _deferred_frees, _flush_deferred_frees, has_host_arrays, is_device_array, np_dtype_of,
                     pack_slots, run_staged, to_device)


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
class CudaDevice(StreamDevice):
    kind = "cuda"
    CALLS = {"alloc": "cuMemAllocAsync", "free": "cuMemFreeAsync", "upload": "cuMemcpyHtoDAsync",
             "download": "cuMemcpyDtoHAsync", "copy": "cuMemcpyDtoDAsync", "memset8": "cuMemsetD8Async",
             "module_load": "cuModuleLoadData", "get_function": "cuModuleGetFunction", "launch": "cuLaunchKernel"}
    LAUNCH_EXTRA = 0

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
        self._init_modules()

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

    def time_calls(self, call, n: int, before=None, after=None) -> list:
        """Seconds each of `n` calls of `call` takes on this device's stream, by CUDA events recorded around each
        call (no host synchronisation between calls: launch overhead stays out of the figure); `before` / `after`
        (stream-ordered resets) fall outside the events."""
        cu = driver()
        self.activate()
        events = []
        try:
            for _ in range(n):
                # (flags 0: CU_EVENT_DEFAULT, timing on)
                events.append(tuple(check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)))
            for start, end in events:
                if before is not None:
                    before()
                check(cu.cuEventRecord(start, self.stream), "cuEventRecord")
                call()
                check(cu.cuEventRecord(end, self.stream), "cuEventRecord")
                if after is not None:
                    after()
            self.synchronize()
            return [check(cu.cuEventElapsedTime(s, e), "cuEventElapsedTime") / 1e3 for s, e in events]
        finally:
            for pair in events:
                for ev in pair:
                    cu.cuEventDestroy(ev)

    def mem_info(self) -> tuple:
        """(free, total) bytes of device memory, the driver's view (other processes' use included)."""
        self.activate()
        free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # memory, modules and launches: StreamDevice (runtime/device.py) with the driver API's calls
    def api(self):
        return driver()

    def check(self, res, call: str):
        return check(res, call)

    def _bind(self) -> None:
        self.activate()

    def _module_data(self, image: bytes) -> bytes:
        return image if not image.lstrip().startswith(b"//") else image + b"\0"     # PTX needs a NUL

    def _configure(self, fn, shared_bytes: int) -> None:
        if shared_bytes > 48 * 1024:
            cu = driver()
            check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        int(shared_bytes)), "cuFuncSetAttribute(max dynamic shared memory)")

    def load_kernel(self, artifacts: dict, symbol: str, meta: dict) -> LoadedKernel:
        return load_kernel(artifacts, symbol, meta, self)


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


# arrays made without a device are CUDA device 0's (looked up at each call: a stand-in device answers)
_device_module.default_device = lambda: get_device()


class HostMemoryDevice(Device):
    """A stand-in CUDA device whose memory is host memory and whose target is `target`: `jitkern build
    --target sm_XX` runs the engine's CUDA path on it under compile-only launches, so the cache gets exactly
    the specialisations (tiles, argument alignment) a real GPU's engine asks for. Nothing runs on it."""
    ordinal = 0

    @property
    def kind(self) -> str:
        """The runtime it stands in for: its target's ("cuda", "hip", "vulkan")."""
        return self._target.backend if self._target is not None else ""

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


# ------------------------------------------------------------------------------------------ launch
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


class CudaGraph(StreamGraph):
    """Launches recorded by stream capture; `replay()` runs them as one graph launch."""

    def keep(self, values) -> None:
        # device arrays and tensor maps (a TensorMap holds the memory its map lives in)
        self._keep.append(tuple(v for v in values if isinstance(v, (DeviceArray, TensorMap))))

    def _begin(self) -> None:
        self.device.activate()
        cu = driver()
        check(cu.cuStreamBeginCapture(self.device.stream,
                                      cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")

    def _end(self) -> tuple:
        self.device.activate()
        cu = driver()
        graph = check(cu.cuStreamEndCapture(self.device.stream), "cuStreamEndCapture")
        return graph, check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def _replay(self) -> None:
        self.device.activate()
        check(driver().cuGraphLaunch(self.exec, self.device.stream), "cuGraphLaunch")


def launch_args(kernel, grid, args, kwargs, target, jk_graph=None):
    """One launch on the CUDA device (launch.py comes here for a CUDA target). `jk_graph`: the `jk.capture()`
    graph active on this thread, if any: stream capture starts at its first launch and the capture's exit ends
    it. Host (numpy) arguments are staged through device memory (run_staged): a convenience for tests and
    one-off calls that keeps the op wrappers' numpy interface; the engine passes DeviceArrays."""
    from . import gpu_profile
    if has_host_arrays(args):
        return run_staged(get_device(), args,
                          lambda dargs: launch_args(kernel, grid, dargs, kwargs, target, jk_graph))
    ck, values, g = kernel.resolve_launch(grid, args, kwargs, target)
    if g is None:
        return ck
    dev = get_device()
    slots = pack_slots(values)
    if jk_graph is not None:
        if jk_graph.cuda is None:
            jk_graph.cuda = CudaGraph(dev)
            jk_graph.cuda.begin()
        jk_graph.cuda.nodes += 1
        jk_graph.cuda.keep(values)
    lk = ck.loaded
    if gpu_profile.ENABLED and jk_graph is None:
        gpu_profile.timed(dev, kernel.__name__, lambda: dev.launch(lk.fn, g, lk.num_threads, lk.shared_bytes, slots))
        return ck
    dev.launch(lk.fn, g, lk.num_threads, lk.shared_bytes, slots)
    return ck


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
