"""Prefill / mixed steps replayed as graphs per token-count bucket (engine/prefill_graphs.py): the logits of
every sampled row and the greedy tokens equal the eager engine's bit for bit, the padding tokens write nothing
(the KV caches end up identical), and one recorded graph serves steps of different lengths and layouts."""
import numpy as np
import pytest

from engine.llm import LLM
from engine.prefill_graphs import seq_bucket, token_bucket
from engine.sampling_params import SamplingParams


def test_buckets():
    assert [token_bucket(n, 4096) for n in (1, 8, 9, 16, 17, 24, 25, 33, 37, 64, 65, 100, 129, 300, 512)] == \
        [8, 8, 16, 16, 24, 24, 32, 40, 40, 64, 80, 112, 160, 320, 512]
    for n in range(1, 3000):
        b = token_bucket(n, 4096)
        assert n <= b and (b - n) * 4 <= max(n, 32), n                 # at most ~25% padding
    assert token_bucket(300, 256) == 256 and token_bucket(70, 100) == 80
    assert [seq_bucket(s, 16) for s in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert seq_bucket(9, 12) == 12


def _logit_log(llm):
    eng = llm.engine
    log = {}
    orig = eng.sampler.sample

    def sample(sched, result):
        by_id = sched.by_id()
        for rid, row in result.sample_rows.items():
            log[(rid, by_id[rid].end - 1)] = np.array(result.logits[row])
        return orig(sched, result)
    eng.sampler.sample = sample
    return log


def _run(model, prompts, sp, graphs, **kw):
    with LLM(model, use_graphs=graphs, **kw) as llm:
        log = _logit_log(llm)
        # one wave of all prompts (chunked prefills beside decodes: mixed steps), then prompts alone (fresh
        # ones: a prefix-cache hit would leave a single-token step)
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts[:-3], sp)]
        toks += [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts[-3:]]
        runner = llm.engine.runner
        caches = [c.numpy() if hasattr(c, "numpy") else np.array(c) for c in runner.model.k_caches + runner.model.v_caches]
        keys = [k for k in runner._graphs if isinstance(k, tuple) and k[0] == "prefill"]
        return toks, log, caches, runner.prefill_graphs.replays, keys


def _check(model, prompts, max_tokens=6, logprobs=None, **kw):
    # logprobs: the sampler then needs every sampled row's logits (on CUDA a plain greedy step brings back
    # only the argmax), so the log below sees them
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False, logprobs=logprobs)
    t_e, log_e, c_e, rep_e, _ = _run(model, prompts, sp, False, **kw)
    t_g, log_g, c_g, rep_g, keys = _run(model, prompts, sp, True, **kw)
    assert rep_e == 0 and rep_g >= 5, (rep_e, rep_g)
    # fewer recordings than replays: steps of other lengths replayed a graph of their bucket
    assert 0 < len(keys) < rep_g, keys
    assert t_g == t_e
    assert log_g.keys() == log_e.keys() and len(log_g) >= 3 * len(prompts)
    for k in log_e:
        np.testing.assert_array_equal(log_g[k], log_e[k], err_msg=str(k))
    # padding tokens have slot -1: nothing else was written into the paged KV cache
    for a, b in zip(c_g, c_e):
        np.testing.assert_array_equal(a, b)


def _tiny(tmp_path_factory, arch):
    from tests.model_fixtures import tiny_model_dir
    return tiny_model_dir(tmp_path_factory, f"tiny-{arch}-pg", arch, seed=11)[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama")


def test_tiny_llama_graphs_equal_eager(tiny_llama):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 200, n).tolist() for n in (37, 5, 70, 17, 9, 40, 33, 12, 70)]
    _check(tiny_llama, prompts, num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.mark.parametrize("arch", ["gemma2", "gpt2", "qwen3"])
def test_other_architectures_graphs_equal_eager(tmp_path_factory, arch):
    # sliding window + logit softcaps (gemma2), learned position embeddings (gpt2), q/k norms (qwen3)
    path = _tiny(tmp_path_factory, arch)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 200, n).tolist() for n in (41, 6, 70, 18, 21, 11)]
    _check(path, prompts, max_tokens=4, num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)


@pytest.mark.slow
def test_embedded_smollm2_graphs_equal_eager():
    """SmolLM2 Q4_1 (the quantised GEMM tiles with padded token counts; chunked prefills of 64 tokens beside
    decodes). Slow-marked: two engines over 30 layers took 190 s at load 15."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (37, 5, 90, 12, 35, 7, 20)]
    _check(None, prompts, max_num_batched_tokens=64, max_num_seqs=4, max_tokens=3)


def test_cuda_prefill_graphs_equal_eager(tiny_llama, fake_or_cuda):
    """The CUDA engine's prefill / mixed steps (padding written before the step's staged copy, rows through the
    staged logits_rows array, CUDA graphs on a GPU; host memory and the CPU kernels on the fake device): the
    same logits bit for bit as its eager steps, the same KV caches."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 200, n).tolist() for n in (37, 5, 70, 17, 9, 40, 33, 12, 70)]
    _check(tiny_llama, prompts, logprobs=1, device="cuda", num_blocks=64, block_size=16, max_num_batched_tokens=64,
           max_num_seqs=8)


