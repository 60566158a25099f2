#!/bin/sh
# One H200 device call (~3 minutes): could wide weights (gate_up, the head: K split in 2 today) drop the K split?
# Session 17's perf/h200_gemm_tiles.sh: without it the prefill tiles run 0.91x cuBLAS ((256, 128), M = 1024-2048)
# instead of the serial split's 0.76x. The price would be at decode: same-run GEMV at M = 1 and 16 (the engine's
# (16, 64, 128, 4) split 2 against split 1 at the same width, at half the width with twice the K step (the same
# bytes a step and programs in flight), and at a doubled K step), then M = 256 (the huge tile split 2 serial
# vs slabs vs none).
# Run from the repo root after the device README's setup: sh perf/h200_wide_nosplit.sh
set -u
timeout 150 python3 perf/tune_gemv_cuda.py --x16 --m 1,16 --shapes 28672x4096 128256x4096 --configs \
    mma,16,64,128,4,2 mma,16,64,128,4,1 mma,16,32,256,4,1 mma,16,64,256,4,1 2>&1 | grep -v "^tensor-core"
timeout 120 python3 perf/tune_gemv_cuda.py --x16 --m 256 --shapes 28672x4096 128256x4096 --configs \
    wg,128,128,64,8,0 wgs,128,128,64,8,0 wg,128,128,64,8,1 wg,256,128,64,8,1 2>&1 | grep -v "^tensor-core\|copy:"
