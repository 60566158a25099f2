"""vllm-bench for the jitkern engine: prefill and decode throughput, TTFT/TPOT, with llama.cpp as a peer.

    .venv/bin/python perf/bench.py [--model M] [--num-prompts 8] [--input-len 37] [--output-len 128]
        [--concurrency 1,16] [--max-num-batched-tokens 2048] [--num-blocks N] [--threads T]
        [--peer {none,llama.cpp}] [--seed 0] [--warmup 1] [--repeats 3] [--no-graphs] [--json out.json]

Prompts are random token ids drawn from the model's vocabulary with --seed, made before anything is timed
(pretokenised); both engines get exactly the same prompts. Three prompt sets: warm-up, prefill, decode.

Phases, each engine:
  prefill   --num-prompts prompts of --input-len tokens, one at a time (each alone, from an empty KV state
            in llama.cpp; our prefix cache is off unless --enable-prefix-caching, since rounds repeat the
            prompts), each producing one token. prefill tok/s = total prompt tokens / total wall time.
            TTFT here = one prompt's latency.
  decode@c  for every c in --concurrency: c requests of --input-len prompt tokens and --output-len output
            tokens (greedy, ignore_eos) submitted together. The decode window starts when the last request
            of the wave has its first token (all prefills done) and ends with the last token;
            decode tok/s = tokens generated inside the window / its length (aggregate over the c streams;
            at c = 1 this is single-stream decode, (output_len - 1) / (last - first token time)).
            TTFT (arrival -> first token) and TPOT ((last - first token time) / (tokens - 1)) are per request.
            The decode prompts of wave c are the first c of one list, so request 0 has the same prompt at
            every c and in every round: its greedy tokens must never change (checked and reported; a
            mismatch means our engine's result depends on the batch).
Ours runs through engine.llm_engine.LLMEngine (add_request / step), with the thread count in
JITKERN_NUM_THREADS. The peer (llama-cpp-python, `make peers`) loads the same GGUF with
n_threads = n_threads_batch = --threads, all through the low-level API: prefill = llama_decode of each prompt
after llama_memory_clear; decode@1 = one sequence, one token per llama_decode; decode@c (c > 1) = all c
prompts prefilled in one batch (in n_batch chunks), then one token per sequence per llama_decode step with
distinct seq ids (as llama.cpp's batched-bench does), greedy argmax over llama_get_logits_ith.
The two engines never run at once (a short pause between them lets spinning worker threads go to sleep);
after an untimed warm-up each, they take turns phase by phase for --repeats timed rounds, so a change in
the host's load hits both alike. Reported per phase: the best round's tok/s (with that round's TTFT/TPOT) and the median over
rounds; ratios ours/llama.cpp of both, beside the CPU goals (prefill >= 3x, decode c=1 >= 2.5x, c=16 >= 3.5x on a
2-core host); each decode row also as GB/s read and % of the host's read bandwidth (perf/bandwidth_cpu.py, probed
before every round; c=1's goal there is >= 80%).
Greedy tokens are compared with llama.cpp's (a sanity check: both quantise differently, so late divergence
is expected; divergence at token 0 on every sequence would mean a broken model).

The host is shared: the 1-minute load average is printed before each engine's timed phases. With a load
near or above the core count every number here is noisy (run again, compare within one run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _concurrency_list(text: str) -> list:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency must be integers separated by commas, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"--concurrency values must be >= 1, got {text!r}")
    return sorted(set(vals))


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or model dir (default: the embedded SmolLM2 Q4_1 GGUF)")
    ap.add_argument("--num-prompts", type=_positive("--num-prompts"), default=8, help="prompts in the prefill phase")
    ap.add_argument("--input-len", type=_positive("--input-len"), default=37, help="prompt tokens")
    ap.add_argument("--output-len", type=_positive("--output-len"), default=128, help="output tokens per decode request")
    ap.add_argument("--concurrency", type=_concurrency_list, default=[1, 16],
                    help="decode waves: comma-separated request counts, e.g. 1,16 (default)")
    ap.add_argument("--max-num-batched-tokens", type=_positive("--max-num-batched-tokens"), default=2048,
                    help="ours: tokens per engine step; llama.cpp: n_batch")
    ap.add_argument("--num-blocks", type=_positive("--num-blocks"), default=None,
                    help="ours: KV blocks (default: the engine's memory budget)")
    ap.add_argument("--threads", type=_positive("--threads"), default=None,
                    help="threads for both engines (default: JITKERN_NUM_THREADS, else physical cores)")
    ap.add_argument("--peer", choices=["none", "llama.cpp", "llama.cpp-static"], default="none",
                    help="llama.cpp: through llama-cpp-python (`make peers`); llama.cpp-static: the same calls from "
                         "perf/peers/llama_cpp_pipe.cpp linked against `make peer-server`'s static libraries")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed warm-up rounds per engine (compiles kernels, records decode graphs)")
    ap.add_argument("--repeats", type=_positive("--repeats"), default=3,
                    help="timed rounds per engine, taken in turns; the best and the median are reported")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="ours: keep automatic prefix caching on (off by default: every round repeats the same "
                         "prompts, and llama.cpp starts each from an empty KV state)")
    ap.add_argument("--no-graphs", action="store_true", help="ours: launch decode steps directly (no graph replay)")
    ap.add_argument("--no-invariance-check", action="store_true",
                    help="skip the untimed check that every decode prompt alone gives the tokens it got in the "
                         "largest wave")
    ap.add_argument("--no-bandwidth", action="store_true",
                    help="skip the read-bandwidth probe (perf/bandwidth_cpu.py) timed before each round, and the "
                         "'%% of the measured bandwidth' of every decode row")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if ARGS.threads is not None:
        os.environ["JITKERN_NUM_THREADS"] = str(ARGS.threads)     # before the kernel pool starts
    # numpy is glue in the engine: keep BLAS from parking spinning threads on our two cores
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

try:
    from tqdm import tqdm as _tqdm
except ImportError:                      # progress bars are a nicety, not a requirement
    _tqdm = None


def tqdm(iterable=None, **kw):
    """A progress bar on stderr when it is a terminal (none in logs); the iterable itself without tqdm."""
    if _tqdm is None:
        return iterable
    return _tqdm(iterable, leave=False, disable=None, **kw)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _p99(xs):
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs, np.float64), 99))


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _pause():
    time.sleep(0.5)          # lets the other side's spinning threads go to sleep before timing


def _decode_window(events, n_requests):
    """events: (time, request index, tokens so far) after each step. The window starts when every request
    has its first token and ends at the last token; returns (tokens inside the window, seconds)."""
    have = set()
    t_start = None
    counts_at_start = {}
    last = {}
    t_end = None
    for t, i, n in events:
        if t_start is None:
            if n >= 1:
                have.add(i)
            last[i] = n
            if len(have) == n_requests:
                t_start = t
                counts_at_start = dict(last)
        else:
            last[i] = n
            t_end = t
    if t_start is None or t_end is None:
        return 0, 0.0
    toks = sum(last[i] - counts_at_start.get(i, 0) for i in last)
    return toks, t_end - t_start


def _phase_result(name, tokens, seconds, ttft=None, tpot=None, extra=None):
    r = {"phase": name, "tokens": tokens, "seconds": seconds,
         "tok_s": tokens / seconds if seconds > 0 else float("nan")}
    if ttft is not None:
        r.update(ttft_median_ms=_median(ttft) * 1e3, ttft_p99_ms=_p99(ttft) * 1e3)
    if tpot is not None:
        r.update(tpot_median_ms=_median(tpot) * 1e3, tpot_p99_ms=_p99(tpot) * 1e3)
    if extra:
        r.update(extra)
    return r


# ------------------------------------------------------------------------------------------------ ours
class OursRunner:
    name = "jitkern"

    def __init__(self, args):
        from engine.llm_engine import EngineArgs, LLMEngine
        from engine.sampling_params import SamplingParams
        self._SamplingParams = SamplingParams
        self.args = args
        self.engine = LLMEngine(EngineArgs(
            model=args.model, num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(64, max(args.concurrency)), use_graphs=not args.no_graphs,
            enable_prefix_caching=args.enable_prefix_caching))
        self.vocab_size = self.engine.config.vocab_size
        self._ids = 0

    def info(self):
        from jitkern.runtime.cpu import runtime_target
        from jitkern.runtime.cpu_pool import get_pool
        runner = self.engine.runner
        return {"cpu_tier": runtime_target().name, "threads": get_pool().num_threads,
                "decode_graphs": bool(runner.use_graphs), "graphs_recorded": len(getattr(runner, "_graphs", {})),
                "num_blocks": self.engine.num_blocks, "max_model_len": self.engine.max_model_len,
                "prefix_caching": bool(self.args.enable_prefix_caching)}

    def _params(self, max_tokens):
        return self._SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def _run_wave(self, prompts, max_tokens, desc=None):
        """Submits all prompts at once, steps until done. Returns (token lists, metrics, step events)."""
        eng = self.engine
        rids = []
        for p in prompts:
            rid = f"bench-{self._ids}"
            self._ids += 1
            eng.add_request(rid, list(p), self._params(max_tokens))
            rids.append(rid)
        index = {rid: i for i, rid in enumerate(rids)}
        tokens = [None] * len(rids)
        metrics = [None] * len(rids)
        events = []
        remaining = len(rids)
        bar = tqdm(total=len(rids) * max_tokens, desc=desc, unit="tok") if desc else None
        while remaining:
            outs = eng.step()
            t = time.monotonic()
            for o in outs:
                i = index.get(o.request_id)
                if i is None:
                    continue
                if o.error:
                    raise RuntimeError(f"our engine failed request {o.request_id}: {o.error}")
                n = len(o.outputs[0].token_ids)
                if bar is not None:
                    bar.update(len(o.outputs[0].delta_token_ids))
                events.append((t, i, n))
                if o.finished:
                    tokens[i] = list(o.outputs[0].token_ids)
                    metrics[i] = o.metrics
                    remaining -= 1
        if bar is not None:
            bar.close()
        for i, toks in enumerate(tokens):
            if len(toks) != max_tokens:
                raise RuntimeError(f"our engine returned {len(toks)} tokens for a request of max_tokens="
                                   f"{max_tokens} with ignore_eos (request {rids[i]})")
        return tokens, metrics, events

    def warmup(self, prompts, rounds):
        """Untimed: the warm-up prompts (never the timed ones, so the prefix cache cannot help)."""
        for _ in range(rounds):
            self._run_wave(prompts[:1], 1)
            for c in self.args.concurrency:
                self._run_wave(prompts[:c], min(self.args.output_len, 8))

    def prefill(self, prompts):
        ttft = []
        t0 = time.perf_counter()
        for p in tqdm(prompts, desc="ours prefill"):
            _, metrics, _ = self._run_wave([p], 1)
            m = metrics[0]
            ttft.append(m.first_token_time - m.arrival_time)
        dt = time.perf_counter() - t0
        return _phase_result("prefill", sum(len(p) for p in prompts), dt, ttft=ttft)

    def decode(self, prompts, c):
        tokens, metrics, events = self._run_wave(prompts[:c], self.args.output_len, desc=f"ours decode c={c}")
        ttft = [m.first_token_time - m.arrival_time for m in metrics]
        tpot = [(m.last_token_time - m.first_token_time) / (len(t) - 1)
                for m, t in zip(metrics, tokens) if len(t) > 1]
        n, dt = _decode_window(events, c)
        return _phase_result(f"decode c={c}", n, dt, ttft=ttft, tpot=tpot), tokens

    def close(self):
        self.engine.close()


# ------------------------------------------------------------------------------------------------ peer
def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        sys.exit(f"error: --peer llama.cpp needs the llama-cpp-python package, which is not importable "
                 f"({e}); install it with `make peers` (builds llama.cpp from PyPI, takes minutes)")
    return llama_cpp


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level (C API) bindings."""
    name = "llama.cpp"

    def __init__(self, args, gguf_path, threads):
        self.llama_cpp = lc = _import_llama_cpp()
        self.args = args
        self.threads = threads
        # llama.cpp logs every load to stderr; keep only errors
        self._log_cb = lc.llama_log_callback(self._log)
        lc.llama_log_set(self._log_cb, None)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_batch = args.max_num_batched_tokens
        self._contexts = {}

    @staticmethod
    def _log(level, text, _user):
        if level == 4:            # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode("utf-8", "replace"))

    def info(self):
        lc = self.llama_cpp
        ver = getattr(lc, "__version__", "?")
        sysinfo = lc.llama_print_system_info().decode("utf-8", "replace").strip()
        return {"llama_cpp_python": ver, "threads": self.threads, "system_info": sysinfo,
                "flash_attn_type": getattr(self, "flash_attn_type", None)}

    def _context(self, n_seq):
        """One context per concurrency (n_seq_max = c, each sequence with its own KV stream)."""
        if n_seq in self._contexts:
            return self._contexts[n_seq]
        lc = self.llama_cpp
        per_seq = -(-(self.args.input_len + self.args.output_len + 16) // 256) * 256
        cp = lc.llama_context_default_params()
        cp.n_ctx = per_seq * n_seq
        cp.n_batch = self.n_batch
        cp.n_ubatch = min(cp.n_ubatch, self.n_batch)
        cp.n_seq_max = n_seq
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        cp.no_perf = True
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={cp.n_ctx}, n_seq_max={n_seq})")
        batch = lc.llama_batch_init(max(self.n_batch, n_seq), 0, n_seq)
        ent = self._contexts[n_seq] = (ctx, batch, lc.llama_get_memory(ctx))
        self.flash_attn_type = int(cp.flash_attn_type)
        return ent

    def _decode(self, ctx, batch, items):
        """items: (token, pos, seq, want_logits). Decodes them; returns batch indices of the logits rows."""
        lc = self.llama_cpp
        batch.n_tokens = len(items)
        for k, (tok, pos, seq, want) in enumerate(items):
            batch.token[k] = int(tok)
            batch.pos[k] = pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = seq
            batch.logits[k] = 1 if want else 0
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc} (batch of {len(items)} tokens)")

    def _argmax(self, ctx, k):
        ptr = self.llama_cpp.llama_get_logits_ith(ctx, k)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _prefill_seqs(self, ctx, batch, prompts):
        """All prompts (seq ids 0..) in batches of n_batch tokens; returns the first greedy token of each."""
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        first = [None] * len(prompts)
        for a in range(0, len(items), self.n_batch):
            chunk = items[a:a + self.n_batch]
            self._decode(ctx, batch, chunk)
            for k, (_, _, s, want) in enumerate(chunk):
                if want:
                    first[s] = self._argmax(ctx, k)
        return first

    def _generate(self, prompts, max_tokens, desc=None):
        c = len(prompts)
        ctx, batch, mem = self._context(c)
        self.llama_cpp.llama_memory_clear(mem, True)
        t_arrival = time.monotonic()
        first = self._prefill_seqs(ctx, batch, prompts)
        t_first = time.monotonic()
        out = [[t] for t in first]
        pos = [len(p) for p in prompts]
        steps = range(max_tokens - 1)
        for _ in (tqdm(steps, desc=desc) if desc else steps):
            self._decode(ctx, batch, [(out[s][-1], pos[s], s, True) for s in range(c)])
            for s in range(c):
                out[s].append(self._argmax(ctx, s))
                pos[s] += 1
        t_last = time.monotonic()
        return out, t_arrival, t_first, t_last

    def warmup(self, prompts, rounds):
        """Untimed: the warm-up prompts (never the timed ones, so the prefix cache cannot help)."""
        for _ in range(rounds):
            self._generate(prompts[:1], 1)
            for c in self.args.concurrency:
                self._generate(prompts[:c], min(self.args.output_len, 8))

    def prefill(self, prompts):
        ttft = []
        t0 = time.perf_counter()
        for p in tqdm(prompts, desc="llama.cpp prefill"):
            _, ta, tf, _ = self._generate([p], 1)
            ttft.append(tf - ta)
        dt = time.perf_counter() - t0
        return _phase_result("prefill", sum(len(p) for p in prompts), dt, ttft=ttft)

    def decode(self, prompts, c):
        out, ta, tf, tl = self._generate(prompts[:c], self.args.output_len, desc=f"llama.cpp decode c={c}")
        n = c * (self.args.output_len - 1)
        tpot = [(tl - tf) / (self.args.output_len - 1)] * c if self.args.output_len > 1 else []
        return _phase_result(f"decode c={c}", n, tl - tf, ttft=[tf - ta] * c, tpot=tpot), out

    def close(self):
        lc = self.llama_cpp
        for ctx, batch, _ in self._contexts.values():
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        self._contexts.clear()
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None


