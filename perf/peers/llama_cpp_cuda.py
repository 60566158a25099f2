"""llama.cpp built for CUDA as a peer, on the same GGUF file as our engine, same run.

    python perf/peers/llama_cpp_cuda.py pack [--check] [--check-build]   # here, with a package index
    python perf/peers/llama_cpp_cuda.py build [--jobs 16] [--arch 90a]    # on the GPU machine (no internet)
    python perf/peers/llama_cpp_cuda.py bench --model FILE.gguf [--batches 1 16 64] [--systems llama ours]
                                              [--json OUT]

pack: downloads llama-cpp-python's sdist (the llama.cpp tree it vendors is the version the CPU peers use, see
the Makefile's peer-server target) into .peers/ and writes .peers/llama-cpp-cuda-src.tar.gz, the tree trimmed to
what the CUDA build of llama-bench, llama-batched-bench and llama-quantize needs (the full sdist is ~75 MB: too
big to carry). --check configures the unpacked trimmed tree with CUDA off (a file the build needs but the trim
dropped fails here, not on the GPU machine); --check-build also builds llama-bench on the CPU.

build: unpacks the tarball under --dir (default /tmp/llama-cpp-cuda) and builds the three tools with CUDA for
--arch; does nothing when the binaries are there already.

bench: llama-bench (pp512, tg128 at batch 1, -ngl 99) and llama-batched-bench (128-token prompts, 128 new
tokens, aggregate decode tok/s at each batch size), then our engine on --device cuda on the same file (a
subprocess: one model in GPU memory at a time): decode tok/s at each batch size with random 128-token prompts
(warm-up call, then the median of --repeat timed calls, EOS ignored) and a 512-token prefill; one table with
the ratios ours / llama.cpp.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSION = "0.3.36"                      # llama-cpp-python; the Makefile's LLAMA_CPP_PY_VERSION
PEERS = os.path.join(ROOT, ".peers")
SDIST = os.path.join(PEERS, f"llama_cpp_python-{VERSION}.tar.gz")
TARBALL = os.path.join(PEERS, "llama-cpp-cuda-src.tar.gz")
TOP = "llama.cpp"                       # the tarball's top folder
TOOLS = ("llama-bench", "batched-bench", "quantize")
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")

# What the build needs from the vendored tree. Backends other than CPU and CUDA are only add_subdirectory'd
# when their GGML_<NAME> option is on (ggml/src/CMakeLists.txt: ggml_add_backend), so their folders can go.
KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "ggml/", "src/", "include/", "common/", "vendor/",
        *(f"tools/{t}/" for t in TOOLS))
DROP = tuple(f"ggml/src/ggml-{b}/" for b in ("vulkan", "sycl", "cann", "opencl", "metal", "webgpu", "musa", "hip",
                                             "hexagon", "openvino", "et", "virtgpu", "zdnn", "zendnn", "rpc")) + (
    # header-only, an INTERFACE target that only the multimodal tool (not built) includes: its CMakeLists stays
    "vendor/miniaudio/miniaudio.h",
)
# tools/CMakeLists.txt adds every tool (server, mtmd, ...); the trimmed tree has only these
TOOLS_CMAKE = ("# the tools the CUDA peer needs (perf/peers/llama_cpp_cuda.py pack)\n"
               "llama_add_compile_flags()\n" + "".join(f"add_subdirectory({t})\n" for t in TOOLS))


def _die(msg: str):
    raise SystemExit(f"llama_cpp_cuda.py: {msg}")


# ---------------------------------------------------------------------------------------------------- pack
def pack(a) -> int:
    os.makedirs(PEERS, exist_ok=True)
    if not os.path.isfile(SDIST):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", PEERS], check=True)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    kept = dropped = 0
    with tarfile.open(SDIST) as src, tarfile.open(TARBALL + ".part", "w:gz", compresslevel=9) as dst:
        for m in src:
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(prefix):] + ("/" if m.isdir() else "")
            if not rel.startswith(KEEP) or rel.startswith(DROP) or rel == "tools/CMakeLists.txt":
                dropped += m.isfile()
                continue
            # a fresh header: a member's pax "path" record (names over 100 characters) would override a new name
            out = tarfile.TarInfo(f"{TOP}/{rel.rstrip('/')}")
            out.type, out.size, out.mode, out.mtime = m.type, m.size, m.mode, m.mtime
            dst.addfile(out, src.extractfile(m) if m.isfile() else None)
            kept += m.isfile()
        data = TOOLS_CMAKE.encode()
        info = tarfile.TarInfo(f"{TOP}/tools/CMakeLists.txt")
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        dst.addfile(info, io.BytesIO(data))
    with tarfile.open(TARBALL + ".part") as t:
        stray = [n for n in t.getnames() if not n.startswith(TOP + "/")]
    if stray:
        _die(f"{len(stray)} members outside {TOP}/ in the new tarball, e.g. {stray[0]}")
    os.replace(TARBALL + ".part", TARBALL)
    print(f"{TARBALL}: {kept} files ({dropped} dropped), {os.path.getsize(TARBALL) / 2**20:.1f} MiB")
    if a.check or a.check_build:
        with tempfile.TemporaryDirectory(prefix="jk-llamacpp-check-") as d:
            src = _unpack(d)
            bdir = os.path.join(d, "build")
            _configure(src, bdir, cuda=False, arch=None)
            if a.check_build:
                _build(bdir, ["llama-bench"], a.jobs)
                subprocess.run([os.path.join(bdir, "bin", "llama-bench"), "--help"], check=True,
                               stdout=subprocess.DEVNULL)
                print("llama-bench built on the CPU from the trimmed tree and runs")
    return 0


# --------------------------------------------------------------------------------------------------- build
def _unpack(d: str) -> str:
    if not os.path.isfile(TARBALL):
        _die(f"{TARBALL} is missing: run `python perf/peers/llama_cpp_cuda.py pack` on a machine with a package "
             "index and carry .peers/llama-cpp-cuda-src.tar.gz along")
    with tarfile.open(TARBALL) as t:
        t.extractall(d, filter="data")
    return os.path.join(d, TOP)


def _configure(src: str, bdir: str, cuda: bool, arch: str | None):
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            _die(f"{tool} not found on PATH")
    if cuda and shutil.which("nvcc") is None and not os.path.isfile("/usr/local/cuda/bin/nvcc"):
        _die("nvcc not found (PATH or /usr/local/cuda/bin): the CUDA build needs the toolkit")
    cmd = ["cmake", "-S", src, "-B", bdir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_UI=OFF",
           "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
           # one GPU; its default ON would look for an NCCL install
           "-DGGML_CUDA_NCCL=OFF"]
    if cuda:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        toolkit = _toolkit(nvcc)
        cmd += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *_cublas_flags(toolkit),
                *_driver_flags(toolkit)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _toolkit(nvcc: str) -> str:
    real = os.path.realpath(nvcc)
    try:     # a wrapper script (exec /usr/local/cuda-X/bin/nvcc "$@"): the toolkit is where it points
        with open(real, "rb") as f:
            head = f.read(400)
        if head.startswith(b"#!"):
            real = next((w.decode() for w in head.split() if w.endswith(b"/nvcc") and os.path.isfile(w)), real)
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(real)))


def _driver_flags(toolkit: str) -> list[str]:
    """ggml-cuda links CUDA::cuda_driver (libcuda.so, the toolkit's stub). An nvcc-only install has no stub:
    then the driver's own libcuda.so.1."""
    import glob
    pats = ("lib64", "lib64/stubs", "lib", "lib/stubs", "targets/*/lib", "targets/*/lib/stubs")
    if any(glob.glob(os.path.join(toolkit, p, "libcuda.so")) for p in pats):
        return []
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    found = [ln.split("=>")[-1].strip() for ln in out.splitlines() if "libcuda.so.1 " in ln and "x86-64" in ln]
    found += glob.glob("/usr/lib/x86_64-linux-gnu/libcuda.so.1") + glob.glob("/usr/lib64/libcuda.so.1")
    if not found:
        _die(f"no libcuda.so in the CUDA toolkit at {toolkit} and no driver libcuda.so.1 (ldconfig -p)")
    print(f"no libcuda.so stub in the CUDA toolkit at {toolkit}: linking the driver's {found[0]}")
    return [f"-DCUDA_cuda_driver_LIBRARY={found[0]}"]


def _cublas_flags(toolkit: str) -> list[str]:
    """ggml-cuda links CUDA::cublas and CUDA::cublasLt. A toolkit without cuBLAS (an nvcc-only install) leaves
    those targets undefined and the configure fails; then take cuBLAS from the pip wheels torch depends on
    (nvidia/**/include/cublas_v2.h, lib/libcublas.so.N), naming the libraries through FindCUDAToolkit's cache
    variables. The build tree's RPATH then holds their folder, so the binaries run without LD_LIBRARY_PATH."""
    import glob
    if glob.glob(os.path.join(toolkit, "include", "cublas_v2.h")) or \
            glob.glob(os.path.join(toolkit, "targets", "*", "include", "cublas_v2.h")):
        return []
    import site
    roots = [os.path.join(p, "nvidia") for p in site.getsitepackages() + [site.getusersitepackages()]]
    try:
        import nvidia      # namespace package of the nvidia-* wheels
        roots += list(nvidia.__path__)
    except ImportError:
        pass
    for root in dict.fromkeys(roots):
        hdr = sorted(glob.glob(os.path.join(root, "**", "include", "cublas_v2.h"), recursive=True))
        if not hdr:
            continue
        inc = os.path.dirname(hdr[0])
        lib = os.path.join(os.path.dirname(inc), "lib")
        libs = {n: sorted(glob.glob(os.path.join(lib, f"lib{n}.so*"))) for n in ("cublas", "cublasLt")}
        if all(libs.values()):
            print(f"no cuBLAS in the CUDA toolkit at {toolkit}: using the pip wheel's under {os.path.dirname(inc)}")
            return [f"-DCUDA_cublas_LIBRARY={libs['cublas'][0]}", f"-DCUDA_cublasLt_LIBRARY={libs['cublasLt'][0]}",
                    f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}", f"-DCMAKE_C_FLAGS=-I{inc}"]
    _die(f"the CUDA toolkit at {toolkit} has no cuBLAS (include/cublas_v2.h) and no nvidia cuBLAS wheel was found "
         f"under {roots}: llama.cpp's CUDA backend needs it")


def _build(bdir: str, targets, jobs: int):
    cmd = ["cmake", "--build", bdir, "-j", str(jobs), "--target", *targets]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"built {' '.join(targets)} in {time.perf_counter() - t0:.0f} s", flush=True)


