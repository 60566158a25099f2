#!/bin/sh
# One H200 device call (~4 minutes): TMA-fed prefetch-2 chains (JITKERN_LINEAR_PREFETCH=2 with TMA on: three
# buffers and mbarriers a chain, the tiles copied two K steps ahead; off by default until this has run):
#   1. bits: TMA and TMA + prefetch 2 against cp.async, the prefetch tests;
#   2. if those pass: timing beside cuBLAS at M = 256-2048, PREFETCH 1 / 2 in separate processes (and the
#      (128, 256) tile with PREFETCH 1);
#   3. the 8-layer Llama-3-8B-shape 1,024-token prefill's kernels (CUPTI) with PREFETCH 2.
# Run from the repo root after the device README's setup: sh perf/h200_tma_prefetch.sh
set -u
out=$(timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k "linear_tma or prefetch" 2>&1)
echo "$out" | tail -15
case "$out" in *failed*|*rror*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for pf in 1 2; do
    echo "== JITKERN_LINEAR_PREFETCH=$pf (TMA on)"
    extra=""
    [ "$pf" = 1 ] && extra="wg,128,256,64,8,0"
    JITKERN_LINEAR_PREFETCH=$pf timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 256,1024,2048 --launches 10 \
        --all-shapes --configs wg,128,128,64,8,0 wgs,128,128,64,8,0 $extra 2>&1 | grep -v "^device"
done
echo "== profile, JITKERN_LINEAR_PREFETCH=2"
JITKERN_LINEAR_PREFETCH=2 timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 \
    --prompt-len 1024 2>&1 | grep -A4 "prefill"
