#!/bin/sh
# One H200 device call (~6 minutes): the tensor-core linear's wgmma tiles fed by the tensor memory accelerator
# (JITKERN_TMA=1: tensor maps, mbarriers, one bulk copy per tile a K step; off by default until this has run):
#   1. bits: TMA against cp.async on the engine's tiles (slab path, serial split, unsplit, 64-row tile, a partial
#      last tile), float64 oracle; the other wgmma / linear tests with TMA on;
#   2. if those pass: timing beside cuBLAS at M = 256-2048, TMA off / on in separate processes;
#   3. the 8-layer Llama-3-8B-shape 1,024-token prefill's kernels (CUPTI) off / on;
#   4. the engine's GPU tests with TMA on.
# Run from the repo root after the device README's setup: sh perf/h200_tma.sh
set -u
out=$(timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k "linear_tma" 2>&1)
echo "$out" | tail -15
out2=$(JITKERN_TMA=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py \
    -k "wgmma or huge or serial or big_tile or split_k or 16bit" 2>&1)
echo "$out2" | tail -6
case "$out$out2" in *failed*|*rror*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for v in 0 1; do
    echo "== JITKERN_TMA=$v"
    JITKERN_TMA=$v timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 256,1024,2048 --launches 10 \
        --all-shapes --configs wg,128,128,64,8,0 wgs,128,128,64,8,0 wg,64,256,64,8,0 2>&1 | grep -v "^device"
done
for v in 0 1; do
    echo "== profile, JITKERN_TMA=$v"
    JITKERN_TMA=$v timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 \
        --prompt-len 1024 2>&1 | grep -A4 "prefill"
done
echo "== engine GPU tests, JITKERN_TMA=1"
JITKERN_TMA=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_cuda.py -k "not smollm" \
    2>&1 | tail -4
