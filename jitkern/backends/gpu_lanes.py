"""Lane expressions of the GPU lowering: the lane id as a Python value whose operators emit IR, so that one
register-layout function (GpuHooks.mma_layout, ldmatrix_lanes) gives both the index maps the lowering emits and
the ones tests model with numpy lanes. Used by backends/gpu.py and its fragment mixin (gpu_fragments.py)."""
from __future__ import annotations


class _LaneExpr:
    """An i32 of the lowering plus a constant (what GpuHooks.mma_layout computes with): shifts, masks,
    products and quotients emit IR; adding a constant stays symbolic, so registers whose coordinates differ
    by a constant share one base value."""

    def __init__(self, low, ref: str, off: int = 0):
        self.low, self.ref, self.off = low, ref, off

    def value(self) -> str:
        if not self.off:
            return self.ref
        return self.low.val(f"add i32 {self.ref}, {self.off}", "i32", 0).ref

    def __add__(self, c):
        if not isinstance(c, int):
            return NotImplemented
        return _LaneExpr(self.low, self.ref, self.off + c)

    __radd__ = __add__

    def _op(self, instr, c):
        if not isinstance(c, int):
            return NotImplemented
        return _LaneExpr(self.low, self.low.val(f"{instr} i32 {self.value()}, {c}", "i32", 0).ref)

    def __rshift__(self, c):
        return self._op("lshr", c)

    def __lshift__(self, c):
        return self._op("shl", c)

    def __and__(self, c):
        return self._op("and", c)

    def __mul__(self, c):
        return self._op("mul", c)

    def __floordiv__(self, c):
        return self._op("udiv", c)

    def __mod__(self, c):
        return self._op("urem", c)


def _sym(x):
    """(symbolic ref or None, constant) of a layout coordinate (a _LaneExpr or an int)."""
    return (x.ref, x.off) if isinstance(x, _LaneExpr) else (None, int(x))
