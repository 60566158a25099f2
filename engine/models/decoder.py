"""One decoder-only transformer for the Llama family (Llama 2/3, SmolLM2, Mistral), Qwen2, Qwen3,
Gemma 2/3, GPT-2, Phi-3, Granite, OLMo 2, gpt-oss and the MoE families, differing only by the traits of the
architecture's record (engine/models/arch.py: norm type and placement, positions, MLP form, embedding scale,
tensor names) and the config. Every tensor operation of the forward pass is a jitkern kernel (engine.ops);
numpy here only slices views and allocates buffers.

Tensor names: GGUF (`blk.N.attn_q.weight`) and HF (`model.layers.N.self_attn.q_proj.weight`) are both
understood (arch.TENSORS, replaced per architecture by its record's `tensors`). GGUF llama-family checkpoints
have their Q/K rows permuted for RoPE on adjacent pairs (llama.cpp's convention, see engine.loader), so they
run with the GPT-J rope layout; HF checkpoints use the NeoX (rotate-half) layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.config import SLIDING_ATTENTION
from engine.device import GPU_DEVICES
from engine.errors import ModelLoadError
from engine.loader import QUANT_TYPES, ROPE_ADJACENT_PAIRS
from engine.models.arch import arch_of
from engine.models.moe import load_moe_block, moe_spec
from engine.models.weights import Linear, linear_from, vector_f32


# CUDA with 16-bit compute (dtype "auto"): the norms / activation before a tensor-core linear write its input in
# the weights' 16-bit type (Linear.x16), the same bits the linear would round f32 x to, from half the bytes
# (H200, perf/tune_gemv_cuda.py --x16: 1.04-1.10x at 64 tokens, 1.08-1.15x at 256-1024)
GPU_X16 = True
# ... and the flash attention kernels write the o projection's input that way too (rounded as they store it; the
# o projection then takes TMA at prefill sizes, which needs 16-bit x; the same bits) where the device target's
# tuning.x16_attn (targets/tuning.py)
# CUDA: a split-K linear (o, gate/up, down; q/k/v up to ROPE_CACHE_PER_HEAD_MAX_T tokens) leaves its slabs to the
# op after it (rms_norm with the residual add, the gated activation, rope + KV cache write), which sums them in the
# sum kernel's order: the same bits, one launch a linear fewer
GPU_FOLD_SPLITK = True
# CUDA: where the down projection takes 16-bit input and the target's tuning.gate_up16, the gate/up projection
# writes its [T, 2 I] output in the weights' 16-bit type too (rounded once as the linear stores it; HF's bf16
# gate_proj / up_proj outputs are rounded so) and the gated activation reads that: half the bytes of the widest
# activation through memory twice. With tuning.gated_linear (an experiment), at decode sizes (matmul.gated_tile:
# the 16-token tile) the gate/up projection and the activation run as one kernel (matmul.gated_linear: the same
# bits, one launch and the [T, 2 I] round trip fewer).


def _tuning(lin):
    """The code-generation choices of the target `lin`'s weight lives on (targets/tuning.py)."""
    from engine.ops._hostargs import resolve_target
    from targets.tuning import DEFAULT
    t = resolve_target(None, lin.weight)
    return t.tuning if t is not None else DEFAULT



@dataclass
class Layer:
    attn_norm: np.ndarray
    attn_norm_b: np.ndarray | None
    qkv: Linear
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    o: Linear
    post_attn_norm: np.ndarray | None
    ffn_norm: np.ndarray
    ffn_norm_b: np.ndarray | None
    post_ffn_norm: np.ndarray | None
    gate_up: Linear | None
    up: Linear | None
    down: Linear
    sliding: bool
    rope_cache: np.ndarray | None
    moe: object = None                 # engine.models.moe.MoEBlock for a sparse MLP layer (then no gate_up/up/down)
    sinks: np.ndarray | None = None    # gpt-oss attention sinks, f32 [num_heads]


