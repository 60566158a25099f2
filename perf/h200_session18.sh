#!/bin/sh
# The first H200 call after session 17 (~9 minutes; the end to end is the second call: sh perf/h200_e2e.sh). Session 17 changed defaults it could not verify on the GPU for
# lack of device time: wide weights (gate_up, the head) no longer split K and take the XL (256, 128) warpgroup tile
# from 1,024 tokens. Bits of those first (stop if they fail: then set GPU_NOSPLIT_MIN_TILES / GPU_LINEAR_XL_M back),
# then attention variants at the new flash code (V by ldmatrix .trans: the decode pipeline and 2 / 4-block steps
# were measured before it) and JITKERN_PIN_REGS, then the narrow weights' K split at decode (perf/h200_narrow_nosplit.sh).
# Run from the repo root after the device README's setup: sh perf/h200_session18.sh
set -u
echo "== bits"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py tests/test_engine_cuda.py \
    -k "xl_tile or huge_tile or big_tile or tile_tiers or split or 16bit or tiny_models" > /tmp/s18_bits.txt 2>&1
rc=$?
tail -15 /tmp/s18_bits.txt
[ $rc -eq 0 ] || exit 1
echo "== attention variants"
timeout 120 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 --decode-cases 16x1024 64x1024 \
    --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-dpipe flash-16bit-warprows-sb2 \
    flash-16bit-warprows-sb4 2>&1 | grep "SDPA\|f16 cache\|FAILED"
echo "== JITKERN_PIN_REGS=1 (the query's fragments held in registers across the block loop): bits, then speed"
JITKERN_PIN_REGS=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py 2>&1 \
    | tail -2
JITKERN_PIN_REGS=1 timeout 90 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 16x1024 64x1024 --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit 2>&1 \
    | grep "SDPA\|f16 cache\|FAILED"
sh perf/h200_narrow_nosplit.sh
