#!/bin/sh
# One H200 device call (~9 minutes): short reductions folded straight from the staged row (JITKERN_REDUCE_DIRECT=1,
# off by default until this runs), rms_norm without the f32 residual's read-back, 2-warp flash decode at every size
# (JITKERN_FLASH_DECODE_WIDE=0) and the prefill grid longest tiles first (JITKERN_FLASH_LONGEST_FIRST).
#   1. CUPTI per-kernel sums of the 8-layer Llama-3-8B-shape decode step (c=1, c=64) and a 1,024-token prefill:
#      defaults, JITKERN_REDUCE_DIRECT=1, + JITKERN_FLASH_LONGEST_FIRST=1, JITKERN_FLASH_DECODE_WIDE=0;
#   2. bits with both switches on: the flash file (decode = prefill row, warps), the engine's GPU tests, the norms.
# Run from the repo root after the device README's setup: sh perf/h200_reduce_direct.sh
set -u
for s in "" "JITKERN_REDUCE_DIRECT=1" "JITKERN_REDUCE_DIRECT=1 JITKERN_FLASH_LONGEST_FIRST=1" "JITKERN_FLASH_DECODE_WIDE=0"; do
    echo "== profile: ${s:-defaults}"
    env $s timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
        2>&1 | grep -A9 "^=== \|wall min" | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
done
echo "== bits: JITKERN_REDUCE_DIRECT=1 JITKERN_FLASH_LONGEST_FIRST=1"
export JITKERN_REDUCE_DIRECT=1 JITKERN_FLASH_LONGEST_FIRST=1
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm.py tests/test_device_arrays.py \
    tests/test_decode_fusion.py -k "norm or rms or reduce or softmax or sum" 2>&1 | tail -3
