"""The H200 benchmark peers, checked on the CPU: the gpt-fast-style torch decoder gives transformers' greedy
tokens; the random-model writer produces folders that transformers, the peer and the engine's loader read."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from perf.peers import gpt_fast  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # tiny matrices on a shared 2-core host: torch's intra-op threads only contend (40 ms per 64x112 linear)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny(arch: str):
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, rms_norm_eps=1e-5)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3-rope":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=24)            # head_dim != hidden / heads, q/k norms
    if arch == "qwen2-tied":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})   # q/k/v biases, tied head
    raise ValueError(arch)


def _hf_model(arch, path, seed=0):
    torch.manual_seed(seed)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2-tied": tf.Qwen2ForCausalLM}.get(arch, tf.LlamaForCausalLM)
    model = cls(_tiny(arch)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:                      # non-trivial norms (HF initialises them to ones)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "qwen3", "qwen2-tied"])
def test_gpt_fast_greedy_equals_transformers(arch, tmp_path):
    hf = _hf_model(arch, tmp_path)
    rng = np.random.default_rng(1)
    B, T, N = 3, 11, 24
    prompt = torch.from_numpy(rng.integers(0, 211, (B, T))).long()
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=N,
                          min_new_tokens=N, pad_token_id=0)[:, T:]
    peer = gpt_fast.load(str(tmp_path), device="cpu", dtype=torch.float32)
    gen = gpt_fast.Generator(peer, batch=B, max_len=64)
    out, timing = gen.generate(prompt, N)
    assert out.shape == (B, N) and timing["total_s"] >= timing["ttft_s"] > 0
    assert torch.equal(out, ref), (out, ref)
    # the cache is reused: a second call with another batch of prompts gives that batch's tokens
    prompt2 = torch.from_numpy(rng.integers(0, 211, (B, T))).long()
    with torch.no_grad():
        ref2 = hf.generate(prompt2, attention_mask=torch.ones_like(prompt2), do_sample=False, max_new_tokens=N,
                           min_new_tokens=N, pad_token_id=0)[:, T:]
    assert torch.equal(gen.generate(prompt2, N)[0], ref2)


def test_gpt_fast_refuses_what_it_cannot_run(tmp_path):
    _hf_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    with pytest.raises(ValueError, match="model_type 'gemma3'"):
        gpt_fast.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gen = gpt_fast.Generator(gpt_fast.load(str(tmp_path)), batch=2, max_len=16)
    with pytest.raises(ValueError, match="exceed max_len"):
        gen.generate(torch.zeros(2, 10, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="batch 2"):
        gen.generate(torch.zeros(3, 4, dtype=torch.long), 2)


def test_random_model_folder_reads_everywhere(tmp_path):
    """The random checkpoint (smoke dims) loads in transformers with the written values, in the peer with the
    same greedy tokens as transformers, and in the engine's loader and tokenizer."""
    from engine.loader import load_checkpoint
    from perf.peers.make_random_model import write_model
    cfg = write_model(str(tmp_path), "qwen3-8b", smoke=True, layers=1, quiet=True)
    assert cfg.num_hidden_layers == 1 and cfg.model_type == "qwen3"
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert set(sd) == set(hf.state_dict())
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16 and 0.015 < float(w.float().std()) < 0.025
    assert torch.equal(hf.model.layers[0].mlp.up_proj.weight, w.float())
    norm = sd["model.layers.0.self_attn.q_norm.weight"].float()
    assert abs(float(norm.mean()) - 1.0) < 0.05 and float(norm.std()) > 0.01
    prompt = torch.randint(2, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, pad_token_id=0)[:, 9:]
    gen = gpt_fast.Generator(gpt_fast.load(str(tmp_path), dtype=torch.float32), batch=2, max_len=32)
    assert torch.equal(gen.generate(prompt, 12)[0], ref)
    ck = load_checkpoint(str(tmp_path))
    assert ck["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert ck.tokenizer.decode([5, 7]) == "t5 t7"
    # a second shape and the --layers bound
    with pytest.raises(ValueError, match="--layers must be in"):
        write_model(str(tmp_path / "x"), "llama3-8b", layers=33, quiet=True)


def test_bench_kernels_smoke_on_host_memory_device(capsys):
    """The kernel harness's jitkern device-array paths (zero-copy views of torch memory, linear, its variant
    name and error check) on the fake device: every row runs and jitkern's outputs match the f32 reference."""
    from perf import bench_kernels_cuda
    rc = bench_kernels_cuda.main(["--smoke", "--device", "cpu", "--only", "gemv", "elem", "--reps", "1",
                                  "--budget", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and " 0 failed" in out, out
    rows = [line for line in out.splitlines() if "jitkern" in line]
    assert len(rows) == 4, out
    for line in rows:
        err = float(line.split()[-2])
        assert err < 1e-5, line


def test_bench_e2e_report_ratios_and_token_checks():
    from perf import bench_e2e_cuda as be
    a = be.parse(["--model", "x", "--concurrency", "1", "4", "--output-len", "5"])
    res = {"hf": {"runs": {"1": {"wall_s": 2.0, "ttft_s": 0.4, "tokens0": [3, 4, 5, 6, 7]},
                           "4": {"wall_s": 4.0, "ttft_s": 0.8, "tokens0": [3, 4, 5, 6, 7]}},
                  "tokens0_f32": [3, 4, 5, 9, 9]},
           "gpt_fast": {"error": "RuntimeError: boom"},
           "ours": {"runs": {"1": {"wall_s": 0.5, "ttft_s": 0.1, "tokens0": [3, 4, 5, 9, 9]},
                             "4": {"wall_s": 1.0, "ttft_s": 0.2, "tokens0": [3, 4, 5, 9, 8]}}}}
    text = "\n".join(be.report(res, a))
    assert res["ours"]["runs"]["4"]["tok_s"] == pytest.approx(4 * 5 / 1.0)
    assert res["ours"]["runs"]["1"]["decode_tok_s"] == pytest.approx(4 / 0.4)
    assert "gpt-fast-style peer    FAILED: RuntimeError: boom" in text
    assert "conc   1: tok/s  4.000x  decode  4.000x  TTFT  4.000x" in text
    assert "ours vs transformers f32:  match (5/5)" in text
    assert "ours vs transformers bf16: MISMATCH at token 3" in text
    assert "(batch invariance): MISMATCH at token 4" in text
    prompts = be.make_prompts(50, [1, 4], 7, seed=3)
    assert prompts["timed"]["1"][0] == prompts["timed"]["4"][0] != prompts["warm"]["1"][0]
    assert all(2 <= t < 50 and len(p) == 7 for p in prompts["timed"]["4"] for t in p)


def test_bench_e2e_report_one_output_token():
    """--output-len 1 (a TTFT run): no decode steps, the report says nan instead of dividing by zero."""
    from perf import bench_e2e_cuda as be
    a = be.parse(["--model", "x", "--concurrency", "1", "--output-len", "1"])
    run = {"wall_s": 0.2, "ttft_s": 0.2, "tokens0": [5]}
    res = {"hf": {"runs": {"1": dict(run)}}, "ours": {"runs": {"1": {**run, "ttft_s": 0.1, "wall_s": 0.1}}}}
    text = "\n".join(be.report(res, a))
    assert "decode    nanx  TTFT  2.000x" in text, text


def test_bench_e2e_reports_the_median_of_repeated_calls():
    """--repeat N (default 3): of the timed calls the one with the median wall time is reported (its own TTFT),
    every wall kept; calls that disagree on the greedy tokens are an error for ours (strict) and a counted
    "wobble" for a peer; --repeat 0 is refused."""
    from perf import bench_e2e_cuda as be
    assert be.parse(["--model", "x"]).repeat == 3
    runs = [{"wall_s": w, "ttft_s": w / 10, "tokens": [[1, 2], [3]]} for w in (0.9, 0.6, 0.7)]
    got = be.median_run(runs, strict=True)
    assert got["wall_s"] == 0.7 and got["ttft_s"] == pytest.approx(0.07) and got["walls_s"] == [0.9, 0.6, 0.7]
    assert got["tokens0"] == [1, 2] and got["wobble"] == 0 and got["prompts"] == 2 and "tokens" not in got
    assert be.median_run(runs[:2], strict=True)["wall_s"] == 0.6
    changed = runs + [{"wall_s": 1.0, "ttft_s": 0.1, "tokens": [[1, 3], [3]]}]
    with pytest.raises(RuntimeError, match="different greedy tokens for 1 of 2 prompts"):
        be.median_run(changed, strict=True)
    assert be.median_run(changed, strict=False)["wobble"] == 1
    with pytest.raises(SystemExit):
        be.parse(["--model", "x", "--repeat", "0"])
