"""Axis information: an IR analysis of integer and pointer tiles that every backend can use.

For each integer (or pointer, or mask) value and each axis of its tile, three facts hold for every run of
elements along that axis (Triton's AxisInfo has the same shape; these are our own rules):
- contig[d]: the values form runs of `contig[d]` consecutive integers (x, x+1, ...), runs aligned to
  multiples of contig[d] in the coordinate;
- div[d]: the first value of each such run is a multiple of div[d] (a power of two; pointers in bytes);
- const[d]: the values are equal over aligned runs of const[d] elements.
Scalars are described as one-element rank-0 facts (div only). Kernel parameters contribute through the
launch's argument specialisation: a pointer aligned to 16 bytes (div 16), an integer divisible by 16.

A backend asks `info(value)` and derives from it what it may do: a load whose pointer has contig >= V and
div >= V * itemsize along the last axis, and a mask constant over runs of V, can read V elements with one
aligned vector access (the GPU lowering does this for 16-byte accesses).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from . import ir

_BIG = 1 << 30        # "divisible by anything we care about" (zero, or a multiple of a large power of two)


def _pow2_div(v: int) -> int:
    """Largest power of two dividing v (capped; 0 counts as divisible by everything)."""
    v = abs(int(v))
    if v == 0:
        return _BIG
    return min(v & -v, _BIG)


@dataclass(frozen=True)
class AxisInfo:
    contig: tuple
    div: tuple
    const: tuple
    scalar_div: int = 1          # for rank-0 values

    @staticmethod
    def unknown(shape) -> "AxisInfo":
        n = len(shape)
        return AxisInfo((1,) * n, (1,) * n, (1,) * n, 1)

    @staticmethod
    def uniform(shape, div: int) -> "AxisInfo":
        """Every element equal, a multiple of `div`."""
        return AxisInfo((1,) * len(shape), (div,) * len(shape), tuple(shape), div)


def _gcd_t(a, b):
    return tuple(gcd(x, y) for x, y in zip(a, b))


class AxisAnalysis:
    """Runs once over a function; `info(v)` answers for any value (unknown for non-integers)."""

    def __init__(self, fn: ir.Function, hints: dict | None = None):
        """hints: param name -> divisibility (pointers: byte alignment; integers: a divisor)."""
        self.facts: dict[int, AxisInfo] = {}
        hints = hints or {}
        for p in fn.params:
            self.facts[p.value.id] = AxisInfo.uniform((), hints.get(p.name, 1))
        self._block(fn.body)

    def info(self, v: ir.Value) -> AxisInfo:
        f = self.facts.get(v.id)
        return f if f is not None else AxisInfo.unknown(v.type.shape)

    # --------------------------------------------------------------------------------- rules
    def _block(self, block: ir.Block) -> None:
        for op in block.ops:
            for r in op.regions:
                for a in r.args:
                    self.facts[a.id] = AxisInfo.unknown(a.type.shape)     # loop-carried: nothing known
            if op.name == "for" and op.regions and op.regions[0].args:
                # the induction variable lb + i * step is a multiple of gcd(lb, step)
                lb, step = self.info(op.operands[0]), self.info(op.operands[2])
                self.facts[op.regions[0].args[0].id] = AxisInfo.uniform((), gcd(lb.scalar_div, step.scalar_div))
            if op.regions:
                for r in op.regions:
                    self._block(r)
            for res, f in zip(op.results, self._rule(op)):
                if f is not None:
                    self.facts[res.id] = f

    def _rule(self, op: ir.Op):
        name = op.name
        shape = op.results[0].type.shape if op.results else ()
        ins = [self.info(o) if o is not None else None for o in op.operands]
        if name == "const":
            v = op.attrs["value"]
            if isinstance(v, (int, bool)) or (isinstance(v, float) and v.is_integer()):
                return [AxisInfo.uniform(shape, _pow2_div(int(v)))]
            return [None]
        if name == "arange":
            n = op.attrs["end"] - op.attrs["start"]
            return [AxisInfo((n,), (_pow2_div(op.attrs["start"]),), (1,), 1)]
        if name == "splat":
            return [AxisInfo.uniform(shape, ins[0].scalar_div)]
        if name == "broadcast":
            src = op.operands[0].type.shape
            pad = len(shape) - len(src)
            a = ins[0]
            if not src:
                return [AxisInfo.uniform(shape, a.scalar_div)]
            elem_div = _elem_div(a)          # what every single element is divisible by
            c, d, k = [], [], []
            for ax, size in enumerate(shape):
                if ax < pad or src[ax - pad] == 1:
                    c.append(1)
                    d.append(elem_div)
                    k.append(size)
                else:
                    c.append(a.contig[ax - pad])
                    d.append(a.div[ax - pad])
                    k.append(a.const[ax - pad])
            return [AxisInfo(tuple(c), tuple(d), tuple(k), a.scalar_div)]
        if name == "reshape":
            src = op.operands[0].type.shape
            a = ins[0]
            kept = [i for i, s in enumerate(src) if s != 1]
            if [src[i] for i in kept] != [s for s in shape if s != 1]:
                return [None]
            it = iter(kept)
            c, d, k = [], [], []
            for s in shape:
                if s == 1:
                    c.append(1), d.append(_elem_div(a)), k.append(1)
                else:
                    i = next(it)
                    c.append(a.contig[i]), d.append(a.div[i]), k.append(a.const[i])
            sd = a.scalar_div if not src else (a.div[0] if a.div else 1)
            return [AxisInfo(tuple(c), tuple(d), tuple(k), sd)]
        if name == "trans":
            a = ins[0]
            perm = op.attrs.get("perm", (1, 0))
            return [AxisInfo(tuple(a.contig[p] for p in perm), tuple(a.div[p] for p in perm),
                             tuple(a.const[p] for p in perm), a.scalar_div)]
        if name == "cast":
            src, dst = op.operands[0].type.elem, op.attrs["to"]
            if isinstance(src, ir.DType) and src.is_int and dst.is_int and not op.attrs.get("bitcast") \
                    and (dst.bits >= src.bits):
                return [ins[0]]
            return [None]
        if name == "addptr":
            p, o = ins
            esize = op.operands[0].type.elem.elem.itemsize
            if not shape:
                return [AxisInfo.uniform((), gcd(p.scalar_div, min(o.scalar_div * esize, _BIG)))]
            if not op.operands[0].type.shape:         # scalar base pointer + offset tile
                p = AxisInfo.uniform(shape, p.scalar_div)
            # pointer facts are kept in bytes for div, in elements for contig/const
            o_bytes = AxisInfo(o.contig, tuple(min(d * esize, _BIG) for d in o.div), o.const, 1)
            return [_add(p, o_bytes, shape, scale=esize)]
        if name == "binary":
            return [self._binary(op.attrs["op"], ins[0], ins[1], shape)]
        if name == "cmp":
            a, b = ins
            if not shape:
                return [AxisInfo.uniform((), 1)]
            # (contiguous run) < (value constant over the run, divisible by g): the answer is constant over
            # aligned runs of gcd(contig, div(a), div(b)) elements
            k = []
            for ax in range(len(shape)):
                kk = gcd(a.const[ax], b.const[ax])
                if op.attrs["op"] in ("lt", "le", "gt", "ge") and b.const[ax] == shape[ax]:
                    kk = max(kk, gcd(a.contig[ax], gcd(a.div[ax], b.div[ax])))
                if op.attrs["op"] in ("lt", "le", "gt", "ge") and a.const[ax] == shape[ax]:
                    kk = max(kk, gcd(b.contig[ax], gcd(a.div[ax], b.div[ax])))
                k.append(min(kk, shape[ax]))
            n = len(shape)
            return [AxisInfo((1,) * n, (1,) * n, tuple(k), 1)]
        if name == "select":
            c, a, b = ins
            if not shape:
                return [AxisInfo.uniform((), gcd(a.scalar_div, b.scalar_div))]
            k = _gcd_t(c.const, _gcd_t(a.const, b.const))
            n = len(shape)
            return [AxisInfo((1,) * n, _gcd_t(a.div, b.div), k, 1)]
        if name == "program_id" or name == "num_programs":
            return [AxisInfo.uniform((), 1)]
        if name == "load":
            return [AxisInfo.unknown(shape)]
        return [None] * len(op.results)

    def _binary(self, k: str, a: AxisInfo, b: AxisInfo, shape) -> AxisInfo:
        n = len(shape)
        if not shape:
            if k in ("add", "sub"):
                return AxisInfo.uniform((), gcd(a.scalar_div, b.scalar_div))
            if k == "mul":
                return AxisInfo.uniform((), min(a.scalar_div * b.scalar_div, _BIG))
            return AxisInfo.uniform((), 1)
        const = _gcd_t(a.const, b.const)
        if k == "add":
            return _add(a, b, shape)
        if k == "sub":
            contig = tuple(gcd(ac, bk) for ac, bk in zip(a.contig, b.const))
            div = tuple(gcd(_sub_div(a, ax, r), _sub_div(b, ax, r)) for ax, r in enumerate(contig))
            return AxisInfo(contig, div, const, 1)
        if k == "mul":
            # contiguity does not survive a product (except by 1, ignored); divisibility multiplies
            div = tuple(min(_sub_div(a, ax, 1) * _sub_div(b, ax, 1), _BIG) for ax in range(n))
            return AxisInfo((1,) * n, div, const, 1)
        return AxisInfo((1,) * n, (1,) * n, const, 1)


def _elem_div(x: AxisInfo) -> int:
    """A divisor of every element (not just of run starts)."""
    if not x.div:
        return x.scalar_div
    g = 0
    for ax in range(len(x.div)):
        g = gcd(g, _sub_div(x, ax, 1))
    return g or 1


def _sub_div(x: AxisInfo, ax: int, r: int, scale: int = 1) -> int:
    """Divisibility of the first value of each aligned run of r elements along `ax` (r divides x's runs):
    a contiguous run's sub-runs start at run start + m * r (times `scale`, the element size for pointers)."""
    if x.contig[ax] == 1:
        return x.div[ax]
    return gcd(x.div[ax], min(r * scale, _BIG))


def _add(a: AxisInfo, b: AxisInfo, shape, scale: int = 1) -> AxisInfo:
    """a + b: a contiguous run plus a value constant over it stays contiguous."""
    contig = tuple(max(gcd(ac, bk), gcd(ak, bc)) for ac, ak, bc, bk in zip(a.contig, a.const, b.contig, b.const))
    div = tuple(gcd(_sub_div(a, ax, r, scale), _sub_div(b, ax, r, scale)) for ax, r in enumerate(contig))
    return AxisInfo(contig, div, _gcd_t(a.const, b.const), 1)
