"""AMDGPU (HIP) targets: compile-verified code objects, and the HIP runtime's code paths on a stubbed driver.

No AMD GPU runs anything here. What is checked:
- `jitkern build --target gfx90a|gfx942|gfx1100` compiles and links every engine kernel specialisation; each
  code object is an AMDGPU HSA ELF (code object v5) for that processor with the kernel's descriptor;
- a simple kernel's machine code (the disassembler's, and LLVM's own assembly) has 16-byte global loads, LDS
  (ds_) writes and reads with s_barrier around the layout change, sin as v_sin_f32, and no scratch or flat
  memory; the IR has the launch bounds and reads the workgroup count from the dispatch packet;
- the matrix units for `dot`: the MMA fragment layouts the lowering uses (GpuHooks.mma_layout) against a numpy
  model of each ISA's register layout (PTX m16n8k16, CDNA MFMA 16x16x16, RDNA3 WMMA 16x16x16), and the
  tensor-core linear kernel's code objects disassembling to v_mfma_* (gfx90a, gfx942) / v_wmma_* (gfx1100);
- runtime/hip.py with a fake `hip` module standing in for hip-python's driver calls (memory is host memory
  the fake hands out): device properties -> target, upload/download round trips, module load of the
  .hsaco, launches with the parameters packed into 8-byte slots, stream capture -> graph replay (hip.capture()
  and jk.capture()), frees held until a capture ends, the pool kept warm, the LDS limit, staged numpy
  arguments, errors that name the call, and the fake's signatures against hip-python's; and with no AMD GPU,
  `python -m jitkern.runtime.hip` fails with one line, no traceback.
"""
import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import jitkern as jk
from jitkern.backends.amdgpu import find_lld
from jitkern.runtime.launch import launch
from targets import get_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["gfx90a", "gfx942", "gfx1100"]
# ELF e_flags EF_AMDGPU_MACH_* (LLVM's AMDGPUUsage, "AMDGPU ELF Header")
MACH = {"gfx90a": 0x3F, "gfx942": 0x4C, "gfx1100": 0x41}

needs_lld = pytest.mark.skipif(find_lld() is None, reason="no ld.lld that links AMDGPU code object v5 (install "
                               "the ziglang wheel, part of the [test] and [hip] extras, or ld.lld-17+)")


