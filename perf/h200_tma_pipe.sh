#!/bin/sh
# One H200 device call (~6 minutes): TMA-fed K loops with their warpgroup MMAs kept in flight into the next step
# (JITKERN_TMA_PIPE=1: commit, wait_group 1, one CTA barrier, then the step's copies; off by default until this
# has run):
#   1. bits: TMA / TMA + prefetch 2 / each with the pipe against cp.async (tests/test_device_arrays.py -k linear_tma);
#   2. if those pass: timing beside cuBLAS at M = 256-2048 with the pipe off / on, prefetch 1 and 2;
#   3. the serial split's register cap (128: spills 152 bytes with TMA; 0: uncapped, 143 registers) at M = 1024-2048;
#   4. the 8-layer Llama-3-8B-shape 1,024-token prefill's kernels (CUPTI) with the pipe on, prefetch 1 and 2.
# Run from the repo root after the device README's setup: sh perf/h200_tma_pipe.sh
set -u
out=$(timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k "linear_tma" 2>&1)
echo "$out" | tail -15
case "$out" in *failed*|*rror*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for pipe in 0 1; do
    for pf in 1 2; do
        echo "== JITKERN_TMA_PIPE=$pipe JITKERN_LINEAR_PREFETCH=$pf"
        JITKERN_TMA_PIPE=$pipe JITKERN_LINEAR_PREFETCH=$pf timeout 100 python3 perf/tune_gemv_cuda.py --x16 \
            --m 256,1024 --launches 10 --all-shapes --configs wg,128,128,64,8,0 wgs,128,128,64,8,0 2>&1 | grep -v "^device"
    done
done
for cap in 128 0; do
    # with TMA the serial split's huge tile needs 143 registers: at the 128 cap ptxas spills 152 bytes (two CTAs an
    # SM), uncapped one CTA an SM fits
    echo "== JITKERN_SERIAL_MAXNREG=$cap (serial split, TMA)"
    JITKERN_SERIAL_MAXNREG=$cap timeout 100 python3 perf/tune_gemv_cuda.py --x16 --m 1024,2048 --launches 10 \
        --all-shapes --configs wgs,128,128,64,8,0 2>&1 | grep -v "^device"
done
for pf in 1 2; do
    echo "== profile, JITKERN_TMA_PIPE=1 JITKERN_LINEAR_PREFETCH=$pf"
    JITKERN_TMA_PIPE=1 JITKERN_LINEAR_PREFETCH=$pf timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 \
        --concurrency 1 --prompt-len 1024 2>&1 | grep -A4 "prefill"
done
