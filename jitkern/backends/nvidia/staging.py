"""Asynchronous operand copies of the NVPTX lowering (a mixin of backends/nvptx.py NvptxLowering).

- cp.async (`_async_analysis`): in kernels launched with num_stages >= 2, a K loop's prefetched dot operands are
  copied global -> shared memory straight into the dot's staging layout (padded rows for mma.sync, core matrices
  for wgmma), two buffers by parity, so the copy of step k + 1 runs during step k's MMAs.
- TMA (`_tma_load`): in kernels launched with the `tma` option, a K loop's jk.tma tiles as one bulk tensor copy
  each, completed on an mbarrier per buffer.
The tiles are the shared lowering's AsyncTile slots (backends/gpu_staging.py), its regions placed at _ASYNC_BASE;
the mbarriers sit above everything else (_TMA_BASE, placed by _staging_layout_end).
"""
from __future__ import annotations

from ... import ir
from ..emitter import LV, _prod, elem_ty
from ..gpu import MmaAcc
from ..gpu_staging import _ASYNC_BASE, AsyncTile

_TMA_BASE = "__jk_tma_base__"          # the TMA regions' mbarriers' byte offset (after everything)


class AsyncCopies:
    """NvptxLowering's cp.async and TMA staging (see the module docstring)."""

    def op_tma(self, op):
        hit = self._async_loads.get(id(op)) if self._async_loads else None
        if hit is not None:
            return self._tma_load(op, *hit)
        return self.get(op.operands[0])

    def _staging_entry(self) -> None:
        if self._tma_nbars:
            self._tma_init_barriers()

    def _staging_layout_end(self) -> None:
        if self._tma_nbars:
            # the TMA regions' mbarriers, above everything (the C tile may overlap the async buffers, never them)
            base = -(-self.smem_bytes // 8) * 8
            self.lines = [ln.replace(_TMA_BASE, str(base)) if ln and _TMA_BASE in ln else ln for ln in self.lines]
            self.smem_bytes = base + 8 * self._tma_nbars

    def _loop_step_end(self) -> None:
        if self._tma_deferred:
            # (a step whose copies no dot issued: issue them here, after a barrier for the buffers' readers)
            self.barrier()
            self._tma_issue_deferred()

    def _async_analysis(self) -> None:
        """In kernels launched with num_stages >= 2 (Triton's option; two stages here) on targets with cp.async:
        K-loop slots whose tiles go global -> shared memory by cp.async (AsyncTile), straight into the dot's
        staging layout, in two buffers: the prefetching loop `v = load(k0); for k: n = load(k + BK); acc =
        dot(v, trans(w), acc); v = n; ...; acc = dot(v, ...)`. A slot qualifies when a 16-bit 2-D load before
        the loop starts it and another load in the body is its yield (each used once), the slot is used only
        as one planned mma.sync dot's A operand (or, through a single-use trans, its B rows), the loop's
        result only so by one dot after the loop, with the same staging shape, and both loads are whole
        aligned chunks (axis analysis) with a chunk-constant mask and zero fill. The copy of step k + 1 then
        runs while step k's MMAs do, without passing through registers.

        Prefetch-2 chains (three buffers): `v = load(k0); v1 = load(k0 + BK); for k: n = load(k); acc = dot(v, ...);
        v = v1; v1 = n; ...; acc = dot(v, ...); acc = dot(v1, ...)`: the head slot v qualifies as above except
        that its yield is the body argument of slot v1, which is used only so, starts with a load and yields a
        body load; its result is the operand of the dot after the head's. The copy of step k + 2 then runs
        while step k's MMAs do (two steps of memory latency covered instead of one)."""
        self._async_loads, self._async_slots, self._async_bytes = {}, {}, 0
        self._async_ahead = {}
        self._async_align = 128
        forced = self.tuning.cp_async
        wanted = forced if forced is not None else int(self.fn.constexprs.get("num_stages") or 1) >= 2
        if not wanted or not self.hooks.has_cp_async:
            return
        use_tma = bool(self.fn.constexprs.get("tma")) and self.hooks.has_tma and self._wg_swizzled()
        passes = self._async_passes()
        linked = {}                     # id(loop result) -> (spec, its loop's TMA decision): a chain going on
        passed = {(id(o), jo) for o, jo in passes.values()}
        registered = {}                 # id(spec) -> [(key of _async_loads, id of an absorbed load or None)]
        for op, body, yop in self._loops():
            args = body.args[1:]
            chains, cands = [], []
            for j, arg in enumerate(args):
                if (id(op), j) in passed:
                    continue            # (a slot this loop only passes on: the inner loop's slot decides)
                (init, res), y = self._async_ends(op, j, passes), yop.operands[j]
                li, ti = self._tma_inner(self.defs.get(init.id))
                link = linked.get(init.id)
                # a prefetch-2 chain: the head's yield is the body argument of slot j2 (see above)
                j2 = next((i for i, a in enumerate(args) if a.id == y.id and i != j), None)
                if j2 is not None:
                    if self.users.get(args[j2].id) != [(yop, j)]:
                        continue
                    (init2, res2), y2 = self._async_ends(op, j2, passes), yop.operands[j2]
                    li2, ti2 = self._tma_inner(self.defs.get(init2.id))
                    ly, ty = self._tma_inner(self.defs.get(y2.id))
                    link2 = linked.get(init2.id)
                    ok2 = (link2 is not None and link is not None and link2[0] is link[0]
                           or li2 is not None and li2.name == "load" and self.uses.get(init2.id) == 1) \
                        and self._async_role(res2) == self._async_role(res) and args[j2].type == arg.type
                    if not ok2:
                        continue
                else:
                    (ly, ty), (li2, ti2) = self._tma_inner(self.defs.get(y.id)), (None, None)
                t = arg.type
                if link is not None:
                    li, ti = None, None         # (the chain's earlier loop loaded its first tiles)
                    li2, ti2 = (None, None) if j2 is not None else (li2, ti2)
                elif li is None or li.name != "load" or self.uses.get(init.id) != 1:
                    continue
                if ly is None or ly.name != "load" or not any(o is ly for o in body.ops) or len(t.shape) != 2 \
                        or t.elem not in (ir.bf16, ir.f16) or self.uses.get(ly.results[0].id) != 1:
                    continue
                r_in, r_out = self._async_role(arg), self._async_role(res)
                if r_out is None and self._async_link_out(res) is not None \
                        and (j2 is None or self._async_link_out(res2) is not None):
                    r_out = r_in                # (the chain goes on in a later loop, which checks its end)
                if r_in is None or r_in != r_out or tuple(t.shape) != r_in[1] \
                        or (li is not None and not self._async_loadable(li)) or not self._async_loadable(ly) \
                        or (li2 is not None and not self._async_loadable(li2)):
                    continue
                rows, k = r_in[1]
                nbuf = 2 if j2 is None else 3
                if link is not None:
                    spec = link[0]
                    if spec["nbuf"] != nbuf or spec["rows"] != rows or spec["KP"] != k + 8:
                        continue
                else:
                    KP = k + 8
                    if r_in[2]:
                        # warpgroup MMAs read core matrices (128-byte swizzled atoms at 1024-byte addresses)
                        al = 1024 if self._wg_swizzled() else 128
                        size = -(-(rows * k * 2 + 16) // al) * al
                        self._async_align = max(self._async_align, al)
                        self._async_bytes = -(-self._async_bytes // al) * al
                    else:
                        size = -(-rows * KP * 2 // 128) * 128
                    spec = dict(off=self._async_bytes, size=size, KP=KP, wg=r_in[2], rows=rows, nbuf=nbuf,
                                chains=1, tma=False)
                    self._async_bytes += nbuf * size
                tma_ok = (link is not None or ti is not None and (j2 is None or ti2 is not None)) \
                    and ty is not None and r_in[2] and k % 64 == 0 and rows % 8 == 0 and rows <= 256
                # (spec, [(load, its tma op, first buffer or the slot it follows)], ...)
                loads = [(ly, ty, arg if j2 is None else args[j2])]
                if link is None:
                    loads.append((li, ti, 0))
                    if j2 is not None:
                        loads.append((li2, ti2, 1))
                slots = [j] if j2 is None else [j, j2]
                cands.append((spec, loads, tma_ok, slots, link))
                if j2 is not None:
                    chains.append(spec)
            # a loop's chains are all fed by TMA (every one qualifies: its tiles are jk.tma boxes staged for
            # warpgroup MMAs with the 128-byte swizzle) or all by cp.async (their waits count groups); a chain
            # going on from an earlier loop keeps that loop's choice (or is not async here)
            tma = use_tma and bool(cands) and all(c[2] for c in cands)
            cands = [c for c in cands if c[4] is None or c[4][1] == tma]
            for spec, loads, _, slots, link in cands:
                if tma and link is None:
                    spec["tma"], spec["bar"] = True, self._tma_nbars
                    spec["pipe"] = bool(self.tuning.tma_pipe)
                    self._tma_nbars += spec["nbuf"]
                for ld, tm, at in loads:
                    hit = (spec, None, at) if isinstance(at, int) else (spec, at, None)
                    if tma:
                        self._async_loads[id(tm)] = hit
                        self._absorbed_loads.add(id(ld))
                    else:
                        self._async_loads[id(ld)] = hit
                    registered.setdefault(id(spec), []).append((id(tm), id(ld)) if tma else (id(ld), None))
                for i, jj in enumerate(slots):
                    # the slot, and the outer loops that only pass it on (their phis carry the tile too)
                    for lp, js in self._async_pass_chain(op, jj, passes):
                        self._async_slots[(id(lp), js)] = spec
                        if i == 0 and len(slots) == 2:
                            a, r = lp.regions[0].args[1 + js], lp.results[js]
                            self._async_ahead[a.id] = self._async_ahead[r.id] = 1
                    r = self._async_ends(op, jj, passes)[1]
                    if self._async_link_out(r) is not None:
                        linked[r.id] = (spec, tma)
            for spec in chains:
                # the loop's chains commit one group each per step, in the same order every step
                spec["chains"] = len(chains)
        # a chain handed to a later loop that did not take it on: that loop would get async tiles as plain
        # values, so such a chain is not async at all (every slot and load of its region dropped)
        dropped = set()
        for rid, (spec, _) in linked.items():
            u = self._async_link_out_of_id(rid)
            if u is None or self._async_slots.get((id(u[0]), u[1])) is not spec:
                dropped.add(id(spec))
        if dropped:
            self._async_slots = {k: v for k, v in self._async_slots.items() if id(v) not in dropped}
            for sid in dropped:
                for key, absorbed in registered.get(sid, ()):
                    self._async_loads.pop(key, None)
                    self._absorbed_loads.discard(absorbed)

    def _async_passes(self) -> dict:
        """Outer loops that only pass a chain on (the serial split's slab loop around its K loop): {(id(inner
        loop), slot): (outer loop, slot)} where the outer slot's body argument is used once, as that inner
        loop's initial value (the inner loop directly in the outer body), and the outer body yields the inner
        loop's result there and nothing else uses it."""
        passes = {}
        for op, body, yop in self._loops():
            for jo, arg in enumerate(body.args[1:]):
                us = self.users.get(arg.id, [])
                if len(us) != 1:
                    continue
                u, idx = us[0]
                if u.name != "for" or idx < 3 or not any(o is u for o in body.ops):
                    continue
                ji = idx - 3
                r = u.results[ji]
                if yop.operands[jo].id != r.id or self.users.get(r.id) != [(yop, jo)]:
                    continue
                passes[(id(u), ji)] = (op, jo)
        return passes

    def _async_pass_chain(self, op, j, passes) -> list:
        """[(loop, slot)] from (op, j) out through the loops that pass it on (_async_passes)."""
        out = [(op, j)]
        while (id(out[-1][0]), out[-1][1]) in passes:
            out.append(passes[(id(out[-1][0]), out[-1][1])])
        return out

    def _async_ends(self, op, j, passes):
        """(initial value, result) of slot j of loop op as seen from outside the loops that pass it on."""
        lp, js = self._async_pass_chain(op, j, passes)[-1]
        return lp.operands[3 + js], lp.results[js]

    def _async_link_out(self, res):
        """(loop, slot) when a loop result's one use is a later loop's initial value of that slot, else None."""
        return self._async_link_out_of_id(res.id)

    def _async_link_out_of_id(self, rid):
        us = self.users.get(rid, [])
        if len(us) != 1 or us[0][0].name != "for" or us[0][1] < 3:
            return None
        return us[0][0], us[0][1] - 3

    def _tma_inner(self, d):
        """(the load under a jk.tma whose only user it is, the tma op), (d, None) for anything else, (None, None)
        for a jk.tma over something other than such a load."""
        if d is None or d.name != "tma":
            return d, None
        inner = self.defs.get(d.operands[0].id)
        if inner is None or inner.name != "load" or self.uses.get(d.operands[0].id) != 1:
            return None, None
        return inner, d

    def _async_role(self, v):
        """("a", (m, k), wg) / ("b", (n, k), wg) when v's one use is a planned dot's A operand / (through a
        single-use trans) its B rows (wg: a warpgroup-MMA dot, whose staging is core matrices), else None."""
        us = self.users.get(v.id, [])
        if len(us) != 1:
            return None
        u, idx = us[0]

        def plan_of(d):
            plan = self.mma_plans.get(id(d))
            ok = plan is not None and not (plan["wg"] and self.tuning.wgmma_pipe) and not plan["split"] \
                and d.results[0].id not in self.frag_keys
            return plan if ok else None
        if u.name == "dot" and idx == 0:
            plan = plan_of(u)
            if plan is not None and plan["a"] is v:
                return ("a", (plan["m"], plan["k"]), bool(plan["wg"]))
        if u.name == "trans" and tuple(u.attrs.get("perm", (1, 0))) == (1, 0):
            tu = self.users.get(u.results[0].id, [])
            if len(tu) == 1 and tu[0][0].name == "dot" and tu[0][1] == 1:
                plan = plan_of(tu[0][0])
                if plan is not None and plan["nk"] and plan["b"] is v:
                    return ("b", (plan["n"], plan["k"]), bool(plan["wg"]))
        return None

    def _async_loadable(self, op) -> bool:
        shape = tuple(op.results[0].type.shape)
        mask = op.operands[1] if len(op.operands) > 1 else None
        V = self._chunk_vector(op.operands[0], mask, shape, op.results[0].type.elem)
        if not V or V * 2 not in (4, 8, 16) or _prod(shape) % (self.T * V):
            return False
        if len(op.operands) > 2 and op.operands[2] is not None:
            d = self.defs.get(op.operands[2].id)
            if d is not None and d.name == "splat":
                d = self.defs.get(d.operands[0].id)
            if d is None or d.name != "const" or float(d.attrs["value"]) != 0.0:
                return False
        return True

    def _core_elem(self, r: str, c: str, R0: int, C0: int) -> str:
        """Element offset (i32 ref) of element (r, c) of an (R0, C0) tile in _smem_write_cores' layout (core
        matrices, or 128-byte swizzled atoms with WGMMA_SWIZZLE)."""
        def op(instr, x, y):
            return self.val(f"{instr} i32 {x}, {y}", "i32", 0).ref
        if self._wg_swizzled():
            d = op("add", op("mul", op("lshr", c, 6), (R0 // 8) * 512), op("shl", r, 6))
            j = op("xor", op("and", op("lshr", c, 3), 7), op("and", r, 7))
            return op("add", op("add", d, op("shl", j, 3)), op("and", c, 7))
        d = op("shl", op("add", op("mul", op("lshr", r, 3), C0 // 8), op("lshr", c, 3)), 6)
        return op("add", op("add", d, op("shl", op("and", r, 7), 3)), op("and", c, 7))

    def _async_region(self, spec, buf: str) -> str:
        """Byte offset (i32 ref) of buffer `buf` of an async region; the regions sit above everything else
        (_ASYNC_BASE is filled in at the end of lower()). A TMA region's tiles carry their copy's sequence
        number in the chain instead (_tma_load): the buffer is that modulo 2."""
        if spec.get("tma"):
            buf = self._tma_buf(spec, buf)
        t = self.val(f"mul i32 {buf}, {spec['size']}", "i32", 0).ref
        t = self.val(f"add i32 {t}, {spec['off']}", "i32", 0).ref
        return self.val(f"add i32 {t}, {_ASYNC_BASE}", "i32", 0).ref

    def _async_load(self, op, spec, slot, first) -> AsyncTile:
        """cp.async of a load's chunks into buffer `first` (a loop's first tiles: 0, and 1 for a chain's second
        slot) or into the buffer after the slot's current tile's (of spec["nbuf"], in turn), at the dot's staging
        addresses (rows of KP elements); masked-off chunks read nothing and are zero-filled. One commit group per
        load."""
        if self.pending_write:
            self.barrier()
        self.pending_read = True
        self._async_ahead_now = 1       # (a copy in flight until a later wait)
        if slot is None:
            buf = str(first)
        elif spec["nbuf"] == 2:
            buf = self.val(f"xor i32 {self.vals[slot.id].buf}, 1", "i32", 0).ref
        else:
            nx = self.val(f"add i32 {self.vals[slot.id].buf}, 1", "i32", 0).ref
            wrap = self.val(f"icmp eq i32 {nx}, {spec['nbuf']}", "i1", 0).ref
            buf = self.val(f"select i1 {wrap}, i32 0, i32 {nx}", "i32", 0).ref
        if not self._async_issued or self._async_issued[-1] == 0:
            self.barrier()      # the buffer's last readers (the previous step's MMAs) are done
        self._async_live = True
        shape = tuple(op.results[0].type.shape)
        p = self.get(op.operands[0])
        mask = self.get(op.operands[1]) if len(op.operands) > 1 and op.operands[1] is not None else None
        et = elem_ty(p.elem)
        esize = p.elem.itemsize
        V = self._chunk_vector(op.operands[0], op.operands[1] if len(op.operands) > 1 else None, shape, p.elem)
        ptrs = self._ptr_vec(p, shape)
        m = self._gpu_mask(shape, mask)
        steps = self._chunk_steps(p, shape, V)
        flat = self.flat_index(shape)
        C0, KP = shape[1], spec["KP"]
        region = self._async_region(spec, buf)
        a3, gas = self.hooks.smem_as, self.hooks.global_as
        safe = None
        gp = None
        for c in range(ptrs.n // V):
            pty, pc, gp = self._chunk_ptr(ptrs, c * V, gp if steps and c else None,
                                          steps[c - 1] if steps and c else None, et)
            e = self.extract(flat, c * V).ref
            r = self.val(f"udiv i32 {e}, {C0}", "i32", 0).ref
            col = self.val(f"urem i32 {e}, {C0}", "i32", 0).ref
            if spec["wg"]:
                d = self._core_elem(r, col, shape[0], C0)     # the warpgroup-MMA staging (_smem_write_cores)
            else:
                d = self.val(f"mul i32 {r}, {KP}", "i32", 0).ref
                d = self.val(f"add i32 {d}, {col}", "i32", 0).ref
            d = self.val(f"shl i32 {d}, 1", "i32", 0).ref
            d = self.val(f"add i32 {d}, {region}", "i32", 0).ref
            dst = self.val(f"getelementptr i8, ptr addrspace({a3}) @__jk_smem, i32 {d}", "ptr", 0).ref
            src, nread = pc.ref, str(V * esize)
            if m is not None:
                mc = self.extract(m, c * V).ref
                if safe is None:
                    safe = self.val(f"addrspacecast ptr {p.base} to {pty}", "ptr", 0).ref if gas else p.base
                src = self.val(f"select i1 {mc}, {pty} {pc.ref}, {pty} {safe}", "ptr", 0).ref
                nread = self.val(f"select i1 {mc}, i32 {V * esize}, i32 0", "i32", 0).ref
            self.hooks.cp_async(self, dst, src, V * esize, nread)
        self.hooks.cp_async_commit(self)
        if self._async_issued:
            self._async_issued[-1] += 1
        return AsyncTile(spec, buf)

    # ---- TMA (sm_90+): a K loop's jk.tma tiles as one bulk tensor copy each (thread 0 issues it), completed
    # through an mbarrier per buffer that counts the bytes in; every thread waits on the barrier's phase.
    def _tma_buf(self, spec, seq: str) -> str:
        """The buffer (i32 ref) of copy `seq` of a TMA chain: seq modulo the region's buffers."""
        if spec["nbuf"] == 2:
            return self.val(f"and i32 {seq}, 1", "i32", 0).ref
        return self.val(f"urem i32 {seq}, {spec['nbuf']}", "i32", 0).ref

    def _tma_parity(self, spec, seq: str) -> str:
        """The phase parity (i32 ref) copy `seq` completes on its buffer's mbarrier: its use count of the
        buffer (seq / buffers) modulo 2."""
        q = self.val(f"lshr i32 {seq}, 1", "i32", 0).ref if spec["nbuf"] == 2 else \
            self.val(f"udiv i32 {seq}, {spec['nbuf']}", "i32", 0).ref
        return self.val(f"and i32 {q}, 1", "i32", 0).ref

    def _tma_bar(self, spec, seq: str) -> str:
        """The shared address (i32 ref) of the mbarrier of copy `seq`'s buffer."""
        b = self._tma_buf(spec, seq)
        b = self.val(f"shl i32 {b}, 3", "i32", 0).ref
        b = self.val(f"add i32 {b}, {spec['bar'] * 8}", "i32", 0).ref
        b = self.val(f"add i32 {b}, {_TMA_BASE}", "i32", 0).ref
        return self.val(f"add i32 {self.hooks.smem_address(self)}, {b}", "i32", 0).ref

    def _tma_bars_of(self, spec) -> list:
        """The shared addresses (i32 refs) of region `spec`'s mbarriers, one per buffer."""
        base = self.val(f"add i32 {self.hooks.smem_address(self)}, {_TMA_BASE}", "i32", 0).ref
        return [self.val(f"add i32 {base}, {(spec['bar'] + i) * 8}", "i32", 0).ref for i in range(spec["nbuf"])]

    def _tma_init_barriers(self) -> None:
        """At the kernel's start: thread 0 initialises every TMA mbarrier (the chains re-initialise theirs at
        their first copy, _tma_load; a barrier follows before any wait)."""
        base = self.val(f"add i32 {self.hooks.smem_address(self)}, {_TMA_BASE}", "i32", 0).ref
        bars = [self.val(f"add i32 {base}, {8 * i}", "i32", 0).ref for i in range(self._tma_nbars)]
        self.hooks.tma_init(self, bars, reinit=False)

    def _tma_load(self, op, spec, slot, first) -> AsyncTile:
        """jk.tma's box (rows x k of a 16-bit matrix) copied by the tensor memory accelerator into the next
        buffer of region `spec`, in the 128-byte swizzled staging the warpgroup MMAs read (one box per 64
        elements of k; TMA's SWIZZLE_128B image of a 128-byte-wide box is that layout, perf/probe_tma.py).
        The tile's `buf` is the copy's sequence number in the chain (0 at the chain's first copy): buffer
        seq % nbuf (2, or 3 for a prefetch-2 chain), waited for at phase parity (seq / nbuf) % 2 of that
        buffer's mbarrier. A chain's first copy
        starts its barriers over (inval + init: a kernel may run the loop again, e.g. the serial split, and
        the phases must restart with the sequence numbers), between two CTA barriers."""
        if self.pending_write:
            self.barrier()
        self.pending_read = True
        self._async_ahead_now = 1       # (a copy in flight until a later wait)
        if slot is None and first == 0:
            seq = "0"
            self.barrier()      # the previous run's readers (of the buffers, and of the barriers' phases) are done
            self.hooks.tma_init(self, self._tma_bars_of(spec), reinit=True)
            self.barrier()
        elif slot is None:
            seq = str(first)    # a prefetch-2 chain's second tile (its barriers were just started over)
        else:
            seq = self.val(f"add i32 {self.vals[slot.id].buf}, 1", "i32", 0).ref
            if not spec.get("pipe") and (not self._async_issued or self._async_issued[-1] == 0):
                self.barrier()  # the buffer's last readers (the previous step's MMAs) are done
        self._async_live = True
        rows, k = tuple(op.results[0].type.shape)
        region = self._async_region(spec, seq)
        dst = self.val(f"add i32 {self.hooks.smem_address(self)}, {region}", "i32", 0).ref
        desc = self.get(op.operands[1]).ref
        row, col = self.get(op.operands[2]).ref, self.get(op.operands[3]).ref
        # the staging's 64-element atoms lie rows * 128 bytes apart: one box each
        boxes = []
        for a in range(k // 64):
            d = dst if a == 0 else self.val(f"add i32 {dst}, {a * rows * 128}", "i32", 0).ref
            c = col if a == 0 else self.val(f"add i32 {col}, {a * 64}", "i32", 0).ref
            boxes.append((d, c))
        copy = (self._tma_bar(spec, seq), desc, row, boxes, rows * k * 2)
        if spec.get("pipe") and slot is not None:
            # TMA_PIPE: the buffer this copy fills is the one the previous step's MMAs read, and they may still
            # run: the dot of this step issues it once they are done (_dot_wgmma_async)
            self._tma_deferred.append(copy)
        else:
            self.hooks.tma_copy(self, *copy)
        if self._async_issued:
            self._async_issued[-1] += 1
        return AsyncTile(spec, seq)

    def _tma_issue_deferred(self) -> None:
        for copy in self._tma_deferred:
            self.hooks.tma_copy(self, *copy)
        self._tma_deferred = []

    def _async_wait(self, *tiles) -> int:
        """Waits for the cp.async copies of the async `tiles` a dot reads: the groups committed after theirs may
        stay in flight (those issued since the loop step began, and a prefetch-2 chain's next step: `ahead`
        times the loop's chains). Returns that `ahead` (0: no later copy of theirs is pending). TMA tiles are
        waited for on their mbarriers' phases instead."""
        tma = [t for t in tiles if t is not None and t.spec.get("tma")]
        if tma:
            # each tile's own barrier: copies of later steps (a prefetch-2 chain's next) go on meanwhile
            for t in tma:
                self.hooks.tma_wait(self, self._tma_bar(t.spec, t.buf), self._tma_parity(t.spec, t.buf))
            tiles = [t for t in tiles if t is not None and not t.spec.get("tma")]
            if not tiles:
                self._async_ahead_now = max(t.ahead for t in tma)
                return self._async_ahead_now
        ahead = max((t.ahead for t in tiles if t is not None), default=0)
        chains = max((t.spec["chains"] for t in tiles if t is not None), default=1)
        issued = self._async_issued[-1] if self._async_issued else 0
        self.hooks.cp_async_wait(self, issued + ahead * chains)
        self._async_ahead_now = ahead
        return ahead


    def _dot_wgmma_async(self, op, plan, g, acc_op, acc_val, frag_in, regs_in, av, bv) -> LV:
        """_dot_wg with operands cp.async copied into core-matrix staging (AsyncTile): the other operand
        (if any) is staged as usual, the copies are waited for, made visible to the async proxy, and the
        MMAs read the buffers in place (not with WGMMA_PIPE: _async_role)."""
        m, n, k = plan["m"], plan["n"], plan["k"]
        al = 1024 if self._wg_swizzled() else 128
        a_async = av if isinstance(av, AsyncTile) else None
        b_async = bv if isinstance(bv, AsyncTile) else None
        if a_async is None:
            parts = self._a_parts(self.get(plan["a"]), plan)
        if b_async is None:
            b = self.get(plan["b"])
        if a_async is None or b_async is None:
            self.barrier()
        off, offs_a = 0, []
        if a_async is not None:
            offs_a = [self._async_region(a_async.spec, a_async.buf)]
        else:
            for p in parts:
                offs_a.append(off)
                off = -(-self._smem_write_cores(LV(p.ref, p.et, p.n, (m, k)), off, (m, k)) // al) * al
        if b_async is not None:
            offb = self._async_region(b_async.spec, b_async.buf)
        else:
            offb = off
            off = -(-self._smem_write_cores(LV(b.ref, b.et, b.n, (n, k)), offb, (n, k)) // al) * al
        ahead = self._async_wait(a_async, b_async)
        keep = (acc_op is None or frag_in is not None) and self._keep_frag(op.result, g["key"])
        pipe = keep and a_async is not None and b_async is not None and bool(self._tma_deferred) \
            and a_async.spec.get("pipe") and b_async.spec.get("pipe")
        if pipe:
            # TMA_PIPE (a K loop's step on TMA tiles): each thread waited on the tiles' mbarriers, which makes
            # the copies visible to it, and nothing else wrote shared memory: no fence or CTA barrier before
            # the MMAs. They stay in flight into the next step: wait only for the previous step's group (the
            # readers of the buffer this step's copies refill), then one barrier (every warpgroup's), then
            # the copies. The accumulators' consumers after the loop wait for the rest (commit_wait 0, or
            # _materialise through plan["in_flight"]).
            regs = self._wgmma_run(plan, g, offs_a, offb, regs_in)
            regs = self.hooks.wgmma_commit(self, regs)
            regs = self.hooks.wgmma_wait(self, 1, regs)
            self.barrier()
            self._tma_issue_deferred()
            plan["in_flight"] = True
            return MmaAcc(g["key"], regs, plan)
        self.hooks.fence_async_smem(self)
        self.barrier()
        regs = self._wgmma_run(plan, g, offs_a, offb, regs_in)
        regs = self.hooks.wgmma_commit_wait(self, regs)
        if keep:
            return MmaAcc(g["key"], regs, plan)
        self.barrier()              # every warpgroup's MMAs are done before any writes the C region
        offc = -(-off // al) * al
        if self._async_live and not self._async_issued and not ahead:
            # the last dot on async buffers (after their loop): after that barrier nothing reads them or the
            # staged operand, so the C tile may overlap both
            self._async_live = False
            offc = 0
        self._claim(offc, g["csize"])
        self._wgmma_store(plan, g, regs, offc)
        self.barrier()
        return self._add_tile_acc(self._tile_read_back(offc, (m, n)), acc_op, acc_val, frag_in, (m, n))
