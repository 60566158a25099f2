"""NVPTX: the CUDA hooks of the shared GPU lowering, and PTX -> cubin.

LLVM 22's NVPTX backend (facts in ../shared/notes/gpu-readiness.md): kernels are `ptx_kernel` functions
whose pointer parameters NVPTXLowerArgs treats as global memory; `llvm.exp/log/sin` do not lower (exp and
log are polynomials in the shared emitter; sin/cos use the hardware approximations below); `emit=obj` is
refused, so the backend emits PTX text and ptxas (or the driver's JIT) makes the cubin.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

from ..errors import CompileError
from .cpu import LV, elem_ty
from .emitter import vty
from .base import GpuBackend
from .gpu import GpuHooks, GpuLowering
from .nvidia.staging import AsyncCopies
from .nvidia.wgmma import WarpgroupMma


class NvptxHooks(GpuHooks):
    smem_as = 3
    smem_index = "i32"
    global_as = 1
    # MMA K loops stay loops: LLVM unrolled the bf16 linear's 8 steps (BK=128) and ptxas then kept every
    # step's fragment loads in flight (sm_90a: 149 -> 167 registers; the tall tile 126 -> 151), which costs
    # CTAs per SM in kernels that are memory-bound at decode
    mma_unroll = 1

    def __init__(self, target):
        self.target = target
        self.max_smem_bytes = target.shared_mem_bytes or 48 * 1024

    def module_header(self, low) -> list:
        return [f'target datalayout = "{self.target.data_layout}"', f'target triple = "{self.target.triple}"']

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
        return f"define ptx_kernel void @{name}({', '.join(args)}) #0"

    def _sreg(self, low, reg: str) -> str:
        name = f"llvm.nvvm.read.ptx.sreg.{reg}"
        low.declare(name, "i32", [])
        return low.val(f"call i32 @{name}()", "i32", 0).ref

    @property
    def has_bulk_prefetch(self) -> bool:
        return self.target.async_copy == "tma"          # sm_90+ (cp.async.bulk)

    def bulk_prefetch_l2(self, low, ptr: str, nbytes: int, pred: str) -> None:
        # cp.async.bulk.prefetch.L2 takes a .global address: the generic pointer cast to the global space
        g = low.val(f"addrspacecast ptr {ptr} to ptr addrspace(1)", "ptr", 0).ref
        p = low.val(f"zext i1 {pred} to i32", "i32", 0).ref
        text = ("{ .reg .pred p; setp.ne.u32 p, $1, 0; @p cp.async.bulk.prefetch.L2.global [$0], " + str(int(nbytes))
                + "; }")
        low.emit(f'call void asm sideeffect "{text}", "l,r,~{{memory}}"(ptr addrspace(1) {g}, i32 {p})')

    def thread_id(self, low) -> str:
        return self._sreg(low, "tid.x")

    def block_id(self, low, axis: int) -> str:
        return self._sreg(low, "ctaid." + "xyz"[axis])

    def num_blocks(self, low, axis: int) -> str:
        return self._sreg(low, "nctaid." + "xyz"[axis])

    def barrier(self, low) -> None:
        low.declare("llvm.nvvm.barrier0", "void", [])
        low.emit("call void @llvm.nvvm.barrier0()")

    has_fast_exp = True

    def math(self, low, name: str, x: LV):
        if name == "exp_fast" and x.et == "float":
            # e^x = 2^(x log2 e): one multiply and ex2.approx.ftz (MUFU.EX2), as FlashAttention's softmax; -inf
            # and very negative x give +0, NaN stays NaN
            fn = "llvm.nvvm.ex2.approx.ftz.f"
            low.declare(fn, "float", ["float"])

            def one(ref):
                t = low.val(f"fmul float {ref}, 0x3FF7154760000000", "float", 0).ref
                return low.val(f"call float @{fn}(float {t})", "float", 0)
            if x.n == 0:
                return one(x.ref)
            return low.build_vector([one(low.extract(x, j).ref) for j in range(x.n)], "float", x.shape)
        if name in ("sin", "cos") and x.et == "float":
            # sin.approx/cos.approx: max abs error ~2^-20.5 on [-pi, pi] (PTX ISA); fine for the DSL's uses
            fn = f"llvm.nvvm.{name}.approx.f"
            low.declare(fn, "float", ["float"])
            if x.n == 0:
                return low.val(f"call float @{fn}(float {x.ref})", "float", 0)
            parts = [low.val(f"call float @{fn}(float {low.extract(x, j).ref})", "float", 0) for j in range(x.n)]
            return low.build_vector(parts, "float", x.shape)
        return None

    def dp4a(self, low, a, b, c, a_signed, b_signed):
        # dp4a.{s32|u32}.{s32|u32} (sm_61+): c + the four byte products, exact, one instruction per lane
        fn = f"llvm.nvvm.idp4a.{'s' if a_signed else 'u'}.{'s' if b_signed else 'u'}"
        low.declare(fn, "i32", ["i32", "i32", "i32"])
        if a.n == 0:
            return low.val(f"call i32 @{fn}(i32 {a.ref}, i32 {b.ref}, i32 {c.ref})", "i32", 0)
        parts = [low.val(f"call i32 @{fn}(i32 {low.extract(a, j).ref}, i32 {low.extract(b, j).ref}, "
                         f"i32 {low.extract(c, j).ref})", "i32", 0) for j in range(a.n)]
        return low.build_vector(parts, "i32", a.shape)

    def round_bf16(self, low, x):
        # fptrunc to bfloat: cvt.rn.bf16x2.f32, two lanes per instruction (sm_80+)
        if self.target.mma not in ("mma.sync", "wgmma", "tcgen05"):
            return None
        bt = vty("bfloat", x.n)
        t = low.val(f"fptrunc {x.ty} {x.ref} to {bt}", "bfloat", x.n, x.shape)
        return low.val(f"bitcast {bt} {t.ref} to {vty('i16', x.n)}", "i16", x.n, x.shape)

    @property
    def mma_shape(self):
        return (16, 8, 16) if self.target.mma in ("mma.sync", "wgmma", "tcgen05") else None

    def mma(self, low, kind, a_regs, b_regs, c_regs):
        # mma.sync.m16n8k16 (sm_80+) as inline PTX: LLVM's intrinsic names for it changed across releases
        asm = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, "
               f"{{$8,$9}}, {{$10,$11,$12,$13}};")
        cons = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"
        args = ", ".join([f"i32 {r}" for r in a_regs + b_regs] + [f"float {c}" for c in c_regs])
        res = low.val(f'call {{ float, float, float, float }} asm "{asm}", "{cons}"({args})',
                      "{4f}", 0)
        return [low.val(f"extractvalue {{ float, float, float, float }} {res.ref}, {j}", "float", 0).ref
                for j in range(4)]

    # ---- wgmma (sm_90a): warpgroup MMAs on operands in shared memory (nvidia/wgmma.py). LLVM 22 has
    # intrinsics for the fence / commit / wait only, so all four are inline PTX: the fence and the wait take
    # the accumulators as tied operands, so LLVM cannot move any use of them between an MMA and its wait
    # (the MMA writes them asynchronously), and every statement clobbers memory, so none moves across the
    # shared-memory staging and barriers around it.
    @property
    def has_wgmma(self):
        return self.target.mma == "wgmma"

    def fence_async_smem(self, low) -> None:
        # shared memory written by ordinary stores and read next by the tensor cores' async proxy
        low.emit('call void asm sideeffect "fence.proxy.async.shared::cta;", "~{memory}"()')

    def _tied_asm(self, low, text: str, regs: list, extra_cons=(), extra_args=()) -> list:
        """An asm statement that takes `regs` (f32 refs) as in/out operands (after its own outputs none)."""
        n = len(regs)
        if n == 0:
            assert not extra_cons
            low.emit(f'call void asm sideeffect "{text}", "~{{memory}}"()')
            return []
        sty = "{ " + ", ".join(["float"] * n) + " }"
        cons = ",".join(["=f"] * n + list(extra_cons) + [str(i) for i in range(n)] + ["~{memory}"])
        args = ", ".join(list(extra_args) + [f"float {r}" for r in regs])
        res = low.val(f'call {sty} asm sideeffect "{text}", "{cons}"({args})', "{wg}", 0)
        return [low.val(f"extractvalue {sty} {res.ref}, {j}", "float", 0).ref for j in range(n)]

    def wgmma_fence(self, low, regs: list) -> list:
        return self._tied_asm(low, "wgmma.fence.sync.aligned;", regs)

    def wgmma(self, low, kind: str, n: int, desc_a: str, desc_b: str, regs: list) -> list:
        """D (64 x n, f32, n / 2 registers a thread) += A (64 x 16) B (16 x n): both operands K-major in
        shared memory through descriptors (i64 refs); scale-d 1 (the registers start at 0.0 when the chain
        does), no negation, no transposes."""
        nr = len(regs)
        assert nr == n // 2
        d = ",".join(f"${i}" for i in range(nr))
        text = (f"{{ .reg .pred p; setp.ne.b32 p, ${nr + 2}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32."
                f"{kind}.{kind} {{{d}}}, ${nr}, ${nr + 1}, p, 1, 1, 0, 0; }}")
        return self._tied_asm(low, text, regs, ("l", "l", "r"), (f"i64 {desc_a}", f"i64 {desc_b}", "i32 1"))

    def wgmma_commit_wait(self, low, regs: list) -> list:
        return self._tied_asm(low, "wgmma.commit_group.sync.aligned; wgmma.wait_group.sync.aligned 0;", regs)

    def wgmma_commit(self, low, regs: list) -> list:
        return self._tied_asm(low, "wgmma.commit_group.sync.aligned;", regs)

    def wgmma_wait(self, low, pending: int, regs: list) -> list:
        """wait until at most `pending` committed groups are still running; regs: accumulators the groups
        write (tied, so no use of them moves above the wait)."""
        return self._tied_asm(low, f"wgmma.wait_group.sync.aligned {pending};", regs)

    # ---- cp.async (sm_80+): global -> shared copies that run asynchronously (nvidia/staging.py)
    @property
    def has_cp_async(self):
        return self.target.async_copy in ("cp.async", "tma")

    def cp_async(self, low, dst: str, src: str, nbytes: int, src_bytes: str) -> None:
        """Copies nbytes from global pointer src (a global-space ptr ref) to shared pointer dst, reading
        src_bytes of them (i32 ref; the rest zero-filled)."""
        kind = "cg" if nbytes == 16 else "ca"           # .cg (L2 only) exists for 16-byte copies only
        name = f"llvm.nvvm.cp.async.{kind}.shared.global.{nbytes}.s"
        low.declare(name, "void", [f"ptr addrspace({self.smem_as})", f"ptr addrspace({self.global_as})", "i32"])
        low.emit(f"call void @{name}(ptr addrspace({self.smem_as}) {dst}, ptr addrspace({self.global_as}) {src}, "
                 f"i32 {src_bytes})")

    def cp_async_commit(self, low) -> None:
        low.declare("llvm.nvvm.cp.async.commit.group", "void", [])
        low.emit("call void @llvm.nvvm.cp.async.commit.group()")

    def cp_async_wait(self, low, pending: int) -> None:
        """Waits until at most `pending` committed copy groups of this thread are still running."""
        low.declare("llvm.nvvm.cp.async.wait.group", "void", ["i32 immarg"])
        low.emit(f"call void @llvm.nvvm.cp.async.wait.group(i32 {pending})")

    # ---- TMA (sm_90+): bulk tensor copies global -> shared (nvidia/staging.py _tma_load). Inline PTX, as the probe
    # that checked the layout (perf/probe_tma.py) ran it: thread 0 arms a buffer's mbarrier with the bytes to
    # come and issues the copies; every thread spins on try_wait.parity. Every statement clobbers memory, so
    # none moves across the staging, the MMAs and the barriers around it.
    @property
    def has_tma(self):
        return self.target.async_copy == "tma"

    def tma_init(self, low, bars: list, reinit: bool) -> None:
        """Thread 0 (re)initialises the mbarriers at `bars` (i32 shared addresses) for one arrival each, and
        makes that visible to the async proxy; a CTA barrier must follow before anyone waits on them."""
        body = []
        for i in range(len(bars)):
            if reinit:
                body.append(f"@p mbarrier.inval.shared::cta.b64 [${i}];")
            body.append(f"@p mbarrier.init.shared::cta.b64 [${i}], 1;")
        text = ("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; " + " ".join(body)
                + " @p fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta; }")
        cons = ",".join(["r"] * len(bars) + ["~{memory}"])
        low.emit(f'call void asm sideeffect "{text}", "{cons}"({", ".join(f"i32 {b}" for b in bars)})')

    def tma_copy(self, low, bar: str, desc: str, row: str, boxes: list, nbytes: int) -> None:
        """Thread 0: arm mbarrier `bar` with `nbytes` and copy each box [(shared dst, column)] at `row` of the
        tensor map at global address `desc` (i64 ref)."""
        n = len(boxes)
        copies = " ".join(
            f"@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[${3 + 2 * i}], [$1, {{${4 + 2 * i}, $2}}], [$0];" for i in range(n))
        text = ("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {nbytes}; {copies} }}")
        cons = ",".join(["r", "l", "r"] + ["r", "r"] * n + ["~{memory}"])
        args = [f"i32 {bar}", f"i64 {desc}", f"i32 {row}"] + [f"i32 {x}" for d, c in boxes for x in (d, c)]
        low.emit(f'call void asm sideeffect "{text}", "{cons}"({", ".join(args)})')

    def tma_wait(self, low, bar: str, parity: str) -> None:
        """Every thread waits until mbarrier `bar` completes the phase of `parity` (0 / 1, an i32 ref)."""
        text = ("{ .reg .pred p; TMA_WAIT${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
                "@!p bra TMA_WAIT${:uid}; }")
        low.emit(f'call void asm sideeffect "{text}", "r,r,~{{memory}}"(i32 {bar}, i32 {parity})')

    def smem_address(self, low) -> str:
        """The shared window address of @__jk_smem (i32), for wgmma descriptors."""
        return low.val(f"ptrtoint ptr addrspace({self.smem_as}) @__jk_smem to i32", "i32", 0).ref

    @property
    def has_ldmatrix(self):
        return self.target.mma in ("mma.sync", "wgmma", "tcgen05")       # ldmatrix: sm_75+

    def ldmatrix_lanes(self, lane):
        # ldmatrix: lanes 8j..8j+7 address the rows of matrix j. A (16 x 16): matrices (rows 0-7, k 0-7),
        # (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3; B (8 n x 16 k): (k 0-7), (k 8-15)
        # = b0, b1 (lanes 16-31 repeat 0-15: x2 ignores their addresses)
        return dict(a=(lane & 15, (lane >> 4) << 3), b=(lane & 7, lane & 8))

    def ldmatrix(self, low, ptr, count, trans=False):
        # .trans: each lane receives the transposed 8x8 matrices' elements (its pair runs down a stored column)
        name = f"llvm.nvvm.ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if trans else ''}.b16"
        sty = "{ " + ", ".join(["i32"] * count) + " }"
        low.declare(name, sty, [f"ptr addrspace({self.smem_as})"])
        res = low.val(f"call {sty} @{name}(ptr addrspace({self.smem_as}) {ptr})", "{ld}", 0)
        return [low.val(f"extractvalue {sty} {res.ref}, {j}", "i32", 0).ref for j in range(count)]

    has_shuffle = True

    def shuffle_idx(self, low, v, src):
        low.declare("llvm.nvvm.shfl.sync.idx.f32", "float", ["i32", "float", "i32", "i32"])
        return low.val(f"call float @llvm.nvvm.shfl.sync.idx.f32(i32 -1, float {v}, i32 {src}, i32 31)",
                       "float", 0).ref

    def shuffle_xor(self, low, v, mask):
        low.declare("llvm.nvvm.shfl.sync.bfly.f32", "float", ["i32", "float", "i32", "i32"])
        return low.val(f"call float @llvm.nvvm.shfl.sync.bfly.f32(i32 -1, float {v}, i32 {mask}, i32 31)",
                       "float", 0).ref

    def mma_layout(self, lane, kind):
        # mma.m16n8k16 .bf16/.f16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"): groupID = lane / 4,
        # threadID_in_group = lane % 4; a0..a7 in 4 registers of 2 (k pairs adjacent), b0..b3 in 2, c0..c3
        g = lane >> 2
        t2 = (lane & 3) << 1
        return dict(a_ty="i32", a_elems=2, b_ty="i32", b_elems=2,
                    a=[(g, t2), (g + 8, t2), (g, t2 + 8), (g + 8, t2 + 8)],
                    b=[(g, t2), (g, t2 + 8)],
                    c=[(g, t2), (g, t2 + 1), (g + 8, t2), (g + 8, t2 + 1)])

    def function_attrs(self, low) -> list:
        attrs = [f'"nvvm.maxntid"="{low.T}"']
        cap = low.fn.constexprs.get("maxnreg")
        if cap:
            # the `maxnreg` launch option (jit.LAUNCH_OPTIONS; in the specialisation, so in the cache key)
            cap = int(cap)
            if not 16 <= cap <= 255:
                raise CompileError(f"maxnreg must be in 16..255, got {cap}", kernel=low.fn.name,
                                   target=self.target.name)
            attrs.append(f'"nvvm.maxnreg"="{cap}"')
        return attrs

    # Masked 16/8/4-byte chunk accesses as predicated PTX instructions (`@p ld.global.v4.b32`): a branch
    # around each load would keep ptxas from issuing a tile's loads back to back, and memory-bound kernels
    # need every load of a step in flight at once. The words go through i32 registers; `other` is tied to
    # the outputs so lanes whose mask is 0 keep it. A "memory" clobber keeps LLVM from moving the asm across
    # stores and barriers (it cannot see that the asm reads memory).
    @staticmethod
    def _words(low, v: LV, vt: str, nbytes: int):
        w = nbytes // 4
        iv = low.val(f"bitcast {vt} {v.ref} to <{w} x i32>", "i32", w)
        return w, [low.extract(iv, j).ref for j in range(w)]

    def masked_chunk_load(self, low, pty, ptr, mask, other, vt, nbytes):
        if nbytes not in (4, 8, 16):
            return None
        w = nbytes // 4
        _, others = self._words(low, other, vt, nbytes)
        addr = low.val(f"ptrtoint {pty} {ptr} to i64", "i64", 0)
        pm = low.val(f"zext i1 {mask} to i32", "i32", 0)
        outs = ", ".join(f"${j}" for j in range(w))
        vec = "" if w == 1 else f".v{w}"
        regs = outs if w == 1 else "{" + outs + "}"
        asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${w + 1}, 0; @p ld.global{vec}.b32 {regs}, [${w}]; }}")
        cons = ",".join(["=r"] * w + ["l", "r"] + [str(j) for j in range(w)] + ["~{memory}"])
        sty = "i32" if w == 1 else "{ " + ", ".join(["i32"] * w) + " }"     # one output: a plain value
        args = ", ".join([f"i64 {addr.ref}", f"i32 {pm.ref}"] + [f"i32 {o}" for o in others])
        res = low.val(f'call {sty} asm sideeffect "{asm}", "{cons}"({args})', "i32" if w == 1 else "{w}", 0)
        words = [res] if w == 1 else [low.val(f"extractvalue {sty} {res.ref}, {j}", "i32", 0) for j in range(w)]
        iv = low.build_vector(words, "i32", ())
        return low.val(f"bitcast <{w} x i32> {iv.ref} to {vt}", "?", 0).ref

    def masked_chunk_store(self, low, pty, ptr, mask, v, vt, nbytes):
        if nbytes not in (4, 8, 16):
            return False
        w, words = self._words(low, v, vt, nbytes)
        addr = low.val(f"ptrtoint {pty} {ptr} to i64", "i64", 0)
        pm = low.val(f"zext i1 {mask} to i32", "i32", 0)
        ins = ", ".join(f"${j + 2}" for j in range(w))
        vec = "" if w == 1 else f".v{w}"
        regs = ins if w == 1 else "{" + ins + "}"
        asm = f"{{ .reg .pred p; setp.ne.b32 p, $1, 0; @p st.global{vec}.b32 [$0], {regs}; }}"
        cons = ",".join(["l", "r"] + ["r"] * w + ["~{memory}"])
        args = ", ".join([f"i64 {addr.ref}", f"i32 {pm.ref}"] + [f"i32 {o}" for o in words])
        low.emit(f'call void asm sideeffect "{asm}", "{cons}"({args})')
        return True


class NvptxLowering(WarpgroupMma, AsyncCopies, GpuLowering):
    """The shared GPU lowering with NVIDIA's own matrix paths: warpgroup MMAs and cp.async / TMA operand copies
    (backends/nvidia/), behind GpuLowering's hook points."""

    def __init__(self, fn, target, hooks):
        super().__init__(fn, target, hooks)
        self._tma_nbars = 0         # mbarriers of the TMA-fed async regions (placed last: _TMA_BASE)
        self._tma_deferred = []     # TMA_PIPE: a loop step's copies, issued after its dot's MMAs (_tma_load)


