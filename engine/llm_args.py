"""vLLM's `LLM(...)` constructor arguments, mapped onto EngineArgs (or accepted and logged, or refused).

    LLM(model, tokenizer=None, dtype="auto", tensor_parallel_size=1, gpu_memory_utilization=0.9,
        max_model_len=None, seed=0, enforce_eager=False, trust_remote_code=False, ...)

Mapped: max_model_len, seed, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, block_size,
kv_cache_dtype ("auto": f16 for 16-bit or quantised weights, f32 for f32 ones; float16 / fp16 / f16, float32 / fp32 /
f32; anything else refused naming it), enforce_eager (decode graphs off), task / runner, generation_config, device,
disable_async_output_proc (overlap_output off: vLLM V0's async output processing is that overlap),
gpu_memory_utilization (on CUDA the KV cache takes what weights and activations leave of that fraction of the card;
no effect on the CPU), kv_cache_memory_bytes (-> kv_cache_memory: the KV pool's bytes, overriding it).
Accepted and logged (no effect here): swap_space, cpu_offload_gb=0,
trust_remote_code (no checkpoint code is ever run), tokenizer_mode, revision, download_dir, load_format,
max_seq_len_to_capture, disable_custom_all_reduce, disable_log_stats, ...; dtype: "auto" / "float16" /
"bfloat16" / "half" -> "auto" (on a GPU a 16-bit checkpoint's matrix-unit inputs are 16-bit, as vLLM; the
weights keep their stored formats; float32 elsewhere), "float32" / "float" -> "float32" (f32 activations split
hi + lo on the matrix units).
tensor_parallel_size: passed to the engine, where engine.parallel.config alone decides (1: normal; > 1: refused
on the CPU, and beyond the GPUs present naming both numbers).
data_parallel_size / distributed_executor_backend ("mp" | "ray"): N replicas behind one front end
(engine.data_parallel).
Refused with the reason: pipeline_parallel_size > 1,
quantization other than None / "gguf" (read from the checkpoint), tokenizer pointing somewhere the model's own
is not (a folder with tokenizer_config.json is taken as --tokenizer-config), unknown keywords.
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("engine")

_IGNORED = ("swap_space", "cpu_offload_gb", "trust_remote_code", "tokenizer_mode",
            "revision", "tokenizer_revision", "code_revision", "download_dir", "load_format",
            "max_seq_len_to_capture", "disable_custom_all_reduce", "disable_log_stats",
            "hf_token", "hf_overrides", "compilation_config", "skip_tokenizer_init", "allowed_local_media_path",
            "max_logprobs_mode", "enable_chunked_prefill", "worker_cls",
            "disable_log_requests", "use_v2_block_manager", "num_scheduler_steps")
# vLLM's LoRA tuning knobs with no counterpart here (adapters stay in host memory; LoRA weights are f32)
_IGNORED += ("max_cpu_loras", "lora_dtype", "fully_sharded_loras", "lora_extra_vocab_size")
_DTYPES_F32 = ("auto", "float32", "float", "fp32")
_DTYPES_LOGGED = ("float16", "half", "bfloat16", "fp16", "bf16")


def engine_kwargs_from_vllm(kwargs: dict) -> dict:
    """EngineArgs keyword arguments for `kwargs` (vLLM's LLM constructor spelling); raises ValueError naming
    the argument for what cannot be honoured."""
    from dataclasses import fields

    from engine.llm_engine import EngineArgs
    names = {f.name for f in fields(EngineArgs)}
    out = {}
    kw = dict(kwargs)

    def take(name, default=None):
        return kw.pop(name, default)

    dtype = take("dtype", "auto")
    dtype = str(dtype).replace("torch.", "") if dtype is not None else "auto"
    if dtype in _DTYPES_LOGGED:
        log.info("dtype=%s: the engine keeps the checkpoint's weight formats; on a GPU a 16-bit checkpoint's "
                 "matrix-unit inputs are 16-bit (dtype auto)", dtype)
    elif dtype not in _DTYPES_F32:
        raise ValueError(f"dtype={dtype!r} is not supported (auto, float32, float16, bfloat16)")
    if dtype in ("float32", "float", "fp32"):
        out["dtype"] = "float32"
    tp = take("tensor_parallel_size", 1)
    if tp not in (None, 1):
        out["tensor_parallel_size"] = tp            # checked by engine.parallel.config before the load
    dp = take("data_parallel_size", 1)
    backend = take("distributed_executor_backend")
    from engine.data_parallel import check_data_parallel
    check_data_parallel(1 if dp is None else dp, backend)
    if dp not in (None, 1):
        out["data_parallel_size"] = dp              # engine.data_parallel: N replicas behind one front end
    if backend is not None:
        out["distributed_executor_backend"] = backend
    for par in ("pipeline_parallel_size",):
        v = take(par, 1)
        if v not in (None, 1):
            raise ValueError(f"{par}={v}: this engine runs a model on one device (no tensor/pipeline/data "
                             "parallelism); use 1")
    q = take("quantization")
    if q not in (None, "gguf"):
        raise ValueError(f"quantization={q!r}: the weight formats are read from the checkpoint (GGUF blocks, FP8 "
                         "safetensors); leave it unset")
    if take("enforce_eager", False):
        out["use_graphs"] = False
    if take("disable_async_output_proc", False):
        out["overlap_output"] = False               # vLLM V0's async output processing = our overlap_output
    tok = take("tokenizer")
    if tok is not None and kw.get("model") is not None and Path(str(tok)).resolve() == Path(str(kw["model"])).resolve():
        tok = None
    if tok is not None:
        p = Path(str(tok))
        cfg = p / "tokenizer_config.json" if p.is_dir() else p
        if not (cfg.is_file() and cfg.name.endswith(".json")):
            raise ValueError(f"tokenizer={tok!r}: the tokenizer comes from the model's own files; a folder with a "
                             "tokenizer_config.json (or that file) may override its chat template and special tokens")
        out["tokenizer_config"] = str(cfg)
    runner = take("runner")
    if runner is not None:
        out["task"] = {"pooling": "embed", "generate": "generate", "auto": "auto"}.get(runner, runner)
    kvm = take("kv_cache_memory_bytes")
    if kvm is not None:
        out["kv_cache_memory"] = kvm                # vLLM's spelling of the pool's bytes
    kvd = take("kv_cache_dtype")
    if kvd is not None:
        from engine.sizing import kv_cache_dtype_name
        out["kv_cache_dtype"] = kv_cache_dtype_name(kvd)     # "auto" stays: the engine decides it from the weights
    for name in _IGNORED:
        if name in kw:
            v = kw.pop(name)
            log.info("LLM(%s=%r): accepted, no effect on this engine", name, v)
    for name in list(kw):
        if name in names:
            out[name] = kw.pop(name)
    if "task" in out and out["task"] == "embedding":
        out["task"] = "embed"
    if kw:
        bad = sorted(kw)[0]
        raise TypeError(f"LLM() got an unexpected keyword argument {bad!r}")
    return out
