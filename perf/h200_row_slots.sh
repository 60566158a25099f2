#!/bin/sh
# One H200 device call (~4 minutes) for two lowering switches that are off by default until this has run:
# JITKERN_ROW_SLOTS=1 (row vectors broadcast into accumulator registers share barriers) and
# JITKERN_PIN_OPERANDS=1 (a loop's dots stage an A operand defined outside the loop once, before it).
#   1. bits: the flash kernels with and without each (tests/ops/test_attention_flash.py -k row_slots), and the
#      whole flash test file with both on;
#   2. if those pass: the attention kernels' timing off / row slots / pins / both (separate processes).
# Run from the repo root after the device README's setup: sh perf/h200_row_slots.sh
set -u
out=$(timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py -k row_slots 2>&1)
echo "$out" | tail -6
out2=$(JITKERN_ROW_SLOTS=1 JITKERN_PIN_OPERANDS=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/ops/test_attention_flash.py 2>&1)
echo "$out2" | tail -6
case "$out$out2" in *failed*|*error*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for v in "JITKERN_ROW_SLOTS=0" "JITKERN_ROW_SLOTS=1" "JITKERN_PIN_OPERANDS=1" "JITKERN_ROW_SLOTS=1 JITKERN_PIN_OPERANDS=1"; do
    echo "== $v"
    env $v timeout 100 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
        --decode-cases 1x136 64x136 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit 2>&1 \
        | grep -i "jitkern"
done
