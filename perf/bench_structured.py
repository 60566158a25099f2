"""Structured outputs: what masking costs per decoded token, on the embedded SmolLM2 (or --model).

    .venv/bin/python perf/bench_structured.py [--model M] [--concurrency 1,8] [--max-tokens 160] [--repeats 3]
        [--json out.json]

For each concurrency c, c requests of the same prompts run greedy, three ways, in turns (free, json,
json + jump-forward) for --repeats rounds:
  free       unconstrained, ignore_eos, max_tokens = the number of tokens the json run produced (so both
             decode the same number of tokens),
  json       response_format-style JSON schema (an array of 10 {name, qty} objects: long, realistic
             output), masks computed per step for every request after the forward pass (the default),
  json-prefetch  the same with Sampler.prefetch_masks on (the next mask computed on a background thread
             while the forward pass runs),
  json+jf    the same with --enable-jump-forward (tokens the grammar forces are appended without a step).
Decode tok/s = output tokens after each request's first / (time of the last token - time of the first
token of the wave), aggregated over the c streams: prefill is left out. Reported per mode: the best and
median round, the ratio to free decoding (goal: json >= 0.90x), and the time spent in the mask path per
constrained token (fill_masks = llguidance computing the bitmask; apply = -inf into the logits row;
advance = consuming the sampled token), measured by wrapping those functions.

The host is shared: compare numbers within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {"type": "object",
          "properties": {"items": {"type": "array", "minItems": 10, "maxItems": 10,
                                   "items": {"type": "object",
                                             "properties": {"name": {"type": "string", "maxLength": 24},
                                                            "qty": {"type": "integer", "minimum": 0,
                                                                    "maximum": 999}},
                                             "required": ["name", "qty"], "additionalProperties": False}}},
          "required": ["items"], "additionalProperties": False}
PROMPTS = ["List ten things to buy at a grocery store, as JSON.",
           "Give me an inventory of a small bakery in JSON.",
           "Write a JSON list of office supplies and how many we have.",
           "Ten fruits and their quantities, in JSON:",
           "A hardware store's stock, as JSON:",
           "JSON list of books on my shelf with counts:",
           "Camping gear checklist as JSON with quantities:",
           "Pantry contents as JSON:"]


class Timers:
    """Wraps the mask path's functions and sums their wall time."""

    def __init__(self):
        self.t = {"fill_masks": 0.0, "apply": 0.0, "advance": 0.0}

    def install(self):
        import engine.structured_outputs as so
        import engine.sampler as sampler_mod
        orig_fill, orig_apply = so.fill_masks, so.apply_bitmask
        orig_adv = sampler_mod.Sampler._advance_grammars
        timers = self.t

        def fill(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig_fill(*a, **k)
            finally:
                timers["fill_masks"] += time.perf_counter() - t0

        def apply(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig_apply(*a, **k)
            finally:
                timers["apply"] += time.perf_counter() - t0

        def adv(self_, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig_adv(self_, *a, **k)
            finally:
                timers["advance"] += time.perf_counter() - t0
        so.fill_masks, so.apply_bitmask = fill, apply
        sampler_mod.Sampler._advance_grammars = adv

    def reset(self):
        for k in self.t:
            self.t[k] = 0.0


def run_wave(engine, prompts, params_list, tag):
    """(decode tokens, decode seconds, total output tokens, outputs) for one wave, prefill excluded."""
    from engine.sampling_params import SamplingParams  # noqa: F401
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params_list):
        engine.add_request(rid, p, sp)
    first, last, counts, final = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = (now, n)
            if n:
                last[o.request_id] = now
            counts[o.request_id] = n
            if o.finished:
                final[o.request_id] = o
    start = max(t for t, _ in first.values())      # every request has its first token: prefill is over
    end = max(last.values())
    decode_tokens = sum(counts[r] - first[r][1] for r in ids)
    return decode_tokens, end - start, sum(counts.values()), [final[r] for r in ids]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", default="free,json,json-prefetch,json+jf", help="which modes to run (free always)")
    args = ap.parse_args(argv)
    conc = sorted({int(c) for c in args.concurrency.split(",")})
    modes = set(args.modes.split(",")) | {"free", "json"}
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    import jsonschema
    timers = Timers()
    timers.install()
    engines = {"plain": LLMEngine(EngineArgs(model=args.model, max_num_seqs=max(conc)))}
    if "json+jf" in modes:
        engines["jf"] = LLMEngine(EngineArgs(model=args.model, max_num_seqs=max(conc), enable_jump_forward=True))
    so = {"json": SCHEMA}
    results = {}
    # warm-up: compiles the kernels for every batch size used, builds the llguidance tokenizer
    for c in conc:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
        for eng in engines.values():
            run_wave(eng, prompts, [SamplingParams(max_tokens=8, temperature=0, structured_outputs=so)] * c, "warm")
            run_wave(eng, prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * c, "warm2")
    for c in conc:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
        rows = {m: [] for m in ("free", "json", "json-prefetch", "json+jf") if m in modes}
        mask_us = []
        for r in range(args.repeats):
            timers.reset()
            dt, secs, total, outs = run_wave(engines["plain"], prompts, [
                SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=so)] * c, f"j{c}-{r}")
            for o in outs:
                if o.outputs[0].finish_reason == "stop":
                    jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
            spent = dict(timers.t)
            mask_us.append({k: 1e6 * v / max(total, 1) for k, v in spent.items()})
            rows["json"].append(dt / secs)
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            free_params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            dt, secs, _, _ = run_wave(engines["plain"], prompts, free_params, f"f{c}-{r}")
            rows["free"].append(dt / secs)
            if "json-prefetch" in modes:
                engines["plain"].sampler.prefetch_masks = True
                dt, secs, _, _ = run_wave(engines["plain"], prompts, [
                    SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=so)] * c, f"s{c}-{r}")
                engines["plain"].sampler.prefetch_masks = False
                rows["json-prefetch"].append(dt / secs)
            if "json+jf" in modes:
                dt, secs, _, outs = run_wave(engines["jf"], prompts, [
                    SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=so)] * c, f"jf{c}-{r}")
                rows["json+jf"].append(dt / secs)
        free_best = max(rows["free"])
        free_med = statistics.median(rows["free"])
        res = {}
        for mode, vals in rows.items():
            res[mode] = {"best": max(vals), "median": statistics.median(vals),
                         "ratio_best": max(vals) / free_best, "ratio_median": statistics.median(vals) / free_med}
        res["mask_us_per_token"] = {k: statistics.median(m[k] for m in mask_us) for k in mask_us[0]}
        res["json_tokens_per_request"] = statistics.mean(lengths)
        results[c] = res
        print(f"\nconcurrency {c} (json output ~{res['json_tokens_per_request']:.0f} tokens per request)")
        print("| mode | decode tok/s best / median | vs free best / median |")
        print("|---|---|---|")
        for mode in rows:
            v = res[mode]
            print(f"| {mode} | {v['best']:.1f} / {v['median']:.1f} | {v['ratio_best']:.2f}x / {v['ratio_median']:.2f}x |")
        m = res["mask_us_per_token"]
        print(f"mask path per constrained token (json, median round): fill_masks {m['fill_masks']:.0f} us, "
              f"apply {m['apply']:.0f} us, advance {m['advance']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for eng in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
