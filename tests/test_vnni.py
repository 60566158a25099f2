"""VNNI tiers (avx512-vnni: vpdpbusd on zmm; avx-vnni: VEX vpdpbusd on ymm) and arm64 SDOT/USDOT.

- the tiers exist, are listed by `jitkern targets` and fail closed when forced on a host without the feature;
- `jk.dot4` and the quantised GEMV/GEMM kernels compile to vpdpbusd (asm; runs on any host: compile-only);
- on hosts that can run a VNNI tier (filtered by can_run, as every op test is), dot4 gives the exact i32 sums
  (numpy), including inputs where pmaddubsw's int16 pair sums saturate, and the quantised matmul gives the same
  bits as the tier without VNNI of the same width (the integer dots are exact on both; the float work is the
  same), alone and in a batch.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import jitkern as jk
import jitkern.compiler as compiler
from engine.ops import quant
from jitkern.runtime import launch as launch_mod
from targets import cpu as tcpu
from targets import get_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VNNI_TIERS = ("avx-vnni", "avx512-vnni")
# a VNNI tier -> the tier of the same vector width without it (same float arithmetic)
BASE_TIER = {"avx-vnni": "avx2", "avx512-vnni": "avx512"}


def _runnable(names):
    return [n for n in names if tcpu.host_arch() == "x86_64" and tcpu.can_run(get_target(n))]


@jk.kernel
def _dot4_k(a, b, out, K: jk.constexpr):
    r = jk.program_id(0)
    o = r * K + jk.arange(0, K)
    jk.store(out + r * (K // 4) + jk.arange(0, K // 4), jk.dot4(jk.load(a + o), jk.load(b + o)))


@jk.kernel
def _dot4_axis_k(a, b, out, N: jk.constexpr, K: jk.constexpr):
    r = jk.program_id(0)
    o = r * (N * K) + jk.arange(0, N)[:, None] * K + jk.arange(0, K)[None, :]
    jk.store(out + r * (K // 4) + jk.arange(0, K // 4), jk.dot4(jk.load(a + o), jk.load(b + o), axis=0))


def _asm_of_launches(monkeypatch, target, fn):
    """Run fn() under compile_only(target); return {kernel name: assembly} of what it compiled."""
    orig = compiler.compile_kernel
    asms = {}

    def with_asm(kernel, params, consts, target=None, *, load=True, emit=("obj",)):
        ck = orig(kernel, params, consts, target, load=False, emit=("obj", "asm"))
        asms[kernel.__name__] = asms.get(kernel.__name__, "") + ck.asm()
        return ck

    monkeypatch.setattr(compiler, "compile_kernel", with_asm)
    with launch_mod.compile_only(target):
        fn()
    return asms


def test_tiers_listed_in_order():
    names = tcpu.cpu_tier_names("x86_64")
    assert names.index("avx2") < names.index("avx-vnni") < names.index("avx512") < names.index("avx512-vnni")
    t = get_target("avx512-vnni")
    assert t.has("avx512vnni") and t.has("avx512f") and t.vector_bits == 512
    t = get_target("avx-vnni")
    assert t.has("avxvnni") and not t.has("avx512f") and t.vector_bits == 256
    # selection: the best runnable tier, so a host with AVX-VNNI and no AVX-512 gets avx-vnni
    host = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avxvnni"})
    if tcpu.host_arch() == "x86_64":
        runnable = [t.name for t in tcpu.X86_TIERS if not tcpu.missing_features(t, host)]
        assert runnable[-1] == "avx-vnni"
        runnable = [t.name for t in tcpu.X86_TIERS
                    if not tcpu.missing_features(t, host | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})]
        assert runnable[-1] == "avx512"
        runnable = [t.name for t in tcpu.X86_TIERS if not tcpu.missing_features(
            t, host | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"})]
        assert runnable[-1] == "avx512-vnni"


# the Linux kernel's /proc/cpuinfo flags each x86 tier needs (an independent source: the kernel clears AVX / AVX-512
# flags when it does not save their register state, as LLVM's XGETBV check does)
_CPUINFO_FLAGS = {"avx2": ("avx", "avx2", "fma", "f16c"),
                  "avx-vnni": ("avx", "avx2", "fma", "f16c", "avx_vnni"),
                  "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
                  "avx512-vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")}


def _cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return None


@pytest.mark.skipif(tcpu.host_arch() != "x86_64" or _cpuinfo_flags() is None
                    or bool(os.environ.get("JITKERN_CPU_MASK_FEATURES")),
                    reason="x86-64 Linux without JITKERN_CPU_MASK_FEATURES: compares with /proc/cpuinfo")
def test_runnable_tiers_match_cpuinfo():
    # the VNNI run-time tests below are parametrised over can_run (LLVM's host features): on a host whose kernel
    # reports the VNNI flags they must run, not skip; on one without, the tier must not be offered
    flags = _cpuinfo_flags()
    for tier, need in _CPUINFO_FLAGS.items():
        assert tcpu.can_run(get_target(tier)) == all(f in flags for f in need), (tier, sorted(flags & set(need)))
    assert set(_runnable(VNNI_TIERS)) == {t for t in VNNI_TIERS if all(f in flags for f in _CPUINFO_FLAGS[t])}


@pytest.mark.skipif(tcpu.host_arch() != "x86_64", reason="x86-64 tiers")
@pytest.mark.parametrize("tier,feature", [("avx-vnni", "avxvnni"), ("avx512-vnni", "avx512vnni")])
def test_forced_vnni_tier_fails_closed(tmp_path, tier, feature):
    code = ("import numpy as np\nfrom tests.test_vnni import _dot4_k\n"
            "a = np.ones((1, 64), np.uint8); b = np.ones((1, 64), np.int8); o = np.zeros(16, np.int32)\n"
            "_dot4_k[(1,)](a, b, o, K=64)\nprint('ran', o[0])\n")
    env = dict(os.environ, JITKERN_CPU_TIER=tier, JITKERN_CPU_MASK_FEATURES=feature,
               JITKERN_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "ran" not in r.stdout
    assert tier in r.stderr and "missing" in r.stderr and feature in r.stderr
    r = subprocess.run([sys.executable, "-m", "jitkern", "targets"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith(tier + " ")][0]
    assert "compile-only" in line and feature in line


@pytest.mark.parametrize("signed", [False, True])
def test_dot4_asm_vpdpbusd(monkeypatch, tmp_path, signed):
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    dt = np.int8 if signed else np.uint8
    a, b, o = np.ones((2, 256), dt), np.ones((2, 256), np.int8), np.zeros(128, np.int32)
    for tier, reg in (("avx512-vnni", "%zmm"), ("avx-vnni", "%ymm")):
        asm = _asm_of_launches(monkeypatch, get_target(tier),
                               lambda: _dot4_k[(2,)](a, b, o, K=256))["_dot4_k"]
        lines = [ln for ln in asm.splitlines() if "vpdpbusd" in ln]
        assert lines and all(reg in ln for ln in lines), tier
        assert "pmaddubsw" not in asm and "pmaddwd" not in asm, tier
        if tier == "avx-vnni":
            assert all("{vex}" in ln for ln in lines)       # AVX-VNNI: the VEX encoding, no EVEX (no AVX-512)
    asm = _asm_of_launches(monkeypatch, get_target("avx2"), lambda: _dot4_k[(2,)](a, b, o, K=256))["_dot4_k"]
    assert "vpdpbusd" not in asm and "pmaddubsw" in asm


QUANT_CASES = [("q4_0", 1), ("q4_0", 8), ("q8_0", 1), ("q8_0", 8), ("q4_K", 1), ("q4_K", 8), ("q6_K", 4)]


def _matmul_launch(qt, M, target):
    N, K = 32, 512
    raw = np.zeros(N * quant.row_bytes(qt, K), np.uint8)
    x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    return lambda: quant.matmul_q(x, raw, qt, N, K, target=target)


@pytest.mark.parametrize("tier", VNNI_TIERS)
def test_quant_kernels_asm_vpdpbusd(monkeypatch, tmp_path, tier):
    # the int8 GEMV (M = 1) and GEMM (M > 1) kernels: every integer dot is a vpdpbusd, no pmaddubsw left
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    t = get_target(tier)
    for qt, M in QUANT_CASES:
        asms = _asm_of_launches(monkeypatch, t, _matmul_launch(qt, M, t))
        mm = {k: v for k, v in asms.items() if "quantize" not in k}
        assert mm, (qt, M)
        for name, asm in mm.items():
            assert "vpdpbusd" in asm, (tier, qt, M, name)
            assert "pmaddubsw" not in asm, (tier, qt, M, name)


@pytest.mark.parametrize("tier,instr", [("arm64-dotprod", "\tsdot\t"), ("arm64-i8mm", "\tusdot\t")])
def test_quant_kernels_asm_arm_dot(monkeypatch, tmp_path, tier, instr):
    # arm64: SDOT (dotprod; u8 x s8 through a - 128) / USDOT (i8mm) in every quantised GEMV/GEMM kernel
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    t = get_target(tier)
    for qt, M in QUANT_CASES:
        asms = _asm_of_launches(monkeypatch, t, _matmul_launch(qt, M, t))
        for name, asm in asms.items():
            if "quantize" in name:
                continue
            want = "dot\t" if qt in ("q8_0", "q6_K") else instr    # s8 weights: s8 x s8 is SDOT on both
            assert want in asm, (tier, qt, M, name)


@pytest.mark.parametrize("tier", _runnable(VNNI_TIERS) or [pytest.param("none", marks=pytest.mark.skip(
    reason="this host runs no VNNI tier (compile-only here; the asm tests cover the lowering)"))])
def test_dot4_exact_on_vnni(tier):
    t = get_target(tier)
    rng = np.random.default_rng(21)
    for K in (16, 32, 64, 256, 96):
        # u8: full range, with rows where pmaddubsw's pair sums saturate int16 (255 * 127 * 2 > 32767)
        a = rng.integers(0, 256, (6, K)).astype(np.uint8)
        b = rng.integers(-128, 128, (6, K)).astype(np.int8)
        a[0], b[0] = 255, 127
        a[1], b[1] = 255, -128
        o = np.full((6, K // 4), -7, np.int32)
        launch_mod.launch(_dot4_k, (6,), (a, b, o), {"K": K}, target=t)
        want = (a.astype(np.int64) * b.astype(np.int64)).reshape(6, K // 4, 4).sum(-1)
        np.testing.assert_array_equal(o, want)
        assert want[0, 0] == 4 * 255 * 127 and want[1, 0] == -4 * 255 * 128
        # i8 a: full range including -128 x -128 (the pmaddubsw path's sign transfer wraps there)
        a = rng.integers(-128, 128, (6, K)).astype(np.int8)
        a[0], b[0] = -128, -128
        o[:] = -7
        launch_mod.launch(_dot4_k, (6,), (a, b, o), {"K": K}, target=t)
        np.testing.assert_array_equal(o, (a.astype(np.int64) * b.astype(np.int64)).reshape(6, K // 4, 4).sum(-1))
        # axis form: 4 slices of full-range u8 x s8 summed in i32 (no int16 stage)
        a = rng.integers(0, 256, (5, 4, K)).astype(np.uint8)
        b = rng.integers(-128, 128, (5, 4, K)).astype(np.int8)
        a[0], b[0] = 255, -128
        o = np.full((5, K // 4), -7, np.int32)
        launch_mod.launch(_dot4_axis_k, (5,), (a, b, o), {"N": 4, "K": K}, target=t)
        want = (a.astype(np.int64) * b.astype(np.int64)).reshape(5, 4, K // 4, 4).sum((1, 3))
        np.testing.assert_array_equal(o, want)


def _random_raw(qt, N, K, rng):
    """Random GGUF blocks with finite f16 scales (gguf's quantiser for the types it has)."""
    import gguf
    w = rng.standard_normal((N, K)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qt.upper())))


