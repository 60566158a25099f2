#!/bin/sh
# One H200 device call (~7 minutes): the flash kernels' softmax exponentials as ex2.approx (JITKERN_FAST_EXP=1,
# jk.exp_fast) with and without warp-owned rows (JITKERN_FLASH_WARP_ROWS=1, now 64 rows / 8 warps). Bits first
# (the whole flash file: decode = prefill row, reference tolerances; exp_fast's accuracy), then prefill / decode
# attention against SDPA in the same process per setting, then the engine's GPU tests and CUPTI sums with both on.
# Run from the repo root after the device README's setup: sh perf/h200_fast_exp.sh
set -u
echo "== bits, JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1"
JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/ops/test_attention_flash.py tests/test_dsl.py -k "flash or exp or step_blocks" > /tmp/fe_bits.txt 2>&1
rc=$?
tail -30 /tmp/fe_bits.txt
[ $rc -eq 0 ] || exit 1
for fe in 0 1; do
    echo "== attention, JITKERN_FAST_EXP=$fe"
    JITKERN_FAST_EXP=$fe timeout 100 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
        --decode-cases 1x256 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit \
        flash-16bit-warprows flash-16bit-warprows-rows32-w4 flash-16bit-warprows-sb2 flash-16bit-warprows-sb4 2>&1 | grep "SDPA\|f16 cache\|FAILED"
done
echo "== engine bits, JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1"
JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
sh perf/h200_profile.sh JITKERN_FAST_EXP=1 JITKERN_FLASH_WARP_ROWS=1
