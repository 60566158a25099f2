#!/bin/sh
# Session 19's second H200 call (~9 minutes): the gate/up projection's 16-bit output (JITKERN_GATE_UP16, on by
# default: linear(out=uint16) through every tile, the engine's gated activation reading it), decode steps' gate/up +
# activation as one kernel (JITKERN_GATED_LINEAR, matmul.gated_linear) and the TTFT with them and rope tiles.
#   1. bits: 16-bit out = the f32 result rounded, every tile (TMA, serial split); the engine's tokens and logprobs
#      with it (and the one kernel) = f32 output rounded before the activation; gated_linear = linear + act_and_mul;
#   2. CUPTI sums (8 layers): defaults, JITKERN_GATED_LINEAR=0, JITKERN_GATE_UP16=0 (as time allows);
#   3. the 32-layer model at the defaults: ours alone at c=1, 128 in / 128 out (the goal is absolute), then the
#      1,024-token TTFT against the gpt-fast-style peer (rope tiles, 16-bit gate/up).
# Run from the repo root after the device README's setup: sh perf/h200_session19b.sh
set -u
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "16bit_out or gate_up_writes or 16bit_linear or gated" 2>&1 | tail -3
for s in "" "JITKERN_GATED_LINEAR=0" "JITKERN_GATE_UP16=0"; do
    left=$((280 - SECONDS))
    [ $left -gt 40 ] || break
    timeout $left sh perf/h200_profile.sh $s
done
echo "== 128 in / 128 out, concurrency 1, ours"
timeout 150 python3 perf/bench_e2e_cuda.py --make llama3-8b --keep /tmp/l8b --systems ours --concurrency 1 \
    --no-f32-check 2>&1 | grep -v "uploading weights\|GB written" | tail -6
echo "== 1,024-token TTFT"
timeout $((590 - SECONDS)) python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours gpt_fast \
    --input-len 1024 --output-len 1 --concurrency 1 --compile-prefill --no-f32-check 2>&1 | tail -12
