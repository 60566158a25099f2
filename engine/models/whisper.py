"""Whisper (HF `WhisperForConditionalGeneration`): an audio encoder and a text decoder with cross-attention.

    encoder: x = gelu(conv1(mel)); x = gelu(conv2(x))          (kernel 3, padding 1; conv2 has stride 2)
             x = x + embed_positions                            (one row per 20 ms frame: max_source_positions)
             layer: x = x + out_proj(Attention(LN1(x)))         (full, non-causal; q/v/out biased, k not)
                    x = x + fc2(act(fc1(LN2(x))))
             enc = LN(x)
    decoder: x = embed_tokens(ids) (* sqrt(d_model) with scale_embedding) + embed_positions(positions)
             layer: x = x + out_proj(SelfAttention(LN1(x)))     (causal, over the request's KV cache)
                    x = x + out_proj(CrossAttention(LN2(x), enc))   (K/V of enc computed once per request)
                    x = x + fc2(act(fc1(LN3(x))))
             logits = LN(x) @ embed_tokens^T                    (proj_out, tied unless the file has its own)

Every tensor operation runs on jitkern kernels. The convolutions are the dense linear over unfolded frames
(engine.ops.audio.unfold1d). Attention reuses the paged kernels as the BERT encoder and LLaVA's vision tower do:
the encoder's keys and values go into scratch blocks and each frame is a one-query sequence over all of them; the
decoder's self-attention is an ordinary causal step over a contiguous per-request cache (block table 0..n), and
its cross-attention makes each decoder token a one-query sequence over the encoder's blocks.

The paged engine does not host Whisper: a request owns its caches (`DecoderState`) for its whole decode, and
engine.transcription runs requests one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError

WHISPER_MODEL_TYPES = ("whisper",)
_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def is_whisper(config) -> bool:
    """Whether a ModelConfig (or a raw config.json dict) is a Whisper checkpoint's."""
    raw = config if isinstance(config, dict) else (getattr(config, "extra", None) or {})
    return raw.get("model_type") in WHISPER_MODEL_TYPES


@dataclass(frozen=True)
class WhisperConfig:
    """The keys of a Whisper config.json the model code reads (WhisperConfig's defaults where absent)."""
    d_model: int
    vocab_size: int
    num_mel_bins: int
    encoder_layers: int
    encoder_heads: int
    decoder_layers: int
    decoder_heads: int
    max_source_positions: int
    max_target_positions: int
    activation: str
    scale_embedding: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg) -> "WhisperConfig":
        raw = cfg.extra or {}
        src = cfg.source or "config.json"
        d = {"d_model": 384, "vocab_size": 51865, "num_mel_bins": 80, "encoder_layers": 4,
             "encoder_attention_heads": 6, "decoder_layers": 4, "decoder_attention_heads": 6,
             "max_source_positions": 1500, "max_target_positions": 448, "activation_function": "gelu",
             "scale_embedding": False, "tie_word_embeddings": True}
        v = {**d, **{k: x for k, x in raw.items() if k in d and x is not None}}
        if v["activation_function"] not in _ACTS:
            raise ModelLoadError(f"activation {v['activation_function']!r} is not supported ({', '.join(_ACTS)})",
                                 path=src, key="activation_function")
        out = cls(d_model=int(v["d_model"]), vocab_size=int(v["vocab_size"]), num_mel_bins=int(v["num_mel_bins"]),
                  encoder_layers=int(v["encoder_layers"]), encoder_heads=int(v["encoder_attention_heads"]),
                  decoder_layers=int(v["decoder_layers"]), decoder_heads=int(v["decoder_attention_heads"]),
                  max_source_positions=int(v["max_source_positions"]),
                  max_target_positions=int(v["max_target_positions"]), activation=v["activation_function"],
                  scale_embedding=bool(v["scale_embedding"]), tie_word_embeddings=bool(v["tie_word_embeddings"]))
        for key, heads in (("encoder_attention_heads", out.encoder_heads), ("decoder_attention_heads",
                                                                              out.decoder_heads)):
            if heads <= 0 or out.d_model % heads:
                raise ModelLoadError(f"d_model {out.d_model} is not a multiple of {key} {heads}", path=src, key=key)
        return out

    @property
    def num_frames(self) -> int:
        """Log-mel frames one encoder pass reads (conv2's stride 2 halves them into max_source_positions)."""
        return 2 * self.max_source_positions


