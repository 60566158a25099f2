#!/bin/sh
# One H200 device call (~4 minutes): is a taller warpgroup tile faster at prefill sizes? Nsight Compute (session 17,
# perf/h200_ncu_source.sh) found the (128, 128) TMA tile at M = 1024 waiting on its copies (31% of stall samples
# at the mbarrier wait) with ~9 TB/s of L2 reads (each operand re-read per tile of the other). Against cuBLAS in the
# same run at M = 1024 / 2048, bf16 x: the engine's serial split (128, 128), and without a K split (other bits, a
# timing only) (128, 128), (256, 128), (128, 256) tiles.
# Run from the repo root after the device README's setup: sh perf/h200_gemm_tiles.sh
set -u
timeout 400 python3 perf/tune_gemv_cuda.py --x16 --m 1024,2048 --all-shapes --configs wgs,128,128,64,8,0 \
    wg,128,128,64,8,1 wg,256,128,64,8,1 wg,128,256,64,8,1 2>&1 | grep -v "^tensor-core"
