"""Crash-isolated compilation (jitkern.isolate): results, error paths, worker restarts."""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import pytest

import llvmlite.binding as llvm

from jitkern import isolate
from jitkern.errors import CompileError, JitkernError
from jitkern.isolate import compile_llvm_ir, run_isolated

TRIPLE = "x86_64-unknown-linux-gnu"
AVX2 = "+avx2,+fma,+f16c"

# y[i] = a * x[i] + y[i] for i < n: a loop the O3 pipeline vectorises (ymm with AVX2).
AXPY_IR = """
define void @jk_axpy(ptr noalias %x, ptr noalias %y, float %a, i64 %n) {
entry:
  %nonempty = icmp sgt i64 %n, 0
  br i1 %nonempty, label %loop, label %exit
loop:
  %i = phi i64 [ 0, %entry ], [ %inext, %loop ]
  %px = getelementptr inbounds float, ptr %x, i64 %i
  %py = getelementptr inbounds float, ptr %y, i64 %i
  %vx = load float, ptr %px, align 4
  %vy = load float, ptr %py, align 4
  %m = fmul contract float %vx, %a
  %s = fadd contract float %m, %vy
  store float %s, ptr %py, align 4
  %inext = add nuw nsw i64 %i, 1
  %more = icmp slt i64 %inext, %n
  br i1 %more, label %loop, label %exit
exit:
  ret void
}
"""

# Parses and verifies, but x86 instruction selection has no pattern for the AVX-512 rcp14
# intrinsic on a target without AVX-512: LLVM prints "LLVM ERROR: Cannot select" and aborts.
ABORTING_IR = """
declare <4 x float> @llvm.x86.avx512.rcp14.ps.128(<4 x float>, <4 x float>, i8)
define <4 x float> @jk_rcp(<4 x float> %x) {
  %r = call <4 x float> @llvm.x86.avx512.rcp14.ps.128(<4 x float> %x, <4 x float> %x, i8 -1)
  ret <4 x float> %r
}
"""

# The return type does not match `ret`: a parse error (a Python exception in the worker).
MALFORMED_IR = "define i32 @jk_bad(i32 %x) {\n  ret i64 0\n}\n"

