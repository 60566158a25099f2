"""Which graphs each call of a workload records, on the CUDA code path of the host-memory fake device
(tests/fake_cuda.py: CPU kernels, so it runs anywhere; the counts are the engine's, the times meaningless).

    .venv/bin/python perf/probe_graph_recordings.py [--concurrency 64] [--input-len 128] [--output-len 128]
        [--no-reserve]

A tiny random bf16 Llama (tests/model_fixtures.py) as perf/bench_e2e_cuda.py drives ours: a warm-up call of
--concurrency prompts of --output-len min 8 tokens, then three timed calls on other prompts. For each call:
the CUDA graphs recorded (ModelRunner._capture_cuda keys: decode batch buckets, ('prefill', tokens, seqs))
and the activation pool's generation (a step that moves a buffer bumps it and drops every recorded graph).
A timed call that records again pays an eager step plus a capture per graph on a real GPU. --no-reserve skips
ModelRunner.reserve_buffers (the buffers then grow with the steps).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64, help="prompts a call (default 64)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens a prompt (default 128)")
    ap.add_argument("--no-reserve", action="store_true", help="skip the start-up buffer reserve (the old behaviour)")
    a = ap.parse_args()
    import numpy as np
    import pytest
    import torch

    from tests.fake_cuda import install
    from tests.model_fixtures import make_model_dir
    mp = pytest.MonkeyPatch()
    install(mp)
    from engine import model_runner
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    recorded = collections.Counter()
    real = model_runner.ModelRunner._capture_cuda

    def capture(self, key):
        recorded[key] += 1
        return real(self, key)
    mp.setattr(model_runner.ModelRunner, "_capture_cuda", capture)
    if a.no_reserve:
        mp.setattr(model_runner.ModelRunner, "reserve_buffers", lambda self: False)
    path = tempfile.mkdtemp()
    make_model_dir("llama", path, seed=1).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    c, seq = a.concurrency, a.input_len + a.output_len
    llm = LLM(path, device="cuda", block_size=16, num_blocks=c * -(-seq // 16) + 64, max_num_seqs=c,
              max_model_len=seq + 16, enable_prefix_caching=False)
    try:
        runner = llm.engine.runner
        vocab = llm.engine.config.vocab_size
        rng = np.random.default_rng(0)
        warm = rng.integers(2, vocab, (c, a.input_len)).tolist()
        timed = rng.integers(2, vocab, (c, a.input_len)).tolist()
        calls = [("warm-up", warm, min(a.output_len, 8))] + [(f"timed {i + 1}", timed, a.output_len) for i in range(3)]
        print(f"after start: pool generation {runner.fwd_batch.buffers.generation}")
        for name, rows, n in calls:
            recorded.clear()
            t0 = time.perf_counter()
            llm.generate(rows, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False))
            print(f"{name:8s}: recorded {dict(recorded) or 'nothing'}; pool generation "
                  f"{runner.fwd_batch.buffers.generation}; {time.perf_counter() - t0:.2f} s (fake device)")
    finally:
        llm.close()
        mp.undo()


if __name__ == "__main__":
    main()
