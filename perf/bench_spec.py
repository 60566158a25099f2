"""Speculative decoding on an input-grounded task: decode tok/s at concurrency 1 with and without n-gram
prompt lookup on the embedded SmolLM2 (greedy; the tokens are asserted identical).

    .venv/bin/python -m perf.bench_spec                       # k = 4, prompt_lookup 2..4, 3 runs per task
    .venv/bin/python -m perf.bench_spec --k 3 5 --runs 5 --max-tokens 160

Decode tok/s of one request = (output tokens - 1) / (last token time - first token time), i.e. without the
prefill; reported as best-of and median over the runs (after one warm-up run per engine and task).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

TEXT = ("The village of Alderbrook sits at the bend of a slow river, where the old stone mill still turns on "
        "market days. Every spring the townspeople repaint the bridge in a new colour, argue about the choice "
        "for a month, and then forget about it until the next year. The baker opens at five in the morning, "
        "the post office closes at noon on Saturdays, and the library keeps a shelf of maps that nobody has "
        "borrowed since 1987. Visitors say the place feels unchanged, but the people who live there know that "
        "the river has moved a little closer to the mill every decade.")
EDIT_TEXT = ("Our team recieved the new laptops on monday. Most of them works fine, but three of them has a "
             "broken keyboard and one dont turn on at all. We have allready contacted the supplier and they "
             "promised to send replacements before the end of the week.")
TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "edit": "Correct the grammar and spelling mistakes in the following paragraph. Reply with the corrected "
            "paragraph only.\n\n" + EDIT_TEXT,
}


def _decode_rate(out) -> tuple:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return n, (n - 1) / max(m.last_token_time - m.first_token_time, 1e-9)


def run(k_values, runs: int, max_tokens: int, lookup_min: int, lookup_max: int) -> list:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    configs = [("off", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max})
                                 for k in k_values]
    results = []
    reference = {}
    for name, spec in configs:
        llm = LLM(speculative_config=spec)
        try:
            for task, text in TASKS.items():
                ids = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
                llm.generate([ids], sp)          # warm-up (kernels, graphs)
                rates, toks = [], None
                for _ in range(runs):
                    out = llm.generate([ids], sp)[0]
                    n, rate = _decode_rate(out)
                    rates.append(rate)
                    toks = out.outputs[0].token_ids
                if spec is None:
                    reference[task] = toks
                else:
                    assert toks == reference[task], f"{name} {task}: tokens differ from speculation off"
                snap = llm.engine.metrics_snapshot()
                row = {"config": name, "task": task, "prompt_tokens": len(ids), "output_tokens": len(toks),
                       "best_tok_s": max(rates), "median_tok_s": statistics.median(rates)}
                if spec is not None:
                    row["acceptance"] = snap["spec_decode_num_accepted_tokens"] / \
                        max(snap["spec_decode_num_draft_tokens"], 1)
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            llm.close()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.bench_spec", description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens values (default 4)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    args = p.parse_args(argv)
    t0 = time.time()
    res = run(args.k, args.runs, args.max_tokens, args.lookup_min, args.lookup_max)
    off = {r["task"]: r for r in res if r["config"] == "off"}
    print(f"| task | config | output tokens | decode tok/s best | median | speed-up (best) | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        base = off[r["task"]]
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
        print(f"| {r['task']} | {r['config']} | {r['output_tokens']} | {r['best_tok_s']:.1f} | {r['median_tok_s']:.1f} "
              f"| {r['best_tok_s'] / base['best_tok_s']:.2f}x | {acc} |")
    print(f"\n(load average {os.getloadavg()[0]:.2f} at the end; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