@pytest.mark.parametrize("tier", _runnable(VNNI_TIERS) or [pytest.param("none", marks=pytest.mark.skip(
    reason="this host runs no VNNI tier (compile-only here; the asm tests cover the lowering)"))])
@pytest.mark.parametrize("qt", ["q4_0", "q4_1", "q8_0"])
def test_quant_matmul_vnni_same_bits_as_base_tier(tier, qt):
    # the integer dots are exact on both tiers (inside dot4's contract), so the outputs are the same bits;
    # and a row alone equals the row in a batch (batch invariance on the VNNI tier)
    import gguf
    t, base = get_target(tier), get_target(BASE_TIER[tier])
    assert tcpu.can_run(base)       # its features are a subset of the VNNI tier's: never a skipped comparison
    rng = np.random.default_rng(22)
    N, K = 40, 352
    raw = _random_raw(qt, N, K, rng).reshape(-1)
    x = rng.standard_normal((7, K)).astype(np.float32)
    y = quant.matmul_q(x, raw, qt, N, K, target=t)
    # oracle: the int8 activations (quantize_q8's natural layout) dequantised, times the dequantised weights in
    # float64; left to the float32 rounding only
    qx, d, _ = quant.quantize_q8(x, target=t)
    xd = (qx.astype(np.float64).reshape(7, -1, 32) * d[..., None]).reshape(7, K)
    w = np.asarray(gguf.quants.dequantize(raw.reshape(N, -1), getattr(gguf.GGMLQuantizationType, qt.upper())),
                   np.float64).reshape(N, K)
    assert np.all(np.abs(y - xd @ w.T) <= 1e-5 * (np.abs(xd) @ np.abs(w).T)), tier
    np.testing.assert_array_equal(y, quant.matmul_q(x, raw, qt, N, K, target=base))
    for i in (0, 3, 6):
        np.testing.assert_array_equal(quant.matmul_q(x[i], raw, qt, N, K, target=t), y[i])


