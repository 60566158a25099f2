"""kv_cache_dtype="auto" follows the checkpoint's weights (issue 12; vLLM: "auto" = the model dtype, llama.cpp: an
f16 cache): f16 for 16-bit or quantised weights, f32 for f32 ones, decided once by LLMEngine after the load
(engine.sizing.resolve_kv_cache_dtype); explicit spellings override it; anything else is refused naming the field."""
import numpy as np
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sizing import KV_CACHE_DTYPES, kv_cache_dtype_name, resolve_kv_cache_dtype

ENGINE = dict(num_blocks=32, block_size=16, max_num_batched_tokens=64, device="cpu")


def test_the_rule_on_weight_kinds():
    for kinds in ({"f32"}, {"f32", "f64"}):
        assert resolve_kv_cache_dtype("auto", kinds) == "f32"
    # 16-bit, GGUF blocks (the embedded SmolLM2: q4_1 + a q8_0 embedding + f32 matrices elsewhere), FP8 with its f32
    # block scales, MXFP4 experts beside bf16 attention: f16
    for kinds in ({"bf16"}, {"f16"}, {"f16", "f32"}, {"q4_1", "q8_0"}, {"q4_K", "q6_K", "f32"},
                  {"f8_e4m3", "f32", "bf16"}, {"mxfp4", "bf16"}):
        assert resolve_kv_cache_dtype("auto", kinds) == "f16", kinds
        assert resolve_kv_cache_dtype(None, kinds) == "f16"
    for kinds in ({"f32"}, {"bf16"}, {"q4_1"}):
        for name in ("f32", "float32", "fp32"):
            assert resolve_kv_cache_dtype(name, kinds) == "f32"
        for name in ("f16", "float16", "fp16"):
            assert resolve_kv_cache_dtype(name, kinds) == "f16"


def test_weight_kinds_are_the_matrices_kinds():
    from pathlib import Path

    from engine.loader import Checkpoint, TensorRef

    def ref(name, shape, dtype):
        return TensorRef(name=name, shape=shape, dtype=dtype, raw=np.zeros(1, np.uint8), file=Path("x"), offset=0)

    def kinds(*refs):
        return Checkpoint(path=Path("x"), format="safetensors", files=[], config=None,
                          tensors={r.name: r for r in refs}).weight_kinds()

    f32_model = [ref("embed.weight", (64, 8), "f32"), ref("norm.weight", (8,), "bf16"), ref("pos_ids", (1, 64), "i64"),
                 ref("mask", (1, 1, 4, 4), "bool")]
    assert kinds(*f32_model) == {"f32"}            # 1-D tensors and integer / bool buffers do not count
    assert resolve_kv_cache_dtype("auto", kinds(*f32_model)) == "f32"
    # gpt-oss MXFP4 safetensors: uint8 expert blocks + scales beside f32 attention -> "mxfp4" (as its GGUF: f16)
    gpt_oss = f32_model + [ref("experts.down_proj_blocks", (2, 8, 1, 16), "u8"),
                           ref("experts.down_proj_scales", (2, 8, 1), "u8")]
    assert kinds(*gpt_oss) == {"f32", "mxfp4"}
    assert resolve_kv_cache_dtype("auto", kinds(*gpt_oss)) == "f16"
    assert kinds(ref("w", (8, 8), "f8_e4m3"), ref("w_scale_inv", (1, 1), "f32")) == {"f8_e4m3", "f32"}


