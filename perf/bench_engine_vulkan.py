"""The engine on Vulkan (Mesa's lavapipe here: a sanity figure, not a speed goal): greedy tokens vs the CPU
engine, prefill seconds and decode tok/s at batch 1 (eager: no graphs on Vulkan yet).

    python perf/bench_engine_vulkan.py [--model FILE_OR_DIR | --tiny] [--tokens 8] [--prompt TEXT] [--no-cpu]

--tiny: a random 2-layer Llama (hidden 256, vocabulary 256) in SmolLM2's GGUF type mix (Q8_0 embedding and
head, Q4_1 layers), written by tests/test_gguf_quant_mixes.py's helper into a temporary directory.

Every kernel specialisation compiles on first use (lavapipe compiles its shader on the first dispatch, then
caches it on disk): the first generate warms up, the second is timed. JITKERN_VULKAN_TIMEOUT raises the
per-dispatch limit (lavapipe runs some of the SmolLM2 GEMMs for minutes when the host is loaded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(model, device, prompt, tokens):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, num_blocks=32, block_size=16, max_num_batched_tokens=64, max_num_seqs=1, device=device)
    res = {"device": device, "load_s": round(time.perf_counter() - t0, 2)}
    try:
        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate([prompt], sp)                        # warm: every specialisation compiled and loaded
        res["warmup_s"] = round(time.perf_counter() - t0, 1)
        out = llm.generate([prompt], sp)[0]
        m = out.metrics
        res["prefill_s"] = round(m.first_token_time - m.arrival_time, 3) if hasattr(m, "arrival_time") else None
        res["decode_tok_s"] = round((tokens - 1) / max(m.last_token_time - m.first_token_time, 1e-9), 3)
        res["tokens"] = out.outputs[0].token_ids
    finally:
        llm.close()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU engine's run")
    p.add_argument("--tiny", action="store_true", help="a tiny random model in SmolLM2's type mix")
    a = p.parse_args()
    if a.tiny:
        import pathlib
        import tempfile

        from gguf import GGMLQuantizationType as QT

        import tests.test_gguf_quant_mixes as qm
        qm.MIXES["smollm2-like"] = (QT.Q8_0, QT.Q8_0, [qm._layer(QT.Q4_1), qm._layer(QT.Q4_1)])
        a.model = qm._model_pair(pathlib.Path(tempfile.mkdtemp()), "smollm2-like", seed=11)[0]
        a.prompt = [17, 41, 99, 5, 230, 77, 12]
    results = []
    for dev in (["vulkan"] if a.no_cpu else ["cpu", "vulkan"]):
        r = run(a.model, dev, a.prompt, a.tokens)
        print(json.dumps(r), flush=True)
        results.append(r)
    if len(results) == 2:
        print(json.dumps({"same_greedy_tokens": results[0]["tokens"] == results[1]["tokens"]}))


if __name__ == "__main__":
    main()