def bin_path(d: str, name: str) -> str:
    return os.path.join(d, "build", "bin", name)


def build(a) -> int:
    if all(os.access(bin_path(a.dir, t), os.X_OK) for t in TARGETS):
        print(f"llama.cpp tools already built under {a.dir}/build/bin")
        return 0
    os.makedirs(a.dir, exist_ok=True)
    src = os.path.join(a.dir, TOP)
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        _unpack(a.dir)
    bdir = os.path.join(a.dir, "build")
    if not os.path.isfile(os.path.join(bdir, "CMakeCache.txt")):
        _configure(src, bdir, cuda=not a.cpu, arch=a.arch)
    _build(bdir, TARGETS, a.jobs)
    return 0


# --------------------------------------------------------------------------------------------------- bench
def _run(cmd, timeout) -> str:
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        sys.stderr.write(p.stderr[-4000:])
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited with {p.returncode}")
    return p.stdout + "\n" + p.stderr


def bench_llama(a) -> dict:
    """{"pp512": tok/s, "tg128": tok/s, "batched": {batch: aggregate decode tok/s}, "info": ...}"""
    exe = {t: bin_path(a.dir, t) for t in TARGETS}
    for t in ("llama-bench", "llama-batched-bench"):
        if not os.access(exe[t], os.X_OK):
            raise FileNotFoundError(f"{exe[t]} not found: run `python perf/peers/llama_cpp_cuda.py build` first")
    res = {"batched": {}}
    out = _run([exe["llama-bench"], "-m", a.model, "-ngl", str(a.ngl), "-p", str(a.prefill), "-n", str(a.output_len),
                "-r", str(a.llama_reps), "-o", "json"], a.timeout)
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        res[key] = {"tok_s": r["avg_ts"], "stddev": r["stddev_ts"]}
    res["info"] = {k: rows[0].get(k) for k in ("gpu_info", "backends", "model_type", "model_size", "flash_attn",
                                                "build_commit")}
    # every batch size twice, the first pass a warm-up (batched-bench warms up on 16 tokens at batch 1 only);
    # a case needing more than -c cells is skipped silently, hence -c for the largest batch
    npl = ",".join(map(str, a.batches * 2))
    ctx = max(a.batches) * (a.input_len + a.output_len)
    out = _run([exe["llama-batched-bench"], "-m", a.model, "-ngl", str(a.ngl), "-c", str(ctx), "-npp",
                str(a.input_len), "-ntg", str(a.output_len), "-npl", npl, "--output-format", "jsonl"], a.timeout)
    for line in out.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            res["batched"][str(r["pl"])] = {"decode_tok_s": r["speed_tg"], "prefill_tok_s": r["speed_pp"],
                                            "flash_attn": r["flash_attn"]}
    missing = [b for b in a.batches if str(b) not in res["batched"]]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no result for batch {missing}")
    return res


