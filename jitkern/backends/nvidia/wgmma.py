"""Dots as warpgroup MMAs (NVIDIA sm_90a wgmma), a mixin of the NVPTX lowering (backends/nvptx.py
NvptxLowering): in kernels launched with the `wgmma` option, a planned dot(x, trans(w)) runs as m64nNk16 chains
with both operands staged K-major as core matrices in shared memory (128-byte swizzled where tuning.wgmma_swizzle
asks), and sums of such accumulators stay in their registers (_wg_sum_analysis). The shared lowering
(backends/gpu.py GpuLowering) calls the hook points _wg_fits, _wg_swizzled, _dot_wg, _materialise_wg and
_wg_sum_analysis; elsewhere they keep every dot on the warp-level MMAs.
"""
from __future__ import annotations

from ... import ir
from ..emitter import LV, _ops_of, vty
from ..gpu import _ES, MmaAcc
from ..gpu_staging import AsyncTile


class WarpgroupMma:
    """NvptxLowering's warpgroup-MMA dots (see the module docstring)."""

    def _wg_fits(self, plan) -> bool:
        """Whether a planned dot runs as warpgroup MMAs (_dot_wg): only in kernels launched with the
        `wgmma` option (a kernel's dots must all give the bits its callers expect, so the kernel opts in as a
        whole), on targets that have them, for dot(x, trans(w)) with w's rows a whole number of 64-row blocks
        per warpgroup and 8..256 tokens (x's rows) in steps of 8."""
        if not self.fn.constexprs.get("wgmma") or not self.hooks.has_wgmma:
            return False
        m, n, k = plan["m"], plan["n"], plan["k"]
        wgs = self.num_warps // 4
        return (plan["nk"] and self.num_warps % 4 == 0 and n % 64 == 0 and (n // 64) % wgs == 0
                and m % 8 == 0 and 8 <= m <= 256 and k % 16 == 0)

    def _materialise_wg(self, acc: MmaAcc, plan, g) -> LV:
        """A warpgroup-MMA accumulator as the tile layout's value (GpuLowering._materialise)."""
        regs = acc.regs
        if self.tuning.wgmma_pipe or plan.get("in_flight"):
            regs = self.hooks.wgmma_wait(self, 0, regs)     # (its last group was committed, not waited)
        if self._async_live and not self._async_issued and not self._async_ahead_now:
            # outside every loop, and the last async wait was after the last copy and had none of its
            # chain still coming: no copy is in flight and (after the barrier below) no MMA reads the
            # buffers, so the C tile may overlap them (the register sums of _wg_sum_analysis end here)
            self._async_live = False
        self.barrier()
        self._claim(0, g["csize"])
        self._wgmma_store(plan, g, regs, 0)
        self.barrier()
        return self._tile_read_back(0, (plan["m"], plan["n"]))

    def _smem_write_cores(self, x: LV, off: int, shape, dyn=None) -> int:
        """Writes an (R0, C0) 16-bit tile K-major as wgmma's core matrices without swizzle: 8 rows x 8
        elements (16 bytes a row) in 128 contiguous bytes, core matrices adjacent along C0 (K) next to each
        other (128 bytes apart), row blocks of 8 C0 / 8 * 128 bytes apart. Element (r, c) goes to element
        offset ((r >> 3) * (C0 / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7); a thread's run of V = 4
        consecutive elements stays inside one core-matrix row (one 8-byte store)."""
        R0, C0 = shape
        assert R0 % 8 == 0 and C0 % 8 == 0
        numel = R0 * C0
        V = self.vec(shape)
        flat = self.flat_index(shape)
        r, c = self._coords(flat, shape)
        n = flat.n
        if self._wg_swizzled():
            # 128-byte swizzle: K in atoms of 64 elements; atom a's rows at a * R0 / 8 * 1024 elements * 2 bytes
            # ... in elements: row r at (r >> 3) * 512 + (r & 7) * 64 of its atom, its 8-element chunk j at chunk
            # j ^ (r & 7) (the hardware XORs address bits 4-6 with bits 7-9 of 1024-byte aligned atoms)
            a_ = self.ibin("lshr", c, 6)
            d = self.ibin("mul", a_, (R0 // 8) * 512)
            d = self.ibin("add", d, self.ibin("shl", r, 6))
            j_ = self.ibin("xor", self.ibin("and", self.ibin("lshr", c, 3), 7), self.ibin("and", r, 7))
            d = self.ibin("add", d, self.ibin("shl", j_, 3))
            d = self.ibin("add", d, self.ibin("and", c, 7))
        else:
            d = self.ibin("add", self.ibin("mul", self.ibin("lshr", r, 3), C0 // 8), self.ibin("lshr", c, 3))
            d = self.ibin("shl", d, 6)
            d = self.ibin("add", d, self.ibin("shl", self.ibin("and", r, 7), 3))
            d = self.ibin("add", d, self.ibin("and", c, 7))
        scratch = numel                                   # padding lanes write past the tile
        if numel % (self.T * V) != 0:
            ok = self.val(f"icmp ult {flat.ty} {flat.ref}, {self.iconst(numel, n).ref}", "i1", n)
            d = self.val(f"select {ok.ty} {ok.ref}, {d.ty} {d.ref}, {d.ty} {self.iconst(scratch, n).ref}",
                         "i32", n)
        a = self.hooks.smem_as
        base = self.smem_ptr(off)
        if dyn is not None:
            base = self.val(f"getelementptr i8, ptr addrspace({a}) {base}, i32 {dyn}", "ptr", 0).ref
        step = V if V > 1 and C0 % V == 0 and 8 % V == 0 else 1
        vt = vty(x.et, step) if step > 1 else x.et
        for j in range(0, n, step):
            dj = self.extract(d, j)
            ptr = self.val(f"getelementptr {x.et}, ptr addrspace({a}) {base}, i32 {dj.ref}", "ptr", 0)
            part = self.shuffle(x, list(range(j, j + step))) if step > 1 else self.extract(x, j)
            self.emit(f"store {vt} {part.ref}, ptr addrspace({a}) {ptr.ref}, align {step * _ES[x.et]}")
        return self._claim(off, (numel + V) * _ES[x.et])

    def _wg_swizzled(self) -> bool:
        """Whether this kernel stages its warpgroup-MMA operands 128-byte swizzled (tuning.wgmma_swizzle, and every
        such dot's K a multiple of 64)."""
        plans = [p for p in self.mma_plans.values() if p.get("wg")]
        return self.tuning.wgmma_swizzle == 128 and bool(plans) and all(p["k"] % 64 == 0 for p in plans)

    def _dot_wg(self, op, plan) -> LV:
        """dot(x, trans(w)) as warpgroup MMAs with the operands' roles swapped ("swap AB"): w's (n, k) rows
        are wgmma's A (64-row blocks, one warpgroup each in turn), x's m rows (tokens) its B (N = m), both
        staged K-major as core matrices; f32 x as hi + lo parts in separate accumulators, as the mma.sync path
        does. Per output the K steps run in order as chains of m64nNk16 MMAs whatever the tile, so a
        token's result should not depend on the others (to be verified on the GPU: perf/probe_wgmma.py).
        tuning.wgmma_pipe: operands in this dot's own buffers (two inside a register-accumulator loop, by iteration
        parity), a wait for all but the latest group before staging, and no wait after the MMAs while the
        accumulator stays in registers (its consumers wait: _materialise, the next dot)."""
        m, n, k = plan["m"], plan["n"], plan["k"]
        g = self._mma_geometry(plan)
        acc_op, acc_val, frag_in = self._frag_acc_in(op, g)
        pipe = self.tuning.wgmma_pipe
        regs_in = frag_in.regs if frag_in is not None else None
        if pipe and regs_in is not None:
            # the group that last read the buffer staged next has finished (only the latest may still run)
            regs_in = self.hooks.wgmma_wait(self, 1, regs_in)
        elif pipe:
            self.hooks.wgmma_wait(self, 1, [])
        av, bv = self.vals.get(plan["a"].id), self.vals.get(plan["b"].id)
        if isinstance(av, AsyncTile) or isinstance(bv, AsyncTile):
            return self._dot_wgmma_async(op, plan, g, acc_op, acc_val, frag_in, regs_in, av, bv)
        a = self.get(plan["a"])
        parts = self._a_parts(a, plan)
        b = self.get(plan["b"])
        self.barrier()
        al = 1024 if self._wg_swizzled() else 128      # swizzle atoms must sit at 1024-byte addresses
        base, dyn = 0, None
        if pipe:
            base, size, nbuf = self._wg_region(op, plan, al)
            if nbuf == 2 and self._frag_loops:
                iv, lb, step = self._frag_loops[-1]
                t = lb.et
                d_ = self.val(f"sub {t} {iv}, {lb.ref}", t, 0)
                d_ = self.val(f"sdiv {t} {d_.ref}, {step.ref}", t, 0)
                d_ = self.val(f"and {t} {d_.ref}, 1", t, 0)
                if t != "i32":
                    d_ = self.val(f"trunc {t} {d_.ref} to i32", "i32", 0)
                dyn = self.val(f"mul i32 {d_.ref}, {size}", "i32", 0).ref
        off, offs_a = base, []
        for p in parts:
            offs_a.append(off)
            off = -(-self._smem_write_cores(LV(p.ref, p.et, p.n, (m, k)), off, (m, k), dyn) // al) * al
        offb = off
        off = -(-self._smem_write_cores(LV(b.ref, b.et, b.n, (n, k)), offb, (n, k), dyn) // al) * al
        offc = self._wg_c_offset(al) if pipe else off
        self._claim(offc, g["csize"])
        self.hooks.fence_async_smem(self)
        self.barrier()
        regs = self._wgmma_run(plan, g, offs_a, offb, regs_in, dyn)
        keep = (acc_op is None or frag_in is not None) and self._keep_frag(op.result, g["key"])
        if keep and pipe:
            return MmaAcc(g["key"], self.hooks.wgmma_commit(self, regs), plan)
        regs = self.hooks.wgmma_commit_wait(self, regs)
        if keep:
            return MmaAcc(g["key"], regs, plan)
        if pipe:
            self.barrier()          # every warpgroup's MMAs are done before any writes the C region
        self._wgmma_store(plan, g, regs, offc)
        self.barrier()
        return self._add_tile_acc(self._tile_read_back(offc, (m, n)), acc_op, acc_val, frag_in, (m, n))

    def _wg_region(self, op, plan, al) -> tuple:
        """(byte offset, bytes of one buffer, buffers) of a pipelined wgmma dot's operand buffers: every such
        dot of the kernel has its own (two for a dot inside a loop), laid out once in program order, so no
        dot stages over operands a still-running group of another dot reads."""
        if self._wg_regions is None:
            self._wg_regions = {}
            off = 0

            def walk(block, in_loop):
                nonlocal off
                for o in block.ops:
                    pl = self.mma_plans.get(id(o))
                    if o.name == "dot" and pl is not None and pl.get("wg"):
                        parts = 2 if pl["split"] else 1
                        # (+ 16 bytes: padding lanes of _smem_write_cores store just past each operand)
                        sz = parts * (-(-(pl["m"] * pl["k"] * 2 + 16) // al) * al) \
                            + -(-(pl["n"] * pl["k"] * 2 + 16) // al) * al
                        nb = 2 if in_loop else 1
                        self._wg_regions[id(o)] = (off, sz, nb)
                        off += sz * nb
                    for r in o.regions:
                        walk(r, in_loop or o.name == "for")
            walk(self.fn.body, False)
            self._wg_end = off
        return self._wg_regions[id(op)]

    def _wg_c_offset(self, al) -> int:
        """The C (result) region of pipelined wgmma dots: past every operand buffer."""
        return -(-self._wg_end // al) * al

    def _warpgroup_ids(self) -> tuple:
        """(warp, lane, warpgroup, warp within the warpgroup) of this thread, as i32 refs."""
        ws = self.target.warp_size
        warp = self.val(f"udiv i32 {self.tid}, {ws}", "i32", 0).ref
        lane = self.val(f"urem i32 {self.tid}, {ws}", "i32", 0).ref
        wg = self.val(f"udiv i32 {warp}, 4", "i32", 0).ref
        q = self.val(f"urem i32 {warp}, 4", "i32", 0).ref
        return warp, lane, wg, q

    def _wgmma_run(self, plan, g, offs_a, offb, init, dyn=None) -> list:
        """The K steps of one staged dot (not yet committed): registers [block][part][m / 2], from `init` or
        0.0; dyn: an i32 byte offset added to the staged regions' addresses (a pipelined dot's buffer)."""
        m, k = plan["m"], plan["k"]
        kind = "bf16" if plan["kind"] == ir.bf16 else "f16"
        nr = m // 2
        regs = list(init) if init is not None else ["0.0"] * g["nregs"]
        wg = self._warpgroup_ids()[2]
        smem = self.hooks.smem_address(self)
        row_block = 8 * (k // 8) * 128              # bytes of one 64-row block of w
        sw = self._wg_swizzled()
        if sw:
            # 128-byte swizzle (mode 1, bits 62-63): stride byte offset 1024 (8-row groups), leading byte
            # offset unused (1); K step s starts (s % 4) * 32 bytes into atom s // 4
            cdesc = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)
        else:
            # no swizzle: leading byte offset (core matrices adjacent in K) 128, stride byte offset (adjacent
            # 8-row groups) k / 8 * 128, base offset 0
            cdesc = ((128 >> 4) << 16) | (((k // 8) * 128 >> 4) << 32)

        def kstep(rows, s_):
            """Byte offset of K step s_ in an operand region of `rows` rows."""
            return (s_ // 4) * (rows // 8) * 1024 + (s_ % 4) * 32 if sw else s_ * 256

        def desc(byte_ref):
            a_ = self.val(f"lshr i32 {byte_ref}, 4", "i32", 0)
            a_ = self.val(f"and i32 {a_.ref}, 16383", "i32", 0)
            w_ = self.val(f"zext i32 {a_.ref} to i64", "i64", 0)
            return self.val(f"or i64 {w_.ref}, {cdesc}", "i64", 0).ref

        n = plan["n"]
        wbase = self.val(f"mul i32 {wg}, {g['per_wg'] * (8 * 1024 if sw else row_block)}", "i32", 0)
        wbase = self.val(f"add i32 {wbase.ref}, {smem}", "i32", 0).ref
        if dyn is not None:
            smem = self.val(f"add i32 {smem}, {dyn}", "i32", 0).ref
            wbase = self.val(f"add i32 {wbase}, {dyn}", "i32", 0).ref
        regs = self.hooks.wgmma_fence(self, regs)
        for s_ in range(k // 16):
            for blk in range(g["per_wg"]):
                # (swizzled: w's 64-row blocks are 8 row groups of 1024 bytes in each K atom, so a block's
                # atom-0 rows start blk * 8 KiB in and its K step adds the atom's n / 8 * 1024 stride)
                wblk = blk * 8 * 1024 if sw else blk * row_block
                if isinstance(offb, str):       # (a cp.async buffer: a run-time offset)
                    wa = self.val(f"add i32 {wbase}, {offb}", "i32", 0).ref
                    wa = self.val(f"add i32 {wa}, {wblk + kstep(n, s_)}", "i32", 0).ref
                else:
                    wa = self.val(f"add i32 {wbase}, {offb + wblk + kstep(n, s_)}", "i32", 0).ref
                da = desc(wa)
                for pi, pa in enumerate(offs_a):
                    if isinstance(pa, str):
                        xa = self.val(f"add i32 {smem}, {pa}", "i32", 0).ref
                        xa = self.val(f"add i32 {xa}, {kstep(m, s_)}", "i32", 0).ref
                    else:
                        xa = self.val(f"add i32 {smem}, {pa + kstep(m, s_)}", "i32", 0).ref
                    base = (blk * len(offs_a) + pi) * nr
                    regs[base:base + nr] = self.hooks.wgmma(self, kind, m, da, desc(xa), regs[base:base + nr])
        return regs

    def _wgmma_store(self, plan, g, regs, offc) -> None:
        """Accumulators to the (m, n) f32 tile at byte offset offc, parts summed in order (hi + lo). m64nNk16
        register i of a lane of warp q of the warpgroup: w row 16 q + lane / 4 + 8 ((i % 4) / 2) of its block,
        token 8 (i / 4) + 2 (lane % 4) + i % 2 (the mma.sync C fragment of each 8-token column block)."""
        m, n = plan["m"], plan["n"]
        nr = m // 2
        nparts = g["nparts"]
        _, lane, wg, q = self._warpgroup_ids()
        row0 = self.val(f"mul i32 {q}, 16", "i32", 0).ref
        g4 = self.val(f"udiv i32 {lane}, 4", "i32", 0).ref
        row0 = self.val(f"add i32 {row0}, {g4}", "i32", 0).ref
        blk0 = self.val(f"mul i32 {wg}, {g['per_wg'] * 64}", "i32", 0).ref
        row0 = self.val(f"add i32 {row0}, {blk0}", "i32", 0).ref
        t4 = self.val(f"urem i32 {lane}, 4", "i32", 0).ref
        tok0 = self.val(f"mul i32 {t4}, 2", "i32", 0).ref
        # element (token, row) at token * n + row: this thread's base tok0 * n + row0, constants per register
        e0 = self.val(f"mul i32 {tok0}, {n}", "i32", 0).ref
        e0 = self.val(f"add i32 {e0}, {row0}", "i32", 0).ref
        base_c = self.smem_ptr(offc)
        a3 = self.hooks.smem_as
        p0 = self.val(f"getelementptr float, ptr addrspace({a3}) {base_c}, i32 {e0}", "ptr", 0).ref
        for blk in range(g["per_wg"]):
            for i in range(nr):
                v = regs[(blk * nparts) * nr + i]
                for pi in range(1, nparts):
                    v = self.val(f"fadd float {v}, {regs[(blk * nparts + pi) * nr + i]}", "float", 0).ref
                const = (8 * (i // 4) + i % 2) * n + blk * 64 + 8 * ((i % 4) // 2)
                ptr = self.val(f"getelementptr float, ptr addrspace({a3}) {p0}, i32 {const}", "ptr", 0).ref
                self.emit(f"store float {v}, ptr addrspace({a3}) {ptr}, align 4")

    def _wg_sum_analysis(self) -> None:
        """Sums of warpgroup-MMA accumulators kept in their registers (the serial split's running sum of slab
        results, _mma_serial_chain): an f32 add whose operands are both, in one layout, a wgmma dot's result,
        a K loop's register accumulator (_frag_slots) or such a sum; and loop slots that carry such a sum
        (initialised to a constant, used once by the add, which is yielded back to the slot). They are added
        register by register, which is the tile's elementwise add, with no C tile in shared memory (whose
        region could not share the copy buffers while the next slab's copies are in flight)."""
        self._wg_sums, self._wg_sum_slots = {}, {}
        if not self.tuning.wg_sums or not any(p["wg"] for p in self.mma_plans.values()):
            return

        def acc_of(v):
            """(layout key, plan) of a value the MMA registers can hold: a wgmma dot's result or a K loop's
            register accumulator (its loop result)."""
            d = self.defs.get(v.id)
            if d is None:
                return None
            if d.name == "dot":
                plan = self.mma_plans.get(id(d))
                if plan is not None and plan["wg"] and not plan["split"]:
                    return self._mma_geometry(plan)["key"], plan
            elif d.name == "for":
                j = next(i for i, r in enumerate(d.results) if r.id == v.id)
                fs = self._frag_slots(d)
                if j in fs and fs[j][1]["wg"]:
                    return fs[j]
            return None

        def is_add(op):
            return op.name == "binary" and op.attrs.get("op") == "add" and op.results[0].type.elem == ir.f32 \
                and len(op.results[0].type.shape) == 2

        sums = {}                       # id(value) -> (key, plan): values held as register sums
        for loop, body, yop in self._loops():
            for j, arg in enumerate(body.args[1:]):
                d = self.defs.get(loop.operands[3 + j].id)
                if d is not None and d.name == "splat":
                    d = self.defs.get(d.operands[0].id)
                us = self.users.get(arg.id, [])
                if d is None or d.name != "const" or len(us) != 1 or not is_add(us[0][0]) \
                        or not any(o is us[0][0] for o in body.ops):
                    continue
                add, idx = us[0]
                other = acc_of(add.operands[1 - idx])
                if other is None or self.users.get(add.results[0].id) != [(yop, j)]:
                    continue
                self._wg_sum_slots[(id(loop), j)] = (other[0], other[1], float(d.attrs["value"]))
                self._wg_sums[id(add)] = other[0]
                self._frag_yields[(id(yop), j)] = other[0]
                sums[loop.results[j].id] = other
        for op in _ops_of(self.fn.body):
            if not is_add(op) or id(op) in self._wg_sums:
                continue
            ks = [sums.get(o.id) or acc_of(o) for o in op.operands]
            if ks[0] is not None and ks[1] is not None and ks[0][0] == ks[1][0]:
                self._wg_sums[id(op)] = ks[0][0]
                sums[op.results[0].id] = ks[0]

    def _wg_sum(self, op):
        """A _wg_sum_analysis add: the two accumulators' registers added one by one (each waited for first if
        its MMAs may still run); kept in registers where its users take that, else a tile value."""
        key = self._wg_sums[id(op)]
        a, b = (self.vals.get(o.id) for o in op.operands)
        if not (isinstance(a, MmaAcc) and isinstance(b, MmaAcc) and a.key == key and b.key == key
                and len(a.regs) == len(b.regs)):
            subs = {o.id: self._materialise(v) for o, v in zip(op.operands, (a, b)) if isinstance(v, MmaAcc)}
            return self._lower_with(op, subs)
        regs = []
        for acc in (a, b):
            r = acc.regs
            if self.tuning.wgmma_pipe or acc.plan.get("in_flight"):
                r = self.hooks.wgmma_wait(self, 0, r)       # (its last group was committed, not waited)
            regs.append(r)
        out = MmaAcc(key, [self.val(f"fadd float {x}, {y}", "float", 0).ref for x, y in zip(*regs)], a.plan)
        return out if self._keep_frag(op.results[0], key) else self._materialise(out)

    def op_binary(self, op):
        if self._wg_sums and id(op) in self._wg_sums:
            return self._wg_sum(op)
        return super().op_binary(op)
