#!/bin/sh
# Nsight Compute with per-instruction stall sampling (SASS, source page as CSV) for the flash prefill (B = 1,
# S = 1024, the engine's flash defaults) and the bf16-x linear at M = 1024 (the TTFT prompt's linears: warpgroup
# MMAs fed by TMA, the serial split on narrow weights): where each kernel's warps wait, instruction by instruction.
# Writes the reports' details and SASS CSVs under $OUT (~4 minutes).
# Run from the repo root after the device README's setup: OUT=/some/dir sh perf/h200_ncu_source.sh
set -u
: "${OUT:=/tmp/ncu_out}"
mkdir -p "$OUT"
prof() {  # name, ncu filter args..., -- probe args
    name=$1; shift
    timeout 240 ncu --clock-control none --set full --import-source no -f -o "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
    tail -4 "$OUT/$name.log"
    ncu -i "$OUT/$name.ncu-rep" --page details 2>&1 | grep -v "^ *-*$" | head -260 >"$OUT/$name.details.txt"
    ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name.sass.csv" 2>&1
    wc -c "$OUT/$name.details.txt" "$OUT/$name.sass.csv"
    python3 perf/ncu_sass_summary.py "$OUT/$name.sass.csv" --top 25
    rm -f "$OUT/$name.ncu-rep"
}
echo "== flash_prefill (B=1 S=1024)"
prof flash_prefill -k regex:flash_prefill --launch-skip 1 --launch-count 1 python3 perf/ncu_probe.py --linear-m 1
grep -i "duration\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|No Eligible\|Warp Cycles Per Issued" \
    "$OUT/flash_prefill.details.txt" | head -20
echo "== linear bf16 x, M = 1024 (4096x4096 second call, then 28672x4096 both calls)"
prof linear1024 -k regex:_gpu_linear_mma_kernel --launch-skip 1 --launch-count 2 python3 perf/ncu_probe.py \
    --linear-m 1024 --x16 --no-attention
grep -i "duration\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|No Eligible\|Warp Cycles Per Issued\|Grid Size" \
    "$OUT/linear1024.details.txt" | head -24
