"""Operand staging of the GPU lowering beyond writing registers to shared memory (a mixin of backends/gpu.py
GpuLowering).

- Asynchronous tiles (`AsyncTile`): a K loop's dot operands that a target's copy engine brings global -> shared
  memory straight into the dot's staging layout, in buffers by parity; the shared lowering carries them through
  loops and waits for them before a dot (`_stage_mma_operands`); the copies themselves are the target's
  (backends/nvidia/staging.py: cp.async and TMA; `_async_analysis` finds none elsewhere).
- Pinned operands (`_pin_analysis`, tuning.pin_operands): a loop's dot whose A operand is defined outside the
  loop has it staged once, before the loop.
Regions of both sit above the rest of shared memory (placeholders filled in at the end of lower()), or overlap
it when nothing else claims shared memory while they are live.
"""
from __future__ import annotations

from .emitter import LV, _ops_of

_ASYNC_BASE = "__jk_async_base__"      # the async regions' byte offset, known once the rest is laid out
_ROWS_BASE = "__jk_rows_base__"        # the row slots' byte offset (after the async regions)
_PIN_BASE = "__jk_pin_base__"          # the pinned operands' byte offset (after the row slots)


class AsyncTile:
    """A 16-bit tile a K loop prefetches for its dot, copied global -> shared memory by the target's copy engine
    straight into the dot's staging layout (rows of k + 8 elements) in one of the spec["nbuf"] buffers of region
    `spec` (the target's _async_analysis); `buf` is the buffer (an i32 ref: the loop carries it as a phi); `ahead`: how
    many later steps' copies of its chain may still be in flight when a dot reads it (1 for the head of a
    prefetch-2 chain, else 0)."""
    __slots__ = ("spec", "buf", "ahead")

    def __init__(self, spec, buf, ahead=0):
        self.spec, self.buf, self.ahead = spec, buf, ahead


