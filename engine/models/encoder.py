"""A BERT-style bidirectional encoder (HF `BertModel`, sentence-transformers' BERT models) for embeddings.

    embeddings = LayerNorm(word[ids] + position[0..n-1] + token_type[0])
    per layer:   a = LayerNorm(x + Wo . Attention(x) + bo)        (post-norm, biased q/k/v/o)
                 x = LayerNorm(a + W2 . gelu(W1 . a + b1) + b2)   (exact erf GELU)
Returns the last hidden states (no pooler: engine.pooling pools them).

Every tensor operation is a jitkern kernel. Non-causal attention reuses the paged decode kernel: each
prompt's K/V go into its KV blocks, then every token of the prompt is one "decode" query over the whole
prompt (query_start = 0..T, seq_len = the prompt's length, the prompt's block-table row for each), so each
token attends to every position of its own prompt, and a token's result does not depend on the batch.
Token type ids are all 0 (single-segment inputs, as vLLM's embedding API sends).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError
from engine.models.weights import linear_from, vector_f32

_PREFIXES = ("", "bert.", "model.")


class BertEncoder:
    supports_graphs = False

    def __init__(self, ckpt, device: str = "cpu"):
        if device != "cpu":
            raise ModelLoadError("BERT-style encoders run on the CPU only so far: use --device cpu", path=ckpt.path,
                                 key="device")
        self.ckpt = ckpt
        self.device = device
        cfg = self.cfg = ckpt.config
        hf = _hf_config(ckpt.path)
        self.eps = float(hf.get("layer_norm_eps", 1e-12))
        act = hf.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"hidden_act {act!r} is not supported for BERT encoders (gelu, gelu_new)",
                                 path=ckpt.path, key="hidden_act")
        self.exact_gelu = act == "gelu"
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError("only absolute position embeddings are supported", path=ckpt.path,
                                 key="position_embedding_type")
        self.H, self.D = cfg.num_heads, cfg.head_dim
        self.KVH = self.H
        self.hidden = cfg.hidden_size
        self.vocab = cfg.vocab_size
        self.scale = 1.0 / np.sqrt(self.D)
        self.word = self._table("embeddings.word_embeddings.weight")
        self.pos = self._table("embeddings.position_embeddings.weight")
        tt = self._get("embeddings.token_type_embeddings.weight", required=False)
        self.type0 = np.ascontiguousarray(self._as_f32(tt)[0]) if tt is not None else None
        self.emb_ln = (self._vec("embeddings.LayerNorm.weight"), self._vec("embeddings.LayerNorm.bias"))
        self.layers = [self._layer(i) for i in range(cfg.num_layers)]
        self.num_kv_layers = cfg.num_layers
        self.k_caches, self.v_caches = [], []
        self._attn_ws = [{} for _ in self.layers]
        self.max_positions = self.pos.shape[0]

    # ------------------------------------------------------------------------------------ loading
    def _get(self, name, required=True):
        for p in _PREFIXES:
            t = self.ckpt.get(p + name)
            if t is not None:
                return t
        if required:
            raise ModelLoadError("the BERT encoder needs this tensor, which the checkpoint lacks",
                                 path=self.ckpt.path, tensor=name)
        return None

    def _as_f32(self, t):
        a = np.asarray(t.raw).reshape(t.shape)
        return a.astype(np.float32) if a.dtype != np.float32 else a

    def _table(self, name):
        return np.ascontiguousarray(self._as_f32(self._get(name)))

    def _vec(self, name):
        return vector_f32(self._get(name))

    def _layer(self, i):
        g = lambda n: self._get(f"encoder.layer.{i}.{n}")  # noqa: E731
        qkv = linear_from([g("attention.self.query.weight"), g("attention.self.key.weight"),
                           g("attention.self.value.weight")], f"enc.{i}.qkv",
                          biases=[g("attention.self.query.bias"), g("attention.self.key.bias"),
                                  g("attention.self.value.bias")])
        o = linear_from([g("attention.output.dense.weight")], f"enc.{i}.o", biases=[g("attention.output.dense.bias")])
        up = linear_from([g("intermediate.dense.weight")], f"enc.{i}.up", biases=[g("intermediate.dense.bias")])
        down = linear_from([g("output.dense.weight")], f"enc.{i}.down", biases=[g("output.dense.bias")])
        v = lambda n: vector_f32(g(n))  # noqa: E731
        return dict(qkv=qkv, o=o, up=up, down=down,
                    ln1=(v("attention.output.LayerNorm.weight"), v("attention.output.LayerNorm.bias")),
                    ln2=(v("output.LayerNorm.weight"), v("output.LayerNorm.bias")))

    # ---------------------------------------------------------------------------------- KV cache
    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.KVH, self.D)
        self.k_caches = [np.zeros(shape, np.float32) for _ in self.layers]
        self.v_caches = [np.zeros(shape, np.float32) for _ in self.layers]

    def free_kv(self) -> None:
        self.k_caches, self.v_caches = [], []

    # ----------------------------------------------------------------------------------- forward
    def forward(self, b) -> np.ndarray:
        """The final hidden states of the rows `b.logits_rows` (every token of each prompt, as engine.pooling
        lays the batch out: prompts from position 0, whole prompts only)."""
        from engine.ops.activation import add, gelu, gelu_tanh
        from engine.ops.attention import paged_attention, reshape_and_cache
        from engine.ops.embedding import embedding
        from engine.ops.norm import layer_norm
        T, S = b.num_tokens, b.num_seqs
        H, D = self.H, self.D
        buf = b.buffers
        ids = b.input_ids[:T]
        pos = b.positions[:T]
        if T and int(pos.max()) >= self.max_positions:
            raise ValueError(f"BERT takes at most {self.max_positions} positions")
        qs = b.query_start[: S + 1]
        if np.any(b.seq_lens[:S] != np.diff(qs)):
            raise ValueError("the BERT encoder runs whole prompts only (no chunked prefill, no cached prefix)")
        # the attention layout: every token is a one-query "sequence" over its own prompt's keys
        a_qs = buf.get("enc_qs", (T + 1,), np.int32)
        a_qs[:] = np.arange(T + 1, dtype=np.int32)
        owner = np.repeat(np.arange(S), np.diff(qs))
        a_sl = buf.get("enc_sl", (T,), np.int32)
        a_sl[:] = b.seq_lens[:S][owner]
        a_bt = buf.get("enc_bt", (T, b.block_table.shape[1]), np.int32)
        a_bt[:] = b.block_table[:S][owner]
        x = buf.get("enc_x", (T, self.hidden))
        t = buf.get("enc_t", (T, self.hidden))
        embedding(ids, self.word, out=x)
        embedding(pos, self.pos, out=t)
        add(x, t, out=x)
        if self.type0 is not None:
            zeros = buf.get("enc_zero_ids", (T,), np.int32)
            zeros[:] = 0
            embedding(zeros, self.type0.reshape(1, -1), out=t)
            add(x, t, out=x)
        layer_norm(x, self.emb_ln[0], self.emb_ln[1], self.eps, out=x)
        qkv = buf.get("enc_qkv", (T, 3 * H * D))
        attn = buf.get("enc_attn", (T, H * D))
        for li, L in enumerate(self.layers):
            L["qkv"](x, out=qkv)
            q = _heads(qkv, 0, H, D)
            k = _heads(qkv, H * D, H, D)
            v = _heads(qkv, 2 * H * D, H, D)
            reshape_and_cache(k, v, self.k_caches[li], self.v_caches[li], b.slot_mapping[:T])
            paged_attention(q, self.k_caches[li], self.v_caches[li], a_qs, a_sl, a_bt, scale=self.scale,
                            out=attn.reshape(T, H, D), workspace=self._attn_ws[li], max_query_len=1)
            L["o"](attn, out=t)
            add(x, t, out=x)
            layer_norm(x, L["ln1"][0], L["ln1"][1], self.eps, out=x)
            mid = buf.get("enc_mid", (T, L["up"].n))
            L["up"](x, out=mid)
            (gelu if self.exact_gelu else gelu_tanh)(mid, out=mid)
            L["down"](mid, out=t)
            add(x, t, out=x)
            layer_norm(x, L["ln2"][0], L["ln2"][1], self.eps, out=x)
        rows = b.logits_rows
        if len(rows) == T and np.array_equal(rows, np.arange(T)):
            return x
        return x[np.asarray(rows)]


def _heads(a, col0, nheads, d):
    return np.lib.stride_tricks.as_strided(a[:, col0:], shape=(a.shape[0], nheads, d),
                                           strides=(a.strides[0], d * a.itemsize, a.itemsize))


def _hf_config(path) -> dict:
    p = Path(path)
    f = (p if p.is_dir() else p.parent) / "config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read config.json: {e}", path=f) from None
    return cfg if isinstance(cfg, dict) else {}
