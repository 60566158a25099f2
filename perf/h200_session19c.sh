#!/bin/sh
# Session 19's third H200 call (~4 minutes): the gated kernel at half the linear's tile width a projection (112
# registers instead of 192: four CTAs an SM, as the linear), and the engine test of the 16-bit gate/up output with a
# rounding buffer made before the engine (its first GPU run allocated one inside a decode graph's capture).
#   1. bits: -k "gate_up_writes or gated" (op: gated_linear = linear + act_and_mul; engine: tokens and logprobs);
#   2. CUPTI sums (8 layers): defaults against JITKERN_GATED_LINEAR=0;
#   3. ours alone at c=1, 128 in / 128 out, 32 layers: defaults, then JITKERN_GATED_LINEAR=0 (same machine).
# Run from the repo root after the device README's setup: sh perf/h200_session19c.sh
set -u
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "gate_up_writes or gated" 2>&1 | grep -v "^  warnings\|Warning\|^$" | tail -25
for s in "" "JITKERN_GATED_LINEAR=0"; do
    timeout 60 sh perf/h200_profile.sh $s | head -9
done
echo "== 128 in / 128 out, concurrency 1, ours: defaults"
timeout 120 python3 perf/bench_e2e_cuda.py --make llama3-8b --keep /tmp/l8b --systems ours --concurrency 1 \
    --no-f32-check 2>&1 | grep "^jitkern engine"
for s in "JITKERN_GATED_LINEAR=0" ""; do
    echo "== 128 in / 128 out, concurrency 1, ours: ${s:-defaults}"
    env $s timeout 60 python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours --concurrency 1 --no-f32-check \
        2>&1 | grep "^jitkern engine"
done
