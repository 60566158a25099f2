"""The jitkern tile language: the `Tile` value and the builtins kernels call (`jk.load`, `jk.dot`, ...).

Kernels are traced by `jitkern.frontend`, which evaluates the kernel's Python AST with these objects:
Python numbers and other constexpr values stay Python values (folded at trace time), run-time values are
`Tile`s whose operators append typed ops to the IR through the current `Builder`.

Numeric rules (Triton-like):
- a Python int/float mixed with a tile adopts the tile's element type (a float literal with an int tile
  gives f32); tile x tile promotes to the wider type (float beats int; f16 with bf16 gives f32);
- `/` is true division (ints become f32); `//` and `%` on ints use C semantics (truncate toward zero);
- shapes broadcast with numpy's rules; pointers plus integer tiles give pointer tiles.
"""
from __future__ import annotations

import builtins as _py
import threading
from typing import Optional

from . import ir
from .ir import DType, TileType, Value
from .ir import f64, f32, f16, bf16, i1, i8, u8, i16, u16, i32, u32, i64  # noqa: F401  (public dtypes)

float32, float16, bfloat16, float64 = f32, f16, bf16, f64
int8, uint8, int16, uint16, int32, uint32, int64 = i8, u8, i16, u16, i32, u32, i64
bool_ = int1 = i1


class CompilationError(Exception):
    """An error in a kernel's source, reported at the user's line."""

    def __init__(self, message: str, loc: Optional[ir.Loc] = None):
        self.message = message
        self.loc = loc
        where = ""
        if loc is not None:
            where = f"{loc.file}:{loc.line}: "
            if loc.text:
                where += f"in `{loc.text.strip()}`: "
        super().__init__(where + message)


