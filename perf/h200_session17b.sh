#!/bin/sh
# Session 17's last device call (~7 minutes): the GEMM tile question (perf/h200_gemm_tiles.sh), then the flash
# file's GPU bits with the pinned scores loop unrolled (gpu.PINNED_MMA_UNROLL).
# Run from the repo root after the device README's setup: sh perf/h200_session17b.sh
set -u
timeout 270 sh perf/h200_gemm_tiles.sh
echo "== flash bits"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py 2>&1 | tail -3
