"""The table of model architectures: one `Arch` record per architecture, in the spirit of llama.cpp's llama-arch
tables. The config readers (engine/config.py), the loader (engine/loader.py), the model registry
(engine/models/__init__.py) and the model code (decoder.py, moe.py, mla.py) read an architecture's facts from its
record instead of testing its name.

A record holds
  * its spellings: HF config.json `model_type`s and `architectures` class names, GGUF `general.architecture`
    names. `arch_of(name)` maps any of them to the record; it is the one place aliases are normalised
    (llama.cpp's "gpt-oss" and HF's "gpt_oss" are one architecture, `ModelConfig.architecture` is the record's
    name);
  * config keys: the defaults of HF's config class for the keys we read, HF key spellings that differ from
    llama's (GPT-2's n_embd ...), and the GGUF values llama.cpp hard-codes for the architecture;
  * tensor names where they differ from the shared map `TENSORS` (llama's HF and GGUF names, GPT-2's);
  * traits: norm type and placement, q/k norms, positions and the GGUF rope layout, attention biases, tied
    embeddings, MLP form, activation, scaling quirks (Gemma's embedding scale), sliding-window layout, MoE
    routing, MLA.

Adding a dense architecture that the decoder's building blocks cover is one record here plus its test
(docs/ARCHITECTURE.md, "How to add a model").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

# ------------------------------------------------------------------------------------------- tensor names

# logical name -> candidate checkpoint names, tried in order ({i} = layer index): the llama layout under its HF
# and GGUF names, GPT-2's, Gemma-3 multimodal's text tower. A record's `tensors` replaces entries.
TENSORS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "embed": ("token_embd.weight", "model.embed_tokens.weight", "transformer.wte.weight", "wte.weight",
              "model.language_model.embed_tokens.weight"),
    "pos_embed": ("position_embd.weight", "transformer.wpe.weight", "wpe.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight", "transformer.ln_f.weight", "ln_f.weight",
                   "model.language_model.norm.weight"),
    "final_norm_b": ("output_norm.bias", "transformer.ln_f.bias", "ln_f.bias"),
    "lm_head": ("output.weight", "lm_head.weight"),
    "attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight",
                  "transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.weight",
                  "model.language_model.layers.{i}.input_layernorm.weight"),
    "attn_norm_b": ("blk.{i}.attn_norm.bias", "transformer.h.{i}.ln_1.bias", "h.{i}.ln_1.bias"),
    "q": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    "k": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    "v": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    "q_b": ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    "k_b": ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    "v_b": ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    # fused q/k/v (GPT-2's c_attn, Phi-3's qkv_proj): used where the checkpoint has no separate q
    "qkv": ("blk.{i}.attn_qkv.weight", "transformer.h.{i}.attn.c_attn.weight", "h.{i}.attn.c_attn.weight",
            "model.layers.{i}.self_attn.qkv_proj.weight"),
    "qkv_b": ("blk.{i}.attn_qkv.bias", "transformer.h.{i}.attn.c_attn.bias", "h.{i}.attn.c_attn.bias"),
    # Phi-3: gate and up in one matrix, gate rows first (GGUF: ffn_up with 2 x intermediate rows, no ffn_gate)
    "gate_up": ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight"),
    "q_norm": ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    "k_norm": ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    "o": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight",
          "transformer.h.{i}.attn.c_proj.weight", "h.{i}.attn.c_proj.weight"),
    "o_b": ("blk.{i}.attn_output.bias", "model.layers.{i}.self_attn.o_proj.bias", "transformer.h.{i}.attn.c_proj.bias",
            "h.{i}.attn.c_proj.bias"),
    "sinks": ("blk.{i}.attn_sinks.weight", "model.layers.{i}.self_attn.sinks"),
    # the norm after attention (norm_placement "sandwich" / "post")
    "post_attn_norm": ("blk.{i}.post_attention_norm.weight",),
    # the norm before the MLP: HF's post_attention_layernorm in the llama layout
    "ffn_norm": ("blk.{i}.ffn_norm.weight", "transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.weight",
                 "model.layers.{i}.post_attention_layernorm.weight"),
    "ffn_norm_b": ("blk.{i}.ffn_norm.bias", "transformer.h.{i}.ln_2.bias", "h.{i}.ln_2.bias"),
    "post_ffn_norm": ("blk.{i}.post_ffw_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight",
                      "model.language_model.layers.{i}.post_feedforward_layernorm.weight"),
    "gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    "up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", "transformer.h.{i}.mlp.c_fc.weight",
           "h.{i}.mlp.c_fc.weight"),
    "up_b": ("transformer.h.{i}.mlp.c_fc.bias", "h.{i}.mlp.c_fc.bias", "blk.{i}.ffn_up.bias"),
    "down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", "transformer.h.{i}.mlp.c_proj.weight",
             "h.{i}.mlp.c_proj.weight"),
    "down_b": ("transformer.h.{i}.mlp.c_proj.bias", "h.{i}.mlp.c_proj.bias", "blk.{i}.ffn_down.bias"),
})

_HF_POST_ATTN = "model.layers.{i}.post_attention_layernorm.weight"
_HF_PRE_FFN = "model.layers.{i}.pre_feedforward_layernorm.weight"

# ------------------------------------------------------------------------------------------- records

# keys HF's config classes mostly agree on, for a model_type without a record of its own
GENERIC_HF_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu"))

_EXPERTS = ("model.layers.{i}.mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class MoE:
    """How a mixture-of-experts checkpoint of this architecture routes (engine/models/moe.py, mla.py). Whether a
    model is sparse is the checkpoint's to say (expert count in its config, router tensors per layer)."""
    routing: str = "softmax_topk"   # softmax over every expert, then the top k | "topk_softmax": softmax over the
    #                                 top-k logits (gpt-oss) | "sigmoid": sigmoid scores (DeepSeek-V3)
    norm_topk: bool | None = None   # HF: top-k weights always renormalised (Mixtral); None: config.norm_topk_prob
    gguf_norm_topk: bool = False    # llama.cpp's build_moe_ffn norm_w when the GGUF has no expert_weights_norm
    hf_experts: tuple = _EXPERTS    # HF per-expert tensor prefix and (gate, up, down) names
    oai_experts: bool = False       # gpt-oss's HF experts: fused gate/up rows interleaved, biases, MXFP4 blocks,
    #                                 clamped SwiGLU (alpha 1.702, limit 7)


