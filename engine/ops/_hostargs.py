"""Host-side argument handling shared by the basic op wrappers (norm, rope, activation, embedding, softmax,
sampling): target resolution, the bf16 storage convention, row strides of 2-D views, launching.

Conventions every wrapper here follows:
- float arrays are float32 or float16; a **uint16 array means bf16 storage** (numpy has no bf16 dtype);
- a "row-strided view" is an array whose last axis is contiguous (stride 1 element) while rows may be
  further apart, e.g. `qkv[:, :q_size]`; the wrappers pass the row stride to the kernel;
- `target=None` means the runtime tier (JITKERN_CPU_TIER or the best runnable); a tier name or a
  `targets.Target` picks another one.
"""
from __future__ import annotations

import numpy as np

from jitkern.jit import as_pointer
from jitkern.runtime.launch import launch

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16))


def is_device(a) -> bool:
    """A GPU DeviceArray (jitkern.runtime.device), checked without importing a GPU runtime."""
    return type(a).__name__ == "DeviceArray"


def is_array(a) -> bool:
    """A numpy array or a GPU DeviceArray (both have dtype, shape, strides in bytes, itemsize, ndim)."""
    return isinstance(a, np.ndarray) or is_device(a)


def empty_like_dev(ref, shape, dtype):
    """An uninitialised array on the device `ref` lives on: a DeviceArray there, else numpy."""
    if is_device(ref):
        from jitkern.runtime.device import DeviceArray
        return DeviceArray.empty(shape, dtype, ref.device)
    return np.empty(shape, dtype)


_scratch: dict = {}


def device_scratch(ref, role: str, shape, dtype):
    """A wrapper's internal temporary on `ref`'s device (e.g. matmul_q's quantised activations), reused
    across calls: stable addresses (what recorded CUDA graphs point at) and no allocation once the sizes
    were seen (stream capture must not allocate). Safe because every launch and copy goes to the device's
    one stream in order; a grown buffer stays alive in the graphs that recorded the old one."""
    from jitkern.runtime.device import DeviceArray
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    key = (id(ref.device), role, dtype.str)
    buf = _scratch.get(key)
    if buf is None or buf.size < n or buf.device is not ref.device:
        buf = _scratch[key] = DeviceArray.empty(max(n, 1), dtype, ref.device)
    return buf[:n].reshape(shape)


def host_copy(a, host=None):
    """The host values of a small array the wrapper must read (lengths, ids): `host` when the caller has a
    host copy, the array itself when it is numpy, else a download (a synchronising copy)."""
    if host is not None:
        return host
    return a.numpy() if is_device(a) else a


def resolve_target(target, *arrays):
    """`target` as a Target; None stays None, except that device arrays among `arrays` pick their GPU."""
    if target is None:
        for a in arrays:
            if is_device(a):
                return a.device.target()
        return None
    if isinstance(target, str):
        from targets import get_target
        return get_target(target)
    return target


def fptr(a: np.ndarray, what: str):
    """The kernel argument for a float array: uint16 storage is passed as bf16."""
    if not is_array(a):
        raise TypeError(f"{what}: expected a numpy array, got {type(a).__name__}")
    if a.dtype == np.uint16:
        return as_pointer(a, "bf16")
    if a.dtype not in (np.float32, np.float16):
        raise TypeError(f"{what}: dtype {a.dtype} is not supported (float32, float16, or uint16 holding bf16)")
    return a


def row_stride(a: np.ndarray, what: str, ndim: int = 2) -> int:
    """Row stride in elements of a 2-D array whose last axis is contiguous."""
    if a.ndim != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D array, got shape {a.shape}")
    it = a.itemsize
    if a.shape[-1] > 1 and a.strides[-1] != it:
        raise ValueError(f"{what}: the last axis must be contiguous (strides {a.strides}, itemsize {it})")
    if any(s % it for s in a.strides):
        raise ValueError(f"{what}: strides {a.strides} are not multiples of the item size {it}")
    return a.strides[0] // it if a.shape[0] > 1 else a.shape[-1]


def elem_strides(a: np.ndarray, what: str) -> tuple:
    """All strides in elements; the last axis must be contiguous."""
    it = a.itemsize
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != it:
        raise ValueError(f"{what}: the last axis must be contiguous (strides {a.strides}, itemsize {it})")
    if any(s % it for s in a.strides):
        raise ValueError(f"{what}: strides {a.strides} are not multiples of the item size {it}")
    return tuple(s // it for s in a.strides)


def check_shape(a: np.ndarray, shape: tuple, what: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def check_dtype(a: np.ndarray, dtype, what: str) -> None:
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{what}: expected dtype {np.dtype(dtype)}, got {a.dtype}")


def pow2_at_least(n: int, lo: int = 1) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def launch_target(target):
    """The Target a launch compiles for (the runtime tier when `target` is None)."""
    t = resolve_target(target)
    if t is None:
        from jitkern.runtime.cpu import runtime_target
        t = runtime_target()
    return t


def narrow_tier(target) -> bool:
    """Tiers without native masked vector loads/stores (x86 below AVX, portable, ARM): LLVM expands masked
    accesses lane by lane there and compile time grows superlinearly with the tile width (an rms_norm row
    tile of 256 lanes took ~27 s to compile on `portable`, 64 lanes < 1 s), so tiles stay <= 64 lanes."""
    t = launch_target(target)
    return not (t.is_x86 and t.has("avx"))


def has_half(*arrays) -> bool:
    """Whether any of these arrays holds 16-bit floats (float16, or uint16 = bf16)."""
    return any(is_array(a) and a.dtype.itemsize == 2 for a in arrays)


def block_for(n: int, cap: int, target=None, half: bool = False) -> int:
    """A power-of-two tile width covering `n`, at most `cap`; larger rows loop over chunks.

    Capped at 64 lanes on narrow tiers, and for tiles touching 16-bit data (`half`) below AVX-512 (no
    16-bit masked loads there either: a masked f16 row load of 1024 lanes took ~90 s to compile on avx2,
    64 lanes 0.07 s)."""
    t = launch_target(target)
    if t.fast_workgroups:
        # a GPU program is a CTA of 128+ threads: a 128-wide chunk keeps most of them idle and loops (the
        # engine's 4096-wide rms_norm took 69 us on an H200); whole rows up to 4096 are 32 lanes a thread
        return min(pow2_at_least(max(int(n), 1), 16), max(cap, GPU_BLOCK_CAP))
    if narrow_tier(target) or (half and not t.has("avx512bw")):
        cap = min(cap, 64)
    return min(pow2_at_least(max(int(n), 1), 16), cap)


GPU_BLOCK_CAP = 4096


def run(kernel, grid, args, target=None, **constexprs):
    """Launches `kernel` on `grid` (skipped when the grid is empty)."""
    if 0 in tuple(grid):
        return None
    return launch(kernel, grid, args, constexprs, target=resolve_target(target))
