"""In-process A/B of CPU prefill-attention switches, in the engine (default) or on the op alone (--ops).

    JITKERN_NUM_THREADS=2 .venv/bin/python perf/ab_prefill_cpu.py [--tokens 2048] [--rounds 4] [--ops] VARIANT...

A VARIANT is NAME[:ATTR=INT...]: entries of the CPU tier's tuning table (targets/tuning.py) or module attributes of
engine.ops.attention set before each of its runs (e.g. `before:prefill_token_group=0:prefill_balance=0 after`; an
entry a variant leaves out keeps its default);
in the engine, `layer_ws=1` gives every layer its own attention workspace (DecoderLM's layout before 4fff2e7)
instead of the model's one shared dict. Each variant keeps its own workspaces, so switching variants never
reallocates another's (a reallocation would time page faults).
Engine: the embedded SmolLM2 (graphs off, so every launch is timed) prefills --tokens random ids once per variant
untimed, then --rounds alternations (ABBA order) each timing one prefill: its wall time and prefill_kernel's wall
and process-CPU time. --ops: paged attention of one --tokens-token sequence at SmolLM2's shapes (q the engine's
strided view of a fused qkv row), f16 cache (--f32: f32), and the outputs of every variant compared bit for bit.
Prints best and median per variant.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variants(specs):
    out = []
    for spec in specs:
        name, *kv = spec.split(":")
        try:
            out.append((name, {k: int(v) for k, v in (x.split("=") for x in kv)}))
        except ValueError:
            sys.exit(f"error: variant {spec!r}: expected NAME[:ATTR=INT...]")
    return out


_DEFAULTS = {}


def _set(A, kw, variants):
    """The module's own values for every attribute any variant sets, then this variant's; tuning entries on a copy
    of the runtime CPU tier (the launches on host arrays read its table)."""
    from jitkern.runtime import cpu as runtime_cpu
    from targets import Tuning, tuned
    names = set(Tuning.__dataclass_fields__)
    base = _DEFAULTS.setdefault("__target__", runtime_cpu.runtime_target())
    for _, other in variants:
        for k in other:
            if k != "layer_ws" and k not in names and k not in _DEFAULTS:
                if not hasattr(A, k):
                    sys.exit(f"error: {k} is neither a tuning entry nor an attribute of engine.ops.attention")
                _DEFAULTS[k] = getattr(A, k)
    for k, v in _DEFAULTS.items():
        if k != "__target__":
            setattr(A, k, v)
    for k, v in kw.items():
        if k != "layer_ws" and k not in names:
            setattr(A, k, v)
    runtime_cpu._target = tuned(base, **{k: v for k, v in kw.items() if k in names})


def _summary(res):
    for name, rows in res.items():
        cols = list(zip(*rows))
        txt = ", ".join(f"{label} best {min(c):.3f} median {sorted(c)[len(c) // 2]:.3f}"
                        for label, c in zip(res.labels, cols))
        print(f"SUMMARY {name}: {txt}")


class _Results(dict):
    labels = ()


def ops(args, variants):
    import engine.ops.attention as A
    S, H, KVH, D, BS = args.tokens, 9, 3, 64, 16
    dt = np.float32 if args.f32 else np.float16
    rng = np.random.default_rng(0)
    nb = -(-S // BS)
    kc = rng.standard_normal((nb + 4, BS, KVH, D)).astype(dt)
    vc = rng.standard_normal((nb + 4, BS, KVH, D)).astype(dt)
    q = rng.standard_normal((S, (H + 2 * KVH) * D)).astype(np.float32)[:, :H * D].reshape(S, H, D)
    qs, sl = np.array([0, S], np.int32), np.array([S], np.int32)
    bt = rng.permutation(nb + 4)[:nb].astype(np.int32)[None, :]
    ws = {name: {} for name, _ in variants}
    outs, res = {}, _Results()
    res.labels = ("wall ms", "cpu ms")
    for r in range(args.rounds + 1):
        for name, kw in (variants if r % 2 == 0 else variants[::-1]):
            _set(A, kw, variants)
            out = np.empty((S, H, D), np.float32)
            t, c = time.perf_counter(), time.process_time()
            A.paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, workspace=ws[name], num_partitions=16)
            t, c = time.perf_counter() - t, time.process_time() - c
            outs.setdefault(name, out)
            if r:                              # round 0 compiles and allocates
                res.setdefault(name, []).append((t * 1e3, c * 1e3))
    first = variants[0][0]
    for name, _ in variants:
        print(f"{name}: output bit-identical to {first}'s: {np.array_equal(outs[name], outs[first])}")
    _summary(res)


def engine(args, variants):
    import engine.ops._hostargs as hostargs
    import engine.ops.attention as A
    import engine.ops.matmul as matmul
    import jitkern.runtime.launch as launch_mod
    from engine.default_model import default_model_path
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(model=str(default_model_path()), use_graphs=False))
    model = eng.model
    if not hasattr(model, "_attn_ws"):
        sys.exit("error: the model has no per-layer attention workspaces to switch")
    nl = len(model._attn_ws)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    acc = collections.Counter()
    orig = launch_mod.launch

    def timed(kernel, grid, a, kwargs, target=None):
        t, c = time.perf_counter(), time.process_time()
        r = orig(kernel, grid, a, kwargs, target=target)
        if kernel.__name__ == "prefill_kernel":
            acc["wall"] += time.perf_counter() - t
            acc["cpu"] += time.process_time() - c
        return r
    hostargs.launch = matmul.launch = launch_mod.launch = timed
    ws = {name: ([{} for _ in range(nl)] if kw.get("layer_ws") else [{}] * nl) for name, kw in variants}
    n = [0]

    def prefill(name, kw):
        _set(A, kw, variants)
        model._attn_ws = ws[name]
        n[0] += 1
        eng.add_request(f"r{n[0]}", rng.integers(100, 40000, args.tokens).tolist(), sp)
        acc.clear()
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t, acc["wall"], acc["cpu"]
    for name, kw in variants:
        prefill(name, kw)
    res = _Results()
    res.labels = ("prefill s", "prefill_kernel s", "prefill_kernel cpu s")
    for r in range(args.rounds):
        for name, kw in (variants if r % 2 == 0 else variants[::-1]):
            row = prefill(name, kw)
            res.setdefault(name, []).append(row)
            print(f"{name}: {args.tokens}-token prefill {row[0]:.2f} s, prefill_kernel {row[1]:.2f} s "
                  f"(cpu {row[2]:.2f} s), load {os.getloadavg()[0]:.2f}", flush=True)
    _summary(res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME[:ATTR=INT...]")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--rounds", type=int, default=4, help="timed alternations (default 4)")
    ap.add_argument("--ops", action="store_true", help="the attention op alone instead of the engine")
    ap.add_argument("--f32", action="store_true", help="--ops: an f32 cache (default f16)")
    args = ap.parse_args()
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be >= 1")
    print(f"load average {os.getloadavg()[0]:.2f}, JITKERN_NUM_THREADS={os.environ.get('JITKERN_NUM_THREADS')}")
    (ops if args.ops else engine)(args, _variants(args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
