"""Kernel A/B harness on a CUDA GPU: jitkern's kernels against the best peer on the same shapes in the same run.

    python perf/bench_kernels_cuda.py [--only gemm attn gemv elem] [--smoke] [--reps 20] [--json out.json]
    python perf/bench_kernels_cuda.py --smoke --device cpu     # checks the script on a CPU (see below)

Sections (each row says which variant ran, its median time, TFLOP/s or GB/s, the ratio to the peer, and the
max error against an f32 reference where one is cheap):
  gemm  bf16 GEMM at Llama-3-8B projection shapes, (N, K) in (4096, 4096) qkv-less o_proj, (6144, 4096) qkv,
        (28672, 4096) gate|up, (4096, 14336) down, (128256, 4096) lm_head; M = 1, 16, 64, 256, 2048, 8192.
        torch.matmul (cuBLAS; bf16 in/out), the Triton matmul of perf/peers/triton_matmul.py (autotuned;
        bf16 in/out), jitkern's `linear` (what the engine's dense layers call on device arrays: f32
        activations, bf16 weights, f32 out; the kernel it launched is printed) and, where the tiles divide
        the shape, the jk.dot tensor-core tile kernel of perf/bench_cuda.py (bf16 in, f32 out).
  attn  prefill: torch SDPA forced to the flash backend (bf16, causal; K/V repeated to 32 heads) vs jitkern's
        paged prefill attention (f32 q, f32 and f16 paged caches), 32 q heads / 8 KV heads / head_dim 128;
        decode: jitkern's paged decode attention (the engine's call: num_partitions=MAX_PARTITIONS) with f32
        and f16 caches, GB/s of KV read vs the copy bandwidth, and torch SDPA (bf16, enable_gqa) for reference.
        Each jitkern row runs per variant, A/B: [flash] = the GPU flash kernels (engine.ops.attention's
        default on GPUs: flash_decode/merge_kernel, flash_prefill_kernel) and [token] = token_attention_kernel
        (tuning.token_attention, the path before them); --attn-variants adds flash settings to sweep
        (flash-rows32 flash-rows16 flash-nopipe flash-pb8 flash-w8 flash-w2 flash-w4p, see ATTN_VARIANTS;
        flash-bs32 / flash-bs64 hold the same tokens in a cache of 32- / 64-token blocks).
  gemv  M = 1 `linear` (decode projections) as GB/s of weights read vs the measured copy bandwidth, next to
        torch.matmul at M = 1.
  elem  rms_norm and silu_and_mul (f32) as GB/s vs the copy bandwidth.
  qgemv GGUF-quantised linears (matmul_q8 on device arrays, activations quantised once outside the timing) of
        --qtypes at SmolLM2-135M shapes (576 x 576, 1536 x 576, 576 x 1536, the 49152 x 576 head) and Llama-3-8B
        ones (4096 x 4096, 14336 x 4096, 4096 x 14336), M = --qgemv-m (default 1 16 64), as GB/s of weight
        blocks + int8 activations vs the copy bandwidth (every type on the GPU-shaped _qmv_gpu_kernel; shapes whose
        K is not a multiple of a type's block are skipped).
The copy bandwidth (cuMemcpyDtoDAsync of 1 GiB, read + write bytes) is measured first in every run.

Timing: CUDA events on jitkern's stream (torch and Triton are made to run on the same stream); before each
timed batch of calls a torch.cuda._sleep kernel holds the GPU while the host enqueues the batch, so the
figure is device time, not Python launch overhead; one warm-up call (compiles, autotunes), then the median
of --reps batches. Weights are rotated over enough copies (>= 256 MB) that small ones are not served from
the 50 MB L2. A call slower than 0.25 s is timed once (marked "1x").

--device cpu: torch on the CPU and jitkern's device arrays on host memory (tests/fake_cuda: the op wrappers'
device-array path with the CPU kernels), perf_counter timing, no Triton/flash (reported as skipped): for
checking the script, not for numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GEMM_NK = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
GEMM_M = (1, 16, 64, 256, 2048, 8192)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_CASES = ((1, 1024), (1, 4096), (8, 1024))          # (sequences, tokens each)
DECODE_CASES = ((1, 1024), (16, 1024), (64, 1024), (1, 4096), (16, 4096), (64, 4096))   # (sequences, context)
# GPU attention paths timed A/B (see attention()): engine.ops.attention module settings per variant
ATTN_VARIANTS = {"flash": {}, "flash-rows32": {"FLASH_ROWS": 32}, "flash-nopipe": {"flash_prefill_pipeline": False},
                 "flash-pb8": {"flash_partition_blocks": 8}, "flash-w8": {"FLASH_WARPS": (8, 8)},
                 "flash-rows16": {"FLASH_ROWS": 16}, "flash-w2": {"FLASH_WARPS": (2, 8)},
                 "flash-w4p": {"FLASH_WARPS": (4, 4)},
                 # the cache's block size (not a module setting): the flash kernels step one block at a time
                 "flash-bs32": {"BLOCK": 32}, "flash-bs64": {"BLOCK": 64},
                 "flash-bs64-nopipe": {"BLOCK": 64, "flash_prefill_pipeline": False},
                 "flash-bs64-pb1": {"BLOCK": 64, "flash_partition_blocks": 1},
                 "flash-16bit": {"GPU_FLASH_OPERANDS": "16bit"},
                 "flash-16bit-w2": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_WARPS": (2, 8)},
                 # decode partitions of 1 / 2 / 8 blocks (more programs at small batches, more merging), and the
                 # decode kernel at 4 warps however wide the launch
                 "flash-16bit-pb1": {"GPU_FLASH_OPERANDS": "16bit", "flash_partition_blocks": 1},
                 "flash-16bit-pb2": {"GPU_FLASH_OPERANDS": "16bit", "flash_partition_blocks": 2},
                 "flash-16bit-pb8": {"GPU_FLASH_OPERANDS": "16bit", "flash_partition_blocks": 8},
                 "flash-16bit-dw4": {"GPU_FLASH_OPERANDS": "16bit", "flash_decode_wide": 1 << 30},
                 # 32-row prefill tiles at 4 warps: 255 registers, no spills (ptxas), so two CTAs an SM
                 "flash-16bit-rows32-w4": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_ROWS": 32, "FLASH_WARPS": (4, 4)},
                 # warp-owned rows (tuning.flash_warp_rows: row max / sum on lane shuffles; registers and
                 # barriers per tile: perf/ptxas_flash.py; the default tile FLASH_WARP_ROWS_TILE is 64 / 8)
                 "flash-16bit-warprows": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True},
                 "flash-16bit-warprows-rows32-w4": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                                    "FLASH_WARP_ROWS_TILE": (32, 4)},
                 "flash-16bit-warprows-rows16-w4": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                                    "FLASH_WARP_ROWS_TILE": (16, 4)},
                 "flash-16bit-warprows-rows64-w8": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                                    "FLASH_WARP_ROWS_TILE": (64, 8)},
                 "flash-16bit-warprows-rows32-w8": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                                    "FLASH_WARP_ROWS_TILE": (32, 8)},
                 # with online-softmax steps of 2 / 4 blocks
                 "flash-16bit-warprows-sb2": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                              "flash_step_blocks": 2},
                 "flash-16bit-warprows-sb4": {"GPU_FLASH_OPERANDS": "16bit", "flash_warp_rows": True,
                                              "flash_step_blocks": 4},
                 # the decode kernel's registers capped (ptxas: 227 at 2 warps, 4 CTAs an SM; 168: 6, 128: 8)
                 "flash-16bit-dm168": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_DECODE_MAXNREG": 168},
                 "flash-16bit-dm128": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_DECODE_MAXNREG": 128},
                 "flash-16bit-shortest-first": {"GPU_FLASH_OPERANDS": "16bit", "flash_longest_first": False},
                 "flash-16bit-nopipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_prefill_pipeline": False},
                 # the earlier settings: decode with the next block's loads in flight, 64-row prefill
                 # tiles at 8 warps
                 "flash-16bit-dpipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_decode_pipeline": True},
                 "flash-16bit-rows64-w8": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_ROWS": 64, "FLASH_WARPS": (4, 8)},
                 # 16-row prefill tiles at 4 warps (2 CTAs an SM; capped at 168 registers: 3)
                 "flash-16bit-rows16-w4": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_ROWS": 16, "FLASH_WARPS": (4, 4)},
                 "flash-16bit-rows16-w4-m168": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_ROWS": 16, "FLASH_WARPS": (4, 4),
                                                "FLASH_PREFILL_MAXNREG": 168},
                 "flash-16bit-m168": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_PREFILL_MAXNREG": 168},
                 # wide decode launches at one warp a program (ptxas: 254 registers without the pipeline, 8 CTAs an
                 # SM; every reduction inside the warp, barriers of one warp)
                 "flash-16bit-dw1": {"GPU_FLASH_OPERANDS": "16bit", "FLASH_DECODE_WIDE_WARPS": 1},
                 # cache blocks of 32 / 64 tokens with 16-bit operands (the online-softmax state in the MMA
                 # registers since the fragment-layout values, so larger steps may fit now)
                 "flash-16bit-bs32": {"GPU_FLASH_OPERANDS": "16bit", "BLOCK": 32},
                 "flash-16bit-bs64": {"GPU_FLASH_OPERANDS": "16bit", "BLOCK": 64},
                 # online-softmax steps of 2 / 4 cache blocks (flash_step_blocks: partitions stay 4 blocks; ptxas:
                 # the 32-row prefill spills 392 / 1028 B with the pipeline, 288 / 640 B without; the decode at 2
                 # warps 245 registers / 472 B spilled, at 4 warps 227 without spills at 4 blocks)
                 "flash-16bit-sb2": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 2},
                 "flash-16bit-sb4": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 4},
                 "flash-16bit-sb2-nopipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 2, "flash_prefill_pipeline": False},
                 # 16-row prefill tiles: sb2 with the pipeline 255 registers, no spills; sb4 without it 192 B spilled
                 "flash-16bit-sb2-rows16": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 2, "FLASH_ROWS": 16},
                 "flash-16bit-sb4-rows16-nopipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 4, "FLASH_ROWS": 16,
                                                   "flash_prefill_pipeline": False},
                 "flash-16bit-sb4-rows16-nopipe-dw4": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 4,
                                                       "FLASH_ROWS": 16, "flash_prefill_pipeline": False,
                                                       "flash_decode_wide": 1 << 30},
                 "flash-16bit-sb4-nopipe-dw4": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 4,
                                                "flash_prefill_pipeline": False, "flash_decode_wide": 1 << 30},
                 # the defaults (2-block steps, the decode pipeline) against 1 / 4-block steps
                 "flash-16bit-sb1-nodpipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 1,
                                             "flash_decode_pipeline": False},
                 "flash-16bit-sb1": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 1},
                 "flash-16bit-sb4-nodpipe": {"GPU_FLASH_OPERANDS": "16bit", "flash_step_blocks": 4,
                                             "flash_decode_pipeline": False},
                 "token": {"token_attention": True}}
ROTATE_BYTES = 256 << 20


class _Keep:
    """Holds the torch tensor a zero-copy DeviceArray views (DeviceArray keeps its `alloc` alive)."""
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


class Bench:
    def __init__(self, device: str, reps: int, budget_s: float):
        import torch
        from jitkern.runtime import cuda
        self.torch = torch
        self.is_cuda = device == "cuda"
        self.device = device
        self.reps = reps
        self.budget_s = budget_s
        self.jdev = cuda.get_device()
        self.cuda_mod = cuda
        self.stream = None
        if self.is_cuda:
            # jitkern launches on its own stream: run torch / Triton there too, so one event pair times both
            self.stream = torch.cuda.ExternalStream(self.jdev.stream_handle)
            torch.cuda.set_stream(self.stream)
        self.rows: list[dict] = []

    # --- arrays
    def dev(self, t, dtype=None):
        """A jitkern DeviceArray over a torch tensor's memory (no copy). dtype: numpy dtype or "bf16"."""
        from jitkern import ir
        t = t.contiguous()
        if dtype == "bf16":
            d = ir.DTYPES["bf16"]
        else:
            d = np.dtype(dtype) if dtype is not None else {
                self.torch.float32: np.dtype(np.float32), self.torch.float16: np.dtype(np.float16),
                self.torch.int32: np.dtype(np.int32), self.torch.bfloat16: np.dtype(np.uint16),
                self.torch.uint8: np.dtype(np.uint8)}[t.dtype]
        return self.cuda_mod.DeviceArray(t.data_ptr(), tuple(t.shape), d, self.jdev, _Keep(t))

    # --- timing
    def sync(self):
        if self.is_cuda:
            self.torch.cuda.synchronize()
        self.jdev.synchronize()

    def time(self, fns) -> tuple[float, str]:
        """Median seconds per call of fns[i % len(fns)] (a rotation over argument sets), and a note."""
        fns = fns if isinstance(fns, (list, tuple)) else [fns]
        fns[0]()                                            # warm-up: compile, autotune, allocator
        self.sync()
        if not self.is_cuda:
            t0 = time.perf_counter()
            fns[0]()
            one = time.perf_counter() - t0
            inner = max(1, min(20, int(0.01 / max(one, 1e-9))))
            reps = max(1, min(self.reps, int(self.budget_s / max(one * inner, 1e-9))))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for i in range(inner):
                    fns[i % len(fns)]()
                ts.append((time.perf_counter() - t0) / inner)
            return statistics.median(ts), f"{reps}x{inner}"
        torch = self.torch
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        h0 = time.perf_counter()
        ev[0].record()
        fns[0]()
        ev[1].record()
        host = time.perf_counter() - h0
        ev[1].synchronize()
        one = ev[0].elapsed_time(ev[1]) / 1e3
        if one > 0.25:
            return one, "1x"
        inner = max(len(fns), min(200, int(0.002 / max(one, 1e-7))))
        # hold the GPU while the host enqueues `inner` calls (~2 GHz SM clock; a longer sleep is harmless)
        sleep_s = 1.5 * inner * host + 50e-6
        reps = max(3, min(self.reps, int(self.budget_s / (one * inner + sleep_s))))
        sleep_cycles = int(2e9 * sleep_s)
        ts = []
        for _ in range(reps):
            torch.cuda._sleep(sleep_cycles)
            ev[0].record()
            for i in range(inner):
                fns[i % len(fns)]()
            ev[1].record()
            ev[1].synchronize()
            ts.append(ev[0].elapsed_time(ev[1]) / 1e3 / inner)
        return statistics.median(ts), f"{reps}x{inner}"

    def row(self, section, case, variant, t, note="", flops=None, nbytes=None, peer=None, err=None):
        r = {"section": section, "case": case, "variant": variant, "ms": t * 1e3 if t else None, "note": note}
        if t and flops:
            r["tflops"] = flops / t / 1e12
        if t and nbytes:
            r["gbs"] = nbytes / t / 1e9
        if peer and t:
            r["ratio"] = peer / t                           # > 1: faster than the peer
        if err is not None:
            r["err"] = err
        self.rows.append(r)
        ms = f"{t * 1e3:9.3f}" if t else f"{'-':>9}"
        tf = f"{r['tflops']:7.1f}" if "tflops" in r else f"{'':>7}"
        gb = f"{r['gbs']:7.0f}" if "gbs" in r else f"{'':>7}"
        ra = f"{r['ratio']:6.3f}" if "ratio" in r else f"{'':>6}"
        er = f"{err:8.1e}" if err is not None else f"{'':>8}"
        print(f"{case:<26} {variant:<44} {ms} {tf} {gb} {ra} {er}  {note}", flush=True)
        return r

    def fail(self, section, case, variant, exc):
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"
        self.rows.append({"section": section, "case": case, "variant": variant, "error": msg})
        print(f"{case:<26} {variant:<44} FAILED {msg}", flush=True)


