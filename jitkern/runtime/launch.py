"""Launching a kernel: specialise, fetch the compiled code, pack the argument block, run the grid."""
from __future__ import annotations

import numpy as np

from ..jit import Pointer, arg_type

_I32 = (-2**31, 2**31)


def pack_args(grid3, values) -> np.ndarray:
    """The argument block of the CPU ABI: grid sizes, then one 8-byte slot per run-time parameter."""
    block = np.empty(3 + len(values), dtype=np.int64)
    block[0], block[1], block[2] = grid3
    fview = block.view(np.float64)
    for i, v in enumerate(values):
        if isinstance(v, np.ndarray):
            block[3 + i] = v.ctypes.data
        elif isinstance(v, Pointer):
            block[3 + i] = v.address
        elif isinstance(v, (float, np.floating)):
            fview[3 + i] = float(v)
        else:
            block[3 + i] = int(v)
    return block


def normalize_grid(grid, meta) -> tuple:
    if callable(grid):
        grid = grid(meta)
    if isinstance(grid, int):
        grid = (grid,)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if len(grid) != 3 or any(g < 0 for g in grid):
        raise ValueError(f"bad grid {grid}")
    return grid


def launch(kernel, grid, args, kwargs, target=None):
    from ..compiler import compile_kernel
    from .cpu_pool import get_pool
    params, consts, values = kernel.specialize(args, kwargs)
    ck = compile_kernel(kernel, params, consts, target)
    g = normalize_grid(grid, consts)
    n = g[0] * g[1] * g[2]
    block = pack_args(g, values)
    if n:
        get_pool().launch(ck.address, block.ctypes.data, n)
    return ck
