#!/bin/bash
# Session 20's last H200 call (~3 minutes, what the budget had left): ours alone at the final defaults (reductions one
# item a thread), c=1 and c=64, with --repeat 3 (the median of three timed calls, each call's wall printed).
# Run from the repo root after the device README's setup: bash perf/h200_session20f.sh
set -u
timeout 240 python3 perf/bench_e2e_cuda.py --make llama3-8b --systems ours --concurrency 1 64 --repeat 3 \
    --no-f32-check --json /tmp/e2e20f.json 2>&1 | grep "^jitkern engine\|batch invariance"
python3 -c "
import json; r = json.load(open('/tmp/e2e20f.json'))['results']['ours']['runs']
print({c: [round(w, 4) for w in v['walls_s']] for c, v in r.items()})"
