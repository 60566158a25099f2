"""The newer architectures loaded from a GGUF written like llama.cpp's converter (tests/gguf_export.py:
the gguf package's tensor names, llama.cpp's metadata keys and weight edits) against HF transformers on
the same tiny random model: full-vocab prompt logprobs (chunked prefill) and 32 greedy tokens, alone
and in a batch."""
import numpy as np
import pytest
from pytest import approx

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from engine.loader import load_checkpoint  # noqa: E402
from tests.gguf_export import roundtrip_hf, write_gguf  # noqa: E402
from tests.model_compare import (check_logits_and_greedy_match_transformers, engine_prompt_logprobs,  # noqa: E402
                                 hf_logprobs, logit_prompt)
from tests.model_fixtures import make_model_dir  # noqa: E402

ARCHS = ["gemma2-gguf", "granite", "olmo2"]


@pytest.fixture(scope="module", params=ARCHS)
def gguf_model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_model_dir(request.param, str(d / "hf"))
    path = write_gguf(hf, str(d / "model.gguf"))
    return request.param, path, hf


def test_gguf_metadata_and_names(gguf_model):
    arch, path, hf = gguf_model
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert ckpt.format == "gguf" and cfg.architecture == arch.split("-")[0]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        hf.config.num_hidden_layers, hf.config.hidden_size, hf.config.num_attention_heads,
        hf.config.num_key_value_heads)
    if arch.startswith("gemma2"):
        assert cfg.attn_logit_softcapping == hf.config.attn_logit_softcapping
        assert cfg.final_logit_softcapping == hf.config.final_logit_softcapping
        assert cfg.layer_types == hf.config.layer_types and cfg.sliding_window == hf.config.sliding_window
        assert cfg.attention_scale == pytest.approx(hf.config.query_pre_attn_scalar ** -0.5)
        assert "blk.0.post_attention_norm.weight" in ckpt.tensors and "blk.0.post_ffw_norm.weight" in ckpt.tensors
    if arch == "granite":
        c = hf.config
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == approx(
            (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling))  # f32 in GGUF
        assert ckpt.rope_layout == "adjacent_pairs"      # llama.cpp permutes Granite's Q/K rows like llama's
    if arch == "olmo2":
        # post-norms only, q/k norms over the whole projections
        assert "blk.0.attn_norm.weight" not in ckpt.tensors and "blk.0.ffn_norm.weight" not in ckpt.tensors
        assert ckpt["blk.0.attn_q_norm.weight"].shape == (cfg.num_heads * cfg.head_dim,)
        assert ckpt["blk.0.attn_k_norm.weight"].shape == (cfg.num_kv_heads * cfg.head_dim,)
        assert "blk.0.post_attention_norm.weight" in ckpt.tensors and "blk.0.post_ffw_norm.weight" in ckpt.tensors


def test_gguf_logits_and_greedy_match_transformers(gguf_model):
    arch, path, hf = gguf_model
    check_logits_and_greedy_match_transformers(path, hf, n_prompts=5)


@pytest.mark.parametrize("arch", ["phi3", "granite"])
def test_gguf_q8_0_matches_its_dequantised_twin(arch, tmp_path):
    """Q8_0 weights (Phi-3's fused attn_qkv / ffn_up, Granite's permuted Q/K rows) on the GGUF kernels vs
    transformers with the same quantised-then-dequantised weights. The engine also quantises activations to
    int8 per block (as llama.cpp does), which moves these tiny models' logprobs by about as much as the
    weight quantisation itself (measured: 0.09 / 0.02 max vs 0.11 / 0.02): the bound is loose, but a wrong
    fused-row split or permutation moves them by whole units, and the argmax must agree almost everywhere."""
    hf = make_model_dir(arch, str(tmp_path / "hf"))
    prompt = logit_prompt()
    orig = hf_logprobs(hf, prompt)[:-1]
    path = write_gguf(hf, str(tmp_path / "model.gguf"), qtype="Q8_0")
    ckpt = load_checkpoint(path)
    assert ckpt.tensors["blk.0.ffn_down.weight"].dtype == "q8_0"
    roundtrip_hf(hf, "Q8_0")
    ref = hf_logprobs(hf, prompt)[:-1]
    # Phi-3: a 128-token limit keeps LongRoPE on the short factors transformers uses for this prompt
    got = engine_prompt_logprobs(path, prompt, max_model_len=128 if arch == "phi3" else None)
    err = np.abs(got - ref).max()
    assert err < 0.25, err
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
    assert np.abs(orig - ref).max() > 1e-3          # the weights were really quantised
