#!/bin/sh
# One H200 device call (~8 minutes): the tensor-core linear's tiles now that cp.async (num_stages=2, tiles of
# 64+ tokens) frees registers and shared memory - more CTAs an SM or taller / wider tiles may now fit. Every
# tile keeps a token's bits (register accumulators in K order), so any winner can become the engine's tier.
# Times against cuBLAS at Llama-3-8B shapes, x in bf16 (the engine's 16-bit inputs); then with the MMA K loop
# unrolled 2x (JITKERN_MMA_UNROLL=2), which did nothing at one CTA an SM.
# Run from the repo root after the device README's setup: sh perf/h200_tiles.sh
set -u
cfgs="mma,64,256,64,8,0 mma,64,128,64,8,0 mma,128,128,64,8,0 mma,128,256,64,8,0 mma,128,256,32,8,0 mma,64,256,64,4,0 mma,64,128,64,4,0"
echo "== tiles"
timeout 280 python3 perf/tune_gemv_cuda.py --x16 --m 64,256,1024 --launches 10 --configs $cfgs 2>&1 | grep -v "^device"
echo "== tiles, JITKERN_MMA_UNROLL=2"
JITKERN_MMA_UNROLL=2 timeout 200 python3 perf/tune_gemv_cuda.py --x16 --m 256,1024 --launches 10 \
    --configs mma,64,256,64,8,0 mma,128,128,64,8,0 mma,128,256,64,8,0 2>&1 | grep -v "^device"