@dataclass(frozen=True, eq=False)
class Arch:
    """One architecture's facts. Every default is llama's, so a record lists only where it differs."""
    name: str                                   # the canonical name: ModelConfig.architecture
    hf_model_types: tuple[str, ...] = ()        # config.json model_type spellings
    hf_architectures: tuple[str, ...] = ()      # config.json "architectures" class names
    gguf_names: tuple[str, ...] = ()            # GGUF general.architecture spellings (llama.cpp's)
    model: str = "decoder"                      # "decoder" (DecoderLM) | "mla" (MLADecoderLM) | "encoder"
    #                                             (BertEncoder, embeddings only) | "whisper" (WhisperModel,
    #                                             transcription only) | "unimplemented"
    missing: str = ""                           # "unimplemented": the model code that is not written yet

    # ---- HF config.json
    # HF's config-class defaults for the keys we read
    hf_defaults: Mapping[str, Any] = field(default_factory=lambda: GENERIC_HF_DEFAULTS)
    hf_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # our key -> its spellings, where not llama's
    hf_sliding: str = "window"                  # which layers slide when config.json lists no layer_types:
    #                                             "window": all once sliding_window is set; "max_window_layers":
    #                                             Qwen's use_sliding_window + layers from max_window_layers on;
    #                                             "pattern": every sliding_pattern-th layer is global
    sliding_pattern: int | None = None          # every N-th layer global, the rest slide (HF "pattern", and GGUF,
    #                                             where llama.cpp hard-codes it: set_swa_pattern)
    sliding_pattern_key: str | None = None      # HF key that overrides sliding_pattern (Gemma-3)

    # ---- GGUF metadata (keys after "{general.architecture}.")
    gguf_defaults: Mapping[str, Any] = field(default_factory=dict)  # what llama.cpp assumes when the file omits a key
    gguf_swa_rope_theta: float | None = None    # rope base of the sliding layers (llama.cpp hard-codes it)
    gguf_wide_query_layers: int | None = None   # the one depth whose query scale is 1/sqrt(hidden/heads), not
    #                                             1/sqrt(head_dim) (Gemma 27B's; llama.cpp keys it on n_layer)
    gguf_yarn_untruncated: bool = False         # YaRN correction range left unrounded (HF truncate: false)
    gguf_longrope_tensors: bool = False         # LongRoPE factors as rope_factors_{short,long} tensors
    gguf_qk_permuted: bool = False              # converter permutes Q/K rows: rope on adjacent pairs (ggml NORM)

    # ---- traits
    norm: str = "rms"                           # "rms" | "layernorm" (with bias)
    norm_placement: str = "pre"                 # "pre": before attention and MLP; "sandwich": also after each
    #                                             (Gemma); "post": after each only (OLMo 2)
    hf_norm_offset: float = 0.0                 # added to stored norm weights in HF checkpoints (Gemma: 1 + w;
    #                                             llama.cpp's converter stores w + 1)
    qk_norm: bool = False                       # RMSNorm over q and k (per head, or over all heads: see below)
    qk_norm_full_width: bool = False            # q/k norms over all heads at once (OLMo 2)
    position: str = "rope"                      # "rope" | "learned" (absolute position embeddings)
    local_rope: bool = False                    # sliding layers rotate with their own base (rope_local_theta)
    attention_bias: bool | None = None          # True: q/k/v always have biases (Qwen2); None: config / tensors
    mlp: str = "gated"                          # "gated": act(gate) * up -> down; "plain": up -> act -> down
    activation: str = "silu"                    # the activation a GGUF implies (it has no key for it)
    embed_scale: str | None = None              # "sqrt_hidden": embeddings times sqrt(hidden) (Gemma)
    tie_embeddings: str = "config"              # "config": config says; "if_missing": the embedding whenever the
    #                                             file has no output projection (GPT-2)
    hf_linear_layout: str = "out_in"            # HF weights (out, in), or "in_out" (GPT-2's Conv1D)
    ffn_default_mult: int | None = None         # MLP width multiple of hidden when the config has none (GPT-2)
    llama_layout: bool = False                  # every layer has the llama tensors (checked at load)
    fused_gate_up: bool = False                 # gate and up in one tensor, q/k/v in one (Phi-3; shape check)
    moe: MoE = MoE()                            # routing of this architecture's sparse checkpoints
    mla: bool = False                           # multi-head latent attention (DeepSeek-V2/V3)
    mla_rope_interleave_key: bool = False       # HF rope_interleave: false switches to rotate-half (DeepSeek-V3)
    tensors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # entries replacing TENSORS'

    def hf_key(self, key: str) -> tuple[str, ...]:
        """config.json spellings of `key` (a llama config.json key), in the order they are tried."""
        return self.hf_keys.get(key, (key,))

    def tensor(self, key: str) -> tuple[str, ...]:
        """Candidate checkpoint names of logical tensor `key` ({i}: layer index)."""
        return self.tensors.get(key) or TENSORS[key]

    @property
    def layernorm(self) -> bool:
        return self.norm == "layernorm"


