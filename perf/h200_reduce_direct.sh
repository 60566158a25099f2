#!/bin/sh
# One H200 device call (~8 minutes): short reductions folded straight from the staged row (JITKERN_REDUCE_DIRECT,
# default on), rms_norm without the f32 residual's read-back, and 2-warp flash decode at every size
# (JITKERN_FLASH_DECODE_WIDE=0).
#   1. bits at the new defaults: the flash file (decode = prefill row), the engine's GPU tests, the norms;
#   2. bits with JITKERN_FLASH_DECODE_WIDE=0 (2 warps: the same bits, checked by the flash file and the engine);
#   3. CUPTI per-kernel sums of the 8-layer Llama-3-8B-shape decode step (c=1, c=64) and a 1,024-token prefill:
#      defaults, JITKERN_REDUCE_DIRECT=0 (the two-pass form, as before), JITKERN_FLASH_DECODE_WIDE=0.
# Run from the repo root after the device README's setup: sh perf/h200_reduce_direct.sh
set -u
echo "== bits: defaults"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm.py tests/test_device_arrays.py \
    tests/test_decode_fusion.py -k "norm or rms or reduce or softmax or sum" 2>&1 | tail -3
echo "== bits: JITKERN_FLASH_DECODE_WIDE=0"
JITKERN_FLASH_DECODE_WIDE=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/ops/test_attention_flash.py tests/test_engine_cuda.py -k "not smollm and (flash or decode or invariant)" 2>&1 | tail -3
for s in "" "JITKERN_REDUCE_DIRECT=0" "JITKERN_FLASH_DECODE_WIDE=0"; do
    echo "== profile: ${s:-defaults}"
    env $s timeout 90 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
        2>&1 | grep -A9 "^=== \|wall min" | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
done
