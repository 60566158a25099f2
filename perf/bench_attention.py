"""Benchmark: paged decode attention (one query token per sequence) at SmolLM2-135M's attention shape.

    .venv/bin/python perf/bench_attention.py [--threads 2] [--batches 1,16] [--contexts 512,2048]
                                             [--dtypes f32,f16] [--reps 50] [--json]

Shape: 9 query heads, 3 KV heads, head_dim 64, block size 16; block tables are random permutations of the
cache's blocks (as after a while of serving). Each timed call reads another "layer" (disjoint blocks of one
cache of --cache-blocks blocks, many times the L3 size), so K/V come from DRAM as in a real decode step
(--hot reuses one layer instead). Per (cache dtype, batch, context) row:
  parts       each sequence's flash-decoding partitions (decode_partitions: 256-token partitions, by length)
  us/call     best (and median) wall time of one paged_attention call = one layer of one decode step
  tok/s       batch / best time: decode tokens per second for this layer's attention alone
  GB/s        K+V bytes the call must read (batch x context x 3 heads x 64 x 2 x itemsize) / best time
  % of bw     that rate over the measured streaming read bandwidth of this host at the same thread count
The header names the CPU tier that ran and the bandwidth probe: perf/bandwidth_cpu.py's read kernel over a
256 MiB f32 array, one contiguous part per thread (best of 10).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--dtypes", default="f32,f16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-prefetch", action="store_true", help="disable the software prefetch of the next block")
    ap.add_argument("--hot", action="store_true", help="reuse one layer's blocks (K/V stay in the CPU caches)")
    ap.add_argument("--cache-blocks", type=int, default=16384,
                    help="blocks in the shared K/V caches (16384 = 2 x 192 MiB at f32)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    return ap.parse_args()


args = parse_args()
os.environ["JITKERN_NUM_THREADS"] = str(args.threads)      # before the pool exists

import numpy as np  # noqa: E402

from engine.ops import attention as A  # noqa: E402
from jitkern.runtime.cpu import runtime_target, runtime_target_reason  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def read_bandwidth() -> float:
    """Streaming read bandwidth in GB/s on this run's threads: perf/bandwidth_cpu.py's probe (256 MiB, best of 10)."""
    from perf.bandwidth_cpu import read_bandwidth as probe
    return probe(args.threads, mib=256, reps=10)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


_caches: dict = {}


def kv_caches(dtype, num_blocks: int):
    """One pair of K/V caches per dtype, shared by all rows (filled once with random values)."""
    key = np.dtype(dtype).name
    if key not in _caches:
        rng = np.random.default_rng(0)
        k = rng.standard_normal((num_blocks, BS, KVH, D), dtype=np.float32).astype(dtype, copy=False)
        v = rng.standard_normal((num_blocks, BS, KVH, D), dtype=np.float32).astype(dtype, copy=False)
        _caches[key] = (k, v)
    return _caches[key]


def bench_decode(batch: int, ctx: int, dtype, reps: int, prefetch: bool, hot: bool, num_blocks: int) -> dict:
    """Times paged_attention calls; each call reads another 'layer' (disjoint random blocks of one big
    cache, >= 8x the L3 cache in all) unless hot, so the K/V stream comes from DRAM as in a real step."""
    k_cache, v_cache = kv_caches(dtype, num_blocks)
    rng = np.random.default_rng(batch * 100003 + ctx)
    per_seq = -(-ctx // BS)
    layers = 1 if hot else max(1, num_blocks // (batch * per_seq))
    perm = rng.permutation(num_blocks)[:layers * batch * per_seq].astype(np.int32)
    tables = perm.reshape(layers, batch, per_seq)
    seq_lens = np.full(batch, ctx, np.int32)
    query_start = np.arange(batch + 1, dtype=np.int32)
    q = rng.standard_normal((batch, H, D)).astype(np.float32)
    out = np.empty_like(q)
    parts = int(A.decode_partitions([ctx], BS)[0])
    ws: dict = {}
    layer = [0]

    def call():
        table = tables[layer[0] % layers]
        layer[0] += 1
        A.paged_attention(q, k_cache, v_cache, query_start, seq_lens, table, scale=D ** -0.5, out=out,
                          max_query_len=1, num_partitions=parts, workspace=ws, prefetch=prefetch, validate=False)

    call()                                               # compile + warm up
    times = sorted(_timed(call) for _ in range(reps))
    best, med = times[0], times[len(times) // 2]
    kv_bytes = batch * ctx * KVH * D * 2 * np.dtype(dtype).itemsize
    return {"dtype": np.dtype(dtype).name, "batch": batch, "context": ctx, "partitions": parts, "layers": layers,
            "best_us": best * 1e6, "median_us": med * 1e6, "tokens_per_s": batch / best,
            "kv_gb_per_s": kv_bytes / best / 1e9}


def main():
    target = runtime_target()
    bw = read_bandwidth()
    rows = []
    for dt in args.dtypes.split(","):
        dtype = {"f32": np.float32, "f16": np.float16}[dt]
        for b in (int(x) for x in args.batches.split(",")):
            for c in (int(x) for x in args.contexts.split(",")):
                r = bench_decode(b, c, dtype, args.reps, not args.no_prefetch, args.hot, args.cache_blocks)
                r["pct_of_bw"] = 100 * r["kv_gb_per_s"] / bw
                rows.append(r)
    if args.json:
        for r in rows:
            print(json.dumps({**r, "tier": target.name, "threads": args.threads, "read_bw_gb_per_s": bw}))
        return
    kv = 'hot (one layer reused)' if args.hot else 'cold (a new layer per call)'
    print(f"tier {target.name} ({runtime_target_reason()}), threads {args.threads}, "
          f"prefetch {'off' if args.no_prefetch else 'on'}, K/V {kv}")
    print(f"measured streaming read bandwidth: {bw:.1f} GB/s")
    print(f"decode attention, {H} heads / {KVH} KV heads / dim {D}, block {BS}, random block tables")
    print(f"{'cache':>5} {'batch':>5} {'context':>7} {'parts':>5} {'us/call':>9} {'(median)':>9} "
          f"{'tok/s':>9} {'GB/s':>6} {'% of bw':>7}")
    for r in rows:
        name = 'f32' if r['dtype'] == 'float32' else 'f16'
        print(f"{name:>5} {r['batch']:>5} {r['context']:>7} {r['partitions']:>5} {r['best_us']:>9.1f} "
              f"{r['median_us']:>9.1f} {r['tokens_per_s']:>9.0f} {r['kv_gb_per_s']:>6.1f} {r['pct_of_bw']:>6.0f}%")


if __name__ == "__main__":
    main()
