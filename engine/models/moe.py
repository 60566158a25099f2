"""Mixture-of-experts MLP blocks for the decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; gpt-oss can reuse it).

Entry points: `moe_spec(ckpt)` reads the routing hyper-parameters (HF config.json keys or llama.cpp GGUF
metadata), `load_moe_block(ckpt, layer, spec)` builds a layer's `MoEBlock` (None for a dense layer: a layer
is sparse when its router tensor is present, which covers Qwen2-MoE's decoder_sparse_step / mlp_only_layers),
and `MoEBlock(x, out, buffers)` runs it. The kernels are engine.ops.moe (routing, grouped expert matmuls,
combine); see there for the batch-invariance argument.

Tensor names:
- HF per-expert: Mixtral `model.layers.N.block_sparse_moe.{gate, experts.E.w1 (gate), w3 (up), w2 (down)}`;
  Qwen2/3-MoE, OLMoE `model.layers.N.mlp.{gate, experts.E.{gate,up,down}_proj}`; HF fused (transformers v5
  layout) `mlp.experts.gate_up_proj` [E, 2I, H] + `mlp.experts.down_proj` [E, H, I]; Qwen2-MoE's shared expert
  `mlp.shared_expert.{gate,up,down}_proj` + `mlp.shared_expert_gate` [1, H].
- GGUF (llama.cpp): `blk.N.ffn_gate_inp` [E, H], `ffn_gate_exps` / `ffn_up_exps` [E, I, H], `ffn_down_exps`
  [E, H, I], `ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp` [H].

Weights: f32 / f16 / bf16 experts run in the grouped DSL kernels (GGUF's are used in place; HF per-expert
tensors are stacked once at load, counted by JITKERN_LOAD_STATS). GGUF-quantised experts run the quantised
matmul kernels (engine.ops.quant) once per expert that has tokens, on that expert's contiguous segment of
grouped rows. The router (and Qwen2-MoE's shared-expert gate, fused in as one extra output) is kept in f32.

gpt-oss: HF float experts (interleaved gate/up, biases) run in the grouped kernels; its MXFP4 experts (HF
`*_blocks` / `*_scales`, repacked once to GGUF block_mxfp4 by `mxfp4_blocks_to_gguf`) and llama.cpp's
quantised `ffn_*_exps` run the quantised path, the biases and clamped SwiGLU added by `expert_bias_act`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError
from engine.loader import QUANT_TYPES, note_host_copy
from engine.models.arch import arch_of
from engine.models.weights import Linear, linear_from, vector_f32


@dataclass
class MoESpec:
    num_experts: int
    top_k: int
    norm_topk: bool          # divide the top-k weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    mode: int = 0            # engine.ops.moe.SOFTMAX_TOPK (these models) or TOPK_SOFTMAX (gpt-oss)


def moe_spec(ckpt) -> MoESpec | None:
    """The checkpoint's routing parameters, or None for a dense model."""
    cfg = ckpt.config
    rec = arch_of(cfg.architecture).moe      # the architecture's routing (engine/models/arch.py MoE)
    if ckpt.format == "gguf":
        fields = ckpt.gguf_reader.fields if ckpt.gguf_reader is not None else {}
        from engine.config import gguf_field_value
        arch = cfg.gguf_architecture or cfg.architecture        # the metadata keys' prefix

        def get(key, default=None):
            f = fields.get(f"{arch}.{key}")
            return default if f is None else gguf_field_value(f)
        E = int(get("expert_count", 0) or 0)
        if E == 0:
            return None
        K = get("expert_used_count")
        if K is None:
            raise ModelLoadError("a mixture-of-experts GGUF needs the number of experts per token",
                                 path=ckpt.path, key=f"{arch}.expert_used_count")
        gating = get("expert_gating_func", 1)
        if int(gating) != 1:
            raise ModelLoadError(f"expert gating function {gating} is not supported (only softmax, 1)",
                                 path=ckpt.path, key=f"{arch}.expert_gating_func")
        # llama.cpp's build_moe_ffn weight normalisation (norm_w) when the file has no expert_weights_norm key
        norm = get("expert_weights_norm", rec.gguf_norm_topk)
        spec = _checked(ckpt, E, int(K), bool(norm), f"{arch}.expert_used_count")
        if rec.routing == "topk_softmax":       # llama.cpp hard-codes gpt-oss's softmax over the top-k logits
            from engine.ops.moe import TOPK_SOFTMAX
            spec.mode = TOPK_SOFTMAX
        return spec
    extra = cfg.extra or {}
    E = extra.get("num_local_experts") or extra.get("num_experts") or 0
    if not E:
        return None
    K = extra.get("num_experts_per_tok")
    if K is None:
        raise ModelLoadError("a mixture-of-experts config needs num_experts_per_tok", path=cfg.source,
                             key="num_experts_per_tok")
    norm = rec.norm_topk if rec.norm_topk is not None else bool(extra.get("norm_topk_prob", False))
    spec = _checked(ckpt, int(E), int(K), norm, "num_experts_per_tok")
    if rec.routing == "topk_softmax":   # softmax over the top-k router logits; the kernels' clamped SwiGLU constants
        from engine.ops.moe import TOPK_SOFTMAX
        for key, want in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            if float(extra.get(key, want)) != want:
                raise ModelLoadError(f"gpt-oss {key} = {extra[key]} is not supported (the kernel uses {want})",
                                     path=cfg.source, key=key)
        spec.mode = TOPK_SOFTMAX
    return spec


