"""Embeddings: pooling a model's final hidden states into one vector per prompt (vLLM's `--task embed`).

Which models embed: `--task embed`, or (`--task auto`) a checkpoint whose config.json names a bare model
class (`LlamaModel`, `Qwen3Model`, ... : no language-model head) or that ships a sentence-transformers
`modules.json`. Such an engine serves embeddings only (generation is refused naming the task), as vLLM does.

How to pool, read as sentence-transformers would (modules.json -> the Pooling module's folder, usually
`1_Pooling/config.json`: `pooling_mode_cls_token` / `pooling_mode_mean_tokens` / `pooling_mode_lasttoken`;
a `sentence_transformers.models.Normalize` module -> L2-normalised). Without a sentence-transformers config,
vLLM's defaults: last-token pooling for decoders, CLS for BERT-style encoders, normalised.
`dimensions` (Matryoshka): only where config.json says the model was trained for it (`matryoshka_dimensions`
or `is_matryoshka`, vLLM's test); the vector is truncated, then normalised.

The forward pass: every prompt of a group is prefilled at once on the decoder's kernels (the engine's own
runner arrays and KV pool, which an embedding engine uses for nothing else), and the model returns its final
normalised hidden states instead of logits (DecoderLM.return_hidden). Causal decoders only so far.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from engine.errors import InvalidRequestError, ModelLoadError

log = logging.getLogger("engine")

TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("last", "mean", "cls")


@dataclass
class PoolingConfig:
    pooling: str = "last"                       # "last" | "mean" | "cls"
    normalize: bool = True
    matryoshka_dimensions: Optional[list] = None
    is_matryoshka: bool = False
    source: str = "defaults"                    # where the settings came from (logged)


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for embeddings: `dimensions` (Matryoshka truncation), `normalize` (None: the
    model's setting)."""
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None


@dataclass
class EmbeddingOutput:
    embedding: list

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: EmbeddingOutput
    finished: bool = True


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path.name}: {e}", path=path) from None


def _hf_config(model_path) -> dict:
    if model_path is None:
        return {}
    p = Path(model_path)
    f = (p if p.is_dir() else p.parent) / "config.json"
    if not f.is_file():
        return {}
    cfg = _read_json(f)
    return cfg if isinstance(cfg, dict) else {}


def _folder(model_path) -> Optional[Path]:
    if model_path is None:
        return None
    p = Path(model_path)
    return p if p.is_dir() else p.parent


def is_embedding_checkpoint(model_path) -> bool:
    """A bare model class (no LM head) in config.json's architectures, or a sentence-transformers layout."""
    folder = _folder(model_path)
    if folder is None:
        return False
    if (folder / "modules.json").is_file():
        return True
    archs = _hf_config(model_path).get("architectures") or []
    # bare encoder/decoder classes (BertModel, Qwen3Model); GPT2LMHeadModel-style names have an LM head
    return any(isinstance(a, str) and a.endswith("Model") and not a.endswith("LMHeadModel") for a in archs)


def resolve_task(task: str, model_path) -> str:
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    return "embed" if is_embedding_checkpoint(model_path) else "generate"


