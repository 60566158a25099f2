#!/bin/sh
# The second H200 call of session 18 (~10 minutes): the serial split's copy chain through its slabs
# (JITKERN_SERIAL_CHAIN) - bits first, off for the rest if they fail - then the 32-layer end to end against the
# gpt-fast-style peer at this tree's defaults (session 18's attention: JITKERN_PIN_REGS=1, 2-block steps, the decode
# pipeline; session 17's linears: wide weights unsplit, the XL tile), then while time is left: the narrow
# weights' prefill GEMMs with and without the chain against cuBLAS, and the flash file's bits.
# Run from the repo root after the device README's setup: sh perf/h200_session18b.sh
set -u
echo "== bits: the serial chain"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py -k "serial_chain or serial_split" \
    > /tmp/s18b_bits.txt 2>&1 || { echo "CHAIN BITS FAILED: JITKERN_SERIAL_CHAIN=0 from here"; export JITKERN_SERIAL_CHAIN=0; }
grep -E "passed|failed|Error|assert" /tmp/s18b_bits.txt | tail -8
sh perf/h200_e2e.sh
for c in 0 1; do
    left=$((590 - SECONDS))
    [ $left -gt 40 ] || break
    echo "== M = 1024, JITKERN_SERIAL_CHAIN=$c"
    JITKERN_SERIAL_CHAIN=$c timeout $left python3 perf/tune_gemv_cuda.py --x16 --m 1024 --all-shapes \
        --shapes 4096x4096 6144x4096 4096x14336 --configs wgs,128,128,64,8,0 2>&1 | grep -v "^tensor-core\|copy:"
done
left=$((590 - SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -3