@pytest.mark.parametrize("bad", ["bf16", "bfloat16", "fp8", "float", "F16", "Auto", "", 16])
def test_a_bad_value_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype=.* is not supported \(expected one of auto, f32, "):
        kv_cache_dtype_name(bad)
    with pytest.raises(ValueError, match=r"kv_cache_dtype="):      # LLM(...): before any load
        LLM("/no/such/model", kv_cache_dtype=bad)


def test_the_server_and_cli_take_the_same_spellings():
    from server.cli import build_parser
    from server.settings import ServerSettings, SettingsError
    assert KV_CACHE_DTYPES == ("auto", "f32", "float32", "fp32", "f16", "float16", "fp16")
    from engine.cli import build_parser as engine_parser
    assert engine_parser().parse_args(["--prompt", "x"]).kv_cache_dtype == "auto"
    for name in KV_CACHE_DTYPES:
        assert build_parser().parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name
        assert engine_parser().parse_args(["--prompt", "x", "--kv-cache-dtype", name]).kv_cache_dtype == name
        s = ServerSettings.from_env({"JITKERN_KV_CACHE_DTYPE": name})
        assert s.engine_kwargs()["kv_cache_dtype"] == name
    with pytest.raises(SettingsError, match="JITKERN_KV_CACHE_DTYPE='bf16'"):
        ServerSettings.from_env({"JITKERN_KV_CACHE_DTYPE": "bf16"})
    assert "auto" in build_parser().format_help()
    # left unset, the engine's default decides (auto)
    assert "kv_cache_dtype" not in ServerSettings.from_env({}).engine_kwargs()


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    """The same tiny random Llama saved in f32 and in bf16 (safetensors, as transformers writes them)."""
    from tests.model_fixtures import tiny_model_dir
    torch = pytest.importorskip("torch")
    return {"f32": tiny_model_dir(tmp_path_factory, "kv-f32", seed=12)[0],
            "bf16": tiny_model_dir(tmp_path_factory, "kv-bf16", seed=12, dtype=torch.bfloat16)[0]}


def _kv_np_dtype(model):
    kinds = {np.dtype(c.dtype) for c in model.k_caches + model.v_caches}
    assert len(kinds) == 1
    return kinds.pop()


@pytest.mark.parametrize("weights, asked, want", [
    ("f32", "auto", "f32"), ("bf16", "auto", "f16"),
    ("f32", "fp16", "f16"), ("f32", "float16", "f16"), ("bf16", "float32", "f32"), ("bf16", "fp32", "f32")])
def test_auto_follows_the_weights_and_explicit_values_override(tiny_paths, weights, asked, want):
    from engine.llm_engine import EngineArgs, LLMEngine
    args = EngineArgs(model=tiny_paths[weights], kv_cache_dtype=asked, num_blocks=32, device="cpu")
    eng = LLMEngine(args)
    try:
        assert eng.checkpoint.weight_kinds() == {weights}
        assert eng.args.kv_cache_dtype == want                  # the resolved value is what the engine reports
        assert args.kv_cache_dtype == asked                     # the caller's args are left as they were
        assert _kv_np_dtype(eng.model) == (np.float16 if want == "f16" else np.float32)
    finally:
        eng.close()


def test_the_engine_refuses_a_bad_value_before_loading():
    from engine.llm_engine import EngineArgs, LLMEngine
    with pytest.raises(ValueError, match="kv_cache_dtype='half' is not supported"):
        LLMEngine(EngineArgs(model="/no/such/model", kv_cache_dtype="half"))


def test_the_pool_is_sized_from_the_resolved_dtype(tiny_paths):
    # the same byte budget holds twice the blocks of an auto (f16) cache on the bf16 checkpoint as of an auto (f32)
    # cache on the f32 one: kv_block_bytes got 2 and 4 bytes, never "auto"
    budget = 1 << 20
    n = {}
    for w in ("f32", "bf16"):
        with LLM(tiny_paths[w], kv_cache_memory=budget, block_size=16, device="cpu") as llm:
            n[w] = llm.engine.num_blocks
            from engine.sizing import kv_block_bytes
            cfg = llm.engine.config
            per_block = kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 2 if w == "bf16" else 4)
            assert n[w] == budget // per_block
    assert n["bf16"] == 2 * n["f32"]