def _header(title):
    print(f"\n== {title}")
    print(f"{'case':<26} {'variant':<44} {'ms':>9} {'TFLOP/s':>7} {'GB/s':>7} {'ratio':>6} {'max err':>8}  reps")


def _rel_err(y, ref) -> float:
    y = y.float()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ sections
def copy_bandwidth(b: Bench, mib: int) -> float:
    torch = b.torch
    n = mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    t, note = b.time(lambda: b.jdev.copy(dst.data_ptr(), src.data_ptr(), n))
    _header("copy bandwidth (the ceiling for memory-bound rows)")
    b.row("copy", f"{mib} MiB", "cuMemcpyDtoDAsync", t, note, nbytes=2 * n)
    t2, note = b.time(lambda: dst.copy_(src))
    b.row("copy", f"{mib} MiB", "torch copy_", t2, note, nbytes=2 * n)
    assert torch.equal(dst[:4096], src[:4096])
    return 2 * n / t / 1e9


def _weights(b, N, K, copies):
    torch = b.torch
    return [(torch.randn(N, K, device=b.device) * 0.05).to(torch.bfloat16) for _ in range(copies)]


def _linear_variant(b, x32, ws, y32):
    """jitkern linear on device arrays (the engine's dense op): f32 x, bf16 w, f32 out. Returns (fns, name)."""
    from engine.ops import matmul as jm
    xd, yd = b.dev(x32), b.dev(y32)
    wds = [b.dev(w) for w in ws]
    fns = [lambda wd=wd: jm.linear(xd, wd, out=yd, w_dtype="bf16") for wd in wds]
    jm._LAST.clear()
    fns[0]()
    b.sync()
    ran = ",".join(sorted(jm._LAST)) or "?"
    tgt = next(iter(jm._LAST.values())).target.name if jm._LAST else "?"
    return fns, f"jitkern linear [{ran} @{tgt}]"


