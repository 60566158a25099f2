"""DeviceArray semantics (numpy dtypes, byte strides, views on any axis, reshape, dtype views) and op
wrappers taking DeviceArrays (outputs allocated on the inputs' device), against numpy references on fresh
random data.

Each test runs twice: on `fake` (tests/fake_cuda.py: host memory standing in for the device, CPU kernels;
runs everywhere) and on `cuda` (a real GPU, marked `gpu`: run with `-m gpu` on the H200)."""
import numpy as np
import pytest

from tests.ops.ref_basic import as_f64, gelu_tanh_ref, layer_norm_ref, rms_norm_ref, rope_ref, silu_ref, stored, to_bf16
from tests.ops.test_attention import BS, make_step, ref_paged_attention

BACKENDS = ["fake", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def cuda(request, monkeypatch):
    from jitkern.runtime import cuda as cuda_mod
    if request.param == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    elif not cuda_mod.is_available():
        pytest.skip("no CUDA device here")
    return cuda_mod


def test_device_array_is_numpy_like(cuda):
    rng = np.random.default_rng(10)
    a = rng.standard_normal((7, 5, 9)).astype(np.float32)
    d = cuda.DeviceArray.from_numpy(a)
    assert d.dtype == np.float32 and d.elem.name == "f32"
    assert (d.shape, d.strides, d.itemsize, d.ndim, d.nbytes) == (a.shape, a.strides, 4, 3, a.nbytes)
    for key in [(slice(None), slice(1, 4)), (2, slice(None), slice(3, 8)), (slice(1, 6, 2), 3),
                (Ellipsis, slice(2, 7)), (-1,), (slice(None), slice(None), 4)]:
        v = d[key]
        assert v.shape == a[key].shape and v.strides == a[key].strides, key
        np.testing.assert_array_equal(v.numpy(), a[key])
    # writes into a strided view land in the parent's memory only there
    new = rng.standard_normal((7, 3, 9)).astype(np.float32)
    d[:, 1:4].copy_from_numpy(new)
    a[:, 1:4] = new
    np.testing.assert_array_equal(d.numpy(), a)
    r = d.reshape(35, 9)
    assert r.ptr == d.ptr and r.shape == (35, 9)
    np.testing.assert_array_equal(r[3:5].numpy(), a.reshape(35, 9)[3:5])
    with pytest.raises(ValueError, match="non-contiguous"):
        d[:, 1:4].reshape(-1)
    bits = to_bf16(rng.standard_normal(33))
    b = cuda.DeviceArray.from_numpy(bits, dtype="bf16")
    assert b.dtype == np.uint16 and b.elem.name == "bf16"
    np.testing.assert_array_equal(b.numpy(), bits)
    u = cuda.DeviceArray.from_numpy(bits)
    assert u.elem.name == "u16" and u.view("bf16").elem.name == "bf16" and u.view(np.float16).dtype == np.float16
    i8 = cuda.DeviceArray.from_numpy(rng.integers(-100, 100, (3, 8)).astype(np.int8))
    assert i8.view(np.int32).shape == (3, 2)
    import jitkern as jk
    assert jk.as_pointer(u, "bf16").elem.name == "bf16" and jk.as_pointer(u, "bf16").ptr == u.ptr
    with pytest.raises(TypeError, match="numpy"):
        np.asarray(d) + 1


def _dev(cuda, a):
    return cuda.DeviceArray.from_numpy(a)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_basic_ops_on_device_arrays(cuda, dtype):
    from engine.ops.activation import add, gelu_tanh, silu_and_mul
    from engine.ops.embedding import embedding
    from engine.ops.norm import layer_norm, rms_norm
    from engine.ops.softmax import softmax
    rng = np.random.default_rng(11)
    T, n = 13, 197
    x = stored(rng.standard_normal((T, n + 50)), dtype)
    w = rng.standard_normal(n).astype(np.float32)
    dx = _dev(cuda, x)[:, 7:7 + n]                     # a row-strided view
    y = rms_norm(dx, _dev(cuda, w), 1e-5)
    assert isinstance(y, cuda.DeviceArray) and y.dtype == x.dtype and y.shape == (T, n)
    np.testing.assert_allclose(as_f64(y.numpy()), rms_norm_ref(as_f64(x[:, 7:7 + n]), w, 1e-5),
                               rtol={"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}[dtype], atol=1e-2)
    b = rng.standard_normal(n).astype(np.float32)
    z = layer_norm(dx, _dev(cuda, w), _dev(cuda, b), 1e-5)
    np.testing.assert_allclose(as_f64(z.numpy()), layer_norm_ref(as_f64(x[:, 7:7 + n]), w, b, 1e-5),
                               rtol={"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}[dtype], atol=2e-2)
    gu = stored(rng.standard_normal((T, 2 * n)), dtype)
    act = silu_and_mul(_dev(cuda, gu))
    want = silu_ref(as_f64(gu[:, :n])) * as_f64(gu[:, n:])
    np.testing.assert_allclose(as_f64(act.numpy()), want, rtol=2e-2 if dtype == "bf16" else 3e-3, atol=2e-2)
    s = add(dx, dx)
    np.testing.assert_allclose(as_f64(s.numpy()), 2 * as_f64(x[:, 7:7 + n]), rtol=1e-2)
    g = gelu_tanh(_dev(cuda, x))
    np.testing.assert_allclose(as_f64(g.numpy()), gelu_tanh_ref(as_f64(x)), rtol=2e-2 if dtype == "bf16" else 3e-3,
                               atol=2e-2)
    table = stored(rng.standard_normal((300, n)), dtype)
    ids = rng.integers(0, 300, T).astype(np.int32)
    e = embedding(_dev(cuda, ids), _dev(cuda, table))
    np.testing.assert_array_equal(e.numpy(), as_f64(table[ids]).astype(np.float32))
    p = softmax(_dev(cuda, x))
    r = np.exp(as_f64(x) - as_f64(x).max(1, keepdims=True))
    np.testing.assert_allclose(p.numpy(), r / r.sum(1, keepdims=True), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("M", [1, 5, 19])
def test_linear_on_device_arrays(cuda, wdt, M):
    from engine.ops.matmul import linear
    rng = np.random.default_rng(12)
    N, K = 37, 131
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = stored(rng.standard_normal((N, K)) / 8, wdt)
    bias = rng.standard_normal(N).astype(np.float32)
    out = linear(_dev(cuda, x), _dev(cuda, w), bias=_dev(cuda, bias), **({"w_dtype": "bf16"} if wdt == "bf16" else {}))
    assert isinstance(out, cuda.DeviceArray)
    np.testing.assert_allclose(out.numpy(), x.astype(np.float64) @ as_f64(w).T + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q4_K", "q6_K"])
def test_quantised_matmul_and_rows_on_device_arrays(cuda, qtype):
    pytest.importorskip("gguf")
    from engine.ops.quant import dequantize_rows, matmul_q
    from tests.ops.test_quant import make_weight
    rng = np.random.default_rng(13)
    N, K = 24, 512
    raw, wd = make_weight(qtype, N, K, rng)
    wd = wd.astype(np.float64)
    draw = _dev(cuda, raw)
    for M in (1, 6):
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = matmul_q(_dev(cuda, x), draw, qtype, N, K)
        assert isinstance(y, cuda.DeviceArray)
        want = x.astype(np.float64) @ wd.T
        np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=0.02 * np.abs(want).max())
        np.testing.assert_array_equal(y.numpy(), matmul_q(x, raw, qtype, N, K, target=draw.device.target()))
    idx = rng.integers(0, N, 9).astype(np.int32)
    rows = dequantize_rows(draw, qtype, _dev(cuda, idx), K)
    np.testing.assert_allclose(rows.numpy(), wd[idx], rtol=1e-6, atol=1e-6)


def test_rope_and_attention_on_device_arrays(cuda):
    from engine.ops.attention import paged_attention, reshape_and_cache
    from engine.ops.rope import rope, rope_cos_sin_cache
    rng = np.random.default_rng(14)
    H, KVH, D = 4, 2, 64
    seqs = [(1, 1), (17, 1), (40, 23), (300, 1), (33, 33)]
    q, kc, vc, qs, sl, bt = make_step(rng, seqs, H, KVH, D, np.float32)
    T = q.shape[0]
    # q, k, v as strided views of one fused buffer, as the engine has them
    qkv = rng.standard_normal((T, (H + 2 * KVH) * D)).astype(np.float32)
    qkv[:, :H * D] = q.reshape(T, -1)
    dqkv = _dev(cuda, qkv)
    dq = dqkv[:, :H * D].as_strided((T, H, D), (dqkv.strides[0], D * 4, 4))
    dk = dqkv[:, H * D:].as_strided((T, KVH, D), (dqkv.strides[0], D * 4, 4))
    dv = dqkv[:, (H + KVH) * D:].as_strided((T, KVH, D), (dqkv.strides[0], D * 4, 4))
    pos = np.concatenate([np.arange(L - ql, L) for L, ql in seqs]).astype(np.int32)
    cache = rope_cos_sin_cache(D, D, 1024, 10000.0, None)
    rope(dq, dk, _dev(cuda, pos), _dev(cuda, cache), D, D, True)
    qr = rope_ref(q.astype(np.float64), pos, cache, D, True)
    kr = rope_ref(qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D).astype(np.float64), pos, cache, D, True)
    np.testing.assert_allclose(dq.numpy(), qr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.numpy(), kr, rtol=1e-5, atol=1e-5)
    # the new tokens' k/v go to fresh slots of the caches
    slots = np.concatenate([[int(bt[i, p // BS]) * BS + p % BS for p in range(L - ql, L)]
                            for i, (L, ql) in enumerate(seqs)]).astype(np.int32)
    dkc, dvc = _dev(cuda, kc), _dev(cuda, vc)
    reshape_and_cache(dk, dv, dkc, dvc, _dev(cuda, slots))
    kc2, vc2 = kc.copy(), vc.copy()
    kc2.reshape(-1, KVH, D)[slots] = dk.numpy()
    vc2.reshape(-1, KVH, D)[slots] = qkv[:, (H + KVH) * D:].reshape(T, KVH, D)
    np.testing.assert_array_equal(dkc.numpy(), kc2)
    np.testing.assert_array_equal(dvc.numpy(), vc2)
    out = paged_attention(dq, dkc, dvc, _dev(cuda, qs), _dev(cuda, sl), _dev(cuda, bt), scale=D ** -0.5,
                          host_step=(qs, sl))
    assert isinstance(out, cuda.DeviceArray)
    want = ref_paged_attention(dq.numpy(), kc2, vc2, qs, sl, bt, D ** -0.5)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=2e-5)
    # without host copies the lengths are downloaded: same result
    out2 = paged_attention(dq, dkc, dvc, _dev(cuda, qs), _dev(cuda, sl), _dev(cuda, bt), scale=D ** -0.5)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())


def test_argmax_on_device_arrays(cuda):
    from engine.ops.sampling import argmax_rows
    rng = np.random.default_rng(15)
    x = rng.standard_normal((6, 1001)).astype(np.float32)
    got = argmax_rows(_dev(cuda, x))
    np.testing.assert_array_equal(got.numpy(), x.argmax(1))


def test_frees_wait_for_the_end_of_a_stream_capture(monkeypatch):
    # a cuMemFreeAsync issued while the stream is being captured would be recorded into the graph and repeated
    # at every replay: frees of arrays dropped during a capture wait for its end (driver calls faked here)
    from jitkern.runtime import cuda
    from tests.fake_cuda import install
    dev = install(monkeypatch)
    dev.stream = object()

    class FakeDriver:
        class CUstreamCaptureMode:
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1

        def cuStreamBeginCapture(self, stream, mode):
            return (0,)

        def cuStreamEndCapture(self, stream):
            return (0, "graph")

        def cuGraphInstantiate(self, graph, flags):
            return (0, "exec")

    monkeypatch.setattr(cuda, "driver", lambda: FakeDriver())
    freed = []
    real_free = dev.free
    monkeypatch.setattr(dev, "free", lambda ptr: (freed.append(ptr), real_free(ptr)))
    a = cuda.DeviceArray.empty(100, np.float32)
    g = cuda.CudaGraph(dev)
    g.begin()
    ptr = a.ptr
    del a
    assert freed == []
    g.end()
    assert freed == [ptr] and g.exec == "exec"
    b = cuda.DeviceArray.empty(10, np.int32)
    ptr = b.ptr
    del b
    assert freed[-1] == ptr


def _sm90a_backend(backend, monkeypatch):
    """The cuda runtime module: the real GPU (skipped without one), or the fake device claiming sm_90a (the
    GPU tiles are chosen and compiled with ptxas, then run on the CPU)."""
    from jitkern.runtime import cuda as cuda_mod
    if backend == "fake":
        monkeypatch.setenv("JITKERN_FAKE_CUDA_TARGET", "sm_90a")
        from tests.fake_cuda import install
        install(monkeypatch)
    elif not cuda_mod.is_available():
        pytest.skip("no CUDA device here")
    return cuda_mod


def _tuned_for(arr, **choices):
    """The target of device array `arr` with tuning entries changed (targets.tuned): a launch option of the ops."""
    from engine.ops._hostargs import resolve_target
    from targets import tuned
    return tuned(resolve_target(None, arr), **choices)


def _bf16_linear_case(cuda_mod, rng, M, N, K):
    """x [M, K] f32, bf16 weights [N, K] (and their float64 values), bias; weights and bias on the device."""
    w = to_bf16(rng.standard_normal((N, K)) / 8)
    w64 = (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x, w64, bias, _dev(cuda_mod, w), _dev(cuda_mod, bias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_split_k_tiles(backend, monkeypatch):
    """The tensor-core linear with K split into slabs (a tile's 5th entry) plus their ordered sum, tokens in
    chunks of GPU_SPLITK_MAX_M: numpy's result, and each token's row the same bits alone as in the batch.
    On `fake` the sm_90a tiles are chosen and compiled (ptxas), then run on the CPU."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 2))
    monkeypatch.setattr(mm, "GPU_SPLITK_MAX_M", 8)
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(13), 19, 96, 256)
    mm._LAST.clear()
    full = mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16").numpy()
    assert mm.last_compiled("_gpu_splitk_sum_kernel") is not None
    assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["SPLIT"] == 2
    want = x.astype(np.float64) @ w64.T + bias
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for M in (1, 5):
        part = mm.linear(_dev(cuda_mod, x[7:7 + M]), dw, bias=db, w_dtype="bf16").numpy()
        np.testing.assert_array_equal(part, full[7:7 + M])


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_serial_split_gives_the_slab_paths_bits(backend, monkeypatch):
    """From tuning.serial_split_m tokens a split K's slabs are summed inside each program (SERIAL, no slabs
    through memory, no sum kernel): bit for bit what the slab programs plus the sum kernel give, with and without
    bias, and a token's row the same bits as its decode (slab path) row."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 4))
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(31), 21, 96, 512)
    want = (to_bf16(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ w64.T + bias
    for b in (db, None):
        mm._LAST.clear()
        slabs = mm.linear(_dev(cuda_mod, x), dw, bias=b, w_dtype="bf16",
                          target=_tuned_for(dw, serial_split_m=1 << 62)).numpy()
        assert mm.last_compiled("_gpu_splitk_sum_kernel") is not None
        assert not mm.last_compiled("_gpu_linear_mma_kernel").constexprs.get("SERIAL")
        T8 = _tuned_for(dw, serial_split_m=8)
        mm._LAST.clear()
        serial = mm.linear(_dev(cuda_mod, x), dw, bias=b, w_dtype="bf16", target=T8).numpy()
        ck = mm.last_compiled("_gpu_linear_mma_kernel")
        assert ck.constexprs["SERIAL"] and ck.constexprs["SPLIT"] == 4
        assert mm.last_compiled("_gpu_splitk_sum_kernel") is None
        np.testing.assert_array_equal(serial, slabs)
        ref = want if b is not None else want - bias
        np.testing.assert_allclose(serial, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        one = mm.linear(_dev(cuda_mod, x[9:10]), dw, bias=b, w_dtype="bf16", target=T8).numpy()   # under 8: slabs
        np.testing.assert_array_equal(one, serial[9:10])


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_prefetch_2_gives_the_same_bits(backend, monkeypatch):
    """tuning.linear_prefetch = 2: the cp.async tiles' K loops load two steps ahead into
    three buffers (num_stages=3, PREFETCH=2; wgmma tiles only): the same dots in the same order, the last two
    chained in the accumulator registers like the loop's, so bit for bit the result of PREFETCH 1, through the
    slab path, the serial split and an unsplit weight, with bf16 x; K ranges of one step keep PREFETCH 1. On `fake` a small tile runs the kernel on the CPU (the DSL's order); on the GPU the
    engine's tiles, the huge one included."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    choices = dict(linear_tma=False)      # (cp.async's chains: with TMA on, PREFETCH 2 is TMA's only)
    if backend == "fake":
        monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 2))
        monkeypatch.setattr(mm, "GPU_LINEAR_ASYNC_MIN_BM", 16)
        choices["linear_wgmma_min_bm"] = 16      # (PREFETCH 2 runs on wgmma tiles only)
        cases = [(21, 96, 512, 8), (21, 96, 512, 1 << 62), (5, 96, 128, 1 << 62)]
    else:
        cases = [(300, 512, 1024, 1 << 62), (300, 512, 1024, 8), (300, 6144, 512, 1 << 62), (70, 4096, 1024, 1 << 62)]
    for M, N, K, serial_m in cases:
        x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(M + N + K), M, N, K)
        xd = _dev(cuda_mod, to_bf16(x))
        got = {}
        for pf in (1, 2):
            T = _tuned_for(dw, serial_split_m=serial_m, linear_prefetch=pf, **choices)
            got[pf] = mm.linear(xd, dw, bias=db, w_dtype="bf16", x_dtype="bf16", target=T).numpy()
            ck = mm.last_compiled("_gpu_linear_mma_kernel")
            S = ck.constexprs.get("SPLIT", 1)
            steps = K // (S * ck.constexprs["BK"])
            assert ck.constexprs.get("PREFETCH", 1) == (2 if pf == 2 and steps >= 2 else 1), (M, N, K, steps)
        np.testing.assert_array_equal(got[2], got[1], err_msg=f"M={M} N={N} K={K}")
        want = (to_bf16(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ w64.T + bias
        np.testing.assert_allclose(got[2], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_tma_gives_the_same_bits(backend, monkeypatch):
    """tuning.linear_tma: the wgmma tiles' K loops copy x and w by the tensor memory accelerator
    (tensor maps, mbarriers) into the same 128-byte swizzled staging cp.async writes: bit for bit the cp.async
    result, through the slab path, the serial split (its chains re-arm their barriers each slab), an unsplit
    weight, the 64-row tile, and token counts that leave a partial tile (TMA zero-fills the rows past M), with
    prefetch-2 chains (three buffers) too. On
    `fake` (no tensor maps: host memory) the launch keeps cp.async and the bits are the same trivially; on the
    GPU the launch must have taken the `tma` option. tuning.tma_pipe (the MMAs in flight into the next step) gives
    the same bits too."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    choices = {}
    if backend == "fake":
        monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 2))
        monkeypatch.setattr(mm, "GPU_LINEAR_ASYNC_MIN_BM", 16)
        choices["linear_wgmma_min_bm"] = 16
        cases = [(21, 96, 512, 8), (21, 96, 512, 1 << 62)]
    else:
        cases = [(300, 512, 1024, 1 << 62), (300, 512, 1024, 8), (300, 6144, 512, 1 << 62), (70, 4096, 1024, 1 << 62),
                 (1030, 1024, 4096, 1 << 62), (129, 28672 // 8, 4096, 1 << 62)]
    for M, N, K, serial_m in cases:
        x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(M + N + K + 5), M, N, K)
        xd = _dev(cuda_mod, to_bf16(x))
        got = {}
        runs = ((False, 1, False), (True, 1, False), (True, 2, False), (True, 1, True), (True, 2, True))
        for on, pf, pipe in runs:
            T = _tuned_for(dw, serial_split_m=serial_m, linear_tma=on, linear_prefetch=pf, tma_pipe=pipe, **choices)
            mm._LAST.clear()
            got[on, pf, pipe] = mm.linear(xd, dw, bias=db, w_dtype="bf16", x_dtype="bf16", target=T).numpy()
            ck = mm.last_compiled("_gpu_linear_mma_kernel")
            assert bool(ck.constexprs.get("tma")) == (on and backend == "cuda"), (M, N, K, ck.constexprs)
            if on and backend == "fake":
                assert ck.constexprs.get("PREFETCH", 1) == 1      # prefetch 2 is for TMA launches only
        for key in runs[1:]:
            np.testing.assert_array_equal(got[key], got[runs[0]], err_msg=f"M={M} N={N} K={K} {key}")
        want = (to_bf16(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ w64.T + bias
        np.testing.assert_allclose(got[runs[1]], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_16bit_activations(backend, monkeypatch):
    """GPU_LINEAR_ACTIVATIONS = "16bit": the tensor-core linear rounds x to bf16 (one MMA chain): the result is
    float64's of the rounded x (closer to it than the f32 result is: the rounding is applied, not the hi + lo
    split), the split-K path takes it too, and a token's row is the same bits alone as in the batch."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 2))
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(21), 19, 96, 256)
    mm._LAST.clear()
    full = mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16").numpy()
    assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["ACT16"] == 1
    x16 = (to_bf16(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    want16 = x16 @ w64.T + bias
    want32 = x.astype(np.float64) @ w64.T + bias
    err16 = np.abs(full - want16).max()
    assert err16 <= 1e-5 * np.abs(want16).max(), err16
    assert np.abs(want32 - want16).max() > 20 * err16       # the test can tell the two modes apart
    for M in (1, 5):
        part = mm.linear(_dev(cuda_mod, x[7:7 + M]), dw, bias=db, w_dtype="bf16").numpy()
        np.testing.assert_array_equal(part, full[7:7 + M])
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "bf16")
    with pytest.raises(ValueError, match="GPU_LINEAR_ACTIVATIONS"):
        mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16")
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    assert (mm._act16_for("bf16"), mm._act16_for("f16")) == (1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tile", [(16, 32, 64, 4, 2), (16, 32, 64, 4)], ids=["splitk", "whole"])
def test_linear_16bit_x_gives_the_16bit_activations_bits(backend, monkeypatch, tile):
    """x already in bf16 (x_dtype="bf16": what a producer writing the linear's input in 16 bits hands over) gives
    bit for bit the f32 x with activations "16bit" (the kernel rounds x to bf16 first), through the split-K
    path and the whole-K one, alone and in a batch; the wrong storage or a path without the kernel is an error
    naming the field."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", tile)
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(37), 19, 96, 256)
    want = mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16", activations="16bit").numpy()
    x16 = to_bf16(x)
    mm._LAST.clear()
    got = mm.linear(_dev(cuda_mod, x16), dw, bias=db, w_dtype="bf16", x_dtype="bf16").numpy()
    assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["ACT16"] == 1
    np.testing.assert_array_equal(got, want)
    part = mm.linear(_dev(cuda_mod, x16[3:4]), dw, bias=db, w_dtype="bf16", x_dtype="bf16").numpy()
    np.testing.assert_array_equal(part, want[3:4])
    ref = (x16.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ w64.T + bias
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="x: expected uint16 storage for x_dtype='bf16'"):
        mm.linear(_dev(cuda_mod, x), dw, w_dtype="bf16", x_dtype="bf16")
    with pytest.raises(ValueError, match="x_dtype='f16' needs the tensor-core GPU linear with f16 weights"):
        mm.linear(_dev(cuda_mod, x.astype(np.float16)), dw, w_dtype="bf16", x_dtype="f16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_k_sum_folded_into_the_norm_and_the_activation(backend, monkeypatch):
    """linear(fold_sum=True) leaves a split-K linear's slabs to its consumer (matmul.SplitK): rms_norm (with the
    residual add) and silu_and_mul sum them in slab order, bit for bit what the sum kernel + the op give; no
    split (one K range), a bias, or too many tokens give the ordinary result."""
    from engine.ops import matmul as mm
    from engine.ops.activation import silu_and_mul
    from engine.ops.norm import rms_norm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 4))
    rng = np.random.default_rng(41)
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, rng, 19, 96, 256)
    xd = _dev(cuda_mod, x)
    y = mm.linear(xd, dw, w_dtype="bf16")
    folded = mm.linear(xd, dw, w_dtype="bf16", fold_sum=True)
    assert isinstance(folded, mm.SplitK) and folded.S == 4 and folded.shape == (19, 96)
    nw = _dev(cuda_mod, rng.standard_normal(96).astype(np.float32))
    res0 = rng.standard_normal((19, 96)).astype(np.float32)
    outs = []
    for src in (y, folded):
        res, out = _dev(cuda_mod, res0), _dev(cuda_mod, np.zeros((19, 96), np.float32))
        rms_norm(src, nw, 1e-5, out=out, residual=res)
        outs.append((out.numpy(), res.numpy()))
    np.testing.assert_array_equal(outs[1][0], outs[0][0])
    np.testing.assert_array_equal(outs[1][1], outs[0][1])
    np.testing.assert_array_equal(outs[0][1], res0 + y.numpy())
    plain = _dev(cuda_mod, np.zeros((19, 96), np.float32))
    rms_norm(mm.linear(xd, dw, w_dtype="bf16", fold_sum=True), nw, 1e-5, out=plain)
    want = rms_norm(y, nw, 1e-5).numpy()
    np.testing.assert_array_equal(plain.numpy(), want)
    a0 = silu_and_mul(y).numpy()
    a1 = silu_and_mul(mm.linear(xd, dw, w_dtype="bf16", fold_sum=True)).numpy()
    np.testing.assert_array_equal(a1, a0)
    assert not isinstance(mm.linear(xd, dw, bias=db, w_dtype="bf16", fold_sum=True), mm.SplitK)
    monkeypatch.setattr(mm, "GPU_SPLITK_MAX_M", 8)
    assert not isinstance(mm.linear(xd, dw, w_dtype="bf16", fold_sum=True), mm.SplitK)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4))
    r = mm.linear(xd, dw, w_dtype="bf16", fold_sum=True)
    assert not isinstance(r, mm.SplitK)


def _tiled_linear_case(cuda_mod, seed, M, N, K, bm):
    """A bf16 linear case of M tokens launched whole: checks it took a tile of bm rows and matches float64;
    returns (x, weights, bias on the device, the result, the float64 reference)."""
    from engine.ops import matmul as mm
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(seed), M, N, K)
    mm._LAST.clear()
    full = mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16").numpy()
    assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["BM"] == bm
    want = x.astype(np.float64) @ w64.T + bias
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    return x, dw, db, full, want


def _tiled_linear_case16(cuda_mod, seed, M, N, K, bm):
    """_tiled_linear_case with 16-bit activations: the float64 reference of the bf16-rounded x."""
    from engine.ops import matmul as mm
    x, w64, bias, dw, db = _bf16_linear_case(cuda_mod, np.random.default_rng(seed), M, N, K)
    mm._LAST.clear()
    full = mm.linear(_dev(cuda_mod, x), dw, bias=db, w_dtype="bf16").numpy()
    ck = mm.last_compiled("_gpu_linear_mma_kernel")
    assert ck.constexprs["BM"] == bm and ck.constexprs["ACT16"] == 1
    want = (to_bf16(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ w64.T + bias
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    return x, dw, db, full, want


def test_linear_tile_tiers_by_token_count():
    """The tensor-core linear's tile on an H100/H200-class GPU: the decode tile below GPU_LINEAR_WIDE_M tokens,
    the tall tile from there, the mid tile (the big one for wide weights) from GPU_LINEAR_MID_M, the big tile
    from GPU_LINEAR_BIG_M, all with the decode tile's K split (which depends on N and K only: 4 for narrow weights, none
    for wide ones), the huge / XL tiles on warpgroup MMAs; a weight a taller tile does not divide keeps the next
    smaller one."""
    from engine.ops import matmul as mm
    from targets import get_target
    T = get_target("sm_90a")
    dec = mm._mma_tile_for(T, 4096, 4096, 1)
    assert dec == (16, 64, 128, 4, 4)                            # narrow weight: K split in 4
    assert mm._mma_tile_for(T, 28672, 4096, 1) == (16, 64, 128, 4, 1)    # wide weight: no K split
    assert mm._mma_tile_for(T, 128256, 4096, 1) == (16, 64, 128, 4, 1)
    assert mm._mma_tile_for(T, 4096, 14336, 1) == (16, 64, 128, 4, 4)
    assert mm._mma_tile_for(T, 64 * (mm.GPU_NOSPLIT_MIN_TILES - 1), 4096, 1)[4] > 1
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_WIDE_M - 1) == dec
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_WIDE_M) == tuple(mm.GPU_LINEAR_WIDE_TILE[:4]) + (4,)
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_BIG_M - 1)[:4] == tuple(mm.GPU_LINEAR_MID_TILE[:4])
    # (unsplit weights with f32 activations keep the mid tile: the big one's hi + lo accumulators spill there)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_BIG_M) == tuple(mm.GPU_LINEAR_MID_TILE[:4]) + (1,)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_BIG_M, act16=1)[:4] == tuple(mm.GPU_LINEAR_HUGE_TILE[:4])
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_MID_M) == tuple(mm.GPU_LINEAR_MID_TILE[:4]) + (4,)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_MID_M) == tuple(mm.GPU_LINEAR_MID_TILE[:4]) + (1,)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_MID_M, act16=1) == tuple(mm.GPU_LINEAR_BIG_TILE[:4]) + (1,)
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_MID_M - 1)[:4] == tuple(mm.GPU_LINEAR_WIDE_TILE[:4])
    assert mm._mma_tile_for(T, 384, 4096, 4096)[:4] == tuple(mm.GPU_LINEAR_MID_TILE[:4])    # 384 % 256 != 0
    assert mm._mma_tile_for(T, 576, 576, 4096) == mm._mma_tile_for(T, 576, 576, 1)        # 576 % 128 != 0
    # the huge tile: from GPU_LINEAR_HUGE_M tokens where it runs on warpgroup MMAs (16-bit activations)
    huge = tuple(mm.GPU_LINEAR_HUGE_TILE[:4])
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_HUGE_M, act16=1) == huge + (4,)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_XL_M - 1, act16=1) == huge + (1,)
    # the XL tile: from GPU_LINEAR_XL_M tokens on warpgroup MMAs where K is not split (the serial split's two
    # accumulators would not fit its registers): wide weights; narrow ones keep the huge tile
    xl = tuple(mm.GPU_LINEAR_XL_TILE[:4])
    assert mm._mma_tile_for(T, 28672, 4096, 8192, act16=1) == xl + (1,)
    assert mm._mma_tile_for(T, 28672, 4096, mm.GPU_LINEAR_XL_M, act16=1) == xl + (1,)
    assert mm._mma_tile_for(T, 4096, 4096, 8192, act16=1) == huge + (4,)
    assert mm._mma_tile_for(T, 28672, 4096, 8192, act16=0)[:4] == tuple(mm.GPU_LINEAR_MID_TILE[:4])
    assert mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_HUGE_M - 1, act16=1) == \
        mm._mma_tile_for(T, 4096, 4096, mm.GPU_LINEAR_HUGE_M - 1, act16=0)
    assert mm._mma_tile_for(T, 4096, 4096, 8192, act16=0)[:4] == tuple(mm.GPU_LINEAR_BIG_TILE[:4])
    assert "wgmma" in mm._mma_regs(T, huge[0], 1) and "wgmma" not in mm._mma_regs(T, huge[0], 0)
    assert "wgmma" not in mm._mma_regs(T, 16, 1) and "wgmma" not in mm._mma_regs(get_target("sm_80"), 128, 1)
    from targets import tuned
    T0 = tuned(T, linear_wgmma=False)                       # mma.sync, no huge tile
    assert mm._mma_tile_for(T0, 4096, 4096, 8192, act16=1)[:4] == tuple(mm.GPU_LINEAR_BIG_TILE[:4])
    assert "wgmma" not in mm._mma_regs(T0, huge[0], 1)