def load_pooling_config(model_path, architecture: str) -> PoolingConfig:
    folder = _folder(model_path)
    hf = _hf_config(model_path)
    encoder = architecture in ("bert", "roberta", "xlm-roberta", "modernbert")
    pc = PoolingConfig(pooling="cls" if encoder else "last", normalize=True)
    mods_file = folder / "modules.json" if folder is not None else None
    if mods_file is not None and mods_file.is_file():
        mods = _read_json(mods_file)
        if not isinstance(mods, list):
            raise ModelLoadError("modules.json must be a list of modules", path=mods_file)
        types = [str(m.get("type", "")) for m in mods if isinstance(m, dict)]
        pc.normalize = any(t.endswith(".Normalize") for t in types)
        pc.source = str(mods_file)
        for m in mods:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
                pf = folder / str(m.get("path", "1_Pooling")) / "config.json"
                if not pf.is_file():
                    raise ModelLoadError("modules.json names a Pooling module but its config.json is missing",
                                         path=pf)
                pcfg = _read_json(pf)
                modes = [k for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken",
                                     "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                     "pooling_mode_weightedmean_tokens") if pcfg.get(k)]
                if len(modes) != 1 or modes[0] in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                                   "pooling_mode_weightedmean_tokens"):
                    raise ModelLoadError(f"pooling {modes or 'none'} is not supported (one of cls / mean / "
                                         "last-token)", path=pf, key="pooling_mode")
                pc.pooling = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                              "pooling_mode_lasttoken": "last"}[modes[0]]
                pc.source = str(pf)
    dims = hf.get("matryoshka_dimensions")
    pc.matryoshka_dimensions = [int(d) for d in dims] if isinstance(dims, list) and dims else None
    pc.is_matryoshka = bool(pc.matryoshka_dimensions) or bool(hf.get("is_matryoshka", False))
    return pc


def pool(hidden: np.ndarray, how: str) -> np.ndarray:
    """One vector from a prompt's [T, H] final hidden states."""
    if how == "last":
        return hidden[-1].astype(np.float32)
    if how == "cls":
        return hidden[0].astype(np.float32)
    if how == "mean":
        return hidden.astype(np.float64).mean(axis=0).astype(np.float32)
    raise ValueError(how)


def finish_vector(v: np.ndarray, pc: PoolingConfig, params: Optional[PoolingParams]) -> np.ndarray:
    """Matryoshka truncation, then L2 normalisation (in that order, as vLLM's embedding head does)."""
    dims = params.dimensions if params is not None else None
    if dims is not None:
        check_dimensions(dims, pc, len(v))
        v = v[:dims]
    norm = pc.normalize if params is None or params.normalize is None else params.normalize
    if norm:
        n = float(np.linalg.norm(v.astype(np.float64)))
        v = (v / max(n, 1e-12)).astype(np.float32)
    return v


def check_dimensions(dims, pc: PoolingConfig, hidden: int) -> None:
    if not isinstance(dims, int) or isinstance(dims, bool):
        raise InvalidRequestError(f"dimensions must be an integer, got {dims!r}", param="dimensions")
    if not pc.is_matryoshka:
        raise InvalidRequestError("this model does not support Matryoshka representations: 'dimensions' cannot "
                                  "change its output size", param="dimensions")
    if pc.matryoshka_dimensions and dims not in pc.matryoshka_dimensions:
        raise InvalidRequestError(f"dimensions {dims} is not one of the model's Matryoshka dimensions "
                                  f"{pc.matryoshka_dimensions}", param="dimensions")
    if not 1 <= dims <= hidden:
        raise InvalidRequestError(f"dimensions must be in [1, {hidden}], got {dims}", param="dimensions")


