"""Python AST -> jitkern IR.

The frontend evaluates a kernel's AST: compile-time values (Python numbers, constexpr parameters, the
target) are ordinary Python objects and fold away; run-time values are `language.Tile`s whose operators
append ops to the IR. Control flow on compile-time values is resolved while tracing; `if` on a run-time
scalar becomes an IR `if`, `for ... in range(...)` an IR `for` with loop-carried variables (names assigned
in the body that existed before it), `for ... in jk.static_range(...)` is unrolled. Calls to other
`@jitkern.jit` functions (also ones passed as constexpr parameters: prologue/epilogue fusion) are inlined.
Errors carry the user's file:line and source text, never compiler frames.
"""
from __future__ import annotations

import ast
import builtins
import operator
from typing import Any

from . import ir
from . import language as L
from .language import CompilationError, Tile, constexpr

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class Traceable:
    """The base of what kernels call and the tracer inlines (jit.py's JitFunction, kernels included): the tracer
    and the compile driver recognise such functions by it without importing jit.py, which builds on them."""
    __slots__ = ()


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class _Undefined:
    """Marks a name that became undefined (e.g. defined in only one branch of a run-time `if`)."""

    def __init__(self, why):
        self.why = why


def assigned_names(stmts) -> list:
    """Names bound anywhere in these statements (for loop-carried variables and if-merges)."""
    out = []

    def add(t):
        if isinstance(t, ast.Name):
            if t.id not in out:
                out.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                add(e)
        elif isinstance(t, ast.Starred):
            add(t.value)

    for node in stmts:
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    add(t)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                add(n.target)
            elif isinstance(n, ast.For):
                add(n.target)
    return out


def _carriable_tuple(v) -> bool:
    """A non-empty tuple of run-time tiles and numbers, which a run-time loop can carry element-wise."""
    return isinstance(v, tuple) and len(v) > 0 and all(
        (isinstance(e, Tile) and not e.type.is_ptr) or isinstance(e, (bool, int, float)) for e in v) \
        and any(isinstance(e, Tile) for e in v)


