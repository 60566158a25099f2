"""DeepSeek-V2 / V3: multi-head latent attention (MLA) with a compressed paged KV cache, plus their MLPs
(dense for the first `first_k_dense_replace` layers, then routed experts + shared experts).

Attention per token (HF `DeepseekV2Attention` / `DeepseekV3Attention`):
  q      = q_proj(x)                                   or q_b_proj(rms(q_a_proj(x)))   [H, nope + rope]
  c, k_r = split(kv_a_proj_with_mqa(x), [kv_lora, rope]);  c = rms(c) (kv_a_layernorm)
  q_r, k_r get RoPE (interleaved pairs = our GPT-J layout; V3 with rope_interleave=false: rotate-half)
  k_h = [W_UK_h c, k_r],  v_h = W_UV_h c   (kv_b_proj rows per head: nope rows of W_UK, then v rows of W_UV)

What the engine stores and computes (the "absorbed" form, for every token, prefill and decode alike):
- the paged cache holds one row per token and layer: [c (kv_lora), k_r (rope)] -- one shared "KV head" of
  kv_lora + rope floats instead of 2 x H x head_dim (DeepSeek-V3: 576 floats vs 2 x 128 x 192);
- q_h . k_h = (W_UK_h^T q_nope_h) . c + q_r_h . k_r, so each head's query becomes [W_UK_h^T q_nope_h, q_r_h]
  and attention runs as multi-query attention over the cache rows (engine.ops.attention.paged_attention with
  one KV head of width kv_lora + rope, the same array passed as K and V cache);
- the attention output over the rows is sum_j p_j [c_j, k_r_j]; its first kv_lora columns are the latent
  output, and W_UV_h maps it to the head's value output (o_h = W_UV_h sum_j p_j c_j).
Every step is per-token arithmetic (linear kernels, paged attention), so a token's result does not depend on
the batch (batch invariance as in the dense decoder).

The per-head absorption matmuls run as one launch over all heads (engine.ops.mla.head_linear).
Limits (see docs/STATUS.md): CPU only; W_UK / W_UV are kept in float32 (a quantised kv_b is dequantised).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError
from engine.models.arch import arch_of
from engine.models.decoder import DecoderLM
from engine.models.moe import MoESpec, load_moe_block
from engine.models.weights import Linear, linear_from, vector_f32

# logical name -> candidate checkpoint names (GGUF names: llama.cpp's deepseek2 architecture)
_MLA_NAMES = {
    "q": ["blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"],
    "q_a": ["blk.{i}.attn_q_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight"],
    "q_a_norm": ["blk.{i}.attn_q_a_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"],
    "q_b": ["blk.{i}.attn_q_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight"],
    "kv_a": ["blk.{i}.attn_kv_a_mqa.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"],
    "kv_a_norm": ["blk.{i}.attn_kv_a_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"],
    "kv_b": ["blk.{i}.attn_kv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"],
    # llama.cpp's MLA-aware converter splits kv_b per head: k_b [H, kv_lora, nope] (transposed), v_b [H, v, kv_lora]
    "k_b": ["blk.{i}.attn_k_b.weight"],
    "v_b": ["blk.{i}.attn_v_b.weight"],
    "o": ["blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"],
    "attn_norm": ["blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"],
    "ffn_norm": ["blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"],
}
_SHARED_EXPERTS = {p: [f"blk.{{i}}.ffn_{p}_shexp.weight", f"model.layers.{{i}}.mlp.shared_experts.{p}_proj.weight"]
                   for p in ("gate", "up", "down")}


@dataclass
class MLAShape:
    heads: int
    q_lora: int | None          # None: a plain q_proj
    kv_lora: int
    nope: int                   # qk_nope_head_dim
    rope: int                   # qk_rope_head_dim
    v: int                      # v_head_dim

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @property
    def row(self) -> int:
        """Floats per token and layer in the compressed cache."""
        return self.kv_lora + self.rope


def mla_shape(cfg) -> MLAShape:
    ex = cfg.extra or {}
    src = cfg.source

    def need(key):
        v = ex.get(key)
        if v is None or int(v) <= 0:
            raise ModelLoadError(f"multi-head latent attention needs a positive {key}", path=src, key=key)
        return int(v)
    ql = ex.get("q_lora_rank")
    return MLAShape(heads=cfg.num_heads, q_lora=int(ql) if ql else None, kv_lora=need("kv_lora_rank"),
                    nope=need("qk_nope_head_dim"), rope=need("qk_rope_head_dim"), v=need("v_head_dim"))


@dataclass
class MLALayer:
    attn_norm: np.ndarray
    proj_a: Linear                  # x -> [q_a (q_lora) | q (H*qk) ; kv_a (kv_lora + rope)]
    q_a_norm: np.ndarray | None
    q_b: Linear | None
    kv_a_norm: np.ndarray
    w_uk: np.ndarray                # f32 [H, kv_lora, nope]: q_nope_h -> its latent query
    w_uv: np.ndarray                # f32 [H, v, kv_lora]: latent output -> v_h
    o: Linear
    ffn_norm: np.ndarray
    gate_up: Linear | None
    down: Linear | None
    moe: object = None


class MLADecoderLM(DecoderLM):
    """DeepSeek-V2/V3 on the CPU; shares the loading helpers and the KV/run interface of DecoderLM."""

    def __init__(self, ckpt, kv_dtype: str = "f32", device: str = "cpu"):
        if device != "cpu":
            raise ModelLoadError("multi-head latent attention (DeepSeek-V2/V3) runs on the CPU only so far: use "
                                 "--device cpu", path=ckpt.path, key="device")
        self.ckpt = ckpt
        self.device = device
        cfg = self.cfg = ckpt.config
        self.arch = cfg.architecture
        if kv_dtype not in ("f32", "f16"):      # "auto" is the engine's to resolve (engine.sizing), never f32 here
            raise ValueError(f"kv_dtype must be 'f32' or 'f16', got {kv_dtype!r}")
        self.kv_dtype = np.float16 if kv_dtype == "f16" else np.float32
        self.shape = s = mla_shape(cfg)
        self.H = s.heads
        self.hidden = cfg.hidden_size
        self.vocab = cfg.vocab_size
        self.norm_offset = 0.0
        self.eps = cfg.rms_norm_eps
        self.layernorm = False
        ex = cfg.extra or {}
        # HF: DeepSeek-V2 rotates interleaved pairs (complex multiply); V3 too unless rope_interleave is false;
        # llama.cpp's deepseek2 rotates adjacent pairs too
        rec = arch_of(self.arch)
        self.is_neox = rec.mla_rope_interleave_key and ex.get("rope_interleave", True) is False
        self.sigmoid_routing = rec.moe.routing == "sigmoid" or ex.get("scoring_func") == "sigmoid"
        scaling = cfg.rope_scaling
        if scaling and ex.get("yarn_mscale_all_dim"):
            # GGUF (rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim): llama.cpp takes mscale ==
            # mscale_all_dim, i.e. unscaled cos/sin tables and mscale^2 on the softmax scale
            m = ex["yarn_mscale_all_dim"]
            scaling = {**scaling, "mscale": m, "mscale_all_dim": m}
        self.scale = s.qk ** -0.5
        if scaling and scaling.get("rope_type", "default") != "default":
            mall = scaling.get("mscale_all_dim") or 0
            if mall:        # yarn: HF's yarn_apply_mscale
                factor = float(scaling["factor"])
                m = 1.0 if factor <= 1 else 0.1 * float(mall) * math.log(factor) + 1.0
                self.scale *= m * m
        from engine.ops.rope import rope_cos_sin_cache
        self.rope_cache = rope_cos_sin_cache(s.rope, s.rope, cfg.max_position_embeddings, cfg.rope_theta or 10000.0,
                                             scaling, max_position_embeddings=cfg.max_position_embeddings)
        self.moe_spec = self._moe_spec()
        self.embed = self._t("embed")
        self.embed_table = self.embed.raw.reshape(self.embed.shape) if self.embed.dtype == "f32" else \
            vector_f32(self.embed).reshape(self.embed.shape)
        self.final_norm = vector_f32(self._t("final_norm"))
        head = self._t("lm_head", required=False)
        if head is None:
            if not cfg.tie_word_embeddings:
                raise ModelLoadError("no output projection (lm_head / output.weight) and the config does not tie "
                                     "the word embeddings", path=ckpt.path, tensor="lm_head.weight")
            head = self.embed
        self.lm_head = linear_from([head], "lm_head")
        # a GGUF's block_count includes DeepSeek-V3's multi-token-prediction blocks (the last ones; not run here,
        # as in transformers); config.json's num_hidden_layers does not
        n_layers = cfg.num_layers - (int(ex.get("num_nextn_predict_layers") or 0) if ckpt.format == "gguf" else 0)
        if n_layers < 1:
            raise ModelLoadError(f"block_count {cfg.num_layers} leaves no layers besides the "
                                 f"{ex.get('num_nextn_predict_layers')} multi-token-prediction ones", path=ckpt.path,
                                 key="nextn_predict_layers")
        self.layers = [self._mla_layer(i) for i in range(n_layers)]
        # decode steps replay from recorded graphs (every kernel reads the step from the batch's int32 arrays),
        # except with GGUF-quantised experts (a host loop over the experts, as in the decoder)
        self.supports_graphs = not any(L.moe is not None and L.moe.quantized for L in self.layers)
        self.num_kv_layers = n_layers
        self.k_caches, self.v_caches = [], []
        self._attn_ws = [{} for _ in self.layers]
        self.device_bytes = 0

    # ------------------------------------------------------------------------------------ loading
    def _moe_spec(self) -> MoESpec | None:
        ex = self.cfg.extra or {}
        E = int(ex.get("n_routed_experts") or 0)
        if not E:
            return None
        K = int(ex.get("num_experts_per_tok") or 0)
        if not 1 <= K <= E:
            raise ModelLoadError(f"num_experts_per_tok ({K}) must be between 1 and n_routed_experts ({E})",
                                 path=self.cfg.source, key="num_experts_per_tok")
        if ex.get("scoring_func", "softmax") not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"expert scoring {ex['scoring_func']!r} is not supported (softmax or sigmoid)",
                                 path=self.cfg.source, key="expert_gating_func")
        if self.sigmoid_routing:
            norm = bool(ex.get("norm_topk_prob", True))
        else:
            method = ex.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                raise ModelLoadError(f"topk_method {method!r} is not supported", path=self.cfg.source,
                                     key="topk_method")
            # HF's DeepseekV2TopkRouter never renormalises; a GGUF says so in expert_weights_norm
            norm = self.ckpt.format == "gguf" and bool(ex.get("norm_topk_prob"))
        return MoESpec(E, K, norm)

    def _g(self, key, i, required=True):
        for pat in _MLA_NAMES[key]:
            t = self.ckpt.get(pat.format(i=i))
            if t is not None:
                return t
        if required:
            raise ModelLoadError(f"the {self.arch} model needs tensor {_MLA_NAMES[key][1].format(i=i)!r} (GGUF: "
                                 f"{_MLA_NAMES[key][0].format(i=i)!r}), which the checkpoint lacks",
                                 path=self.ckpt.path, tensor=_MLA_NAMES[key][1].format(i=i))
        return None

    def _mla_layer(self, i) -> MLALayer:
        s, H = self.shape, self.H
        path = self.ckpt.path
        kv_a = self._g("kv_a", i)
        if tuple(kv_a.shape) != (s.row, self.hidden):
            raise ModelLoadError(f"kv_a_proj_with_mqa is {list(kv_a.shape)}, expected [kv_lora_rank + "
                                 f"qk_rope_head_dim = {s.row}, {self.hidden}]", path=path, tensor=kv_a.name)
        if s.q_lora:
            q_a = self._g("q_a", i)
            proj_a = linear_from([q_a, kv_a], f"blk.{i}.q_a+kv_a")
            q_a_norm = vector_f32(self._g("q_a_norm", i))
            q_b = linear_from([self._g("q_b", i)], f"blk.{i}.q_b")
            if q_b.n != H * s.qk or q_a.shape[0] != s.q_lora:
                raise ModelLoadError(f"q_a/q_b projections {list(q_a.shape)} / {q_b.n} rows disagree with "
                                     f"q_lora_rank {s.q_lora} and heads x qk_head_dim {H * s.qk}", path=path,
                                     tensor=_MLA_NAMES["q_b"][1].format(i=i))
        else:
            q = self._g("q", i)
            if q.shape[0] != H * s.qk:
                raise ModelLoadError(f"q_proj has {q.shape[0]} rows, expected heads x (qk_nope + qk_rope) = "
                                     f"{H * s.qk}", path=path, tensor=q.name)
            proj_a = linear_from([q, kv_a], f"blk.{i}.q+kv_a")
            q_a_norm = q_b = None
        kv_b_t = self._g("kv_b", i, required=False)
        if kv_b_t is None and self._g("k_b", i, required=False) is not None:
            k_b_t, v_b_t = self._g("k_b", i), self._g("v_b", i)
            for t, want in ((k_b_t, (H, s.kv_lora, s.nope)), (v_b_t, (H, s.v, s.kv_lora))):
                if tuple(t.shape) != want:
                    raise ModelLoadError(f"{t.name} is {list(t.shape)}, expected {list(want)}", path=path,
                                         tensor=t.name)
            uk = vector_f32(k_b_t).reshape(H, s.kv_lora, s.nope)        # already W_UK_h^T per head
            uv = vector_f32(v_b_t).reshape(H, s.v, s.kv_lora)
        else:
            kv_b_t = kv_b_t if kv_b_t is not None else self._g("kv_b", i)
            if tuple(kv_b_t.shape) != (H * (s.nope + s.v), s.kv_lora):
                raise ModelLoadError(f"kv_b_proj is {list(kv_b_t.shape)}, expected [heads x (qk_nope + v) = "
                                     f"{H * (s.nope + s.v)}, kv_lora_rank = {s.kv_lora}]", path=path,
                                     tensor=kv_b_t.name)
            kv_b = vector_f32(kv_b_t).reshape(H, s.nope + s.v, s.kv_lora)
            uk = np.swapaxes(kv_b[:, :s.nope], 1, 2)
            uv = kv_b[:, s.nope:]
        w_uk = np.ascontiguousarray(uk, np.float32)       # [H, kv_lora, nope]
        w_uv = np.ascontiguousarray(uv, np.float32)       # [H, v, kv_lora]
        o = linear_from([self._g("o", i)], f"blk.{i}.o")
        moe = load_moe_block(self.ckpt, i, self.moe_spec, self.hidden)
        gate_up = down = None
        if moe is None:
            gate_up = linear_from([self._t("gate", i), self._t("up", i)], f"blk.{i}.gate_up")
            down = linear_from([self._t("down", i)], f"blk.{i}.down")
        else:
            self._deepseek_moe(moe, i)
        return MLALayer(attn_norm=vector_f32(self._g("attn_norm", i)), proj_a=proj_a, q_a_norm=q_a_norm, q_b=q_b,
                        kv_a_norm=vector_f32(self._g("kv_a_norm", i)), w_uk=w_uk, w_uv=w_uv, o=o,
                        ffn_norm=vector_f32(self._g("ffn_norm", i)), gate_up=gate_up, down=down, moe=moe)

    def _deepseek_moe(self, moe, i):
        """DeepSeek's always-on shared experts (ungated, summed with the routed output) and its
        routed_scaling_factor on the routing weights."""
        ex = self.cfg.extra or {}
        ts = [self.ckpt.get(n.format(i=i)) for p in ("gate", "up", "down") for n in _SHARED_EXPERTS[p]]
        g = next((t for t in ts[0:2] if t is not None), None)
        u = next((t for t in ts[2:4] if t is not None), None)
        d = next((t for t in ts[4:6] if t is not None), None)
        if int(ex.get("n_shared_experts") or 0) > 0 or g is not None:
            if g is None or u is None or d is None:
                raise ModelLoadError(f"layer {i}: the config has shared experts but the checkpoint lacks their "
                                     "gate/up/down weights", path=self.ckpt.path,
                                     tensor=_SHARED_EXPERTS["gate"][1].format(i=i))
            moe.shared_gate_up = linear_from([g, u], f"blk.{i}.shared_gate_up")
            moe.shared_down = linear_from([d], f"blk.{i}.shared_down")
            moe.shared_gated = False
        moe.routed_scale = float(ex.get("routed_scaling_factor", 1.0) or 1.0)
        E, K = self.moe_spec.num_experts, self.moe_spec.top_k
        ng = int(ex.get("n_group") or 1)
        tg = int(ex.get("topk_group") or ng)
        v2_groups = not self.sigmoid_routing and ex.get("topk_method") == "group_limited_greedy" and tg < ng
        if self.sigmoid_routing or v2_groups:
            from engine.ops.moe import SIGMOID_GROUP_TOPK
            if E % ng or not 1 <= tg <= ng or (ng > 1 and E // ng < 2) or K > tg * (E // ng):
                raise ModelLoadError(f"n_group {ng} / topk_group {tg} do not fit {E} experts with {K} per token "
                                     "(equal groups of at least 2, enough eligible experts)", path=self.cfg.source,
                                     key="n_group")
            bias = None
            if self.sigmoid_routing:
                bias = self.ckpt.get(f"model.layers.{i}.mlp.gate.e_score_correction_bias") or \
                    self.ckpt.get(f"blk.{i}.exp_probs_b.bias")
            moe.spec = MoESpec(E, K, self.moe_spec.norm_topk, SIGMOID_GROUP_TOPK)
            moe.score_bias = vector_f32(bias) if bias is not None else np.zeros(E, np.float32)
            moe.groups = (ng, tg)
            moe.score_softmax = v2_groups

    # ---------------------------------------------------------------------------------- KV cache
    def kv_block_bytes(self, block_size: int, dtype_bytes: int) -> int:
        """One block over all layers: a single [block_size, kv_lora + rope] row array per layer."""
        return self.num_kv_layers * block_size * self.shape.row * dtype_bytes

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        # one compressed cache per layer, passed as both K and V cache to the attention kernels
        self.k_caches = [np.zeros((num_blocks, block_size, 1, self.shape.row), self.kv_dtype) for _ in self.layers]
        self.v_caches = self.k_caches

    # ----------------------------------------------------------------------------------- forward
    def _attention(self, li, L: MLALayer, x, b, buf, out, host_step):
        from engine.ops.attention import MAX_PARTITIONS, paged_attention, reshape_and_cache
        from engine.ops.mla import copy_heads, head_linear
        from engine.ops.norm import rms_norm
        from engine.ops.rope import rope
        s, H = self.shape, self.H
        T = x.shape[0]
        pos = b.positions[:T]
        fused = buf.get("mla.a", (T, L.proj_a.n))
        L.proj_a(x, out=fused)
        if L.q_b is not None:
            qa = buf.get("mla.qa", (T, s.q_lora))
            rms_norm(fused[:, :s.q_lora], L.q_a_norm, self.eps, out=qa)
            q = buf.get("mla.q", (T, H * s.qk))
            L.q_b(qa, out=q)
            kv = fused[:, s.q_lora:]
        else:
            q = fused[:, :H * s.qk]
            kv = fused[:, H * s.qk:]
        rms_norm(kv[:, :s.kv_lora], L.kv_a_norm, self.eps, out=kv[:, :s.kv_lora])
        item = fused.itemsize
        q_pe = np.lib.stride_tricks.as_strided(q[:, s.nope:], (T, H, s.rope), (q.strides[0], s.qk * item, item))
        k_pe = np.lib.stride_tricks.as_strided(kv[:, s.kv_lora:], (T, 1, s.rope), (kv.strides[0], s.rope * item, item))
        rope(q_pe, k_pe, pos, self.rope_cache, s.rope, s.rope, self.is_neox)
        rows = np.lib.stride_tricks.as_strided(kv, (T, 1, s.row), (kv.strides[0], s.row * item, item))
        cache = self.k_caches[li]
        reshape_and_cache(rows, rows, cache, cache, b.slot_mapping[:T])
        # absorbed queries [T, H, kv_lora + rope]: W_UK_h^T q_nope_h, then q_pe_h
        qabs = buf.get("mla.qabs", (T, H * s.row)).reshape(T, H, s.row)
        q_nope = np.lib.stride_tricks.as_strided(q, (T, H, s.nope), (q.strides[0], s.qk * item, item))
        head_linear(q_nope, L.w_uk, out=qabs[:, :, :s.kv_lora])
        copy_heads(q_pe, qabs[:, :, s.kv_lora:])
        lat = buf.get("mla.lat", (T, H * s.row)).reshape(T, H, s.row)
        paged_attention(qabs, cache, cache, b.query_start[: b.num_seqs + 1], b.seq_lens[: b.num_seqs],
                        b.block_table[: b.num_seqs], scale=self.scale, out=lat, workspace=self._attn_ws[li],
                        num_partitions=MAX_PARTITIONS, host_step=host_step)
        attn = buf.get("mla.attn", (T, H * s.v))
        head_linear(lat[:, :, :s.kv_lora], L.w_uv, out=attn.reshape(T, H, s.v))
        L.o(attn, out=out)

    def forward(self, b) -> np.ndarray:
        from engine.ops.activation import copy, silu_and_mul
        from engine.ops.embedding import embedding
        from engine.ops.norm import rms_norm
        T = b.num_tokens
        buf = b.buffers
        h = buf.get("h", (T, self.hidden))
        embedding(b.input_ids[:T], self.embed_table, out=h)
        residual = buf.get("residual", (T, self.hidden))
        x = buf.get("x", (T, self.hidden))
        o = buf.get("o", (T, self.hidden))
        host_step = (b.host.query_start[: b.num_seqs + 1], b.host.seq_lens[: b.num_seqs]) \
            if b.host is not None else None
        for li, L in enumerate(self.layers):
            if li == 0:
                copy(h, out=residual)
                rms_norm(residual, L.attn_norm, self.eps, out=x)
            else:
                rms_norm(h, L.attn_norm, self.eps, out=x, residual=residual)
            self._attention(li, L, x, b, buf, o, host_step)
            rms_norm(o, L.ffn_norm, self.eps, out=x, residual=residual)
            if L.moe is not None:
                L.moe(x, h, buf)
            else:
                gu = buf.get("gu", (T, L.gate_up.n))
                L.gate_up(x, out=gu)
                act = buf.get("act", (T, L.gate_up.n // 2))
                silu_and_mul(gu, out=act)
                L.down(act, out=h)
        rms_norm(h, self.final_norm, self.eps, out=x, residual=residual)
        rows = b.logits_rows
        R = len(rows)
        if R == 0:
            return np.zeros((0, self.vocab), np.float32)
        xs = self._logit_rows(x, b, buf)
        if getattr(self, "return_hidden", False):
            return xs
        logits = buf.get("logits", (R, self.vocab))
        self.lm_head(xs, out=logits)
        return logits

    def set_max_model_len(self, n: int) -> None:
        return None


__all__ = ["MLADecoderLM", "MLAShape", "mla_shape"]
