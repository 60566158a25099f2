"""GGUF quantised matmul/GEMV ops (engine/ops/quant.py) against numpy + the `gguf` package, on every tier.

References:
- weights: `gguf.quants.dequantize` of the raw blocks. q8_0 / q4_0 / q4_1 / q5_0 / q5_1 blocks come from
  `gguf.quants.quantize` of random normals; the gguf package cannot quantise the K-quants (q2_K..q6_K) nor
  iq4_nl / iq4_xs, so those blocks are random bytes with sane f16 scales (every byte pattern of the other
  fields is a valid block: quants, 4/6-bit scales and mins, high-bit masks, scales_h / scales_l).
- activations: `ref_quantize_q8` below, the same f32 arithmetic as the kernel: d = max|x| / 127,
  q = round-half-to-even(x * (1/d)) (ggml's AVX2 rounding), clipped to [-127, 127], sum = d * sum(q).
  quantize_q8 must match it exactly.

Tolerances (stated per check):
- dequantize_rows: bit-exact against gguf (same f32 operations in the same order).
- matmul_q "tight": against x_q @ W^T in float64, where x_q is the dequantised int8 activation the kernel
  really uses; |err| <= 1e-5 * sum_k |x_q[m,k] W[n,k]| (f32 accumulation over K; the integer block dots are
  exact).
- matmul_q "loose": against x @ W^T with the f32 activations; the int8 rounding moves each x[k] by at most
  d_block / 2 = amax_block / 254, so |err| <= sum_k |W[n,k]| * amax_block(k) / 254 (+ the tight tolerance).
"""
import numpy as np
import pytest

import gguf
import gguf.quants as gq

from engine.ops import quant as Q

QTYPES = ["q8_0", "q4_0", "q4_1", "q4_K", "q5_K", "q6_K", "q5_0", "q5_1", "iq4_nl", "q2_K", "q3_K", "iq4_xs",
          "mxfp4"]
_GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_K": gguf.GGMLQuantizationType.Q4_K,
         "q5_K": gguf.GGMLQuantizationType.Q5_K, "q6_K": gguf.GGMLQuantizationType.Q6_K,
         "q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1,
         "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL, "q2_K": gguf.GGMLQuantizationType.Q2_K,
         "q3_K": gguf.GGMLQuantizationType.Q3_K, "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS,
         "mxfp4": gguf.GGMLQuantizationType.MXFP4}
# types gguf.quants can quantise (the rest: random valid blocks) and the byte offsets of their f16 scales
_GGUF_QUANTIZES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")
_F16_SCALES = {"q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "iq4_nl": (0,), "q2_K": (80, 82), "q3_K": (108,),
               "iq4_xs": (0,)}
# two K per type: a whole number of steps, and a remainder: 11 blocks (q4_0 / q4_1) leave a pair and a single
# block after 4-block steps, 6 (q8_0) a pair after one 4-block step (AVX-512), 5 a single block; 2 blocks
# (q4_1, K = 64) are fewer than one 4-block step
KS = {"q8_0": (192, 160), "q4_0": (128, 352), "q4_1": (64, 352), "q4_K": (256, 768), "q5_K": (256, 768),
      "q6_K": (256, 768), "q5_0": (224, 64), "q5_1": (160, 224), "iq4_nl": (224, 96), "q2_K": (256, 768),
      "q3_K": (256, 768), "iq4_xs": (256, 768), "mxfp4": (224, 96)}
# (7 blocks: a pair and a single block after 4-block steps, one after 2-block steps; 2 or 3 blocks: less than
# one 4-block step)


# --------------------------------------------------------------------------------------------- references
def ref_quantize_q8(x: np.ndarray):
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    t = (b * inv[..., None]).astype(np.float32)
    r = np.clip(np.rint(t), -127, 127).astype(np.float32)
    q = r.astype(np.int8).reshape(x.shape)
    s = (d * r.sum(-1, dtype=np.float32)).astype(np.float32)
    return q, d, s