class DecoderLM:
    def __init__(self, ckpt, kv_dtype: str = "f32", device: str = "cpu", dtype: str = "auto"):
        self.ckpt = ckpt
        self.device = device                   # "cpu" or "cuda" (engine.device.resolve_device)
        if dtype not in ("auto", "float32"):
            raise ValueError(f"dtype must be 'auto' or 'float32', got {dtype!r}")
        self.dtype = dtype
        cfg = self.cfg = ckpt.config
        self.arch = cfg.architecture
        self.rec = rec = arch_of(self.arch)     # the architecture's traits and tensor names (engine/models/arch.py)
        if kv_dtype not in ("f32", "f16"):      # "auto" is the engine's to resolve (engine.sizing), never f32 here
            raise ValueError(f"kv_dtype must be 'f32' or 'f16', got {kv_dtype!r}")
        self.kv_dtype = np.float16 if kv_dtype == "f16" else np.float32
        self.H, self.KVH, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden = cfg.hidden_size
        self.vocab = cfg.vocab_size
        self.norm_offset = float(getattr(ckpt, "norm_weight_offset", 0.0) or 0.0)
        self.eps = cfg.layer_norm_eps if cfg.norm_type == "layernorm" else cfg.rms_norm_eps
        self.layernorm = cfg.norm_type == "layernorm"
        self.transpose_linear = getattr(ckpt, "linear_layout", "out_in") == "in_out"
        self.is_neox = ckpt.rope_layout != ROPE_ADJACENT_PAIRS
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping or 0.0
        self.final_softcap = cfg.final_logit_softcapping or 0.0
        # fused decode-path kernels (norm -> int8 input of a GGUF linear, activation -> int8 input of the down
        # projection, RoPE + KV-cache write); False runs the separate ops (same results bit for bit)
        self.fuse_decode = True

        self.moe_spec = moe_spec(ckpt)          # None: a dense model
        if self.moe_spec is not None and device == "vulkan":
            raise ModelLoadError("mixture-of-experts layers are not wired for Vulkan yet: use --device cpu or cuda",
                                 path=ckpt.path, key="device")
        self.embed = self._t("embed")
        # Gemma: sqrt(hidden); Granite: embedding_multiplier
        self.embed_scale = math.sqrt(self.hidden) if rec.embed_scale == "sqrt_hidden" else cfg.embedding_multiplier
        self.residual_scale = cfg.residual_multiplier        # Granite: block outputs scaled before the residual add
        self.pos_embed = vector_f32(self._t("pos_embed")) if rec.position == "learned" else None
        self.final_norm = vector_f32(self._t("final_norm"))
        fb = self._t("final_norm_b", required=False)
        self.final_norm_b = vector_f32(fb) if fb is not None else None
        head = self._t("lm_head", required=False)
        if head is None:
            if not cfg.tie_word_embeddings and rec.tie_embeddings != "if_missing" and \
                    not getattr(ckpt, "pooling_only", False):
                raise ModelLoadError("no output projection (lm_head / output.weight) and the config does not tie "
                                     "the word embeddings", path=ckpt.path, tensor="lm_head.weight")
            head = self.embed
        self.lm_head = linear_from([head], "lm_head")
        if self.embed.dtype in QUANT_TYPES:
            self.embed_table = None
        else:
            self.embed_table = self.embed.raw.reshape(self.embed.shape)
            if self.embed_table.dtype == np.float64:
                self.embed_table = self.embed_table.astype(np.float32)

        rot = cfg.rotary_dim or self.D
        self.rotary_dim = rot
        self.layers = []
        from engine.ops.rope import rope_cos_sin_cache
        self.rope_global = None
        self.rope_local = None
        self.longrope = None        # Phi-3 LongRoPE: {"short": cache, "long": cache, "orig": pretrained context}
        if cfg.position_embedding == "rope" and cfg.rope_theta:
            scaling = self._rope_scaling()
            self.rope_global = rope_cos_sin_cache(self.D, rot, cfg.max_position_embeddings, cfg.rope_theta,
                                                  scaling,
                                                  max_position_embeddings=cfg.max_position_embeddings)
            if scaling and scaling["rope_type"] == "longrope":
                orig = int(scaling["original_max_position_embeddings"])
                long_cache = rope_cos_sin_cache(self.D, rot, cfg.max_position_embeddings, cfg.rope_theta, scaling,
                                                max_position_embeddings=cfg.max_position_embeddings, seq_len=orig + 1)
                self.longrope = {"short": self.rope_global, "long": long_cache, "orig": orig}
                # one set of factors for every sequence, picked from the context length the engine serves
                # (set_max_model_len; vLLM and llama.cpp do the same), so cached keys never mix the two sets
                if cfg.max_position_embeddings > orig:
                    self.rope_global = long_cache
            if rec.local_rope and cfg.rope_local_theta:
                self.rope_local = rope_cos_sin_cache(self.D, rot, cfg.max_position_embeddings, cfg.rope_local_theta,
                                                     None)
        for i in range(cfg.num_layers):
            self.layers.append(self._layer(i))
        # decode graphs: MoE layers run all-kernel while a graph records (engine.ops.moe.routed_experts), except
        # GGUF-quantised experts (a host loop over the experts that have tokens)
        self.supports_graphs = not any(L.moe is not None and L.moe.quantized for L in self.layers)
        if device != "cpu" and not self.supports_graphs:
            raise ModelLoadError("GGUF-quantised MoE experts run on the CPU only so far (a host loop over the "
                                 "experts): use --device cpu", path=ckpt.path, key="device")
        self.num_kv_layers = cfg.num_layers
        self.k_caches = []
        self.v_caches = []
        self._attn16_ok = {}        # layer -> whether attention writes the o projection's 16-bit input
        self._gate_up16_of = {}     # layer -> _gate_up16's answer (fixed once the weights are placed)
        # attention scratch with stable addresses (graphs), one for all layers: they run one after another,
        # so one set of softmax-state arrays per step shape serves them (per layer it was ~180 MB over 30
        # layers at 2,048 tokens, and the CPU prefill's token groups hold 16 tokens' state a program)
        shared_ws = {}
        self._attn_ws = [shared_ws for _ in self.layers]
        self.embed_raw = self.embed.raw if self.embed_table is None else None
        self.device_bytes = 0
        # on GPUs, a 16-bit checkpoint with dtype "auto" computes as vLLM does: the activations entering the
        # tensor-core linears and q / the probabilities in the flash attention dots are rounded to 16 bits (one
        # MMA chain each); "float32" keeps them as f32 hi + lo parts (~16-22 significant bits, twice the MMAs).
        # Norms, softmax statistics, residuals and accumulators stay f32 either way; the CPU is not affected.
        kinds = {lin.kind for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.up, L.down) if lin is not None}
        self.compute16 = dtype == "auto" and device != "cpu" and bool(kinds) and kinds <= {"bf16", "f16"}
        self._attn_operands = "16bit" if self.compute16 else None
        if device in GPU_DEVICES:
            self._to_device()
        else:
            self._split_weights()
        self._fold_splitk = self._folds()             # fixed by the architecture and device: decided once

    def _to_device(self) -> None:
        """Uploads every weight once (from the memory map; GGUF blocks stay compressed) and drops the host
        references, so the forward pass runs on device arrays only."""
        from engine.device import Uploader
        up = Uploader(self.device)
        try:
            from tqdm import tqdm
            layers = tqdm(self.layers, desc="uploading weights", unit="layer", leave=False,
                          disable=len(self.layers) < 8)
        except ImportError:
            layers = self.layers
        for L in layers:
            for f in ("attn_norm", "attn_norm_b", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "ffn_norm_b",
                      "post_ffn_norm", "rope_cache", "sinks"):
                setattr(L, f, up(getattr(L, f)))
            for lin in (L.qkv, L.o, L.gate_up, L.up, L.down):
                if lin is not None:
                    lin.to_device(up)
                    if self.compute16:
                        lin.activations = "16bit"
                        lin.x16 = self._x16_storage(lin)
            if L.moe is not None:
                L.moe.to_device(up)
        self.lm_head.to_device(up)
        if self.compute16:
            self.lm_head.activations = "16bit"
        self.embed_table = up(self.embed_table)
        self.embed_raw = up(self.embed_raw)
        self.pos_embed = up(self.pos_embed)
        self.final_norm = up(self.final_norm)
        self.final_norm_b = up(self.final_norm_b)
        self.rope_global = up(self.rope_global)
        self.rope_local = up(self.rope_local)
        self.device_bytes = up.nbytes

    def _split_weights(self) -> None:
        """CPU: the linears' GGUF blocks regrouped into the planes the CPU kernels load fastest (Linear.use_split_layout:
        one copy of the q4_0 / q4_1 / q8_0 weights at load; the embedding keeps the file's blocks)."""
        from jitkern.compiler import default_target
        target = default_target()
        for L in self.layers:
            for lin in (L.qkv, L.o, L.gate_up, L.up, L.down):
                if lin is not None:
                    lin.use_split_layout(target)
        self.lm_head.use_split_layout(target)

    def set_max_model_len(self, n: int) -> None:
        """The engine's context limit, once sized: Phi-3's LongRoPE uses its long factors for every sequence
        when it exceeds the pretrained context (original_max_position_embeddings), else its short ones.
        (HF transformers switches per forward call by the longest position in it: the same as this for a
        prompt prefilled at once and for decoding, except while a sequence is still shorter than the
        pretrained context under a longer limit.)"""
        if self.longrope is None:
            return
        pick = self.longrope["long"] if n > self.longrope["orig"] else self.longrope["short"]
        if self.device != "cpu":
            from engine.device import Uploader
            pick = Uploader(self.device)(pick)
        for L in self.layers:
            if L.rope_cache is self.rope_global:
                L.rope_cache = pick
        self.rope_global = pick

    def _rope_scaling(self):
        """The config's rope scaling; a GGUF's LongRoPE factors are tensors (rope_factors_short/long)."""
        scaling = self.cfg.rope_scaling
        if not scaling or scaling.get("rope_type") != "longrope" or "long_factor" in scaling:
            return scaling
        fac = {k: self.ckpt.get(f"rope_factors_{k}.weight") for k in ("short", "long")}
        for k, t in fac.items():
            if t is None:
                raise ModelLoadError(f"LongRoPE scaling needs the rope_factors_{k}.weight tensor, which the "
                                     "checkpoint lacks", path=self.ckpt.path, tensor=f"rope_factors_{k}.weight")
        return {**scaling, "short_factor": vector_f32(fac["short"]).tolist(),
                "long_factor": vector_f32(fac["long"]).tolist()}

    # ------------------------------------------------------------------------------------ loading
    def _t(self, key, i=None, required=True):
        """The checkpoint tensor of logical name `key` (layer i), under the architecture's names (Arch.tensor)."""
        pats = arch_of(self.arch).tensor(key)
        for pat in pats:
            name = pat.format(i=i)
            t = self.ckpt.get(name)
            if t is not None:
                return t
        if required:
            alt = pats[1] if len(pats) > 1 else pats[0]
            raise ModelLoadError(f"the {self.arch} model needs tensor {pats[0].format(i=i)!r} "
                                 f"(or {alt.format(i=i)!r}), which the checkpoint lacks",
                                 path=self.ckpt.path, tensor=alt.format(i=i))
        return None

    def _vec(self, t):
        return None if t is None else vector_f32(t)

    def _norm_w(self, t):
        w = vector_f32(t)
        return w

    def _layer(self, i) -> Layer:
        cfg, rec = self.cfg, self.rec
        get = lambda k, req=True: self._t(k, i, req)  # noqa: E731
        if get("q", False) is None and get("qkv", False) is not None:
            # fused q/k/v: GPT-2's c_attn / attn_qkv, Phi-3's qkv_proj / attn_qkv
            qb = get("qkv_b", False)
            qkv = linear_from([get("qkv")], f"blk.{i}.qkv", transpose=self.transpose_linear,
                              biases=[qb] if qb is not None else None)
        else:
            bs = [get("q_b", False), get("k_b", False), get("v_b", False)]
            qkv = linear_from([get("q"), get("k"), get("v")], f"blk.{i}.qkv",
                              biases=bs if all(b is not None for b in bs) else None)
        expect = (self.H + 2 * self.KVH) * self.D
        if qkv.n != expect:
            raise ModelLoadError(f"fused q/k/v has {qkv.n} rows, expected (heads {self.H} + 2 x kv heads "
                                 f"{self.KVH}) x head_dim {self.D} = {expect}", path=self.ckpt.path,
                                 tensor=f"layer {i} q/k/v")
        ob = get("o_b", False)
        o = linear_from([get("o")], f"blk.{i}.o", transpose=self.transpose_linear,
                        biases=[ob] if ob is not None else None)
        # norm placement (Arch.norm_placement): "pre" norms before attention and the MLP, "sandwich" (Gemma) one
        # after each too, "post" (OLMo 2) after each only; which HF name is which norm is in the record's tensors
        placement = rec.norm_placement
        attn_norm = None if placement == "post" else self._norm_w(get("attn_norm"))
        post_attn = self._norm_w(get("post_attn_norm")) if placement in ("sandwich", "post") else None
        ffn_norm = None if placement == "post" else self._norm_w(get("ffn_norm"))
        post_ffn = self._norm_w(get("post_ffn_norm")) if placement in ("sandwich", "post") else None
        moe = None
        if rec.mlp == "plain":          # GPT-2: up, activation, down
            ub, db = get("up_b", False), get("down_b", False)
            up = linear_from([get("up")], f"blk.{i}.up", transpose=self.transpose_linear,
                             biases=[ub] if ub is not None else None)
            down = linear_from([get("down")], f"blk.{i}.down", transpose=self.transpose_linear,
                               biases=[db] if db is not None else None)
            gate_up = None
        elif get("gate", False) is None and get("gate_up", False) is not None and \
                get("gate_up").shape[0] == 2 * cfg.intermediate_size:        # Phi-3's fused gate_up_proj
            gate_up = linear_from([get("gate_up")], f"blk.{i}.gate_up")
            down = None if moe is not None else linear_from([get("down")], f"blk.{i}.down")
            up = None
        else:
            moe = load_moe_block(self.ckpt, i, self.moe_spec, self.hidden)
            gate_up = None if moe is not None else linear_from([get("gate"), get("up")], f"blk.{i}.gate_up")
            down = None if moe is not None else linear_from([get("down")], f"blk.{i}.down")
            up = None
        sliding = bool(cfg.layer_types) and cfg.layer_types[i] == SLIDING_ATTENTION and bool(cfg.sliding_window)
        rope = self.rope_global
        if rec.local_rope and sliding and self.rope_local is not None:
            rope = self.rope_local
        return Layer(attn_norm=attn_norm, attn_norm_b=self._vec(get("attn_norm_b", False)), qkv=qkv,
                     q_norm=self._vec(get("q_norm", False)), k_norm=self._vec(get("k_norm", False)), o=o,
                     post_attn_norm=post_attn, ffn_norm=ffn_norm, ffn_norm_b=self._vec(get("ffn_norm_b", False)),
                     post_ffn_norm=post_ffn, gate_up=gate_up, up=up, down=down, sliding=sliding, rope_cache=rope,
                     moe=moe, sinks=self._vec(get("sinks", False)))

    # ---------------------------------------------------------------------------------- KV cache
    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.KVH, self.D)
        if self.device in GPU_DEVICES:
            from engine.device import runtime_device
            from jitkern.runtime.device import DeviceArray
            dev = runtime_device(self.device)
            self.k_caches = [DeviceArray.zeros(shape, self.kv_dtype, dev) for _ in self.layers]
            self.v_caches = [DeviceArray.zeros(shape, self.kv_dtype, dev) for _ in self.layers]
            return
        self.k_caches = [np.zeros(shape, self.kv_dtype) for _ in self.layers]
        self.v_caches = [np.zeros(shape, self.kv_dtype) for _ in self.layers]

    def free_kv(self) -> None:
        self.k_caches, self.v_caches = [], []

    # ----------------------------------------------------------------------------------- forward
    def _norm(self, x, w, b, out, residual=None):
        from engine.ops.norm import layer_norm, rms_norm
        if w is None:          # OLMo 2: no pre-norm; the block reads the residual stream itself
            from engine.ops.activation import add, copy
            if residual is not None:
                add(residual, x, out=residual)
                x = residual
            return copy(x, out=out)
        if self.layernorm:
            if residual is not None:
                from engine.ops.activation import add
                add(residual, x, out=residual)
                x = residual
            return layer_norm(x, w, b, self.eps, out=out)
        return rms_norm(x, w, self.eps, out=out, residual=residual, weight_offset=self.norm_offset)

    def _x16_storage(self, lin):
        """Linear.x16 for `lin` on this model's device: the 16-bit storage its input may come in (CUDA, a plain
        16-bit Linear on the tensor-core path, after an RMSNorm or the gated activation), else None."""
        if not GPU_X16 or self.device != "cuda" or type(lin) is not Linear or self.layernorm:
            return None
        from engine.ops._hostargs import resolve_target
        from engine.ops.matmul import takes_16bit_x
        if not takes_16bit_x(lin.kind, lin.k, resolve_target(None, lin.weight)):
            return None
        return np.uint16 if lin.kind == "bf16" else np.float16

    def _gate_up16(self, L):
        """The 16-bit storage the gate/up projection writes its output in (tuning.gate_up16), or None: CUDA, both
        projections plain 16-bit linears of one type on the tensor-core path taking 16-bit x (Linear.x16), and
        gate/up's K not split (matmul.gpu_linear_mma_tile: a split one's slabs may go to the activation as f32,
        matmul.SplitK, at some step sizes and not others, which would round differently)."""
        if self.device != "cuda" or not _tuning(L.gate_up).gate_up16:
            return None
        key = id(L)
        if key not in self._gate_up16_of:
            st = getattr(L.gate_up, "x16", None)
            if st is not None and getattr(L.down, "x16", None) == st and type(L.gate_up) is Linear:
                from engine.ops.matmul import gpu_linear_mma_tile
                tile = gpu_linear_mma_tile(L.gate_up.n, L.gate_up.k)
                st = st if len(tile) < 5 or tile[4] == 1 else None
            else:
                st = None
            self._gate_up16_of[key] = st
        return self._gate_up16_of[key]

    def _attn16_for(self, lin, li: int) -> bool:
        """Whether attention writes `lin`'s (the o projection's) input in its 16-bit storage (tuning.x16_attn):
        lin takes 16-bit x and paged_attention runs the flash kernels for this model's heads and cache."""
        if getattr(lin, "x16", None) is None or type(lin) is not Linear or not _tuning(lin).x16_attn:
            return False
        ok = self._attn16_ok
        if li not in ok:
            from engine.ops._hostargs import resolve_target
            from engine.ops.attention import writes_16bit_out
            kc = self.k_caches[li]
            ok[li] = writes_16bit_out(resolve_target(None, lin.weight), self.H,
                                      kc.shape[2], kc.shape[3], kc.shape[1])
        return ok[li]

    def _x_for(self, lin, norm_w, x, buf):
        """The buffer the pre-norm writes `lin`'s input into: x (f32), or its 16-bit twin when lin takes it."""
        st = getattr(lin, "x16", None)
        if st is None or norm_w is None:
            return x
        return buf.get("x16", x.shape, st)

    def _folds(self) -> bool:
        """Whether this model's split-K sums may go into the next op (GPU_FOLD_SPLITK): CUDA, RMSNorm pre-norms on
        every layer and at the end (the ops that take a matmul.SplitK)."""
        return bool(GPU_FOLD_SPLITK and self.device == "cuda" and not self.layernorm and self.final_norm is not None
                    and all(L.attn_norm is not None and L.ffn_norm is not None for L in self.layers))

    @staticmethod
    def _fold_kw(lin, ok: bool) -> dict:
        return {"fold_sum": True} if ok and type(lin) is Linear and not lin.quantized else {}

    def _q8_bufs(self, buf, T: int, K: int, rep4: bool):
        """Activation buffers for int8 inputs of K columns (quantize_q8's arrays; the repeated scales with rep4)."""
        o8 = (buf.get(f"q8x{K}", (T, K), np.int8), buf.get(f"q8d{K}", (T, K // 32)), buf.get(f"q8s{K}", (T, K // 32)))
        o4 = (buf.get(f"q8d4_{K}", (T, K // 8)), buf.get(f"q8s4_{K}", (T, K // 8))) if rep4 else None
        return o8, o4

    def _attn_q8(self, lin, buf, T: int):
        """The Q8Activations the attention fills with lin's (the o projection's) int8 input, quantised as lin
        would quantise it (engine.ops.attention.paged_attention(q8_out=)); None where lin takes other input or
        the fused decode path is off."""
        spec = lin.q8_input(T) if self.fuse_decode else None
        if spec is None or lin.k % 32:
            return None
        from engine.ops.quant import Q8Activations
        layout, rep4 = spec
        o8, o4 = self._q8_bufs(buf, T, lin.k, rep4)
        return Q8Activations(*o8, layout, *(o4 or ()))

    def _gated_call(self, L, T: int, xg, gelu: bool, gu):
        """A callable (x, out) running L's gate/up projection (into the 16-bit `gu`) and the gated activation as one
        kernel (matmul.gated_linear, tuning.gated_linear) for a T-token step whose gate/up input is xg, or None where
        that kernel does not apply (then gate/up and the activation run apart, with the same bits)."""
        if xg.dtype == np.float32 or not _tuning(L.gate_up).gated_linear:
            return None
        from engine.ops._hostargs import resolve_target
        from engine.ops.matmul import gated_linear, gated_tile
        lin = L.gate_up
        if gated_tile(lin.kind, lin.n, lin.k, T, lin.kind, resolve_target(None, lin.weight)) is None:
            return None
        wkw = {"w_dtype": "bf16"} if lin.kind == "bf16" else {}

        def call(x, out, **_):
            return gated_linear(x, lin.weight, out, gu, act="gelu_tanh" if gelu else "silu", x_dtype=lin.kind, **wkw)
        return call

    def _norm_linear(self, src, w, b, lin, out, x, buf, residual=None, first=False, fold=False, call=None):
        """lin(norm(src)) into `out`, the pre-norm's residual handling as `_norm` (`first`: residual = src, the
        first layer's residual stream). A GGUF-quantised `lin` after an RMSNorm gets its int8 input straight from
        the norm kernel (engine.ops.norm.rms_norm_q8): one launch instead of norm + quantise; else the norm
        writes `x` and lin reads it. `src` may be a split-K linear's slabs (matmul.SplitK); `fold`: lin may
        return its own (see GPU_FOLD_SPLITK). `call` (x, out): runs in lin's place (tuning.gated_linear)."""
        T = src.shape[0]
        spec = None if (self.layernorm or w is None or not self.fuse_decode) else lin.q8_input(T)
        if spec is not None and not isinstance(src, np.ndarray) and hasattr(src, "sum_into"):
            src = src.sum_into(buf.get("hsum", src.shape))       # rms_norm_q8 reads a plain array
        if spec is None:
            if first and w is not None and not self.layernorm and self.fuse_decode:
                from engine.ops.norm import rms_norm        # residual = src and its norm: one launch
                rms_norm(src, w, self.eps, out=x, residual=residual, residual_copy=True, weight_offset=self.norm_offset)
            elif first:
                from engine.ops.activation import copy
                copy(src, out=residual)
                self._norm(residual, w, b, x)
            else:
                self._norm(src, w, b, x, residual=residual)
            return (call or lin)(x, out=out, **self._fold_kw(lin, fold))
        from engine.ops.norm import rms_norm_q8
        layout, rep4 = spec
        o8, o4 = self._q8_bufs(buf, T, lin.k, rep4)
        xq = rms_norm_q8(src, w, self.eps, o8, layout=layout, out4=o4, residual=residual, residual_copy=first,
                         weight_offset=self.norm_offset)
        return lin.call_q8(xq, out=out)

    def forward(self, b) -> np.ndarray:
        """One step over the flat batch `b` (engine.model_runner.Batch); returns logits [len(b.logits_rows), V]."""
        from engine.ops.activation import add, gelu_tanh, gelu_tanh_and_mul, scale_inplace, silu_and_mul
        from engine.ops.attention import MAX_PARTITIONS, paged_attention, reshape_and_cache
        from engine.ops.embedding import embedding
        from engine.ops.norm import rms_norm, rms_norm_heads
        from engine.ops._hostargs import resolve_target
        from engine.ops.matmul import SplitK
        from engine.ops.rope import rope, rope_and_cache, takes_split_k
        T = b.num_tokens
        H, KVH, D = self.H, self.KVH, self.D
        ids = b.input_ids[:T]
        pos = b.positions[:T]
        buf = b.buffers
        tp = getattr(self, "tp", None)       # engine.parallel.tp.TPShard: this model is one tensor-parallel rank
        if tp is not None:
            ids = tp.local_ids(ids)          # rows of this rank's vocabulary slice (outside: a zero row)
        h = buf.get("h", (T, self.hidden))
        if self.embed_table is not None:
            embedding(ids, self.embed_table, out=h, scale=self.embed_scale)
        else:
            from engine.ops.quant import dequantize_rows
            dequantize_rows(self.embed_raw, self.embed.dtype, ids, self.hidden, out=h)
            if self.embed_scale is not None:
                from engine.ops.activation import scale_inplace
                scale_inplace(h, self.embed_scale)
        if tp is not None:
            tp.all_reduce(h)
        if getattr(b, "mm_rows", None) is not None:
            # image input (LLaVA): the image tokens' embeddings are the projected image features
            from engine.ops.vision import scatter_rows
            scatter_rows(b.mm_embeds, b.mm_rows, h)
        if self.pos_embed is not None:
            pe = buf.get("pe", (T, self.hidden))
            embedding(pos, self.pos_embed, out=pe)
            add(h, pe, out=h)
        residual = buf.get("residual", (T, self.hidden))
        x = buf.get("x", (T, self.hidden))
        qkv_out = buf.get("qkv", (T, (H + 2 * KVH) * D))
        attn = buf.get("attn", (T, H * D))
        o = buf.get("o", (T, self.hidden))
        # a device batch: attention's host-side reads (lengths) come from the host twin, not a download
        host_step = (b.host.query_start[: b.num_seqs + 1], b.host.seq_lens[: b.num_seqs]) \
            if b.host is not None else None
        first = True
        fold = tp is None and self.residual_scale is None and self._fold_splitk
        # the q/k/v projection's split-K slabs can go to the rope + cache kernel at this step's size (decided once)
        fold_rope = fold and self.fuse_decode and takes_split_k(T, resolve_target(None, qkv_out))
        hsrc = h                             # the residual stream's next input: h, or the down projection's slabs
        for li, L in enumerate(self.layers):
            # attention block (pre-norm; the residual add is fused into the norm, and into the quantisation of
            # the q/k/v projection's input for GGUF weights)
            # the q/k/v projection's split-K slabs go to the rope + cache kernel, which sums them as it reads
            # (GPU_FOLD_SPLITK; the sum kernel's bits): where nothing else reads q/k/v before it
            fold_qkv = fold_rope and L.rope_cache is not None and L.q_norm is None
            qkv_src = self._norm_linear(hsrc, L.attn_norm, L.attn_norm_b, L.qkv, qkv_out,
                                        self._x_for(L.qkv, L.attn_norm, x, buf), buf, residual=residual,
                                        first=first, fold=fold_qkv)
            first = False
            q = _heads(qkv_out, 0, H, D)
            k = _heads(qkv_out, H * D, KVH, D)
            v = _heads(qkv_out, (H + KVH) * D, KVH, D)
            slabs = qkv_src if isinstance(qkv_src, SplitK) else None
            if L.q_norm is not None and L.q_norm.shape[0] != D:
                # OLMoE: one RMSNorm over all of q (and of k), not per head
                rms_norm(qkv_out[:, :H * D], L.q_norm, self.cfg.rms_norm_eps, out=qkv_out[:, :H * D])
                rms_norm(qkv_out[:, H * D:(H + KVH) * D], L.k_norm, self.cfg.rms_norm_eps,
                         out=qkv_out[:, H * D:(H + KVH) * D])
            elif L.q_norm is not None:
                rms_norm_heads(q, L.q_norm, self.cfg.rms_norm_eps, weight_offset=self.norm_offset)
                rms_norm_heads(k, L.k_norm, self.cfg.rms_norm_eps, weight_offset=self.norm_offset)
            if L.rope_cache is not None and self.fuse_decode:
                # rotate q in place, rotated k and v into the paged cache: one launch
                if slabs is not None:
                    p0 = slabs.parts[0]
                    rope_and_cache(_heads(p0, 0, H, D), _heads(p0, H * D, KVH, D), _heads(p0, (H + KVH) * D, KVH, D),
                                   pos, L.rope_cache, D, self.rotary_dim, self.is_neox, self.k_caches[li],
                                   self.v_caches[li], b.slot_mapping[:T], q_out=q, parts=slabs.S,
                                   part_stride=slabs.parts.strides[0] // slabs.parts.itemsize)
                else:
                    rope_and_cache(q, k, v, pos, L.rope_cache, D, self.rotary_dim, self.is_neox, self.k_caches[li],
                                   self.v_caches[li], b.slot_mapping[:T])
            else:
                if L.rope_cache is not None:
                    rope(q, k, pos, L.rope_cache, D, self.rotary_dim, self.is_neox)
                reshape_and_cache(k, v, self.k_caches[li], self.v_caches[li], b.slot_mapping[:T])
            # the o projection's input straight in its 16-bit storage where it takes one (Linear.x16) and the
            # flash kernels write it: rounded as they store, the bits the linear would round f32 to
            attn_o = buf.get("attn16", (T, H * D), L.o.x16) if self._attn16_for(L.o, li) else attn
            # a GGUF o projection's int8 input written by the attention (its merge kernel, in decode steps)
            o_q8 = self._attn_q8(L.o, buf, T) if attn_o is attn else None
            paged_attention(q, self.k_caches[li], self.v_caches[li], b.query_start[: b.num_seqs + 1],
                            b.seq_lens[: b.num_seqs], b.block_table[: b.num_seqs], scale=self.scale,
                            sliding_window=self.cfg.sliding_window if L.sliding else 0, softcap=self.softcap,
                            sinks=L.sinks,
                            out=attn_o.reshape(T, H, D), workspace=self._attn_ws[li],
                            # the full partition axis: a recorded decode graph stays valid as contexts grow
                            # (each sequence uses only the partitions its own length needs)
                            num_partitions=MAX_PARTITIONS, host_step=host_step, operands=self._attn_operands,
                            q8_out=o_q8)
            osrc = L.o.call_q8(o_q8, out=o) if o_q8 is not None else \
                L.o(attn_o, out=o, **self._fold_kw(L.o, fold and L.post_attn_norm is None))
            if tp is not None:               # row-parallel o: partial sums
                tp.all_reduce(o)
            if self.residual_scale is not None:
                scale_inplace(o, self.residual_scale)
            if L.post_attn_norm is not None:
                rms_norm(o, L.post_attn_norm, self.eps, out=o, weight_offset=self.norm_offset)
            # MLP block
            down_q8 = None
            if L.moe is not None:
                self._norm(osrc, L.ffn_norm, L.ffn_norm_b, x, residual=residual)
                L.moe(x, h, buf)
            elif L.gate_up is not None:
                down_q8 = L.down.q8_input(T) if self.fuse_decode else None
                gu16 = self._gate_up16(L) if down_q8 is None else None
                gelu = self.cfg.hidden_act.startswith("gelu")
                xg = self._x_for(L.gate_up, L.ffn_norm, x, buf)
                gu = buf.get("gu", (T, L.gate_up.n)) if gu16 is None else buf.get("gu16", (T, L.gate_up.n), gu16)
                gated = self._gated_call(L, T, xg, gelu, gu) if gu16 is not None else None
                if gated is not None:
                    # gate/up and the activation in one launch, into the down projection's 16-bit input
                    act = buf.get("act16", (T, L.gate_up.n // 2), gu16)
                    self._norm_linear(osrc, L.ffn_norm, L.ffn_norm_b, L.gate_up, act, xg, buf, residual=residual,
                                      call=gated)
                else:
                    gu = self._norm_linear(osrc, L.ffn_norm, L.ffn_norm_b, L.gate_up, gu, xg, buf,
                                           residual=residual, fold=fold and down_q8 is None)
                    if down_q8 is not None:
                        # the activation writes the down projection's int8 input directly: one launch fewer
                        from engine.ops.activation import act_and_mul_q8
                        o8, o4 = self._q8_bufs(buf, T, L.down.k, down_q8[1])
                        L.down.call_q8(act_and_mul_q8(gu, o8, gelu=gelu, layout=down_q8[0], out4=o4), out=h)
                    else:
                        st = getattr(L.down, "x16", None)
                        act = buf.get("act", (T, L.gate_up.n // 2)) if st is None else \
                            buf.get("act16", (T, L.gate_up.n // 2), st)
                        (gelu_tanh_and_mul if gelu else silu_and_mul)(gu, out=act)
            else:
                self._norm(osrc, L.ffn_norm, L.ffn_norm_b, x, residual=residual)
                act = buf.get("act", (T, L.up.n))
                L.up(x, out=act)
                gelu_tanh(act, out=act)
            hsrc = h
            if L.moe is None:
                if down_q8 is None:
                    hsrc = L.down(act, out=h, **self._fold_kw(L.down, fold and L.post_ffn_norm is None))
                if tp is not None:           # row-parallel down: partial sums
                    tp.all_reduce(h)
            if L.post_ffn_norm is not None:
                rms_norm(h, L.post_ffn_norm, self.eps, out=h, weight_offset=self.norm_offset)
            if self.residual_scale is not None:
                scale_inplace(h, self.residual_scale)
        # final norm on the rows we need logits for
        rows = b.logits_rows
        R = len(rows)
        if R == T and R and tp is None and not getattr(self, "return_hidden", False) and \
                not self.layernorm and self.fuse_decode and self.lm_head.q8_input(T) is not None and \
                np.array_equal(rows, np.arange(T)):
            # every row wants logits (decode): the final norm writes the LM head's int8 input directly
            logits = buf.get("logits", (R, self.vocab))
            self._norm_linear(hsrc, self.final_norm, self.final_norm_b, self.lm_head, logits, x, buf, residual=residual)
            return self._finish_logits(logits)
        self._norm(hsrc, self.final_norm, self.final_norm_b, x, residual=residual)
        if R == 0:
            return np.zeros((0, self.vocab), np.float32)
        xs = self._logit_rows(x, b, buf)
        if getattr(self, "return_hidden", False):      # embeddings (engine.pooling): final hidden states
            return xs
        logits = buf.get("logits", (R, self.vocab))
        (self.lm_head if tp is None else tp.lm_head)(xs, out=logits)     # tp: vocab slices, all-gathered
        return self._finish_logits(logits)

    def _logit_rows(self, x, b, buf):
        """The final hidden states of the rows that want logits (b.logits_rows, at least one): x itself when
        that is every row in order, else those rows gathered into the batch buffer "xs"."""
        rows = b.logits_rows
        R, T = len(rows), x.shape[0]
        if R == T and np.array_equal(rows, np.arange(T)):
            return x
        from engine.ops.embedding import embedding as gather_rows
        xs = buf.get("xs", (R, self.hidden))
        idx = b.device_rows[:R] if b.device_rows is not None else rows.astype(np.int32)
        gather_rows(idx, x, out=xs)
        return xs

    def _finish_logits(self, logits):
        from engine.ops.activation import scale_inplace
        if self.final_softcap:
            from engine.ops.activation import softcap_inplace
            softcap_inplace(logits, self.final_softcap)
        if self.cfg.logits_scaling is not None:        # Granite: logits / logits_scaling
            scale_inplace(logits, 1.0 / self.cfg.logits_scaling)
        return logits


def _heads(a: np.ndarray, col0: int, nheads: int, d: int) -> np.ndarray:
    """A [T, nheads, d] strided view of columns col0.. of a [T, C] row-major buffer."""
    if not isinstance(a, np.ndarray):          # a GPU DeviceArray
        return a[:, col0:].as_strided((a.shape[0], nheads, d), (a.strides[0], d * a.itemsize, a.itemsize))
    return np.lib.stride_tricks.as_strided(a[:, col0:], shape=(a.shape[0], nheads, d),
                                           strides=(a.strides[0], d * a.itemsize, a.itemsize))
