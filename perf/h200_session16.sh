#!/bin/sh
# The first H200 call after session 15 (~4 minutes): the flash file and the engine's GPU tests at this tree's
# defaults (flash_merge_kernel back to session 13's one partition at a time; the step-blocks setting at 1), then the
# CUPTI sums of the 8-layer steps (the merge should be back at ~24 / ~37 us for c=1 / c=64).
# Run from the repo root after the device README's setup: sh perf/h200_session16.sh
set -u
echo "== bits"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py tests/test_engine_cuda.py \
    -k "not smollm" 2>&1 | tail -3
sh perf/h200_profile.sh