def gemm(b: Bench, Ms, NKs, check_rows=64):
    torch = b.torch
    triton_mm = _triton(b)
    _header("bf16 GEMM y[M,N] = x[M,K] @ w[N,K]^T  (ratio: cuBLAS time / variant time)")
    for N, K in NKs:
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / (2 * N * K))))
        ws = _weights(b, N, K, copies)
        for M in Ms:
            case = f"M={M} N={N} K={K}"
            flops, nb = 2 * M * N * K, 2 * (N * K + M * K + M * N)
            x = (torch.randn(M, K, device=b.device)).to(torch.bfloat16)
            x32 = x.float()
            m = min(M, check_rows)
            ref = x32[:m] @ ws[0].float().T
            y = torch.empty(M, N, dtype=torch.bfloat16, device=b.device)
            y32 = torch.empty(M, N, dtype=torch.float32, device=b.device)
            t_cublas = None
            try:
                t_cublas, note = b.time([lambda w=w: torch.matmul(x, w.T, out=y) for w in ws])
                torch.matmul(x, ws[0].T, out=y)
                b.row("gemm", case, "cuBLAS torch.matmul (bf16 out)", t_cublas, note, flops, nb,
                      err=_rel_err(y[:m], ref))
            except Exception as e:      # noqa: BLE001 - a failed variant is reported, the run goes on
                b.fail("gemm", case, "cuBLAS torch.matmul", e)
            if triton_mm is not None:
                try:
                    t, note = b.time([lambda w=w: triton_mm.matmul(x, w, out=y) for w in ws])
                    triton_mm.matmul(x, ws[0], out=y)
                    b.row("gemm", case, f"Triton [{triton_mm.best_config(M, N, K)}]", t, note, flops, nb,
                          t_cublas, _rel_err(y[:m], ref))
                except Exception as e:  # noqa: BLE001
                    b.fail("gemm", case, "Triton matmul", e)
            try:
                fns, name = _linear_variant(b, x32, ws, y32)
                t, note = b.time(fns)
                fns[0]()
                b.sync()
                b.row("gemm", case, name, t, note, flops, 2 * N * K + 4 * (M * K + M * N), t_cublas,
                      _rel_err(y32[:m], ref))
            except Exception as e:      # noqa: BLE001
                b.fail("gemm", case, "jitkern linear", e)
            BM, BN, BK = 64, 64, 32
            if M % BM == 0 and N % BN == 0 and K % BK == 0:
                try:
                    from perf.bench_cuda import _gemm_bf16
                    xd, yd = b.dev(x, "bf16"), b.dev(y32)
                    wds = [b.dev(w, "bf16") for w in ws]
                    grid = (M // BM, N // BN)
                    fns = [lambda wd=wd: _gemm_bf16[grid](xd, wd, yd, M, N, K, BM=BM, BN=BN, BK=BK, num_warps=4)
                           for wd in wds]
                    t, note = b.time(fns)
                    fns[0]()
                    b.sync()
                    b.row("gemm", case, "jitkern jk.dot tiles 64x64x32 (bench_cuda)", t, note, flops, nb, t_cublas,
                          _rel_err(y32[:m], ref))
                except Exception as e:  # noqa: BLE001
                    b.fail("gemm", case, "jitkern jk.dot tiles", e)
        del ws
        if b.is_cuda:
            torch.cuda.empty_cache()


def gemv(b: Bench, copy_gbs: float, NKs, Ms=(1,)):
    torch = b.torch
    _header(f"decode GEMV (GB/s of weights + activations; ratio: of the {copy_gbs:.0f} GB/s copy bandwidth)")
    for N, K in NKs:
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / (2 * N * K))))
        ws = _weights(b, N, K, copies)
        for M in Ms:
            case = f"M={M} N={N} K={K}"
            x = torch.randn(M, K, device=b.device).to(torch.bfloat16)
            x32 = x.float()
            ref = x32 @ ws[0].float().T
            y = torch.empty(M, N, dtype=torch.bfloat16, device=b.device)
            y32 = torch.empty(M, N, dtype=torch.float32, device=b.device)
            try:
                t, note = b.time([lambda w=w: torch.matmul(x, w.T, out=y) for w in ws])
                nb = 2 * (N * K + M * K + M * N)
                torch.matmul(x, ws[0].T, out=y)
                b.row("gemv", case, "cuBLAS torch.matmul", t, note, nbytes=nb, peer=nb / copy_gbs / 1e9,
                      err=_rel_err(y, ref))
            except Exception as e:      # noqa: BLE001
                b.fail("gemv", case, "cuBLAS torch.matmul", e)
            try:
                fns, name = _linear_variant(b, x32, ws, y32)
                t, note = b.time(fns)
                nb = 2 * N * K + 4 * (M * K + M * N)
                fns[0]()
                b.sync()
                b.row("gemv", case, name, t, note, nbytes=nb, peer=nb / copy_gbs / 1e9, err=_rel_err(y32, ref))
            except Exception as e:      # noqa: BLE001
                b.fail("gemv", case, "jitkern linear", e)
        del ws


