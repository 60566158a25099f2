#!/bin/sh
# One H200 device call (~6 minutes): warpgroup MMAs fed by cp.async (JITKERN_WGMMA=1 with the linear's tiles of
# 64+ tokens launched with num_stages=2): the wgmma bit tests first (float64 oracle, rows equal across tiles and
# batches), then timing beside the mma.sync big tile and cuBLAS, 128-byte swizzled staging.
# Run from the repo root after the device README's setup: sh perf/h200_wgmma_async.sh
set -u
echo "== bits"
out=$(JITKERN_WGMMA_SWIZZLE=128 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k wgmma 2>&1)
echo "$out" | tail -5
case "$out" in *failed*|*error*) echo "== wgmma timing skipped (not right yet)"; exit 0 ;; esac
JITKERN_WGMMA_SWIZZLE=128 timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 64,256,1024 --launches 10 \
    --configs mma,64,256,64,8,0 wg,64,256,64,8,0 wg,64,128,64,8,0 wg,128,256,64,8,0 2>&1 | grep -v "^device"
