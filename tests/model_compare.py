"""The engine against transformers on the tiny models of tests/model_fixtures.py: random prompts, transformers'
greedy tokens and log-probabilities, the engine's prompt log-probabilities and greedy runs, and the checks the
model-family tests share (full-vocab prompt logprobs under chunked prefill; greedy tokens alone and in a batch).

FLOAT_TOL is the float32 comparison's tolerance: the engine's f32 kernels against transformers' f32 forward,
compared as float64 log-softmax."""
from __future__ import annotations

import numpy as np

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.model_fixtures import VOCAB

FLOAT_TOL = {"atol": 2e-4, "rtol": 1e-4}
# the logits checks' engine: 16-token prefill chunks, so the logit prompt's 33-69 tokens take several chunks
CHUNKED = {"num_blocks": 64, "block_size": 16, "max_num_batched_tokens": 16, "max_logprobs": -1}


def random_prompts(k: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list:
    """k prompts of ids 2..VOCAB-1 (no eos), each of lo..hi-1 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(k)]


def logit_prompt() -> list:
    """The prompt of the logits checks: a random one plus a run of 30 ids."""
    return random_prompts(1, seed=1)[0] + list(range(5, 35))


def greedy_params(n: int, **kw) -> SamplingParams:
    """n greedy tokens whatever they are (eos ignored), ids only."""
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False, **kw)


def hf_greedy(hf, prompt, n: int, **inputs) -> list:
    """transformers' greedy continuation: exactly n tokens (`inputs`: more model inputs, e.g. pixel_values)."""
    import torch
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, **inputs)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, prompt) -> np.ndarray:
    """transformers' log-softmax in float64 at every prompt position, (len(prompt), vocab): row i is the
    distribution of token i + 1 (the engine's prompt logprobs of position i + 1)."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()


def prompt_logprob_rows(plp, prompt, vocab: int = VOCAB) -> np.ndarray:
    """The engine's full-vocab prompt logprobs (prompt_logprobs=-1) of positions 1.. as (len(prompt) - 1, vocab)."""
    return np.array([[plp[i][t].logprob for t in range(vocab)] for i in range(1, len(prompt))])


def prompt_logprobs(llm, prompt, vocab: int = VOCAB) -> np.ndarray:
    """prompt_logprob_rows of one prefill of `prompt` on `llm` (a max_logprobs=-1 engine)."""
    plp = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1,
                                                detokenize=False))[0].prompt_logprobs
    return prompt_logprob_rows(plp, prompt, vocab)


def engine_prompt_logprobs(path, prompt, vocab: int = VOCAB, **llm_kw) -> np.ndarray:
    """prompt_logprobs on a fresh engine for `path` (CHUNKED, `llm_kw` changing it), closed after."""
    llm = LLM(path, **{**CHUNKED, **llm_kw})
    try:
        return prompt_logprobs(llm, prompt, vocab)
    finally:
        llm.close()


def greedy(llm, prompts, n: int) -> list:
    """The greedy tokens of `prompts` run as one batch."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params(n))]


def solo_and_batch(llm, prompts, n: int):
    """(the first prompt's greedy tokens run alone, every prompt's run as one batch)."""
    return greedy(llm, prompts[:1], n)[0], greedy(llm, prompts, n)


def each_alone_and_batch(llm, prompts, n: int):
    """([each prompt's greedy tokens run alone], every prompt's run as one batch)."""
    return [greedy(llm, [p], n)[0] for p in prompts], greedy(llm, prompts, n)


def greedy_on_devices(path, prompts, n: int, devices=("cpu", "cuda"), **llm_kw) -> dict:
    """{device: each_alone_and_batch} from one engine per device (block_size 16, 64-token steps, `llm_kw`)."""
    got = {}
    for dev in devices:
        llm = LLM(path, **{"block_size": 16, "max_num_batched_tokens": 64, **llm_kw, "device": dev})
        try:
            got[dev] = each_alone_and_batch(llm, prompts, n)
        finally:
            llm.close()
    return got


def check_logits_match_transformers(path, hf) -> None:
    """The engine's prompt logprobs (chunked prefill) = transformers' log-softmax within FLOAT_TOL."""
    prompt = logit_prompt()
    ref = hf_logprobs(hf, prompt)
    llm = LLM(path, **CHUNKED)
    try:
        plp = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1,
                                                    detokenize=False))[0].prompt_logprobs
    finally:
        llm.close()
    assert plp[0] is None and len(plp) == len(prompt)
    np.testing.assert_allclose(prompt_logprob_rows(plp, prompt), ref[:-1], **FLOAT_TOL)


def check_greedy_matches_transformers(path, hf) -> None:
    """32 greedy tokens of 8 prompts = transformers' greedy generate, the first alone and all in one batch, and
    again from the prefix cache."""
    prompts = random_prompts(8, seed=2)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(path, num_blocks=128, block_size=16, max_num_batched_tokens=64)
    try:
        solo, batch = solo_and_batch(llm, prompts, 32)
        assert solo == want[0]
        for got, w in zip(batch, want):
            assert got == w
        # prefix caching: the same prompts again hit the cache and give the same tokens
        before = llm.engine.kv.stats.hits
        again = greedy(llm, prompts, 32)
        assert llm.engine.kv.stats.hits > before
        assert again == want
    finally:
        llm.close()


def check_logits_and_greedy_match_transformers(path, hf, n_prompts: int) -> None:
    """check_logits_match_transformers and 32 greedy tokens of n_prompts prompts (the first alone, all batched)
    on one engine (CHUNKED)."""
    prompt = logit_prompt()
    ref = hf_logprobs(hf, prompt)
    prompts = random_prompts(n_prompts, seed=2)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(path, **CHUNKED)
    try:
        got = prompt_logprobs(llm, prompt)
        solo, batch = solo_and_batch(llm, prompts, 32)
    finally:
        llm.close()
    np.testing.assert_allclose(got, ref[:-1], **FLOAT_TOL)
    assert solo == want[0]
    assert batch == want


def check_device_greedy_matches_transformers(path, hf, prompts, n: int = 12) -> None:
    """device="cuda" (a GPU, or tests/fake_cuda.py's host-memory device when installed): n greedy tokens of the
    first prompt alone and of all of them batched = transformers'."""
    want = [hf_greedy(hf, p, n) for p in prompts]
    llm = LLM(path, device="cuda", num_blocks=64, block_size=16, max_num_batched_tokens=64)
    try:
        assert greedy(llm, prompts[:1], n)[0] == want[0]
        assert greedy(llm, prompts, n) == want
    finally:
        llm.close()


def greedy_margins(path, runs, kv_cache_dtype="auto"):
    """The tie-aware greedy comparison. For each (prompt ids, another engine's greedy continuation): per generated
    token, how far below this engine's (the CPU's) best logprob at that position the chosen token lies (0 where
    the CPU would pick it too; a near tie gives a small margin, a wrong token a large one)."""
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=256, device="cpu",
              kv_cache_dtype=kv_cache_dtype)
    try:
        out = []
        for prompt, cont in runs:
            ids = list(prompt) + list(cont)
            o = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1,
                                                   detokenize=False))[0]
            out.append([max(v.logprob for v in o.prompt_logprobs[i].values()) - o.prompt_logprobs[i][ids[i]].logprob
                        for i in range(len(prompt), len(ids))])
        return out
    finally:
        llm.close()
