#!/bin/sh
# One H200 device call (~7 minutes): the small kernels of a concurrency-1 decode step. rms_norm takes ~4.8 us a
# launch and the flash decode ~11 us a layer there (one program per row / a few per KV head: latency, not bytes).
#   1. CUPTI per-kernel sums of the 8-layer Llama-3-8B-shape decode step (c=1, c=64) and a 1,024-token prefill
#      at the defaults and JITKERN_FLASH_PARTITION_BLOCKS=2 / 1;
#   2. bits with partitions of 1 block: the flash file (decode = prefill row), the norm and engine GPU tests;
#   3. ours end to end (32 layers, 128 in / 128 out at c=1 and 64, a 1,024-token TTFT) at the defaults and with 1-block partitions.
# (Session 12 ran it with a JITKERN_NORM_WARPS switch in rms_norm, since removed: 16 warps slower everywhere,
# 8 warps -0.5% at c=1 but slower prefill norms; it also broke rms_norm_q8 = rms_norm + quantise, bit for bit.)
# Run from the repo root after the device README's setup: sh perf/h200_c1_small.sh
set -u
for s in "" "JITKERN_FLASH_PARTITION_BLOCKS=2" "JITKERN_FLASH_PARTITION_BLOCKS=1"; do
    echo "== profile: ${s:-defaults}"
    env $s timeout 90 python3 perf/profile_engine_cuda.py --cupti --layers 8 --concurrency 1 64 --prompt-len 1024 \
        2>&1 | grep -A7 "^=== \|wall min" | grep -v "^--$\|argmax\|embedding\|gather\|Memcpy"
done
both="JITKERN_FLASH_PARTITION_BLOCKS=1"
model="--make llama3-8b --keep /tmp/l8b"
for s in "" "$both"; do
    echo "== ours end to end: ${s:-defaults}"
    env $s timeout 150 python3 perf/bench_e2e_cuda.py $model --systems ours --no-f32-check 2>&1 \
        | grep "^jitkern engine\|invariance"
    model="--model /tmp/l8b"
    env $s timeout 100 python3 perf/bench_e2e_cuda.py $model --systems ours --input-len 1024 --output-len 1 \
        --concurrency 1 --no-f32-check 2>&1 | grep "^jitkern engine"
done
echo "== bits: $both"
env $both timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention_flash.py \
    tests/test_engine_cuda.py -k "not smollm" 2>&1 | tail -4
env $both timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm.py tests/test_device_arrays.py \
    -k "norm or rms" 2>&1 | tail -4
