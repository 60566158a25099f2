"""A chat choice's generated text -> `reasoning_content`, `content` and `tool_calls` (message and deltas).

When a request needs a parser (a reasoning parser is configured, or tools are offered with a tool
choice other than "none"), the engine detokenizes that request with special tokens kept
(`skip_special_tokens=False`), so framing tokens reach the parsers even where they are special tokens;
the request's own `skip_special_tokens` then applies here: special-token strings left in the content
and the reasoning (end-of-turn markers and the like) are removed after parsing.

Pipeline per choice: text -> reasoning parser (`<think>`) -> its content -> tool parser -> content.
Streaming and non-streaming run the same pipeline (the whole text fed at once), so they agree.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from server.reasoning import make_reasoning_parser
from server.tool_parsers import NamedCallParser, RequiredCallsParser, make_tool_parser


@dataclass
class ChatOutputSpec:
    """What a chat request asks of its output parsing (built by server/protocol.py)."""
    tool_mode: str = "none"                # none | auto | required | named
    tool_parser: Optional[str] = None      # dialect for "auto"
    named_function: Optional[str] = None
    max_calls: Optional[int] = None        # 1 with parallel_tool_calls=false
    reasoning_parser: Optional[str] = None
    include_reasoning: bool = True
    strip_special: bool = True             # the request's skip_special_tokens
    special_strings: tuple = ()
    prompt_text: Optional[str] = None
    template_kwargs: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.tool_mode != "none" or self.reasoning_parser is not None


def special_strings(tokenizer) -> tuple:
    """The text of every special token of `tokenizer` (cached on it)."""
    cached = getattr(tokenizer, "_jitkern_special_strings", None)
    if cached is None:
        ids = sorted(getattr(tokenizer, "special_token_ids", ()) or ())
        texts = {tokenizer.decode([i], skip_special_tokens=False) for i in ids}
        cached = tuple(sorted((t for t in texts if t), key=len, reverse=True))
        try:
            tokenizer._jitkern_special_strings = cached
        except AttributeError:
            pass
    return cached


class SpecialStripper:
    """Removes special-token strings from a text stream, holding back a suffix that may begin one."""

    def __init__(self, strings: tuple):
        self.pattern = re.compile("|".join(re.escape(s) for s in strings)) if strings else None
        self.prefixes = {s[:k] for s in strings for k in range(1, len(s))}
        self.longest = max((len(s) for s in strings), default=0)
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> str:
        if self.pattern is None:
            return text
        self.buf += text
        out = self.pattern.sub("", self.buf)
        keep = 0
        if not final:
            for k in range(min(self.longest - 1, len(out)), 0, -1):
                if out[-k:] in self.prefixes:
                    keep = k
                    break
        self.buf = out[len(out) - keep:] if keep else ""
        return out[:len(out) - keep]


class ChatOutputProcessor:
    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self.reasoning = None
        if spec.reasoning_parser is not None and spec.tool_mode not in ("required", "named"):
            # A forced tool call is constrained from its first token: there is no reasoning to separate.
            self.reasoning = make_reasoning_parser(spec.reasoning_parser, spec.prompt_text, spec.template_kwargs)
        if spec.tool_mode == "auto":
            self.tools = make_tool_parser(spec.tool_parser, spec.max_calls)
        elif spec.tool_mode == "required":
            self.tools = RequiredCallsParser(spec.max_calls)
        elif spec.tool_mode == "named":
            self.tools = NamedCallParser(spec.named_function)
        else:
            self.tools = None
        strings = spec.special_strings if spec.strip_special else ()
        # A forced call's text is JSON from the first token: special tokens (the end of turn) never belong
        # to it, whatever skip_special_tokens says.
        self._strip_forced = SpecialStripper(spec.special_strings) if spec.tool_mode in ("required", "named") \
            else None
        self._strip_content = SpecialStripper(strings)
        self._strip_reasoning = SpecialStripper(strings)
        # The whole message so far (for the non-streamed response).
        self.content = ""
        self.reasoning_text = ""
        self.tool_calls: list = []
        self.finished = False

    @property
    def called_tools(self) -> bool:
        return bool(self.tool_calls)

    def _events(self, text: str, final: bool, whole: bool = False) -> list:
        """Events of the next text piece: ("reasoning", s), ("content", s), ("call", ...), ("args", ...)."""
        if self._strip_forced is not None:
            text = self._strip_forced.feed(text, final)
        if self.reasoning is not None:
            stage = self.reasoning.feed(text) if text else []
            if final:
                stage += self.reasoning.finish()
        else:
            stage = [("content", text)] if text else []
        if self.tools is None:
            return stage
        if whole:
            text = "".join(ev[1] for ev in stage if ev[0] == "content")
            return [ev for ev in stage if ev[0] != "content"] + self.tools.parse_whole(text)
        out = []
        for ev in stage:
            if ev[0] == "content":
                out += self.tools.feed(ev[1])
            else:
                out.append(ev)
        if final:
            out += self.tools.finish()
        return out

    def delta(self, text: str, final: bool = False, whole: bool = False) -> dict:
        """The OpenAI delta for the next text piece (empty dict: nothing to send yet). `final` flushes;
        `whole`: `text` is the complete output (a non-streamed response)."""
        if self.finished:
            return {}
        self.finished = final
        reasoning, content, calls = [], [], []
        for ev in self._events(text, final, whole):
            if ev[0] == "reasoning":
                reasoning.append(ev[1])
            elif ev[0] == "content":
                content.append(ev[1])
            elif ev[0] == "call":
                entry = {"index": ev[1], "id": ev[2], "type": "function",
                         "function": {"name": ev[3], "arguments": ""}}
                calls.append(entry)
                self.tool_calls.append({"id": ev[2], "type": "function",
                                        "function": {"name": ev[3], "arguments": ""}})
            else:
                index, fragment = ev[1], ev[2]
                if calls and calls[-1]["index"] == index:
                    calls[-1]["function"]["arguments"] += fragment
                else:
                    calls.append({"index": index, "function": {"arguments": fragment}})
                self.tool_calls[index]["function"]["arguments"] += fragment
        r = self._strip_reasoning.feed("".join(reasoning), final)
        c = self._strip_content.feed("".join(content), final)
        self.reasoning_text += r
        self.content += c
        out = {}
        if r and self.spec.include_reasoning:
            out["reasoning_content"] = r
        if c:
            out["content"] = c
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str, echo_text: str = "") -> dict:
        """The complete assistant message for the whole generated `text`."""
        self.delta(text, final=True, whole=True)
        content = echo_text + self.content
        msg = {"role": "assistant", "content": content}
        if self.tool_calls:
            for call in self.tool_calls:
                call["function"]["arguments"] = call["function"]["arguments"] or "{}"
            if not content.strip():
                msg["content"] = None
            msg["tool_calls"] = self.tool_calls
        if self.reasoning is not None and self.spec.include_reasoning:
            msg["reasoning_content"] = self.reasoning_text or None
        return msg

    def finish_reason(self, engine_reason: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        if engine_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return engine_reason