def test_llm_keywords_map_onto_the_engine(tiny_paths):
    from engine.llm_args import engine_kwargs_from_vllm
    assert engine_kwargs_from_vllm({"kv_cache_dtype": "auto"})["kv_cache_dtype"] == "auto"
    assert engine_kwargs_from_vllm({"kv_cache_dtype": "float32"})["kv_cache_dtype"] == "f32"
    assert engine_kwargs_from_vllm({"kv_cache_dtype": "fp16"})["kv_cache_dtype"] == "f16"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        engine_kwargs_from_vllm({"kv_cache_dtype": "fp8"})
    with LLM(tiny_paths["bf16"], kv_cache_dtype="auto", **ENGINE) as llm:
        assert llm.engine.args.kv_cache_dtype == "f16"


def test_a_draft_model_takes_the_targets_resolved_dtype(tiny_paths):
    # target bf16 (auto -> f16), draft f32 (on its own it would be f32): one cache type per engine, as vLLM
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41, 42, 43, 44]]
    with LLM(tiny_paths["bf16"], **ENGINE) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    with LLM(tiny_paths["bf16"], speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                     "model": tiny_paths["f32"]}, **ENGINE) as llm:
        assert _kv_np_dtype(llm.engine.model) == np.float16
        draft = llm.engine.spec.draft.model
        assert {np.dtype(c.dtype) for c in draft.k_caches + draft.v_caches} == {np.dtype(np.float16)}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == base


def test_build_model_refuses_an_unresolved_dtype(tiny_paths):
    from engine.loader import load_checkpoint
    from engine.models import build_model
    with pytest.raises(ValueError, match="kv_dtype must be 'f32' or 'f16', got 'auto'"):
        build_model(load_checkpoint(tiny_paths["f32"]), kv_dtype="auto", device="cpu")


def _smollm2_run(kv):
    from server.app import _engine_facts
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(max_tokens=10, temperature=0, logprobs=5, prompt_logprobs=3)
    with LLM(kv_cache_dtype=kv, num_blocks=32, block_size=16, max_num_batched_tokens=128) as llm:
        outs = llm.generate(prompts, sp)
        resolved = llm.engine.args.kv_cache_dtype
        assert _engine_facts(llm.engine)["args"]["kv_cache_dtype"] == resolved     # /server_info's vllm_config
        cache = _kv_np_dtype(llm.engine.model)
        kinds = llm.engine.checkpoint.weight_kinds()
    got = [(list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
            [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs])
           for o in outs]
    return resolved, cache, kinds, got


def test_embedded_smollm2_auto_is_an_f16_cache():
    """The embedded Q4_1 GGUF: auto resolves to f16, and its greedy tokens and logprobs (prompt and output, top 5)
    are bit for bit those of an explicit f16 run, and not those of an f32 cache (f16 rounding of K/V shows in the
    logprobs: so a rule that fell back to f32 fails here)."""
    auto = _smollm2_run("auto")
    f16 = _smollm2_run("f16")
    f32 = _smollm2_run("float32")
    assert {"q4_1", "q8_0"} <= auto[2]
    assert (auto[0], auto[1]) == ("f16", np.float16)
    assert (f32[0], f32[1]) == ("f32", np.float32)
    assert auto[3] == f16[3]
    assert auto[3] != f32[3]


def test_tensor_parallel_ranks_take_the_resolved_dtype(tiny_paths):
    # rank 0 here and rank 1 in its own process get "f16" for the bf16 checkpoint (a rank handed "auto" would fail
    # to start: build_model refuses it), and the sharded greedy tokens equal the unsharded engine's
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [[5, 17, 33, 2, 9], [7, 8, 9, 10, 11, 12, 13]]
    with LLM(tiny_paths["bf16"], **ENGINE) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    with LLM(tiny_paths["bf16"], tensor_parallel_size=2, tensor_parallel_backend="cpu-pipes", **ENGINE) as llm:
        assert llm.engine.args.kv_cache_dtype == "f16" and llm.engine.model.tensor_parallel_size == 2
        assert _kv_np_dtype(llm.engine.model) == np.float16          # rank 0's shard
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
