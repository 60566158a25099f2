"""AMDGPU: the HIP hooks of the shared GPU lowering, and object -> code object (.hsaco) linking.

Facts this rests on (../shared/notes/feasibility-codegen.md section 2, LLVM's AMDGPUUsage):
- kernels are `amdgpu_kernel` functions; pointer parameters stay flat (`ptr`, address space 0), the same
  IR as every other target: LLVM's AMDGPU pipeline assumes flat pointer kernel arguments point to global
  memory (InferAddressSpaces), so loads and stores become `global_load` / `global_store` (the tests check
  the disassembly for them);
- thread / block ids are `llvm.amdgcn.workitem.id.x` / `llvm.amdgcn.workgroup.id.{x,y,z}`; the number of
  workgroups comes from the HSA dispatch packet (`llvm.amdgcn.dispatch.ptr`): grid_size (u32 at byte 12 +
  4 * axis, in work-items) divided by workgroup_size (u16 at byte 4 + 2 * axis). The packet is there under
  every code object version and every runtime, so no hidden kernel parameter is needed;
- `__syncthreads` is a workgroup-scope release fence, `llvm.amdgcn.s.barrier`, a workgroup-scope acquire
  fence (the fences make LDS and global writes of the workgroup visible across the barrier);
- LDS is address space 3 with 32-bit pointers; the dynamic part is an external zero-sized addrspace(3)
  array, sized at launch (hipModuleLaunchKernel's sharedMemBytes), exactly as HIP's `extern __shared__`;
- `amdgpu-flat-work-group-size`="1,T" tells the register allocator the workgroup size (launch bounds);
- there is no libm: exp and log are the shared emitter's polynomials; sin/cos use `llvm.amdgcn.sin/cos`,
  which take revolutions (x / 2pi), after a range reduction to [-0.5, 0.5) revolutions in f32;
- LLVM 22 emits code object v6 by default; the module flag asks for v5, which ROCm 6.x loads.
LLVM emits a relocatable ELF (`emit=obj`); `ld.lld -shared` makes the code object `hipModuleLoadData` takes.
An ld.lld that knows AMDGPU and code object v5 is needed: the `ziglang` wheel's (LLD 22, pip-installable,
the `[hip]` extra), or ld.lld-17+ on PATH; Debian 12's lld 14 rejects v5/v6 objects.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ..errors import CompileError
from .base import GpuBackend, Options
from .emitter import LV
from .gpu import GpuHooks, GpuLowering

CODE_OBJECT_VERSION = 500


class AmdgpuHooks(GpuHooks):
    # No rematerialised broadcasts on AMDGPU: with them, LLVM 22's AMDGPU instruction selection (DAGCombiner)
    # does not finish on the q8_0 dequant_rows kernel (minutes; llc-19 compiles the same IR in a second, and the
    # kernel without rematerialisation in 0.2 s). Layout changes go through LDS there, as before.
    remat = False
    smem_as = 3
    smem_index = "i32"
    # 16-byte chunk accesses go through addrspace(1) pointers: a chunk pointer extracted from a pointer vector
    # is beyond LLVM's address-space inference, and a flat pointer there would make flat_load / flat_store
    global_as = 1

    def __init__(self, target):
        self.target = target
        self.max_smem_bytes = target.shared_mem_bytes or 64 * 1024

    def module_header(self, low) -> list:
        return [f'target datalayout = "{self.target.data_layout}"', f'target triple = "{self.target.triple}"',
                "!llvm.module.flags = !{!0}",
                f'!0 = !{{i32 1, !"amdhsa_code_object_version", i32 {CODE_OBJECT_VERSION}}}']

    def kernel_signature(self, low, name, params) -> str:
        args = []
        for k, prm in enumerate(params):
            t = prm.type
            if t.is_ptr:
                args.append(f"ptr noundef %arg{k}")
            elif t.elem.is_float:
                args.append(f"double %arg{k}")
            else:
                args.append(f"i64 %arg{k}")
        return f"define amdgpu_kernel void @{name}({', '.join(args)}) #0"

    def _call_i32(self, low, name: str) -> str:
        low.declare(name, "i32", [])
        return low.val(f"call i32 @{name}()", "i32", 0).ref

    def thread_id(self, low) -> str:
        return self._call_i32(low, "llvm.amdgcn.workitem.id.x")

    def block_id(self, low, axis: int) -> str:
        return self._call_i32(low, "llvm.amdgcn.workgroup.id." + "xyz"[axis])

    def num_blocks(self, low, axis: int) -> str:
        # hsa_kernel_dispatch_packet_t: u16 workgroup_size_{x,y,z} at bytes 4/6/8, u32 grid_size_{x,y,z}
        # (in work-items) at bytes 12/16/20; the runtime launches whole workgroups, so the division is exact
        low.declare("llvm.amdgcn.dispatch.ptr", "ptr addrspace(4)", [])
        dp = low.val("call ptr addrspace(4) @llvm.amdgcn.dispatch.ptr()", "ptr", 0).ref
        gp = low.val(f"getelementptr inbounds i8, ptr addrspace(4) {dp}, i64 {12 + 4 * axis}", "ptr", 0).ref
        grid = low.val(f"load i32, ptr addrspace(4) {gp}, align 4, !invariant.load !{{}}", "i32", 0).ref
        if axis == 0:
            # the workgroup size along x is the kernel's own T (the runtime launches (T, 1, 1) workgroups)
            return low.val(f"udiv i32 {grid}, {low.T}", "i32", 0).ref
        wp = low.val(f"getelementptr inbounds i8, ptr addrspace(4) {dp}, i64 {4 + 2 * axis}", "ptr", 0).ref
        w16 = low.val(f"load i16, ptr addrspace(4) {wp}, align 2, !invariant.load !{{}}", "i16", 0).ref
        w = low.val(f"zext i16 {w16} to i32", "i32", 0).ref
        return low.val(f"udiv i32 {grid}, {w}", "i32", 0).ref

    def barrier(self, low) -> None:
        low.declare("llvm.amdgcn.s.barrier", "void", [])
        low.emit('fence syncscope("workgroup") release')
        low.emit("call void @llvm.amdgcn.s.barrier()")
        low.emit('fence syncscope("workgroup") acquire')

    def math(self, low, name: str, x: LV):
        if name in ("sin", "cos") and x.et == "float":
            # llvm.amdgcn.sin/cos compute sin(2 pi r) for r in revolutions; valid for |r| up to ~256 on
            # gfx9, so reduce first: r = t - rint(t), t = x / (2 pi), giving r in [-0.5, 0.5]
            fn = f"llvm.amdgcn.{name}.f32"
            low.declare(fn, "float", ["float"])
            low.declare("llvm.rint.f32", "float", ["float"])

            def one(v: str) -> LV:
                t = low.val(f"fmul float {v}, {_f32(1.0 / (2.0 * math.pi))}", "float", 0).ref
                k = low.val(f"call float @llvm.rint.f32(float {t})", "float", 0).ref
                r = low.val(f"fsub float {t}, {k}", "float", 0).ref
                return low.val(f"call float @{fn}(float {r})", "float", 0)
            if x.n == 0:
                return one(x.ref)
            parts = [one(low.extract(x, j).ref) for j in range(x.n)]
            return low.build_vector(parts, "float", x.shape)
        return None

    def function_attrs(self, low) -> list:
        return [f'"amdgpu-flat-work-group-size"="1,{low.T}"']

    # ------------------------------------------------------------------------------ matrix units
    # Both are 16x16x16 with f32 accumulators, 16-bit A/B (bf16 or f16), one wavefront per instruction.
    @property
    def mma_shape(self):
        return (16, 16, 16) if self.target.mma in ("mfma", "wmma") else None

    def mma_layout(self, lane, kind):
        i16 = "i16" if kind == "bf16" else "half"
        r = lane & 15
        if self.target.mma == "mfma":
            # v_mfma_f32_16x16x16{bf16_1k,f16}, wave64 (CDNA2/CDNA3 ISA, "Dependent arithmetic" matrix layouts;
            # AMD's matrix instruction calculator): lane l holds A[l % 16][4 (l / 16) + 0..3], B[4 (l / 16) +
            # 0..3][l % 16] (one 64-bit register pair each) and D[4 (l / 16) + i][l % 16] in accumulator i
            kq = (lane >> 4) << 2
            return dict(a_ty=f"<4 x {i16}>", a_elems=4, b_ty=f"<4 x {i16}>", b_elems=4,
                        a=[(r, kq)], b=[(r, kq)], c=[(kq + i, r) for i in range(4)])
        # v_wmma_f32_16x16x16_{bf16,f16}, wave32 (RDNA3 ISA "Wave Matrix Multiply Accumulate"): lane l holds
        # row l % 16 of A and column l % 16 of B, all 16 k (8 VGPRs; lanes 16..31 repeat lanes 0..15), and
        # D[2 i + l / 16][l % 16] in accumulator i (the even rows in lanes 0..15, the odd ones in 16..31)
        h = lane >> 4
        return dict(a_ty=f"<16 x {i16}>", a_elems=16, b_ty=f"<16 x {i16}>", b_elems=16,
                    a=[(r, 0)], b=[(r, 0)], c=[(h + 2 * i, r) for i in range(8)])

    def mma(self, low, kind, a_regs, b_regs, c_regs):
        i16 = "i16" if kind == "bf16" else "half"
        nc = len(c_regs)
        vc = f"<{nc} x float>"
        c = low.build_vector([LV(x, "float", 0) for x in c_regs], "float", ())
        if self.target.mma == "mfma":
            # the bf16 form with 4 k per lane is the `_1k` one (gfx90a+); cbsz / abid / blgp = 0: no broadcast
            fn = "llvm.amdgcn.mfma.f32.16x16x16" + ("bf16.1k" if kind == "bf16" else "f16")
            vt = f"<4 x {i16}>"
            low.declare(fn, vc, [vt, vt, vc, "i32", "i32", "i32"])
            res = low.val(f"call {vc} @{fn}({vt} {a_regs[0]}, {vt} {b_regs[0]}, {vc} {c.ref}, i32 0, i32 0, "
                          f"i32 0)", "float", nc)
        else:
            vt = f"<16 x {i16}>"
            fn = f"llvm.amdgcn.wmma.f32.16x16x16.{kind}.v8f32.v16{'i16' if kind == 'bf16' else 'f16'}"
            low.declare(fn, vc, [vt, vt, vc])
            res = low.val(f"call {vc} @{fn}({vt} {a_regs[0]}, {vt} {b_regs[0]}, {vc} {c.ref})", "float", nc)
        return [low.extract(res, j).ref for j in range(nc)]


def _f32(v: float) -> str:
    """An LLVM float literal: the f32 value written as the hex of its double."""
    import struct
    f = struct.unpack("<f", struct.pack("<f", v))[0]
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", f))[0]


def lower_to_amdgpu(fn, target) -> tuple[str, dict]:
    """(LLVM IR text, launch metadata) for one kernel."""
    low = GpuLowering(fn, target, AmdgpuHooks(target))
    text = low.lower()
    return text, {"num_threads": low.T, "shared_bytes": low.smem_bytes}


# ------------------------------------------------------------------------------------------ ld.lld
_found_lld: dict = {}


def find_lld():
    """An ld.lld command (list) that links AMDGPU code object v5: $JITKERN_LLD, the ziglang wheel's, or
    ld.lld-22 ... ld.lld-17 / ld.lld on PATH when new enough; None if there is none (memoised per
    $JITKERN_LLD and $PATH: every cache key asks)."""
    key = (os.environ.get("JITKERN_LLD"), os.environ.get("PATH"))
    if key not in _found_lld:
        _found_lld[key] = _search_lld()
    return _found_lld[key]


def _search_lld():
    env = os.environ.get("JITKERN_LLD")
    if env:
        return env.split() if shutil.which(env.split()[0]) else None
    cands = []
    try:
        import importlib.util
        if importlib.util.find_spec("ziglang") is not None:
            cands.append([sys.executable, "-m", "ziglang", "ld.lld"])
    except (ImportError, ValueError):
        pass
    for v in range(22, 16, -1):
        p = shutil.which(f"ld.lld-{v}")
        if p:
            cands.append([p])
    p = shutil.which("ld.lld")
    if p:
        cands.append([p])
    for c in cands:
        if _lld_major(c) >= 17:
            return c
    return None


_lld_version_cache: dict = {}


def lld_version(cmd) -> str:
    """The linker's version line (part of the cache key: a new linker makes new code objects)."""
    if cmd is None:
        return "none"
    key = tuple(cmd)
    hit = _lld_version_cache.get(key)
    if hit is None:
        try:
            out = subprocess.run(list(cmd) + ["--version"], capture_output=True, text=True, timeout=60).stdout
            hit = out.strip().splitlines()[0] if out.strip() else "unknown"
        except (OSError, subprocess.SubprocessError):
            hit = "unknown"
        _lld_version_cache[key] = hit
    return hit


