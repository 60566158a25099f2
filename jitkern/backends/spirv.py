"""SPIR-V for Vulkan: the Vulkan hooks of the shared GPU lowering.

LLVM 22's SPIR-V backend with a vulkan triple (facts in ../shared/notes/feasibility-codegen.md, section 1)
emits Vulkan compute shaders under the *logical* addressing model: no pointer kernel parameters, no pointer
casts, no vectors of pointers. Buffers come in through resource intrinsics (`llvm.spv.resource.*`), the
entry point is a `void()` function with `"hlsl.shader"="compute"` and `"hlsl.numthreads"`. So this target
replaces the lowering's memory access (pointer parameters + GEPs + masked gathers/scatters) with:

- the argument ABI of the CPU and CUDA: binding 0 is a storage buffer of 8-byte slots (grid sizes, then one
  slot per kernel parameter: ints as i64, floats as f64 bits, and for a pointer parameter its *element*
  offset inside its buffer); pointer parameter k is storage buffer binding 1 + k of the element type the
  kernel reads it as (descriptor set 0). Two parameters may be bound to the same buffer (aliasing is legal
  in Vulkan); a buffer of one element type is never reinterpreted inside a kernel (the DSL has no pointer
  casts: host code views one allocation as two dtypes through two parameters);
- per-lane scalar accesses: each lane of a tile access is one `OpAccessChain` + load/store, guarded by its
  mask bit (branches the backend structurizes), since SPIR-V has no gathers;
- shared memory as one Workgroup array per element type (logical addressing cannot reinterpret bytes): a
  region at byte offset `off` of element type `et` is the elements from off / sizeof(et) on in the `et`
  array, whose length is only known once the kernel is lowered (placeholders replaced in `smem_decl`);
- `llvm.spv.group.memory.barrier.with.group.sync` as the barrier (OpControlBarrier, workgroup scope), and
  thread / workgroup ids from `llvm.spv.thread.id.in.group` / `llvm.spv.group.id`.

The data layout and triple come from the target (targets/registry.py: `vulkan`, SPIR-V 1.5 / Vulkan 1.2).
Launch metadata: threads per workgroup, shared bytes, the slot count and the pointer parameters' bindings.
"""
from __future__ import annotations

import re

from ..errors import CompileError
from ..language import CompilationError
from .base import GpuBackend
from .emitter import LV, elem_ty, vty
from .gpu import _ES, GpuHooks, GpuLowering
from .scalarize import scalarize

_SFX = {"float": "f32", "double": "f64", "i8": "i8", "i16": "i16", "i32": "i32", "i64": "i64"}
_PLACEHOLDER = "__JK_SMEM_LEN_{}__"


def _buf_ty(st: str) -> str:
    return f'target("spirv.VulkanBuffer", [0 x {st}], 12, 1)'