@pytest.mark.parametrize("tier,reg", [("avx512-vnni", "%zmm"), ("avx-vnni", "%ymm")])
def test_cli_asm_shows_vpdpbusd(tmp_path, tier, reg):
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "jitkern", "asm", "tests/test_vnni.py:_dot4_k", "--sig",
                        "a=*u8,b=*i8,out=*i32", "--const", "K=128", "--target", tier], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "vpdpbusd" in ln]
    assert lines and all(reg in ln for ln in lines)


# -------------------------------------------------------------------- the 4-bit GEMM's integer-dot route switch
X86_TIERS = ("avx2", "avx512", "avx-vnni", "avx512-vnni")


def _gemm_asm(monkeypatch, tier, qt, route):
    import re
    monkeypatch.setattr(quant, "QMM_GEMM_DOT_ROUTE", route)
    t = get_target(tier)
    asm = _asm_of_launches(monkeypatch, t, _matmul_launch(qt, 8, t))["_qmm_kernel"]
    return re.sub(r"_qmm_kernel_[0-9a-f]+", "_qmm_kernel", asm)      # the symbol names the specialisation


@pytest.mark.parametrize("qt", ["q4_0", "q4_1"])
def test_gemm_route_switch_asm(monkeypatch, tmp_path, qt):
    # quant.QMM_GEMM_DOT_ROUTE really changes the instructions of the M > 1 q4 GEMM (compile-only: any host):
    # "madd" on a VNNI tier: pmaddubsw + pmaddwd, no vpdpbusd; the default there: vpdpbusd only; on avx2 /
    # avx512 "dot4" drops the rows' shared int16 stage (one pmaddwd per row instead of one per 2 rows)
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    for tier in VNNI_TIERS:
        default, madd, dot4 = (_gemm_asm(monkeypatch, tier, qt, r) for r in (None, "madd", "dot4"))
        assert "vpdpbusd" in default and "pmaddubsw" not in default and "pmaddwd" not in default, tier
        assert "vpdpbusd" not in madd and "pmaddubsw" in madd and "pmaddwd" in madd, tier
        assert dot4 == default, tier
    for tier in ("avx2", "avx512"):
        default, madd, dot4 = (_gemm_asm(monkeypatch, tier, qt, r) for r in (None, "madd", "dot4"))
        assert madd == default and "vpdpbusd" not in dot4, tier
        assert dot4.count("pmaddwd") == 2 * default.count("pmaddwd") > 0, tier
    monkeypatch.setattr(quant, "QMM_GEMM_DOT_ROUTE", "vnni")
    with pytest.raises(ValueError, match="QMM_GEMM_DOT_ROUTE"):
        quant._gemm_route(4, get_target("avx2"))


