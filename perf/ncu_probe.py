"""A few launches of the engine's hot GPU kernels at Llama-3-8B shapes, for Nsight Compute to profile: the bf16
dense linear at M = 1 and 256 (4096x4096 and 28672x4096), paged decode attention (B = 16, ctx = 1024) and paged
prefill attention (B = 1, S = 1024), f16 cache, 16-bit flash operands, 32 q / 8 KV heads, head_dim 128.

    ncu -k regex:'_gpu_linear_mma_kernel|flash_' --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats python3 perf/ncu_probe.py

Each call runs twice (the first compiles); every result is checked against numpy so a wrong kernel is not
profiled unnoticed.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.ops.ref_basic import from_bf16, to_bf16  # noqa: E402

HEADS, KV_HEADS, D, BS = 32, 8, 128, 16


def _attn_ref(q, kc, vc, bt, qlens, seqlens, scale, last=4):
    """Causal paged attention in float64 for the last `last` query tokens of each sequence: q [T, HEADS, D]."""
    out, t = np.zeros(q.shape, np.float64), 0
    for s, (ql, sl) in enumerate(zip(qlens, seqlens)):
        keys = np.concatenate([kc[b] for b in bt[s]], 0)[:sl].astype(np.float64)      # [sl, KVH, D]
        vals = np.concatenate([vc[b] for b in bt[s]], 0)[:sl].astype(np.float64)
        for i in range(max(0, ql - last), ql):
            pos = sl - ql + i
            for h in range(HEADS):
                sc = keys[:pos + 1, h // (HEADS // KV_HEADS)] @ q[t + i, h] * scale
                p = np.exp(sc - sc.max())
                out[t + i, h] = p @ vals[:pos + 1, h // (HEADS // KV_HEADS)] / p.sum()
        t += ql
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="launches of the hot GPU kernels for Nsight Compute")
    ap.add_argument("--linear-m", default="1,256", help="token counts of the linear launches (comma list)")
    ap.add_argument("--x16", action="store_true", help="x in bf16 (x_dtype='bf16'): the engine's prefill path "
                    "(warpgroup MMAs fed by TMA from 64 tokens)")
    ap.add_argument("--no-attention", action="store_true", help="the linears only")
    args = ap.parse_args(argv)
    from engine.ops import attention as ja
    from engine.ops import matmul
    from jitkern.runtime import cuda
    dev = cuda.get_device()
    rng = np.random.default_rng(0)
    for (N, K) in ((4096, 4096), (28672, 4096)):
        w = to_bf16(rng.standard_normal((N, K), dtype=np.float32) * 0.05)
        dw = cuda.to_device(w)
        for M in (int(m) for m in args.linear_m.split(",")):
            x = rng.standard_normal((M, K), dtype=np.float32)
            if args.x16:
                x = from_bf16(to_bf16(x))
            dx = cuda.to_device(to_bf16(x) if args.x16 else x)
            for _ in range(2):
                y = matmul.linear(dx, dw, w_dtype="bf16", **({"x_dtype": "bf16"} if args.x16 else {}))
            dev.synchronize()
            ref = x.astype(np.float64) @ from_bf16(w).astype(np.float64).T
            err = float(np.max(np.abs(y.numpy() - ref)) / np.max(np.abs(ref)))
            print(f"linear N={N} K={K} M={M}: max rel err {err:.1e}", flush=True)
    if args.no_attention:
        return 0
    scale = D ** -0.5
    ja.GPU_FLASH_OPERANDS = "16bit"         # (the engine's flash operands on 16-bit checkpoints)
    for B, qlen, ctx in ((16, 1, 1024), (1, 1024, 1024)):
        nb = -(-ctx // BS)
        kc = (rng.standard_normal((B * nb, BS, KV_HEADS, D)) * 0.5).astype(np.float16)
        vc = rng.standard_normal((B * nb, BS, KV_HEADS, D)).astype(np.float16)
        bt = np.arange(B * nb, dtype=np.int32).reshape(B, nb)
        q = rng.standard_normal((B * qlen, HEADS, D)).astype(np.float32)
        qs = np.arange(B + 1, dtype=np.int32) * qlen
        sl = np.full(B, ctx, np.int32)
        dq, dk, dv, dbt, dqs, dsl = (cuda.to_device(a) for a in (q, kc, vc, bt, qs, sl))
        out = cuda.DeviceArray.empty(q.shape, np.float32)
        ws = {}
        for _ in range(2):
            ja.paged_attention(dq, dk, dv, dqs, dsl, dbt, scale=scale, out=out, workspace=ws, max_query_len=qlen,
                               num_partitions=ja.MAX_PARTITIONS, validate=False, host_step=(qs, sl))
        dev.synchronize()
        ref = _attn_ref(q[:qlen], kc, vc, bt[:1], [qlen], [ctx], scale)     # sequence 0's last 4 tokens
        err = float(np.max(np.abs(out.numpy()[qlen - 4 if qlen > 4 else 0:qlen] - ref[max(0, qlen - 4):qlen])))
        print(f"attention B={B} q_len={qlen} ctx={ctx}: max abs err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
