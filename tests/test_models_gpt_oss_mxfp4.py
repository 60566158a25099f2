"""gpt-oss with MXFP4 experts (HF/OpenAI `*_blocks` / `*_scales` safetensors, kept compressed and run on the
GGUF block_mxfp4 kernel after a nibble repack at load) and gpt-oss from a GGUF written like llama.cpp's
converter (tests/gguf_export.py: split, biased ffn_{gate,up,down}_exps, attn_sinks, gpt-oss.* keys), each
against transformers on the same tiny random model.

The MXFP4 quantiser here follows the format definition (32-element blocks of e2m1 codes with an e8m0 scale,
HF's packing: byte j = elements 2j (low nibble) / 2j + 1 (high)); the oracle for the packed bytes is
transformers' own dequantiser (convert_moe_packed_tensors) and, after the repack, gguf's."""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from engine.llm import LLM  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from tests.gguf_export import write_gguf  # noqa: E402
from tests.model_compare import (FLOAT_TOL, check_device_greedy_matches_transformers,  # noqa: E402
                                 engine_prompt_logprobs, greedy_params, hf_greedy, hf_logprobs, logit_prompt,
                                 random_prompts)
from tests.model_fixtures import VOCAB, init_weights, make_config, save_tiny_model  # noqa: E402