class Staging:
    """GpuLowering's asynchronous-tile and pinned-operand staging (see the module docstring)."""

    def _pin_analysis(self) -> None:
        """Dots directly in a loop's body whose A operand (16-bit, or f32 split in parts) is defined outside the
        loop: the flash kernels' query tile, the same every block. Each such value gets a region of its own
        (above everything else, _PIN_BASE), written once before the loop (_pin_stage); the dots then stage
        only B each step. On by default (tuning.pin_operands)."""
        self._pins = {}
        if not self.tuning.pin_operands:
            return
        for op, body, _ in self._loops():
            inside = {r.id for o in _ops_of(body) for r in o.results if r is not None}
            inside |= {a.id for a in body.args}
            seen = {}
            for d in body.ops:
                plan = self.mma_plans.get(id(d))
                if d.name != "dot" or plan is None or plan["wg"] or plan["a"].id in inside \
                        or plan["a"].id in self.frag_keys:
                    continue
                a = plan["a"]
                if a.id in seen:
                    continue
                m, k = plan["m"], plan["k"]
                KP = k + 8
                nparts = 2 if plan["split"] else 1
                size = -(-((m * KP + 4) * 2) // 16) * 16     # rows of KP + the padding lanes' scratch
                offs = []
                for _ in range(nparts):
                    offs.append(self._pin_bytes)
                    self._pin_bytes += size
                seen[a.id] = True
                self._pins.setdefault(id(op), []).append((a, plan, offs))

    def _costage_analysis(self) -> None:
        """Warp-owned rows: a loop body's dot D2 whose A comes from registers (P, _a_from_rows) and whose B is
        ready before an earlier dot D1 of the body (the V tile, loaded before the scores' dot) has its B staged
        by D1, in a region of its own above everything else (_PIN_BASE, as pinned operands), between D1's
        barriers; D2 then stages nothing and needs no barrier (D1's trailing barrier made B visible, and the
        next step's D1 writes it again only after its leading barrier, which every warp reaches after its D2).
        The online softmax's step is then one barrier pair (K and V together) instead of two."""
        self._costage, self._prestaged = {}, {}
        if not (self.tuning.costage and self.tuning.a_from_rows and self._warp_rows_on()):
            return
        staged_async = self._async_loads_values()
        for loop, body, _ in self._loops():
            at = {}
            for i, d in enumerate(body.ops):
                for o in [d] + [x for rg in d.regions for x in _ops_of(rg)]:
                    for r in o.results:
                        if r is not None:
                            at[r.id] = i
            dots = [(i, d) for i, d in enumerate(body.ops) if d.name == "dot" and id(d) in self.mma_plans]
            for j, (i1, d1) in enumerate(dots):
                p1 = self.mma_plans[id(d1)]
                if p1["wg"] or id(d1) in self._prestaged:
                    continue
                for i2, d2 in dots[j + 1:]:
                    p2 = self.mma_plans[id(d2)]
                    if id(d2) in self._prestaged or not self._a_rows_static(p2):
                        continue
                    b = p2["b"]
                    if at.get(b.id, -1) >= i1 or b.id in staged_async:
                        continue
                    shape2, row2, tr2 = self._b_rows(p2)
                    # (its rows as staged, _b_rows, + the padding lanes' scratch)
                    size = -(-(((shape2[1] if tr2 else shape2[0]) * row2 + 8) * 2) // 16) * 16
                    off = self._pin_bytes
                    self._pin_bytes += size
                    self._costage.setdefault(id(d1), []).append((p2, off))
                    self._prestaged[id(d2)] = off

    def _async_loads_values(self) -> set:
        """Ids of the values staged by cp.async / TMA (AsyncTile slots and their loads)."""
        out = set()
        for op, body, _ in self._loops():
            for j, a in enumerate(body.args[1:]):
                if (id(op), j) in self._async_slots:
                    out.add(a.id)
        return out

    def _a_rows_static(self, plan) -> bool:
        """Whether a dot's A is, by _frag_analysis, a fragment value of the rows its warps own (block or rep
        mode) of this dot's row tiles (what _a_from_rows takes the fragments from)."""
        k = self.frag_keys.get(plan["a"].id)
        g = self._mma_geometry(plan)
        return bool(k and k[0] != "row" and self._row_key(k) and k[5] in ("block", "rep") and not plan["split"]
                    and g.get("rows") and self._row_key(k) == ("row", plan["m"], self.num_warps)
                    and (k[0], k[1]) == (plan["m"], plan["k"]))

    def _pin_stage(self, loop) -> list:
        """Stages the pinned A operands of `loop`'s dots before it; returns their value ids."""
        out = []
        pins = self._pins.get(id(loop), ())
        if pins:
            self.barrier()              # an earlier run of this loop's dots may still read the regions
        for a, plan, offs in pins:
            m, k = plan["m"], plan["k"]
            parts = self._a_parts(self.get(a), plan)
            refs = []
            for p, rel in zip(parts, offs):
                ref = self.val(f"add i32 {rel}, {_PIN_BASE}", "i32", 0).ref
                self._smem_write_rows(LV(p.ref, p.et, p.n, (m, k)), ref, (m, k), k + 8, False, claim=False)
                refs.append(ref)
            self._pinned[a.id] = refs
            out.append(a.id)
        if pins and self.tuning.pin_regs:
            self._pin_frags_load(pins)
        return out

    def _pin_frags_load(self, pins) -> None:
        """PIN_REGS: each pinned A (one part, fragments by ldmatrix) read into this warp's fragment registers for
        its dot's units, once, after the pinned rows are visible; the dot (FragmentOps._dot_frag) then takes its A
        from them every step. The units are set up as the dot's will be (the same geometry), so unit i here is
        unit i there."""
        self.barrier()
        for a, plan, offs in pins:
            if plan["split"] or len(offs) != 1 or plan.get("id") in self._pin_frags:
                continue
            g = self._mma_geometry(plan)
            ctx = self._mma_ctx(plan, g, plan["k"] + 8, self._pinned[a.id], None)
            if not ctx.ldm:
                continue
            us = self._warp_units(ctx, g)
            self._pin_frags[plan.get("id")] = ctx.a_frags(us)

    def _loops(self):
        """(for op, its body, the body's yield) of every loop of the kernel."""
        for op in _ops_of(self.fn.body):
            if op.name == "for":
                body = op.regions[0]
                if body.ops and body.ops[-1].name == "yield":
                    yield op, body, body.ops[-1]


    def _stage_mma_operands(self, plan, a_in_regs=False):
        """Stages a planned dot's A (parts) and B in shared memory as padded rows of k + 8 elements; operands
        already there (AsyncTile: copied by the target's copy engine) are waited for instead. Returns (A regions,
        B region, end of what was staged); regions are byte offsets (ints, or i32 refs for async buffers)."""
        m, n, k = plan["m"], plan["n"], plan["k"]
        KP = k + 8
        av, bv = self.vals.get(plan["a"].id), self.vals.get(plan["b"].id)
        a_async = av if isinstance(av, AsyncTile) else None
        b_async = bv if isinstance(bv, AsyncTile) else None
        pinned = self._pinned.get(plan["a"].id)
        if a_in_regs:
            a_async, pinned = None, (None,)     # (A's fragments come from registers: nothing to stage)
        pre = self._prestaged.get(plan.get("id"))
        if pre is not None:
            offb_pre = self.val(f"add i32 {pre}, {_PIN_BASE}", "i32", 0).ref
            if a_in_regs:
                return [None], offb_pre, 0      # (staged by an earlier dot, between its barriers)
            b_async = "pre"
        if a_async is None and pinned is None:
            a, aflat = self._dot_a(plan)
            parts = self._a_parts(a, plan)
        if b_async is None:
            b = self.get(plan["b"])
        if (a_async is None and pinned is None) or b_async is None:
            self.barrier()
        off, offs_a = 0, []
        if a_async is not None:
            offs_a = [self._async_region(a_async.spec, a_async.buf)]
        elif pinned is not None:
            offs_a = list(pinned)               # staged once before the loop (_pin_stage)
        else:
            for p in parts:
                offs_a.append(off)
                off = self._with_flat((m, k), aflat, lambda: self._smem_write_rows(
                    LV(p.ref, p.et, p.n, (m, k)), off, (m, k), KP, False)) if aflat is not None else \
                    self._smem_write_rows(LV(p.ref, p.et, p.n, (m, k)), off, (m, k), KP, False)
        if b_async == "pre":
            offb, b_async = offb_pre, None
        elif b_async is not None:
            offb = self._async_region(b_async.spec, b_async.buf)
        else:
            offb = off
            shape_b, row_b, tr_b = self._b_rows(plan)
            off = self._smem_write_rows(LV(b.ref, b.et, b.n, shape_b), offb, shape_b, row_b, tr_b)
        for p2, rel in self._costage.get(plan.get("id"), ()):
            # a later dot's B (the V tile), in its own region: visible to it after this dot's barrier
            b2 = self.get(p2["b"])
            shape2, row2, tr2 = self._b_rows(p2)
            ref = self.val(f"add i32 {rel}, {_PIN_BASE}", "i32", 0).ref
            self._smem_write_rows(LV(b2.ref, b2.et, b2.n, shape2), ref, shape2, row2, tr2, claim=False)
        if a_async is not None or b_async is not None:
            self._async_wait(a_async, b_async)
        self.barrier()
        return offs_a, offb, off

