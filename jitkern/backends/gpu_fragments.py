"""Fragment-layout values of the GPU lowering (a mixin of backends/gpu.py GpuLowering).

A dot's accumulator on the matrix units is spread over the warps' registers in the MMA's own layout. The tile
layout (backends/gpu.py) deals a tile's elements to threads differently, so every elementwise op on an
accumulator used to cost a round trip through shared memory. `FragV` keeps an (m, n) f32 value in the
accumulator layout instead (one vector lane per register), for the values `_frag_analysis` picks: what the flash
kernels' online softmax does to its accumulator and scores. Cheap operands (constants, splats, broadcasts) are
evaluated in that layout; anything else gets the tile value through shared memory (`get`). The same IEEE
operations run per element, so the bits are the tile path's. Row slots (JITKERN_ROW_SLOTS) stage the row
vectors those ops broadcast where they are computed, so several broadcasts share one barrier.
"""
from __future__ import annotations

from .. import ir
from ..language import CompilationError
from .emitter import LV, _ops_of, _prod, vty
from .gpu_staging import _ROWS_BASE


def _gpu():
    """backends/gpu.py (its switches are read there at call time: tests patch them there)."""
    from . import gpu
    return gpu


class FragV:
    """An (m, n) f32 value held the way the MMA units hold a dot's accumulator (layout `key`, as MmaAcc), not
    in the tile layout: `lv` has one lane per accumulator register (MmaAcc.regs' order: warp-unit, C
    register) and shape (m, n). Dot results whose accumulator is one, elementwise ops on them with constants,
    splats and broadcasts (a row's alpha: `acc * alpha[:, None]`), and loop slots carrying them stay in
    registers (GpuLowering._frag_analysis decides which); any other use gets the tile value through shared
    memory (GpuLowering.get). Per element the same IEEE operations run as on the tile, so bits do not move."""
    __slots__ = ("key", "lv")

    def __init__(self, key, lv):
        self.key, self.lv = key, lv


