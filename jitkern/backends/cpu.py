"""CPU lowering: jitkern IR -> LLVM IR text for one CPU tier (x86-64 / AArch64).

A tile is one LLVM vector (row-major flattening of its shape); a scalar is an LLVM scalar. The kernel
becomes `void @name(ptr %args, i64 %begin, i64 %end)` looping over flat program ids (see the ABI in
docs/ARCHITECTURE.md). Text is emitted directly (not through llvmlite.ir) because we need vector GEPs,
masked intrinsics, string function attributes and target intrinsics that llvmlite.ir cannot express.

Memory access strategy: integer tiles carry an *affine* description (scalar base + per-axis strides) when
they are built from `arange`, broadcasts, adds and multiplications by uniform values. A load or store
whose pointer tile is unit-stride along its last axis becomes one vector load/store per row (masked when a
mask is given); anything else becomes a masked gather/scatter. Half types (f16, bf16) are kept as i16 bit
patterns in registers and widened to f32 for arithmetic (F16C instructions when the tier has them, exact
bit manipulation otherwise, so no compiler-rt helpers are needed).
"""
from __future__ import annotations

from .. import ir
from ..ir import DType
from ..errors import CompileError
from ..language import CompilationError
from .base import Backend
from .emitter import _SUFFIX, LV, PT, Aff, LlvmEmitter, _prod, elem_ty, vty


def _last_axis_splat(p: PT, shape) -> bool:
    """A pointer tile whose last axis (longer than 1) has stride 0: each row reads a single element."""
    return len(shape) >= 1 and shape[-1] > 1 and p.offs is not None and p.offs.aff is not None \
        and p.offs.aff.strides[-1] == 0