def _ro(**kw) -> Mapping:
    return MappingProxyType(kw)


_GEMMA_TENSORS = _ro(
    post_attn_norm=("blk.{i}.post_attention_norm.weight", _HF_POST_ATTN),
    ffn_norm=(_HF_PRE_FFN,) + TENSORS["ffn_norm"][:3])

ARCHS: tuple[Arch, ...] = (
    Arch("llama", ("llama",), ("LlamaForCausalLM",), ("llama",),
         hf_defaults=_ro(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                         bos_token_id=1, eos_token_id=2),
         gguf_qk_permuted=True, llama_layout=True,
         # llama.cpp writes Mixtral as "llama" with {arch}.expert_count
         moe=MoE(gguf_norm_topk=True)),
    Arch("mistral", ("mistral",), ("MistralForCausalLM",), (),       # llama.cpp writes Mistral as "llama"
         hf_defaults=_ro(max_position_embeddings=4096 * 32, rope_theta=10000.0, rms_norm_eps=1e-6,
                         num_key_value_heads=8, tie_word_embeddings=False, hidden_act="silu", sliding_window=4096,
                         bos_token_id=1, eos_token_id=2),
         llama_layout=True),
    Arch("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), ("qwen2",),
         hf_defaults=_ro(max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-6, num_key_value_heads=32,
                         tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                         sliding_window=4096, max_window_layers=28),
         hf_sliding="max_window_layers", attention_bias=True, llama_layout=True),
    Arch("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), ("qwen3",),
         hf_defaults=_ro(max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-6, num_key_value_heads=32,
                         tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                         use_sliding_window=False, sliding_window=4096, max_window_layers=28, head_dim=128),
         hf_sliding="max_window_layers", qk_norm=True, llama_layout=True),
    Arch("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), ("gemma2",),
         hf_defaults=_ro(max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         hidden_activation="gelu_pytorch_tanh", num_key_value_heads=4, attention_bias=False,
                         query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                         attn_logit_softcapping=50.0, head_dim=256, bos_token_id=2, eos_token_id=1,
                         pad_token_id=0),
         hf_sliding="pattern", sliding_pattern=2,
         # llama.cpp: window 4096 and soft-caps 30 (final) / 50 (attention) unless the file says
         gguf_defaults=_ro(**{"attention.sliding_window": 4096, "final_logit_softcapping": 30.0,
                              "attn_logit_softcapping": 50.0}),
         gguf_wide_query_layers=46,
         norm_placement="sandwich", hf_norm_offset=1.0, local_rope=True, activation="gelu_pytorch_tanh",
         embed_scale="sqrt_hidden", llama_layout=True, tensors=_GEMMA_TENSORS),
    Arch("gemma3", ("gemma3", "gemma3_text"), ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3",),
         hf_defaults=_ro(max_position_embeddings=131072, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                         num_key_value_heads=4, attention_bias=False, query_pre_attn_scalar=256,
                         sliding_window=4096, sliding_window_pattern=6, final_logit_softcapping=None,
                         attn_logit_softcapping=None, head_dim=256, bos_token_id=2, eos_token_id=1, pad_token_id=0),
         hf_sliding="pattern", sliding_pattern=6, sliding_pattern_key="sliding_window_pattern",
         # llama.cpp hard-codes Gemma-3's layout: every 6th layer global, the rest a 4096 window with rope base
         # 10k; none of it is in the file
         gguf_defaults=_ro(**{"rope.freq_base": 1_000_000.0, "attention.sliding_window": 4096}),
         gguf_swa_rope_theta=10000.0, gguf_wide_query_layers=62,
         norm_placement="sandwich", hf_norm_offset=1.0, qk_norm=True, local_rope=True,
         activation="gelu_pytorch_tanh", embed_scale="sqrt_hidden", llama_layout=True, tensors=_GEMMA_TENSORS),
    Arch("gpt2", ("gpt2",), ("GPT2LMHeadModel",), ("gpt2",),
         hf_defaults=_ro(n_positions=1024, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                         activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256),
         hf_keys=_ro(hidden_size=("n_embd", "hidden_size"), num_hidden_layers=("n_layer", "num_hidden_layers"),
                     num_attention_heads=("n_head", "num_attention_heads"), intermediate_size=("n_inner",),
                     max_position_embeddings=("n_positions", "max_position_embeddings")),
         norm="layernorm", position="learned", mlp="plain", activation="gelu_new", tie_embeddings="if_missing",
         hf_linear_layout="in_out", ffn_default_mult=4),
    Arch("phi3", ("phi3",), ("Phi3ForCausalLM",), ("phi3",),
         hf_defaults=_ro(max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         hidden_act="silu", sliding_window=None, bos_token_id=1, eos_token_id=32000,
                         pad_token_id=32000),
         gguf_longrope_tensors=True, fused_gate_up=True),
    Arch("granite", ("granite",), ("GraniteForCausalLM",), ("granite",),
         hf_defaults=_ro(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
                         embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                         logits_scaling=1.0),
         gguf_qk_permuted=True, llama_layout=True),
    Arch("olmo2", ("olmo2",), ("Olmo2ForCausalLM",), ("olmo2",),
         hf_defaults=_ro(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         hidden_act="silu", attention_bias=False, eos_token_id=50279, pad_token_id=1),
         # HF's post_attention_layernorm is a post-norm here, and there is no norm before attention or the MLP
         norm_placement="post", qk_norm=True, qk_norm_full_width=True,
         tensors=_ro(post_attn_norm=("blk.{i}.post_attention_norm.weight", _HF_POST_ATTN))),
    Arch("gpt_oss", ("gpt_oss",), ("GptOssForCausalLM",), ("gpt-oss",),
         hf_defaults=_ro(max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, hidden_act="silu", attention_bias=True, sliding_window=128,
                         head_dim=64, num_key_value_heads=8),
         # even layers slide (llama.cpp: set_swa_pattern(2); the window is in the file); its YaRN keeps the
         # correction range unrounded
         hf_sliding="pattern", sliding_pattern=2, gguf_yarn_untruncated=True,
         moe=MoE(routing="topk_softmax", oai_experts=True),
         # llama.cpp names the pre-MLP norm post_attention_norm
         tensors=_ro(ffn_norm=TENSORS["ffn_norm"] + ("blk.{i}.post_attention_norm.weight",))),
    # mixture-of-experts (the decoder with engine/models/moe.py MLPs)
    Arch("mixtral", ("mixtral",), ("MixtralForCausalLM",), (),       # GGUF: "llama" with experts
         moe=MoE(norm_topk=True,
                 hf_experts=("model.layers.{i}.block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")))),
    Arch("qwen2_moe", ("qwen2_moe",), ("Qwen2MoeForCausalLM",), ("qwen2moe",), hf_sliding="max_window_layers"),
    Arch("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), ("qwen3moe",), hf_sliding="max_window_layers",
         moe=MoE(gguf_norm_topk=True)),
    Arch("olmoe", ("olmoe",), ("OlmoeForCausalLM",), ("olmoe",)),
    # multi-head latent attention (engine/models/mla.py), dense or MoE; llama.cpp's deepseek2 is both V2 and V3
    # (its routing from the file's expert_gating_func, its rope on interleaved pairs): the V2 record
    Arch("deepseek_v2", ("deepseek_v2",), ("DeepseekV2ForCausalLM",), ("deepseek2",), model="mla", mla=True),
    Arch("deepseek_v3", ("deepseek_v3",), ("DeepseekV3ForCausalLM",), (), model="mla", mla=True,
         moe=MoE(routing="sigmoid"), mla_rope_interleave_key=True),
    # bidirectional encoders for embeddings (engine/models/encoder.py; engine.pooling)
    Arch("bert", ("bert",), ("BertModel", "BertForMaskedLM"), ("bert",), model="encoder"),
    # encoder-decoder speech recognition (engine/models/whisper.py; engine.transcription): config.json's decoder
    # keys read as the text model's, the encoder's by the model code
    Arch("whisper", ("whisper",), ("WhisperForConditionalGeneration",), (), model="whisper",
         hf_defaults=_ro(d_model=384, decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536,
                         max_target_positions=448, vocab_size=51865, activation_function="gelu",
                         tie_word_embeddings=True, eos_token_id=50256, bos_token_id=50256, pad_token_id=50256,
                         layer_norm_epsilon=1e-5),
         hf_keys=_ro(hidden_size=("d_model",), num_hidden_layers=("decoder_layers",),
                     num_attention_heads=("decoder_attention_heads",), intermediate_size=("decoder_ffn_dim",),
                     max_position_embeddings=("max_target_positions",)),
         norm="layernorm", position="learned", mlp="plain", activation="gelu"),
    # configs we can read but whose model code is not written yet
    Arch("falcon", ("falcon",), ("FalconForCausalLM",), ("falcon",), model="unimplemented",
         missing="Falcon's parallel attention/MLP block and ALiBi"),
    Arch("mamba", ("mamba",), ("MambaForCausalLM",), ("mamba",), model="unimplemented",
         missing="selective state-space (Mamba) layers"),
    Arch("qwen3_next", ("qwen3_next",), ("Qwen3NextForCausalLM",), ("qwen3next",), model="unimplemented",
         missing="gated delta-net (linear attention) layers"),
)

_BY_NAME: dict[str, Arch] = {}
for _a in ARCHS:
    for _n in (_a.name, *_a.hf_model_types, *_a.hf_architectures, *_a.gguf_names):
        if _BY_NAME.setdefault(_n, _a) is not _a:
            raise AssertionError(f"architecture spelling {_n!r} names two records")
del _a, _n


def arch_of(name: str) -> Arch:
    """The record for any spelling of an architecture (canonical name, HF model_type or architectures class name,
    GGUF general.architecture). An unknown name gets a record of the generic defaults under that name (its config
    still reads; the model registry refuses it by name)."""
    rec = _BY_NAME.get(name)
    return rec if rec is not None else Arch(str(name))


def canonical_name(name: str) -> str:
    """The canonical architecture name for any of its spellings (`arch_of(name).name`)."""
    return arch_of(name).name


def known(name: str) -> bool:
    return name in _BY_NAME


def names(model: str | None = None) -> tuple[str, ...]:
    """Canonical names of the records, of one model kind ("decoder", "mla", "encoder", "unimplemented") if given."""
    return tuple(a.name for a in ARCHS if model is None or a.model == model)
