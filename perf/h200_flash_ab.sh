#!/bin/sh
# One H200 device call (~5 minutes): flash attention variants against torch SDPA in the same run, then Nsight
# Compute's stall reasons (perf/h200_ncu_flash.sh).
#   flash-16bit (the engine's defaults), flash-16bit-rows32-w4 (32-row prefill tiles at 4 warps: two CTAs an SM),
#   flash-16bit-shortest-first (JITKERN_FLASH_LONGEST_FIRST=0: the grid before session 14),
#   flash-16bit-dw4 (decode at 4 warps however wide the launch).
# Run from the repo root after the device README's setup: sh perf/h200_flash_ab.sh
set -u
timeout 240 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 --decode-cases 1x256 64x256 64x1024 \
    --prefill-cases 1x1024 8x1024 1x4096 --attn-variants flash-16bit flash-16bit-rows32-w4 flash-16bit-shortest-first \
    flash-16bit-dw4 2>&1 | tail -40
sh perf/h200_ncu_flash.sh
