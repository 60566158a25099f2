#!/bin/bash
# Session 20's second H200 call (~6 minutes): the first call (perf/h200_session20.sh) measured ours at the defaults
# c=1 203.7 / c=64 5787.7 tok/s in the peer's run and 211.9 / 6207.8 with 1-block attention steps in a later
# process, so this splits setting from run order: ours alone, the same kept model, two rounds of
#   default | JITKERN_FLASH_STEP_BLOCKS=1 | JITKERN_GATE_UP16=0 | both
# at c=1 and c=64, then the 1,024-token TTFT for the default and 1-block steps.
# Run from the repo root after the device README's setup: bash perf/h200_session20b.sh
set -u
bash perf/h200_ours_rounds.sh 2 10000 "X=1" "JITKERN_FLASH_STEP_BLOCKS=1" "JITKERN_GATE_UP16=0" \
    "JITKERN_FLASH_STEP_BLOCKS=1 JITKERN_GATE_UP16=0"
for s in "X=1" "JITKERN_FLASH_STEP_BLOCKS=1" "X=1" "JITKERN_FLASH_STEP_BLOCKS=1"; do
  echo "== TTFT: $s"
  env $s timeout 40 python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours --input-len 1024 --output-len 1 \
      --concurrency 1 --repeat 1 --no-f32-check 2>&1 | grep "^jitkern engine"
done
