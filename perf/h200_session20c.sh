#!/bin/bash
# Session 20's third H200 call (~7 minutes): weight rows prefetched into L2 before the dependency wait.
#   1. bits: the linear with L2_ROWS, with and without programmatic dependent launch, and the DSL's prefetch rows +
#      wait_dependencies; the engine's GPU tests with JITKERN_PDL=1 JITKERN_LINEAR_L2_PREFETCH=64;
#   2. ours alone (one kept model), two rounds at c=1 and c=64 of
#      default | L2 64 KiB | L2 128 KiB | PDL | PDL + L2 64 | PDL + L2 128.
# Run from the repo root after the device README's setup: bash perf/h200_session20c.sh (bash: $SECONDS)
set -u
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_dsl.py \
    -k "l2_prefetch or prefetch_rows" 2>&1 | tail -3
JITKERN_PDL=1 JITKERN_LINEAR_L2_PREFETCH=64 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
bash perf/h200_ours_rounds.sh 2 $((560 - SECONDS)) "X=1" "JITKERN_LINEAR_L2_PREFETCH=64" \
    "JITKERN_LINEAR_L2_PREFETCH=128" "JITKERN_PDL=1" "JITKERN_PDL=1 JITKERN_LINEAR_L2_PREFETCH=64" \
    "JITKERN_PDL=1 JITKERN_LINEAR_L2_PREFETCH=128"
