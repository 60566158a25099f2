"""The GPU tile lowering shared by every GPU target: jitkern IR -> LLVM IR for one CTA / workgroup.

A program is one CTA of T = num_warps * warp_size threads. Every tile is *distributed*: its elements,
flattened row-major, are dealt to the threads cyclically, so thread t holds flat elements t, t + T,
t + 2T, ... as the lanes of one LLVM vector of R = ceil(numel / T) lanes (lanes past numel are padding:
never loaded, stored or reduced). Adjacent threads hold adjacent elements, so a row-major tile load is a
coalesced warp access. Scalars are *uniform*: every thread holds the same value (they come from kernel
arguments, program ids, scalar loads, loop counters and reductions to a scalar, all computed by every
thread), so run-time `if`/`for` never diverge and barriers inside them are legal.

Elementwise arithmetic, casts, half conversions, the polynomial math and structured control flow come
from the target-neutral emitter (backends/emitter.py) that the CPU tiers share (a tile there is also one
LLVM vector, of all its elements). What differs on a GPU is anything
that moves an element to another thread; those ops go through shared memory in a fixed order:
- broadcast / trans / reshape to a scalar: write the tile to shared memory at its flat index, barrier,
  read each output element from the source index (`_relayout`);
- reduce / argreduce: each output's row is split into G chunks (G from the row length and T only); each
  chunk folds a strided part of the row in increasing order, then the G partials are folded in chunk
  order. The order never depends on the other axes of the tile (the batch), the data or the grid, so
  results are batch invariant;
- dot / dot4 / madd: operands through shared memory, each thread computing its own output elements (FMA
  in K order; tensor cores are the next step).

Memory model (the DSL's, on every target): within one program, a load sees the program's own earlier
stores and a store never overtakes an earlier load of the same memory. On a GPU the threads of a program
need a barrier for that, so the lowering puts one between a store and a later load (and between a load
or store and a later store) in program order; loops that store are treated as storing before their first
load. `jk.barrier()` is the explicit form. Programs (CTAs) never see each other's writes within a launch.

Everything target-specific goes through a `GpuHooks` object: the module header, the kernel signature, thread
and block ids, the barrier, the shared-memory address space and the math that has no portable form.
"""
from __future__ import annotations

import math

from .. import ir
from ..language import CompilationError
from .emitter import LV, PT, Aff, LlvmEmitter, _ops_of, _prod, elem_ty, vty
from .gpu_fragments import FragmentOps, FragV
from .gpu_lanes import _LaneExpr, _sym
from .gpu_staging import _ASYNC_BASE, _PIN_BASE, _ROWS_BASE, AsyncTile, Staging