def lower_to_nvptx(fn, target) -> tuple[str, dict]:
    """(LLVM IR text, launch metadata) for one kernel."""
    low = NvptxLowering(fn, target, NvptxHooks(target))
    text = low.lower()
    return text, {"num_threads": low.T, "shared_bytes": low.smem_bytes}


# ------------------------------------------------------------------------------------------ ptxas
def _wheel_ptxas():
    """ptxas from the nvidia-cuda-nvcc wheel: nvidia/cu13/bin/ptxas on the CUDA 13 line (the [cuda] extra's),
    nvidia/cuda_nvcc/bin/ptxas on the 12 line; `nvidia` is a namespace package spread over site directories."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in list(spec.submodule_search_locations or ()) if spec else ():
        for sub in ("cu13", "cuda_nvcc"):
            p = os.path.join(root, sub, "bin", "ptxas")
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    return None


def find_ptxas():
    """ptxas from $JITKERN_PTXAS, the nvidia-cuda-nvcc wheel, CUDA_HOME, or PATH; None if there is none."""
    env = os.environ.get("JITKERN_PTXAS")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    p = _wheel_ptxas()
    if p is not None:
        return p
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "ptxas")):
            return os.path.join(home, "bin", "ptxas")
    return shutil.which("ptxas")


_ptxas_version_cache: dict = {}


def ptxas_version(path) -> str:
    """The ptxas release line (part of the cache key: a new ptxas makes new cubins)."""
    if path is None:
        return "none"
    hit = _ptxas_version_cache.get(path)
    if hit is None:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            hit = out.strip().splitlines()[-1] if out.strip() else "unknown"
        except (OSError, subprocess.SubprocessError):
            hit = "unknown"
        _ptxas_version_cache[path] = hit
    return hit


def ptx_to_cubin(ptx: bytes, arch: str, *, describe: str = "") -> bytes:
    """Assembles PTX for `arch` (e.g. sm_90a) with ptxas; raises CompileError with ptxas's message."""
    path = find_ptxas()
    if path is None:
        raise CompileError("no ptxas found (install the [cuda] extra, or set JITKERN_PTXAS / CUDA_HOME)",
                           target=arch)
    with tempfile.TemporaryDirectory(prefix="jitkern-ptxas-") as d:
        src = os.path.join(d, "k.ptx")
        dst = os.path.join(d, "k.cubin")
        with open(src, "wb") as f:
            f.write(ptx)
        try:
            r = subprocess.run([path, f"-arch={arch}", "-O3", src, "-o", dst], capture_output=True, text=True,
                               timeout=600)
        except subprocess.TimeoutExpired:
            raise CompileError(f"ptxas timed out on {describe}", target=arch) from None
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip()[-2000:]
            raise CompileError(f"ptxas rejected the PTX of {describe}: {msg}", target=arch)
        with open(dst, "rb") as f:
            return f.read()


