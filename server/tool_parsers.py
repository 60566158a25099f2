"""Tool-call parsers: model output text -> OpenAI `tool_calls`, incrementally.

One parser object per choice. `feed(text)` takes the next piece of generated text (special tokens kept,
so framing tokens such as `[TOOL_CALLS]` or `<|python_tag|>` are visible) and returns events; `finish()`
flushes what is still held back. The same events make the streamed deltas and, concatenated, the final
message, so a streamed answer and a non-streamed one always agree. Events:

    ("content", text)               text outside tool calls
    ("call", index, id, name)       a call starts (its id and name are known)
    ("args", index, fragment)       the next piece of that call's JSON `arguments`

A call's `arguments` is the JSON text the model wrote for it (JSON formats), or the JSON encoding of the
parsed keyword arguments (pythonic). A call block that turns out not to parse is given back as content
when nothing of it has been announced yet; text that may still become a marker is held back, never sent
as content and then taken back.

Dialects (`--tool-call-parser`):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere, any number
               (Qwen2.5/Qwen3, Hermes, SmolLM3)
  llama3_json  the output is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
               several separated by `;` (Llama 3.1/3.2 JSON tool calling)
  mistral      `[TOOL_CALLS]` then a JSON array of calls (v3 tokenizers) or `name[ARGS]{...}` (v11+);
               ids are 9 alphanumerics, as Mistral's templates require
  pythonic     the output is `[f(a=1), g(b="x")]` (optionally in `<|python_start|>...<|python_end|>`),
               read with Python's `ast` (literals only; nothing is evaluated)
  auto         picked from the chat template's text (`detect_tool_parser`), hermes when it says nothing
"""
from __future__ import annotations

import ast
import json
import logging
import re
import secrets
import string
from typing import Optional

