"""Server settings, read from `JITKERN_*` environment variables.

`python -m server --flag ...` turns its flags into these variables and execs gunicorn, whose one worker
builds the app from them (`server.app`); `gunicorn server.app` alone reads the same variables. A bad value
is reported naming the variable, not as a traceback.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

ENV_PREFIX = "JITKERN_"


class SettingsError(ValueError):
    """A JITKERN_* variable has a value the server cannot use; the message names the variable."""


def _parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={text!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


def _parse_int(name: str, text: str, low: int | None = None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SettingsError(f"{name}={text!r}: expected an integer") from None
    if low is not None and value < low:
        raise SettingsError(f"{name}={value}: must be at least {low}")
    return value


def _parse_float(name: str, text: str, low: float | None = None) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingsError(f"{name}={text!r}: expected a number") from None
    if value != value or (low is not None and value < low):
        raise SettingsError(f"{name}={text!r}: must be a number >= {low}")
    return value


SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
# auto (f16 for 16-bit or quantised weights, f32 for f32 ones) and the explicit spellings; the engine resolves them
from engine.sizing import KV_CACHE_DTYPES  # noqa: E402  (a light module: logging and dataclasses only)
# vLLM's --dtype: the GPU compute precision of 16-bit checkpoints (engine.llm_args maps the spellings)
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


@dataclass
class ServerSettings:
    # engine (None: the engine's own default)
    model: Optional[str] = None                  # JITKERN_MODEL; None: the embedded SmolLM2
    served_model_name: Optional[str] = None      # JITKERN_SERVED_MODEL_NAME; default: model file/dir name
    tokenizer_config: Optional[str] = None
    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    kv_cache_dtype: Optional[str] = None
    dtype: Optional[str] = None                  # JITKERN_DTYPE: vLLM's --dtype (float32: f32 matrix-unit inputs)
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    scheduling_policy: str = "fcfs"
    max_logprobs: Optional[int] = None
    logprobs_mode: Optional[str] = None          # JITKERN_LOGPROBS_MODE: vLLM's --logprobs-mode
    seed: Optional[int] = None
    speculative_config: Optional[str] = None     # JITKERN_SPECULATIVE_CONFIG: vLLM's JSON (engine.spec_decode)
    enable_jump_forward: Optional[bool] = None   # JITKERN_ENABLE_JUMP_FORWARD: structured outputs' forced tokens
    task: Optional[str] = None                   # JITKERN_TASK: auto | generate | embed (vLLM's --task)
    generation_config: Optional[str] = None      # JITKERN_GENERATION_CONFIG: auto | vllm | a folder
    tensor_parallel_size: Optional[int] = None   # JITKERN_TENSOR_PARALLEL_SIZE (engine.parallel.config decides)
    device: Optional[str] = None                 # JITKERN_DEVICE: auto | cpu | cuda | vulkan (engine.device)
    # JITKERN_GPU_MEMORY_UTILIZATION: vLLM's fraction of the GPU's memory for the engine, 0 < x <= 1 (0.9)
    gpu_memory_utilization: Optional[float] = None
    kv_events_config: Optional[str] = None       # JITKERN_KV_EVENTS_CONFIG: vLLM's JSON (engine.kv_events)
    # JITKERN_ITL_TARGET_MS: step-time target while prompts prefill beside running streams (engine.scheduler
    # PrefillBudget); 0: off (only max_num_batched_tokens); unset: the engine's default for the device
    itl_target_ms: Optional[float] = None
    # LoRA (vLLM's --enable-lora, --max-loras, --max-lora-rank, --lora-modules; engine.lora, server.lora):
    # JITKERN_LORA_MODULES is a JSON list of {"name", "path"} objects
    enable_lora: Optional[bool] = None
    max_loras: Optional[int] = None
    max_lora_rank: Optional[int] = None
    lora_modules: Optional[str] = None
    # JITKERN_DATA_PARALLEL_SIZE / JITKERN_DISTRIBUTED_EXECUTOR_BACKEND: N engine replicas behind this server
    # (engine.data_parallel), as local processes ("mp") or Ray actors ("ray")
    data_parallel_size: Optional[int] = None
    distributed_executor_backend: Optional[str] = None
    # JITKERN_ENGINE_PROCESS: the engine in a process of its own (vLLM's engine core), so that the HTTP threads
    # never hold the interpreter lock the engine's step needs; None: on where the device is CUDA
    engine_process: Optional[bool] = None
    # JITKERN_API_SERVER_COUNT: HTTP worker processes in front of the one engine process (vLLM's
    # --api-server-count), each with its own interpreter lock for the per-token work of its streams; default 1
    api_server_count: Optional[int] = None
    # server
    api_key: Optional[str] = None
    log_requests: bool = True
    log_outputs: bool = False
    max_log_len: int = 256
    enable_metrics: bool = True
    verbose: bool = False
    max_body_bytes: int = 32 << 20              # larger request bodies are answered 413
    sse_ping_s: float = 15.0                     # SSE comment frame while a stream waits; 0: off
    drain_timeout_s: float = 25.0                # after SIGTERM, streams still running this long are ended
    warmup: bool = True                          # one short generation before the worker takes requests
    tool_call_parser: str = "auto"               # hermes | llama3_json | mistral | pythonic | auto | none
    reasoning_parser: str = "none"               # deepseek_r1 | qwen3 | think_auto | auto | none
    enable_thinking: Optional[bool] = None       # the chat template's enable_thinking (None: the template's)
    # For tests: "module:callable" returning an AsyncEngine-like object, called with these settings.
    engine_factory: Optional[str] = None

    # name -> (kind, extra check)
    _KINDS = {
        "model": "str", "served_model_name": "str", "tokenizer_config": "str", "block_size": "pos_int",
        "num_blocks": "pos_int", "kv_cache_memory": "pos_int", "kv_cache_dtype": "kv_dtype", "dtype": "dtype",
        "max_model_len": "len_int", "max_num_seqs": "pos_int", "max_num_batched_tokens": "len_int",
        "enable_prefix_caching": "bool", "scheduling_policy": "policy", "max_logprobs": "logprobs_int",
        "logprobs_mode": "logprobs_mode",
        "seed": "int", "enable_jump_forward": "bool", "api_key": "str", "log_requests": "bool", "log_outputs": "bool",
        "max_log_len": "nonneg_int", "enable_metrics": "bool", "verbose": "bool", "max_body_bytes": "pos_int",
        "sse_ping_s": "nonneg_float", "drain_timeout_s": "nonneg_float", "warmup": "bool", "engine_factory": "str",
        "tool_call_parser": "tool_parser", "reasoning_parser": "reasoning_parser", "enable_thinking": "bool",
        "speculative_config": "spec_config", "task": "task", "generation_config": "generation_config",
        "tensor_parallel_size": "pos_int", "device": "device", "gpu_memory_utilization": "fraction",
        "kv_events_config": "kv_events", "itl_target_ms": "nonneg_float",
        "enable_lora": "bool", "max_loras": "pos_int", "max_lora_rank": "pos_int", "lora_modules": "lora_modules",
        "data_parallel_size": "pos_int", "distributed_executor_backend": "executor_backend",
        "engine_process": "bool", "api_server_count": "pos_int",
    }

    @classmethod
    def env_name(cls, field_name: str) -> str:
        return ENV_PREFIX + field_name.upper()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ServerSettings":
        environ = os.environ if environ is None else environ
        values: dict = {}
        for f in fields(cls):
            kind = cls._KINDS.get(f.name)
            if kind is None:
                continue
            name = cls.env_name(f.name)
            text = environ.get(name)
            if text is None or text == "":
                continue
            values[f.name] = _parse(kind, name, text)
        return cls(**values)

    def to_env(self) -> dict:
        """The variables that reproduce these settings (for handing them to the gunicorn worker)."""
        env = {}
        for f in fields(self):
            if f.name not in self._KINDS:
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            env[self.env_name(f.name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env

    def lora_module_list(self) -> list:
        """The --lora-modules entries as [{"name", "path"}] (server.lora)."""
        if not self.lora_modules:
            return []
        from server.lora import parse_lora_modules
        return parse_lora_modules([json.dumps(m) for m in json.loads(self.lora_modules)])

    def engine_kwargs(self) -> dict:
        """EngineArgs keyword arguments for the fields that are set (the rest keep the engine's defaults)."""
        names = ("model", "tokenizer_config", "block_size", "num_blocks", "kv_cache_memory", "kv_cache_dtype",
                 "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                 "scheduling_policy", "max_logprobs", "logprobs_mode", "seed", "enable_jump_forward",
                 "speculative_config", "task", "generation_config", "tensor_parallel_size", "device",
                 "gpu_memory_utilization", "kv_events_config", "itl_target_ms", "enable_lora", "max_loras",
                 "max_lora_rank", "data_parallel_size", "distributed_executor_backend")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        out["usage_context"] = "openai_api_server"      # vLLM's server defaults (engine.sizing.default_batch_limits)
        if self.dtype in ("float32", "float"):
            out["dtype"] = "float32"          # the other spellings are the engine's default ("auto")
        return out


def _parse(kind: str, name: str, text: str):
    if kind == "str":
        return text
    if kind == "bool":
        return _parse_bool(name, text)
    if kind == "int":
        return _parse_int(name, text)
    if kind == "pos_int":
        return _parse_int(name, text, low=1)
    if kind == "nonneg_int":
        return _parse_int(name, text, low=0)
    if kind == "len_int":
        value = _parse_int(name, text, low=0)
        return value or None          # 0 means "the default" (the seeds' --max-model-len 0)
    if kind == "logprobs_int":
        return _parse_int(name, text, low=-1)
    if kind == "logprobs_mode":
        from engine.logits_process import LOGPROBS_MODES
        if text not in LOGPROBS_MODES:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(LOGPROBS_MODES)}")
        return text
    if kind == "nonneg_float":
        return _parse_float(name, text, low=0.0)
    if kind == "policy":
        if text not in SCHEDULING_POLICIES:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(SCHEDULING_POLICIES)}")
        return text
    if kind in ("tool_parser", "reasoning_parser"):
        from server.reasoning import REASONING_PARSER_CHOICES
        from server.tool_parsers import TOOL_PARSER_CHOICES
        choices = TOOL_PARSER_CHOICES if kind == "tool_parser" else REASONING_PARSER_CHOICES
        if text not in choices:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(choices)}")
        return text
    if kind == "spec_config":
        from engine.spec_decode import SpeculativeConfig, SpeculativeConfigError
        try:
            SpeculativeConfig.parse(text)
        except SpeculativeConfigError as e:
            raise SettingsError(f"{name}: {e}") from None
        return text
    if kind == "task":
        from engine.pooling import TASKS
        if text not in TASKS:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(TASKS)}")
        return text
    if kind == "generation_config":
        if text not in ("auto", "vllm") and not os.path.isdir(text):
            raise SettingsError(f"{name}={text!r}: expected auto, vllm or a folder holding generation_config.json")
        return text
    if kind == "dtype":
        if text not in DTYPES:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(DTYPES)}")
        return text
    if kind == "device":
        from engine.device import DEVICES
        value = text.strip().lower()
        if value not in DEVICES:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(DEVICES)}")
        return value
    if kind == "fraction":
        from engine.sizing import check_gpu_memory_utilization
        try:
            return check_gpu_memory_utilization(text.strip())
        except ValueError:
            raise SettingsError(f"{name}={text!r}: expected a number > 0 and <= 1") from None
    if kind == "kv_events":
        from engine.kv_events import KVEventsConfig, KVEventsConfigError
        try:
            KVEventsConfig.parse(text)
        except KVEventsConfigError as e:
            raise SettingsError(f"{name}: {e}") from None
        return text
    if kind == "lora_modules":
        from server.lora import parse_lora_modules
        try:
            items = json.loads(text)
            parse_lora_modules([json.dumps(m) for m in items] if isinstance(items, list) else [text])
        except ValueError as e:
            raise SettingsError(f"{name}: {e}") from None
        return text
    if kind == "executor_backend":
        if text not in ("mp", "ray"):
            raise SettingsError(f"{name}={text!r}: expected mp or ray")
        return text
    if kind == "kv_dtype":
        if text not in KV_CACHE_DTYPES:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        return text
    raise AssertionError(kind)


def env_int(name: str, default: int, low: int = 0, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    if text is None or text == "":
        return default
    return _parse_int(name, text, low=low)


def env_float(name: str, default: float, low: float = 0.0, environ: Mapping[str, str] | None = None) -> float:
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    if text is None or text == "":
        return default
    return _parse_float(name, text, low=low)
