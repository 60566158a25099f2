"""A compact gpt-fast-style Llama-family decoder in plain torch: the end-to-end peer of the H200 benchmarks.

What makes it "gpt-fast style" (the recipe of pytorch-labs/gpt-fast, written here from scratch):
  * a static KV cache (one [batch, kv_heads, max_len, head_dim] buffer pair per layer, written in place with
    index_copy_), so every decode step has the same shapes;
  * fused projections (q|k|v in one weight, gate|up in one weight) to cut launches;
  * the one-token decode step compiled with torch.compile(mode="reduce-overhead", fullgraph=True): Inductor
    fuses the elementwise work and the step replays as one CUDA graph;
  * greedy sampling inside the compiled step (argmax), prefill run once per prompt batch.

It loads a checkpoint folder written by transformers (config.json + model.safetensors or a sharded index):
Llama / Mistral-without-window / Qwen2 (q/k/v biases) / Qwen3 (per-head q/k RMSNorm) and SmolLM2 (tied
embeddings). Rotary embedding: HF's rotate-half layout on the checkpoint's own q/k rows, "default" and
"llama3" rope types. Batched generation assumes equal-length prompts (no padding: every row shares the
positions), which is what the benchmark feeds it.

    model = load(folder, device="cuda", dtype=torch.bfloat16)
    gen = Generator(model, batch=64, max_len=256, compile=True)
    tokens, timing = gen.generate(prompt_ids, new_tokens=128)      # prompt_ids: LongTensor [batch, T]
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qk_norm: bool

    @classmethod
    def from_json(cls, cfg: dict) -> "Config":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"config.json: model_type {mt!r} is not one of {SUPPORTED}")
        if mt == "mistral" and cfg.get("sliding_window"):
            raise ValueError("config.json: sliding_window is set; this peer has no sliding-window attention")
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta + rope_scaling
        rp = cfg.get("rope_parameters") or {}
        theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
        return cls(model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=mt == "qwen3")


def rope_inv_freq(cfg: Config) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding (float32 [head_dim / 2])."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"config.json: rope type {kind!r} is not supported by this peer (default, llama3)")
    # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(mid, blended, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # as HF: normalise in float32, cast back, then scale in the model dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config, bias: bool):
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.wo = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # buffers (not plain attributes), so torch.compile treats them as static module state mutated in place
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        c = self.cfg
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))          # [B, heads, T, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # static cache: write this step's keys/values at their positions, attend over the whole buffer
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        rep = c.num_heads // c.num_kv_heads
        kc = self.k_cache.repeat_interleave(rep, dim=1) if rep > 1 else self.k_cache
        vc = self.v_cache.repeat_interleave(rep, dim=1) if rep > 1 else self.v_cache
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=c.head_dim ** -0.5)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)     # gate | up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        g, u = self.w13(x).split([self.inter, self.inter], dim=-1)
        return self.w2(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, cfg: Config, bias: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, bias)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attn(self.attn_norm(x), cos, sin, mask, input_pos)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config, bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, bias) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for name in ("cos_table", "sin_table", "causal"):
            self.register_buffer(name, None, persistent=False)
        self.max_len = 0
        self.batch = 0

    def setup_caches(self, batch: int, max_len: int) -> None:
        """(Re)allocates the static KV caches and the rotary / causal-mask tables for batch x max_len."""
        c = self.cfg
        p = self.embed.weight
        for layer in self.layers:
            shape = (batch, c.num_kv_heads, max_len, c.head_dim)
            layer.attn.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
            layer.attn.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1).to(p.device)
        self.cos_table, self.sin_table = emb.cos().to(p.dtype), emb.sin().to(p.dtype)
        self.causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=p.device))
        self.max_len, self.batch = max_len, batch

    def forward(self, tokens, input_pos):
        """tokens [B, T] at positions input_pos [T] (shared by the rows) -> logits of the last position [B, V]."""
        x = self.embed(tokens)
        cos = self.cos_table[input_pos][None, None]            # [1, 1, T, D]
        sin = self.sin_table[input_pos][None, None]
        mask = self.causal[input_pos][None, None]              # [1, 1, T, max_len]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.lm_head(self.norm(x[:, -1]))


# ------------------------------------------------------------------------------------------------ loading
def read_state_dict(folder: str) -> dict:
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    sd = {}
    for name in files:
        sd.update(load_file(os.path.join(folder, name)))
    return sd


def load(folder: str, device="cpu", dtype: torch.dtype | None = None) -> Transformer:
    """Builds the peer from a transformers checkpoint folder; dtype None keeps the checkpoint's."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = Config.from_json(json.load(f))
    sd = read_state_dict(folder)
    dtype = dtype or sd["model.embed_tokens.weight"].dtype
    bias = "model.layers.0.self_attn.q_proj.bias" in sd
    with torch.device("meta"):
        model = Transformer(cfg, bias)

    def take(name):
        if name not in sd:
            raise KeyError(f"{folder}: checkpoint has no tensor {name}")
        return sd.pop(name).to(device=device, dtype=dtype)

    own = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    own["lm_head.weight"] = take("lm_head.weight") if "lm_head.weight" in sd or not cfg.tie_word_embeddings \
        else own["embed.weight"]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        own[q + "attn.wqkv.weight"] = torch.cat([take(a + n + "_proj.weight") for n in "qkv"])
        if bias:
            own[q + "attn.wqkv.bias"] = torch.cat([take(a + n + "_proj.bias") for n in "qkv"])
        own[q + "attn.wo.weight"] = take(a + "o_proj.weight")
        if cfg.qk_norm:
            own[q + "attn.q_norm.weight"] = take(a + "q_norm.weight")
            own[q + "attn.k_norm.weight"] = take(a + "k_norm.weight")
        own[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        own[q + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        own[q + "mlp.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        own[q + "mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
    model.load_state_dict(own, assign=True, strict=True)
    return model.eval()


# --------------------------------------------------------------------------------------------- generation
class Generator:
    """Greedy generation with a static cache for `batch` equal-length prompts of up to max_len tokens total.

    compile=True (CUDA): the decode step is torch.compile'd with mode="reduce-overhead" (CUDA graphs);
    compile_prefill=True also compiles the prefill (dynamic shapes, no graphs)."""

    def __init__(self, model: Transformer, batch: int, max_len: int, compile: bool = False,
                 compile_prefill: bool = False):
        self.model = model
        model.setup_caches(batch, max_len)
        self.batch, self.max_len = batch, max_len
        self.device = model.embed.weight.device
        self._prefill = self._prefill_eager
        self._decode = self._decode_eager
        if compile:
            self._decode = torch.compile(self._decode_eager, mode="reduce-overhead", fullgraph=True, dynamic=False)
            if compile_prefill:
                self._prefill = torch.compile(self._prefill_eager, fullgraph=True, dynamic=True)

    def _prefill_eager(self, tokens, input_pos):
        return torch.argmax(self.model(tokens, input_pos), dim=-1)

    def _decode_eager(self, tokens, input_pos):
        return torch.argmax(self.model(tokens, input_pos), dim=-1)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int):
        """prompt: int64 [batch, T] -> (tokens int64 [batch, new_tokens] on the CPU, timing dict with ttft_s
        (prefill + first token) and total_s, wall clock with the device synchronised)."""
        B, T = prompt.shape
        if B != self.batch:
            raise ValueError(f"prompt has {B} rows but the generator was built for batch {self.batch}")
        if T + new_tokens > self.max_len:
            raise ValueError(f"{T} prompt + {new_tokens} new tokens exceed max_len {self.max_len}")
        prompt = prompt.to(self.device)
        out = torch.empty(B, new_tokens, dtype=torch.int64, device=self.device)
        self._sync()
        t0 = time.perf_counter()
        tok = self._prefill(prompt, torch.arange(T, device=self.device))
        out[:, 0] = tok
        self._sync()
        t1 = time.perf_counter()
        for i in range(1, new_tokens):
            pos = torch.tensor([T + i - 1], device=self.device)
            if self._decode is not self._decode_eager:
                torch.compiler.cudagraph_mark_step_begin()
            # the graph's output buffer is reused by the next replay: copy the token out at once
            tok = self._decode(tok.view(B, 1), pos).clone()
            out[:, i] = tok
        self._sync()
        t2 = time.perf_counter()
        return out.cpu(), {"ttft_s": t1 - t0, "total_s": t2 - t0}