class SpirvHooks(GpuHooks):
    smem_as = 3
    smem_index = "i32"

    def __init__(self, target):
        self.target = target
        self.max_smem_bytes = target.shared_mem_bytes or 16 * 1024
        self.smem_len: dict = {}          # element type -> end (in elements, from byte 0) of its Workgroup array
        self.smem_base: dict = {}         # element type -> lowest byte offset it serves
        self.names: list = []             # module-level resource-name strings
        self.handles: dict = {}           # param index -> (handle ref, storage type)
        self.bases: dict = {}             # param index -> i32 ref of its element offset
        self.bindings: list = []          # (param index, binding, storage element type)
        self.slots = 0

    # ------------------------------------------------------------------------------- module, entry
    def module_header(self, low) -> list:
        return [f'target datalayout = "{self.target.data_layout}"', f'target triple = "{self.target.triple}"']

    def kernel_signature(self, low, name, params) -> str:
        return f"define void @{name}() #0"

    def function_attrs(self, low) -> list:
        return [f'"hlsl.numthreads"="{low.T},1,1"', '"hlsl.shader"="compute"']

    def _name(self, text: str) -> str:
        ref = f"@.jk.res.{len(self.names)}"
        self.names.append(f'{ref} = private unnamed_addr constant [{len(text) + 1} x i8] c"{text}\\00", align 1')
        return ref

    def _handle(self, low, binding: int, st: str, label: str, ref=None) -> str:
        bt = _buf_ty(st)
        name = f"llvm.spv.resource.handlefrombinding.tspirv.VulkanBuffer_a0{_SFX[st]}_12_1t"
        low.declare(name, bt, ["i32", "i32", "i32", "i32", "ptr"])
        ref = ref or f"%jk.h{binding}"
        low.emit(f"{ref} = call {bt} @{name}(i32 0, i32 {binding}, i32 1, i32 0, ptr {self._name(label)})")
        return ref

    def _elem_ptr(self, low, handle: str, st: str, idx: str) -> str:
        bt = _buf_ty(st)
        name = f"llvm.spv.resource.getpointer.p11.tspirv.VulkanBuffer_a0{_SFX[st]}_12_1t"
        low.declare(name, "ptr addrspace(11)", [bt, "i32"])
        return low.val(f"call ptr addrspace(11) @{name}({bt} {handle}, i32 {idx})", "ptr", 0).ref

    def _slot(self, low, k: int, st="i64") -> str:
        p = self._elem_ptr(low, "%jk.h0" if st == "i64" else "%jk.h0f", st, str(k))
        return low.val(f"load {st}, ptr addrspace(11) {p}, align 8", st, 0).ref

    def entry(self, low) -> None:
        params = low.fn.params
        self.slots = 3 + len(params)
        self._handle(low, 0, "i64", "jk_args")
        if any(not prm.type.is_ptr and prm.type.elem.is_float for prm in params):
            # float slots through a second, f64-typed view of binding 0: a load of i64 bitcast to double
            # would be folded into a double load through an i64 pointer, which logical SPIR-V cannot express
            self._handle(low, 0, "double", "jk_fargs", ref="%jk.h0f")
        for k, prm in enumerate(params):
            t = prm.type
            if not t.is_ptr and t.elem.is_float:
                low.emit(f"%arg{k} = fadd double {self._slot(low, 3 + k, 'double')}, -0.0")
                continue
            s = self._slot(low, 3 + k)
            if t.is_ptr:
                st = self._st(elem_ty(t.elem.elem))
                h = self._handle(low, 1 + k, st, f"jk_arg{k}")
                self.handles[k] = (h, st)
                self.bindings.append((k, 1 + k, st))
                self.bases[k] = low.val(f"trunc i64 {s} to i32", "i32", 0).ref
            else:
                low.emit(f"%arg{k} = add i64 {s}, 0")

    @staticmethod
    def _st(et: str) -> str:
        return "i8" if et == "i1" else et

    # ----------------------------------------------------------------------------------- ids, sync
    def thread_id(self, low) -> str:
        low.declare("llvm.spv.thread.id.in.group.i32", "i32", ["i32"])
        return low.val("call i32 @llvm.spv.thread.id.in.group.i32(i32 0)", "i32", 0).ref

    def block_id(self, low, axis: int) -> str:
        low.declare("llvm.spv.group.id.i32", "i32", ["i32"])
        return low.val(f"call i32 @llvm.spv.group.id.i32(i32 {axis})", "i32", 0).ref

    def num_blocks(self, low, axis: int) -> str:
        return low.val(f"trunc i64 {self._slot(low, axis)} to i32", "i32", 0).ref

    def barrier(self, low) -> None:
        low.declare("llvm.spv.group.memory.barrier.with.group.sync", "void", [])
        low.emit("call void @llvm.spv.group.memory.barrier.with.group.sync()")

    # ------------------------------------------------------------------------------ global memory
    def _param_of(self, low, p) -> int:
        base = p.base
        if not base.startswith("%arg"):
            raise CompilationError(f"vulkan: a pointer that is not a kernel parameter ({base})")
        return int(base[4:])

    def _index(self, low, k: int, off) -> str:
        """i32 element index into parameter k's buffer: its base offset + off (None, or a scalar LV)."""
        b = self.bases[k]
        if off is None:
            return b
        o = off.ref
        if off.et == "i64":
            o = low.val(f"trunc i64 {o} to i32", "i32", 0).ref
        elif off.et in ("i8", "i16"):
            o = low.val(f"sext {off.et} {o} to i32", "i32", 0).ref
        return low.val(f"add i32 {b}, {o}", "i32", 0).ref

    def _lane(self, low, v, j):
        """Lane j of v (None stays None; a scalar is every lane)."""
        if v is None or v.n == 0:
            return v
        return low.extract(v, j)

    def _load1(self, low, k, et, off) -> LV:
        h, st = self.handles[k]
        p = self._elem_ptr(low, h, st, self._index(low, k, off))
        v = low.val(f"load {st}, ptr addrspace(11) {p}, align {_ES[st]}", st, 0)
        return low.val(f"trunc i8 {v.ref} to i1", "i1", 0) if et == "i1" else v

    def _store1(self, low, k, et, off, v: LV) -> None:
        h, st = self.handles[k]
        p = self._elem_ptr(low, h, st, self._index(low, k, off))
        ref = low.val(f"zext i1 {v.ref} to i8", "i8", 0).ref if et == "i1" else v.ref
        low.emit(f"store {st} {ref}, ptr addrspace(11) {p}, align {_ES[st]}")

    def _guarded(self, low, cond, fn, et=None, other=None):
        """fn() under `cond` (an i1 ref, or None for always); with et: the loaded value, or `other`."""
        if cond is None:
            return fn()
        yes, done = low.label("vk_m"), low.label("vk_m_done")
        pred = low.block
        low.emit(f"br i1 {cond}, label %{yes}, label %{done}")
        low.start_block(yes)
        v = fn()
        end = low.block
        low.emit(f"br label %{done}")
        low.start_block(done)
        if et is None:
            return None
        o = other if other is not None else ("0.0" if et in ("float", "double") else "false" if et == "i1" else "0")
        return low.val(f"phi {et} [ {v.ref}, %{end} ], [ {o}, %{pred} ]", et, 0)

    def load(self, low, p, shape, mask, other):
        k = self._param_of(low, p)
        et = elem_ty(p.elem)
        if not shape:
            m = mask.ref if mask is not None else None
            return self._guarded(low, m, lambda: self._load1(low, k, et, p.offs), et,
                                 other.ref if other is not None else None)
        R = low.lanes(shape)
        m = low._gpu_mask(shape, mask)
        parts = []
        for j in range(R):
            oj = self._lane(low, p.offs, j)
            mj = self._lane(low, m, j)
            ot = self._lane(low, other, j)
            parts.append(self._guarded(low, mj.ref if mj is not None else None,
                                       lambda oj=oj: self._load1(low, k, et, oj), et,
                                       ot.ref if ot is not None else None))
        return low.build_vector(parts, et, shape) if R > 1 else self._one(low, parts[0], shape)

    def _one(self, low, x: LV, shape) -> LV:
        r = low.val(f"insertelement <1 x {x.et}> poison, {x.et} {x.ref}, i32 0", x.et, 1, shape)
        return LV(r.ref, x.et, 1, tuple(shape))

    def store(self, low, p, v, shape, mask) -> bool:
        k = self._param_of(low, p)
        et = elem_ty(p.elem)
        if not shape:
            self._store1(low, k, et, p.offs, v)
            return True
        R = low.lanes(shape)
        m = low._gpu_mask(shape, mask)
        for j in range(R):
            oj = self._lane(low, p.offs, j)
            mj = self._lane(low, m, j)
            vj = low.extract(v, j)
            self._guarded(low, mj.ref if mj is not None else None,
                          lambda oj=oj, vj=vj: self._store1(low, k, et, oj, vj))
        return True

    # ------------------------------------------------------------------------------ shared memory
    def _smem_ptr(self, low, et: str, off: int, idx: str) -> str:
        es = _ES[et]
        if off % es:
            raise CompilationError(f"vulkan: shared region at byte {off} is not aligned for {et}")
        self.smem_len.setdefault(et, 1)
        self.smem_base[et] = min(self.smem_base.get(et, off), off)
        arr = f"[{_PLACEHOLDER.format(et)} x {et}]"
        # the element offset is relative to the lowest byte offset this array serves (known at the end)
        i = low.val(f"add i32 {idx}, __JK_SMEM_OFF_{et}_{off}__", "i32", 0).ref
        return low.val(f"getelementptr {arr}, ptr addrspace(3) @__jk_smem_{et}, i32 0, i32 {i}", "ptr", 0).ref

    # floats live in the integer array of their size (bitcast values): one array per element *size* keeps the
    # workgroup memory of kernels that mix f32 and i32 regions (top-k) within the byte layout's footprint
    _SMEM_ST = {"float": "i32", "double": "i64"}

    def smem_store(self, low, et, off, idx, v) -> bool:
        R = v.n
        st = self._SMEM_ST.get(et, et)
        self.smem_len[st] = max(self.smem_len.get(st, 1), off // _ES[st] + low.T * R)
        for j in range(R):
            p = self._smem_ptr(low, st, off, low.extract(idx, j).ref)
            x = low.extract(v, j).ref
            if st != et:
                x = low.val(f"bitcast {et} {x} to {st}", st, 0).ref
            low.emit(f"store {st} {x}, ptr addrspace(3) {p}, align {_ES[st]}")
        return True

    def _smem_load1(self, low, et, off, i: str) -> LV:
        st = self._SMEM_ST.get(et, et)
        p = self._smem_ptr(low, st, off, i)
        x = low.val(f"load {st}, ptr addrspace(3) {p}, align {_ES[st]}", st, 0)
        return x if st == et else low.val(f"bitcast {st} {x.ref} to {et}", et, 0)

    def smem_load(self, low, et, off, idx):
        R = idx.n
        if R == 0:
            return self._smem_load1(low, et, off, idx.ref)
        parts = []
        for j in range(R):
            parts.append(self._smem_load1(low, et, off, low.extract(idx, j).ref))
        if R == 1:
            return self._one(low, parts[0], ())
        return low.build_vector(parts, et, ())

    def smem_decl(self, low) -> list:
        # each array covers [its lowest region's byte offset, its end): regions of other sizes below it cost nothing
        self.smem_len = {et: n - self.smem_base.get(et, 0) // _ES[et] for et, n in self.smem_len.items()}
        offs = re.compile(r"__JK_SMEM_OFF_(\w+?)_(\d+)__")

        def rel(m):
            et, off = m.group(1), int(m.group(2))
            return str((off - self.smem_base[et]) // _ES[et])
        total = sum(n * _ES[et] for et, n in self.smem_len.items())
        if total > self.max_smem_bytes:
            raise CompilationError(
                f"kernel {low.fn.name} needs {total} bytes of workgroup memory on vulkan (one array per element "
                f"size: {', '.join(f'{et} x {n}' for et, n in sorted(self.smem_len.items()))}), more than "
                f"{self.max_smem_bytes}: use smaller tiles")
        self.smem_total = total
        for i, line in enumerate(low.lines):
            if "__JK_SMEM_" in line:
                for et, n in self.smem_len.items():
                    line = line.replace(_PLACEHOLDER.format(et), str(n))
                low.lines[i] = offs.sub(rel, line)
        out = [f"@__jk_smem_{et} = internal addrspace(3) global [{n} x {et}] poison, align 16"
               for et, n in sorted(self.smem_len.items())]
        return out + self.names


# ---------------------------------------------------------------------- intrinsics without a SPIR-V form
# LLVM 22's SPIR-V backend cannot select G_FCOPYSIGN or G_SADDSAT (scalar or vector); the shared emitter
# uses both (tanh's sign, madd's i16 saturation), so their calls are expanded into plain IR here.
_CALL = re.compile(r"^(\s*)(%[\w.]+) = call (<(\d+) x (\w+)>|\w+) @llvm\.(copysign|sadd\.sat)\.\w+\("
                   r"(?:<\d+ x \w+>|\w+) ([^,]+), (?:<\d+ x \w+>|\w+) ([^)]+)\)\s*$")
_WIDE = {"i8": "i16", "i16": "i32", "i32": "i64"}
_BITS = {"float": ("i32", 0x7FFFFFFF, -0x80000000), "double": ("i64", 0x7FFFFFFFFFFFFFFF, -0x8000000000000000)}


def _splat(et: str, n, v) -> str:
    return f"<{', '.join([f'{et} {v}'] * int(n))}>" if n else str(v)


def _expand(line: str) -> list:
    m = _CALL.match(line)
    if not m:
        return [line]
    ind, r, ty, n, vet, what, a, b = m.groups()
    et = vet or ty
    t = lambda k: f"{r}.jk{k}"  # noqa: E731
    vt = lambda e: f"<{n} x {e}>" if n else e  # noqa: E731
    if what == "copysign":
        it, mag, sign = _BITS[et]
        return [f"{ind}{t(0)} = bitcast {ty} {a} to {vt(it)}", f"{ind}{t(1)} = bitcast {ty} {b} to {vt(it)}",
                f"{ind}{t(2)} = and {vt(it)} {t(0)}, {_splat(it, n, mag)}",
                f"{ind}{t(3)} = and {vt(it)} {t(1)}, {_splat(it, n, sign)}",
                f"{ind}{t(4)} = or {vt(it)} {t(2)}, {t(3)}", f"{ind}{r} = bitcast {vt(it)} {t(4)} to {ty}"]
    w = _WIDE[et]
    bits = int(et[1:])
    hi, lo = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    return [f"{ind}{t(0)} = sext {ty} {a} to {vt(w)}", f"{ind}{t(1)} = sext {ty} {b} to {vt(w)}",
            f"{ind}{t(2)} = add {vt(w)} {t(0)}, {t(1)}",
            f"{ind}{t(3)} = icmp sgt {vt(w)} {t(2)}, {_splat(w, n, hi)}",
            f"{ind}{t(4)} = select {vt('i1')} {t(3)}, {vt(w)} {_splat(w, n, hi)}, {vt(w)} {t(2)}",
            f"{ind}{t(5)} = icmp slt {vt(w)} {t(4)}, {_splat(w, n, lo)}",
            f"{ind}{t(6)} = select {vt('i1')} {t(5)}, {vt(w)} {_splat(w, n, lo)}, {vt(w)} {t(4)}",
            f"{ind}{r} = trunc {vt(w)} {t(6)} to {ty}"]


# `fcmp uno/ord` become OpUnordered/OpOrdered, which need the Kernel capability: NaN tests are rewritten
# into self-comparisons (OpFUnordNotEqual / OpFOrdEqual), which shaders have.
_FCMP = re.compile(r"^(\s*)(%[\w.]+) = fcmp (uno|ord) (<\d+ x \w+>|\w+) ([^,]+), (.+?)\s*$")


def _expand_fcmp(line: str) -> list:
    m = _FCMP.match(line)
    if not m:
        return [line]
    ind, r, pred, ty, a, b = m.groups()
    p = "une" if pred == "uno" else "oeq"
    if a == b:
        return [f"{ind}{r} = fcmp {p} {ty} {a}, {a}"]
    bt = re.sub(r"\b(float|double|half)\b", "i1", ty)
    return [f"{ind}{r}.jka = fcmp {p} {ty} {a}, {a}", f"{ind}{r}.jkb = fcmp {p} {ty} {b}, {b}",
            f"{ind}{r} = {'or' if pred == 'uno' else 'and'} {bt} {r}.jka, {r}.jkb"]


# Vulkan allows OpFDiv on 32-bit floats an error of 2.5 ULP, and NVIDIA's driver uses it (1 ULP off in q8 block
# scales: an activation then rounds to the other integer at a near-tie, test_matmul_q[vulkan-q5_K] off by 0.3).
# An f32 division is done in f64 and rounded back instead: any f64 quotient within 2^-50 relative of the exact
# one rounds to the correctly rounded f32 quotient (an f32 a / b is never within 2^-49 of an f32 midpoint
# unless exact), so every target gives IEEE's a / b bit for bit, as the CPU and CUDA (div.rn.f32) do.
_FDIV = re.compile(r"^(\s*)(%[\w.]+) = fdiv ((?:[a-z]+ )*)(<(\d+) x float>|float) ([^,]+), (.+?)\s*$")


def _exact_fdiv(line: str) -> list:
    m = _FDIV.match(line)
    if not m:
        return [line]
    ind, r, flags, ty, n, a, b = m.groups()
    dt = f"<{n} x double>" if n else "double"
    return [f"{ind}{r}.jkda = fpext {ty} {a} to {dt}", f"{ind}{r}.jkdb = fpext {ty} {b} to {dt}",
            f"{ind}{r}.jkdq = fdiv {flags}{dt} {r}.jkda, {r}.jkdb", f"{ind}{r} = fptrunc {dt} {r}.jkdq to {ty}"]


def legalize_intrinsics(text: str) -> str:
    out = []
    for line in text.split("\n"):
        if line.startswith("declare") and ("@llvm.copysign." in line or "@llvm.sadd.sat." in line):
            continue
        if " = fdiv " in line:
            out += _exact_fdiv(line)
        elif " = fcmp uno " in line or " = fcmp ord " in line:
            out += _expand_fcmp(line)
        else:
            out += _expand(line) if ("@llvm.copysign." in line or "@llvm.sadd.sat." in line) else [line]
    return "\n".join(out)


def lower_to_spirv(fn, target) -> tuple[str, dict]:
    """(LLVM IR text, launch metadata) for one kernel."""
    hooks = SpirvHooks(target)
    low = GpuLowering(fn, target, hooks)
    # the backend cannot legalize most vectors wider than 4 (and <N x i1>): hand it scalar IR
    text = legalize_intrinsics(scalarize(low.lower()))
    meta = {"num_threads": low.T, "shared_bytes": getattr(hooks, "smem_total", 0), "slots": hooks.slots,
            "bindings": [list(b) for b in hooks.bindings], "entry": fn.name}
    return text, meta


# ------------------------------------------------------------------------------ SPIR-V binary fix-ups
def strip_int8_capability(spv: bytes) -> bytes:
    """Drops `OpCapability Int8` when no 8-bit integer type is left: the backend adds it for the resource-name
    strings even in kernels without 8-bit data, which would be a needless device requirement."""
    import struct
    words = list(struct.unpack(f"<{len(spv) // 4}I", spv))
    i, out_words, has_i8 = 5, words[:5], False
    cap_at = []
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        inst = words[i:i + n]
        if op == 21 and inst[2] == 8:          # OpTypeInt 8
            has_i8 = True
        if op == 17 and inst[1] == 39:         # OpCapability Int8
            cap_at.append(len(out_words))
        out_words += inst
        i += max(n, 1)
    if has_i8 or not cap_at:
        return spv
    for at in reversed(cap_at):
        del out_words[at:at + 2]
    return struct.pack(f"<{len(out_words)}I", *out_words)


_BARRIER_SEMANTICS = 0x2 << 2 | 0x40 | 0x100     # AcquireRelease | UniformMemory | WorkgroupMemory (= 0x148)


def fix_barrier_semantics(spv: bytes) -> bytes:
    """Gives every OpControlBarrier the memory semantics AcquireRelease | UniformMemory | WorkgroupMemory.

    LLVM 22 lowers `llvm.spv.group.memory.barrier.with.group.sync` to `OpControlBarrier Workgroup Workgroup
    SequentiallyConsistent` with no storage-class bit, which orders no memory at all: lavapipe then moves
    workgroup loads across the barrier (a relayout read other invocations' stale data). The DSL's barrier
    must order both workgroup (shared) and storage-buffer memory between the invocations of a workgroup."""
    import struct
    words = list(struct.unpack(f"<{len(spv) // 4}I", spv))
    i, uint_at, uint_id, barriers, const_id = 5, None, None, [], None
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 21 and words[i + 2] == 32 and words[i + 3] == 0 and uint_id is None:     # OpTypeInt 32 0
            uint_id, uint_at = words[i + 1], i + n
        elif op == 43 and uint_id is not None and words[i + 1] == uint_id and n == 4 \
                and words[i + 3] == _BARRIER_SEMANTICS:                                    # OpConstant
            const_id = words[i + 2]
        elif op == 224:                                                                    # OpControlBarrier
            barriers.append(i)
        i += max(n, 1)
    if not barriers:
        return spv
    if uint_id is None:
        raise CompileError("SPIR-V module with a barrier but no 32-bit integer type", target="vulkan")
    insert = []
    if const_id is None:
        const_id = words[3]
        words[3] += 1                                    # the id bound
        insert = [(4 << 16) | 43, uint_id, const_id, _BARRIER_SEMANTICS]
    for at in barriers:
        words[at + 3] = const_id
    words[uint_at:uint_at] = insert
    return struct.pack(f"<{len(words)}I", *words)


_FLOAT_ARITH = {127, 129, 131, 133, 136, 140, 141}      # OpFNegate, OpFAdd, OpFSub, OpFMul, OpFDiv, OpFRem, OpFMod


def decorate_no_contraction(spv: bytes) -> bytes:
    """Decorates every float arithmetic result NoContraction.

    Vulkan drivers may otherwise treat float math as reassociable (Mesa's NIR rewrites (t + c) - c to t unless
    the instruction is exact: the round-half-even trick of the quantisers then stops rounding) and fuse
    multiplies into adds. The DSL's arithmetic is IEEE operation by operation on every target (batch
    invariance relies on it), so each operation stays as written; `fma` is an explicit Fma."""
    import struct
    words = list(struct.unpack(f"<{len(spv) // 4}I", spv))
    i, first_type, ids = 5, None, []
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if first_type is None and 19 <= op <= 39:
            first_type = i
        elif op in _FLOAT_ARITH:
            ids.append(words[i + 2])
        i += max(n, 1)
    if not ids or first_type is None:
        return spv
    deco = []
    for rid in ids:
        deco += [(3 << 16) | 71, rid, 42]                  # OpDecorate %rid NoContraction
    words[first_type:first_type] = deco
    return struct.pack(f"<{len(words)}I", *words)


# opcodes without a result id, and those whose result id is their first operand (no result type); every other
# instruction is (result type, result id, ...)
_NO_RESULT = {0, 2, 3, 4, 5, 6, 8, 10, 14, 15, 16, 17, 39, 56, 62, 63, 64, 71, 72, 74, 75, 224, 225, 228, 246, 247,
              249, 250, 251, 252, 253, 254, 255, 256, 257, 317, 330, 331, 332, 5632, 5633}
_RESULT_FIRST = set(range(19, 39)) | {7, 11, 73, 248, 322, 327, 4417, 4456, 5341, 5358}


def duplicate_result_ids(spv: bytes) -> list:
    """Result ids defined more than once in a module (LLVM 22's SPIR-V backend, after many modules in one
    process, sometimes numbers a function's ids over the module's types: "Id 1 is defined more than once")."""
    import struct
    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    seen, dup, i = set(), [], 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        at = None if op in _NO_RESULT else 1 if op in _RESULT_FIRST else 2
        if at is not None and at < n:
            rid = words[i + at]
            if rid in seen:
                dup.append(rid)
            seen.add(rid)
        i += max(n, 1)
    return dup


def compile_module(llvm_ir: str, target, describe: str, kernel: str, spec: str) -> bytes:
    """LLVM IR -> the finished SPIR-V module, isolated (the backend aborts on bad input). A module with
    duplicate result ids (state left in a long-lived compile worker by earlier modules; the same IR compiles
    cleanly in a new process) is compiled again in a fresh worker."""
    from ..isolate import compile_llvm_ir
    args = dict(triple=target.triple, cpu="", features="", opt=0, emit=("obj",), describe=describe, kernel=kernel,
                specialization=spec)
    try:
        spv = finish_module(compile_llvm_ir(llvm_ir, **args)["obj"])
        if duplicate_result_ids(spv):
            spv = finish_module(compile_llvm_ir(llvm_ir, fresh=True, **args)["obj"])
    except CompileError as e:
        if e.target is None:
            e.target = target.name
        raise
    dup = duplicate_result_ids(spv)
    if dup:
        raise CompileError(f"{describe}: the SPIR-V backend defined result ids {sorted(set(dup))[:8]} more than "
                           f"once, also in a fresh compile worker", target=target.name)
    return spv


def finish_module(spv: bytes) -> bytes:
    """The backend's SPIR-V with the fix-ups above (barrier semantics, exact float arithmetic, the stray Int8
    capability)."""
    return strip_int8_capability(decorate_no_contraction(fix_barrier_semantics(spv)))


__all__ = ["SpirvHooks", "lower_to_spirv", "compile_module", "duplicate_result_ids", "strip_int8_capability", "fix_barrier_semantics", "finish_module"]


# ------------------------------------------------------------------------------------------ backend
class SpirvBackend(GpuBackend):
    """Vulkan: LLVM IR -> logical SPIR-V (LLVM's SPIR-V backend, isolated; fixed up: `compile_module`), loaded as
    a compute pipeline by runtime/vulkan.py."""
    family = "vulkan"
    artifact = "kernel.spv"
    tuning_entries = ("reduce_direct", "reduce_one_each")
    engine_device = "vulkan"

    def lower(self, fn, target) -> tuple:
        return lower_to_spirv(fn, target)

    def compile(self, fn, target, emit, describe, kernel_name, spec) -> tuple:
        llvm_ir, launch_meta = lower_to_spirv(fn, target)
        return {**self.sources(fn, llvm_ir),
                "kernel.spv": compile_module(llvm_ir, target, describe, kernel_name, spec)}, {"launch": launch_meta}

    def runtime(self):
        from ..runtime import vulkan
        return vulkan

    def runs(self, target) -> str:
        return "on a Vulkan device (lavapipe counts)"


BACKEND = SpirvBackend()
