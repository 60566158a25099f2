#!/bin/sh
# The second H200 call of session 18 (~9 minutes): session 18's attention defaults (JITKERN_PIN_REGS=1, 2-block
# online-softmax steps, the decode pipeline) and session 17's linear defaults (wide weights unsplit, the XL tile)
# - bits first (the flash file and the engine's GPU tests), then the 32-layer end to end against the
# gpt-fast-style peer, the CUPTI sums, and the attention kernels at 1 / 2 / 4-block steps if time is left.
# Run from the repo root after the device README's setup: sh perf/h200_session18b.sh
set -u
echo "== bits"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py tests/test_engine_cuda.py \
    -k "not smollm" 2>&1 | tail -3
sh perf/h200_e2e.sh
sh perf/h200_profile.sh
left=$((585 - SECONDS))
[ $left -gt 30 ] && timeout $left python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 16x1024 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-sb1 \
    flash-16bit-sb1-nodpipe flash-16bit-sb4-nodpipe 2>&1 | grep "SDPA\|f16 cache\|FAILED"
