"""CPU tier against CPU tier in one run (issue 12, "VNNI tiers"): the quantised matmul kernels the engine runs for
SmolLM2-135M (q4_1 layers, q8_0 head) on every tier among avx2 / avx512 / avx-vnni / avx512-vnni that this host
can run, and optionally the engine's decode tok/s per tier.

    .venv/bin/python perf/ab_tiers_cpu.py [--quick] [--rounds R] [--threads 1,8] [--tiers avx2,avx-vnni]
        [--routes] [--ms 16] [--qtypes q4_1] [--engine --gguf PATH [--engine-threads T] [--output-len L]]

--routes: each VNNI tier also runs as "<tier>/madd": the q4_0 / q4_1 GEMM (M > 1) with the madd integer-dot route
(pmaddubsw + pmaddwd, quant.QMM_GEMM_DOT_ROUTE = "madd") instead of the tier's vpdpbusd route; its outputs are
asserted to be the same bits as the same-width base tier's, and a route table prints vpdpbusd vs madd per case.
--ms / --qtypes: only those M values / weight types of the shapes below.

Which tiers run comes from targets/cpu.py's own host detection (LLVM's host features: CPUID + OS register
state, minus JITKERN_CPU_MASK_FEATURES); the others are listed with the features they miss.

Kernels: one subprocess per thread count (JITKERN_NUM_THREADS; default 1 and min(8, physical cores)); inside
it every tier is pinned by passing its Target to quantize_q8 / matmul_q8 (as the op tests do), each launch is
recorded as a graph and replayed, the tiers taking turns round by round (order reversed every other round);
the best wall time of the rounds is kept. Shapes N x K: the engine's fused q/k/v 960x576, o 576x576, a k/v
projection 192x576, gate_up 3072x576, down 576x1536 (q4_1) and the tied head 49152x576 (q8_0), at M = 1 (the
GEMV) and M = 16 (the GEMM). Checked (asserted, the run fails otherwise):
  - every output against a float64 oracle: the dequantised int8 activations (quantize_q8's natural layout)
    times the dequantised weights (gguf), to 1e-5 of sum |x| |w| (the float32 rounding; a wrong block or row
    is off by far more);
  - a VNNI tier gives the same bits as the tier of the same vector width without VNNI (avx-vnni = avx2,
    avx512-vnni = avx512): the integer dots are exact on both and the float work is the same (docs/STATUS.md
    "VNNI tiers"); 256- vs 512-bit tiers sum different float lanes, so only their max difference is printed;
  - row 0 of the M = 16 GEMM equals the M = 1 GEMV of the same row (batch invariance), per tier;
  - the outputs are the same bits at every thread count (work split invariance), per tier.
Reported: best time (us), GOP/s (2 M N K / t) and the ratio of speed to the reference tier (avx512 where it
runs, else avx2), plus each tier's setup time (its kernels' compile, the first time in a process).

--engine: one subprocess per tier with JITKERN_CPU_TIER=<tier> (checked: the engine's runtime target is that
tier, and the engine's device the CPU) and JITKERN_NUM_THREADS (--engine-threads, default min(8, physical
cores)); the engine with perf/bench.py's settings (device="cpu", graphs on, no prefix caching) on --gguf (the
embedded SmolLM2 where left out), greedy, 37-token random prompts; decode tok/s of wall time at concurrency 1
and 16 (perf/ab_engine_cpu.py's window: from every request's first token to the end), best of
--engine-rounds; greedy tokens compared with the same-width tier without VNNI (asserted).

The 1-minute load average is printed at the start and the end: with a load near the core count every time
here is noisy (compare within one run).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TIERS = ("avx2", "avx512", "avx-vnni", "avx512-vnni")
SAME_WIDTH_BASE = {"avx-vnni": "avx2", "avx512-vnni": "avx512"}
VNNI = ("avx-vnni", "avx512-vnni")


def _base(name):
    """The same-width tier without VNNI of a tier or a "<tier>/<route>" variant (None for avx2 / avx512)."""
    return SAME_WIDTH_BASE.get(name.split("/")[0])
# (label, qtype, N, K): SmolLM2-135M's linears as the engine runs them (q/k/v and gate/up fused along N)
SHAPES = [("qkv", "q4_1", 960, 576), ("o", "q4_1", 576, 576), ("k|v", "q4_1", 192, 576),
          ("gate_up", "q4_1", 3072, 576), ("down", "q4_1", 576, 1536), ("head", "q8_0", 49152, 576)]
MS = (1, 16)
RESULT = "RESULT-JSON "


def _load():
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def tier_report():
    """[(tier, runnable, why)] from targets/cpu.py's host detection."""
    from targets import cpu as tcpu
    from targets import get_target
    masked = os.environ.get("JITKERN_CPU_MASK_FEATURES", "").strip()
    rows = []
    for name in TIERS:
        t = get_target(name)
        miss = tcpu.missing_features(t)
        if miss:
            why = "missing " + ", ".join(miss)
            if masked and any(f in masked.split(",") for f in miss):
                why += f" (JITKERN_CPU_MASK_FEATURES={masked})"
        else:
            why = "host has " + ", ".join(t.requires)
        rows.append((name, not miss, why))
    return rows


