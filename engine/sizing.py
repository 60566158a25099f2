"""Context length versus the KV pool, checked once at startup.

Behaviour from the vllm.cpp guide (seed 000, "Context length vs the KV pool"), which
mirrors vLLM: the pool holds num_blocks x block_size tokens.

* `--max-model-len` given and the pool cannot hold one sequence that long: refuse to
  start, naming the sizes and the flags that close the gap (vLLM's
  _check_enough_kv_cache_memory).
* not given: serve min(model's max_position_embeddings, pool capacity) and log it when
  the pool is what limits it (vLLM's _auto_fit_max_model_len).

Admission-time rejection of prompts at or past max_model_len lives in
`Scheduler.add_request`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class KVPoolTooSmallError(ValueError):
    """The KV pool cannot hold one sequence of the requested context length."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one KV block over all layers: K and V, each [block_size, kv_heads, head_dim]."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("dtype_bytes", dtype_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


def num_blocks_for_memory(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in a memory budget (e.g. --kv-cache-memory BYTES)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    blocks = int(budget_bytes) // bytes_per_block
    if blocks < 1:
        raise KVPoolTooSmallError(
            f"a KV cache budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; "
            f"give at least {bytes_per_block} bytes (--kv-cache-memory) or lower --block-size")
    return blocks


@dataclass(frozen=True)
class ContextSizing:
    max_model_len: int
    num_blocks: int
    block_size: int
    auto_fitted: bool  # max_model_len was lowered to what the pool holds

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


def resolve_max_model_len(num_blocks: int, block_size: int, max_model_len: int | None = None,
                          model_max_len: int | None = None) -> ContextSizing:
    """Check or derive the serving context length for a pool of num_blocks x block_size.

    max_model_len: the user's --max-model-len (None or <= 0: not given).
    model_max_len: the model's max_position_embeddings (None: unknown, no cap).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    pool_tokens = num_blocks * block_size
    if max_model_len is not None and max_model_len > 0:
        if model_max_len is not None and max_model_len > model_max_len:
            raise ValueError(
                f"--max-model-len {max_model_len} is larger than the model's maximum context length "
                f"(max_position_embeddings = {model_max_len}); use --max-model-len {model_max_len} or less")
        needed = cdiv(max_model_len, block_size)
        if needed > num_blocks:
            fit = pool_tokens
            raise KVPoolTooSmallError(
                f"the KV cache pool cannot hold one sequence of max_model_len = {max_model_len} tokens: "
                f"it needs {needed} blocks of {block_size} tokens, but the pool has {num_blocks} blocks "
                f"({pool_tokens} tokens). Raise --num-blocks to at least {needed}, or lower --max-model-len "
                f"to at most {fit}, or change --block-size (the pool holds --num-blocks x --block-size tokens).")
        return ContextSizing(max_model_len, num_blocks, block_size, auto_fitted=False)
    limit = pool_tokens if model_max_len is None else min(model_max_len, pool_tokens)
    auto = model_max_len is None or pool_tokens < model_max_len
    if model_max_len is not None and pool_tokens < model_max_len:
        logger.warning(
            "max_model_len auto-fitted to %d tokens: the KV pool (%d blocks x %d tokens) is smaller than the "
            "model's %d-token context; raise --num-blocks for a longer context", limit, num_blocks, block_size,
            model_max_len)
    else:
        logger.info("max_model_len = %d tokens (pool %d blocks x %d tokens, model max %s)",
                    limit, num_blocks, block_size, model_max_len)
    return ContextSizing(limit, num_blocks, block_size, auto_fitted=auto)


# ----------------------------------------------------------------------------------- KV-cache element type
# kv_cache_dtype spellings (EngineArgs, LLM(...), --kv-cache-dtype, JITKERN_KV_CACHE_DTYPE) -> the element type
KV_CACHE_DTYPE_ALIASES = {"f32": "f32", "float32": "f32", "fp32": "f32", "f16": "f16", "float16": "f16", "fp16": "f16"}
KV_CACHE_DTYPES = ("auto",) + tuple(KV_CACHE_DTYPE_ALIASES)
KV_DTYPE_BYTES = {"f32": 4, "f16": 2}
# weight kinds (engine.loader.Checkpoint.weight_kinds) that keep an "auto" KV cache in f32
_FULL_PRECISION_KINDS = frozenset({"f32", "f64"})


def kv_cache_dtype_name(asked) -> str:
    """"auto", "f32" or "f16" for a kv_cache_dtype spelling (None: "auto"); a ValueError naming the field and the
    accepted values for anything else. Cheap: the engine checks the spelling before the slow load."""
    if asked is None or asked == "auto":
        return "auto"
    if isinstance(asked, str) and asked in KV_CACHE_DTYPE_ALIASES:
        return KV_CACHE_DTYPE_ALIASES[asked]
    raise ValueError(f"kv_cache_dtype={asked!r} is not supported (expected one of {', '.join(KV_CACHE_DTYPES)})")


def resolve_kv_cache_dtype(asked, weight_kinds) -> str:
    """The KV cache's element type, "f32" or "f16", for the kv_cache_dtype the user asked for and the checkpoint's
    weight kinds (engine.loader.Checkpoint.weight_kinds). An explicit type is kept. "auto" follows the model's
    dtype as vLLM does: f16 for 16-bit (bf16 / f16) or quantised weights (GGUF blocks, FP8; llama.cpp's default
    cache is f16 too), f32 when every weight matrix is f32 (or f64), so an f32 checkpoint keeps a full-precision
    cache. Decode attention reads the whole cache every step, so f16 halves its bytes (docs/BENCHMARKS.md)."""
    name = kv_cache_dtype_name(asked)
    if name != "auto":
        return name
    kinds = frozenset(weight_kinds)
    return "f32" if not kinds or kinds <= _FULL_PRECISION_KINDS else "f16"