def _graphs_survive_growing_steps(model, **kw):
    """Steps that grow (one short prompt alone, then a wave of longer and chunked prompts beside decodes of more
    sequences, then a decode batch of every sequence) move no activation buffer after the engine started
    (ModelRunner.reserve_buffers), so no recorded graph is dropped and recorded again."""
    rng = np.random.default_rng(21)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, detokenize=False)
    with LLM(model, num_blocks=128, block_size=16, max_num_batched_tokens=64, max_num_seqs=8, **kw) as llm:
        runner = llm.engine.runner
        gen = runner.fwd_batch.buffers.generation
        llm.generate([rng.integers(3, 200, 6).tolist()], sp)
        first = dict(runner._graphs)
        assert first, "the short prompt's steps recorded no graph"
        llm.generate([rng.integers(3, 200, n).tolist() for n in (90, 7, 40, 33, 12, 70, 5, 21)], sp)
        assert runner.fwd_batch.buffers.generation == gen
        assert all(runner._graphs.get(k) is g for k, g in first.items())
        assert len(runner._graphs) > len(first)


def test_steps_move_no_buffer_after_start(tiny_llama):
    _graphs_survive_growing_steps(tiny_llama)


@pytest.mark.parametrize("arch", ["gemma2", "gpt2", "qwen3"])
def test_buffers_reserved_for_other_architectures(tmp_path_factory, arch):
    # the dry forward runs each model's host code between launches: a failure there only logs and leaves the
    # buffers to grow (graphs dropped mid-serving), so check it really ran
    with LLM(_tiny(tmp_path_factory, arch), num_blocks=64, block_size=16, max_num_batched_tokens=64,
             max_num_seqs=4) as llm:
        assert llm.engine.runner.reserve_buffers()


def test_buffers_reserved_when_steps_outgrow_the_context(tiny_llama):
    # 64 batched tokens but sequences of at most 8: the dry step gives each sequence at most 8 (a sequence
    # longer than its block table failed the dry run, which left the buffers unreserved)
    with LLM(tiny_llama, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=2,
             max_model_len=8) as llm:
        runner = llm.engine.runner
        gen = runner.fwd_batch.buffers.generation
        assert runner.reserve_buffers() and runner.fwd_batch.buffers.generation == gen
        assert runner.fwd_batch.buffers.get("h", (16, llm.engine.config.hidden_size)) is not None
        assert runner.fwd_batch.buffers.generation == gen


def test_cuda_steps_move_no_buffer_after_start(tiny_llama, fake_or_cuda):
    _graphs_survive_growing_steps(tiny_llama, device="cuda")


def test_decode_buckets():
    from engine.model_runner import decode_bucket
    assert [decode_bucket(n, 64) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 63, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 64, 64]
    assert decode_bucket(9, 12) == 12 and decode_bucket(3, 3) == 3


def test_cuda_decode_graphs_per_batch_bucket(tiny_llama, fake_or_cuda):
    """CUDA decode steps are padded to their batch-size bucket (1, 2, 4, then multiples of 8) and replay that
    bucket's graph: requests ending at different steps give decode batches of 11 sizes here, recorded as the
    graphs of 5 buckets, and every sampled row's logits (and the tokens) equal the eager engine's bit for bit."""
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(3, 20, 11)]

    def run(graphs):
        sizes = []
        with LLM(tiny_llama, use_graphs=graphs, device="cuda", num_blocks=64, block_size=16,
                 max_num_batched_tokens=256, max_num_seqs=16) as llm:
            log = _logit_log(llm)
            real = llm.engine.runner.prepare

            def prepare(sched):
                res = real(sched)
                b = llm.engine.runner.batch
                if b.num_tokens == b.num_seqs:
                    sizes.append(b.num_seqs)
                return res
            llm.engine.runner.prepare = prepare
            outs = [o.outputs[0].token_ids for o in llm.generate(
                prompts, [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True, detokenize=False,
                                         logprobs=1) for i in range(len(prompts))])]
            keys = [k for k in llm.engine.runner._graphs if isinstance(k, int)]
        return outs, log, sizes, keys
    t_e, log_e, _, _ = run(False)
    t_g, log_g, sizes, keys = run(True)
    assert sorted(set(sizes)) == list(range(1, 12)) and sorted(keys) == [1, 2, 4, 8, 16], (sorted(set(sizes)), keys)
    assert t_g == t_e and log_g.keys() == log_e.keys()
    for k in log_e:
        np.testing.assert_array_equal(log_g[k], log_e[k], err_msg=str(k))


def test_cuda_prefill_graph_token_cap(tiny_llama, monkeypatch):
    """Steps padded past JITKERN_CUDA_GRAPH_MAX_TOKENS run eagerly on CUDA (0: every prefill step); the CPU
    ignores the cap. Fake device."""
    from tests.fake_cuda import install
    install(monkeypatch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, n).tolist() for n in (30, 9)]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, detokenize=False)
    replays = {}
    for cap in ("0", "16", ""):
        monkeypatch.setenv("JITKERN_CUDA_GRAPH_MAX_TOKENS", cap)
        with LLM(tiny_llama, device="cuda", num_blocks=64, block_size=16, max_num_batched_tokens=64,
                 max_num_seqs=4) as llm:
            for p in prompts:                        # a 30-token prefill (bucket 32) and a 9-token one (16)
                llm.generate([p], sp)
            runner = llm.engine.runner
            replays[cap] = runner.prefill_graphs.replays
            if cap == "":
                # each bucket's first step is recorded then, though its eager run grew the batch buffers
                assert {("prefill", 32, 1), ("prefill", 16, 1)} <= set(runner._graphs), list(runner._graphs)
    assert replays == {"0": 0, "16": 1, "": 2}, replays
