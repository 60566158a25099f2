"""The table of model architectures (engine/models/arch.py): every spelling names one record, the spellings are
the ones transformers and llama.cpp use, the HF defaults are the config classes' own, and the config readers,
the loader and the registry take an architecture's facts from its record."""
import pytest

from engine import models
from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.models import arch
from engine.models.arch import ARCHS, TENSORS, arch_of, canonical_name


def test_every_spelling_names_one_record():
    seen = {}
    for rec in ARCHS:
        for name in (rec.name, *rec.hf_model_types, *rec.hf_architectures, *rec.gguf_names):
            assert seen.setdefault(name, rec.name) == rec.name, name
            assert arch_of(name) is rec and canonical_name(name) == rec.name
    # the aliases that used to travel separately
    assert canonical_name("gpt-oss") == canonical_name("gpt_oss") == "gpt_oss"
    assert canonical_name("gemma3_text") == "gemma3" and canonical_name("qwen3moe") == "qwen3_moe"
    assert canonical_name("deepseek2") == "deepseek_v2" and canonical_name("LlamaForCausalLM") == "llama"
    # an unknown name keeps its spelling and the generic defaults; the registry refuses it by name
    other = arch_of("not_an_arch")
    assert other.name == "not_an_arch" and not arch.known("not_an_arch")
    assert other.hf_defaults == arch.GENERIC_HF_DEFAULTS and other.model == "decoder"


def test_registry_is_the_table():
    assert models.SUPPORTED == tuple(a.name for a in ARCHS if a.model == "decoder")
    assert models.MLA == ("deepseek_v2", "deepseek_v3") and models.ENCODERS == ("bert",)
    assert set(models.KNOWN_UNIMPLEMENTED) == {"falcon", "mamba", "qwen3_next"}
    assert all(models.KNOWN_UNIMPLEMENTED.values())
    for rec in ARCHS:
        assert set(rec.tensors) <= set(TENSORS), rec.name
        assert rec.norm in ("rms", "layernorm") and rec.norm_placement in ("pre", "sandwich", "post")
        assert rec.position in ("rope", "learned") and rec.mlp in ("gated", "plain")
        assert rec.hf_sliding in ("window", "max_window_layers", "pattern")
        assert (rec.hf_sliding == "pattern") <= bool(rec.sliding_pattern), rec.name
        assert rec.moe.routing in ("softmax_topk", "topk_softmax", "sigmoid")


def test_spellings_are_the_ones_transformers_and_llama_cpp_use():
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    llama_cpp = set(gguf.MODEL_ARCH_NAMES.values())
    for rec in ARCHS:
        for name in rec.gguf_names:
            assert name in llama_cpp, (rec.name, name)
        for name in rec.hf_model_types:
            assert name in transformers.CONFIG_MAPPING, (rec.name, name)
        for name in rec.hf_architectures:
            assert hasattr(transformers, name), (rec.name, name)


# HF defaults of ours that are not the config class's, and why that is harmless
_INERT = {("qwen2", "sliding_window"), ("qwen3", "sliding_window"),    # use_sliding_window defaults to false
          ("whisper", "layer_norm_epsilon")}        # WhisperConfig has no key: its LayerNorms are torch's 1e-5


@pytest.mark.parametrize("rec", [a for a in ARCHS if a.hf_defaults is not arch.GENERIC_HF_DEFAULTS],
                         ids=lambda a: a.name)
def test_hf_defaults_are_the_config_classes(rec):
    transformers = pytest.importorskip("transformers")
    ref = transformers.CONFIG_MAPPING[rec.hf_model_types[-1]]()      # gemma3: the text config (gemma3_text)
    rope = getattr(ref, "rope_parameters", None) or {}
    for key, ours in rec.hf_defaults.items():
        if (rec.name, key) in _INERT:
            continue
        if key == "rope_theta" and not hasattr(ref, key):          # transformers v5: rope_parameters
            theirs = (rope.get(FULL_ATTENTION) or rope)["rope_theta"]
        elif key == "rope_local_base_freq" and not hasattr(ref, key):
            theirs = rope[SLIDING_ATTENTION]["rope_theta"]
        elif key == "sliding_window_pattern" and not hasattr(ref, key):  # v5: the pattern is in layer_types
            theirs = ref.layer_types.index(FULL_ATTENTION) + 1
        else:
            theirs = getattr(ref, key)
        assert ours == theirs, (rec.name, key)


def test_gguf_spellings_read_to_the_canonical_name():
    def meta(a, **more):
        p = a + "."
        return {"general.architecture": a, p + "embedding_length": 64, p + "block_count": 4,
                p + "attention.head_count": 4, p + "attention.head_count_kv": 2, p + "feed_forward_length": 96,
                p + "context_length": 256, p + "vocab_size": 100, p + "attention.layer_norm_rms_epsilon": 1e-6,
                **{p + k: v for k, v in more.items()}}
    c = ModelConfig.from_gguf_metadata(meta("gpt-oss", **{"attention.sliding_window": 64}), tensor_names=[])
    assert (c.architecture, c.gguf_architecture) == ("gpt_oss", "gpt-oss")
    assert c.layer_types == [SLIDING_ATTENTION, FULL_ATTENTION] * 2 and c.sliding_window == 64
    c = ModelConfig.from_gguf_metadata(meta("qwen3moe"), tensor_names=["blk.0.attn_q_norm.weight"])
    assert (c.architecture, c.gguf_architecture, c.qk_norm) == ("qwen3_moe", "qwen3moe", True)
    c = ModelConfig.from_gguf_metadata(meta("gemma3", block_count=7), tensor_names=[])
    # llama.cpp's hard-coded Gemma-3 facts, from the record
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.sliding_window == 4096
    assert c.layer_types == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION, SLIDING_ATTENTION]
    assert c.hidden_act == "gelu_pytorch_tanh" and c.qk_norm and c.query_pre_attn_scalar == 16.0
    c = ModelConfig.from_gguf_metadata(meta("llama"), tensor_names=[])
    assert c.layer_types == [FULL_ATTENTION] * 4 and c.rope_theta == 1e4 and c.hidden_act == "silu"


def test_hf_spellings_read_to_the_canonical_name():
    core = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    c = ModelConfig.from_hf_config({"model_type": "gpt_oss", **core}, source="t")
    assert c.architecture == "gpt_oss" and c.gguf_architecture is None
    assert c.layer_types == [SLIDING_ATTENTION, FULL_ATTENTION] * 2 and c.sliding_window == 128
    c = ModelConfig.from_hf_config({"model_type": "qwen2", **core, "use_sliding_window": True,
                                    "sliding_window": 32, "max_window_layers": 3}, source="t")
    assert c.attention_bias and c.layer_types == [FULL_ATTENTION] * 3 + [SLIDING_ATTENTION]
    c = ModelConfig.from_hf_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                    "n_inner": None, "vocab_size": 100}, source="t")
    assert (c.intermediate_size, c.max_position_embeddings, c.rope_theta, c.norm_type) == (256, 1024, None,
                                                                                          "layernorm")
