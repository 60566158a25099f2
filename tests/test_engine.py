"""Engine behaviour: sampling semantics, stop handling, logprobs, lifecycle, admission, async front, CLI."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from engine.errors import InvalidRequestError, ModelLoadError  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.model_fixtures import tiny_model_dir  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # The oracle libraries (torch, transformers) are needed here and not at module level: the tests on the
    # embedded model need neither.
    return tiny_model_dir(tmp_path_factory, "tiny-llama", seed=5)


@pytest.fixture(scope="module")
def llm(tiny):
    path, _ = tiny
    m = LLM(path, num_blocks=256, block_size=16, max_num_batched_tokens=128, max_logprobs=-1)
    yield m
    m.close()


P1 = [5, 17, 33, 2, 9, 100, 44]
P2 = [7, 8, 9, 10, 11]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234, detokenize=False)
    alone = llm.generate([P1], sp)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, detokenize=False) for i in range(5)]
    batch = llm.generate([P2, P1, P2, P2, P1, P2], [others[0], sp, others[1], others[2], others[3], others[4]])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([P1], sp)[0].outputs[0].token_ids
    assert again == alone
    different = llm.generate([P1], SamplingParams(max_tokens=20, temperature=1.0, seed=99, detokenize=False))
    assert different[0].outputs[0].token_ids != alone


def test_n_sequences(llm):
    out = llm.generate([P1], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, detokenize=False))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in out.outputs]
    assert all(len(s) == 12 for s in seqs) and len(set(seqs)) > 1
    out2 = llm.generate([P1], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, detokenize=False))[0]
    assert [tuple(o.token_ids) for o in out2.outputs] == seqs


def test_greedy_logprobs_match_transformers(llm, tiny):
    from tests.model_compare import hf_logprobs
    _, hf = tiny
    out = llm.generate([P1], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True,
                                            detokenize=False))[0].outputs[0]
    seq = P1 + out.token_ids
    ref = hf_logprobs(hf, seq)
    assert len(out.logprobs) == 6
    cum = 0.0
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(P1) - 1 + i]
        assert tok == int(np.argmax(row))
        assert lp[tok].rank == 1
        np.testing.assert_allclose(lp[tok].logprob, row[tok], atol=2e-4)
        top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [t for t, _ in top] == list(np.argsort(-row)[:3])
        cum += row[tok]
    np.testing.assert_allclose(out.cumulative_logprob, cum, atol=1e-3)


def test_stop_strings_and_tokens(llm):
    base = llm.generate([P1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    words = base.text.split()
    assert len(words) >= 4
    stop = words[2]
    cut = llm.generate([P1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop not in cut.text and base.text.startswith(cut.text)
    inc = llm.generate([P1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text.endswith(stop)
    tok = base.token_ids[3]
    st = llm.generate([P1], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tok],
                                           detokenize=False))[0].outputs[0]
    assert st.token_ids == base.token_ids[:4] and st.finish_reason == "stop" and st.stop_reason == tok


def test_min_tokens_masks_stop_ids(llm):
    base = llm.generate([P1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                             detokenize=False))[0].outputs[0].token_ids
    first = base[0]
    out = llm.generate([P1], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first], min_tokens=3,
                                            detokenize=False))[0].outputs[0]
    assert out.token_ids[0] != first and len(out.token_ids) >= 3


def test_logit_bias_allowed_ids_and_penalties(llm):
    out = llm.generate([P1], SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0},
                                            detokenize=False))[0].outputs[0]
    assert out.token_ids == [42] * 5
    out = llm.generate([P1], SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=[3, 4],
                                            detokenize=False))[0].outputs[0]
    assert set(out.token_ids) <= {3, 4}
    out = llm.generate([P1], SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0},
                                            presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5,
                                            detokenize=False))[0].outputs[0]
    assert out.token_ids[0] == 42


def test_max_tokens_unset_runs_to_the_context_length(tiny):
    path, _ = tiny
    m = LLM(path, num_blocks=16, block_size=8, max_model_len=40)
    try:
        out = m.generate([P1], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True,
                                              detokenize=False))[0].outputs[0]
        assert len(out.token_ids) == 40 - len(P1) and out.finish_reason == "length"
        with pytest.raises(InvalidRequestError) as e:
            m.generate([list(range(2, 42))], SamplingParams(max_tokens=1))
        assert "40" in str(e.value) and e.value.param == "prompt"
    finally:
        m.close()


def test_pool_too_small_for_max_model_len_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(Exception) as e:
        LLM(path, num_blocks=4, block_size=8, max_model_len=100)
    msg = str(e.value)
    assert "--num-blocks" in msg and "--max-model-len" in msg and "100" in msg


def test_build_destroy_build_again(tiny):
    path, _ = tiny
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
    a = LLM(path, num_blocks=32)
    first = a.generate([P2], sp)[0].outputs[0].token_ids
    a.close()
    b = LLM(path, num_blocks=32)
    try:
        assert b.generate([P2], sp)[0].outputs[0].token_ids == first
    finally:
        b.close()


def test_stream_yields_the_same_text(llm):
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    full = llm.generate([P1], sp)[0].outputs[0].text
    assert "".join(llm.stream(P1, sp)) == full


def test_async_engine_many_threads_and_abort(tiny):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    path, _ = tiny
    eng = AsyncEngine(EngineArgs(model=path, num_blocks=128, block_size=16))
    try:
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
        want = [o for o in eng.submit("solo", P1, sp)][-1].outputs[0].token_ids
        results = {}

        def worker(i):
            outs = list(eng.submit(f"r{i}", P1, sp.clone()))
            results[i] = outs[-1].outputs[0].token_ids

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert all(results[i] == want for i in range(8))
        # an aborted request frees its blocks
        s = eng.submit("long", P1, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True,
                                                  detokenize=False))
        next(s)
        s.abort()
        import time
        for _ in range(100):
            if eng.call(lambda e: e.scheduler.num_running) == 0:
                break
            time.sleep(0.02)
        assert eng.call(lambda e: e.kv.usage) == 0
        with pytest.raises(InvalidRequestError):
            eng.submit("bad", P1, SamplingParams(temperature=-1))
    finally:
        eng.shutdown()


def test_unimplemented_architecture_names_what_is_missing(tmp_path):
    cfg = {"model_type": "falcon", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.numpy import save_file
    save_file({"model.embed_tokens.weight": np.zeros((32, 16), np.float32)}, str(tmp_path / "model.safetensors"))
    from engine.loader import load_checkpoint
    from engine.models import build_model
    ckpt = load_checkpoint(tmp_path, load_tokenizer=False, check_shapes=False)
    with pytest.raises(ModelLoadError, match="falcon.*not implemented yet: missing Falcon's parallel attention"):
        build_model(ckpt)


def test_cli_on_the_embedded_model():
    r = subprocess.run([sys.executable, "-m", "engine.cli", "--prompt", "The capital of France is",
                        "--max-tokens", "8"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris"), r.stdout
    r = subprocess.run([sys.executable, "-m", "engine.cli", "-h"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--max-tokens" in r.stdout and "--repeat" in r.stdout
    r = subprocess.run([sys.executable, "-m", "engine.cli", "--model", "/nonexistent", "--prompt", "x"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "/nonexistent" in r.stderr and "Traceback" not in r.stderr


def test_embedded_model_greedy_is_batch_invariant():
    """SmolLM2 Q4_1: every prompt's greedy tokens are the same alone and inside a batch with prefills of
    other lengths (quantised GEMV vs GEMM tiles, decode vs prefill attention, partitions)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (5, 37, 129, 300, 17, 64)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    m = LLM(max_num_seqs=8, max_num_batched_tokens=256)
    try:
        alone = [m.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
        batch = [o.outputs[0].token_ids for o in m.generate(prompts, sp)]
    finally:
        m.close()
    assert batch == alone


def test_greedy_decode_graphs_pick_the_logits_argmax(tiny):
    """CPU decode graphs end with each row's argmax (ModelRunner._record_greedy): plain greedy steps take their
    tokens from there. Those picks must be the argmax of the step's logits, a batch with a sampled request
    must not use them, and the text must equal the eager engine's (no graphs: the sampler's own argmax)."""
    path, _ = tiny
    prompts = [P1, P2, [3, 1, 4, 1, 5, 9, 2, 6]]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, detokenize=False)
    eager = LLM(path, num_blocks=64, block_size=16, use_graphs=False)
    try:
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)]
        want_mixed = [o.outputs[0].token_ids for o in eager.generate(prompts, [greedy, sampled, greedy])]
    finally:
        eager.close()
    m = LLM(path, num_blocks=64, block_size=16)
    runner = m.engine.runner
    seen = {"picks": 0, "logits": 0}
    orig = runner.execute

    def execute(sched):
        res = orig(sched)
        if res.greedy_tokens is not None:
            seen["picks"] += 1
            rows = np.array(sorted(res.sample_rows.values()))
            np.testing.assert_array_equal(res.greedy_tokens[rows], np.argmax(res.logits[rows], axis=1))
            np.testing.assert_array_equal(res.greedy_values[rows], res.logits[rows, res.greedy_tokens[rows]])
        elif not res.prompt_rows and len(res.sample_rows) == len(sched.scheduled) and \
                all(s.num_tokens == 1 for s in sched.scheduled):
            seen["logits"] += 1        # a decode step sampled from the logits (the mixed batch)
        return res
    runner.execute = execute
    try:
        got = [o.outputs[0].token_ids for o in m.generate(prompts, greedy)]
        picks = seen["picks"]
        got_mixed = [o.outputs[0].token_ids for o in m.generate(prompts, [greedy, sampled, greedy])]
    finally:
        m.close()
    assert got == want and got_mixed == want_mixed
    assert picks >= 8 and seen["picks"] == picks and seen["logits"] >= 8
