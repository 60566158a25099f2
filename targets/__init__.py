"""Target descriptions and host detection.

One `Target` record per name (CPU ISA tiers, CUDA sm, AMD gfx, Vulkan). Kernels see the target at
trace time (`target.is_cpu`, `target.has("avx512f")`, `target.vector_bits`), so a per-target branch in a
kernel costs nothing at run time.
"""
from .base import Target, UnknownTargetError, TargetUnavailableError
from .registry import all_targets, get_target, target_names
from .tuning import Tuning, tuned
from .cpu import host_cpu_features, select_cpu_tier, cpu_tier_names, check_runnable

__all__ = [
    "Target", "UnknownTargetError", "TargetUnavailableError", "all_targets", "get_target", "target_names",
    "host_cpu_features", "select_cpu_tier", "cpu_tier_names", "check_runnable",
    "Tuning", "tuned",
]
