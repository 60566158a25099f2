"""End-to-end greedy generation on one model folder: transformers (static cache, generate's own torch.compile)
vs the gpt-fast-style peer vs our engine, same prompts, same run, printing tok/s, TTFT and same-run ratios, and
whether our greedy tokens equal transformers' on the first prompt.

    python perf/bench_e2e_cuda.py --model DIR            # a transformers folder (perf/peers/make_random_model.py)
    python perf/bench_e2e_cuda.py --make llama3-8b --layers 8 [--keep DIR]   # writes a random one first
    python perf/bench_e2e_cuda.py --smoke --device cpu   # tiny model, every code path, on a CPU

Options: --concurrency 1 64 (prompts per batch; each batch is timed as one generate call), --input-len 128,
--output-len 128, --systems hf gpt_fast ours, --json FILE, --no-f32-check, --no-compile (peers eager),
--kv-cache-dtype auto|f32|f16 (ours; auto: the engine's default, f16 for 16-bit or quantised weights),
--compile-prefill (gpt-fast peer; e.g. for a TTFT run: --input-len 1024 --output-len 1 --concurrency 1).

Each system runs in its own subprocess (one model in GPU memory at a time; a crash or an LLVM abort in one does
not take the others down), loads the model, warms up on other prompts of the same shapes (compiles, CUDA graphs,
cuBLAS heuristics; 8 new tokens, transformers the full output-len: its static cache is sized by it), then times
--repeat generate calls (default 3) per concurrency and reports the median one (a single short call moves a few
percent between fresh processes): `c` random prompts of exactly input-len ids (equal lengths, no padding: the
torch peers run them as one batch), output-len new tokens each, greedy, EOS ignored. tok/s = c * output_len /
wall time of the call (prefill included); TTFT = time to the batch's first tokens (transformers: a separate
one-token call); decode tok/s = c * (output_len - 1) / (wall - TTFT).

Repeat wobble: the number of prompts whose greedy tokens changed between the timed calls. For ours it must be 0
(an error otherwise: the engine promises deterministic greedy output); for a peer it is printed next to its
numbers, which stay valid.

Token check: each system records its greedy tokens for prompt 0 (the first row of every batch). Ours is compared
with transformers bf16 and, by default, with transformers in float32 (the same weights upcast: our kernels keep
bf16 weights and compute in f32, so f32 is the oracle that should match; bf16 activations round differently
and random-weight logits are close together, so a bf16 mismatch after some tokens is expected). Ours at
concurrency 1 vs its own row 0 at the largest concurrency checks batch invariance.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEMS = ("hf", "gpt_fast", "ours", "ours_f32")
DEFAULT_SYSTEMS = ("hf", "gpt_fast", "ours")
# ours_f32: our engine with dtype="float32" (f32 activations as hi + lo parts on the matrix units; "ours" runs
# vLLM's dtype="auto": 16-bit matrix-unit inputs for a 16-bit checkpoint)
LABEL = {"hf": "transformers static", "gpt_fast": "gpt-fast-style peer", "ours": "jitkern engine",
         "ours_f32": "jitkern dtype=float32"}


# ------------------------------------------------------------------------------------------------- prompts
def make_prompts(vocab: int, concurrency: list[int], input_len: int, seed: int) -> dict:
    """{c: [c prompts of input_len ids]} for the timed runs and the warm-ups (other ids). Row 0 is the same
    prompt at every concurrency. Ids avoid 0 and 1 (unk / eos of the random tokenizer)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    top = max(concurrency)
    timed = rng.integers(2, vocab, (top, input_len)).tolist()
    warm = rng.integers(2, vocab, (top, input_len)).tolist()
    return {"timed": {str(c): timed[:c] for c in concurrency}, "warm": {str(c): warm[:c] for c in concurrency}}


# ------------------------------------------------------------------------------------------------- workers
def median_run(runs: list, strict: bool) -> dict:
    """Of `--repeat` timed calls of one shape, the one with the median wall time (the lower middle of an even
    count), its TTFT with it, and every call's wall time under "walls_s". Each run carries "tokens" (every
    prompt's greedy tokens; dropped here, only prompt 0's are kept). "wobble" counts the prompts whose tokens
    changed between the calls (same prompts, greedy). strict (ours: the engine promises determinism): any change
    is an error. Peers: the count is reported, not fatal (a peer's nondeterministic kernels are information
    about the peer; its timings are still valid)."""
    wobble = sum(any(r["tokens"][i] != runs[0]["tokens"][i] for r in runs[1:]) for i in range(len(runs[0]["tokens"])))
    if wobble and strict:
        raise RuntimeError(f"repeated timed calls gave different greedy tokens for {wobble} of "
                           f"{len(runs[0]['tokens'])} prompts")
    pick = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    pick = {k: v for k, v in pick.items() if k != "tokens"}
    return {**pick, "tokens0": runs[0]["tokens"][0], "walls_s": [r["wall_s"] for r in runs], "wobble": wobble,
            "prompts": len(runs[0]["tokens"])}