class constexpr:
    """Annotation for kernel parameters folded at trace time (`BLOCK: jk.constexpr`)."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self):
        return f"constexpr({self.value!r})"


# --------------------------------------------------------------------------------------------- builder
class Builder:
    """Appends ops to the current block. The frontend sets `loc` before evaluating each statement."""

    def __init__(self, target):
        self.target = target
        self.block_stack: list[ir.Block] = []
        self.loc: Optional[ir.Loc] = None

    @property
    def block(self) -> ir.Block:
        return self.block_stack[-1]

    def op(self, name: str, operands, result_types, attrs=None, regions=None) -> ir.Op:
        results = [Value(t) for t in result_types]
        op = ir.Op(name, list(operands), results, dict(attrs or {}), list(regions or []), self.loc)
        self.block.ops.append(op)
        return op

    def value(self, name, operands, rtype, **attrs) -> "Tile":
        return Tile(self.op(name, [o.value if isinstance(o, Tile) else o for o in operands], [rtype], attrs).result)


_state = threading.local()


def _builder() -> Builder:
    b = getattr(_state, "builder", None)
    if b is None:
        raise CompilationError("jitkern builtins can only be used inside a kernel being compiled")
    return b


def _error(msg: str):
    raise CompilationError(msg, getattr(getattr(_state, "builder", None), "loc", None))


# --------------------------------------------------------------------------------------------- typing
def _is_py_scalar(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, Tile)


def promote(a: DType, b: DType) -> DType:
    if a == b:
        return a
    if a.is_float or b.is_float:
        if a.is_float and b.is_float:
            if {a, b} == {f16, bf16}:
                return f32
            return a if a.bits >= b.bits else b
        return a if a.is_float else b
    if a.is_bool:
        return b
    if b.is_bool:
        return a
    bits = _py.max(a.bits, b.bits)
    signed = a.is_signed or b.is_signed
    for d in (i8, i16, i32, i64) if signed else (u8, u16, u32, i64):
        if d.bits == bits:
            return d
    return i64


def broadcast_shapes(s1: tuple, s2: tuple) -> tuple:
    n = _py.max(len(s1), len(s2))
    a = (1,) * (n - len(s1)) + tuple(s1)
    b = (1,) * (n - len(s2)) + tuple(s2)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            _error(f"shapes {tuple(s1)} and {tuple(s2)} do not broadcast")
        out.append(_py.max(x, y))
    return tuple(out)


def _const(value, dtype: DType, shape=()) -> "Tile":
    if dtype.is_bool:
        value = bool(value)
    elif dtype.is_int:
        value = int(value)
    else:
        value = float(value)
    return _builder().value("const", [], TileType(dtype, tuple(shape)), value=value)


def to_tile(x, like: Optional["Tile"] = None, dtype: Optional[DType] = None) -> "Tile":
    if isinstance(x, Tile):
        return x
    if isinstance(x, constexpr):
        x = x.value
    if _is_py_scalar(x):
        if dtype is None:
            if like is not None and not like.type.is_ptr:
                ld = like.dtype
                if isinstance(x, float) and not ld.is_float:
                    dtype = f32
                elif isinstance(x, bool) and not ld.is_bool:
                    dtype = ld
                else:
                    dtype = ld
            else:
                dtype = i1 if isinstance(x, bool) else f32 if isinstance(x, float) else (
                    i32 if -2**31 <= x < 2**31 else i64)
        return _const(x, dtype)
    _error(f"cannot use {type(x).__name__} value {x!r} in a kernel expression")


def broadcast_to(x: "Tile", shape) -> "Tile":
    x = to_tile(x)
    shape = tuple(shape)
    if x.shape == shape:
        return x
    if x.type.is_scalar:
        return _builder().value("splat", [x], x.type.with_shape(shape))
    if len(x.shape) < len(shape):
        x = reshape(x, (1,) * (len(shape) - len(x.shape)) + x.shape)
    for a, b in zip(x.shape, shape):
        if a != b and a != 1:
            _error(f"cannot broadcast {x.shape} to {shape}")
    return _builder().value("broadcast", [x], x.type.with_shape(shape))


def cast(x, dtype: DType, bitcast: bool = False) -> "Tile":
    if isinstance(dtype, constexpr):
        dtype = dtype.value
    if isinstance(dtype, str):
        dtype = ir.DTYPES[dtype]
    x = to_tile(x, dtype=dtype if _is_py_scalar(x) else None)
    if x.type.is_ptr:
        _error("cannot cast a pointer tile")
    if x.dtype == dtype:
        return x
    if bitcast and x.dtype.bits != dtype.bits:
        _error(f"bitcast between {x.dtype} and {dtype} of different widths")
    return _builder().value("cast", [x], x.type.with_elem(dtype), to=dtype, bitcast=bitcast)


def _binary_operands(a, b):
    if isinstance(a, Tile) and a.type.is_ptr or isinstance(b, Tile) and b.type.is_ptr:
        _error("arithmetic other than + and - on pointers is not supported")
    if not isinstance(a, Tile):
        a = to_tile(a, like=b)
    if not isinstance(b, Tile):
        b = to_tile(b, like=a)
    dt = promote(a.dtype, b.dtype)
    shape = broadcast_shapes(a.shape, b.shape)
    return broadcast_to(cast(a, dt), shape), broadcast_to(cast(b, dt), shape)


def binary(op: str, a, b) -> "Tile":
    if op == "div":
        a, b = _binary_operands(a, b)
        if not a.dtype.is_float:
            a, b = cast(a, f32), cast(b, f32)
    else:
        a, b = _binary_operands(a, b)
    if op in ("and", "or", "xor", "shl", "shr", "floordiv", "mod") and a.dtype.is_float and op not in ("mod",):
        if op != "floordiv":
            _error(f"bitwise '{op}' on float tiles")
    return _builder().value("binary", [a, b], a.type, op=op)


def compare(op: str, a, b) -> "Tile":
    a, b = _binary_operands(a, b)
    return _builder().value("cmp", [a, b], a.type.with_elem(i1), op=op)


def unary(op: str, x, float_only: bool = True) -> "Tile":
    x = to_tile(x)
    if float_only and not x.dtype.is_float:
        x = cast(x, f32)
    if x.dtype in (f16, bf16) and op not in ("neg", "abs"):
        # transcendental math is computed in f32 and rounded back (no native half math on CPUs)
        return cast(_builder().value("unary", [cast(x, f32)], x.type.with_elem(f32), op=op), x.dtype)
    return _builder().value("unary", [x], x.type, op=op)


def reshape(x, shape) -> "Tile":
    x = to_tile(x)
    shape = tuple(int(s.value if isinstance(s, constexpr) else s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    if n != x.type.numel:
        _error(f"cannot reshape {x.shape} ({x.type.numel} elements) to {shape}")
    if shape == x.shape:
        return x
    return _builder().value("reshape", [x], x.type.with_shape(shape))


# ------------------------------------------------------------------------------------------------ Tile
class Tile:
    """A run-time value inside a kernel: a static-shape tile (or scalar) of one element type."""

    __slots__ = ("value",)

    def __init__(self, value: Value):
        self.value = value

    @property
    def type(self) -> TileType:
        return self.value.type

    @property
    def shape(self) -> tuple:
        return self.value.type.shape

    @property
    def dtype(self):
        return self.value.type.elem

    @property
    def numel(self) -> int:
        return self.value.type.numel

    def __repr__(self) -> str:
        return f"Tile({self.value!r}: {self.type})"

    def __bool__(self):
        _error("a run-time tile has no Python truth value here; use `if` on a scalar or jk.where")

    def __index__(self):
        _error("a run-time tile cannot be used where a compile-time integer is required (use jk.constexpr)")

    def __iter__(self):
        _error("cannot iterate over a tile")

    def __len__(self):
        return self.shape[0] if self.shape else _error("len() of a scalar")

    # pointer arithmetic and arithmetic
    def __add__(self, other):
        if self.type.is_ptr:
            return addptr(self, other)
        if isinstance(other, Tile) and other.type.is_ptr:
            return addptr(other, self)
        return binary("add", self, other)

    def __radd__(self, other):
        if self.type.is_ptr:
            return addptr(self, other)
        return binary("add", other, self)

    def __sub__(self, other):
        if self.type.is_ptr:
            return addptr(self, -to_tile(other) if isinstance(other, Tile) else -other)
        return binary("sub", self, other)

    def __rsub__(self, other):
        return binary("sub", other, self)

    def __mul__(self, other):
        return binary("mul", self, other)

    def __rmul__(self, other):
        return binary("mul", other, self)

    def __truediv__(self, other):
        return binary("div", self, other)

    def __rtruediv__(self, other):
        return binary("div", other, self)

    def __floordiv__(self, other):
        return binary("floordiv", self, other)

    def __rfloordiv__(self, other):
        return binary("floordiv", other, self)

    def __mod__(self, other):
        return binary("mod", self, other)

    def __rmod__(self, other):
        return binary("mod", other, self)

    def __and__(self, other):
        return binary("and", self, other)

    def __rand__(self, other):
        return binary("and", other, self)

    def __or__(self, other):
        return binary("or", self, other)

    def __ror__(self, other):
        return binary("or", other, self)

    def __xor__(self, other):
        return binary("xor", self, other)

    def __rxor__(self, other):
        return binary("xor", other, self)

    def __lshift__(self, other):
        return binary("shl", self, other)

    def __rlshift__(self, other):
        return binary("shl", other, self)

    def __rshift__(self, other):
        return binary("shr", self, other)

    def __rrshift__(self, other):
        return binary("shr", other, self)

    def __neg__(self):
        return _builder().value("unary", [self], self.type, op="neg")

    def __pos__(self):
        return self

    def __invert__(self):
        if self.dtype.is_float:
            _error("~ on a float tile")
        return _builder().value("unary", [self], self.type, op="not")

    def __abs__(self):
        return _builder().value("unary", [self], self.type, op="abs")

    def __lt__(self, other):
        return compare("lt", self, other)

    def __le__(self, other):
        return compare("le", self, other)

    def __gt__(self, other):
        return compare("gt", self, other)

    def __ge__(self, other):
        return compare("ge", self, other)

    def __eq__(self, other):
        return compare("eq", self, other)

    def __ne__(self, other):
        return compare("ne", self, other)

    __hash__ = object.__hash__

    def __getitem__(self, idx):
        """Only shape manipulation: `x[:, None]`, `x[None, :]`, `x[None]`, `x[:]`."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        shape, dim = [], 0
        for s in idx:
            if s is None:
                shape.append(1)
            elif isinstance(s, slice) and s == slice(None):
                if dim >= len(self.shape):
                    _error(f"too many indices for a tile of shape {self.shape}")
                shape.append(self.shape[dim])
                dim += 1
            elif s is Ellipsis:
                rest = len(self.shape) - dim - _py.sum(1 for t in idx if isinstance(t, slice))
                shape.extend(self.shape[dim:dim + rest])
                dim += rest
            else:
                _error("tile indexing supports only `:` and `None` (use loads with offsets to gather)")
        shape.extend(self.shape[dim:])
        return reshape(self, shape)

    def to(self, dtype, bitcast=False):
        return cast(self, dtype, bitcast=bitcast)

    @property
    def T(self):
        return trans(self)


