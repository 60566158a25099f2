#!/bin/sh
# The fourth H200 call of session 18 (~2.5 minutes): sums of warpgroup-MMA accumulators in their registers
# (JITKERN_WG_SUMS, default 1: the serial split's running sum without a C tile in shared memory) - bits of the
# serial split with and without the copy chain, then the narrow weights' prefill GEMMs at M = 1024 against cuBLAS:
# the serial split as it was (WG_SUMS=0), with register sums, and with register sums + the chain.
# Run from the repo root after the device README's setup: sh perf/h200_session18d.sh
set -u
echo "== bits"
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py \
    -k "serial_chain or serial_split or xl_tile or huge_tile" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
for s in "JITKERN_WG_SUMS=0 JITKERN_SERIAL_CHAIN=0" "JITKERN_WG_SUMS=1 JITKERN_SERIAL_CHAIN=0" \
         "JITKERN_WG_SUMS=1 JITKERN_SERIAL_CHAIN=1"; do
    left=$((170 - SECONDS))
    [ $left -gt 15 ] || break
    echo "== M = 1024, $s"
    env $s timeout $left python3 perf/tune_gemv_cuda.py --x16 --m 1024 --all-shapes --launches 20 \
        --shapes 4096x4096 6144x4096 4096x14336 --configs wgs,128,128,64,8,0 2>&1 | grep -v "^tensor-core\|copy:"
done