class Embedder:
    """Runs prompts (token-id lists) through the engine's model and pools them. Engine thread only."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        self.runner = engine.runner
        ckpt = engine.checkpoint
        self.pooling = load_pooling_config(getattr(ckpt, "path", None), engine.config.architecture)
        self.hidden_size = engine.config.hidden_size
        if getattr(self.runner, "device", "cpu") != "cpu":
            raise ModelLoadError("embeddings run on the CPU engine only so far: use --device cpu",
                                 path=getattr(ckpt, "path", None), key="device")
        log.info("embeddings: %s pooling, normalize=%s (from %s)", self.pooling.pooling, self.pooling.normalize,
                 self.pooling.source)

    def _check(self, ids, i: int) -> None:
        where = "input" if i is None else f"input[{i}]"
        if not ids:
            raise InvalidRequestError(f"{where} is empty", param="input")
        V = self.engine.config.vocab_size
        bad = [t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} in {where} is out of range [0, {V})", param="input")
        if len(ids) > self.engine.max_model_len:
            raise InvalidRequestError(f"{where} has {len(ids)} tokens; the maximum context length is "
                                      f"{self.engine.max_model_len}", param="input")

    def embed(self, prompts: list, params: Optional[PoolingParams] = None) -> list:
        """One float32 vector per token-id list, in order."""
        if params is not None and params.dimensions is not None:
            check_dimensions(params.dimensions, self.pooling, self.hidden_size)
        for i, ids in enumerate(prompts):
            self._check(ids, i)
        out = [None] * len(prompts)
        for group in self._groups(prompts):
            hidden = self._forward([prompts[i] for i in group])
            for i, h in zip(group, hidden):
                out[i] = finish_vector(pool(h, self.pooling.pooling), self.pooling, params)
        return out

    def _groups(self, prompts: list):
        b = self.runner.batch
        maxT, maxS = len(b.input_ids), len(b.seq_lens)
        bs = self.runner.block_size
        max_blocks = self.engine.num_blocks
        group, T, blocks = [], 0, 0
        for i, ids in enumerate(prompts):
            n, nb = len(ids), -(-len(ids) // bs)
            if n > maxT or nb > max_blocks:
                raise InvalidRequestError(f"input[{i}] has {n} tokens; one forward pass of this engine takes at "
                                          f"most {min(maxT, max_blocks * bs)} (--max-num-batched-tokens)",
                                          param="input")
            if group and (T + n > maxT or len(group) == maxS or blocks + nb > max_blocks):
                yield group
                group, T, blocks = [], 0, 0
            group.append(i)
            T += n
            blocks += nb
        if group:
            yield group

    def _forward(self, seqs: list) -> list:
        b = self.runner.batch
        bs = self.runner.block_size
        t, next_block = 0, 0
        b.block_table[: len(seqs)] = 0
        for i, ids in enumerate(seqs):
            n = len(ids)
            nb = -(-n // bs)
            blocks = np.arange(next_block, next_block + nb, dtype=np.int32)
            next_block += nb
            pos = np.arange(n, dtype=np.int32)
            b.input_ids[t:t + n] = ids
            b.positions[t:t + n] = pos
            b.slot_mapping[t:t + n] = blocks[pos // bs] * bs + pos % bs
            b.query_start[i] = t
            b.seq_lens[i] = n
            b.block_table[i, :nb] = blocks
            t += n
        b.query_start[len(seqs)] = t
        b.num_tokens = t
        b.num_seqs = len(seqs)
        b.logits_rows = np.arange(t, dtype=np.int32)
        prev = getattr(self.model, "return_hidden", False)
        self.model.return_hidden = True
        try:
            hidden = np.array(self.model.forward(b), dtype=np.float32, copy=True)
        finally:
            self.model.return_hidden = prev
        qs = b.query_start
        return [hidden[qs[i]:qs[i + 1]] for i in range(len(seqs))]


def embedder_of(engine) -> Embedder:
    """The engine's Embedder (made on first use); refuses engines that do not serve embeddings."""
    if getattr(engine, "task", "generate") != "embed":
        raise InvalidRequestError("this model is served for generation; embeddings need an embedding model "
                                  "(--task embed, or a checkpoint without a language-model head)", param="model")
    emb = getattr(engine, "_embedder", None)
    if emb is None:
        emb = engine._embedder = Embedder(engine)
    return emb


def adapt_for_embedding(ckpt) -> None:
    """A bare-model checkpoint (`LlamaModel.save_pretrained`: `layers.0...`, `embed_tokens.weight`, `norm.weight`)
    also answers to the `model.`-prefixed names the decoder looks for; it has no LM head (pooling only)."""
    extra = {"model." + k: v for k, v in ckpt.tensors.items()
             if not k.startswith("model.") and (k.startswith("layers.") or k in ("embed_tokens.weight", "norm.weight"))}
    for k, v in extra.items():
        ckpt.tensors.setdefault(k, v)
    ckpt.pooling_only = True
