"""The compile driver: error locations, crash isolation, cache rebuilds, tier selection, asm per tier, CLI."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jitkern as jk
from jitkern import compiler, ir
from jitkern.errors import CompileError
from jitkern.language import CompilationError
from targets import get_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


@jk.kernel
def _scale(x, out, n, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, jk.load(x + offs, mask=m) * 3.0, mask=m)


@jk.kernel
def _bad_shapes(x, out, BLOCK: jk.constexpr):
    a = jk.arange(0, BLOCK)
    b = jk.arange(0, BLOCK + 1)
    jk.store(out + a, a + b)


@jk.kernel
def _bad_name(x, out):
    jk.store(out, undefined_thing)  # noqa: F821


_F32P = ir.TileType(ir.PtrType(ir.f32))
_SPEC = [("x", _F32P), ("out", _F32P), ("n", ir.TileType(ir.i32))]


def test_errors_point_at_the_kernel_line():
    with pytest.raises(CompilationError) as e:
        _bad_shapes.compile(np.zeros(4, np.float32), np.zeros(4, np.float32), BLOCK=4)
    msg = str(e.value)
    assert "test_compiler.py:" in msg and "a + b" in msg and "do not broadcast" in msg
    line = int(msg.split("test_compiler.py:")[1].split(":")[0])
    src = open(__file__).read().splitlines()[line - 1]
    assert "jk.store(out + a, a + b)" in src
    with pytest.raises(CompilationError, match="undefined_thing"):
        _bad_name.compile(np.zeros(4, np.float32), np.zeros(4, np.float32))


def test_ir_verifier_rejects_use_before_def():
    v = ir.Value(ir.TileType(ir.f32))
    body = ir.Block(ops=[ir.Op("unary", [v], [ir.Value(ir.TileType(ir.f32))], {"op": "neg"}),
                         ir.Op("const", [], [v], {"value": 1.0})])
    with pytest.raises(ir.VerifyError, match="before definition"):
        ir.verify(ir.Function("f", [], body))


def test_llvm_abort_becomes_compile_error(monkeypatch):
    # LLVM 22 aborts (SIGABRT) when asked to select an AVX-512 intrinsic for a target without it
    # (seen with this llvmlite wheel). The abort must stay in the compile worker.
    bad = textwrap.dedent("""
        declare <4 x float> @llvm.x86.avx512.rcp14.ps.128(<4 x float>, <4 x float>, i8)
        define void @{name}(ptr %args, i64 %b, i64 %e) {{
          %v = call <4 x float> @llvm.x86.avx512.rcp14.ps.128(<4 x float> zeroinitializer, <4 x float> zeroinitializer, i8 -1)
          store <4 x float> %v, ptr %args
          ret void
        }}
    """)
    monkeypatch.setenv("JITKERN_ALWAYS_COMPILE", "1")
    from jitkern.backends import cpu as cpu_backend     # the CPU backend's lowering, which its compile calls
    monkeypatch.setattr(cpu_backend, "lower_to_llvm", lambda fn, target: bad.format(name=fn.name))
    t = get_target("sse2")
    with pytest.raises(CompileError) as e:
        compiler.compile_kernel(_scale, _SPEC, {"BLOCK": 8}, t, load=False)
    msg = str(e.value)
    assert "_scale" in msg and "BLOCK=8" in msg and "sse2" in msg
    assert "SIGABRT" in msg or "LLVM ERROR" in msg
    monkeypatch.undo()
    # the process and the compile service survive: the next compile works
    x = np.arange(10, dtype=np.float32)
    out = np.zeros_like(x)
    from jitkern.runtime.launch import launch
    launch(_scale, (1,), (x, out, 10), {"BLOCK": 16}, target=t)
    np.testing.assert_array_equal(out, 3 * x)


def test_corrupted_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    compiler.reset_kernel_cache()
    try:
        t = get_target("sse2")
        ck = compiler.compile_kernel(_scale, _SPEC, {"BLOCK": 32}, t)
        assert not ck.from_cache
        compiler.reset_kernel_cache()
        ck2 = compiler.compile_kernel(_scale, _SPEC, {"BLOCK": 32}, t)
        assert ck2.from_cache
        objs = list(tmp_path.rglob("kernel.o"))
        assert len(objs) == 1
        data = objs[0].read_bytes()
        objs[0].write_bytes(data[: len(data) // 2])          # truncated entry
        compiler.reset_kernel_cache()
        ck3 = compiler.compile_kernel(_scale, _SPEC, {"BLOCK": 32}, t)
        assert not ck3.from_cache, "a truncated object must be detected and rebuilt"
        x = np.random.default_rng(0).standard_normal(77).astype(np.float32)
        out = np.zeros_like(x)
        from jitkern.runtime.launch import launch
        launch(_scale, (3,), (x, out, 77), {"BLOCK": 32}, target=t)
        np.testing.assert_allclose(out, 3 * x)
    finally:
        compiler.reset_kernel_cache()


def test_asm_registers_per_tier():
    counts = {}
    for name in ("sse2", "avx2", "avx512"):
        ck = compiler.compile_kernel(_scale, _SPEC, {"BLOCK": 64}, get_target(name), load=False, emit=("obj", "asm"))
        asm = ck.asm()
        counts[name] = {r: asm.count("%" + r) for r in ("xmm", "ymm", "zmm")}
    assert counts["sse2"]["xmm"] > 0 and counts["sse2"]["ymm"] == 0 and counts["sse2"]["zmm"] == 0
    assert counts["avx2"]["ymm"] > 0 and counts["avx2"]["zmm"] == 0
    assert counts["avx512"]["zmm"] > 0


def _run_py(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([PY, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


_LAUNCH = textwrap.dedent("""
    import numpy as np
    from tests.test_compiler import _scale
    x = np.ones(8, np.float32); o = np.zeros(8, np.float32)
    _scale[(1,)](x, o, 8, BLOCK=8)
    print("ran", o[0])