def _sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def worker_hf(a, prompts) -> dict:
    """transformers' own fast path: generate with a static KV cache, which makes generate torch.compile the
    decode step itself (mode reduce-overhead: CUDA graphs; prefill stays eager). --no-compile keeps the static
    cache and sets disable_compile. On a CPU generate does not compile (its own device check)."""
    import torch
    import transformers as tf
    t0 = time.perf_counter()
    model = tf.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(a.device).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.disable_compile = not a.compile
    res = {"load_s": time.perf_counter() - t0, "runs": {}}

    def gen(rows, n, **kw):
        ids = torch.tensor(rows, dtype=torch.long, device=a.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, **kw)
        return out[:, ids.shape[1]:].cpu()

    for c, rows in prompts["timed"].items():
        # warm-up at the timed length: the static cache is sized by max_new_tokens, and another size would make
        # the timed call recompile and re-record the decode graphs
        t0 = time.perf_counter()
        gen(prompts["warm"][c], a.output_len)
        _sync(a.device)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen(rows, 1)                    # one new token: prefill only (eager in generate), so TTFT
        _sync(a.device)
        ttft = time.perf_counter() - t0
        runs = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            toks = gen(rows, a.output_len)
            _sync(a.device)
            runs.append({"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "warmup_s": warm,
                         "tokens": toks.tolist()})
        res["runs"][c] = median_run(runs, strict=False)
    res["variant"] = ("static cache, generate's torch.compile (decode)"
                      if a.compile and hasattr(model, "_compiled_call") else "static cache, no compile")
    if a.f32_check:
        # the oracle only needs tokens: eager (no f32 recompile)
        model = model.float()
        first = prompts["timed"][str(min(a.concurrency))][:1]
        res["tokens0_f32"] = gen(first, a.output_len, disable_compile=True)[0].tolist()
    return res


def worker_gpt_fast(a, prompts) -> dict:
    import torch
    from perf.peers import gpt_fast
    t0 = time.perf_counter()
    model = gpt_fast.load(a.model, device=a.device, dtype=torch.bfloat16)
    res = {"load_s": time.perf_counter() - t0, "runs": {}}
    compile_ = a.compile and str(a.device).startswith("cuda")
    res["variant"] = "torch.compile reduce-overhead (CUDA graphs)" if compile_ else "eager"
    if compile_:
        torch._logging.set_logs(perf_hints=True)      # prints it if Inductor skips the CUDA graphs (and why)
    for c, rows in prompts["timed"].items():
        gen = gpt_fast.Generator(model, batch=int(c), max_len=a.input_len + a.output_len, compile=compile_,
                                 compile_prefill=compile_ and a.compile_prefill)
        t0 = time.perf_counter()
        try:
            gen.generate(torch.tensor(prompts["warm"][c]), min(a.output_len, 8))  # compiles, records the graph
        except Exception as e:      # noqa: BLE001 - a compile failure still leaves the eager peer to measure
            if not compile_:
                raise
            import traceback
            traceback.print_exc()
            compile_ = False
            res["variant"] = f"eager (torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
            gen = gpt_fast.Generator(model, batch=int(c), max_len=a.input_len + a.output_len)
            gen.generate(torch.tensor(prompts["warm"][c]), min(a.output_len, 8))
        warm = time.perf_counter() - t0
        runs = []
        for _ in range(a.repeat):
            toks, timing = gen.generate(torch.tensor(rows), a.output_len)
            runs.append({"wall_s": timing["total_s"], "ttft_s": timing["ttft_s"], "warmup_s": warm,
                         "tokens": toks.tolist()})
        res["runs"][c] = median_run(runs, strict=False)
        del gen
    return res


