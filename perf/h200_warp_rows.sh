#!/bin/sh
# One H200 device call (~6 minutes): the flash prefill with warp-owned rows (JITKERN_FLASH_WARP_ROWS=1; row max /
# sum on lane shuffles, row values in registers). Bits first (against the tile path, decode = prefill row), then
# prefill attention against SDPA in the same run at four warp-rows tiles, then the engine's GPU tests and the
# CUPTI sums with the switch on.
# Run from the repo root after the device README's setup: sh perf/h200_warp_rows.sh
set -u
echo "== bits"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py -k "warp_rows" -x \
    > /tmp/wr_bits.txt 2>&1
rc=$?
tail -40 /tmp/wr_bits.txt
[ $rc -eq 0 ] || exit 1
echo "== attention"
timeout 150 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 --decode-cases 1x256 \
    --prefill-cases 1x1024 8x1024 --attn-variants flash-16bit flash-16bit-warprows flash-16bit-warprows-rows16-w4 \
    flash-16bit-warprows-rows64-w8 flash-16bit-warprows-rows32-w8 flash-16bit-warprows-sb2 2>&1 | grep "SDPA\|f16 cache\|FAILED"
echo "== engine bits, JITKERN_FLASH_WARP_ROWS=1"
JITKERN_FLASH_WARP_ROWS=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_cuda.py \
    -k "not smollm" 2>&1 | tail -3
sh perf/h200_profile.sh JITKERN_FLASH_WARP_ROWS=1
