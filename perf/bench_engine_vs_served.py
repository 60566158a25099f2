"""Engine-only vs served output tok/s on the same prompts (issue 12, "the server's path").

    python -m perf.bench_engine_vs_served --mode engine --num-prompts 16 --input-len 64 --output-len 64 --rounds 3
    python -m perf.bench_engine_vs_served --mode async  ...   # AsyncEngine + one consumer thread per request
    python -m perf.bench_engine_vs_served --mode served --base-url http://127.0.0.1:8000/v1 ...
    python -m perf.bench_engine_vs_served --mode compare --rounds 5    # all three side by side (below)

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
  compare starts `python -m server` and llama.cpp's C++ `llama-server` (not with --no-peer) (`make peer-server` builds it into
          .peers/llama-server; --llama-server PATH) on the same embedded SmolLM2 GGUF, both with
          --threads threads (default 2; our in-process engine too, through JITKERN_NUM_THREADS), llama-server
          with `--parallel num-prompts` (its continuous batching) and a context of num-prompts x (input +
          output + 64) tokens; then every round measures ours engine-only, ours served and llama-server
          served (streaming /v1/completions, concurrency num-prompts), in a rotating order so the host's
          load drifts over all three alike, and prints them side by side (best-of and median).
The 1-minute load average is printed with every round (the host is shared: compare ratios within a session).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc, url: str, name: str, timeout: float) -> None:
    """Polls url until it answers 200 (the server has loaded its model) or the process exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with code {proc.returncode} before it was ready (see its log above)")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{name} not ready after {timeout:.0f} s ({url})")


def _default_llama_server() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, ".peers", "llama-server")


def start_servers(args) -> dict:
    """name -> (Popen, base_url) of our server and llama-server, both ready."""
    from engine.default_model import default_model_path
    gguf = args.gguf or str(default_model_path())
    if not args.no_peer and not os.path.isfile(args.llama_server):
        raise SystemExit(f"--llama-server: {args.llama_server}: no such file (build it with `make peer-server`)")
    env = dict(os.environ, JITKERN_NUM_THREADS=str(args.threads))
    procs = {}
    try:
        p1 = _free_port()
        procs["ours served"] = (subprocess.Popen(
            [sys.executable, "-m", "server", "--model", gguf, "--host", "127.0.0.1", "--port", str(p1),
             "--disable-log-requests"], env=env, stdout=subprocess.DEVNULL), f"http://127.0.0.1:{p1}/v1")
        if not args.no_peer:
            p2 = _free_port()
            ctx = args.num_prompts * (args.input_len + args.output_len + 64)
            procs["llama-server"] = (subprocess.Popen(
                [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(p2), "--parallel",
                 str(args.num_prompts), "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads),
                 "--no-webui", "--log-disable"], stdout=subprocess.DEVNULL), f"http://127.0.0.1:{p2}/v1")
        for name, (proc, url) in procs.items():     # /health: 200 once the model is loaded (503 before)
            _wait_ready(proc, url[:-len("/v1")] + "/health", name, args.start_timeout)
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: dict) -> None:
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_compare(args) -> int:
    os.environ["JITKERN_NUM_THREADS"] = str(args.threads)     # before the engine loads the kernel pool
    procs = start_servers(args)
    try:
        from engine.llm_engine import EngineArgs, LLMEngine
        engine = LLMEngine(EngineArgs(model=args.gguf))
        systems = ["ours engine-only", "ours served"] + ([] if args.no_peer else ["llama-server"])
        results = {s: [] for s in systems}
        loads = []
        for rnd in range(args.rounds + 1):
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            line = []
            for name in order:
                load = os.getloadavg()[0]
                if name == "ours engine-only":
                    tps = run_engine(args, engine, rnd)
                else:
                    args.base_url = procs[name][1]
                    tps = run_served(args, rnd)
                line.append(f"{name} {tps:.1f}")
                if rnd:
                    results[name].append(tps)
                    loads.append(load)
            tag = "warm-up" if rnd == 0 else f"round {rnd}"
            print(f"{tag}: " + ", ".join(line) + f" output tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
        eng = results["ours engine-only"]
        print(f"\nc={args.num_prompts} streaming, in={args.input_len} out={args.output_len}, {args.threads} threads, "
              f"{args.rounds} rounds, load average {min(loads):.2f}-{max(loads):.2f}")
        print("| system | output tok/s best | median | best / ours engine-only best | median / median |")
        print("|---|---|---|---|---|")
        for name in systems:
            r = results[name]
            print(f"| {name} | {max(r):.1f} | {statistics.median(r):.1f} | {max(r) / max(eng):.2f} | "
                  f"{statistics.median(r) / statistics.median(eng):.2f} |")
        if args.no_peer:
            return 0
        ours, peer = results["ours served"], results["llama-server"]
        print(f"\nours served / llama-server: best {max(ours) / max(peer):.2f}x, median "
              f"{statistics.median(ours) / statistics.median(peer):.2f}x")
    finally:
        stop_servers(procs)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("engine", "async", "served", "compare"), required=True)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=100, help="round r uses seed + r (round 0 is an unmeasured warm-up)")
    ap.add_argument("--llama-server", default=_default_llama_server(),
                    help="compare: the llama-server binary (default .peers/llama-server, from `make peer-server`)")
    ap.add_argument("--no-peer", action="store_true",
                    help="compare: ours engine-only and ours served only (no llama-server)")
    ap.add_argument("--gguf", default=None, help="compare: the model both serve (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2, help="compare: threads of every system (default 2)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="compare: seconds to wait for a server")
    args = ap.parse_args(argv)
    if args.mode == "compare":
        return run_compare(args)

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
