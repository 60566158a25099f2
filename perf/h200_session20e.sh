#!/bin/bash
# Session 20's fifth H200 call (~5 minutes): CTA-wide reductions one work item a thread (JITKERN_REDUCE_ONE_EACH,
# default 1: the same items folded in the same order, so the same bits; the c=1 step's two rms_norm launches a
# layer, 4.2 us each, fold a 4096-wide row on one warp's 128 shared loads a thread before it).
#   1. bits: the DSL's reductions with it on = off on the GPU, the norm / softmax / sampling op tests;
#   2. CUPTI (8 layers) with it on and off;
#   3. ours alone (one kept model), two rounds at c=1 and c=64 of JITKERN_REDUCE_ONE_EACH=1 | 0.
# Run from the repo root after the device README's setup: bash perf/h200_session20e.sh
set -u
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dsl.py tests/ops/test_norm.py \
    tests/ops/test_softmax.py -k "one_item or rms or softmax or norm" 2>&1 | tail -3
sh perf/h200_profile.sh
sh perf/h200_profile.sh JITKERN_REDUCE_ONE_EACH=0
bash perf/h200_ours_rounds.sh 2 $((360 - SECONDS)) "JITKERN_REDUCE_ONE_EACH=1" "JITKERN_REDUCE_ONE_EACH=0"
