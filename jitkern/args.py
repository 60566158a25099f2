"""Kernel arguments: how host values (numpy arrays, device arrays, Pointers, ints, floats) become kernel parameter
types and specialisation facts, and the launch options a launch may carry. Below the kernel objects (jit.py),
the compiler and the runtimes, which all read them."""
from __future__ import annotations

import numpy as np

from . import ir

_NP_TO_DTYPE = {
    np.dtype(np.float32): ir.f32, np.dtype(np.float64): ir.f64, np.dtype(np.float16): ir.f16,
    np.dtype(np.int8): ir.i8, np.dtype(np.uint8): ir.u8, np.dtype(np.int16): ir.i16, np.dtype(np.uint16): ir.u16,
    np.dtype(np.int32): ir.i32, np.dtype(np.uint32): ir.u32, np.dtype(np.int64): ir.i64,
    np.dtype(np.bool_): ir.u8,
}


# Keyword arguments of a launch that configure it rather than the kernel (GPU targets read them; the CPU
# ignores them): threads per program = num_warps * warp size; pipeline depth for async copies; maxnreg: a cap
# on registers per thread (NVIDIA: PTX .maxnreg; a tuning knob like Triton's, e.g. 168 = 3 CTAs of 128
# threads per SM; ptxas spills what does not fit); wgmma: a kernel's eligible dots as warpgroup MMAs (sm_90a);
# tma: its `jk.tma` tiles copied by the tensor memory accelerator where the K-loop staging allows (sm_90+);
# warp_rows: its MMA tiles dealt so each warp owns whole rows, whose reductions then run on lane shuffles.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "wgmma", "tma", "warp_rows")


# Argument specialisation on GPUs (like Triton's): a pointer 16-byte aligned, an integer divisible by 16.
# The facts go into the specialisation (and so the cache key) under this constexpr name; the GPU lowering's
# axis analysis (jitkern/analysis.py) turns them into aligned vector accesses.
SPEC_HINTS = "__spec_hints"


def spec_hints(params, values, skip=frozenset()) -> tuple:
    out = []
    for (name, t), v in zip(params, values):
        if name in skip:
            continue
        if t.is_ptr:
            # device arrays; host arrays and Pointers too (`jitkern build` traces the engine on numpy arrays:
            # their views sit at the same offsets as the device buffers', which the allocator aligns)
            addr = v.ptr if _is_device_array(v) else v.address if isinstance(v, Pointer) else \
                v.ctypes.data if isinstance(v, np.ndarray) else 1
            if addr % 16 == 0:
                out.append((name, 16))
        elif not t.is_ptr and t.elem.is_int and not isinstance(v, (bool, np.bool_)) and int(v) % 16 == 0:
            out.append((name, 16))
    return tuple(out)


class Pointer:
    """A typed raw pointer argument (e.g. an array's bytes reinterpreted as bf16, or an offset view)."""

    __slots__ = ("address", "dtype", "keepalive")

    def __init__(self, address: int, dtype: ir.DType, keepalive=None):
        self.address = int(address)
        self.dtype = dtype
        self.keepalive = keepalive


def as_pointer(arr: np.ndarray, dtype: ir.DType | str) -> Pointer:
    """View an array's memory as another element type (e.g. uint16 storage as bf16, bytes as u8).
    A GPU DeviceArray gives the same device array with that kernel element type (launches stay on the GPU)."""
    if isinstance(dtype, str):
        dtype = ir.DTYPES[dtype]
    if _is_device_array(arr):
        return arr.with_elem(dtype)
    return Pointer(arr.ctypes.data, dtype, arr)


def _is_device_array(v) -> bool:
    return type(v).__name__ == "DeviceArray" and hasattr(v, "ptr")


def arg_type(name: str, v) -> ir.TileType:
    if _is_device_array(v):
        return ir.TileType(ir.PtrType(v.elem))
    if isinstance(v, np.ndarray):
        d = _NP_TO_DTYPE.get(v.dtype)
        if d is None:
            raise TypeError(f"argument '{name}': arrays of dtype {v.dtype} are not supported")
        return ir.TileType(ir.PtrType(d))
    if isinstance(v, Pointer):
        return ir.TileType(ir.PtrType(v.dtype))
    if isinstance(v, (bool, np.bool_)):
        return ir.TileType(ir.i32)
    if isinstance(v, (int, np.integer)):
        return ir.TileType(ir.i32 if -2**31 <= int(v) < 2**31 else ir.i64)
    if isinstance(v, (float, np.floating)):
        return ir.TileType(ir.f32)
    raise TypeError(f"argument '{name}': cannot pass {type(v).__name__} to a kernel "
                    f"(numpy arrays, jitkern.Pointer, int and float are accepted)")
