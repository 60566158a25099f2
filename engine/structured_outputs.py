"""Structured outputs (constrained decoding): JSON schemas, regexes, choices and grammars, on llguidance.

The one entry point for everything that constrains what a request may generate is
`SamplingParams.structured_outputs`, a `StructuredOutputsParams` with exactly one of:

    json=<JSON schema (dict or its JSON text)>   the output is one JSON value valid for the schema
    json_object=True                             the output is one JSON object (any keys)
    regex=<pattern>                              the output matches the regex as a whole (Rust regex syntax)
    choice=[str, ...]                            the output is exactly one of the strings
    grammar=<GBNF or Lark text>                  llama.cpp GBNF (`root ::= ...`) or llguidance Lark (`start: ...`)

Server fields map onto it (server/protocol.py): OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` and `guided_*`, llama.cpp's `grammar`. Other server code (tool calls with
`tool_choice: required` or a named function) builds one with `json=<schema of the call>`; `source` names
the request field that error messages should point at.

Validation happens at construction, without a model: the constraint is converted to an llguidance
grammar and compiled under `PARSER_LIMITS` (bounded lexer fuel, lexer states and grammar size), so a bad
schema/regex/grammar is an `InvalidRequestError` naming the field -- and an expensive one fails fast
instead of hanging the request thread. `GrammarCompiler.matcher` (engine, at admission, caller's thread)
builds the per-sequence matcher against the engine's tokenizer.

During decoding (engine/sampler.py): every step, the sampler asks each constrained request's matcher for
its token bitmask (all of them in one call to llguidance's thread pool, which releases the GIL), sets
the logits of forbidden tokens to -inf, samples, and advances the matcher with the chosen token; the
scheduler stops a request whose grammar is finished (finish_reason "stop"). With jump-forward on, the
tokens the grammar forces next (`compute_ff_tokens`) are appended at once and computed by the next
forward step together, instead of one step each.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from engine.errors import InvalidRequestError

# Bounds on what a request may send (characters of the schema's JSON text / regex / grammar; choices).
MAX_SPEC_CHARS = 64_000
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# Whitespace a JSON output may put between tokens: nothing, one space, or one newline and up to 20 spaces or
# tabs of indentation (llama.cpp's json-schema-to-grammar `space` rule). Unbounded whitespace lets a small
# model loop on newlines until max_tokens.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"

# Jump-forward only for forced runs at least this long: the step that computes appended tokens is a
# multi-token (eager, prefill-path) step, which on the CPU costs more than a replayed one-token decode step.
JUMP_FORWARD_MIN_TOKENS = 4

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _limits():
    import llguidance as llg
    # Compile-time and per-step work is bounded by llguidance's "fuel" (about 50k units/ms to build the
    # lexer, 14k/ms per mask step): at most ~40 ms to compile, ~15 ms for one mask, and a capped lexer
    # (each state 1-2 kB) and grammar size, so no request can stall a thread or take gigabytes.
    return llg.LLParserLimits(initial_lexer_fuel=2_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                              max_lexer_states=50_000, max_grammar_size=200_000, verbose_errors=False)


_limits_cache = None

# llguidance's grammar compiler recurses with the depth of the grammar (a chain of 1300 `$ref`s or Lark
# rules overflows an 8 MiB thread stack: a segfault, not an exception). Every compile therefore runs on
# one of these threads, whose stack is large enough for anything MAX_SPEC_CHARS lets through (pages are
# only committed when touched).
COMPILE_STACK_BYTES = 1 << 30
_stack_size_lock = threading.Lock()


def run_compile(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a fresh thread with a COMPILE_STACK_BYTES stack; its result or its exception.
    (A thread costs ~0.1 ms, a compile ~1 ms; the stack size is process-wide, so it is set just for the start.)"""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e
    th = None
    with _stack_size_lock:
        for size in (COMPILE_STACK_BYTES, COMPILE_STACK_BYTES // 4):
            old = threading.stack_size(size)
            try:
                th = threading.Thread(target=target, name="grammar-compile", daemon=True)
                th.start()
                break
            except (RuntimeError, MemoryError, ValueError):   # address space limited (ulimit -v): smaller
                th = None
            finally:
                threading.stack_size(old)
    if th is None:
        target()        # no big stack to be had: compile here (the size caps still apply)
    else:
        th.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def parser_limits():
    global _limits_cache
    if _limits_cache is None:
        _limits_cache = _limits()
    return _limits_cache


@dataclass
class StructuredOutputsParams:
    json: Any = None                    # JSON schema: dict (or bool) or its JSON text
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None       # GBNF (llama.cpp) or Lark (llguidance)
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON: no whitespace at all between tokens
    # The request field errors should name (e.g. "response_format", "guided_regex"); default
    # "structured_outputs.<kind>". Not part of the constraint.
    source: Optional[str] = field(default=None, compare=False)
    # The compiled llguidance grammar (set by validation).
    llg_grammar: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        set_ = self._set_kinds()
        return set_[0] if set_ else ""

    def _set_kinds(self) -> list:
        out = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            out.append("json_object")
        return out

    @property
    def param(self) -> str:
        return self.source or f"structured_outputs.{self.kind or 'json'}"

    def _error(self, message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self.param}: {message}", self.param)

    def validate(self) -> None:
        """Type and size checks, then the compile under parser_limits(); InvalidRequestError on the first
        problem, naming `param`."""
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}",
                                      "structured_outputs.json_object")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace must be a boolean",
                                      "structured_outputs.disable_any_whitespace")
        kinds = self._set_kinds()
        if len(kinds) != 1:
            what = "none" if not kinds else ", ".join(kinds)
            raise InvalidRequestError(
                f"structured outputs need exactly one of json, json_object, regex, choice, grammar (got {what})",
                self.source or "structured_outputs")
        self.llg_grammar = run_compile(self._to_llguidance, kinds[0])
        import llguidance as llg
        err = run_compile(llg.LLMatcher.validate_grammar, self.llg_grammar, None, limits=parser_limits())
        if err and not err.startswith("WARNING"):
            raise self._error(f"invalid {self._what()}: {_first_lines(err)}")

    def _what(self) -> str:
        return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
                "choice": "choice list", "grammar": "grammar"}[self.kind]

    def _json_options(self) -> dict:
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}

    def _to_llguidance(self, kind: str) -> str:
        import llguidance as llg
        if kind == "json" or kind == "json_object":
            schema = self.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                if len(schema) > MAX_SPEC_CHARS:
                    raise self._error(f"the JSON schema is {len(schema)} characters long; at most {MAX_SPEC_CHARS}")
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise self._error(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise self._error(f"a JSON schema must be an object (or a boolean), got {type(schema).__name__}")
            try:
                text = json.dumps(schema)
            except (TypeError, ValueError, RecursionError) as e:
                raise self._error(f"the JSON schema cannot be serialised: {e}") from None
            if len(text) > MAX_SPEC_CHARS:
                raise self._error(f"the JSON schema is {len(text)} characters long; at most {MAX_SPEC_CHARS}")
            try:
                return llg.LLMatcher.grammar_from_json_schema(text, defaults=self._json_options())
            except (ValueError, TypeError) as e:
                raise self._error(f"invalid JSON schema: {_first_lines(str(e))}") from None
        if kind == "regex":
            self._check_text(self.regex, "regex")
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            if not isinstance(self.choice, (list, tuple)):
                raise self._error(f"choice must be a list of strings, got {type(self.choice).__name__}")
            if not self.choice:
                raise self._error("choice must not be empty")
            if len(self.choice) > MAX_CHOICES:
                raise self._error(f"choice has {len(self.choice)} entries; at most {MAX_CHOICES}")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str):
                    raise self._error(f"choice[{i}] must be a string, got {type(c).__name__}")
                if not c:
                    raise self._error(f"choice[{i}] is empty")
                if len(c) > MAX_CHOICE_CHARS:
                    raise self._error(f"choice[{i}] is {len(c)} characters long; at most {MAX_CHOICE_CHARS}")
            self.choice = list(self.choice)
            # Lark string literals are JSON strings: every character is escaped exactly.
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        # grammar: GBNF (llama.cpp) is converted to Lark; Lark passes through (any_to_lark tells them apart)
        self._check_text(self.grammar, "grammar")
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            lark = any_to_lark(self.grammar)
        except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions for bad GBNF
            raise self._error(f"invalid GBNF grammar: {_first_lines(str(e))}") from None
        return llg.LLMatcher.grammar_from_lark(lark)

    def _check_text(self, value, name: str) -> None:
        if not isinstance(value, str):
            raise self._error(f"{name} must be a string, got {type(value).__name__}")
        if not value:
            raise self._error(f"{name} must not be empty")
        if len(value) > MAX_SPEC_CHARS:
            raise self._error(f"{name} is {len(value)} characters long; at most {MAX_SPEC_CHARS}")

    @classmethod
    def from_value(cls, value, source: str = "structured_outputs") -> "StructuredOutputsParams":
        """A StructuredOutputsParams as given, or built from a dict of its fields (vLLM's request field)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{source} must be an object, got {type(value).__name__}", source)
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        ignored = {"disable_fallback", "disable_additional_properties", "whitespace_pattern", "structural_tag",
                   "backend", "backend_was_auto", "_backend", "_backend_was_auto"}
        for key, v in value.items():
            if key in ignored:
                if v not in (None, False):
                    raise InvalidRequestError(f"{source}.{key} is not supported", f"{source}.{key}")
            elif key not in known:
                raise InvalidRequestError(f"unknown field '{source}.{key}'", f"{source}.{key}")
        kw = {k: v for k, v in value.items() if k in known and v is not None}
        kinds = [k for k in ("json", "regex", "choice", "grammar") if k in kw] + \
            (["json_object"] if kw.get("json_object") else [])
        src = f"{source}.{kinds[0]}" if len(kinds) == 1 else source
        return cls(**kw, source=src)


def _first_lines(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------ engine side

class GrammarCompiler:
    """The llguidance tokenizer for an engine's tokenizer (built once, on first use: ~0.5 s for a 49k
    vocabulary) and per-sequence matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._ll_error: Optional[str] = None
        self._executor = None

    def ll_tokenizer(self, param: str = "structured_outputs"):
        with self._lock:
            if self._ll_tokenizer is None and self._ll_error is None:
                try:
                    self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
                except Exception as e:  # noqa: BLE001 - reported to the request by name below
                    self._ll_error = f"{type(e).__name__}: {e}"
        if self._ll_tokenizer is None:
            raise InvalidRequestError(
                f"structured outputs are not available for this model's tokenizer ({self._ll_error})", param)
        return self._ll_tokenizer

    def matcher(self, so: StructuredOutputsParams, jump_forward: bool = False) -> "GrammarState":
        import llguidance as llg
        tok = self.ll_tokenizer(so.param)
        m = run_compile(llg.LLMatcher, tok, so.llg_grammar, log_level=0, limits=parser_limits())
        if m.is_error():
            raise InvalidRequestError(f"{so.param}: invalid {so._what()}: {_first_lines(m.get_error())}", so.param)
        return GrammarState(m, tok.vocab_size, jump_forward=jump_forward)

    @property
    def executor(self):
        if self._executor is None:
            import llguidance as llg
            self._executor = llg.LLExecutor()
        return self._executor