_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantize_mxfp4(w: np.ndarray):
    """w [..., K] (K % 32 == 0) -> (blocks u8 [..., K/32, 16], scales u8 [..., K/32]) in HF's layout: per block
    the smallest power of two 2^(e - 127) with max|w| / 2^(e - 127) <= 6, codes the nearest e2m1 value."""
    x = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float64)
    amax = np.abs(x).max(-1)
    ex = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127)
    y = np.abs(x) / np.exp2(ex)[..., None]
    idx = np.abs(y[..., None] - _FP4).argmin(-1).astype(np.uint8)
    codes = idx | ((x < 0).astype(np.uint8) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((ex + 127).astype(np.uint8))


def _hf_dequant(blocks, scales):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(dir of the MXFP4 safetensors checkpoint, HF float32 model with the dequantised experts, {HF expert name:
    (blocks, scales)})."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    packed = {}

    def init(model):
        init_weights("gpt_oss", model)          # the gpt-oss draws; then the float experts become MXFP4 values
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                # HF keeps x @ W ([E, in, out]); the blocks run along `in` for each output row
                blocks, scales = quantize_mxfp4(p.detach().numpy().swapaxes(1, 2))
                deq = _hf_dequant(blocks, scales)
                assert deq.shape == p.shape
                assert torch.abs(deq - p).max() < 0.5 * torch.abs(p).max()       # a faithful quantiser
                p.copy_(deq)
                packed[name] = (blocks, scales)

    ref_dir = str(root / "deq")
    hf = save_tiny_model(make_config("gpt_oss"), ref_dir, seed=3, init=init)
    qdir = str(root / "mxfp4")
    os.makedirs(qdir)
    from safetensors.torch import save_file
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k not in packed}
    for name, (blocks, scales) in packed.items():
        sd[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        sd[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(sd, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]}
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    for fn in os.listdir(ref_dir):
        if fn.startswith("tokenizer") or fn == "generation_config.json":
            shutil.copy(os.path.join(ref_dir, fn), qdir)
    return qdir, hf, packed, ref_dir


def _greedy(path, prompts, n=32):
    """Greedy tokens and their logprobs: the first prompt alone, then all of them in one batch."""
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    try:
        sp = greedy_params(n, logprobs=0)
        res = [llm.generate([prompts[0]], sp)[0].outputs[0]] + [o.outputs[0] for o in llm.generate(prompts, sp)]
    finally:
        llm.close()
    return [(list(o.token_ids), np.array([lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])) for o in res]


def test_mxfp4_repack_matches_transformers_and_gguf_dequantisers(mxfp4_model):
    """The load-time repack (HF nibble order -> block_mxfp4) dequantises, by gguf's reference, to what
    transformers' own dequantiser makes of the HF blocks; and the experts stay compressed in the model."""
    from engine.models.moe import mxfp4_blocks_to_gguf
    qdir, hf, packed, _ = mxfp4_model
    for name, (blocks, scales) in packed.items():
        want = _hf_dequant(blocks, scales).numpy().swapaxes(1, 2)            # [E, out, in]
        got = gguf.quants.dequantize(mxfp4_blocks_to_gguf(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
        np.testing.assert_array_equal(got.reshape(want.shape), want)
    from engine.models import build_model
    model = build_model(load_checkpoint(qdir))
    for L in model.layers:
        assert L.moe.kind == "mxfp4" and L.moe.quantized and L.moe.gate.dtype == np.uint8
        assert L.moe.gate.shape == (4, 32, 64 // 32 * 17) and L.moe.down.shape == (4, 64, 32 // 32 * 17)


def test_mxfp4_experts_match_dequantised_float32(mxfp4_model):
    """MXFP4 experts (int8 activations on the block kernel) vs transformers in float32 with the dequantised
    experts, and vs the engine on those float experts: logprobs within 0.05 (measured ~0.01: the int8
    activation rounding of the expert inputs), equal greedy tokens; alone = batched bit for bit."""
    qdir, hf, _, ref_dir = mxfp4_model
    prompt = logit_prompt()
    ref = hf_logprobs(hf, prompt)[:-1]
    got = engine_prompt_logprobs(qdir, prompt)
    flt = engine_prompt_logprobs(ref_dir, prompt)
    np.testing.assert_allclose(flt, ref, **FLOAT_TOL)                # the float path (tests/test_models_gpt_oss)
    err = np.abs(got - ref).max()
    assert err < 0.05, err
    assert err > 0                                                   # int8 activations: not the float path
    prompts = random_prompts(6, seed=2)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    res = _greedy(qdir, prompts)
    (solo, solo_lp), batch = res[0], res[1:]
    assert [t for t, _ in batch] == want
    assert solo == want[0]
    np.testing.assert_array_equal(solo_lp, batch[0][1])              # batch invariance, per token


def test_mxfp4_checkpoint_refuses_bad_blocks(mxfp4_model, tmp_path):
    from engine.errors import ModelLoadError
    from safetensors.torch import load_file, save_file
    qdir = mxfp4_model[0]
    bad = str(tmp_path / "bad")
    shutil.copytree(qdir, bad)
    sd = load_file(os.path.join(bad, "model.safetensors"))
    del sd["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        LLM(bad, num_blocks=16, block_size=16)


def test_gguf_metadata_and_names(mxfp4_model, tmp_path):
    _, hf, _, _ = mxfp4_model
    path = write_gguf(hf, str(tmp_path / "m.gguf"), vocab=VOCAB)
    ckpt = load_checkpoint(path)
    cfg, c = ckpt.config, hf.config
    assert ckpt.format == "gguf" and cfg.architecture == "gpt_oss" and cfg.gguf_architecture == "gpt-oss"
    assert cfg.layer_types == c.layer_types and cfg.sliding_window == c.sliding_window
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling["truncate"] is False
    for n in ("attn_sinks.weight", "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_down_exps.bias",
              "ffn_gate_inp.bias", "post_attention_norm.weight"):
        assert f"blk.1.{n}" in ckpt.tensors, n


@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_gguf_matches_transformers(mxfp4_model, tmp_path, experts):
    """f32 GGUF: full-vocab logprobs vs transformers at the float tolerance. MXFP4 GGUF (the converter's
    repacked blocks): the same logits as the MXFP4 safetensors checkpoint bit for bit (same blocks, same
    kernels) and so within its bound of transformers. Both: 32 greedy tokens alone and batched."""
    qdir, hf, packed, _ = mxfp4_model
    path = write_gguf(hf, str(tmp_path / "m.gguf"), vocab=VOCAB,
                      mxfp4_experts=packed if experts == "mxfp4" else None)
    ckpt = load_checkpoint(path)
    assert ckpt.tensors["blk.0.ffn_gate_exps.weight"].dtype == experts
    prompt = logit_prompt()
    ref = hf_logprobs(hf, prompt)[:-1]
    got = engine_prompt_logprobs(path, prompt)
    if experts == "f32":
        np.testing.assert_allclose(got, ref, **FLOAT_TOL)
    else:
        np.testing.assert_array_equal(got, engine_prompt_logprobs(qdir, prompt))
        assert np.abs(got - ref).max() < 0.05
    prompts = random_prompts(5, seed=2)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    res = _greedy(path, prompts)
    assert res[0][0] == want[0]
    assert [t for t, _ in res[1:]] == want
    np.testing.assert_array_equal(res[0][1], res[1][1])


def test_gguf_float_experts_on_the_fake_device(mxfp4_model, tmp_path, monkeypatch):
    """A gpt-oss GGUF with f32 experts on the device-array path (host-memory fake CUDA device, CPU kernels):
    greedy tokens equal transformers' alone and batched. MXFP4 experts are refused there by name."""
    from engine.errors import ModelLoadError
    from tests.fake_cuda import install
    qdir, hf, packed, _ = mxfp4_model
    install(monkeypatch)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), vocab=VOCAB)
    check_device_greedy_matches_transformers(path, hf, random_prompts(3, seed=7))
    with pytest.raises(ModelLoadError, match="CPU only"):
        LLM(qdir, device="cuda", num_blocks=16, block_size=16)