QGEMV_NK = ((576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096), (14336, 4096), (4096, 14336))


# byte offsets of each type's f16 scales (and mins) in a block (ggml-common.h)
_F16_SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,),
               "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,), "q2_K": (80, 82), "q3_K": (108,), "iq4_xs": (0,),
               "mxfp4": ()}


def _qweight(qtype: str, N: int, K: int, rng) -> np.ndarray:
    """Random GGUF blocks of `qtype` (N, row bytes) with finite f16 scales and mins (mxfp4: exponents near 2^0)."""
    from engine.ops import quant as Q
    q = Q.QTYPES[qtype]
    nb = K // q.block_elems
    raw = rng.integers(0, 256, (N, nb, q.block_bytes), dtype=np.uint8)
    for off in _F16_SCALES[qtype]:
        raw[:, :, off:off + 2] = rng.uniform(-0.02, 0.02, (N, nb)).astype(np.float16).view(np.uint8).reshape(
            N, nb, 2)
    if qtype == "mxfp4":
        raw[:, :, 0] = rng.integers(118, 128, (N, nb))
    return raw.reshape(N, -1)


def qgemv(b: Bench, copy_gbs: float, NKs, Ms, qtypes):
    from engine.ops import quant as Q
    _header(f"GGUF linears (GB/s of blocks + int8 activations; ratio: of the {copy_gbs:.0f} GB/s copy bandwidth)")
    rng = np.random.default_rng(0)
    dev = b.jdev
    base = dev.target()
    own = dev.__dict__.get("target")             # a stand-in device may carry its target on the instance
    cuda = b.cuda_mod
    for qtype in qtypes:
        for N, K in NKs:
            if K % Q.QTYPES[qtype].block_elems:
                continue                                  # (the 256-element super-block types need K % 256 == 0)
            rb = Q.row_bytes(qtype, K)
            copies = max(1, min(8, math.ceil(ROTATE_BYTES / (N * rb))))
            one = _qweight(qtype, N, K, rng)
            ws = [cuda.DeviceArray.from_numpy(one, device=dev) for _ in range(copies)]
            for M in Ms:
                case = f"{qtype} M={M} N={N} K={K}"
                x = cuda.DeviceArray.from_numpy(rng.standard_normal((M, K)).astype(np.float32), device=dev)
                for name, tgt in (("gpu" if Q._gpu_qmv(Q.QTYPES[qtype], base) else "qmm", base),):
                    dev.target = lambda t=tgt: t          # the ops read their choices from the device's target
                    try:
                        lay = Q.act_layout(qtype, M, tgt)
                        rep4 = not Q._gpu_qmv(Q.QTYPES[qtype], tgt)
                        xq = Q.quantize_q8(x, layout=lay, rep4=rep4)
                        y = cuda.DeviceArray.empty((M, N), np.float32, dev)
                        fns = [lambda w=w: Q.matmul_q8(xq, w, qtype, N, K, out=y) for w in ws]
                        t, note = b.time(fns)
                        nb = N * rb + M * K + 8 * M * K // 32 + 4 * M * N
                        b.row("qgemv", case, f"[{name}] matmul_q8", t, note, nbytes=nb, peer=nb / copy_gbs / 1e9)
                    except Exception as e:      # noqa: BLE001
                        b.fail("qgemv", case, f"[{name}] matmul_q8", e)
                    finally:
                        if own is None:
                            del dev.target
                        else:
                            dev.target = own
            del ws