@pytest.mark.gpu
@pytest.mark.parametrize("M,activations", [(160, "f32"), (60, "f32"), (160, "16bit"), (60, "16bit")])
def test_linear_big_tile_gives_the_decode_tiles_bits(monkeypatch, M, activations):
    """From GPU_LINEAR_MID_M tokens the linear takes the mid tile (64 rows, 8 warps; N = 512 is narrow), from
    GPU_LINEAR_BIG_M the big one (the huge one with 16-bit activations): rows through them are the same bits as through the tall and the decode
    tiles, with either activation precision (GPU only: on the CPU a dot's sums depend on the tile)."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend("cuda", monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", activations)
    bm = mm._mma_tile_for(cuda_mod.get_device().target(), 512, 512, M, int(activations == "16bit"))[0]
    x, dw, db, full, _ = _tiled_linear_case(cuda_mod, 15, M, 512, 512, bm) \
        if activations == "f32" else _tiled_linear_case16(cuda_mod, 15, M, 512, 512, bm)
    for lo, hi in ((0, 1), (M - 10, M - 9), (M - 10, M), (5, 37), (11, 58)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, bias=db, w_dtype="bf16").numpy()
        assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["BM"] in (16, mm.GPU_LINEAR_WIDE_TILE[0])
        np.testing.assert_array_equal(part, full[lo:hi])


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(512, 512), (6144, 1024)])
def test_linear_huge_tile_gives_the_decode_tiles_bits(monkeypatch, N, K):
    """From GPU_LINEAR_HUGE_M tokens with 16-bit activations the linear takes the huge tile (128 tokens, two
    warpgroups of wgmma fed by cp.async, the defaults): it matches float64 and a token's row
    is the same bits through it as through the big, mid, tall and decode tiles (mma.sync below 64 tokens)."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend("cuda", monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    M = mm.GPU_LINEAR_HUGE_M + 45
    x, dw, db, full, _ = _tiled_linear_case16(cuda_mod, 17, M, N, K, mm.GPU_LINEAR_HUGE_TILE[0])
    ck = mm.last_compiled("_gpu_linear_mma_kernel")
    assert ck.constexprs.get("wgmma") == 1 and "wgmma.mma_async" in ck.ptx() and "cp.async" in ck.ptx()
    seen = set()
    for lo, hi in ((0, 1), (3, 30), (M - 70, M), (11, 150), (1, mm.GPU_LINEAR_HUGE_M - 1), (0, M - 1)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, bias=db, w_dtype="bf16").numpy()
        seen.add(mm.last_compiled("_gpu_linear_mma_kernel").constexprs["BM"])
        np.testing.assert_array_equal(part, full[lo:hi], err_msg=f"tokens {lo}:{hi}")
    assert seen == {16, 32, 64, 128}, seen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefetch", [1, 2])
