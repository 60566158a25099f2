"""Fused decode-path kernels vs the separate ops they replace, at SmolLM2 shapes (hidden 576, MLP 1536, 9/3 heads
of 64, Q4_1 activation layout), on the CPU runtime tier:

    python perf/bench_decode_fusions.py T           # T tokens (1: a decode step of one sequence)
    python perf/bench_decode_fusions.py --engine B  # whole decode steps of the embedded SmolLM2, batch B

--engine: the engine's recorded decode graph of batch B with DecoderLM.fuse_decode on and off, each replayed
5 times per turn, 6 turns in alternation (the same step replayed: timing only); min / median ms per step.

Each case is recorded as a graph of 200 launch groups and replayed 7 times in turns; per group: min / median us.
rms_norm + quantize_q8 vs rms_norm_q8, silu_and_mul + quantize_q8 vs act_and_mul_q8, rope + reshape_and_cache
vs rope_and_cache (all with the engine's argument shapes; results are bit-identical, see the op tests).
"""
import sys
import time

import numpy as np

import jitkern as jk
from engine.ops.norm import rms_norm, rms_norm_q8
from engine.ops.quant import quantize_q8, act_layout
from engine.ops.activation import silu_and_mul, act_and_mul_q8
from engine.ops.rope import rope, rope_and_cache, rope_cos_sin_cache
from engine.ops.attention import reshape_and_cache
rng=np.random.default_rng(0)


def engine_replays(B):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(num_blocks=16 * B + 16, block_size=16, max_num_seqs=B, max_model_len=512,
                               enable_prefix_caching=False))
    for i in range(B):
        eng.add_request(f"r{i}", list(range(100 + i, 116 + i)),
                        SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, detokenize=False))
    eng.step()
    eng.step()
    graphs = {}
    for mode in (True, False):
        eng.model.fuse_decode = mode
        eng.runner._graphs.clear()
        eng.step()
        eng.step()
        graphs[mode] = eng.runner._graphs[B][0]
    res = {True: [], False: []}
    for _ in range(6):
        for mode in (True, False):
            t0 = time.perf_counter()
            for _ in range(5):
                graphs[mode].replay()
            res[mode].append((time.perf_counter() - t0) / 5 * 1e3)
    for mode in (True, False):
        print(f"batch {B} {'fused' if mode else 'separate'}: {len(graphs[mode].entries)} graph nodes, step min "
              f"{min(res[mode]):.2f} ms, median {sorted(res[mode])[3]:.2f} ms")
    eng.close()


if len(sys.argv) > 2 and sys.argv[1] == "--engine":
    engine_replays(int(sys.argv[2]))
    sys.exit(0)
T=int(sys.argv[1]) if len(sys.argv) > 1 else 1; n=576; I=1536; H,KVH,D=9,3,64
lay=act_layout("q4_1",T)
x=rng.standard_normal((T,n)).astype(np.float32); w=rng.standard_normal(n).astype(np.float32); r=rng.standard_normal((T,n)).astype(np.float32)
y=np.empty_like(x)
o8=(np.empty((T,n),np.int8),np.empty((T,n//32),np.float32),np.empty((T,n//32),np.float32))
o4=(np.empty((T,n//8),np.float32),np.empty((T,n//8),np.float32)) if T>1 else None
gu=rng.standard_normal((T,2*I)).astype(np.float32); act=np.empty((T,I),np.float32)
a8=(np.empty((T,I),np.int8),np.empty((T,I//32),np.float32),np.empty((T,I//32),np.float32))
a4=(np.empty((T,I//8),np.float32),np.empty((T,I//8),np.float32)) if T>1 else None
qkv=rng.standard_normal((T,(H+2*KVH)*D)).astype(np.float32)
q=qkv[:,:H*D].reshape(T,H,D); k=qkv[:,H*D:(H+KVH)*D].reshape(T,KVH,D); v=qkv[:,(H+KVH)*D:].reshape(T,KVH,D)
kc=np.zeros((64,16,KVH,D),np.float32); vc=kc.copy(); cache=rope_cos_sin_cache(D,D,1000,1e5); pos=np.arange(T,dtype=np.int32); sl=np.arange(T,dtype=np.int32)
cases={
 "norm+quant": lambda: (rms_norm(x,w,1e-5,out=y,residual=r), quantize_q8(y,out=o8,layout=lay,rep4=T>1,out4=o4)),
 "norm_q8": lambda: rms_norm_q8(x,w,1e-5,o8,layout=lay,out4=o4,residual=r),
 "act+quant": lambda: (silu_and_mul(gu,out=act), quantize_q8(act,out=a8,layout=lay,rep4=T>1,out4=a4)),
 "act_q8": lambda: act_and_mul_q8(gu,a8,layout=lay,out4=a4),
 "rope+cache": lambda: (rope(q,k,pos,cache,D,D,False), reshape_and_cache(k,v,kc,vc,sl)),
 "rope_cache": lambda: rope_and_cache(q,k,v,pos,cache,D,D,False,kc,vc,sl),
}
graphs={}
for name,f in cases.items():
    f()
    with jk.capture() as g:
        for _ in range(200): f()
    graphs[name]=g
res={k:[] for k in cases}
for rep in range(7):
    for name,g in graphs.items():
        t0=time.perf_counter(); g.replay(); res[name].append((time.perf_counter()-t0)/200*1e6)
for name in cases: print(f"T={T} {name:12s} min {min(res[name]):7.2f} us  median {sorted(res[name])[3]:7.2f} us")