class LlamaCppPipeRunner(LlamaCppRunner):
    """--peer llama.cpp-static: LlamaCppRunner's calls made by perf/peers/llama_cpp_pipe.cpp (llama.cpp linked
    statically from .peers/build-server, the tree `make peer-server` builds), driven over a pipe; the
    timestamps of each generation are taken inside that process, so the pipe is outside the timed windows.
    The phases (warm-up, prefill, decode) are LlamaCppRunner's."""
    name = "llama.cpp"

    def __init__(self, args, gguf_path, threads):
        import subprocess
        self.args = args
        self.threads = threads
        exe = _build_llama_cpp_pipe()
        per_seq = -(-(args.input_len + args.output_len + 16) // 256) * 256
        self.proc = subprocess.Popen([exe, str(gguf_path), str(threads), str(args.max_num_batched_tokens),
                                      str(per_seq)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.n_vocab = None
        self.model = None

    def _generate(self, prompts, max_tokens, desc=None):
        lines = [f"gen {len(prompts)} {max_tokens}"] + [" ".join(map(str, [len(p)] + list(p))) for p in prompts]
        self.proc.stdin.write("\n".join(lines) + "\n")
        self.proc.stdin.flush()
        head = self.proc.stdout.readline().split()
        if not head or head[0] != "ok":
            raise RuntimeError(f"llama-cpp-pipe failed (exit {self.proc.poll()})")
        ta, tf, tl = (float(v) for v in head[1:4])
        out = [[int(t) for t in self.proc.stdout.readline().split()] for _ in prompts]
        return out, ta, tf, tl

    def info(self):
        self.proc.stdin.write("info\n")
        self.proc.stdin.flush()
        sysinfo, _, fa = self.proc.stdout.readline().strip().rpartition(" | flash_attn_type ")
        return {"llama_cpp_python": "none (static llama.cpp from .peers/build-server, perf/peers/llama_cpp_pipe.cpp)",
                "threads": self.threads, "system_info": sysinfo, "flash_attn_type": int(fa)}

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


def _build_llama_cpp_pipe() -> str:
    """.peers/llama-cpp-pipe, linked (g++) from perf/peers/llama_cpp_pipe.cpp and the static llama.cpp libraries
    of .peers/build-server when missing or older than its source."""
    import glob
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(root, "perf", "peers", "llama_cpp_pipe.cpp")
    exe = os.path.join(root, ".peers", "llama-cpp-pipe")
    b = os.path.join(root, ".peers", "build-server")
    libs = [os.path.join(b, "src", "libllama.a")] + [os.path.join(b, "ggml", "src", f"lib{n}.a")
                                                      for n in ("ggml", "ggml-cpu", "ggml-base")]
    missing = [x for x in libs if not os.path.isfile(x)]
    if missing:
        sys.exit(f"error: --peer llama.cpp-static needs {missing[0]}: run `make peer-server` (it builds the "
                 f"llama.cpp libraries first)")
    if os.path.isfile(exe) and os.path.getmtime(exe) >= max(os.path.getmtime(x) for x in libs + [src]):
        return exe
    inc = glob.glob(os.path.join(root, ".peers", "llama_cpp_python-*", "vendor", "llama.cpp"))
    if not inc:
        sys.exit("error: --peer llama.cpp-static: no llama.cpp source under .peers/ (run `make peer-server`)")
    cmd = ["g++", "-O2", "-std=c++17", src, "-I" + os.path.join(inc[0], "include"),
           "-I" + os.path.join(inc[0], "ggml", "include")] + libs + ["-fopenmp", "-lpthread", "-o", exe]
    print("[llama.cpp] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return exe


# ------------------------------------------------------------------------------------------------ main
def _timed_round(runners, prompts, args):
    """One round of the timed phases; the engines take turns phase by phase, so a change in the host's load
    hits both alike. Returns {engine: (load average before its prefill, phase results, decode tokens per c)}."""
    out = {r.name: [None, [], {}] for r in runners}
    phases = [("prefill", None)] + [("decode", c) for c in args.concurrency]
    for kind, c in phases:
        for r in runners:
            _pause()
            load = _load1()
            if kind == "prefill":
                res = r.prefill(prompts["prefill"])
                out[r.name][0] = load
            else:
                res, toks = r.decode(prompts["decode"], c)
                out[r.name][2][c] = toks
            res["load_avg_1m_before"] = load
            out[r.name][1].append(res)
    return {name: tuple(v) for name, v in out.items()}


def _summarise(rounds):
    """rounds: [(load, phases, tokens)]. Per phase: the round with the highest tok/s (its TTFT/TPOT with it),
    plus the median tok/s over rounds."""
    out = []
    for k, first in enumerate(rounds[0][1]):
        runs = [r[1][k] for r in rounds]
        best = dict(max(runs, key=lambda r: r["tok_s"]))
        best["tok_s_median"] = _median([r["tok_s"] for r in runs])
        best["tok_s_all"] = [r["tok_s"] for r in runs]
        out.append(best)
    return {"load_avg_1m_before": [r[0] for r in rounds], "phases": out}


def _check_invariance(ours, prompts, wave_tokens, args):
    """Untimed: each prompt of the largest wave decoded alone must give the same greedy tokens as in the wave
    (greedy decoding must not depend on what else is in the batch). Returns per-sequence first divergence."""
    c = max(args.concurrency)
    div = []
    for i in range(c):
        alone, _, _ = ours._run_wave([prompts["decode"][i]], args.output_len)
        div.append(_first_divergence(wave_tokens[c][i], alone[0]))
    return {"concurrency": c, "identical": sum(d == args.output_len for d in div), "of": c,
            "first_divergence": div}


def _code_version(root):
    """The commit and whether the engine's sources differ from it (the tree may be shared and changing)."""
    import subprocess
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "jitkern", "engine", "targets"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    dirty = [line[3:] for line in dirty if line.strip()]
    if not head:
        return "unknown (not a git checkout)"
    return head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)")


def _check_determinism(rounds):
    """Request 0 has the same prompt in every wave and every round: its greedy tokens must not change.
    Returns the (round, concurrency) pairs that differ from round 0 at the smallest concurrency."""
    c0 = min(rounds[0][2])
    ref = rounds[0][2][c0][0]
    return [(i, c) for i, r in enumerate(rounds) for c, toks in sorted(r[2].items()) if toks[0] != ref]


def _first_divergence(a, b):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


def _fmt(x, spec=".1f"):
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def main(args):
    from engine.default_model import default_model_path
    from jitkern.runtime.cpu_pool import default_num_threads
    if args.model is not None and not os.path.exists(args.model):
        sys.exit(f"error: --model {args.model!r} does not exist")
    gguf = args.model or str(default_model_path())
    threads = args.threads or default_num_threads()
    if args.peer == "llama.cpp":
        _import_llama_cpp()                    # fail before the long part, not after it
    if args.peer != "none":
        if not (os.path.isfile(gguf) and gguf.endswith(".gguf")):
            sys.exit(f"error: --peer llama.cpp needs a .gguf file as --model, got {gguf!r}")

    print(f"[jitkern] loading {gguf} ...", file=sys.stderr, flush=True)
    runners = [OursRunner(args)]
    try:
        vocab = runners[0].vocab_size
        rng = np.random.default_rng(args.seed)
        maxc = max(args.concurrency)
        prompts = {   # pretokenised, shared by both engines; three disjoint random sets
            "warmup": rng.integers(0, vocab, size=(maxc, args.input_len)).tolist(),
            "prefill": rng.integers(0, vocab, size=(args.num_prompts, args.input_len)).tolist(),
            "decode": rng.integers(0, vocab, size=(maxc, args.input_len)).tolist(),
        }
        if args.peer != "none":
            print(f"[llama.cpp] loading {gguf} ...", file=sys.stderr, flush=True)
            runners.append((LlamaCppRunner if args.peer == "llama.cpp" else LlamaCppPipeRunner)(args, gguf, threads))
            if runners[1].n_vocab not in (None, vocab):
                sys.exit(f"error: llama.cpp reads a vocabulary of {runners[1].n_vocab} tokens from {gguf}, "
                         f"our engine {vocab}")
        for r in runners:
            if args.warmup:
                print(f"[{r.name}] warm-up ({args.warmup} round(s)) ...", file=sys.stderr, flush=True)
                r.warmup(prompts["warmup"], args.warmup)
        rounds = {r.name: [] for r in runners}
        bandwidth = []
        for i in range(args.repeats):
            print(f"timed round {i + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            if not args.no_bandwidth:
                from perf.bandwidth_cpu import read_bandwidth
                _pause()
                bandwidth.append(read_bandwidth(threads, mib=256, reps=3))
            for name, res in _timed_round(runners, prompts, args).items():
                rounds[name].append(res)
        infos = {r.name: r.info() for r in runners}
        invariance = None
        if max(args.concurrency) > 1 and not args.no_invariance_check:
            print("[jitkern] batch-invariance check (untimed) ...", file=sys.stderr, flush=True)
            invariance = _check_invariance(runners[0], prompts, rounds["jitkern"][0][2], args)
    finally:
        for r in runners:
            r.close()

    report = {"command": " ".join([".venv/bin/python", "perf/bench.py"] + sys.argv[1:]),
              "code": _code_version(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
              "model": gguf, "threads": threads, "cpus": os.cpu_count(), "repeats": args.repeats,
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "concurrency": args.concurrency, "seed": args.seed, "engines": {}}
    for name, rs in rounds.items():
        report["engines"][name] = _summarise(rs)
        report["engines"][name]["info"] = infos[name]
    if bandwidth:
        _add_bandwidth(report, gguf, bandwidth)
    report["determinism_failures"] = _check_determinism(rounds["jitkern"])
    report["batch_invariance"] = invariance
    if "llama.cpp" in rounds:
        agree = {}
        ours_tok, peer_tok = rounds["jitkern"][0][2], rounds["llama.cpp"][0][2]
        for c in args.concurrency:
            div = [_first_divergence(a, b) for a, b in zip(ours_tok[c], peer_tok[c])]
            agree[c] = {"identical": sum(d == args.output_len for d in div), "of": c,
                        "median_first_divergence": _median(div)}
        report["greedy_agreement_with_peer"] = agree

    _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _add_bandwidth(report, model, probe_gbs):
    """Per decode phase of each engine: the bytes a step reads (the checkpoint's weights once, the f16 KV cache of
    each sequence at its mean context) times steps per second, and that as a share of the best read bandwidth
    the probe measured before the rounds at the same thread count."""
    from perf.bandwidth_cpu import decode_bytes_per_token
    context = report["input_len"] + report["output_len"] / 2
    per = decode_bytes_per_token(model, context)
    best = max(probe_gbs)
    report["bandwidth"] = {"probe_read_gbs": probe_gbs, "best_read_gbs": best, "weights_bytes": per["weights"],
                           "kv_bytes_per_seq": per["kv"], "mean_context": context}
    for eng in report["engines"].values():
        for p in eng["phases"]:
            if not p["phase"].startswith("decode c="):
                continue
            c = int(p["phase"].split("=")[1])
            step_bytes = per["weights"] + c * per["kv"]
            for key in ("tok_s", "tok_s_median"):
                gbs = p[key] / c * step_bytes / 1e9
                p[key.replace("tok_s", "read_gbs")] = gbs
                p[key.replace("tok_s", "pct_bw")] = 100.0 * gbs / best


def _print_report(rep):
    ours = rep["engines"]["jitkern"]
    peer = rep["engines"].get("llama.cpp")
    info = ours["info"]
    print()
    print(f"# {rep['command']}")
    print(f"code {rep['code']}")
    print(f"model {rep['model']}")
    print(f"input {rep['input_len']} tokens, output {rep['output_len']}, prefill prompts {rep['num_prompts']}, "
          f"concurrency {','.join(map(str, rep['concurrency']))}, seed {rep['seed']}, "
          f"{rep['repeats']} timed round(s), the engines taking turns phase by phase")
    print(f"jitkern: {info['threads']} threads, CPU tier {info['cpu_tier']}, decode graphs "
          f"{'on' if info['decode_graphs'] else 'off'} ({info['graphs_recorded']} recorded), "
          f"{info['num_blocks']} KV blocks, max_model_len {info['max_model_len']}, prefix caching "
          f"{'on' if info['prefix_caching'] else 'off'}")
    if peer:
        pi = peer["info"]
        fa = {-1: "auto (llama.cpp's default)", 0: "off", 1: "on"}.get(pi.get("flash_attn_type"), "?")
        print(f"llama.cpp: llama-cpp-python {pi['llama_cpp_python']}, {pi['threads']} threads "
              f"(n_threads = n_threads_batch), flash-attn {fa}")
    loads = [("jitkern", ours["load_avg_1m_before"])] + ([("llama.cpp", peer["load_avg_1m_before"])] if peer else [])
    worst = max(x for _, ls in loads for x in ls)
    print(f"1-min load average before each timed round ({rep['cpus']} CPUs): " +
          "; ".join(f"{n} " + " ".join(f"{x:.2f}" for x in ls) for n, ls in loads) +
          ("  -- shared host: numbers are noisy" if worst > 0.5 else ""))
    print()
    hdr = f"{'phase':<12} {'engine':<10} {'tok/s':>8} {'median':>8} {'TTFT med':>9} {'TTFT p99':>9} " \
          f"{'TPOT med':>9} {'TPOT p99':>9} {'tokens':>7} {'secs':>7}"
    print(hdr)
    print("-" * len(hdr))
    peer_by = {p["phase"]: p for p in peer["phases"]} if peer else {}
    for p in ours["phases"]:
        rows = [("jitkern", p)] + ([("llama.cpp", peer_by[p["phase"]])] if p["phase"] in peer_by else [])
        for name, r in rows:
            print(f"{r['phase']:<12} {name:<10} {_fmt(r['tok_s']):>8} {_fmt(r['tok_s_median']):>8} "
                  f"{_fmt(r.get('ttft_median_ms')):>9} {_fmt(r.get('ttft_p99_ms')):>9} "
                  f"{_fmt(r.get('tpot_median_ms')):>9} {_fmt(r.get('tpot_p99_ms')):>9} "
                  f"{r['tokens']:>7} {r['seconds']:>7.2f}")
    print("tok/s: best round (its TTFT/TPOT in ms beside it); median: over rounds. prefill = prompt tokens / "
          "wall, one prompt at a time; decode = tokens after every request's first / decode window, all streams")
    bw = rep.get("bandwidth")
    if bw:
        print()
        print(f"memory: read bandwidth {bw['best_read_gbs']:.1f} GB/s on {rep['threads']} threads (best of the "
              f"probes before each round: {' '.join(f'{x:.1f}' for x in bw['probe_read_gbs'])}; "
              f"perf/bandwidth_cpu.py); a decode step reads {bw['weights_bytes'] / 1e6:.1f} MB of weights + "
              f"{bw['kv_bytes_per_seq'] / 1e6:.2f} MB of KV per sequence (mean context {bw['mean_context']:g})")
        for p in ours["phases"]:
            if "pct_bw" not in p:
                continue
            rows = [("jitkern", p)] + ([("llama.cpp", peer_by[p["phase"]])] if p["phase"] in peer_by else [])
            print(f"{p['phase']:<12} " + "   ".join(
                f"{name} {r['read_gbs']:.1f} GB/s = {r['pct_bw']:.0f}% (median {r['pct_bw_median']:.0f}%)"
                for name, r in rows if "pct_bw" in r) + " of the measured read bandwidth")
    if peer:
        print()
        goals = {"prefill": 3.0, "decode c=1": 2.5, "decode c=16": 3.5}      # the CPU goals (2-core host)
        for p in ours["phases"]:
            q = peer_by.get(p["phase"])
            if not q:
                continue
            best = p["tok_s"] / q["tok_s"] if q["tok_s"] > 0 else float("nan")
            med = p["tok_s_median"] / q["tok_s_median"] if q["tok_s_median"] > 0 else float("nan")
            goal = goals.get(p["phase"])
            print(f"ratio jitkern/llama.cpp {p['phase']:<12} best {best:6.2f}x   median {med:6.2f}x" +
                  (f"   (goal >= {goal:g}x)" if goal else ""))
        ag = rep["greedy_agreement_with_peer"]
        print("greedy tokens identical to llama.cpp's: " + ", ".join(
            f"c={c}: {a['identical']}/{a['of']} sequences (median first divergence at token "
            f"{_fmt(a['median_first_divergence'], 'g')})" for c, a in ag.items()))
    inv = rep.get("batch_invariance")
    if inv:
        bad_seqs = {i: d for i, d in enumerate(inv["first_divergence"]) if d != rep["output_len"]}
        print(f"jitkern batch invariance (each c={inv['concurrency']} prompt alone vs in the wave): "
              f"{inv['identical']}/{inv['of']} sequences identical" +
              (f"; DIFFERENT: sequence -> first divergent token {bad_seqs}" if bad_seqs else ""))
    bad = rep["determinism_failures"]
    print("jitkern request 0 (same prompt at every concurrency and round): " +
          ("identical greedy tokens throughout" if not bad else
           f"DIFFERENT greedy tokens in (round, concurrency) {bad} than in round 0 at concurrency "
           f"{rep['concurrency'][0]}"))


if __name__ == "__main__":
    main(ARGS)
