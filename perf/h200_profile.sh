#!/bin/sh
# The CUPTI kernel sums of an 8-layer Llama-3-8B-shape engine (decode steps at c=1 and c=64, a 1,024-token
# prefill) under the environment settings given as arguments (none: this tree's defaults), filtered to the kernel
# lines. The shared form of the "profile under these settings" step of the H200 device scripts.
#   sh perf/h200_profile.sh [JITKERN_X=value ...]
# Run from the repo root after the device README's setup.
set -u
echo "== profile ${*:-(defaults)}"
env "$@" timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
    2>&1 | grep -A9 "^=== " | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