def worker_ours(a, prompts, dtype="auto") -> dict:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    top = max(a.concurrency)
    seq = a.input_len + a.output_len
    blocks_per_seq = -(-seq // 16)
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, block_size=16, num_blocks=top * blocks_per_seq + 64, max_num_seqs=top,
              max_model_len=seq + 16, enable_prefix_caching=False, kv_cache_dtype=a.kv_cache_dtype, dtype=dtype)
    res = {"load_s": time.perf_counter() - t0, "runs": {}, "variant": f"LLM(device={a.device!r}), "
           f"kv_cache_dtype={a.kv_cache_dtype} ({llm.engine.args.kv_cache_dtype}), dtype={dtype}"}
    try:
        sp = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True, detokenize=False)
        warm_sp = SamplingParams(max_tokens=min(a.output_len, 8), temperature=0, ignore_eos=True, detokenize=False)
        for c, rows in prompts["timed"].items():
            t0 = time.perf_counter()
            llm.generate(prompts["warm"][c], warm_sp)              # warm-up: kernels, decode graph of this batch
            warm = time.perf_counter() - t0
            runs = []
            for _ in range(a.repeat):
                start = time.monotonic()
                t0 = time.perf_counter()
                outs = llm.generate(rows, sp)
                wall = time.perf_counter() - t0
                first = max(o.metrics.first_token_time for o in outs)
                runs.append({"wall_s": wall, "ttft_s": first - start, "warmup_s": warm,
                             "tokens": [list(o.outputs[0].token_ids) for o in outs]})
            res["runs"][c] = median_run(runs, strict=True)
    finally:
        llm.close()
    return res


WORKERS = {"hf": worker_hf, "gpt_fast": worker_gpt_fast, "ours": worker_ours,
           "ours_f32": lambda a, prompts: worker_ours(a, prompts, dtype="float32")}


# ------------------------------------------------------------------------------------------------- report
def _agree(a, b) -> str:
    if a is None or b is None:
        return "n/a"
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return f"MISMATCH at token {i} (first {i} of {n} equal)"
    return f"match ({n}/{n})" if len(a) == len(b) else f"prefix match ({n}), lengths {len(a)} vs {len(b)}"


def report(results: dict, a) -> list[str]:
    lines = [f"{'system':<22} {'conc':>4} {'tok/s':>9} {'decode tok/s':>12} {'TTFT ms':>9} {'wall s':>7} "
             f"{'warm-up s':>9}  repeat wobble (prompts whose tokens changed between timed calls)"]
    for s in a.systems:
        r = results.get(s)
        if not r or "error" in r:
            lines.append(f"{LABEL[s]:<22} FAILED: {(r or {}).get('error', 'no result')}")
            continue
        for c in map(str, a.concurrency):
            x = r["runs"].get(c)
            if x is None:
                continue
            n = int(c) * a.output_len
            dec = int(c) * (a.output_len - 1) / max(x["wall_s"] - x["ttft_s"], 1e-9)
            x["tok_s"], x["decode_tok_s"] = n / x["wall_s"], dec
            wob = f"{x['wobble']}/{x['prompts']}" if "wobble" in x else ""
            lines.append(f"{LABEL[s]:<22} {c:>4} {x['tok_s']:9.1f} {dec:12.1f} {1e3 * x['ttft_s']:9.1f} "
                         f"{x['wall_s']:7.2f} {x.get('warmup_s', 0):9.1f}  {wob}")
    lines.append("same-run ratios (ours / peer, tok/s; TTFT as peer / ours: > 1 means ours is faster):")
    ours = results.get("ours", {}).get("runs", {})
    for peer in ("hf", "gpt_fast"):
        pr = results.get(peer, {}).get("runs", {})
        for c in map(str, a.concurrency):
            if c in ours and c in pr and "tok_s" in ours[c] and "tok_s" in pr[c]:
                dec = ours[c]["decode_tok_s"] / pr[c]["decode_tok_s"] if pr[c]["decode_tok_s"] else float("nan")
                lines.append(f"  vs {LABEL[peer]:<20} conc {c:>3}: tok/s {ours[c]['tok_s'] / pr[c]['tok_s']:6.3f}x"
                             f"  decode {dec:6.3f}x"
                             f"  TTFT {pr[c]['ttft_s'] / max(ours[c]['ttft_s'], 1e-9):6.3f}x")
    c1, ctop = str(min(a.concurrency)), str(max(a.concurrency))

    def toks(s, c=c1, key="tokens0"):
        r = results.get(s, {})
        return r.get(key) if key != "tokens0" else r.get("runs", {}).get(c, {}).get("tokens0")
    lines.append(f"greedy tokens of prompt 0 (concurrency {c1}, {a.output_len} tokens):")
    lines.append(f"  ours vs transformers f32:  {_agree(toks('ours'), toks('hf', key='tokens0_f32'))}")
    lines.append(f"  ours vs transformers bf16: {_agree(toks('ours'), toks('hf'))}")
    lines.append(f"  peer vs transformers bf16: {_agree(toks('gpt_fast'), toks('hf'))}")
    if ctop != c1:
        lines.append(f"  ours conc {c1} vs row 0 at conc {ctop} (batch invariance): "
                     f"{_agree(toks('ours'), toks('ours', ctop))}")
    return lines


