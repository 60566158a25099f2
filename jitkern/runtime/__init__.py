"""Run-time support for compiled kernels (CPU thread pool)."""
from .cpu_pool import CpuPool, PoolError, NativeLibrary, get_pool, physical_core_count

__all__ = ["CpuPool", "PoolError", "NativeLibrary", "get_pool", "physical_core_count"]