def make_weight(qtype: str, N: int, K: int, rng):
    """(raw uint8 (N, row_bytes), dequantised float32 (N, K))."""
    q = Q.QTYPES[qtype]
    if qtype in _GGUF_QUANTIZES:
        raw = gq.quantize(rng.standard_normal((N, K)).astype(np.float32), _GGUF[qtype])
    else:
        nb = K // q.block_elems
        raw = rng.integers(0, 256, (N, nb, q.block_bytes), dtype=np.uint8)
        for off in _F16_SCALES[qtype]:
            v = rng.uniform(0.002, 0.02, (N, nb)).astype(np.float16)
            v[rng.random((N, nb)) < 0.3] *= -1      # negative scales are legal (and occur with dmin)
            raw[:, :, off:off + 2] = v.view(np.uint8).reshape(N, nb, 2)
        raw = raw.reshape(N, -1)
    raw = np.ascontiguousarray(raw)
    assert raw.shape == (N, Q.row_bytes(qtype, K))
    return raw, gq.dequantize(raw, _GGUF[qtype]).reshape(N, K).astype(np.float32)


def dequant_acts(qx, xd):
    M, K = qx.shape
    return (qx.reshape(M, -1, 32).astype(np.float64) * xd[:, :, None]).reshape(M, K)


# ---------------------------------------------------------------------------------------------- tests
def _assert_div_exact(got, ref, tier):
    """Float results of a division (block scales d = amax / 127, sums): bit-exact on every tier. Vulkan's spec
    allows OpFDiv 2.5 ULP (NVIDIA's driver was 1 ULP off here, which also flipped a q5_K activation); the SPIR-V
    hooks divide f32 in f64 since 759dd7b, which gives IEEE's quotient on any driver."""
    np.testing.assert_array_equal(got, ref)


def test_quantize_q8_exact(tier):
    rng = np.random.default_rng(1)
    for M, K in ((1, 32), (3, 96), (5, 576)):
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 50, (M, 1))).astype(np.float32)
        x[0, :32] = 0.0                               # an all-zero block: d = 0, q = 0
        x[-1, 5] = 1e4                                # an outlier block
        if K >= 96:
            # exact .5 ties after scaling: a block with amax 127 has d = 1 and 1/d = 1 exactly
            x[-1, 64:96] = rng.uniform(-100, 100, 32).astype(np.float32)
            x[-1, 64:69] = [127.0, 2.5, -3.5, 0.5, -0.5]
        qx, xd, xs = Q.quantize_q8(x, target=tier)
        rq, rd, rs = ref_quantize_q8(x)
        _assert_div_exact(xd, rd, tier)
        np.testing.assert_array_equal(qx, rq)
        _assert_div_exact(xs, rs, tier)
    # 1-D input keeps its rank; out= is filled in place
    x = rng.standard_normal(64).astype(np.float32)
    out = (np.empty(64, np.int8), np.empty(2, np.float32), np.empty(2, np.float32))
    got = Q.quantize_q8(x, out=out, target=tier)
    assert got[0] is out[0]
    np.testing.assert_array_equal(out[0], ref_quantize_q8(x)[0])


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_rows_exact(tier, qtype):
    rng = np.random.default_rng(2)
    K = KS[qtype][1]
    raw, wd = make_weight(qtype, 11, K, rng)
    idx = np.array([10, 0, 3, 3, 7], np.int32)
    out = Q.dequantize_rows(raw, qtype, idx, K, target=tier)
    np.testing.assert_array_equal(out, wd[idx])


