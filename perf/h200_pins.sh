#!/bin/sh
# One H200 device call (~4 minutes): the flash kernels with their query tile staged once before the block loop
# (JITKERN_PIN_OPERANDS=1, GpuLowering._pin_analysis; session 10 measured 1.02-1.035x on the flash kernels of then
# and left it off as "within 3%") at session 14's flash tiles, against the defaults in two processes (the switch is
# read at import), then the flash file's GPU tests with it on (decode = prefill row).
# Run from the repo root after the device README's setup: sh perf/h200_pins.sh
set -u
for pin in 0 1; do
    echo "== JITKERN_PIN_OPERANDS=$pin"
    JITKERN_PIN_OPERANDS=$pin timeout 90 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
        --decode-cases 1x256 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit 2>&1 \
        | grep "SDPA\|f16 cache"
done
echo "== bits, JITKERN_PIN_OPERANDS=1"
JITKERN_PIN_OPERANDS=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    2>&1 | tail -2
