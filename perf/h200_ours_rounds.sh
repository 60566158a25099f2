#!/bin/bash
# Ours alone, A/B rounds of environment settings on one kept random Llama-3-8B-shape model (/tmp/l8b, written first
# if missing), a fresh process per (round, setting): the shared form of the session scripts' "ours alone" loops.
#   bash perf/h200_ours_rounds.sh ROUNDS SECONDS_LEFT SETTING [SETTING ...]
# SETTING: "NAME=value [NAME=value ...]" ("X=1" for the defaults); rounds stop once SECONDS_LEFT have passed.
# Each call times one generate call per concurrency (--repeat 1), as the session-20 runs that use it did.
# Run from the repo root after the device README's setup.
set -u
rounds=$1 left=$2
shift 2
[ -d /tmp/l8b ] || timeout 200 python3 perf/bench_e2e_cuda.py --make llama3-8b --keep /tmp/l8b --systems ours \
    --concurrency 1 --repeat 1 --no-f32-check 2>&1 | grep "^jitkern engine"
for round in $(seq 1 "$rounds"); do
  for s in "$@"; do
    [ $SECONDS -gt "$left" ] && break 2
    echo "== round $round: $s"
    env $s timeout 60 python3 perf/bench_e2e_cuda.py --model /tmp/l8b --systems ours --concurrency 1 64 \
        --repeat 1 --no-f32-check 2>&1 | grep "^jitkern engine"
  done
done
