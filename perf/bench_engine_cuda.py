"""The engine on CPU vs CUDA for one model: greedy text, teacher-forced NLL, decode tok/s (CUDA with and
without decode graphs). First numbers for the GPU engine, not a tuned benchmark.

    python perf/bench_engine_cuda.py [--model FILE_OR_DIR] [--tokens 64] [--batch 1 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a wooden screw press into a system that could produce books "
        "quickly and cheaply. Within a few decades printing shops had spread across Europe.")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "To make a cup of tea,", "In 1969, astronauts", "The quick brown fox", "Water boils at"]


def run(model, device, graphs, tokens, batches):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, num_blocks=512, block_size=16, max_num_batched_tokens=512, max_num_seqs=16, device=device,
              use_graphs=graphs)
    res = {"device": device, "graphs": graphs, "load_s": round(time.perf_counter() - t0, 2)}
    try:
        sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        res["greedy"] = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], sp)]
        ids = llm.tokenizer.encode(TEXT)
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False))
        plp = out[0].prompt_logprobs
        lps = [plp[i][ids[i]].logprob for i in range(1, len(ids))]
        res["nll"] = -sum(lps) / len(lps)
        res["_lps"] = lps
        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
        for b in batches:
            llm.generate(PROMPTS[:b], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm
            rates = []
            for _ in range(2):
                outs = llm.generate(PROMPTS[:b], sp)
                m = [o.metrics for o in outs]
                first = max(x.first_token_time for x in m)
                last = max(x.last_token_time for x in m)
                rates.append(b * (tokens - 1) / max(last - first, 1e-9))
            res[f"decode_tok_s_batch{b}"] = round(max(rates), 1)
    finally:
        llm.close()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json", default=None)
    p.add_argument("--devices", nargs="+", default=["cpu", "cuda-eager", "cuda"])
    a = p.parse_args()
    results = []
    for d in a.devices:
        dev, _, mode = d.partition("-")
        r = run(a.model, dev, mode != "eager", a.tokens, a.batch)
        if results:
            # per-token teacher-forced logprob differences against the first run (the CPU by default)
            diffs = [abs(x - y) for x, y in zip(r["_lps"], results[0]["_lps"])]
            r["max_token_logprob_diff_vs_first"] = max(diffs)
            r["nll_rel_diff_vs_first"] = abs(r["nll"] - results[0]["nll"]) / results[0]["nll"]
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}), flush=True)
        results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("_")} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
