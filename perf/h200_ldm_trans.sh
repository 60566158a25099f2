#!/bin/sh
# One H200 device call (~7 minutes): V tiles by ldmatrix .trans (JITKERN_LDMATRIX_TRANS, default 1: the flash
# kernels' P @ V operand staged with vector stores instead of 16-way conflicted 16-bit stores). Bits first (the
# flash file, the DSL's dots, the engine's GPU tests), then attention against SDPA with it off / on and with the
# MMA K loops unrolled (JITKERN_MMA_UNROLL: the scores' 8-step loop waits on each ldmatrix), then CUPTI sums.
# Run from the repo root after the device README's setup: sh perf/h200_ldm_trans.sh
set -u
echo "== bits"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py tests/test_engine_cuda.py \
    -k "not smollm" 2>&1 | tail -3
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dsl.py -k "dot or mma or flash" 2>&1 | tail -3
for e in JITKERN_LDMATRIX_TRANS=0 JITKERN_LDMATRIX_TRANS=1 JITKERN_MMA_UNROLL=2 JITKERN_MMA_UNROLL=8; do
    echo "== attention $e"
    env $e timeout 60 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
        --decode-cases 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit 2>&1 \
        | grep "SDPA\|f16 cache\|FAILED"
done
sh perf/h200_profile.sh