def _paged_cache(b, B, S, dtype, block=16):
    """A paged cache holding B sequences of S random tokens each (sequence i in blocks i*nb .. i*nb+nb-1)."""
    torch = b.torch
    nb = -(-S // block)
    kc = (torch.randn(B * nb, block, KV_HEADS, HEAD_DIM, device=b.device) * 0.5).to(dtype)
    vc = torch.randn(B * nb, block, KV_HEADS, HEAD_DIM, device=b.device).to(dtype)
    bt = torch.arange(B * nb, dtype=torch.int32, device=b.device).reshape(B, nb)
    return kc, vc, bt, nb


def _reblock(c, B, S, nb, block):
    """The same tokens as the paged cache c (B sequences of S tokens, nb blocks each) in blocks of `block`
    tokens (sequence i in blocks i*nb2 .. i*nb2+nb2-1), with its block table and nb2."""
    torch = __import__("torch")
    old = c.shape[1]
    if block == old:
        return c, None, nb
    nb2 = -(-S // block)
    dense = c.reshape(B, nb * old, *c.shape[2:])[:, :S]
    out = torch.zeros(B, nb2 * block, *c.shape[2:], dtype=c.dtype, device=c.device)
    out[:, :S] = dense
    bt = torch.arange(B * nb2, dtype=torch.int32, device=c.device).reshape(B, nb2)
    return out.reshape(B * nb2, block, *c.shape[2:]), bt, nb2


def _variant_cache(kc, vc, bt, B, S, nb, variant):
    """(k, v, block table) for `variant`: the given cache, or the same tokens re-blocked (ATTN_VARIANTS BLOCK)."""
    block = ATTN_VARIANTS[variant].get("BLOCK", kc.shape[1])
    if block == kc.shape[1]:
        return kc, vc, bt
    k2, bt2, _ = _reblock(kc, B, S, nb, block)
    v2, _, _ = _reblock(vc, B, S, nb, block)
    return k2, v2, bt2


def _dense_kv(kc, vc, B, S, nb):
    """[B, KV_HEADS, S, D] views of the paged caches (for the torch reference / peer)."""
    k = kc.reshape(B, nb * kc.shape[1], KV_HEADS, HEAD_DIM)[:, :S].transpose(1, 2)
    v = vc.reshape(B, nb * vc.shape[1], KV_HEADS, HEAD_DIM)[:, :S].transpose(1, 2)
    return k, v


def _step_arrays(b, qlens, seqlens):
    torch = b.torch
    qs = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    sl = np.asarray(seqlens, np.int32)
    return (b.dev(torch.from_numpy(qs).to(b.device)), b.dev(torch.from_numpy(sl).to(b.device)), qs, sl)


class _attn_variant:
    """Selects a GPU attention path of engine.ops.attention for the calls inside (restored after): "flash"
    (the flash kernels at their defaults), "flash-*" (one setting changed: prefill rows, no pipelining,
    8-block partitions, 8 warps) or "token" (token_attention_kernel). On --device cpu all run the CPU
    kernels (the fake device's target is the CPU tier): the rows check the script only."""

    def __init__(self, ja, variant):
        from targets import Tuning
        names = set(Tuning.__dataclass_fields__)
        settings = {k: v for k, v in ATTN_VARIANTS[variant].items() if k != "BLOCK"}
        # lower-case keys are entries of the device target's tuning table (targets/tuning.py), the rest module
        # settings of engine.ops.attention
        self.tuning = {k: v for k, v in settings.items() if k in names}
        self.ja, self.flags = ja, {k: v for k, v in settings.items() if k not in names}

    def __enter__(self):
        self.old = {k: getattr(self.ja, k) for k in self.flags}
        for k, v in self.flags.items():
            setattr(self.ja, k, v)
        self.dev = None
        if self.tuning:
            from jitkern.runtime import cuda
            from targets import tuned
            self.dev = cuda.get_device()
            t = tuned(self.dev.target(), **self.tuning)
            self.dev.target = lambda: t          # (an instance attribute over the method, removed on exit)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.ja, k, v)
        if self.dev is not None:
            del self.dev.target
        return False


def attention(b: Bench, prefill_cases, decode_cases, copy_gbs, variants=ATTN_VARIANTS):
    torch = b.torch
    import torch.nn.functional as F
    from engine.ops import attention as ja
    scale = HEAD_DIM ** -0.5
    _header("prefill attention, causal, 32 q / 8 KV heads, D=128 (ratio: SDPA time / variant time)")
    for B, S in prefill_cases:
        case = f"B={B} S={S}"
        flops = 4 * B * HEADS * HEAD_DIM * S * (S + 1) // 2
        kc, vc, bt, nb = _paged_cache(b, B, S, torch.float32)
        q = torch.randn(B * S, HEADS, HEAD_DIM, device=b.device)
        k, v = _dense_kv(kc, vc, B, S, nb)
        qb = q.reshape(B, S, HEADS, HEAD_DIM).transpose(1, 2)
        rep = HEADS // KV_HEADS
        kb = k.repeat_interleave(rep, dim=1).to(torch.bfloat16).contiguous()
        vb = v.repeat_interleave(rep, dim=1).to(torch.bfloat16).contiguous()
        qbb = qb.to(torch.bfloat16).contiguous()
        t_sdpa = None
        try:
            from contextlib import nullcontext
            from torch.nn.attention import SDPBackend, sdpa_kernel
            ctx = (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])) if b.is_cuda else nullcontext
            with ctx():
                t_sdpa, note = b.time(lambda: F.scaled_dot_product_attention(qbb, kb, vb, is_causal=True))
                ref = F.scaled_dot_product_attention(qbb, kb, vb, is_causal=True).float()
            b.row("attn", case, f"torch SDPA {'flash ' if b.is_cuda else ''}(bf16)", t_sdpa, note, flops)
        except Exception as e:          # noqa: BLE001
            b.fail("attn", case, "torch SDPA flash", e)
            ref = None
        for cdt, cname in ((torch.float32, "f32"), (torch.float16, "f16")):
            kcd, vcd = (kc, vc) if cdt == torch.float32 else (kc.to(cdt), vc.to(cdt))
            for variant in variants:
                name = f"jitkern paged prefill [{variant}] ({cname} cache)"
                try:
                    qs, sl, qs_h, sl_h = _step_arrays(b, [S] * B, [S] * B)
                    out = torch.empty_like(q)
                    kv, vv, btv = _variant_cache(kcd, vcd, bt, B, S, nb, variant)
                    qd, od, kd, vd, btd = b.dev(q), b.dev(out), b.dev(kv), b.dev(vv), b.dev(btv)
                    ws = {}

                    def ours():
                        with _attn_variant(ja, variant):
                            ja.paged_prefill_attention(qd, kd, vd, qs, sl, btd, scale=scale, out=od, workspace=ws,
                                                       validate=False, host_step=(qs_h, sl_h))
                    t, note = b.time(ours)
                    ours()
                    b.sync()
                    err = None
                    if ref is not None:
                        err = _rel_err(out.reshape(B, S, HEADS, HEAD_DIM).transpose(1, 2), ref)
                    b.row("attn", case, name, t, note, flops, peer=t_sdpa, err=err)
                except Exception as e:          # noqa: BLE001
                    b.fail("attn", case, name, e)
            del kcd, vcd

    _header(f"decode attention, one query per sequence (GB/s of KV read; ratio: of the {copy_gbs:.0f} GB/s copy)")
    for B, L in decode_cases:
        for cdt, name in ((torch.float32, "f32"), (torch.float16, "f16")):
            case = f"B={B} ctx={L} {name} cache"
            kc, vc, bt, nb = _paged_cache(b, B, L, cdt)
            nbytes = 2 * B * L * KV_HEADS * HEAD_DIM * kc.element_size()
            q = torch.randn(B, HEADS, HEAD_DIM, device=b.device)
            k, v = _dense_kv(kc, vc, B, L, nb)
            ref = F.scaled_dot_product_attention(q[:, :, None].float(), k.float().repeat_interleave(4, 1),
                                                 v.float().repeat_interleave(4, 1))[:, :, 0] if B * L <= 65536 else None
            if cdt == torch.float32:
                try:
                    qb = q[:, :, None].to(torch.bfloat16)
                    kb, vb = k.to(torch.bfloat16).contiguous(), v.to(torch.bfloat16).contiguous()
                    t, note = b.time(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True))
                    nbb = 2 * B * L * KV_HEADS * HEAD_DIM * 2
                    b.row("attn", f"B={B} ctx={L} bf16 dense", "torch SDPA enable_gqa (bf16, auto backend)", t,
                          note, nbytes=nbb, peer=nbb / copy_gbs / 1e9)
                    del kb, vb
                except Exception as e:  # noqa: BLE001
                    b.fail("attn", f"B={B} ctx={L} bf16 dense", "torch SDPA enable_gqa", e)
            for variant in variants:
                name = f"jitkern paged decode [{variant}] (engine's call)"
                try:
                    qs, sl, qs_h, sl_h = _step_arrays(b, [1] * B, [L] * B)
                    out = torch.empty_like(q)
                    kv, vv, btv = _variant_cache(kc, vc, bt, B, L, nb, variant)
                    qd, od, kd, vd, btd = b.dev(q), b.dev(out), b.dev(kv), b.dev(vv), b.dev(btv)
                    ws = {}

                    def ours():
                        with _attn_variant(ja, variant):
                            ja.paged_attention(qd, kd, vd, qs, sl, btd, scale=scale, out=od, workspace=ws,
                                               max_query_len=1, num_partitions=ja.MAX_PARTITIONS, validate=False,
                                               host_step=(qs_h, sl_h))
                    t, note = b.time(ours)
                    ours()
                    b.sync()
                    b.row("attn", case, name, t, note, nbytes=nbytes,
                          peer=nbytes / copy_gbs / 1e9, err=None if ref is None else _rel_err(out, ref))
                except Exception as e:      # noqa: BLE001
                    b.fail("attn", case, name, e)
            del kc, vc, q, k, v


