#!/bin/sh
# The first H200 call after session 14 (~7 minutes): what session 14 wrote without a device.
#   1. bits: the q/k/v projection's split-K slabs summed by rope_and_cache (GPU_FOLD_SPLITK; op test on the GPU,
#      the engine's 16-bit / fold test with the split-K tile), the launch plans memoised for defaulted constexprs
#      (every GPU test below goes through them), CUDA prefill graphs up to 2,048 tokens;
#   2. CUPTI sums of the 8-layer decode step (c=1, c=64) and 1,024-token prefill: the split-K sum kernel should be
#      gone from the decode steps (session 14: 9 launches, 10.3 us at c=1; 41.3 us at c=64);
#   3. wall of an 8-layer 1,024-token prefill, eager (cap 512) against a CUDA graph (cap 2048).
# Then, if the graph wins: raise prefill_graphs.CUDA_MAX_TOKENS and run `sh perf/h200_e2e.sh`.
# Run from the repo root after the device README's setup: sh perf/h200_session15.sh
set -u
echo "== bits"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "split_k or 16bit_linear or tiny_models" 2>&1 | tail -3
JITKERN_CUDA_GRAPH_MAX_TOKENS=2048 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_graphs.py \
    -k cuda 2>&1 | tail -2
echo "== profile"
timeout 100 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
    2>&1 | grep -A9 "^=== " | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
for cap in 512 2048; do
    echo "== JITKERN_CUDA_GRAPH_MAX_TOKENS=$cap"
    JITKERN_CUDA_GRAPH_MAX_TOKENS=$cap timeout 100 python3 perf/probe_prefill_wall.py --top 0 2>&1 | grep "wall min"
done
