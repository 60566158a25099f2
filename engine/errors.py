"""Errors the loading layer raises: each names the file (and tensor / key) at fault.

They are raised instead of whatever a library raised deep inside (gguf, safetensors, json,
tokenizers, jinja2), so a user sees which file is bad and why, not a traceback into gguf.
"""
from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A checkpoint (or one of its files) cannot be loaded.

    Attributes: ``path`` (the file at fault), ``tensor`` (tensor name, if any), ``key``
    (metadata / config key, if any). ``str(err)`` always contains the path and, when given,
    the tensor name and key.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 tensor: str | None = None, key: str | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        self.key = key
        self.reason = message
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if key is not None and key not in message:
            where.append(f"key {key!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)


def read_json_object(path, required: bool = False) -> dict:
    """A checkpoint's JSON file (config.json, preprocessor_config.json, generation_config.json) as a dict: {} when
    the file is absent and not required; a ModelLoadError naming the file when it is missing but required, cannot
    be read, is not JSON or is not an object."""
    import json
    from pathlib import Path
    path = Path(path)
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} not found", path=path)
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse JSON: {exc}", path=path) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object", path=path)
    return data


class TokenizerLoadError(ModelLoadError):
    """The tokenizer described by a tokenizer.json / GGUF vocabulary cannot be built."""


class ChatTemplateError(ValueError):
    """A chat template failed to compile or raised while rendering.

    ``source`` says where the template came from (a file path, or ``<file>:tokenizer.chat_template``
    for a GGUF's metadata), so the user knows which template to fix or override.
    """

    def __init__(self, message: str, *, source: str):
        self.source = source
        super().__init__(f"chat template from {source}: {message}")


class InvalidRequestError(ValueError):
    """A request (sampling parameters, prompt) is invalid; ``param`` names the offending field.

    Used by the sampling-parameter validation and the scheduler's admission check (the server maps it
    to HTTP 400). Signature: ``InvalidRequestError(message, param=None, value=None)``.
    """

    def __init__(self, message: str, param: str | None = None, value=None):
        self.message = message
        self.param = param
        self.value = value
        text = message if param is None or param in message else f"{message} (param: {param})"
        super().__init__(text)
