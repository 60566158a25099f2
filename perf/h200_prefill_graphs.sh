#!/bin/sh
# One H200 device call (~5 minutes): 1,024-token prefills as CUDA graphs. Session 14 found the 8-layer
# 1,024-token prefill host-bound (perf/probe_prefill_wall.py: ~18-21 ms wall against 10.8 ms of kernels under CUPTI;
# ~95 launches from Python) because steps padded past prefill_graphs.CUDA_MAX_TOKENS (512) run eagerly.
#   1. bits: the CUDA prefill graphs equal the eager steps (tests/test_prefill_graphs.py, on the GPU);
#   2. wall of an 8-layer prefill, eager (cap 512) against a graph (cap 2048), 1,024 and 2,048 tokens;
#   3. the 32-layer 1,024-token TTFT against the gpt-fast-style peer with the cap at 2048.
# If 2 and 3 show the gain (and the graph kept the TMA linears: its wall near the kernel sum), raise CUDA_MAX_TOKENS.
# Run from the repo root after the device README's setup: sh perf/h200_prefill_graphs.sh
set -u
echo "== bits"
JITKERN_CUDA_GRAPH_MAX_TOKENS=2048 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_graphs.py \
    -k cuda 2>&1 | tail -2
for cap in 512 2048; do
    for n in 1024 2048; do
        echo "== JITKERN_CUDA_GRAPH_MAX_TOKENS=$cap, $n tokens"
        JITKERN_CUDA_GRAPH_MAX_TOKENS=$cap timeout 100 python3 perf/probe_prefill_wall.py --prompt-len $n --top 0 \
            2>&1 | grep "wall min"
    done
done
echo "== 1,024-token TTFT, cap 2048"
JITKERN_CUDA_GRAPH_MAX_TOKENS=2048 timeout 240 python3 perf/bench_e2e_cuda.py --make llama3-8b --systems ours gpt_fast \
    --input-len 1024 --output-len 1 --concurrency 1 --compile-prefill --no-f32-check 2>&1 | tail -8
