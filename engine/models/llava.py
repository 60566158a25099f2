"""LLaVA (HF `LlavaForConditionalGeneration`): a CLIP ViT vision tower and a two-layer projector in front of a
Llama-family decoder.

    x      = [class_embedding, W_patch . unfold(pixels)] + position_embedding      (one row per patch, CLS first)
    x      = LayerNorm_pre(x)                                                       (hidden state 0)
    layer  : x = x + out_proj(Attention(LayerNorm1(x)))                             (full, non-causal; biased)
             x = x + fc2(act(fc1(LayerNorm2(x))))                                   (act: quick_gelu / gelu)
    feats  = hidden state `vision_feature_layer` (a list: several, side by side); "default" drops the CLS row
    embeds = linear_2(act(linear_1(feats)))                                         (projector_hidden_act: gelu)

The projected rows replace the embeddings of the prompt's image tokens: the image token of a prompt is expanded
to one token per feature row (engine.multimodal), and the decoder's prefill scatters the rows over those
positions (DecoderLM.forward, Batch.mm_rows). The language model is the ordinary decoder: the checkpoint's
language-model tensors are listed under the text model's own names (`rename_tensors`).

Every tensor operation runs on jitkern kernels. The patch convolution (stride = kernel = patch size) is a matmul
over the image's patches, unfolded on the host (a reshape and transpose of the pixels). Attention reuses the
paged decode kernel as the BERT encoder does (engine/models/encoder.py): an image's keys and values go into
scratch blocks of its own, and each of its tokens is a one-query sequence over all of them.

On CUDA the tower's weights are uploaded once (engine.device.Uploader); an encode uploads the unfolded pixels and
its index arrays, runs on device arrays, and `encode` returns the features on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError

LLAVA_MODEL_TYPES = ("llava",)

# config.json keys LlamaConfig fills when a LLaVA text_config leaves them out (llava-hf's configs keep only what
# differs from those defaults, so hidden_size and the rest are often absent)
LLAMA_TEXT_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                       "num_hidden_layers": 32, "num_attention_heads": 32}
# LlavaConfig's vision_config defaults (CLIP ViT-L/14 at 336 px), then CLIPVisionConfig's own
_VISION_DEFAULTS = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "patch_size": 14, "image_size": 336,
                    "num_channels": 3, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}

# checkpoint name prefixes -> the names the model code reads: transformers 4.x and the llava-hf repos write
# language_model.model.* / language_model.lm_head / vision_tower.vision_model.*, transformers 5 model.language_model.*
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.vision_tower.vision_model.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))


def is_llava(config) -> bool:
    """Whether a ModelConfig (or a raw config.json dict) is a LLaVA checkpoint's."""
    raw = config if isinstance(config, dict) else (getattr(config, "extra", None) or {})
    return raw.get("model_type") in LLAVA_MODEL_TYPES


def rename_tensors(tensors: dict) -> dict:
    """A LLaVA checkpoint's tensor map under the names the decoder (model.*, lm_head) and the vision code
    (vision_tower.*, multi_modal_projector.*) read; the TensorRefs keep the file's own names for errors."""
    out = {}
    for name, ref in tensors.items():
        new = name
        for old, rep in _RENAMES:
            if name.startswith(old):
                new = rep + name[len(old):]
                break
        if new in out:
            raise ModelLoadError(f"two tensors of the checkpoint map to {new!r}", path=ref.file, tensor=name)
        out[new] = ref
    return out


