#!/bin/sh
# Nsight Compute on the flash kernels (perf/ncu_probe.py: decode B = 16 ctx 1024, prefill B = 1 S = 1024, f16 cache,
# Llama-3-8B heads): where their warps stall, one launch each (the second, compiled one). ~2 minutes.
# Run from the repo root after the device README's setup: sh perf/h200_ncu_flash.sh
set -u
timeout 240 ncu --clock-control none -k regex:'flash_' --launch-count 6 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 perf/ncu_probe.py 2>&1 | grep -v "^==PROF==\|^ *-*$" | grep -i -E "flash_|duration|throughput|stall|warp cycles|issued|eligible|active warps|registers|occupancy|shared memory|barrier|long scoreboard|short|mio|math|wait|branch|dispatch|selected|not selected|lg |tex|drain|sleeping|membar|no instruction|block limit|grid size|threads|waves" | head -150
