"""Engine-only vs served output tok/s on the same prompts (issue 12, "the server's path").

    python -m perf.bench_engine_vs_served --mode engine --num-prompts 16 --input-len 64 --output-len 64 --rounds 3
    python -m perf.bench_engine_vs_served --mode async  ...   # AsyncEngine + one consumer thread per request
    python -m perf.bench_engine_vs_served --mode served --base-url http://127.0.0.1:8000/v1 ...

Every mode sends one wave of --num-prompts requests at once (concurrency = num-prompts), built exactly as
perf/bench_serving.py builds them (random token texts of --input-len tokens, seed = --seed + round, so no
round hits the prefix cache of an earlier one), greedy, `ignore_eos`, --output-len tokens each, and reports
output tok/s = tokens generated / wall time from the first submission to the last token (bench_serving's
"Output token throughput"), so the three modes are directly comparable:
  engine  LLMEngine.add_request for all, then step() until done, in this thread (the engine's own figure,
          detokenisation included);
  async   engine.async_engine.AsyncEngine (the server's engine thread) with one reader thread per request,
          as the server's handler threads read their streams (no HTTP);
  served  perf.bench_serving against a running server (`python -m server`), concurrency = num-prompts.
The 1-minute load average is printed with every round (the host is shared: compare ratios within a session).
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


def _prompts(args, rnd: int) -> list:
    from perf.bench_serving import load_tokenizer, random_prompts
    return random_prompts(load_tokenizer(None), args.num_prompts, args.input_len, args.seed + rnd)


def _params(args):
    from engine.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)


def run_engine(args, engine, rnd: int) -> float:
    prompts = _prompts(args, rnd)
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{rnd}-{i}", p, _params(args))
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.monotonic() - t0)


def run_async(args, aengine, rnd: int) -> float:
    prompts = _prompts(args, rnd)
    counts = [0] * len(prompts)

    def reader(i, prompt):
        stream = aengine.submit(f"a{rnd}-{i}", prompt, _params(args))
        for out in stream:
            if out.finished:
                counts[i] = len(out.outputs[0].token_ids)

    threads = [threading.Thread(target=reader, args=(i, p)) for i, p in enumerate(prompts)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def run_served(args, rnd: int) -> float:
    from perf import bench_serving
    ns = bench_serving.build_parser().parse_args([
        "--base-url", args.base_url, "--num-prompts", str(args.num_prompts), "--concurrency", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed + rnd),
        "--warmup", "0", "-q"])
    rep = bench_serving.run_benchmark(ns)
    if rep["failed_requests"]:
        raise SystemExit(f"{rep['failed_requests']} requests failed: {rep['errors']}")
    return rep["output_throughput"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("engine", "async", "served"), required=True)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=100, help="round r uses seed + r (round 0 is an unmeasured warm-up)")
    args = ap.parse_args(argv)

    engine = aengine = None
    if args.mode in ("engine", "async"):
        from engine.llm_engine import EngineArgs, LLMEngine
        engine = LLMEngine(EngineArgs())
        if args.mode == "async":
            from engine.async_engine import AsyncEngine
            aengine = AsyncEngine(engine=engine)
    results = []
    for rnd in range(args.rounds + 1):
        load = os.getloadavg()[0]
        if args.mode == "engine":
            tps = run_engine(args, engine, rnd)
        elif args.mode == "async":
            tps = run_async(args, aengine, rnd)
        else:
            tps = run_served(args, rnd)
        tag = "warm-up" if rnd == 0 else f"round {rnd}"
        print(f"{args.mode} {tag}: {tps:.1f} output tok/s (load {load:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
        if rnd:
            results.append(tps)
    print(f"{args.mode}: c={args.num_prompts} in={args.input_len} out={args.output_len}: best {max(results):.1f} "
          f"median {statistics.median(results):.1f} output tok/s over {len(results)} rounds")
    if aengine is not None:
        aengine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
