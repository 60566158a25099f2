#!/bin/sh
# One H200 device call (~5 minutes) at session 14's flash defaults (decode without the next block's loads in flight,
# 32-row prefill tiles at 4 warps, the direct short-row fold, the longest-first prefill grid):
#   1. bits: the flash file and the engine's GPU tests (decode = prefill row, tokens against the CPU engine);
#   2. CUPTI per-kernel sums of the 8-layer Llama-3-8B-shape decode step (c=1, c=64) and a 1,024-token prefill;
#   3. flash variants against SDPA in the same run (16-row prefill tiles at 4 warps, capped at 168 registers or not;
#      wide decodes at one warp; the pre-session-14 settings).
# Run from the repo root after the device README's setup: sh perf/h200_session14.sh
set -u
echo "== bits"
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
echo "== profile"
timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
    2>&1 | grep -A9 "^=== \|wall min" | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
echo "== prefill variants"
timeout 150 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 --decode-cases 16x1024 64x1024 \
    64x4096 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-rows16-w4 flash-16bit-rows16-w4-m168 \
    flash-16bit-m168 flash-16bit-rows64-w8 flash-16bit-dw1 flash-16bit-dpipe 2>&1 | grep "SDPA\|f16 cache"