def bench_ours(a) -> dict:
    """Our engine on the file: decode tok/s per batch size (random input-len prompts, output-len new tokens,
    aggregate decode = b * (output_len - 1) / (wall - time to the batch's first tokens), as in
    perf/bench_e2e_cuda.py) and one prefill-length prompt's tok/s (prefill_len / wall of a one-token call)."""
    import numpy as np

    from engine import LLM, SamplingParams
    top = max(a.batches)
    seq = max(a.input_len + a.output_len, a.prefill + 1)
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, block_size=16, num_blocks=top * -(-seq // 16) + 64, max_num_seqs=top,
              max_model_len=seq + 16, enable_prefix_caching=False)
    res = {"load_s": time.perf_counter() - t0, "batched": {}}
    try:
        vocab = llm.engine.config.vocab_size
        rng = np.random.default_rng(a.seed)
        prompts = lambda n, length: rng.integers(2, vocab, (n, length)).tolist()   # noqa: E731
        sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)  # noqa: E731
        for b in a.batches:
            llm.generate(prompts(b, a.input_len), sp(a.output_len))     # warm-up: kernels, this batch's graphs
            rows, runs = prompts(b, a.input_len), []
            for _ in range(a.repeat):
                start = time.monotonic()
                t0 = time.perf_counter()
                outs = llm.generate(rows, sp(a.output_len))
                wall = time.perf_counter() - t0
                ttft = max(o.metrics.first_token_time for o in outs) - start
                runs.append(b * (a.output_len - 1) / max(wall - ttft, 1e-9))
            res["batched"][str(b)] = {"decode_tok_s": sorted(runs)[(len(runs) - 1) // 2], "runs": runs}
        llm.generate(prompts(1, a.prefill), sp(1))
        walls = []
        for _ in range(a.repeat):
            rows = prompts(1, a.prefill)     # a fresh prompt each time (prefix caching is off anyway)
            t0 = time.perf_counter()
            llm.generate(rows, sp(1))
            walls.append(time.perf_counter() - t0)
        res[f"pp{a.prefill}"] = {"tok_s": a.prefill / sorted(walls)[(len(walls) - 1) // 2]}
    finally:
        llm.close()
    return res


def _ours_subprocess(a) -> dict:
    with tempfile.TemporaryDirectory(prefix="jk-llamacpp-ours-") as d:
        out = os.path.join(d, "ours.json")
        cmd = [sys.executable, os.path.abspath(__file__), "_ours", "--model", a.model, "--result", out,
               "--device", a.device, "--batches", *map(str, a.batches), "--input-len", str(a.input_len),
               "--output-len", str(a.output_len), "--prefill", str(a.prefill), "--repeat", str(a.repeat),
               "--seed", str(a.seed)]
        try:
            rc = subprocess.run(cmd, timeout=a.timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if not os.path.isfile(out):
            return {"error": f"our engine's worker exited with {rc} and no result"}
        with open(out) as f:
            return json.load(f)


def table(res: dict, a) -> list[str]:
    llama, ours = res.get("llama", {}), res.get("ours", {})

    def val(r, key, b=None):
        x = r.get("batched", {}).get(str(b), {}) if b is not None else r.get(key, {})
        return x.get("decode_tok_s" if b is not None else "tok_s")

    rows = [(f"prefill {a.prefill} tok/s (batch 1)", f"pp{a.prefill}", None),
            (f"decode tok/s batch 1 (llama-bench tg{a.output_len})", f"tg{a.output_len}", None)]
    rows += [(f"decode tok/s batch {b} (aggregate)", None, b) for b in a.batches]
    fmt = lambda v: f"{v:12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}"   # noqa: E731
    lines = [f"{'':<44} {'llama.cpp':>12} {'ours':>12} {'ours/llama':>10}"]
    for label, key, b in rows:
        lv = val(llama, key, b)
        ov = val(ours, key, b) if b is not None or key.startswith("pp") else val(ours, None, 1)
        ratio = f"{ov / lv:10.3f}" if lv and ov else f"{'-':>10}"
        lines.append(f"{label:<44} {fmt(lv)} {fmt(ov)} {ratio}")
    for s in ("llama", "ours"):
        if "error" in res.get(s, {}):
            lines.append(f"{s}: FAILED: {res[s]['error']}")
    return lines


def bench(a) -> int:
    if not os.path.isfile(a.model):
        _die(f"--model {a.model}: no such file (perf/peers/make_gguf.py writes test files)")
    res = {}
    if "llama" in a.systems:
        try:
            res["llama"] = bench_llama(a)
        except Exception as e:      # noqa: BLE001 - our side still runs; the table says what failed
            res["llama"] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res["llama"], indent=1), flush=True)
    if "ours" in a.systems:
        res["ours"] = _ours_subprocess(a)
        print(json.dumps(res["ours"], indent=1), flush=True)
    lines = [f"{os.path.basename(a.model)}: {a.input_len}-token prompts, {a.output_len} new tokens, "
             f"device {a.device}, median of {a.repeat} (ours) / llama-bench -r {a.llama_reps}"] + table(res, a)
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": res, "table": lines}, f, indent=1)
    return 1 if any("error" in r for r in res.values()) else 0


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write .peers/llama-cpp-cuda-src.tar.gz (needs a package index)")
    p.add_argument("--check", action="store_true", help="configure the trimmed tree (CUDA off) in a temp dir")
    p.add_argument("--check-build", action="store_true", help="also build llama-bench on the CPU")
    p.add_argument("--jobs", type=int, default=2)
    p = sub.add_parser("build", help="build llama-bench, llama-batched-bench, llama-quantize for CUDA")
    p.add_argument("--dir", default="/tmp/llama-cpp-cuda")
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--arch", default="90a", help="CMAKE_CUDA_ARCHITECTURES (default 90a: H100/H200)")
    p.add_argument("--cpu", action="store_true", help="build without CUDA (checks the script)")
    for name in ("bench", "_ours"):
        p = sub.add_parser(name, help="llama.cpp vs ours on one GGUF file" if name == "bench" else argparse.SUPPRESS)
        p.add_argument("--model", required=True, help="a GGUF file")
        p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill figure")
        p.add_argument("--repeat", type=int, default=3, help="ours: timed calls per figure, median reported")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="cuda", help="ours: engine device")
        if name == "bench":
            p.add_argument("--systems", nargs="+", choices=("llama", "ours"), default=["llama", "ours"])
            p.add_argument("--dir", default="/tmp/llama-cpp-cuda", help="where `build` put llama.cpp")
            p.add_argument("--ngl", type=int, default=99, help="llama.cpp layers on the GPU")
            p.add_argument("--llama-reps", type=int, default=5, help="llama-bench -r")
            p.add_argument("--timeout", type=float, default=900, help="seconds per tool / worker")
            p.add_argument("--json", default=None)
        else:
            p.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        return pack(a)
    if a.cmd == "build":
        return build(a)
    a.batches = sorted(set(a.batches))
    if a.cmd == "bench":
        return bench(a)
    sys.path.insert(0, ROOT)
    with open(a.result, "w") as f:
        json.dump(bench_ours(a), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
