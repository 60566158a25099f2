#!/bin/sh
# The first H200 call after session 16 (~8 minutes): the whole flash file and the engine's GPU tests at the new
# defaults (warp-owned rows, jk.exp_fast, pinned query tiles), then the 32-layer end to end against the
# gpt-fast-style peer (c=1, c=64, 1,024-token TTFT), then the CUPTI sums with 2-block steps.
# Run from the repo root after the device README's setup: sh perf/h200_session17.sh
set -u
echo "== bits"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py tests/test_engine_cuda.py \
    -k "not smollm" 2>&1 | tail -3
sh perf/h200_e2e.sh
sh perf/h200_profile.sh JITKERN_FLASH_STEP_BLOCKS=2
