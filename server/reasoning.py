"""Reasoning parsers: `<think>...</think>` in the output -> `reasoning_content`, the rest -> `content`.

One parser per choice, fed text pieces as they are generated (special tokens kept, so a `<think>` that
is a special token is still seen); `feed` and `finish` return ("reasoning", text) / ("content", text)
events. A suffix that may still become `</think>` (or a leading `<think>`) is held back.

`--reasoning-parser`:
  deepseek_r1  the output starts inside the reasoning (DeepSeek-R1's template opens `<think>` in the
               prompt); a leading `<think>` is dropped; reasoning runs to `</think>`, and an output that
               never closes it is all reasoning
  qwen3        reasoning only when the output opens with `<think>` or the prompt ends inside an open
               `<think>` (Qwen3-Thinking templates); nothing is reasoning when the request renders the
               template with `enable_thinking: false` (the template then closes an empty think block)
  think_auto   like qwen3, decided from the prompt and the output alone (any `<think>` template)
  auto         think_auto when the chat template mentions `<think>`, else no reasoning parsing

Content right after `</think>` starts at its first non-whitespace character (templates put a blank line
there).
"""
from __future__ import annotations

from typing import Optional

from server.tool_parsers import partial_marker_len

REASONING_PARSERS = ("deepseek_r1", "qwen3", "think_auto")
REASONING_PARSER_CHOICES = REASONING_PARSERS + ("auto", "none")
THINK_START, THINK_END = "<think>", "</think>"
_WS = " \t\r\n"


def detect_reasoning_parser(template_text: str) -> Optional[str]:
    return "think_auto" if THINK_START in (template_text or "") else None


def prompt_opens_thinking(prompt_text: Optional[str]) -> bool:
    """The rendered prompt ends inside a `<think>` block: the model's output starts with reasoning."""
    return bool(prompt_text) and prompt_text.rstrip(_WS).endswith(THINK_START)


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool):
        self.fallback = "reasoning" if starts_in_reasoning else "content"
        self.state = "start"          # start -> reasoning -> after -> content
        self.buf = ""
        self.events: list = []

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self.events.append((kind, text))

    def feed(self, text: str) -> list:
        self.buf += text
        self._step(final=False)
        out, self.events = self.events, []
        return out

    def finish(self) -> list:
        self._step(final=True)
        out, self.events = self.events, []
        return out

    def _step(self, final: bool) -> None:
        if self.state == "start":
            head = self.buf.lstrip(_WS)
            if head.startswith(THINK_START):
                self.buf = head[len(THINK_START):]
                self.state = "reasoning"
            elif not final and THINK_START.startswith(head):
                return                # empty or a partial "<think>": wait
            else:
                self.state = self.fallback
        if self.state == "reasoning":
            i = self.buf.find(THINK_END)
            if i < 0:
                keep = 0 if final else partial_marker_len(self.buf, (THINK_END,))
                self._emit("reasoning", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            self._emit("reasoning", self.buf[:i])
            self.buf = self.buf[i + len(THINK_END):]
            self.state = "after"
        if self.state == "after":
            self.buf = self.buf.lstrip(_WS)
            if not self.buf:
                return
            self.state = "content"
        self._emit("content", self.buf)
        self.buf = ""


def make_reasoning_parser(name: str, prompt_text: Optional[str], template_kwargs: dict) -> Optional[ReasoningParser]:
    """The parser for one choice of a request, or None when this request has no reasoning to separate."""
    if name == "deepseek_r1":
        return ReasoningParser(starts_in_reasoning=True)
    if name == "qwen3" and template_kwargs.get("enable_thinking") is False:
        return None
    if name in ("qwen3", "think_auto"):
        return ReasoningParser(starts_in_reasoning=prompt_opens_thinking(prompt_text))
    raise ValueError(f"unknown reasoning parser {name!r}")