@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_q(tier, qtype):
    rng = np.random.default_rng(3 + QTYPES.index(qtype))
    N = 37
    for K in KS[qtype]:
        raw, wd = make_weight(qtype, N, K, rng)
        for M in ((1, 3, 5, 16, 17, 37) if Q.QTYPES[qtype].block_elems == 32 else (1, 3, 17)):
            x = rng.standard_normal((M, K)).astype(np.float32)
            x[0, :3] *= 20.0                              # uneven block scales
            y = Q.matmul_q(x if M > 1 else x[0], raw, qtype, N, K, target=tier)
            assert y.shape == ((M, N) if M > 1 else (N,)) and y.dtype == np.float32
            y = y.reshape(M, N)
            qx, xd, _ = ref_quantize_q8(x)
            xq = dequant_acts(qx, xd)
            w64 = wd.astype(np.float64)
            tight_ref = xq @ w64.T
            tight_tol = 1e-5 * (np.abs(xq) @ np.abs(w64).T) + 1e-30
            err = np.abs(y - tight_ref)
            assert (err <= tight_tol).all(), \
                f"{qtype} M={M} K={K}: tight max err {err.max():.3g}, worst ratio {(err / tight_tol).max():.3g}"
            amax = np.repeat(np.abs(x).reshape(M, -1, 32).max(-1), 32, axis=1).astype(np.float64)
            loose_tol = (amax / 254.0) @ np.abs(w64).T * (1 + 1e-6) + tight_tol
            err = np.abs(y - x.astype(np.float64) @ w64.T)
            assert (err <= loose_tol).all(), f"{qtype} M={M} K={K}: loose max err {err.max():.3g}"