def addptr(ptr: Tile, offset) -> Tile:
    offset = to_tile(offset)
    if not offset.dtype.is_int:
        _error(f"pointer offsets must be integers, got {offset.dtype}")
    shape = broadcast_shapes(ptr.shape, offset.shape)
    return _builder().value("addptr", [broadcast_to(ptr, shape), broadcast_to(offset, shape)], ptr.type.with_shape(shape))


# -------------------------------------------------------------------------------------------- builtins
def builtin(fn):
    fn._jk_builtin = True
    return fn


@builtin
def program_id(axis) -> Tile:
    axis = int(getattr(axis, "value", axis))
    if axis not in (0, 1, 2):
        _error(f"program_id axis must be 0, 1 or 2, got {axis}")
    return _builder().value("program_id", [], TileType(i32), axis=axis)


@builtin
def num_programs(axis) -> Tile:
    axis = int(getattr(axis, "value", axis))
    if axis not in (0, 1, 2):
        _error(f"num_programs axis must be 0, 1 or 2, got {axis}")
    return _builder().value("num_programs", [], TileType(i32), axis=axis)


@builtin
def arange(start, end=None) -> Tile:
    if end is None:
        start, end = 0, start
    start, end = int(getattr(start, "value", start)), int(getattr(end, "value", end))
    if end <= start:
        _error(f"arange({start}, {end}) is empty")
    return _builder().value("arange", [], TileType(i32, (end - start,)), start=start, end=end)


