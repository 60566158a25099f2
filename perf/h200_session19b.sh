#!/bin/sh
# Session 19's second H200 call (~6 minutes): the gate/up projection's 16-bit output (JITKERN_GATE_UP16, on by
# default: linear(out=uint16) through every tile, the engine's gated activation reading it) and the rms_norm
# program's warps (JITKERN_NORM_WARPS: a decode step's norm is one CTA, 4.2 us a launch at 4 warps).
#   1. bits: 16-bit out = the f32 result rounded, every tile (TMA, serial split); the engine's tokens and logprobs
#      with it = f32 output rounded before the activation; rms_norm's GPU tier at 16 warps;
#   2. CUPTI sums (8 layers): defaults, JITKERN_GATE_UP16=0, JITKERN_NORM_WARPS=8 / 16.
# Run from the repo root after the device README's setup: sh perf/h200_session19b.sh
set -u
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "16bit_out or gate_up_writes or 16bit_linear" 2>&1 | tail -3
JITKERN_NORM_WARPS=16 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm.py \
    2>&1 | tail -2
for s in "" "JITKERN_GATE_UP16=0" "JITKERN_NORM_WARPS=8" "JITKERN_NORM_WARPS=16"; do
    left=$((590 - SECONDS))
    [ $left -gt 60 ] || break
    timeout $left sh perf/h200_profile.sh $s
done
