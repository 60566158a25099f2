"""jitkern's typed SSA tile IR: types, values, operations with structured regions, a printer and a verifier.

A kernel is one `Function` whose body is a `Block` of `Op`s. Every value is a *tile*: a static shape
(possibly empty = a scalar) of one element type (a scalar dtype or a pointer to one). Control flow is
structured (`for`, `if`, each ending its regions with `yield`), like MLIR's scf dialect, so every backend
can lower it without rebuilding a CFG.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


# ----------------------------------------------------------------------------------------------- types
@dataclass(frozen=True)
class DType:
    name: str
    kind: str      # "f" float, "i" signed int, "u" unsigned int, "b" bool
    bits: int

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in ("i", "u")

    @property
    def is_signed(self) -> bool:
        return self.kind == "i"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


f64 = DType("f64", "f", 64)
f32 = DType("f32", "f", 32)
f16 = DType("f16", "f", 16)
bf16 = DType("bf16", "f", 16)
i1 = DType("i1", "b", 1)
i8 = DType("i8", "i", 8)
u8 = DType("u8", "u", 8)
i16 = DType("i16", "i", 16)
u16 = DType("u16", "u", 16)
i32 = DType("i32", "i", 32)
u32 = DType("u32", "u", 32)
i64 = DType("i64", "i", 64)
DTYPES = {d.name: d for d in (f64, f32, f16, bf16, i1, i8, u8, i16, u16, i32, u32, i64)}
DTYPES["bool"] = i1


@dataclass(frozen=True)
class PtrType:
    elem: DType

    def __repr__(self) -> str:
        return f"*{self.elem}"

    __str__ = __repr__


@dataclass(frozen=True)
class TileType:
    elem: Any                 # DType or PtrType
    shape: tuple = ()

    @property
    def is_scalar(self) -> bool:
        return self.shape == ()

    @property
    def is_ptr(self) -> bool:
        return isinstance(self.elem, PtrType)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def with_shape(self, shape) -> "TileType":
        return TileType(self.elem, tuple(shape))

    def with_elem(self, elem) -> "TileType":
        return TileType(elem, self.shape)

    def __repr__(self) -> str:
        if not self.shape:
            return str(self.elem)
        return f"<{'x'.join(map(str, self.shape))}x{self.elem}>"

    __str__ = __repr__


# ------------------------------------------------------------------------------------------- structure
@dataclass(frozen=True)
class Loc:
    """Where in the user's kernel an op came from (for errors and IR dumps)."""
    file: str
    line: int
    col: int = 0
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Value:
    _counter = 0

    def __init__(self, type: TileType, name: str = ""):
        Value._counter += 1
        self.id = Value._counter
        self.type = type
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name or self.id}"


@dataclass
class Block:
    args: list = field(default_factory=list)
    ops: list = field(default_factory=list)


@dataclass
class Op:
    name: str
    operands: list
    results: list
    attrs: dict = field(default_factory=dict)
    regions: list = field(default_factory=list)    # list of Block
    loc: Optional[Loc] = None

    @property
    def result(self) -> Value:
        return self.results[0]


@dataclass
class Param:
    name: str
    type: TileType          # scalar dtype or pointer
    value: Value


@dataclass
class Function:
    name: str
    params: list            # list of Param (runtime parameters only; constexprs are folded)
    body: Block
    constexprs: dict = field(default_factory=dict)
    loc: Optional[Loc] = None


# Op names and what they mean (attrs in brackets):
#   const[value]          splat constant of the result type
#   program_id[axis]      num_programs[axis]
#   arange[start,end]     i32 tile start..end-1
#   splat                 scalar -> tile of result shape
#   broadcast             tile -> result shape (numpy rules; size-1 dims expand)
#   reshape               same element count, new shape (row-major)
#   trans[perm]           2-D transpose, or with perm any permutation of the axes (result axis i = input perm[i])
#   binary[op]            add sub mul div floordiv mod and or xor shl shr min max
#   cmp[op]               eq ne lt le gt ge  -> i1
#   unary[op]             neg exp exp2 log log2 sqrt rsqrt tanh sigmoid abs floor ceil not erf
#   fma                   a*b+c
#   cast[to, bitcast]     element conversion
#   select                where(cond, a, b)
#   addptr                pointer tile + integer offsets (in elements)
#   load                  ptr[, mask[, other]]
#   store                 ptr, value[, mask]
#   prefetch[locality]    ptr (cache hint; no result, never faults)
#   reduce[kind, axis]    sum max min  (axis removed)
#   argreduce[kind, axis] argmax argmin -> i32
#   dot                   (M,K)x(K,N)[+acc] -> (M,N), f32 (or i32 for integer inputs)
#   dot4[axis]            (...,K)x(...,K) int8/uint8 -> (...,K/4) i32: sums of products of groups of 4
#   dp4a[a_signed,b_signed] a, b i32/u32 packed bytes, c i32 (same shape) -> c + sum of the 4 byte products
#   madd                  (...,K)x(...,K) u8 x i8 -> (...,K/2) i16 (saturated), i16 x i16 -> i32: pair sums
#                         (with axis: also summed over that input axis, which the result drops)
#   for                   lb, ub, step, *inits; region args (iv, *carried); yields carried; results
#   if                    cond; regions then, else; each yields the results
#   yield                 *values
BINARY_OPS = {"add", "sub", "mul", "div", "floordiv", "mod", "and", "or", "xor", "shl", "shr", "min", "max"}
CMP_OPS = {"eq", "ne", "lt", "le", "gt", "ge"}
UNARY_OPS = {"neg", "exp", "exp_fast", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "floor", "ceil",
             "not", "erf", "sin", "cos"}
