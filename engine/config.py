"""Model hyper-parameters, read from a HF ``config.json`` or from a GGUF's metadata.

One ``ModelConfig`` describes the transformer the model code builds. Both sources use different
names for the same facts (``num_hidden_layers`` vs ``llama.block_count``); this module is the only
place that knows both spellings. What differs per architecture (its aliases, HF defaults, the GGUF
values llama.cpp hard-codes, sliding-window layouts, traits) is its record in engine/models/arch.py.

A key a file omits takes the *architecture's* default (the value HF's config class for that
model_type would use: ``Arch.hf_defaults``), never a neutral one -- a Gemma-3 config.json without
``sliding_window`` still gets Gemma-3's 4096-token window. The core dimensions (vocab size, hidden
size, layers, heads) have no safe default: a file without them is refused, naming the key and the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine.errors import ModelLoadError, read_json_object
from engine.models.arch import arch_of
from engine.models.llava import LLAMA_TEXT_DEFAULTS, LLAVA_MODEL_TYPES

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class ModelConfig:
    """What the model code needs to know about a checkpoint's transformer.

    Shapes as the maths sees them: q_proj is (num_heads*head_dim, hidden_size), k/v_proj
    (num_kv_heads*head_dim, hidden_size), gate/up (intermediate_size, hidden_size).
    ``layer_types`` has one entry per layer, FULL_ATTENTION or SLIDING_ATTENTION; sliding layers
    attend to the last ``sliding_window`` positions. ``eos_token_ids`` is config.json's eos id(s)
    as a list (see ``engine.tokenizer.stop_token_ids`` for the merged stop set).
    """

    architecture: str                           # canonical name (engine.models.arch.arch_of): the record's
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float | None = 10000.0          # None: no rotary embedding (GPT-2's learned positions)
    rope_scaling: dict | None = None            # HF-style dict with "rope_type" ("linear", "yarn", "llama3", ...)
    rope_local_theta: float | None = None       # Gemma-3's sliding layers use their own base (10k)
    rotary_dim: int | None = None               # rotated dims per head (== head_dim unless partial)
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float | None = None         # GPT-2 uses LayerNorm (with bias) instead of RMSNorm
    norm_type: str = "rms"                      # "rms" | "layernorm"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    query_pre_attn_scalar: float | None = None  # attention scale is query_pre_attn_scalar**-0.5 when set
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False                # bias on q/k/v projections (Qwen2: yes)
    mlp_bias: bool = False
    qk_norm: bool = False                       # RMSNorm over each head of q and k (Qwen3, Gemma-3)
    position_embedding: str = "rope"            # "rope" | "learned"
    # Granite's multipliers (HF embedding_multiplier / residual_multiplier / attention_multiplier /
    # logits_scaling; GGUF {arch}.embedding_scale / residual_scale / attention.scale / logit_scale)
    embedding_multiplier: float | None = None   # embeddings are multiplied by it
    residual_multiplier: float | None = None    # each block's output is multiplied by it before the residual add
    attention_multiplier: float | None = None   # replaces the 1/sqrt(head_dim) attention scale
    logits_scaling: float | None = None         # final logits are divided by it
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    source: str = ""                            # the file this was read from
    gguf_architecture: str | None = None        # a GGUF's general.architecture as written: its metadata keys' prefix
    extra: dict = field(default_factory=dict, repr=False)  # the raw config, for model-specific keys

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def attention_scale(self) -> float:
        """The factor q.k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING_ATTENTION for t in self.layer_types)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf_config_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = Path(path)
        raw = read_json_object(path, required=True)
        return cls.from_hf_config(raw, source=str(path))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF config.json (Llama, Mistral, Qwen2, Qwen3, Gemma-3, GPT-2, ...).

        Gemma-3 multimodal configs nest the text tower under ``text_config``; its keys win over the
        top level. A LLaVA config's architecture is its text_config's (``extra`` keeps the vision side).
        GPT-2's n_embd / n_layer / n_head / n_positions / n_inner are understood.
        """
        top = dict(config)
        model_type = top.get("model_type")
        if not model_type:
            raise ModelLoadError("missing 'model_type' (cannot tell the architecture)", path=source,
                                 key="model_type")
        text = dict(top)
        if isinstance(top.get("text_config"), dict):
            text.update(top["text_config"])
        if model_type in LLAVA_MODEL_TYPES:
            # LLaVA: the decoder is the text_config's architecture (engine/models/llava.py runs the vision side)
            tc = top.get("text_config")
            if not isinstance(tc, dict):
                raise ModelLoadError("a LLaVA config needs a 'text_config' object", path=source, key="text_config")
            model_type = tc.get("model_type") or "llama"
            if model_type == "llama":
                for k, v in LLAMA_TEXT_DEFAULTS.items():
                    text.setdefault(k, v)
        rec = arch_of(model_type)
        arch = rec.name
        defaults = rec.hf_defaults

        def get(key, *alts, default=KeyError):
            for k in (key, *alts):
                if k in text and text[k] is not None:
                    return text[k]
            for k in (key, *alts):
                if k in text:       # an explicit null: keep it (it disables e.g. a window)
                    return None
            for k in (key, *alts):
                if k in defaults:
                    return defaults[k]
            if default is KeyError:
                raise ModelLoadError(f"missing required key {key!r} for architecture {arch!r}",
                                     path=source, key=key)
            return default

        key = rec.hf_key
        hidden = int(get(*key("hidden_size")))
        num_layers = int(get(*key("num_hidden_layers")))
        num_heads = int(get(*key("num_attention_heads")))
        if rec.ffn_default_mult:            # GPT-2: n_inner null means 4 x hidden
            inner = get(*key("intermediate_size"), default=None)
            intermediate = int(inner) if inner else rec.ffn_default_mult * hidden
        else:
            intermediate = int(get(*key("intermediate_size")))
        max_pos = int(get(*key("max_position_embeddings")))
        num_kv = get(*key("num_key_value_heads"), default=None)
        num_kv = int(num_kv) if num_kv is not None else num_heads
        head_dim = get(*key("head_dim"), default=None)
        head_dim = int(head_dim) if head_dim else hidden // num_heads
        rope_theta = get("rope_theta", default=10000.0) if rec.position == "rope" else None
        vocab = int(get("vocab_size"))
        _check_positive(source, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers,
                        num_attention_heads=num_heads, num_key_value_heads=num_kv, head_dim=head_dim)
        if num_heads % num_kv:
            raise ModelLoadError(f"num_attention_heads ({num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({num_kv})", path=source, key="num_key_value_heads")

        # Rotary parameters: transformers v5 writes `rope_parameters` (possibly one dict per layer
        # type), older files `rope_theta` + `rope_scaling`.
        rope_scaling = text.get("rope_scaling")
        rope_local = get("rope_local_base_freq", default=None)
        params = text.get("rope_parameters")
        if isinstance(params, dict) and rec.position == "rope":
            if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
                full = params.get(FULL_ATTENTION) or {}
                slide = params.get(SLIDING_ATTENTION) or {}
                rope_theta = full.get("rope_theta", rope_theta)
                rope_local = slide.get("rope_theta", rope_local)
                params = full
            else:
                rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = params
        rope_scaling = _normalise_rope_scaling(rope_scaling)
        if rope_scaling and rope_scaling["rope_type"] in ("longrope", "su"):   # "su": Phi-3's first name for it
            rope_scaling["rope_type"] = "longrope"
            if rope_scaling.get("original_max_position_embeddings") is None:
                rope_scaling["original_max_position_embeddings"] = int(
                    get("original_max_position_embeddings", default=max_pos))
        partial = get("partial_rotary_factor", default=None)
        if partial is None and isinstance(params, dict):      # transformers v5 keeps it in rope_parameters
            partial = params.get("partial_rotary_factor")
        rotary_dim = int(head_dim * partial) if (partial and rope_theta is not None) else (
            head_dim if rope_theta is not None else None)

        # Which layers slide.
        sliding_window = get("sliding_window", default=None)
        layer_types = text.get("layer_types")
        if rec.hf_sliding == "max_window_layers":         # Qwen
            if not get("use_sliding_window", default=False):
                sliding_window = None
            if layer_types is None:
                mwl = int(get("max_window_layers", default=num_layers))
                layer_types = [SLIDING_ATTENTION if sliding_window is not None and i >= mwl else FULL_ATTENTION
                               for i in range(num_layers)]
        elif rec.hf_sliding == "pattern" and layer_types is None:
            # Gemma 2 and gpt-oss alternate (even layers slide), Gemma 3 has one global layer in 6
            pattern = rec.sliding_pattern
            if rec.sliding_pattern_key:
                pattern = int(get(rec.sliding_pattern_key, default=pattern))
            layer_types = _pattern_layers(pattern, num_layers)
        if layer_types is None:
            kind = SLIDING_ATTENTION if sliding_window else FULL_ATTENTION
            layer_types = [kind] * num_layers
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(layer_types)} entries but the model has "
                                 f"{num_layers} layers", path=source, key="layer_types")
        if SLIDING_ATTENTION in layer_types and not sliding_window:
            raise ModelLoadError("layer_types names sliding layers but sliding_window is not set",
                                 path=source, key="sliding_window")

        eos = get("eos_token_id", default=None)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_theta=float(rope_theta) if rope_theta is not None else None,
            rope_scaling=rope_scaling,
            rope_local_theta=float(rope_local) if rope_local is not None else None,
            rotary_dim=rotary_dim,
            rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
            layer_norm_eps=float(get("layer_norm_epsilon")) if rec.layernorm else None,
            norm_type=rec.norm,
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=layer_types,
            query_pre_attn_scalar=_opt_float(get("query_pre_attn_scalar", default=None)),
            final_logit_softcapping=_opt_float(get("final_logit_softcapping", default=None)),
            attn_logit_softcapping=_opt_float(get("attn_logit_softcapping", default=None)),
            hidden_act=str(get("hidden_activation", "hidden_act", "activation_function", default="silu")),
            attention_bias=rec.attention_bias or bool(get("attention_bias", default=False)),
            mlp_bias=bool(get("mlp_bias", default=False)),
            qk_norm=rec.qk_norm,
            position_embedding=rec.position,
            embedding_multiplier=_opt_float(get("embedding_multiplier", default=None)),
            residual_multiplier=_opt_float(get("residual_multiplier", default=None)),
            attention_multiplier=_opt_float(get("attention_multiplier", default=None)),
            logits_scaling=_opt_float(get("logits_scaling", default=None)),
            bos_token_id=_opt_int(get("bos_token_id", default=None)),
            eos_token_ids=_id_list(eos),
            pad_token_id=_opt_int(get("pad_token_id", default=None)),
            source=str(source),
            extra=dict(config),
        )

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf_metadata(cls, reader: Any, source: str | None = None,
                           tensor_names: list[str] | None = None) -> "ModelConfig":
        """Build from a GGUF's metadata (llama.cpp key names, e.g. ``llama.block_count``).

        ``reader`` is a ``gguf.GGUFReader`` (its tensors decide ``tie_word_embeddings``: a file
        without ``output.weight`` shares the embedding) or a plain ``{key: value}`` mapping, with
        ``tensor_names`` then given separately.
        """
        if hasattr(reader, "fields"):
            meta = _GGUFMeta(reader)
            if tensor_names is None:
                tensor_names = [t.name for t in reader.tensors]
            if source is None:
                source = str(getattr(getattr(reader, "data", None), "filename", None) or "<gguf>")
        else:
            meta = dict(reader)
        source = source or "<gguf>"

        def get(key, default=KeyError):
            if key in meta:
                return meta[key]
            if default is KeyError:
                raise ModelLoadError(f"missing required GGUF metadata key {key!r}", path=source, key=key)
            return default

        gguf_arch = str(get("general.architecture"))
        rec = arch_of(gguf_arch)
        arch = rec.name
        p = gguf_arch + "."
        hard = rec.gguf_defaults           # what llama.cpp assumes for this architecture when the file omits a key
        hidden = int(get(p + "embedding_length"))
        num_layers = int(get(p + "block_count"))
        num_heads = _uniform(get(p + "attention.head_count"), p + "attention.head_count", source)
        num_kv = _uniform(get(p + "attention.head_count_kv", num_heads), p + "attention.head_count_kv", source)
        ffn_default = rec.ffn_default_mult * hidden if rec.ffn_default_mult else KeyError     # GPT-2: 4 x hidden
        ffn = _uniform(get(p + "feed_forward_length", ffn_default),
                       p + "feed_forward_length", source)
        max_pos = int(get(p + "context_length"))
        head_dim = int(get(p + "attention.key_length", hidden // num_heads if num_heads else 0))
        vocab = get(p + "vocab_size", None)
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens") if not isinstance(meta, _GGUFMeta) else meta.array_len(
                "tokenizer.ggml.tokens")
            vocab = len(tokens) if isinstance(tokens, list) else tokens
        if vocab is None:
            raise ModelLoadError(f"cannot tell the vocabulary size: neither {p}vocab_size nor "
                                 "tokenizer.ggml.tokens is present", path=source, key=p + "vocab_size")
        vocab = int(vocab)
        _check_positive(source, **{p + "embedding_length": hidden, p + "block_count": num_layers,
                                   p + "attention.head_count": num_heads,
                                   p + "attention.head_count_kv": num_kv, "vocab_size": vocab})
        if num_heads % num_kv:
            raise ModelLoadError(f"head_count ({num_heads}) is not a multiple of head_count_kv ({num_kv})",
                                 path=source, key=p + "attention.head_count_kv")

        rope_theta = float(get(p + "rope.freq_base", hard.get("rope.freq_base", 10000.0))) \
            if rec.position == "rope" else None
        if rec.layernorm:
            rms_eps = 1e-6
            ln_eps = float(get(p + "attention.layer_norm_epsilon"))
        else:
            rms_eps = float(get(p + "attention.layer_norm_rms_epsilon"))
            ln_eps = None
        rotary_dim = int(get(p + "rope.dimension_count", head_dim)) if rope_theta is not None else None

        rope_scaling = None
        scaling_type = get(p + "rope.scaling.type", None)
        factor = get(p + "rope.scaling.factor", None)
        if factor is None and get(p + "rope.scale_linear", None) is not None:   # older files
            scaling_type, factor = "linear", get(p + "rope.scale_linear")
        if scaling_type not in (None, "none") and factor is not None:
            rope_scaling = {"rope_type": str(scaling_type), "factor": float(factor)}
            orig = get(p + "rope.scaling.original_context_length", None)
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)
            attn_factor = get(p + "rope.scaling.attn_factor", None)
            if attn_factor is not None:
                rope_scaling["attention_factor"] = float(attn_factor)

        # llama.cpp hard-codes the sliding layout of the architectures that have one (set_swa_pattern), and
        # Gemma's window (4096) where the file has none
        sliding_window = get(p + "attention.sliding_window", None) or hard.get("attention.sliding_window")
        if rec.sliding_pattern:
            layer_types = _pattern_layers(rec.sliding_pattern, num_layers)
        else:
            kind = SLIDING_ATTENTION if sliding_window else FULL_ATTENTION
            layer_types = [kind] * num_layers
        rope_local = rec.gguf_swa_rope_theta
        query_pre_attn_scalar = None
        if rec.gguf_wide_query_layers:
            # Gemma: the query scale is 1/sqrt(head_dim) except for the 27B (Gemma 2: 46 layers, Gemma 3: 62),
            # which uses 1/sqrt(hidden/heads); not in the file
            query_pre_attn_scalar = float(hidden // num_heads) if num_layers == rec.gguf_wide_query_layers \
                else float(head_dim)
        if rec.gguf_yarn_untruncated and rope_scaling and rope_scaling["rope_type"] == "yarn":
            # gpt-oss: HF config truncate: false; the converter writes no beta keys (HF's / llama.cpp's
            # defaults 32 / 1 unless the file has them)
            rope_scaling["truncate"] = False
            for k in ("beta_fast", "beta_slow"):
                v = get(p + f"rope.scaling.yarn_{k}", None)
                if v is not None:
                    rope_scaling[k] = float(v)

        names = set(tensor_names or ())
        if rec.gguf_longrope_tensors and "rope_factors_long.weight" in names:
            # Phi-3 LongRoPE (the factors themselves are tensors, read by the model code)
            attn_factor = get(p + "rope.scaling.attn_factor", None)
            rope_scaling = {"rope_type": "longrope", "original_max_position_embeddings":
                            int(get(p + "rope.scaling.original_context_length", max_pos))}
            if attn_factor is not None:
                rope_scaling["attention_factor"] = float(attn_factor)
        tie = bool(names) and "output.weight" not in names
        eos = get("tokenizer.ggml.eos_token_id", None)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_local_theta=rope_local,
            rotary_dim=rotary_dim,
            rms_norm_eps=rms_eps,
            layer_norm_eps=ln_eps,
            norm_type=rec.norm,
            tie_word_embeddings=tie,
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=layer_types,
            query_pre_attn_scalar=query_pre_attn_scalar,
            final_logit_softcapping=_opt_float(get(p + "final_logit_softcapping",
                                                   hard.get("final_logit_softcapping"))),
            attn_logit_softcapping=_opt_float(get(p + "attn_logit_softcapping", hard.get("attn_logit_softcapping"))),
            hidden_act=rec.activation,
            attention_bias=bool(rec.attention_bias) or "blk.0.attn_q.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names and rec.mlp == "gated",
            qk_norm="blk.0.attn_q_norm.weight" in names or rec.qk_norm,
            # Granite (llama.cpp: {arch}.embedding_scale, residual_scale, attention.scale, logit_scale)
            embedding_multiplier=_opt_float(get(p + "embedding_scale", None)),
            residual_multiplier=_opt_float(get(p + "residual_scale", None)),
            attention_multiplier=_opt_float(get(p + "attention.scale", None)),
            logits_scaling=_opt_float(get(p + "logit_scale", None)),
            position_embedding=rec.position,
            bos_token_id=_opt_int(get("tokenizer.ggml.bos_token_id", None)),
            eos_token_ids=_id_list(eos),
            pad_token_id=_opt_int(get("tokenizer.ggml.padding_token_id", None)),
            source=str(source),
            gguf_architecture=gguf_arch,
            extra=_deepseek2_extra(get, p, head_dim, rotary_dim) if rec.mla else {},
        )


class _GGUFMeta:
    """Lazy ``key in meta`` / ``meta[key]`` over a GGUFReader's fields (python values)."""

    def __init__(self, reader):
        self._fields = reader.fields

    def __contains__(self, key):
        return key in self._fields

    def __getitem__(self, key):
        return gguf_field_value(self._fields[key])

    def get(self, key, default=None):
        return self[key] if key in self else default

    def array_len(self, key):
        f = self._fields.get(key)
        return None if f is None else len(f.data)