@dataclass(frozen=True)
class VisionConfig:
    """The vision side of a LLaVA config.json."""
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple            # hidden-state indices (0 = after the pre-norm, i = after layer i)
    select_strategy: str             # "default" (drop CLS) | "full"
    projector_act: str
    projector_bias: bool
    image_token_id: int
    text_hidden: int

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_features(self) -> int:
        """Rows of projected features per image: the placeholder tokens an image takes in the prompt."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, cfg) -> "VisionConfig":
        raw = cfg.extra or {}
        src = cfg.source or "config.json"
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            raise ModelLoadError("a LLaVA config needs a 'vision_config' object", path=src, key="vision_config")
        v = {**_VISION_DEFAULTS, **{k: x for k, x in vc.items() if x is not None}}
        if v["model_type"] != "clip_vision_model":
            raise ModelLoadError(f"vision tower {v['model_type']!r} is not supported (LLaVA with a CLIP vision "
                                 "tower, clip_vision_model, is)", path=src, key="vision_config.model_type")
        acts = ("quick_gelu", "gelu", "gelu_new", "gelu_pytorch_tanh")
        for key, act in (("vision_config.hidden_act", v["hidden_act"]),
                         ("projector_hidden_act", raw.get("projector_hidden_act", "gelu"))):
            if act not in acts:
                raise ModelLoadError(f"activation {act!r} is not supported ({', '.join(acts)})", path=src, key=key)
        layers = int(v["num_hidden_layers"])
        fl = raw.get("vision_feature_layer", -2)
        fl = [fl] if isinstance(fl, int) else list(fl)
        resolved = []
        for i in fl:
            j = int(i) if int(i) >= 0 else layers + 1 + int(i)
            if not 0 <= j <= layers:
                raise ModelLoadError(f"vision_feature_layer {i} is outside the vision tower's {layers} layers",
                                     path=src, key="vision_feature_layer")
            resolved.append(j)
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not 'default' or 'full'",
                                 path=src, key="vision_feature_select_strategy")
        token = raw.get("image_token_index", raw.get("image_token_id", 32000))
        out = cls(image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
                  num_channels=int(v["num_channels"]), hidden_size=int(v["hidden_size"]),
                  intermediate_size=int(v["intermediate_size"]), num_layers=layers,
                  num_heads=int(v["num_attention_heads"]), layer_norm_eps=float(v["layer_norm_eps"]),
                  hidden_act=v["hidden_act"], feature_layers=tuple(resolved), select_strategy=strategy,
                  projector_act=raw.get("projector_hidden_act", "gelu"),
                  projector_bias=bool(raw.get("multimodal_projector_bias", True)), image_token_id=int(token),
                  text_hidden=cfg.hidden_size)
        if out.image_size % out.patch_size or out.hidden_size % out.num_heads:
            raise ModelLoadError("vision_config: image_size must be a multiple of patch_size and hidden_size of "
                                 "num_attention_heads", path=src, key="vision_config")
        if not 0 <= out.image_token_id < cfg.vocab_size:
            raise ModelLoadError(f"image_token_index {out.image_token_id} is outside the vocabulary "
                                 f"[0, {cfg.vocab_size})", path=src, key="image_token_index")
        return out


def _act(name: str):
    from engine.ops.activation import gelu, gelu_tanh
    from engine.ops.vision import quick_gelu
    return {"quick_gelu": quick_gelu, "gelu": gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh}[name]


class LlavaVision:
    """The vision tower and projector of a LLaVA checkpoint: pixels -> the rows replacing the image tokens."""

    BLOCK = 16          # scratch KV block size of the encoder's attention

    def __init__(self, ckpt, device: str = "cpu"):
        # (imported here: engine.config reads this module's constants, and the weights module imports the loader,
        # which imports engine.config)
        from engine.models.weights import Linear, linear_from, vector_f32
        self.ckpt = ckpt
        self.cfg = vc = VisionConfig.from_config(ckpt.config)
        C, p, Hd = vc.num_channels, vc.patch_size, vc.hidden_size
        pw = self._get("vision_tower.embeddings.patch_embedding.weight")
        if tuple(pw.shape) != (Hd, C, p, p):
            raise ModelLoadError(f"shape disagrees with the vision config: expected {[Hd, C, p, p]}, found "
                                 f"{list(pw.shape)}", path=pw.file, tensor=pw.name)
        if pw.dtype not in ("f32", "f16", "bf16"):
            raise ModelLoadError(f"unsupported weight dtype {pw.dtype}", path=pw.file, tensor=pw.name)
        # the convolution as a matmul over unfolded patches: W [hidden, C * p * p], (c, ky, kx) order
        w = np.ascontiguousarray(pw.raw.reshape(Hd, C * p * p))
        self.patch = Linear(w, pw.dtype, Hd, C * p * p, None, "vision.patch")
        P = vc.num_patches
        pos = self._get("vision_tower.embeddings.position_embedding.weight")
        if tuple(pos.shape) != (P + 1, Hd):
            raise ModelLoadError(f"shape disagrees with the vision config: expected {[P + 1, Hd]}, found "
                                 f"{list(pos.shape)}", path=pos.file, tensor=pos.name)
        # one table for what is added to each row after the patch matmul: row 0 (CLS, whose matmul row is zero)
        # gets the class embedding, the patch rows the conv bias when there is one
        table = np.array(vector_f32(pos), np.float32)
        table[0] += vector_f32(self._get("vision_tower.embeddings.class_embedding"))
        pb = self._get("vision_tower.embeddings.patch_embedding.bias", required=False)
        if pb is not None:
            table[1:] += vector_f32(pb)
        self.pos_table = np.ascontiguousarray(table)
        self.pre_ln = self._ln("vision_tower.pre_layrnorm")
        self.depth = max(vc.feature_layers)            # layers past the deepest selected state never run
        self.layers = [self._layer(i) for i in range(self.depth)]
        pre = "multi_modal_projector."
        bias = (lambda n: [self._get(pre + n + ".bias")]) if vc.projector_bias else (lambda n: None)  # noqa: E731
        self.proj1 = linear_from([self._get(pre + "linear_1.weight")], "vision.proj1", biases=bias("linear_1"))
        self.proj2 = linear_from([self._get(pre + "linear_2.weight")], "vision.proj2", biases=bias("linear_2"))
        feat_in = Hd * len(vc.feature_layers)
        if self.proj1.k != feat_in or self.proj2.n != vc.text_hidden or self.proj1.n != self.proj2.k:
            raise ModelLoadError(f"the projector maps {self.proj1.k} -> {self.proj2.n}, expected {feat_in} "
                                 f"(vision hidden x feature layers) -> {vc.text_hidden} (text hidden)",
                                 path=ckpt.path, tensor="multi_modal_projector.linear_1.weight")
        self._attn_ws: dict = {}
        self.device = device
        from engine.device import GPU_DEVICES, Arrays
        self.arrays = Arrays(device)             # the encode's buffers and index arrays
        if device in GPU_DEVICES:
            self._to_device()

    def _to_device(self) -> None:
        from engine.device import Uploader
        up = Uploader(self.device)
        for lin in (self.patch, self.proj1, self.proj2):
            lin.to_device(up)
        self.pos_table = up(self.pos_table)
        self.pre_ln = tuple(up(v) for v in self.pre_ln)
        for L in self.layers:
            for k in ("qkv", "o", "fc1", "fc2"):
                L[k].to_device(up)
            for k in ("ln1", "ln2"):
                L[k] = tuple(up(v) for v in L[k])

    # ------------------------------------------------------------------------------------ loading
    def _get(self, name, required=True):
        t = self.ckpt.get(name)
        if t is None and required:
            raise ModelLoadError("the LLaVA vision tower needs this tensor, which the checkpoint lacks",
                                 path=self.ckpt.path, tensor=name)
        return t

    def _ln(self, pre):
        from engine.models.weights import vector_f32
        return vector_f32(self._get(pre + ".weight")), vector_f32(self._get(pre + ".bias"))

    def _layer(self, i):
        from engine.models.weights import linear_from
        pre = f"vision_tower.encoder.layers.{i}."
        g = lambda n: self._get(pre + n)  # noqa: E731
        qkv = linear_from([g(f"self_attn.{x}_proj.weight") for x in "qkv"], f"vision.{i}.qkv",
                          biases=[g(f"self_attn.{x}_proj.bias") for x in "qkv"])
        o = linear_from([g("self_attn.out_proj.weight")], f"vision.{i}.o", biases=[g("self_attn.out_proj.bias")])
        fc1 = linear_from([g("mlp.fc1.weight")], f"vision.{i}.fc1", biases=[g("mlp.fc1.bias")])
        fc2 = linear_from([g("mlp.fc2.weight")], f"vision.{i}.fc2", biases=[g("mlp.fc2.bias")])
        Hd = self.cfg.hidden_size
        if qkv.n != 3 * Hd or qkv.k != Hd or fc1.k != Hd or fc2.n != Hd:
            raise ModelLoadError(f"vision layer {i}: projection shapes disagree with hidden_size {Hd}",
                                 path=self.ckpt.path, tensor=pre + "self_attn.q_proj.weight")
        return dict(qkv=qkv, o=o, fc1=fc1, fc2=fc2, ln1=self._ln(pre + "layer_norm1"),
                    ln2=self._ln(pre + "layer_norm2"))

    # ----------------------------------------------------------------------------------- forward
    def unfold(self, pixels: np.ndarray) -> np.ndarray:
        """[N, C, S, S] pixels -> [N * (P + 1), C * p * p] matmul rows, a zero row first for each image's CLS
        token (the host side of the patch convolution: a reshape and transpose, no arithmetic)."""
        vc = self.cfg
        N = pixels.shape[0]
        C, p, g = vc.num_channels, vc.patch_size, vc.grid
        if pixels.shape[1:] != (C, vc.image_size, vc.image_size):
            raise ValueError(f"pixel values must be [N, {C}, {vc.image_size}, {vc.image_size}], got "
                             f"{list(pixels.shape)}")
        rows = np.zeros((N, vc.num_patches + 1, C * p * p), np.float32)
        rows[:, 1:] = pixels.reshape(N, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(N, g * g, C * p * p)
        return rows.reshape(N * (vc.num_patches + 1), C * p * p)

    def hidden_states(self, pixels: np.ndarray) -> list:
        """The selected hidden states [N * (P + 1), hidden] (vision_feature_layer order) of N images."""
        from engine.ops.activation import add, copy
        from engine.ops.attention import paged_attention, reshape_and_cache
        from engine.ops.embedding import embedding
        from engine.ops.norm import layer_norm
        vc = self.cfg
        pixels = np.ascontiguousarray(pixels, np.float32)
        N = pixels.shape[0]
        S = vc.num_patches + 1                      # tokens per image
        T = N * S
        Hd, H, D = vc.hidden_size, vc.num_heads, vc.head_dim
        eps = vc.layer_norm_eps
        x = self.arrays.empty((T, Hd))
        t = self.arrays.empty((T, Hd))
        self.patch(self.arrays.put(self.unfold(pixels)), out=x)
        embedding(self.arrays.put(np.tile(np.arange(S, dtype=np.int32), N)), self.pos_table, out=t)
        add(x, t, out=x)
        layer_norm(x, *self.pre_ln, eps, out=x)
        keep = {j: None for j in vc.feature_layers}
        if 0 in keep:
            keep[0] = copy(x, out=self.arrays.empty((T, Hd)))
        # attention layout: image n's tokens in its own scratch blocks; every token one query over its image
        bs = self.BLOCK
        nb = -(-S // bs)
        kc = self.arrays.zeros((N * nb, bs, H, D))
        vcache = self.arrays.zeros((N * nb, bs, H, D))
        tok = np.arange(T, dtype=np.int32)
        img = tok // S
        slots = (img * nb * bs + tok % S).astype(np.int32)
        qs_h = np.arange(T + 1, dtype=np.int32)
        lens_h = np.full(T, S, np.int32)
        table = (img[:, None] * nb + np.arange(nb, dtype=np.int32)[None, :]).astype(np.int32)
        # (a GPU's attention reads the lengths' host copies for its launch shape: host_step)
        host_step = (qs_h, lens_h) if self.arrays.device is not None else None
        slots, qs, lens, table = (self.arrays.put(a) for a in (slots, qs_h, lens_h, table))
        scale = float(D) ** -0.5
        act = _act(vc.hidden_act)
        qkv = self.arrays.empty((T, 3 * Hd))
        attn = self.arrays.empty((T, Hd))
        mid = self.arrays.empty((T, vc.intermediate_size))
        for li, L in enumerate(self.layers):
            layer_norm(x, *L["ln1"], eps, out=t)
            L["qkv"](t, out=qkv)
            q, k, v = (_heads(qkv, j * Hd, H, D) for j in range(3))
            reshape_and_cache(k, v, kc, vcache, slots)
            paged_attention(q, kc, vcache, qs, lens, table, scale=scale, out=attn.reshape(T, H, D),
                            workspace=self._attn_ws, max_query_len=1, host_step=host_step)
            L["o"](attn, out=t)
            add(x, t, out=x)
            layer_norm(x, *L["ln2"], eps, out=t)
            L["fc1"](t, out=mid)
            act(mid, out=mid)
            L["fc2"](mid, out=t)
            add(x, t, out=x)
            if li + 1 in keep:
                keep[li + 1] = x if li + 1 == self.depth else copy(x, out=self.arrays.empty((T, Hd)))
        return [keep[j] for j in vc.feature_layers]

    def features(self, pixels: np.ndarray) -> np.ndarray:
        """The vision features the projector reads, [N, F, hidden x feature layers] (F = num_features)."""
        from engine.ops.activation import copy
        from engine.ops.embedding import embedding
        vc = self.cfg
        states = self.hidden_states(pixels)
        N, S, Hd = pixels.shape[0], vc.num_patches + 1, vc.hidden_size
        if len(states) == 1:
            cat = states[0]
        else:
            cat = self.arrays.empty((N * S, Hd * len(states)))
            for j, s in enumerate(states):
                copy(s, out=cat[:, j * Hd:(j + 1) * Hd])
        if vc.select_strategy == "full":
            return cat.reshape(N, S, -1)
        rows = (np.arange(N, dtype=np.int32)[:, None] * S + np.arange(1, S, dtype=np.int32)[None, :]).reshape(-1)
        out = embedding(self.arrays.put(rows), cat)       # the CLS rows dropped (a row gather)
        return out.reshape(N, S - 1, -1)

    def encode(self, pixels: np.ndarray):
        """Projected image features [N, F, text hidden] for pixel values [N, C, S, S] (engine.multimodal's), on
        the tower's device."""
        feats = self.features(pixels)
        N, F, K = feats.shape
        h = self.proj1(feats.reshape(N * F, K))
        _act(self.cfg.projector_act)(h, out=h)
        return self.proj2(h).reshape(N, F, -1)


def _heads(a, col0, nheads, d):
    # the decoder's (numpy and device arrays alike), imported here for the reason given in LlavaVision.__init__
    from engine.models.decoder import _heads as heads
    return heads(a, col0, nheads, d)