def _shape_arg(shape):
    if isinstance(shape, constexpr):
        shape = shape.value
    if isinstance(shape, int):
        return (shape,)
    return tuple(int(getattr(s, "value", s)) for s in shape)


@builtin
def full(shape, value, dtype=f32) -> Tile:
    dtype = getattr(dtype, "value", dtype)
    shape = _shape_arg(shape)
    if isinstance(value, Tile):
        return broadcast_to(cast(value, dtype), shape)
    return _const(value, dtype, shape)


@builtin
def zeros(shape, dtype=f32) -> Tile:
    return full(shape, 0, dtype)


@builtin
def load(pointer, mask=None, other=None) -> Tile:
    pointer = to_tile(pointer)
    if not pointer.type.is_ptr:
        _error(f"load needs a pointer, got {pointer.type}")
    shape = pointer.shape
    elem = pointer.dtype.elem
    ops = [pointer]
    if mask is not None:
        mask = to_tile(mask)
        shape = broadcast_shapes(shape, mask.shape)
        ops = [broadcast_to(pointer, shape), broadcast_to(cast(mask, i1), shape)]
        if other is not None:
            ops.append(broadcast_to(cast(to_tile(other, dtype=elem), elem), shape))
    elif other is not None:
        _error("load: `other` needs a `mask`")
    return _builder().value("load", ops, TileType(elem, shape))


@builtin
def tma(tile, tensor_map, row, col) -> Tile:
    """`tile` (a 2-D tile just loaded) as the box at (row, col) of a tensor map: the kernel's promise that
    `tensor_map` (an i64: the global address of a 128-byte CUtensorMap, cuTensorMapEncodeTiled) describes the
    same elements, rows past the map's last one and masked-off elements reading zero. Targets with a tensor
    memory accelerator (sm_90+, kernels launched with the `tma` option) may copy the box into shared memory
    with one bulk copy instead of the loads (backends/nvidia/staging.py); everywhere else it is `tile` itself."""
    tile = to_tile(tile)
    if len(tile.shape) != 2:
        _error(f"tma needs a 2-D tile, got shape {tile.shape}")
    ops = [tile, cast(to_tile(tensor_map), i64), cast(to_tile(row), i32), cast(to_tile(col), i32)]
    if any(o.shape for o in ops[1:]):
        _error("tma: the tensor map, row and col must be scalars")
    return _builder().value("tma", ops, tile.type)


