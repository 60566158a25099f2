"""Lowerings and toolchains, one family object per target family (backends/base.py: the interface)."""
from __future__ import annotations

from ..errors import CompileError

# Target.backend -> the module holding that family's BACKEND object (imported on first use)
FAMILIES = {"cpu": "cpu", "cuda": "nvptx", "hip": "amdgpu", "vulkan": "spirv"}
_loaded: dict = {}


def backend_of(target):
    """The family object (backends/base.py Backend) that compiles, keys and loads kernels for `target`."""
    b = _loaded.get(target.backend)
    if b is None:
        module = FAMILIES.get(target.backend)
        if module is None:
            raise CompileError(f"no lowering for {target.backend} targets yet (target {target.name})",
                               target=target.name)
        from importlib import import_module
        b = _loaded[target.backend] = import_module(f"{__name__}.{module}").BACKEND
    return b
