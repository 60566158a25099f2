"""Fragment-layout values of the GPU lowering (a mixin of backends/gpu.py GpuLowering).

A dot's accumulator on the matrix units is spread over the warps' registers in the MMA's own layout. The tile
layout (backends/gpu.py) deals a tile's elements to threads differently, so every elementwise op on an
accumulator used to cost a round trip through shared memory. `FragV` keeps an (m, n) f32 value in the
accumulator layout instead (one vector lane per register), for the values `_frag_analysis` picks: what the flash
kernels' online softmax does to its accumulator and scores. Cheap operands (constants, splats, broadcasts) are
evaluated in that layout; anything else gets the tile value through shared memory (`get`). The same IEEE
operations run per element, so the bits are the tile path's. Row slots (tuning.row_slots) stage the row
vectors those ops broadcast where they are computed, so several broadcasts share one barrier.
"""
from __future__ import annotations

from .. import ir
from ..language import CompilationError
from .emitter import LV, _ops_of, _prod, vty
from .gpu_lanes import _LaneExpr, _sym
from .gpu_staging import _ROWS_BASE


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
        if not self.tuning.frag_ops:
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
                if j in old or t.elem != ir.f32 or len(t.shape) not in (1, 2) or d is None or d.name != "const":
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
                if res is not None and res.type.elem == ir.f32 and len(res.type.shape) in (1, 2):
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
            elif d.name in ("const", "splat", "arange"):
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
            if op.name == "reduce":
                return self._row_reduce_key(op, fk.get(op.operands[0].id), TOP)
            if len(t.shape) == 1:
                return row_rule(op, t)
            if op.name == "cmp":
                return None
            if len(t.shape) != 2 or not (t.elem == ir.f32 or op.name == "cast" and t.elem in (ir.f16, ir.bf16)):
                return None
            if op.name == "cast" and (op.operands[0].type.elem != ir.f32 or op.attrs.get("bitcast")):
                return None
            if op.name == "binary" and op.attrs["op"] not in self._FRAG_BIN:
                return None
            return merged_key(op, cheap, lambda k: (k[0], k[1]) == tuple(t.shape))

        def merged_key(op, operand_ok, fits):
            """The layout an elementwise op's result takes from its operands: the one concrete layout among them
            if `fits` takes it, TOP if only undecided ones, None with two layouts or an operand that is neither
            held nor `operand_ok`."""
            ks = set()
            for o in op.operands:
                k = fk.get(o.id) if o is not None else None
                if k is not None:
                    ks.add(k)
                elif o is None or not operand_ok(o):
                    return None
            concrete = ks - {TOP}
            if len(concrete) > 1:
                return None
            if concrete:
                k = concrete.pop()
                return k if fits(k) else None
            return TOP if ks else None

        def row_rule(op, t):
            """A row value (R,) of warp-owned MMA rows: an elementwise op (or comparison) of row values of one
            layout and cheap operands (index math included: aranges); f32, or i1 from a comparison."""
            if op.name not in self._FRAG_EW + ("cmp",) or op.name == "cast":
                return None
            if not (t.elem == ir.f32 or op.name == "cmp"):
                return None
            if op.name == "binary" and op.attrs["op"] not in self._FRAG_BIN:
                return None
            return merged_key(op, lambda o: not o.type.shape or cheap(o) or self._row_remat_ok(o),
                              lambda k: k[0] == "row" and k[1] == t.shape[0])

        ops = [op for op in _ops_of(self.fn.body) if len(op.results) == 1 and op.results[0] is not None
               and (id(op) in dots or op.name in self._FRAG_EW + ("reduce", "cmp"))]
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
        if self.tuning.row_slots:
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
            if k is not None and op.name in self._FRAG_EW + ("cmp",):
                return self._frag_elementwise(op, k)
            if r.id in self._lazy_ops:
                return None                 # lowered where a tile-layout user asks for it (get)
        res = getattr(self, "op_" + op.name)(op)
        if r is not None and r.id in self._row_of and isinstance(res, LV):
            self._row_write(r.id, res)      # staged now: its fragment-layout broadcasts share a barrier
        return res

    def _frag_flat(self, key) -> LV:
        """i32 lanes: the flat (m, n) element index of each accumulator register of layout `key` (a row layout:
        the row of each row lane)."""
        if key[0] == "row":
            return self._row_flat(key)
        plan = self._frag_plans[key]
        g = self._mma_geometry(plan)
        ctx = self._mma_ctx(plan, g, plan["k"] + 8, None, None)
        us = self._warp_units(ctx, g)
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
        if key[0] == "row":
            n = self._row_lanes(key)
        else:
            plan = self._frag_plans[key]
            g = self._mma_geometry(plan)
            n = g["per_warp"] * len(self.hooks.mma_layout(0, "f16")["c"])     # (per unit, its C registers)
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
        if key[0] == "row" and self._row_remat_ok(v):
            # index math (a row's position, partition, fold flags) evaluated at each row lane's row
            return self._with_flat(shape, F, lambda: self._remat(v, shape, lambda e: e))
        if d is not None and d.name == "const":
            return self._with_flat(shape, F, lambda: self.op_const(d))
        if d is not None and d.name == "splat":
            return self._with_flat(shape, F, lambda: self.op_splat(d))
        if d is not None and d.name == "arange":
            return self._with_flat(shape, F, lambda: self.op_arange(d))
        if d is not None and d.name == "broadcast":
            src = d.operands[0]
            rv = self._row_source(src)
            if rv is not None and key[0] != "row" and self._row_key(key) == rv.key:
                return self._row_bcast(rv, key, shape)
            rv = self._row_index_math(src, key)
            if rv is not None:
                return self._row_bcast(rv, key, shape)
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
        # warp-owned rows: A's fragments from the registers of the rows its warp owns (P = the scores cast to 16 bits),
        # packed in pairs, instead of staging A and reading it back with ldmatrix (the same values, the same bits)
        a_regs = self._a_from_rows(plan, g) if self.tuning.a_from_rows else None
        pinned = self._pin_frags.get(plan.get("id")) if a_regs is None else None
        if pinned is not None and self._pinned.get(plan["a"].id) is not None:
            # (PIN_REGS: A's fragments were read into registers before the loop, Staging._pin_frags_load)
            a_regs = lambda ui, kk: pinned[ui][kk]      # noqa: E731
        offs_a, offb, _ = self._stage_mma_operands(plan, a_in_regs=a_regs is not None)
        ctx = self._mma_ctx(plan, g, KP, offs_a, offb)
        us = self._warp_units(ctx, g)
        regs = ctx.run_units(us, None, a_regs)
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

    # ------------------------------------------------------------------ row values of warp-owned MMA rows
    # Kernels launched with `warp_rows` deal their MMA tiles so that each warp owns whole rows of a dot's output
    # (GpuLowering._mma_geometry: key (m, n, 1, warps, "rows")). A row reduction of such a fragment value
    # (the online softmax's row max and row sum) then needs no shared memory: each lane folds the registers it
    # holds of the row and the lanes of the row exchange partials by shuffles. Its result is a row value:
    # FragV with key ("row", m, warps), one lane per (row tile of the warp, row of the lane in it), shape (m,);
    # elementwise ops on row values and cheap operands stay row values, and a broadcast of one into a fragment
    # op (m_new[:, None], alpha[:, None]) is a register shuffle. The sum runs in the tile path's order
    # (element 0, 1, ..., n - 1 in turn, the running value handed from lane to lane), so the bits are the tile
    # path's; a max or min does not depend on the order.

    @staticmethod
    def _row_key(key):
        """The row layout of fragment layout `key` (warp-owned rows, any mode), else None."""
        if isinstance(key, tuple) and len(key) == 6 and key[4] == "rows":
            return ("row", key[0], key[3])
        return None

    _ROW_REMAT_BUDGET = 256

    def _row_remat_ok(self, v) -> bool:
        """A 1-D operand of a row op that is index math (rematerialisable: GpuLowering._remat_ok). A row layout
        holds a few lanes a thread, so longer chains than a tile's are worth recomputing (a prefill row's
        partition split; LLVM hoists their loop-invariant part)."""
        return len(v.type.shape) == 1 and self.hooks.remat and self._remat_ok(v, set(), self._ROW_REMAT_BUDGET)

    def _row_info(self):
        """How the MMA accumulator registers hold rows (numpy lanes through hooks.mma_layout), or None when
        the pattern below does not hold: register classes with the same row (H of them; `cls`: the class of
        each C register), the Q consecutive lanes that share a row, and per class the (lane % Q, register)
        of each column in column order (the same for every row group)."""
        if hasattr(self, "_row_info_memo"):
            return self._row_info_memo
        import numpy as np
        info = None
        ws = self.target.warp_size
        MS, NS, _ = self.hooks.mma_shape
        lane = np.arange(ws)
        lay = self.hooks.mma_layout(lane, "f16")
        rows = [np.broadcast_to(np.asarray(r), (ws,)) for r, _ in lay["c"]]
        cols = [np.broadcast_to(np.asarray(c), (ws,)) for _, c in lay["c"]]
        classes, cls = [], []
        for r in rows:
            for h, rr in enumerate(classes):
                if np.array_equal(rr, r):
                    cls.append(h)
                    break
            else:
                classes.append(r)
                cls.append(len(classes) - 1)
        Q = int(np.sum(rows[0] == rows[0][0]))
        ok = Q > 0 and Q & (Q - 1) == 0 and ws % Q == 0
        order = []
        if ok:
            for h, rr in enumerate(classes):
                groups = rr.reshape(ws // Q, Q)
                ok &= bool(np.all(groups == groups[:, :1])) and len(set(rr.tolist())) == ws // Q
                pos = {}
                for j in (j for j, c in enumerate(cls) if c == h):
                    cj = cols[j].reshape(ws // Q, Q)
                    ok &= bool(np.all(cj == cj[:1]))         # column a function of (lane % Q, register)
                    for q in range(Q):
                        pos[int(cj[0, q])] = (q, j)
                ok &= sorted(pos) == list(range(NS))
                order.append([pos[c] for c in sorted(pos)])
        if ok:
            info = dict(H=len(classes), Q=Q, cls=cls, order=order)
        self._row_info_memo = info
        return info

    def _row_reduce_key(self, op, kx, TOP):
        """_frag_analysis: the row layout of a reduction's result, TOP (undecided) or None."""
        if kx is None or op.attrs.get("axis") != 1 or op.attrs.get("kind") not in ("sum", "max", "min"):
            return None
        x = op.operands[0]
        if len(x.type.shape) != 2 or x.type.elem != ir.f32 or op.results[0].type.elem != ir.f32:
            return None
        # (the tile path folds one element a chunk only up to T elements a row: past that its order differs)
        if x.type.shape[1] > self.T or self._row_info() is None:
            return None
        if kx == TOP:
            return TOP
        # (a row split over warps, "split", is not whole in any one warp)
        return self._row_key(kx) if self._row_key(kx) and kx[5] in ("block", "rep") else None

    def _row_geom(self, key):
        """(row tiles a warp owns, row classes H, warps sharing a row tile) of row layout `key`."""
        MS = self.hooks.mma_shape[0]
        TM, W = key[1] // MS, key[2]
        if TM >= W:
            return TM // W, self._row_info()["H"], 1
        return 1, self._row_info()["H"], W // TM

    def _row_lanes(self, key) -> int:
        mtw, H, _ = self._row_geom(key)
        return mtw * H

    def _row_flat(self, key) -> LV:
        """i32 lanes of row layout `key`: the row each lane holds ([row tile of the warp][class] order)."""
        MS = self.hooks.mma_shape[0]
        ws = self.target.warp_size
        mtw, H, rep = self._row_geom(key)
        warp = self.val(f"udiv i32 {self.tid}, {ws}", "i32", 0).ref
        if rep > 1:
            warp = self.val(f"udiv i32 {warp}, {rep}", "i32", 0).ref      # (its row of tiles)
        lane = self.val(f"urem i32 {self.tid}, {ws}", "i32", 0).ref
        lay = self.hooks.mma_layout(_LaneExpr(self, lane), "f16")
        info = self._row_info()
        first = [info["cls"].index(h) for h in range(H)]
        refs = []
        for lt in range(mtw):
            mi = self.val(f"add i32 {self.val(f'mul i32 {warp}, {mtw}', 'i32', 0).ref}, {lt}", "i32", 0).ref
            r0 = self.val(f"mul i32 {mi}, {MS}", "i32", 0).ref
            for h in range(H):
                ref, c = _sym(lay["c"][first[h]][0])
                r = r0 if ref is None else self.val(f"add i32 {r0}, {ref}", "i32", 0).ref
                refs.append(self.val(f"add i32 {r}, {c}", "i32", 0).ref if c else r)
        return self._vector_of(refs, "i32", (key[1],))

    def _row_index_math(self, src, key):
        """src = v[:, None] of 1-D index math v (a row's position, its partition flags) inside an op of fragment
        layout `key` with warp-owned rows: v evaluated in the row layout (a few lanes a thread), to be broadcast by
        _row_bcast, instead of recomputed at every accumulator register (or moved through shared memory when the
        chain is too long for that); None otherwise."""
        rk = self._row_key(key) if key[0] != "row" else None
        d = self.defs.get(src.id)
        if rk is None or d is None or d.name != "reshape" or len(src.type.shape) != 2 or src.type.shape[1] != 1:
            return None
        v = d.operands[0]
        if tuple(v.type.shape) != (rk[1],) or not self._row_remat_ok(v):
            return None
        shape = tuple(v.type.shape)
        lv = self._with_flat(shape, self._row_flat(rk), lambda: self._remat(v, shape, lambda e: e))
        return FragV(rk, LV(lv.ref, lv.et, lv.n, shape))

    def _row_source(self, src):
        """The row value v when src is v[:, None] (an (m, 1) reshape of a value held in a row layout)."""
        d = self.defs.get(src.id)
        if d is None or d.name != "reshape" or tuple(src.type.shape[1:]) != (1,) or len(src.type.shape) != 2:
            return None
        x = self.vals.get(d.operands[0].id)
        return x if isinstance(x, FragV) and x.key[0] == "row" else None

    def _row_bcast(self, rv: "FragV", key, shape) -> LV:
        """Row value rv broadcast into fragment layout `key` (warp-owned rows, same rows): each accumulator
        register takes its row's lane (one shufflevector)."""
        MS, NS, _ = self.hooks.mma_shape
        info = self._row_info()
        H, nc = info["H"], len(info["cls"])
        NT = key[1] // NS
        mtw, _, rep = self._row_geom(self._row_key(key))
        per_warp = mtw * NT if key[5] == "block" else NT if key[5] == "rep" else NT // rep
        # (block: unit i is in the warp's row tile i // NT; rep / split: one row tile)
        idx = [((i // NT) if key[5] == "block" else 0) * H + info["cls"][j] for i in range(per_warp)
               for j in range(nc)]
        n, et = rv.lv.n, rv.lv.et
        mask = "<" + ", ".join(f"i32 {x}" for x in idx) + ">"
        r = self.val(f"shufflevector <{n} x {et}> {rv.lv.ref}, <{n} x {et}> poison, <{len(idx)} x i32> {mask}",
                     et, len(idx))
        return LV(r.ref, et, len(idx), tuple(shape))

    def _row_reduce(self, op, fv: "FragV", rkey) -> "FragV":
        """A row reduction of a warp-owned fragment value, in registers and lane shuffles (see above)."""
        kind = op.attrs["kind"]
        MS, NS, _ = self.hooks.mma_shape
        info = self._row_info()
        H, Q, nc = info["H"], info["Q"], len(info["cls"])
        m, n = fv.lv.shape
        NT = n // NS
        mtw = self._row_geom(rkey)[0]
        ws = self.target.warp_size
        lane = self.val(f"urem i32 {self.tid}, {ws}", "i32", 0).ref
        base = self.val(f"and i32 {lane}, {~(Q - 1) & 0xFFFFFFFF}", "i32", 0).ref
        srcs = {}

        def src(q):
            if q not in srcs:
                srcs[q] = self.val(f"or i32 {base}, {q}", "i32", 0).ref if q else base
            return srcs[q]
        regs = [self.extract(fv.lv, i).ref for i in range(fv.lv.n)]
        out = []
        fn = None if kind == "sum" else self._minmax("maxnum" if kind == "max" else "minnum",
                                                      LV("x", "float", 0))
        for lt in range(mtw):
            for h in range(H):
                if kind == "sum":
                    # element by element in column order from -0.0 (the tile path's operations), the running
                    # value handed to the lane that holds the next column
                    a, owner = "-0.0", None
                    for nt in range(NT):
                        for q, j in info["order"][h]:
                            if owner is not None and q != owner:
                                a = self.hooks.shuffle_idx(self, a, src(owner))
                            e = regs[(lt * NT + nt) * nc + j]
                            t = self.val(f"fadd float -0.0, {e}", "float", 0).ref
                            a = self.val(f"fadd float {a}, {t}", "float", 0).ref
                            owner = q
                    a = self.hooks.shuffle_idx(self, a, src(owner))
                else:
                    # from the identity, as the tile path (an element that is NaN is skipped either way)
                    a = "0xFFF0000000000000" if kind == "max" else "0x7FF0000000000000"
                    for nt in range(NT):
                        for q, j in info["order"][h]:
                            e = regs[(lt * NT + nt) * nc + j]
                            a = self.val(f"call float @{fn}(float {a}, float {e})", "float", 0).ref
                    s_ = 1
                    while s_ < Q:
                        o = self.hooks.shuffle_xor(self, a, s_)
                        a = self.val(f"call float @{fn}(float {a}, float {o})", "float", 0).ref
                        s_ *= 2
                out.append(a)
        return FragV(rkey, self._vector_of(out, "float", (m,)))

    def _a_from_rows(self, plan, g):
        """fn(unit index, k step) -> A's fragment registers of a dot with warp-owned rows whose A is a fragment
        value of the same rows (block or rep mode, the dot's row tiles the value's: same m and warps) whose
        columns are this dot's K; or None. Which accumulator registers make each A register is read off
        mma_layout with numpy lanes (NVIDIA m16n8k16: a0 = c0, c1 of column tile 2 kk, a1 = c2, c3 of it,
        a2 / a3 the same of column tile 2 kk + 1)."""
        import numpy as np
        x = self.vals.get(plan["a"].id)
        mode = g.get("rows")
        if not isinstance(x, FragV) or not mode or plan["split"] or x.key[0] == "row":
            return None
        kx = x.key
        if self._row_key(kx) is None or kx[5] not in ("block", "rep") or self._row_key(kx) != ("row", g["m"],
                                                                                             self.num_warps):
            return None
        MS, NS, KS = self.hooks.mma_shape
        if x.lv.shape != (g["m"], plan["k"]) or x.lv.et not in ("i16", "half", "bfloat"):
            return None
        ws = self.target.warp_size
        kind = "bf16" if plan["kind"] == ir.bf16 else "f16"
        lay = self.hooks.mma_layout(np.arange(ws), kind)
        if lay["a_ty"] != "i32" or lay["a_elems"] != 2:
            return None
        crow = [np.broadcast_to(np.asarray(r), (ws,)) for r, _ in lay["c"]]
        ccol = [np.broadcast_to(np.asarray(c), (ws,)) for _, c in lay["c"]]
        src = []                                # per A register: [(column tile offset, C register)] x 2
        for r, kc in lay["a"]:
            r, kc = np.broadcast_to(np.asarray(r), (ws,)), np.broadcast_to(np.asarray(kc), (ws,))
            pair = []
            for e in (0, 1):
                col = kc + e
                off = col // NS
                if not np.all(off == off[0]):
                    return None
                js = [j for j in range(len(lay["c"])) if np.array_equal(crow[j], r % MS)
                      and np.array_equal(ccol[j], col % NS)]
                if not js:
                    return None
                pair.append((int(off[0]), js[0]))
            src.append(pair)
        NTx = plan["k"] // NS                   # the value's column tiles (this dot's K)
        NTd = g["n"] // NS
        nc = len(lay["c"])
        per = KS // NS
        memo = {}

        def regs(ui, kk):
            lt = ui // NTd if mode == "block" else 0
            if (lt, kk) not in memo:
                out = []
                for pair in src:
                    hs = [self.extract(x.lv, (lt * NTx + kk * per + off) * nc + j).ref for off, j in pair]
                    v = self.val(f"insertelement <2 x {x.lv.et}> poison, {x.lv.et} {hs[0]}, i32 0",
                                 x.lv.et, 2).ref
                    v = self.val(f"insertelement <2 x {x.lv.et}> {v}, {x.lv.et} {hs[1]}, i32 1", x.lv.et, 2).ref
                    out.append(self.val(f"bitcast <2 x {x.lv.et}> {v} to i32", "i32", 0).ref)
                memo[(lt, kk)] = out
            return memo[(lt, kk)]
        return regs
