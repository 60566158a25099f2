"""The GPU-shaped GGUF linear (engine/ops/quant.py `_qmv_gpu_kernel`: warps over rows, lanes over blocks, `jk.dp4a`
integer dots) and the `jk.dp4a` builtin under it.

- dp4a: against numpy's int64 byte products on every CPU tier (the emitter's portable form) and, compiled for
  sm_90a, one PTX dp4a per element.
- the linear on device arrays: `fake` (tests/fake_cuda.py claiming sm_90a: each launch compiled for sm_90a, ptxas
  included, then run on the CPU) and `cuda` (a real GPU): against the float64 product of the dequantised weights
  (gguf.quants) and the int8 activations the kernel really uses (quantize_q8's rounding modelled by
  tests/ops/test_quant.py's ref_quantize_q8), |err| <= 1e-5 * sum_k |x_q W| (f32 sums of exact integer block
  dots); each row alone bit-identical to the same row in batches of several sizes.
- its sm_90a PTX: ptxas takes it without spills, the activations come in 16-byte vector loads, the dots are dp4a.
"""
import re
import subprocess

import numpy as np
import pytest

import jitkern as jk
from jitkern.runtime.launch import launch
from engine.ops import quant as Q
from tests.ops.test_quant import dequant_acts, make_weight, ref_quantize_q8

# every GGUF type the engine runs: the K-quants first (the Q4_K_M / Q5_K_M / Q6_K files), then the 32-element ones
GPU_TYPES = ["q4_K", "q6_K", "q5_K", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "q2_K", "q3_K",
             "mxfp4"]


def _ks(qtype) -> tuple:
    """K of the tests: 18 blocks (SmolLM2's 576: lanes of 16, the second step past the row for most lanes) or for
    the 256-element super-block types 24 (768: 3 super-blocks, lanes of 16, the second step half past the row),
    and 64 blocks (two full steps of 32 lanes)."""
    return (768 if Q.QTYPES[qtype].block_elems == 256 else 576, 2048)


@jk.kernel
def _dp4a_kernel(a, b, c, out, n, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, jk.dp4a(jk.load(a + offs, mask=m, other=0), jk.load(b + offs, mask=m, other=0),
                                 jk.load(c + offs, mask=m, other=0)), mask=m)


def _ref_dp4a(a, b, c):
    ab = a.view(np.uint8 if a.dtype == np.uint32 else np.int8).reshape(-1, 4).astype(np.int64)
    bb = b.view(np.uint8 if b.dtype == np.uint32 else np.int8).reshape(-1, 4).astype(np.int64)
    return (c.astype(np.int64) + (ab * bb).sum(1)).astype(np.int32)


