"""FP8 (e4m3) safetensors checkpoints through the engine, weights kept compressed (engine/ops/fp8.py):
a tiny random Llama (tests/model_fixtures.py) whose linear weights are stored as F8_E4M3 in the two layouts
the hub uses -

- compressed-tensors: `<name>.weight` F8_E4M3 + `<name>.weight_scale` per-channel (N, 1) f32 (one layer) or
  per-tensor (1,) bf16 (the other layer);
- DeepSeek-V3 / Qwen3 FP8: `<name>.weight` F8_E4M3 + `<name>.weight_scale_inv` (ceil(N/128), ceil(K/128)) f32
  128 x 128 block scales (partial edge tiles here: N, K < 128);

against the same model with those FP8 values times their scales written as float32 (the dense path): full-vocab
prompt logprobs within 1e-4 (no activation quantisation on either side: only the f32 summation order differs),
and the same 16 greedy tokens alone and in a batch of 3.
"""
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from engine.errors import ModelLoadError  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.ops.fp8 import dequantize_fp8  # noqa: E402
from tests.model_compare import each_alone_and_batch, greedy_on_devices, prompt_logprobs  # noqa: E402
from tests.model_fixtures import make_model_dir  # noqa: E402

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8(w: torch.Tensor, layout: str, layer: int):
    """(e4m3 tensor, {suffix: scale tensor}) for one (N, K) float weight."""
    N, K = w.shape
    if layout == "block":
        nb, kb = -(-N // 128), -(-K // 128)
        pad = torch.zeros(nb * 128, kb * 128)
        pad[:N, :K] = w.abs()
        amax = pad.reshape(nb, 128, kb, 128).amax(dim=(1, 3))
        s = (amax / 448.0).clamp(min=1e-12)
        full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        return (w / full).to(torch.float8_e4m3fn), {"weight_scale_inv": s.float()}
    if layer == 0:      # per-channel f32
        s = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
        return (w / s).to(torch.float8_e4m3fn), {"weight_scale": s.float()}
    s = (w.abs().max() / 448.0).to(torch.bfloat16).reshape(1)        # per-tensor bf16
    return (w / s.float()).to(torch.float8_e4m3fn), {"weight_scale": s}


def _write_pair(tmp_path, layout):
    hf_dir = tmp_path / "hf"
    make_model_dir("llama", str(hf_dir))
    sd = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    q_sd, f_sd = {}, {}
    for name, t in sd.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in _LINEARS):
            layer = int(name.split(".")[2])
            w8, scales = _fp8(t.float(), layout, layer)
            q_sd[name] = w8
            for suffix, s in scales.items():
                q_sd[name + "_" + suffix.split("weight_")[1]] = s
            s = next(iter(scales.values()))
            s_np = s.view(torch.uint16).numpy() if s.dtype == torch.bfloat16 else s.numpy()
            f_sd[name] = torch.from_numpy(dequantize_fp8(w8.view(torch.uint8).numpy(), s_np))
        else:
            q_sd[name] = f_sd[name] = t
    dirs = {}
    for kind, state in (("fp8", q_sd), ("f32", f_sd)):
        d = tmp_path / kind
        shutil.copytree(hf_dir, d)
        (d / "model.safetensors").unlink()
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"),
                                    metadata={"format": "pt"})
        dirs[kind] = str(d)
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "fp8", "weight_block_size": [128, 128]} if layout == "block" else
                                  {"quant_method": "compressed-tensors", "format": "float-quantized"})
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    return dirs["fp8"], dirs["f32"]


def _run(path, prompts):
    # an f32 KV cache on both sides: kv_cache_dtype "auto" would give the FP8 checkpoint an f16 cache and its
    # float32 twin an f32 one, and this comparison is of the weight paths (only the summation order may differ)
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=64, max_logprobs=-1,
              kv_cache_dtype="float32")
    try:
        lp = prompt_logprobs(llm, prompts[0])
        alone, batch = each_alone_and_batch(llm, prompts, 16)
    finally:
        llm.close()
    return lp, alone, batch


@pytest.mark.parametrize("layout", ["compressed-tensors", "block"])
def test_fp8_checkpoint_matches_its_float32_twin(tmp_path, layout):
    fp8_dir, f32_dir = _write_pair(tmp_path, layout)
    ckpt = load_checkpoint(fp8_dir, load_tokenizer=False)
    w = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == "f8_e4m3" and w.scale is not None and w.raw.dtype == np.uint8
    del ckpt
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 256, n).tolist() for n in (19, 5, 11)]
    lp, alone, batch = _run(fp8_dir, prompts)
    want_lp, want_alone, _ = _run(f32_dir, prompts)
    np.testing.assert_allclose(lp, want_lp, atol=1e-4, rtol=0)
    assert alone == want_alone
    assert batch == alone


def test_fp8_weight_without_scale_is_named(tmp_path):
    fp8_dir, _ = _write_pair(tmp_path, "block")
    from safetensors.torch import load_file, save_file
    sd = load_file(fp8_dir + "/model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(sd, fp8_dir + "/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="without a scale tensor") as info:
        load_checkpoint(fp8_dir, load_tokenizer=False)
    assert info.value.tensor == "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_checkpoint_on_the_device_equals_the_cpu(tmp_path, monkeypatch, backend):
    """FP8 bytes and scales uploaded as they are; the same greedy tokens on the device (`fake`:
    tests/fake_cuda.py, host memory standing in; `cuda`: a GPU) as on the CPU, alone and batched."""
    if backend == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    fp8_dir, _ = _write_pair(tmp_path, "block")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 256, n).tolist() for n in (12, 6)]
    got = greedy_on_devices(fp8_dir, prompts, 10, num_blocks=64)
    assert got["cuda"] == got["cpu"]