@pytest.mark.parametrize("tier", _runnable(X86_TIERS) or [pytest.param("none", marks=pytest.mark.skip(
    reason="no x86 tier runs here"))])
@pytest.mark.parametrize("qt", ["q4_0", "q4_1"])
def test_gemm_routes_same_bits(monkeypatch, tier, qt):
    # both routes give the same exact integer dots, so the same output bits; checked on every x86 tier this
    # host runs (on VNNI tiers: vpdpbusd vs pmaddubsw + pmaddwd), against a float64 oracle too, with odd N, K/32
    # and M (the pair + single tail blocks, the shifted last tiles), and a row alone equals the row in the batch
    import gguf
    t = get_target(tier)
    rng = np.random.default_rng(23)
    N, K, M = 44, 416, 11
    raw = _random_raw(qt, N, K, rng).reshape(-1)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ys = {}
    for route in (None, "madd", "dot4"):
        monkeypatch.setattr(quant, "QMM_GEMM_DOT_ROUTE", route)
        ys[route] = quant.matmul_q(x, raw, qt, N, K, target=t)
    qx, d, _ = quant.quantize_q8(x, target=t)
    xd = (qx.astype(np.float64).reshape(M, -1, 32) * d[..., None]).reshape(M, K)
    w = np.asarray(gguf.quants.dequantize(raw.reshape(N, -1), getattr(gguf.GGMLQuantizationType, qt.upper())),
                   np.float64).reshape(N, K)
    assert np.all(np.abs(ys[None] - xd @ w.T) <= 1e-5 * (np.abs(xd) @ np.abs(w).T)), tier
    np.testing.assert_array_equal(ys["madd"], ys[None])
    np.testing.assert_array_equal(ys["dot4"], ys[None])
    for i in (0, 5, 10):
        np.testing.assert_array_equal(quant.matmul_q(x[i], raw, qt, N, K, target=t), ys[None][i])