@builtin
def prefetch(pointer, locality=3, nbytes=None) -> None:
    """Hints that the memory a pointer tile addresses will be read soon (one cache-line prefetch per 64
    bytes of each row). Never faults, so it may address past the end of an array (e.g. the next block
    of a loop). The pointer tile must be contiguous along its last axis (or a scalar pointer).
    locality as LLVM's: 3 = into every cache level (x86 prefetcht0), 2 = L2 and out (prefetcht1), 1 = the
    last level (prefetcht2), 0 = non-temporal. Prefetching more than L1 holds is better done at 2.

    With `nbytes` (a compile-time multiple of 16) each pointer of the tile, in any layout, starts a run of
    nbytes contiguous bytes, 16-byte aligned (e.g. the weight rows a GEMV program will stream): GPUs with bulk
    copies (sm_90+) fetch each run into L2 with one instruction; elsewhere (CPU tiers, other GPUs) this form is
    ignored. Never faults either."""
    pointer = to_tile(pointer)
    if not pointer.type.is_ptr:
        _error(f"prefetch needs a pointer, got {pointer.type}")
    locality = getattr(locality, "value", locality)
    if locality not in (0, 1, 2, 3):
        _error(f"prefetch locality must be a compile-time 0, 1, 2 or 3, got {locality!r}")
    attrs = {"locality": int(locality)}
    if nbytes is not None:
        nbytes = getattr(nbytes, "value", nbytes)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0 or nbytes % 16:
            _error(f"prefetch nbytes must be a compile-time positive multiple of 16, got {nbytes!r}")
        attrs["nbytes"] = int(nbytes)
    _builder().op("prefetch", [pointer.value], [], attrs)


@builtin
def store(pointer, value, mask=None) -> None:
    pointer = to_tile(pointer)
    if not pointer.type.is_ptr:
        _error(f"store needs a pointer, got {pointer.type}")
    elem = pointer.dtype.elem
    value = to_tile(value, dtype=elem)
    shape = broadcast_shapes(pointer.shape, value.shape)
    ops = [broadcast_to(pointer, shape), broadcast_to(cast(value, elem), shape)]
    if mask is not None:
        mask = to_tile(mask)
        shape2 = broadcast_shapes(shape, mask.shape)
        if shape2 != shape:
            ops = [broadcast_to(ops[0], shape2), broadcast_to(ops[1], shape2)]
        ops.append(broadcast_to(cast(mask, i1), shape2))
    _builder().op("store", [o.value for o in ops], [])


@builtin
def where(cond, a, b) -> Tile:
    cond = to_tile(cond)
    if isinstance(a, Tile) or isinstance(b, Tile):
        a, b = _binary_operands(a, b)
    else:
        a, b = _binary_operands(to_tile(a), b)
    shape = broadcast_shapes(cond.shape, a.shape)
    return _builder().value("select", [broadcast_to(cast(cond, i1), shape), broadcast_to(a, shape),
                                       broadcast_to(b, shape)], a.type.with_shape(shape))


@builtin
def maximum(a, b) -> Tile:
    a, b = getattr(a, "value", a) if isinstance(a, constexpr) else a, getattr(b, "value", b) if isinstance(b, constexpr) else b
    if not isinstance(a, Tile) and not isinstance(b, Tile):
        return _py.max(a, b)          # both compile-time: fold
    return binary("max", a, b)


@builtin
def minimum(a, b) -> Tile:
    a, b = getattr(a, "value", a) if isinstance(a, constexpr) else a, getattr(b, "value", b) if isinstance(b, constexpr) else b
    if not isinstance(a, Tile) and not isinstance(b, Tile):
        return _py.min(a, b)
    return binary("min", a, b)