log = logging.getLogger("jitkern.server")

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
TOOL_PARSER_CHOICES = TOOL_PARSERS + ("auto", "none")

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def new_mistral_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def partial_marker_len(text: str, markers) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (held back:
    it may still become the marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def detect_tool_parser(template_text: str) -> str:
    """The dialect a chat template's tool section asks for; hermes (the most common) when it says nothing."""
    t = template_text or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_start|>" in t or "[func_name1(" in t or "[func_name(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ('"parameters"' in t and "<|eot_id|>" in t):
        return "llama3_json"
    return "hermes"


def _decode_value(text: str, pos: int):
    """(value, end) of the JSON value at text[pos] (after whitespace), or None when it is not complete
    (or not valid) yet."""
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*')
_ARGS_HEAD = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _args_json(value) -> Optional[str]:
    """The OpenAI `arguments` text for a parsed arguments value (None: not an object)."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


class ToolParser:
    """Shared machinery: event list, call ids, the call being streamed, the parallel_tool_calls cap."""
    name = "base"

    def __init__(self, max_calls: Optional[int] = None):
        self.buf = ""                   # text received and not yet consumed
        self.events: list = []
        self.num_calls = 0              # announced calls
        self.max_calls = max_calls
        self._open = None               # the call being streamed: [index or None, args sent]

    # ------------------------------------------------------------------ events
    def _content(self, text: str) -> None:
        if text:
            self.events.append(("content", text))

    def _new_id(self) -> str:
        return new_call_id()

    def _announce(self, name: str) -> Optional[int]:
        """A new call; None when parallel_tool_calls=false already has its one call (then it is dropped)."""
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        index = self.num_calls
        self.num_calls += 1
        self.events.append(("call", index, self._new_id(), name))
        return index

    def _args(self, index: Optional[int], fragment: str) -> None:
        if index is not None and fragment:
            self.events.append(("args", index, fragment))

    def _take(self) -> list:
        out, self.events = self.events, []
        return out

    # ------------------------------------------------------------------ API
    def feed(self, text: str) -> list:
        self.buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> list:
        self._step(final=True)
        return self._take()

    def parse_whole(self, text: str) -> list:
        """Events of a complete output seen at once (a non-streamed response): nothing was announced early,
        so a call that does not parse (one cut by max_tokens included) stays content, as in vLLM."""
        self.buf += text
        self._step(final=True)
        return self._take()

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ one JSON call object
    def _object_call(self, text: str, final: bool, raw: str = "") -> Optional[int]:
        """Streams the JSON call object at the start of `text` ({"name": ..., "arguments"|"parameters": ...}).

        Returns the length of `text` it used once the object is complete (the call is finished: announced
        and all its arguments sent, or given back as content `raw + object text` when it does not parse
        and nothing of it was sent), None while it is incomplete (the name is announced and the arguments
        streamed as far as they are known). With `final`, an incomplete object is ended as it is."""
        done = _decode_value(text, 0)
        if done is None and not final:
            self._stream_partial(text)
            return None
        end = done[1] if done is not None else len(text)
        self._finish_object(text[:end], done[0] if done is not None else None, raw)
        return end

    def _stream_partial(self, text: str) -> None:
        m = _NAME_HEAD.match(text)
        if m is None:
            return
        name = _decode_value(text, m.end())
        if name is None or not isinstance(name[0], str):
            return
        if self._open is None:
            self._open = [self._announce(name[0]), ""]
        a = _ARGS_HEAD.match(text, name[1])
        if a is None or a.end() >= len(text) or text[a.end()] != "{":
            return          # arguments not started, or not an object: sent whole at the end
        value = _decode_value(text, a.end())
        args = text[a.end():value[1]] if value is not None else text[a.end():]
        # While the object is open, what is sent stops before trailing whitespace (it may end the value).
        args = args if value is not None else args.rstrip(_WS)
        index, sent = self._open
        if args.startswith(sent) and len(args) > len(sent):
            self._args(index, args[len(sent):])
            self._open[1] = args

    def _finish_object(self, text: str, obj, raw: str) -> None:
        args = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            key = "arguments" if "arguments" in obj else "parameters"
            args = _args_json(obj.get(key))
            if args is not None and isinstance(obj.get(key), dict):
                # Prefer the text the model wrote (what streaming already sent a prefix of).
                m = _NAME_HEAD.match(text)
                name = _decode_value(text, m.end()) if m else None
                a = _ARGS_HEAD.match(text, name[1]) if name else None
                value = _decode_value(text, a.end()) if a else None
                if value is not None and value[0] == obj[key]:
                    args = text[a.end():value[1]].strip(_WS)
        if self._open is None:
            if args is None:
                self._content(raw + text)
            else:
                index = self._announce(obj["name"])
                self._args(index, args)
        else:
            index, sent = self._open
            if args is not None and args.startswith(sent):
                self._args(index, args[len(sent):])
            else:
                log.warning("tool call %s: its arguments did not parse after streaming began; ended as sent",
                            index)
        self._open = None


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the output."""
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: Optional[int] = None):
        super().__init__(max_calls)
        self.in_call = False

    def _step(self, final: bool) -> None:
        while True:
            if not self.in_call:
                i = self.buf.find(self.START)
                if i < 0:
                    keep = 0 if final else partial_marker_len(self.buf, (self.START,))
                    self._content(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                self._content(self.buf[:i])
                self.buf = self.buf[i + len(self.START):]
                self.in_call = True
            j = self.buf.find(self.END)
            if j < 0 and not final:
                self._stream_partial(self.buf)
                return
            body = self.buf if j < 0 else self.buf[:j]
            rest = "" if j < 0 else self.buf[j + len(self.END):]
            obj = _decode_value(body, 0)
            trailing = body[obj[1]:].strip(_WS) if obj is not None else ""
            if obj is not None and not trailing:
                self._finish_object(body, obj[0], "")
            elif self._open is None:
                self._content(self.START + body + ("" if j < 0 else self.END))
            else:
                self._finish_object(body, None, "")
            self.in_call = False
            self.buf = rest
            if j < 0:
                return


class _JsonListMixin:
    """A run of JSON call objects separated by `,` or `;`, optionally inside `[...]`."""

    def _object_run(self, final: bool, closing: Optional[str]) -> bool:
        """Consumes call objects from self.buf; True when the run ended (closing bracket or other text)."""
        while True:
            k = 0
            while k < len(self.buf) and self.buf[k] in _WS + ",;":
                k += 1
            self.buf = self.buf[k:]
            if not self.buf:
                return final
            if closing is not None and self.buf[0] == closing:
                self.buf = self.buf[1:]
                return True
            if self.buf[0] != "{":
                return True
            used = self._object_call(self.buf, final)
            if used is None:
                return False
            self.buf = self.buf[used:]


class Llama3JsonParser(_JsonListMixin, ToolParser):
    """The whole output is JSON calls (after an optional `<|python_tag|>`), separated by `;`."""
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self, max_calls: Optional[int] = None):
        super().__init__(max_calls)
        self.mode = "start"

    def _step(self, final: bool) -> None:
        if self.mode == "start":
            head = self.buf.lstrip(_WS)
            if head.startswith(self.TAG):
                self.buf = head[len(self.TAG):]
                self.mode = "calls"
            elif head.startswith("{"):
                self.buf = head
                self.mode = "calls"
            elif (not head or self.TAG.startswith(head)) and not final:
                return
            else:
                self.mode = "content"
        if self.mode == "calls":
            if not self._object_run(final, None):
                return
            self.mode = "content"
        self._content(self.buf)
        self.buf = ""


class MistralParser(_JsonListMixin, ToolParser):
    """`[TOOL_CALLS]` followed by a JSON array/object of calls, or by `name[ARGS]{...}` (v11 tokenizers)."""
    name = "mistral"
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def __init__(self, max_calls: Optional[int] = None):
        super().__init__(max_calls)
        self.mode = "content"

    def _new_id(self) -> str:
        return new_mistral_call_id()

    def _step(self, final: bool) -> None:
        while True:
            if self.mode == "content":
                i = self.buf.find(self.BOT)
                if i < 0:
                    keep = 0 if final else partial_marker_len(self.buf, (self.BOT,))
                    self._content(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                self._content(self.buf[:i])
                self.buf = self.buf[i + len(self.BOT):]
                self.mode = "after_bot"
            if self.mode == "after_bot":
                head = self.buf.lstrip(_WS)
                if not head and not final:
                    return
                self.buf = head
                if head.startswith("["):
                    self.buf = head[1:]
                    self.mode = "array"
                elif head.startswith("{"):
                    self.mode = "object"
                else:
                    self.mode = "named"
            if self.mode in ("array", "object"):
                if not self._object_run(final, "]" if self.mode == "array" else None):
                    return
                self.mode = "content"
                continue
            if self.mode == "named":
                if not self._named_call(final):
                    return
                self.mode = "content"

    def _named_call(self, final: bool) -> bool:
        """`name[ARGS]{...}` (with an optional `[CALL_ID]id` before `[ARGS]`); True when finished."""
        if self._open is None:
            i = self.buf.find(self.ARGS)
            if i < 0:
                keep = partial_marker_len(self.buf, (self.ARGS, self.CALL_ID))
                head = self.buf[:len(self.buf) - keep].split(self.CALL_ID)[0]
                plausible = self._NAME.fullmatch(head.strip()) or not head.strip()
                if plausible and not final:
                    return False
                self._content(self.BOT + self.buf)
                self.buf = ""
                return True
            name = self.buf[:i].split(self.CALL_ID)[0].strip()
            if not self._NAME.fullmatch(name):
                self._content(self.BOT + self.buf[:i + len(self.ARGS)])
                self.buf = self.buf[i + len(self.ARGS):]
                return True
            self._open = [self._announce(name), ""]
            self.buf = self.buf[i + len(self.ARGS):].lstrip(_WS)
        value = _decode_value(self.buf, 0)
        index, sent = self._open
        if value is None and not final:
            args = self.buf.rstrip(_WS)
            if self.buf.startswith("{") and args.startswith(sent) and len(args) > len(sent):
                self._args(index, args[len(sent):])
                self._open[1] = args
            return False
        if value is not None and isinstance(value[0], dict):
            args = self.buf[:value[1]]
            self.buf = self.buf[value[1]:]
        else:
            args = sent or "{}"
            if value is None:
                log.warning("mistral tool call %s: its arguments never completed", index)
            self.buf = self.buf[value[1]:] if value is not None else ""
        if args.startswith(sent):
            self._args(index, args[len(sent):])
        self._open = None
        return True


class PythonicParser(ToolParser):
    """The output is a Python list of calls, `[f(a=1), g(b="x")]`; each call is parsed with `ast` when its
    closing parenthesis arrives (keyword arguments with literal values only; nothing is evaluated)."""
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    _HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")

    def __init__(self, max_calls: Optional[int] = None):
        super().__init__(max_calls)
        self.mode = "start"
        self.block = ""            # text of the list consumed so far (given back if nothing parses)
        self.announced_here = 0

    def _could_start(self, head: str) -> bool:
        """`head` is a prefix of `[name(`."""
        return re.fullmatch(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?", head) is not None

    def _step(self, final: bool) -> None:
        if self.mode == "start":
            head = self.buf.lstrip(_WS)
            if head.startswith(self.START):
                head = head[len(self.START):].lstrip(_WS)
            if self._HEAD.match(head):
                self.block = self.buf[:len(self.buf) - len(head)] + "["
                self.buf = head[1:]
                self.mode = "calls"
            elif not final and (not head or self.START.startswith(head) or self._could_start(head)):
                return
            else:
                self.mode = "content"
        if self.mode == "calls":
            if not self._calls(final):
                return
            self.mode = "after"
        if self.mode == "after":           # an optional <|python_end|> closes the list
            head = self.buf.lstrip(_WS)
            if head.startswith(self.END):
                self.buf = head[len(self.END):]
            elif not final and self.END.startswith(head):
                return
            self.mode = "content"
        self._content(self.buf)
        self.buf = ""

    def _calls(self, final: bool) -> bool:
        while True:
            k = 0
            while k < len(self.buf) and self.buf[k] in _WS + ",":
                k += 1
            self.block += self.buf[:k]
            self.buf = self.buf[k:]
            if self.buf.startswith("]"):
                self.buf = self.buf[1:]
                if self.announced_here == 0:       # nothing in it parsed: the list was text after all
                    self._content(self.block + "]")
                    self.block = ""
                return True
            end = _python_call_end(self.buf)
            if end is None:
                if final:
                    self._give_back(self.buf)
                    self.buf = ""
                    return True
                return False
            text = self.buf[:end]
            self.buf = self.buf[end:]
            parsed = _parse_python_call(text)
            if parsed is None:
                self._give_back(text)
                continue
            index = self._announce(parsed[0])
            self.announced_here += 1
            self._args(index, parsed[1])
            self.block += text

    def _give_back(self, text: str) -> None:
        if self.announced_here == 0:
            self._content(self.block + text)
            self.block = ""
        else:
            self._content(text)


def _python_call_end(text: str) -> Optional[int]:
    """Index just past the call expression at the start of `text` (`name(...)`), or None while it is
    incomplete. Tracks brackets and string literals (quotes, escapes, triple quotes)."""
    depth = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            q = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            j = i + len(q)
            while True:
                if j >= n:
                    return None
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(q, j):
                    j += len(q)
                    break
                j += 1
            i = j
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return i            # a stray closer: the call text ends here (it will not parse)
            if depth == 0 and c == ")":
                return i + 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


def _parse_python_call(text: str) -> Optional[tuple]:
    """(name, arguments JSON) of one `name(key=literal, ...)` call, or None."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    parts, f = [], node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if not isinstance(f, ast.Name):
        return None
    parts.append(f.id)
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            value = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        args[kw.arg] = _jsonable(value)
    try:
        return ".".join(reversed(parts)), json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _jsonable(value):
    if isinstance(value, (tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, complex):
        raise TypeError("complex")
    return value


class RequiredCallsParser(_JsonListMixin, ToolParser):
    """tool_choice "required": the (constrained) output is a JSON array of {"name", "parameters"}."""
    name = "required"

    def __init__(self, max_calls: Optional[int] = None):
        super().__init__(max_calls)
        self.started = False

    def _step(self, final: bool) -> None:
        if not self.started:
            head = self.buf.lstrip(_WS)
            if not head:
                return
            if not head.startswith("["):
                self._content(self.buf)
                self.buf = ""
                return
            self.buf = head[1:]
            self.started = True
        if self._object_run(final, "]") or final:
            self._content(self.buf.strip(_WS))
            self.buf = ""


class NamedCallParser(ToolParser):
    """A named tool_choice: the (constrained) output is the arguments object of that one function."""
    name = "named"

    def __init__(self, function_name: str):
        super().__init__(None)
        self.function = function_name
        self.index = None
        self.sent = ""

    def _step(self, final: bool) -> None:
        if self.index is None:
            self.index = self._announce(self.function)
        text = self.buf.strip(_WS) if final else self.buf.lstrip(_WS).rstrip(_WS)
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self._args(self.index, text[len(self.sent):])
            self.sent = text


_CLASSES = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
            "pythonic": PythonicParser}


def make_tool_parser(name: str, max_calls: Optional[int] = None) -> ToolParser:
    return _CLASSES[name](max_calls)


def collect(events: list) -> tuple:
    """(content text, [tool call dicts]) from a list of events."""
    content, calls = [], []
    for ev in events:
        if ev[0] == "content":
            content.append(ev[1])
        elif ev[0] == "call":
            calls.append({"id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}})
        else:
            calls[ev[1]]["function"]["arguments"] += ev[2]
    for c in calls:
        if not c["function"]["arguments"]:
            c["function"]["arguments"] = "{}"
    return "".join(content), calls
