"""The engine's kernel specialisations for a model, for `jitkern build` (and warm starts).

`build_specializations(model)` builds a small engine for the model and drives representative steps
through it — a chunked prefill, prefills of a few lengths, decode batches of several sizes — so that every
kernel the forward pass and the sampler launch is specialised the way that model needs it. Under
`jitkern.runtime.launch.compile_only` nothing runs: each launch only compiles into the cache.
"""
from __future__ import annotations


# Decode batches up to this many sequences are driven on a GPU path: every decode bucket (model_runner's
# decode_bucket: 1, 2, 4, then multiples of 8) a server with vLLM's GPU default of 256 sequences steps at.
GPU_MAX_DECODE_BATCH = 256


def build_specializations(model: str | None = None, *, max_num_seqs: int = 8, device: str = "cpu") -> int:
    """Drives a short engine warm-up (prefills of several lengths, decodes, the sampler) so that every kernel
    specialisation the engine uses is launched; under `compile_only` that fills the kernel cache. `device`
    is the engine's device path to drive ("cuda" on a stand-in device for GPU targets).

    A GPU path is driven twice: eagerly (steps of any row count, as prompt-logprob and speculative steps
    run), then as a user's engine runs (graphs on, so kernels that only recorded steps launch, such as the
    decode graphs' greedy pick, compile too) with a prompt long enough for the tallest prefill tile and a
    decode step at every decode bucket up to GPU_MAX_DECODE_BATCH: the linear's tile depends on the step's
    rows, so a bucket left out is a kernel the first run would compile."""
    steps = _drive(_engine(model=model, num_blocks=256, block_size=16, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=256, use_graphs=False, device=device),
                   [5, 37, 300], max_num_seqs)          # short, medium and a chunked (> 256 tokens) prefill
    if device == "cpu" or _compile_failed():
        return steps
    B = max(max_num_seqs, GPU_MAX_DECODE_BATCH)
    # max_model_len: the model's own (the pool holds it for most models), as a GPU server's is
    eng = _engine(model=model, num_blocks=1024, block_size=16, max_num_seqs=B, max_num_batched_tokens=2048,
                  device=device, max_model_len=None)
    return steps + _drive(eng, [5, 1100], 4, decode_buckets=B)   # 1,100 rows: over GPU_LINEAR_XL_M


def build_kernel_set(model: str | None, device: str = "cpu") -> int:
    """`jitkern build`'s kernel set (registered in setup.cfg, group jitkern.kernel_sets): the warm-up above,
    with a model the engine cannot load reported as jitkern's BuildInputError."""
    from engine.errors import ModelLoadError
    from jitkern.errors import BuildInputError
    try:
        return build_specializations(model, device=device)
    except ModelLoadError as e:
        raise BuildInputError(str(e)) from e


def _check_environment() -> None:
    from engine.settings import check_environment
    check_environment()


# `jitkern build` runs the kernel set's setting checks with its own, before it compiles anything
build_kernel_set.check_environment = _check_environment


def _drive(eng, lengths: list, max_num_seqs: int, decode_buckets: int = 0) -> int:
    from engine.sampling_params import SamplingParams
    # Under compile-only launches no kernel runs, so sampled ids and logprobs are garbage: keep the
    # engine's bookkeeping valid by replacing them with a fixed in-vocabulary token.
    real_sample = eng.sampler.sample

    def sample(sched, result):
        out = real_sample(sched, result) if not _compiling_only() else _fake_sample(sched, result)
        return out
    eng.sampler.sample = sample
    try:
        vocab = eng.config.vocab_size
        lengths = [min(L, eng.max_model_len - 4) for L in lengths]
        for i, L in enumerate(lengths + [9] * (max_num_seqs - 1)):
            prompt = [(7 * j + 3 * i) % (vocab - 10) + 5 for j in range(L)]
            eng.add_request(f"warm-{i}", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                               detokenize=False))
        eng.add_request("warm-sampled", [11, 12, 13], SamplingParams(max_tokens=2, temperature=0.8, top_k=20,
                                                                    top_p=0.9, logprobs=2, seed=1,
                                                                    detokenize=False))
        steps = 0
        while eng.has_unfinished_requests() and steps < 64 and not _compile_failed():
            eng.step()
            steps += 1
        # and one request alone: single-token decode steps (M = 1) take the GEMV tiles
        eng.add_request("warm-alone", [21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True, detokenize=False))
        while eng.has_unfinished_requests() and steps < 96 and not _compile_failed():
            eng.step()
            steps += 1
        if decode_buckets:
            from engine.model_runner import decode_bucket
            for B in sorted({decode_bucket(n, decode_buckets) for n in range(1, decode_buckets + 1)}):
                if _compile_failed():
                    break
                # B short prompts prefilled together, then one decode step of exactly B sequences
                for j in range(B):
                    eng.add_request(f"warm-b{B}-{j}", [(5 * j + B) % (vocab - 10) + 5, 7, 9],
                                    SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False))
                while eng.has_unfinished_requests() and not _compile_failed():
                    eng.step()
                    steps += 1
        return steps
    finally:
        eng.close()


def _engine(max_model_len=2048, **kw):
    """An engine of a 2,048-token context (None: the model's own), or the model's own where that is shorter."""
    from engine.llm_engine import EngineArgs, LLMEngine
    try:
        return LLMEngine(EngineArgs(max_model_len=max_model_len, **kw))
    except ValueError as e:
        if "max_position_embeddings" not in str(e):
            raise
        return LLMEngine(EngineArgs(max_model_len=None, **kw))


def _compile_failed() -> bool:
    """Whether a compile of this build has failed: compiles are deterministic, so driving more steps would
    only fail more requests on the same kernels (`jitkern build` reports the first failure and exits)."""
    from jitkern.runtime import launch
    co = getattr(launch._capture, "compile_only", None)
    return co is not None and bool(co.errors)


def _compiling_only() -> bool:
    from jitkern.runtime import launch
    return getattr(launch._capture, "compile_only", None) is not None


def _fake_sample(sched, result):
    """Drives the sampler's kernels (so they compile) but returns token 0 for every sampled request."""
    from engine.sampler import SampleResult
    import numpy as np
    from engine.ops.sampling import (apply_penalties, apply_temperature, argmax_rows, penalty_tables,
                                      sample_from_logits, topk_rows)
    from engine.ops.softmax import log_softmax
    if result.logits is not None and len(result.logits):
        x = np.zeros_like(result.logits)
        B = x.shape[0]
        argmax_rows(x)
        log_softmax(x)
        apply_temperature(x, np.ones(B, np.float32))
        ids, counts = penalty_tables([[1]] * B, [[2]] * B)
        apply_penalties(x, ids, counts, np.ones(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32))
        topk_rows(x, 20)
        topk_rows(x, 16)        # k is specialised on its divisibility by 16: both variants
        sample_from_logits(x, np.zeros(x.shape[0], np.float32))
    return {rid: SampleResult(0) for rid in result.sample_rows}
