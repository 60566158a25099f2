#!/bin/sh
# One H200 device call (~3 minutes) for the row slots (JITKERN_ROW_SLOTS=1, off by default until this has run):
#   1. bits: the flash kernels with and without them (tests/ops/test_attention_flash.py -k row_slots), and the
#      fragment-layout and 16-bit-operand flash tests with them on;
#   2. if those pass: the attention kernels' timing with and without (separate processes).
# Run from the repo root after the device README's setup: sh perf/h200_row_slots.sh
set -u
out=$(timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py -k row_slots 2>&1)
echo "$out" | tail -6
out2=$(JITKERN_ROW_SLOTS=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py 2>&1)
echo "$out2" | tail -6
case "$out$out2" in *failed*|*error*) echo "== timing skipped (not right yet)"; exit 0 ;; esac
for v in 0 1; do
    echo "== JITKERN_ROW_SLOTS=$v"
    JITKERN_ROW_SLOTS=$v timeout 120 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
        --decode-cases 1x136 64x136 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit 2>&1 \
        | grep -i "jitkern\|SDPA"
done