# Parses, but the verifier rejects it: %x does not dominate its use in %join.
UNVERIFIABLE_IR = """
define i32 @jk_unverified(i1 %c) {
entry:
  br i1 %c, label %then, label %join
then:
  %x = add i32 1, 2
  br label %join
join:
  ret i32 %x
}
"""


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    """Every test starts and ends without workers, with the default environment."""
    for name in ("JITKERN_COMPILE_INPROCESS", "JITKERN_COMPILE_WORKERS", "JITKERN_COMPILE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    isolate.shutdown_workers()
    yield
    isolate.shutdown_workers()


def _run_axpy_object(obj: bytes, n: int, seed: int) -> None:
    """Load the object with ORC (add_object_img), run it and compare with numpy."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine()
    lljit = llvm.create_lljit_compiler(tm)
    lib = (
        llvm.JITLibraryBuilder()
        .add_object_img(obj)
        .export_symbol("jk_axpy")
        .link(lljit, f"axpy_{seed}")
    )
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64)(
        lib["jk_axpy"]
    )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    a = np.float32(rng.uniform(0.5, 2.0))
    want = a * x + y
    fn(x.ctypes.data, y.ctypes.data, float(a), n)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


def test_compile_avx2_object_assembly_and_optimised_ir():
    out = compile_llvm_ir(
        AXPY_IR, triple=TRIPLE, cpu="x86-64", features=AVX2, emit=("obj", "asm", "opt_ll")
    )
    assert set(out) == {"obj", "asm", "opt_ll"}
    assert out["obj"][:4] == b"\x7fELF"
    asm = out["asm"].decode()
    assert "ymm" in asm and "vfmadd" in asm, asm
    opt_ll = out["opt_ll"].decode()
    assert "<8 x float>" in opt_ll  # the O3 loop vectoriser ran with the AVX2 target machine
    assert f'target triple = "{TRIPLE}"' in opt_ll
    _run_axpy_object(out["obj"], n=1003, seed=1)


def test_compile_baseline_has_no_avx():
    out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features="", emit=("asm", "obj"))
    asm = out["asm"].decode()
    assert "ymm" not in asm and "vfmadd" not in asm
    assert "xmm" in asm
    assert out["obj"][:4] == b"\x7fELF"
    _run_axpy_object(out["obj"], n=37, seed=2)


def test_opt_level_zero_keeps_scalar_loop():
    out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features=AVX2, opt=0, emit=("opt_ll",))
    assert "<8 x float>" not in out["opt_ll"].decode()


def test_worker_is_reused_across_compiles():
    compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features="")
    pids = isolate.worker_pids()
    assert len(pids) == 1 and pids[0] != os.getpid()
    compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features=AVX2)
    assert isolate.worker_pids() == pids


@pytest.mark.parametrize("bad_ir, needle", [(MALFORMED_IR, "parsing error"), (UNVERIFIABLE_IR, "does not dominate")])
def test_python_errors_come_back_without_killing_the_worker(bad_ir, needle):
    compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features="")
    pids = isolate.worker_pids()
    with pytest.raises(CompileError) as info:
        compile_llvm_ir(bad_ir, triple=TRIPLE, cpu="x86-64", features="", describe="jk_bad[i32] on x86-64")
    err = info.value
    assert isinstance(err, JitkernError)
    assert "jk_bad[i32] on x86-64" in str(err)
    assert needle in str(err).lower()
    assert err.target is not None and TRIPLE in err.target
    assert isolate.worker_pids() == pids  # same worker survived
    out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features="")
    assert out["obj"][:4] == b"\x7fELF"


def test_llvm_abort_is_isolated_and_worker_restarts():
    compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features="")
    (old_pid,) = isolate.worker_pids()
    with pytest.raises(CompileError) as info:
        compile_llvm_ir(
            ABORTING_IR,
            triple=TRIPLE,
            cpu="x86-64",
            features=AVX2,
            describe="jk_rcp[f32x4] on cpu-x86_64-avx2",
            kernel="jk_rcp",
            specialization="f32x4",
        )
    err = info.value
    msg = str(err)
    assert "jk_rcp[f32x4] on cpu-x86_64-avx2" in msg
    assert "SIGABRT" in msg
    assert "LLVM ERROR" in err.stderr_tail and "Cannot select" in err.stderr_tail
    assert "LLVM ERROR" in msg
    assert (err.kernel, err.specialization) == ("jk_rcp", "f32x4")
    assert isolate.worker_pids() == []  # the dead worker was reaped
    # We are still alive, and the next compile transparently gets a new worker.
    out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features=AVX2, emit=("obj",))
    assert out["obj"][:4] == b"\x7fELF"
    (new_pid,) = isolate.worker_pids()
    assert new_pid != old_pid


def test_segfault_in_worker_is_isolated():
    with pytest.raises(CompileError) as info:
        run_isolated("ctypes:string_at", 0, describe="segv probe")
    assert "segv probe" in str(info.value) and "SIGSEGV" in str(info.value)
    assert run_isolated("math:hypot", 3.0, 4.0) == 5.0


def test_run_isolated_calls_and_forwards_exceptions():
    assert run_isolated("os:getpid") != os.getpid()
    assert run_isolated("jitkern.isolate:EMIT_KINDS.index", "asm") == 1
    with pytest.raises(CompileError) as info:
        run_isolated("math:sqrt", -1.0, describe="sqrt probe")
    assert "sqrt probe" in str(info.value) and "ValueError" in str(info.value)
    with pytest.raises(CompileError, match="module:function"):
        run_isolated("no_colon_here")


def test_run_isolated_abort_names_the_description():
    with pytest.raises(CompileError) as info:
        run_isolated("os:abort", describe="abort probe on cuda-sm_90a")
    assert "abort probe on cuda-sm_90a" in str(info.value) and "SIGABRT" in str(info.value)
    assert run_isolated("math:sqrt", 9.0) == 3.0


def test_worker_exit_reports_exit_code():
    with pytest.raises(CompileError, match="exited with code 7"):
        run_isolated("os:_exit", 7, describe="exit probe")
    assert run_isolated("math:sqrt", 16.0) == 4.0


def test_timeout_kills_worker(monkeypatch):
    # warm start first, under the default timeout: starting a worker alone takes ~0.45 s on a loaded host,
    # so the 0.5 s timeout below measures only the call itself
    run_isolated("math:sqrt", 1.0)
    monkeypatch.setenv("JITKERN_COMPILE_TIMEOUT", "0.5")
    (old_pid,) = isolate.worker_pids()
    with pytest.raises(CompileError, match="timed out after 0.5 s") as info:
        run_isolated("time:sleep", 30, describe="sleepy kernel")
    assert "sleepy kernel" in str(info.value)
    assert isolate.worker_pids() == []
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)  # really gone (reaped), not left running
    monkeypatch.delenv("JITKERN_COMPILE_TIMEOUT")      # a fresh worker's start may itself take ~0.5 s
    assert run_isolated("math:sqrt", 4.0) == 2.0


def test_explicit_timeout_argument():
    with pytest.raises(CompileError, match="timed out"):
        run_isolated("time:sleep", 30, timeout=0.3)


def _kill_and_wait(pid: int) -> None:
    os.kill(pid, 9)
    # Wait until it is dead without reaping it (the pool's Popen does that).
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def test_worker_killed_while_idle_is_replaced():
    run_isolated("math:sqrt", 1.0)
    (pid,) = isolate.worker_pids()
    _kill_and_wait(pid)
    assert run_isolated("math:sqrt", 25.0) == 5.0
    assert isolate.worker_pids() not in ([], [pid])


def test_dead_worker_not_yet_noticed_gets_the_request_retried(monkeypatch):
    run_isolated("math:sqrt", 1.0)
    (pid,) = isolate.worker_pids()
    _kill_and_wait(pid)
    # Pretend the liveness check missed the death: the write then hits a broken pipe, which
    # must be retried on a fresh worker instead of failing the request.
    monkeypatch.setattr(isolate._Worker, "alive", lambda self: self.proc is not None)
    assert run_isolated("math:sqrt", 36.0) == 6.0
    monkeypatch.undo()
    (new_pid,) = isolate.worker_pids()
    assert new_pid != pid


def test_parallel_compiles_with_two_workers(monkeypatch):
    monkeypatch.setenv("JITKERN_COMPILE_WORKERS", "2")
    results: list = []
    errors: list = []

    def job(i: int) -> None:
        try:
            features = AVX2 if i % 2 else ""
            out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features=features, emit=("asm",))
            results.append((i, b"ymm" in out["asm"]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [(i, bool(i % 2)) for i in range(8)]
    assert 1 <= len(isolate.worker_pids()) <= 2


def test_inprocess_mode(monkeypatch):
    monkeypatch.setenv("JITKERN_COMPILE_INPROCESS", "1")
    out = compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="x86-64", features=AVX2, emit=("asm",))
    assert b"ymm" in out["asm"]
    assert isolate.worker_pids() == []
    assert run_isolated("os:getpid") == os.getpid()
    with pytest.raises(CompileError, match="jk_bad in-process"):
        compile_llvm_ir(MALFORMED_IR, triple=TRIPLE, cpu="x86-64", features="", describe="jk_bad in-process")


def test_bad_arguments_are_rejected_before_any_work():
    with pytest.raises(ValueError, match="emit"):
        compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="", features="", emit=("elf",))
    with pytest.raises(ValueError, match="opt"):
        compile_llvm_ir(AXPY_IR, triple=TRIPLE, cpu="", features="", opt=4)
    assert isolate.worker_pids() == []


def test_compile_error_pickles_with_attributes():
    import pickle

    err = CompileError("boom", kernel="k", specialization="s", target="t", stderr_tail="LLVM ERROR: x")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.kernel, back.specialization, back.target, back.stderr_tail) == (
        "boom", "k", "s", "t", "LLVM ERROR: x"
    )


# --- GPU targets (codegen only; nothing runs). Both need a re-parse per emission and the SPIR-V
# backend a fresh TargetMachine per module, or LLVM aborts / segfaults.

AMDGPU_IR = """
declare i32 @llvm.amdgcn.workitem.id.x()
define amdgpu_kernel void @vadd(ptr addrspace(1) noalias readonly %a, ptr addrspace(1) noalias %c, i32 %n) #0 {
entry:
  %tid = call i32 @llvm.amdgcn.workitem.id.x()
  %inb = icmp ult i32 %tid, %n
  br i1 %inb, label %body, label %exit
body:
  %i64 = zext i32 %tid to i64
  %pa = getelementptr inbounds float, ptr addrspace(1) %a, i64 %i64
  %pc = getelementptr inbounds float, ptr addrspace(1) %c, i64 %i64
  %va = load float, ptr addrspace(1) %pa, align 4
  %s = fadd float %va, 1.0
  store float %s, ptr addrspace(1) %pc, align 4
  br label %exit
exit:
  ret void
}
attributes #0 = { "amdgpu-flat-work-group-size"="1,256" }
"""
SPIRV_IR = """
@.str.a = private unnamed_addr constant [2 x i8] c"A\\00", align 1
declare target("spirv.VulkanBuffer", [0 x float], 12, 1) @llvm.spv.resource.handlefrombinding.tspirv.VulkanBuffer_a0f32_12_1t(i32, i32, i32, i32, ptr)
declare ptr addrspace(11) @llvm.spv.resource.getpointer.p11.tspirv.VulkanBuffer_a0f32_12_1t(target("spirv.VulkanBuffer", [0 x float], 12, 1), i32)
declare i32 @llvm.spv.thread.id.i32(i32)
define void @main() #0 {
entry:
  %ha = call target("spirv.VulkanBuffer", [0 x float], 12, 1) @llvm.spv.resource.handlefrombinding.tspirv.VulkanBuffer_a0f32_12_1t(i32 0, i32 0, i32 1, i32 0, ptr @.str.a)
  %tid = call i32 @llvm.spv.thread.id.i32(i32 0)
  %pa = call ptr addrspace(11) @llvm.spv.resource.getpointer.p11.tspirv.VulkanBuffer_a0f32_12_1t(target("spirv.VulkanBuffer", [0 x float], 12, 1) %ha, i32 %tid)
  %a = load float, ptr addrspace(11) %pa, align 4
  %s = fadd float %a, 1.0
  store float %s, ptr addrspace(11) %pa, align 4
  ret void
}
attributes #0 = { "hlsl.numthreads"="64,1,1" "hlsl.shader"="compute" }
"""


def test_amdgpu_object_and_assembly_from_one_request():
    out = compile_llvm_ir(
        AMDGPU_IR, triple="amdgcn-amd-amdhsa", cpu="gfx942", features="", emit=("obj", "asm"),
        describe="vadd on hip-gfx942",
    )
    assert out["obj"][:4] == b"\x7fELF"
    assert b".amdhsa_kernel vadd" in out["asm"] and b"global_load_dword" in out["asm"]


def test_spirv_repeated_compiles_in_one_worker():
    for _ in range(5):  # a reused SPIR-V TargetMachine segfaults around the 4th module
        out = compile_llvm_ir(
            SPIRV_IR, triple="spirv1.6-unknown-vulkan1.3-compute", cpu="", features="",
            emit=("obj", "asm"),
        )
        assert out["obj"][:4] == bytes.fromhex("03022307")  # SPIR-V magic 0x07230203, little-endian
        assert b"OpEntryPoint GLCompute" in out["asm"]
    assert len(isolate.worker_pids()) == 1
