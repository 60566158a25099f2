"""The engine's kernel specialisations for a model, for `jitkern build` (and warm starts).

`build_specializations(model)` builds a small engine for the model and drives representative steps
through it — a chunked prefill, prefills of a few lengths, decode batches of several sizes — so that every
kernel the forward pass and the sampler launch is specialised the way that model needs it. Under
`jitkern.runtime.launch.compile_only` nothing runs: each launch only compiles into the cache.
"""
from __future__ import annotations


def build_specializations(model: str | None = None, *, max_num_seqs: int = 8, device: str = "cpu") -> int:
    """Drives a short engine warm-up (prefills of several lengths, decodes, the sampler) so that every kernel
    specialisation the engine uses is launched; under `compile_only` that fills the kernel cache. `device`
    is the engine's device path to drive ("cuda" on a stand-in device for GPU targets)."""
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineArgs(model=model, num_blocks=256, block_size=16, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=256, use_graphs=False, max_model_len=2048, device=device))
    # Under compile-only launches no kernel runs, so sampled ids and logprobs are garbage: keep the
    # engine's bookkeeping valid by replacing them with a fixed in-vocabulary token.
    real_sample = eng.sampler.sample

    def sample(sched, result):
        out = real_sample(sched, result) if not _compiling_only() else _fake_sample(sched, result)
        return out
    eng.sampler.sample = sample
    try:
        vocab = eng.config.vocab_size
        lengths = [5, 37, 300]             # short, medium and a chunked (> 256 tokens) prefill
        n = 0
        for i, L in enumerate(lengths + [9] * (max_num_seqs - 1)):
            prompt = [(7 * j + 3 * i) % (vocab - 10) + 5 for j in range(L)]
            eng.add_request(f"warm-{i}", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                               detokenize=False))
            n += 1
        eng.add_request("warm-sampled", [11, 12, 13], SamplingParams(max_tokens=2, temperature=0.8, top_k=20,
                                                                    top_p=0.9, logprobs=2, seed=1,
                                                                    detokenize=False))
        steps = 0
        while eng.has_unfinished_requests() and steps < 64:
            eng.step()
            steps += 1
        # and one request alone: single-token decode steps (M = 1) take the GEMV tiles
        eng.add_request("warm-alone", [21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True, detokenize=False))
        while eng.has_unfinished_requests() and steps < 96:
            eng.step()
            steps += 1
        return steps
    finally:
        eng.close()


def _compiling_only() -> bool:
    from jitkern.runtime import launch
    return getattr(launch._capture, "compile_only", None) is not None


def _fake_sample(sched, result):
    """Drives the sampler's kernels (so they compile) but returns token 0 for every sampled request."""
    from engine.sampler import SampleResult
    import numpy as np
    from jitkern.ops.sampling import argmax_rows, sample_from_logits, topk_rows
    from jitkern.ops.softmax import log_softmax
    if result.logits is not None and len(result.logits):
        x = np.zeros_like(result.logits)
        argmax_rows(x)
        log_softmax(x)
        topk_rows(x, 20)
        topk_rows(x, 16)        # k is specialised on its divisibility by 16: both variants
        sample_from_logits(x, np.zeros(x.shape[0], np.float32))
    return {rid: SampleResult(0) for rid in result.sample_rows}
