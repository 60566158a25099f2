"""The target-neutral LLVM IR emitter every lowering shares (CPU tiers and the GPU tile lowering).

A tile value is one LLVM vector (`LV`: ref, element type, lanes, logical shape, optional affine form) or a
pointer tile (`PT`: scalar base + integer element offsets); a scalar is an LLVM scalar. What lives here does
not depend on how a target lays tiles out or runs programs: SSA bookkeeping and emission, constants and
lane shuffles, integer/float arithmetic, comparisons, selects and FMAs, casts and the exact f16/bf16
conversions (F16C when the target has it), the polynomial math (exp, tanh: no libm, so it runs on GPUs
too), pointer offsets, scalar loads, and structured control flow (`for`/`if` with carried values).
Lowerings subclass `LlvmEmitter` and add the layout-dependent ops: program ids, tile creation and layout
changes, tile loads/stores, reductions and the matrix ops (backends/cpu.py, backends/gpu.py).

Text is emitted directly (not through llvmlite.ir) because we need vector GEPs, masked intrinsics, string
function attributes and target intrinsics that llvmlite.ir cannot express.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Union

from .. import ir
from ..ir import DType
from ..language import CompilationError

# ---------------------------------------------------------------------------------------------- types
_ELEM = {"f64": "double", "f32": "float", "f16": "i16", "bf16": "i16", "i1": "i1", "i8": "i8", "u8": "i8",
         "i16": "i16", "u16": "i16", "i32": "i32", "u32": "i32", "i64": "i64"}
_SUFFIX = {"double": "f64", "float": "f32", "half": "f16", "i1": "i1", "i8": "i8", "i16": "i16", "i32": "i32",
           "i64": "i64", "ptr": "p0"}


def elem_ty(d: DType) -> str:
    return _ELEM[d.name]


def vty(et: str, n: int) -> str:
    return f"<{n} x {et}>" if n else et


def _flt(x: float) -> str:
    """An LLVM float literal: the exact double hex form of a value representable as f32."""
    x = struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) else x
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", x))[0]


@dataclass
class Aff:
    """base + sum(index_d * strides[d]); base and strides are ints or LLVM scalar refs (same int type)."""
    base: Union[int, str]
    strides: tuple


@dataclass
class LV:
    ref: str
    et: str          # LLVM element type
    n: int           # lanes (0 = scalar)
    shape: tuple = ()
    aff: Optional[Aff] = None

    @property
    def ty(self) -> str:
        return vty(self.et, self.n)


@dataclass
class PT:
    """A pointer tile: a scalar base pointer plus integer element offsets (None = 0)."""
    base: str
    elem: DType
    offs: Optional[LV]
    shape: tuple

    @property
    def n(self) -> int:
        return math.prod(self.shape) if self.shape else 0


def _ops_of(block: ir.Block):
    for op in block.ops:
        yield op
        for r in op.regions:
            yield from _ops_of(r)


def _prod(s) -> int:
    return math.prod(s) if s else 1


class LlvmEmitter:
    def __init__(self, fn: ir.Function, target):
        self.fn = fn
        self.target = target
        self.lines: list[str] = []
        self.decls: dict[str, str] = {}
        self.vals: dict[int, Union[LV, PT]] = {}
        self.counter = 0
        self.block = "entry"
        self.x86 = False                  # x86 intrinsics allowed (set by the CPU lowering)
        self.f16c = target.has("f16c")

    # ------------------------------------------------------------------------------------ emission
    def tmp(self, hint="t") -> str:
        self.counter += 1
        return f"%{hint}{self.counter}"

    def label(self, hint) -> str:
        self.counter += 1
        return f"{hint}{self.counter}"

    def emit(self, text: str) -> None:
        self.lines.append("  " + text)

    def start_block(self, name: str) -> None:
        self.lines.append(f"{name}:")
        self.block = name

    def val(self, expr: str, et: str, n: int, shape=(), aff=None, hint="t") -> LV:
        r = self.tmp(hint)
        self.emit(f"{r} = {expr}")
        return LV(r, et, n, tuple(shape), aff)

    def declare(self, name: str, ret: str, args: list) -> str:
        if name not in self.decls:
            self.decls[name] = f"declare {ret} @{name}({', '.join(args)})"
        return name

    def const(self, value, et: str, n: int, shape=()) -> LV:
        if et in ("float", "double"):
            lit = _flt(value) if math.isfinite(value) else ("0x7FF0000000000000" if value > 0 else
                                                            "0xFFF0000000000000" if value < 0 else
                                                            "0x7FF8000000000000")
        elif et == "i1":
            lit = "true" if value else "false"
        else:
            lit = str(int(value))
        if n == 0:
            aff = Aff(int(value), ()) if et not in ("float", "double", "i1") else None
            return LV(lit, et, 0, (), aff)
        ref = "<" + ", ".join(f"{et} {lit}" for _ in range(n)) + ">"
        aff = Aff(int(value), (0,) * len(shape)) if et not in ("float", "double", "i1") else None
        return LV(ref, et, n, tuple(shape), aff)

    def splat(self, s: LV, n: int, shape=()) -> LV:
        if n == 0:
            return s
        ins = self.val(f"insertelement <1 x {s.et}> poison, {s.et} {s.ref}, i32 0", s.et, 1)
        out = self.val(f"shufflevector <1 x {s.et}> {ins.ref}, <1 x {s.et}> poison, <{n} x i32> zeroinitializer",
                       s.et, n, shape)
        if s.aff is not None and not s.aff.strides:
            out.aff = Aff(s.aff.base, (0,) * len(shape))
        elif s.aff is None and s.et in ("i8", "i16", "i32", "i64"):
            # any integer scalar (e.g. one loaded from memory) is uniform across the tile, so offsets
            # built from it stay affine and loads through them stay vector loads, not gathers
            out.aff = Aff(s.ref, (0,) * len(shape))
        return out

    def shuffle(self, v: LV, idx: list, shape=()) -> LV:
        if v.n == 0:
            return self.splat(v, len(idx), shape)
        if len(idx) == 1 and not shape:
            return self.val(f"extractelement {v.ty} {v.ref}, i32 {idx[0]}", v.et, 0)
        mask = "<" + ", ".join(f"i32 {i}" for i in idx) + ">"
        return self.val(f"shufflevector {v.ty} {v.ref}, {v.ty} poison, <{len(idx)} x i32> {mask}", v.et, len(idx),
                        shape)

    def extract(self, v: LV, i: int) -> LV:
        return self.val(f"extractelement {v.ty} {v.ref}, i32 {i}", v.et, 0)

    def build_vector(self, scalars: list, et: str, shape) -> LV:
        n = len(scalars)
        cur = "poison"
        for i, s in enumerate(scalars):
            r = self.tmp()
            self.emit(f"{r} = insertelement <{n} x {et}> {cur}, {et} {s.ref}, i32 {i}")
            cur = r
        return LV(cur, et, n, tuple(shape))

    def concat(self, parts: list, shape) -> LV:
        """Concatenates equal-width vectors."""
        while len(parts) > 1:
            nxt = []
            for i in range(0, len(parts) - 1, 2):
                a, b = parts[i], parts[i + 1]
                idx = list(range(a.n)) + [a.n + j for j in range(b.n)]
                if a.n != b.n:
                    # shufflevector needs equal operand widths: widen the narrower one with poison lanes
                    w = max(a.n, b.n)
                    pad = lambda v: self.val(  # noqa: E731
                        f"shufflevector {v.ty} {v.ref}, {v.ty} poison, <{w} x i32> <"
                        + ", ".join(f"i32 {j}" if j < v.n else "i32 poison" for j in range(w)) + ">", v.et, w)
                    idx = list(range(a.n)) + [w + j for j in range(b.n)]
                    a, b = (pad(a) if a.n < w else a), (pad(b) if b.n < w else b)
                mask = "<" + ", ".join(f"i32 {j}" for j in idx) + ">"
                nxt.append(self.val(f"shufflevector {a.ty} {a.ref}, {b.ty} {b.ref}, <{len(idx)} x i32> {mask}",
                                    a.et, len(idx)))
            if len(parts) % 2:
                nxt.append(parts[-1])
            parts = nxt
        out = parts[0]
        return LV(out.ref, out.et, out.n, tuple(shape), None)

    # ----------------------------------------------------------------------------------------- ops
    def get(self, v: ir.Value):
        return self.vals[v.id]

    def lower_block(self, block: ir.Block):
        for op in block.ops:
            if op.name == "yield":
                return self.yield_values(op)
            try:
                res = self.lower_op(op)
            except CompilationError:
                raise
            except KeyError as e:
                raise CompilationError(f"internal lowering error for {op.name}: missing value {e}", op.loc) from None
            if op.results:
                if not isinstance(res, (list, tuple)):
                    res = [res]
                for r, lv in zip(op.results, res):
                    self.vals[r.id] = lv
        return []

    def yield_values(self, op) -> list:
        """The values a region's yield hands back (a lowering may keep some in a layout of its own)."""
        return [self.get(o) for o in op.operands]

    def lower_op(self, op):
        return getattr(self, "op_" + op.name)(op)

    # ---------------------------------------------------------------------------------- arithmetic
    def _aff_combine(self, a: Optional[Aff], b: Optional[Aff], et: str, sign: int) -> Optional[Aff]:
        if a is None or b is None or len(a.strides) != len(b.strides):
            return None

        def comb(x, y):
            if isinstance(x, int) and isinstance(y, int):
                return x + sign * y
            xs = x if isinstance(x, str) else str(x)
            ys = y if isinstance(y, str) else str(y)
            if y == 0:
                return x
            if x == 0 and sign > 0:
                return y
            return self.val(f"{'add' if sign > 0 else 'sub'} {et} {xs}, {ys}", et, 0).ref
        return Aff(comb(a.base, b.base), tuple(comb(p, q) for p, q in zip(a.strides, b.strides)))

    def _aff_scale(self, a: Optional[Aff], b: Optional[Aff], et: str) -> Optional[Aff]:
        """a * b where b is uniform (all strides 0)."""
        if a is None or b is None or len(a.strides) != len(b.strides) or any(s != 0 for s in b.strides):
            return None
        u = b.base

        def mul(x):
            if isinstance(x, int) and isinstance(u, int):
                return x * u
            if x == 0:
                return 0
            if x == 1:
                return u
            return self.val(f"mul {et} {x}, {u}", et, 0).ref
        return Aff(mul(a.base), tuple(mul(s) for s in a.strides))

    def _uniform_scalar(self, v: LV) -> Optional[LV]:
        if v.aff is not None and all(s == 0 for s in v.aff.strides):
            b = v.aff.base
            return LV(str(b) if isinstance(b, int) else b, v.et, 0)
        return None

    def op_binary(self, op):
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        d = op.operands[0].type.elem
        k = op.attrs["op"]
        if d in (ir.f16, ir.bf16):
            r = self._binary_f(k, self.to_f32(a, d), self.to_f32(b, d), "float")
            return self.from_f32(r, d)
        if d.is_float:
            return self._binary_f(k, a, b, elem_ty(d))
        return self._binary_i(k, a, b, d)

    def _binary_f(self, k, a: LV, b: LV, et) -> LV:
        ty = a.ty
        fm = "fast" if False else ""
        if k in ("add", "sub", "mul", "div", "mod"):
            instr = {"add": "fadd", "sub": "fsub", "mul": "fmul", "div": "fdiv", "mod": "frem"}[k]
            return self.val(f"{instr} {fm} {ty} {a.ref}, {b.ref}".replace("  ", " "), a.et, a.n, a.shape)
        if k in ("min", "max"):
            name = f"llvm.{'minnum' if k == 'min' else 'maxnum'}.{self.sfx(a)}"
            self.declare(name, ty, [ty, ty])
            return self.val(f"call {ty} @{name}({ty} {a.ref}, {ty} {b.ref})", a.et, a.n, a.shape)
        if k == "floordiv":
            q = self.val(f"fdiv {ty} {a.ref}, {b.ref}", a.et, a.n, a.shape)
            return self.math_call("floor", q)
        raise CompilationError(f"operator {k} is not defined for floats")

    def _binary_i(self, k, a: LV, b: LV, d: DType) -> LV:
        ty, et = a.ty, a.et
        s = d.is_signed
        simple = {"add": "add", "sub": "sub", "mul": "mul", "and": "and", "or": "or", "xor": "xor", "shl": "shl",
                  "shr": "ashr" if s else "lshr", "floordiv": "sdiv" if s else "udiv", "mod": "srem" if s else "urem"}
        if k in simple:
            r = self.val(f"{simple[k]} {ty} {a.ref}, {b.ref}", et, a.n, a.shape)
            if k in ("add", "sub"):
                r.aff = self._aff_combine(a.aff, b.aff, et, 1 if k == "add" else -1)
            elif k == "mul":
                r.aff = self._aff_scale(a.aff, b.aff, et) or self._aff_scale(b.aff, a.aff, et)
            elif k in ("floordiv", "shr", "mod", "and") and a.aff is not None and b.aff is not None \
                    and all(x == 0 for x in a.aff.strides) and all(x == 0 for x in b.aff.strides):
                r.aff = Aff(r.ref if a.n == 0 else self._uniform_ref(r), a.aff.strides)
            return r
        if k in ("min", "max"):
            name = f"llvm.{'s' if s else 'u'}{k}.{self.sfx(a)}"
            self.declare(name, ty, [ty, ty])
            return self.val(f"call {ty} @{name}({ty} {a.ref}, {ty} {b.ref})", et, a.n, a.shape)
        raise CompilationError(f"operator {k} is not defined for integers")

    def _uniform_ref(self, v: LV) -> str:
        return self.extract(v, 0).ref

    def sfx(self, v: LV) -> str:
        s = _SUFFIX[v.et]
        return f"v{v.n}{s}" if v.n else s

    def op_cmp(self, op):
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        d = op.operands[0].type.elem
        k = op.attrs["op"]
        if isinstance(a, PT) or isinstance(b, PT):
            raise CompilationError("comparing pointers is not supported", op.loc)
        if d in (ir.f16, ir.bf16):
            a, b, d = self.to_f32(a, d), self.to_f32(b, d), ir.f32
        n = a.n
        if d.is_float:
            pred = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge"}[k]
            return self.val(f"fcmp {pred} {a.ty} {a.ref}, {b.ref}", "i1", n, a.shape)
        s = "s" if d.is_signed else "u"
        pred = {"eq": "eq", "ne": "ne", "lt": f"{s}lt", "le": f"{s}le", "gt": f"{s}gt", "ge": f"{s}ge"}[k]
        return self.val(f"icmp {pred} {a.ty} {a.ref}, {b.ref}", "i1", n, a.shape)

    def op_select(self, op):
        c, a, b = (self.get(o) for o in op.operands)
        if isinstance(a, PT):
            raise CompilationError("where() on pointer tiles is not supported; select offsets instead", op.loc)
        return self.val(f"select {c.ty} {c.ref}, {a.ty} {a.ref}, {b.ty} {b.ref}", a.et, a.n, a.shape)

    def op_fma(self, op):
        a, b, c = (self.get(o) for o in op.operands)
        d = op.operands[0].type.elem
        if d in (ir.f16, ir.bf16):
            r = self.fmuladd(self.to_f32(a, d), self.to_f32(b, d), self.to_f32(c, d))
            return self.from_f32(r, d)
        if d.is_float:
            return self.fmuladd(a, b, c)
        m = self.val(f"mul {a.ty} {a.ref}, {b.ref}", a.et, a.n, a.shape)
        return self.val(f"add {a.ty} {m.ref}, {c.ref}", a.et, a.n, a.shape)

    def op_dp4a(self, op):
        a, b, c = (self.get(o) for o in op.operands)
        return self.dp4a(a, b, c, op.attrs["a_signed"], op.attrs["b_signed"])

    def dp4a(self, a: LV, b: LV, c: LV, a_signed: bool, b_signed: bool) -> LV:
        """c + sum over the 4 bytes j of byte_j(a) * byte_j(b): each byte sign- or zero-extended in its i32
        lane by shifts, then 4 multiplies and adds (exact: |products| <= 2^16). The portable form of PTX dp4a,
        which the GPU lowering takes where its hooks have it (the same bits)."""
        def byte(v, j, signed):
            if signed:
                t = self.val(f"shl {v.ty} {v.ref}, {self.const(24 - 8 * j, 'i32', v.n).ref}", "i32", v.n, v.shape) \
                    if j < 3 else v
                return self.val(f"ashr {v.ty} {t.ref}, {self.const(24, 'i32', v.n).ref}", "i32", v.n, v.shape)
            t = self.val(f"lshr {v.ty} {v.ref}, {self.const(8 * j, 'i32', v.n).ref}", "i32", v.n, v.shape) \
                if j else v
            return self.val(f"and {v.ty} {t.ref}, {self.const(255, 'i32', v.n).ref}", "i32", v.n, v.shape)
        acc = c
        for j in range(4):
            p = self.val(f"mul {a.ty} {byte(a, j, a_signed).ref}, {byte(b, j, b_signed).ref}", "i32", a.n, a.shape)
            acc = self.val(f"add {a.ty} {acc.ref}, {p.ref}", "i32", a.n, a.shape)
        return acc

    def fmuladd(self, a: LV, b: LV, c: LV) -> LV:
        # llvm.fmuladd, not llvm.fma: on tiers without FMA, llvm.fma becomes a libm call per element.
        name = f"llvm.fmuladd.{self.sfx(a)}"
        self.declare(name, a.ty, [a.ty] * 3)
        return self.val(f"call {a.ty} @{name}({a.ty} {a.ref}, {a.ty} {b.ref}, {a.ty} {c.ref})", a.et, a.n, a.shape)

    def fbin(self, instr, a: LV, b: LV) -> LV:
        return self.val(f"{instr} {a.ty} {a.ref}, {b.ref}", a.et, a.n, a.shape)

    def fconst(self, x: float, like: LV) -> LV:
        return self.const(x, like.et, like.n, like.shape)

    def math_call(self, name: str, x: LV) -> LV:
        n = f"llvm.{name}.{self.sfx(x)}"
        self.declare(n, x.ty, [x.ty])
        return self.val(f"call {x.ty} @{n}({x.ty} {x.ref})", x.et, x.n, x.shape)

    def op_unary(self, op):
        x = self.get(op.operands[0])
        d = op.operands[0].type.elem
        k = op.attrs["op"]
        if d in (ir.f16, ir.bf16):
            if k == "neg":
                return self.val(f"xor {x.ty} {x.ref}, {self.const(0x8000, 'i16', x.n, x.shape).ref}", x.et, x.n,
                                x.shape)
            if k == "abs":
                return self.val(f"and {x.ty} {x.ref}, {self.const(0x7fff, 'i16', x.n, x.shape).ref}", x.et, x.n,
                                x.shape)
            return self.from_f32(self._unary_f(k, self.to_f32(x, d)), d)
        if d.is_float:
            return self._unary_f(k, x)
        if k == "neg":
            r = self.val(f"sub {x.ty} {self.const(0, x.et, x.n, x.shape).ref}, {x.ref}", x.et, x.n, x.shape)
            if x.aff is not None:
                r.aff = self._aff_scale(x.aff, Aff(-1, (0,) * len(x.aff.strides)), x.et)
            return r
        if k == "not":
            return self.val(f"xor {x.ty} {x.ref}, {self.const(-1 if x.et != 'i1' else 1, x.et, x.n, x.shape).ref}",
                            x.et, x.n, x.shape)
        if k == "abs":
            name = f"llvm.abs.{self.sfx(x)}"
            self.declare(name, x.ty, [x.ty, "i1"])
            return self.val(f"call {x.ty} @{name}({x.ty} {x.ref}, i1 false)", x.et, x.n, x.shape)
        raise CompilationError(f"{k} is not defined for integers")

    def _unary_f(self, k, x: LV) -> LV:
        if k == "neg":
            return self.val(f"fneg {x.ty} {x.ref}", x.et, x.n, x.shape)
        if k == "abs":
            return self.math_call("fabs", x)
        if k in ("sqrt", "floor", "ceil", "sin", "cos", "log", "log2"):
            return self.math_call(k, x)
        if k == "rsqrt":
            return self.fbin("fdiv", self.fconst(1.0, x), self.math_call("sqrt", x))
        if k == "exp":
            return self.exp(x)
        if k == "exp_fast":
            return self.math_call("exp_fast", x) if self._has_fast_exp() else self.exp(x)
        if k == "exp2":
            return self.exp(self.fbin("fmul", x, self.fconst(math.log(2.0), x)))
        if k == "sigmoid":
            e = self.exp(self.val(f"fneg {x.ty} {x.ref}", x.et, x.n, x.shape))
            return self.fbin("fdiv", self.fconst(1.0, x), self.fbin("fadd", self.fconst(1.0, x), e))
        if k == "tanh":
            return self.tanh(x)
        if k == "erf":
            raise CompilationError("erf is not implemented on the CPU backend yet (use the tanh GELU)")
        raise CompilationError(f"unknown unary op {k}")

    def _has_fast_exp(self) -> bool:
        """Whether math_call("exp_fast") has a hardware approximation here (GPU hooks); else exp_fast = exp."""
        return False

    def floor_fast(self, t: LV) -> LV:
        """floor() through truncation (cvttps2dq): no libm call on tiers without SSE4.1 round."""
        it = "i32" if t.et == "float" else "i64"
        ti = self.val(f"fptosi {t.ty} {t.ref} to {vty(it, t.n)}", it, t.n, t.shape)
        tf = self.val(f"sitofp {ti.ty} {ti.ref} to {t.ty}", t.et, t.n, t.shape)
        gt = self.val(f"fcmp ogt {t.ty} {tf.ref}, {t.ref}", "i1", t.n, t.shape)
        one = self.fconst(1.0, t)
        tm1 = self.fbin("fsub", tf, one)
        return self.val(f"select {gt.ty} {gt.ref}, {t.ty} {tm1.ref}, {t.ty} {tf.ref}", t.et, t.n, t.shape)

    def exp(self, x: LV) -> LV:
        """expf by Cody-Waite range reduction and Cephes' degree-5 polynomial (max rel. error ~2 ulp).

        Vectorises on every tier, unlike llvm.exp which becomes one libm call per lane.
        """
        if x.et == "double":
            return self.math_call("exp", x)
        ty, n, sh = x.ty, x.n, x.shape
        c = lambda v: self.fconst(v, x)  # noqa: E731
        xc = self.val(f"call {ty} @{self._minmax('maxnum', x)}({ty} {x.ref}, {ty} {c(-87.5).ref})", x.et, n, sh)
        xc = self.val(f"call {ty} @{self._minmax('minnum', x)}({ty} {xc.ref}, {ty} {c(88.7).ref})", x.et, n, sh)
        t = self.fmuladd(xc, c(1.44269504088896341), c(0.5))
        fl = self.floor_fast(t)
        r = self.fmuladd(fl, c(-0.693359375), xc)
        r = self.fmuladd(fl, c(2.12194440e-4), r)
        p = c(1.9875691500E-4)
        for coef in (1.3981999507E-3, 8.3334519073E-3, 4.1665795894E-2, 1.6666665459E-1, 5.0000001201E-1):
            p = self.fmuladd(p, r, c(coef))
        r2 = self.fbin("fmul", r, r)
        y = self.fmuladd(p, r2, r)
        y = self.fbin("fadd", y, c(1.0))
        # 2^n as (n + 126) << 23 times 2: keeps the biased exponent in [1, 254] for n in [-125, 128]
        ni = self.val(f"fptosi {ty} {fl.ref} to {vty('i32', n)}", "i32", n, sh)
        nb = self.val(f"add {vty('i32', n)} {ni.ref}, {self.const(126, 'i32', n, sh).ref}", "i32", n, sh)
        nb = self.val(f"call {vty('i32', n)} @{self._minmax('smax', nb)}({vty('i32', n)} {nb.ref}, "
                      f"{vty('i32', n)} {self.const(0, 'i32', n, sh).ref})", "i32", n, sh)
        sh23 = self.val(f"shl {vty('i32', n)} {nb.ref}, {self.const(23, 'i32', n, sh).ref}", "i32", n, sh)
        scale = self.val(f"bitcast {vty('i32', n)} {sh23.ref} to {ty}", x.et, n, sh)
        out = self.fbin("fmul", self.fbin("fmul", y, scale), c(2.0))
        lo = self.val(f"fcmp olt {ty} {x.ref}, {c(-87.33654).ref}", "i1", n, sh)
        out = self.val(f"select {lo.ty} {lo.ref}, {ty} {c(0.0).ref}, {ty} {out.ref}", x.et, n, sh)
        hi = self.val(f"fcmp ogt {ty} {x.ref}, {c(88.72283).ref}", "i1", n, sh)
        out = self.val(f"select {hi.ty} {hi.ref}, {ty} {self.const(float('inf'), x.et, n, sh).ref}, {ty} {out.ref}",
                       x.et, n, sh)
        nan = self.val(f"fcmp uno {ty} {x.ref}, {x.ref}", "i1", n, sh)
        return self.val(f"select {nan.ty} {nan.ref}, {ty} {x.ref}, {ty} {out.ref}", x.et, n, sh)

    def _minmax(self, which, v: LV) -> str:
        name = f"llvm.{which}.{self.sfx(v)}"
        self.declare(name, v.ty, [v.ty, v.ty])
        return name

    def tanh(self, x: LV) -> LV:
        """tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|); a short odd polynomial near 0."""
        ty, n, sh = x.ty, x.n, x.shape
        c = lambda v: self.fconst(v, x)  # noqa: E731
        ax = self.math_call("fabs", x)
        e = self.exp(self.fbin("fmul", ax, c(-2.0)))
        q = self.fbin("fdiv", self.fbin("fsub", c(1.0), e), self.fbin("fadd", c(1.0), e))
        x2 = self.fbin("fmul", x, x)
        p = self.fmuladd(x2, c(2.0 / 15.0), c(-1.0 / 3.0))
        p = self.fmuladd(p, x2, c(1.0))
        small = self.fbin("fmul", p, ax)
        usesmall = self.val(f"fcmp olt {ty} {ax.ref}, {c(0.004).ref}", "i1", n, sh)
        m = self.val(f"select {usesmall.ty} {usesmall.ref}, {ty} {small.ref}, {ty} {q.ref}", x.et, n, sh)
        name = f"llvm.copysign.{self.sfx(x)}"
        self.declare(name, ty, [ty, ty])
        return self.val(f"call {ty} @{name}({ty} {m.ref}, {ty} {x.ref})", x.et, n, sh)

    # ---------------------------------------------------------------------------------------- casts
    def to_f32(self, x: LV, d: DType) -> LV:
        """Widens an f16/bf16 bit pattern (i16 lanes) to f32."""
        n, sh = x.n, x.shape
        i32t, fty = vty("i32", n), vty("float", n)
        if d == ir.bf16:
            z = self.val(f"zext {x.ty} {x.ref} to {i32t}", "i32", n, sh)
            s = self.val(f"shl {i32t} {z.ref}, {self.const(16, 'i32', n, sh).ref}", "i32", n, sh)
            return self.val(f"bitcast {i32t} {s.ref} to {fty}", "float", n, sh)
        if self.f16c:
            h = self.val(f"bitcast {x.ty} {x.ref} to {vty('half', n)}", "half", n, sh)
            return self.val(f"fpext {h.ty} {h.ref} to {fty}", "float", n, sh)
        # exact f16 -> f32 without F16C: rebias the exponent, renormalise subnormals through a float
        # subtraction, and route Inf/NaN to exponent 255.
        c = lambda v: self.const(v, "i32", n, sh)  # noqa: E731
        h = self.val(f"zext {x.ty} {x.ref} to {i32t}", "i32", n, sh)
        em = self.val(f"and {i32t} {h.ref}, {c(0x7fff).ref}", "i32", n, sh)
        o = self.val(f"shl {i32t} {em.ref}, {c(13).ref}", "i32", n, sh)
        ex = self.val(f"and {i32t} {o.ref}, {c(0x0f800000).ref}", "i32", n, sh)
        o = self.val(f"add {i32t} {o.ref}, {c(0x38000000).ref}", "i32", n, sh)
        isinf = self.val(f"icmp eq {i32t} {ex.ref}, {c(0x0f800000).ref}", "i1", n, sh)
        o_inf = self.val(f"add {i32t} {o.ref}, {c(0x38000000).ref}", "i32", n, sh)
        iszero = self.val(f"icmp eq {i32t} {ex.ref}, {c(0).ref}", "i1", n, sh)
        o_sub = self.val(f"add {i32t} {o.ref}, {c(1 << 23).ref}", "i32", n, sh)
        f_sub = self.val(f"bitcast {i32t} {o_sub.ref} to {fty}", "float", n, sh)
        magic = self.val(f"bitcast {i32t} {c(113 << 23).ref} to {fty}", "float", n, sh)
        f_sub = self.val(f"fsub {fty} {f_sub.ref}, {magic.ref}", "float", n, sh)
        o_sub = self.val(f"bitcast {fty} {f_sub.ref} to {i32t}", "i32", n, sh)
        o = self.val(f"select {vty('i1', n)} {isinf.ref}, {i32t} {o_inf.ref}, {i32t} {o.ref}", "i32", n, sh)
        o = self.val(f"select {vty('i1', n)} {iszero.ref}, {i32t} {o_sub.ref}, {i32t} {o.ref}", "i32", n, sh)
        sign = self.val(f"and {i32t} {h.ref}, {c(0x8000).ref}", "i32", n, sh)
        sign = self.val(f"shl {i32t} {sign.ref}, {c(16).ref}", "i32", n, sh)
        o = self.val(f"or {i32t} {o.ref}, {sign.ref}", "i32", n, sh)
        return self.val(f"bitcast {i32t} {o.ref} to {fty}", "float", n, sh)

    def from_f32(self, x: LV, d: DType) -> LV:
        """Rounds f32 to f16/bf16 (round to nearest even), giving i16 bit patterns."""
        n, sh = x.n, x.shape
        i32t, i16t = vty("i32", n), vty("i16", n)
        c = lambda v: self.const(v, "i32", n, sh)  # noqa: E731
        if d == ir.bf16:
            b = self.val(f"bitcast {x.ty} {x.ref} to {i32t}", "i32", n, sh)
            lsb = self.val(f"lshr {i32t} {b.ref}, {c(16).ref}", "i32", n, sh)
            lsb = self.val(f"and {i32t} {lsb.ref}, {c(1).ref}", "i32", n, sh)
            r = self.val(f"add {i32t} {b.ref}, {c(0x7fff).ref}", "i32", n, sh)
            r = self.val(f"add {i32t} {r.ref}, {lsb.ref}", "i32", n, sh)
            r = self.val(f"lshr {i32t} {r.ref}, {c(16).ref}", "i32", n, sh)
            nan = self.val(f"fcmp uno {x.ty} {x.ref}, {x.ref}", "i1", n, sh)
            r = self.val(f"select {vty('i1', n)} {nan.ref}, {i32t} {c(0x7fc0).ref}, {i32t} {r.ref}", "i32", n, sh)
            return self.val(f"trunc {i32t} {r.ref} to {i16t}", "i16", n, sh)
        if self.f16c:
            h = self.val(f"fptrunc {x.ty} {x.ref} to {vty('half', n)}", "half", n, sh)
            return self.val(f"bitcast {h.ty} {h.ref} to {i16t}", "i16", n, sh)
        fty = x.ty
        b = self.val(f"bitcast {fty} {x.ref} to {i32t}", "i32", n, sh)
        sign = self.val(f"lshr {i32t} {b.ref}, {c(16).ref}", "i32", n, sh)
        sign = self.val(f"and {i32t} {sign.ref}, {c(0x8000).ref}", "i32", n, sh)
        a = self.val(f"and {i32t} {b.ref}, {c(0x7fffffff).ref}", "i32", n, sh)
        # normal range: rebias 127 -> 15 and round to nearest even on the 13 dropped bits
        odd = self.val(f"lshr {i32t} {a.ref}, {c(13).ref}", "i32", n, sh)
        odd = self.val(f"and {i32t} {odd.ref}, {c(1).ref}", "i32", n, sh)
        nr = self.val(f"sub {i32t} {a.ref}, {c(0x38000000).ref}", "i32", n, sh)
        nr = self.val(f"add {i32t} {nr.ref}, {c(0xfff).ref}", "i32", n, sh)
        nr = self.val(f"add {i32t} {nr.ref}, {odd.ref}", "i32", n, sh)
        nr = self.val(f"lshr {i32t} {nr.ref}, {c(13).ref}", "i32", n, sh)
        # subnormal results: adding 0.5 aligns the mantissa so the FPU does the rounding
        af = self.val(f"bitcast {i32t} {a.ref} to {fty}", "float", n, sh)
        half = self.val(f"bitcast {i32t} {c(0x3f000000).ref} to {fty}", "float", n, sh)
        sf = self.val(f"fadd {fty} {af.ref}, {half.ref}", "float", n, sh)
        sb = self.val(f"bitcast {fty} {sf.ref} to {i32t}", "i32", n, sh)
        sb = self.val(f"sub {i32t} {sb.ref}, {c(0x3f000000).ref}", "i32", n, sh)
        issub = self.val(f"icmp ult {i32t} {a.ref}, {c(0x38800000).ref}", "i1", n, sh)
        r = self.val(f"select {vty('i1', n)} {issub.ref}, {i32t} {sb.ref}, {i32t} {nr.ref}", "i32", n, sh)
        big = self.val(f"icmp uge {i32t} {a.ref}, {c(0x477ff000).ref}", "i1", n, sh)
        r = self.val(f"select {vty('i1', n)} {big.ref}, {i32t} {c(0x7c00).ref}, {i32t} {r.ref}", "i32", n, sh)
        isnan = self.val(f"icmp ugt {i32t} {a.ref}, {c(0x7f800000).ref}", "i1", n, sh)
        r = self.val(f"select {vty('i1', n)} {isnan.ref}, {i32t} {c(0x7e00).ref}, {i32t} {r.ref}", "i32", n, sh)
        r = self.val(f"or {i32t} {r.ref}, {sign.ref}", "i32", n, sh)
        return self.val(f"trunc {i32t} {r.ref} to {i16t}", "i16", n, sh)

    def op_cast(self, op):
        x = self.get(op.operands[0])
        src, dst = op.operands[0].type.elem, op.attrs["to"]
        if isinstance(x, PT):
            raise CompilationError("cannot cast pointers", op.loc)
        return self.convert(x, src, dst, op.attrs.get("bitcast", False))

    def convert(self, x: LV, src: DType, dst: DType, bitcast=False) -> LV:
        n, sh = x.n, x.shape
        if src == dst:
            return x
        if bitcast:
            return self.val(f"bitcast {x.ty} {x.ref} to {vty(elem_ty(dst), n)}", elem_ty(dst), n, sh)
        if src in (ir.f16, ir.bf16):
            return self.convert(self.to_f32(x, src), ir.f32, dst)
        if dst in (ir.f16, ir.bf16):
            return self.from_f32(self.convert(x, src, ir.f32), dst)
        se, de = elem_ty(src), elem_ty(dst)
        dty = vty(de, n)
        if src.is_float and dst.is_float:
            instr = "fpext" if dst.bits > src.bits else "fptrunc"
            return self.val(f"{instr} {x.ty} {x.ref} to {dty}", de, n, sh)
        if src.is_float:
            if dst.is_bool:
                return self.val(f"fcmp une {x.ty} {x.ref}, {self.const(0.0, se, n, sh).ref}", "i1", n, sh)
            instr = "fptosi" if dst.is_signed or dst.bits >= 64 else "fptoui"
            return self.val(f"{instr} {x.ty} {x.ref} to {dty}", de, n, sh)
        if dst.is_float:
            instr = "uitofp" if (not src.is_signed) else "sitofp"
            return self.val(f"{instr} {x.ty} {x.ref} to {dty}", de, n, sh)
        if dst.is_bool:
            return self.val(f"icmp ne {x.ty} {x.ref}, {self.const(0, se, n, sh).ref}", "i1", n, sh)
        if dst.bits == src.bits:
            out = LV(x.ref, de, n, sh, x.aff)
            return out
        if dst.bits > src.bits:
            instr = "sext" if src.is_signed else "zext"
            r = self.val(f"{instr} {x.ty} {x.ref} to {dty}", de, n, sh)
            if x.aff is not None and src.is_signed:
                r.aff = self._aff_cast(x.aff, x.et, de, "sext")
            return r
        r = self.val(f"trunc {x.ty} {x.ref} to {dty}", de, n, sh)
        if x.aff is not None:
            r.aff = self._aff_cast(x.aff, x.et, de, "trunc")
        return r

    def _aff_cast(self, a: Aff, se, de, instr) -> Aff:
        def cv(v):
            if isinstance(v, int):
                return v
            return self.val(f"{instr} {se} {v} to {de}", de, 0).ref
        return Aff(cv(a.base), tuple(cv(s) for s in a.strides))

    # -------------------------------------------------------------------------------------- memory
    def op_tma(self, op):
        # jk.tma: the loaded tile itself (the NVPTX lowering copies it by the tensor memory accelerator instead where
        # its K-loop staging allows, backends/nvidia/staging.py)
        return self.get(op.operands[0])

    def op_addptr(self, op):
        p, o = self.get(op.operands[0]), self.get(op.operands[1])
        shape = op.result.type.shape
        if p.offs is None:
            return PT(p.base, p.elem, o, shape)
        a = p.offs
        if a.et != o.et:
            a, o = self.to_i64(a), self.to_i64(o)
        r = self.val(f"add {a.ty} {a.ref}, {o.ref}", a.et, a.n, shape)
        r.aff = self._aff_combine(a.aff, o.aff, a.et, 1)
        return PT(p.base, p.elem, r, shape)

    def to_i64(self, v: LV) -> LV:
        if v.et == "i64":
            return v
        r = self.val(f"sext {v.ty} {v.ref} to {vty('i64', v.n)}", "i64", v.n, v.shape)
        if v.aff is not None:
            r.aff = self._aff_cast(v.aff, v.et, "i64", "sext")
        return r

    def scalar_i64(self, s) -> str:
        if isinstance(s, int):
            return str(s)
        return s

    def _elem_ptr(self, p: PT, off) -> str:
        """Scalar pointer p.base + off elements (off: int, or an LLVM scalar ref of type `oet`)."""
        et = elem_ty(p.elem)
        if isinstance(off, int):
            if off == 0:
                return p.base
            return self.val(f"getelementptr inbounds {et}, ptr {p.base}, i64 {off}", "ptr", 0).ref
        ref, oty = off
        return self.val(f"getelementptr inbounds {et}, ptr {p.base}, {oty} {ref}", "ptr", 0).ref

    def _guarded_scalar_load(self, ptr, et, align, mask: LV, other: Optional[LV]) -> LV:
        yes, done = self.label("ld"), self.label("ld_done")
        pred = self.block
        self.emit(f"br i1 {mask.ref}, label %{yes}, label %{done}")
        self.start_block(yes)
        v = self.val(f"load {et}, ptr {ptr}, align {align}", et, 0)
        self.emit(f"br label %{done}")
        self.start_block(done)
        o = other.ref if other is not None else ("0.0" if et in ("float", "double") else "0")
        return self.val(f"phi {et} [ {v.ref}, %{yes} ], [ {o}, %{pred} ]", et, 0)

    def _combine(self, kind, a: LV, b: LV, d: DType) -> LV:
        if kind == "sum":
            return self.val(f"{'fadd' if d.is_float else 'add'} {a.ty} {a.ref}, {b.ref}", a.et, a.n, a.shape)
        if d.is_float:
            return self.val(f"call {a.ty} @{self._minmax('maxnum' if kind == 'max' else 'minnum', a)}({a.ty} {a.ref}, "
                            f"{a.ty} {b.ref})", a.et, a.n, a.shape)
        s = "s" if d.is_signed else "u"
        return self.val(f"call {a.ty} @{self._minmax(s + kind, a)}({a.ty} {a.ref}, {a.ty} {b.ref})", a.et, a.n,
                        a.shape)

    def _abs_decl(self, v: LV) -> str:
        name = f"llvm.abs.{self.sfx(v)}"
        self.declare(name, v.ty, [v.ty, "i1"])
        return name

    # ------------------------------------------------------------------------------- control flow
    def _phi_repr(self, v):
        """(type string, ref) for a loop-carried / merged value; pointer tiles carry their offsets."""
        if isinstance(v, PT):
            offs = v.offs if v.offs is not None else self.const(0, "i64", v.n, v.shape)
            offs = self.to_i64(offs)
            return offs
        return v

    def _unphi(self, like, lv: LV):
        if isinstance(like, PT):
            return PT(like.base, like.elem, LV(lv.ref, lv.et, lv.n, like.shape), like.shape)
        return LV(lv.ref, lv.et, lv.n, like.shape if isinstance(like, LV) else ())

    def op_for(self, op):
        lb, ub, step = (self.get(o) for o in op.operands[:3])
        inits = [self.get(o) for o in op.operands[3:]]
        body = op.regions[0]
        hdr, bb, ex = self.label("for_hdr"), self.label("for_body"), self.label("for_exit")
        inits_r = [self._phi_repr(v) for v in inits]
        pred = self.block
        self.emit(f"br label %{hdr}")
        self.start_block(hdr)
        it = lb.et
        iv = self.tmp("iv")
        phi_idx = len(self.lines)
        self.lines.append(None)   # patched below with the latch value
        carried = []
        for v, r in zip(inits, inits_r):
            ph = self.tmp("c")
            carried.append((ph, r))
            self.lines.append(None)
        cond = self.val(f"icmp slt {it} {iv}, {ub.ref}", "i1", 0)
        self.emit(f"br i1 {cond.ref}, label %{bb}, label %{ex}")
        self.start_block(bb)
        ivlv = LV(iv, it, 0, (), Aff(iv, ()))
        self.vals[body.args[0].id] = ivlv
        for arg, v, (ph, r) in zip(body.args[1:], inits, carried):
            self.vals[arg.id] = self._unphi(v, LV(ph, r.et, r.n, r.shape))
        ys = self.lower_block(body)
        ys_r = []
        for y, v in zip(ys, inits):
            if isinstance(v, PT) and (not isinstance(y, PT) or y.base != v.base):
                raise CompilationError("a loop-carried pointer tile must keep its base pointer", op.loc)
            ys_r.append(self._phi_repr(y))
        nxt = self.val(f"add {it} {iv}, {step.ref}", it, 0)
        latch = self.block
        self.emit(f"br label %{hdr}")
        self.lines[phi_idx] = f"  {iv} = phi {it} [ {lb.ref}, %{pred} ], [ {nxt.ref}, %{latch} ]"
        for i, ((ph, r), y) in enumerate(zip(carried, ys_r)):
            self.lines[phi_idx + 1 + i] = f"  {ph} = phi {r.ty} [ {r.ref}, %{pred} ], [ {y.ref}, %{latch} ]"
        self.start_block(ex)
        return [self._unphi(v, LV(ph, r.et, r.n, r.shape)) for v, (ph, r) in zip(inits, carried)]

    # Lowering state that flows through the branches of an `if` (the GPU's pending memory accesses): each
    # branch starts from the state before the `if`; the merge gets the states both branches ended with.
    def _branch_state(self):
        return None

    def _enter_branch(self, state) -> None:
        pass

    def _merge_branches(self, states: list) -> None:
        pass

    def op_if(self, op):
        c = self.get(op.operands[0])
        tb, eb, mb = self.label("then"), self.label("else"), self.label("endif")
        self.emit(f"br i1 {c.ref}, label %{tb}, label %{eb}")
        outs, ends = [], []
        before = self._branch_state()
        for name, region in ((tb, op.regions[0]), (eb, op.regions[1])):
            self._enter_branch(before)
            self.start_block(name)
            ys = self.lower_block(region)
            outs.append(([self._if_phi_repr(op, j, y) for j, y in enumerate(ys)], ys, self.block))
            ends.append(self._branch_state())
            self.emit(f"br label %{mb}")
        self._merge_branches(ends)
        self.start_block(mb)
        res = []
        (tr, tys, tend), (er, eys, eend) = outs
        for j, (a, b, ya, yb) in enumerate(zip(tr, er, tys, eys)):
            if isinstance(ya, PT) and (not isinstance(yb, PT) or ya.base != yb.base):
                raise CompilationError("both branches must give pointer tiles with the same base", op.loc)
            ph = self.val(f"phi {a.ty} [ {a.ref}, %{tend} ], [ {b.ref}, %{eend} ]", a.et, a.n, a.shape)
            res.append(self._if_unphi(op, j, ya, ph))
        return res

    def _if_phi_repr(self, op, j, y):
        """What a run-time `if` merges for its result j (a branch's yield y): _phi_repr's (a lowering may keep some
        results in a layout of its own)."""
        return self._phi_repr(y)

    def _if_unphi(self, op, j, like, ph: LV):
        """The value of result j from its merged phi (like: the then-branch's yield)."""
        return self._unphi(like, ph)
