#!/bin/sh
# One H200 device call (~6 minutes): the o projection's 16-bit input (JITKERN_X16_ATTN=1: the flash kernels store
# the attention output in bf16, so the o projection takes TMA) with prefetch 1 / 2 and the TMA pipe, against the
# defaults:
#   1. the 8-layer Llama-3-8B-shape 1,024-token prefill's kernels (CUPTI) for each setting;
#   2. ours end to end (32 layers, 128 in / 128 out at c=1 and 64, then a 1,024-token TTFT) at the defaults and at
#      X16_ATTN + prefetch 2.
# Run from the repo root after the device README's setup: sh perf/h200_x16_pf2.sh
set -u
for s in "" "JITKERN_X16_ATTN=1" "JITKERN_X16_ATTN=1 JITKERN_LINEAR_PREFETCH=2" \
        "JITKERN_X16_ATTN=1 JITKERN_LINEAR_PREFETCH=2 JITKERN_TMA_PIPE=1"; do
    echo "== profile: ${s:-defaults}"
    env $s timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 --prompt-len 1024 \
        2>&1 | grep -A4 "prefill"
done
model="--make llama3-8b --keep /tmp/l8b"
for s in "" "JITKERN_X16_ATTN=1 JITKERN_LINEAR_PREFETCH=2"; do
    echo "== ours end to end: ${s:-defaults}"
    env $s timeout 150 python3 perf/bench_e2e_cuda.py $model --systems ours --no-f32-check 2>&1 \
        | grep "jitkern engine\|invariance"
    model="--model /tmp/l8b"
    env $s timeout 100 python3 perf/bench_e2e_cuda.py $model --systems ours --input-len 1024 --output-len 1 \
        --concurrency 1 --no-f32-check 2>&1 | grep "jitkern engine"
done
