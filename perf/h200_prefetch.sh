#!/bin/sh
# One H200 device call (~7 minutes): the tensor-core linear's K loop loading two steps ahead into three cp.async
# buffers (JITKERN_LINEAR_PREFETCH=2; off by default until this has run):
#   1. bits: PREFETCH 2 against 1 on the engine's tiles (slab path, serial split, unsplit), float64 oracle;
#   2. timing beside cuBLAS at M = 256-2048, PREFETCH 1 and 2 in separate processes;
#   3. the 8-layer Llama-3-8B-shape 1,024-token prefill's kernels (CUPTI) with each.
# Run from the repo root after the device README's setup: sh perf/h200_prefetch.sh
set -u
out=$(timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k "prefetch or huge" 2>&1)
echo "$out" | tail -4
case "$out" in *failed*|*error*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for pf in 1 2; do
    echo "== JITKERN_LINEAR_PREFETCH=$pf"
    JITKERN_LINEAR_PREFETCH=$pf timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 256,1024,2048 --launches 10 \
        --all-shapes --configs wg,128,128,64,8,0 wgs,128,128,64,8,0 wg,64,128,64,8,0 2>&1 | grep -v "^device"
done
for pf in 1 2; do
    echo "== profile, JITKERN_LINEAR_PREFETCH=$pf"
    JITKERN_LINEAR_PREFETCH=$pf timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 \
        --prompt-len 1024 2>&1 | grep -A4 "prefill"
done