class Tracer:
    def __init__(self, jitfn, builder: L.Builder, scope: dict):
        self.fn = jitfn
        self.b = builder
        self.scope = scope
        self.runtime_depth = 0          # >0 inside a run-time if/for (no `return` there)

    # ------------------------------------------------------------------------------------ utilities
    def loc(self, node) -> ir.Loc:
        line = self.fn.first_line + getattr(node, "lineno", 1) - 1
        text = ""
        idx = getattr(node, "lineno", 1) - 1
        if 0 <= idx < len(self.fn.source_lines):
            text = self.fn.source_lines[idx]
        return ir.Loc(self.fn.filename, line, getattr(node, "col_offset", 0), text)

    def error(self, node, msg):
        raise CompilationError(msg, self.loc(node))

    def lookup(self, node, name):
        if name in self.scope:
            v = self.scope[name]
            if isinstance(v, _Undefined):
                self.error(node, f"name '{name}' is not defined here: {v.why}")
            return v
        g = self.fn.globals_and_closure()
        if name in g:
            return g[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        self.error(node, f"name '{name}' is not defined")

    # ----------------------------------------------------------------------------------- statements
    def run_block(self, stmts):
        for s in stmts:
            self.stmt(s)

    def stmt(self, node):
        self.b.loc = self.loc(node)
        try:
            method = getattr(self, "stmt_" + type(node).__name__, None)
            if method is None:
                self.error(node, f"unsupported statement in a kernel: {type(node).__name__}")
            method(node)
        except (CompilationError, _Return):
            raise
        except Exception as e:  # any Python error while tracing becomes an error at the user's line
            raise CompilationError(f"{type(e).__name__}: {e}", self.loc(node)) from None

    def stmt_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        self.expr(node.value)

    def stmt_Pass(self, node):
        pass

    def stmt_Assign(self, node):
        value = self.expr(node.value)
        for t in node.targets:
            self.assign(t, value)

    def stmt_AnnAssign(self, node):
        if node.value is not None:
            self.assign(node.target, self.expr(node.value))

    def stmt_AugAssign(self, node):
        cur = self.expr(ast.Name(id=node.target.id, ctx=ast.Load(), lineno=node.lineno, col_offset=0)) \
            if isinstance(node.target, ast.Name) else self.error(node, "only names can be augmented-assigned")
        self.assign(node.target, _BINOPS[type(node.op)](cur, self.expr(node.value)))

    def assign(self, target, value):
        if isinstance(target, ast.Name):
            if isinstance(value, constexpr):
                value = value.value
            self.scope[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            vals = list(value)
            if len(vals) != len(target.elts):
                self.error(target, f"cannot unpack {len(vals)} values into {len(target.elts)} names")
            for t, v in zip(target.elts, vals):
                self.assign(t, v)
        else:
            self.error(target, "only assignments to names and tuples of names are supported "
                               "(write memory with jk.store)")

    def stmt_Assert(self, node):
        cond = self.expr(node.test)
        msg = self.expr(node.msg) if node.msg is not None else ""
        L.static_assert(cond, msg)

    def stmt_Return(self, node):
        if self.runtime_depth:
            self.error(node, "`return` inside run-time control flow is not supported; assign a variable instead")
        raise _Return(self.expr(node.value) if node.value is not None else None)

    def stmt_While(self, node):
        self.error(node, "`while` loops are not supported in kernels; use `for i in range(...)`")

    def stmt_Break(self, node):
        self.error(node, "`break` is not supported in kernels")

    def stmt_Continue(self, node):
        self.error(node, "`continue` is not supported in kernels")

    def stmt_If(self, node):
        cond = self.expr(node.test)
        if isinstance(cond, constexpr):
            cond = cond.value
        if not isinstance(cond, Tile):
            self.run_block(node.body if cond else node.orelse)
            return
        if not cond.type.is_scalar:
            self.error(node, f"`if` needs a scalar condition, got a tile of shape {cond.shape}; use jk.where")
        self.runtime_if(node, cond)

    def runtime_if(self, node, cond: Tile):
        cond = L.cast(cond, ir.i1)
        before = dict(self.scope)
        branches = []
        for stmts in (node.body, node.orelse):
            self.scope = dict(before)
            block = ir.Block()
            self.b.block_stack.append(block)
            self.runtime_depth += 1
            try:
                self.run_block(stmts)
            finally:
                self.runtime_depth -= 1
                self.b.block_stack.pop()
            branches.append((block, self.scope))
        (tblock, tscope), (eblock, escope) = branches
        merged, names = {}, []
        for name in set(tscope) | set(escope):
            tv, ev = tscope.get(name, _Undefined("")), escope.get(name, _Undefined(""))
            if tv is ev:
                merged[name] = tv
                continue
            if isinstance(tv, _Undefined) or isinstance(ev, _Undefined):
                merged[name] = _Undefined("it is assigned in only one branch of a run-time `if`")
                continue
            if not isinstance(tv, Tile) and not isinstance(ev, Tile):
                if type(tv) is type(ev) and tv == ev:
                    merged[name] = tv
                    continue
                if not isinstance(tv, (int, float, bool)) or not isinstance(ev, (int, float, bool)):
                    merged[name] = _Undefined("its compile-time value differs between the branches of a run-time `if`")
                    continue
            names.append(name)
        self.b.loc = self.loc(node)
        yields_t, yields_e, types = [], [], []
        for name in sorted(names):
            tv, ev = tscope[name], escope[name]
            ttype = self._merge_type(node, name, tv, ev)
            yields_t.append(self._coerce_into(tblock, tv, ttype))
            yields_e.append(self._coerce_into(eblock, ev, ttype))
            types.append(ttype)
        for block, ys in ((tblock, yields_t), (eblock, yields_e)):
            block.ops.append(ir.Op("yield", [y.value for y in ys], [], loc=self.loc(node)))
        op = self.b.op("if", [cond.value], types, regions=[tblock, eblock])
        self.scope = merged
        for name, r in zip(sorted(names), op.results):
            self.scope[name] = Tile(r)

    def _merge_type(self, node, name, a, b) -> ir.TileType:
        ta = a.type if isinstance(a, Tile) else None
        tb = b.type if isinstance(b, Tile) else None
        if ta is not None and tb is not None:
            if ta != tb:
                if ta.is_ptr or tb.is_ptr or ta.shape != tb.shape:
                    self.error(node, f"'{name}' is {ta} in one branch and {tb} in the other")
                return ta.with_elem(L.promote(ta.elem, tb.elem))
            return ta
        t = ta or tb
        if t is None:
            v = a
            return ir.TileType(ir.f32 if isinstance(v, float) else ir.i1 if isinstance(v, bool) else ir.i32)
        return t

    def _coerce_into(self, block, v, ttype: ir.TileType) -> Tile:
        """Converts `v` to `ttype`, appending any needed ops at the end of `block`."""
        self.b.block_stack.append(block)
        try:
            t = L.to_tile(v, dtype=ttype.elem if not ttype.is_ptr else None)
            if not ttype.is_ptr and t.dtype != ttype.elem:
                t = L.cast(t, ttype.elem)
            if t.shape != ttype.shape:
                t = L.broadcast_to(t, ttype.shape)
            return t
        finally:
            self.b.block_stack.pop()

    def stmt_For(self, node):
        if node.orelse:
            self.error(node, "`for ... else` is not supported")
        it = node.iter
        if not isinstance(it, ast.Call):
            self.error(node, "kernels loop only over range(...) or jk.static_range(...)")
        callee = self.expr(it.func)
        args = [self.expr(a) for a in it.args]
        if isinstance(callee, type) and issubclass(callee, L.static_range):
            for i in L.static_range(*args).range:
                self.assign(node.target, i)
                self.run_block(node.body)
            return
        if callee is not range:
            self.error(node, "kernels loop only over range(...) or jk.static_range(...)")
        if not isinstance(node.target, ast.Name):
            self.error(node, "the loop variable must be a single name")
        args = [a.value if isinstance(a, constexpr) else a for a in args]
        if len(args) == 1:
            lb, ub, step = 0, args[0], 1
        elif len(args) == 2:
            (lb, ub), step = args, 1
        else:
            lb, ub, step = args
        if isinstance(step, Tile):
            self.error(node, "the range step must be a compile-time integer")
        if step <= 0:
            self.error(node, "the range step must be positive")
        self.runtime_for(node, lb, ub, step)

    def runtime_for(self, node, lb, ub, step):
        idx_t = ir.i32
        for v in (lb, ub):
            if isinstance(v, Tile):
                if v.type.is_ptr or not v.type.is_scalar or not v.dtype.is_int:
                    self.error(node, f"range bounds must be integer scalars, got {v.type}")
                idx_t = L.promote(idx_t, v.dtype)
            elif not -2**31 <= v < 2**31:
                idx_t = ir.i64
        lbv, ubv = L.cast(L.to_tile(lb, dtype=idx_t), idx_t), L.cast(L.to_tile(ub, dtype=idx_t), idx_t)
        stepv = L.to_tile(step, dtype=idx_t)
        names = [n for n in assigned_names(node.body) if n in self.scope and n != node.target.id
                 and not isinstance(self.scope[n], _Undefined)]
        before = dict(self.scope)
        # A tuple of tiles/numbers (e.g. per-head accumulators built with jk.static_range) is carried
        # element by element under the hidden names 'name#i'; the body sees and rebinds the tuple.
        tuples = {n: len(before[n]) for n in names if _carriable_tuple(before[n])}
        for n, k in tuples.items():
            for i in range(k):
                before[f"{n}#{i}"] = before[n][i]
        names = [e for n in names for e in ([f"{n}#{i}" for i in range(tuples[n])] if n in tuples else [n])]
        carried_types = {}
        for n in names:
            v = before[n]
            if isinstance(v, Tile):
                carried_types[n] = v.type
            elif isinstance(v, (bool, int, float)):
                carried_types[n] = L.to_tile(v).type
            # other compile-time values must not change inside the loop (checked after tracing)
        names = [n for n in names if n in carried_types]
        # Trace the body; if a carried variable comes out with another type (e.g. `acc = 0.0` then
        # `acc += tile`), widen its initial type and trace again.
        for attempt in range(3):
            block, out_scope, iv, args = self._trace_loop_body(node, idx_t, names, carried_types, before, tuples)
            changed = False
            for n in names:
                v = out_scope.get(n)
                if not isinstance(v, Tile):
                    continue
                t0 = carried_types[n]
                if v.type != t0:
                    if v.type.is_ptr != t0.is_ptr:
                        self.error(node, f"loop-carried '{n}' changes from {t0} to {v.type}")
                    shape = L.broadcast_shapes(t0.shape, v.type.shape) if not t0.is_ptr else v.type.shape
                    elem = t0.elem if t0.is_ptr else L.promote(t0.elem, v.type.elem)
                    nt = ir.TileType(elem, shape)
                    if nt != t0:
                        carried_types[n] = nt
                        changed = True
            if not changed:
                break
        else:
            self.error(node, "loop-carried variable types do not settle")
        for n, v in out_scope.items():
            if n not in names and n not in tuples and n in before and v is not before[n] and not isinstance(v, Tile) \
                    and not isinstance(v, _Undefined) \
                    and not (isinstance(v, type(before[n])) and v == before[n]):
                self.error(node, f"compile-time value '{n}' changes inside a run-time loop")
        self.b.loc = self.loc(node)
        ys = [self._coerce_into(block, out_scope[n], carried_types[n]) for n in names]
        block.ops.append(ir.Op("yield", [y.value for y in ys], [], loc=self.loc(node)))
        inits = [self._coerce_into(self.b.block, before[n], carried_types[n]) for n in names]
        op = self.b.op("for", [lbv.value, ubv.value, stepv.value] + [i.value for i in inits],
                       [carried_types[n] for n in names], regions=[block])
        self.scope = dict(before)
        for n, r in zip(names, op.results):
            self.scope[n] = Tile(r)
        for n, k in tuples.items():
            self.scope[n] = tuple(self.scope.pop(f"{n}#{i}") for i in range(k))
        for n in assigned_names(node.body):
            if n not in before and n not in names:
                self.scope[n] = _Undefined("it is only assigned inside a run-time loop")
        self.scope[node.target.id] = _Undefined("the loop variable of a run-time loop is not defined after it")

    def _trace_loop_body(self, node, idx_t, names, carried_types, before, tuples=None):
        iv = ir.Value(ir.TileType(idx_t), name=node.target.id)
        args = [ir.Value(carried_types[n], name=n) for n in names]
        block = ir.Block(args=[iv] + args)
        self.scope = dict(before)
        self.scope[node.target.id] = Tile(iv)
        for n, a in zip(names, args):
            self.scope[n] = Tile(a)
        for n, k in (tuples or {}).items():
            self.scope[n] = tuple(self.scope[f"{n}#{i}"] for i in range(k))
        self.b.block_stack.append(block)
        self.runtime_depth += 1
        try:
            self.run_block(node.body)
        finally:
            self.runtime_depth -= 1
            self.b.block_stack.pop()
        out = self.scope
        for n, k in (tuples or {}).items():
            t = out.get(n)
            if not isinstance(t, tuple) or len(t) != k:
                self.error(node, f"loop-carried tuple '{n}' must stay a tuple of {k} values inside the loop")
            for i in range(k):
                out[f"{n}#{i}"] = t[i]
        self.scope = dict(before)
        return block, out, iv, args

    # ---------------------------------------------------------------------------------- expressions
    def expr(self, node) -> Any:
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            self.error(node, f"unsupported expression in a kernel: {type(node).__name__}")
        return method(node)

    def expr_Constant(self, node):
        return node.value

    def expr_Name(self, node):
        return self.lookup(node, node.id)

    def expr_Attribute(self, node):
        obj = self.expr(node.value)
        if isinstance(obj, constexpr):
            obj = obj.value
        try:
            return getattr(obj, node.attr)
        except AttributeError:
            self.error(node, f"{type(obj).__name__} has no attribute '{node.attr}'")

    def expr_Tuple(self, node):
        return tuple(self.expr(e) for e in node.elts)

    def expr_List(self, node):
        return [self.expr(e) for e in node.elts]

    def expr_Slice(self, node):
        return slice(*(self.expr(x) if x is not None else None for x in (node.lower, node.upper, node.step)))

    def expr_Subscript(self, node):
        obj = self.expr(node.value)
        idx = self.expr(node.slice)
        if isinstance(obj, constexpr):
            obj = obj.value
        return obj[idx]

    def expr_JoinedStr(self, node):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append(format(self.expr(v.value), self.expr(v.format_spec) if v.format_spec else ""))
        return "".join(parts)

    def expr_FormattedValue(self, node):
        return format(self.expr(node.value))

    def expr_BinOp(self, node):
        a, b = self.expr(node.left), self.expr(node.right)
        a = a.value if isinstance(a, constexpr) else a
        b = b.value if isinstance(b, constexpr) else b
        op = _BINOPS.get(type(node.op))
        if op is None or (op is operator.pow and (isinstance(a, Tile) or isinstance(b, Tile))):
            self.error(node, f"unsupported operator {type(node.op).__name__}")
        return op(a, b)

    def expr_UnaryOp(self, node):
        v = self.expr(node.operand)
        v = v.value if isinstance(v, constexpr) else v
        if isinstance(node.op, ast.Not):
            if isinstance(v, Tile):
                return L.compare("eq", v, 0) if not v.dtype.is_bool else ~v
            return not v
        return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[type(node.op)](v)

    def expr_BoolOp(self, node):
        vals = []
        for e in node.values:
            v = self.expr(e)
            v = v.value if isinstance(v, constexpr) else v
            if not isinstance(v, Tile):
                # short-circuit on compile-time values, as Python does
                if isinstance(node.op, ast.And) and not v:
                    return v if not vals else False
                if isinstance(node.op, ast.Or) and v:
                    return v if not vals else True
                continue
            vals.append(L.cast(v, ir.i1))
        if not vals:
            return isinstance(node.op, ast.And)
        out = vals[0]
        for v in vals[1:]:
            out = (out & v) if isinstance(node.op, ast.And) else (out | v)
        return out

    def expr_Compare(self, node):
        left = self.expr(node.left)
        result = None
        for opnode, rnode in zip(node.ops, node.comparators):
            right = self.expr(rnode)
            a = left.value if isinstance(left, constexpr) else left
            b = right.value if isinstance(right, constexpr) else right
            r = _CMPOPS[type(opnode)](a, b)
            result = r if result is None else (result & r if isinstance(r, Tile) or isinstance(result, Tile)
                                               else result and r)
            left = right
        return result

    def expr_IfExp(self, node):
        cond = self.expr(node.test)
        cond = cond.value if isinstance(cond, constexpr) else cond
        if isinstance(cond, Tile):
            return L.where(cond, self.expr(node.body), self.expr(node.orelse))
        return self.expr(node.body) if cond else self.expr(node.orelse)

    def expr_Call(self, node):
        fn = self.expr(node.func)
        if isinstance(fn, constexpr):
            fn = fn.value
        args = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                args.extend(self.expr(a.value))
            else:
                args.append(self.expr(a))
        kwargs = {k.arg: self.expr(k.value) for k in node.keywords if k.arg is not None}
        if isinstance(fn, Traceable):
            return self.inline_call(node, fn, args, kwargs)
        if getattr(fn, "_jk_builtin", False):
            return fn(*args, **kwargs)
        any_tile = any(isinstance(a, Tile) for a in list(args) + list(kwargs.values()))
        if fn is builtins.min and any_tile:
            out = args[0]
            for a in args[1:]:
                out = L.minimum(out, a)
            return out
        if fn is builtins.max and any_tile:
            out = args[0]
            for a in args[1:]:
                out = L.maximum(out, a)
            return out
        if fn is builtins.abs and any_tile:
            return L.abs(args[0])
        if any_tile and fn not in (isinstance, len, getattr, hasattr):
            self.error(node, f"cannot call {getattr(fn, '__name__', fn)!r} on run-time tiles inside a kernel")
        args = [a.value if isinstance(a, constexpr) else a for a in args]
        return fn(*args, **kwargs)

    def inline_call(self, node, fn, args, kwargs):
        bound = fn.bind(args, kwargs, where=self.loc(node))
        sub = Tracer(fn, self.b, bound)
        sub.runtime_depth = 0
        saved = self.b.loc
        try:
            sub.run_block(fn.tree.body)
        except _Return as r:
            return r.value
        finally:
            self.b.loc = saved
        return None


def trace(jitfn, params: list, constexprs: dict, target, name: str) -> ir.Function:
    """Builds the IR of kernel `jitfn` for run-time params [(name, TileType)] and constexpr values."""
    b = L.Builder(target)
    body = ir.Block()
    b.block_stack.append(body)
    scope = {}
    irparams = []
    for pname, ptype in params:
        v = ir.Value(ptype, name=pname)
        irparams.append(ir.Param(pname, ptype, v))
        scope[pname] = Tile(v)
    for k, v in constexprs.items():
        scope[k] = v
    prev = getattr(L._state, "builder", None)
    L._state.builder = b
    try:
        Tracer(jitfn, b, scope).run_block(jitfn.tree.body)
    except _Return as r:
        if r.value is not None:
            raise CompilationError("a kernel cannot return a value; store results through a pointer",
                                   b.loc) from None
    finally:
        L._state.builder = prev
    fn = ir.Function(name, irparams, body, dict(constexprs), ir.Loc(jitfn.filename, jitfn.first_line))
    ir.verify(fn)
    return fn