""")


def test_forced_tier_the_host_cannot_run_fails_closed():
    r = _run_py(_LAUNCH, JITKERN_CPU_TIER="avx512", JITKERN_CPU_MASK_FEATURES="avx512f,avx512bw")
    assert r.returncode != 0 and "ran" not in r.stdout
    assert "avx512" in r.stderr and "missing" in r.stderr and "avx512f" in r.stderr
    r = _run_py(_LAUNCH, JITKERN_CPU_TIER="nonsense")
    assert r.returncode != 0 and "not a CPU tier" in r.stderr
    r = _run_py(_LAUNCH, JITKERN_CPU_TIER="sse2")
    assert r.returncode == 0 and "ran 3.0" in r.stdout, r.stderr


def test_cli_commands(tmp_path):
    env = {"JITKERN_CACHE_DIR": str(tmp_path)}
    r = _run_py("from jitkern.cli import main; main(['targets'])", **env)
    assert r.returncode == 0 and "selected CPU tier" in r.stdout and "sm_90a" in r.stdout
    r = _run_py("from jitkern.cli import main; main(['targets'])", JITKERN_CPU_MASK_FEATURES="avx512f", **env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("avx512 ")][0]
    assert "compile-only" in line and "avx512f" in line
    spec = "tests/test_compiler.py:_scale"
    r = _run_py(f"from jitkern.cli import main; main(['ir', '{spec}', '--sig', 'x=*f32,out=*f32,n=i32', "
                f"'--const', 'BLOCK=16', '--llvm'])", **env)
    assert r.returncode == 0 and "arange" in r.stdout and "define void" in r.stdout, r.stderr
    r = _run_py(f"import sys; from jitkern.cli import main; sys.exit(main(['asm', '{spec}', '--sig', "
                f"'x=*f32,out=*f32,n=i32', '--const', 'BLOCK=64', '--target', 'avx512']))", **env)
    assert r.returncode == 0 and "zmm" in r.stdout, r.stderr
    r = _run_py(f"import sys; from jitkern.cli import main; sys.exit(main(['asm', '{spec}', '--sig', 'x=*f32']))",
                **env)
    assert r.returncode == 2 and "needs a type" in r.stderr
    r = _run_py("from jitkern.cli import main; main(['cache'])", **env)
    assert r.returncode == 0 and str(tmp_path) in r.stdout
    r = subprocess.run([PY, "-m", "jitkern", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "targets" in r.stdout and "build" in r.stdout
