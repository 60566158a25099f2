#!/bin/sh
# One H200 device call (~6 minutes): the flash kernels' softmax exponentials as ex2.approx (JITKERN_FAST_EXP=1,
# jk.exp_fast) with warp-owned rows (JITKERN_FLASH_WARP_ROWS=1, 64 rows / 8 warps) and 1 / 2 / 4-block steps.
# Bits first (the flash file's batch-invariance, warp-rows, step-blocks and fold tests: decode = prefill row,
# reference tolerances; exp_fast's accuracy), then attention against SDPA (fast exp off, then on), then the
# engine's GPU tests and CUPTI sums with both on.
# Run from the repo root after the device README's setup: sh perf/h200_fast_exp.sh
set -u
echo "== bits, JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1"
JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/ops/test_attention_flash.py tests/test_dsl.py \
    -k "warp_rows or batch_invariance or step_blocks or fold_skip or exp_fast or partition_axis" > /tmp/fe_bits.txt 2>&1
rc=$?
tail -30 /tmp/fe_bits.txt
[ $rc -eq 0 ] || exit 1
echo "== attention, JITKERN_FAST_EXP=0"
JITKERN_FAST_EXP=0 timeout 70 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-warprows 2>&1 \
    | grep "SDPA\|f16 cache\|FAILED"
echo "== attention, JITKERN_FAST_EXP=1"
JITKERN_FAST_EXP=1 timeout 110 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-warprows \
    flash-16bit-warprows-sb2 flash-16bit-warprows-sb4 2>&1 | grep "SDPA\|f16 cache\|FAILED"
echo "== engine bits, JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1"
JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
sh perf/h200_profile.sh JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1
