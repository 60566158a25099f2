#!/bin/sh
# One H200 device call (~7 minutes): programmatic dependent launch (JITKERN_PDL=1: every kernel starts with
# griddepcontrol.wait + launch_dependents, launches carry programmatic stream serialization, graphs record
# programmatic edges; off by default until this has run):
#   1. right: the device-array ops, the engine's GPU tests (graphs included) with the switch on;
#   2. if those pass: the 32-layer end-to-end run with it on (the c=1 decode goal is where launch gaps count;
#      compare with the last `sh perf/h200_e2e.sh`), then the same without it for a same-machine baseline.
# Run from the repo root after the device README's setup: sh perf/h200_pdl.sh
set -u
out=$(JITKERN_PDL=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py \
    tests/test_engine_cuda.py tests/test_cuda_runtime.py -k "not smollm" 2>&1)
echo "$out" | tail -8
case "$out" in *failed*|*rror*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
model="--make llama3-8b --keep /tmp/l8b"
for v in 1 0; do
    echo "== JITKERN_PDL=$v: 128 in / 128 out, concurrency 1 and 64"
    JITKERN_PDL=$v timeout 170 python3 perf/bench_e2e_cuda.py $model --systems ours --no-f32-check 2>&1 \
        | grep -v "uploading weights\|GB written" | grep "jitkern engine\|invariance"
    model="--model /tmp/l8b"
done