def build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids=()):
    """llguidance's tokenizer from ours: both of our tokenizer sources (tokenizer.json and a GGUF's
    vocabulary) are HF `tokenizers` objects, whose JSON llguidance reads directly. The vocabulary is the
    model's (its logits row), which may be padded past the tokenizer's; padding ids are never allowed."""
    import llguidance as llg
    backend = getattr(tokenizer, "backend", tokenizer)
    n_vocab = max(int(vocab_size), backend.get_vocab_size(with_added_tokens=True))
    eos = [int(t) for t in eos_token_ids] or ([tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None)
                                              is not None else [])
    if not eos:
        raise ValueError("the tokenizer has no end-of-sequence token")
    return llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos if len(eos) > 1 else eos[0])


class GrammarState:
    """One sequence's matcher: its mask for the next token, the tokens it accepts, whether it is done.

    Overlap: after a token is accepted, `prefetch` starts computing the next mask on a background thread
    (llguidance releases the GIL), so it runs while the engine does the next forward pass; `fill_masks`
    takes the finished mask. While a prefetch runs nothing else touches the matcher: every method that
    does waits for it first, and `finished_at` reads a flag cached when the token was accepted."""

    def __init__(self, matcher, vocab_size: int, jump_forward: bool = False):
        self.matcher = matcher
        self.vocab_size = vocab_size            # the llguidance tokenizer's (>= the model's logits row)
        self.jump_forward = jump_forward
        self.num_accepted = 0
        self._stopped = matcher.is_stopped()
        self._prefetch = None                   # Future of the next mask (an int32 row), or None

    def _wait(self):
        fut, self._prefetch = self._prefetch, None
        return fut.result() if fut is not None else None

    @property
    def terminated(self) -> bool:
        """Nothing but end-of-sequence can follow (or the matcher failed): the request stops."""
        return self._stopped

    def finished_at(self, num_output_tokens: int) -> bool:
        """Whether the request stops after its first num_output_tokens outputs: the grammar is finished and
        every token it consumed (forced ones included) has been appended."""
        return num_output_tokens >= self.num_accepted and self._stopped

    @property
    def error(self) -> str:
        self._wait()
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def accept(self, token_id: int) -> bool:
        self._wait()
        ok = self.matcher.consume_token(int(token_id))
        if ok:
            self.num_accepted += 1
        self._stopped = self.matcher.is_stopped()
        return ok

    def forced_tokens(self) -> list:
        """Tokens the grammar forces next (consumed here); empty when there is a choice."""
        self._wait()
        if self._stopped:
            return []
        toks = list(self.matcher.compute_ff_tokens())
        if len(toks) < JUMP_FORWARD_MIN_TOKENS:
            return []          # a short run: ordinary decode steps are cheaper than one eager multi-token step
        if not self.matcher.consume_tokens(toks):
            self._stopped = self.matcher.is_stopped()
            return []
        self.num_accepted += len(toks)
        self._stopped = self.matcher.is_stopped()
        return toks

    def prefetch(self) -> None:
        """Start computing the next token's mask in the background (nothing when the grammar is done)."""
        if self._stopped or self._prefetch is not None:
            return
        self._prefetch = _prefetch_pool().submit(self._compute_row)

    def _compute_row(self) -> np.ndarray:
        row = np.empty(mask_words(self.vocab_size), np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row

    def take_prefetched(self):
        """The prefetched mask row (waiting for it if still running), or None when none was started."""
        return self._wait()


_pool = None
_pool_lock = threading.Lock()


def _prefetch_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return _pool


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(compiler: Optional[GrammarCompiler], states: list) -> np.ndarray:
    """int32 bitmasks (len(states), ceil(V/32)) for the next token of every state: the prefetched ones as they
    are, the rest in one parallel llguidance call."""
    import llguidance.numpy as lln
    bitmask = np.empty((len(states), mask_words(states[0].vocab_size)), np.int32)
    todo = []
    for j, s in enumerate(states):
        row = s.take_prefetched()
        if row is not None:
            bitmask[j] = row
        else:
            todo.append(j)
    if len(todo) == 1 or (todo and compiler is None):
        for j in todo:
            lln.fill_next_token_bitmask(states[j].matcher, bitmask, j)
    elif todo:
        lln.fill_next_token_bitmask_par(compiler.executor, [(states[j].matcher, j) for j in todo], bitmask)
    return bitmask


def allowed_from_bitmask(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[V]: bit t of the little-endian int32 words says whether token t is allowed."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return bits[:vocab_size].view(np.bool_)


def apply_bitmask(row: np.ndarray, bitmask_row: np.ndarray) -> None:
    """Forbidden tokens' logits become -inf, in place (row: float32[V])."""
    allowed = allowed_from_bitmask(bitmask_row, row.shape[0])
    np.copyto(row, np.float32(-np.inf), where=~allowed)