@builtin
def fma(a, b, c) -> Tile:
    a, b = _binary_operands(a, b)
    a, c = _binary_operands(a, c)
    a, b = _binary_operands(a, b)
    return _builder().value("fma", [a, b, c], a.type)


def _math(name):
    def f(x):
        return unary(name, x)
    f.__name__ = name
    f._jk_builtin = True
    return f


exp, exp2, log, log2, sqrt, rsqrt, tanh, sigmoid, floor, ceil, erf, sin, cos = (
    _math(n) for n in ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "floor", "ceil", "erf",
                       "sin", "cos"))
# e^x by the target's approximate hardware exponential where it has one (NVIDIA: ex2.approx of x log2(e), ~2^-21
# relative for the softmax range; what FlashAttention computes), elsewhere exactly `exp`. For online softmax
# statistics, where a kernel's callers compare its bits only with its own (decode vs prefill attention).
exp_fast = _math("exp_fast")


@builtin
def abs(x) -> Tile:  # noqa: A001
    x = to_tile(x)
    return _builder().value("unary", [x], x.type, op="abs")


def _axis(x: Tile, axis) -> int:
    axis = getattr(axis, "value", axis)
    if axis is None:
        return -1
    axis = int(axis)
    if axis < 0:
        axis += len(x.shape)
    if not 0 <= axis < len(x.shape):
        _error(f"axis {axis} out of range for shape {x.shape}")
    return axis


def _reduce(kind: str, x, axis=None, keep_dims=False) -> Tile:
    x = to_tile(x)
    if x.type.is_scalar:
        return x
    if axis is None or getattr(axis, "value", axis) is None:
        x = reshape(x, (x.numel,))
        axis = 0
    ax = _axis(x, axis)
    if kind == "sum" and x.dtype in (f16, bf16):
        x = cast(x, f32)       # accumulate half inputs in f32
    if kind == "sum" and x.dtype.is_bool:
        x = cast(x, i32)
    shape = x.shape[:ax] + x.shape[ax + 1:]
    out = _builder().value("reduce", [x], x.type.with_shape(shape), kind=kind, axis=ax)
    if keep_dims:
        out = reshape(out, x.shape[:ax] + (1,) + x.shape[ax + 1:])
    return out


@builtin
def sum(x, axis=None, keep_dims=False) -> Tile:  # noqa: A001
    return _reduce("sum", x, axis, keep_dims)


@builtin
def max(x, axis=None, keep_dims=False) -> Tile:  # noqa: A001
    return _reduce("max", x, axis, keep_dims)


@builtin
def min(x, axis=None, keep_dims=False) -> Tile:  # noqa: A001
    return _reduce("min", x, axis, keep_dims)


def _argreduce(kind, x, axis):
    x = to_tile(x)
    if axis is None:
        x = reshape(x, (x.numel,))
        axis = 0
    ax = _axis(x, axis)
    shape = x.shape[:ax] + x.shape[ax + 1:]
    return _builder().value("argreduce", [x], TileType(i32, shape), kind=kind, axis=ax)


@builtin
def argmax(x, axis=None) -> Tile:
    """Index of the first maximum along `axis` (i32)."""
    return _argreduce("argmax", x, axis)


@builtin
def argmin(x, axis=None) -> Tile:
    return _argreduce("argmin", x, axis)


@builtin
def dot(a, b, acc=None, out_dtype=None) -> Tile:
    """(M, K) x (K, N) -> (M, N), accumulated in f32 (i32 for integer inputs, or `out_dtype`), plus `acc`.

    The inputs keep their dtypes (bf16/f16/i8 in, f32/i32 accumulate) and `acc` is an operand of the op, as
    matrix units take them; each backend widens inside its own lowering. Inputs of two different float
    dtypes are both widened to the accumulator type first."""
    a, b = to_tile(a), to_tile(b)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
        _error(f"dot needs (M, K) x (K, N) tiles, got {a.shape} x {b.shape}")
    if a.dtype.is_int != b.dtype.is_int or a.dtype.is_bool or b.dtype.is_bool:
        _error(f"dot needs two float or two integer tiles, got {a.dtype} x {b.dtype}")
    out = getattr(out_dtype, "value", out_dtype)
    if out is None:
        out = i32 if a.dtype.is_int else f32
    if not isinstance(out, DType) or out.is_int != a.dtype.is_int or out.bits < 32:
        _error(f"dot out_dtype must be f32/f64 for float inputs or i32/i64 for integer inputs, got {out_dtype!r}")
    if a.dtype != b.dtype:
        a, b = cast(a, out), cast(b, out)
    shape = (a.shape[0], b.shape[1])
    operands = [a, b]
    if acc is not None:
        operands.append(broadcast_to(cast(to_tile(acc), out), shape))
    return _builder().value("dot", operands, TileType(out, shape))