# --------------------------------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a transformers checkpoint folder")
    src.add_argument("--make", help="write a random model of this shape first (llama3-8b, qwen3-8b, smollm2-135m)")
    ap.add_argument("--layers", type=int, default=None, help="with --make: keep the first N decoder layers")
    ap.add_argument("--keep", default=None, help="with --make: write the model here and keep it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "f32", "f16"))
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="run the peers eager (transformers: static cache, disable_compile)")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="also torch.compile the peer's prefill (dynamic shapes; for TTFT runs)")
    ap.add_argument("--no-f32-check", dest="f32_check", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed calls per concurrency, the median reported (default 3); ours must give the same "
                         "tokens in each, a peer's changes are counted and printed")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per system subprocess (default 300)")
    ap.add_argument("--smoke", action="store_true", help="tiny llama3-family model, 16 in / 8 out, conc 1 and 4")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {a.repeat}")
    if a.smoke:
        a.make = a.make or (None if a.model else "llama3-8b")
        a.input_len, a.output_len = min(a.input_len, 16), min(a.output_len, 8)
        if a.concurrency == [1, 64]:
            a.concurrency = [1, 4]
    a.concurrency = sorted(set(a.concurrency))
    return a


def run_worker(a) -> int:
    with open(a.prompts) as f:
        prompts = json.load(f)
    if a.device == "cpu" and a.worker not in ("ours", "ours_f32"):
        import torch
        torch.set_num_threads(1)        # CPU smoke runs: tiny matrices, threads only contend
    try:
        res = WORKERS[a.worker](a, prompts)
    except Exception as e:      # noqa: BLE001 - reported to the parent, which goes on with the other systems
        import traceback
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}"}
    with open(a.result, "w") as f:
        json.dump(res, f)
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return run_worker(a)
    tmp = tempfile.mkdtemp(prefix="jk-e2e-")
    try:
        model = a.model
        if a.make:
            from perf.peers.make_random_model import write_model
            model = a.keep or os.path.join(tmp, "model")
            dev = "cpu" if a.device == "cpu" else a.device
            write_model(model, a.make, a.layers, device=dev, seed=a.seed, smoke=a.smoke)
        if not model:
            raise SystemExit("give --model DIR or --make SHAPE (or --smoke)")
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        prompts_file = os.path.join(tmp, "prompts.json")
        with open(prompts_file, "w") as f:
            json.dump(make_prompts(cfg["vocab_size"], a.concurrency, a.input_len, a.seed), f)
        print(f"model {model}: {cfg.get('model_type')}, {cfg['num_hidden_layers']} layers, hidden "
              f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}; {a.input_len} in / {a.output_len} out, "
              f"concurrency {a.concurrency}, device {a.device}", flush=True)
        results = {}
        for s in a.systems:
            out = os.path.join(tmp, f"{s}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", s, "--model", model, "--prompts",
                   prompts_file, "--result", out, "--device", a.device, "--input-len", str(a.input_len),
                   "--output-len", str(a.output_len), "--kv-cache-dtype", a.kv_cache_dtype,
                   "--concurrency", *map(str, a.concurrency), "--repeat", str(a.repeat)]
            cmd += [] if a.compile else ["--no-compile"]
            cmd += ["--compile-prefill"] if a.compile_prefill else []
            cmd += [] if a.f32_check else ["--no-f32-check"]
            t0 = time.perf_counter()
            print(f"--- {LABEL[s]} ...", flush=True)
            try:
                rc = subprocess.run(cmd, timeout=a.timeout, cwd=ROOT).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if os.path.isfile(out):
                with open(out) as f:
                    results[s] = json.load(f)
            else:
                results[s] = {"error": f"worker exited with {rc} and no result"}
            r = results[s]
            print(f"--- {LABEL[s]}: {'error: ' + r['error'] if 'error' in r else 'done'} in "
                  f"{time.perf_counter() - t0:.1f} s (load {r.get('load_s', 0):.1f} s; {r.get('variant', '')})",
                  flush=True)
            for c, x in r.get("runs", {}).items():        # at once, in case a later system runs out of time
                print(f"    conc {c}: {int(c) * a.output_len / x['wall_s']:.1f} tok/s, TTFT "
                      f"{1e3 * x['ttft_s']:.1f} ms, wall {x['wall_s']:.2f} s"
                      + (f", {x['wobble']} of {x['prompts']} prompts' tokens changed between the {a.repeat} timed "
                         f"calls" if x.get("wobble") else ""), flush=True)
        lines = report(results, a)
        print("\n".join(lines), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("worker", "prompts", "result")},
                           "config": cfg, "results": results, "report": lines}, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