def test_matmul_q_out_and_small_n(tier):
    rng = np.random.default_rng(9)
    raw, wd = make_weight("q4_1", 3, 64, rng)          # N smaller than the row tile
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = np.full((2, 3), np.nan, np.float32)
    y = Q.matmul_q(x, raw, "q4_1", 3, 64, out=out, target=tier)
    assert y is out
    qx, xd, _ = ref_quantize_q8(x)
    np.testing.assert_allclose(out, dequant_acts(qx, xd) @ wd.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_quantize_q8_q4_layout(tier):
    # 'q4' layout: blocks 2j, 2j+1 stored as [2j lo16, 2j+1 lo16, 2j hi16, 2j+1 hi16], an odd last block as is
    rng = np.random.default_rng(4)
    for M, K in ((1, 32), (3, 64), (2, 160), (5, 576)):
        x = rng.standard_normal((M, K)).astype(np.float32) * 3
        got = Q.quantize_q8(x, layout="q4", target=tier)
        assert got.layout == "q4"
        rq, rd, rs = ref_quantize_q8(x)
        nb = K // 32
        want = rq.reshape(M, nb, 2, 16).copy()
        npair = nb // 2
        if npair:
            p = want[:, :2 * npair].reshape(M, npair, 2, 2, 16)        # (pair, block in pair, half, 16)
            want[:, :2 * npair] = p.transpose(0, 1, 3, 2, 4).reshape(M, 2 * npair, 2, 16)
        np.testing.assert_array_equal(got[0], want.reshape(M, K))
        _assert_div_exact(got[1], rd, tier)
        _assert_div_exact(got[2], rs, tier)


def test_quantize_q8_q4x4_layout(tier):
    # 'q4x4': groups of 4 blocks [b0 lo16 .. b3 lo16, b0 hi16 .. b3 hi16]; of the last K/32 % 4 blocks a pair
    # as in 'q4', then an odd last block in order
    rng = np.random.default_rng(19)
    for nb in (1, 2, 3, 4, 5, 6, 7, 11, 18):
        M, K = 3, 32 * nb
        x = rng.standard_normal((M, K)).astype(np.float32) * 3
        got = Q.quantize_q8(x, layout="q4x4", target=tier)
        assert got.layout == "q4x4"
        rq, rd, rs = ref_quantize_q8(x)
        blocks = rq.reshape(M, nb, 2, 16)
        parts, b = [], 0
        for g in [4] * (nb // 4) + ([2] if nb % 4 >= 2 else []) + ([1] if nb % 2 else []):
            parts.append(blocks[:, b:b + g].transpose(0, 2, 1, 3).reshape(M, -1))   # (half, block, 16)
            b += g
        np.testing.assert_array_equal(got[0], np.concatenate(parts, axis=1))
        _assert_div_exact(got[1], rd, tier)
        _assert_div_exact(got[2], rs, tier)


import jitkern as jk  # noqa: E402


@jk.kernel
def _q8_by_heads_kernel(x, qx, xd, xs, xd4, xs4, nblk, HB: jk.constexpr, G: jk.constexpr, REP4: jk.constexpr):
    # program (row, head of HB blocks), heads in reverse order: each quantises its own blocks of the row
    row = jk.program_id(0).to(jk.i64)
    head = jk.num_programs(1) - 1 - jk.program_id(1)
    blk = head.to(jk.i64) * HB + jk.arange(0, HB)
    ok = blk < nblk
    v = jk.load(x + row * nblk * 32 + blk[:, None] * 32 + jk.arange(0, 32)[None, :], mask=ok[:, None], other=0.0)
    Q.q8_store_blocks(v, qx, xd, xs, xd4, xs4, row, nblk, blk, ok, HB, G, REP4)


@pytest.mark.parametrize("layout", ["natural", "q4", "q4x4"])
def test_q8_store_blocks_matches_quantize_q8(tier, layout):
    # what a kernel producing a few blocks of a row (an attention head's output) uses to write them quantised
    # (the o projection's input): every block where quantize_q8 puts it, with its bits, in every layout
    from jitkern.runtime.launch import launch
    rng = np.random.default_rng(23)
    for nb, HB in ((18, 2), (19, 2), (7, 4), (5, 1), (3, 4), (1, 2)):
        M, K = 3, 32 * nb
        x = rng.standard_normal((M, K)).astype(np.float32) * 3
        x[1, :32] = 0.0                                            # a zero block: d = 0, q = 0
        for rep4 in (False, True):
            want = Q.quantize_q8(x, layout=layout, rep4=rep4, target=tier)
            got = [np.full(a.shape, 77 if a.dtype == np.int8 else np.nan, a.dtype)
                   for a in (want[0], want[1], want[2])]
            got4 = [np.full(a.shape, np.nan, np.float32) for a in (want.scales4, want.sums4)] if rep4 else got[1:]
            launch(_q8_by_heads_kernel, (M, -(-nb // HB)), (x, *got, *got4, nb), {"HB": HB,
                   "G": Q.q8_group(layout, nb), "REP4": rep4}, target=tier)
            for g, w in zip(got + (got4 if rep4 else []), list(want) + ([want.scales4, want.sums4] if rep4 else [])):
                np.testing.assert_array_equal(g, w, err_msg=f"{layout} nb={nb} HB={HB} rep4={rep4}")


def test_layout_mismatch_is_an_error():
    raw = np.zeros(18 * 2 * 2, np.uint8)
    xq = Q.quantize_q8(np.ones(64, np.float32))                   # natural layout
    with pytest.raises(ValueError, match="needs activations in the 'q4(x4)?' layout"):
        Q.matmul_q8(xq, raw, "q4_0", 2, 64)
    with pytest.raises(ValueError, match="layout 'x4'"):
        Q.quantize_q8(np.ones(64, np.float32), layout="x4")


def test_prequantized_and_empty(tier):
    rng = np.random.default_rng(10)
    raw, wd = make_weight("q8_0", 9, 96, rng)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    xq = Q.quantize_q8(x, layout=Q.act_layout("q8_0", 5, tier), target=tier)
    np.testing.assert_array_equal(Q.matmul_q8(xq, raw, "q8_0", 9, 96, target=tier),
                                  Q.matmul_q(x, raw, "q8_0", 9, 96, target=tier))
    raw4, _ = make_weight("q4_1", 9, 96, rng)
    xq4 = Q.quantize_q8(x, layout=Q.act_layout("q4_1"), target=tier)
    np.testing.assert_array_equal(Q.matmul_q8(xq4, raw4, "q4_1", 9, 96, target=tier),
                                  Q.matmul_q(x, raw4, "q4_1", 9, 96, target=tier))
    assert Q.matmul_q(np.zeros((0, 96), np.float32), raw, "q8_0", 9, 96, target=tier).shape == (0, 9)


def test_errors_name_the_problem():
    raw = np.zeros(34 * 2, np.uint8)
    with pytest.raises(ValueError, match="qtype 'iq2_xxs'"):
        Q.matmul_q(np.zeros(32, np.float32), raw, "iq2_xxs", 2, 32)
    with pytest.raises(ValueError, match="K=48"):
        Q.row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="68 bytes"):
        Q.matmul_q(np.zeros(32, np.float32), raw[:-1], "q8_0", 2, 32)
    with pytest.raises(ValueError, match=r"x must be \(K,\) or \(M, K\) with K=32"):
        Q.matmul_q(np.zeros(64, np.float32), raw, "q8_0", 2, 32)
    with pytest.raises(TypeError, match="uint8"):
        Q.matmul_q(np.zeros(32, np.float32), raw.view(np.int8), "q8_0", 2, 32)
    with pytest.raises(IndexError, match="out of range"):
        Q.dequantize_rows(raw, "q8_0", np.array([2], np.int32), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_q8(np.zeros(40, np.float32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_q_batch_invariant(tier, qtype):
    # a row's output must not depend on the batch: each row alone (M = 1, the GEMV tiles) and inside batches
    # of several sizes (other tile shapes, shifted last tiles) must give bit-identical results
    rng = np.random.default_rng(20 + QTYPES.index(qtype))
    N = 41
    for K in KS[qtype]:
        raw, _ = make_weight(qtype, N, K, rng)
        x = rng.standard_normal((37, K)).astype(np.float32)
        alone = np.stack([Q.matmul_q(x[i], raw, qtype, N, K, target=tier) for i in range(x.shape[0])])
        for M in (2, 3, 5, 16, 17, 37):
            np.testing.assert_array_equal(Q.matmul_q(x[:M], raw, qtype, N, K, target=tier), alone[:M],
                                          err_msg=f"{qtype} K={K} M={M}")


NEW_QTYPES = ["q5_0", "q5_1", "iq4_nl", "q2_K", "q3_K", "iq4_xs", "mxfp4"]


def _record_launches(monkeypatch) -> list:
    """Every launch of engine.ops.quant from here on, as (kernel, args, constexprs), still run as usual."""
    launches = []
    real_run = Q.run

    def recording_run(kernel, grid, args, target=None, **constexprs):
        launches.append((kernel, args, constexprs))
        return real_run(kernel, grid, args, target, **constexprs)

    monkeypatch.setattr(Q, "run", recording_run)
    return launches


@pytest.mark.parametrize("qtype", NEW_QTYPES)
def test_new_types_compile_for_the_gpu_lowering(qtype, tmp_path, monkeypatch):
    """No GPU needed: every kernel specialisation a GEMV, a GEMM and a row dequantisation of this type launch
    on the CPU also compiles for sm_90a (NVPTX lowering) and ptxas makes a cubin of it (the engine kernels of
    the default model are covered by `jitkern build` in tests/test_cuda_runtime.py; these types are not in it)."""
    from jitkern.backends.nvptx import find_ptxas
    from jitkern.compiler import compile_kernel, reset_kernel_cache
    from targets import get_target
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine (install the [cuda] extra)")
    launches = _record_launches(monkeypatch)
    rng = np.random.default_rng(30)
    K = KS[qtype][0]
    raw, _ = make_weight(qtype, 9, K, rng)
    Q.matmul_q(rng.standard_normal(K).astype(np.float32), raw, qtype, 9, K)
    Q.matmul_q(rng.standard_normal((5, K)).astype(np.float32), raw, qtype, 9, K)
    Q.dequantize_rows(raw, qtype, np.array([1, 4], np.int32), K)
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    reset_kernel_cache()
    try:
        t = get_target("sm_90a")
        done = set()
        for kernel, args, constexprs in launches:
            params, consts, _ = kernel.specialize(args, constexprs)
            key = (kernel.__name__, repr(params), repr(sorted(consts.items(), key=lambda kv: kv[0])))
            if key in done:
                continue
            done.add(key)
            ck = compile_kernel(kernel, params, consts, t, load=False)
            assert ck.artifacts["kernel.cubin"][:4] == b"\x7fELF", kernel.__name__
        names = {k[0] for k in done}
        assert {"_quantize_q8_kernel", "_dequant_rows_kernel"} <= names
        assert ("_qmm_kernel" in names) or ("_kq_kernel" in names)
    finally:
        reset_kernel_cache()


def _weights_before_a_guard_page(raw: np.ndarray):
    """A copy of raw whose last byte sits just before a PROT_NONE page (an access past the end faults), and
    the mapping that keeps it alive."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    data_pages = -(-raw.nbytes // page)
    m = mmap.mmap(-1, (data_pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(ctypes.c_void_p(base + data_pages * page), page, 0) == 0     # PROT_NONE
    start = data_pages * page - raw.nbytes
    out = np.frombuffer(m, np.uint8, raw.nbytes, start)
    out[:] = raw.reshape(-1)
    return out.reshape(raw.shape), m


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_gemv_prefetch_same_results_and_stays_a_hint(tier, qtype, monkeypatch):
    # the CPU GEMV (M = 1) prefetches the weight rows GEMV_PREFETCH_ROWS ahead: a hint that must change no
    # result (bit-identical to no prefetch, and within the reference tolerance), that the kernel really
    # carries (the launch passes the distance, the code has the prefetch), and that never faults past the
    # end of the weights (they end just before an inaccessible page here)
    if not tier.is_cpu:
        pytest.skip("the prefetch is a CPU GEMV hint")
    from jitkern.compiler import compile_kernel
    rng = np.random.default_rng(40 + ["q8_0", "q4_0", "q4_1"].index(qtype))
    launches = _record_launches(monkeypatch)
    for N, K in ((1003, KS[qtype][1]), (23, KS[qtype][0])):
        raw0, wd = make_weight(qtype, N, K, rng)
        raw, keep = _weights_before_a_guard_page(raw0)
        x = rng.standard_normal(K).astype(np.float32)
        x[:3] *= 20.0
        monkeypatch.setattr(Q, "GEMV_PREFETCH_ROWS", 0)
        off = Q.matmul_q(x, raw, qtype, N, K, target=tier)
        assert "PF" not in launches[-1][2]
        monkeypatch.setattr(Q, "GEMV_PREFETCH_ROWS", 16)
        on = Q.matmul_q(x, raw, qtype, N, K, target=tier)
        kernel, args, constexprs = launches[-1]
        assert constexprs.get("PF") == 16 * Q.row_bytes(qtype, K), constexprs
        np.testing.assert_array_equal(on, off, err_msg=f"{qtype} N={N} K={K}")
        qx, xd, _ = ref_quantize_q8(x[None, :])
        xq = dequant_acts(qx, xd)[0]
        w64 = wd.astype(np.float64)
        tol = 1e-5 * (np.abs(w64) @ np.abs(xq)) + 1e-30
        err = np.abs(on - w64 @ xq)
        assert (err <= tol).all(), f"{qtype} N={N} K={K}: max err {err.max():.3g}"
        del raw, keep
    params, consts, _ = kernel.specialize(args, constexprs)
    asm = compile_kernel(kernel, params, consts, tier, load=False, emit=("obj", "asm")).asm()
    assert "prefetch" in asm or "prfm" in asm, "the GEMV kernel has no prefetch instruction"


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_gemm_rows_outer_order_same_bits_and_splits_rows(tier, qtype, monkeypatch):
    # CPU GEMMs of several token tiles (small K) run their programs rows-major (ROWS_OUTER): the same programs
    # in another order, so bit-identical outputs; the CPU pool's contiguous half of the flat program ids (one
    # thread's chunk of 2) must then hold the first half of the weight rows for every token
    if not tier.is_cpu:
        pytest.skip("program order over the CPU pool's thread chunks")
    import ctypes
    import jitkern as jk
    rng = np.random.default_rng(50 + ["q8_0", "q4_0", "q4_1"].index(qtype))
    launches = _record_launches(monkeypatch)
    N, M = 40, 32
    for K in KS[qtype]:
        raw, _ = make_weight(qtype, N, K, rng)
        x = rng.standard_normal((M, K)).astype(np.float32)
        monkeypatch.setattr(Q, "QMM_ROWS_OUTER", False)
        off = Q.matmul_q(x, raw, qtype, N, K, target=tier)
        monkeypatch.setattr(Q, "QMM_ROWS_OUTER", True)
        on = Q.matmul_q(x, raw, qtype, N, K, target=tier)
        qmm = [c for k, a, c in launches[-3:] if k is Q._qmm_kernel]
        if not qmm or qmm[-1]["BM"] >= M:
            pytest.skip(f"one token tile holds M={M} on this tier")
        assert qmm[-1].get("ROWS_OUTER") is True, qmm[-1]
        np.testing.assert_array_equal(on, off, err_msg=f"{qtype} K={K}")
        out = np.full((M, N), np.nan, np.float32)
        with jk.capture() as graph:
            Q.matmul_q(x, raw, qtype, N, K, out=out, target=tier)
        *before, (addr, block, n) = graph.entries
        run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
        for a, b, nb in before:                      # the activations' quantisation, whole
            run(a)(b.__array_interface__["data"][0], 0, nb)
        run(addr)(block.__array_interface__["data"][0], 0, n // 2)
        np.testing.assert_array_equal(out[:, :N // 2], on[:, :N // 2])
        assert np.isnan(out[:, N // 2:]).all()
        run(addr)(block.__array_interface__["data"][0], n // 2, n)
        np.testing.assert_array_equal(out, on)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_gemm_token_tile_of_the_vnni_tiers_same_bits(tier, qtype, monkeypatch):
    # 512-bit VNNI tiers run M > 1 in 8-token tiles (16 spilled), the 4-bit types' in groups of 4 tokens: neither
    # the tile nor the groups ever change an output's arithmetic, so 16 tokens in one tile of 16, two of 8 (the
    # default there) and four of 4 give the same bits, and the whole batch equals each token alone (the GEMV)
    if not tier.is_cpu:
        pytest.skip("CPU token tiles")
    rng = np.random.default_rng(60 + ["q8_0", "q4_1"].index(qtype))
    launches = _record_launches(monkeypatch)
    N, M = 44, 16
    for K in KS[qtype]:
        raw, _ = make_weight(qtype, N, K, rng)
        x = rng.standard_normal((M, K)).astype(np.float32)
        default = Q.matmul_q(x, raw, qtype, N, K, target=tier)
        bm = [c for k, a, c in launches[-3:] if k is Q._qmm_kernel][-1]["BM"]
        if tier.has("avx512vnni") and tier.vector_bits >= 512:
            assert bm == 8, bm
        alone = np.stack([Q.matmul_q(x[i], raw, qtype, N, K, target=tier) for i in range(M)])
        np.testing.assert_array_equal(default, alone, err_msg=f"{qtype} K={K} default tile vs GEMV")
        for tile in ((16, 4), (4, 4)):
            monkeypatch.setattr(Q, "QMM_TILE_OVERRIDE", tile)
            np.testing.assert_array_equal(Q.matmul_q(x, raw, qtype, N, K, target=tier), default,
                                          err_msg=f"{qtype} K={K} tile {tile}")
        monkeypatch.setattr(Q, "QMM_TILE_OVERRIDE", None)
        # token groups (QMM_TOKEN_GROUP: one weight decode per step, the tokens' FMAs a group at a time): the
        # same bits with groups of 4 (the default), 2 and none, in 8- and 16-token tiles
        for tile in (None, (16, 4)):
            monkeypatch.setattr(Q, "QMM_TILE_OVERRIDE", tile)
            for tg in (0, 2, 4):
                monkeypatch.setattr(Q, "QMM_TOKEN_GROUP", tg)
                got = Q.matmul_q(x, raw, qtype, N, K, target=tier)
                last = [c for k, a, c in launches[-3:] if k is Q._qmm_kernel][-1]
                if tier.has("avx512vnni") and tier.vector_bits >= 512 and qtype == "q4_1":
                    assert last.get("TG", 0) == tg, (tg, last)
                np.testing.assert_array_equal(got, default, err_msg=f"{qtype} K={K} tile {tile} groups of {tg}")
        monkeypatch.setattr(Q, "QMM_TILE_OVERRIDE", None)
        monkeypatch.setattr(Q, "QMM_TOKEN_GROUP", 4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_gemv_rows_in_lockstep_same_bits(tier, qtype, monkeypatch):
    # the CPU GEMV takes 4 short rows in lockstep (the GEMM's tile and its 4-row transpose-and-add; tuning
    # cpu_gemv_rows) or one row at a time: the same float operations per output either way, so the same bits,
    # against a float64 reference; the 4-row tile reads the activations' repeated scales (rep4), which
    # matmul_q must then make for M = 1 too
    if not tier.is_cpu:
        pytest.skip("CPU GEMV tiles")
    from targets.tuning import tuned
    rng = np.random.default_rng(70 + ["q8_0", "q4_0", "q4_1"].index(qtype))
    launches = _record_launches(monkeypatch)
    N = 45
    for K in KS[qtype]:
        raw, wd = make_weight(qtype, N, K, rng)
        x = rng.standard_normal(K).astype(np.float32)
        four = Q.matmul_q(x, raw, qtype, N, K, target=tuned(tier, cpu_gemv_rows=4, cpu_gemv_rows_max_bytes=4096))
        r4 = [c for k, a, c in launches[-3:] if k is Q._qmm_kernel][-1]["R"]
        assert r4 == (1 if qtype == "q8_0" and tier.vector_bits == 256 else 4), r4
        one = Q.matmul_q(x, raw, qtype, N, K, target=tuned(tier, cpu_gemv_rows=1))
        assert [c for k, a, c in launches[-3:] if k is Q._qmm_kernel][-1]["R"] == 1
        np.testing.assert_array_equal(four, one, err_msg=f"{qtype} K={K}")
        ref = wd.astype(np.float64) @ x.astype(np.float64)
        np.testing.assert_allclose(one, ref, rtol=0.05, atol=0.05 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_split_layout_same_bits(tier, qtype):
    # the split layout (all rows' quants, then all blocks' scales: the CPU linears' weights after load) holds the
    # same bytes regrouped, and its decoders hand the kernel the same values: every M gives the GGUF layout's bits
    if not Q.split_layout_for(qtype, tier):
        with pytest.raises(ValueError, match="split"):
            Q.matmul_q(np.ones((1, 64), np.float32), Q.split_blocks(make_weight(qtype, 4, 64, np.random.default_rng(0))[0],
                                                                    qtype, 4, 64), qtype, 4, 64, target=tier)
        return
    rng = np.random.default_rng(80 + ["q4_0", "q4_1", "q8_0"].index(qtype))
    N = 45
    for K in KS[qtype]:
        raw, wd = make_weight(qtype, N, K, rng)
        sp = Q.split_blocks(raw, qtype, N, K)
        assert sp.nbytes == raw.nbytes and sp.quant_bytes == N * K // 32 * (Q.QTYPES[qtype].block_bytes -
                                                                          Q._SPLIT_SCALE_BYTES[qtype])
        for M in (1, 2, 16, 37):
            x = rng.standard_normal((M, K)).astype(np.float32)
            got = Q.matmul_q(x, sp, qtype, N, K, target=tier)
            np.testing.assert_array_equal(got, Q.matmul_q(x, raw, qtype, N, K, target=tier),
                                          err_msg=f"{qtype} K={K} M={M}")
            ref = x.astype(np.float64) @ wd.astype(np.float64).T
            np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.05 * np.abs(ref).max())
    import pickle
    again = pickle.loads(pickle.dumps(sp))        # the planes' boundary survives a pickle
    assert isinstance(again, Q.SplitBlocks) and again.quant_bytes == sp.quant_bytes
    np.testing.assert_array_equal(Q.matmul_q(x, again, qtype, N, K, target=tier), got)
    with pytest.raises(TypeError, match="split-layout"):
        Q.dequantize_rows(sp, qtype, np.array([0], np.int32), K)
    if qtype == "q4_0":       # iq4_nl has q4_0's block size: the bytes fit, the layout does not
        with pytest.raises(ValueError, match="split-layout"):
            Q.matmul_q(np.ones((1, K), np.float32), sp, "iq4_nl", N, K, target=tier)