@builtin
def dot4(a, b, axis=None) -> Tile:
    """Sums of products of each group of 4 adjacent elements along the last axis: (..., K) -> (..., K/4) i32.

    `a` is u8 or i8, `b` is i8. This is the shape of x86's pmaddubsw+pmaddwd / VNNI vpdpbusd and ARM's sdot, so
    quantised dot products lower to those instructions on tiers that have them. For u8 `a` the caller must keep
    a*b pair sums inside int16 (true for 4-bit weights against int8 activations, and for |a| <= 127 signed).

    `axis` (compile-time, not the last axis) also sums the results over that axis of the inputs:
    (..., n, ..., K) -> (..., ..., K/4), i.e. jk.sum(jk.dot4(a, b), axis) computed with fewer instructions: x86
    adds the n pmaddubsw results in int16 and widens once (one pmaddwd instead of n, and no i32 adds). So the
    caller must keep the sums of 2*n products inside int16 (4-bit weights against int8 activations: n <= 8).
    """
    a, b = to_tile(a), to_tile(b)
    if a.shape != b.shape or not a.shape or a.shape[-1] % 4:
        _error(f"dot4 needs equal shapes with a last axis divisible by 4, got {a.shape} and {b.shape}")
    if a.dtype not in (i8, u8) or b.dtype != i8:
        _error(f"dot4 takes (u8|i8, i8) tiles, got ({a.dtype}, {b.dtype})")
    if axis is None:
        return _builder().value("dot4", [a, b], TileType(i32, a.shape[:-1] + (a.shape[-1] // 4,)))
    ax = getattr(axis, "value", axis)
    if not isinstance(ax, int) or not -len(a.shape) <= ax < len(a.shape):
        _error(f"dot4 axis must be a compile-time axis of the {len(a.shape)}-D inputs, got {axis!r}")
    ax = ax + len(a.shape) if ax < 0 else ax
    if ax == len(a.shape) - 1:
        _error("dot4 axis cannot be the last axis (the groups of 4 are summed along it already)")
    rshape = a.shape[:ax] + a.shape[ax + 1:-1] + (a.shape[-1] // 4,)
    return _builder().value("dot4", [a, b], TileType(i32, rshape), axis=ax)


@builtin
def dp4a(a, b, c) -> Tile:
    """c + the sum of the products of the four bytes of each 32-bit element of `a` and `b` (elementwise, i32).

    `a` and `b` are i32 or u32 tiles of four packed bytes each (byte 0 the lowest): a u32 operand's bytes are
    unsigned (0..255), an i32 operand's signed (-128..127). `c` is i32 (a Python int adopts that type). The sum
    is exact in i32 (it wraps only where c does), so every target gives the same bits: one PTX dp4a per element
    on CUDA, byte extracts, multiplies and adds elsewhere. Unlike `dot4` the bytes never leave their element,
    so on a GPU it is a register operation (dot4's groups of 4 tile elements may live in other threads)."""
    a, b = to_tile(a), to_tile(b)
    if a.dtype not in (i32, u32) or b.dtype not in (i32, u32):
        _error(f"dp4a takes i32 / u32 tiles of packed bytes, got ({a.dtype}, {b.dtype})")
    c = c if isinstance(c, Tile) else _const(int(getattr(c, "value", c)), i32)
    if c.dtype != i32:
        _error(f"dp4a's accumulator must be i32, got {c.dtype}")
    shape = broadcast_shapes(broadcast_shapes(a.shape, b.shape), c.shape)
    return _builder().value("dp4a", [broadcast_to(a, shape), broadcast_to(b, shape), broadcast_to(c, shape)],
                            TileType(i32, shape), a_signed=a.dtype == i32, b_signed=b.dtype == i32)


@builtin
def madd(a, b) -> Tile:
    """Sums of products of adjacent pairs along the last axis: (..., K) x (..., K) -> (..., K/2).

    (u8, i8) -> i16, saturated to [-32768, 32767] (x86 pmaddubsw); (i16, i16) -> i32 (pmaddwd; two products
    of -32768 wrap). The two stages of `dot4`, for kernels that add int16 partial sums of different tiles
    before widening them (the caller keeps those sums inside int16)."""
    a, b = to_tile(a), to_tile(b)
    if a.shape != b.shape or not a.shape or a.shape[-1] % 2:
        _error(f"madd needs equal shapes with an even last axis, got {a.shape} and {b.shape}")
    if (a.dtype, b.dtype) == (u8, i8):
        rt = i16
    elif (a.dtype, b.dtype) == (i16, i16):
        rt = i32
    else:
        _error(f"madd takes (u8, i8) or (i16, i16) tiles, got ({a.dtype}, {b.dtype})")
    return _builder().value("madd", [a, b], TileType(rt, a.shape[:-1] + (a.shape[-1] // 2,)))


@builtin
def barrier() -> None:
    """Orders memory within a program: every store before it is seen by every load after it, and no store
    after it overtakes a load before it (a CTA barrier on GPUs; nothing on the CPU, where a program is one
    thread). The lowering inserts these where program order needs them; this is the explicit form."""
    _builder().op("barrier", [], [])


@builtin
def trans(x, axes=None) -> Tile:
    """Transpose: a 2-D tile's two axes, or with `axes` (a compile-time permutation, as numpy.transpose) any
    tile's axes: result axis i is input axis axes[i]."""
    x = to_tile(x)
    if axes is None:
        if len(x.shape) != 2:
            _error(f"trans needs a 2-D tile (or axes=), got {x.shape}")
        return _builder().value("trans", [x], x.type.with_shape((x.shape[1], x.shape[0])))
    axes = getattr(axes, "value", axes)
    try:
        perm = tuple(int(getattr(a, "value", a)) for a in axes)
    except (TypeError, ValueError):
        _error(f"trans axes must be a compile-time tuple of ints, got {axes!r}")
    if sorted(perm) != list(range(len(x.shape))):
        _error(f"trans axes {perm} are not a permutation of the {len(x.shape)} axes of a {x.shape} tile")
    return _builder().value("trans", [x], x.type.with_shape(tuple(x.shape[p] for p in perm)), perm=perm)


@builtin
def expand_dims(x, axis) -> Tile:
    x = to_tile(x)
    axis = int(getattr(axis, "value", axis))
    if axis < 0:
        axis += len(x.shape) + 1
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


def cdiv(a, b):
    """Ceiling division; folds at trace time for Python ints."""
    if isinstance(a, constexpr):
        a = a.value
    if isinstance(b, constexpr):
        b = b.value
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return (a + b - 1) // b


def static_assert(cond, msg: str = "") -> None:
    if isinstance(cond, Tile):
        _error("static_assert needs a compile-time condition")
    if not cond:
        _error(f"static_assert failed: {msg}" if msg else "static_assert failed")


class static_range:
    """A loop the frontend unrolls at trace time (bounds must be compile-time ints)."""

    def __init__(self, start, stop=None, step=1):
        if stop is None:
            start, stop = 0, start
        self.range = range(int(getattr(start, "value", start)), int(getattr(stop, "value", stop)),
                           int(getattr(step, "value", step)))


builtin(broadcast_to)
builtin(reshape)
builtin(cast)


class _TargetProxy:
    """`jk.target` inside a kernel: the Target being compiled for, read at trace time.

    `if jk.target.has("avx512f"):` or `jk.target.vector_bits` fold while tracing, so per-target
    branches cost nothing at run time (each target compiles its own specialisation anyway).
    """

    def __getattr__(self, name):
        return getattr(_builder().target, name)

    def __repr__(self):
        b = getattr(_state, "builder", None)
        return f"jk.target({b.target.name if b else 'outside a kernel'})"


target = _TargetProxy()
