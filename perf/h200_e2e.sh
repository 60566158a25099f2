#!/bin/sh
# One H200 device call (~8 minutes): the 32-layer Llama-3-8B shape end to end against the gpt-fast-style peer at
# this tree's defaults (issue 8's goals: c=1 decode, c=64 aggregate, 1,024-token TTFT), everything to stdout.
#   1. 128 in / 128 out at concurrency 1 and 64 (writes the random model to /tmp/l8b and keeps it);
#   2. the first-token latency of a 1,024-token prompt on the same model (the peer's prefill compiled too).
# Run from the repo root after the device README's setup (PYTHONPATH with the carried wheels):
#   sh perf/h200_e2e.sh
set -u
echo "== 128 in / 128 out, concurrency 1 and 64"
timeout 330 python3 perf/bench_e2e_cuda.py --make llama3-8b --keep /tmp/l8b --systems ours gpt_fast \
    --no-f32-check 2>&1 | grep -v "uploading weights\|GB written" | tail -16
echo "== 1,024-token TTFT"
timeout 200 python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours gpt_fast --input-len 1024 \
    --output-len 1 --concurrency 1 --compile-prefill --no-f32-check 2>&1 | tail -12
