"""The jitkern inference engine. `from engine import LLM, SamplingParams`.

Imports are lazy so that `import engine.tokenizer` (or the server's argument parsing) stays light.
"""
__all__ = ["LLM", "LLMClosedError", "SamplingParams", "StructuredOutputsParams", "LLMEngine", "EngineArgs",
           "AsyncEngine", "RequestOutput", "LoRARequest"]


def __getattr__(name):
    if name in ("LLM", "LLMClosedError"):
        from engine import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from engine.structured_outputs import StructuredOutputsParams
        return StructuredOutputsParams
    if name in ("LLMEngine", "EngineArgs"):
        from engine import llm_engine
        return getattr(llm_engine, name)
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "LoRARequest":
        from engine.lora import LoRARequest
        return LoRARequest
    if name == "RequestOutput":
        from engine.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