def test_linear_serial_chain_gives_the_serial_splits_bits(backend, prefetch, monkeypatch):
    """The serial split with one copy chain through its slabs (tuning.serial_chain, _mma_serial_chain) at the
    engine's prefill tile for a narrow weight (K split in 4; 16-bit x on the device: warpgroup MMAs fed by TMA on
    the H200, cp.async on `fake`): bit for bit the serial split that restarts its pipeline a slab, and a token's
    row the same bits as its decode (slab programs) row; float64 close."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    rng = np.random.default_rng(41)
    N, K, M = 256, 1024, 263
    assert mm.gpu_linear_mma_tile(N, K)[4] == 4
    w = to_bf16(rng.standard_normal((N, K)) / 8)
    w64 = (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    x = to_bf16(rng.standard_normal((M, K)))
    x64 = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    dw, dx = _dev(cuda_mod, w), _dev(cuda_mod, x)
    got = {}
    for chain in (False, True):
        T = _tuned_for(dw, linear_prefetch=prefetch, serial_split_m=200, serial_chain=chain)
        mm._LAST.clear()
        got[chain] = mm.linear(dx, dw, w_dtype="bf16", x_dtype="bf16", target=T).numpy()
        ck = mm.last_compiled("_gpu_linear_mma_kernel")
        assert ck.constexprs["SERIAL"] and ck.constexprs["SPLIT"] == 4 and ck.constexprs["CHAIN"] == chain
        if backend == "cuda":
            assert ck.constexprs.get("tma") == 1 and ck.constexprs.get("PREFETCH", 1) == prefetch
            assert "cp.async.bulk.tensor" in ck.ptx() and "ld.global" not in ck.ptx()
    np.testing.assert_array_equal(got[True], got[False])
    want = x64 @ w64.T
    np.testing.assert_allclose(got[True], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for lo, hi in ((0, 1), (100, 103)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, w_dtype="bf16", x_dtype="bf16", target=T).numpy()
        assert not mm.last_compiled("_gpu_linear_mma_kernel").constexprs.get("SERIAL")
        np.testing.assert_array_equal(part, got[True][lo:hi], err_msg=f"tokens {lo}:{hi}")


@pytest.mark.gpu
def test_linear_xl_tile_gives_the_decode_tiles_bits(monkeypatch):
    """A wide weight (GPU_NOSPLIT_MIN_TILES column tiles: no K split) from GPU_LINEAR_XL_M tokens with 16-bit
    activations takes the XL tile (256 tokens, two warpgroups of m64n256 wgmma fed by TMA): it matches float64 and a
    token's row is the same bits through it as through the huge, big, tall and decode tiles."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend("cuda", monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    N, K = 64 * mm.GPU_NOSPLIT_MIN_TILES, 512
    assert mm.gpu_linear_mma_tile(N, K)[4] == 1
    M = mm.GPU_LINEAR_XL_M + 45
    x, dw, db, full, _ = _tiled_linear_case16(cuda_mod, 19, M, N, K, mm.GPU_LINEAR_XL_TILE[0])
    ck = mm.last_compiled("_gpu_linear_mma_kernel")
    assert ck.constexprs.get("wgmma") == 1 and ck.constexprs["SPLIT"] == 1
    seen = set()
    for lo, hi in ((0, 1), (3, 30), (M - 70, M), (11, 150), (0, mm.GPU_LINEAR_XL_M - 1), (5, M)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, bias=db, w_dtype="bf16").numpy()
        seen.add(mm.last_compiled("_gpu_linear_mma_kernel").constexprs["BM"])
        np.testing.assert_array_equal(part, full[lo:hi], err_msg=f"tokens {lo}:{hi}")
    assert seen == {16, 32, 64, 128, 256}, seen


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.gpu), "fake"])
@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
def test_linear_16bit_out_is_the_f32_result_rounded(monkeypatch, backend, wide):
    """`linear(..., out=uint16 array)`: the tensor-core linear stores its f32 result rounded to bf16 (nearest even),
    through every tile the token count picks, with bf16 x (TMA on sm_90a from 64 tokens): a wide weight (no K
    split: decode, tall, mid / big, huge, XL tiles) and a narrow one (K split in 4: slab programs + the sum kernel,
    the serial split from tuning.serial_split_m tokens). The fake sm_90a device runs the small sizes only."""
    from engine.ops import matmul as mm
    from targets import Tuning
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    rng = np.random.default_rng(23)
    N, K = (64 * mm.GPU_NOSPLIT_MIN_TILES, 512) if wide else (256, 1024)
    assert (mm.gpu_linear_mma_tile(N, K)[4] == 1) == wide
    w = to_bf16(rng.standard_normal((N, K)) / 8)
    dw = _dev(cuda_mod, w)
    sizes = (1, 30, 70) if backend == "fake" else (1, 30, 70, 200, Tuning().serial_split_m + 45)
    seen = set()
    for M in sizes:
        x = _dev(cuda_mod, to_bf16(rng.standard_normal((M, K))))
        y32 = mm.linear(x, dw, w_dtype="bf16", x_dtype="bf16").numpy()
        y16 = cuda_mod.DeviceArray.empty((M, N), np.uint16, dw.device)
        assert mm.linear(x, dw, w_dtype="bf16", x_dtype="bf16", out=y16) is y16
        ck = mm.last_compiled("_gpu_linear_mma_kernel")
        seen.add((ck.constexprs["BM"], bool(ck.constexprs.get("SERIAL")), ck.constexprs.get("tma")))
        np.testing.assert_array_equal(y16.numpy(), to_bf16(y32), err_msg=f"M={M}")
    if backend == "cuda":
        assert any(t == 1 for _, _, t in seen), seen
        assert any(serial for _, serial, _ in seen) == (not wide), seen


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.gpu), "fake"])
@pytest.mark.parametrize("wdt,act", [("bf16", "silu"), ("f16", "gelu_tanh")])
def test_gated_linear_is_linear_then_act_and_mul(monkeypatch, backend, wdt, act):
    """matmul.gated_linear (decode-sized steps: a program's tile holds gate rows and the same outputs' up rows, the
    activation in its epilogue) gives the bits of `linear(out=<16-bit>)` into a gate_up array (which it writes too)
    followed by silu_and_mul / gelu_tanh_and_mul, at 1 to GPU_GATED_MAX_M tokens, with K split (decode tile of a wide weight: none) or not
    applicable (gated_tile None where the tile would split K or from the tall tile on)."""
    from engine.ops import activation as A
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    rng = np.random.default_rng(31)
    N, K = 2 * 64 * mm.GPU_NOSPLIT_MIN_TILES, 256
    T = cuda_mod.get_device().target()
    st = np.uint16 if wdt == "bf16" else np.float16
    w = to_bf16(rng.standard_normal((N, K)) / 8) if wdt == "bf16" else (rng.standard_normal((N, K)) / 8).astype(st)
    dw = _dev(cuda_mod, w)
    assert mm.gated_tile(wdt, N, K, mm.GPU_GATED_MAX_M + 1, wdt, T) is None
    assert mm.gated_tile(wdt, N // 8, K, 1, wdt, T) is None           # a narrow weight: K split
    assert mm.gated_tile(wdt, N, K, 1, "f32", T) is None
    for M in (1, 5, mm.GPU_GATED_MAX_M):
        xs = rng.standard_normal((M, K))
        x = _dev(cuda_mod, to_bf16(xs) if wdt == "bf16" else xs.astype(st))
        assert mm.gated_tile(wdt, N, K, M, wdt, T) is not None
        gu = cuda_mod.DeviceArray.empty((M, N), st, dw.device)
        mm.linear(x, dw, w_dtype=wdt if wdt == "bf16" else None, x_dtype=wdt, out=gu)
        want = cuda_mod.DeviceArray.empty((M, N // 2), st, dw.device)
        (A.silu_and_mul if act == "silu" else A.gelu_tanh_and_mul)(gu, out=want)
        got = cuda_mod.DeviceArray.empty((M, N // 2), st, dw.device)
        gu2 = cuda_mod.DeviceArray.empty((M, N), st, dw.device)
        assert mm.gated_linear(x, dw, got, gu2, act=act, w_dtype=wdt if wdt == "bf16" else None, x_dtype=wdt) is got
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"M={M}")
        np.testing.assert_array_equal(gu2.numpy(), gu.numpy(), err_msg=f"M={M}")
    with pytest.raises(ValueError, match="gated_linear: out must be a"):
        mm.gated_linear(x, dw, cuda_mod.DeviceArray.empty((M, N // 2), np.float32, dw.device), gu2, act=act,
                        w_dtype=wdt if wdt == "bf16" else None, x_dtype=wdt)
    with pytest.raises(ValueError, match="gated_linear: gate_up: expected"):
        mm.gated_linear(x, dw, got, cuda_mod.DeviceArray.empty((M, N - 2), st, dw.device), act=act,
                        w_dtype=wdt if wdt == "bf16" else None, x_dtype=wdt)
        assert np.abs(got.numpy().astype(np.int64)).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle,pipe,min_bm", [(0, False, 0), (128, False, 0), (128, True, 0), (0, False, 64)])
@pytest.mark.parametrize("N,K", [(512, 512), (4096, 1024)])
def test_wgmma_linear_matches_float64_and_is_batch_invariant(monkeypatch, N, K, swizzle, pipe, min_bm):
    """The warpgroup-MMA linear (tuning.linear_wgmma, sm_90a: the dots as wgmma with weights as the 64-row
    operand and tokens as N): every tile the token count picks (decode 16, tall 32, mid / big 64) matches
    float64, and a token's row has the same bits whichever tile and batch it went through (narrow and wide
    weights: K split in 4 and in 2), with the operands staged as plain core matrices and 128-byte swizzled,
    and with the K loop's MMAs overlapping the next step's staging (tuning.wgmma_pipe); min_bm 64: wgmma for the 64-row
    tiles only, mma.sync below (equal bits across that switch or the mode is unusable). 16-bit activations: with
    f32 ones the linear keeps mma.sync (matmul._wgmma_for; test_linear_tile_tiers_by_token_count)."""
    from engine.ops import matmul as mm
    from targets import tuned
    cuda_mod = _sm90a_backend("cuda", monkeypatch)
    dev = cuda_mod.get_device()
    T = tuned(dev.target(), linear_wgmma=True, wgmma_swizzle=swizzle, wgmma_pipe=pipe, linear_wgmma_min_bm=min_bm)
    monkeypatch.setattr(dev, "target", lambda: T)      # (every launch on the device's arrays takes these choices)
    monkeypatch.setattr(mm, "GPU_LINEAR_ACTIVATIONS", "16bit")
    M = 160
    x, dw, db, full, _ = _tiled_linear_case16(cuda_mod, 16, M, N, K,
                                              mm._mma_tile_for(cuda_mod.get_device().target(), N, K, M, 1)[0])
    assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs.get("wgmma") == 1
    assert "wgmma.mma_async" in mm.last_compiled("_gpu_linear_mma_kernel").ptx()
    for lo, hi in ((0, 1), (7, 9), (M - 10, M), (5, 37), (11, 75), (0, M - 1)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, bias=db, w_dtype="bf16").numpy()
        np.testing.assert_array_equal(part, full[lo:hi], err_msg=f"tokens {lo}:{hi}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_tall_tile_gives_the_decode_tiles_bits(backend, monkeypatch):
    """From GPU_LINEAR_WIDE_M tokens the tensor-core linear takes a taller tile (32 rows, K steps of 64)
    than at decode sizes (16 rows, K steps of 128): each token's row must be the same bits either way (the
    engine's batch invariance across that switch). On `fake` the sm_90a choice and PTX are exercised and
    the CPU runs the kernels."""
    from engine.ops import matmul as mm
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MID_M", 1 << 62)         # (the mid / big tiles: the test above)
    if backend == "fake":
        # the fake runs these GPU kernels on the CPU, where a dot's sums depend on its K step: the bits
        # match only on the GPU, so the fake keeps the taller tile off by default (tests/fake_cuda.py); a
        # narrower tall tile of the same shape family keeps its CPU compile short
        monkeypatch.setattr(mm, "GPU_LINEAR_WIDE_M", 17)
        # (narrower tiles of the same family than the engine's: a GPU tile's dot compiled for the CPU costs
        # ~1.5 minutes at (16, 64, 128); the sm_90a choice logic and PTX are the same)
        monkeypatch.setattr(mm, "GPU_LINEAR_DECODE_TILE", (16, 32, 64, 4))
        monkeypatch.setattr(mm, "GPU_LINEAR_WIDE_TILE", (32, 32, 64, 4))
    x, dw, db, full, want = _tiled_linear_case(cuda_mod, 14, 97, 256, 512, mm.GPU_LINEAR_WIDE_TILE[0])
    for lo, hi in ((0, 1), (40, 41), (90, 97), (3, 19)):
        part = mm.linear(_dev(cuda_mod, x[lo:hi]), dw, bias=db, w_dtype="bf16").numpy()
        assert mm.last_compiled("_gpu_linear_mma_kernel").constexprs["BM"] == 16
        if backend == "fake":
            np.testing.assert_allclose(part, full[lo:hi], rtol=1e-5, atol=1e-5 * np.abs(want).max())
        else:
            np.testing.assert_array_equal(part, full[lo:hi])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox,rotary", [(True, 32), (False, 32), (True, 16)], ids=["neox", "gptj", "neox-tail"])
def test_split_k_qkv_folded_into_rope_and_cache(backend, monkeypatch, neox, rotary):
    """rope_and_cache(parts=S) reads a split-K q/k/v projection's slabs (matmul.SplitK) and sums them in slab order
    as it reads: the rotated q (its unrotated tail too) and both caches are bit for bit what the sum kernel + the
    in-place op give; slot -1 writes nothing. Wrong q_out / too many tokens are refused."""
    from engine.ops import matmul as mm
    from engine.ops import rope as rp
    cuda_mod = _sm90a_backend(backend, monkeypatch)
    monkeypatch.setattr(mm, "GPU_LINEAR_MMA_TILE", (16, 32, 64, 4, 4))
    rng = np.random.default_rng(43 + rotary + neox)
    T, H, KVH, D = 5, 4, 2, 32
    N = (H + 2 * KVH) * D
    x, _, _, dw, _ = _bf16_linear_case(cuda_mod, rng, T, N, 256)
    xd = _dev(cuda_mod, x)
    y = mm.linear(xd, dw, w_dtype="bf16")
    folded = mm.linear(xd, dw, w_dtype="bf16", fold_sum=True)
    assert isinstance(folded, mm.SplitK) and folded.S == 4
    cos_sin = _dev(cuda_mod, rp.rope_cos_sin_cache(D, rotary, 64, 10000.0))
    pos = _dev(cuda_mod, rng.integers(0, 64, T).astype(np.int32))
    slots = _dev(cuda_mod, np.array([3, -1, 0, 9, 14], np.int32))

    def heads(a, col0, n):
        return a[:, col0:].as_strided((T, n, D), (a.strides[0], D * a.itemsize, a.itemsize))
    fill = rng.standard_normal((4, 4, KVH, D)).astype(np.float16)
    results = []
    for src in (y, folded):
        kc, vc = _dev(cuda_mod, fill), _dev(cuda_mod, fill[::-1].copy())
        out = _dev(cuda_mod, np.full((T, N), np.nan, np.float32))
        if src is y:
            out = _dev(cuda_mod, y.numpy())
            rp.rope_and_cache(heads(out, 0, H), heads(out, H * D, KVH), heads(out, (H + KVH) * D, KVH), pos, cos_sin,
                              D, rotary, neox, kc, vc, slots)
        else:
            p0 = src.parts[0]
            rp.rope_and_cache(heads(p0, 0, H), heads(p0, H * D, KVH), heads(p0, (H + KVH) * D, KVH), pos, cos_sin,
                              D, rotary, neox, kc, vc, slots, q_out=heads(out, 0, H), parts=src.S,
                              part_stride=src.parts.strides[0] // 4)
        results.append((out.numpy()[:, :H * D], kc.numpy(), vc.numpy()))
    for a, b in zip(results[1], results[0]):
        np.testing.assert_array_equal(a, b)
    # the slot -1 token wrote nothing; slot 3 (block 0, offset 3) got token 0's v
    np.testing.assert_array_equal(results[1][2][0, 3], y.numpy()[0, (H + KVH) * D:].reshape(KVH, D).astype(np.float16))
    assert not np.isnan(results[1][0]).any()
    p0 = folded.parts[0]
    with pytest.raises(ValueError, match="q_out must be an array of q's shape and strides"):
        rp.rope_and_cache(heads(p0, 0, H), heads(p0, H * D, KVH), heads(p0, (H + KVH) * D, KVH), pos, cos_sin, D,
                          rotary, neox, kc, vc, slots, q_out=None, parts=4, part_stride=T * N)
    with pytest.raises(ValueError, match="parts must be 1 or more"):
        rp.rope_and_cache(heads(p0, 0, H), heads(p0, H * D, KVH), heads(p0, (H + KVH) * D, KVH), pos, cos_sin, D,
                          rotary, neox, kc, vc, slots, parts=0)
    monkeypatch.setattr(rp, "ROPE_CACHE_PER_HEAD_MAX_T", 4)
    with pytest.raises(ValueError, match="split-K slabs are read on GPUs for at most 4 tokens"):
        rp.rope_and_cache(heads(p0, 0, H), heads(p0, H * D, KVH), heads(p0, (H + KVH) * D, KVH), pos, cos_sin, D,
                          rotary, neox, kc, vc, slots, q_out=heads(out, 0, H), parts=4, part_stride=T * N)