def _lld_major(cmd) -> int:
    import re
    m = re.search(r"LLD (\d+)\.", lld_version(cmd))
    return int(m.group(1)) if m else 0


def link_code_object(obj: bytes, *, target: str = "", describe: str = "") -> bytes:
    """Links an AMDGPU relocatable object into a code object (.hsaco); CompileError with lld's message."""
    cmd = find_lld()
    if cmd is None:
        raise CompileError("no ld.lld with AMDGPU code object v5 support found (install the [hip] extra, which "
                           "brings the ziglang wheel's ld.lld, or ld.lld-17+, or set JITKERN_LLD)", target=target)
    with tempfile.TemporaryDirectory(prefix="jitkern-lld-") as d:
        src = os.path.join(d, "k.o")
        dst = os.path.join(d, "k.hsaco")
        with open(src, "wb") as f:
            f.write(obj)
        try:
            r = subprocess.run(list(cmd) + ["-shared", src, "-o", dst], capture_output=True, text=True,
                               timeout=300)
        except subprocess.TimeoutExpired:
            raise CompileError(f"ld.lld timed out on {describe}", target=target) from None
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip()[-2000:]
            raise CompileError(f"ld.lld rejected the object of {describe}: {msg}", target=target)
        with open(dst, "rb") as f:
            return f.read()


