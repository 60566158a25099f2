"""The HIP runtime on hip-python (`from hip import hip`, the `[hip]` extra) for AMD GPUs. UNTESTED ON HARDWARE:
no AMD GPU has run it yet; its code paths are exercised by tests/test_amdgpu.py with the driver calls stubbed.

Imported lazily: nothing on the CPU or CUDA paths imports this module. hip-python itself imports without
ROCm; the first driver call fails to dlopen libamdhip64.so, which `HipDevice` turns into one clear
`HipUnavailable` error. The memory, module and launch calls are runtime/device.py's StreamDevice, shared with
runtime/cuda.py:
- `HipDevice`: one GPU (hipSetDevice), one non-blocking stream that every launch and copy goes to; memory
  through hipMallocAsync / hipFreeAsync on that stream from the device's default pool, kept warm (release
  threshold at its maximum, as runtime/cuda.py does): a caching allocator;
- `DeviceArray` is runtime/device.py's class (it only calls its device's alloc/free/upload/download/copy/
  memset8), made here with a `HipDevice`: `to_device(x)`, `empty`, `zeros`;
- module loading of the linked code object (`kernel.hsaco`, backends/amdgpu.py) with hipModuleLoadData and
  launches through hipModuleLaunchKernel with one 8-byte slot per kernel parameter (the CPU ABI's slots),
  workgroups of (num_threads, 1, 1) and the kernel's dynamic LDS bytes;
- `HipGraph`: `jk.capture()` (or `hip.capture()`) around launches on AMD device arrays is HIP stream
  capture, and `replay()` is one hipGraphLaunch; frees of arrays dropped during a capture wait for its end
  (a free issued into the capture would be recorded into the graph);
- numpy arguments with `target=` an AMD target are staged: copied to the device, launched, copied back (for
  tests and one-off calls, as the CUDA path does).
`launch(kernel, grid, *args, **kwargs)` runs a `@jk.kernel` here (`python -m jitkern.runtime.hip` prints
the device, or the one-line reason there is none).
"""
from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager

import numpy as np

from ..errors import JitkernError
from .device import (DeviceArray, LoadedKernel, StreamDevice, StreamGraph, has_host_arrays,  # noqa: F401
                     pack_slots, run_staged)


class HipError(JitkernError):
    """A HIP runtime call failed (the message names the call and HIP's error)."""


class HipUnavailable(HipError):
    """No usable HIP runtime / AMD GPU / hip-python here."""


_hip = None
_STREAM_NON_BLOCKING = 1          # hipStreamNonBlocking


def hip_api():
    """The hip-python module (`hip.hip`), imported on first use."""
    global _hip
    if _hip is None:
        try:
            from hip import hip as h
        except (ImportError, OSError) as e:
            raise HipUnavailable(f"hip-python is not installed or not loadable ({_first_line(e)}); install "
                                 f"jitkern[hip]") from None
        _hip = h
    return _hip


def _text(v) -> str:
    v = v[0] if isinstance(v, tuple) and len(v) == 1 else v
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def check(res, call: str):
    """hip-python returns (hipError_t, *values): raise on an error, else return the values."""
    err = res[0]
    if int(err) != 0:
        h = hip_api()
        try:
            detail = f"{_text(h.hipGetErrorName(err))}: {_text(h.hipGetErrorString(err))}"
        except Exception:          # noqa: BLE001 - the error message itself must not fail
            detail = f"error {int(err)}"
        raise HipError(f"{call} failed: {detail}")
    vals = res[1:]
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