def _deepseek2_extra(get, p: str, key_length: int, rope_dim: int | None) -> dict:
    """llama.cpp's deepseek2 metadata as the HF DeepSeek-V2/V3 config keys engine/models/mla.py reads. Two
    converter generations: the classic one writes key_length = qk_nope + qk_rope and value_length = v_head_dim;
    the MLA-aware one writes key_length = kv_lora + rope (the compressed row) and the per-head sizes under
    key_length_mla / value_length_mla."""
    rope = int(rope_dim or 0)
    qk = int(get(p + "attention.key_length_mla", key_length))
    v = get(p + "attention.value_length_mla", None)
    if v is None:
        v = get(p + "attention.value_length", key_length)
    gating = int(get(p + "expert_gating_func", 1))      # llama.cpp: 1 softmax, 2 sigmoid
    ex = {"q_lora_rank": int(get(p + "attention.q_lora_rank", 0)) or None,
          "kv_lora_rank": int(get(p + "attention.kv_lora_rank")),
          "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope, "v_head_dim": int(v),
          "first_k_dense_replace": int(get(p + "leading_dense_block_count", 0)),
          "n_routed_experts": int(get(p + "expert_count", 0)),
          "num_experts_per_tok": int(get(p + "expert_used_count", 0)),
          "n_shared_experts": int(get(p + "expert_shared_count", 0)),
          "moe_intermediate_size": int(get(p + "expert_feed_forward_length", 0)),
          "routed_scaling_factor": float(get(p + "expert_weights_scale", 1.0)),
          "norm_topk_prob": bool(get(p + "expert_weights_norm", False)),
          "scoring_func": {1: "softmax", 2: "sigmoid"}.get(gating, f"gating function {gating}"),
          "n_group": int(get(p + "expert_group_count", 1)), "topk_group": int(get(p + "expert_group_used_count", 1)),
          # newer converters count the multi-token-prediction blocks in block_count (they come last)
          "num_nextn_predict_layers": int(get(p + "nextn_predict_layers", 0))}
    if gating == 1 and ex["n_group"] > 1:
        # the converter copies HF's n_group / topk_group: DeepSeek-V2's group_limited_greedy (HF semantics:
        # a group scores its best softmax score)
        ex["topk_method"] = "group_limited_greedy"
    log_mul = get(p + "rope.scaling.yarn_log_multiplier", None)
    if log_mul:             # 0.1 * mscale_all_dim (llama.cpp applies it to the softmax scale only)
        ex["yarn_mscale_all_dim"] = float(log_mul) / 0.1
    return ex


def _pattern_layers(pattern: int, num_layers: int) -> list[str]:
    """Every `pattern`-th layer global (full attention), the others sliding."""
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]


def gguf_field_value(field) -> Any:
    """A GGUF metadata field as a Python value (str, int, float, bool, or list of those)."""
    value = field.contents()
    if hasattr(value, "item"):
        value = value.item()
    return value


def _uniform(value, key: str, source: str) -> int:
    """A per-layer array (some converters write one value per layer) must be uniform here."""
    if isinstance(value, (list, tuple)):
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(f"per-layer values {list(value)[:8]}... differ; only uniform layers are "
                                 "supported", path=source, key=key)
        value = value[0]
    return int(value)


def _check_positive(source: str, **values: int) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ModelLoadError(f"{key} must be positive, got {value}", path=source, key=key)


def _normalise_rope_scaling(scaling: Any) -> dict | None:
    if not isinstance(scaling, dict):
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return scaling


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


def _opt_int(v) -> int | None:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return None if v is None else int(v)


def _id_list(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]
