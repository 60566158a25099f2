"""Speculative decoding on an input-grounded task: decode tok/s at concurrency 1 with and without n-gram
prompt lookup on the embedded SmolLM2 (greedy; the tokens are asserted identical).

    .venv/bin/python -m perf.bench_spec                       # k = 7, prompt_lookup 2..4, 3 runs per task
    .venv/bin/python -m perf.bench_spec --k 3 7 --runs 5 --max-tokens 160 --tasks edit summarise

Each k runs twice: "ngram k=K" with adaptive drafting (engine/spec_decode.py: per-request draft levels and
n-gram re-anchoring, the default) and "ngram k=K fixed" (always K drafts, plain most-recent lookup), beside
speculation off, in the same rounds.

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
EMAIL = ("Hi all, the quarterly review meeting has been moved from Thursday the 12th to Friday the 13th at 10 am, "
         "in the large conference room on the third floor. Please bring the updated sales figures for your region, "
         "the list of open customer issues, and your plans for the next quarter. Lunch will be provided after the "
         "meeting. If you cannot attend, send your report to Daniel by Wednesday evening so that he can present it "
         "for you. Thanks, Laura")
TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "edit": "Correct the grammar and spelling mistakes in the following paragraph. Reply with the corrected "
            "paragraph only.\n\n" + EDIT_TEXT,
    "summarise": "Summarise the following text in three sentences.\n\n" + TEXT,
    "summarise-email": "Summarise this email in two sentences.\n\n" + EMAIL,
}
DEFAULT_TASKS = ("repeat", "edit")


def _decode_rate(out) -> tuple:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return n, (n - 1) / max(m.last_token_time - m.first_token_time, 1e-9)


def _time_steps(llm, step_times: dict) -> None:
    """Records the model runner's time per decode step of one sequence by its token count (1: a plain decode
    step, 1 + d: a verification of d drafts), for the cost of verification relative to a decode step."""
    runner = llm.engine.runner
    orig = runner.execute

    def execute(sched):
        t0 = time.perf_counter()
        res = orig(sched)
        dt = time.perf_counter() - t0
        if len(sched.scheduled) == 1 and not sched.scheduled[0].is_prefill:
            step_times.setdefault(sum(s.num_tokens for s in sched.scheduled), []).append(dt)
        return res
    runner.execute = execute


def run(k_values, runs: int, max_tokens: int, lookup_min: int, lookup_max: int, tasks=DEFAULT_TASKS,
        fixed: bool = True, step_times: dict | None = None, halve: bool = False, backoffs=(),
        no_anchor: bool = False) -> list:
    """All engines loaded side by side and run in turns (round -> config -> task), so that a shared host's
    load falls on every configuration alike."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    configs = [("off", None, True)]
    for k in k_values:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
                "prompt_lookup_max": lookup_max}
        configs.append((f"ngram k={k}", spec, True))
        for b in (["halve"] if halve else []) + [b for b in backoffs if not (halve and b == "halve")]:
            configs.append((f"ngram k={k} {b}", spec, b))
        if no_anchor:
            configs.append((f"ngram k={k} no-anchor", spec, "no-anchor"))
        if fixed:
            configs.append((f"ngram k={k} fixed", spec, False))
    llms = {}
    for name, spec, adaptive in configs:
        llms[name] = LLM(speculative_config=spec)
        if spec is not None:
            llms[name].engine.spec.adaptive = bool(adaptive)
            if adaptive == "no-anchor":
                llms[name].engine.spec.anchoring = False
            elif isinstance(adaptive, str):
                llms[name].engine.spec.backoff = adaptive
        if step_times is not None:
            _time_steps(llms[name], step_times)
    try:
        tok = llms["off"].tokenizer
        prompts = {task: tok.encode_chat([{"role": "user", "content": TASKS[task]}]) for task in tasks}
        rates = {(name, task): [] for name in llms for task in prompts}
        counts = {(name, task): {} for name in llms for task in prompts}
        tokens = {}
        for rnd in range(runs + 1):                   # round 0 warms up (kernels, graphs)
            if rnd == 1 and step_times is not None:
                step_times.clear()
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
                # over every decode step (verification steps and the plain ones of requests without a match)
                decoded = (len(tokens[task]) - 1) * (runs + 1)
                row["tokens_per_decode_step"] = decoded / max(decoded - snap["spec_decode_num_accepted_tokens"], 1)
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        return results
    finally:
        for llm in llms.values():
            llm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.bench_spec", description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[7], help="num_speculative_tokens values (default 7)")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=sorted(TASKS))
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed-k (non-adaptive) configurations")
    p.add_argument("--halve", action="store_true",
                   help="also run adaptive drafting with backoff \"halve\" (\"ngram k=K halve\"; the plain \"ngram k=K\" "
                        "row takes JITKERN_SPEC_BACKOFF / the default)")
    p.add_argument("--backoffs", nargs="*", default=[], choices=("halve", "reset", "keep"),
                   help="also run adaptive drafting with each of these backoffs (\"ngram k=K <backoff>\")")
    p.add_argument("--no-anchor", action="store_true",
                   help="also run adaptive drafting without n-gram re-anchoring (\"ngram k=K no-anchor\")")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    args = p.parse_args(argv)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    step_times: dict = {}
    res = run(args.k, args.runs, args.max_tokens, args.lookup_min, args.lookup_max, args.tasks, not args.no_fixed,
              step_times, halve=args.halve, backoffs=args.backoffs, no_anchor=args.no_anchor)
    off = {r["task"]: r for r in res if r["config"] == "off"}
    print("| task | config | output tokens | decode tok/s best | median | speed-up best / median | acceptance "
          "| tokens per verification step | tokens per decode step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res:
        base = off[r["task"]]
        acc = (f"{r['acceptance']:.2f} | {r['tokens_per_step']:.2f} | {r['tokens_per_decode_step']:.2f}"
               if "acceptance" in r else "- | - | 1")
        print(f"| {r['task']} | {r['config']} | {r['output_tokens']} | {r['best_tok_s']:.1f} | {r['median_tok_s']:.1f} "
              f"| {r['best_tok_s'] / base['best_tok_s']:.2f}x / {r['median_tok_s'] / base['median_tok_s']:.2f}x | {acc} |")
    if 1 in step_times:
        base = statistics.median(step_times[1])
        print("\nModel runner time per decode step of one sequence, by tokens in the step (1: plain decode, "
              "1 + d: verification of d drafts), all configurations and rounds after the warm-up:\n")
        print("| tokens in the step | steps | median ms | best ms | median / 1-token median |")
        print("|---|---|---|---|---|")
        for n in sorted(step_times):
            v = step_times[n]
            print(f"| {n} | {len(v)} | {1e3 * statistics.median(v):.2f} | {1e3 * min(v):.2f} | "
                  f"{statistics.median(v) / base:.2f} |")
    print(f"\n(load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
