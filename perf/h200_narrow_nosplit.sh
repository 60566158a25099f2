#!/bin/sh
# One H200 device call (~4 minutes): could narrow weights (q/k/v, o, down: K split in 4 today) drop the K split, or
# split in 2?
# Without it their prefill tiles run 0.81-0.92x cuBLAS at M = 1024 (session 17) instead of the serial split's
# 0.66-0.86x, which restarts its copy pipeline at every slab. The price is at decode, where the split gives the
# programs in flight: the engine's (16, 64, 128, 4) split 4 against unsplit tiles with as many programs (narrower
# rows, longer K steps: the same bytes a step), at M = 1 and 16, then the prefill tiles at M = 256.
# Run from the repo root after the device README's setup: sh perf/h200_narrow_nosplit.sh
set -u
timeout 200 python3 perf/tune_gemv_cuda.py --x16 --m 1,16 --shapes 4096x4096 6144x4096 4096x14336 --configs \
    mma,16,64,128,4,4 mma,16,64,128,4,2 mma,16,32,128,4,2 mma,16,32,256,4,2 mma,16,64,128,4,1 mma,16,32,256,4,1 \
    mma,16,16,256,2,1 \
    2>&1 | grep -v "^tensor-core"
timeout 120 python3 perf/tune_gemv_cuda.py --x16 --m 256 --shapes 4096x4096 6144x4096 4096x14336 --configs \
    wg,128,128,64,8,0 wg,128,128,64,8,2 wg,128,128,64,8,1 wg,64,128,64,8,1 2>&1 | grep -v "^tensor-core\|copy:"
echo "== M = 1024: the serial split in 4 (the engine's) and in 2 against none"
timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 1024 --all-shapes --shapes 4096x4096 6144x4096 4096x14336 \
    --configs wgs,128,128,64,8,0 wgs,128,128,64,8,2 wg,128,128,64,8,1 2>&1 | grep -v "^tensor-core\|copy:"
