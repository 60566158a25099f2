"""The synchronous engine: requests in, `RequestOutput`s out, one `step()` at a time (vLLM V1's shape).

    add_request -> Scheduler (paged KV, chunked prefill, prefix cache, preemption)
    step()      -> schedule -> ModelRunner (jitkern kernels) -> Sampler -> Scheduler.update_from_output
                -> detokenize, stop strings, logprobs -> RequestOutput per request that changed

`n > 1` fans a request out into n sequences (`<id>#<i>`) that share the prompt (and, through the
prefix cache, its KV blocks).

Admission is split in two so that the costly half runs in the caller's thread: `prepare_request`
(tokenise, validate against the model, build the logit edits and detokenizers; touches no engine state)
and `add_prepared` (register with the scheduler; cheap, on the engine thread).

One request never fails another: if the model step or sampling raises for a batch, each request is run
alone to find the one at fault; that request (all its sequences) finishes with finish_reason "error" and
a generic message (the exception goes to the log), its KV blocks are freed, and the others go on. The
same holds for a failure while turning one request's tokens into output.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from engine import limits
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.logit_edits import LogitEdits
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

log = logging.getLogger("engine")


@dataclass
class EngineArgs:
    model: Optional[str] = None                 # None: the embedded SmolLM2
    tokenizer_config: Optional[str] = None
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None       # bytes for the KV pool when num_blocks is not given
    # "auto" (f16 for 16-bit or quantised weights, f32 for f32 ones: engine.sizing.resolve_kv_cache_dtype) |
    # "f32" / "float32" / "fp32" | "f16" / "float16" / "fp16"; the engine's own args hold the resolved "f32" / "f16"
    kv_cache_dtype: str = "auto"
    max_model_len: Optional[int] = None
    # None: engine.sizing.default_batch_limits for the resolved device (the CPU: 64 and 2048; CUDA: vLLM's 256
    # and a token budget by usage_context and card memory); the engine's own args hold the resolved numbers
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    # vLLM's --gpu-memory-utilization: on CUDA, without num_blocks / kv_cache_memory, the fraction of the card's
    # memory this engine may hold; weights and the activation reserve are measured, the rest is KV blocks
    gpu_memory_utilization: float = 0.9
    # vLLM's UsageContext, for the CUDA default of max_num_batched_tokens: "llm_class" (offline batches: LLM,
    # the engine CLI) or "openai_api_server" (the server)
    usage_context: str = "llm_class"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    seed: int = 0
    use_graphs: bool = True                     # replay decode steps as recorded jitkern graphs
    device: str = "auto"                        # "auto" | "cpu" | "cuda" (engine.device)
    # GPU compute precision of 16-bit checkpoints (vLLM's dtype): "auto" = the checkpoint's 16-bit type enters the
    # matrix units (as vLLM), "float32" = f32 activations split hi + lo (twice the MMAs); no effect on the CPU
    dtype: str = "auto"
    # vLLM's --tensor-parallel-size; engine.parallel.config decides whether it can run here
    tensor_parallel_size: int = 1
    tensor_parallel_backend: str = "auto"       # "cpu-pipes": CPU ranks over pipes (tests of the runtime only)
    # vLLM's --speculative-config: a JSON string or dict (engine.spec_decode.SpeculativeConfig); None: off
    speculative_config: object = None
    # structured outputs: tokens a request's grammar forces are appended without a forward step each
    enable_jump_forward: bool = False
    # vLLM's --task: "auto" (embed for a checkpoint without an LM head, see engine.pooling), "generate", "embed"
    task: str = "auto"
    # vLLM's --generation-config: "auto" (generation_config.json's sampling defaults), "vllm" (none), or a folder
    generation_config: str = "auto"
    # CUDA: build a step's outputs (detokenisation, stop strings, logprob dicts, RequestOutputs) during the next
    # step() call, while the GPU runs that step (LLMEngine.step). None: the environment variable
    # JITKERN_OVERLAP_OUTPUT ("0" off, "1" on), else on for device "cuda" and off elsewhere (on the CPU the
    # kernels run in the engine's thread: nothing to overlap). Never with speculative decoding.
    overlap_output: Optional[bool] = None
    # vLLM's --logprobs-mode: which tensor returned logprobs are read from (engine.logits_process.LOGPROBS_MODES):
    # raw_logprobs (default) / raw_logits before any processing, processed_logprobs / processed_logits as sampled
    logprobs_mode: str = "raw_logprobs"
    # vLLM v1's engine-wide logits processors: LogitsProcessor subclasses (built once with the engine) or
    # instances (engine/logits_process.py)
    logits_processors: Optional[list] = None
    # vLLM's --kv-events-config: a JSON string, dict or engine.kv_events.KVEventsConfig; None: no KV-cache events
    kv_events_config: object = None
    # Fairness: while prompts prefill beside running streams, each step's prefill tokens are sized from measured
    # step times so a step takes about this long (engine.scheduler.PrefillBudget); the streams' inter-token
    # latency. 0: off (only max_num_batched_tokens bounds a step). None: DEFAULT_ITL_TARGET_MS for the server
    # (usage_context "openai_api_server") off CUDA, where one step of a 2048-token chunk deep in a long prompt
    # takes seconds; off for offline batches (LLM, the engine CLI: throughput, not latency) and on CUDA.
    itl_target_ms: Optional[float] = None
    # vLLM's --enable-lora / --max-loras / --max-lora-rank: LoRA adapters per request (engine.lora); max_loras
    # adapters run at a time, each of rank at most max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's --data-parallel-size / --distributed-executor-backend ("mp" | "ray"; None: mp): N > 1 replicas of
    # this engine behind one front end (engine.data_parallel); LLM and the server build that front end, an
    # LLMEngine itself is always one replica
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None


# The KV pool's bytes without num_blocks / kv_cache_memory where the device's free memory is not measured: the
# CPU, Vulkan (its runtime has heap sizes but no free-memory query: VK_EXT_memory_budget is not used), and a
# stand-in device that reports no memory
_DEFAULT_KV_MEMORY = 1 << 30
# The server's default step-time target off CUDA (EngineArgs.itl_target_ms): 5 tokens/s per stream at worst
# while a long prompt prefills; a decode-only step of 8 SmolLM2-135M streams takes ~20 ms on 2 cores.
DEFAULT_ITL_TARGET_MS = 200.0
# What a request is told when the engine failed on it; the exception itself goes to the log only.
INTERNAL_ERROR = "internal error while running this request (the server log has the details)"


@dataclass
class _SeqState:
    """Per-sequence output state (one per n)."""
    index: int
    request: Request
    detok: object
    params: SamplingParams
    text: str = ""
    sent_text_len: int = 0
    token_ids: list = field(default_factory=list)
    sent_tokens: int = 0
    logprobs: Optional[list] = None
    sent_logprobs: int = 0
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    stop_buffer: int = 0


@dataclass
class _ReqState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    seqs: list
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None
    stream: bool = True
    error: Optional[str] = None


@dataclass
class PreparedRequest:
    """A request checked and built in the caller's thread, ready for `LLMEngine.add_prepared`."""
    request_id: str
    text: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    seqs: list                                  # _SeqState per n, each holding its scheduler Request
    arrival: float
    stream: bool = True


