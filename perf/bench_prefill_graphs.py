"""Prefill steps replayed as graphs (engine/prefill_graphs.py) vs launched from Python, on the same engine.

    .venv/bin/python perf/bench_prefill_graphs.py [--lengths 37,512] [--prompts 6] [--rounds 3] [--model M]

For each prompt length: two engines (graphs on / off), each warmed up on prompts of that length (so the
bucket's graph is recorded and every kernel compiled), then --rounds rounds of --prompts fresh random prompts,
one at a time, each producing one token (the prefill step alone: the prefix cache is off). Reported per
engine: prompt tokens / wall second (best round and median), and the process CPU seconds per prompt (user +
system of this process, all threads): on a shared host the CPU time counts the work done whatever the load,
where wall time also counts the waiting. The two engines' greedy first tokens are compared (they must agree).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="37,512")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    import numpy as np

    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for L in [int(x) for x in args.lengths.split(",")]:
        res = {}
        firsts = {}
        for graphs in (True, False):
            eng = LLMEngine(EngineArgs(model=args.model, use_graphs=graphs,
                                       max_num_batched_tokens=args.max_num_batched_tokens))
            vocab = eng.config.vocab_size
            rs = np.random.default_rng(L)             # the same prompts for both engines

            def run(prompt, tag):
                eng.add_request(tag, prompt, sp)
                out = None
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        if o.finished:
                            out = o.outputs[0].token_ids
                return out
            for i in range(2):
                run(rng.integers(0, vocab, L).tolist(), f"warm{i}")
            walls, cpus, toks = [], [], []
            for r in range(args.rounds):
                ps = [rs.integers(0, vocab, L).tolist() for _ in range(args.prompts)]
                t0, c0 = time.perf_counter(), time.process_time()
                for j, p in enumerate(ps):
                    toks.append(run(p, f"r{r}-{j}"))
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            firsts[graphs] = toks
            n = args.prompts * L
            res[graphs] = (n / min(walls), n / statistics.median(walls), min(cpus) / args.prompts * 1e3,
                           getattr(eng.runner.prefill_graphs, "replays", 0))
            eng.close()
        print(f"\nprefill, {L}-token prompts ({args.prompts} prompts x {args.rounds} rounds), load "
              f"{os.getloadavg()[0]:.2f}")
        print("engine        tok/s best  tok/s median  CPU ms/prompt (best)  prefill graph replays")
        for g in (True, False):
            b, m, c, rp = res[g]
            print(f"{'graphs' if g else 'eager':12s} {b:11.1f} {m:13.1f} {c:21.1f} {rp:22d}")
        print(f"graphs / eager: {res[True][0] / res[False][0]:.2f}x best tok/s, "
              f"{res[True][1] / res[False][1]:.2f}x median, {res[False][2] / res[True][2]:.2f}x less CPU time")
        print("same first tokens:", firsts[True] == firsts[False])


if __name__ == "__main__":
    main()
