#!/bin/sh
# One H200 device call (~5 minutes): the flash decode kernel with its registers capped (FLASH_DECODE_MAXNREG 168 /
# 128: 6 / 8 CTAs an SM instead of 4) and without the next block's loads in flight (nopipe: 168 registers, no
# spills), the 32-row prefill tiles at 4 warps, all against torch SDPA in the same run; then Nsight Compute's
# stall reasons for the prefill kernel (per issued instruction, the 1,024-token prompt of perf/ncu_probe.py).
# Run from the repo root after the device README's setup: sh perf/h200_decode_regs.sh
set -u
timeout 260 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 1x256 16x1024 64x1024 64x4096 --prefill-cases 1x1024 8x1024 \
    --attn-variants flash-16bit flash-16bit-dm168 flash-16bit-dm128 flash-16bit-nopipe flash-16bit-rows32-w4 \
    > /tmp/attn_ab.txt 2>&1
grep -v "f32 cache" /tmp/attn_ab.txt | tail -45
timeout 200 ncu --clock-control none -k regex:'flash_prefill' --launch-count 1 --launch-skip 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 perf/ncu_probe.py 2>&1 | grep -v "^==PROF==" | grep -E "flash_|Duration|Throughput|stalled|Registers|Occupancy|Waves" \
    | grep -v " 0$\| 0\.0[0-9]*$" | head -60