class LLMEngine:
    overlap_output = False        # (set per engine in __init__; class defaults for engines built without it)
    _pending = None
    kv_events_publisher = None

    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        from engine.default_model import default_model_path
        from engine.loader import load_checkpoint
        from engine.models import build_model
        from engine.model_runner import ModelRunner
        from engine.sampler import Sampler
        from engine.sizing import (KV_DTYPE_BYTES, check_gpu_memory_utilization, default_batch_limits,
                                   kv_block_bytes, kv_cache_dtype_name, kv_cache_log_line, num_blocks_for_memory,
                                   resolve_kv_cache_dtype, resolve_max_model_len)
        kv_cache_dtype_name(args.kv_cache_dtype)        # a bad spelling fails before the slow load
        from engine.logits_process import EngineConfigView, build_engine_processors, check_logprobs_mode
        check_logprobs_mode(args.logprobs_mode)
        if args.logits_processors and args.speculative_config is not None:
            # the verifier computes the target distribution itself and would skip them
            raise ValueError("logits_processors cannot be combined with speculative_config (speculative "
                             "decoding does not run engine-wide logits processors)")
        from engine.kv_events import KVEventsConfig
        kv_events = KVEventsConfig.parse(args.kv_events_config)     # (so does a bad --kv-events-config)
        if args.enable_lora:
            from engine.lora import check_lora_args
            check_lora_args(args)               # (and LoRA settings the engine cannot serve)
        gpu_util = check_gpu_memory_utilization(args.gpu_memory_utilization)
        default_batch_limits("cpu", args.usage_context)  # a bad usage_context fails before the load too
        # A Hugging Face id (Qwen/Qwen3-0.6B) becomes its cached or downloaded folder; a local path stays as it is.
        from engine.hub import resolve_model
        path = resolve_model(args.model) if args.model else str(default_model_path())
        spec_cfg = None
        if args.speculative_config is not None:
            from engine.spec_decode import SpeculativeConfig
            spec_cfg = SpeculativeConfig.parse(args.speculative_config)   # before the slow load
        from engine.parallel.config import check_tensor_parallel
        self.tensor_parallel_size = check_tensor_parallel(args.tensor_parallel_size, args.device,
                                                          backend=args.tensor_parallel_backend)   # before the load
        t0 = time.perf_counter()
        # the device's (free, total) memory before anything of this engine is on it (None: not measured, see
        # _memory_device): the card's size picks the default token budget, and without num_blocks /
        # kv_cache_memory the weights' share of the KV sizing is what the load takes from the free bytes
        mem_dev = self._memory_device(args) if self.tensor_parallel_size == 1 else None
        mem_at_start = mem_dev.mem_info() if mem_dev is not None else None
        self.checkpoint = ckpt = load_checkpoint(path, tokenizer_config=args.tokenizer_config)
        self.config = cfg = ckpt.config
        self.tokenizer = ckpt.tokenizer
        from engine.models.whisper import is_whisper
        if is_whisper(cfg):             # speech recognition: no paged engine (engine.transcription runs it)
            self._init_transcription(args, ckpt, path, t0)
            return
        from engine.generation_defaults import load_generation_defaults
        from engine.pooling import adapt_for_embedding, resolve_task
        self.task = resolve_task(args.task, ckpt.path)
        if self.task == "embed":
            adapt_for_embedding(ckpt)
        self.default_sampling = load_generation_defaults(ckpt.path, args.generation_config)
        # The KV cache's element type, decided once here from the checkpoint's weights ("auto": f16 for 16-bit or
        # quantised weights, f32 for f32 ones); everything after (the model's caches, the pool's sizing, the
        # tensor-parallel ranks, a draft model) and self.args (/server_info) see only "f32" or "f16". The
        # caller's EngineArgs is not changed (it may build another engine on another checkpoint).
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, ckpt.weight_kinds())
        if kv_dtype != args.kv_cache_dtype:
            args = self.args = dataclasses.replace(args, kv_cache_dtype=kv_dtype)
        if self.tensor_parallel_size > 1:         # rank 0 here, ranks 1.. in their own processes
            from engine.parallel.runtime import start_ranks
            self.model = start_ranks(path, world=self.tensor_parallel_size, kv_dtype=kv_dtype,
                                     backend=args.tensor_parallel_backend, ckpt=ckpt)
        else:
            self.model = build_model(ckpt, kv_dtype=kv_dtype, device=args.device, dtype=args.dtype)
        device_kind = getattr(self.model, "device", "cpu")
        # image input (engine.multimodal): a model with a vision tower (LLaVA) takes prompts with images
        self.image_inputs = None
        if getattr(self.model, "vision", None) is not None:
            from engine.multimodal import ImageInputs
            self.image_inputs = ImageInputs(self.model, ckpt.path, self.tokenizer)
        self.lora = None
        if args.enable_lora:
            from engine.lora import enable_lora
            self.lora = enable_lora(self, args)
        seqs, tokens = default_batch_limits(device_kind, args.usage_context,
                                            mem_at_start[1] if mem_at_start is not None else None)
        if args.max_num_seqs is None or args.max_num_batched_tokens is None:
            args = self.args = dataclasses.replace(
                args, max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else seqs,
                max_num_batched_tokens=args.max_num_batched_tokens if args.max_num_batched_tokens is not None
                else tokens)
        dsize = KV_DTYPE_BYTES[kv_dtype]
        per_block = kv_block_bytes(self.model.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, dsize) \
            if not hasattr(self.model, "kv_block_bytes") else self.model.kv_block_bytes(args.block_size, dsize)
        self.gpu_memory = None        # the GpuMemoryProfile the pool was sized by (CUDA without an override)
        self._reserved_buffers = None  # the measuring runner's device buffers, for the real runner
        if args.num_blocks:
            num_blocks = args.num_blocks
        elif args.kv_cache_memory:
            num_blocks = num_blocks_for_memory(args.kv_cache_memory, per_block)
        elif mem_at_start is not None and device_kind == "cuda":
            num_blocks = self._gpu_num_blocks(mem_dev, mem_at_start, gpu_util, per_block, cfg)
        else:
            num_blocks = num_blocks_for_memory(_DEFAULT_KV_MEMORY, per_block)
        sizing = resolve_max_model_len(num_blocks, args.block_size, args.max_model_len, cfg.max_position_embeddings)
        log.info("%s", kv_cache_log_line(num_blocks, args.block_size, per_block, sizing.max_model_len))
        self.max_model_len = sizing.max_model_len
        if hasattr(self.model, "set_max_model_len"):        # Phi-3 LongRoPE picks its factors from it
            self.model.set_max_model_len(self.max_model_len)
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                                 kv_events=bool(kv_events and kv_events.enabled))
        self.kv_events_publisher = None
        if kv_events is not None and kv_events.enabled:
            from engine.kv_events import make_publisher
            self.kv_events_publisher = make_publisher(kv_events)
        # Sampling params and prompt ids are validated by prepare_request, in the caller's thread; the
        # scheduler does not repeat that on the engine thread (no vocab_size in its config).
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
            max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
            max_loras=args.max_loras if self.lora is not None else 0), self.kv)
        itl = args.itl_target_ms
        if itl is None:
            itl = DEFAULT_ITL_TARGET_MS if args.usage_context == "openai_api_server" and device_kind != "cuda" else 0
        if itl < 0 or itl != itl:
            raise ValueError(f"itl_target_ms must be >= 0 (0: off), got {args.itl_target_ms!r}")
        self.itl_target_ms = float(itl)
        if itl > 0:
            from engine.scheduler import PrefillBudget
            self.scheduler.prefill_budget = PrefillBudget(itl / 1000.0, max(args.max_num_batched_tokens, 1))
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=args.block_size,
                                  max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
                                  max_model_len=self.max_model_len,
                                  # a LoRA step's tiles (grids) change with its adapters: no recorded graphs
                                  use_graphs=args.use_graphs and self.lora is None,
                                  device_buffers=self._reserved_buffers)
        self.runner.lora = self.lora
        self._reserved_buffers = None
        self.stop_ids = tuple(ckpt.stop_token_ids or cfg.eos_token_ids or ())
        procs = build_engine_processors(
            args.logits_processors, EngineConfigView(cfg.vocab_size, args.max_num_seqs, model_config=cfg,
                                                     engine_args=args, eos_token_ids=self.stop_ids),
            getattr(self.model, "device", "cpu"))
        # plain greedy steps pick their tokens where the logits are, unless an engine-wide processor could change
        # a pick (it must then see every row on the host)
        self.runner.device_greedy = all(p.is_argmax_invariant() for p in procs)
        self.runner.reserve_buffers()             # the largest steps' buffers now: none moves under a graph later
        self.sampler = Sampler(cfg.vocab_size, seed=args.seed, tokenizer=self.tokenizer,
                               logprobs_mode=args.logprobs_mode, logits_processors=procs)
        self.spec = None
        if spec_cfg is not None:
            from engine.spec_decode import SpecDecoder
            self.spec = SpecDecoder(spec_cfg, self)
        from engine.structured_outputs import GrammarCompiler
        self.grammar_compiler = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.stop_ids)
        self.sampler.grammar_compiler = self.grammar_compiler
        self._reqs: dict[str, _ReqState] = {}
        self._seq_of: dict[str, tuple] = {}          # scheduler id -> (request id, seq index)
        self.overlap_output = self._resolve_overlap(args.overlap_output)
        self._pending = None          # overlap_output: the last step's output work, done during the next step
        self._counter = itertools.count()
        self.load_seconds = time.perf_counter() - t0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}
        # "Type: message" of the last exception a model step raised (requests are told only INTERNAL_ERROR;
        # the server's warm-up names it when it fails the start)
        self.last_step_error: Optional[str] = None
        log.info("engine ready: %s, %d KV blocks x %d tokens (%s), max_model_len %d%s, load %.2fs", path,
                 num_blocks, args.block_size, kv_dtype, self.max_model_len,
                 " (auto-fitted)" if sizing.auto_fitted else "", self.load_seconds)

    def _init_transcription(self, args, ckpt, path, t0) -> None:
        """A Whisper checkpoint: the model and its Transcriber (engine.transcription), requests through
        `transcribe`; text generation is refused (prepare_request) and there is no KV pool or scheduler."""
        from engine.models import build_model
        from engine.transcription import Transcriber
        if args.task not in ("auto", "transcription"):
            raise ValueError(f"task {args.task!r}: a Whisper checkpoint is a speech recognition model (task "
                             "'auto' or 'transcription')")
        self.task = "transcription"
        self.model = build_model(ckpt, device=args.device)
        self.transcriber = Transcriber(self.model, self.tokenizer, ckpt.path)
        self.default_sampling = {}
        self.image_inputs = self.lora = self.spec = self.kv = self.scheduler = self.runner = None
        self.max_model_len = self.model.cfg.max_target_positions
        self.num_blocks = 0
        self.stop_ids = (self.transcriber.gen.eos,)
        self._reqs, self._seq_of = {}, {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}
        self.last_step_error = None
        self.load_seconds = time.perf_counter() - t0
        log.info("engine ready: %s, speech recognition (Whisper, %d mels, %.0f s windows), load %.2fs", path,
                 self.model.cfg.num_mel_bins, self.transcriber.features.seconds, self.load_seconds)

    def transcribe(self, audio, **kwargs):
        """Speech to text with a Whisper checkpoint (engine.transcription.Transcriber.transcribe)."""
        tr = getattr(self, "transcriber", None)
        if tr is None:
            raise InvalidRequestError("this model does not do transcription (it is not a Whisper speech "
                                      "recognition model)", param="model")
        out = tr.transcribe(audio, **kwargs)
        self.stats["generation_tokens"] += len(out.token_ids)
        return out

    @staticmethod
    def _memory_device(args):
        """The runtime device whose memory is measured, or None where nothing is: not CUDA (the CPU; Vulkan
        keeps _DEFAULT_KV_MEMORY) or a device without a memory query (a stand-in that reports none). Resolving
        the device here is what build_model does next (a cached device)."""
        from engine.device import resolve_device
        try:
            if resolve_device(args.device) != "cuda":
                return None
        except Exception:       # noqa: BLE001 - build_model reports a bad or missing device with its one line
            return None
        from jitkern.runtime import cuda
        dev = cuda.get_device(0)
        query = getattr(dev, "mem_info", None)
        return dev if query is not None and query() is not None else None

    def _gpu_num_blocks(self, dev, mem_at_start, utilization: float, per_block: int, cfg) -> int:
        """KV blocks for what is left of utilization x the card once the weights are loaded and the activation
        buffers reserved (vLLM's profile run). The reserve runs on a throwaway runner over a one-block cache
        with the longest context this engine could serve (the given max_model_len, else the model's: an
        auto-fitted one is shorter and needs no more); its buffers go back to the allocator's pool, which
        keeps them for the real runner's, built afterwards as on the other devices."""
        from engine.model_runner import ModelRunner
        from engine.sizing import GpuMemoryProfile, fmt_bytes, gpu_num_blocks
        args = self.args
        free_after_weights, total = dev.mem_info()
        longest = args.max_model_len or cfg.max_position_embeddings or max(args.max_num_batched_tokens, 1)
        probe = ModelRunner(self.model, num_blocks=1, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=max(args.max_num_batched_tokens, 1), max_model_len=longest,
                            use_graphs=args.use_graphs)
        try:
            if not probe.reserve_buffers(measure=True):
                log.warning("the activation buffers were not measured (see above): the KV cache takes what the "
                            "weights leave of gpu_memory_utilization; lower it if large steps run out of memory")
            dev.synchronize()
            free_after_reserve, _ = dev.mem_info()
            self._reserved_buffers = probe.fwd_batch.buffers
            from engine.model_runner import BufferPool
            probe.fwd_batch.buffers = BufferPool()      # (so close() leaves the handed-over buffers alone)
        finally:
            probe.close()
        # the probe's step inputs go back to the pool now, for the real runner's (the runner and its prefill
        # graphs refer to each other: without a collection they would stay allocated beside the new ones)
        del probe
        import gc
        gc.collect()
        prof = self.gpu_memory = GpuMemoryProfile(total=total, free_at_start=mem_at_start[0],
                                                  free_after_weights=free_after_weights,
                                                  free_after_reserve=free_after_reserve)
        num_blocks = gpu_num_blocks(prof, utilization, per_block, args.block_size, args.max_model_len)
        log.info("GPU memory: total %s x gpu_memory_utilization %g; weights %s, activation reserve %s, in use "
                 "after both %s; KV cache %s (%d blocks of %s)", fmt_bytes(total), utilization,
                 fmt_bytes(prof.weights), fmt_bytes(prof.activation_reserve), fmt_bytes(prof.in_use),
                 fmt_bytes(num_blocks * per_block), num_blocks, fmt_bytes(per_block))
        return num_blocks

    def _resolve_overlap(self, asked) -> bool:
        if asked is None:
            from engine.settings import overlap_output
            env = overlap_output()              # a bad value: SettingError naming the variable
            asked = env if env is not None else getattr(self.runner, "device", "cpu") == "cuda"
        if asked and self.spec is not None:
            log.warning("overlap_output is off: speculative decoding runs its steps synchronously")
            return False
        return bool(asked)

    # ----------------------------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt) -> tuple:
        """(text or None, token ids) for a str prompt or a list of token ids."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError("the prompt is not valid Unicode text (it contains a lone surrogate)",
                                          param="prompt") from None
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {self.config.vocab_size})",
                                          param="prompt")
            return None, list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, stream: bool = True, lora_request=None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority=priority,
                                               arrival_time=arrival_time, stream=stream, lora_request=lora_request))

    def prepare_request(self, request_id: str, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                        arrival_time: float | None = None, stream: bool = True,
                        lora_request=None) -> PreparedRequest:
        """Everything admission needs that does not touch engine state: safe in any thread, linear in the
        request's size. Raises InvalidRequestError (param names the field) for anything the engine would
        refuse or could fail on."""
        if getattr(self, "task", "generate") == "embed":
            raise InvalidRequestError("this model is served for embeddings (--task embed): text generation is "
                                      "not available; use /v1/embeddings or LLM.embed", param="model")
        if getattr(self, "task", "generate") == "transcription":
            raise InvalidRequestError("this model is a speech recognition model (Whisper): text generation is not "
                                      "available; use /v1/audio/transcriptions or LLM.transcribe", param="model")
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request id must be a non-empty string", param="request_id")
        images = []
        if isinstance(prompt, dict):        # vLLM's prompt dicts, possibly with multi_modal_data
            prompt, images = self._prompt_dict(prompt)
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        mm_inputs = []
        if images:
            # each image token becomes the image's feature rows (engine.multimodal)
            ids, mm_inputs = self.image_inputs.prepare(ids, images)
        params.validate(self.config.vocab_size, self.args.max_logprobs)
        adapter = self._lora_adapter(lora_request) if lora_request is not None else None
        if params.extra_args is not None:
            from engine.kv_events import check_report_mode
            try:
                check_report_mode(params.extra_args)
            except ValueError as e:
                raise InvalidRequestError(str(e), param="extra_args") from None
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the maximum context length is {self.max_model_len} "
                f"tokens (the prompt must be shorter to leave room for output)", param="prompt")
        edits = LogitEdits.build(params, vocab_size=self.config.vocab_size, eos_token_ids=self.stop_ids,
                                 tokenizer=self.tokenizer)
        so = params.structured_outputs
        grammars = [self.grammar_compiler.matcher(so, self.args.enable_jump_forward) for _ in range(params.n)] \
            if so is not None else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            # A shallow copy per sequence: the lists (allowed ids, bad words, ...) are shared, never changed.
            p = copy.copy(params)
            p.n = 1
            if params.seed is not None and params.n > 1:
                p.seed = (params.seed + i) % (limits.MAX_SEED + 1)
            sid = request_id if params.n == 1 else f"{request_id}#{i}"
            r = Request(sid, ids, p, arrival_time=arrival, priority=priority, eos_token_ids=self.stop_ids)
            r.logit_edits = edits
            r.grammar = grammars[i] if grammars else None
            r.lora = adapter
            r.mm_inputs = mm_inputs
            detok = self.tokenizer.detokenizer(skip_special_tokens=p.skip_special_tokens, prompt_ids=ids) \
                if p.detokenize else None
            st = _SeqState(i, r, detok, p, logprobs=[] if p.logprobs is not None else None,
                           cumulative_logprob=0.0 if p.logprobs is not None else None)
            if p.stop and not p.include_stop_str_in_output:
                st.stop_buffer = max(len(s) for s in p.stop) - 1
            seqs.append(st)
        return PreparedRequest(request_id, text, ids, params, seqs, arrival, stream=stream)

    def _prompt_dict(self, prompt: dict) -> tuple:
        """(str or token ids, PIL images) of a vLLM prompt dict: {"prompt": str} or {"prompt_token_ids": [...]},
        with optional {"multi_modal_data": {"image": image or [images]}}."""
        from engine.multimodal import images_of
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown:
            raise InvalidRequestError(f"unknown prompt field {unknown[0]!r} (prompt, prompt_token_ids, "
                                      "multi_modal_data)", param=unknown[0])
        if "prompt_token_ids" in prompt:
            body = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            body = prompt["prompt"]
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        mm = prompt.get("multi_modal_data")
        images = images_of(mm) if mm is not None else []
        if images and getattr(self, "image_inputs", None) is None:
            raise InvalidRequestError("this model does not take image input", param="multi_modal_data")
        return body, images

    def _lora_adapter(self, lora_request):
        """The loaded adapter of a LoRARequest (engine.lora; loaded from its path the first time)."""
        from engine.lora import LoRAError
        if self.lora is None:
            raise InvalidRequestError("this engine was started without LoRA support: pass enable_lora=True "
                                      "(--enable-lora) to use lora_request", param="lora_request")
        try:
            return self.lora.get_or_load(lora_request)
        except LoRAError as e:
            raise InvalidRequestError(str(e), param="lora_request") from None

    def add_prepared(self, prep: PreparedRequest) -> None:
        """Registers a prepared request with the scheduler (the engine thread's share of admission)."""
        if prep.request_id in self._reqs:
            raise InvalidRequestError(f"request id {prep.request_id!r} is already in use", param="request_id")
        added = []
        try:
            for st in prep.seqs:
                self.scheduler.add_request(st.request)   # checks the length again; raises before keeping it
                added.append(st.request.request_id)
        except BaseException:
            for sid in added:
                self.scheduler.abort_request(sid)
            raise
        self._reqs[prep.request_id] = _ReqState(prep.request_id, prep.text, prep.prompt_token_ids, prep.params,
                                                prep.seqs, RequestMetrics(prep.arrival), stream=prep.stream,
                                                prompt_logprobs=None)
        for st in prep.seqs:
            self._seq_of[st.request.request_id] = (prep.request_id, st.index)

    def abort_request(self, request_id: str) -> bool:
        rs = self._reqs.pop(request_id, None)
        if rs is None:
            return False
        for st in rs.seqs:
            self.scheduler.abort_request(st.request.request_id)
            self._seq_of.pop(st.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list:
        """Runs one scheduler step; returns a RequestOutput for every request that made progress.

        A step is schedule -> launch the forward pass -> wait for it, sample -> Scheduler.update_from_output (the
        token appended, EOS / max_tokens / stop ids applied, blocks freed) -> the output work: detokenisation,
        stop strings, logprob dicts, RequestOutputs. With `overlap_output` (CUDA) the output work of a step runs
        in the next step() call, between launching that call's forward pass and waiting for it, so the GPU does
        not wait on it; step() then returns the previous step's outputs (a call that schedules nothing returns
        the last ones). A stop string found that late finishes a request that is already in the running step:
        that step's token for it is dropped (the scheduler skips finished requests, the sampler draws nothing for
        it), so every request gets the same outputs as without the overlap, one step() call later. (Its blocks
        come back one step later too: when the pool is short, the scheduler may preempt differently for a step;
        tokens stay the same, but an n > 1 request's deltas may be split across outputs differently and
        unseeded sampled requests draw in another order, as with any other change of batch.)"""
        budget = self.scheduler.prefill_budget
        if budget is not None:
            t0 = time.perf_counter()
            try:
                outs = self._step()
            finally:
                budget.observe(time.perf_counter() - t0, self._last_prefill_tokens)
            return outs
        return self._step()

    _last_prefill_tokens = 0

    def _step(self) -> list:
        self._last_prefill_tokens = 0
        if self.spec is not None:
            self.spec.propose(self.scheduler)          # draft tokens for decoding requests
            try:
                sched = self.scheduler.schedule()
            finally:
                self.spec.clear()
        else:
            sched = self.scheduler.schedule()
        outs: list = []
        pending, self._pending = self._pending, None

        def previous_outputs():                        # the last step's output work (overlap_output)
            nonlocal pending
            if pending is not None:
                work, pending = pending, None
                outs.extend(self._finish_outputs(*work))

        changed: dict[str, _ReqState] = {}
        if sched.is_empty:
            previous_outputs()
            self._mark_errored(sched, changed)
            self._publish_kv_events()
            outs.extend(self._emit(changed))
            return outs
        now = time.monotonic()
        sampled = self._run_and_sample(sched, previous_outputs)
        previous_outputs()                             # (done already unless the step raised first)
        self._mark_errored(sched, changed)
        for rid, smp in sampled.items():
            if getattr(smp, "error", None):
                self._fail_sequence(rid, smp.error, changed)
        for s in sched.scheduled:
            ent = self._seq_of.get(s.req_id)
            if ent and self._reqs[ent[0]].metrics.first_scheduled_time is None:
                self._reqs[ent[0]].metrics.first_scheduled_time = now
        self._last_prefill_tokens = sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        self.stats["prompt_tokens"] += self._last_prefill_tokens
        for rid, smp in sampled.items():
            if smp.prompt_logprobs is not None and not getattr(smp, "error", None):
                ent = self._seq_of.get(rid)
                if ent is not None:
                    rs = self._reqs[ent[0]]
                    if ent[1] == 0:
                        try:
                            plps = [self._plp_dict(e) for e in smp.prompt_logprobs]
                        except Exception:  # noqa: BLE001 - this request alone fails
                            log.exception("prompt logprobs of request %s failed", rid)
                            self._fail_sequence(rid, INTERNAL_ERROR, changed)
                            continue
                        if rs.prompt_logprobs is None:
                            rs.prompt_logprobs = [None]
                        rs.prompt_logprobs.extend(plps)
                    changed[rs.request_id] = rs
        updates = self.scheduler.update_from_output(
            sched, {rid: getattr(t, "token_ids", None) or [t.token_id] for rid, t in sampled.items()
                    if t.token_id >= 0 and not getattr(t, "error", None)})
        self._publish_kv_events()
        work = (updates, sampled, time.monotonic(), changed)
        if self.overlap_output:
            self._pending = work if updates or changed else None
        else:
            outs.extend(self._finish_outputs(*work))
        return outs

    def _mark_errored(self, sched, changed: dict) -> None:
        """Requests the scheduler finished with an error (they cannot fit the KV pool)."""
        for r in sched.errored:
            ent = self._seq_of.get(r.request_id)
            if ent:
                rs = self._reqs.get(ent[0])
                if rs is not None:
                    st = rs.seqs[ent[1]]
                    st.finish_reason = "error"
                    rs.error = r.error
                    changed[rs.request_id] = rs

    def _finish_outputs(self, updates, sampled, now: float, changed: dict) -> list:
        """A step's output work: its tokens into text, logprobs and finish states, then the RequestOutputs.
        Requests aborted since the step ran are left out."""
        for u in updates:
            try:
                self._apply_update(u, sampled.get(u.req_id), now, changed)
            except Exception:  # noqa: BLE001 - this request alone fails
                log.exception("output processing of request %s failed", u.req_id)
                self._fail_sequence(u.req_id, INTERNAL_ERROR, changed)
        return self._emit({rid: rs for rid, rs in changed.items() if self._reqs.get(rid) is rs})

    def _run_and_sample(self, sched, host_work=None) -> dict:
        """The model step and sampling for the batch; if that raises, each request alone, so that only the
        request(s) at fault get an error (`SampleResult(-1, error=...)`) and the others their tokens.
        `host_work` runs between launching the step and waiting for it (overlap_output)."""
        from engine.sampler import SampleResult
        try:
            if self.overlap_output and self._runner_splits_steps():
                try:
                    launched = self.runner.launch(sched)
                finally:
                    if host_work is not None:
                        host_work()
                result = self.runner.finish(sched, launched)
            else:
                result = self.runner.execute(sched)
            return self._sample(sched, result)
        except Exception as e:  # noqa: BLE001
            if getattr(e, "fatal", False):        # a tensor-parallel rank died: no request can run
                raise
            self.last_step_error = f"{type(e).__name__}: {e}"
            if len(sched.scheduled) == 1:
                log.exception("the step of request %s failed", sched.scheduled[0].req_id)
                return {sched.scheduled[0].req_id: SampleResult(-1, error=INTERNAL_ERROR)}
            log.warning("a step of %d requests failed; running them one by one to find the one at fault",
                        len(sched.scheduled), exc_info=True)
        out = {}
        for s in sched.scheduled:
            alone = SchedulerOutput(scheduled=[s], num_scheduled_tokens=s.num_tokens)
            try:
                out.update(self._sample(alone, self.runner.execute(alone)))
            except Exception as e:  # noqa: BLE001
                log.exception("the step of request %s failed", s.req_id)
                self.last_step_error = f"{type(e).__name__}: {e}"
                out[s.req_id] = SampleResult(-1, error=INTERNAL_ERROR)
        return out

    def _runner_splits_steps(self) -> bool:
        from engine.model_runner import PLAIN_EXECUTE
        return getattr(getattr(self.runner, "execute", None), "__func__", None) is PLAIN_EXECUTE

    def _sample(self, sched, result) -> dict:
        out = self.sampler.sample(sched, result)
        if result.spec_rows:
            out.update(self.spec.verify(sched, result))     # speculative decoding: accept/reject drafts
        return out

    def _apply_update(self, u, smp, now: float, changed: dict) -> None:
        """One sequence's new tokens into its text, logprobs and finish state."""
        ent = self._seq_of.get(u.req_id)
        if ent is None:
            return
        rs = self._reqs[ent[0]]
        st = rs.seqs[ent[1]]
        if st.request is not u.request:
            return      # (overlap_output) aborted after its step ran, and the id taken again since
        changed[rs.request_id] = rs
        if rs.metrics.first_token_time is None and u.new_token_ids:
            rs.metrics.first_token_time = now
            rs.metrics.num_cached_tokens = max(st.request.num_cached_tokens, 0)
        if u.new_token_ids:
            rs.metrics.last_token_time = now
        self.stats["generation_tokens"] += len(u.new_token_ids)
        for tok in u.new_token_ids:
            st.token_ids.append(tok)
            if st.logprobs is not None and smp is not None:
                st.logprobs.append(self._logprob_dict(smp))
                st.cumulative_logprob += smp.logprob
            if st.detok is not None:
                st.text += st.detok.add(tok)
                if len(u.new_token_ids) > 1 and st.params.stop and not u.finished:
                    # several tokens in one step (speculative decoding): stop where one token at a time would
                    self._check_stop_strings(st)
                    if st.finish_reason is not None:
                        return
        if u.finished:
            st.finish_reason = u.finish_reason
            st.stop_reason = u.stop_reason
            if st.detok is not None:
                st.text += st.detok.flush()
        elif st.params.stop and st.detok is not None:
            self._check_stop_strings(st)

    def _fail_sequence(self, seq_id: str, message: str, changed: dict) -> None:
        """Finishes every sequence of seq_id's request with finish_reason "error" (blocks freed at once)."""
        ent = self._seq_of.get(seq_id)
        if ent is None:
            self.scheduler.finish_request(seq_id, "error")
            return
        rs = self._reqs.get(ent[0])
        if rs is None:
            return
        rs.error = rs.error or message
        for st in rs.seqs:
            if st.finish_reason is None:
                self.scheduler.finish_request(st.request.request_id, "error")
                st.finish_reason = "error"
        changed[rs.request_id] = rs

    def _check_stop_strings(self, st: _SeqState) -> None:
        text = st.text
        window_start = max(0, st.sent_text_len - max(len(s) for s in st.params.stop))
        for s in st.params.stop:
            i = text.find(s, window_start)
            if i >= 0:
                st.text = text[: i + len(s)] if st.params.include_stop_str_in_output else text[:i]
                st.finish_reason = "stop"
                st.stop_reason = s
                self.scheduler.finish_request(st.request.request_id, "stop", stop_reason=s)
                return

    def _logprob_dict(self, smp) -> dict:
        out = {}
        for tid, lp, rank in smp.top_logprobs:
            out[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        if smp.token_id not in out:
            out[smp.token_id] = Logprob(smp.logprob, smp.rank, self.tokenizer.decode([smp.token_id]))
        return out

    def _plp_dict(self, entry) -> dict:
        tid, lp, rank, top = entry
        out = {t: Logprob(l, r, self.tokenizer.decode([t])) for t, l, r in top}
        out.setdefault(tid, Logprob(lp, rank, self.tokenizer.decode([tid])))
        return out

    def _emit(self, changed: dict) -> list:
        outs = []
        now = time.monotonic()
        for rid, rs in changed.items():
            try:
                outs.append(self._output(rs, now))
            except Exception:  # noqa: BLE001 - this request alone fails
                log.exception("building the output of request %s failed", rid)
                self._fail_sequence(rs.seqs[0].request.request_id, INTERNAL_ERROR, {})
                self._forget(rs)
                outs.append(RequestOutput(rid, rs.prompt, rs.prompt_token_ids,
                                          [CompletionOutput(index=st.index, finish_reason="error") for st in rs.seqs],
                                          True, metrics=rs.metrics, error=rs.error))
        return outs

    def _output(self, rs: _ReqState, now: float) -> RequestOutput:
        comps = []
        for st in rs.seqs:
            hold = 0 if st.finish_reason else st.stop_buffer
            visible = len(st.text) - hold
            delta_text = st.text[st.sent_text_len:visible] if visible > st.sent_text_len else ""
            st.sent_text_len = max(st.sent_text_len, visible)
            delta_ids = st.token_ids[st.sent_tokens:]
            st.sent_tokens = len(st.token_ids)
            delta_lp = None
            if st.logprobs is not None:
                delta_lp = st.logprobs[st.sent_logprobs:]
                st.sent_logprobs = len(st.logprobs)
            comps.append(CompletionOutput(
                index=st.index, text=st.text, token_ids=list(st.token_ids),
                cumulative_logprob=st.cumulative_logprob, logprobs=st.logprobs,
                finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_lp))
        finished = all(st.finish_reason is not None for st in rs.seqs)
        if finished:
            rs.metrics.finished_time = now
            self._forget(rs)
        return RequestOutput(rs.request_id, rs.prompt, rs.prompt_token_ids, comps, finished,
                             prompt_logprobs=rs.prompt_logprobs, metrics=rs.metrics, error=rs.error)

    def _forget(self, rs: _ReqState) -> None:
        self._reqs.pop(rs.request_id, None)
        for st in rs.seqs:
            self._seq_of.pop(st.request.request_id, None)

    # ------------------------------------------------------------------------------------ metrics
    def metrics_snapshot(self) -> dict:
        if self.kv is None:             # a transcription engine: no scheduler, no KV pool
            return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                    "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                    "prompt_tokens": self.stats["prompt_tokens"], "generation_tokens": self.stats["generation_tokens"]}
        st = self.kv.stats
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "num_preemptions": self.scheduler.num_preemptions_total,
            "prompt_tokens": self.stats["prompt_tokens"],
            "generation_tokens": self.stats["generation_tokens"],
            **(self.spec.metrics() if self.spec is not None else {}),
        }

    def reset_prefix_cache(self) -> bool:
        if self.scheduler is None:
            return False
        ok = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()        # AllBlocksCleared now, not at the next request's step
        return ok

    def _publish_kv_events(self) -> None:
        """The events the KV cache queued since the last publish, as one KVEventBatch (none if nothing happened)."""
        if self.kv_events_publisher is None:
            return
        events = self.kv.events.take()
        if events:
            from engine.kv_events import new_batch
            self.kv_events_publisher.publish(new_batch(events))

    def close(self) -> None:
        """Frees the KV pool and model buffers; the engine cannot be used afterwards."""
        for rid in list(self._reqs):
            self.abort_request(rid)
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        if self.kv_events_publisher is not None:
            self.kv_events_publisher.shutdown()
            self.kv_events_publisher = None
        if self.spec is not None:
            self.spec.close()
        self.model = None
