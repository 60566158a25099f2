"""Default sampling settings from a checkpoint's generation_config.json (vLLM's `--generation-config auto`).

vLLM (`ModelConfig.get_diff_sampling_param`) takes these keys from generation_config.json and uses them for
every field a request leaves unset: repetition_penalty, temperature, top_k, top_p, min_p, and max_new_tokens
(as max_tokens). `--generation-config vllm` turns that off (vLLM's own defaults only). A missing file gives
no defaults; a malformed one is logged and ignored (the model still serves with vLLM's defaults).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("engine")

# generation_config.json key -> SamplingParams field
_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")


def load_generation_defaults(model_path, mode: str = "auto") -> dict:
    """{SamplingParams field: value} from `model_path`'s generation_config.json.

    mode "auto": the checkpoint's file (a directory holding generation_config.json, or the directory of a
    single-file checkpoint); "vllm": none; any other string: a directory holding generation_config.json."""
    if mode == "vllm" or model_path is None and mode == "auto":
        return {}
    if mode == "auto":
        p = Path(model_path)
        folder = p if p.is_dir() else p.parent
    else:
        folder = Path(mode)
        if not folder.is_dir():
            raise ValueError(f"generation_config {mode!r} is neither 'auto', 'vllm' nor a directory")
    f = folder / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", f, e)
        return {}
    out = {}
    for key, field_name in _KEYS.items():
        v = cfg.get(key)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[field_name] = int(v) if field_name in ("top_k", "max_tokens") else float(v)
    if out:
        log.info("default sampling settings from %s: %s (--generation-config vllm turns them off)",
                 os.fspath(f), out)
    return out