class CpuLowering(LlvmEmitter):
    """The CPU tiers: a program is one call on one thread; tiles are whole LLVM vectors in registers."""

    def __init__(self, fn: ir.Function, target):
        super().__init__(fn, target)
        self.x86 = target.arch == "x86_64" and target.name != "portable"

    # ---------------------------------------------------------------------------------------- entry
    def lower(self) -> str:
        fn = self.fn
        self.start_block("entry")
        self.emit("%empty = icmp uge i64 %begin, %end")
        self.emit("br i1 %empty, label %exit, label %prologue")
        self.start_block("prologue")
        g = []
        for i in range(3):
            p = self.val(f"getelementptr i64, ptr %args, i64 {i}", "ptr", 0)
            g.append(self.val(f"load i64, ptr {p.ref}, align 8", "i64", 0, hint="grid"))
        self.grid = g
        for k, prm in enumerate(fn.params):
            slot = self.val(f"getelementptr i64, ptr %args, i64 {3 + k}", "ptr", 0)
            t = prm.type
            if t.is_ptr:
                base = self.val(f"load ptr, ptr {slot.ref}, align 8", "ptr", 0, hint="arg")
                self.vals[prm.value.id] = PT(base.ref, t.elem.elem, None, ())
            elif t.elem.is_float:
                d = self.val(f"load double, ptr {slot.ref}, align 8", "double", 0, hint="arg")
                if t.elem == ir.f64:
                    self.vals[prm.value.id] = d
                else:
                    f = self.val(f"fptrunc double {d.ref} to float", "float", 0)
                    self.vals[prm.value.id] = f if t.elem == ir.f32 else self.from_f32(f, t.elem)
            else:
                q = self.val(f"load i64, ptr {slot.ref}, align 8", "i64", 0, hint="arg")
                et = elem_ty(t.elem)
                v = q if et == "i64" else self.val(f"trunc i64 {q.ref} to {et}", et, 0)
                v.aff = Aff(v.ref, ())
                self.vals[prm.value.id] = v
        g01 = self.val(f"mul i64 {g[0].ref}, {g[1].ref}", "i64", 0)
        self.g01 = g01
        self.emit("br label %pid_loop")
        self.start_block("pid_loop")
        self.emit("%pid = phi i64 [ %begin, %prologue ], [ %pid.next, %pid_latch ]")
        self.lower_block(fn.body)
        self.emit("br label %pid_latch")
        self.start_block("pid_latch")
        self.emit("%pid.next = add i64 %pid, 1")
        self.emit("%more = icmp ult i64 %pid.next, %end")
        self.emit("br i1 %more, label %pid_loop, label %exit")
        self.start_block("exit")
        self.emit("ret void")
        body = "\n".join(self.lines)
        # no-builtins: LLVM must not turn loops into memset/memcpy calls; a kernel object references no
        # symbol outside itself, so linking it into the process can never depend on what else is loaded
        attrs = [f'"target-cpu"="{self.target.cpu}"', '"no-builtins"']
        if self.target.features:
            attrs.append(f'"target-features"="{self.target.feature_string}"')
        for k, v in self.target.extra:
            attrs.append(f'"{k}"="{v}"')
        out = [f"; jitkern kernel {fn.name} for {self.target.name}",
               f'target triple = "{self.target.triple}"', ""]
        out += sorted(self.decls.values())
        out.append("")
        out.append(f"define void @{fn.name}(ptr noundef %args, i64 %begin, i64 %end) #0 {{")
        out.append(body)
        out.append("}")
        out.append(f"attributes #0 = {{ nounwind {' '.join(attrs)} }}")
        return "\n".join(out) + "\n"

    def op_const(self, op):
        t = op.result.type
        d = t.elem
        if d in (ir.f16, ir.bf16):
            f = self.const(float(op.attrs["value"]), "float", t.numel if t.shape else 0, t.shape)
            return self.from_f32(f, d)
        return self.const(op.attrs["value"], elem_ty(d), t.numel if t.shape else 0, t.shape)

    def op_program_id(self, op):
        ax = op.attrs["axis"]
        if ax == 0:
            r = self.val(f"urem i64 %pid, {self.grid[0].ref}", "i64", 0)
        elif ax == 1:
            q = self.val(f"udiv i64 %pid, {self.grid[0].ref}", "i64", 0)
            r = self.val(f"urem i64 {q.ref}, {self.grid[1].ref}", "i64", 0)
        else:
            r = self.val(f"udiv i64 %pid, {self.g01.ref}", "i64", 0)
        out = self.val(f"trunc i64 {r.ref} to i32", "i32", 0)
        out.aff = Aff(out.ref, ())
        return out

    def op_num_programs(self, op):
        out = self.val(f"trunc i64 {self.grid[op.attrs['axis']].ref} to i32", "i32", 0)
        out.aff = Aff(out.ref, ())
        return out

    def op_arange(self, op):
        s, e = op.attrs["start"], op.attrs["end"]
        ref = "<" + ", ".join(f"i32 {i}" for i in range(s, e)) + ">"
        return LV(ref, "i32", e - s, (e - s,), Aff(s, (1,)))

    def op_splat(self, op):
        x = self.get(op.operands[0])
        shape = op.result.type.shape
        if isinstance(x, PT):
            return PT(x.base, x.elem, self.splat(x.offs, _prod(shape), shape) if x.offs else None, shape)
        return self.splat(x, _prod(shape), shape)

    def _bcast_index(self, src_shape, dst_shape) -> list:
        src = (1,) * (len(dst_shape) - len(src_shape)) + tuple(src_shape)
        idx = []
        strides = []
        acc = 1
        for s in reversed(src):
            strides.append(acc)
            acc *= s
        strides = list(reversed(strides))
        import itertools
        for coord in itertools.product(*[range(d) for d in dst_shape]):
            idx.append(sum((c if s != 1 else 0) * st for c, s, st in zip(coord, src, strides)))
        return idx

    def _bcast_lv(self, x: LV, dst_shape) -> LV:
        if x.n == 0:
            return self.splat(x, _prod(dst_shape), dst_shape)
        out = self.shuffle(x, self._bcast_index(x.shape, dst_shape), dst_shape)
        if x.aff is not None:
            src = (1,) * (len(dst_shape) - len(x.shape)) + tuple(x.shape)
            st = (0,) * (len(dst_shape) - len(x.shape)) + tuple(x.aff.strides)
            out.aff = Aff(x.aff.base, tuple(0 if s == 1 else k for s, k in zip(src, st)))
        return out

    def op_broadcast(self, op):
        x = self.get(op.operands[0])
        shape = op.result.type.shape
        if isinstance(x, PT):
            offs = self._bcast_lv(x.offs, shape) if x.offs else None
            return PT(x.base, x.elem, offs, shape)
        return self._bcast_lv(x, shape)

    def _reshape_lv(self, x: LV, shape) -> LV:
        out = LV(x.ref, x.et, x.n, tuple(shape), None)
        if x.n == 0 and shape:
            return self.splat(x, 1, shape)
        if x.aff is not None:
            # a reshape keeps an affine form when it only inserts or removes size-1 axes
            old = [(s, k) for s, k in zip(x.shape, x.aff.strides) if s != 1]
            if [s for s in shape if s != 1] == [s for s, _ in old]:
                it = iter(k for _, k in old)
                out.aff = Aff(x.aff.base, tuple(0 if s == 1 else next(it) for s in shape))
        if not shape and x.n == 1:
            return self.extract(x, 0)
        return out

    def op_reshape(self, op):
        x = self.get(op.operands[0])
        shape = op.result.type.shape
        if isinstance(x, PT):
            return PT(x.base, x.elem, self._reshape_lv(x.offs, shape) if x.offs else None, shape)
        return self._reshape_lv(x, shape)

    def op_trans(self, op):
        x = self.get(op.operands[0])
        shape = op.operands[0].type.shape
        perm = op.attrs.get("perm", (1, 0))
        oshape = tuple(shape[p] for p in perm)
        # lane of every output element (row-major output order) in the row-major input
        istr = [_prod(shape[i + 1:]) for i in range(len(shape))]
        idx = [0]
        for p in perm:
            idx = [b + j * istr[p] for b in idx for j in range(shape[p])]
        if isinstance(x, PT):
            offs = self.shuffle(x.offs, idx, oshape) if x.offs else None
            if offs is not None and x.offs.aff is not None:
                offs.aff = Aff(x.offs.aff.base, tuple(x.offs.aff.strides[p] for p in perm))
            return PT(x.base, x.elem, offs, oshape)
        out = self.shuffle(x, idx, oshape)
        if x.aff is not None:
            out.aff = Aff(x.aff.base, tuple(x.aff.strides[p] for p in perm))
        return out

    def _row_offsets(self, p: PT, allow_splat=False):
        """For a unit-stride-last-axis pointer tile: (row length, [row start offset (int or (ref, type))]).

        A last axis of length 1 counts as unit-stride whatever its stride (broadcasting sets it to 0). With
        `allow_splat`, a stride-0 last axis is accepted too (every row reads one element: see op_load)."""
        shape = p.shape
        aff = p.offs.aff if p.offs is not None else None
        if p.offs is None:
            return None
        if aff is None or len(aff.strides) != len(shape) or not shape:
            return None
        if aff.strides[-1] != 1 and shape[-1] != 1 and not (allow_splat and aff.strides[-1] == 0):
            return None
        L = shape[-1]
        rows = []
        import itertools
        oet = p.offs.et
        lead = shape[:-1]
        for coord in itertools.product(*[range(d) for d in lead]):
            terms = [aff.base]
            for c, st in zip(coord, aff.strides[:-1]):
                if c == 0 or st == 0:
                    continue
                terms.append(c * st if isinstance(st, int) else ("mul", c, st))
            const = sum(t for t in terms if isinstance(t, int))
            syms = [t for t in terms if not isinstance(t, int)]
            if not syms:
                rows.append(const)
                continue
            acc = None
            for s in syms:
                if isinstance(s, tuple):
                    s = self.val(f"mul {oet} {s[2]}, {s[1]}", oet, 0).ref
                acc = s if acc is None else self.val(f"add {oet} {acc}, {s}", oet, 0).ref
            if const:
                acc = self.val(f"add {oet} {acc}, {const}", oet, 0).ref
            rows.append((acc, oet))
        return L, rows

    def op_load(self, op):
        p = self.get(op.operands[0])
        mask = self.get(op.operands[1]) if len(op.operands) > 1 else None
        other = self.get(op.operands[2]) if len(op.operands) > 2 else None
        et = elem_ty(p.elem)
        align = p.elem.itemsize
        shape = op.result.type.shape
        if not shape:
            off = 0 if p.offs is None else (p.offs.ref, p.offs.et) if not p.offs.ref.lstrip("-").isdigit() \
                else int(p.offs.ref)
            ptr = self._elem_ptr(p, off)
            if mask is None:
                return self.val(f"load {et}, ptr {ptr}, align {align}", et, 0)
            return self._guarded_scalar_load(ptr, et, align, mask, other)
        n = _prod(shape)
        if other is None:
            other = LV("zeroinitializer", et, n, shape)
        rows = self._row_offsets(p, allow_splat=True)
        if rows is not None and _last_axis_splat(p, shape):
            # stride 0 along the last axis: one scalar load per row, broadcast (x86: a broadcast load or an
            # FMA's embedded-broadcast operand), e.g. a[rows, k] against a row of b in a matmul microkernel
            L, starts = rows
            parts = []
            for r, st in enumerate(starts):
                ptr = self._elem_ptr(p, st)
                if mask is None:
                    s = self.val(f"load {et}, ptr {ptr}, align {align}", et, 0)
                    parts.append(self.splat(s, L))
                    continue
                m = self.shuffle(mask, list(range(r * L, r * L + L))) if len(starts) > 1 else mask
                o = self.shuffle(other, list(range(r * L, r * L + L))) if len(starts) > 1 else other
                m, o = LV(m.ref, m.et, L), LV(o.ref, o.et, L)
                rname = f"llvm.vector.reduce.or.v{L}i1"
                self.declare(rname, "i1", [vty("i1", L)])
                anyv = self.val(f"call i1 @{rname}({m.ty} {m.ref})", "i1", 0)
                m1 = self.val(f"insertelement <1 x i1> poison, i1 {anyv.ref}, i32 0", "i1", 1)
                name = f"llvm.masked.load.v1{_SUFFIX[et]}.p0"
                self.declare(name, vty(et, 1), ["ptr", "i32", "<1 x i1>", vty(et, 1)])
                s1 = self.val(f"call <1 x {et}> @{name}(ptr {ptr}, i32 {align}, <1 x i1> {m1.ref}, "
                              f"<1 x {et}> zeroinitializer)", et, 1)
                sp = self.shuffle(s1, [0] * L)
                parts.append(self.val(f"select {m.ty} {m.ref}, {sp.ty} {sp.ref}, {o.ty} {o.ref}", et, L))
            return self.concat(parts, shape) if len(parts) > 1 else LV(parts[0].ref, et, n, shape)
        if rows is not None:
            L, starts = rows
            parts = []
            for r, st in enumerate(starts):
                ptr = self._elem_ptr(p, st)
                vt = vty(et, L)
                if mask is None:
                    parts.append(self.val(f"load {vt}, ptr {ptr}, align {align}", et, L))
                else:
                    m = self.shuffle(mask, list(range(r * L, r * L + L))) if len(starts) > 1 else mask
                    o = self.shuffle(other, list(range(r * L, r * L + L))) if len(starts) > 1 else other
                    if L == 1 and len(starts) > 1:
                        m = LV(m.ref, m.et, 1) if m.n else self.splat(m, 1)
                        o = LV(o.ref, o.et, 1) if o.n else self.splat(o, 1)
                    name = f"llvm.masked.load.v{L}{_SUFFIX[et]}.p0"
                    self.declare(name, vt, ["ptr", "i32", vty("i1", L), vt])
                    call = f"call {vt} @{name}(ptr {ptr}, i32 {align}, {vty('i1', L)} {m.ref}, {vt} {o.ref})"
                    if self.target.has("avx512f") or (self.target.has("avx") and p.elem.itemsize >= 4):
                        parts.append(self.val(call, et, L))
                        continue
                    # No native masked load for this element size (AVX/AVX2 have 32/64-bit vmaskmov only;
                    # SSE, portable and NEON have none): LLVM expands it lane by lane, so a row whose mask
                    # is all true (every chunk but a tail) takes a plain vector load instead.
                    rname = f"llvm.vector.reduce.and.v{L}i1"
                    self.declare(rname, "i1", [vty("i1", L)])
                    allv = self.val(f"call i1 @{rname}({vty('i1', L)} {m.ref})", "i1", 0)
                    full, some, done = self.label("ld_full"), self.label("ld_some"), self.label("ld_done")
                    self.emit(f"br i1 {allv.ref}, label %{full}, label %{some}")
                    self.start_block(full)
                    vf = self.val(f"load {vt}, ptr {ptr}, align {align}", et, L)
                    self.emit(f"br label %{done}")
                    self.start_block(some)
                    vs = self.val(call, et, L)
                    self.emit(f"br label %{done}")
                    self.start_block(done)
                    parts.append(self.val(f"phi {vt} [ {vf.ref}, %{full} ], [ {vs.ref}, %{some} ]", et, L))
            return self.concat(parts, shape) if len(parts) > 1 else LV(parts[0].ref, et, n, shape)
        # general case: gather
        offs = self.to_i64(p.offs) if p.offs is not None else self.const(0, "i64", n, shape)
        if offs.n == 0:
            offs = self.splat(offs, n, shape)
        ptrs = self.val(f"getelementptr inbounds {et}, ptr {p.base}, {offs.ty} {offs.ref}", "ptr", n, shape)
        m = mask if mask is not None else self.const(1, "i1", n, shape)
        vt = vty(et, n)
        name = f"llvm.masked.gather.v{n}{_SUFFIX[et]}.v{n}p0"
        self.declare(name, vt, [vty("ptr", n), "i32", vty("i1", n), vt])
        return self.val(f"call {vt} @{name}({vty('ptr', n)} {ptrs.ref}, i32 {align}, {m.ty} {m.ref}, {vt} {other.ref})",
                        et, n, shape)

    def op_prefetch(self, op):
        """One llvm.prefetch (read, high locality) per 64-byte line of each contiguous row. The addresses
        are formed without `inbounds`: a prefetch may point past an array (it never faults). The `nbytes`
        form (runs for a GPU's bulk L2 prefetch) is ignored here."""
        if op.attrs.get("nbytes"):
            return None
        p = self.get(op.operands[0])
        shape = op.operands[0].type.shape
        et, isz = elem_ty(p.elem), p.elem.itemsize
        name = self.declare("llvm.prefetch.p0", "void", ["ptr", "i32", "i32", "i32"])
        if not shape:
            off = 0 if p.offs is None else (p.offs.ref, p.offs.et)
            starts, L = [off], 1
        else:
            rows = self._row_offsets(p)
            if rows is None:
                raise CompilationError("prefetch needs a pointer tile that is contiguous along its last axis",
                                       op.loc)
            L, starts = rows
        for st in starts:
            if isinstance(st, int):
                row = self.val(f"getelementptr {et}, ptr {p.base}, i64 {st}", "ptr", 0).ref
            else:
                row = self.val(f"getelementptr {et}, ptr {p.base}, {st[1]} {st[0]}", "ptr", 0).ref
            for byte in range(0, L * isz, 64):
                ptr = row if byte == 0 else self.val(f"getelementptr i8, ptr {row}, i64 {byte}", "ptr", 0).ref
                self.emit(f"call void @{name}(ptr {ptr}, i32 0, i32 {op.attrs.get('locality', 3)}, i32 1)")
        return None

    def op_store(self, op):
        p = self.get(op.operands[0])
        v = self.get(op.operands[1])
        mask = self.get(op.operands[2]) if len(op.operands) > 2 else None
        et = elem_ty(p.elem)
        align = p.elem.itemsize
        shape = op.operands[0].type.shape
        if not shape:
            off = 0 if p.offs is None else (p.offs.ref, p.offs.et) if not p.offs.ref.lstrip("-").isdigit() \
                else int(p.offs.ref)
            ptr = self._elem_ptr(p, off)
            if mask is None:
                self.emit(f"store {et} {v.ref}, ptr {ptr}, align {align}")
                return None
            yes, done = self.label("st"), self.label("st_done")
            self.emit(f"br i1 {mask.ref}, label %{yes}, label %{done}")
            self.start_block(yes)
            self.emit(f"store {et} {v.ref}, ptr {ptr}, align {align}")
            self.emit(f"br label %{done}")
            self.start_block(done)
            return None
        n = _prod(shape)
        rows = self._row_offsets(p)
        if rows is not None:
            L, starts = rows
            for r, st in enumerate(starts):
                ptr = self._elem_ptr(p, st)
                vt = vty(et, L)
                part = self.shuffle(v, list(range(r * L, r * L + L))) if len(starts) > 1 else v
                if L == 1 and len(starts) > 1:
                    part = LV(part.ref, part.et, 1) if part.n else self.splat(part, 1)
                if mask is None:
                    self.emit(f"store {vt} {part.ref}, ptr {ptr}, align {align}")
                else:
                    m = self.shuffle(mask, list(range(r * L, r * L + L))) if len(starts) > 1 else mask
                    if L == 1 and len(starts) > 1:
                        m = LV(m.ref, m.et, 1) if m.n else self.splat(m, 1)
                    name = f"llvm.masked.store.v{L}{_SUFFIX[et]}.p0"
                    self.declare(name, "void", [vt, "ptr", "i32", vty("i1", L)])
                    call = f"call void @{name}({vt} {part.ref}, ptr {ptr}, i32 {align}, {vty('i1', L)} {m.ref})"
                    if self.target.has("avx512f"):
                        self.emit(call)
                        continue
                    # Below AVX-512 a masked store is slow (AVX/AVX2 vmaskmov stores are microcoded on AMD
                    # Zen: ~4x a plain store in a streaming loop) or expanded lane by lane (SSE, portable,
                    # NEON); a row whose mask is all true (every chunk but a tail) takes a plain store.
                    rname = f"llvm.vector.reduce.and.v{L}i1"
                    self.declare(rname, "i1", [vty("i1", L)])
                    allv = self.val(f"call i1 @{rname}({vty('i1', L)} {m.ref})", "i1", 0)
                    full, some, done = self.label("st_full"), self.label("st_some"), self.label("st_done")
                    self.emit(f"br i1 {allv.ref}, label %{full}, label %{some}")
                    self.start_block(full)
                    self.emit(f"store {vt} {part.ref}, ptr {ptr}, align {align}")
                    self.emit(f"br label %{done}")
                    self.start_block(some)
                    self.emit(call)
                    self.emit(f"br label %{done}")
                    self.start_block(done)
            return None
        offs = self.to_i64(p.offs) if p.offs is not None else self.const(0, "i64", n, shape)
        if offs.n == 0:
            offs = self.splat(offs, n, shape)
        ptrs = self.val(f"getelementptr inbounds {et}, ptr {p.base}, {offs.ty} {offs.ref}", "ptr", n, shape)
        m = mask if mask is not None else self.const(1, "i1", n, shape)
        vt = vty(et, n)
        name = f"llvm.masked.scatter.v{n}{_SUFFIX[et]}.v{n}p0"
        self.declare(name, "void", [vt, vty("ptr", n), "i32", vty("i1", n)])
        self.emit(f"call void @{name}({vt} {v.ref}, {vty('ptr', n)} {ptrs.ref}, i32 {align}, {m.ty} {m.ref})")
        return None

    # ---------------------------------------------------------------------------------- reductions
    def _reduce_vec(self, kind: str, v: LV, d: DType) -> LV:
        """Reduces all lanes of v to a scalar."""
        if v.n == 1:
            return self.extract(v, 0)
        if d.is_float:
            if kind == "sum":
                return self._fsum_tree(v)
            name = f"llvm.vector.reduce.{'fmax' if kind == 'max' else 'fmin'}.{self.sfx(v)}"
            self.declare(name, v.et, [v.ty])
            return self.val(f"call {v.et} @{name}({v.ty} {v.ref})", v.et, 0)
        s = "s" if d.is_signed else "u"
        op = {"sum": "add", "max": f"{s}max", "min": f"{s}min"}[kind]
        name = f"llvm.vector.reduce.{op}.{self.sfx(v)}"
        self.declare(name, v.et, [v.ty])
        return self.val(f"call {v.et} @{name}({v.ty} {v.ref})", v.et, 0)

    def _fsum_tree(self, v: LV) -> LV:
        """Sum of the lanes as an explicit halving tree, with no fast-math flags.

        The order of the additions is fixed by the lane count alone (pad to a power of two with -0.0, add
        the upper half to the lower half, repeat), never by what LLVM finds around it. Kernels that lay the
        same values out in the same lanes therefore reduce them bit-identically, which batch invariance
        relies on (a request's logits must not depend on what else is in the batch)."""
        n = v.n
        p = 1
        while p < n:
            p *= 2
        if p != n:
            idx = ", ".join(f"i32 {i if i < n else n}" for i in range(p))
            v = self.val(f"shufflevector {v.ty} {v.ref}, {v.ty} {self.const(-0.0, v.et, n).ref}, "
                         f"<{p} x i32> <{idx}>", v.et, p)
        while v.n > 1:
            h = v.n // 2
            lo = self.shuffle(LV(v.ref, v.et, v.n), list(range(h))) if h > 1 else self.extract(v, 0)
            hi = self.shuffle(LV(v.ref, v.et, v.n), list(range(h, 2 * h))) if h > 1 else self.extract(v, 1)
            v = self.val(f"fadd {lo.ty} {lo.ref}, {hi.ref}", v.et, lo.n)
        return v

    def op_reduce(self, op):
        x = self.get(op.operands[0])
        d = op.operands[0].type.elem
        kind, ax = op.attrs["kind"], op.attrs["axis"]
        half = d in (ir.f16, ir.bf16)
        if half:
            x = self.to_f32(x, d)
        rd = ir.f32 if half else d
        shape = op.operands[0].type.shape
        pre, n, post = _prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])
        oshape = op.result.type.shape
        if post == 1 and pre >= 4 and 2 <= n <= 8 and n & (n - 1) == 0:
            # many short rows (e.g. the lanes of per-(token, row) accumulators): halve every row at once, as
            # whole-tile shuffles + vector ops (two-source permutes per register), instead of one horizontal
            # reduction and one lane insert per row
            cur, m = x, n
            while m > 1:
                h = m // 2
                lo = self.shuffle(cur, [p * m + q for p in range(pre) for q in range(h)])
                hi = self.shuffle(cur, [p * m + h + q for p in range(pre) for q in range(h)])
                cur = self._combine(kind, lo, hi, rd)
                m = h
            res = LV(cur.ref, cur.et, cur.n, oshape)
        elif post == 1:
            outs = []
            for p in range(pre):
                sl = self.shuffle(x, list(range(p * n, p * n + n))) if pre > 1 else x
                if sl.n == 0:
                    outs.append(sl)
                else:
                    outs.append(self._reduce_vec(kind, LV(sl.ref, sl.et, sl.n), rd))
            res = outs[0] if pre == 1 else self.build_vector(outs, x.et, oshape)
        else:
            slices = [self.shuffle(x, [p * n * post + j * post + q for p in range(pre) for q in range(post)], oshape)
                      for j in range(n)]
            while len(slices) > 1:   # a tree keeps the dependency chain short
                nxt = [self._combine(kind, slices[i], slices[i + 1], rd) for i in range(0, len(slices) - 1, 2)]
                if len(slices) % 2:
                    nxt.append(slices[-1])
                slices = nxt
            res = slices[0]
            res = LV(res.ref, res.et, res.n, oshape)
        if not oshape and res.n:
            res = self.extract(res, 0)
        elif oshape and res.n == 0:
            res = self.splat(res, 1, oshape)     # a (1,)-shaped result (e.g. (1, K) summed over K) stays a vector
        return self.from_f32(res, d) if half else res

    def op_argreduce(self, op):
        x = self.get(op.operands[0])
        d = op.operands[0].type.elem
        kind, ax = op.attrs["kind"], op.attrs["axis"]
        if d in (ir.f16, ir.bf16):
            x, d = self.to_f32(x, d), ir.f32
        shape = op.operands[0].type.shape
        pre, n, post = _prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])
        oshape = op.result.type.shape
        m = pre * post
        best_v = self.shuffle(x, [p * n * post + q for p in range(pre) for q in range(post)], oshape)
        if best_v.n == 0 and m == 1 and oshape:
            best_v = self.splat(best_v, 1, oshape)
        best_i = self.const(0, "i32", best_v.n, oshape)
        if d.is_float:
            pred = "ogt" if kind == "argmax" else "olt"
        else:
            s = "s" if d.is_signed else "u"
            pred = f"{s}gt" if kind == "argmax" else f"{s}lt"
        cmp = "fcmp" if d.is_float else "icmp"
        if post == 1 and pre <= 64 and n >= 8:
            # per row: the extreme value, then the smallest index that attains it
            outs = []
            red = "max" if kind == "argmax" else "min"
            iota = LV("<" + ", ".join(f"i32 {i}" for i in range(n)) + ">", "i32", n, (n,))
            for p in range(pre):
                sl = self.shuffle(x, list(range(p * n, p * n + n))) if pre > 1 else LV(x.ref, x.et, x.n)
                mv = self._reduce_vec(red, sl, d)
                ms = self.splat(mv, n)
                eq = self.val(f"{cmp} {'oeq' if d.is_float else 'eq'} {sl.ty} {sl.ref}, {ms.ref}", "i1", n)
                idx = self.val(f"select {eq.ty} {eq.ref}, {iota.ty} {iota.ref}, {iota.ty} "
                               f"{self.const(n, 'i32', n).ref}", "i32", n)
                outs.append(self._reduce_vec("min", idx, ir.u32))
            res = outs[0] if pre == 1 else self.build_vector(outs, "i32", oshape)
            if oshape and res.n == 0:
                res = self.splat(res, 1, oshape)        # one row of a (1, n) tile: a (1,) result, one lane
            return res if oshape else (res if res.n == 0 else self.extract(res, 0))
        for j in range(1, n):
            v = self.shuffle(x, [p * n * post + j * post + q for p in range(pre) for q in range(post)], oshape)
            if v.n == 0 and oshape:
                v = self.splat(v, 1, oshape)
            better = self.val(f"{cmp} {pred} {v.ty} {v.ref}, {best_v.ref}", "i1", v.n, oshape)
            best_v = self.val(f"select {better.ty} {better.ref}, {v.ty} {v.ref}, {v.ty} {best_v.ref}", v.et, v.n, oshape)
            best_i = self.val(f"select {better.ty} {better.ref}, {best_i.ty} {self.const(j, 'i32', v.n, oshape).ref}, "
                              f"{best_i.ty} {best_i.ref}", "i32", v.n, oshape)
        if not oshape and best_i.n:
            return self.extract(best_i, 0)
        return best_i

    # ----------------------------------------------------------------------------------------- dot
    def op_barrier(self, op):
        return None          # one thread runs a program: program order is memory order

    def op_dot(self, op):
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        d = op.result.type.elem
        # the IR keeps the input dtypes; the CPU widens whole tiles first, then adds `acc` after the products
        # (the order the kernels' numerics were tuned with)
        a = self.convert(a, op.operands[0].type.elem, d)
        b = self.convert(b, op.operands[1].type.elem, d)
        acc_in = self.get(op.operands[2]) if len(op.operands) > 2 else None
        res = self._dot_products(a, b, op, d)
        if acc_in is None:
            return res
        return self.val(f"{'fadd' if d.is_float else 'add'} {res.ty} {res.ref}, {acc_in.ref}", res.et, res.n,
                        res.shape)

    def _dot_products(self, a, b, op, d):
        m, k = op.operands[0].type.shape
        n = op.operands[1].type.shape[1]
        shape = (m, n)
        acc = None
        # outer-product formulation: acc[m, n] += a[m, kk] * b[kk, n] for each kk; each term is one
        # broadcast of a column of `a` and a row of `b` to the (m, n) tile, which maps onto register
        # broadcasts + vector FMAs once LLVM legalises the vectors.
        for kk in range(k):
            av = self.shuffle(a, [i * k + kk for i in range(m) for _ in range(n)], shape)
            bv = self.shuffle(b, [kk * n + j for _ in range(m) for j in range(n)], shape)
            if av.n == 0:
                av, bv = self.splat(av, 1, shape), self.splat(bv, 1, shape)
            if acc is None:
                acc = self.val(f"{'fmul' if d.is_float else 'mul'} {av.ty} {av.ref}, {bv.ref}", av.et, av.n, shape)
            elif d.is_float:
                acc = self.fmuladd(av, bv, acc)
            else:
                p = self.val(f"mul {av.ty} {av.ref}, {bv.ref}", av.et, av.n, shape)
                acc = self.val(f"add {av.ty} {acc.ref}, {p.ref}", av.et, av.n, shape)
        return acc

    def op_dot4(self, op):
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        ad = op.operands[0].type.elem
        shape = op.operands[0].type.shape
        oshape = op.result.type.shape
        ax = op.attrs.get("axis")
        if ax is None:
            return self._dot4([a], [b], ad, _prod(shape), oshape)
        # summed over input axis `ax`: the n slices along it, each flattened in the result's order
        pre, n, post = _prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])
        idx = [[p * n * post + j * post + q for p in range(pre) for q in range(post)] for j in range(n)]
        return self._dot4([self.shuffle(a, ix) for ix in idx], [self.shuffle(b, ix) for ix in idx], ad, pre * post,
                          oshape)

    def _dot4(self, aa: list, bb: list, ad, n: int, oshape):
        """Sum over the slices j of dot4(aa[j], bb[j]) (each n lanes). x86 adds the slices' pmaddubsw results
        in int16 and widens once (the caller's contract keeps those sums inside int16); elsewhere the i32
        results are added."""
        vnni = self._vnni_chunk(n)
        if vnni:
            return self._dot4_vnni(aa, bb, ad, n, oshape, vnni)
        chunk = 0
        if self.x86:
            if self.target.has("avx512bw") and n % 64 == 0:
                chunk = 64
            elif self.target.has("avx2") and n % 32 == 0:
                chunk = 32
            elif self.target.has("avx") and n % 16 == 0:
                chunk = 16     # SSSE3 pmaddubsw (AVX implies SSSE3)
        if len(aa) > 1 and not chunk:
            parts = [self._dot4([a], [b], ad, n, oshape) for a, b in zip(aa, bb)]
            acc = parts[0]
            for p in parts[1:]:
                acc = self.val(f"add {acc.ty} {acc.ref}, {p.ref}", "i32", acc.n, oshape)
            return acc
        if chunk:
            psign = None
            signs = [None] * len(aa)
            if ad.is_signed:
                # u8 x s8 instructions: |a| times b with a's sign (a == 0 gives 0 either way). SSSE3/AVX2 have
                # psignb for the sign transfer (one instruction per chunk, applied below); AVX-512 has none,
                # so 512-bit chunks use compare + masked negate.
                if chunk != 64:
                    psign = "llvm.x86.avx2.psign.b" if chunk == 32 else "llvm.x86.ssse3.psign.b.128"
                    self.declare(psign, vty("i8", chunk), [vty("i8", chunk)] * 2)
                aa, bb = list(aa), list(bb)
                for j, (a, b) in enumerate(zip(aa, bb)):
                    ab = self.val(f"call {a.ty} @{self._abs_decl(a)}({a.ty} {a.ref}, i1 false)", "i8", n)
                    if chunk == 64:
                        neg = self.val(f"icmp slt {a.ty} {a.ref}, zeroinitializer", "i1", n)
                        nb = self.val(f"sub {b.ty} zeroinitializer, {b.ref}", "i8", n)
                        bb[j] = self.val(f"select {neg.ty} {neg.ref}, {b.ty} {nb.ref}, {b.ty} {b.ref}", "i8", n)
                    else:
                        signs[j] = a
                    aa[j] = ab
            ub, wd = {64: ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
                      32: ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
                      16: ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd")}[chunk]
            bt, wt, dt = vty("i8", chunk), vty("i16", chunk // 2), vty("i32", chunk // 4)
            self.declare(ub, wt, [bt, bt])
            self.declare(wd, dt, [wt, wt])
            ones = self.const(1, "i16", chunk // 2).ref
            parts = []
            for c in range(n // chunk):
                lanes = list(range(c * chunk, (c + 1) * chunk))
                w = None
                for a, b, sa in zip(aa, bb, signs):
                    ac = self.shuffle(a, lanes) if n > chunk else a
                    bc = self.shuffle(b, lanes) if n > chunk else b
                    if psign:
                        sc = self.shuffle(sa, lanes) if n > chunk else sa
                        bc = self.val(f"call {bt} @{psign}({bt} {bc.ref}, {bt} {sc.ref})", "i8", chunk)
                    wj = self.val(f"call {wt} @{ub}({bt} {ac.ref}, {bt} {bc.ref})", "i16", chunk // 2)
                    w = wj if w is None else self.val(f"add {wt} {w.ref}, {wj.ref}", "i16", chunk // 2)
                parts.append(self.val(f"call {dt} @{wd}({wt} {w.ref}, {wt} {ones})", "i32", chunk // 4))
            return self.concat(parts, oshape) if len(parts) > 1 else LV(parts[0].ref, "i32", n // 4, oshape)
        a, b = aa[0], bb[0]
        arm_fn = u8_bias = None
        if self.target.arch == "aarch64" and n % 16 == 0:
            if ad.is_signed and self.target.has("dotprod"):
                arm_fn = "llvm.aarch64.neon.sdot.v4i32.v16i8"      # SDOT: s8 x s8 groups of 4
            elif not ad.is_signed and self.target.has("i8mm"):
                arm_fn = "llvm.aarch64.neon.usdot.v4i32.v16i8"     # USDOT: u8 x s8 groups of 4
            elif not ad.is_signed and self.target.has("dotprod"):
                # u8 x s8 without I8MM: SDOT on a - 128 (the s8 a ^ 0x80), plus 128 sum(b) taken back as
                # SDOT(-128, b) subtracted: exact for every input (4-bit weights took the generic path before)
                arm_fn = "llvm.aarch64.neon.sdot.v4i32.v16i8"
                u8_bias = self.const(-128, "i8", 16).ref
        if arm_fn:
            self.declare(arm_fn, "<4 x i32>", ["<4 x i32>", "<16 x i8>", "<16 x i8>"])
            parts = []
            for c in range(n // 16):
                ac = self.shuffle(a, list(range(c * 16, (c + 1) * 16))) if n > 16 else a
                bc = self.shuffle(b, list(range(c * 16, (c + 1) * 16))) if n > 16 else b
                if u8_bias is not None:
                    ac = self.val(f"xor <16 x i8> {ac.ref}, {u8_bias}", "i8", 16)
                r = self.val(f"call <4 x i32> @{arm_fn}(<4 x i32> zeroinitializer, <16 x i8> {ac.ref}, "
                             f"<16 x i8> {bc.ref})", "i32", 4)
                if u8_bias is not None:
                    corr = self.val(f"call <4 x i32> @{arm_fn}(<4 x i32> zeroinitializer, <16 x i8> {u8_bias}, "
                                    f"<16 x i8> {bc.ref})", "i32", 4)
                    r = self.val(f"sub <4 x i32> {r.ref}, {corr.ref}", "i32", 4)
                parts.append(r)
            return self.concat(parts, oshape) if len(parts) > 1 else LV(parts[0].ref, "i32", n // 4, oshape)
        # generic: per 16-byte chunk (whole-tile widening makes huge vectors and shuffles that LLVM's
        # instruction selection handles very slowly), widen, multiply, add the four strided lanes; x86 tiers
        # without SSSE3 use SSE2's pmaddwd on the widened halves (pairs summed to i32) and add adjacent pairs
        ext_a = "sext" if ad.is_signed else "zext"
        parts = []
        starts = range(0, n, 16)        # a last chunk of 4, 8 or 12 lanes when n is not a multiple of 16
        for c0 in starts:
            cw = min(16, n - c0)
            ac = self.shuffle(a, list(range(c0, c0 + cw))) if n > cw else a
            bc = self.shuffle(b, list(range(c0, c0 + cw))) if n > cw else b
            if self.x86 and cw == 16:
                wa = self.val(f"{ext_a} {ac.ty} {ac.ref} to <16 x i16>", "i16", 16)
                wb = self.val(f"sext {bc.ty} {bc.ref} to <16 x i16>", "i16", 16)
                self.declare("llvm.x86.sse2.pmadd.wd", "<4 x i32>", ["<8 x i16>", "<8 x i16>"])
                pair = []
                for h in range(2):
                    ah, bh = self.shuffle(wa, list(range(8 * h, 8 * h + 8))), self.shuffle(wb, list(range(8 * h, 8 * h + 8)))
                    pair.append(self.val(f"call <4 x i32> @llvm.x86.sse2.pmadd.wd(<8 x i16> {ah.ref}, <8 x i16> "
                                         f"{bh.ref})", "i32", 4))
                pr = self.concat(pair, (8,))
                ev, od = self.shuffle(pr, [0, 2, 4, 6]), self.shuffle(pr, [1, 3, 5, 7])
                parts.append(self.val(f"add <4 x i32> {ev.ref}, {od.ref}", "i32", 4))
                continue
            wa = self.val(f"{ext_a} {ac.ty} {ac.ref} to {vty('i32', cw)}", "i32", cw)
            wb = self.val(f"sext {bc.ty} {bc.ref} to {vty('i32', cw)}", "i32", cw)
            pr = self.val(f"mul {wa.ty} {wa.ref}, {wb.ref}", "i32", cw)
            q = cw // 4
            lanes = [self.shuffle(pr, [4 * i + j for i in range(q)]) if q > 1 else self.shuffle(pr, [j, j])
                     for j in range(4)]
            s01 = self.val(f"add {lanes[0].ty} {lanes[0].ref}, {lanes[1].ref}", "i32", lanes[0].n)
            s23 = self.val(f"add {lanes[2].ty} {lanes[2].ref}, {lanes[3].ref}", "i32", lanes[0].n)
            sm = self.val(f"add {s01.ty} {s01.ref}, {s23.ref}", "i32", lanes[0].n)
            parts.append(sm if q > 1 else self.shuffle(sm, [0], (1,) if len(starts) > 1 else ()))
        if len(parts) == 1:
            p0 = parts[0]
            return LV(p0.ref, "i32", p0.n, oshape) if p0.n else self.splat(p0, 1, oshape)
        return self.concat(parts, oshape)

    def _vnni_chunk(self, n: int) -> int:
        """Bytes per vpdpbusd for n lanes on this tier (0: no VNNI, or n fits no width): zmm with AVX512-VNNI,
        ymm with AVX-VNNI (VEX) or AVX512-VNNI + VL, xmm likewise."""
        if not self.x86:
            return 0
        zmm = self.target.has("avx512vnni") and self.target.has("avx512f")
        ymm = self.target.has("avxvnni") or (zmm and self.target.has("avx512vl"))
        for c, ok in ((64, zmm), (32, ymm), (16, ymm)):
            if ok and n % c == 0:
                return c
        return 0

    def _dot4_vnni(self, aa: list, bb: list, ad, n: int, oshape, chunk: int):
        """dot4 on VNNI: one vpdpbusd (u8 x s8 groups of 4 added into i32 lanes) per chunk and slice, the
        slices accumulated by the instruction itself. No int16 stage, so the sums are exact where pmaddubsw
        saturates (its results equal these whenever the caller keeps dot4's int16 contract). Signed `a`:
        a + 128 is the u8 a ^ 0x80, and dot(a, b) = dot(a ^ 0x80, b) - dot(128, b), exact for every input
        (the abs/sign-transfer of the pmaddubsw path wraps at a = b = -128)."""
        # LLVM 22 (IntrinsicsX86.td): <N x i32> @llvm.x86.avx512.vpdpbusd.{512,256,128}(<N x i32> acc,
        # <4N x i8> u8, <4N x i8> s8); the 256/128-bit forms select the VEX encoding on AVX-VNNI tiers
        fn = {64: "llvm.x86.avx512.vpdpbusd.512", 32: "llvm.x86.avx512.vpdpbusd.256",
              16: "llvm.x86.avx512.vpdpbusd.128"}[chunk]
        bt, dt = vty("i8", chunk), vty("i32", chunk // 4)
        self.declare(fn, dt, [dt, bt, bt])
        signed = ad.is_signed
        bias = self.const(-128, "i8", chunk).ref if signed else None
        parts = []
        for c in range(n // chunk):
            lanes = list(range(c * chunk, (c + 1) * chunk))
            acc, corr = "zeroinitializer", "zeroinitializer"
            for a, b in zip(aa, bb):
                ac = self.shuffle(a, lanes) if n > chunk else a
                bc = self.shuffle(b, lanes) if n > chunk else b
                if signed:
                    ac = self.val(f"xor {bt} {ac.ref}, {bias}", "i8", chunk)
                    corr = self.val(f"call {dt} @{fn}({dt} {corr}, {bt} {bias}, {bt} {bc.ref})", "i32",
                                    chunk // 4).ref
                acc = self.val(f"call {dt} @{fn}({dt} {acc}, {bt} {ac.ref}, {bt} {bc.ref})", "i32", chunk // 4).ref
            if signed:
                acc = self.val(f"sub {dt} {acc}, {corr}", "i32", chunk // 4).ref
            parts.append(LV(acc, "i32", chunk // 4))
        return self.concat(parts, oshape) if len(parts) > 1 else LV(parts[0].ref, "i32", n // 4, oshape)

    def op_madd(self, op):
        """Pair sums of products: u8 x i8 -> i16 saturated (pmaddubsw), i16 x i16 -> i32 (pmaddwd)."""
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        wide = op.operands[0].type.elem == ir.i16
        oshape = op.result.type.shape
        n = _prod(op.operands[0].type.shape)
        et, rt = ("i16", "i32") if wide else ("i8", "i16")
        chunk = 0
        if self.x86:
            lanes = {64: "avx512bw", 32: "avx2", 16: "sse2" if wide else "avx"}
            for c in (64, 32, 16):          # bytes per instruction
                if self.target.has(lanes[c]) and (n * (2 if wide else 1)) % c == 0:
                    chunk = c
                    break
        if chunk:
            cn = chunk // (2 if wide else 1)            # input lanes per instruction
            fn = ({64: "llvm.x86.avx512.pmaddw.d.512", 32: "llvm.x86.avx2.pmadd.wd", 16: "llvm.x86.sse2.pmadd.wd"}
                  if wide else {64: "llvm.x86.avx512.pmaddubs.w.512", 32: "llvm.x86.avx2.pmadd.ub.sw",
                                16: "llvm.x86.ssse3.pmadd.ub.sw.128"})[chunk]
            it, ot = vty(et, cn), vty(rt, cn // 2)
            self.declare(fn, ot, [it, it])
            parts = []
            for c in range(n // cn):
                lanes_c = list(range(c * cn, (c + 1) * cn))
                ac = self.shuffle(a, lanes_c) if n > cn else a
                bc = self.shuffle(b, lanes_c) if n > cn else b
                parts.append(self.val(f"call {ot} @{fn}({it} {ac.ref}, {it} {bc.ref})", rt, cn // 2))
            return self.concat(parts, oshape) if len(parts) > 1 else LV(parts[0].ref, rt, n // 2, oshape)
        # generic: widen, multiply, add the even and odd products (saturating to i16 for the byte form)
        wa = self.val(f"{'sext' if wide else 'zext'} {a.ty} {a.ref} to {vty(rt, n)}", rt, n)
        wb = self.val(f"sext {b.ty} {b.ref} to {vty(rt, n)}", rt, n)
        pr = self.val(f"mul {wa.ty} {wa.ref}, {wb.ref}", rt, n)
        ev = self.shuffle(pr, list(range(0, n, 2)), (n // 2,))
        od = self.shuffle(pr, list(range(1, n, 2)), (n // 2,))
        if wide:
            res = self.val(f"add {ev.ty} {ev.ref}, {od.ref}", rt, n // 2)
        else:
            name = f"llvm.sadd.sat.{self.sfx(ev)}"
            self.declare(name, ev.ty, [ev.ty, ev.ty])
            res = self.val(f"call {ev.ty} @{name}({ev.ty} {ev.ref}, {ev.ty} {od.ref})", rt, n // 2)
        return LV(res.ref, rt, n // 2, oshape)


def lower_to_llvm(fn: ir.Function, target) -> str:
    return CpuLowering(fn, target).lower()


# ------------------------------------------------------------------------------------------ backend
class CpuBackend(Backend):
    """CPU tiers: LLVM IR -> a relocatable object (and, on request, assembly / optimised IR) through an isolated
    LLVM; loaded through ORC LLJIT (runtime/cpu.py) and run by the thread pool (runtime/cpu_pool.py)."""
    family = "cpu"
    artifact = "kernel.o"

    def lower(self, fn, target) -> tuple:
        return lower_to_llvm(fn, target), {}

    def compile(self, fn, target, emit, describe, kernel_name, spec) -> tuple:
        llvm_ir = lower_to_llvm(fn, target)
        out = self.llvm(llvm_ir, target, emit, describe, kernel_name, spec)
        artifacts = self.sources(fn, llvm_ir)
        names = {"obj": "kernel.o", "asm": "kernel.s", "opt_ll": "kernel.opt.ll"}
        for k, v in out.items():
            artifacts[names[k]] = v
        return artifacts, {}

    def load(self, ck, describe: str, spec: str) -> None:
        if "kernel.o" not in ck.artifacts:
            return
        from ..runtime.cpu import load_object
        try:
            ck.address = load_object(ck.artifacts["kernel.o"], ck.symbol, describe=describe)
        except CompileError as e:
            e.kernel, e.specialization, e.target = ck.name, spec, ck.target.name
            raise


BACKEND = CpuBackend()
