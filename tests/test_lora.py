"""LoRA adapters (engine.lora) through the LLM API against transformers with the adapters' deltas merged.

The oracle: a tiny random Llama (transformers) and random PEFT adapters written with numpy + safetensors; the
reference model for an adapter is the HF model with W + scale * B @ A merged into each targeted weight (float64,
stored as float32). Ours runs the base weights plus the segmented low-rank kernels (engine.ops.lora) in batches
that mix both adapters and the base model in one step.
"""
import copy
import json
import os

import numpy as np
import pytest

from tests.model_compare import (
    FLOAT_TOL,
    greedy_params,
    hf_greedy,
    hf_logprobs,
    prompt_logprob_rows,
    random_prompts,
)

torch = pytest.importorskip("torch")

from engine.errors import InvalidRequestError  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.lora import LoRARequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.model_fixtures import make_model_dir  # noqa: E402

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(path, hf, modules, r, alpha, seed, rslora=False, std=0.08, config_extra=None):
    """A random PEFT LoRA adapter for `hf` (lora_A [r, in], lora_B [out, r] per layer and module)."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i, layer in enumerate(hf.model.layers):
        for m in modules:
            lin = getattr(layer.self_attn if m in ATTN else layer.mlp, m)
            out_f, in_f = lin.weight.shape
            pre = f"base_model.model.model.layers.{i}.{'self_attn' if m in ATTN else 'mlp'}.{m}"
            tensors[f"{pre}.lora_A.weight"] = (rng.standard_normal((r, in_f)) * std).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((out_f, r)) * std).astype(np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
           "use_rslora": rslora, "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}
    cfg.update(config_extra or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors


def merged(hf, tensors, scale):
    """hf with scale * B @ A added to each adapted weight (in float64)."""
    m = copy.deepcopy(hf)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            key = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            w = params[key]
            w.copy_(torch.from_numpy(w.detach().double().numpy() + scale * (b.astype(np.float64) @
                                                                               a.astype(np.float64))))
    return m


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path = str(root / "model")
    hf = make_model_dir("llama", path)
    t1 = write_adapter(str(root / "a1"), hf, ("q_proj", "v_proj", "o_proj"), r=8, alpha=16, seed=1)
    t2 = write_adapter(str(root / "a2"), hf, ATTN + MLP, r=4, alpha=8, seed=2, rslora=True)
    refs = {None: hf, "a1": merged(hf, t1, 16 / 8), "a2": merged(hf, t2, 8 / np.sqrt(4))}
    reqs = {None: None, "a1": LoRARequest("a1", 1, str(root / "a1")), "a2": LoRARequest("a2", 2, str(root / "a2"))}
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=96, block_size=16,
              max_num_batched_tokens=256, max_logprobs=-1)
    yield root, path, hf, refs, reqs, llm
    llm.close()


def _prompts(k, seed):
    return random_prompts(k, seed, lo=20, hi=40)


def test_mixed_batch_logits_match_merged_transformers(setup):
    _, _, _, refs, reqs, llm = setup
    prompts = _prompts(3, seed=5)
    names = [None, "a1", "a2"]
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=-1, detokenize=False)
    outs = llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])
    # every prompt was prefilled in one step, and the decode steps mixed both adapters and the base model
    assert llm.engine.lora.step_slots == {0, 1}
    for p, name, o in zip(prompts, names, outs):
        ref, base = hf_logprobs(refs[name], p), hf_logprobs(refs[None], p)
        np.testing.assert_allclose(prompt_logprob_rows(o.prompt_logprobs, p), ref[:-1], **FLOAT_TOL)
        if name is not None:       # the adapter changes the logits far beyond the tolerance
            assert np.abs(ref - base).max() > 0.05


def test_greedy_mixed_batch_equals_solo_and_transformers(setup):
    _, _, _, refs, reqs, llm = setup
    prompts = _prompts(6, seed=6)
    names = [None, "a1", "a2", "a1", None, "a2"]
    sp = greedy_params(10)
    want = [hf_greedy(refs[n], p, 10) for p, n in zip(prompts, names)]
    batch = llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])
    assert [o.outputs[0].token_ids for o in batch] == want
    solo = llm.generate([prompts[2]], sp, lora_request=reqs["a2"])[0].outputs[0].token_ids
    assert solo == want[2]


def test_prefix_cache_is_keyed_by_adapter(setup):
    _, _, _, refs, reqs, llm = setup
    p = _prompts(1, seed=7)[0] + list(range(10, 40))          # > 3 full blocks
    sp = greedy_params(4)
    kv = llm.engine.kv.stats
    first = llm.generate([p], sp, lora_request=reqs["a1"])[0]
    h0 = kv.hits
    other = llm.generate([p], sp, lora_request=reqs["a2"])[0]     # a2 must not read a1's KV
    assert kv.hits == h0
    assert other.outputs[0].token_ids == hf_greedy(refs["a2"], p, 4)
    base = llm.generate([p], sp)[0]
    assert kv.hits == h0
    assert base.outputs[0].token_ids == hf_greedy(refs[None], p, 4)
    again = llm.generate([p], sp, lora_request=reqs["a1"])[0]     # a1 again: its own blocks are hit
    assert kv.hits > h0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_one_slot_serves_two_adapters_in_turn(setup):
    _, path, _, refs, reqs, _ = setup
    prompts = _prompts(3, seed=8)
    names = ["a1", "a2", "a1"]
    sp = greedy_params(5)
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64, block_size=16) as llm:
        outs = llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(refs[n], p, 5) for p, n in zip(prompts, names)]


def test_bad_adapters_name_the_field_or_file(setup):
    root, path, hf, _, _, llm = setup
    sp = SamplingParams(max_tokens=1)

    def err(req):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([[5, 6, 7]], sp, lora_request=req)
        return str(e.value)

    write_adapter(str(root / "big"), hf, ("q_proj",), r=16, alpha=16, seed=3)
    assert "'r' is 16, above max_lora_rank=8" in err(LoRARequest("big", 10, str(root / "big")))
    write_adapter(str(root / "head"), hf, ("q_proj",), r=4, alpha=4, seed=3,
                  config_extra={"target_modules": ["q_proj", "lm_head"]})
    assert "target_modules" in (m := err(LoRARequest("head", 11, str(root / "head")))) and "lm_head" in m
    write_adapter(str(root / "nofile"), hf, ("q_proj",), r=4, alpha=4, seed=3)
    os.remove(root / "nofile" / "adapter_model.safetensors")
    assert "adapter_model.safetensors: missing" in err(LoRARequest("nofile", 12, str(root / "nofile")))
    assert "does not exist" in err(LoRARequest("nowhere", 13, str(root / "nowhere")))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(root / "a1"))
    with LLM(path, num_blocks=16) as plain:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            plain.generate([[5, 6]], sp, lora_request=LoRARequest("a1", 1, str(root / "a1")))


def test_kv_blocks_are_keyed_and_reported_by_adapter():
    """The prefix cache's hashes differ per adapter load; KV events carry the adapter's id (vLLM's lora_id)."""
    from types import SimpleNamespace

    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request
    kv = KVCacheManager(16, 4, kv_events=True)
    toks = list(range(2, 11))
    reqs = [Request(f"r{i}", toks) for i in range(3)]
    reqs[1].lora = SimpleNamespace(key="lora:a:1:1", int_id=1)
    reqs[2].lora = SimpleNamespace(key="lora:b:2:2", int_id=2)
    hashes = [kv.update_block_hashes(r)[:2] for r in reqs]
    assert len({h[0] for h in hashes}) == 3 and len({h[1] for h in hashes}) == 3
    for r in reqs:
        assert kv.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    assert [e.lora_id for e in kv.events.take()] == [None, 1, 2]


def test_lora_settings_and_devices_refused_before_the_load(monkeypatch):
    from engine import device
    from engine.llm_engine import EngineArgs
    from engine.lora import check_lora_args
    with pytest.raises(ValueError, match="max_lora_rank"):
        check_lora_args(EngineArgs(enable_lora=True, max_lora_rank=0, device="cpu"))
    monkeypatch.setattr(device, "resolve_device", lambda setting: "vulkan")
    with pytest.raises(ValueError, match="CPU and CUDA only"):
        LLM("no-such-model-is-loaded", enable_lora=True, device="vulkan")


def test_gguf_checkpoint_takes_hf_adapters(setup):
    """A GGUF llama's q/k rows are permuted for rope on adjacent pairs: an HF adapter's q/k deltas follow."""
    from tests.gguf_export import write_gguf
    root, _, hf, refs, reqs, _ = setup
    gguf = write_gguf(hf, str(root / "model.gguf"))
    p = _prompts(1, seed=9)[0]
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1, detokenize=False)
    with LLM(gguf, enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=32, max_logprobs=-1) as llm:
        out = llm.generate([p], sp, lora_request=reqs["a2"])[0]
    ref = hf_logprobs(refs["a2"], p)
    np.testing.assert_allclose(prompt_logprob_rows(out.prompt_logprobs, p), ref[:-1], **FLOAT_TOL)
