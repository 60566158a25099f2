#!/bin/sh
# The first H200 call after session 18 (~9 minutes): session 18 could not run the end to end at its final defaults
# (the serial split's copy chain with register sums, JITKERN_SERIAL_CHAIN / JITKERN_WG_SUMS) for lack of device
# time; and the engine's c=64 flash_decode got slower at its short contexts (128-256 tokens: 197 -> 257 us on 8
# layers) with session 18's attention defaults, though faster at ctx = 1024 in the kernel A/B.
#   1. the 32-layer end to end against the gpt-fast-style peer (c=1, c=64, 1,024-token TTFT);
#   2. CUPTI sums at the defaults and with each attention setting back (which one costs c=64's decode);
#   3. the 4-block steps' prefill (TTFT) against decode, and rope + cache with a token's heads as one tile
#      (JITKERN_ROPE_TILES=1, off until measured; its bits: -m gpu tests/ops/test_rope.py -k tile), as CUPTI A/Bs.
# Run from the repo root after the device README's setup: sh perf/h200_session19.sh
set -u
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_rope.py -k tile 2>&1 | tail -1
sh perf/h200_e2e.sh
# (in order of interest; the loop stops when the call's time runs out: the rest is a second call's)
for s in "" "JITKERN_FLASH_STEP_BLOCKS=1" "JITKERN_PIN_REGS=0" "JITKERN_ROPE_TILES=1" "JITKERN_FLASH_DECODE_PIPELINE=0" \
         "JITKERN_FLASH_STEP_BLOCKS=4 JITKERN_FLASH_DECODE_PIPELINE=0"; do
    left=$((590 - SECONDS))
    [ $left -gt 60 ] || break
    timeout $left sh perf/h200_profile.sh $s
done
