#!/bin/sh
# One H200 device call (~5 minutes): the flash kernels' online-softmax steps of 2 / 4 cache blocks
# (FLASH_STEP_BLOCKS) - bits first, then the attention A/B against torch SDPA / the copy bandwidth in the same
# run - and the CUPTI sums of the 8-layer steps at this tree's defaults (flash_merge_kernel back to one fold per
# row statistic after session 15's first call).
# Run from the repo root after the device README's setup: sh perf/h200_step_blocks.sh
set -u
echo "== bits"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    -k "step_blocks or batch_invariance or partition_axis" 2>&1 | tail -3
echo "== attention A/B"
timeout 250 python3 perf/bench_kernels_cuda.py --only attn --reps 5 --budget 0.1 \
    --decode-cases 1x256 16x1024 64x1024 64x4096 --prefill-cases 1x1024 8x1024 \
    --attn-variants flash-16bit flash-16bit-sb2 flash-16bit-sb2-rows16 flash-16bit-sb4-nopipe-dw4 \
    > /tmp/attn_ab.txt 2>&1
grep -v "f32 cache" /tmp/attn_ab.txt | tail -45
sh perf/h200_profile.sh