class FragmentOps:
    """GpuLowering's fragment-layout values (see the module docstring)."""

    _FRAG_EW = ("binary", "select", "unary", "cast")
    _FRAG_BIN = ("add", "sub", "mul", "div", "max", "min")
    _FRAG_TOP = "?"

    def _frag_analysis(self) -> None:
        """Which (m, n) f32 values are held as FragV (self.frag_keys: value id -> layout key): the result of a
        planned mma.sync dot (16-bit A, a layout where every warp has the same units) whose accumulator is
        one; an elementwise op (binary, select, unary) with at least one such operand, all of one layout,
        and otherwise only "cheap" operands (constants, splats, broadcasts of fewer elements and elementwise
        ops of those, evaluated in the fragment layout); a loop slot starting at a constant whose yield is
        one (and the loop's result). Loop slots are assumed held (optimistic) and dropped until the yields
        agree. The flash kernels' online-softmax accumulator (`acc * alpha[:, None]` into dot(p, v, .))
        then never leaves the MMA registers; the K loops' `acc = dot(a, b, acc)` keep MmaAcc (_frag_slots)."""
        self.frag_keys, self._frag_plans, self._frag_keep, self._lazy_ops = {}, {}, {}, {}
        if not _gpu().FRAG_OPS:
            return
        dots, fresh = {}, set()
        for op in _ops_of(self.fn.body):
            plan = self.mma_plans.get(id(op))
            if op.name != "dot" or plan is None or plan["wg"] or plan["split"]:
                continue
            key = self._mma_geometry(plan)["key"]
            if key is None:
                continue
            if len(op.operands) < 3 or op.operands[2] is None:
                # a dot without accumulator (the flash kernels' scores) stays in registers when only
                # elementwise ops and reductions use it
                us = self.users.get(op.results[0].id, [])
                if not us or any(u.name not in self._FRAG_EW + ("reduce",) for u, _ in us):
                    continue
                fresh.add(id(op))
            dots[id(op)] = key
            self._frag_plans.setdefault(key, plan)
        if not dots:
            return
        TOP = self._FRAG_TOP
        fk = {}
        slots = []                      # (slot arg, yielded value, loop result, yield op, slot index)
        for op, body, yop in self._loops():
            old = self._frag_slots(op)
            for j, arg in enumerate(body.args[1:]):
                t = arg.type
                d = self.defs.get(op.operands[3 + j].id)
                if j in old or t.elem != ir.f32 or len(t.shape) != 2 or d is None or d.name != "const":
                    continue
                fk[arg.id] = TOP
                slots.append((arg, yop.operands[j], op.results[j], yop, j))
        # run-time `if`s: a result is held when both branches yield values held in one layout
        ifs = []                        # (result, then yield op, else yield op, index)
        for op in _ops_of(self.fn.body):
            if op.name != "if" or len(op.regions) != 2:
                continue
            ys = [r.ops[-1] if r.ops and r.ops[-1].name == "yield" else None for r in op.regions]
            if ys[0] is None or ys[1] is None:
                continue
            for j, res in enumerate(op.results):
                if res is not None and res.type.elem == ir.f32 and len(res.type.shape) == 2:
                    ifs.append((res, ys[0], ys[1], j))
                    fk[res.id] = TOP            # optimistic, as loop slots (a loop's dot may decide it)
        cheap_memo = {}

        def cheap(v, depth=0) -> bool:
            if v.id in cheap_memo:
                return cheap_memo[v.id]
            d = self.defs.get(v.id)
            ok = False
            if d is None or v.type.is_ptr:
                ok = False
            elif d.name in ("const", "splat"):
                ok = True
            elif d.name == "broadcast":
                ok = _prod(d.operands[0].type.shape) < _prod(v.type.shape)
            elif d.name in ("binary", "select", "unary", "cmp", "cast") and depth < 6 and v.type.shape:
                ok = all(o is not None and cheap(o, depth + 1) for o in d.operands)
            cheap_memo[v.id] = ok
            return ok

        def rule(op):
            t = op.results[0].type
            if id(op) in dots:
                k = dots[id(op)]
                return k if id(op) in fresh or fk.get(op.operands[2].id) in (k, TOP) else None
            if len(t.shape) != 2 or not (t.elem == ir.f32 or op.name == "cast" and t.elem in (ir.f16, ir.bf16)):
                return None
            if op.name == "cast" and (op.operands[0].type.elem != ir.f32 or op.attrs.get("bitcast")):
                return None
            if op.name == "binary" and op.attrs["op"] not in self._FRAG_BIN:
                return None
            ks = set()
            for o in op.operands:
                k = fk.get(o.id)
                if k is not None:
                    ks.add(k)
                elif not cheap(o):
                    return None
            concrete = ks - {TOP}
            if len(concrete) > 1:
                return None
            if concrete:
                k = concrete.pop()
                return k if (k[0], k[1]) == tuple(t.shape) else None
            return TOP if ks else None

        ops = [op for op in _ops_of(self.fn.body) if len(op.results) == 1 and op.results[0] is not None
               and (id(op) in dots or op.name in self._FRAG_EW)]
        while True:
            changed = True
            while changed:
                changed = False
                for op in ops:
                    rid = op.results[0].id
                    k = rule(op)
                    if fk.get(rid) != k:
                        changed = True
                        if k is None:
                            fk.pop(rid, None)
                        else:
                            fk[rid] = k
                for arg, y, res, _, _ in slots:
                    cur = fk.get(arg.id)
                    if cur is None:
                        continue
                    yk = fk.get(y.id)
                    new = yk if cur == TOP else (cur if yk in (cur, TOP) else None)
                    if new != cur:
                        changed = True
                        if new is None:
                            fk.pop(arg.id, None)
                        else:
                            fk[arg.id] = new
                    if fk.get(res.id) != fk.get(arg.id):
                        changed = True
                        if fk.get(arg.id) is None:
                            fk.pop(res.id, None)
                        else:
                            fk[res.id] = fk[arg.id]
                for res, ty, ey, j in ifs:
                    kt, ke = fk.get(ty.operands[j].id), fk.get(ey.operands[j].id)
                    new = None if kt is None or ke is None else ke if kt == TOP else kt if ke in (kt, TOP) \
                        else None
                    if fk.get(res.id) != new:
                        changed = True
                        if new is None:
                            fk.pop(res.id, None)
                        else:
                            fk[res.id] = new
            stuck = [arg for arg, *_ in slots if fk.get(arg.id) == TOP] + \
                [res for res, *_ in ifs if fk.get(res.id) == TOP]
            if not stuck:
                break
            for v in stuck:                 # a slot only ever yielding itself (or another undecided one)
                fk.pop(v.id)
        self.frag_keys = {v: k for v, k in fk.items() if k != TOP}
        for arg, y, res, yop, j in slots:
            if arg.id in self.frag_keys:
                self._frag_keep.setdefault(id(yop), set()).add(j)
        for res, ty, ey, j in ifs:
            if res.id in self.frag_keys:
                for yop in (ty, ey):
                    self._frag_keep.setdefault(id(yop), set()).add(j)
        # operands that only fragment-layout ops use (alpha[:, None], masks) are evaluated there from the IR
        # (_frag_operand); lowering them in the tile layout too would cost a broadcast through shared memory
        # that nothing reads, so they are lowered only where something else asks for them (get)
        self._lazy_ops = {}
        pure = ("broadcast", "reshape", "splat", "const", "binary", "cmp", "select", "unary", "cast")
        allops = list(_ops_of(self.fn.body))
        changed = True
        while changed:
            changed = False
            for op in reversed(allops):
                if op.name not in pure or len(op.results) != 1 or op.results[0] is None:
                    continue
                r = op.results[0]
                if r.id in self._lazy_ops or r.id in self.frag_keys or not r.type.shape or r.type.is_ptr:
                    continue
                us = self.users.get(r.id, [])
                if us and all((u.name in self._FRAG_EW and len(u.results) == 1
                               and u.results[0].id in self.frag_keys)
                              or (len(u.results) == 1 and u.results[0].id in self._lazy_ops) for u, _ in us):
                    self._lazy_ops[r.id] = op
                    changed = True
        if _gpu().ROW_SLOTS:
            self._row_slot_analysis()

    def _row_slot_analysis(self) -> None:
        """Row vectors (R,) broadcast (through an (R, 1) reshape) only into fragment-layout ops, with float
        data (not rematerialisable index math), get a slot of their own in shared memory: the value is written
        there right where it is computed (no barrier), and a broadcast reads its rows after a barrier only if
        a slot was written since the last one. The online softmax's new maxima and alpha, and the prefill
        fold's factors, then share barriers instead of two each."""
        for bid, op in self._lazy_ops.items():
            if op.name != "broadcast":
                continue
            src = op.operands[0]
            d = self.defs.get(src.id)
            st = src.type
            if d is None or d.name != "reshape" or len(st.shape) != 2 or st.shape[1] != 1 or st.elem != ir.f32:
                continue
            v = d.operands[0]
            if len(v.type.shape) != 1 or v.id not in self.defs or self._remat_ok(src, set()):
                continue
            off = self._row_of.get(v.id)
            if off is None:
                off = self._row_of[v.id] = self._rows_bytes
                self._rows_bytes += -(-self.T * self.lanes(v.type.shape) * 4 // 16) * 16
            self._row_slots[src.id] = (v.id, off)

    def _row_slot_ptr(self, off: int) -> str:
        """Byte offset (i32 ref) of a row slot (the slots sit above everything else; _ROWS_BASE is filled in at
        the end of lower())."""
        return self.val(f"add i32 {off}, {_ROWS_BASE}", "i32", 0).ref

    def _row_write(self, vid, x: LV) -> None:
        off = self._row_of[vid]
        if off in self._rows_read:
            self.barrier()              # this iteration's readers of the slot's previous value are done
        self.smem_write(x, self._row_slot_ptr(off), claim=False)
        self._rows_written.add(vid)
        self._rows_dirty = True

    def _row_gather(self, vid, F: LV, n: int, shape) -> LV:
        """The rows of each register of fragment layout F (flat indices of an (m, n) tile) from v's slot."""
        off = self._row_of[vid]
        if self._rows_dirty:
            self.barrier()              # one barrier for every slot written since the last
        rows = self.ibin("udiv", LV(F.ref, "i32", F.n), n) if n > 1 else LV(F.ref, "i32", F.n)
        self._rows_read = set(self._rows_read) | {off}
        return self.smem_read("float", self._row_slot_ptr(off), rows, shape)

    def get(self, v):
        x = self.vals.get(v.id)
        if x is None:
            op = self._lazy_ops.get(v.id)
            if op is None:
                raise KeyError(v.id)
            # lowered where it is used, not kept: the use may sit in a region the next one does not see
            x = getattr(self, "op_" + op.name)(op)
            return x[0] if isinstance(x, (list, tuple)) else x
        if isinstance(x, FragV):
            return self._frag_materialise(x)
        return x

    def _if_phi_repr(self, op, j, y):
        """A run-time `if` result held as FragV (_frag_analysis: both branches yield it in one layout) merges as
        its one vector of accumulator registers; the rest as LlvmEmitter.op_if merges them."""
        r = op.results[j]
        if r is None or r.id not in self.frag_keys:
            return super()._if_phi_repr(op, j, y)
        if not isinstance(y, FragV) or y.key != self.frag_keys[r.id]:
            raise CompilationError("internal lowering error: an `if` result left its fragment layout", op.loc)
        return y.lv

    def _if_unphi(self, op, j, like, ph: LV):
        r = op.results[j]
        if r is None or r.id not in self.frag_keys:
            return super()._if_unphi(op, j, like, ph)
        return FragV(like.key, LV(ph.ref, "float", ph.n, tuple(r.type.shape)))

    def yield_values(self, op) -> list:
        keep = self._frag_keep.get(id(op), ()) if self.frag_keys else ()
        return [self.vals[o.id] if j in keep else self.get(o) for j, o in enumerate(op.operands)]

    def lower_op(self, op):
        r = op.results[0] if len(op.results) == 1 else None
        if r is not None and self.frag_keys:
            k = self.frag_keys.get(r.id)
            if k is not None and op.name in self._FRAG_EW:
                return self._frag_elementwise(op, k)
            if r.id in self._lazy_ops:
                return None                 # lowered where a tile-layout user asks for it (get)
        res = getattr(self, "op_" + op.name)(op)
        if r is not None and r.id in self._row_of and isinstance(res, LV):
            self._row_write(r.id, res)      # staged now: its fragment-layout broadcasts share a barrier
        return res

    def _frag_flat(self, key) -> LV:
        """i32 lanes: the flat (m, n) element index of each accumulator register of layout `key`."""
        plan = self._frag_plans[key]
        g = self._mma_geometry(plan)
        ctx = self._mma_ctx(plan, g, plan["k"] + 8, None, None)
        us = [ctx.setup(self.val(f"add i32 {ctx.warp}, {i * self.num_warps}", "i32", 0).ref)
              for i in range(g["per_warp"])]
        refs = ctx.flat_units(us)
        return self._vector_of(refs, "i32", (g["m"], g["n"]))

    def _vector_of(self, refs, et: str, shape) -> LV:
        n = len(refs)
        cur = "poison"
        for j, r in enumerate(refs):
            cur = self.val(f"insertelement {vty(et, n)} {cur}, {et} {r}, i32 {j}", et, n).ref
        return LV(cur, et, n, tuple(shape))

    def _frag_const(self, v, key) -> LV:
        d = self.defs[v.id]
        plan = self._frag_plans[key]
        g = self._mma_geometry(plan)
        n = g["m"] * g["n"] // self.T      # (a fused layout: each thread holds m * n / T accumulators)
        return self.const(float(d.attrs["value"]), "float", n, tuple(v.type.shape))

    def _with_flat(self, shape, F, fn):
        saved = self._flat_override
        self._flat_override = (tuple(shape), F)
        try:
            return fn()
        finally:
            self._flat_override = saved

    def _frag_operand(self, v, key, F) -> LV:
        """Operand v of a fragment-layout op as lanes of the layout F (a FragV's own lanes, or a cheap value
        evaluated there: constants and splats directly, broadcasts recomputed (index math) or gathered from
        shared memory, elementwise ops of those recursively)."""
        x = self.vals.get(v.id)
        if isinstance(x, FragV):
            if x.key != key:
                raise CompilationError("internal lowering error: fragment layouts differ", None)
            return x.lv
        shape = tuple(v.type.shape)
        if not shape:
            return x
        d = self.defs.get(v.id)
        if d is not None and d.name == "const":
            return self._with_flat(shape, F, lambda: self.op_const(d))
        if d is not None and d.name == "splat":
            return self._with_flat(shape, F, lambda: self.op_splat(d))
        if d is not None and d.name == "broadcast":
            src = d.operands[0]
            slot = self._row_slots.get(src.id)
            if slot is not None and slot[0] in self._rows_written:
                return self._row_gather(slot[0], F, shape[1], shape)
            sshape = src.type.shape
            index = self._broadcast_index(sshape, shape)

            def bc():
                r = self._remat_move(src, shape, index)
                return r if r is not None else self._move(self.get(src), sshape, shape, index)
            return self._with_flat(shape, F, bc)
        if d is not None and d.name in ("binary", "select", "unary", "cmp", "cast"):
            return self._frag_apply(d, key, F)
        # any other tile: through shared memory into the fragment layout
        t = self.get(v)
        self.barrier()
        self.smem_write(t, 0)
        self.barrier()
        return self.smem_read(t.et, 0, self.umin(F, _prod(shape) - 1), shape)

    def _frag_apply(self, op, key, F) -> LV:
        subs = {o.id: self._frag_operand(o, key, F) for o in op.operands}
        res = self._lower_with(op, subs, lambda: self._with_flat(op.results[0].type.shape, F,
                                                                 lambda: getattr(self, "op_" + op.name)(op)))
        return LV(res.ref, res.et, res.n, tuple(op.results[0].type.shape))

    def _frag_elementwise(self, op, key) -> FragV:
        return FragV(key, self._frag_apply(op, key, self._frag_flat(key)))

    def _frag_materialise(self, fv: FragV) -> LV:
        """A FragV as the tile layout's value (through shared memory)."""
        shape = tuple(fv.lv.shape)
        F = self._frag_flat(fv.key)
        self.barrier()
        self._with_flat(shape, F, lambda: self.smem_write(fv.lv, 0))
        self.barrier()
        return self.smem_read(fv.lv.et, 0, self.umin(self.flat_index(shape), _prod(shape) - 1), shape)

    def _dot_frag(self, op, plan, g, key) -> FragV:
        """A planned dot whose accumulator is a FragV of its own layout: the MMA chain from zero, then the
        accumulator added per register (the tile path's `mma + acc`, so the same bits), kept as a FragV."""
        acc = self.vals[op.operands[2].id] if len(op.operands) > 2 and op.operands[2] is not None else None
        if acc is not None and (not isinstance(acc, FragV) or acc.key != key):
            raise CompilationError("internal lowering error: a fragment accumulator left its layout", op.loc)
        m, n, k = plan["m"], plan["n"], plan["k"]
        KP = k + 8
        offs_a, offb, _ = self._stage_mma_operands(plan)
        ctx = self._mma_ctx(plan, g, KP, offs_a, offb)
        us = [ctx.setup(self.val(f"add i32 {ctx.warp}, {i * self.num_warps}", "i32", 0).ref)
              for i in range(g["per_warp"])]
        regs = ctx.run_units(us, None)
        if acc is None:
            return FragV(key, self._vector_of(regs, "float", (m, n)))
        if len(regs) != acc.lv.n:
            raise CompilationError("internal lowering error: fragment register counts differ", op.loc)
        outs = []
        for j, r in enumerate(regs):
            x = self.extract(acc.lv, j)
            outs.append(self.val(f"fadd float {r}, {x.ref}", "float", 0).ref)
        return FragV(key, self._vector_of(outs, "float", (m, n)))

    def _dot_a(self, plan):
        """A dot's A operand for staging: (its lanes, None) in the tile layout, or (a FragV's lanes, their flat
        indices) when it is held in accumulator registers (the probabilities p of the flash kernels): the
        staging then writes each register at its element, with no round trip into the tile layout."""
        x = self.vals.get(plan["a"].id)
        if isinstance(x, FragV):
            return x.lv, self._frag_flat(x.key)
        return self.get(plan["a"]), None