_ES = {"float": 4, "double": 8, "half": 2, "i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8}


class GpuHooks:
    """What one GPU target supplies to the shared lowering (see backends/nvptx.py)."""
    smem_as = 3                  # address space of shared memory
    smem_index = "i32"           # pointer width of that address space
    max_smem_bytes = 48 * 1024

    def module_header(self, low) -> list:
        raise NotImplementedError

    def kernel_signature(self, low, name: str, params: list) -> str:
        raise NotImplementedError

    def thread_id(self, low) -> str:
        raise NotImplementedError

    def block_id(self, low, axis: int) -> str:
        raise NotImplementedError

    def num_blocks(self, low, axis: int) -> str:
        raise NotImplementedError

    def barrier(self, low) -> None:
        raise NotImplementedError

    def math(self, low, name: str, x: LV):
        """An LV for math function `name` on x, or None to use the portable polynomial."""
        return None

    def round_bf16(self, low, x: LV):
        """f32 lanes rounded to bf16 (nearest even) as i16 bit patterns in hardware, or None for the
        integer sequence of the emitter's from_f32."""
        return None

    def function_attrs(self, low) -> list:
        return []

    global_as = 0               # address space of kernel pointer arguments' memory (NVPTX: 1 = global)
    remat = True                # broadcasts of index/mask math recomputed in place (GpuLowering._remat_move)
    mma_unroll = None           # copies of an MMA K loop's step LLVM may unroll to (None: its own choice)

    # matrix units: None where the target has none (dot then runs FMA through shared memory)
    mma_shape = None            # (m, n, k) of one warp-level MMA, e.g. (16, 8, 16)

    def mma(self, low, kind: str, a_regs: list, b_regs: list, c_regs: list) -> list:
        """One warp-level MMA: A/B fragments as refs of mma_layout's a_ty / b_ty, C as f32 refs (one per
        accumulator register); returns the new C refs."""
        raise NotImplementedError

    def mma_layout(self, lane, kind: str) -> dict:
        """Which tile elements each lane's MMA registers hold, for mma_shape (m, n, k) and 16-bit `kind`:
          a_ty, b_ty: the LLVM type of one A / B register, loaded from shared memory as a_elems / b_elems
                      16-bit elements consecutive along k;
          a: per A register, (row, k) of its first element in the (m, k) tile;
          b: per B register, (col, k) of its first element in the (n, k) tile (B as its columns);
          c: per accumulator register, the (row, col) of the (m, n) output it holds.
        `lane` is the lane id within the warp: an int or numpy array (tests model the layout with it), or the
        lowering's _LaneExpr, whose Python operators emit IR; so one function gives both the index maps the
        code uses and the ones the tests check. Coordinates are built with >>, &, <<, //, %, * on the lane
        and + with integer constants (kept symbolic, folded into each register's address)."""
        raise NotImplementedError

    def dp4a(self, low, a: LV, b: LV, c: LV, a_signed: bool, b_signed: bool):
        """An LV of jk.dp4a in hardware (a 4-byte integer dot instruction), or None for the emitter's shifts."""
        return None

    has_ldmatrix = False
    # lane shuffles within a warp (shuffle_idx / shuffle_xor): row reductions of warp-owned MMA rows
    has_shuffle = False

    def shuffle_idx(self, low, v: str, src: str) -> str:
        """f32 `v` of lane `src` (an i32 ref, a lane of this warp) for every lane of the warp."""
        raise NotImplementedError

    def shuffle_xor(self, low, v: str, mask: int) -> str:
        """f32 `v` of lane (this lane ^ mask)."""
        raise NotImplementedError

    def ldmatrix_lanes(self, lane) -> dict:
        """For has_ldmatrix targets: the (row, k) each lane addresses for A's (16, 16) step (4 matrices) and B's
        (8, 16) step as (n, k) rows (2 matrices), relative to the unit's tile origin and the step's k;
        `lane` as in mma_layout."""
        raise NotImplementedError

    def ldmatrix(self, low, ptr: str, count: int, trans: bool = False):
        """`count` (2 or 4) 32-bit fragment registers of 8x8 16-bit matrices in shared memory, one instruction
        for the warp: lane l gives the address of row l % 8 of matrix l // 8 (`ptr`, 16-byte aligned), and
        each lane receives, of every matrix, the element pair (row l // 4, columns 2 (l % 4), +1); with `trans`
        the pair (rows 2 (l % 4), +1, column l // 4). None where the target has no such instruction (the
        lowering then loads each register itself)."""
        return None

    # Targets without pointer kernel parameters (Vulkan's logical addressing) override these; the defaults
    # keep the lowering's own code (pointer parameters, GEPs, masked gathers/scatters on pointer vectors).
    def entry(self, low) -> None:
        """Emits code at the top of the entry block (e.g. parameter values that are not LLVM arguments)."""

    def smem_decl(self, low) -> list:
        """The module-level declaration(s) of shared memory (1024-byte aligned where a swizzled operand needs
        its atoms there, GpuLowering._wg_swizzled)."""
        align = 1024 if low._wg_swizzled() else 16
        return [f"@__jk_smem = external addrspace({self.smem_as}) global [0 x i8], align {align}"]

    # a bulk prefetch of a contiguous run into L2 (jk.prefetch(..., nbytes=); NVIDIA sm_90+)
    has_bulk_prefetch = False

    def bulk_prefetch_l2(self, low, ptr: str, nbytes: int, pred: str) -> None:
        """Prefetches `nbytes` (a multiple of 16) from generic pointer `ptr` (16-byte aligned) into L2 where i1
        `pred` holds."""
        raise NotImplementedError

    def load(self, low, p, shape, mask, other):
        """An LV loaded through pointer tile p (mask: the user's i1 mask or None; lanes past the tile are
        the hook's to mask, with low._gpu_mask), or None for the lowering's own code."""
        return None

    def store(self, low, p, v, shape, mask) -> bool:
        """Stores v through p (scalar stores come already guarded); False for the lowering's own code."""
        return False

    def masked_chunk_load(self, low, pty: str, ptr: str, mask: str, other: LV, vt: str, nbytes: int):
        """One masked vector load of a chunk without a branch (a predicated instruction): the loaded <V x et>
        ref, or None for the lowering's branch around a plain load. `other` is the value where mask is 0."""
        return None

    def masked_chunk_store(self, low, pty: str, ptr: str, mask: str, v: LV, vt: str, nbytes: int) -> bool:
        """One masked vector store of a chunk without a branch; False for the lowering's branch."""
        return False

    def smem_store(self, low, et: str, off: int, idx, v) -> bool:
        """Stores the lanes of v at shared element indices idx of the region at byte offset off."""
        return False

    def smem_load(self, low, et: str, off: int, idx):
        """Loads shared elements at indices idx (an LV) of the region at byte offset off, or None."""
        return None


class MmaAcc:
    """A dot's f32 accumulator left in the MMA units' registers (no shared-memory round trip): `regs` per
    warp-unit, part (hi/lo) and C register, in the layout `key` (GpuLowering._mma_geometry). Passed as the
    acc of the next dot of the same layout or around a loop; turned into a tile value where anything else
    uses it (GpuLowering._materialise)."""
    __slots__ = ("key", "regs", "plan")

    def __init__(self, key, regs, plan):
        self.key, self.regs, self.plan = key, regs, plan


_LAZY = object()      # a value left for the dot that consumes it to lower (see GpuLowering._mma_plan)
# the MMA K loops of dots with a pinned A operand (Staging._pin_analysis: the flash kernels' scores) are unrolled
# when they have at most this many steps (fewer loop-carried fragment copies; faster flash prefill and decode)
PINNED_MMA_UNROLL = 8
# The lowering's other choices (ldmatrix, wgmma staging, pinning, reductions, ...) are the target's tuning table,
# targets/tuning.py: self.tuning.


class GpuLowering(FragmentOps, Staging, LlvmEmitter):
    _flat_override = None           # (shape, flat index LV) while an operand is evaluated in a fragment layout
    _async_live = False             # (see __init__)
    _rows_dirty = False
    _rows_read = frozenset()

    def __init__(self, fn: ir.Function, target, hooks: GpuHooks):
        super().__init__(fn, target)
        self.x86 = False
        self.f16c = False
        self.hooks = hooks
        self.tuning = target.tuning     # code-generation choices (targets/tuning.py)
        self.num_warps = int(fn.constexprs.get("num_warps", 4))
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
            raise CompilationError(f"num_warps must be a power of two in 1..32, got {self.num_warps}")
        self.T = self.num_warps * target.warp_size
        self.smem_bytes = 0
        self.pending_write = False
        self.pending_read = False
        self._flat = {}
        self._flat_parts = {}       # flat index ref -> (thread part t * V, lanes, V)
        self._flat_override = None  # (shape, flat index LV): tiles of that shape take a fragment layout
        self.frag_keys = {}         # value id -> layout key of the values held as FragV (_frag_analysis)
        self._lazy_ops = {}         # value id -> op lowered only where a tile-layout user asks (_frag_analysis)
        self._async_loads = {}      # id(load) -> (region spec, slot arg or None, first buffer) (_async_analysis)
        self._async_slots = {}      # (id(for), slot) -> async region spec
        self._async_bytes = 0
        self._async_align = 128     # the async regions' alignment (1024 for swizzled operand atoms)
        self._async_issued = []     # per loop being lowered: async copy groups committed in this step so far
        self._async_ahead = {}      # value id -> AsyncTile.ahead of a prefetch-2 chain's head (_async_analysis)
        self._async_ahead_now = 0   # the ahead of the last async wait (_async_wait)
        self._wg_sums, self._wg_sum_slots = {}, {}      # (_wg_sum_analysis)
        self._async_live = False    # from the first async copy until the last dot reading async buffers
        self._row_slots = {}        # id of a (R, 1) broadcast source -> (its (R,) value id, slot byte offset)
        self._row_of = {}           # id of that (R,) value -> slot byte offset
        self._rows_bytes = 0
        self._rows_written = set()  # (R,) values whose slot holds them
        self._rows_dirty = False    # slots written since the last barrier
        self._rows_read = set()     # slots read since the last barrier
        self._pins = {}             # id(loop) -> [(A value, plan, byte offset, parts)] (_pin_analysis)
        self._costage = {}          # id(dot) -> [(later dot's plan, region offset)] whose B it stages too
        self._prestaged = {}        # id(dot) -> region offset of its B, staged by an earlier dot
        self._pin_bytes = 0
        self._pinned = {}           # A value id -> region refs (one per part), while its loop is lowered
        self._pin_frags = {}        # id(dot) -> its pinned A's fragment registers [unit][k step] (PIN_REGS)
        self._async_shared = False  # something claimed shared memory meanwhile
        self._absorbed_loads = set()    # id(load) whose tile an async copy brings instead (_async_analysis)
        self.loop_md = []           # loop metadata nodes (emit_loop's unroll limits)

    # ------------------------------------------------------------------------------ layout helpers
    @staticmethod
    def vec(shape) -> int:
        """Elements per chunk V: a thread holds runs of V consecutive elements (16 bytes of f32), so an
        aligned contiguous load is one vector access. A function of the element count only, so a reshape
        keeps the layout."""
        return 4 if shape and _prod(shape) % 4 == 0 else 1

    def lanes(self, shape) -> int:
        """Lanes per thread of a tile of this shape (0 for a scalar)."""
        if not shape:
            return 0
        fo = self._flat_override
        if fo is not None and tuple(shape) == fo[0]:
            return fo[1].n
        V = self.vec(shape)
        return -(-_prod(shape) // (self.T * V)) * V

    def flat_index(self, shape) -> LV:
        """i32 vector: the flat element index each of this thread's lanes holds. Lane j of thread t holds
        element ((j // V) * T + t) * V + j % V: chunks of V consecutive elements dealt cyclically."""
        fo = self._flat_override
        if fo is not None and tuple(shape) == fo[0]:
            # a fragment layout's elements (_frag_flat), while an operand is evaluated in it (_frag_operand)
            return LV(fo[1].ref, "i32", fo[1].n, tuple(shape))
        R, V = self.lanes(shape), self.vec(shape)
        hit = self._flat.get((R, V))
        if hit is not None:
            return LV(hit.ref, "i32", R, tuple(shape))
        # defined in the entry block (spliced in after the thread id), so every later block may use it
        ins, spl, tv, ref = self.tmp("fi"), self.tmp("fs"), self.tmp("ft"), self.tmp("flat")
        steps = "<" + ", ".join(f"i32 {(j // V) * self.T * V + j % V}" for j in range(R)) + ">"
        self.entry_defs += [
            f"  {tv} = mul i32 {self.tid}, {V}",
            f"  {ins} = insertelement <1 x i32> poison, i32 {tv}, i32 0",
            f"  {spl} = shufflevector <1 x i32> {ins}, <1 x i32> poison, <{R} x i32> zeroinitializer",
            f"  {ref} = add {vty('i32', R)} {spl}, {steps}"]
        out = LV(ref, "i32", R, tuple(shape))
        self._flat[(R, V)] = out
        self._flat_parts[ref] = (tv, R, V)
        return out

    def _flat_coords(self, e: LV, shape):
        """_coords of a flat index vector (flat_index's own value) as thread part + per-lane constant, or None.
        Lane j's element is (j // V) * T * V + j % V + t * V: three disjoint bit ranges when T, V and the
        axis sizes are powers of two, so each coordinate (a bit field of the flat index) is the field of the
        thread part t * V (one scalar a thread) plus a constant per lane. LLVM then sees `splat(s) + <c>`
        and folds the constants into shared-memory immediates and address adds, where udiv/urem of the
        vector hid that chunks of one thread differ by constants (a register per chunk and address)."""
        hit = self._flat_parts.get(e.ref)
        if hit is None or e.n != hit[1] or any(d & (d - 1) for d in shape) or self.T & (self.T - 1):
            return None
        tv, R, V = hit
        TV = self.T * V
        out = []
        for ax in range(len(shape)):
            lo = _prod(shape[ax + 1:]).bit_length() - 1
            mask = None if ax == 0 else shape[ax] - 1
            t = self.val(f"lshr i32 {tv}, {lo}", "i32", 0) if lo else LV(tv, "i32", 0)
            if mask is not None:
                t = self.val(f"and i32 {t.ref}, {mask}", "i32", 0)
            cs = []
            for j in range(R):
                k = ((j // V) * TV + j % V) >> lo
                cs.append(k if mask is None else k & mask)
            sp = self.splat(t, R, e.shape)
            cv = "<" + ", ".join(f"i32 {c}" for c in cs) + ">"
            out.append(self.val(f"add nuw nsw {vty('i32', R)} {sp.ref}, {cv}", "i32", R, e.shape))
        return out

    def iconst(self, v: int, n: int, shape=()) -> LV:
        return self.const(v, "i32", n, shape)

    def ibin(self, instr: str, a: LV, b) -> LV:
        if isinstance(b, int):
            b = self.iconst(b, a.n, a.shape)
        return self.val(f"{instr} {a.ty} {a.ref}, {b.ref}", a.et, a.n, a.shape)

    def umin(self, a: LV, b: int) -> LV:
        return self.val(f"call {a.ty} @{self._minmax('umin', a)}({a.ty} {a.ref}, {a.ty} "
                        f"{self.iconst(b, a.n, a.shape).ref})", a.et, a.n, a.shape)

    def barrier(self) -> None:
        self.hooks.barrier(self)
        self.pending_write = self.pending_read = False
        self._rows_dirty = False
        self._rows_read = set()

    # ------------------------------------------------------------------------------ shared memory
    def smem_ptr(self, byte_off: int) -> str:
        a = self.hooks.smem_as
        return self.val(f"getelementptr i8, ptr addrspace({a}) @__jk_smem, {self.hooks.smem_index} {byte_off}",
                        "ptr", 0).ref

    def _claim(self, off: int, nbytes: int) -> int:
        """Reserves [off, off + nbytes) of shared memory for one op; returns the next 16-byte aligned offset."""
        if self._async_live:
            self._async_shared = True       # the async regions cannot overlap this one (see lower())
        end = off + nbytes
        self.smem_bytes = max(self.smem_bytes, end)
        return -(-end // 16) * 16

    def _st_et(self, et: str) -> str:
        return "i8" if et == "i1" else et

    def smem_write(self, x: LV, off: int, claim: bool = True, idx: LV = None) -> int:
        """Writes every lane of tile x at its flat index into shared memory at byte offset `off` (padding lanes
        land in the padded tail, so no mask is needed); returns the end offset of the region (claim=False: a
        region reserved elsewhere, `off` may be a placeholder; returns None). `idx`: the lanes' indices instead
        (i32 lanes below T * lanes, e.g. one value a thread at its thread id)."""
        et = self._st_et(x.et)
        R = x.n
        v = x if x.et != "i1" else self.val(f"zext {x.ty} {x.ref} to {vty('i8', R)}", "i8", R, x.shape)
        if idx is None:
            idx = self.flat_index(x.shape)
        if self.hooks.smem_store(self, et, off, idx, v):
            return self._claim(off, self.T * R * _ES[et]) if claim else None
        base = self.smem_ptr(off)
        a = self.hooks.smem_as
        ptrs = self.val(f"getelementptr {et}, ptr addrspace({a}) {base}, {idx.ty} {idx.ref}", "ptr", R)
        pv = f"<{R} x ptr addrspace({a})>"
        name = f"llvm.masked.scatter.v{R}{self._sfx_et(et)}.v{R}p{a}"
        self.declare(name, "void", [vty(et, R), pv, "i32", vty("i1", R)])
        self.emit(f"call void @{name}({vty(et, R)} {v.ref}, {pv} {ptrs.ref}, i32 {_ES[et]}, "
                  f"{vty('i1', R)} {self.const(1, 'i1', R).ref})")
        return self._claim(off, self.T * R * _ES[et]) if claim else None

    def smem_read(self, et_val: str, off: int, idx: LV, shape) -> LV:
        """Gathers elements at flat indices `idx` (i32 lanes, clamped by the caller) from shared memory."""
        et = self._st_et(et_val)
        R = idx.n
        a = self.hooks.smem_as
        v = self.hooks.smem_load(self, et, off, idx)
        if v is not None:
            pass
        elif R == 0:
            base = self.smem_ptr(off)
            p = self.val(f"getelementptr {et}, ptr addrspace({a}) {base}, i32 {idx.ref}", "ptr", 0)
            v = self.val(f"load {et}, ptr addrspace({a}) {p.ref}, align {_ES[et]}", et, 0)
        else:
            base = self.smem_ptr(off)
            ptrs = self.val(f"getelementptr {et}, ptr addrspace({a}) {base}, {idx.ty} {idx.ref}", "ptr", R)
            pv = f"<{R} x ptr addrspace({a})>"
            name = f"llvm.masked.gather.v{R}{self._sfx_et(et)}.v{R}p{a}"
            self.declare(name, vty(et, R), [pv, "i32", vty("i1", R), vty(et, R)])
            v = self.val(f"call {vty(et, R)} @{name}({pv} {ptrs.ref}, i32 {_ES[et]}, {vty('i1', R)} "
                         f"{self.const(1, 'i1', R).ref}, {vty(et, R)} poison)", et, R, tuple(shape))
        if et_val == "i1":
            v = self.val(f"trunc {v.ty} {v.ref} to {vty('i1', R)}", "i1", R, tuple(shape))
        return LV(v.ref, v.et, R, tuple(shape))

    @staticmethod
    def _sfx_et(et: str) -> str:
        return {"double": "f64", "float": "f32", "half": "f16", "i8": "i8", "i16": "i16", "i32": "i32",
                "i64": "i64"}[et]

    def _relayout(self, x: LV, src_shape, dst_shape, src_index) -> LV:
        """Moves tile x (laid out for src_shape) to the layout of dst_shape: output flat element e takes source
        element src_index(e) (an i32 LV -> i32 LV function built from vector integer ops)."""
        self.barrier()                        # earlier readers of shared memory are done
        self.smem_write(x, 0)
        self.barrier()
        if dst_shape:
            e = self.flat_index(dst_shape)
            si = self.umin(src_index(e), _prod(src_shape) - 1)   # padding lanes read a valid element
        else:
            si = LV(str(src_index(None)), "i32", 0)
        return self.smem_read(x.et, 0, si, dst_shape)

    def _coords(self, e: LV, shape) -> list:
        """Per-axis coordinates of flat indices e in a row-major tile of `shape`."""
        if e.n:
            fast = self._flat_coords(e, shape)
            if fast is not None:
                return fast
        out = []
        for ax in range(len(shape)):
            inner = _prod(shape[ax + 1:])
            c = self.ibin("udiv", e, inner) if inner > 1 else e
            if ax > 0:
                c = self.ibin("urem", c, shape[ax])
            out.append(c)
        return out

    def _flat_of(self, coords: list, shape, like: LV) -> LV:
        acc = None
        for ax, c in enumerate(coords):
            if c is None or shape[ax] == 1:
                continue
            st = _prod(shape[ax + 1:])
            term = self.ibin("mul", c, st) if st > 1 else c
            acc = term if acc is None else self.ibin("add", acc, term)
        return acc if acc is not None else self.iconst(0, like.n, like.shape)

    # ---------------------------------------------------------------------------------------- entry
    def lower(self) -> str:
        fn = self.fn
        h = self.hooks
        from ..analysis import AxisAnalysis
        from ..args import SPEC_HINTS
        self.axes = AxisAnalysis(fn, dict(fn.constexprs.get(SPEC_HINTS, ())))
        self.defs = {r.id: op for op in _ops_of(fn.body) for r in op.results}
        self.uses = {}
        for op in _ops_of(fn.body):
            for o in op.operands:
                if o is not None:
                    self.uses[o.id] = self.uses.get(o.id, 0) + 1
        self.users = {}             # value id -> [(op, operand index)], yields included
        for op in _ops_of(fn.body):
            for i, o in enumerate(op.operands):
                if o is not None:
                    self.users.setdefault(o.id, []).append((op, i))
        self._frag_yields = {}      # (id(yield op), slot) -> accumulator layout carried in registers
        self._frag_loops = []       # (iv, lb, step) of the register-accumulator loops being lowered
        self._wg_regions = None     # id(dot) -> (byte offset, bytes, buffers) of pipelined warpgroup operands
        self.lazy = set()           # values lowered by the dot that consumes them (see _mma_plan)
        self.mma_plans = {}
        if h.mma_shape:
            for op in _ops_of(fn.body):
                if op.name == "dot":
                    plan = self._mma_plan(op)
                    if plan is not None:
                        self.mma_plans[id(op)] = plan
                        self.lazy.update(plan["lazy"])
            self._frag_analysis()
            self._async_analysis()
            self._wg_sum_analysis()
            self._pin_analysis()
            self._costage_analysis()
        self.start_block("entry")
        h.entry(self)
        self.tid = h.thread_id(self)
        self.entry_defs = []
        splice_at = len(self.lines)
        self.param_refs = []
        for k, prm in enumerate(fn.params):
            t = prm.type
            ref = f"%arg{k}"
            if t.is_ptr:
                self.vals[prm.value.id] = PT(ref, t.elem.elem, None, ())
            elif t.elem.is_float:
                d = LV(ref, "double", 0)
                if t.elem == ir.f64:
                    self.vals[prm.value.id] = d
                else:
                    f = self.val(f"fptrunc double {ref} to float", "float", 0)
                    self.vals[prm.value.id] = f if t.elem == ir.f32 else self.from_f32(f, t.elem)
            else:
                et = elem_ty(t.elem)
                v = LV(ref, "i64", 0) if et == "i64" else self.val(f"trunc i64 {ref} to {et}", et, 0)
                self.vals[prm.value.id] = v
        self._staging_entry()
        self.lower_block(fn.body)
        self.emit("ret void")
        self.lines[splice_at:splice_at] = self.entry_defs
        if self._async_bytes:
            # the async regions overlap the rest when nothing else claims shared memory while they are live
            # (the tensor-core linear: its C tile is written after the last dot's barrier)
            al = self._async_align
            base = -(-self.smem_bytes // al) * al if self._async_shared else 0
            self.lines = [ln.replace(_ASYNC_BASE, str(base)) if ln and _ASYNC_BASE in ln else ln
                          for ln in self.lines]
            self.smem_bytes = max(self.smem_bytes, base + self._async_bytes)
        if self._pin_bytes:
            base = -(-(self.smem_bytes + self._rows_bytes) // 16) * 16
            self.lines = [ln.replace(_PIN_BASE, str(base)) if ln and _PIN_BASE in ln else ln
                          for ln in self.lines]
            pin_end = base + self._pin_bytes
        if self._rows_bytes:
            base = -(-self.smem_bytes // 16) * 16
            self.lines = [ln.replace(_ROWS_BASE, str(base)) if ln and _ROWS_BASE in ln else ln
                          for ln in self.lines]
            self.smem_bytes = base + self._rows_bytes
        if self._pin_bytes:
            self.smem_bytes = max(self.smem_bytes, pin_end)
        self._staging_layout_end()
        if self.smem_bytes > h.max_smem_bytes:
            raise CompilationError(
                f"kernel {fn.name} needs {self.smem_bytes} bytes of shared memory for its layout changes, more "
                f"than {h.max_smem_bytes} on {self.target.name}: use smaller tiles")
        out = [f"; jitkern kernel {fn.name} for {self.target.name} (num_warps={self.num_warps}, "
               f"shared={self.smem_bytes} bytes)"]
        out += h.module_header(self)
        out += h.smem_decl(self)
        out.append("")
        out += sorted(self.decls.values())
        out.append("")
        out.append(h.kernel_signature(self, fn.name, fn.params) + " {")
        out.append("\n".join(self.lines))
        out.append("}")
        attrs = h.function_attrs(self)
        out.append(f"attributes #0 = {{ nounwind {' '.join(attrs)} }}")
        out += self.loop_md
        return "\n".join(out) + "\n"

    # --------------------------------------------------------------------------- ids and creation
    def op_program_id(self, op):
        return LV(self.hooks.block_id(self, op.attrs["axis"]), "i32", 0)

    def op_num_programs(self, op):
        return LV(self.hooks.num_blocks(self, op.attrs["axis"]), "i32", 0)

    def op_const(self, op):
        t = op.result.type
        d = t.elem
        R = self.lanes(t.shape)
        if d in (ir.f16, ir.bf16):
            return self.from_f32(self.const(float(op.attrs["value"]), "float", R, t.shape), d)
        return self.const(op.attrs["value"], elem_ty(d), R, t.shape)

    def op_arange(self, op):
        s, e = op.attrs["start"], op.attrs["end"]
        shape = (e - s,)
        f = self.flat_index(shape)
        r = LV(f.ref, f.et, f.n, f.shape) if s == 0 else self.ibin("add", f, s)
        r.aff = Aff(s, (1,))          # the tile's affine form (layout-free): chunk addresses use its strides
        return r

    def op_tma(self, op):
        # the loaded tile itself; a target with bulk tensor copies overrides this (backends/nvidia/staging.py)
        return self.get(op.operands[0])

    def op_splat(self, op):
        x = self.get(op.operands[0])
        shape = op.result.type.shape
        R = self.lanes(shape)
        if isinstance(x, PT):
            return PT(x.base, x.elem, self.splat(x.offs, R, shape) if x.offs is not None else None, shape)
        return self.splat(x, R, shape)

    # ------------------------------------------------------------------------------ layout changes
    def _move(self, x, src_shape, dst_shape, src_index):
        """_relayout for values and pointer tiles (a pointer tile moves its offsets)."""
        if isinstance(x, PT):
            if x.offs is None:
                return PT(x.base, x.elem, None, dst_shape)
            return PT(x.base, x.elem, self._move(x.offs, src_shape, dst_shape, src_index), dst_shape)
        if x.n == 0:
            return self.splat(x, self.lanes(dst_shape), dst_shape)
        return self._relayout(x, src_shape, dst_shape, src_index)

    def _broadcast_index(self, sshape, shape):
        src = (1,) * (len(shape) - len(sshape)) + tuple(sshape)

        def index(e):
            cs = self._coords(e, shape)
            return self._flat_of([c if s != 1 else None for c, s in zip(cs, src)], src, e)
        return index

    def op_broadcast(self, op):
        x = self.get(op.operands[0])
        sshape = op.operands[0].type.shape
        shape = op.result.type.shape
        src = (1,) * (len(shape) - len(sshape)) + tuple(sshape)
        if _prod(src) == _prod(shape):
            r = self._retag(x, shape)
        else:
            index = self._broadcast_index(sshape, shape)
            r = self._remat_move(op.operands[0], shape, index)
            r = r if r is not None else self._move(x, sshape, shape, index)
        return self._with_aff(r, x, lambda a: Aff(a.base, tuple(
            0 if sz == 1 else k for sz, k in zip(src, (0,) * (len(shape) - len(sshape)) + tuple(a.strides)))))

    @staticmethod
    def _with_aff(r, x, f):
        """r (x's tile after a layout or shape change) with the affine form f(x's form), when x has one: the
        form describes the logical tile (base + sum of index * stride), whatever the lanes' layout."""
        xv = x.offs if isinstance(x, PT) else x
        rv = r.offs if isinstance(r, PT) else r
        if xv is None or rv is None or xv.aff is None or rv is xv:
            return r
        aff = f(xv.aff)
        nv = LV(rv.ref, rv.et, rv.n, rv.shape, aff)
        return PT(r.base, r.elem, nv, r.shape) if isinstance(r, PT) else nv

    # Rematerialisation: a tile computed only from aranges, constants and uniform scalars through integer /
    # boolean / pointer arithmetic (index and mask math: `(k + offs)[None, :]`, `rows[:, None] < n`) is
    # recomputed in the destination layout instead of moved through shared memory: each lane evaluates the
    # chain at the source coordinates of the element it holds. Exact (integer ops), and it saves two
    # barriers and a shared-memory round trip per broadcast, which in a loop is most of a GEMV's time.
    _REMAT_ELEMENTWISE = ("binary", "cmp", "cast", "select", "addptr")
    _REMAT_BUDGET = 48

    def _remat_ok(self, v, seen, budget=None) -> bool:
        """Whether v can be recomputed in another layout (at most `budget` ops: _REMAT_BUDGET by default)."""
        budget = self._REMAT_BUDGET if budget is None else budget
        if not v.type.shape or v.id in seen:
            return True
        op = self.defs.get(v.id)
        if op is None or len(seen) >= budget:
            return False
        seen.add(v.id)
        if op.name in ("arange", "const"):
            return True
        if op.name in ("splat", "reshape", "broadcast", "trans") + self._REMAT_ELEMENTWISE:
            if op.name in ("binary", "cmp", "select", "cast"):
                d = op.results[0].type.elem
                if d.is_float or any(o.type.elem.is_float for o in op.operands if not o.type.is_ptr):
                    return False
            return all(self._remat_ok(o, seen, budget) for o in op.operands)
        return False

    def _remat_move(self, v, dst_shape, index):
        """v's tile in dst_shape's layout (element e = v's element index(e)) by recomputation, or None."""
        if not self.hooks.remat or not self._remat_ok(v, set()):
            return None
        return self._remat(v, dst_shape, index)

    def _remat(self, v, dst_shape, index):
        R = self.lanes(dst_shape)
        shape = v.type.shape
        if not shape:
            x = self.get(v)
            if isinstance(x, PT):
                return PT(x.base, x.elem, self.splat(x.offs, R, dst_shape) if x.offs is not None else None,
                          dst_shape)
            return self.splat(x, R, dst_shape) if x.n == 0 else x
        op = self.defs[v.id]
        if op.name == "arange":
            e = index(self.flat_index(dst_shape))
            s = op.attrs["start"]
            r = e if s == 0 else self.ibin("add", e, s)
            return LV(r.ref, "i32", R, tuple(dst_shape))
        if op.name == "const":
            d = v.type.elem
            if d in (ir.f16, ir.bf16):
                return self.from_f32(self.const(float(op.attrs["value"]), "float", R, dst_shape), d)
            return self.const(op.attrs["value"], elem_ty(d), R, dst_shape)
        if op.name == "splat":
            return self._remat(op.operands[0], dst_shape, index)
        if op.name == "reshape":
            return self._remat(op.operands[0], dst_shape, index)      # same flat order
        if op.name == "broadcast":
            inner = self._broadcast_index(op.operands[0].type.shape, shape)
            return self._remat(op.operands[0], dst_shape, lambda e: inner(index(e)))
        if op.name == "trans":
            perm = op.attrs.get("perm", (1, 0))
            src_shape = op.operands[0].type.shape

            def tindex(e):
                cs = self._coords(e, shape)
                inc = [None] * len(src_shape)
                for i, p_ in enumerate(perm):
                    inc[p_] = cs[i]
                return self._flat_of(inc, src_shape, e)
            return self._remat(op.operands[0], dst_shape, lambda e: tindex(index(e)))
        # elementwise: evaluate the op on its operands rematerialised in the destination layout
        res = self._lower_with(op, {o.id: self._remat(o, dst_shape, index) for o in op.operands})
        if isinstance(res, PT):
            return PT(res.base, res.elem, LV(res.offs.ref, res.offs.et, res.offs.n, tuple(dst_shape))
                      if res.offs is not None else None, dst_shape)
        return LV(res.ref, res.et, res.n, tuple(dst_shape))

    def _lower_with(self, op, subs: dict, fn=None):
        """op lowered with its operands' values replaced by `subs` (value id -> value) for the duration (fn: how,
        default its op_ method); the values of record are restored afterwards."""
        saved = {k: self.vals.get(k) for k in subs}
        self.vals.update(subs)
        try:
            return fn() if fn is not None else getattr(self, "op_" + op.name)(op)
        finally:
            for k, old in saved.items():
                if old is None:
                    self.vals.pop(k, None)
                else:
                    self.vals[k] = old

    def _retag(self, x, shape):
        """Same flat order and element count: the layout is unchanged, only the shape."""
        if isinstance(x, PT):
            return PT(x.base, x.elem, self._retag(x.offs, shape) if x.offs is not None else None, shape)
        if x.n == 0:
            return self.splat(x, self.lanes(shape), shape) if shape else x
        if not shape:
            # a one-element tile to a scalar: thread 0 holds it; every thread needs it
            return self._move(x, x.shape, (), lambda e: 0)
        return LV(x.ref, x.et, x.n, tuple(shape))

    def op_reshape(self, op):
        x = self.get(op.operands[0])
        shape = op.result.type.shape
        r = self._retag(x, shape)
        old = [(sz, i) for i, sz in enumerate(x.shape) if sz != 1]

        def form(a):
            # a reshape keeps the form when it only inserts or removes size-1 axes
            if [sz for sz in shape if sz != 1] != [sz for sz, _ in old]:
                return None
            it = iter(a.strides[i] for _, i in old)
            return Aff(a.base, tuple(0 if sz == 1 else next(it) for sz in shape))
        return self._with_aff(r, x, form)

    def op_cast(self, op):
        if op.results[0].id in self.lazy:
            return _LAZY
        return super().op_cast(op)

    def op_trans(self, op):
        if op.results[0].id in self.lazy:
            return _LAZY
        x = self.get(op.operands[0])
        shape = op.operands[0].type.shape
        perm = op.attrs.get("perm", (1, 0))
        oshape = tuple(shape[p] for p in perm)

        def index(e):
            cs = self._coords(e, oshape)         # output coordinate i is input axis perm[i]
            inc = [None] * len(shape)
            for i, p in enumerate(perm):
                inc[p] = cs[i]
            return self._flat_of(inc, shape, e)
        r = self._remat_move(op.operands[0], oshape, index)
        r = r if r is not None else self._move(x, shape, oshape, index)
        return self._with_aff(r, x, lambda a: Aff(a.base, tuple(a.strides[p] for p in perm)))

    # -------------------------------------------------------------------------------------- memory
    def _gpu_mask(self, shape, mask):
        """The user's mask (or none) and-ed with the lanes that hold real elements."""
        R = self.lanes(shape)
        if mask is not None and mask.n == 0:
            mask = self.splat(mask, R, shape)
        if _prod(shape) % (self.T * self.vec(shape)) == 0:
            return mask
        valid = self.val(f"icmp ult {vty('i32', R)} {self.flat_index(shape).ref}, "
                         f"{self.iconst(_prod(shape), R).ref}", "i1", R, shape)
        if mask is None:
            return valid
        return self.val(f"and {mask.ty} {mask.ref}, {valid.ref}", "i1", R, shape)

    def _ptr_vec(self, p: PT, shape) -> LV:
        R = self.lanes(shape)
        et = elem_ty(p.elem)
        offs = self.to_i64(p.offs) if p.offs is not None else self.const(0, "i64", R, shape)
        if offs.n == 0:
            offs = self.splat(offs, R, shape)
        return self.val(f"getelementptr inbounds {et}, ptr {p.base}, {offs.ty} {offs.ref}", "ptr", R, shape)

    def op_load(self, op):
        hit = self._async_loads.get(id(op)) if self._async_loads else None
        if hit is not None:
            return self._async_load(op, *hit)
        if id(op) in self._absorbed_loads:
            return None             # its one user, a jk.tma, copies the tile instead (the target's op_tma)
        if self.pending_write:
            self.barrier()
        self.pending_read = True
        shape = op.result.type.shape
        p = self.get(op.operands[0])
        mask = self.get(op.operands[1]) if len(op.operands) > 1 else None
        other = self.get(op.operands[2]) if len(op.operands) > 2 else None
        et = elem_ty(p.elem)
        hooked = self.hooks.load(self, p, shape, mask, other)
        if hooked is not None:
            return hooked
        if not shape:
            # a scalar load: every thread loads the same (uniform) value
            off = 0 if p.offs is None else (p.offs.ref, p.offs.et)
            ptr = self._elem_ptr(p, off)
            if mask is None:
                return self.val(f"load {et}, ptr {ptr}, align {p.elem.itemsize}", et, 0)
            return self._guarded_scalar_load(ptr, et, p.elem.itemsize, mask, other)
        R = self.lanes(shape)
        if other is None:
            other = LV("zeroinitializer", et, R, shape)
        elif other.n == 0:
            other = self.splat(other, R, shape)
        ptrs = self._ptr_vec(p, shape)
        m = self._gpu_mask(shape, mask)
        V = self._chunk_vector(op.operands[0], op.operands[1] if len(op.operands) > 1 else None, shape, p.elem)
        if V:
            return self._load_chunks(ptrs, m, other, V, et, p.elem.itemsize, shape, self._chunk_steps(p, shape, V))
        vt = vty(et, R)
        if m is None:
            m = self.const(1, "i1", R, shape)
        name = f"llvm.masked.gather.v{R}{self._sfx_et(et)}.v{R}p0"
        self.declare(name, vt, [vty("ptr", R), "i32", vty("i1", R), vt])
        return self.val(f"call {vt} @{name}({vty('ptr', R)} {ptrs.ref}, i32 {p.elem.itemsize}, {m.ty} {m.ref}, "
                        f"{vt} {other.ref})", et, R, shape)

    def op_store(self, op):
        if self.pending_write or self.pending_read:
            self.barrier()
        self.pending_write = True
        shape = op.operands[0].type.shape
        p = self.get(op.operands[0])
        v = self.get(op.operands[1])
        mask = self.get(op.operands[2]) if len(op.operands) > 2 else None
        et = elem_ty(p.elem)
        if not shape:
            # a scalar is uniform: one thread stores it
            first = self.val(f"icmp eq i32 {self.tid}, 0", "i1", 0)
            cond = first if mask is None else self.val(f"and i1 {first.ref}, {mask.ref}", "i1", 0)
            yes, done = self.label("st"), self.label("st_done")
            self.emit(f"br i1 {cond.ref}, label %{yes}, label %{done}")
            self.start_block(yes)
            if not self.hooks.store(self, p, v, (), None):
                off = 0 if p.offs is None else (p.offs.ref, p.offs.et)
                ptr = self._elem_ptr(p, off)
                self.emit(f"store {et} {v.ref}, ptr {ptr}, align {p.elem.itemsize}")
            self.emit(f"br label %{done}")
            self.start_block(done)
            return None
        R = self.lanes(shape)
        if v.n == 0:
            v = self.splat(v, R, shape)
        if self.hooks.store(self, p, v, shape, mask):
            return None
        ptrs = self._ptr_vec(p, shape)
        m = self._gpu_mask(shape, mask)
        V = self._chunk_vector(op.operands[0], op.operands[2] if len(op.operands) > 2 else None, shape, p.elem)
        if V:
            self._store_chunks(ptrs, v, m, V, et, p.elem.itemsize, self._chunk_steps(p, shape, V))
            return None
        if m is None:
            m = self.const(1, "i1", R, shape)
        vt = vty(et, R)
        name = f"llvm.masked.scatter.v{R}{self._sfx_et(et)}.v{R}p0"
        self.declare(name, "void", [vt, vty("ptr", R), "i32", vty("i1", R)])
        self.emit(f"call void @{name}({vt} {v.ref}, {vty('ptr', R)} {ptrs.ref}, i32 {p.elem.itemsize}, "
                  f"{m.ty} {m.ref})")
        return None

    def _chunk_vector(self, ptr_val, mask_val, shape, elem) -> int:
        """V when every V-element chunk of this access is one aligned vector of at most 16 bytes with one
        mask bit (the axis analysis proves contiguity, alignment and a chunk-constant mask), else 0."""
        V = self.vec(shape)
        size = V * elem.itemsize
        if V == 1 or shape[-1] % V or size > 16 or size < 4:
            return 0
        info = self.axes.info(ptr_val)
        if info.contig[-1] % V or info.div[-1] % size:
            return 0
        if mask_val is not None and self.axes.info(mask_val).const[-1] % V:
            return 0
        return V

    def _chunk_steps(self, p: PT, shape, V: int):
        """Element steps (i64 refs or ints) from each chunk's first element to the next one's, when the
        offsets have an affine form (p.offs.aff: base + sum of index * stride, uniform strides) and the
        tile's sizes are powers of two, else None. A thread's chunks then differ by uniform amounts (see
        _flat_coords: coordinate deltas between chunks are constants), so its chunk pointers are one pointer
        plus uniform steps rather than one 64-bit offset each (16 chunks of a bf16 weight tile were 32 of
        a linear's 255 registers). Like the CPU path's affine form, it takes the i32 index math feeding an
        address not to wrap (a wrapped index addresses memory outside the tensor anyway)."""
        a = p.offs.aff if p.offs is not None else None
        R = self.lanes(shape)
        if a is None or R // V < 2 or len(a.strides) != len(shape) or any(d & (d - 1) for d in shape) \
                or self.T & (self.T - 1):
            return None
        TV = self.T * V

        def fields(k):
            out = []
            for ax in range(len(shape)):
                f = k >> (_prod(shape[ax + 1:]).bit_length() - 1)
                out.append(f if ax == 0 else f & (shape[ax] - 1))
            return out
        et = p.offs.et
        steps, memo = [], {}
        for c in range(1, R // V):
            d = [x - y for x, y in zip(fields(c * TV), fields((c - 1) * TV))]
            key = tuple(d)
            if key not in memo:
                tot, terms = 0, []
                for dk, st in zip(d, a.strides):
                    if dk == 0 or (isinstance(st, int) and st == 0):
                        continue
                    if isinstance(st, int):
                        tot += dk * st
                        continue
                    st64 = st if et == "i64" else self.val(f"sext {et} {st} to i64", "i64", 0).ref
                    terms.append(st64 if dk == 1 else self.val(f"mul i64 {st64}, {dk}", "i64", 0).ref)
                ref = str(tot) if tot or not terms else None
                for t_ in terms:
                    ref = t_ if ref is None else self.val(f"add i64 {ref}, {t_}", "i64", 0).ref
                memo[key] = ref
            steps.append(memo[key])
        return steps

    def _chunk_ptr(self, ptrs: LV, lane: int, prev=None, step=None, et=None):
        """(pointer type, ref) of one chunk's first element, in the global address space when the target
        names one (a generic pointer would make NVPTX emit generic ld/st); with `prev` (the previous chunk's
        generic pointer) it is prev + step elements. Also returns the generic pointer."""
        if prev is not None:
            pc = self.val(f"getelementptr {et}, ptr {prev}, i64 {step}", "ptr", 0)
        else:
            pc = self.extract(ptrs, lane)
        gas = self.hooks.global_as
        if not gas:
            return "ptr", pc, pc.ref
        g = self.val(f"addrspacecast ptr {pc.ref} to ptr addrspace({gas})", "ptr", 0)
        return f"ptr addrspace({gas})", g, pc.ref

    def _load_chunks(self, ptrs: LV, m, other: LV, V: int, et: str, esize: int, shape, steps=None) -> LV:
        parts = []
        vt = vty(et, V)
        gp = None
        for c in range(ptrs.n // V):
            pty, pc, gp = self._chunk_ptr(ptrs, c * V, gp if steps and c else None,
                                          steps[c - 1] if steps and c else None, et)
            if m is None:
                parts.append(self.val(f"load {vt}, {pty} {pc.ref}, align {V * esize}", et, V))
                continue
            mc = self.extract(m, c * V)
            oc = self.shuffle(other, list(range(c * V, c * V + V))) if other.ref != "zeroinitializer" else \
                LV("zeroinitializer", et, V)
            hooked = self.hooks.masked_chunk_load(self, pty, pc.ref, mc.ref, oc, vt, V * esize)
            if hooked is not None:
                parts.append(LV(hooked, et, V))
                continue
            pred = self.block
            yes, done = self.label("vld"), self.label("vld_done")
            self.emit(f"br i1 {mc.ref}, label %{yes}, label %{done}")
            self.start_block(yes)
            lv = self.val(f"load {vt}, {pty} {pc.ref}, align {V * esize}", et, V)
            self.emit(f"br label %{done}")
            self.start_block(done)
            parts.append(self.val(f"phi {vt} [ {lv.ref}, %{yes} ], [ {oc.ref}, %{pred} ]", et, V))
        if len(parts) == 1:
            return LV(parts[0].ref, et, V, tuple(shape))
        return self.concat(parts, shape)

    def _store_chunks(self, ptrs: LV, v: LV, m, V: int, et: str, esize: int, steps=None) -> None:
        vt = vty(et, V)
        gp = None
        for c in range(ptrs.n // V):
            pty, pc, gp = self._chunk_ptr(ptrs, c * V, gp if steps and c else None,
                                          steps[c - 1] if steps and c else None, et)
            part = self.shuffle(v, list(range(c * V, c * V + V))) if v.n > V else v
            if m is None:
                self.emit(f"store {vt} {part.ref}, {pty} {pc.ref}, align {V * esize}")
                continue
            mc = self.extract(m, c * V)
            if self.hooks.masked_chunk_store(self, pty, pc.ref, mc.ref, part, vt, V * esize):
                continue
            yes, done = self.label("vst"), self.label("vst_done")
            self.emit(f"br i1 {mc.ref}, label %{yes}, label %{done}")
            self.start_block(yes)
            self.emit(f"store {vt} {part.ref}, {pty} {pc.ref}, align {V * esize}")
            self.emit(f"br label %{done}")
            self.start_block(done)

    def op_prefetch(self, op):
        """The `nbytes` form on targets with a bulk L2 prefetch: each valid element's run, one instruction (a
        thread per element; replicated elements, past the tile's size, are skipped). Otherwise nothing: a
        cache hint, and GPUs stream through L2 anyway."""
        nbytes = op.attrs.get("nbytes")
        if not nbytes or not self.hooks.has_bulk_prefetch:
            return None
        p = self.get(op.operands[0])
        shape = op.operands[0].type.shape
        if not shape:
            off = 0 if p.offs is None else (p.offs.ref, p.offs.et)
            first = self.val(f"icmp eq i32 {self.tid}, 0", "i1", 0)
            self.hooks.bulk_prefetch_l2(self, self._elem_ptr(p, off), nbytes, first.ref)
            return None
        ptrs = self._ptr_vec(p, shape)
        idx = self.flat_index(shape)
        for j in range(ptrs.n):
            ok = self.val(f"icmp slt i32 {self.extract(idx, j).ref}, {_prod(shape)}", "i1", 0)
            self.hooks.bulk_prefetch_l2(self, self.extract(ptrs, j).ref, nbytes, ok.ref)
        return None

    def op_barrier(self, op):
        self.barrier()
        return None

    # ------------------------------------------------------------------------------------- loops
    def emit_loop(self, count: int, carried: list, body, unroll=None):
        """A counted loop 0..count-1 (uniform) with vector values carried; body(iv_ref, carried) -> carried.
        unroll: None (LLVM decides), or at most this many copies of the body (llvm.loop.unroll.count)."""
        hdr, bb, ex = self.label("l_hdr"), self.label("l_body"), self.label("l_exit")
        pred = self.block
        self.emit(f"br label %{hdr}")
        self.start_block(hdr)
        iv = self.tmp("i")
        slot = len(self.lines)
        self.lines.append(None)
        phis = []
        for c in carried:
            ph = self.tmp("c")
            phis.append(ph)
            self.lines.append(None)
        cond = self.val(f"icmp slt i32 {iv}, {count}", "i1", 0)
        self.emit(f"br i1 {cond.ref}, label %{bb}, label %{ex}")
        self.start_block(bb)
        cur = [LV(ph, c.et, c.n, c.shape) for ph, c in zip(phis, carried)]
        nxt = body(iv, cur)
        inc = self.val(f"add i32 {iv}, 1", "i32", 0)
        latch = self.block
        if unroll is not None:
            md = 9000 + len(self.loop_md)      # ids clear of a hook's module metadata (AMDGPU: !0)
            self.loop_md.append(f'!{md} = distinct !{{!{md}, !{md + 1}}}')
            self.loop_md.append(f'!{md + 1} = !{{!"llvm.loop.unroll.count", i32 {unroll}}}' if unroll > 1 else
                                f'!{md + 1} = !{{!"llvm.loop.unroll.disable"}}')
            self.emit(f"br label %{hdr}, !llvm.loop !{md}")
        else:
            self.emit(f"br label %{hdr}")
        self.lines[slot] = f"  {iv} = phi i32 [ 0, %{pred} ], [ {inc.ref}, %{latch} ]"
        for i, (ph, c, n) in enumerate(zip(phis, carried, nxt)):
            self.lines[slot + 1 + i] = f"  {ph} = phi {c.ty} [ {c.ref}, %{pred} ], [ {n.ref}, %{latch} ]"
        self.start_block(ex)
        return cur

    def op_for(self, op):
        pinned_here = self._pin_stage(op)         # (first: its barrier must not clear the loop's own flags)
        body_ops = list(_ops_of(op.regions[0]))
        stores = any(o.name == "store" for o in body_ops)
        loads = any(o.name == "load" for o in body_ops)
        # a later iteration's load follows this iteration's store (and its store an earlier load); the loop
        # may also run no iteration at all, so afterwards anything pending before or inside stays pending
        before = (self.pending_write, self.pending_read)
        self.pending_write |= stores
        self.pending_read |= loads
        # row slots: the previous iteration may have read any slot after the body's last barrier, and the loop
        # may run no iteration at all (so what was written before stays unsynchronised after it)
        rows_before = (self._rows_dirty, set(self._rows_read))
        if self._row_of:
            self._rows_read = set(self._row_of.values())
        slots = self._frag_slots(op)
        slots.update({j: (k, plan) for (o, j), (k, plan, _) in self._wg_sum_slots.items() if o == id(op)})
        fslots = {j: self.frag_keys[a.id] for j, a in enumerate(op.regions[0].args[1:]) if a.id in self.frag_keys}
        aslots = {j: sp for (o, j), sp in self._async_slots.items() if o == id(op)}
        res = self._for_with_frags(op, slots, fslots, aslots) if slots or fslots or aslots else super().op_for(op)
        self.pending_write |= stores or before[0]
        self.pending_read |= loads or before[1]
        self._rows_dirty = self._rows_dirty or rows_before[0]
        self._rows_read = set(self._rows_read) | rows_before[1]
        for vid in pinned_here:
            self._pinned.pop(vid, None)
        return res

    def _frag_slots(self, op) -> dict:
        """Loop-carried slots whose value can stay in MMA registers: initialised to zero, used in the body
        only as the acc of one planned dot whose result is only yielded back to the same slot (the
        `acc = dot(a, b, acc)` of a K loop). slot -> (layout key, plan)."""
        if not self.hooks.mma_shape:
            return {}
        body = op.regions[0]
        yop = body.ops[-1] if body.ops and body.ops[-1].name == "yield" else None
        if yop is None:
            return {}
        slots = {}
        for j, arg in enumerate(body.args[1:]):
            us = self.users.get(arg.id, [])
            if len(us) != 1:
                continue
            u, idx = us[0]
            if u.name != "dot" or idx != 2 or id(u) not in self.mma_plans:
                continue
            plan = self.mma_plans[id(u)]
            key = self._mma_geometry(plan)["key"]
            y = yop.operands[j]
            yu = self.users.get(y.id, [])
            if key is None or y.id != u.results[0].id or len(yu) != 1 or yu[0][0] is not yop:
                continue
            d = self.defs.get(op.operands[3 + j].id)
            if d is None or d.name != "const" or float(d.attrs["value"]) != 0.0:
                continue
            slots[j] = (key, plan)
            self._frag_yields[(id(yop), j)] = key
        return slots

    def _for_with_frags(self, op, slots, fslots=None, aslots=None):
        """The counted loop of LlvmEmitter.op_for with the `slots` carried as MMA registers (one phi per
        register, starting at 0.0); afterwards each stays in registers if only dots of its layout use it,
        else it becomes a tile value at the loop's exit. `fslots` (slot -> layout key) are carried as FragV:
        one vector phi each, from the constant the slot starts at."""
        fslots = fslots or {}
        aslots = aslots or {}
        lb, ub, step = (self.get(o) for o in op.operands[:3])
        inits = [self.get(o) for o in op.operands[3:]]
        body = op.regions[0]
        hdr, bb, ex = self.label("for_hdr"), self.label("for_body"), self.label("for_exit")
        inits_r = [None if j in aslots else self._phi_repr(v) for j, v in enumerate(inits)]
        nregs = {}
        for j, (key, plan) in slots.items():       # (before the header: mma_layout may emit lane math)
            g = self._mma_geometry(plan)
            if plan["wg"]:
                nregs[j] = g["nregs"]
                continue
            lay = self.hooks.mma_layout(_LaneExpr(self, self.tid), "bf16" if plan["kind"] == ir.bf16 else "f16")
            nregs[j] = g["per_warp"] * g["nparts"] * len(lay["c"])
        finit = {j: self._frag_const(op.operands[3 + j], key) for j, key in fslots.items()}
        pred = self.block
        self.emit(f"br label %{hdr}")
        self.start_block(hdr)
        it = lb.et
        iv = self.tmp("iv")
        phi_idx = len(self.lines)
        self.lines.append(None)
        carried = []
        for j, r in enumerate(inits_r):
            if j in slots:
                key, plan = slots[j]
                phs = [self.tmp("f") for _ in range(nregs[j])]
                self.lines.extend([None] * nregs[j])
                carried.append(("frag", phs, key, plan))
            elif j in fslots:
                ph = self.tmp("fv")
                self.lines.append(None)
                carried.append(("flv", ph, fslots[j], finit[j]))
            elif j in aslots:
                if not isinstance(inits[j], AsyncTile):
                    raise CompilationError("internal lowering error: an async slot's first tile is not async", op.loc)
                ph = self.tmp("ab")
                self.lines.append(None)
                carried.append(("async", ph, aslots[j], inits[j].buf))
            else:
                ph = self.tmp("c")
                self.lines.append(None)
                carried.append(("lv", ph, r))
        cond = self.val(f"icmp slt {it} {iv}, {ub.ref}", "i1", 0)
        self.emit(f"br i1 {cond.ref}, label %{bb}, label %{ex}")
        self.start_block(bb)
        self.vals[body.args[0].id] = LV(iv, it, 0, (), Aff(iv, ()))
        for arg, v, c in zip(body.args[1:], inits, carried):
            if c[0] == "frag":
                self.vals[arg.id] = MmaAcc(c[2], c[1], c[3])
            elif c[0] == "flv":
                self.vals[arg.id] = FragV(c[2], LV(c[1], "float", c[3].n, tuple(arg.type.shape)))
            elif c[0] == "async":
                self.vals[arg.id] = AsyncTile(c[2], c[1], self._async_ahead.get(arg.id, 0))
            else:
                self.vals[arg.id] = self._unphi(v, LV(c[1], c[2].et, c[2].n, c[2].shape))
        self._frag_loops.append((iv, lb, step))
        self._async_issued.append(0)
        ys = self.lower_block(body)
        self._loop_step_end()
        self._async_issued.pop()
        self._frag_loops.pop()
        ys_r = []
        for j, (y, v) in enumerate(zip(ys, inits)):
            if j in slots:
                if not isinstance(y, MmaAcc) or y.key != slots[j][0]:
                    raise CompilationError("internal lowering error: a register accumulator left its layout",
                                           op.loc)
                ys_r.append(y)
                continue
            if j in aslots:
                if not isinstance(y, AsyncTile) or y.spec is not aslots[j]:
                    raise CompilationError("internal lowering error: an async slot's tile is not async", op.loc)
                ys_r.append(LV(y.buf, "i32", 0))
                continue
            if j in fslots:
                if not isinstance(y, FragV) or y.key != fslots[j]:
                    raise CompilationError("internal lowering error: a fragment-layout slot left its layout",
                                           op.loc)
                ys_r.append(y.lv)
                continue
            if isinstance(v, PT) and (not isinstance(y, PT) or y.base != v.base):
                raise CompilationError("a loop-carried pointer tile must keep its base pointer", op.loc)
            ys_r.append(self._phi_repr(y))
        nxt = self.val(f"add {it} {iv}, {step.ref}", it, 0)
        latch = self.block
        self.emit(f"br label %{hdr}")
        self.lines[phi_idx] = f"  {iv} = phi {it} [ {lb.ref}, %{pred} ], [ {nxt.ref}, %{latch} ]"
        k = phi_idx + 1
        for j, (c, y) in enumerate(zip(carried, ys_r)):
            if c[0] == "frag":
                # (register accumulators start at 0.0; a register sum at its slot's constant: -0.0 for the
                # serial split's, so slab 0's value is the sum's exactly)
                ws = self._wg_sum_slots.get((id(op), j))
                init = "0.0" if ws is None else repr(float(ws[2]))
                for ph, yr in zip(c[1], y.regs):
                    self.lines[k] = f"  {ph} = phi float [ {init}, %{pred} ], [ {yr}, %{latch} ]"
                    k += 1
            elif c[0] == "flv":
                self.lines[k] = f"  {c[1]} = phi {c[3].ty} [ {c[3].ref}, %{pred} ], [ {y.ref}, %{latch} ]"
                k += 1
            elif c[0] == "async":
                self.lines[k] = f"  {c[1]} = phi i32 [ {c[3]}, %{pred} ], [ {y.ref}, %{latch} ]"
                k += 1
            else:
                self.lines[k] = f"  {c[1]} = phi {c[2].ty} [ {c[2].ref}, %{pred} ], [ {y.ref}, %{latch} ]"
                k += 1
        self.start_block(ex)
        out = []
        for j, (v, c) in enumerate(zip(inits, carried)):
            if c[0] == "frag":
                acc = MmaAcc(c[2], c[1], c[3])
                out.append(acc if self._keep_frag(op.results[j], c[2], to_dots=True) else self._materialise(acc))
            elif c[0] == "flv":
                out.append(FragV(c[2], LV(c[1], "float", c[3].n, tuple(op.results[j].type.shape))))
            elif c[0] == "async":
                out.append(AsyncTile(c[2], c[1], self._async_ahead.get(op.results[j].id, 0)))
            else:
                out.append(self._unphi(v, LV(c[1], c[2].et, c[2].n, c[2].shape)))
        return out

    def _branch_state(self):
        return (self.pending_write, self.pending_read, self._rows_dirty, frozenset(self._rows_read))

    def _enter_branch(self, state) -> None:
        self.pending_write, self.pending_read, self._rows_dirty, rows_read = state
        self._rows_read = set(rows_read)

    def _merge_branches(self, states: list) -> None:
        # after the `if`, whatever either branch left pending stays pending
        self.pending_write = any(s_[0] for s_ in states)
        self.pending_read = any(s_[1] for s_ in states)
        self._rows_dirty = any(s_[2] for s_ in states)
        self._rows_read = set().union(*(s_[3] for s_ in states))

    def _phi_repr(self, v):
        if isinstance(v, PT):
            offs = v.offs if v.offs is not None else self.const(0, "i64", self.lanes(v.shape), v.shape)
            return self.to_i64(offs)
        return v

    # ---------------------------------------------------------------------------------- reductions
    def _identity(self, kind: str, et: str, d: ir.DType, n: int) -> LV:
        if kind == "sum":
            return self.const(-0.0 if et in ("float", "double") else 0, et, n)
        if et in ("float", "double"):
            return self.const(-math.inf if kind in ("max", "argmax") else math.inf, et, n)
        bits = _ES[et] * 8
        if d.is_signed:
            lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        else:
            lo, hi = 0, -1          # all ones: the largest unsigned value
        return self.const(lo if kind in ("max", "argmax") else hi, et, n)

    def _better(self, kind, d, v: LV, vi: LV, b: LV, bi: LV) -> LV:
        """(v, vi) beats (b, bi): strictly more extreme, or equal with a smaller index."""
        if d.is_float:
            pred = "ogt" if kind == "argmax" else "olt"
            strict = self.val(f"fcmp {pred} {v.ty} {v.ref}, {b.ref}", "i1", v.n)
            eq = self.val(f"fcmp oeq {v.ty} {v.ref}, {b.ref}", "i1", v.n)
        else:
            s = "s" if d.is_signed else "u"
            pred = f"{s}gt" if kind == "argmax" else f"{s}lt"
            strict = self.val(f"icmp {pred} {v.ty} {v.ref}, {b.ref}", "i1", v.n)
            eq = self.val(f"icmp eq {v.ty} {v.ref}, {b.ref}", "i1", v.n)
        lower = self.val(f"icmp slt {vi.ty} {vi.ref}, {bi.ref}", "i1", v.n)
        tie = self.val(f"and {eq.ty} {eq.ref}, {lower.ref}", "i1", v.n)
        return self.val(f"or {eq.ty} {strict.ref}, {tie.ref}", "i1", v.n)

    def _reduce_common(self, op, arg: bool):
        fv = self.vals.get(op.operands[0].id)
        rkey = self.frag_keys.get(op.results[0].id) if not arg else None
        if rkey is not None:
            if not isinstance(fv, FragV) or self._row_key(fv.key) != rkey:
                raise CompilationError("internal lowering error: a row reduction left its layout", op.loc)
            return self._row_reduce(op, fv, rkey)
        if isinstance(fv, FragV) and fv.lv.et == "float":
            # accumulator registers go straight to the staging the reduction reads (each at its flat
            # element), so the tile layout's round trip is skipped and the order of operations is the same
            F = self._frag_flat(fv.key)
            saved = self._flat_override
            self._flat_override = (tuple(fv.lv.shape), F)
            try:
                return self._reduce_lanes(op, arg, fv.lv)
            finally:
                self._flat_override = saved
        return self._reduce_lanes(op, arg, self.get(op.operands[0]))

    def _reduce_lanes(self, op, arg: bool, x):
        d = op.operands[0].type.elem
        kind, ax = op.attrs["kind"], op.attrs["axis"]
        half = d in (ir.f16, ir.bf16)
        if half:
            x, d = self.to_f32(x, d), ir.f32
        shape = op.operands[0].type.shape
        oshape = op.result.type.shape
        pre, n, post = _prod(shape[:ax]), shape[ax], _prod(shape[ax + 1:])
        O = pre * post
        T = self.T
        # chunks per output: a function of the reduced length (and T) only, never of how many outputs the
        # tile has, so an output's order of operations is the same whatever the other axes (the batch) are.
        # G = min(next power of two >= n, T) also makes a row padded with identities at its end (a merge over
        # 3 partitions launched as 4 or 16) reduce bit-identically: element k always lands in chunk k mod G,
        # chunks fold their elements in increasing k, and identities only ever add exact no-ops.
        G = 1
        while G < min(n, T):
            G *= 2
        W = O * G                               # work items (output, chunk), laid out as a (W,) tile
        RW = self.lanes((W,))
        # up to T items: one a thread (item = thread id) instead of the tile layout's 4-lane chunks, which left all
        # but W / 4 threads idle and gave each four items' reads in series (a 4096-wide row sum: 128 shared loads a
        # thread on one warp, against 32 on four). Each item folds the same elements in the same order: same bits
        one_each = W <= T and RW > 1 and self.tuning.reduce_one_each
        if one_each:
            RW = 1
        et = x.et
        self.barrier()
        end = self.smem_write(x, 0)
        self.barrier()
        steps = -(-n // G)
        if steps == 1 and G > 1 and not arg and self.tuning.reduce_direct:
            return self._reduce_direct(op, kind, d, et, shape, oshape, n, post, G, half)
        if one_each:
            w = self.val(f"insertelement <1 x i32> poison, i32 {self.tid}, i32 0", "i32", 1)
        else:
            w = LV(self.flat_index((W,)).ref, "i32", RW)
        o = self.ibin("udiv", w, G) if G > 1 else w
        c = self.ibin("urem", w, G) if G > 1 else self.iconst(0, RW)
        p_, q_ = (self.ibin("udiv", o, post), self.ibin("urem", o, post)) if post > 1 else (o, None)
        base = self.ibin("mul", p_, n * post)
        if q_ is not None:
            base = self.ibin("add", base, q_)
        okw = self.val(f"icmp ult {w.ty} {w.ref}, {self.iconst(W, RW).ref}", "i1", RW)
        ident = self._identity(kind, et, d, RW)

        def body(iv, cur):
            ivv = self.splat(LV(iv, "i32", 0), RW)
            k = self.ibin("add", self.ibin("mul", ivv, G), c) if G > 1 else ivv
            ok = self.val(f"icmp ult {k.ty} {k.ref}, {self.iconst(n, RW).ref}", "i1", RW)
            ok = self.val(f"and {ok.ty} {ok.ref}, {okw.ref}", "i1", RW)
            idx = self.ibin("add", base, self.ibin("mul", k, post) if post > 1 else k)
            idx = self.umin(idx, _prod(shape) - 1)
            v = self.smem_read(et, 0, idx, ())
            v = LV(v.ref, v.et, RW)
            v = self.val(f"select {ok.ty} {ok.ref}, {v.ty} {v.ref}, {ident.ty} {ident.ref}", et, RW)
            if not arg:
                return [self._combine(kind, cur[0], v, d)]
            better = self._better(kind, d, v, k, cur[0], cur[1])
            better = self.val(f"and {better.ty} {better.ref}, {ok.ref}", "i1", RW)
            return [self.val(f"select {better.ty} {better.ref}, {v.ty} {v.ref}, {v.ty} {cur[0].ref}", et, RW),
                    self.val(f"select {better.ty} {better.ref}, {k.ty} {k.ref}, {k.ty} {cur[1].ref}", "i32", RW)]
        init = [ident] + ([self.iconst(n, RW)] if arg else [])
        # (unrolled: the chunk's shared-memory reads are independent and can all be in flight; only the
        # combines chain, in the same order)
        part = self.emit_loop(steps, init, body, unroll=min(steps, 8) if steps > 1 else None)
        R_out = self.lanes(oshape)
        if G == 1:
            # one chunk per output: the work items are the outputs in the output tile's layout
            res = part[1] if arg else part[0]
            res = LV(res.ref, res.et, R_out, oshape)
        else:
            # fold the G partials of each output in chunk order
            self.barrier()
            offv = end
            at = w if one_each else None
            end_v = self.smem_write(LV(part[0].ref, et, RW, (W,)), offv, idx=at)
            if arg:
                self.smem_write(LV(part[1].ref, "i32", RW, (W,)), end_v, idx=at)
            self.barrier()
            if oshape:
                ov = self.flat_index(oshape)
                n_out = R_out
            else:
                ov, n_out = self.iconst(0, 1), 1
            ov = self.umin(ov, O - 1)
            pbase = self.ibin("mul", ov, G)
            cur0 = [self._identity(kind, et, d, n_out)] + ([self.iconst(n, n_out)] if arg else [])

            def fold(iv, cur):
                i = self.ibin("add", pbase, self.splat(LV(iv, "i32", 0), n_out))
                v = self.smem_read(et, offv, i, ())
                v = LV(v.ref, v.et, n_out)
                if not arg:
                    return [self._combine(kind, cur[0], v, d)]
                vi = self.smem_read("i32", end_v, i, ())
                vi = LV(vi.ref, "i32", n_out)
                better = self._better(kind, d, v, vi, cur[0], cur[1])
                return [self.val(f"select {better.ty} {better.ref}, {v.ty} {v.ref}, {v.ty} {cur[0].ref}", et, n_out),
                        self.val(f"select {better.ty} {better.ref}, {vi.ty} {vi.ref}, {vi.ty} {cur[1].ref}", "i32",
                                 n_out)]
            # (unrolled: the partials' reads are independent and can be in flight; the combines chain in order)
            fin = self.emit_loop(G, cur0, fold, unroll=min(G, 16) if self.tuning.reduce_one_each else None)
            res = fin[1] if arg else fin[0]
            if oshape:
                res = LV(res.ref, res.et, R_out, oshape)
            else:
                res = self.extract(LV(res.ref, res.et, 1), 0)
        if not oshape and G == 1:
            # one output computed by thread 0 only: make the scalar uniform
            res = self._move(LV(res.ref, res.et, 1, (1,)), (1,), (), lambda e: 0)
        if half and not arg:
            res = self.from_f32(res, op.operands[0].type.elem)
        return res

    def _reduce_direct(self, op, kind, d, et, shape, oshape, n, post, G, half):
        """_reduce_lanes when every chunk holds one element (n <= G): each output's thread folds its elements
        straight from the staged input, in chunk order, as combine(identity, element) then into the running
        value: the very operations of the two-pass form (whose first pass computes exactly those partials),
        without staging the partials (a barrier pair and a shared-memory round trip fewer)."""
        O = _prod(shape) // n
        R_out = self.lanes(oshape) if oshape else 1
        if oshape:
            ov = self.umin(self.flat_index(oshape), O - 1)
        else:
            ov = self.iconst(0, 1)
        p_, q_ = (self.ibin("udiv", ov, post), self.ibin("urem", ov, post)) if post > 1 else (ov, None)
        base = self.ibin("mul", p_, n * post)
        if q_ is not None:
            base = self.ibin("add", base, q_)
        ident = self._identity(kind, et, d, R_out)

        def fold(iv, cur):
            ivv = self.splat(LV(iv, "i32", 0), R_out)
            ok = self.val(f"icmp ult i32 {iv}, {n}", "i1", 0)
            idx = self.ibin("add", base, self.ibin("mul", ivv, post) if post > 1 else ivv)
            idx = self.umin(idx, _prod(shape) - 1)
            v = self.smem_read(et, 0, idx, ())
            v = LV(v.ref, v.et, R_out)
            v = self.val(f"select i1 {ok.ref}, {v.ty} {v.ref}, {ident.ty} {ident.ref}", et, R_out)
            return [self._combine(kind, cur[0], self._combine(kind, ident, v, d), d)]
        res = self.emit_loop(G, [ident], fold, unroll=min(G, 16))[0]     # (reads in flight; combines chain)
        if oshape:
            res = LV(res.ref, res.et, R_out, oshape)
        else:
            res = self.extract(LV(res.ref, res.et, 1), 0)
        if half:
            res = self.from_f32(res, op.operands[0].type.elem)
        return res

    def op_reduce(self, op):
        return self._reduce_common(op, arg=False)

    def op_argreduce(self, op):
        return self._reduce_common(op, arg=True)

    # ----------------------------------------------------------------------------------------- dot
    def _to_acc(self, v: LV, d: ir.DType, acc_d: ir.DType) -> LV:
        return self.convert(v, d, acc_d) if d != acc_d else v

    def op_dot(self, op):
        plan = self.mma_plans.get(id(op))
        if plan is not None:
            return self._dot_mma_plan(op, plan)
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        acc_in = self.get(op.operands[2]) if len(op.operands) > 2 and op.operands[2] is not None else None
        ad, bd = op.operands[0].type.elem, op.operands[1].type.elem
        rd = op.result.type.elem
        m, k = op.operands[0].type.shape
        n = op.operands[1].type.shape[1]
        oshape = (m, n)
        R = self.lanes(oshape)
        self.barrier()
        offb = self.smem_write(a, 0)
        self.smem_write(b, offb)
        self.barrier()
        e = self.flat_index(oshape)
        e = self.umin(e, m * n - 1)
        row = self.ibin("udiv", e, n) if n > 1 else e
        col = self.ibin("urem", e, n) if n > 1 else self.iconst(0, R)
        arow = self.ibin("mul", row, k)
        ret = elem_ty(rd)
        if acc_in is not None:
            init = acc_in if acc_in.n else self.splat(acc_in, R, oshape)
            init = self._to_acc(init, op.operands[2].type.elem, rd)
        else:
            init = self.const(0.0 if rd.is_float else 0, ret, R, oshape)

        def body(iv, cur):
            kk = self.splat(LV(iv, "i32", 0), R)
            av = self.smem_read(a.et, 0, self.ibin("add", arow, kk), ())
            bv = self.smem_read(b.et, offb, self.ibin("add", self.ibin("mul", kk, n), col), ())
            av = self._to_acc(LV(av.ref, av.et, R), ad, rd)
            bv = self._to_acc(LV(bv.ref, bv.et, R), bd, rd)
            if rd.is_float:
                return [self.fmuladd(av, bv, cur[0])]
            pr = self.val(f"mul {av.ty} {av.ref}, {bv.ref}", ret, R)
            return [self.val(f"add {pr.ty} {cur[0].ref}, {pr.ref}", ret, R)]
        out = self.emit_loop(k, [LV(init.ref, init.et, R)], body)[0]
        return LV(out.ref, out.et, R, oshape)

    # ---------------------------------------------------------------------- dot on the matrix units
    def _single_use_cast_from(self, v, kinds):
        """The 16-bit source of v when v is a single-use widening cast from one of `kinds`, else None."""
        d = self.defs.get(v.id)
        if d is not None and d.name == "cast" and not d.attrs.get("bitcast", False) \
                and d.operands[0].type.elem in kinds and self.uses.get(v.id, 0) == 1:
            return d.operands[0]
        return None

    def _mma_plan(self, op):
        """How a dot runs on the matrix units, or None for the FMA path. B must be 16-bit (f16/bf16), maybe
        behind a single-use widening cast (the language widens mixed-dtype operands to f32) and a single-use
        transpose (`dot(x, trans(w))`: w's (n, k) rows are written to shared memory as they are, so no layout
        change is spent on the transpose). A is the same 16-bit type, or f32 split into two 16-bit parts
        hi + lo (two MMAs per step: ~16 significant bits of the activations rather than 8)."""
        ms = self.hooks.mma_shape
        if op.results[0].type.elem != ir.f32:
            return None
        av, bv = op.operands[0], op.operands[1]
        m, k = av.type.shape
        n = bv.type.shape[1]
        if m % ms[0] or n % ms[1] or k % ms[2] or k % 8:
            return None
        lazy = []
        b16 = bv if bv.type.elem in (ir.bf16, ir.f16) else None
        if b16 is None and bv.type.elem == ir.f32:
            b16 = self._single_use_cast_from(bv, (ir.bf16, ir.f16))
            if b16 is not None:
                lazy.append(bv.id)
        if b16 is None:
            return None
        kind = b16.type.elem
        nk, b_src = False, b16
        t = self.defs.get(b16.id)
        if t is not None and t.name == "trans" and tuple(t.attrs.get("perm", (1, 0))) == (1, 0) \
                and self.uses.get(b16.id, 0) == 1:
            nk, b_src = True, t.operands[0]
            lazy.append(b16.id)
        if av.type.elem == kind:
            a_src, split = av, False
        elif av.type.elem == ir.f32:
            a_src = self._single_use_cast_from(av, (kind,))
            if a_src is not None:
                lazy.append(av.id)
                split = False
            else:
                a_src, split = av, True
        else:
            return None
        plan = dict(a=a_src, split=split, b=b_src, nk=nk, kind=kind, m=m, n=n, k=k, lazy=lazy,
                    acc=len(op.operands) > 2 and op.operands[2] is not None, id=id(op))
        plan["wg"] = self._wg_fits(plan)
        return plan

    def _b_trans(self, plan) -> bool:
        """Whether a planned dot's B, a (k, n) tile rather than a folded trans(w), is staged in its own row order
        (rows of n + 8 elements, vector stores) and read by ldmatrix .trans (tuning.ldmatrix_trans: NVIDIA's m16n8k16;
        elsewhere B is staged transposed as (n, k) rows, element by element)."""
        t = self.tuning
        return bool(t.ldmatrix_trans and t.ldmatrix and not plan["nk"] and not plan["wg"] and self.hooks.has_ldmatrix
                    and tuple(self.hooks.mma_shape) == (16, 8, 16) and plan["n"] % 8 == 0)

    def _b_rows(self, plan):
        """B's staging in shared memory: (shape written, row length, whether written transposed)."""
        n, k = plan["n"], plan["k"]
        if plan["nk"]:
            return (n, k), k + 8, False
        if self._b_trans(plan):
            return (k, n), n + 8, False
        return (k, n), k + 8, True

    def _smem_write_rows(self, x: LV, off: int, shape, KP: int, transpose: bool, claim: bool = True) -> int:
        """Writes a 2-D 16-bit tile to shared memory as rows of KP elements: element (r, c) at r * KP + c, or
        at c * KP + r with `transpose`. The padding (KP = row length + 8) shifts consecutive rows by 16 bytes,
        so the MMA fragment loads (8 rows x 4 pairs per warp) hit 32 different banks."""
        R0, C0 = shape
        numel = R0 * C0
        rows_out = C0 if transpose else R0
        scratch = rows_out * KP                           # padding lanes write here
        V = self.vec(shape)
        flat = self.flat_index(shape)
        a = self.hooks.smem_as
        base = self.smem_ptr(off)
        pad_lanes = _prod(shape) % (self.T * V) != 0
        frag = self._flat_override is not None and self._flat_override[0] == tuple(shape)
        if frag:
            pad_lanes = False                             # a fragment layout's lanes are all elements
        if not transpose and C0 % V == 0 and V > 1 and not frag:
            # chunks of V consecutive elements stay within one row: one vector store each
            vt = vty(x.et, V)
            fc = self._flat_coords(flat, shape)
            if fc is not None:
                # thread part of the offset once; chunk c adds a constant (an immediate offset in the store)
                r0, c0 = self.extract(fc[0], 0), self.extract(fc[1], 0)
                d0 = self.val(f"mul nuw nsw i32 {r0.ref}, {KP}", "i32", 0)
                d0 = self.val(f"add nuw nsw i32 {d0.ref}, {c0.ref}", "i32", 0)
                TV = self.T * V
            for c in range(x.n // V):
                e = self.extract(flat, c * V)
                if fc is not None:
                    k = c * TV
                    d = self.val(f"add nuw nsw i32 {d0.ref}, {(k // C0) * KP + k % C0}", "i32", 0)
                else:
                    r = self.val(f"udiv i32 {e.ref}, {C0}", "i32", 0)
                    col = self.val(f"urem i32 {e.ref}, {C0}", "i32", 0)
                    d = self.val(f"mul i32 {r.ref}, {KP}", "i32", 0)
                    d = self.val(f"add i32 {d.ref}, {col.ref}", "i32", 0)
                if pad_lanes:
                    ok = self.val(f"icmp ult i32 {e.ref}, {numel}", "i1", 0)
                    d = self.val(f"select i1 {ok.ref}, i32 {d.ref}, i32 {scratch}", "i32", 0)
                part = self.shuffle(x, list(range(c * V, c * V + V)))
                ptr = self.val(f"getelementptr {x.et}, ptr addrspace({a}) {base}, i32 {d.ref}", "ptr", 0)
                self.emit(f"store {vt} {part.ref}, ptr addrspace({a}) {ptr.ref}, align {V * _ES[x.et]}")
        else:
            r, col = self._coords(flat, shape)
            d = self.ibin("add", self.ibin("mul", col, KP), r) if transpose else \
                self.ibin("add", self.ibin("mul", r, KP), col)
            if pad_lanes:
                ok = self.val(f"icmp ult {flat.ty} {flat.ref}, {self.iconst(numel, flat.n).ref}", "i1", flat.n)
                d = self.val(f"select {ok.ty} {ok.ref}, {d.ty} {d.ref}, {d.ty} {self.iconst(scratch, d.n).ref}",
                             "i32", d.n)
            for j in range(x.n):
                dj = self.extract(d, j)
                ptr = self.val(f"getelementptr {x.et}, ptr addrspace({a}) {base}, i32 {dj.ref}", "ptr", 0)
                self.emit(f"store {x.et} {self.extract(x, j).ref}, ptr addrspace({a}) {ptr.ref}, "
                          f"align {_ES[x.et]}")
        return self._claim(off, (scratch + V) * _ES[x.et]) if claim else None

    def _dot_mma_plan(self, op, plan) -> LV:
        """(m, k) x (k, n) -> f32 on the matrix units: operands staged in shared memory as padded rows along
        k (A as (m, k), B as (n, k)), each warp taking 16x8 output tiles round-robin and running the K loop
        as m16n8k16 MMAs whose fragments are single 32-bit loads (k pairs are adjacent), hi and lo parts in
        separate accumulators; results written to shared memory and read back in the tile layout, then `acc`
        added, unless the result is a K loop's carried accumulator: then it stays in the MMA registers
        (MmaAcc, see op_for) and the next step's MMAs start from it. Per output element the K steps and the
        hi/lo order are the same whatever m is, so results stay batch invariant."""
        if plan["wg"]:
            return self._dot_wg(op, plan)
        m, n, k = plan["m"], plan["n"], plan["k"]
        g = self._mma_geometry(plan)
        fkey = self.frag_keys.get(op.results[0].id)
        if fkey is not None:
            return self._dot_frag(op, plan, g, fkey)
        # first: an accumulator in another register layout becomes a tile value through shared memory, which
        # must happen before this dot stages its operands there
        acc_op, acc_val, frag_in = self._frag_acc_in(op, g)
        KP = k + 8
        was_live = self._async_live
        self._async_ahead_now = 0
        offs_a, offb, offc = self._stage_mma_operands(plan)
        # (a prefetch-2 chain's head: the next dot still reads an async buffer)
        last = was_live and not self._async_issued and g["fused"] and not self._async_ahead_now
        if last:
            # the last dot on async buffers (after their loop: every copy waited for): shared memory claimed
            # from here on may overlap them (its C tile, after a barrier: these MMAs read them)
            self._async_live = False
            offc = 0
        ctx = self._mma_ctx(plan, g, KP, offs_a, offb)
        if g["fused"]:
            # every warp has per_warp units: one K loop for all of them, no branches
            us = self._warp_units(ctx, g)
            regs = ctx.run_units(us, frag_in.regs if frag_in is not None else None)
            if (acc_op is None or frag_in is not None) and self._keep_frag(op.result, g["key"]):
                # the accumulator stays in the MMA registers (a loop-carried acc, or the acc of the next dot);
                # a tile-valued acc operand is added after the read-back below instead
                return MmaAcc(g["key"], regs, plan)
            if last:
                self.barrier()
            self._claim(offc, g["csize"])
            ctx.store_units(us, regs, offc)
        else:
            self._claim(offc, g["csize"])
            for i in range(g["per_warp"]):
                q = self.val(f"add i32 {ctx.warp}, {i * self.num_warps}", "i32", 0)
                yes, done = self.label("mma_tile"), self.label("mma_done")
                ok = self.val(f"icmp ult i32 {q.ref}, {g['units']}", "i1", 0)
                self.emit(f"br i1 {ok.ref}, label %{yes}, label %{done}")   # warp-uniform: no barrier inside
                self.start_block(yes)
                u = ctx.setup(q.ref)
                ctx.store_units([u], ctx.run_units([u], None), offc)
                self.emit(f"br label %{done}")
                self.start_block(done)
        self.barrier()
        return self._add_tile_acc(ctx.read_back(offc), acc_op, acc_val, frag_in, (m, n))

    def _frag_acc_in(self, op, g):
        """(acc operand, its value, the MmaAcc to start from or None): an accumulator in registers of another
        layout becomes a tile value first."""
        acc_op = op.operands[2] if len(op.operands) > 2 and op.operands[2] is not None else None
        acc_val = self.vals.get(acc_op.id) if acc_op is not None else None
        if isinstance(acc_val, FragV):
            acc_val = self._frag_materialise(acc_val)
        frag_in = None
        if isinstance(acc_val, MmaAcc):
            if acc_val.key == g["key"]:
                frag_in = acc_val
            else:
                self.vals[acc_op.id] = acc_val = self._materialise(acc_val)
        return acc_op, acc_val, frag_in

    def _add_tile_acc(self, out: LV, acc_op, acc_val, frag_in, oshape) -> LV:
        if acc_op is not None and frag_in is None:
            R = self.lanes(oshape)
            init = acc_val if acc_val.n else self.splat(acc_val, R, oshape)
            init = self._to_acc(init, acc_op.type.elem, ir.f32)
            out = self.val(f"fadd {out.ty} {out.ref}, {init.ref}", "float", R, oshape)
        return out

    def _a_parts(self, a: LV, plan) -> list:
        """The dot's A operand as its 16-bit MMA parts: [a] as it is, or f32 split into hi + lo."""
        d16 = plan["kind"]
        if plan["split"] and d16 == ir.bf16:
            # hi = x's top 16 bits (truncation: a shift and a mask, no rounding sequence), lo = x - hi exactly
            # in f32, rounded to bf16: ~16 significant bits of x in two bf16 parts
            n_, sh_ = a.n, a.shape
            i32t = vty("i32", n_)
            bits = self.val(f"bitcast {a.ty} {a.ref} to {i32t}", "i32", n_, sh_)
            top = self.val(f"and {i32t} {bits.ref}, {self.const(-65536, 'i32', n_, sh_).ref}", "i32", n_, sh_)
            hs = self.val(f"lshr {i32t} {bits.ref}, {self.const(16, 'i32', n_, sh_).ref}", "i32", n_, sh_)
            hi = self.val(f"trunc {i32t} {hs.ref} to {vty('i16', n_)}", "i16", n_, sh_)
            topf = self.val(f"bitcast {i32t} {top.ref} to {a.ty}", "float", n_, sh_)
            rest = self.val(f"fsub {a.ty} {a.ref}, {topf.ref}", "float", n_, sh_)
            lo = self.hooks.round_bf16(self, rest)
            parts = [hi, lo if lo is not None else self.from_f32(rest, d16)]
        elif plan["split"]:
            hi = self.from_f32(a, d16)
            rest = self.val(f"fsub {a.ty} {a.ref}, {self.to_f32(hi, d16).ref}", "float", a.n, a.shape)
            parts = [hi, self.from_f32(rest, d16)]
        else:
            parts = [a]
        return parts

    # ------------------------------------------------------- hook points of target-specific matrix paths
    # A target with warpgroup MMAs or asynchronous operand copies overrides these in a mixin of its lowering
    # (backends/nvidia/: NvptxLowering); here every dot runs on the warp-level MMAs with operands staged from
    # registers, and no tile is copied asynchronously.
    def _wg_fits(self, plan) -> bool:
        """Whether a planned dot runs as warpgroup MMAs (_dot_wg)."""
        return False

    def _wg_swizzled(self) -> bool:
        """Whether this kernel stages its warpgroup-MMA operands swizzled (1024-byte aligned atoms)."""
        return False

    def _dot_wg(self, op, plan) -> LV:
        raise CompilationError(f"internal: no warpgroup MMAs on {self.target.name}")

    def _materialise_wg(self, acc: "MmaAcc", plan, g) -> LV:
        raise CompilationError(f"internal: no warpgroup MMAs on {self.target.name}")

    def _wg_sum_analysis(self) -> None:
        """Sums of warpgroup-MMA accumulators kept in their registers (_wg_sums, _wg_sum_slots): none here."""

    def _async_analysis(self) -> None:
        """K-loop slots whose tiles an asynchronous copy brings (AsyncTile, _async_loads): none here."""

    def _staging_entry(self) -> None:
        """Set-up at the kernel's entry for the asynchronous copies (after the parameters)."""

    def _staging_layout_end(self) -> None:
        """Places what the asynchronous copies keep above the rest of shared memory, once it is laid out."""

    def _loop_step_end(self) -> None:
        """At the end of a loop step's body: copies of the step still to issue."""

    def _tile_read_back(self, offc, oshape) -> LV:
        m, n = oshape
        idx = self.umin(self.flat_index(oshape), m * n - 1)
        return self.smem_read("float", offc, idx, oshape)

    def _mma_geometry(self, plan) -> dict:
        """How a planned dot's 16x8 output tiles are dealt to warps (round-robin; each runs all K steps, so
        an element's sum order is the same for every tile shape: kernels such as decode vs prefill attention
        rely on equal bits from two shapes; splitting K over idle warps was tried and broke that). `key`
        (fused layouts only: every warp has per_warp units) names the accumulator register layout two dots
        must share to pass an accumulator in registers."""
        m, n, k = plan["m"], plan["n"], plan["k"]
        nparts = 2 if plan["split"] else 1
        if plan["wg"]:
            # warpgroup w takes weight-row blocks w * per_wg .. (64 rows each); every thread holds m / 2
            # accumulators per block and part
            wgs = self.num_warps // 4
            per_wg = n // 64 // wgs
            return dict(m=m, n=n, ksteps=k // 16, nparts=nparts, wgs=wgs, per_wg=per_wg, fused=True,
                        csize=m * n * 4, nregs=per_wg * nparts * (m // 2),
                        key=("wg", m, n, nparts, self.num_warps))
        MS, NS, KS = self.hooks.mma_shape
        W = self.num_warps
        units = (m // MS) * (n // NS)
        fused = units % W == 0
        per_warp = -(-units // W)
        # warp-owned rows (kernels launched with `warp_rows`, targets with lane shuffles): every row of the output
        # lives in the warp(s) that own its row of tiles (units numbered row-major), so row reductions and
        # broadcasts stay in registers (FragmentOps: row values). Modes: "block", warp w takes units
        # w * per_warp .. (whole rows of tiles: at least as many rows of tiles as warps); with fewer rows of tiles
        # than warps, `rep` warps share one: "rep", each computes the whole row of tiles (a dot without
        # accumulator: the scores, which are row-reduced, so every warp of the row has them all), or "split",
        # each takes an equal share of its columns (a dot into an accumulator: P @ V, whose alpha and P come from
        # the replicated scores). Per output element the MMA chain is the same in every mode.
        TM, NT = m // MS, n // NS
        mode, rep = None, 1
        if nparts == 1 and self._warp_rows_on():
            if TM % W == 0:
                mode = "block"
            elif W % TM == 0:
                rep = W // TM
                if not plan.get("acc"):
                    mode, per_warp, fused = "rep", NT, True
                elif NT % rep == 0:
                    mode, per_warp, fused = "split", NT // rep, True
        key = None
        if fused:
            key = (m, n, nparts, W, "rows", mode) if mode else (m, n, nparts, W)
        return dict(m=m, n=n, ksteps=k // KS, units=units, nparts=nparts, per_warp=per_warp, fused=fused,
                    csize=m * n * 4, rows=mode, rep=rep, key=key)

    def _warp_rows_on(self) -> bool:
        return bool(self.fn.constexprs.get("warp_rows")) and self.hooks.has_shuffle

    def _warp_units(self, ctx, g) -> list:
        """The work units (16x8 output tiles) of this thread's warp, set up (ctx.setup): round-robin
        (warp + i * num_warps), or with warp-owned rows the block warp * per_warp + i."""
        mode = g.get("rows")
        if mode:
            NT = g["n"] // self.hooks.mma_shape[1]
            if mode == "block":
                w0 = self.val(f"mul i32 {ctx.warp}, {g['per_warp']}", "i32", 0).ref
            else:
                # (warp // rep) * NT, + (warp % rep) * per_warp when the row's columns are split
                r = self.val(f"udiv i32 {ctx.warp}, {g['rep']}", "i32", 0).ref
                w0 = self.val(f"mul i32 {r}, {NT}", "i32", 0).ref
                if mode == "split":
                    c = self.val(f"urem i32 {ctx.warp}, {g['rep']}", "i32", 0).ref
                    c = self.val(f"mul i32 {c}, {g['per_warp']}", "i32", 0).ref
                    w0 = self.val(f"add i32 {w0}, {c}", "i32", 0).ref
            return [ctx.setup(self.val(f"add i32 {w0}, {i}", "i32", 0).ref) for i in range(g["per_warp"])]
        return [ctx.setup(self.val(f"add i32 {ctx.warp}, {i * self.num_warps}", "i32", 0).ref)
                for i in range(g["per_warp"])]

    def _keep_frag(self, v, key, to_dots=False) -> bool:
        """Whether every use of v takes an MMA accumulator in registers of layout `key`: the yield of a loop
        slot carried in registers, or (to_dots: for a loop's result) the acc operand of a planned dot of the
        same layout. A dot's result handed straight to another dot stays a tile value: kernels that must
        give the same bits with two tile shapes (decode vs prefill attention, whose layouts may differ in
        being fused) then add accumulators the same way whatever the layout. Except into a warpgroup MMA
        (kernels opt into wgmma as a whole: the linear, whose every tile chains its K steps in the
        accumulator registers, so a dot feeding the next one's acc - the prefetch-2 K loop's last two steps -
        must chain the same way to give PREFETCH 1's bits)."""
        users = self.users.get(v.id, [])
        if key is None or not users:
            return False
        for u, idx in users:
            if u.name == "dot" and idx == 2 and id(u) in self.mma_plans \
                    and (to_dots or self.mma_plans[id(u)]["wg"]) \
                    and self._mma_geometry(self.mma_plans[id(u)])["key"] == key:
                continue
            if self._frag_yields.get((id(u), idx)) == key:
                continue
            if self._wg_sums.get(id(u)) == key:
                continue
            return False
        return True

    def op_dp4a(self, op):
        a, b, c = (self.get(o) for o in op.operands)
        r = self.hooks.dp4a(self, a, b, c, op.attrs["a_signed"], op.attrs["b_signed"])
        return r if r is not None else self.dp4a(a, b, c, op.attrs["a_signed"], op.attrs["b_signed"])

    def _materialise(self, acc: "MmaAcc") -> LV:
        """An accumulator held in MMA registers as the tile layout's value (through shared memory)."""
        plan = acc.plan
        g = self._mma_geometry(plan)
        if plan["wg"]:
            return self._materialise_wg(acc, plan, g)
        ctx = self._mma_ctx(plan, g, plan["k"] + 8, None, None)
        self.barrier()
        self._claim(0, g["csize"])
        us = self._warp_units(ctx, g)
        ctx.store_units(us, acc.regs, 0)
        self.barrier()
        return ctx.read_back(0)

    def _mma_ctx(self, plan, g, KP, offs_a, offb):
        """The per-warp pieces of a dot on the matrix units (see _dot_mma_plan): unit setup, the K loop,
        the C stores and the read-back, as closures over this lowering."""
        low = self
        MS, NS, KS = self.hooks.mma_shape
        m, n = plan["m"], plan["n"]
        kind = "bf16" if plan["kind"] == ir.bf16 else "f16"
        ksteps = g["ksteps"]
        nparts = g["nparts"]
        oshape = (m, n)
        a3 = self.hooks.smem_as
        ws = self.target.warp_size
        warp = self.val(f"udiv i32 {self.tid}, {ws}", "i32", 0)
        lane = self.val(f"urem i32 {self.tid}, {ws}", "i32", 0)
        lay = self.hooks.mma_layout(_LaneExpr(self, lane.ref), kind)
        # ldmatrix (NVIDIA m16n8k16): a unit's A fragments of a K step in one instruction (4 matrices), its B
        # fragments in one (2), at the rows / k offsets ldmatrix_lanes gives each lane, instead of 6 loads;
        # each lane then holds exactly the registers mma_layout names (tests/test_gpu_registers.py models
        # both). Rows are 16-byte aligned: KP = k + 8 elements with k % 16 == 0, regions at 16-byte offsets
        ldm = (self.tuning.ldmatrix and (MS, NS, KS) == (16, 8, 16) and lay["a_ty"] == "i32" and lay["b_ty"] == "i32"
               and KP % 8 == 0 and all(o is None or isinstance(o, str) or o % 16 == 0
                                       for o in list(offs_a or []) + ([offb] if offb is not None else []))
               and self.hooks.has_ldmatrix)
        if ldm:
            la = self.hooks.ldmatrix_lanes(_LaneExpr(self, lane.ref))
            la_row, la_k = (x.value() for x in la["a"])
            lb_row, lb_k = (x.value() for x in la["b"])
        # B staged as (k, n) rows of NP (_b_trans): ldmatrix .trans, lanes 0-15 addressing k rows 0-15 of the
        # step at the unit's 8 columns; lane (g, t) then holds B[2t, 2t + 1][g] and B[2t + 8, 2t + 9][g] (b0, b1)
        bt = self._b_trans(plan)
        NP = n + 8
        # a dot whose A is pinned (staged once before its loop: the flash kernels' scores, q @ k^T over the head
        # dimension) has its K loop unrolled up to PINNED_MMA_UNROLL steps, so its fragment loads issue ahead of the
        # MMAs that wait on them (H200: the not unrolled loop's MMAs waited on each step's ldmatrix; same MMAs in the
        # same order). Other dots (the linear's K loops, at up to 255 registers) keep the target's choice.
        unroll_pinned = ksteps if (self._pinned.get(plan["a"].id) is not None and ksteps <= PINNED_MMA_UNROLL) \
            else None
        if bt and not ldm:
            raise CompilationError(f"internal: a (k, n) MMA operand staged for ldmatrix .trans but the fragment loads "
                                   f"cannot use ldmatrix (regions {offs_a!r}, {offb!r}); compile with "
                                   f"tuning.ldmatrix_trans off")

        def coords(regs):        # per register: (symbolic ref or None, constant) of each coordinate
            return [_sym(x) for x, _ in regs], [_sym(y) for _, y in regs]
        a_rows, a_ks = coords(lay["a"])
        b_cols, b_ks = coords(lay["b"])
        c_rows, c_cols = coords(lay["c"])
        nc = len(c_rows)

        def add(x, y):
            return low.val(f"add i32 {x}, {y}", "i32", 0).ref

        def mul(x, c):
            return low.val(f"mul i32 {x}, {c}", "i32", 0).ref

        def ld(byte_off_region, elem_idx, ty, elems, const=0, cache=None):
            """A fragment register at element elem_idx (+ the constant `const`) of a staged region: the
            symbolic address is shared (cache) and the constant goes into the load's immediate offset, so
            a warp's fragment loads of a K step use a few base registers (not one address register each)."""
            key = (byte_off_region, elem_idx)
            p = cache.get(key) if cache is not None else None
            if p is None:
                eb = add(mul(elem_idx, 2), byte_off_region)
                p = low.val(f"getelementptr i8, ptr addrspace({a3}) @__jk_smem, i32 {eb}", "ptr", 0).ref
                if cache is not None:
                    cache[key] = p
            if const:
                p = low.val(f"getelementptr i8, ptr addrspace({a3}) {p}, i32 {2 * const}", "ptr", 0).ref
            return low.val(f"load {ty}, ptr addrspace({a3}) {p}, align {min(16, 2 * elems)}", ty, 0).ref

        def ldmx(byte_off_region, elem_idx, count, cache, trans=False):
            """`count` fragment registers by one ldmatrix (.trans) at element elem_idx of a staged region (cached
            per address within a K step: units that share a tile row or column share the instruction)."""
            key = ("ldm", byte_off_region, elem_idx, count, trans)
            if key not in cache:
                eb = add(mul(elem_idx, 2), byte_off_region)
                p = low.val(f"getelementptr i8, ptr addrspace({a3}) @__jk_smem, i32 {eb}", "ptr", 0).ref
                cache[key] = low.hooks.ldmatrix(low, p, count, trans=True) if trans else \
                    low.hooks.ldmatrix(low, p, count)
            return cache[key]

        def bases(crds, origin, cache):
            """tile origin + each distinct symbolic part (one add each; constants are added per register)."""
            for ref, _ in crds:
                if ref not in cache:
                    cache[ref] = origin() if ref is None else add(origin(), ref)
            return cache

        class Ctx:
            pass
        ctx = Ctx()
        ctx.warp = warp.ref

        def setup(u):
            """Tile origin and fragment row offsets of work unit (= tile) q (an i32 ref)."""
            q = u
            # one row of tiles (decode: BM = 16): the row origin is the constant 0, so every unit's A
            # fragments are the same loads (shared in the K loop below)
            mi = LV("0", "i32", 0) if m == MS else low.val(f"udiv i32 {q}, {n // NS}", "i32", 0)
            ni = low.val(f"urem i32 {q}, {n // NS}", "i32", 0)
            rows, cols = {}, {}                             # tile row / column bases per symbolic part
            bases(a_rows, lambda: mul(mi.ref, MS), rows)
            bases(b_cols, lambda: mul(ni.ref, NS), cols)
            bases(c_cols, lambda: mul(ni.ref, NS), cols)
            bases(c_rows, lambda: mul(mi.ref, MS), rows)
            roff = {}               # element offset of each symbolic row part (x KP); constants go to ld
            if offs_a is not None:
                for (ref, c) in a_rows:
                    if ("a", ref) not in roff:
                        roff[("a", ref)] = mul(rows[ref], KP)
                for (ref, c) in b_cols:
                    if ("b", ref) not in roff:
                        roff[("b", ref)] = mul(cols[ref], KP)
            u = dict(rows=rows, cols=cols, roff=roff)
            if ldm and offs_a is not None:
                u["lda"] = add(mul(add(mul(mi.ref, MS), la_row), KP), la_k)
                u["ldb"] = add(mul(la_row, NP), mul(ni.ref, NS)) if bt else \
                    add(mul(add(mul(ni.ref, NS), lb_row), KP), lb_k)
            return u

        def run_units(us, init, a_regs=None):
            """One K loop for the units `us` together: hi and lo parts (and the units) accumulate into
            separate registers, so a warp has independent MMA chains in flight rather than one serial chain.
            Registers: [unit][part][c register], from `init` (the same layout) or zero. a_regs: A's fragments
            already in registers, fn(unit index, k step) -> refs (warp-owned rows: P from the score
            registers); the K steps are then unrolled here (the step picks registers)."""
            start = [LV(r, "float", 0) for r in init] if init is not None else \
                [LV("0.0", "float", 0)] * (nc * nparts * len(us))

            def kstep(iv, cur, kk=None):
                out = []
                shared_a = {}        # part -> A fragments, when every unit reads the same ones
                for ui, u in enumerate(us):
                    it = iv
                    same_row = m == MS or g.get("rows") in ("rep", "split") or \
                        (g.get("rows") == "block" and g["per_warp"] == n // NS)
                    kb = {}
                    for ref, _ in b_ks + a_ks:              # k of each register: step * KS + its lane part
                        if ref not in kb:
                            kb[ref] = mul(it, KS) if ref is None else add(mul(it, KS), ref)
                    sums, addrs = {}, {}

                    def elem(side, rr, kr):                 # symbolic row part x KP + symbolic k part
                        if (side, rr, kr) not in sums:
                            sums[(side, rr, kr)] = add(u["roff"][(side, rr)], kb[kr])
                        return sums[(side, rr, kr)]
                    if ldm:
                        kofs = mul(it, KS)
                        regs_b = ldmx(offb, add(u["ldb"], mul(it, KS * NP)), 2, addrs, True) if bt else \
                            ldmx(offb, add(u["ldb"], kofs), 2, addrs)
                    else:
                        regs_b = [ld(offb, elem("b", bc[0], kr), lay["b_ty"], lay["b_elems"], bc[1] * KP + kc,
                                     addrs) for bc, (kr, kc) in zip(b_cols, b_ks)]
                    for pi, pa in enumerate(offs_a):
                        if a_regs is not None:
                            regs_a = a_regs(ui, kk)
                        elif same_row and pi in shared_a:
                            regs_a = shared_a[pi]
                        elif ldm:
                            regs_a = ldmx(pa, add(u["lda"], kofs), 4, addrs)
                            shared_a[pi] = regs_a
                        else:
                            regs_a = [ld(pa, elem("a", ar[0], kr), lay["a_ty"], lay["a_elems"], ar[1] * KP + kc,
                                         addrs) for ar, (kr, kc) in zip(a_rows, a_ks)]
                            shared_a[pi] = regs_a
                        base = (ui * nparts + pi) * nc
                        out += low.hooks.mma(low, kind, regs_a, regs_b, [c.ref for c in cur[base:base + nc]])
                return [LV(o, "float", 0) for o in out]
            if a_regs is not None:
                cur = start
                for kk in range(ksteps):
                    cur = kstep(str(kk), cur, kk)
                return [r.ref for r in cur]
            return [r.ref for r in low.emit_loop(ksteps, start, kstep, unroll=self.tuning.mma_unroll or unroll_pinned
                                                      or low.hooks.mma_unroll)]

        def store_units(us, regs, offc):
            """Per register the parts summed in order (hi + lo), stored at its tile element."""
            base_c = low.smem_ptr(offc)
            for ui, u in enumerate(us):
                for j, ((rr, rc), (cr, cc)) in enumerate(zip(c_rows, c_cols)):
                    base = ui * nparts * nc
                    v = regs[base + j]
                    for pi in range(1, nparts):
                        v = low.val(f"fadd float {v}, {regs[base + pi * nc + j]}", "float", 0).ref
                    e = add(mul(add(u["rows"][rr], rc), n), add(u["cols"][cr], cc))
                    ptr = low.val(f"getelementptr float, ptr addrspace({a3}) {base_c}, i32 {e}", "ptr", 0)
                    low.emit(f"store float {v}, ptr addrspace({a3}) {ptr.ref}, align 4")

        def read_back(offc):
            """The tile layout's values."""
            idx = low.umin(low.flat_index(oshape), m * n - 1)
            return low.smem_read("float", offc, idx, oshape)

        def flat_units(us):
            """Per unit and C register (store_units' order): the flat (m, n) index of its element."""
            return [add(mul(add(u["rows"][rr], rc), n), add(u["cols"][cr], cc))
                    for u in us for (rr, rc), (cr, cc) in zip(c_rows, c_cols)]

        def a_frags(us):
            """Per unit, per K step: the A fragment registers by ldmatrix (a single A part), all issued here
            (tuning.pin_regs: before the loop of a dot with a pinned A; units sharing a row share the loads)."""
            cache = {}
            return [[ldmx(offs_a[0], add(u["lda"], mul(str(kk), KS)), 4, cache) for kk in range(ksteps)]
                    for u in us]

        ctx.setup, ctx.run_units, ctx.store_units, ctx.read_back = setup, run_units, store_units, read_back
        ctx.a_frags, ctx.ldm = a_frags, ldm
        ctx.flat_units = flat_units
        return ctx

    def _int_products(self, a_et_signed: bool, av: LV, bv: LV, b_signed=True, wide="i32") -> LV:
        wa = self.val(f"{'sext' if a_et_signed else 'zext'} {av.ty} {av.ref} to {vty(wide, av.n)}", wide, av.n)
        wb = self.val(f"{'sext' if b_signed else 'zext'} {bv.ty} {bv.ref} to {vty(wide, bv.n)}", wide, bv.n)
        return self.val(f"mul {wa.ty} {wa.ref}, {wb.ref}", wide, av.n)

    def op_dot4(self, op):
        """Exact i32 sums of products of groups of 4 (and over `axis`): no int16 intermediate on GPUs."""
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        ad = op.operands[0].type.elem
        shape = op.operands[0].type.shape
        oshape = op.result.type.shape
        ax = op.attrs.get("axis")
        R = self.lanes(oshape)
        self.barrier()
        offb = self.smem_write(a, 0)
        self.smem_write(b, offb)
        self.barrier()
        o = self.umin(self.flat_index(oshape), _prod(oshape) - 1)
        if ax is None:
            starts = [self.ibin("mul", o, 4)]
        else:
            nax = shape[ax]
            post = _prod(shape[ax + 1:])             # elements per slice (includes the K axis)
            q4 = post // 4
            p_ = self.ibin("udiv", o, q4) if q4 > 1 else o
            r4 = self.ibin("urem", o, q4) if q4 > 1 else self.iconst(0, R)
            b0 = self.ibin("add", self.ibin("mul", p_, nax * post), self.ibin("mul", r4, 4))
            starts = [self.ibin("add", b0, j * post) if j else b0 for j in range(nax)]
        acc = None
        for s in starts:
            for g in range(4):
                i = self.ibin("add", s, g) if g else s
                av = self.smem_read("i8", 0, i, ())
                bv = self.smem_read("i8", offb, i, ())
                pr = self._int_products(ad.is_signed, LV(av.ref, "i8", R), LV(bv.ref, "i8", R))
                acc = pr if acc is None else self.val(f"add {pr.ty} {acc.ref}, {pr.ref}", "i32", R)
        return LV(acc.ref, "i32", R, oshape)

    def op_madd(self, op):
        """Pair sums of products with the CPU's exact semantics: u8 x i8 -> i16 saturated, i16 x i16 -> i32."""
        a, b = self.get(op.operands[0]), self.get(op.operands[1])
        wide = op.operands[0].type.elem == ir.i16
        oshape = op.result.type.shape
        R = self.lanes(oshape)
        et, rt = ("i16", "i32") if wide else ("i8", "i16")
        self.barrier()
        offb = self.smem_write(a, 0)
        self.smem_write(b, offb)
        self.barrier()
        o2 = self.ibin("mul", self.umin(self.flat_index(oshape), _prod(oshape) - 1), 2)
        prods = []
        for g in range(2):
            i = self.ibin("add", o2, g) if g else o2
            av = LV(self.smem_read(et, 0, i, ()).ref, et, R)
            bv = LV(self.smem_read(et, offb, i, ()).ref, et, R)
            prods.append(self._int_products(wide, av, bv, wide=rt))
        if wide:
            res = self.val(f"add {prods[0].ty} {prods[0].ref}, {prods[1].ref}", rt, R)
        else:
            name = f"llvm.sadd.sat.{self.sfx(prods[0])}"
            self.declare(name, prods[0].ty, [prods[0].ty] * 2)
            res = self.val(f"call {prods[0].ty} @{name}({prods[0].ty} {prods[0].ref}, {prods[1].ty} "
                           f"{prods[1].ref})", rt, R)
        return LV(res.ref, rt, R, oshape)

    # ----------------------------------------------------------------------------------------- math
    def _has_fast_exp(self) -> bool:
        return bool(getattr(self.hooks, "has_fast_exp", False)) and self.tuning.fast_exp

    def math_call(self, name: str, x: LV) -> LV:
        hooked = self.hooks.math(self, name, x)
        if hooked is not None:
            return hooked
        if name in ("log", "log2") and x.et == "float":
            y = self.logf(x)
            return y if name == "log" else self.fbin("fmul", y, self.fconst(1.0 / math.log(2.0), x))
        return super().math_call(name, x)

    def logf(self, x: LV) -> LV:
        """logf by Cephes' method: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-8 polynomial in m - 1
        (max rel. error ~2 ulp); log(0) = -inf, log(<0) = NaN, log(inf) = inf, NaN passes through."""
        ty, n, sh = x.ty, x.n, x.shape
        c = lambda v: self.fconst(v, x)  # noqa: E731
        it = vty("i32", n)
        ci = lambda v: self.const(v, "i32", n, sh)  # noqa: E731
        # subnormals: scale by 2^23 first
        sub = self.val(f"fcmp olt {ty} {x.ref}, {c(1.17549435e-38).ref}", "i1", n, sh)
        xs = self.val(f"select {sub.ty} {sub.ref}, {ty} {self.fbin('fmul', x, c(8388608.0)).ref}, {ty} {x.ref}",
                      x.et, n, sh)
        eadj = self.val(f"select {sub.ty} {sub.ref}, {it} {ci(-23).ref}, {it} {ci(0).ref}", "i32", n, sh)
        bits = self.val(f"bitcast {ty} {xs.ref} to {it}", "i32", n, sh)
        e = self.val(f"lshr {it} {bits.ref}, {ci(23).ref}", "i32", n, sh)
        e = self.val(f"sub {it} {e.ref}, {ci(126).ref}", "i32", n, sh)
        e = self.val(f"add {it} {e.ref}, {eadj.ref}", "i32", n, sh)
        mb = self.val(f"and {it} {bits.ref}, {ci(0x807fffff).ref}", "i32", n, sh)
        mb = self.val(f"or {it} {mb.ref}, {ci(0x3f000000).ref}", "i32", n, sh)     # m in [0.5, 1)
        m = self.val(f"bitcast {it} {mb.ref} to {ty}", x.et, n, sh)
        small = self.val(f"fcmp olt {ty} {m.ref}, {c(0.707106781186547524).ref}", "i1", n, sh)
        e1 = self.val(f"sub {it} {e.ref}, {ci(1).ref}", "i32", n, sh)
        e = self.val(f"select {small.ty} {small.ref}, {it} {e1.ref}, {it} {e.ref}", "i32", n, sh)
        m2 = self.fbin("fadd", m, m)
        m = self.val(f"select {small.ty} {small.ref}, {ty} {m2.ref}, {ty} {m.ref}", x.et, n, sh)
        f = self.fbin("fsub", m, c(1.0))
        p = c(7.0376836292E-2)
        for coef in (-1.1514610310E-1, 1.1676998740E-1, -1.2420140846E-1, 1.4249322787E-1, -1.6668057665E-1,
                     2.0000714765E-1, -2.4999993993E-1, 3.3333331174E-1):
            p = self.fmuladd(p, f, c(coef))
        z = self.fbin("fmul", f, f)
        y = self.fbin("fmul", self.fbin("fmul", p, f), z)
        ef = self.val(f"sitofp {it} {e.ref} to {ty}", x.et, n, sh)
        y = self.fmuladd(ef, c(-2.12194440e-4), y)
        y = self.fmuladd(z, c(-0.5), y)
        r = self.fbin("fadd", f, y)
        r = self.fmuladd(ef, c(0.693359375), r)
        zero = self.val(f"fcmp oeq {ty} {x.ref}, {c(0.0).ref}", "i1", n, sh)
        r = self.val(f"select {zero.ty} {zero.ref}, {ty} {self.const(-math.inf, x.et, n, sh).ref}, {ty} {r.ref}",
                     x.et, n, sh)
        neg = self.val(f"fcmp ult {ty} {x.ref}, {c(0.0).ref}", "i1", n, sh)       # also NaN
        r = self.val(f"select {neg.ty} {neg.ref}, {ty} {self.const(math.nan, x.et, n, sh).ref}, {ty} {r.ref}",
                     x.et, n, sh)
        inf = self.val(f"fcmp oeq {ty} {x.ref}, {self.const(math.inf, x.et, n, sh).ref}", "i1", n, sh)
        return self.val(f"select {inf.ty} {inf.ref}, {ty} {x.ref}, {ty} {r.ref}", x.et, n, sh)