@pytest.mark.parametrize("signs", ["ss", "us", "su", "uu"])
def test_dp4a_matches_numpy_byte_products(tier, signs):
    if tier.is_gpu:
        pytest.skip("the GPU's dp4a is checked through the linear below")
    rng = np.random.default_rng(5 + "ss us su uu".split().index(signs))
    n = 301
    a = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    a[:4] = [0x80808080, 0xFFFFFFFF, 0x7F7F7F7F, 0]          # the extremes of both signednesses
    b[:4] = [0x80808080, 0x80808080, 0xFFFFFFFF, 0x01020304]
    a = a if signs[0] == "u" else a.view(np.int32)
    b = b if signs[1] == "u" else b.view(np.int32)
    c = rng.integers(-2 ** 20, 2 ** 20, n).astype(np.int32)
    out = np.zeros(n, np.int32)
    launch(_dp4a_kernel, (-(-n // 64),), (a, b, c, out, n), {"BLOCK": 64}, target=tier)
    np.testing.assert_array_equal(out, _ref_dp4a(a, b, c))


def test_dp4a_is_one_ptx_instruction_per_element():
    from jitkern.cli import parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    for sig, op in (("a=*u32:16,b=*i32:16,c=*i32:16,out=*i32:16,n=i32", "dp4a.u32.s32"),
                    ("a=*i32:16,b=*i32:16,c=*i32:16,out=*i32:16,n=i32", "dp4a.s32.s32")):
        params, cx = parse_sig(_dp4a_kernel, sig, ["BLOCK=512", "num_warps=4"])
        ptx = compile_kernel(_dp4a_kernel, params, cx, get_target("sm_90a"), load=False).artifacts["kernel.ptx"]
        ptx = ptx.decode()
        assert ptx.count(op) == 4, ptx          # 512 elements over 128 threads: 4 a thread


# ------------------------------------------------------------------------------------------------ the linear
def _device(backend, monkeypatch):
    from jitkern.runtime import cuda
    if backend == "fake":
        monkeypatch.setenv("JITKERN_FAKE_CUDA_TARGET", "sm_90a")
        from tests.fake_cuda import install
        install(monkeypatch)
    elif not cuda.is_available():
        pytest.skip("no CUDA device here")
    return cuda


def _spy(monkeypatch) -> set:
    names = set()
    run = Q.run

    def spy(kernel, grid, args, target=None, **kw):
        names.add(kernel.__name__)
        return run(kernel, grid, args, target, **kw)
    monkeypatch.setattr(Q, "run", spy)
    return names


def _tight(y, x, wd):
    qx, xd, _ = ref_quantize_q8(x)
    xq = dequant_acts(qx, xd)
    w64 = wd.astype(np.float64)
    ref = xq @ w64.T
    tol = 1e-5 * (np.abs(xq) @ np.abs(w64).T) + 1e-30
    err = np.abs(y - ref)
    return (err <= tol).all(), err.max(), (err / tol).max()


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("qtype", GPU_TYPES)
def test_gpu_linear_matches_the_float64_reference(backend, qtype, monkeypatch):
    cuda = _device(backend, monkeypatch)
    names = _spy(monkeypatch)
    rng = np.random.default_rng(40 + GPU_TYPES.index(qtype))
    N = 45                                    # not a whole number of row groups
    for K in _ks(qtype):
        raw, wd = make_weight(qtype, N, K, rng)
        draw = cuda.DeviceArray.from_numpy(raw)
        for M in (1, 3, 9):
            x = rng.standard_normal((M, K)).astype(np.float32)
            x[0, :5] *= 30.0                  # uneven block scales
            y = Q.matmul_q(cuda.DeviceArray.from_numpy(x), draw, qtype, N, K).numpy()
            ok, worst, ratio = _tight(y, x, wd)
            assert ok, f"{qtype} K={K} M={M}: max err {worst:.3g}, worst ratio {ratio:.3g}"
    assert "_qmv_gpu_kernel" in names and not names & {"_qmm_kernel", "_kq_kernel"}, names


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("qtype", GPU_TYPES)
def test_gpu_linear_rows_alone_equal_batched(backend, qtype, monkeypatch):
    # a row's arithmetic is fixed by K: alone (M = 1), in token tiles of 2, 4 and 8, with the last tile shifted
    # back over earlier tokens, every output is the same bits
    cuda = _device(backend, monkeypatch)
    rng = np.random.default_rng(50 + GPU_TYPES.index(qtype))
    N, K = 37, _ks(qtype)[0]
    raw, _ = make_weight(qtype, N, K, rng)
    draw = cuda.DeviceArray.from_numpy(raw)
    x = rng.standard_normal((19, K)).astype(np.float32)

    def mm(rows):
        return Q.matmul_q(cuda.DeviceArray.from_numpy(np.ascontiguousarray(rows)), draw, qtype, N, K).numpy()
    alone = np.concatenate([mm(x[i:i + 1]) for i in range(x.shape[0])])
    for M in (2, 3, 5, 8, 11, 19):
        np.testing.assert_array_equal(mm(x[:M]), alone[:M], err_msg=f"{qtype} M={M}")
    np.testing.assert_array_equal(mm(x[7:12]), alone[7:12])


def test_gpu_linear_is_the_cuda_choice():
    from targets import cpu_tier_names, get_target, tuned
    sm90 = get_target("sm_90a")
    assert sorted(GPU_TYPES) == sorted(Q.QTYPES)           # every type the CPU runs
    for q in GPU_TYPES:
        assert Q._gpu_qmv(Q.QTYPES[q], sm90) and Q.act_layout(q, 1, sm90) == "natural"
        for name in cpu_tier_names():
            assert not Q._gpu_qmv(Q.QTYPES[q], get_target(name))
    # tiles: lanes from K alone, tokens from M up to the tuning's cap
    assert Q.qmv_tiles("q4_1", 1, 576, 576, sm90)[:3] == (8, 16, 1)
    assert Q.qmv_tiles("q4_1", 37, 576, 576, sm90)[:3] == (8, 16, 8)
    assert Q.qmv_tiles("q4_1", 3, 576, 1536, sm90)[:3] == (4, 32, 2)
    assert Q.qmv_tiles("q4_1", 37, 576, 1536, tuned(sm90, quant_gemv_tokens=4))[2] == 4
    # lanes and warps from the tuning table
    assert Q.qmv_tiles("q4_K", 1, 576, 4096, tuned(sm90, quant_gemv_lanes=16))[:2] == (8, 16)
    assert Q.qmv_tiles("q4_K", 1, 576, 4096, tuned(sm90, quant_gemv_warps=8))[:2] == (8, 32)


# ------------------------------------------------------------------------------------------------- the PTX
def _qmv_ptx(qtype, K, BM):
    from jitkern.cli import parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    t = get_target("sm_90a")
    R, L, _, warps = Q.qmv_tiles(qtype, BM, 576, K, t)
    sig = ("w8=*u8:16,w16=*u16:16,w32=*u32:16,wh=*f16:16,xw=*i32:16,xd=*f32:16,xs=*f32:16,y=*f32:16,M=i32,"
           "N=i32:16")
    params, cx = parse_sig(Q._qmv_gpu_kernel, sig, [f"K={K}", f"QT={Q._QMV_TYPES[qtype]}", f"RB={Q.row_bytes(qtype, K)}",
                                                   f"R={R}", f"L={L}", f"BM={BM}", f"num_warps={warps}"])
    return compile_kernel(Q._qmv_gpu_kernel, params, cx, t, load=False).artifacts["kernel.ptx"].decode()


@pytest.mark.parametrize("qtype", GPU_TYPES)
@pytest.mark.parametrize("BM", [1, 8])
def test_gpu_linear_ptx_assembles_without_spills(qtype, BM, tmp_path):
    from jitkern.backends.nvptx import find_ptxas
    ptx = _qmv_ptx(qtype, _ks(qtype)[0], BM)
    # the activations' words: one 16-byte load per block half and token, and q4_K / q5_K's quant words (their
    # 144 / 176-byte blocks keep the nibbles and q5_K's high bits 16-byte aligned) one per half too; the dots:
    # dp4a, two a word and token
    weights = {"q4_K": 2, "q5_K": 4}.get(qtype, 0)
    assert len(re.findall(r"ld\.global(\.nc)?\.v4\.(u32|b32|s32)", ptx)) >= 2 * BM + weights, ptx
    assert ptx.count("dp4a.") >= 8 * BM
    if find_ptxas() is None:
        pytest.skip("no ptxas (the [cuda] extra)")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([find_ptxas(), "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    spills = [int(v) for v in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr).groups()]
    assert sum(spills) == 0 and "bytes stack frame" in r.stderr, r.stderr
    assert int(re.search(r"(\d+) bytes stack frame", r.stderr).group(1)) == 0, r.stderr


# ------------------------------------------------------------------- the producers of the linear's int8 input
@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n", [576, 96])
def test_natural_layout_producers_on_the_gpu_equal_the_separate_ops(backend, n, monkeypatch):
    """rms_norm_q8 and act_and_mul_q8 in the 'natural' layout (what the GPU-shaped linear takes) quantise a CTA's
    blocks as one tile on GPUs (NAT; the last tile shifted back over its neighbour): bit-identical to the separate
    norm / activation followed by quantize_q8 on the same device, and within half a quantisation step of the
    float64 numpy values."""
    cuda = _device(backend, monkeypatch)
    from engine.ops.activation import act_and_mul_q8, silu_and_mul
    from engine.ops.norm import rms_norm, rms_norm_q8
    rng = np.random.default_rng(60 + n)
    T, nb = 3, n // 32
    x = (rng.standard_normal((T, n)) * rng.uniform(0.1, 5, (T, 1))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    gu = rng.standard_normal((T, 2 * n)).astype(np.float32)
    D = cuda.DeviceArray

    def bufs():
        return (D.empty((T, n), np.int8), D.empty((T, nb), np.float32), D.empty((T, nb), np.float32))
    cases = (
        ("rms_norm_q8", lambda o: rms_norm_q8(D.from_numpy(x), D.from_numpy(w), 1e-5, o),
         lambda: rms_norm(D.from_numpy(x), D.from_numpy(w), 1e-5),
         x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * w),
        ("act_and_mul_q8", lambda o: act_and_mul_q8(D.from_numpy(gu), o),
         lambda: silu_and_mul(D.from_numpy(gu)),
         gu[:, :n] / (1 + np.exp(-gu[:, :n].astype(np.float64))) * gu[:, n:]))
    for name, fused, plain, ref in cases:
        got = [a.numpy() for a in fused(bufs())]
        want = [a.numpy() for a in Q.quantize_q8(plain(), out=bufs())]
        for g, wnt in zip(got, want):
            np.testing.assert_array_equal(g, wnt, err_msg=name)
        deq = dequant_acts(got[0], got[1])
        step = np.repeat(got[1], 32, axis=1)
        assert (np.abs(deq - ref) <= 0.5 * step * (1 + 1e-5) + 1e-6 * np.abs(ref)).all(), name
