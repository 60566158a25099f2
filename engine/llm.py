"""The Python API: `from engine import LLM, SamplingParams`.

    llm = LLM()                                   # the embedded SmolLM2 (device="auto": a CUDA GPU when present)
    llm = LLM("model.gguf", device="cuda")        # or "cpu"; "cuda" without a GPU fails naming the setting
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].outputs[0].text)
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(delta, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])[0]          # a list, one output per conversation
    llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "Hi"}])   # vLLM's prompt forms
    llm.generate({"prompt": "USER: <image>\nWhat is this? ASSISTANT:",       # a vision-language model (LLaVA)
                  "multi_modal_data": {"image": PIL.Image.open("cat.png")}})
    llm.beam_search(["Hello"], BeamSearchParams(beam_width=4, max_tokens=16))   # engine.beam_search
    LLM("embedding-model-dir").embed(["a sentence"])[0].outputs.embedding     # engine.pooling
    LLM("whisper-dir").transcribe("speech.wav", language="en").text            # engine.transcription
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLMClosedError(RuntimeError):
    """The LLM was closed (`llm.close()`, or the end of its `with` block): it has no engine any more."""

    def __init__(self):
        super().__init__("this LLM was closed (llm.close()); create a new one")


class LLM:
    _engine: Optional[LLMEngine] = None     # None before __init__ finished and after close()

    def __init__(self, model: Optional[str] = None, **engine_kwargs):
        # vLLM's constructor spelling (dtype, tensor_parallel_size, enforce_eager, ...): engine.llm_args
        from engine.llm_args import engine_kwargs_from_vllm
        args = EngineArgs(**engine_kwargs_from_vllm({"model": model, **engine_kwargs}))
        if args.data_parallel_size != 1 or args.distributed_executor_backend == "ray":
            from engine.data_parallel import DataParallelEngine     # N replicas, one front end
            self._engine = DataParallelEngine(args)
        else:
            self._engine = LLMEngine(args)
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        # Every method reaches the engine through here, so a closed LLM fails with one clear error instead
        # of an AttributeError on None somewhere inside.
        if self._engine is None:
            raise LLMClosedError()
        return self._engine

    @engine.setter
    def engine(self, value: Optional[LLMEngine]) -> None:
        self._engine = value

    llm_engine = engine           # vLLM's name for it

    @property
    def closed(self) -> bool:
        return self._engine is None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults with generation_config.json's sampling settings on top (--generation-config auto)."""
        return SamplingParams(**getattr(self.engine, "default_sampling", {}))

    def _prompt(self, p):
        """One vLLM prompt (str, token-id list, {"prompt": str} or {"prompt_token_ids": [...]}) -> str | ids."""
        if isinstance(p, dict):
            if p.get("multi_modal_data") is not None:
                return p                    # the engine reads the images (engine.multimodal)
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        return p

    def _next_id(self) -> str:
        return f"llm-{next(self._ids)}"

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """Generates for a batch of prompts (strings or token-id lists); returns outputs in prompt order.
        lora_request: one engine.lora.LoRARequest for every prompt, or a list with one (or None) per prompt."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                      isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        prompts = [self._prompt(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora requests")
        ids = []
        try:
            for p, sp, lr in zip(prompts, params, loras):
                rid = self._next_id()
                self.engine.add_request(rid, p, sp.clone() if hasattr(sp, "clone") else sp,
                                        **({"lora_request": lr} if lr is not None else {}))
                ids.append(rid)
            final: dict[str, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(ids), desc="generating", unit="req")
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [final[r] for r in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *, lora_request=None) -> Iterator[str]:
        """Yields text deltas of one request as they are generated."""
        rid = self._next_id()
        self.engine.add_request(rid, prompt, (sampling_params or SamplingParams()).clone(),
                                **({"lora_request": lora_request} if lora_request is not None else {}))
        try:
            while True:
                done = False
                for out in self.engine.step():
                    if out.request_id == rid:
                        d = out.outputs[0].delta_text
                        if d:
                            yield d
                        done = out.finished
                if done or not self.engine.has_unfinished_requests():
                    return
        finally:
            self.engine.abort_request(rid)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, tools=None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """Renders one conversation (a list of messages) or a list of conversations with the model's chat
        template and generates a reply to each; returns a list of outputs (one per conversation), as vLLM.
        A message's content may be a list of parts: text, and for a model that takes images (LLaVA) OpenAI's
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} or vLLM's {"type": "image_pil",
        "image_pil": PIL.Image} (engine.multimodal.chat_images)."""
        from engine.multimodal import chat_images
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = getattr(self.engine, "image_inputs", None)
        placeholder = inputs.token_text if inputs is not None else None
        prompts = []
        for conv in convs:
            conv, images = chat_images(conv, getattr(self.tokenizer, "chat_template", None), placeholder)
            ids = self.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts, params, *, use_tqdm: bool = False) -> list:
        """vLLM's LLM.beam_search (engine.beam_search): one BeamSearchOutput per prompt."""
        from engine.beam_search import beam_search
        prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
        if 0 <= self.engine.args.max_logprobs < 2 * params.beam_width:
            raise ValueError(f"beam_width {params.beam_width} needs {2 * params.beam_width} logprobs per step; the "
                             f"engine allows max_logprobs={self.engine.args.max_logprobs} (raise it in LLM(...))")
        return beam_search(self._generate_ids, self.engine.tokenizer, [self._prompt(p) for p in prompts], params,
                           eos_token_ids=self.engine.stop_ids, max_model_len=self.engine.max_model_len)

    def _generate_ids(self, prompts: list, sp: SamplingParams) -> list:
        return self.generate(prompts, sp)

    def embed(self, prompts, pooling_params=None, *, use_tqdm: bool = False) -> list:
        """vLLM's LLM.embed for an embedding model (engine.pooling): one EmbeddingRequestOutput per prompt."""
        from engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, embedder_of
        emb = embedder_of(self.engine)
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                      isinstance(prompts[0], int))
        prompts = [self._prompt(p) for p in ([prompts] if single else prompts)]
        ids = [self.engine.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
               for p in prompts]
        vecs = emb.embed(ids, pooling_params)
        return [EmbeddingRequestOutput(self._next_id(), i, EmbeddingOutput(v.tolist())) for i, v in zip(ids, vecs)]

    def transcribe(self, audio, *, sampling_rate: int | None = None, language: str | None = None,
                   prompt: str | None = None, temperature: float = 0.0, seed: int | None = None,
                   max_tokens: int | None = None, task: str = "transcribe"):
        """Speech to text with a Whisper checkpoint (engine.transcription): `audio` is a path or encoded bytes
        (WAV, FLAC, OGG), an (array, sample rate) pair, or an array at `sampling_rate` (default 16 kHz); any rate
        is resampled, channels are averaged. Returns a Transcription (text, language, duration, segments,
        token_ids). language: a code ("en") or None to detect it; prompt: text the transcript continues;
        temperature 0 is greedy, above 0 samples (with `seed`, reproducibly). A list of audios gives a list."""
        kw = dict(sampling_rate=sampling_rate, language=language, prompt=prompt, temperature=temperature,
                  seed=seed, max_tokens=max_tokens, task=task)
        if isinstance(audio, list):
            return [self.engine.transcribe(a, **kw) for a in audio]
        return self.engine.transcribe(audio, **kw)

    def close(self) -> None:
        """Frees the engine (its memory, threads, GPU context); closing twice is harmless."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