def elementwise(b: Bench, copy_gbs, T, H, inter):
    torch = b.torch
    from engine.ops.activation import silu_and_mul
    from engine.ops.norm import rms_norm
    _header(f"elementwise (GB/s read + written; ratio: of the {copy_gbs:.0f} GB/s copy bandwidth)")
    x = torch.randn(T, H, device=b.device)
    w = torch.rand(H, device=b.device) + 0.5
    out = torch.empty_like(x)
    try:
        xd, wd, od = b.dev(x), b.dev(w), b.dev(out)
        t, note = b.time(lambda: rms_norm(xd, wd, 1e-5, out=od))
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        nb = 2 * x.numel() * 4
        b.row("elem", f"rms_norm [{T}, {H}] f32", "jitkern rms_norm", t, note, nbytes=nb, peer=nb / copy_gbs / 1e9,
              err=_rel_err(out, ref))
    except Exception as e:              # noqa: BLE001
        b.fail("elem", f"rms_norm [{T}, {H}]", "jitkern rms_norm", e)
    gu = torch.randn(T, 2 * inter, device=b.device)
    o2 = torch.empty(T, inter, device=b.device)
    try:
        gud, o2d = b.dev(gu), b.dev(o2)
        t, note = b.time(lambda: silu_and_mul(gud, out=o2d))
        ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        nb = (gu.numel() + o2.numel()) * 4
        b.row("elem", f"silu_and_mul [{T}, {2 * inter}] f32", "jitkern silu_and_mul", t, note, nbytes=nb,
              peer=nb / copy_gbs / 1e9, err=_rel_err(o2, ref))
    except Exception as e:              # noqa: BLE001
        b.fail("elem", f"silu_and_mul [{T}, {2 * inter}]", "jitkern silu_and_mul", e)


