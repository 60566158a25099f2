"""Where a long CPU prefill goes (issue 12: prefill >= 2x llama.cpp at every prompt length).

    JITKERN_NUM_THREADS=2 .venv/bin/python perf/profile_prefill_cpu.py [--tokens 2048] [--rounds 2] [--ops]

Default: the embedded SmolLM2 engine (decode graphs off, so every launch is timed) prefills --tokens random token
ids (one request, one output token) once untimed, then --rounds times with every kernel launch timed by kernel
name (CPU launches return when the kernel is done); prints the prefill's wall time and the per-kernel sums.
--ops: the ops alone at SmolLM2's shapes instead: paged prefill attention of one --tokens-token sequence (9 query
/ 3 KV heads, head_dim 64, random block table; f32 and f16 caches; one workspace kept across calls) and the four
q4_1 linears at M = --tokens, best of 3 each, with their 30-layer totals.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _best(fn, reps=3):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ops(S: int) -> None:
    from engine.ops import quant
    from engine.ops.attention import paged_attention
    H, KVH, D, BS, layers = 9, 3, 64, 16, 30
    rng = np.random.default_rng(0)
    nb = -(-S // BS)
    for dt in (np.float32, np.float16):
        kc = rng.standard_normal((nb + 4, BS, KVH, D)).astype(dt)
        vc = rng.standard_normal((nb + 4, BS, KVH, D)).astype(dt)
        q = rng.standard_normal((S, H, D)).astype(np.float32)
        qs, sl = np.array([0, S], np.int32), np.array([S], np.int32)
        bt = rng.permutation(nb + 4)[:nb].astype(np.int32)[None, :]
        out = np.empty_like(q)
        ws = {}      # the softmax-state workspace kept across calls, as the engine does (a fresh one each call
        #              timed its allocation and first-touch page faults too)
        t = _best(lambda: paged_attention(q, kc, vc, qs, sl, bt, scale=0.125, out=out, workspace=ws))
        print(f"prefill attention, {S} tokens, {np.dtype(dt).name} cache: {t * 1e3:.1f} ms a layer, "
              f"{t * layers:.2f} s for {layers} layers, {2 * S * S * H * D / t / 1e9:.1f} GFLOP/s")
    for N, K in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        raw = rng.integers(0, 255, N * quant.row_bytes("q4_1", K), dtype=np.uint8)
        blocks = raw.reshape(-1, quant.QTYPES["q4_1"].block_bytes)
        blocks[:, :4] = (rng.random((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
        xq = quant.quantize_q8(rng.standard_normal((S, K)).astype(np.float32),
                               layout=quant.act_layout("q4_1", S), rep4=True)
        o = np.empty((S, N), np.float32)
        t = _best(lambda: quant.matmul_q8(xq, raw, "q4_1", N, K, out=o))
        print(f"q4_1 linear {N}x{K}, M = {S}: {t * 1e3:.1f} ms, {t * layers:.2f} s for {layers} layers, "
              f"{2 * S * N * K / t / 1e9:.1f} GOP/s")


def engine(S: int, rounds: int) -> None:
    import engine.ops._hostargs as hostargs
    import engine.ops.matmul as matmul
    import jitkern.runtime.launch as launch_mod
    from engine.default_model import default_model_path
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(model=str(default_model_path()), use_graphs=False))
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prefill(i):
        eng.add_request(f"r{i}", rng.integers(100, 40000, S).tolist(), sp)
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t
    prefill(0)
    per_kernel = collections.Counter()
    orig = launch_mod.launch

    def timed(kernel, grid, args, kwargs, target=None):
        t = time.perf_counter()
        r = orig(kernel, grid, args, kwargs, target=target)
        per_kernel[kernel.__name__] += time.perf_counter() - t
        return r
    hostargs.launch = matmul.launch = launch_mod.launch = timed
    for i in range(rounds):
        per_kernel.clear()
        wall = prefill(i + 1)
        print(f"round {i + 1}: {S}-token prefill {wall:.2f} s, kernels {sum(per_kernel.values()):.2f} s")
        for name, t in per_kernel.most_common(6):
            print(f"  {name}: {t:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--rounds", type=int, default=2, help="timed engine prefills (default 2)")
    ap.add_argument("--ops", action="store_true", help="time the ops alone instead of the engine")
    args = ap.parse_args()
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be >= 1")
    print(f"load average {os.getloadavg()[0]:.2f}, JITKERN_NUM_THREADS={os.environ.get('JITKERN_NUM_THREADS')}")
    if args.ops:
        ops(args.tokens)
    else:
        engine(args.tokens, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
