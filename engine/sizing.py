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


# ----------------------------------------------------------------------------------- the GPU's memory
# vLLM's --gpu-memory-utilization default: the fraction of the card's memory this engine may hold in all
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GIB = 1 << 30
# Batch limits when the user gives none. The CPU keeps its own (its steps run on a few cores: a wide batch only
# adds latency). On CUDA they are vLLM's choice (vLLM's EngineArgs._set_default_args): 256 sequences, and a
# per-step token budget by usage context and card memory: on a card of >= 70 GiB 8192 tokens for the
# OpenAI server and 16384 for the LLM class (offline batches), below that 2048 and 8192.
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 2048
GPU_MAX_NUM_SEQS = 256
GPU_LARGE_CARD_BYTES = 70 * GIB
USAGE_CONTEXTS = ("llm_class", "openai_api_server")
_GPU_BATCHED_TOKENS = {  # usage context -> (card >= 70 GiB, smaller card)
    "llm_class": (16384, 8192),
    "openai_api_server": (8192, 2048),
}


def check_gpu_memory_utilization(value) -> float:
    """The fraction as a float; a ValueError naming --gpu-memory-utilization unless 0 < value <= 1."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--gpu-memory-utilization {value!r}: expected a number in (0, 1]") from None
    if not 0.0 < x <= 1.0:          # (NaN fails this too)
        raise ValueError(f"--gpu-memory-utilization {value!r}: must be > 0 and <= 1 (the fraction of the GPU's "
                         f"memory this engine may use; default {DEFAULT_GPU_MEMORY_UTILIZATION})")
    return x


def default_batch_limits(device: str, usage_context: str = "llm_class", total_bytes: int | None = None) -> tuple:
    """(max_num_seqs, max_num_batched_tokens) when the user gives none, for the resolved device kind. CUDA gets
    vLLM's defaults (above); a card whose memory is unknown (total_bytes None) counts as a smaller one. The CPU
    and Vulkan (lavapipe runs on the host's cores; no free-memory query) keep the CPU's."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context={usage_context!r} is not one of {', '.join(USAGE_CONTEXTS)}")
    if device != "cuda":
        return CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS
    large, small = _GPU_BATCHED_TOKENS[usage_context]
    return GPU_MAX_NUM_SEQS, large if total_bytes is not None and total_bytes >= GPU_LARGE_CARD_BYTES else small


def fmt_bytes(n: int) -> str:
    """Bytes for a log line or error: GiB / MiB with two decimals, small sizes in bytes."""
    n = int(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n} bytes"


@dataclass(frozen=True)
class GpuMemoryProfile:
    """The device's (free, total) bytes measured at three points of the engine's start: before the weights
    load, after them, and after the activation reserve (ModelRunner.reserve_buffers). The CUDA allocator's
    pool keeps freed memory, so the last free figure is the reserve step's peak: the conservative one."""
    total: int
    free_at_start: int
    free_after_weights: int
    free_after_reserve: int

    @property
    def weights(self) -> int:
        return max(self.free_at_start - self.free_after_weights, 0)

    @property
    def activation_reserve(self) -> int:
        return max(self.free_after_weights - self.free_after_reserve, 0)

    @property
    def in_use(self) -> int:
        """Everything held on the card after the reserve: this engine's weights and buffers, its context, and
        other processes' memory (vLLM's older profiling counts it the same way)."""
        return self.total - self.free_after_reserve


def gpu_kv_budget(profile: GpuMemoryProfile, utilization: float) -> int:
    """Bytes left for the KV cache: utilization x total minus what is in use after weights and reserve (may
    be negative)."""
    return int(utilization * profile.total) - profile.in_use


def gpu_num_blocks(profile: GpuMemoryProfile, utilization: float, bytes_per_block: int, block_size: int,
                   max_model_len: int | None = None) -> int:
    """vLLM's sizing: floor((utilization x total - in use after weights + reserve) / bytes per block).

    A KVPoolTooSmallError (one line, every size named) when that is not one block, or fewer than one sequence of
    the user's max_model_len needs (without one, engine.sizing.resolve_max_model_len fits the context to the
    pool)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    left = gpu_kv_budget(profile, utilization)
    blocks = left // bytes_per_block if left > 0 else 0
    needed = cdiv(max_model_len, block_size) if max_model_len else 1
    if blocks < needed:
        other = max(profile.in_use - profile.weights - profile.activation_reserve, 0)
        what = (f"one sequence of --max-model-len {max_model_len} needs {needed} blocks ({fmt_bytes(needed * bytes_per_block)})"
                if max_model_len else "not even one block fits")
        raise KVPoolTooSmallError(
            f"not enough GPU memory for the KV cache: card total {fmt_bytes(profile.total)} x "
            f"--gpu-memory-utilization {utilization:g} = {fmt_bytes(int(utilization * profile.total))}; in use "
            f"after the load {fmt_bytes(profile.in_use)} (weights {fmt_bytes(profile.weights)}, activation "
            f"reserve {fmt_bytes(profile.activation_reserve)}, CUDA context and other processes "
            f"{fmt_bytes(other)}); left for the KV cache {fmt_bytes(left)}, one block of {block_size} tokens needs "
            f"{fmt_bytes(bytes_per_block)}: {what}. Raise --gpu-memory-utilization, "
            f"lower --max-model-len / --max-num-batched-tokens / --max-num-seqs, or use a smaller model")
    return blocks


def kv_cache_log_line(num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int) -> str:
    """vLLM's two start-up lines ("GPU KV cache size: N tokens", "Maximum concurrency for L tokens per
    request: X.XXx") as one."""
    tokens = num_blocks * block_size
    return (f"KV cache: {tokens:,} tokens ({num_blocks:,} blocks x {block_size}, "
            f"{fmt_bytes(num_blocks * bytes_per_block)}), max concurrency {tokens / max_model_len:.2f}x for "
            f"{max_model_len:,} tokens per request")


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