REDUCE_KINDS = {"sum", "max", "min"}


# ------------------------------------------------------------------------------------------- printing
def format_function(fn: Function) -> str:
    lines = []
    params = ", ".join(f"{p.value!r}: {p.type} {p.name}" for p in fn.params)
    cx = ", ".join(f"{k}={v!r}" for k, v in fn.constexprs.items())
    lines.append(f"kernel @{fn.name}({params})" + (f"  [constexpr {cx}]" if cx else "") + " {")
    _format_block(fn.body, lines, 1)
    lines.append("}")
    return "\n".join(lines)


def _fmt_attr(v) -> str:
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    return repr(v)


def _format_block(block: Block, lines: list, depth: int) -> None:
    pad = "  " * depth
    for op in block.ops:
        res = ", ".join(repr(r) for r in op.results)
        lhs = f"{res} = " if res else ""
        attrs = ""
        if op.attrs:
            attrs = "[" + ", ".join(f"{k}={_fmt_attr(v)}" for k, v in op.attrs.items()) + "]"
        args = ", ".join(repr(o) if o is not None else "none" for o in op.operands)
        ty = ""
        if op.results:
            ty = " : " + ", ".join(str(r.type) for r in op.results)
        loc = f"  // line {op.loc.line}" if op.loc else ""
        lines.append(f"{pad}{lhs}{op.name}{attrs}({args}){ty}{loc}")
        for i, region in enumerate(op.regions):
            rargs = ", ".join(f"{a!r}: {a.type}" for a in region.args)
            lines.append(f"{pad}  region{i}({rargs}):")
            _format_block(region, lines, depth + 2)


# ------------------------------------------------------------------------------------------- verifier
class VerifyError(Exception):
    pass


def verify(fn: Function) -> None:
    """Checks SSA dominance (every operand defined before use, in an enclosing scope) and op typing."""
    defined = {p.value.id for p in fn.params}
    _verify_block(fn.body, defined)


def _verify_block(block: Block, defined: set) -> None:
    scope = set(defined) | {a.id for a in block.args}
    for op in block.ops:
        for o in op.operands:
            if o is not None and o.id not in scope:
                raise VerifyError(f"{op.name} at {op.loc}: operand {o!r} used before definition")
        _verify_op(op)
        for region in op.regions:
            _verify_block(region, scope)
            if not region.ops or region.ops[-1].name != "yield":
                raise VerifyError(f"{op.name} at {op.loc}: region does not end with yield")
            ys = region.ops[-1].operands
            if op.name == "for":
                carried = region.args[1:]
                if [y.type for y in ys] != [c.type for c in carried]:
                    raise VerifyError(f"for at {op.loc}: yielded types {[y.type for y in ys]} != carried "
                                      f"{[c.type for c in carried]}")
            elif op.name == "if":
                if [y.type for y in ys] != [r.type for r in op.results]:
                    raise VerifyError(f"if at {op.loc}: branch yields {[y.type for y in ys]} but results are "
                                      f"{[r.type for r in op.results]}")
        scope.update(r.id for r in op.results)


def _verify_op(op: Op) -> None:
    t = [o.type for o in op.operands if o is not None]
    r = [x.type for x in op.results]
    where = f"{op.name} at {op.loc}"
    if op.name in ("binary", "select", "fma", "dp4a"):
        shapes = {x.shape for x in t}
        if len(shapes) != 1:
            raise VerifyError(f"{where}: operand shapes differ {shapes}")
    if op.name == "binary" and op.attrs["op"] not in BINARY_OPS:
        raise VerifyError(f"{where}: unknown binary op {op.attrs['op']}")
    if op.name == "binary" and len({x.elem for x in t}) != 1:
        raise VerifyError(f"{where}: operand element types differ {t}")
    if op.name == "cmp" and r[0].elem != i1:
        raise VerifyError(f"{where}: cmp must produce i1")
    if op.name in ("load",):
        if not t[0].is_ptr:
            raise VerifyError(f"{where}: load from a non-pointer {t[0]}")
        if r[0] != TileType(t[0].elem.elem, t[0].shape):
            raise VerifyError(f"{where}: load result {r[0]} does not match pointer {t[0]}")
    if op.name == "store":
        if not t[0].is_ptr or t[1].shape != t[0].shape or t[1].elem != t[0].elem.elem:
            raise VerifyError(f"{where}: store of {t[1]} through {t[0]}")
    if op.name == "reshape" and r[0].numel != t[0].numel:
        raise VerifyError(f"{where}: reshape changes element count {t[0]} -> {r[0]}")
    if op.name == "dot":
        (m, k), (k2, n) = t[0].shape, t[1].shape
        if k != k2 or r[0].shape != (m, n):
            raise VerifyError(f"{where}: dot shapes {t[0]} x {t[1]} -> {r[0]}")