def code_object_digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


__all__ = ["AmdgpuHooks", "lower_to_amdgpu", "find_lld", "lld_version", "link_code_object", "CODE_OBJECT_VERSION"]


# ------------------------------------------------------------------------------------------ backend
@dataclass(frozen=True)
class AmdgpuOptions(Options):
    """AMDGPU's key also holds the ld.lld release that links the code object (the artifact a launch loads)."""
    lld: str = ""

    def key(self) -> tuple:
        return ("ld.lld", self.lld) + self.tuning


class AmdgpuBackend(GpuBackend):
    """AMD targets: LLVM IR -> relocatable AMDGPU object (isolated LLVM) -> code object (ld.lld), loaded by
    runtime/hip.py. `jitkern build` runs the engine's device-array path (GPU tiles: MFMA/WMMA linear, flash
    attention) on the CUDA runtime's host-memory stand-in: what an engine on the AMD GPU asks for."""
    family = "hip"
    artifact = "kernel.hsaco"
    tuning_entries = ("frag_ops", "row_slots", "pin_operands", "reduce_direct", "reduce_one_each")

    def options(self, target) -> AmdgpuOptions:
        return AmdgpuOptions(target.tuning.tags(self.tuning_entries), lld_version(find_lld()))

    def lower(self, fn, target) -> tuple:
        return lower_to_amdgpu(fn, target)

    def compile(self, fn, target, emit, describe, kernel_name, spec) -> tuple:
        llvm_ir, launch_meta = lower_to_amdgpu(fn, target)
        obj = self.llvm(llvm_ir, target, ("obj",), describe, kernel_name, spec)["obj"]
        return {**self.sources(fn, llvm_ir), "kernel.o": obj,
                "kernel.hsaco": link_code_object(obj, target=target.name, describe=describe)}, {"launch": launch_meta}

    def runtime(self):
        from ..runtime import hip
        return hip

    def runs(self, target) -> str:
        return "build only (runtime untested)"

    def build_problem(self, target):
        if find_lld() is None:
            return (f"target {target.name}: no ld.lld that links AMDGPU code object v5 (install jitkern[hip], which "
                    f"brings the ziglang wheel's ld.lld, or ld.lld-17+; or set JITKERN_LLD)")
        return None

    def build_device(self, target):
        from ..runtime.cuda import HostMemoryDevice, standing_in
        return standing_in(HostMemoryDevice(target))


BACKEND = AmdgpuBackend()
