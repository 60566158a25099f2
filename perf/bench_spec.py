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
             "promised to send replacements before the end of the week. In the meantime, the people who's laptop "
             "is broken can borrow one of the old machines from the storage room, which are slow but still usefull. "
             "Please remember to copy you're files to the shared drive before you returns a broken laptop, because "
             "the supplier will erase the disk. If you has any questions, ask Maria or me, we are happy to help "
             "every one of you get started with the new equipment as quick as possible.")
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
    """All engines loaded side by side and run in turns (round -> config -> task), so that a shared host's
    load falls on every configuration alike."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    configs = [("off", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max})
                                 for k in k_values]
    llms = {name: LLM(speculative_config=spec) for name, spec in configs}
    try:
        tok = llms["off"].tokenizer
        prompts = {task: tok.encode_chat([{"role": "user", "content": text}]) for task, text in TASKS.items()}
        rates = {(name, task): [] for name in llms for task in TASKS}
        counts = {(name, task): {} for name in llms for task in TASKS}
        tokens = {}
        for rnd in range(runs + 1):                   # round 0 warms up (kernels, graphs)
            for name, llm in llms.items():
                for task, ids in prompts.items():
                    before = llm.engine.metrics_snapshot()
                    out = llm.generate([ids], sp)[0]
                    after = llm.engine.metrics_snapshot()
                    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                "spec_decode_num_accepted_tokens"):
                        if key in after:
                            counts[(name, task)][key] = counts[(name, task)].get(key, 0) + after[key] - before[key]
                    toks = out.outputs[0].token_ids
                    ref = tokens.setdefault(task, toks)
                    assert toks == ref, f"{name} {task}: tokens differ from speculation off"
                    if rnd:
                        rates[(name, task)].append(_decode_rate(out)[1])
        results = []
        for (name, task), r in rates.items():
            row = {"config": name, "task": task, "prompt_tokens": len(prompts[task]),
                   "output_tokens": len(tokens[task]), "best_tok_s": max(r), "median_tok_s": statistics.median(r)}
            snap = counts[(name, task)]
            if "spec_decode_num_draft_tokens" in snap:
                row["acceptance"] = snap["spec_decode_num_accepted_tokens"] / max(snap["spec_decode_num_draft_tokens"], 1)
                row["tokens_per_step"] = 1 + snap["spec_decode_num_accepted_tokens"] / max(snap["spec_decode_num_drafts"], 1)
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        return results
    finally:
        for llm in llms.values():
            llm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.bench_spec", description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens values (default 4)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    args = p.parse_args(argv)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    res = run(args.k, args.runs, args.max_tokens, args.lookup_min, args.lookup_max)
    off = {r["task"]: r for r in res if r["config"] == "off"}
    print("| task | config | output tokens | decode tok/s best | median | speed-up best / median | acceptance | tokens per step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res:
        base = off[r["task"]]
        acc = f"{r['acceptance']:.2f} | {r['tokens_per_step']:.2f}" if "acceptance" in r else "- | 1"
        print(f"| {r['task']} | {r['config']} | {r['output_tokens']} | {r['best_tok_s']:.1f} | {r['median_tok_s']:.1f} "
              f"| {r['best_tok_s'] / base['best_tok_s']:.2f}x / {r['median_tok_s'] / base['median_tok_s']:.2f}x | {acc} |")
    print(f"\n(load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
