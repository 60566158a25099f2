#!/bin/bash
# Session 20's fourth H200 call (~6 minutes): the gated activation in the down projection's x loads
# (JITKERN_GATED_X, linear(gated_x=): one act_and_mul launch a layer fewer at decode sizes).
#   1. bits: linear(gated_x=) against act_and_mul + linear (narrow and wide weights, 1-40 tokens), and the engine's
#      tokens and prompt logprobs with it on and off;
#   2. ours alone (one kept model), three rounds at c=1 and c=64 of JITKERN_GATED_X=0 | 1.
# Run from the repo root after the device README's setup: bash perf/h200_session20d.sh
set -u
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "gated_x or gated_activation" 2>&1 | tail -4
bash perf/h200_ours_rounds.sh 3 $((540 - SECONDS)) "JITKERN_GATED_X=0" "JITKERN_GATED_X=1"
