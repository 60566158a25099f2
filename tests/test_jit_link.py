"""Linking compiled CPU objects into the process (jitkern/runtime/cpu.py load_object).

Seen on the H200 host (2026-12-02, tests/test_vnni.py; earlier tests/test_engine_cuda.py's CPU half): the whole
process aborted inside the JIT link with RuntimeDyldELF's `Assertion isInt<32>(RealOffset) failed` (the llvmlite
wheel has LLVM assertions on): RuntimeDyld's SectionMemoryManager maps an object's code and its constant pool
(.rodata) with separate mmaps, and in a busy address space (CUDA, torch, many JIT libraries) they can land more
than 2 GiB apart, out of reach of the code's 32-bit PC-relative constant loads. The test below builds that
address-space layout on purpose (a one-page hole above an 8 GiB reserve, every gap above filled) and links a
kernel whose code reads its constant pool; each case runs in a subprocess, since the failure mode is an abort.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jitkern as jk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a subprocess: leave a one-page hole at the top of an 8 GiB PROT_NONE reserve with every gap above it
# filled (top-down mmap layout), so that the next two small anonymous mmaps land > 2 GiB apart (one takes the
# hole, the other goes below the reserve).
_HOLES = textwrap.dedent("""
    import ctypes, mmap as _m
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    PAGE = _m.PAGESIZE
    FLAGS = _m.MAP_PRIVATE | _m.MAP_ANONYMOUS | 0x4000          # MAP_NORESERVE

    def _map(n, prot=0):
        p = libc.mmap(None, n, prot, FLAGS, -1, 0)
        if p is None or p == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
        return p

    def make_hole(reserve=8 << 30):
        r = _map(reserve)
        for size in (1 << 30, 64 << 20, 4 << 20, 256 << 10, 16 << 10, PAGE):
            while True:
                p = _map(size)
                if p < r:
                    libc.munmap(p, size)
                    break
        libc.munmap(r + reserve - PAGE, PAGE)

    # the layout works on this host only if two fresh one-page maps after make_hole() are > 2 GiB apart
    make_hole()
    a, b = _map(PAGE, 3), _map(PAGE, 3)
    if abs(a - b) <= 1 << 31:
        print("LAYOUT-NOT-TOP-DOWN", hex(a), hex(b))
        raise SystemExit(0)
""")


@jk.kernel
def _affine_k(x, y, n, BLOCK: jk.constexpr):
    o = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = o < n
    v = jk.load(x + o, mask=m, other=0.0)
    jk.store(y + o, v * 0.3711 + 1.2503, mask=m)      # constants: the code loads them from its .rodata


def _run(code, tmp_path):
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-c", _HOLES + textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="mmap layout built with Linux's top-down allocator")
def test_link_with_code_and_constants_far_apart(tmp_path):
    # before the fix: SIGABRT (RuntimeDyldELF: Assertion `isInt<32>(RealOffset)' failed); after: links and runs
    r = _run("""
        import numpy as np
        import jitkern.compiler as compiler
        from jitkern.runtime import launch as launch_mod
        from jitkern.runtime.cpu import load_object, runtime_target
        from tests.test_jit_link import _affine_k
        t = runtime_target()
        x = np.random.default_rng(5).standard_normal(203).astype(np.float32)
        y = np.zeros_like(x)
        with launch_mod.compile_only(t) as co:          # compiles in the worker, links nothing
            _affine_k[(4,)](x, y, 203, BLOCK=64)
        ck = co.compiled[0]
        obj = ck.artifacts["kernel.o"]
        assert b".rodata" in obj, "the kernel no longer has a constant pool: the test would prove nothing"
        for i in range(3):
            make_hole()
            load_object(obj, ck.symbol)
        make_hole()
        _affine_k[(4,)](x, y, 203, BLOCK=64)            # links this process's copy (after a hole) and runs it
        ref = x * np.float32(0.3711) + np.float32(1.2503)
        assert np.allclose(y, ref, rtol=1e-6, atol=1e-6), np.abs(y - ref).max()
        print("LINKED-AND-RAN")
    """, tmp_path)
    if "LAYOUT-NOT-TOP-DOWN" in r.stdout:
        pytest.skip("this host's mmap layout is not top-down: " + r.stdout.strip())
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "LINKED-AND-RAN" in r.stdout


def test_unresolvable_symbol_is_a_clear_error(tmp_path):
    # an object that calls a function the process does not have: a CompileError naming the symbol and the
    # kernel, and the JIT still links and runs kernels afterwards
    r = _run("""
        import numpy as np
        from jitkern.errors import CompileError
        from jitkern.isolate import compile_llvm_ir
        from jitkern.runtime.cpu import load_object, runtime_target
        from tests.test_jit_link import _affine_k
        t = runtime_target()
        ir = '''
        declare i64 @jk_test_no_such_function(i64)
        define void @jk_test_calls_missing(ptr %a, i64 %b, i64 %e) {
          %r = call i64 @jk_test_no_such_function(i64 %b)
          store i64 %r, ptr %a
          ret void
        }
        '''
        obj = compile_llvm_ir(ir, triple=t.triple, cpu=t.cpu, features=t.feature_string, emit=("obj",))["obj"]
        try:
            load_object(obj, "jk_test_calls_missing", describe="kernel jk_test_calls_missing for target " + t.name)
        except CompileError as e:
            print("ERROR:", e)
        else:
            print("NO ERROR")
        x = np.arange(70, dtype=np.float32); y = np.zeros_like(x)
        _affine_k[(2,)](x, y, 70, BLOCK=64)
        assert np.allclose(y, x * np.float32(0.3711) + np.float32(1.2503), rtol=1e-6, atol=1e-6)
        print("STILL-RUNS")
    """, tmp_path)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    err = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR:")]
    assert err, r.stdout + r.stderr[-2000:]
    assert "jk_test_no_such_function" in err[0] and "jk_test_calls_missing" in err[0], err[0]
    assert "STILL-RUNS" in r.stdout
