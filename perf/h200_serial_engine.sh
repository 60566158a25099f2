#!/bin/sh
# One H200 device call (~6 minutes): the serial split (JITKERN_SERIAL_SPLIT_M, JITKERN_SERIAL_MAXNREG) in the
# engine: an 8-layer Llama-3-8B-shape 1,024-token prefill's kernels under CUPTI (perf/profile_engine_cuda.py
# --cupti), slab programs + folded sums vs serial at 128 registers vs serial uncapped; the linear bit tests first.
# Run from the repo root after the device README's setup: sh perf/h200_serial_engine.sh
set -u
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py \
    -k "serial or huge or big_tile" 2>&1 | tail -3
for v in "JITKERN_SERIAL_SPLIT_M=1000000" "JITKERN_SERIAL_SPLIT_M=1024" "JITKERN_SERIAL_SPLIT_M=1024 JITKERN_SERIAL_MAXNREG=0" "JITKERN_SERIAL_SPLIT_M=512"; do
    echo "== $v"; case "$v" in *1000000*) t=150 ;; *) t=100 ;; esac
    env $v timeout $t python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 --prompt-len 1024 \
        2>&1 | grep -A8 "prefill"
done