def _triton(b: Bench):
    if not b.is_cuda:
        print("Triton matmul: skipped (needs a CUDA device)")
        return None
    try:
        import triton  # noqa: F401

        from perf.peers import triton_matmul
        return triton_matmul
    except ImportError as e:
        print(f"Triton matmul: skipped ({e})")
        return None


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=("gemm", "attn", "gemv", "elem", "qgemv"),
                    default=["gemm", "attn", "gemv", "elem", "qgemv"])
    ap.add_argument("--qtypes", nargs="+", default=["q4_1", "q8_0", "q4_0"], help="qgemv: GGUF types")
    ap.add_argument("--qgemv-m", type=int, nargs="+", default=[1, 16, 64], help="qgemv: token counts")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (seconds)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=20, help="timed batches per variant (median)")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed calls per variant")
    ap.add_argument("--m", type=int, nargs="+", default=None, help="GEMM M values (default 1 16 64 256 2048 8192)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode-cases", nargs="+", default=None, metavar="BxCTX",
                    help="attn: decode cases as sequences x context, e.g. 1x136 64x136 (default: %s)"
                    % " ".join(f"{b}x{c}" for b, c in DECODE_CASES))
    ap.add_argument("--prefill-cases", nargs="*", default=None, metavar="BxS",
                    help="attn: prefill cases as sequences x tokens (none: skip prefill; default: %s)"
                    % " ".join(f"{b}x{c}" for b, c in PREFILL_CASES))
    ap.add_argument("--attn-variants", nargs="+", choices=list(ATTN_VARIANTS), default=["flash", "token"],
                    help="GPU attention paths to time in the attn section (default: flash token)")
    a = ap.parse_args(argv)
    mp = None
    if a.device == "cpu":
        import pytest
        import torch

        from tests import fake_cuda
        mp = pytest.MonkeyPatch()
        fake_cuda.install(mp)
        n_threads = torch.get_num_threads()
        torch.set_num_threads(1)        # tiny CPU shapes: torch's threads only contend with the kernels'
    try:
        return _run(a)
    finally:
        if mp is not None:
            import torch
            torch.set_num_threads(n_threads)
            mp.undo()


