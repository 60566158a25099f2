#!/bin/sh
# Nsight Compute on the flash prefill (B = 1, S = 1024, f16 cache, 16-bit operands; perf/ncu_probe.py), the
# compiled launch, at the defaults and with warp-owned rows (JITKERN_FLASH_WARP_ROWS=1): where its warps stall and
# what it issues. ~3 minutes.
# Run from the repo root after the device README's setup: sh perf/h200_ncu_rows.sh
set -u
for wr in 0 1; do
    echo "== JITKERN_FLASH_WARP_ROWS=$wr"
    JITKERN_FLASH_WARP_ROWS=$wr timeout 200 ncu --clock-control none -k regex:'flash_prefill' --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis python3 perf/ncu_probe.py 2>&1 | grep -v "^==PROF==\|^ *-*$" \
        | grep -v "^linear\|^attention" | head -120
done