def _checked(ckpt, E, K, norm, key) -> MoESpec:
    if not 1 <= K <= E:
        raise ModelLoadError(f"experts per token ({K}) must be between 1 and the expert count ({E})",
                             path=ckpt.path, key=key)
    return MoESpec(E, K, norm)


_ROUTER = ["blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.block_sparse_moe.gate.weight",
           "model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.router.weight"]
_SHARED = {"gate": ["blk.{i}.ffn_gate_shexp.weight", "model.layers.{i}.mlp.shared_expert.gate_proj.weight"],
           "up": ["blk.{i}.ffn_up_shexp.weight", "model.layers.{i}.mlp.shared_expert.up_proj.weight"],
           "down": ["blk.{i}.ffn_down_shexp.weight", "model.layers.{i}.mlp.shared_expert.down_proj.weight"],
           "gate_inp": ["blk.{i}.ffn_gate_inp_shexp.weight", "model.layers.{i}.mlp.shared_expert_gate.weight"]}


def _first(ckpt, names, i):
    for n in names:
        t = ckpt.get(n.format(i=i))
        if t is not None:
            return t
    return None


class MoEBlock:
    """One sparse MLP: router -> top-k -> grouped experts -> weighted combine (+ gated shared expert)."""

    def __init__(self, spec: MoESpec, router: Linear, hidden: int, inter: int, kind: str, gate, up, down,
                 shared_gate_up: Linear | None = None, shared_down: Linear | None = None,
                 shared_gated: bool = False, name: str = ""):
        self.spec = spec
        self.router = router            # [E (+1 shared-expert gate), H] f32
        self.hidden, self.inter = hidden, inter
        self.kind = kind                # "f32" | "f16" | "bf16" | a GGUF quant type
        self.gate, self.up, self.down = gate, up, down    # up None: gate is the fused [E, 2I, H]
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.shared_gated = shared_gated
        self.name = name
        # gpt-oss: expert biases (f32 [E, 2I] / [E, H]), interleaved gate/up rows, clamped SwiGLU
        self.gate_up_bias = self.down_bias = None
        self.act, self.interleaved = "silu", False
        # DeepSeek: routing weights times routed_scaling_factor; V3's sigmoid router (mode SIGMOID_GROUP_TOPK)
        # adds score_bias (e_score_correction_bias) for the choice and limits it to groups = (n_group, topk_group)
        self.routed_scale = 1.0
        self.score_bias, self.groups = None, (1, 1)
        self.score_softmax = False      # DeepSeek-V2 group_limited_greedy: softmax scores, groups by their best

    @property
    def quantized(self) -> bool:
        return self.kind in QUANT_TYPES

    def to_device(self, upload) -> None:
        """Router, expert and shared-expert weights onto the GPU (`upload`: engine.device.Uploader; the expert
        arrays straight from the memory map)."""
        self.router.to_device(upload)
        self.gate, self.up, self.down = upload(self.gate), upload(self.up), upload(self.down)
        self.gate_up_bias, self.down_bias = upload(self.gate_up_bias), upload(self.down_bias)      # gpt-oss
        for lin in (self.shared_gate_up, self.shared_down):
            if lin is not None:
                lin.to_device(upload)

    def __call__(self, x: np.ndarray, out: np.ndarray, buffers) -> np.ndarray:
        from engine.ops.activation import silu_and_mul
        from engine.ops.moe import route_topk, routed_experts
        T = x.shape[0]
        E, K = self.spec.num_experts, self.spec.top_k
        get = buffers.get
        logits = get("moe.logits", (T, self.router.n))
        self.router(x, out=logits)
        shared = None
        if self.shared_gate_up is not None:
            gu = get("moe.sh_gu", (T, self.shared_gate_up.n))
            self.shared_gate_up(x, out=gu)
            sact = get("moe.sh_act", (T, self.shared_gate_up.n // 2))
            silu_and_mul(gu, out=sact)
            shared = get("moe.sh", (T, self.hidden))
            self.shared_down(sact, out=shared)
        if self.score_bias is not None:
            from engine.ops.moe import route_sigmoid_group
            ids, wts = route_sigmoid_group(logits, self.score_bias, E, K, n_group=self.groups[0],
                                           topk_group=self.groups[1], norm=self.spec.norm_topk,
                                           scale=self.routed_scale, ids=get("moe.ids", (T, K), np.int32),
                                           weights=get("moe.w", (T, K), np.float32), softmax=self.score_softmax)
        else:
            ids, wts = route_topk(logits, E, K, norm=self.spec.norm_topk, mode=self.spec.mode,
                                  ids=get("moe.ids", (T, K), np.int32), weights=get("moe.w", (T, K), np.float32))
            if self.routed_scale != 1.0:
                from engine.ops.activation import scale_inplace
                scale_inplace(wts, self.routed_scale)
        if self.quantized:
            gate_up_fn, down_fn = self._q_gate_up, self._q_down
        else:
            from engine.ops.moe import expert_down, expert_gate_up
            gate_up_fn = lambda xs, tiles, bm, o: expert_gate_up(xs, self.gate, tiles, bm, o, w_up=self.up,  # noqa
                                                                 bias=self.gate_up_bias, act=self.act,
                                                                 interleaved=self.interleaved)
            down_fn = lambda a, tiles, bm, o: expert_down(a, self.down, tiles, bm, o, bias=self.down_bias)  # noqa
        return routed_experts(x, ids, wts, gate_up_fn, down_fn, E, self.inter, out=out, shared=shared,
                              shared_gate=logits[:, E:] if self.shared_gated else None, scratch=get,
                              host_tiles=self.quantized)

    # GGUF-quantised experts: the quantised matmul kernels per expert with tokens, on its segment of pairs
    # (segments are contiguous in the grouped order; the per-row arithmetic of matmul_q does not depend on
    # the row count, so this stays batch invariant)
    @staticmethod
    def _segments(tiles):
        te, ts, tl = tiles
        if len(te) == 0:
            return []
        change = np.flatnonzero(np.diff(te)) + 1
        firsts = np.concatenate(([0], change))
        lasts = np.concatenate((change - 1, [len(te) - 1]))
        return list(zip(te[firsts].tolist(), ts[firsts].tolist(), (ts[lasts] + tl[lasts]).tolist()))

    def _q_gate_up(self, xs, tiles, bm, out):
        from engine.ops.activation import silu_and_mul
        from engine.ops.quant import matmul_q
        I, H = self.inter, self.hidden
        from engine.ops.activation import copy
        P = xs.shape[0]
        g, u = np.empty((P, I), np.float32), np.empty((P, I), np.float32)     # matmul_q wants contiguous rows
        for e, s, t in self._segments(tiles):
            matmul_q(xs[s:t], self.gate[e], self.kind, I, H, out=g[s:t])
            matmul_q(xs[s:t], self.up[e], self.kind, I, H, out=u[s:t])
        gu = np.empty((P, 2 * I), np.float32)
        copy(g, out=gu[:, :I])
        copy(u, out=gu[:, I:])
        if self.gate_up_bias is not None:       # gpt-oss: + per-expert biases, then its clamped SwiGLU
            from engine.ops.moe import expert_bias_act
            return expert_bias_act(gu, self._pair_experts(tiles, P), self.gate_up_bias, out=out, act=self.act)
        return silu_and_mul(gu, out=out)

    def _pair_experts(self, tiles, P):
        pe = np.empty(P, np.int32)
        for e, s, t in self._segments(tiles):
            pe[s:t] = e
        return pe

    def _q_down(self, act, tiles, bm, out):
        from engine.ops.quant import matmul_q
        for e, s, t in self._segments(tiles):
            matmul_q(act[s:t], self.down[e], self.kind, self.hidden, self.inter, out=out[s:t])
        if self.down_bias is not None:
            from engine.ops.moe import expert_bias_act
            expert_bias_act(out, self._pair_experts(tiles, out.shape[0]), self.down_bias, out=out, gated=False)
        return out


def load_moe_block(ckpt, i: int, spec: MoESpec | None, hidden: int) -> MoEBlock | None:
    """Layer i's MoE block, or None when the layer has no router (a dense layer)."""
    if spec is None:
        return None
    router_t = _first(ckpt, _ROUTER, i)
    if router_t is None:
        return None
    E = spec.num_experts
    path = ckpt.path
    router = vector_f32(router_t).reshape(-1, hidden)
    if router.shape[0] != E:
        raise ModelLoadError(f"router has {router.shape[0]} rows but the config says {E} experts", path=path,
                             tensor=router_t.name)
    gate = up = down = None
    oai = None
    moe = arch_of(ckpt.config.architecture).moe
    if moe.oai_experts and ckpt.format != "gguf":
        gate, up, down, inter, kind, oai = _gpt_oss_experts(ckpt, i, E, hidden)
    elif ckpt.get(f"blk.{i}.ffn_gate_exps.weight") is not None:                       # GGUF: [E, I, H] in place
        ts = [ckpt[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")]
        kinds = {t.dtype for t in ts}
        if len(kinds) != 1:
            raise ModelLoadError(f"expert tensors of different types {sorted(kinds)} in one layer are not "
                                 "supported", path=path, tensor=ts[0].name)
        kind = kinds.pop()
        for t in ts:
            if len(t.shape) != 3 or t.shape[0] != E:
                raise ModelLoadError(f"expected an [experts={E}, rows, cols] tensor, found {list(t.shape)}",
                                     path=path, tensor=t.name)
        inter = ts[0].shape[1]
        if ts[0].shape[2] != hidden or ts[1].shape != ts[0].shape or tuple(ts[2].shape) != (E, hidden, inter):
            raise ModelLoadError(f"expert shapes {[list(t.shape) for t in ts]} disagree with hidden size {hidden}",
                                 path=path, tensor=ts[2].name)
        gate, up, down = (t.raw for t in ts)
        bs = [ckpt.get(f"blk.{i}.ffn_{p}_exps.bias") for p in ("gate", "up", "down")]
        if any(b is not None for b in bs):             # gpt-oss (llama.cpp splits HF's interleaved gate/up)
            gate, up, inter, oai = _gguf_biased_experts(ckpt, i, E, hidden, inter, kind, gate, up, ts, bs)
    elif ckpt.get(f"model.layers.{i}.mlp.experts.gate_up_proj") is not None:           # HF fused 3-D
        gu_t = ckpt[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        d_t = ckpt[f"model.layers.{i}.mlp.experts.down_proj"]
        kind = gu_t.dtype
        inter = gu_t.shape[1] // 2
        if tuple(gu_t.shape) != (E, 2 * inter, hidden) or tuple(d_t.shape) != (E, hidden, inter) \
                or d_t.dtype != kind:
            raise ModelLoadError(f"fused expert tensors {list(gu_t.shape)} / {list(d_t.shape)} are not "
                                 f"[{E}, 2*I, {hidden}] / [{E}, {hidden}, I] of one dtype", path=path,
                                 tensor=gu_t.name)
        gate, down = gu_t.raw, d_t.raw
    else:                                                                                # HF per expert: stack
        prefix, (gn, un, dn) = moe.hf_experts
        gus, ds = [], []
        kind = None
        for e in range(E):
            p = prefix.format(i=i, e=e)
            ts = []
            for n in (gn, un, dn):
                t = ckpt.get(p + n + ".weight")
                if t is None:
                    raise ModelLoadError(f"layer {i} has a router but lacks expert {e}'s weight", path=path,
                                         tensor=p + n + ".weight")
                ts.append(t)
            for t in ts:
                if kind is None:
                    kind = t.dtype
                if t.dtype != kind:
                    raise ModelLoadError(f"expert weights of different types ({t.dtype} vs {kind})", path=path,
                                         tensor=t.name)
            gus.append(np.concatenate([ts[0].raw.reshape(ts[0].shape), ts[1].raw.reshape(ts[1].shape)]))
            ds.append(ts[2].raw.reshape(ts[2].shape))
        if kind not in ("f32", "f16", "bf16"):
            raise ModelLoadError(f"unsupported expert weight dtype {kind}", path=path, tensor=prefix.format(i=i, e=0))
        gate, down = np.stack(gus), np.stack(ds)
        inter = gate.shape[1] // 2
        if gate.shape != (E, 2 * inter, hidden) or down.shape != (E, hidden, inter):
            raise ModelLoadError(f"expert shapes {gate.shape} / {down.shape} disagree with hidden size {hidden}",
                                 path=path, tensor=prefix.format(i=i, e=0) + dn + ".weight")
        note_host_copy(gate.nbytes + down.nbytes)
    if kind not in ("f32", "f16", "bf16") and kind not in QUANT_TYPES:
        raise ModelLoadError(f"unsupported expert weight dtype {kind}", path=path, tensor=f"layer {i} experts")
    if kind in QUANT_TYPES and up is None:
        raise ModelLoadError("quantised experts are only read from GGUF's ffn_*_exps tensors", path=path,
                             tensor=f"layer {i} experts")

    shared_gate_up = shared_down = None
    sg = _first(ckpt, _SHARED["gate"], i)
    shared_gated = False
    if sg is not None:
        su, sd = _first(ckpt, _SHARED["up"], i), _first(ckpt, _SHARED["down"], i)
        if su is None or sd is None:
            raise ModelLoadError(f"layer {i} has a shared-expert gate projection but not its up/down", path=path,
                                 tensor=sg.name)
        shared_gate_up = linear_from([sg, su], f"blk.{i}.shared_gate_up")
        shared_down = linear_from([sd], f"blk.{i}.shared_down")
        gi = _first(ckpt, _SHARED["gate_inp"], i)
        if gi is not None:
            row = vector_f32(gi).reshape(-1)
            if row.shape[0] != hidden:
                raise ModelLoadError(f"shared-expert gate has {row.shape[0]} values, expected {hidden}", path=path,
                                     tensor=gi.name)
            router = np.concatenate([router, row[None, :]])
            shared_gated = True
    router = np.ascontiguousarray(router, np.float32)
    rb = ckpt.get(f"model.layers.{i}.mlp.router.bias") or ckpt.get(f"blk.{i}.ffn_gate_inp.bias")   # gpt-oss
    router_lin = Linear(router, "f32", router.shape[0], hidden, vector_f32(rb) if rb is not None else None,
                        f"blk.{i}.router")
    block = MoEBlock(spec, router_lin, hidden, inter, kind, gate, up, down, shared_gate_up, shared_down,
                     shared_gated, name=f"blk.{i}.moe")
    if oai is not None:
        block.gate_up_bias, block.down_bias, block.interleaved = oai
        block.act = "swiglu_oai"
    return block


def mxfp4_blocks_to_gguf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF/OpenAI MXFP4 (`*_blocks` u8 [..., G, 16], `*_scales` u8 [..., G]) -> GGUF block_mxfp4 rows
    u8 [..., G * 17]. Both formats are 32-element blocks of e2m1 codes (bit 3 the sign) with one e8m0 byte
    and the same values: HF's w = FP4[q] * 2^(e - 127), ggml's kvalues (doubled e2m1) * 2^(e - 128). Only
    the nibble order differs: HF byte j holds elements 2j (low nibble) and 2j + 1 (high), ggml's byte j
    elements j and j + 16 (q4_0's order). One repacking copy at load; the blocks stay compressed."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)} are not [..., G, 16] / "
                         "[..., G]")
    codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)   # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate((scales[..., None], packed), axis=-1)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17), np.uint8)


def _gpt_oss_experts(ckpt, i, E, hidden):
    """HF gpt-oss experts: gate_up_proj [E, H, 2I] (gate/up columns interleaved) and down_proj [E, I, H] as
    x @ W, with biases; returned as the kernels' [E, 2I, H] / [E, H, I] rows (one transposing copy).
    MXFP4 checkpoints (`gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32], rows already the
    output features; down likewise [E, H, I/32, 16]): repacked to GGUF's block_mxfp4 (mxfp4_blocks_to_gguf)
    with the interleaved gate/up rows split into gate [E, I] and up [E, I] row sets, as llama.cpp's converter
    does, and run on the quantised-expert path. Returns (gate, up, down, inter, kind, (gate_up bias, down bias,
    interleaved))."""
    p = f"model.layers.{i}.mlp.experts."
    gb_t, db_t = ckpt.get(p + "gate_up_proj_bias"), ckpt.get(p + "down_proj_bias")
    if ckpt.get(p + "gate_up_proj_blocks") is not None:
        ts = {n: ckpt.get(p + n) for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                           "down_proj_scales", "gate_up_proj_bias", "down_proj_bias")}
        for n, t in ts.items():
            if t is None:
                raise ModelLoadError(f"layer {i} has MXFP4 experts but lacks {n}", path=ckpt.path, tensor=p + n)
            if n.endswith(("_blocks", "_scales")) and t.dtype != "u8":
                raise ModelLoadError(f"MXFP4 {n} must be uint8, found {t.dtype}", path=ckpt.path, tensor=p + n)
        gub, gus = ts["gate_up_proj_blocks"], ts["gate_up_proj_scales"]
        db, ds = ts["down_proj_blocks"], ts["down_proj_scales"]
        inter = gub.shape[1] // 2 if len(gub.shape) == 4 else 0
        if tuple(gub.shape) != (E, 2 * inter, hidden // 32, 16) or tuple(gus.shape) != (E, 2 * inter, hidden // 32) \
                or hidden % 32 or inter % 32 or tuple(db.shape) != (E, hidden, inter // 32, 16) \
                or tuple(ds.shape) != (E, hidden, inter // 32):
            raise ModelLoadError(f"MXFP4 expert tensors {list(gub.shape)} / {list(gus.shape)} / {list(db.shape)} / "
                                 f"{list(ds.shape)} are not [{E}, 2I, {hidden}/32, 16] / [{E}, 2I, {hidden}/32] / "
                                 f"[{E}, {hidden}, I/32, 16] / [{E}, {hidden}, I/32] with I a multiple of 32",
                                 path=ckpt.path, tensor=gub.name)
        gu = mxfp4_blocks_to_gguf(gub.raw.reshape(gub.shape), gus.raw.reshape(gus.shape))
        gate, up = np.ascontiguousarray(gu[:, 0::2]), np.ascontiguousarray(gu[:, 1::2])
        down = mxfp4_blocks_to_gguf(db.raw.reshape(db.shape), ds.raw.reshape(ds.shape))
        note_host_copy(gate.nbytes + up.nbytes + down.nbytes)
        gbi = vector_f32(gb_t).reshape(E, 2 * inter)
        gb = np.ascontiguousarray(np.concatenate((gbi[:, 0::2], gbi[:, 1::2]), axis=1))    # gate then up
        dbias = np.ascontiguousarray(vector_f32(db_t).reshape(E, hidden))
        return gate, up, down, inter, "mxfp4", (gb, dbias, False)
    gu_t, d_t = ckpt.get(p + "gate_up_proj"), ckpt.get(p + "down_proj")
    for name, t in (("gate_up_proj", gu_t), ("down_proj", d_t), ("gate_up_proj_bias", gb_t),
                    ("down_proj_bias", db_t)):
        if t is None:
            raise ModelLoadError(f"layer {i} has a router but lacks its experts' {name}", path=ckpt.path,
                                 tensor=p + name)
    kind = gu_t.dtype
    if kind not in ("f32", "f16", "bf16") or d_t.dtype != kind:
        raise ModelLoadError(f"expert weights must be one of f32/f16/bf16, found {gu_t.dtype} / {d_t.dtype}",
                             path=ckpt.path, tensor=gu_t.name)
    inter = gu_t.shape[2] // 2
    if tuple(gu_t.shape) != (E, hidden, 2 * inter) or tuple(d_t.shape) != (E, inter, hidden):
        raise ModelLoadError(f"gpt-oss expert tensors {list(gu_t.shape)} / {list(d_t.shape)} are not "
                             f"[{E}, {hidden}, 2*I] / [{E}, I, {hidden}]", path=ckpt.path, tensor=gu_t.name)
    gate = np.ascontiguousarray(np.swapaxes(gu_t.raw.reshape(gu_t.shape), 1, 2))
    down = np.ascontiguousarray(np.swapaxes(d_t.raw.reshape(d_t.shape), 1, 2))
    note_host_copy(gate.nbytes + down.nbytes)
    gb = np.ascontiguousarray(vector_f32(gb_t).reshape(E, 2 * inter))
    db = np.ascontiguousarray(vector_f32(db_t).reshape(E, hidden))
    return gate, None, down, inter, kind, (gb, db, True)


def _gguf_biased_experts(ckpt, i, E, hidden, inter, kind, gate, up, ts, bs):
    """llama.cpp's gpt-oss experts: ffn_{gate,up,down}_exps [E, I, H] / [E, H, I] with .bias [E, I] / [E, H]
    (the converter splits HF's interleaved gate/up rows into the two tensors). Float experts: gate and up
    joined once into the kernels' fused [E, 2I, H] (gate rows first); quantised ones stay separate blocks
    in place. Returns (gate, up, inter, (bias [E, 2I] gate then up, down bias [E, H], interleaved=False))."""
    for b, t, n in zip(bs, ts, (inter, inter, hidden)):
        if b is None or tuple(b.shape) != (E, n):
            raise ModelLoadError(f"biased experts need all three of ffn_gate/up/down_exps.bias as [{E}, {n}], found "
                                 f"{None if b is None else list(b.shape)}", path=ckpt.path,
                                 tensor=t.name.replace(".weight", ".bias"))
    gb = np.ascontiguousarray(np.concatenate((vector_f32(bs[0]).reshape(E, inter),
                                              vector_f32(bs[1]).reshape(E, inter)), axis=1))
    db = np.ascontiguousarray(vector_f32(bs[2]).reshape(E, hidden))
    if kind in ("f32", "f16", "bf16"):
        gate = np.ascontiguousarray(np.concatenate((gate, up), axis=1))
        note_host_copy(gate.nbytes)
        up = None
    return gate, up, inter, (gb, db, False)
