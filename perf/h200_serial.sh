#!/bin/sh
# One H200 device call (~8 minutes): the tensor-core linear summing a split K's slabs inside each program (SERIAL,
# matmul.GPU_LINEAR_SERIAL_SPLIT_M) against the slab programs + sum kernel, on the huge wgmma tile:
#   1. bits: serial against the slab path, the huge tile against the decode tiles (GPU tests);
#   2. timing beside cuBLAS at M = 256-2048 on every Llama-3-8B projection, uncapped and at 128 registers;
#   3. the 1,024-token TTFT of the 32-layer Llama-3-8B shape against the gpt-fast-style peer at this tree's defaults.
# Run from the repo root after the device README's setup: sh perf/h200_serial.sh
set -u
echo "== bits"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_device_arrays.py \
    -k "serial or huge or wgmma or big_tile or split_k" 2>&1 | tail -4
echo "== timing"
timeout 200 python3 perf/tune_gemv_cuda.py --x16 --m 256,512,1024,2048 --launches 10 --all-shapes \
    --configs wg,128,128,64,8,0 wgs,128,128,64,8,0 2>&1 | grep -v "^device"
echo "== timing, serial capped at 128 registers"
timeout 120 python3 perf/tune_gemv_cuda.py --x16 --m 512,2048 --launches 10 --all-shapes --serial-maxnreg 128 \
    --configs wgs,128,128,64,8,0 2>&1 | grep -v "^device"
echo "== 1,024-token TTFT"
timeout 240 python3 perf/bench_e2e_cuda.py --make llama3-8b --keep /tmp/l8b --systems ours gpt_fast \
    --input-len 1024 --output-len 1 --concurrency 1 --compile-prefill --no-f32-check 2>&1 \
    | grep -v "uploading weights\|GB written" | tail -12
