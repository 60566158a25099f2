"""Data parallelism (engine.data_parallel): aggregate decode throughput of DP=1 vs DP=N, and the prefix-cache
hit rate of round-robin vs prefix-aware routing on a shared-prefix workload.

    python perf/bench_data_parallel.py                          # the embedded SmolLM2, DP 1 vs 2, c=32
    python perf/bench_data_parallel.py --model DIR --dp 1 2 4 --concurrency 32 --max-tokens 128
    python perf/bench_data_parallel.py --backend ray             # replicas as Ray actors (`ray start --head` first)
    python perf/bench_data_parallel.py --skip-decode --prefixes 8 --per-prefix 64

Decode: each DP size gets the same cores (this process's affinity), split evenly between its replicas; one
unmeasured wave of `concurrency` requests, then a measured one; aggregate tok/s = generated tokens / wall time of
the wave. Every request decodes max_tokens tokens (ignore_eos), greedy. The greedy texts of every DP size are
compared with the first's.

Prefix: `prefixes` system prompts of `prefix-blocks` full KV blocks, each followed by `per-prefix` distinct
questions, shuffled, `concurrency` in flight, on DP=max(--dp); hit rate = prefix-cache hits / queries (tokens)
summed over the replicas, as /metrics reports them (vllm:prefix_cache_hits / vllm:prefix_cache_queries).
While every replica's pool holds every system prompt, round-robin loses only one miss per prompt per replica;
the difference is in a pool that cannot (--prefix-num-blocks): round-robin makes each replica cycle through all
prompts and evict, prefix-aware routing gives each replica its share of them.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(args, dp: int, routing=None, num_blocks=None, max_load_imbalance=None):
    from engine.data_parallel import DataParallelEngine
    from engine.llm_engine import EngineArgs
    ea = EngineArgs(model=args.model, max_num_seqs=max(args.concurrency, 1), data_parallel_size=dp,
                    distributed_executor_backend=args.backend, block_size=args.block_size,
                    usage_context="openai_api_server", itl_target_ms=0, num_blocks=num_blocks)
    return DataParallelEngine(ea, routing=routing, max_load_imbalance=max_load_imbalance)


def _wave(eng, prompts, params, concurrency: int) -> tuple:
    """Runs every prompt with at most `concurrency` in flight; (seconds, generated tokens, outputs by index)."""
    outs: dict = {}
    lock = threading.Lock()
    it = iter(enumerate(prompts))

    def worker():
        while True:
            with lock:
                try:
                    i, p = next(it)
                except StopIteration:
                    return
            last = None
            for last in eng.submit(f"b{time.monotonic_ns()}-{i}", p, params.clone()):
                pass
            outs[i] = last
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs.values()), outs


def bench_decode(args) -> None:
    from engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    first = None
    base = None
    for dp in args.dp:
        eng = _engine(args, dp, routing="load")
        try:
            tok = eng.tokenizer
            words = ["the", "a", "cat", "dog", "runs", "sleeps", "on", "under", "mat", "tree", "and", "then"]
            prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(args.prompt_words)),
                                  add_special_tokens=True) for _ in range(args.concurrency)]
            rng.seed(0)
            _wave(eng, prompts, params, args.concurrency)                 # warm-up (kernel loads, graphs)
            dt, n, outs = _wave(eng, prompts, params, args.concurrency)
            texts = [outs[i].outputs[0].token_ids for i in range(len(prompts))]
            same = "" if first is None else ("  greedy = DP%d" % args.dp[0] if texts == first else "  GREEDY DIFFERS")
            first = first or texts
            rate = n / dt
            base = base or rate
            sets = [getattr(r.transport, "cpus", None) for r in eng.replicas]
            print(f"DP={dp} ({args.backend}, cores {sets}): c={args.concurrency} x {args.max_tokens} tokens: "
                  f"{n} tokens in {dt:.2f}s = {rate:.1f} tok/s aggregate ({rate / base:.2f}x DP={args.dp[0]}){same}",
                  flush=True)
        finally:
            eng.close()


def bench_prefix(args) -> None:
    from engine.sampling_params import SamplingParams
    dp = max(args.dp)
    if dp < 2:
        print("prefix routing: needs --dp with a size >= 2")
        return
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.prefix_max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    results = {}
    for routing in ("round_robin", "prefix"):
        eng = _engine(args, dp, routing=routing, num_blocks=args.prefix_num_blocks,
                      max_load_imbalance=args.max_load_imbalance)
        try:
            vocab = [t for t in range(10, 250)]
            plen = args.prefix_blocks * eng.block_size
            systems = [[rng.choice(vocab) for _ in range(plen)] for _ in range(args.prefixes)]
            work = [s + [rng.choice(vocab) for _ in range(8)] for s in systems for _ in range(args.per_prefix)]
            random.Random(2).shuffle(work)
            eng.reset_prefix_cache()
            before = eng.metrics_snapshot()
            dt, n, _ = _wave(eng, work, params, args.concurrency)
            after = eng.metrics_snapshot()
            hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
            queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
            results[routing] = hits / max(queries, 1)
            per = {r: after["replicas"][r].get("dp_routed_requests", 0) - before["replicas"][r].get(
                "dp_routed_requests", 0) for r in after["replicas"]}
            print(f"prefix workload ({args.prefixes} prefixes x {args.per_prefix}, {plen}-token prefixes, DP={dp}, "
                  f"c={args.concurrency}) routing {routing:11s}: hit rate {results[routing]:.3f} "
                  f"({hits}/{queries} tokens), routed {per}, {len(work) / dt:.1f} req/s", flush=True)
        finally:
            eng.close()
    rr = results["round_robin"]
    print(f"prefix-aware / round-robin hit rate: {results['prefix'] / rr if rr else float('inf'):.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--backend", choices=("mp", "ray"), default="mp")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2], help="data-parallel sizes (first = baseline)")
    p.add_argument("--concurrency", "-c", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=64)
    p.add_argument("--prefix-blocks", type=int, default=8, help="full KV blocks per system prompt")
    p.add_argument("--prefix-max-tokens", type=int, default=4)
    p.add_argument("--prefix-num-blocks", type=int, default=None,
                   help="KV blocks per replica for the prefix workload (default: the engine's pool). Routing shows "
                        "in the hit rate when one replica's pool cannot hold every system prompt")
    p.add_argument("--max-load-imbalance", type=int, default=None,
                   help="prefix routing: a replica more than this many unfinished requests above the least loaded "
                        "one is passed over (default: the engine's, max(8, max_num_seqs // 2))")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    args = p.parse_args(argv)
    if not args.skip_decode:
        bench_decode(args)
    if not args.skip_prefix:
        bench_prefix(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
