#!/bin/sh
# The first H200 call after session 19 (~10 minutes; the gated A/B at its end may need a second call): the 32-layer
# end to end at session 19's final defaults (rope tiles and the bf16 gate/up output on; session 19 measured their
# TTFT alone, 30.3 vs 26.2 ms = 1.156x the peer's, and c=1 / c=64 only before them), then the same with 1-block online-softmax steps: CUPTI gave the c=64 decode
# attention 255 -> 190 us (8 layers) for +100 us of prefill attention, and with the TTFT now inside its 1.2x there
# is room to trade (decode and prefill step alike for the bits, so one setting for both).
#   1. sh perf/h200_e2e.sh at the defaults (c=1, c=64, 1,024-token TTFT, same run as the peer);
#   2. ours alone at c=1 / c=64 and the TTFT with JITKERN_FLASH_STEP_BLOCKS=1 (the model kept from step 1);
#   3. the one gated kernel (JITKERN_GATED_LINEAR=1, off by default) in its one-dot form: GPU bits, c=1.
# Run from the repo root after the device README's setup: sh perf/h200_session20.sh
set -u
sh perf/h200_e2e.sh
echo "== JITKERN_FLASH_STEP_BLOCKS=1, ours alone"
JITKERN_FLASH_STEP_BLOCKS=1 timeout $((590 - SECONDS)) python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours \
    --concurrency 1 64 --no-f32-check 2>&1 | grep "^jitkern engine"
JITKERN_FLASH_STEP_BLOCKS=1 timeout $((595 - SECONDS)) python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours \
    --input-len 1024 --output-len 1 --concurrency 1 --no-f32-check 2>&1 | grep "^jitkern engine"
# 3. the one gated kernel's one-dot form (session 19's two-dot form was slower): bits, then c=1 with it
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "gated or gate_up_writes" 2>&1 | tail -2
echo "== JITKERN_GATED_LINEAR=1, ours alone at c=1"
JITKERN_GATED_LINEAR=1 timeout 90 python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours --concurrency 1 \
    --no-f32-check 2>&1 | grep "^jitkern engine"