# --------------------------------------------------------------------------------------------- device
class HipDevice(StreamDevice):
    kind = "hip"
    CALLS = {"alloc": "hipMallocAsync", "free": "hipFreeAsync", "upload": "hipMemcpyHtoDAsync",
             "download": "hipMemcpyDtoHAsync", "copy": "hipMemcpyDtoDAsync", "memset8": "hipMemsetD8Async",
             "module_load": "hipModuleLoadData", "get_function": "hipModuleGetFunction",
             "launch": "hipModuleLaunchKernel"}

    def __init__(self, ordinal: int = 0):
        h = hip_api()
        try:
            check(h.hipInit(0), "hipInit")
            count = check(h.hipGetDeviceCount(), "hipGetDeviceCount")
        except (HipError, RuntimeError, OSError) as e:
            # without ROCm the first call raises RuntimeError("failed to dlopen libamdhip64.so")
            raise HipUnavailable(f"no AMD GPU: the HIP runtime is not usable here ({_first_line(e)})") from None
        if ordinal >= count:
            raise HipUnavailable(f"AMD GPU {ordinal} asked for, {count} present")
        self.ordinal = ordinal
        check(h.hipSetDevice(ordinal), "hipSetDevice")
        props = check(h.hipGetDeviceProperties(ordinal), "hipGetDeviceProperties")
        self.arch = _text(props.gcnArchName)          # e.g. "gfx942:sramecc+:xnack-"
        self.name = _text(props.name)
        self.warp_size = int(props.warpSize)
        self.num_cus = int(props.multiProcessorCount)
        self.max_shared_bytes = int(getattr(props, "sharedMemPerBlock", 64 * 1024))
        self.stream = check(h.hipStreamCreateWithFlags(_STREAM_NON_BLOCKING), "hipStreamCreateWithFlags")
        pool = check(h.hipDeviceGetDefaultMemPool(ordinal), "hipDeviceGetDefaultMemPool")
        # keep freed blocks in the pool (the default threshold 0 hands them back to the OS at every sync)
        threshold = ctypes.c_uint64(0xFFFFFFFFFFFFFFFF)
        check(h.hipMemPoolSetAttribute(pool, h.hipMemPoolAttr.hipMemPoolAttrReleaseThreshold,
                                       ctypes.addressof(threshold)), "hipMemPoolSetAttribute(release threshold)")
        self._init_modules()

    @property
    def target_name(self) -> str:
        """The jitkern target of this GPU: the gfx name without its feature suffixes."""
        return self.arch.split(":")[0]

    def target(self):
        from targets import get_target
        from targets.base import UnknownTargetError
        try:
            t = get_target(self.target_name)
        except UnknownTargetError:
            t = None
        if t is None or not t.is_hip:
            raise HipUnavailable(f"{self.name} is {self.arch}, which jitkern has no target for "
                                 f"(gfx90a, gfx942 and gfx1100 exist)")
        return t

    def activate(self) -> None:
        check(hip_api().hipSetDevice(self.ordinal), "hipSetDevice")

    def synchronize(self) -> None:
        check(hip_api().hipStreamSynchronize(self.stream), "hipStreamSynchronize")

    # memory, modules and launches: StreamDevice (runtime/device.py) with HIP's calls
    def api(self):
        return hip_api()

    def check(self, res, call: str):
        return check(res, call)

    def _check_shared(self, symbol: str, shared_bytes: int) -> None:
        """LDS needs no opt-in on AMD (a workgroup may use all of it), but more than the device has fails every
        launch: refused here with the numbers."""
        if shared_bytes > self.max_shared_bytes:
            raise HipError(f"kernel {symbol} needs {shared_bytes} bytes of LDS, {self.name} has "
                           f"{self.max_shared_bytes} per workgroup: use smaller tiles")

    def load_kernel(self, artifacts: dict, symbol: str, meta: dict) -> LoadedKernel:
        return load_kernel(artifacts, symbol, meta, self)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


_devices: dict = {}
_dev_lock = threading.Lock()


def get_device(ordinal: int = 0) -> HipDevice:
    d = _devices.get(ordinal)
    if d is None:
        with _dev_lock:
            d = _devices.get(ordinal)
            if d is None:
                d = _devices[ordinal] = HipDevice(ordinal)
    return d


def is_available() -> bool:
    """True when hip-python is installed and an AMD GPU answers (never raises)."""
    try:
        get_device(0)
        return True
    except Exception:       # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------- arrays
def to_device(x, dtype=None, device: HipDevice | None = None):
    """Uploads a numpy array to the AMD GPU (a DeviceArray on a HipDevice)."""
    return DeviceArray.from_numpy(np.asarray(x), dtype, device or get_device())


def empty(shape, dtype, device: HipDevice | None = None):
    return DeviceArray.empty(shape, dtype, device or get_device())


def zeros(shape, dtype, device: HipDevice | None = None):
    return DeviceArray.zeros(shape, dtype, device or get_device())