# ------------------------------------------------------------------------------------------ ELF helpers
def elf_info(blob: bytes) -> dict:
    """Header fields and symbol names of a 64-bit little-endian ELF (enough to check a code object)."""
    assert blob[:4] == b"\x7fELF", "not an ELF file"
    assert blob[4] == 2 and blob[5] == 1, "not ELF64 little-endian"
    e_type, e_machine = struct.unpack_from("<HH", blob, 16)
    e_flags, = struct.unpack_from("<I", blob, 48)
    e_shoff, = struct.unpack_from("<Q", blob, 40)
    e_shentsize, e_shnum = struct.unpack_from("<HH", blob, 58)
    secs = [struct.unpack_from("<IIQQQQIIQQ", blob, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    names = set()
    for (_, sh_type, _, _, off, size, link, _, _, entsize) in secs:
        if sh_type in (2, 11):              # SHT_SYMTAB, SHT_DYNSYM
            stroff = secs[link][4]
            for k in range(size // entsize):
                st_name, = struct.unpack_from("<I", blob, off + k * entsize)
                end = blob.index(b"\0", stroff + st_name)
                names.add(blob[stroff + st_name:end].decode())
    return {"type": e_type, "machine": e_machine, "osabi": blob[7], "abiversion": blob[8], "flags": e_flags,
            "symbols": names}


def check_code_object(blob: bytes, target: str, symbol: str) -> None:
    info = elf_info(blob)
    assert info["machine"] == 224, "e_machine is not EM_AMDGPU"
    assert info["type"] == 3, "not a linked (ET_DYN) code object"
    assert info["osabi"] == 64, "OS/ABI is not AMDGPU_HSA"
    assert info["abiversion"] == 3, f"not code object v5 (ABI version {info['abiversion']})"
    assert info["flags"] & 0xFF == MACH[target], f"e_flags {info['flags']:#x} is not {target}"
    assert symbol in info["symbols"] and symbol + ".kd" in info["symbols"], "kernel or its descriptor missing"
    assert f"amdgcn-amd-amdhsa--{target}".encode() in blob, "metadata note does not name the processor"


def find_objdump():
    """An llvm-objdump that decodes gfx942 (LLVM 17+), or None."""
    for name in [f"llvm-objdump-{v}" for v in range(22, 16, -1)] + ["llvm-objdump"]:
        p = shutil.which(name)
        if not p:
            continue
        try:
            out = subprocess.run([p, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"LLVM version (\d+)", out)
        if m and int(m.group(1)) >= 17:
            return p
    return None


# ------------------------------------------------------------------------------------- engine build
@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """`jitkern build --target T` for the three AMD targets (concurrently, each into its own cache)."""
    # The caches are made here, not in the threads: tmp_path_factory creates its base directory lazily and
    # is not thread-safe (three threads racing on that first mkdir failed CI with FileExistsError).
    caches = {t: tmp_path_factory.mktemp(f"cache-{t}") for t in TARGETS}

    def run(t):
        cache = caches[t]
        env = dict(os.environ, JITKERN_CACHE_DIR=str(cache))
        r = subprocess.run([sys.executable, "-m", "jitkern.cli", "build", "--target", t, "--quiet"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=900)
        return t, (r, cache)
    with ThreadPoolExecutor(3) as ex:
        return dict(ex.map(run, TARGETS))


@needs_lld
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("target", TARGETS)
def test_build_links_every_engine_kernel(builds, target):
    r, cache = builds[target]
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"(\d+) kernel specialisations for " + target, r.stdout)
    assert m, r.stdout
    n = int(m.group(1))
    assert n >= 20, f"only {n} engine specialisations"
    import json
    entries = [d for d, _, files in os.walk(cache) if "kernel.hsaco" in files]
    assert len(entries) == n
    kinds = set()
    for d in entries:
        meta = json.load(open(os.path.join(d, "meta.json")))
        assert meta["target"] == target
        kinds.add(meta["kernel"].rsplit(".", 1)[-1])
        with open(os.path.join(d, "kernel.hsaco"), "rb") as f:
            check_code_object(f.read(), target, meta["symbol"])
        with open(os.path.join(d, "kernel.ll")) as f:
            ll = f.read()
        assert "amdgpu_kernel" in ll and "amdgpu-flat-work-group-size" in ll
    # no flat (generic) memory access anywhere in the engine's code objects (scratch spills are a speed
    # matter, not checked: wave32 gfx1100 spills in the quantised matmul and attention at num_warps=4)
    if find_objdump() is not None:
        for d in entries:
            r = subprocess.run([find_objdump(), "-d", f"--mcpu={target}", os.path.join(d, "kernel.hsaco")],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            ops = _mnemonics(r.stdout)
            # (a kernel whose every load is uniform reads through the scalar cache: gather_rows_kernel)
            assert sum(v for k, v in ops.items() if k.startswith(("global_load", "s_load"))) >= 1, d
            bad = [k for k in ops if k.startswith("flat_")]
            assert not bad, f"{d}: {bad}"
    # the sampler's kernels on logits copied back run on the host, as on CUDA: built for the host's CPU tier
    host = set()
    for d, _, files in os.walk(cache):
        if "kernel.o" in files:
            host.add(json.load(open(os.path.join(d, "meta.json")))["kernel"].rsplit(".", 1)[-1])
    assert "sample_kernel" in host, sorted(host)
    # the forward pass and the greedy pick are all there: the engine's GPU (device-array) path, as on CUDA
    for k in ("rms_norm", "rope", "attention:decode", "attention:prefill", "_qmm_kernel", "embedding_kernel",
              "argmax_kernel"):
        if k.startswith("attention:"):
            ok = {"flash_" + k[10:] + "_kernel", "token_attention_kernel", k[10:] + "_kernel"} & kinds
        else:
            ok = [n for n in kinds if n.startswith(k)]
        assert ok, f"{k} was not built ({sorted(kinds)})"


# ------------------------------------------------------------------------------- one kernel, in detail
@jk.kernel
def colsum_sin(x, out, n_rows, B: jk.constexpr):
    pid = jk.program_id(0)
    v = jk.load(x + pid * B * B + jk.arange(0, B * B))          # contiguous: 16-byte loads per thread
    t = jk.trans(jk.reshape(v, (B, B)))                          # a layout change through LDS
    s = jk.sum(t, 1) + jk.num_programs(0)
    r = jk.arange(0, B)
    jk.store(out + pid * B + r, jk.sin(s), mask=r < n_rows)


def _compile_simple(target: str, chunks: int = 1):
    from jitkern.compiler import compile_kernel
    t = get_target(target)
    # `chunks` 16-byte chunks per thread: 1024 elements over num_warps * wave threads
    warps = 1024 // (4 * chunks * t.warp_size)
    x, o = np.zeros(1024, np.float32), np.zeros(32, np.float32)
    params, consts, _ = colsum_sin.specialize((x, o, 32), {"B": 32, "num_warps": warps}, t)
    return compile_kernel(colsum_sin, params, consts, t, load=False)


def _mnemonics(text: str) -> dict:
    out = {}
    for m in re.finditer(r"^\s+([a-z][a-z0-9_]+)", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def _code_object_mnemonics(ck, target: str, tmp_path) -> dict:
    """A compiled kernel's code object checked (check_code_object) and disassembled: mnemonic -> count."""
    p = tmp_path / "k.hsaco"
    p.write_bytes(ck.artifacts["kernel.hsaco"])
    check_code_object(p.read_bytes(), target, ck.symbol)
    r = subprocess.run([find_objdump(), "-d", f"--mcpu={target}", str(p)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return _mnemonics(r.stdout)


def _check_instructions(ops: dict, target: str) -> None:
    gfx11 = target.startswith("gfx11")
    load16 = "global_load_b128" if gfx11 else "global_load_dwordx4"
    assert ops.get(load16, 0) >= 1, f"no 16-byte global load: {sorted(ops)}"
    assert ops.get("s_barrier", 0) >= 2, "no barriers around the layout change"
    writes = [k for k in ops if k.startswith("ds_write" if not gfx11 else "ds_store")]
    reads = [k for k in ops if k.startswith("ds_read" if not gfx11 else "ds_load")]
    assert writes and reads, f"no LDS writes/reads: {sorted(ops)}"
    assert any(k.startswith("global_store") for k in ops)
    assert ops.get("v_sin_f32_e32", 0) + ops.get("v_sin_f32_e64", 0) >= 1, "sin is not v_sin_f32"
    # (buffer_gl0_inv / buffer_wbinvl1 are the cache controls of the barrier's acquire fence, not accesses)
    bad = [k for k in ops if k.startswith(("flat_", "scratch_", "buffer_load", "buffer_store"))]
    assert not bad, f"flat or scratch memory instructions: {bad}"


@needs_lld
@pytest.mark.parametrize("target", TARGETS)
def test_simple_kernel_ir_and_code_object(target):
    ck = _compile_simple(target)
    t = get_target(target)
    warps = 1024 // (4 * t.warp_size)
    ll = ck.artifacts["kernel.ll"].decode()
    assert "define amdgpu_kernel void @" + ck.symbol in ll
    assert f'"amdgpu-flat-work-group-size"="1,{warps * t.warp_size}"' in ll
    assert "@llvm.amdgcn.dispatch.ptr()" in ll          # num_programs from the dispatch packet
    assert 'fence syncscope("workgroup") release' in ll and "@llvm.amdgcn.s.barrier()" in ll
    assert "addrspace(3) @__jk_smem" in ll and "@llvm.amdgcn.sin.f32" in ll
    assert ck.launch_meta == {"num_threads": warps * t.warp_size, "shared_bytes": ck.launch_meta["shared_bytes"]}
    assert ck.launch_meta["shared_bytes"] >= 32 * 32 * 4
    check_code_object(ck.artifacts["kernel.hsaco"], target, ck.symbol)
    # LLVM's own assembly of the same IR (the LLVM that made the object; always available)
    from jitkern.isolate import compile_llvm_ir
    asm = compile_llvm_ir(ll, triple=t.triple, cpu=t.cpu, features="", opt=3, emit=("asm",))["asm"].decode()
    _check_instructions(_mnemonics(asm), target)
    assert ".amdhsa_user_sgpr_dispatch_ptr 1" in asm


@needs_lld
@pytest.mark.skipif(find_objdump() is None, reason="no llvm-objdump 17+ for AMDGPU (apt: llvm-19)")
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("target", TARGETS)
def test_simple_kernel_disassembly(target, chunks, tmp_path):
    ck = _compile_simple(target, chunks)
    p = tmp_path / "k.hsaco"
    p.write_bytes(ck.artifacts["kernel.hsaco"])
    r = subprocess.run([find_objdump(), "-d", f"--mcpu={target}", str(p)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"<{ck.symbol}>:" in r.stdout
    _check_instructions(_mnemonics(r.stdout), target)


def test_lower_only_without_linker():
    """The lowering itself needs no linker: kernel signature ABI for f32/i32 scalars and pointers."""
    from jitkern.compiler import build_ir, lower_with_meta
    t = get_target("gfx1100")
    x, o = np.zeros(1024, np.float32), np.zeros(32, np.float32)
    params, consts, _ = colsum_sin.specialize((x, o, 32), {"B": 32}, t)
    ll, meta = lower_with_meta(build_ir(colsum_sin, params, consts, t), t)
    assert re.search(r"define amdgpu_kernel void @\w+\(ptr noundef %arg0, ptr noundef %arg1, i64 %arg2\)", ll)
    assert meta["num_threads"] == 4 * 32           # default num_warps=4, wave32
    assert "amdhsa_code_object_version\", i32 500" in ll


# ------------------------------------------------------------------------------ runtime, stubbed driver
class FakeHip:
    """Stands in for hip-python's `hip.hip`: every call returns (hipError_t, *values) as hip-python does.
    Device memory is host memory (ctypes buffers), so copies really move bytes."""

    class hipStreamCaptureMode:
        hipStreamCaptureModeThreadLocal = 1

    class hipMemPoolAttr:
        hipMemPoolAttrReleaseThreshold = 4

    class Props:
        gcnArchName = b"gfx942:sramecc+:xnack-"
        name = b"AMD Instinct MI300X (fake)"
        warpSize = 64
        multiProcessorCount = 304
        sharedMemPerBlock = 64 * 1024

    def __init__(self, arch=b"gfx942:sramecc+:xnack-"):
        self.calls = []
        self.buffers = {}
        self.modules = {}
        self.launches = []
        self.fail = {}
        self.pool_attrs = {}
        self.Props = type("Props", (FakeHip.Props,), {"gcnArchName": arch})

    def _ok(self, name, *vals):
        self.calls.append(name)
        return (self.fail.get(name, 0),) + vals

    def hipGetErrorName(self, err):
        return (b"hipErrorOutOfMemory",) if int(err) == 2 else (b"hipErrorUnknown",)

    def hipGetErrorString(self, err):
        return (b"out of memory",) if int(err) == 2 else (b"unknown",)

    def hipInit(self, flags):
        return self._ok("hipInit")

    def hipGetDeviceCount(self):
        return self._ok("hipGetDeviceCount", 1)

    def hipSetDevice(self, i):
        return self._ok("hipSetDevice")

    def hipGetDeviceProperties(self, i):
        return self._ok("hipGetDeviceProperties", self.Props())

    def hipStreamCreateWithFlags(self, flags):
        assert flags == 1
        return self._ok("hipStreamCreateWithFlags", "stream0")

    def hipDeviceGetDefaultMemPool(self, i):
        return self._ok("hipDeviceGetDefaultMemPool", "pool0")

    def hipMemPoolSetAttribute(self, pool, attr, value):
        # value: the address of the attribute's value (a uint64 for the release threshold)
        assert pool == "pool0"
        self.pool_attrs[attr] = ctypes.c_uint64.from_address(value).value
        return self._ok("hipMemPoolSetAttribute")

    def hipStreamSynchronize(self, s):
        assert s == "stream0"
        return self._ok("hipStreamSynchronize")

    def hipMallocAsync(self, n, s):
        buf = ctypes.create_string_buffer(n)
        self.buffers[ctypes.addressof(buf)] = buf
        return self._ok("hipMallocAsync", ctypes.addressof(buf))

    def hipFreeAsync(self, p, s):
        self.buffers.pop(int(p), None)
        return self._ok("hipFreeAsync")

    def hipMemcpyHtoDAsync(self, dst, src, n, s):
        ctypes.memmove(dst, src, n)
        return self._ok("hipMemcpyHtoDAsync")

    def hipMemcpyDtoHAsync(self, dst, src, n, s):
        ctypes.memmove(dst, src, n)
        return self._ok("hipMemcpyDtoHAsync")

    def hipMemcpyDtoDAsync(self, dst, src, n, s):
        ctypes.memmove(dst, src, n)
        return self._ok("hipMemcpyDtoDAsync")

    def hipMemsetD8Async(self, dst, v, n, s):
        ctypes.memset(dst, v, n)
        return self._ok("hipMemsetD8Async")

    def hipModuleLoadData(self, image):
        self.modules[len(self.modules)] = bytes(image)
        return self._ok("hipModuleLoadData", f"module{len(self.modules) - 1}")

    def hipModuleGetFunction(self, mod, name):
        return self._ok("hipModuleGetFunction", (mod, name))

    def hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append(dict(fn=f, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream,
                                  params=params))
        self._params_at_launch = params
        return self._ok("hipModuleLaunchKernel")

    def hipStreamBeginCapture(self, s, mode):
        assert mode == 1
        return self._ok("hipStreamBeginCapture")

    def hipStreamEndCapture(self, s):
        return self._ok("hipStreamEndCapture", "graph0")

    def hipGraphInstantiate(self, g, n):
        assert g == "graph0"
        return self._ok("hipGraphInstantiate", "exec0", None, None)

    def hipGraphLaunch(self, e, s):
        assert e == "exec0" and s == "stream0"
        return self._ok("hipGraphLaunch")


@pytest.fixture
def fake_hip(monkeypatch):
    from jitkern.runtime import hip
    fake = FakeHip()
    monkeypatch.setattr(hip, "_hip", fake)
    monkeypatch.setattr(hip, "_devices", {})
    return fake


def test_device_memory_round_trip(fake_hip):
    from jitkern.runtime import hip
    dev = hip.get_device()
    assert dev.target().name == "gfx942" and dev.warp_size == 64 and dev.num_cus == 304
    rng = np.random.default_rng(3)
    a = rng.standard_normal((7, 13)).astype(np.float32)
    d = hip.to_device(a)
    assert d.device is dev and d.shape == (7, 13)
    np.testing.assert_array_equal(d.numpy(), a)
    np.testing.assert_array_equal(d[2:5].numpy(), a[2:5])
    z = hip.zeros((5,), np.int32)
    np.testing.assert_array_equal(z.numpy(), np.zeros(5, np.int32))
    b = hip.empty((7, 13), np.float32)
    dev.copy(b.ptr, d.ptr, a.nbytes)
    np.testing.assert_array_equal(b.numpy(), a)
    assert {"hipInit", "hipSetDevice", "hipMallocAsync", "hipMemcpyHtoDAsync", "hipMemcpyDtoHAsync",
            "hipMemsetD8Async", "hipMemcpyDtoDAsync"} <= set(fake_hip.calls)


def test_unknown_arch_and_errors_name_the_call(monkeypatch):
    from jitkern.runtime import hip
    fake = FakeHip(arch=b"gfx1030")
    monkeypatch.setattr(hip, "_hip", fake)
    monkeypatch.setattr(hip, "_devices", {})
    dev = hip.get_device()
    with pytest.raises(hip.HipUnavailable, match="gfx1030, which jitkern has no target for"):
        dev.target()
    fake.fail["hipMallocAsync"] = 2
    with pytest.raises(hip.HipError, match=r"hipMallocAsync\(64 bytes\) failed: hipErrorOutOfMemory: out of "
                                           r"memory"):
        dev.alloc(64)


@needs_lld
def test_launch_loads_code_object_and_packs_slots(fake_hip):
    from jitkern.runtime import hip
    rng = np.random.default_rng(5)
    x = hip.to_device(rng.standard_normal(1024 * 3).astype(np.float32))
    out = hip.zeros((96,), np.float32)

    def slots_of(launch):
        ptrs = (ctypes.c_void_p * 3).from_address(launch["params"])
        return [ctypes.c_uint64.from_address(ptrs[i]).value for i in range(3)]

    ck = hip.launch(colsum_sin, (3,), x, out, 29, B=32)
    assert ck.target.name == "gfx942"
    (image,) = fake_hip.modules.values()
    check_code_object(image, "gfx942", ck.symbol)
    (ln,) = fake_hip.launches
    assert ln["fn"] == ("module0", ck.symbol.encode())
    assert ln["grid"] == (3, 1, 1) and ln["block"] == (256, 1, 1) and ln["stream"] == "stream0"
    assert ln["shared"] == ck.launch_meta["shared_bytes"] > 0
    # the slots are read while the launch call runs (the array lives that long): check them from a
    # launch recorded with a copy
    fake_hip.launches.clear()
    seen = []
    real = fake_hip.hipModuleLaunchKernel

    def capture_slots(*a):
        r = real(*a)
        seen.append(slots_of(fake_hip.launches[-1]))
        return r
    fake_hip.hipModuleLaunchKernel = capture_slots
    hip.launch(colsum_sin, (3,), x, out, 29, B=32)
    assert seen == [[x.ptr, out.ptr, 29]]
    assert len(fake_hip.modules) == 1             # the module is loaded once


@needs_lld
def test_graph_capture_and_replay(fake_hip):
    from jitkern.runtime import hip
    x = hip.to_device(np.random.default_rng(6).standard_normal(1024).astype(np.float32))
    out = hip.zeros((32,), np.float32)
    with hip.capture() as g:
        hip.launch(colsum_sin, (1,), x, out, 32, B=32)
        hip.launch(colsum_sin, (1,), x, out, 17, B=32)
    assert len(g) == 2
    assert fake_hip.calls.index("hipStreamBeginCapture") < fake_hip.calls.index("hipModuleLaunchKernel") < \
        fake_hip.calls.index("hipStreamEndCapture") < fake_hip.calls.index("hipGraphInstantiate")
    g.replay()
    g.replay()
    assert fake_hip.calls.count("hipGraphLaunch") == 2


def test_no_amd_gpu_fails_closed():
    """Here (no ROCm, maybe no hip-python) the runtime reports one line and exits 1: no traceback."""
    from jitkern.runtime import hip
    if hip.is_available():
        pytest.skip("an AMD GPU answers here")
    r = subprocess.run([sys.executable, "-m", "jitkern.runtime.hip"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jitkern: ") and ("no AMD GPU" in lines[0] or "hip-python is "
                                                                       "not installed" in lines[0])


@needs_lld
def test_kernel_call_with_hip_arrays_goes_to_hip(fake_hip):
    """`kernel[grid](...)` with DeviceArrays made by runtime/hip.py launches through HIP (not CUDA)."""
    from jitkern.runtime import hip
    x = hip.to_device(np.random.default_rng(7).standard_normal(2048).astype(np.float32))
    out = hip.zeros((64,), np.float32)
    colsum_sin[(2,)](x, out, 31, B=32)
    (ln,) = fake_hip.launches
    assert ln["grid"] == (2, 1, 1) and ln["block"] == (256, 1, 1)


@needs_lld
def test_jk_capture_records_hip_launches(fake_hip):
    """jk.capture() around launches on AMD device arrays is HIP stream capture (begun at the first launch,
    ended at the block's end); Graph.replay() is one hipGraphLaunch. Numpy arguments inside are refused."""
    from jitkern.runtime import hip
    x = hip.to_device(np.random.default_rng(8).standard_normal(1024).astype(np.float32))
    out = hip.zeros((32,), np.float32)
    with jk.capture() as g:
        colsum_sin[(1,)](x, out, 32, B=32)
        colsum_sin[(1,)](x, out, 7, B=32)
        with pytest.raises(hip.HipError, match="numpy arguments cannot be captured"):
            launch(colsum_sin, (1,), (x, np.zeros(32, np.float32), 7), {"B": 32}, target=get_target("gfx942"))
    c = fake_hip.calls
    assert c.count("hipStreamBeginCapture") == 1 and c.count("hipStreamEndCapture") == 1
    assert c.index("hipStreamBeginCapture") < c.index("hipModuleLaunchKernel") < c.index("hipStreamEndCapture")
    assert isinstance(g.cuda, hip.HipGraph) and len(g.cuda) == 2 and not g.cuda.capturing
    g.replay()
    g.replay()
    assert c.count("hipGraphLaunch") == 2 and len(fake_hip.launches) == 2


def test_frees_wait_for_the_end_of_a_capture(fake_hip):
    """A DeviceArray dropped during stream capture is freed after the capture ends, not recorded into it."""
    from jitkern.runtime import hip
    dev = hip.get_device()
    tmp = hip.empty((100,), np.float32)
    ptr = tmp.ptr
    with hip.capture(dev):
        del tmp
        assert "hipFreeAsync" not in fake_hip.calls and ptr in fake_hip.buffers
    assert "hipFreeAsync" in fake_hip.calls and ptr not in fake_hip.buffers
    assert fake_hip.calls.index("hipStreamEndCapture") < fake_hip.calls.index("hipFreeAsync")


def test_pool_kept_warm_and_lds_limit(fake_hip):
    """As the CUDA runtime: the default memory pool keeps freed blocks (release threshold at its maximum);
    a kernel asking for more LDS than the device has is refused at load with the numbers, naming it."""
    from jitkern.runtime import hip
    dev = hip.get_device()
    assert fake_hip.pool_attrs == {FakeHip.hipMemPoolAttr.hipMemPoolAttrReleaseThreshold: 2 ** 64 - 1}
    assert dev.max_shared_bytes == 64 * 1024
    with pytest.raises(hip.HipError, match="kernel big_k needs 70000 bytes of LDS, .* has 65536"):
        hip.load_kernel({"kernel.hsaco": b"\x7fELF"}, "big_k", {"num_threads": 256, "shared_bytes": 70000})
    assert "hipModuleLoadData" not in fake_hip.calls
    with pytest.raises(hip.HipError, match="no code object"):
        hip.load_kernel({}, "k", {"num_threads": 64})


@needs_lld
def test_numpy_arguments_are_staged(fake_hip):
    """numpy arguments with target=gfx942: each host buffer goes over whole (a view keeps its offset), the
    kernel is launched with the device addresses, and every buffer comes back. The fake 'kernel' writes
    known values through the pointer it was given, so the copy back and the view offset are both checked."""
    from jitkern.runtime import hip
    rng = np.random.default_rng(9)
    x = rng.standard_normal(1024).astype(np.float32)
    big = np.zeros(64 + 32, np.float32)
    out = big[64:]                                  # a view: its device address must keep the offset
    real = fake_hip.hipModuleLaunchKernel
    want = rng.standard_normal(32).astype(np.float32)

    def run(*a):
        r = real(*a)
        ptrs = (ctypes.c_void_p * 3).from_address(fake_hip.launches[-1]["params"])
        xp, op = (ctypes.c_uint64.from_address(ptrs[i]).value for i in range(2))
        got = np.empty(1024, np.float32)
        ctypes.memmove(got.ctypes.data, xp, got.nbytes)
        np.testing.assert_array_equal(got, x)          # x arrived before the launch
        ctypes.memmove(op, want.ctypes.data, want.nbytes)
        return r
    fake_hip.hipModuleLaunchKernel = run
    launch(colsum_sin, (1,), (x, out, 32), {"B": 32}, target=get_target("gfx942"))
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(big[:64], 0)
    assert fake_hip.calls.count("hipMemcpyHtoDAsync") == 2 and fake_hip.calls.count("hipMemcpyDtoHAsync") == 2


def test_fake_hip_matches_hip_python():
    """The fake's calls take the parameters hip-python's do (the first line of each function's docstring is
    its signature), so the runtime calls real hip-python the way the tests call the fake."""
    try:
        from hip import hip as real
    except (ImportError, OSError):
        pytest.skip("hip-python is not installed")
    import inspect
    names = [n for n in vars(FakeHip) if n.startswith("hip") and callable(getattr(FakeHip, n))
             and not isinstance(getattr(FakeHip, n), type)]
    assert len(names) >= 20
    for n in names:
        sig = getattr(real, n).__doc__.splitlines()[0]
        assert sig.startswith(n + "("), sig
        inner = sig[len(n) + 1:-1].strip()
        n_real = len(inner.split(",")) if inner else 0
        n_fake = len(inspect.signature(getattr(FakeHip(), n)).parameters)
        assert n_fake == n_real, f"{n}: fake takes {n_fake} arguments, hip-python {sig}"
    assert hasattr(real.hipMemPoolAttr, "hipMemPoolAttrReleaseThreshold")
    assert hasattr(real.hipStreamCaptureMode, "hipStreamCaptureModeThreadLocal")


def test_build_without_linker_fails_with_one_line(tmp_path):
    env = dict(os.environ, JITKERN_LLD=str(tmp_path / "no-such-ld.lld"), JITKERN_CACHE_DIR=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-m", "jitkern.cli", "build", "--target", "gfx942", "--quiet"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "jitkern build: error: target gfx942: no ld.lld that links AMDGPU code object v5 (install jitkern[hip], "
        "which brings the ziglang wheel's ld.lld, or ld.lld-17+; or set JITKERN_LLD)"]


# ------------------------------------------------------------------------- matrix units for `dot`
# A numpy model of each matrix instruction's register layout, written from the ISA documents (not from the
# hooks): per lane, the (row, k) of A, (k, col) of B and (row, col) of D held in register element i.
def _isa_model(target: str, lane: int) -> dict:
    if target.startswith("sm_"):
        # PTX ISA, "Matrix Fragments for mma.m16n8k16" (.bf16/.f16): groupID = laneid >> 2,
        # threadID_in_group = laneid % 4; a0..a7 (pairs per .b32 register), b0..b3, c0..c3
        g, t = lane >> 2, lane % 4
        a = [(g + 8 * ((i // 2) % 2), t * 2 + (i % 2) + 8 * (i // 4)) for i in range(8)]
        b = [(t * 2 + (i % 2) + 8 * (i // 2), g) for i in range(4)]
        c = [(g + 8 * (i // 2), t * 2 + (i % 2)) for i in range(4)]
    elif target in ("gfx90a", "gfx942"):
        # CDNA2/CDNA3 ISA, v_mfma_f32_16x16x16{bf16_1k,f16} (one block, wave64): A[i][k] is in lane
        # i + 16 * (k // 4), element k % 4; B[k][j] in lane j + 16 * (k // 4), element k % 4; D[i][j] in lane
        # j + 16 * (i // 4), accumulator i % 4
        a = [(lane % 16, 4 * (lane // 16) + i) for i in range(4)]
        b = [(4 * (lane // 16) + i, lane % 16) for i in range(4)]
        c = [(4 * (lane // 16) + i, lane % 16) for i in range(4)]
    else:
        # RDNA3 ISA, "Wave Matrix Multiply Accumulate", wave32: lanes 0-15 hold row (A) / column (B) lane % 16,
        # all 16 k, lanes 16-31 the same again; D (f32): accumulator i of lane l is D[2 i + l // 16][l % 16]
        a = [(lane % 16, i) for i in range(16)]
        b = [(i, lane % 16) for i in range(16)]
        c = [(2 * i + lane // 16, lane % 16) for i in range(8)]
    return dict(a=a, b=b, c=c)


def _hooks(target: str):
    t = get_target(target)
    if t.is_hip:
        from jitkern.backends.amdgpu import AmdgpuHooks
        return t, AmdgpuHooks(t)
    from jitkern.backends.nvptx import NvptxHooks
    return t, NvptxHooks(t)


def _lowering_maps(target: str, kind: str):
    """The index maps the lowering uses (hooks.mma_layout evaluated on numpy lanes): per lane, the (row, k)
    of A, (k, col) of B in element order (registers in order, each one's elements consecutive along k) and
    the (row, col) each accumulator register is stored to."""
    t, h = _hooks(target)
    lanes = np.arange(t.warp_size)
    lay = h.mma_layout(lanes, kind)
    bc = lambda v: np.broadcast_to(np.asarray(v), lanes.shape)    # noqa: E731 - constant coordinates
    out = []
    for ln in range(t.warp_size):
        a = [(int(bc(r)[ln]), int(bc(k)[ln]) + j) for r, k in lay["a"] for j in range(lay["a_elems"])]
        b = [(int(bc(k)[ln]) + j, int(bc(c)[ln])) for c, k in lay["b"] for j in range(lay["b_elems"])]
        c = [(int(bc(r)[ln]), int(bc(c)[ln])) for r, c in lay["c"]]
        out.append(dict(a=a, b=b, c=c))
    return t, h, lay, out


MMA_TARGETS = ["sm_90a", "gfx90a", "gfx942", "gfx1100"]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("target", MMA_TARGETS)
def test_mma_layout_agrees_with_the_isa(target, kind):
    t, h, lay, maps = _lowering_maps(target, kind)
    MS, NS, KS = h.mma_shape
    ws = t.warp_size
    # every element of A (MS x KS), B (KS x NS) and D (MS x NS) is held exactly once per wavefront, or
    # exactly twice where the ISA repeats A/B in both halves of a wave32 (WMMA: lanes 16-31 = lanes 0-15)
    for key, shape in (("a", (MS, KS)), ("b", (KS, NS)), ("c", (MS, NS))):
        cover = np.zeros(shape, int)
        for m in maps:
            for r, c in m[key]:
                cover[r, c] += 1
        reps = 2 if (t.mma == "wmma" and key != "c") else 1
        assert (cover == reps).all(), f"{key}: {cover}"
        if reps == 2:
            assert all(maps[ln][key] == maps[ln - 16][key] for ln in range(16, 32))
    # and the element each lane's register element i holds is the one the ISA puts there
    for ln in range(ws):
        model = _isa_model(target, ln)
        assert maps[ln] == model, f"lane {ln}"
    # end to end: registers filled by the lowering's maps, multiplied as the ISA defines, stored where the
    # lowering stores the accumulators -> exactly A @ B (integer-valued inputs: exact in any order)
    rng = np.random.default_rng(11)
    A = rng.integers(-8, 8, (MS, KS)).astype(np.float64)
    B = rng.integers(-8, 8, (KS, NS)).astype(np.float64)
    hwA, hwB = np.full((MS, KS), np.nan), np.full((KS, NS), np.nan)
    for ln in range(ws):
        regs_a = [A[r, k] for r, k in maps[ln]["a"]]
        regs_b = [B[k, c] for k, c in maps[ln]["b"]]
        for i, (r, k) in enumerate(_isa_model(target, ln)["a"]):
            hwA[r, k] = regs_a[i]
        for i, (k, c) in enumerate(_isa_model(target, ln)["b"]):
            hwB[k, c] = regs_b[i]
    D = hwA @ hwB
    out = np.full((MS, NS), np.nan)
    for ln in range(ws):
        for i, (r, c) in enumerate(maps[ln]["c"]):
            mr, mc = _isa_model(target, ln)["c"][i]
            out[r, c] = D[mr, mc]
    np.testing.assert_array_equal(out, A @ B)
    # the register types hold the elements the maps say
    esz = {"i32": 2, "<4 x i16>": 4, "<4 x half>": 4, "<16 x i16>": 16, "<16 x half>": 16}
    assert esz[lay["a_ty"]] == lay["a_elems"] and esz[lay["b_ty"]] == lay["b_elems"]


def test_mma_layout_model_catches_a_wrong_layout(monkeypatch):
    """The oracle can fail: a layout with the WMMA accumulator rows in halves (a plausible mistake) is caught."""
    from jitkern.backends.amdgpu import AmdgpuHooks
    real = AmdgpuHooks.mma_layout

    def wrong(self, lane, kind):
        lay = real(self, lane, kind)
        if self.target.mma == "wmma":
            lay["c"] = [((lane >> 4) * 8 + i, lane & 15) for i in range(8)]
        return lay
    monkeypatch.setattr(AmdgpuHooks, "mma_layout", wrong)
    with pytest.raises(AssertionError):
        test_mma_layout_agrees_with_the_isa("gfx1100", "bf16")


def _compile_linear_mma(target: str, wdt: str):
    from jitkern.cli import parse_sig
    from jitkern.compiler import compile_kernel
    from engine.ops.matmul import _gpu_linear_mma_kernel
    params, consts = parse_sig(_gpu_linear_mma_kernel,
                               f"x=*f32:16,w=*{wdt}:16,bias=*f32:16,y=*f32:16,M=i32,N=i32:16,K=i32:16,ldx=i32:16,"
                               f"ldy=i32:16,xmap=i64,wmap=i64", ["HAS_BIAS=1", "BM=16", "BN=64", "BK=64", "EVEN=1"])
    return compile_kernel(_gpu_linear_mma_kernel, params, consts, get_target(target), load=False)


# the MFMA / WMMA mnemonics llvm-objdump prints for a 16x16x16 bf16 / f16 step
MMA_OPS = {("gfx90a", "bf16"): "v_mfma_f32_16x16x16bf16_1k", ("gfx90a", "f16"): "v_mfma_f32_16x16x16f16",
           ("gfx942", "bf16"): "v_mfma_f32_16x16x16_bf16", ("gfx942", "f16"): "v_mfma_f32_16x16x16_f16",
           ("gfx1100", "bf16"): "v_wmma_f32_16x16x16_bf16", ("gfx1100", "f16"): "v_wmma_f32_16x16x16_f16"}


@needs_lld
@pytest.mark.skipif(find_objdump() is None, reason="no llvm-objdump 17+ for AMDGPU (apt: llvm-19)")
@pytest.mark.parametrize("wdt", ["bf16", "f16"])
@pytest.mark.parametrize("target", TARGETS)
def test_linear_gemm_runs_on_the_matrix_units(target, wdt, tmp_path):
    """The tensor-core linear / GEMM kernel (f32 activations split hi + lo, 16-bit weights) disassembles to
    MFMA (gfx90a, gfx942) or WMMA (gfx1100) instructions, 16-byte global loads, LDS staging between barriers,
    no scratch or flat access. (Not executed: no AMD GPU; the fragment layouts are checked above.)"""
    ck = _compile_linear_mma(target, wdt)
    ll = ck.artifacts["kernel.ll"].decode()
    assert ("@llvm.amdgcn.mfma." if target != "gfx1100" else "@llvm.amdgcn.wmma.") in ll
    ops = _code_object_mnemonics(ck, target, tmp_path)
    op = MMA_OPS[(target, wdt)]
    # BM=16, BN=64, BK=64 per K step: 4 output tiles x 4 k steps x 2 (hi + lo of the f32 activations)
    n_mma = sum(v for k, v in ops.items() if k.startswith(op))
    assert n_mma >= 4 * 2, (op, sorted(k for k in ops if "mfma" in k or "wmma" in k))
    load16 = "global_load_b128" if target == "gfx1100" else "global_load_dwordx4"
    assert ops.get(load16, 0) >= 1, sorted(ops)
    assert any(k.startswith(("ds_write", "ds_store")) for k in ops)
    assert not [k for k in ops if k.startswith(("scratch_", "flat_", "buffer_store"))]
    assert ops.get("s_barrier", 0) >= 2


@needs_lld
@pytest.mark.skipif(find_objdump() is None, reason="no llvm-objdump 17+ for AMDGPU (apt: llvm-19)")
@pytest.mark.parametrize("wdt", ["bf16", "f16"])
@pytest.mark.parametrize("target", TARGETS)
def test_dense_linear_picks_the_matrix_units(target, wdt, tmp_path):
    """`linear` (the engine's dense projection) on an AMD target with 16-bit weights takes the tensor-core
    kernel with its engine tile (gpu_linear_mma_tile: decode M = 1 and a prefill-sized M alike, one kernel:
    batch invariant), and that code object runs its dots on MFMA / WMMA. f32 weights or K % 16 != 0 keep the
    FMA kernel. Compile-only (no AMD GPU): what the engine would launch there."""
    from engine.ops import matmul as mm
    from jitkern.runtime.launch import compile_only
    t = get_target(target)
    rng = np.random.default_rng(7)
    N, K = 96, 256
    w = rng.standard_normal((N, K)).astype(np.float16)
    w = w if wdt == "f16" else w.view(np.uint16)
    with compile_only(t) as co:
        for M in (1, 37):
            mm.linear(rng.standard_normal((M, K)).astype(np.float32), w, target=t, w_dtype=wdt)
    names = {ck.name for ck in co.compiled}
    assert names == {"_gpu_linear_mma_kernel"}, names
    tile = mm._mma_tile_for(t, N, K)          # the engine's (N, K) tile; K steps of 64 on wave32 WMMA
    assert all((ck.constexprs["BM"], ck.constexprs["BN"], ck.constexprs["BK"]) == tuple(tile[:3])
               for ck in co.compiled), [ck.constexprs for ck in co.compiled]
    assert len({ck.symbol for ck in co.compiled}) == 1          # M is not specialised on: one kernel for every M
    ck = co.compiled[0]
    ops = _code_object_mnemonics(ck, target, tmp_path)
    assert sum(v for k, v in ops.items() if k.startswith(MMA_OPS[(target, wdt)])) >= 2, sorted(ops)
    assert not [k for k in ops if k.startswith(("scratch_", "flat_"))]     # no VGPR spills, no flat access
    # the FMA kernel where the matrix units do not apply
    with compile_only(t) as co:
        mm.linear(rng.standard_normal((3, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32),
                  target=t)
        mm.linear(rng.standard_normal((3, 40)).astype(np.float32), w[:, :40].copy(), target=t, w_dtype=wdt)
    assert {ck.name for ck in co.compiled} == {"_gpu_linear_kernel"}


@needs_lld
@pytest.mark.skipif(find_objdump() is None, reason="no llvm-objdump 17+ for AMDGPU (apt: llvm-19)")
@pytest.mark.parametrize("target", ["gfx942", "gfx1100"])
def test_serial_split_linear_on_the_matrix_units(target, tmp_path):
    """From tuning.serial_split_m tokens a split K's slabs are summed inside each program (SERIAL: a run-time
    loop over the slabs around the K loop): on AMD targets that code object links, runs its dots on MFMA / WMMA
    and neither spills nor takes flat access. Compile-only (no AMD GPU)."""
    from engine.ops import matmul as mm
    from jitkern.runtime.launch import compile_only
    t = get_target(target)
    rng = np.random.default_rng(9)
    w = rng.standard_normal((128, 512)).astype(np.float16)          # narrow: K split in 4
    with compile_only(t) as co:
        mm.linear(rng.standard_normal((t.tuning.serial_split_m, 512)).astype(np.float32), w, target=t,
                  w_dtype="f16")
    (ck,) = co.compiled
    assert ck.name == "_gpu_linear_mma_kernel" and ck.constexprs["SERIAL"] and ck.constexprs["SPLIT"] == 4
    ops = _code_object_mnemonics(ck, target, tmp_path)
    assert sum(v for k, v in ops.items() if k.startswith(MMA_OPS[(target, "f16")])) >= 2, sorted(ops)
    assert not [k for k in ops if k.startswith(("scratch_", "flat_"))]


@needs_lld
@pytest.mark.timeout(900)
@pytest.mark.skipif(find_objdump() is None, reason="no llvm-objdump 17+ for AMDGPU (apt: llvm-19)")
@pytest.mark.parametrize("target", ["gfx942", "gfx1100"])
def test_build_with_a_bf16_model_has_the_mma_linear(target, tmp_path):
    """`jitkern build --target gfx942 / gfx1100 --model <bf16 safetensors>` drives the engine's GPU path on a
    stand-in device: its projections are the tensor-core linear, whose code object runs v_mfma / v_wmma."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json
    import torch
    from tests.model_fixtures import make_model_dir
    model = str(tmp_path / "tiny-bf16")
    make_model_dir("llama", model, seed=3, dtype=torch.bfloat16)
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["max_position_embeddings"] = 4096            # the build's warm-up asks for 2048 positions
    json.dump(cfg, open(cfg_path, "w"))
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "jitkern.cli", "build", "--target", target, "--model", model,
                        "--quiet"], cwd=ROOT, env=dict(os.environ, JITKERN_CACHE_DIR=str(cache)),
                       capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    linear = []
    for d, _, files in os.walk(cache):
        if "meta.json" in files and json.load(open(os.path.join(d, "meta.json")))["kernel"].endswith(
                "_gpu_linear_mma_kernel"):
            linear.append(d)
    assert linear, "no tensor-core linear in the build"
    for d in linear:
        dis = subprocess.run([find_objdump(), "-d", f"--mcpu={target}", os.path.join(d, "kernel.hsaco")],
                             capture_output=True, text=True, timeout=120)
        assert dis.returncode == 0, dis.stderr
        ops = _mnemonics(dis.stdout)
        assert sum(v for k, v in ops.items() if k.startswith(MMA_OPS[(target, "bf16")])) >= 2, sorted(ops)