def _run(a) -> int:
    import torch
    b = Bench(a.device, a.reps, a.budget)
    if b.is_cuda:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, jitkern target "
              f"{b.jdev.target_name}")
    if a.smoke:
        Ms, NKs = a.m or (1, 16, 64), ((128, 64), (96, 160))
        pre, dec = ((1, 64), (2, 48)), ((1, 40), (3, 64))
        copy_mib, elem = 4, (64, 256, 384)
        qnk = ((96, 64), (40, 576), (24, 768))      # (768: a shape for the 256-element super-block types)
    else:
        Ms, NKs = a.m or GEMM_M, GEMM_NK
        pre, dec = PREFILL_CASES, DECODE_CASES
        copy_mib, elem = 1024, (8192, 4096, 14336)
        qnk = QGEMV_NK
    if a.decode_cases is not None:
        dec = tuple(tuple(int(v) for v in c.split("x")) for c in a.decode_cases)
    if a.prefill_cases is not None:
        pre = tuple(tuple(int(v) for v in c.split("x")) for c in a.prefill_cases)
    t0 = time.perf_counter()
    with torch.no_grad():
        copy_gbs = copy_bandwidth(b, copy_mib)
        if "gemm" in a.only:
            gemm(b, Ms, NKs)
        if "gemv" in a.only:
            gemv(b, copy_gbs, NKs)
        if "attn" in a.only:
            attention(b, pre, dec, copy_gbs, a.attn_variants)
        if "elem" in a.only:
            elementwise(b, copy_gbs, *elem)
        if "qgemv" in a.only:
            qgemv(b, copy_gbs, qnk, a.qgemv_m, a.qtypes)
    b.sync()
    failed = [r for r in b.rows if "error" in r]
    print(f"\n{len(b.rows)} rows, {len(failed)} failed, {time.perf_counter() - t0:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": b.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
