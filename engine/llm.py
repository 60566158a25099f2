"""The Python API: `from engine import LLM, SamplingParams`.

    llm = LLM()                                   # the embedded SmolLM2 (device="auto": a CUDA GPU when present)
    llm = LLM("model.gguf", device="cuda")        # or "cpu"; "cuda" without a GPU fails naming the setting
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].outputs[0].text)
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(delta, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

from engine.llm_engine import EngineArgs, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _next_id(self) -> str:
        return f"llm-{next(self._ids)}"

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates for a batch of prompts (strings or token-id lists); returns outputs in prompt order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                rid = self._next_id()
                self.engine.add_request(rid, p, sp.clone() if hasattr(sp, "clone") else sp)
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

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one request as they are generated."""
        rid = self._next_id()
        self.engine.add_request(rid, prompt, (sampling_params or SamplingParams()).clone())
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

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, add_generation_prompt: bool = True,
             tools=None, chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Renders `messages` with the model's chat template and generates a reply."""
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **(chat_template_kwargs or {}))
        return self.generate([ids], sampling_params)[0]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
