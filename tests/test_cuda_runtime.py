"""The CUDA runtime and the NVPTX path: device arrays, launches on device arrays, CUDA-graph capture and
replay, shared memory past 48 KiB, cache hits with zero compiles, and (without a GPU) PTX that ptxas accepts.

GPU tests carry the `gpu` marker (CI deselects them; run them on the H200 with `-m gpu`)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import jitkern as jk
from jitkern.compiler import compile_kernel
from targets import get_target


@jk.kernel
def _saxpy(x, y, out, n, a, BLOCK: jk.constexpr):
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, a * jk.load(x + offs, mask=m) + jk.load(y + offs, mask=m), mask=m)


@jk.kernel
def _row_sum_big(x, out, N: jk.constexpr):
    # one 16384-element f32 row: 64 KiB in shared memory for the reduction, past the 48 KiB default
    row = jk.program_id(0)
    offs = jk.arange(0, N)
    v = jk.load(x + row * N + offs)
    jk.store(out + row, jk.sum(v * v, axis=0))


@jk.kernel
def _step(tok, pos, table, out, D: jk.constexpr):
    # reads per-step data from device arrays (as the engine's decode graphs do)
    i = jk.program_id(0)
    t = jk.load(tok + i)
    p = jk.load(pos + i)
    cols = jk.arange(0, D)
    jk.store(out + i * D + cols, jk.load(table + t * D + cols) * (p + 1).to(jk.f32))


def _cuda():
    from jitkern.runtime import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA device here")
    return cuda


@pytest.mark.gpu
def test_device_array_round_trip_and_views():
    cuda = _cuda()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 19)).astype(np.float32)
    d = cuda.DeviceArray.from_numpy(a)
    assert d.shape == (37, 19) and d.dtype == np.float32 and d.elem == jk.f32
    np.testing.assert_array_equal(d.numpy(), a)
    np.testing.assert_array_equal(d[5].numpy(), a[5])
    np.testing.assert_array_equal(d[3:9].numpy(), a[3:9])
    bits = rng.integers(0, 2**16, 100, dtype=np.uint16)
    b = cuda.DeviceArray.from_numpy(bits, dtype="bf16")
    assert b.elem == jk.bf16 and b.dtype == np.uint16      # numpy's view of bf16 storage
    np.testing.assert_array_equal(b.numpy(), bits)
    z = cuda.DeviceArray.zeros(1000, np.int32)
    assert not z.numpy().any()


@jk.kernel
def _scale_in_thread(x, out, n, a, BLOCK: jk.constexpr):
    # a kernel of its own, so its module is first loaded by the thread below
    offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = offs < n
    jk.store(out + offs, jk.load(x + offs, mask=m) * a - 1.0, mask=m)


@pytest.mark.gpu
def test_a_thread_that_did_not_create_the_device_loads_and_launches():
    """The server's engine thread loads modules that the main thread never did; the driver's current context
    is per thread, so the device must make its context current there (CUDA_ERROR_INVALID_CONTEXT before)."""
    import threading
    cuda = _cuda()
    cuda.get_device(0)                       # created (and made current) in this thread
    rng = np.random.default_rng(11)
    n = 4099
    x = rng.standard_normal(n).astype(np.float32)
    result, errors = {}, []

    def work():
        try:
            dx = cuda.to_device(x)
            dout = cuda.DeviceArray.empty(n, np.float32)
            _scale_in_thread[(jk.cdiv(n, 128),)](dx, dout, n, 1.5, BLOCK=128)
            _scale_in_thread[(jk.cdiv(n, 128),)](dout, dout, n, 1.0, BLOCK=128)     # out = out - 1
            with jk.capture() as g:
                _scale_in_thread[(jk.cdiv(n, 128),)](dout, dout, n, 2.0, BLOCK=128)
            g.replay()
            result["out"] = dout.numpy()
            result["mem"] = cuda.get_device(0).mem_info()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    np.testing.assert_allclose(result["out"], (x * 1.5 - 2.0) * 2.0 - 1.0, rtol=1e-6, atol=1e-5)
    free, total = result["mem"]
    assert 0 < free <= total


@pytest.mark.gpu
def test_launch_on_device_arrays_picks_the_gpu():
    cuda = _cuda()
    rng = np.random.default_rng(1)
    n = 100_003
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    dx, dy = cuda.to_device(x), cuda.to_device(y)
    dout = cuda.DeviceArray.empty(n, np.float32)
    ck = _saxpy[(jk.cdiv(n, 256),)](dx, dy, dout, n, 0.5, BLOCK=256)
    assert ck.target.is_cuda
    np.testing.assert_allclose(dout.numpy(), 0.5 * x + y, rtol=1e-6, atol=1e-6)
    ck8 = _saxpy[(jk.cdiv(n, 256),)](dx, dy, dout, n, 2.0, BLOCK=256, num_warps=8)
    assert ck8.launch_meta["num_threads"] == 256 and ck8.symbol != ck.symbol
    np.testing.assert_allclose(dout.numpy(), 2.0 * x + y, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_shared_memory_past_48k():
    cuda = _cuda()
    rng = np.random.default_rng(2)
    N = 16384
    x = rng.standard_normal((3, N)).astype(np.float32)
    out = cuda.DeviceArray.empty(3, np.float32)
    ck = _row_sum_big[(3,)](cuda.to_device(x), out, N=N)
    assert ck.launch_meta["shared_bytes"] > 48 * 1024
    np.testing.assert_allclose(out.numpy(), (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_replays_new_device_data():
    cuda = _cuda()
    rng = np.random.default_rng(3)
    B, D, V = 4, 64, 50
    table = cuda.to_device(rng.standard_normal((V, D)).astype(np.float32))
    tok, pos = cuda.DeviceArray.empty(B, np.int32), cuda.DeviceArray.empty(B, np.int32)
    out = cuda.DeviceArray.empty((B, D), np.float32)
    t0, p0 = rng.integers(0, V, B).astype(np.int32), rng.integers(0, 9, B).astype(np.int32)
    tok.copy_from_numpy(t0)
    pos.copy_from_numpy(p0)
    _step[(B,)](tok, pos, table, out, D=D)          # compile and load outside the capture
    with jk.capture() as g:
        _step[(B,)](tok, pos, table, out, D=D)
    assert g.cuda is not None and len(g.cuda) == 1
    host_table = table.numpy()
    for _ in range(3):
        t, p = rng.integers(0, V, B).astype(np.int32), rng.integers(0, 9, B).astype(np.int32)
        tok.copy_from_numpy(t)
        pos.copy_from_numpy(p)
        g.replay()
        np.testing.assert_array_equal(out.numpy(), host_table[t] * (p + 1)[:, None].astype(np.float32))


@pytest.mark.gpu
def test_second_process_loads_every_kernel_from_the_cache(tmp_path):
    _cuda()
    code = ("import numpy as np, jitkern as jk\n"
            "from jitkern.runtime import cuda\n"
            "from tests.test_cuda_runtime import _saxpy\n"
            "x = cuda.to_device(np.ones(1000, np.float32))\n"
            "o = cuda.DeviceArray.empty(1000, np.float32)\n"
            "ck = _saxpy[(4,)](x, x, o, 1000, 3.0, BLOCK=256)\n"
            "assert (o.numpy() == 4.0).all()\n"
            "print('FROM_CACHE', ck.from_cache)\n")
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "FROM_CACHE False" in first.stdout
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "FROM_CACHE True" in second.stdout


@pytest.mark.gpu
def test_driver_jit_when_there_is_no_ptxas(tmp_path):
    _cuda()
    code = ("import numpy as np, jitkern as jk\n"
            "from jitkern.runtime import cuda\n"
            "from tests.test_cuda_runtime import _saxpy\n"
            "x = cuda.to_device(np.arange(300, dtype=np.float32))\n"
            "o = cuda.DeviceArray.empty(300, np.float32)\n"
            "ck = _saxpy[(2,)](x, x, o, 300, 1.0, BLOCK=256)\n"
            "assert 'kernel.cubin' not in ck.artifacts\n"
            "assert (o.numpy() == 2 * np.arange(300)).all()\n")
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path), JITKERN_NO_PTXAS="1", PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------- no GPU needed: PTX for sm_80/sm_90a
@pytest.mark.parametrize("sub", ["cu13", "cuda_nvcc"])
def test_ptxas_is_found_in_the_nvcc_wheel(sub, tmp_path, monkeypatch):
    """find_ptxas takes ptxas from the nvidia-cuda-nvcc wheel: nvidia/cu13/bin on the CUDA 13 line (the [cuda] and
    [test] extras' wheel; nvidia/cuda_nvcc/bin on the 12 line), wherever the `nvidia` namespace has that folder,
    before CUDA_HOME and PATH; JITKERN_PTXAS still comes first."""
    import importlib
    from jitkern.backends.nvptx import find_ptxas
    exe = tmp_path / "nvidia" / sub / "bin" / "ptxas"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.5, V13.5.37'\n")
    exe.chmod(0o755)
    monkeypatch.delenv("JITKERN_PTXAS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert find_ptxas() == str(exe)
    other = tmp_path / "other-ptxas"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("JITKERN_PTXAS", str(other))
    assert find_ptxas() == str(other)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_ptx_is_accepted_by_ptxas(arch, tmp_path, monkeypatch):
    from jitkern.backends.nvptx import find_ptxas
    from jitkern.compiler import reset_kernel_cache
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine (install the [cuda] extra)")
    monkeypatch.setenv("JITKERN_CACHE_DIR", str(tmp_path))
    reset_kernel_cache()
    try:
        t = get_target(arch)
        f32 = np.zeros(4, np.float32)
        for kern, args, kw in [(_saxpy, (f32, f32, f32, 10, 1.0), dict(BLOCK=256)),
                               (_row_sum_big, (f32, f32), dict(N=16384)),
                               (_step, (np.zeros(4, np.int32), np.zeros(4, np.int32), f32, f32), dict(D=64))]:
            params, consts, _ = kern.specialize(args, kw)
            ck = compile_kernel(kern, params, consts, t, load=False)
            assert ck.artifacts["kernel.cubin"][:4] == b"\x7fELF"
            assert f".target {arch}" in ck.ptx()
    finally:
        reset_kernel_cache()


def test_build_fails_when_a_kernel_does_not_compile(tmp_path):
    """`jitkern build` exits 2 naming the kernel when a compile fails (the engine driving the build must not
    swallow it), here through a ptxas that rejects everything."""
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake ptxas 0.0'; exit 0; fi\n"
                    "echo 'ptxas fatal: rejected on purpose' >&2; exit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path / "cache"), JITKERN_PTXAS=str(fake),
               PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "jitkern", "build", "--target", "sm_90a", "--quiet"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "failed to compile for sm_90a" in last and "rejected on purpose" in last, last


@pytest.mark.timeout(900)
def test_jitkern_build_of_a_bf16_model_has_the_tma_linear(tmp_path):
    """`jitkern build --target sm_90a --model <bf16 safetensors>` (a stand-in device, nothing launched) compiles
    the tensor-core linear the H200 runs at prefill sizes: warpgroup MMAs fed by TMA (the `tma` launch option,
    tensor-map arguments of a map's type), so a built cache holds that kernel too; ptxas accepts it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jitkern.backends.nvptx import find_ptxas
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine (install the [cuda] extra)")
    import json
    import torch
    import transformers as tf
    from tests.model_fixtures import _tokenizer_json, make_config
    model = str(tmp_path / "small-bf16")
    cfg = make_config("llama")
    # projections whose N is a multiple of the 128-row tiles (the TMA path is the EVEN one), 2048 positions
    # for the build's warm-up
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 512, 1
    cfg.max_position_embeddings = 4096
    torch.manual_seed(3)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(model, safe_serialization=True)
    _tokenizer_json(model)
    cache = tmp_path / "cache"
    env = dict(os.environ, JITKERN_CACHE_DIR=str(cache), PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "jitkern", "build", "--target", "sm_90a", "--model", model,
                        "--quiet"], env=env, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = [p.read_text() for p in cache.glob("v1/cuda-nvptx64-sm_90a/*/*/kernel.ptx")
           if json.loads((p.parent / "meta.json").read_text())["kernel"].endswith("_gpu_linear_mma_kernel")]
    assert ptx, "no tensor-core linear in the build"
    tma = [p for p in ptx if "cp.async.bulk.tensor.2d" in p]
    assert tma and all("wgmma.mma_async" in p for p in tma), (len(ptx), len(tma))
    cubins = list(cache.glob("v1/cuda-nvptx64-sm_90a/*/*/kernel.cubin"))
    assert len(cubins) >= len(ptx)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_jitkern_build_compiles_every_engine_kernel(arch, tmp_path):
    """CI has no GPU: every engine kernel specialisation compiles for sm_80 and sm_90a and ptxas accepts it
    (each cache entry holds a cubin)."""
    from jitkern.backends.nvptx import find_ptxas
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine (install the [cuda] extra)")
    env = dict(os.environ, JITKERN_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "jitkern", "build", "--target", arch, "--quiet"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    n = int(r.stdout.split(" kernel specialisations")[0].split()[-1])
    assert n >= 30, r.stdout
    metas = list(tmp_path.glob(f"v1/cuda-nvptx64-{arch}/*/*/kernel.cubin"))
    assert len(metas) == n, (len(metas), n)