def _act(name: str):
    from engine.ops.activation import gelu, gelu_tanh
    return gelu if name == "gelu" else gelu_tanh


def _heads(a, col0, nheads, d):
    # the decoder's (numpy and device arrays alike), imported here as engine.models.llava does
    from engine.models.decoder import _heads as heads
    return heads(a, col0, nheads, d)


class DecoderState:
    """One request's decoder caches: its self-attention K/V (contiguous blocks 0..n) and the encoder output's
    cross-attention K/V, and how many tokens the self-attention cache holds."""

    def __init__(self, model: "WhisperModel", enc: np.ndarray):
        from engine.ops.attention import reshape_and_cache
        c = model.cfg
        H, D, bs = c.decoder_heads, c.d_model // c.decoder_heads, model.BLOCK
        L = c.decoder_layers
        nb = -(-c.max_target_positions // bs)
        arr = model.arrays
        self.self_k = [arr.zeros((nb, bs, H, D)) for _ in range(L)]
        self.self_v = [arr.zeros((nb, bs, H, D)) for _ in range(L)]
        self.self_table = arr.put(np.arange(nb, dtype=np.int32)[None, :])
        S = enc.shape[0]
        nbe = -(-S // bs)
        self.enc_len = S
        self.cross_table = np.arange(nbe, dtype=np.int32)
        self.cross_k, self.cross_v = [], []
        kv = arr.empty((S, 2 * c.d_model))
        slots = arr.put(np.arange(S, dtype=np.int32))
        for layer in model.dec_layers:
            kc = arr.zeros((nbe, bs, H, D))
            vc = arr.zeros((nbe, bs, H, D))
            layer["cross_kv"](enc, out=kv)
            reshape_and_cache(_heads(kv, 0, H, D), _heads(kv, c.d_model, H, D), kc, vc, slots)
            self.cross_k.append(kc)
            self.cross_v.append(vc)
        self.length = 0


class WhisperModel:
    """A Whisper checkpoint's encoder and decoder on jitkern kernels (the CPU or CUDA)."""

    BLOCK = 16          # block size of the scratch and per-request KV caches

    def __init__(self, ckpt, device: str = "cpu"):
        from engine.models.weights import Linear, linear_from, vector_f32
        self.ckpt = ckpt
        self.cfg = c = WhisperConfig.from_config(ckpt.config)
        d = c.d_model
        self.prefix = "model." if ckpt.get("model.encoder.conv1.weight") is not None else ""
        # the convolutions as matmuls over unfolded frames: W [d, C * 3], (channel, tap) order
        self.conv = []
        for name, cin in (("conv1", c.num_mel_bins), ("conv2", d)):
            w = self._get(f"encoder.{name}.weight")
            if tuple(w.shape) != (d, cin, 3):
                raise ModelLoadError(f"shape disagrees with the config: expected {[d, cin, 3]}, found "
                                     f"{list(w.shape)}", path=w.file, tensor=w.name)
            if w.dtype not in ("f32", "f16", "bf16"):
                raise ModelLoadError(f"unsupported weight dtype {w.dtype}", path=w.file, tensor=w.name)
            self.conv.append(Linear(np.ascontiguousarray(w.raw.reshape(d, cin * 3)), w.dtype, d, cin * 3,
                                    vector_f32(self._get(f"encoder.{name}.bias")), f"whisper.{name}"))
        self.enc_pos = self._table("encoder.embed_positions.weight", (c.max_source_positions, d), f32=True)
        self.enc_layers = [self._enc_layer(i) for i in range(c.encoder_layers)]
        self.enc_ln = self._ln("encoder.layer_norm")
        self.embed = self._table("decoder.embed_tokens.weight", (c.vocab_size, d))
        self.dec_pos = self._table("decoder.embed_positions.weight", (c.max_target_positions, d), f32=True)
        self.dec_layers = [self._dec_layer(i) for i in range(c.decoder_layers)]
        self.dec_ln = self._ln("decoder.layer_norm")
        head = self.ckpt.get("proj_out.weight")
        self.lm_head = linear_from([head], "whisper.proj_out") if head is not None else \
            linear_from([self._get("decoder.embed_tokens.weight")], "whisper.proj_out")
        if (self.lm_head.n, self.lm_head.k) != (c.vocab_size, d):
            raise ModelLoadError(f"proj_out maps {self.lm_head.k} -> {self.lm_head.n}, expected {d} -> "
                                 f"{c.vocab_size}", path=ckpt.path, tensor="proj_out.weight")
        self.embed_scale = float(np.sqrt(d)) if c.scale_embedding else None
        self._ws: dict = {}
        self.device = device
        from engine.device import GPU_DEVICES, Arrays
        self.arrays = Arrays(device)             # buffers, caches and index arrays of encodes and decodes
        if device in GPU_DEVICES:
            self._to_device()

    def _to_device(self) -> None:
        from engine.device import Uploader
        up = Uploader(self.device)
        for lin in self.conv + [self.lm_head]:
            lin.to_device(up)
        self.enc_pos, self.embed, self.dec_pos = up(self.enc_pos), up(self.embed), up(self.dec_pos)
        self.enc_ln, self.dec_ln = tuple(up(v) for v in self.enc_ln), tuple(up(v) for v in self.dec_ln)
        for L in self.enc_layers + self.dec_layers:
            for k, v in L.items():
                L[k] = tuple(up(x) for x in v) if isinstance(v, tuple) else v
                if not isinstance(v, tuple):
                    v.to_device(up)

    # ------------------------------------------------------------------------------------ loading
    def _get(self, name, required=True):
        t = self.ckpt.get(self.prefix + name)
        if t is None and required:
            raise ModelLoadError("the Whisper model needs this tensor, which the checkpoint lacks",
                                 path=self.ckpt.path, tensor=self.prefix + name)
        return t

    def _table(self, name, shape, f32=False):
        from engine.models.weights import vector_f32
        t = self._get(name)
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"shape disagrees with the config: expected {list(shape)}, found {list(t.shape)}",
                                 path=t.file, tensor=t.name)
        if f32:
            return np.ascontiguousarray(vector_f32(t), np.float32)
        if t.dtype not in ("f32", "f16", "bf16"):
            raise ModelLoadError(f"unsupported weight dtype {t.dtype}", path=t.file, tensor=t.name)
        return np.ascontiguousarray(t.raw.reshape(shape))

    def _ln(self, pre):
        from engine.models.weights import vector_f32
        return vector_f32(self._get(pre + ".weight")), vector_f32(self._get(pre + ".bias"))

    def _attn(self, pre, parts, name):
        """One Linear over the named projections of an attention block, biases side by side (k_proj has none:
        zeros in its columns)."""
        from engine.models.weights import linear_from, vector_f32
        ws = [self._get(f"{pre}.{p}_proj.weight") for p in parts]
        lin = linear_from(ws, name)
        d = self.cfg.d_model
        bias = []
        for p in parts:
            b = self._get(f"{pre}.{p}_proj.bias", required=False)
            bias.append(vector_f32(b) if b is not None else np.zeros(d, np.float32))
        lin.bias = np.ascontiguousarray(np.concatenate(bias), np.float32)
        if lin.k != d or lin.n != d * len(parts):
            raise ModelLoadError(f"attention projections disagree with d_model {d}", path=self.ckpt.path,
                                 tensor=ws[0].name)
        return lin

    def _mlp(self, pre, name):
        from engine.models.weights import linear_from
        g = lambda n: self._get(f"{pre}.{n}")  # noqa: E731
        fc1 = linear_from([g("fc1.weight")], f"{name}.fc1", biases=[g("fc1.bias")])
        fc2 = linear_from([g("fc2.weight")], f"{name}.fc2", biases=[g("fc2.bias")])
        if fc1.k != self.cfg.d_model or fc2.n != self.cfg.d_model or fc1.n != fc2.k:
            raise ModelLoadError(f"MLP shapes disagree with d_model {self.cfg.d_model}", path=self.ckpt.path,
                                 tensor=f"{self.prefix}{pre}.fc1.weight")
        return fc1, fc2

    def _enc_layer(self, i):
        pre = f"encoder.layers.{i}"
        fc1, fc2 = self._mlp(pre, f"whisper.enc.{i}")
        return dict(qkv=self._attn(pre + ".self_attn", "qkv", f"whisper.enc.{i}.qkv"),
                    o=self._attn(pre + ".self_attn", ("out",), f"whisper.enc.{i}.o"),
                    ln1=self._ln(pre + ".self_attn_layer_norm"), ln2=self._ln(pre + ".final_layer_norm"),
                    fc1=fc1, fc2=fc2)

    def _dec_layer(self, i):
        pre = f"decoder.layers.{i}"
        fc1, fc2 = self._mlp(pre, f"whisper.dec.{i}")
        return dict(qkv=self._attn(pre + ".self_attn", "qkv", f"whisper.dec.{i}.qkv"),
                    o=self._attn(pre + ".self_attn", ("out",), f"whisper.dec.{i}.o"),
                    cross_q=self._attn(pre + ".encoder_attn", "q", f"whisper.dec.{i}.cross_q"),
                    cross_kv=self._attn(pre + ".encoder_attn", "kv", f"whisper.dec.{i}.cross_kv"),
                    cross_o=self._attn(pre + ".encoder_attn", ("out",), f"whisper.dec.{i}.cross_o"),
                    ln1=self._ln(pre + ".self_attn_layer_norm"), ln2=self._ln(pre + ".encoder_attn_layer_norm"),
                    ln3=self._ln(pre + ".final_layer_norm"), fc1=fc1, fc2=fc2)

    # ------------------------------------------------------------------------------------ encoder
    def encode(self, features: np.ndarray):
        """Encoder output [max_source_positions, d_model] of one window's log-mel features [num_mel_bins,
        2 * max_source_positions], on the model's device."""
        from engine.ops.activation import add
        from engine.ops.attention import paged_attention, reshape_and_cache
        from engine.ops.audio import unfold1d
        from engine.ops.embedding import embedding
        from engine.ops.norm import layer_norm
        c = self.cfg
        feats = np.ascontiguousarray(features, np.float32)
        if feats.shape != (c.num_mel_bins, c.num_frames):
            raise ValueError(f"input features must be [{c.num_mel_bins}, {c.num_frames}], got {list(feats.shape)}")
        act = _act(c.activation)
        arr = self.arrays
        d, H = c.d_model, c.encoder_heads
        D = d // H
        h = self.conv[0](unfold1d(arr.put(feats), 3, stride=1, pad=1, channels_first=True))
        act(h, out=h)
        x = self.conv[1](unfold1d(h, 3, stride=2, pad=1, channels_first=False))
        act(x, out=x)
        S = x.shape[0]
        t = arr.empty((S, d))
        frames = arr.put(np.arange(S, dtype=np.int32))       # positions, and the cache slots below
        embedding(frames, self.enc_pos, out=t)
        add(x, t, out=x)
        # every frame one query over all of the window's frames (scratch blocks 0..nb)
        bs = self.BLOCK
        nb = -(-S // bs)
        kc = arr.zeros((nb, bs, H, D))
        vc = arr.zeros((nb, bs, H, D))
        qs_h, lens_h = np.arange(S + 1, dtype=np.int32), np.full(S, S, np.int32)
        host_step = (qs_h, lens_h) if arr.device is not None else None     # a GPU launch's shape reads them
        qs, lens = arr.put(qs_h), arr.put(lens_h)
        table = arr.put(np.broadcast_to(np.arange(nb, dtype=np.int32), (S, nb)))
        scale = float(D) ** -0.5
        qkv = arr.empty((S, 3 * d))
        attn = arr.empty((S, d))
        mid = None
        for L in self.enc_layers:
            layer_norm(x, *L["ln1"], 1e-5, out=t)
            L["qkv"](t, out=qkv)
            reshape_and_cache(_heads(qkv, d, H, D), _heads(qkv, 2 * d, H, D), kc, vc, frames)
            paged_attention(_heads(qkv, 0, H, D), kc, vc, qs, lens, table, scale=scale, out=attn.reshape(S, H, D),
                            workspace=self._ws.setdefault("enc", {}), max_query_len=1, host_step=host_step)
            L["o"](attn, out=t)
            add(x, t, out=x)
            layer_norm(x, *L["ln2"], 1e-5, out=t)
            if mid is None:
                mid = arr.empty((S, L["fc1"].n))
            L["fc1"](t, out=mid)
            act(mid, out=mid)
            L["fc2"](mid, out=t)
            add(x, t, out=x)
        return layer_norm(x, *self.enc_ln, 1e-5, out=x)

    # ------------------------------------------------------------------------------------ decoder
    def start(self, enc: np.ndarray) -> DecoderState:
        """A request's decoder state over encoder output `enc` (its cross-attention K/V computed now)."""
        return DecoderState(self, enc)

    def decode(self, state: DecoderState, ids, all_logits: bool = False) -> np.ndarray:
        """Runs the decoder over the next tokens `ids` of the request (appended to its cache); returns the
        logits f32 [V] of the last one, or [len(ids), V] of every one with all_logits."""
        from engine.ops.activation import add
        from engine.ops.attention import paged_attention, reshape_and_cache
        from engine.ops.embedding import embedding
        from engine.ops.norm import layer_norm
        c = self.cfg
        ids = np.ascontiguousarray(ids, np.int32)
        n = ids.shape[0]
        p0 = state.length
        if n == 0:
            raise ValueError("decode needs at least one token")
        if p0 + n > c.max_target_positions:
            raise ValueError(f"the decoder holds at most {c.max_target_positions} tokens; {p0} + {n} asked")
        arr = self.arrays
        d, H = c.d_model, c.decoder_heads
        D = d // H
        # the step's index arrays (on a GPU, their host copies give the attention launches' shapes)
        host = {"ids": ids, "pos": np.arange(p0, p0 + n, dtype=np.int32), "qs_self": np.array([0, n], np.int32),
                "lens_self": np.array([p0 + n], np.int32), "qs_cross": np.arange(n + 1, dtype=np.int32),
                "lens_cross": np.full(n, state.enc_len, np.int32),
                "table_cross": np.broadcast_to(state.cross_table, (n, state.cross_table.shape[0]))}
        a = {k: arr.put(v) for k, v in host.items()}
        on_gpu = arr.device is not None
        x = embedding(a["ids"], self.embed, scale=self.embed_scale)
        t = embedding(a["pos"], self.dec_pos)
        add(x, t, out=x)
        scale = float(D) ** -0.5
        qkv = arr.empty((n, 3 * d))
        attn = arr.empty((n, d))
        q = arr.empty((n, d))
        act = _act(c.activation)
        mid = None
        for li, L in enumerate(self.dec_layers):
            layer_norm(x, *L["ln1"], 1e-5, out=t)
            L["qkv"](t, out=qkv)
            reshape_and_cache(_heads(qkv, d, H, D), _heads(qkv, 2 * d, H, D), state.self_k[li], state.self_v[li],
                              a["pos"])
            paged_attention(_heads(qkv, 0, H, D), state.self_k[li], state.self_v[li], a["qs_self"], a["lens_self"],
                            state.self_table, scale=scale, out=attn.reshape(n, H, D),
                            workspace=self._ws.setdefault("self", {}), max_query_len=n,
                            host_step=(host["qs_self"], host["lens_self"]) if on_gpu else None)
            L["o"](attn, out=t)
            add(x, t, out=x)
            layer_norm(x, *L["ln2"], 1e-5, out=t)
            L["cross_q"](t, out=q)
            paged_attention(q.reshape(n, H, D), state.cross_k[li], state.cross_v[li], a["qs_cross"],
                            a["lens_cross"], a["table_cross"], scale=scale, out=attn.reshape(n, H, D),
                            workspace=self._ws.setdefault("cross", {}), max_query_len=1,
                            host_step=(host["qs_cross"], host["lens_cross"]) if on_gpu else None)
            L["cross_o"](attn, out=t)
            add(x, t, out=x)
            layer_norm(x, *L["ln3"], 1e-5, out=t)
            if mid is None:
                mid = arr.empty((n, L["fc1"].n))
            L["fc1"](t, out=mid)
            act(mid, out=mid)
            L["fc2"](mid, out=t)
            add(x, t, out=x)
        state.length = p0 + n
        rows = x if all_logits else x[n - 1:]
        h = layer_norm(rows, *self.dec_ln, 1e-5)
        from engine.ops._hostargs import host_copy
        logits = host_copy(self.lm_head(h))          # (engine.transcription samples on the host)
        return logits if all_logits else logits[0]