# --------------------------------------------------------------------------------------- kernels
def load_kernel(artifacts: dict, symbol: str, meta: dict, device: HipDevice | None = None) -> LoadedKernel:
    device = device or get_device()
    image = artifacts.get("kernel.hsaco")
    if image is None:
        raise HipError(f"kernel {symbol}: the cache entry has no code object (kernel.hsaco)")
    mod, fn = device.load_function(image, symbol, meta.get("shared_bytes", 0))
    return LoadedKernel(mod, fn, meta["num_threads"], meta.get("shared_bytes", 0))


class HipGraph(StreamGraph):
    """Launches recorded by HIP stream capture; `replay()` runs them as one graph launch."""

    def _begin(self) -> None:
        h = hip_api()
        check(h.hipStreamBeginCapture(self.device.stream, h.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal),
              "hipStreamBeginCapture")

    def _end(self) -> tuple:
        h = hip_api()
        graph = check(h.hipStreamEndCapture(self.device.stream), "hipStreamEndCapture")
        out = check(h.hipGraphInstantiate(graph, 0), "hipGraphInstantiate")
        return graph, (out[0] if isinstance(out, tuple) else out)     # (exec, error node, log) in hip-python

    def _replay(self) -> None:
        if self.exec is None:
            raise HipError("replay() of a graph whose capture has not ended")
        check(hip_api().hipGraphLaunch(self.exec, self.device.stream), "hipGraphLaunch")


_capture = threading.local()


@contextmanager
def capture(device: HipDevice | None = None):
    """Records the HIP launches of this thread into a HipGraph (ended and instantiated on exit)."""
    g = HipGraph(device or get_device())
    if getattr(_capture, "graph", None) is not None:
        raise HipError("hip.capture() is already active on this thread")
    g.begin()
    _capture.graph = g
    try:
        yield g
    finally:
        _capture.graph = None
        g.end()


def launch(kernel, grid, *args, target=None, **kwargs):
    """Runs `kernel` over `grid` on the AMD GPU with DeviceArray / scalar arguments; returns the
    CompiledKernel. The target defaults to the device's (gfx942 on an MI300). `kernel[grid](...)` with a
    DeviceArray made here comes the same way (launch.py)."""
    return launch_args(kernel, grid, args, kwargs, target or get_device().target())


def _launch_staged(kernel, grid, args, kwargs, target, jk_graph):
    """numpy arguments: copied in whole, the kernel runs, copied back (device.py run_staged). Not inside a
    capture: a replay would not copy anything."""
    if jk_graph is not None or getattr(_capture, "graph", None) is not None:
        raise HipError(f"{kernel.__name__}: numpy arguments cannot be captured (a staged copy per launch is "
                       f"not replayable); upload them with jitkern.runtime.hip.to_device")
    return run_staged(get_device(), args, lambda dargs: launch_args(kernel, grid, dargs, kwargs, target),
                      what=f"{kernel.__name__}: an AMD GPU launch", error=HipError)


def launch_args(kernel, grid, args, kwargs, target, jk_graph=None):
    """One launch on the AMD GPU. `jk_graph`: the `jk.capture()` graph active on this thread, if any: its
    launches go into one HipGraph (stream capture starts at the first, capture's exit ends it; the graph's
    `cuda` slot holds it, as for a CUDA graph, so `Graph.replay()` replays it)."""
    if has_host_arrays(args):
        return _launch_staged(kernel, grid, args, kwargs, target, jk_graph)
    dev = get_device()
    ck, values, g = kernel.resolve_launch(grid, args, kwargs, target)
    if g is None:
        return ck
    slots = pack_slots(values)
    graph = getattr(_capture, "graph", None)
    if graph is None and jk_graph is not None:
        if jk_graph.cuda is None:
            jk_graph.cuda = HipGraph(dev)
            jk_graph.cuda.begin()
        elif not isinstance(jk_graph.cuda, HipGraph):
            raise HipError("one jk.capture() cannot record both CUDA and AMD GPU launches")
        graph = jk_graph.cuda
    if graph is not None:
        graph.nodes += 1
        graph.keep(values)
    lk = ck.loaded
    dev.launch(lk.fn, g, lk.num_threads, lk.shared_bytes, slots)
    return ck


def main() -> int:
    try:
        d = get_device()
        print(f"{d.name} ({d.arch}): jitkern target {d.target().name}, wave{d.warp_size}, {d.num_cus} CUs")
        return 0
    except HipError as e:
        print(f"jitkern: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
