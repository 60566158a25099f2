"""The engine's JITKERN_* environment settings, parsed and checked in one place (the compiler's and runtime's are
jitkern/env.py's, the server's server/settings.py's).

The engine reads each where it is used (a bad value raises jitkern.env.SettingError naming the variable); the
command-line tools (engine.cli, the server's CLI, `jitkern build`) call ``check_environment()`` first, before any
model load, and print that message as one line with exit status 2.

Settings (all optional):

    JITKERN_OVERLAP_OUTPUT      0 or 1: the engine's output work overlapped with the next GPU step (default:
                                on for CUDA, off elsewhere; LLM(overlap_output=) and vLLM's
                                disable_async_output_proc take precedence).
    JITKERN_SPEC_ADAPTIVE       0 or 1: speculative decoding drafts by adaptive levels (default 1; 0: always
                                num_speculative_tokens).
    JITKERN_SPEC_BACKOFF        halve, reset or keep: the adaptive draft level after a rejection (default halve;
                                keep: a step that accepted at least half its drafts keeps the level).
    JITKERN_CUDA_GRAPH_MAX_TOKENS  the largest padded token count of a CUDA prefill / mixed step recorded as a
                                graph, an integer >= 0 (default 2048; 0: eager).
"""
from __future__ import annotations

from typing import Optional

from jitkern.env import env_choice, env_int

SETTINGS = ("JITKERN_OVERLAP_OUTPUT", "JITKERN_SPEC_ADAPTIVE", "JITKERN_SPEC_BACKOFF", "JITKERN_CUDA_GRAPH_MAX_TOKENS")


def overlap_output(environ=None) -> Optional[bool]:
    """JITKERN_OVERLAP_OUTPUT as True / False, or None when unset (the engine decides by device)."""
    v = env_choice("JITKERN_OVERLAP_OUTPUT", ("0", "1"), environ)
    return None if v is None else v == "1"


def spec_adaptive(environ=None) -> bool:
    """JITKERN_SPEC_ADAPTIVE: adaptive draft levels (default on)."""
    return env_choice("JITKERN_SPEC_ADAPTIVE", ("0", "1"), environ) != "0"


def spec_backoff(default: str, environ=None) -> str:
    """JITKERN_SPEC_BACKOFF ("halve" | "reset" | "keep"), or `default` when unset."""
    return env_choice("JITKERN_SPEC_BACKOFF", ("halve", "reset", "keep"), environ) or default


def cuda_graph_max_tokens(default: int, environ=None) -> int:
    """JITKERN_CUDA_GRAPH_MAX_TOKENS, or `default` when unset."""
    v = env_int("JITKERN_CUDA_GRAPH_MAX_TOKENS", 0, environ)
    return default if v is None else v


def check_environment(environ=None) -> None:
    """Raise jitkern.env.SettingError for the first engine setting that cannot be used (no model, no compile)."""
    overlap_output(environ)
    spec_adaptive(environ)
    spec_backoff("halve", environ)
    cuda_graph_max_tokens(0, environ)