def _host_lines():
    import llvmlite.binding as llvm
    from jitkern.runtime.cpu_pool import physical_core_count
    from targets import cpu as tcpu
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    best, why = tcpu.select_cpu_tier()
    return [f"host: {model}; LLVM host cpu {llvm.get_host_cpu_name()}; {physical_core_count()} physical cores, "
            f"{os.cpu_count()} logical; {_load()}",
            f"tier the runtime selects here: {best.name} ({why})"]


# ------------------------------------------------------------------------------------------- kernel child
def _weights(qt, N, K, rng):
    """Random GGUF blocks: random quant bytes, small positive f16 scales (and q4_1 minimums)."""
    from engine.ops import quant
    import numpy as np
    q = quant.QTYPES[qt]
    raw = rng.integers(0, 256, N * quant.row_bytes(qt, K), dtype=np.uint8)
    blocks = raw.reshape(-1, q.block_bytes)
    nb = 4 if qt == "q4_1" else 2
    blocks[:, :nb] = ((rng.random((blocks.shape[0], nb // 2)) + 0.05) * 0.01).astype(np.float16).view(np.uint8)
    return raw


def _oracle(x, raw, qt, N, K, T):
    """float64 (dequantised int8 activations) @ (dequantised weights)^T, and sum |x| |w| per output."""
    import gguf
    import numpy as np
    from engine.ops import quant
    qx, d, _ = quant.quantize_q8(x, target=T, layout="natural")
    xd = (qx.astype(np.float64).reshape(x.shape[0], -1, 32) * d.astype(np.float64)[..., None]).reshape(x.shape)
    w = gguf.quants.dequantize(raw.reshape(N, -1), getattr(gguf.GGMLQuantizationType, qt.upper()))
    w = np.asarray(w, np.float64).reshape(N, K)
    return xd @ w.T, np.abs(xd) @ np.abs(w).T


def child_kernels(args):
    import numpy as np
    from engine.ops import quant
    from jitkern.runtime.cpu_pool import get_pool
    from jitkern.runtime.launch import capture
    from targets import get_target
    class Col:          # a column: a tier, or "<tier>/<route>" (that tier with quant.QMM_GEMM_DOT_ROUTE = route)
        def __init__(self, spec):
            self.name = spec
            tier, _, route = spec.partition("/")
            self.target, self.route = get_target(tier), route or None

    tiers = [Col(n) for n in args.tiers.split(",")]
    threads = get_pool().num_threads
    ms = [int(v) for v in args.ms.split(",")] if args.ms else list(MS)
    rng = np.random.default_rng(12)
    cases = []          # (label, qt, N, K, M, x, raw)
    for label, qt, N, K in SHAPES:
        raw = _weights(qt, N, K, rng)
        x16 = rng.standard_normal((16, K)).astype(np.float32)
        if args.qtypes and qt not in args.qtypes.split(","):
            continue
        for M in ms:
            cases.append((label, qt, N, K, M, x16[:M], raw))
    setup_s, graphs, outs, errs = {}, {}, {}, {}
    for col in tiers:
        T = col.target
        quant.QMM_GEMM_DOT_ROUTE = col.route       # read when a launch compiles and records its kernel
        t0 = time.perf_counter()
        for ci, (label, qt, N, K, M, x, raw) in enumerate(cases):
            q = quant.QTYPES[qt]
            xq = quant.quantize_q8(x if M > 1 else x[0], target=T, layout=quant.act_layout(qt, M, T),
                                   rep4=M > 1 and quant._qmm_kernel_for(q))
            out = np.full((M, N) if M > 1 else (N,), np.nan, np.float32)
            quant.matmul_q8(xq, raw, qt, N, K, out=out, target=T)       # compiles (first time), then recorded
            with capture() as g:
                quant.matmul_q8(xq, raw, qt, N, K, out=out, target=T)
            g.replay()
            graphs[(col.name, ci)] = g
            outs[(col.name, ci)] = out.reshape(M, N)
        quant.QMM_GEMM_DOT_ROUTE = None
        setup_s[col.name] = time.perf_counter() - t0
        print(f"  [{threads} thr] {col.name}: kernels compiled + recorded in {setup_s[col.name]:.1f} s",
              file=sys.stderr, flush=True)
    # checks: oracle (once per case: the outputs of every tier against it), same bits where promised
    failures = []
    for ci, (label, qt, N, K, M, x, raw) in enumerate(cases):
        ref, mag = _oracle(x, raw, qt, N, K, tiers[0].target)
        for T in tiers:
            y = outs[(T.name, ci)]
            bad = np.abs(y - ref) > 1e-5 * mag + 1e-30
            err = float(np.max(np.abs(y - ref) / np.maximum(mag, 1e-30)))
            errs[(T.name, ci)] = err
            if bad.any() or not np.isfinite(y).all():
                failures.append(f"{T.name} {label} {N}x{K} M={M}: {int(bad.sum())} outputs off the float64 oracle "
                                f"(max |err| / sum|x||w| = {err:.3g})")
            base = _base(T.name)
            if base and (base, ci) in outs and not np.array_equal(y, outs[(base, ci)]):
                failures.append(f"{T.name} {label} {N}x{K} M={M}: not the same bits as {base} (max diff "
                                f"{np.abs(y - outs[(base, ci)]).max():.3g})")
            if M > 1 and ci > 0 and cases[ci - 1][0] == label and cases[ci - 1][4] == 1:
                y1 = outs[(T.name, ci - 1)]
                if not np.array_equal(y[0], y1[0]):
                    failures.append(f"{T.name} {label} {N}x{K}: row 0 of M={M} differs from M=1 (max diff "
                                    f"{np.abs(y[0] - y1[0]).max():.3g}): not batch invariant")
    # timing: tiers take turns, order reversed every other round; best wall time per (tier, case)
    best = {k: float("inf") for k in graphs}
    for r in range(args.rounds):
        order = tiers if r % 2 == 0 else tiers[::-1]
        for ci, (label, qt, N, K, M, x, raw) in enumerate(cases):
            reps = max(2, int(args.work // (2 * M * N * K)))
            for T in order:
                g = graphs[(T.name, ci)]
                t = time.perf_counter()
                for _ in range(reps):
                    g.replay()
                best[(T.name, ci)] = min(best[(T.name, ci)], (time.perf_counter() - t) / reps)
    res = {"threads": threads, "setup_s": setup_s, "failures": failures, "cases": []}
    for ci, (label, qt, N, K, M, x, raw) in enumerate(cases):
        res["cases"].append({
            "label": label, "qt": qt, "N": N, "K": K, "M": M,
            "time_s": {T.name: best[(T.name, ci)] for T in tiers},
            "oracle_err": {T.name: errs[(T.name, ci)] for T in tiers},
            "sha1": {T.name: hashlib.sha1(outs[(T.name, ci)].tobytes()).hexdigest() for T in tiers},
            "maxdiff": {T.name: float(np.abs(outs[(T.name, ci)] - outs[(tiers[0].name, ci)]).max()) for T in tiers},
            "vs_base": {T.name: float(np.abs(outs[(T.name, ci)] - outs[(_base(T.name), ci)]).max())
                        for T in tiers if (_base(T.name), ci) in outs},
        })
    print(RESULT + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------- engine child
def child_engine(args):
    saved = os.environ.get("JITKERN_NUM_THREADS")
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    import ab_engine_cpu            # noqa: E402  (sets JITKERN_NUM_THREADS=1 on import: put ours back)
    os.environ["JITKERN_NUM_THREADS"] = saved or "1"
    from jitkern.runtime.cpu import runtime_target
    from jitkern.runtime.cpu_pool import get_pool
    t0 = time.perf_counter()
    import numpy as np
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    conc = [1, 16]

    class Ours:     # perf/bench.py's OursRunner settings, with device="cpu" (device="auto" takes a CUDA GPU)
        engine = LLMEngine(EngineArgs(model=args.gguf, device="cpu", max_num_seqs=64, max_num_batched_tokens=2048,
                                      use_graphs=True, enable_prefix_caching=False))
        vocab_size = engine.config.vocab_size

        @staticmethod
        def _params(n):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

        def close(self):
            self.engine.close()

    ours = Ours()
    dev = getattr(ours.engine.runner, "device", "cpu")
    if dev != "cpu":
        raise SystemExit(f"error: the engine runs on {dev!r}, not the CPU")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, ours.vocab_size, 37).tolist() for _ in range(max(conc))]
    want = os.environ.get("JITKERN_CPU_TIER")
    got = runtime_target().name
    if got != want:
        raise SystemExit(f"error: the engine runs on tier {got!r}, not the forced JITKERN_CPU_TIER={want!r}")
    for c in conc:                  # warm-up: compiles, records the decode graphs
        ab_engine_cpu._wave(ours, prompts, c, min(args.output_len, 6), clock=time.perf_counter)
    setup = time.perf_counter() - t0
    tps, toks = {}, {}
    for _ in range(args.engine_rounds):
        for c in conc:
            v, tk = ab_engine_cpu._wave(ours, prompts, c, args.output_len, clock=time.perf_counter)
            tps.setdefault(c, []).append(v)
            toks[c] = tk
    ours.close()
    print(RESULT + json.dumps({"tier": got, "threads": get_pool().num_threads, "setup_s": setup,
                               "tps": {str(c): v for c, v in tps.items()},
                               "tokens": {str(c): v for c, v in toks.items()}}), flush=True)


# ------------------------------------------------------------------------------------------------ parent
def _child(argv, env_extra, timeout):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv, env=env, stdout=subprocess.PIPE,
                           stderr=None, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: child {' '.join(argv)} ({env_extra}) ran past --child-timeout {timeout} s")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(RESULT)), None)
    if r.returncode != 0 or line is None:
        tail = "\n".join(r.stdout.splitlines()[-20:])
        raise SystemExit(f"error: child {' '.join(argv)} ({env_extra}) failed with exit code {r.returncode} after "
                         f"{time.perf_counter() - t0:.0f} s\n{tail}")
    return json.loads(line[len(RESULT):])


def _ref_tier(names):
    return "avx512" if "avx512" in names else "avx2" if "avx2" in names else names[0]


def kernel_table(results, names):
    ref = _ref_tier(names)
    w = 22
    print(f"\nQuantised matmul kernels (best wall time of the rounds; GOP/s = 2MNK/t; x = speed vs {ref})")
    head = f"{'threads':>7} {'linear':<8} {'type':<5} {'N x K':>10} {'M':>3} |" + "".join(
        f" {n:^{w}} |" for n in names)
    print(head)
    print("-" * len(head))
    for res in results:
        for c in res["cases"]:
            cells = []
            tr = c["time_s"][ref]
            for n in names:
                t = c["time_s"][n]
                gops = 2 * c["M"] * c["N"] * c["K"] / t / 1e9
                cells.append(f" {t * 1e6:8.1f}us {gops:6.1f} {tr / t:4.2f}x |")
            print(f"{res['threads']:>7} {c['label']:<8} {c['qt']:<5} {c['N']:>5}x{c['K']:<4} {c['M']:>3} |"
                  + "".join(cells))
    print("setup (compile + record) per tier, s: " + "; ".join(
        f"{res['threads']} thr: " + ", ".join(f"{n} {res['setup_s'][n]:.1f}" for n in names) for res in results))
    # cross-tier and cross-thread facts
    errmax = max(max(c["oracle_err"].values()) for res in results for c in res["cases"])
    print(f"float64 oracle: max |y - ref| / sum|x||w| over all tiers, shapes, M, threads = {errmax:.2e} "
          f"(bound asserted: 1e-5)")
    for n in names:
        base = _base(n)
        if base in names:
            d = max(c["vs_base"][n] for res in results for c in res["cases"])
            print(f"{n} vs {base} (same width): max abs diff {d:.3g} over every shape, M, thread count "
                  f"({'bit-identical' if d == 0 else 'NOT bit-identical'}; asserted per case)")
    first = names[0]
    for n in names[1:]:
        if _base(n) != first:
            print(f"{n} vs {first}: max abs diff {max(c['maxdiff'][n] for res in results for c in res['cases']):.3g}"
                  f" (different float lane sums where the widths differ: not expected to be equal)")
    if len(results) > 1:
        diff = [(res["threads"], c["label"], c["M"], n) for res in results[1:] for c, c0 in
                zip(res["cases"], results[0]["cases"]) for n in names if c["sha1"][n] != c0["sha1"][n]]
        print("outputs identical across thread counts " + ", ".join(str(r["threads"]) for r in results) + ": "
              + ("yes (every tier, shape, M)" if not diff else f"NO: {diff}"))
        return not diff
    return True


def route_table(results, names):
    """vpdpbusd (the VNNI tiers' default) vs the madd route per case, and each against the same-width base."""
    pairs = [(n, n + "/madd") for n in names if n + "/madd" in names]
    if not pairs:
        return
    print("\nq4 GEMM integer-dot route on the VNNI tiers: vpdpbusd (default) vs madd (QMM_GEMM_DOT_ROUTE='madd');"
          " us, and speed vs the same-width tier without VNNI; madd/vpd = speed of madd over vpdpbusd")
    head = f"{'threads':>7} {'linear':<8} {'type':<5} {'N x K':>10} {'M':>3} |" + "".join(
        f" {n + ': vpdpbusd':>24} {'madd':>17} {'madd/vpd':>8} |" for n, _ in pairs)
    print(head)
    print("-" * len(head))
    for res in results:
        for c in res["cases"]:
            t = c["time_s"]
            cells = []
            for n, v in pairs:
                b = _base(n)
                def cell(k):
                    return f"{t[k] * 1e6:.1f}us" + (f" {t[b] / t[k]:4.2f}x" if b in t else "")
                cells.append(f" {cell(n):>24} {cell(v):>17} {t[n] / t[v]:8.2f} |")
            print(f"{res['threads']:>7} {c['label']:<8} {c['qt']:<5} {c['N']:>5}x{c['K']:<4} {c['M']:>3} |"
                  + "".join(cells))


def engine_table(rows, names):
    ref = _ref_tier(names)
    print(f"\nEngine decode tok/s (wall time, best of rounds; x = vs {ref}); {rows[0]['threads']} threads")
    print(f"{'tier':<12} {'setup s':>8} {'c=1':>8} {'x':>5} {'c=16':>8} {'x':>5}  greedy tokens vs same-width base")
    by = {r["tier"]: r for r in rows}
    ok = True
    for n in names:
        r = by[n]
        b1, b16 = max(r["tps"]["1"]), max(r["tps"]["16"])
        r1, r16 = max(by[ref]["tps"]["1"]), max(by[ref]["tps"]["16"])
        base = SAME_WIDTH_BASE.get(n)
        same = ""
        if base in by:
            eq = [r["tokens"][c] == by[base]["tokens"][c] for c in ("1", "16")]
            same = f"{'identical' if all(eq) else 'DIFFERENT'} vs {base}"
            ok = ok and all(eq)
        print(f"{n:<12} {r['setup_s']:8.1f} {b1:8.1f} {b1 / r1:5.2f} {b16:8.1f} {b16 / r16:5.2f}  {same}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds and less work per timing (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7, --quick 2)")
    ap.add_argument("--threads", default=None, help="thread counts, e.g. 1,8 (default: 1 and min(8, cores))")
    ap.add_argument("--tiers", default=None, help="subset of the runnable tiers (default: all runnable)")
    ap.add_argument("--routes", action="store_true",
                    help="also each VNNI tier with the q4 GEMM's madd route (\"<tier>/madd\" columns)")
    ap.add_argument("--ms", default=None, help="M values to run, e.g. 16 (default 1,16)")
    ap.add_argument("--qtypes", default=None, help="weight types to run, e.g. q4_1 (default all)")
    ap.add_argument("--engine", action="store_true", help="also the engine's decode tok/s per tier")
    ap.add_argument("--gguf", default=None, help="GGUF for --engine (default: the embedded SmolLM2)")
    ap.add_argument("--engine-threads", type=int, default=None, help="default min(8, physical cores)")
    ap.add_argument("--engine-rounds", type=int, default=None, help="default 3 (--quick 1)")
    ap.add_argument("--output-len", type=int, default=None, help="decode tokens per request (default 64, --quick 16)")
    ap.add_argument("--child-timeout", type=int, default=900, help="seconds per child process")
    ap.add_argument("--child", choices=["kernels", "engine"], help=argparse.SUPPRESS)
    ap.add_argument("--work", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.work = args.work or (2e8 if args.quick else 1e9)
    args.engine_rounds = args.engine_rounds or (1 if args.quick else 3)
    args.output_len = args.output_len or (16 if args.quick else 64)
    if args.child == "kernels":
        return child_kernels(args)
    if args.child == "engine":
        return child_engine(args)

    sys.stdout.reconfigure(line_buffering=True)     # the tables reach a pipe / tee as they are printed
    from jitkern.runtime.cpu_pool import physical_core_count
    for ln in _host_lines():
        print(ln)
    rows = tier_report()
    print("CPU tiers:")
    for name, ok, why in rows:
        print(f"  {name:<12} {'runnable' if ok else 'NOT runnable':<13} {why}")
    names = [n for n, ok, _ in rows if ok]
    if args.tiers:
        want = [t.strip() for t in args.tiers.split(",") if t.strip()]
        bad = [t for t in want if t not in names]
        if bad:
            raise SystemExit(f"error: --tiers {','.join(bad)} not runnable here (runnable: {', '.join(names)})")
        names = [n for n in names if n in want]
    if not names:
        raise SystemExit("error: none of " + ", ".join(TIERS) + " runs on this host")
    cap = min(8, physical_core_count())
    threads = sorted({int(v) for v in args.threads.split(",")}) if args.threads else sorted({1, cap})
    ok = True
    results = []
    for n in threads:
        cols = [c for n in names for c in ([n, n + "/madd"] if args.routes and n in VNNI else [n])]
        argv = ["--child", "kernels", "--tiers", ",".join(cols), "--rounds", str(args.rounds), "--work",
                str(args.work)] + (["--ms", args.ms] if args.ms else []) + (["--qtypes", args.qtypes] if args.qtypes
                                                                              else [])
        res = _child(argv, {"JITKERN_NUM_THREADS": str(n)}, args.child_timeout)
        results.append(res)
        for f in res["failures"]:
            print(f"FAIL ({n} threads): {f}")
        ok = ok and not res["failures"]
    cols = [c for n in names for c in ([n, n + "/madd"] if args.routes and n in VNNI else [n])]
    ok = kernel_table(results, cols) and ok
    route_table(results, cols)
    if args.engine:
        et = args.engine_threads or cap
        rows_e = []
        for n in names:
            argv = ["--child", "engine", "--engine-rounds", str(args.engine_rounds), "--output-len",
                    str(args.output_len)]
            if args.gguf:
                argv += ["--gguf", os.path.abspath(args.gguf)]
            env = {"JITKERN_CPU_TIER": n, "JITKERN_NUM_THREADS": str(et)}
            rows_e.append(_child(argv, env, args.child_timeout))
            print(f"  engine {n}: done ({_load()})", file=sys.stderr, flush=True)
        ok = engine_table(rows_e, names) and ok
    print(_load())
    if not ok:
        raise SystemExit("FAILED: see the FAIL / NO / DIFFERENT lines above")


if __name__ == "__main__":
    main()
