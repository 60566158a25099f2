"""`python -m server --model DIR --port P ...`: the seeds' server flags, turned into JITKERN_* variables,
then gunicorn (one gthread worker, server/gunicorn_conf.py) serving `server.app`.

Flags are checked here, before gunicorn starts, so a typo is one clear line and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from server.reasoning import REASONING_PARSER_CHOICES
from engine.device import DEVICES
from engine.logits_process import LOGPROBS_MODES
from server.settings import DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, ServerSettings
from server.tool_parsers import TOOL_PARSER_CHOICES

# Flags of `vllm serve` recipes that are accepted and have no effect here (a notice is printed).
INERT_FLAGS = ("--trust-remote-code", "--enable-auto-tool-choice", "--disable-frontend-multiprocessing")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _fraction(text: str) -> float:
    from engine.sizing import check_gpu_memory_utilization
    try:
        return check_gpu_memory_utilization(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0 and <= 1, got {text!r}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _kv_events_config(text: str) -> str:
    from engine.kv_events import KVEventsConfig, KVEventsConfigError
    try:
        KVEventsConfig.parse(text)
    except KVEventsConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _port(text: str) -> int:
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description="OpenAI-compatible server (gunicorn + Falcon) "
                                "for the jitkern engine.")
    p.add_argument("--model", help="model directory (safetensors), .gguf file or Hugging Face model id (org/name, "
                   "org/name:FILE.gguf; cached or downloaded) (default: the embedded SmolLM2)")
    p.add_argument("--host", default="0.0.0.0", help="bind host (default 0.0.0.0)")
    p.add_argument("--port", type=_port, default=8000, help="bind port (default 8000)")
    p.add_argument("--served-model-name", help="model id in /v1/models and responses (default: model name)")
    p.add_argument("--tokenizer-config", help="tokenizer_config.json with the chat template")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model runs: auto (a CUDA GPU when present, else the CPU; default), cpu, cuda or "
                        "vulkan")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                   help="on CUDA, the fraction of the GPU's memory for this engine (0 < x <= 1, default 0.9, "
                        "vLLM's): the KV cache gets what the weights and the activation reserve leave of it; "
                        "--num-blocks / --kv-cache-memory override it")
    p.add_argument("--block-size", type=_positive, help="KV block size in tokens")
    p.add_argument("--num-blocks", type=_positive, help="KV blocks in the pool (overrides the GPU's sizing)")
    p.add_argument("--kv-cache-memory", type=_positive, help="bytes for the KV pool when --num-blocks is not given "
                   "(overrides the GPU's sizing; default 1 GiB off CUDA)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="KV-cache element type (default auto: the model's dtype, f16 for a 16-bit (bf16/f16) or "
                        "quantised (GGUF, FP8) checkpoint, f32 for an f32 one; f32/float32/fp32 or "
                        "f16/float16/fp16 force it)")
    p.add_argument("--dtype", choices=DTYPES, help="GPU compute precision of a 16-bit checkpoint (vLLM's --dtype): "
                   "auto / bfloat16 / float16 feed the matrix units 16-bit activations; float32 keeps f32 "
                   "activations (hi + lo parts). The CPU computes in float32 either way")
    p.add_argument("--max-model-len", type=_non_negative, help="max sequence length (0: the model's, fitted to "
                   "the KV pool)")
    p.add_argument("--max-num-seqs", type=_positive, help="max concurrent sequences in a batch (default 64 on the "
                   "CPU, 256 on CUDA as vLLM)")
    p.add_argument("--max-num-batched-tokens", type=_non_negative, help="per-step token budget (0: default: 2048 on "
                   "the CPU; on CUDA vLLM's server choice, 8192 on a card of >= 70 GiB, else 2048)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching (--no-enable-prefix-caching turns it off)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs (default); priority: honour the request field `priority`; lpm: SGLang's "
                        "longest-prefix-match, waiting requests with the longest cached prefix first (fcfs "
                        "beyond 128 waiting)")
    p.add_argument("--kv-events-config", metavar="JSON", type=_kv_events_config, default=None,
                   help='KV-cache events, vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "topic": "", "replay_endpoint": null}: one msgpack '
                        'KVEventBatch per engine step on a ZMQ PUB socket (needs pyzmq and msgpack)')
    p.add_argument("--itl-target-ms", type=_non_negative_float, default=None, metavar="MS",
                   help="while prompts prefill beside running streams, size each step's prefill chunk so the "
                        "step takes about MS milliseconds (the streams' inter-token latency); 0: off, only "
                        "--max-num-batched-tokens bounds a step (default 200 on the CPU, off on CUDA)")
    p.add_argument("--max-logprobs", type=int, help="largest logprobs/top_logprobs a request may ask for")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=None,
                   help="what returned logprobs hold: raw_logprobs (default), raw_logits (before any processing), "
                        "processed_logprobs, processed_logits (as sampled: after temperature, top-k/top-p/min-p)")
    p.add_argument("--seed", type=int, help="engine random seed")
    logs = p.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=True,
                      help="log each request (default)")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                      help="no per-request log line")
    p.add_argument("--enable-log-outputs", action="store_true", help="also log generated outputs")
    p.add_argument("--max-log-len", type=_non_negative, default=256, help="truncate logged prompts/outputs to N "
                   "characters (default 256)")
    metrics = p.add_mutually_exclusive_group()
    metrics.add_argument("--enable-metrics", dest="enable_metrics", action="store_true", default=True,
                         help="serve Prometheus metrics on /metrics (default)")
    metrics.add_argument("--disable-metrics", dest="enable_metrics", action="store_false",
                         help="no /metrics endpoint")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (or set JITKERN_API_KEY)")
    p.add_argument("--max-body-bytes", type=_positive, help="larger request bodies are answered 413 (default 32 MiB)")
    p.add_argument("--threads", type=_positive, help="HTTP threads of the worker (default max-num-seqs + 32)")
    p.add_argument("--graceful-timeout", type=_positive, help="seconds in-flight requests get after SIGTERM "
                   "(default 30)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_CHOICES, default="auto",
                   help="tool-call dialect for tool_choice auto (default auto: from the chat template, else hermes; "
                   "none: no tool calls)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default="none",
                   help="<think> blocks -> reasoning_content (default none)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="the chat template's enable_thinking variable (default: the template's own default)")
    p.add_argument("--enable-jump-forward", action="store_true", default=None,
                   help="structured outputs: append the tokens a grammar forces without a forward step each")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4}')
    p.add_argument("--task", choices=("auto", "generate", "embed"), default=None,
                   help="embed: serve /v1/embeddings (default auto: embed for a checkpoint without an LM head or "
                        "with a sentence-transformers modules.json)")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="default sampling settings for unset request fields: auto (the model's "
                        "generation_config.json, default), vllm (none), or a folder holding one")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=None,
                   help="tensor parallelism: only 1 (the default) runs today; N > 1 is refused with the reason")
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters (vLLM's flag)")
    p.add_argument("--max-loras", type=_positive, default=None, help="adapters running at a time (default 1)")
    p.add_argument("--max-lora-rank", type=_positive, default=None, help="largest adapter rank (default 16)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapters served under their names (name=path or vLLM's JSON object form)")
    p.add_argument("--data-parallel-size", "-dp", type=_positive, default=None,
                   help="engine replicas behind this server, each with its own KV cache and scheduler (default 1)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                   help="where the replicas run: mp (local processes on disjoint cores, the default) or ray "
                        "(Ray actors in placement groups: `ray start --head` first; pip install 'jitkern[distributed]')")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own (as vLLM's engine core), apart from the HTTP "
                        "threads; default: on where the device is CUDA")
    p.add_argument("--api-server-count", type=_positive, default=None, metavar="N",
                   help="HTTP worker processes in front of the one engine process (vLLM's flag; default 1): each "
                        "has its own interpreter for the per-token work of its streams, so more serve more "
                        "concurrent streams; N > 1 runs the engine in its own process")
    p.add_argument("-v", "--verbose", action="store_true", help="verbose logging (and gunicorn's access log)")
    for flag in INERT_FLAGS:
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return p


def _lora_modules_json(items):
    if not items:
        return None
    from server.lora import parse_lora_modules
    return json.dumps(parse_lora_modules(items))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        model=args.model, served_model_name=args.served_model_name, tokenizer_config=args.tokenizer_config,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, max_model_len=args.max_model_len or None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens or None,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode, seed=args.seed, enable_jump_forward=args.enable_jump_forward,
        speculative_config=args.speculative_config, task=args.task, generation_config=args.generation_config,
        tensor_parallel_size=args.tensor_parallel_size, kv_events_config=args.kv_events_config,
        itl_target_ms=args.itl_target_ms, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, lora_modules=_lora_modules_json(args.lora_modules),
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, engine_process=args.engine_process,
        api_server_count=args.api_server_count,
        # the flag, else JITKERN_DEVICE from the environment (`python -m server` clears the other JITKERN_* names)
        device=args.device or os.environ.get("JITKERN_DEVICE") or None,
        gpu_memory_utilization=args.gpu_memory_utilization, api_key=args.api_key or os.environ.get("JITKERN_API_KEY"),
        log_requests=args.log_requests, log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
        enable_metrics=args.enable_metrics, verbose=args.verbose, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, enable_thinking=args.enable_thinking,
        max_body_bytes=args.max_body_bytes or ServerSettings.max_body_bytes)


def gunicorn_command(args: argparse.Namespace) -> tuple[list, dict]:
    """(argv, environment) that start gunicorn serving these settings."""
    settings = settings_from_args(args)
    env = dict(os.environ)
    # Start from a clean slate of engine/server variables: the flags say everything.
    for name in list(env):
        if name.startswith("JITKERN_") and name[len("JITKERN_"):].lower() in ServerSettings._KINDS \
                and name not in ("JITKERN_ENGINE_FACTORY", "JITKERN_SSE_PING_S", "JITKERN_DRAIN_TIMEOUT_S"):
            del env[name]
    env.update(settings.to_env())
    env["JITKERN_HOST"] = args.host
    env["JITKERN_PORT"] = str(args.port)
    if args.threads:
        env["JITKERN_THREADS"] = str(args.threads)
    if args.graceful_timeout:
        env["JITKERN_GRACEFUL_TIMEOUT"] = str(args.graceful_timeout)
    # The repo root (or wherever `server` is installed) must be importable from gunicorn's worker.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [sys.executable, "-m", "gunicorn", "--config", "python:server.gunicorn_conf", "server.app"]
    return argv, env


def main(argv: list | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in INERT_FLAGS:
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            print(f"note: {flag} has no effect on this server", file=sys.stderr)
    if args.model is not None and not Path(args.model).exists():
        # A hub id is fetched here, before gunicorn (its progress bar on this terminal); the worker then finds
        # it in the cache.
        from engine.errors import ModelLoadError
        from engine.hub import resolve_model
        try:
            resolve_model(args.model)
        except ModelLoadError as e:
            parser.error(f"--model {e}")
    if args.tokenizer_config is not None and not Path(args.tokenizer_config).is_file():
        parser.error(f"--tokenizer-config {args.tokenizer_config}: no such file")
    if args.speculative_config is not None:
        from engine.spec_decode import SpeculativeConfig, SpeculativeConfigError
        try:
            SpeculativeConfig.parse(args.speculative_config)
        except SpeculativeConfigError as e:
            parser.error(f"--speculative-config: {e}")
    if args.lora_modules:
        from server.lora import parse_lora_modules
        try:
            parse_lora_modules(args.lora_modules)
        except ValueError as e:
            parser.error(str(e))
        if not args.enable_lora:
            parser.error("--lora-modules needs --enable-lora")
    if args.tensor_parallel_size not in (None, 1):      # the engine's one decision, before gunicorn starts
        from engine.parallel.config import TensorParallelError, check_tensor_parallel
        try:
            check_tensor_parallel(args.tensor_parallel_size, "auto")
        except TensorParallelError as e:
            parser.error(f"--tensor-parallel-size: {e}")
    if (args.api_server_count or 1) > 1:
        # the API processes share one engine process (server/shared_engine.py), one replica without adapters
        from server.shared_engine import refusal
        why = refusal(settings_from_args(args))
        if why is not None:
            parser.error(why)
    command, env = gunicorn_command(args)
    # JITKERN_* settings (from the environment and the flags above) are checked here, before gunicorn and
    # the model load: one line naming the setting, exit 2
    from engine.settings import check_environment as check_engine_environment
    from jitkern.env import SettingError, check_environment
    try:
        check_environment(environ=env)
        check_engine_environment(environ=env)
    except SettingError as e:
        parser.exit(2, f"python -m server: error: {e}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)
    return 0   # not reached
