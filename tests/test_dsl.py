"""The tile language end to end on every runnable CPU tier, against numpy."""
import numpy as np
import pytest

import jitkern as jk
from jitkern.runtime.launch import launch


@jk.kernel
def _axpb(x, out, n, a, b, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    v = jk.load(x + offs, mask=m, other=0.0)
    jk.store(out + offs, v * a + b, mask=m)


@jk.kernel
def _matmul(a, b, c, M, N, K, BM: jk.constexpr, BN: jk.constexpr, BK: jk.constexpr):
    rm = jk.program_id(0) * BM + jk.arange(0, BM)
    rn = jk.program_id(1) * BN + jk.arange(0, BN)
    acc = jk.zeros((BM, BN), jk.f32)
    for k in range(0, K, BK):
        rk = k + jk.arange(0, BK)
        av = jk.load(a + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        bv = jk.load(b + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = jk.dot(av, bv, acc)
    jk.store(c + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@jk.kernel
def _row_stats(x, smax, ssum, amax, N, BLOCK: jk.constexpr):
    row = jk.program_id(0)
    offs = jk.arange(0, BLOCK)
    v = jk.load(x + row * N + offs, mask=offs < N, other=-float("inf"))
    jk.store(smax + row, jk.max(v, axis=0))
    jk.store(amax + row, jk.argmax(v, axis=0))
    jk.store(ssum + row, jk.sum(jk.where(offs < N, v, 0.0), axis=0))


@jk.kernel
def _col_sum(x, out, M, N: jk.constexpr, BM: jk.constexpr):
    rows = jk.arange(0, BM)
    cols = jk.arange(0, N)
    v = jk.load(x + rows[:, None] * N + cols[None, :], mask=rows[:, None] < M, other=0.0)
    jk.store(out + cols, jk.sum(v, axis=0))
    jk.store(out + N + cols, jk.min(v * 1.0 + jk.where(rows[:, None] < M, 0.0, 1e30), axis=0))


@jk.jit
def _silu(x):
    return x * jk.sigmoid(x)


@jk.jit
def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jk.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@jk.kernel
def _unary(x, out, n, F: jk.constexpr, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, F(jk.load(x + offs, mask=m, other=0.0)), mask=m)


@jk.jit
def _exp(x):
    return jk.exp(x)


@jk.jit
def _rsqrt(x):
    return jk.rsqrt(jk.abs(x) + 0.1)


@jk.kernel
def _copy(x, out, n, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, jk.load(x + offs, mask=m), mask=m)


@jk.kernel
def _dot4(a, b, out, K: jk.constexpr):
    r = jk.program_id(0)
    offs = jk.arange(0, K)
    p = jk.dot4(jk.load(a + r * K + offs), jk.load(b + r * K + offs))
    jk.store(out + r * (K // 4) + jk.arange(0, K // 4), p)


@jk.kernel
def _branchy(x, out, n, thresh, BLOCK: jk.constexpr):
    pid = jk.program_id(0)
    offs = pid * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    v = jk.load(x + offs, mask=m, other=0.0)
    if pid % 2 == 0:
        w = v * 2.0
    else:
        w = v - thresh
    total = 0.0
    for i in range(3):
        total += jk.sum(jk.where(m, w, 0.0), axis=0) * i
    jk.store(out + offs, w, mask=m)
    jk.store(out + n + pid, total)


@jk.kernel
def _gather(x, idx, out, n, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    i = jk.load(idx + offs, mask=m, other=0)
    jk.store(out + offs, jk.load(x + i, mask=m, other=0.0), mask=m)


def _run(kernel, grid, tier, *args, **kw):
    return launch(kernel, grid, args, kw, target=tier)


def test_elementwise_masked_tail(tier):
    rng = np.random.default_rng(1)
    for n in (1, 63, 64, 1001):
        x = rng.standard_normal(n).astype(np.float32)
        out = np.full(n + 5, 7.0, np.float32)
        ck = _run(_axpb, (jk.cdiv(n, 64),), tier, x, out, n, 1.5, -0.25, BLOCK=64)
        assert ck.target.name == tier.name
        np.testing.assert_allclose(out[:n], x * 1.5 - 0.25, rtol=1e-6, atol=1e-6)
        assert (out[n:] == 7.0).all(), "masked-off lanes must not be written"


@jk.kernel
def _barrier_reverse(x, scratch, out, BLOCK: jk.constexpr):
    # each program stores its block to scratch, then reads it back reversed: on GPUs other threads' stores, which
    # jk.barrier orders before the loads
    base = jk.program_id(0) * BLOCK
    i = jk.arange(0, BLOCK)
    jk.store(scratch + base + i, jk.load(x + base + i) * 2.0)
    jk.barrier()
    jk.store(out + base + i, jk.load(scratch + base + BLOCK - 1 - i))


def test_barrier_orders_a_programs_stores_before_its_loads(tier):
    """jk.barrier (a CTA barrier on GPUs, nothing on the CPU): values stored by a program are what its loads after
    the barrier read, whichever thread stored them."""
    rng = np.random.default_rng(4)
    B = 256
    x = rng.standard_normal(3 * B).astype(np.float32)
    scratch = np.zeros_like(x)
    out = np.zeros_like(x)
    _run(_barrier_reverse, (3,), tier, x, scratch, out, BLOCK=B)
    np.testing.assert_array_equal(out, (x * 2.0).reshape(3, B)[:, ::-1].reshape(-1))


@jk.kernel
def _row_sums_prefetched(w, out, K, ROWS: jk.constexpr, BK: jk.constexpr, NB: jk.constexpr):
    # the rows' first NB bytes prefetched (a bulk L2 prefetch a row on sm_90+, ignored elsewhere), then the rows' sums
    r = jk.program_id(0) * ROWS + jk.arange(0, ROWS)
    jk.prefetch(w + r.to(jk.i64) * K, nbytes=NB)
    k = jk.arange(0, BK)
    acc = jk.zeros((ROWS,), jk.f32)
    for c in range(0, K, BK):
        acc += jk.sum(jk.load(w + r.to(jk.i64)[:, None] * K + (c + k)[None, :]), axis=1)
    jk.store(out + r, acc)


def test_prefetch_rows_keeps_the_results(tier):
    """jk.prefetch(..., nbytes=) is a hint: the kernel computes what it would without it, on every tier."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    out = np.zeros(64, np.float32)
    _run(_row_sums_prefetched, (4,), tier, w, out, 256, ROWS=16, BK=64, NB=512)
    np.testing.assert_allclose(out, w.sum(1), rtol=1e-5, atol=1e-4)


def test_prefetch_nbytes_must_be_a_multiple_of_16():
    @jk.kernel
    def bad(w, NB: jk.constexpr):
        jk.prefetch(w + jk.arange(0, 16), nbytes=NB)
    for nb in (24, 0):
        with pytest.raises(jk.CompilationError, match="nbytes must be a compile-time positive multiple of 16"):
            launch(bad, (1,), (np.zeros(16, np.float32),), dict(NB=nb))


@jk.kernel
def _reductions(x, out, N: jk.constexpr, R: jk.constexpr):
    # a whole (R * N,) tile to one sum / max / argmax, and (R, N) rows to R sums and argmins
    i = jk.arange(0, R * N)
    v = jk.load(x + i)
    jk.store(out, jk.sum(v, axis=0))
    jk.store(out + 1, jk.max(v, axis=0))
    jk.store(out + 2, jk.argmax(v, axis=0).to(jk.f32))
    r = jk.arange(0, R)
    c = jk.arange(0, N)
    m = jk.load(x + r[:, None] * N + c[None, :])
    jk.store(out + 3 + r, jk.sum(m * m, axis=1))
    jk.store(out + 3 + R + r, jk.argmin(m, axis=1).to(jk.f32))


@pytest.mark.parametrize("R,N", [(2, 2048), (4, 256), (2, 16), (32, 32), (1, 1024)])
def test_reductions_one_item_a_thread_keep_the_bits(tier, R, N):
    """GPU lowerings (Vulkan, CUDA): a CTA-wide reduction of up to a thread per work item runs one item a thread
    (tuning.reduce_one_each) with the bits of the tile layout's chunks (the same items, folded in the same order),
    sums, maxima and arg-reductions, one output and several (a (1, N) tile's row too: its arg-reduction gave the CPU
    tiers a scalar for the (1,) result, an LLVM type error); close to numpy on every tier."""
    from targets import tuned
    rng = np.random.default_rng(R * N)
    x = rng.standard_normal(R * N).astype(np.float32)
    got = {}
    for each in (True, False):
        out = np.zeros(3 + 2 * R, np.float32)
        _run(_reductions, (1,), tuned(tier, reduce_one_each=each), x, out, N=N, R=R)     # (in the cache key)
        got[each] = out
    np.testing.assert_array_equal(got[True], got[False])
    m = x.reshape(R, N)
    np.testing.assert_allclose(got[True][0], x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)
    assert got[True][1] == x.max() and got[True][2] == np.argmax(x)
    np.testing.assert_allclose(got[True][3:3 + R], (m.astype(np.float64) ** 2).sum(1), rtol=1e-4)
    np.testing.assert_array_equal(got[True][3 + R:], np.argmin(m, axis=1))


def test_matmul_dot(tier):
    rng = np.random.default_rng(2)
    M, N, K = 37, 45, 129
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = np.zeros((M, N), np.float32)
    _run(_matmul, (jk.cdiv(M, 16), jk.cdiv(N, 16)), tier, A, B, C, M, N, K, BM=16, BN=16, BK=8)
    np.testing.assert_allclose(C, A.astype(np.float64) @ B, rtol=1e-4, atol=1e-4)


def test_reductions_and_argmax(tier):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((13, 100)).astype(np.float32)
    smax, ssum, amax = np.zeros(13, np.float32), np.zeros(13, np.float32), np.zeros(13, np.int32)
    _run(_row_stats, (13,), tier, X, smax, ssum, amax, 100, BLOCK=128)
    np.testing.assert_array_equal(smax, X.max(1))
    np.testing.assert_array_equal(amax, X.argmax(1))
    np.testing.assert_allclose(ssum, X.sum(1), rtol=1e-5, atol=1e-5)
    Y = rng.standard_normal((7, 16)).astype(np.float32)
    out = np.zeros(32, np.float32)
    _run(_col_sum, (1,), tier, Y, out, 7, N=16, BM=8)
    np.testing.assert_allclose(out[:16], Y.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[16:], Y.min(0))


@pytest.mark.parametrize("fn,ref,tol", [
    (_silu, lambda x: x / (1 + np.exp(-x)), 2e-6),
    (_gelu_tanh, lambda x: 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3))), 2e-6),
    (_exp, np.exp, 0),
    (_rsqrt, lambda x: 1 / np.sqrt(np.abs(x) + 0.1), 1e-6),
])
def test_fused_jit_functions_and_math(tier, fn, ref, tol):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(1003) * 6).astype(np.float32)
    x[:4] = [0.0, -0.0, 1e-5, -1e-3]
    out = np.zeros_like(x)
    _run(_unary, (8,), tier, x, out, x.size, F=fn, BLOCK=128)
    want = ref(x.astype(np.float64))
    if fn is _exp:   # relative accuracy of the polynomial exp: a few ulp (Vulkan's Fma may be unfused)
        np.testing.assert_allclose(out, want, rtol=4e-6 if tier.is_vulkan else 4e-7)
    else:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=tol)


@jk.jit
def _exp_fast(x):
    return jk.exp_fast(x)


def test_exp_fast(tier):
    """jk.exp_fast: the target's hardware exponential where it has one (NVIDIA with tuning.fast_exp: ex2.approx of
    x log2 e, within 2e-6 relative on the softmax range [-30, 0] and 0 for -inf / far below), elsewhere exactly
    jk.exp's bits."""
    assert tier.tuning.fast_exp
    rng = np.random.default_rng(5)
    x = np.concatenate([-rng.random(1000).astype(np.float32) * 30, np.float32([0, -1000, -np.inf, np.nan])])
    out, ref = np.zeros_like(x), np.zeros_like(x)
    _run(_unary, (8,), tier, x, out, x.size, F=_exp_fast, BLOCK=128)
    _run(_unary, (8,), tier, x, ref, x.size, F=_exp, BLOCK=128)
    if tier.is_gpu and tier.is_cuda:
        np.testing.assert_allclose(out[:1001], np.exp(x[:1001].astype(np.float64)), rtol=2e-6)
        assert out[1001] == 0 and out[1002] == 0 and np.isnan(out[1003])
    else:
        np.testing.assert_array_equal(out, ref)


def test_exp_extremes(tier):
    x = np.array([-1000, -88, -87.5, -20, 0, 1, 20, 88, 88.7, 89, 1000, np.inf, -np.inf, np.nan], np.float32)
    out = np.zeros_like(x)
    _run(_unary, (1,), tier, x, out, x.size, F=_exp, BLOCK=16)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    finite = np.isfinite(want) & (want > 1e-37)
    # Vulkan: Fma's precision is that of OpFMul then OpFAdd (SPIR-V environment spec); lavapipe's is unfused
    np.testing.assert_allclose(out[finite], want[finite], rtol=4e-6 if tier.is_vulkan else 1e-6)
    assert out[0] == 0 and np.isposinf(out[9]) and np.isposinf(out[10]) and np.isposinf(out[11])
    assert out[12] == 0 and np.isnan(out[13])


def test_half_conversions_exact(tier):
    rng = np.random.default_rng(5)
    h = (rng.standard_normal(777) * 100).astype(np.float16)
    h[:6] = [np.inf, -np.inf, np.nan, 6e-8, -0.0, 65504]
    out = np.zeros(777, np.float32)
    _run(_copy, (7,), tier, h, out, 777, BLOCK=128)
    np.testing.assert_array_equal(out.view(np.uint32)[3:], h.astype(np.float32).view(np.uint32)[3:])
    assert np.isnan(out[2])
    f = (rng.standard_normal(777) * 1000).astype(np.float32)
    f[:8] = [1e-6, 6e-8, 7e4, np.inf, -3e-5, 65519, 65520, 2.98e-8]
    fh = np.zeros(777, np.float16)
    _run(_copy, (7,), tier, f, fh, 777, BLOCK=128)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(fh.view(np.uint16), f.astype(np.float16).view(np.uint16))
    torch = pytest.importorskip("torch")
    bf = np.zeros(777, np.uint16)
    _run(_copy, (7,), tier, f, jk.as_pointer(bf, "bf16"), 777, BLOCK=128)
    want = torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf, want)
    back = np.zeros(777, np.float32)
    _run(_copy, (7,), tier, jk.as_pointer(bf, "bf16"), back, 777, BLOCK=128)
    np.testing.assert_array_equal(back, torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("signed", [False, True])
def test_dot4(tier, signed):
    rng = np.random.default_rng(6)
    for K in (16, 64, 96):
        if signed:
            a = rng.integers(-127, 128, (5, K)).astype(np.int8)
        else:
            a = rng.integers(0, 16, (5, K)).astype(np.uint8)
        b = rng.integers(-127, 128, (5, K)).astype(np.int8)
        out = np.zeros((5, K // 4), np.int32)
        _run(_dot4, (5,), tier, a, b, out, K=K)
        want = (a.astype(np.int32) * b.astype(np.int32)).reshape(5, K // 4, 4).sum(-1)
        np.testing.assert_array_equal(out, want)


def test_runtime_if_and_loop_carried(tier):
    rng = np.random.default_rng(7)
    n = 200
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(n + 4, np.float32)
    _run(_branchy, (4,), tier, x, out, n, 0.5, BLOCK=64)
    want = x.copy()
    totals = []
    for p in range(4):
        sl = slice(p * 64, min(n, p * 64 + 64))
        want[sl] = x[sl] * 2 if p % 2 == 0 else x[sl] - 0.5
        totals.append(want[sl].sum() * 3)
    np.testing.assert_allclose(out[:n], want, rtol=1e-6)
    np.testing.assert_allclose(out[n:], totals, rtol=1e-4, atol=1e-4)


def test_gather_fallback(tier):
    rng = np.random.default_rng(8)
    x = rng.standard_normal(500).astype(np.float32)
    idx = rng.integers(0, 500, 77).astype(np.int32)
    out = np.zeros(77, np.float32)
    _run(_gather, (2,), tier, x, idx, out, 77, BLOCK=64)
    np.testing.assert_array_equal(out, x[idx])


def test_capture_replay_reads_new_values():
    x = np.random.default_rng(9).standard_normal(100).astype(np.float32)
    out = np.zeros(100, np.float32)
    with jk.capture() as g:
        _axpb[(2,)](x, out, 100, 2.0, 0.0, BLOCK=64)
    assert len(g) == 1 and (out == 0).all()
    g.replay()
    np.testing.assert_allclose(out, 2 * x)
    x[:] = 1.0
    g.replay()
    np.testing.assert_allclose(out, 2.0)


@jk.kernel
def _tuple_carry(x, out, n, R: jk.constexpr, BLOCK: jk.constexpr):
    # one accumulator per row, held in a tuple that the run-time loop carries element by element
    accs = ()
    for r in jk.static_range(R):
        accs = accs + (jk.zeros((BLOCK,), jk.f32),)
    stats = (0.0, jk.full((BLOCK,), -1e30, jk.f32))
    for i in range(0, n, BLOCK):
        offs = i + jk.arange(0, BLOCK)
        new = ()
        for r in jk.static_range(R):
            v = jk.load(x + r * n + offs, mask=offs < n, other=0.0)
            new = new + (accs[r] + v * (r + 1),)
            stats = (stats[0] + jk.sum(v, axis=0), jk.maximum(stats[1], jk.where(offs < n, v, -1e30)))
        accs = new
    for r in jk.static_range(R):
        jk.store(out + r * BLOCK + jk.arange(0, BLOCK), accs[r])
    jk.store(out + R * BLOCK + jk.arange(0, BLOCK), stats[1])
    jk.store(out + (R + 1) * BLOCK, stats[0])


def test_loop_carried_tuple(tier):
    rng = np.random.default_rng(10)
    R, B, n = 3, 16, 75
    x = rng.standard_normal((R, n)).astype(np.float32)
    out = np.zeros((R + 2) * B, np.float32)
    _run(_tuple_carry, (1,), tier, x, out, n, R=R, BLOCK=B)
    xp = np.zeros((R, 80), np.float32)
    xp[:, :n] = x
    want = (xp.reshape(R, 5, B).sum(1) * np.arange(1, R + 1)[:, None]).ravel()
    np.testing.assert_allclose(out[:R * B], want, rtol=1e-5, atol=1e-5)
    xm = np.full((R, 80), -1e30, np.float32)
    xm[:, :n] = x
    np.testing.assert_array_equal(out[R * B:(R + 1) * B], xm.transpose(1, 0).reshape(5, B, R).max((0, 2)))
    np.testing.assert_allclose(out[(R + 1) * B], x.sum(), rtol=1e-4, atol=1e-4)


@jk.kernel
def _rows_to_one(x, out, R: jk.constexpr, K: jk.constexpr):
    # (R, K) summed over K: for R == 1 the reduction's (1,)-shaped result must stay a vector
    v = jk.load(x + jk.arange(0, R)[:, None] * K + jk.arange(0, K)[None, :])
    jk.store(out + jk.arange(0, R), jk.sum(v, axis=1))


def test_reduce_to_length_one(tier):
    rng = np.random.default_rng(11)
    for R in (1, 2):
        x = rng.standard_normal((R, 8)).astype(np.float32)
        out = np.zeros(R, np.float32)
        _run(_rows_to_one, (1,), tier, x, out, R=R, K=8)
        np.testing.assert_allclose(out, x.sum(1), rtol=1e-6, atol=1e-6)


def test_dot4_signed_extremes(tier):
    # the sign trick (|a| as u8, b with a's sign: psignb on SSSE3/AVX2) must be exact for a = -128 and b = -127
    rng = np.random.default_rng(12)
    for K in (16, 32, 64):
        a = rng.integers(-128, 128, (5, K)).astype(np.int8)
        a[:, :4] = -128
        a[:, 4:8] = 0
        b = rng.integers(-127, 128, (5, K)).astype(np.int8)
        b[:, :8] = -127
        out = np.zeros((5, K // 4), np.int32)
        _run(_dot4, (5,), tier, a, b, out, K=K)
        want = (a.astype(np.int32) * b.astype(np.int32)).reshape(5, K // 4, 4).sum(-1)
        np.testing.assert_array_equal(out, want)


@jk.kernel
def _row_splat(a, out, M, K, k, BM: jk.constexpr, BN: jk.constexpr):
    # a pointer tile broadcast along its last axis (stride 0): one scalar load per row, splatted; the last
    # row block is shifted back with a scalar jk.minimum, which must keep the offsets affine
    row0 = jk.minimum(jk.program_id(0) * BM, M - BM)
    rows = row0 + jk.arange(0, BM)
    cols = jk.arange(0, BN)
    v = jk.load(jk.broadcast_to(a + rows[:, None] * K + k, (BM, BN)))
    m = (cols[None, :] % 3 != 1) & (rows[:, None] % 2 == 0)
    w = jk.load(jk.broadcast_to(a + rows[:, None] * K + k + 1, (BM, BN)), mask=m, other=-5.0)
    jk.store(out + rows[:, None] * (2 * BN) + cols[None, :], v)
    jk.store(out + rows[:, None] * (2 * BN) + BN + cols[None, :], w)


def test_stride0_load_is_row_splat_and_scalar_min_stays_affine(tier):
    rng = np.random.default_rng(13)
    M, K, k, BM, BN = 11, 7, 3, 4, 8
    a = rng.standard_normal((M, K)).astype(np.float32)
    out = np.zeros((M, 2 * BN), np.float32)
    ck = _run(_row_splat, (3,), tier, a, out, M, K, k, BM=BM, BN=BN)
    np.testing.assert_array_equal(out[:, :BN], np.repeat(a[:, k:k + 1], BN, 1))
    m = (np.arange(BN)[None, :] % 3 != 1) & (np.arange(M)[:, None] % 2 == 0)
    np.testing.assert_array_equal(out[:, BN:], np.where(m, a[:, k + 1:k + 2], -5.0))
    if tier.is_cpu:         # the CPU lowering's access shapes (GPUs distribute the tile over threads)
        ll = ck.artifacts["kernel.ll"].decode()
        assert "masked.gather" not in ll and "masked.scatter" not in ll


@jk.kernel
def _reused_loop_var(x, out, n, BLOCK: jk.constexpr):
    # the inner loop reuses the name of an earlier run-time loop's variable (undefined after that loop)
    offs = jk.arange(0, BLOCK)
    acc = jk.zeros((BLOCK,), jk.f32)
    for h in range(0, 2):
        acc += 1.0
    for i in range(0, n):
        for h in range(0, 3):
            acc += jk.load(x + (i * 3 + h) * BLOCK + offs)
    jk.store(out + offs, acc)


def test_loop_variable_name_reused_in_nested_runtime_loop(tier):
    x = np.random.default_rng(11).standard_normal((4, 3, 16)).astype(np.float32)
    out = np.zeros(16, np.float32)
    _run(_reused_loop_var, (1,), tier, x, out, 4, BLOCK=16)
    np.testing.assert_allclose(out, x.sum((0, 1)) + 2.0, rtol=1e-5, atol=1e-5)


def test_dot4_small_and_many_chunks(tier):
    # the generic (portable / SSE2) lowering works per 16-byte chunk: cover tiles below and far above one chunk
    rng = np.random.default_rng(13)
    for K in (4, 8, 256):
        for signed in (False, True):
            a = (rng.integers(-128, 128, (3, K)) if signed else rng.integers(0, 64, (3, K))).astype(
                np.int8 if signed else np.uint8)
            b = rng.integers(-127, 128, (3, K)).astype(np.int8)     # b = -128 is outside dot4's contract
            out = np.zeros((3, K // 4), np.int32)
            _run(_dot4, (3,), tier, a, b, out, K=K)
            want = (a.astype(np.int32) * b.astype(np.int32)).reshape(3, K // 4, 4).sum(-1)
            np.testing.assert_array_equal(out, want)


@jk.kernel
def _prefetched_rows(x, out, n_rows, ROWS: jk.constexpr, N: jk.constexpr):
    # prefetch the next chunk of rows (past the end on the last one: prefetches never fault), then read
    r = jk.arange(0, ROWS)
    c = jk.arange(0, N)
    acc = jk.zeros((N,), jk.f32)
    for i in range(0, n_rows, ROWS):
        jk.prefetch(x + (i + ROWS + r[:, None]) * N + c[None, :])
        jk.prefetch(x + i * N + 5, locality=2)
        acc += jk.sum(jk.load(x + (i + r[:, None]) * N + c[None, :], mask=(i + r[:, None]) < n_rows, other=0.0),
                      axis=0)
    jk.store(out + c, acc)


@jk.kernel
def _prefetch_gather(x, idx):
    jk.prefetch(x + jk.load(idx + jk.arange(0, 8)))


def test_prefetch(tier):
    x = np.random.default_rng(12).standard_normal((37, 48)).astype(np.float32)
    out = np.zeros(48, np.float32)
    ck = _run(_prefetched_rows, (1,), tier, x, out, 37, ROWS=8, N=48)
    np.testing.assert_allclose(out, x.sum(0), rtol=1e-5, atol=1e-5)
    if not tier.is_cpu:
        return              # a prefetch is a no-op hint on GPUs (they stream through L2)
    ll = ck.artifacts["kernel.ll"].decode()
    assert ll.count("call void @llvm.prefetch.p0(") == 8 * 3 + 1      # 8 rows x 3 lines of 64 B, + scalar
    assert ll.count(", i32 0, i32 2, i32 1)") == 1                     # the scalar one goes to L2
    with pytest.raises(jk.CompilationError, match="contiguous along its last axis"):
        _prefetch_gather.compile(x, np.zeros(8, np.int32), target=tier)


@jk.kernel
def _masked_rows_copy(x, out, n_rows, n_cols, ROWS: jk.constexpr, COLS: jk.constexpr):
    # 2-D tiles whose rows are fully in, partly in (column tail) or fully out (row tail) of the mask
    r = jk.program_id(0) * ROWS + jk.arange(0, ROWS)
    c = jk.arange(0, COLS)
    for c0 in range(0, n_cols, COLS):
        m = (r[:, None] < n_rows) & ((c0 + c)[None, :] < n_cols)
        v = jk.load(x + r[:, None] * n_cols + c0 + c[None, :], mask=m, other=7.0)
        jk.store(out + r[:, None] * n_cols + c0 + c[None, :], v * 2.0 + 1.0, mask=m)


@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int8, np.uint16])
def test_masked_row_loads_stores_full_partial_empty(tier, dt):
    # below AVX-512 the backend gives all-true rows a plain vector load/store and keeps masked ones for
    # tails; this covers all three kinds of rows, with a sentinel band around the output
    rng = np.random.default_rng(14)
    n_rows, n_cols = 11, 70
    x = (np.abs(rng.standard_normal((n_rows, n_cols))) * 20).astype(dt)     # 2x + 1 fits every dtype
    out_buf = np.full(n_rows * n_cols + 64, 99, dt)
    out = out_buf[32:32 + n_rows * n_cols].reshape(n_rows, n_cols)
    ck = _run(_masked_rows_copy, (jk.cdiv(n_rows, 4),), tier, x, out, n_rows, n_cols, ROWS=4, COLS=32)
    want = (x.astype(np.float64) * 2 + 1).astype(dt)
    np.testing.assert_array_equal(out, want)
    assert (out_buf[:32] == 99).all() and (out_buf[32 + n_rows * n_cols:] == 99).all()
    ll = ck.artifacts["kernel.ll"].decode()
    if not tier.is_cpu:
        pass                # GPUs predicate each thread's elements; no row-shaped access to check
    elif tier.has("avx512f"):
        assert "st_full" not in ll
    else:
        assert "st_full" in ll and "@llvm.masked.store" in ll


@jk.kernel
def _dot4_axis(a, b, out, N: jk.constexpr, S: jk.constexpr, K: jk.constexpr):
    # per program a (N, S, K) tile; dot4 summed over axis 0 (the N slices), then over axis 1 via a negative axis
    r = jk.program_id(0)
    offs = (r * (N * S * K) + jk.arange(0, N)[:, None, None] * (S * K) + jk.arange(0, S)[None, :, None] * K
            + jk.arange(0, K)[None, None, :])
    av, bv = jk.load(a + offs), jk.load(b + offs)
    p = jk.dot4(av, bv, axis=0)                                                     # (S, K/4)
    jk.store(out + r * (S * K // 4) + jk.arange(0, S)[:, None] * (K // 4) + jk.arange(0, K // 4)[None, :], p)
    q = jk.dot4(av, bv, axis=-2)                                                    # (N, K/4)
    jk.store(out + jk.num_programs(0) * (S * K // 4) + r * (N * K // 4) + jk.arange(0, N)[:, None] * (K // 4)
             + jk.arange(0, K // 4)[None, :], q)


@pytest.mark.parametrize("signed", [False, True])
def test_dot4_axis(tier, signed):
    # dot4(a, b, axis) == sum(dot4(a, b), axis); x86 adds the slices' pmaddubsw results in int16 (contract: the
    # sums of 2*n products fit int16), so the values stay inside it: nibbles (u8) or |a| <= 31 (i8) against
    # full-range int8, n <= 4. Shapes with whole 512/256/128-bit chunks and ones below a chunk (generic path).
    rng = np.random.default_rng(15)
    for N, S, K in ((2, 4, 16), (2, 2, 16), (4, 1, 32), (3, 2, 8), (2, 1, 4)):
        a = (rng.integers(-31, 32, (5, N, S, K)) if signed else rng.integers(0, 16, (5, N, S, K))).astype(
            np.int8 if signed else np.uint8)
        a.reshape(-1)[:4] = -31 if signed else 15                                   # extremes of the contract
        b = rng.integers(-127, 128, (5, N, S, K)).astype(np.int8)
        b.reshape(-1)[:4] = 127
        out = np.full(5 * (S + N) * K // 4, -7, np.int32)
        _run(_dot4_axis, (5,), tier, a, b, out, N=N, S=S, K=K)
        p = (a.astype(np.int32) * b.astype(np.int32)).reshape(5, N, S, K // 4, 4).sum(-1)
        np.testing.assert_array_equal(out[:5 * S * K // 4].reshape(5, S, K // 4), p.sum(1))
        np.testing.assert_array_equal(out[5 * S * K // 4:].reshape(5, N, K // 4), p.sum(2))


def test_dot4_axis_errors():
    a = np.zeros((2, 16), np.uint8)
    b = np.zeros((2, 16), np.int8)

    @jk.kernel
    def _bad_axis(a, b, out, AX: jk.constexpr):
        o = jk.arange(0, 2)[:, None] * 16 + jk.arange(0, 16)[None, :]
        jk.store(out + jk.arange(0, 4), jk.dot4(jk.load(a + o), jk.load(b + o), axis=AX))

    for ax in (1, -1, 2):
        with pytest.raises(Exception, match="dot4 axis"):
            _bad_axis[(1,)](a, b, np.zeros(4, np.int32), AX=ax)


def test_dot4_lanes_not_a_multiple_of_16(tier):
    # the generic lowering works per 16 lanes; a tile of 24 or 40 lanes leaves a last chunk of 8 (was dropped)
    rng = np.random.default_rng(16)
    for K in (24, 40, 20):
        a = rng.integers(0, 16, (3, K)).astype(np.uint8)
        b = rng.integers(-127, 128, (3, K)).astype(np.int8)
        out = np.full((3, K // 4), -7, np.int32)
        _run(_dot4, (3,), tier, a, b, out, K=K)
        np.testing.assert_array_equal(out, (a.astype(np.int32) * b.astype(np.int32)).reshape(3, K // 4, 4).sum(-1))


@jk.kernel
def _permute3(x, out, A: jk.constexpr, B: jk.constexpr, C: jk.constexpr):
    # out = x.transpose(2, 0, 1) (values), out2 = the same through a transposed pointer tile, plus a 2-D trans
    offs = jk.arange(0, A)[:, None, None] * (B * C) + jk.arange(0, B)[None, :, None] * C + jk.arange(0, C)[None, None, :]
    v = jk.load(x + offs)
    o = jk.arange(0, C)[:, None, None] * (A * B) + jk.arange(0, A)[None, :, None] * B + jk.arange(0, B)[None, None, :]
    jk.store(out + o, jk.trans(v, (2, 0, 1)))
    jk.store(out + A * B * C + o, jk.load(jk.trans(x + offs, axes=(2, 0, 1))))
    o2 = jk.arange(0, B * C)[:, None] * A + jk.arange(0, A)[None, :]
    jk.store(out + 2 * A * B * C + o2, jk.trans(jk.reshape(v, (A, B * C))))


def test_trans_axes(tier):
    # N-D permutation (numpy.transpose semantics) of values and of pointer tiles, and the 2-D default
    rng = np.random.default_rng(17)
    for A, B, C in ((2, 3, 4), (4, 4, 16), (1, 5, 2)):
        x = rng.standard_normal(A * B * C).astype(np.float32)
        out = np.full(3 * A * B * C, np.nan, np.float32)
        _run(_permute3, (1,), tier, x, out, A=A, B=B, C=C)
        want = x.reshape(A, B, C).transpose(2, 0, 1).ravel()
        np.testing.assert_array_equal(out[:A * B * C], want)
        np.testing.assert_array_equal(out[A * B * C:2 * A * B * C], want)
        np.testing.assert_array_equal(out[2 * A * B * C:], x.reshape(A, B * C).T.ravel())


@jk.kernel
def _short_row_reduce(x, out, R: jk.constexpr, N: jk.constexpr):
    # reductions over a short last axis of many rows (the whole-tile halving tree in the backend)
    v = jk.load(x + jk.arange(0, R)[:, None] * N + jk.arange(0, N)[None, :])
    jk.store(out + jk.arange(0, R), jk.sum(v, axis=1))
    jk.store(out + R + jk.arange(0, R), jk.max(v, axis=1))
    jk.store(out + 2 * R + jk.arange(0, R), jk.min(v, axis=1))


@pytest.mark.parametrize("dt", [np.float32, np.int32])
def test_reduce_many_short_rows(tier, dt):
    rng = np.random.default_rng(18)
    for R, N in ((4, 2), (16, 4), (12, 8), (64, 2), (3, 4), (8, 16)):
        x = (rng.standard_normal((R, N)) * 100).astype(dt)
        out = np.zeros(3 * R, dt)
        _run(_short_row_reduce, (1,), tier, x, out, R=R, N=N)
        tol = dict(rtol=1e-6, atol=1e-4) if dt == np.float32 else dict(rtol=0, atol=0)
        np.testing.assert_allclose(out[:R], x.sum(1, dtype=np.float64).astype(dt), **tol)
        np.testing.assert_array_equal(out[R:2 * R], x.max(1))
        np.testing.assert_array_equal(out[2 * R:], x.min(1))


def test_trans_axes_errors():
    @jk.kernel
    def _bad_perm(x, out, AX: jk.constexpr):
        v = jk.load(x + jk.arange(0, 2)[:, None] * 4 + jk.arange(0, 4)[None, :])
        jk.store(out + jk.arange(0, 8), jk.reshape(jk.trans(v, AX), (8,)))

    x = np.zeros(8, np.float32)
    for ax in ((0, 0), (0, 1, 2), (1,)):
        with pytest.raises(Exception, match="trans axes"):
            _bad_perm[(1,)](x, np.zeros(8, np.float32), AX=ax)


@jk.kernel
def _fold_minmax(out, N: jk.constexpr):
    jk.store(out + jk.arange(0, 4), jk.full((4,), jk.maximum(N, 3) * 10 + jk.minimum(N, 3), jk.i32))


def test_maximum_minimum_of_compile_time_values_fold(tier):
    out = np.zeros(4, np.int32)
    launch(_fold_minmax, (1,), (out,), {"N": 7}, target=tier)
    assert (out == 73).all()


@jk.kernel
def _madd_kernel(a, b, out, R: jk.constexpr, K: jk.constexpr):
    offs = jk.arange(0, R)[:, None] * K + jk.arange(0, K)[None, :]
    p = jk.madd(jk.load(a + offs), jk.load(b + offs))
    jk.store(out + jk.arange(0, R)[:, None] * (K // 2) + jk.arange(0, K // 2)[None, :], p)


@pytest.mark.parametrize("kind", ["u8i8", "i16i16"])
def test_madd(tier, kind):
    # pair sums of products: u8 x i8 -> i16 saturated (pmaddubsw), i16 x i16 -> i32 (pmaddwd, wrapping only for
    # two (-32768)^2 products); whole and partial vector chunks, including the saturation edges
    rng = np.random.default_rng(21)
    for R, K in ((3, 64), (2, 32), (5, 16), (1, 6), (4, 2)):
        if kind == "u8i8":
            a = rng.integers(0, 256, (R, K)).astype(np.uint8)
            b = rng.integers(-128, 128, (R, K)).astype(np.int8)
            if K >= 4:
                a[0, :4] = 255
                b[0, :4] = [127, 127, -128, -128]              # +32385 * 2 -> 32767, -32640 * 2 -> -32768
            want = np.clip((a.astype(np.int64) * b).reshape(R, K // 2, 2).sum(-1), -32768, 32767).astype(np.int16)
            out = np.zeros((R, K // 2), np.int16)
        else:
            a = rng.integers(-32768, 32768, (R, K)).astype(np.int16)
            b = rng.integers(-32768, 32768, (R, K)).astype(np.int16)
            a[0, :2] = b[0, :2] = -32768                       # 2^31: wraps to -2^31
            want = ((a.astype(np.int64) * b).reshape(R, K // 2, 2).sum(-1) + 2**31) % 2**32 - 2**31
            want = want.astype(np.int32)
            out = np.zeros((R, K // 2), np.int32)
        _run(_madd_kernel, (1,), tier, a, b, out, R=R, K=K)
        np.testing.assert_array_equal(out, want)


def test_madd_errors():
    @jk.kernel
    def _bad_madd(a, b, out):
        o = jk.arange(0, 4)
        jk.store(out + jk.arange(0, 2), jk.madd(jk.load(a + o), jk.load(b + o)).to(jk.i32))

    with pytest.raises(Exception, match=r"madd takes \(u8, i8\) or \(i16, i16\)"):
        _bad_madd[(1,)](np.zeros(4, np.int8), np.zeros(4, np.int8), np.zeros(2, np.int32))


@jk.kernel
def _half_dot(a, b, c, acc0, M: jk.constexpr, N: jk.constexpr, K: jk.constexpr):
    # 16-bit inputs straight into dot (matrix units on GPUs that have them), f32 accumulator operand
    rm = jk.arange(0, M)
    rn = jk.arange(0, N)
    rk = jk.arange(0, K)
    av = jk.load(a + rm[:, None] * K + rk[None, :])
    bv = jk.load(b + rk[:, None] * N + rn[None, :])
    acc = jk.load(acc0 + rm[:, None] * N + rn[None, :])
    jk.store(c + rm[:, None] * N + rn[None, :], jk.dot(av, bv, acc))


@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_dot_of_16_bit_inputs(tier, half):
    rng = np.random.default_rng(21)
    M, N, K = 32, 24, 48
    a32 = rng.standard_normal((M, K)).astype(np.float32)
    b32 = rng.standard_normal((K, N)).astype(np.float32)
    acc = rng.standard_normal((M, N)).astype(np.float32)
    if half == "f16":
        a, b = a32.astype(np.float16), b32.astype(np.float16)
        ar, br = a.astype(np.float64), b.astype(np.float64)
        args = (a, b)
    else:
        torch = pytest.importorskip("torch")
        ab = torch.from_numpy(a32).to(torch.bfloat16)
        bb = torch.from_numpy(b32).to(torch.bfloat16)
        ar, br = ab.double().numpy(), bb.double().numpy()
        a_bits = ab.view(torch.int16).numpy().view(np.uint16).copy()
        b_bits = bb.view(torch.int16).numpy().view(np.uint16).copy()
        args = (jk.as_pointer(a_bits, "bf16"), jk.as_pointer(b_bits, "bf16"))
    c = np.full((M, N), np.nan, np.float32)
    _run(_half_dot, (1,), tier, *args, c, acc, M=M, N=N, K=K)
    want = ar @ br + acc
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


@jk.kernel
def _mixed_dot_nt(x, w, c, M: jk.constexpr, N: jk.constexpr, K: jk.constexpr):
    # f32 activations x 16-bit weight rows, as the dense linear does: dot(x, trans(w)); on GPUs with matrix
    # units x runs as two 16-bit parts (hi + lo)
    rm = jk.arange(0, M)
    rn = jk.arange(0, N)
    rk = jk.arange(0, K)
    xv = jk.load(x + rm[:, None] * K + rk[None, :])
    wv = jk.load(w + rn[:, None] * K + rk[None, :])
    acc = jk.zeros((M, N), jk.f32) + 0.5
    jk.store(c + rm[:, None] * N + rn[None, :], jk.dot(xv, jk.trans(wv), acc))


# (M, N, K, warps): one 16x8 tile for 4 warps (the K steps split 4 ways), two tiles for 8 warps (4 ways),
# 16 tiles for 4 warps (4 per warp in one K loop), 6 tiles for 4 warps (the round-robin with a tail)
@pytest.mark.parametrize("M,N,K,warps", [(16, 8, 64, 4), (16, 16, 64, 8), (64, 32, 32, 4), (32, 24, 48, 4)])
def test_dot_f32_by_bf16_rows_work_splits(tier, M, N, K, warps):
    rng = np.random.default_rng(M * 1000 + N * 10 + warps)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    w_bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    w64 = (w_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    c = np.full((M, N), np.nan, np.float32)
    _run(_mixed_dot_nt, (1,), tier, x, jk.as_pointer(w_bits, "bf16"), c, M=M, N=N, K=K, num_warps=warps)
    want = x.astype(np.float64) @ w64.T + 0.5
    mag = np.abs(x.astype(np.float64)) @ np.abs(w64).T + 0.5
    # hi + lo keeps ~16 significant bits of x (2**-17 relative); f32 accumulation on top
    err = np.abs(c - want)
    assert np.isfinite(c).all()
    assert (err <= (2.0 ** -16 + (K + 2) * 2.0 ** -24) * mag).all(), float((err / mag).max())
    # each row alone gives the same bits as the full tile (a row's MMAs do not depend on the other rows)
    if M > 1:
        c1 = np.full((M, N), np.nan, np.float32)
        x1 = np.zeros_like(x)
        x1[3] = x[3]
        _run(_mixed_dot_nt, (1,), tier, x1, jk.as_pointer(w_bits, "bf16"), c1, M=M, N=N, K=K, num_warps=warps)
        np.testing.assert_array_equal(c1[3], c[3])


@jk.kernel
def _k_loop_dot(x, w, c, K, M: jk.constexpr, N: jk.constexpr, BK: jk.constexpr, EPI: jk.constexpr):
    # acc = dot(x, trans(w), acc) over K steps (on matrix units the accumulator stays in the MMA registers
    # around the loop); EPI: one more dot after the loop takes the loop's accumulator. EPI == 2: that dot's x
    # is rounded to bf16 (one MMA chain, where the loop's f32 x has hi + lo chains): the registers' layouts
    # differ, so it turns the accumulator into a tile value first (GpuLowering._frag_acc_in), which must not
    # clobber its own staged operands
    rm = jk.arange(0, M)
    rn = jk.arange(0, N)
    rk = jk.arange(0, BK)
    acc = jk.zeros((M, N), jk.f32)
    for k in range(0, K, BK):
        xv = jk.load(x + rm[:, None] * K + (k + rk)[None, :])
        wv = jk.load(w + rn[:, None] * K + (k + rk)[None, :])
        acc = jk.dot(xv, jk.trans(wv), acc)
    if EPI:
        xv = jk.load(x + rm[:, None] * K + rk[None, :])
        if EPI == 2:
            xv = xv.to(jk.bf16)
        wv = jk.load(w + rn[:, None] * K + rk[None, :])
        acc = jk.dot(xv, jk.trans(wv), acc)
    jk.store(c + rm[:, None] * N + rn[None, :], acc + 1.0)


# (M, N, BK, K, warps): one tile with its K steps split over warps, 2 and 4 tiles per warp, 6 tiles for 4
# warps (round-robin with a tail: the accumulator goes through shared memory instead)
@pytest.mark.parametrize("M,N,BK,K,warps", [(16, 8, 32, 128, 4), (16, 64, 64, 192, 4), (64, 32, 32, 64, 4),
                                            (32, 24, 32, 96, 4)])
@pytest.mark.parametrize("epi", [False, True])
def test_dot_accumulator_carried_around_a_k_loop(tier, M, N, BK, K, warps, epi):
    if not tier.is_gpu and (M, N) != (16, 8):
        pytest.skip("the larger shapes exercise the GPU lowering's register accumulators; on the CPU tiers "
                    "their unrolled dots take minutes to compile")
    rng = np.random.default_rng(M + N + BK + K + warps + epi)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    w_bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    w64 = (w_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    c = np.full((M, N), np.nan, np.float32)
    _run(_k_loop_dot, (1,), tier, x, jk.as_pointer(w_bits, "bf16"), c, K, M=M, N=N, BK=BK, EPI=epi,
         num_warps=warps)
    x64 = x.astype(np.float64)
    want = x64 @ w64.T + 1.0
    mag = np.abs(x64) @ np.abs(w64).T + 1.0
    if epi:
        want += x64[:, :BK] @ w64[:, :BK].T
        mag += np.abs(x64[:, :BK]) @ np.abs(w64[:, :BK]).T
    err = np.abs(c - want)
    assert np.isfinite(c).all()
    assert (err <= (2.0 ** -16 + (K + BK + 2) * 2.0 ** -24) * mag).all(), float((err / mag).max())


def test_dot_accumulator_handed_to_a_dot_of_another_register_layout(tier):
    """A K loop of f32-activation dots whose accumulator feeds a bf16-activation dot (_k_loop_dot, EPI 2)."""
    from tests.ops.ref_basic import from_bf16, to_bf16
    rng = np.random.default_rng(91)
    M, N, BK, K = 16, 16, 32, 96
    x = rng.standard_normal((M, K)).astype(np.float32)
    w_bits = to_bf16(rng.standard_normal((N, K)))
    w64 = from_bf16(w_bits).astype(np.float64)
    c = np.full((M, N), np.nan, np.float32)
    _run(_k_loop_dot, (1,), tier, x, jk.as_pointer(w_bits, "bf16"), c, K, M=M, N=N, BK=BK, EPI=2)
    x64 = x.astype(np.float64)
    xb64 = from_bf16(to_bf16(x[:, :BK])).astype(np.float64)          # the epilogue's x rounded to bf16
    want = x64 @ w64.T + xb64 @ w64[:, :BK].T + 1.0
    mag = np.abs(x64) @ np.abs(w64).T + np.abs(xb64) @ np.abs(w64[:, :BK]).T + 1.0
    assert np.isfinite(c).all()
    assert (np.abs(c - want) <= (2.0 ** -16 + (K + BK + 2) * 2.0 ** -24) * mag).all()


@jk.kernel
def _nested_dot_acc(x, w1, w2, acc0, c, M: jk.constexpr, N: jk.constexpr, K: jk.constexpr):
    # dot(x, w2, dot(x, w1, acc)): the inner dot's result is the outer's accumulator (kept in MMA
    # registers on GPUs) and the inner dot's own acc is a tile value
    rm = jk.arange(0, M)
    rn = jk.arange(0, N)
    rk = jk.arange(0, K)
    xv = jk.load(x + rm[:, None] * K + rk[None, :])
    a = jk.load(acc0 + rm[:, None] * N + rn[None, :])
    w1v = jk.load(w1 + rn[:, None] * K + rk[None, :])
    w2v = jk.load(w2 + rn[:, None] * K + rk[None, :])
    jk.store(c + rm[:, None] * N + rn[None, :], jk.dot(xv, jk.trans(w2v), jk.dot(xv, jk.trans(w1v), a)))


def test_dot_of_a_dot_with_a_tile_accumulator(tier):
    rng = np.random.default_rng(77)
    M, N, K = 16, 32, 32
    x = rng.standard_normal((M, K)).astype(np.float32)
    acc0 = rng.standard_normal((M, N)).astype(np.float32)
    ws, w64 = [], []
    for _ in range(2):
        bits = (rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        ws.append(jk.as_pointer(bits, "bf16"))
        w64.append((bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    c = np.full((M, N), np.nan, np.float32)
    _run(_nested_dot_acc, (1,), tier, x, ws[0], ws[1], acc0, c, M=M, N=N, K=K)
    x64 = x.astype(np.float64)
    want = x64 @ w64[0].T + x64 @ w64[1].T + acc0
    mag = np.abs(x64) @ (np.abs(w64[0]) + np.abs(w64[1])).T + np.abs(acc0)
    assert (np.abs(c - want) <= (2.0 ** -16 + (2 * K + 2) * 2.0 ** -24) * mag).all()


@jk.kernel
def _strided_tile_sum(x, y, R, K, ldx, ldy, BR: jk.constexpr, BC: jk.constexpr):
    # y[r, c] = sum over k steps of x[r, k + c] * (step + 1): a tile with a run-time row stride loaded in a K
    # loop, as the dense linear does (GPU: a thread's chunks are one pointer plus uniform row steps)
    rows = jk.program_id(0) * BR + jk.arange(0, BR)
    cols = jk.arange(0, BC)
    rm = rows[:, None] < R
    xrows = x + rows.to(jk.i64)[:, None] * ldx.to(jk.i64)
    acc = jk.zeros((BR, BC), jk.f32)
    step = 1.0
    for k in range(0, K, BC):
        acc = acc + jk.load(xrows + (k + cols)[None, :], mask=rm, other=-1.0) * step
        step = step + 1.0
    jk.store(y + rows[:, None] * ldy + cols[None, :], acc, mask=rm)


@pytest.mark.parametrize("BR,BC", [(16, 32), (2, 256), (8, 4)])
def test_strided_tile_chunk_addresses(tier, BR, BC):
    """Chunk addresses of 2-D tiles with a run-time row stride (GPU lowering: chunk pointer = previous chunk
    pointer + a uniform step from the offsets' affine form; coordinates as thread part + constants), with
    rows both a multiple of the threads' chunk span and spanning several of them, a masked row tail, and an
    aligned and an odd row stride (vector chunk loads and gathers). One warp: 4 chunks of 4 a thread."""
    rng = np.random.default_rng(BR * 7 + BC)
    for R, ldx in ((BR * 2 + 1, 3 * BC + 16), (BR - 1 if BR > 2 else 1, 2 * BC + 3)):
        K = 2 * BC
        x = rng.standard_normal((R, ldx)).astype(np.float32)
        ldy = BC + 4
        y = np.full((R + 1, ldy), np.nan, np.float32)
        _run(_strided_tile_sum, (jk.cdiv(R, BR),), tier, x, y, R, K, ldx, ldy, BR=BR, BC=BC, num_warps=1)
        want = x[:, :BC] * 1.0 + x[:, BC:2 * BC] * 2.0
        np.testing.assert_allclose(y[:R, :BC], want, rtol=1e-6, atol=1e-6)
        assert np.isnan(y[:R, BC:]).all() and np.isnan(y[R:]).all(), "stores outside the tile"