def ptx_digest(ptx: bytes) -> str:
    return hashlib.sha256(ptx).hexdigest()[:16]


__all__ = ["NvptxHooks", "lower_to_nvptx", "find_ptxas", "ptxas_version", "ptx_to_cubin", "elem_ty"]


# ------------------------------------------------------------------------------------------ backend
class NvptxBackend(GpuBackend):
    """CUDA targets: LLVM IR -> PTX (isolated LLVM) -> cubin (ptxas, when present), loaded by runtime/cuda.py.
    The key leaves ptxas out: the PTX (from our LLVM, in the key) is the artifact of record and the ptxas release
    that made the cubin is recorded in the entry's meta; a cubin the driver refuses falls back to that PTX, so a
    cache filled by `jitkern build` with one ptxas loads with no compile where another ptxas (or none) is
    installed."""
    family = "cuda"
    artifact = "kernel.cubin"
    tuning_entries = ("ldmatrix", "ldmatrix_trans", "wgmma_swizzle", "wgmma_pipe", "tma_pipe", "frag_ops", "cp_async",
                      "mma_unroll", "row_slots", "pin_operands", "pin_regs", "a_from_rows", "costage", "fast_exp",
                      "reduce_direct", "reduce_one_each", "wg_sums")

    def lower(self, fn, target) -> tuple:
        return lower_to_nvptx(fn, target)

    def compile(self, fn, target, emit, describe, kernel_name, spec) -> tuple:
        llvm_ir, launch_meta = lower_to_nvptx(fn, target)
        ptx = self.llvm(llvm_ir, target, ("asm",), describe, kernel_name, spec)["asm"]
        artifacts = {**self.sources(fn, llvm_ir), "kernel.ptx": ptx}
        if find_ptxas() is not None and not os.environ.get("JITKERN_NO_PTXAS"):
            artifacts["kernel.cubin"] = ptx_to_cubin(ptx, target.cpu, describe=describe)
        return artifacts, {"launch": launch_meta,
                           "ptxas": "none" if "kernel.cubin" not in artifacts else ptxas_version(find_ptxas())}

    def runtime(self):
        from ..runtime import cuda
        return cuda

    def runs(self, target) -> str:
        return "on its GPU; build anywhere"


BACKEND = NvptxBackend()
