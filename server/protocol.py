"""Parsing and validating OpenAI request bodies into engine requests.

Every mistake is an `APIError` (HTTP 400) whose `param` names the field, checked before anything
reaches the engine: JSON types first (so the engine never sees a string where a number belongs), then
ranges through `SamplingParams.validate`, then prompt lengths against max_model_len.

Field policy. Each endpoint lists the fields it honours (OpenAI's plus vLLM's extras), fields that are
accepted and have no effect on the output (`user`, `metadata`, ...), and fields we know but cannot
honour (structured outputs, beam search, ...): setting one of those is a 400 naming it rather than a
silent drop (vLLM's dropped `guided_json` is a well-known trap). A field nobody knows is a 400 as well.
"""
from __future__ import annotations

import json
import math
import re
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from server.errors import APIError, bad_request

INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
MAX_PROMPTS_PER_REQUEST = 4096
MAX_REQUEST_ID_LEN = 128
# Bound on characters per token for the cheap length check before tokenising (see check_text_length).
MAX_CHARS_PER_TOKEN = 64

# ------------------------------------------------------------------------------------- field sets

# Sampling fields shared by both endpoints (OpenAI's and vLLM's "sampling params" block).
_SAMPLING_FIELDS = {
    "temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
    "prompt_logprobs", "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "priority",
    "request_id", "return_tokens_as_token_ids", "return_token_ids", "stream", "stream_options", "model",
    "max_tokens", "response_format", "use_beam_search", "length_penalty",
    # structured outputs (engine/structured_outputs.py): vLLM's field, its older guided_* spellings, llama.cpp's
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "grammar", "json_schema",
    # vLLM's explicit ids to score at each generated position (engine.sampling_params)
    "logprob_token_ids",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "echo",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "modalities",
    "parallel_tool_calls", "include_reasoning",
}
# Accepted; they do not change what is generated.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "session_id", "stream_interval"}
# Known, but this server cannot do what they ask: a non-null value is a 400 naming the field.
UNSUPPORTED_FIELDS = {
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (set structured_outputs."
                                 "disable_any_whitespace to forbid whitespace in JSON)",
    "prompt_embeds": "prompt embeddings are not supported",
    "kv_transfer_params": "KV transfer is not supported", "ec_transfer_params": "encoder-cache transfer is not supported",
    "vllm_xargs": "vllm_xargs is not supported", "logits_processors": "custom logits processors are not supported",
    "thinking_token_budget": "thinking_token_budget is not supported",
    "repetition_detection": "repetition_detection is not supported", "watermarking": "watermarking is not supported",
    "cache_salt": "cache_salt is not supported (the prefix cache is shared by all requests)",
    "chat_template": "a per-request chat_template is not supported (start the server with --tokenizer-config)",
    "documents": "documents are not supported", "mm_processor_kwargs": "multimodal inputs are not supported",
    "media_io_kwargs": "multimodal inputs are not supported", "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported", "function_call":
        "the deprecated 'function_call' field is not supported",
    "reasoning_effort": "reasoning_effort is not supported by this server",
    "verbosity": "verbosity is not supported", "safety_identifier": None, "prompt_cache_key": None,
}
# Of the above, these are harmless identifiers: accepted like IGNORED_FIELDS.
_HARMLESS = {k for k, v in UNSUPPORTED_FIELDS.items() if v is None}

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs may not override what the request already says explicitly (vLLM refuses these too).
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "chat_template", "tokenize", "add_generation_prompt",
                            "continue_final_message", "documents"}


# ------------------------------------------------------------------------------------- JSON helpers

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_JSON_DEPTH = 64


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object (400 for anything else, including NaN/Infinity)."""
    if not raw:
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {_json_type(body)}",
                          code="invalid_json")
    _check_structure(body, check_surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_structure(body: dict, check_surrogates: bool) -> None:
    """Walks the parsed body once, without recursion: nesting deeper than MAX_JSON_DEPTH is a 400 (deep
    structures would otherwise reach recursive code: templates, json.dumps, error messages), and so is a
    lone UTF-16 surrogate (`"\\ud800"`) in any string or key, which is not Unicode text: it cannot be
    tokenised, logged as UTF-8, or echoed back in a response."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                              code="invalid_json")
        if isinstance(value, dict):
            items = value.items()
        else:
            items = enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                if check_surrogates and _has_surrogate(key):
                    raise _surrogate_error(f"{path}.{ascii(key)}".lstrip("."))
                where = f"{path}.{key}" if path else key
            else:
                where = None
            if isinstance(item, (dict, list)):
                stack.append((item, where if where is not None else f"{path}[{key}]", depth + 1))
            elif check_surrogates and isinstance(item, str) and _has_surrogate(item):
                raise _surrogate_error(where if where is not None else f"{path}[{key}]")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_error(param: str) -> APIError:
    return bad_request(f"'{param}' contains a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                       "which is not valid Unicode text", param=param, code="invalid_unicode")


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, numbers.Integral):
        return "integer"
    if isinstance(value, numbers.Real):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_error(name: str, expected: str, value) -> APIError:
    return bad_request(f"'{name}' must be {expected}, got {_json_type(value)} {_show(value)}", param=name,
                       code="invalid_type")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class Fields:
    """Typed access to a request body's fields; the first bad one raises a 400 naming it."""

    def __init__(self, body: dict, honoured: set, endpoint: str):
        self.body = body
        for key, value in body.items():
            if key in honoured or key in IGNORED_FIELDS or key in _HARMLESS:
                continue
            if key in UNSUPPORTED_FIELDS:
                if value is None or value is False:
                    continue
                raise bad_request(f"'{key}': {UNSUPPORTED_FIELDS[key]}", param=key, code="unsupported_parameter")
            raise bad_request(f"unknown field '{key}' for {endpoint}", param=key, code="unknown_parameter")

    def raw(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def bool(self, name: str, default: bool | None = None) -> bool | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)
        return value

    def int(self, name: str, default: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if _is_int(value):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(name, "an integer", value)

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _type_error(name, "a number", value)
        if not math.isfinite(value):
            raise bad_request(f"'{name}' must be a finite number", param=name)
        return float(value)

    def str(self, name: str, default: str | None = None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise _type_error(name, "a string", value)
        return value

    def dict(self, name: str) -> dict | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise _type_error(name, "an object", value)
        return value

    def list(self, name: str) -> list | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise _type_error(name, "an array", value)
        return value

    def int_list(self, name: str) -> list | None:
        value = self.list(name)
        if value is None:
            return None
        for i, v in enumerate(value):
            if not _is_int(v):
                raise _type_error(f"{name}[{i}]", "an integer", v)
        return [int(v) for v in value]

    def str_list(self, name: str) -> list | None:
        value = self.list(name)
        if value is None:
            return None
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise _type_error(f"{name}[{i}]", "a string", v)
        return value

    def stop(self) -> list:
        value = self.body.get("stop")
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            return self.str_list("stop")
        raise _type_error("stop", "a string or an array of strings", value)


# ------------------------------------------------------------------------------------- requests

@dataclass
class PromptInput:
    text: Optional[str]            # None when the prompt was given as token ids
    token_ids: list
    images: Optional[list] = None  # PIL images of a chat request's image_url parts, in prompt order


@dataclass
class GenerationRequest:
    endpoint: str                  # "completion" | "chat"
    model: Optional[str]
    prompts: list                  # list[PromptInput]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    echo: bool = False
    echo_text: str = ""            # chat: the final assistant message, prepended when echo is set
    logprobs: Optional[int] = None  # top-N per generated token (chat: top_logprobs) or None
    prompt_logprobs: Optional[int] = None
    echo_logprobs: bool = False    # completions: echo=true with logprobs: prompt tokens get logprobs too
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    priority: int = 0
    request_id: Optional[str] = None
    log_summary: dict = field(default_factory=dict)
    chat_output: Any = None        # chat: a server.chat_output.ChatOutputSpec when the output is parsed
    beam: Any = None               # completions with use_beam_search: engine.beam_search.BeamSearchParams


@dataclass
class ServingContext:
    """What request parsing needs to know about the served model."""
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_logprobs: Optional[int] = 20
    scheduling_policy: str = "fcfs"
    tool_parser: Optional[str] = None          # resolved --tool-call-parser (None: no tool calls)
    reasoning_parser: Optional[str] = None     # resolved --reasoning-parser (None: off)
    enable_thinking: Optional[bool] = None     # --enable-thinking: the template's default enable_thinking
    # generation_config.json's sampling defaults for fields a request leaves unset (--generation-config auto)
    default_sampling: dict = field(default_factory=dict)
    # a model that takes image input (engine.multimodal): its image token's text; None: text only
    image_placeholder: Optional[str] = None


def _model(f: Fields) -> Optional[str]:
    return f.str("model")


def _stream_options(f: Fields, stream: bool) -> tuple:
    opts = f.dict("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise bad_request("'stream_options' can only be set when 'stream' is true", param="stream_options")
    unknown = [k for k in opts if k not in ("include_usage", "continuous_usage_stats")]
    if unknown:
        raise bad_request(f"unknown field 'stream_options.{unknown[0]}'", param=f"stream_options.{unknown[0]}")
    out = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = opts.get(key)
        if value is not None and not isinstance(value, bool):
            raise _type_error(f"stream_options.{key}", "a boolean", value)
        out.append(bool(value))
    return tuple(out)


def _response_format(f: Fields) -> None:
    """Checked by _structured_outputs (it becomes a constraint there)."""


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "grammar": "grammar", "json_schema": "json"}


def _structured_outputs(f: Fields):
    """The request's output constraint as a StructuredOutputsParams (None: free text), from whichever of
    response_format (json_object / json_schema), structured_outputs, guided_* or llama.cpp's grammar /
    json_schema is set; two at once is a 400. Bad schemas, regexes and grammars are 400s naming the field
    (the constraint is compiled here, before admission)."""
    from engine.structured_outputs import StructuredOutputsParams
    found = []
    fmt = f.dict("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", dict(json_object=True)))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict):
                raise _type_error("response_format.json_schema", "an object ({\"name\": ..., \"schema\": {...}})", js)
            schema = js.get("schema")
            if schema is None:
                raise bad_request("'response_format.json_schema.schema' is required", code="missing_required_parameter",
                                  param="response_format.json_schema.schema")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise _type_error("response_format.json_schema.strict", "a boolean", strict)
            # strict or not, the schema is enforced token by token (OpenAI's strict mode is the only behaviour)
            found.append(("response_format.json_schema.schema", dict(json=schema)))
        elif kind not in (None, "text"):
            raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format.type", code="unsupported_parameter")
    so = f.body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("structured_outputs", "an object", so)
        if any(v is not None and v is not False for v in so.values()):
            found.append(("structured_outputs", so))
    for name, kind in _GUIDED.items():
        value = f.body.get(name)
        if value is None:
            continue
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise _type_error(name, "a string", value)
        if kind == "choice" and not isinstance(value, list):
            raise _type_error(name, "an array of strings", value)
        found.append((name, {kind: value}))
    backend = f.str("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "guidance", "llguidance"):
        raise bad_request(f"'guided_decoding_backend' {backend!r} is not available; this server uses llguidance "
                          "('auto', 'guidance' or 'llguidance')", param="guided_decoding_backend",
                          code="unsupported_parameter")
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint per request; got '{found[0][0]}' and "
                          f"'{found[1][0]}'", param=found[1][0])
    source, value = found[0]
    try:
        if source == "structured_outputs":
            return StructuredOutputsParams.from_value(value, "structured_outputs")
        return StructuredOutputsParams(**value, source=source)
    except InvalidRequestError as e:
        raise bad_request(e.message, param=e.param) from None


def _max_tokens(f: Fields, default: Optional[int], names=("max_tokens",)) -> Optional[int]:
    """The first of `names` that is set; non-positive means unset (up to the context length)."""
    for name in names:
        value = f.int(name)
        if value is not None:
            return value if value > 0 else None
    return default


def _sampling_params(f: Fields, ctx: ServingContext, *, max_tokens: Optional[int], logprobs: Optional[int],
                     prompt_logprobs: Optional[int], beam_ok: bool = False) -> SamplingParams:
    if f.bool("use_beam_search", False) and not beam_ok:
        raise bad_request("beam search is not supported", param="use_beam_search", code="unsupported_parameter")
    length_penalty = f.number("length_penalty")
    if length_penalty is not None and length_penalty != 1.0 and not (beam_ok and f.bool("use_beam_search", False)):
        raise bad_request("'length_penalty' only applies to beam search, which is not supported",
                          param="length_penalty", code="unsupported_parameter")
    seed = f.int("seed")
    if seed is not None and not INT64_MIN <= seed <= UINT64_MAX:
        raise bad_request(f"'seed' must fit in 64 bits, got {seed}", param="seed")
    logit_bias = f.dict("logit_bias")
    bad_words = f.str_list("bad_words")
    structured = _structured_outputs(f)
    d = ctx.default_sampling          # user value -> generation_config.json -> vLLM's default
    kwargs = dict(
        # beam search: n choices of the beams (server.beam), each engine request is one sequence
        n=1 if beam_ok and f.bool("use_beam_search", False) else f.int("n", 1), temperature=f.number("temperature", d.get("temperature", 1.0)),
        top_p=f.number("top_p", d.get("top_p", 1.0)), top_k=f.int("top_k", d.get("top_k", 0)),
        min_p=f.number("min_p", d.get("min_p", 0.0)),
        repetition_penalty=f.number("repetition_penalty", d.get("repetition_penalty", 1.0)),
        presence_penalty=f.number("presence_penalty", 0.0), frequency_penalty=f.number("frequency_penalty", 0.0),
        seed=seed, max_tokens=max_tokens, min_tokens=f.int("min_tokens", 0), stop=f.stop(),
        stop_token_ids=f.int_list("stop_token_ids") or [],
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        ignore_eos=f.bool("ignore_eos", False), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias, allowed_token_ids=f.int_list("allowed_token_ids"), bad_words=bad_words or [],
        skip_special_tokens=f.bool("skip_special_tokens", True),
        spaces_between_special_tokens=f.bool("spaces_between_special_tokens", True),
        structured_outputs=structured, logprob_token_ids=f.int_list("logprob_token_ids"),
    )
    try:
        params = SamplingParams(**kwargs)
        params.validate(ctx.vocab_size, ctx.max_logprobs)
    except InvalidRequestError as e:
        raise bad_request(e.message, param=e.param) from None
    return params


def _shown_logprobs(params: SamplingParams, logprobs: Optional[int]) -> Optional[int]:
    """How many entries a response shows per token: with logprob_token_ids all of them (the ids and the
    sampled token, each ranked over the whole vocabulary), else the request's own count."""
    return -1 if params.logprob_token_ids else logprobs


def _priority(f: Fields, ctx: ServingContext) -> int:
    priority = f.int("priority", 0)
    if priority != 0 and ctx.scheduling_policy != "priority":
        raise bad_request(f"'priority' is only honoured with --scheduling-policy priority (the server uses "
                          f"{ctx.scheduling_policy!r}); leave it unset or 0", param="priority")
    return priority


def _truncate(f: Fields, ctx: ServingContext, ids: list, param: str) -> list:
    k = f.int("truncate_prompt_tokens")
    side = f.str("truncation_side", "left")
    if side not in ("left", "right"):
        raise bad_request(f"'truncation_side' must be 'left' or 'right', got {side!r}", param="truncation_side")
    if k is not None:
        if k == -1:
            k = ctx.max_model_len
        if k < 1:
            raise bad_request(f"'truncate_prompt_tokens' must be at least 1 or -1, got {k}",
                              param="truncate_prompt_tokens")
        if k > ctx.max_model_len:
            raise bad_request(f"'truncate_prompt_tokens' ({k}) is larger than the maximum context length "
                              f"({ctx.max_model_len})", param="truncate_prompt_tokens")
        if len(ids) > k:
            ids = ids[-k:] if side == "left" else ids[:k]
    if not ids:
        raise bad_request("the prompt is empty (it has no tokens)", param=param)
    if len(ids) >= ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your request has "
            f"{len(ids)} input tokens, which leaves no room for output. Please reduce the length of the "
            f"{'messages' if param == 'messages' else 'prompt'}.", param=param, code="context_length_exceeded")
    return ids


def _check_token_ids(ids: list, vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} in '{param}' is out of range [0, {vocab_size})", param=param)


def max_text_chars(ctx: ServingContext) -> int:
    return ctx.max_model_len * MAX_CHARS_PER_TOKEN


def check_text_length(ctx: ServingContext, text: str, param: str) -> None:
    """A cheap bound before tokenising: no tokenizer makes fewer than one token per MAX_CHARS_PER_TOKEN
    characters of ordinary text, so a longer text cannot fit the context (an 8 MiB prompt is refused
    here in microseconds instead of being tokenised for tens of seconds first)."""
    limit = max_text_chars(ctx)
    if len(text) > limit:
        raise bad_request(f"'{param}' is {len(text)} characters long; this server accepts at most {limit} "
                          f"characters ({MAX_CHARS_PER_TOKEN} per token of its {ctx.max_model_len}-token context)",
                          param=param, code="context_length_exceeded")


def encode_texts(ctx: ServingContext, texts: list, add_special_tokens: bool) -> list:
    """Token ids of `texts`, on the request's thread. `encode_batch` (HF tokenizers, Rust) releases the GIL
    while it works, where `encode` holds it: a long prompt must not stall the engine thread and every
    other stream of the process."""
    if not texts:
        return []
    encode_batch = getattr(ctx.tokenizer, "encode_batch", None)
    if encode_batch is None:
        return [ctx.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return encode_batch(list(texts), add_special_tokens=add_special_tokens)


def _common(f: Fields, ctx: ServingContext, req: GenerationRequest) -> None:
    req.stream = bool(f.bool("stream", False))
    req.include_usage, req.continuous_usage_stats = _stream_options(f, req.stream)
    req.return_tokens_as_token_ids = bool(f.bool("return_tokens_as_token_ids", False))
    req.return_token_ids = bool(f.bool("return_token_ids", False))
    req.priority = _priority(f, ctx)
    req.request_id = check_request_id(f.str("request_id"))
    _response_format(f)


def check_request_id(request_id: Optional[str], param: str = "request_id") -> Optional[str]:
    """A client's request id goes into the X-Request-Id header and the logs: at most MAX_REQUEST_ID_LEN
    visible ASCII characters (no spaces or controls), else a 400 naming the field."""
    if request_id is None:
        return None
    if not request_id:
        raise bad_request(f"'{param}' must not be empty", param=param)
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise bad_request(f"'{param}' is {len(request_id)} characters long; at most {MAX_REQUEST_ID_LEN} are "
                          "allowed", param=param)
    bad = next((c for c in request_id if not "!" <= c <= "~"), None)
    if bad is not None:
        raise bad_request(f"'{param}' may only contain visible ASCII characters (no spaces or control "
                          f"characters); it contains {ascii(bad)}", param=param)
    return request_id


def parse_completion_request(body: dict, ctx: ServingContext) -> GenerationRequest:
    f = Fields(body, COMPLETION_FIELDS, "/v1/completions")
    model = _model(f)
    suffix = f.str("suffix")
    if suffix:
        raise bad_request("'suffix' is not supported", param="suffix", code="unsupported_parameter")
    logprobs = f.int("logprobs")
    prompt_logprobs = f.int("prompt_logprobs")
    echo = bool(f.bool("echo", False))
    stream = bool(f.bool("stream", False))
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' is not available when streaming", param="prompt_logprobs")
    engine_prompt_logprobs = prompt_logprobs
    if echo and logprobs is not None:
        # Echoed prompt tokens carry logprobs too (OpenAI's legacy behaviour), so the engine scores the prompt.
        engine_prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    params = _sampling_params(f, ctx, max_tokens=_max_tokens(f, ctx.default_sampling.get("max_tokens", 16)),
                              logprobs=logprobs, prompt_logprobs=engine_prompt_logprobs, beam_ok=True)
    best_of = f.int("best_of")
    beam = None
    if f.bool("use_beam_search", False):
        from server.beam import beam_params
        beam = beam_params(f, ctx, params, best_of, stream, echo)
    elif best_of is not None and best_of != params.n:
        raise bad_request(f"'best_of' must equal n ({params.n}) or be unset; best_of > n is not supported",
                          param="best_of", code="unsupported_parameter")
    req = GenerationRequest("completion", model, [], params, echo=echo, logprobs=_shown_logprobs(params, logprobs),
                            prompt_logprobs=prompt_logprobs, echo_logprobs=echo and logprobs is not None)
    req.beam = beam
    _common(f, ctx, req)
    add_special = f.bool("add_special_tokens", True)
    prompts = _split_prompts(body.get("prompt"))
    texts = [p for p in prompts if isinstance(p, str)]
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            check_text_length(ctx, p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    encoded = iter(encode_texts(ctx, texts, add_special))
    req.prompts = [_prompt_input(f, ctx, p, next(encoded) if isinstance(p, str) else None) for p in prompts]
    req.log_summary = {"prompt": body.get("prompt")}
    return req


def _split_prompts(prompt) -> list:
    """The `prompt` field as a list of single prompts (each a str or a list of token ids)."""
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise _type_error("prompt", "a string, an array of strings, an array of token ids or an array of "
                          "token-id arrays", prompt)
    if not prompt:
        raise bad_request("'prompt' must not be an empty array", param="prompt")
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompt)}", param="prompt")
    if all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p:
                raise bad_request(f"'prompt[{i}]' is an empty token array", param="prompt")
            for j, t in enumerate(p):
                if not _is_int(t):
                    raise _type_error(f"prompt[{i}][{j}]", "an integer token id", t)
        return [list(p) for p in prompt]
    raise bad_request("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                      "token-id arrays (not a mixture)", param="prompt", code="invalid_type")


def _prompt_input(f: Fields, ctx: ServingContext, prompt, encoded: Optional[list]) -> PromptInput:
    if isinstance(prompt, str):
        ids, text = encoded, prompt
    else:
        _check_token_ids(prompt, ctx.vocab_size, "prompt")
        ids, text = prompt, None
    before = len(ids)
    ids = _truncate(f, ctx, ids, "prompt")
    if text is not None and len(ids) != before:
        text = None   # truncated: the echo is decoded from what remains
    return PromptInput(text, ids)


# ------------------------------------------------------------------------------------- chat

def _content_text(content, where: str, images: Optional[list] = None, placeholder: Optional[str] = None):
    """A message's content as the template sees it: text parts are joined with newlines (as vLLM does). With
    `images` (a model that takes image input, `placeholder` its image token's text), image_url parts are decoded
    into it and the content is the parts list the template renders (`{"type": "image"}` where each image goes)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(where, "a string or an array of content parts", content)
    texts, parts = [], []
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(pwhere, "a content-part object", part)
        kind = part.get("type")
        if kind == "image_url":
            if images is None:
                raise bad_request("this model does not take image input", param=pwhere,
                                  code="unsupported_parameter")
            images.append(_data_url_image(part, pwhere))
            parts.append({"type": "image"})
            continue
        if kind != "text":
            what = "'text' and 'image_url'" if images is not None else "only 'text'"
            raise bad_request(f"'{pwhere}.type' {kind!r} is not supported by this model ({what} parts)",
                              param=f"{pwhere}.type", code="unsupported_parameter")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{pwhere}.text", "a string", text)
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if images is None or all(p["type"] == "text" for p in parts):
        return "\n".join(texts)
    return parts


def _data_url_image(part: dict, where: str):
    """The PIL image of an image_url content part: only data: URLs (base64), since the server downloads nothing."""
    from engine.multimodal import image_from_data_url
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, dict) else iu
    if not isinstance(url, str):
        raise _type_error(f"{where}.image_url.url", "a string (a data: URL)", url)
    try:
        return image_from_data_url(url, where)
    except InvalidRequestError as e:
        raise bad_request(e.message, param=e.param, code="invalid_value") from None


def _messages(f: Fields, max_chars: Optional[int] = None, ctx: Optional[ServingContext] = None,
              images: Optional[list] = None) -> list:
    """The request's messages checked, as the chat template takes them. `images`: a list to decode image_url
    parts into (the server's context says whether the model takes image input)."""
    placeholder = ctx.image_placeholder if ctx is not None else None
    if placeholder is None and images is not None:
        images = None                   # a text-only model: an image_url part is refused by name
    messages = f.body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array of message objects", messages)
    if not messages:
        raise bad_request("'messages' must not be empty", param="messages")
    out = []
    total_chars = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "a message object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                              param=f"{where}.role")
        msg = dict(m)
        content = _content_text(m.get("content"), f"{where}.content", images, placeholder)
        if content is None and not m.get("tool_calls"):
            content = ""
        msg["content"] = content
        total_chars += len(content or "") if not isinstance(content, list) else \
            sum(len(p.get("text", "")) for p in content)
        if max_chars is not None and total_chars > max_chars:
            raise bad_request(f"the messages' contents are longer than this server accepts ({max_chars} characters "
                              "in all)", param="messages", code="context_length_exceeded")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise _type_error(f"{where}.name", "a string", m["name"])
        if "tool_calls" in m and m["tool_calls"] is not None:
            from server.tool_request import template_tool_calls
            msg["tool_calls"] = template_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise _type_error(f"{where}.tool_call_id", "a string", m["tool_call_id"])
        out.append(msg)
    if images:
        _fit_template_format(out, getattr(ctx.tokenizer, "chat_template", None), placeholder)
    return out


def _fit_template_format(messages: list, template, placeholder: str) -> None:
    from engine.multimodal import fit_template_format
    fit_template_format(messages, template, placeholder)


def parse_chat_request(body: dict, ctx: ServingContext) -> GenerationRequest:
    f = Fields(body, CHAT_FIELDS, "/v1/chat/completions")
    model = _model(f)
    images: list = []
    messages = _messages(f, max_text_chars(ctx), ctx, images)
    from server.tool_request import chat_output_spec, enforce_forced_call, parse_tools
    tools, tool_choice, parallel_tool_calls = parse_tools(f.body)
    modalities = f.str_list("modalities")
    if modalities is not None and any(m != "text" for m in modalities):
        raise bad_request("only the 'text' modality is supported", param="modalities", code="unsupported_parameter")
    want_logprobs = bool(f.bool("logprobs", False))
    top = f.int("top_logprobs")
    if top is not None and top != 0 and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if top is not None and top < -1:
        raise bad_request(f"'top_logprobs' must be non-negative or -1, got {top}", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    if f.body.get("logprob_token_ids") is not None:
        logprobs = top or None          # the ids' count (top_logprobs, when set, must equal it)
    prompt_logprobs = f.int("prompt_logprobs")
    if prompt_logprobs is not None and f.bool("stream", False):
        raise bad_request("'prompt_logprobs' is not available when streaming", param="prompt_logprobs")
    try:
        params = _sampling_params(f, ctx, max_tokens=_max_tokens(f, ctx.default_sampling.get("max_tokens"),
                                                                       ("max_completion_tokens", "max_tokens")),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs, beam_ok=True)
    except APIError as e:
        if e.param == "logprobs" and top is not None:
            e.param = "top_logprobs"
        raise
    req = GenerationRequest("chat", model, [], params, logprobs=_shown_logprobs(params, logprobs),
                            prompt_logprobs=prompt_logprobs)
    _common(f, ctx, req)
    add_generation_prompt = f.bool("add_generation_prompt", True)
    continue_final = bool(f.bool("continue_final_message", False))
    if continue_final and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true (set "
                          "add_generation_prompt to false to continue the final message)",
                          param="continue_final_message")
    kwargs = f.dict("chat_template_kwargs") or {}
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {reserved[0]!r} (use the request field instead)",
                          param="chat_template_kwargs")
    f.bool("include_reasoning")
    if ctx.enable_thinking is not None:
        kwargs = {"enable_thinking": ctx.enable_thinking, **kwargs}
    if tool_choice in ("required",) or isinstance(tool_choice, tuple):
        enforce_forced_call(params, tools, tool_choice, parallel_tool_calls)
    if f.bool("use_beam_search", False):
        if images:
            raise bad_request("use_beam_search is not available with image input", param="use_beam_search")
        from server.beam import beam_params
        req.beam = beam_params(f, ctx, params, None, req.stream, bool(f.bool("echo", False)))
    from engine.errors import ChatTemplateError
    try:
        text = ctx.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template could not render these messages: {e}", param="messages",
                          code="chat_template_error") from None
    if continue_final:
        last = messages[-1].get("content") or ""
        if isinstance(last, list):          # content parts with images: the final text part is what continues
            last = next((p["text"] for p in reversed(last) if p["type"] == "text"), "")
        cut = text.rfind(last) if last else -1
        if cut < 0:
            raise bad_request("the final message could not be located in the rendered prompt, so it cannot be "
                              "continued", param="continue_final_message")
        text = text[:cut + len(last)]
    req.echo = bool(f.bool("echo", False))
    if req.echo and messages[-1]["role"] == "assistant" and isinstance(messages[-1].get("content"), str):
        req.echo_text = messages[-1]["content"]
    check_text_length(ctx, text, "messages")
    (ids,) = encode_texts(ctx, [text], bool(f.bool("add_special_tokens", False)))
    ids = _truncate(f, ctx, ids, "messages")
    req.prompts = [PromptInput(text, ids, images or None)]
    req.log_summary = {"prompt": text}
    req.chat_output = chat_output_spec(f.body, ctx, tools, tool_choice, parallel_tool_calls, prompt_text=text,
                                       template_kwargs=kwargs, skip_special_tokens=params.skip_special_tokens)
    if req.chat_output is not None:
        # The parsers must see framing tokens even when they are special tokens: the engine keeps them in
        # the text, and the response strips what is left of them (server/chat_output.py).
        params.skip_special_tokens = False
    return req


# ------------------------------------------------------------------------------------- tokenize

def parse_tokenize_request(body: dict, ctx: ServingContext) -> tuple:
    """(token ids, want token strings, model) for /tokenize (a `prompt` or chat `messages`)."""
    if "messages" in body:
        f = Fields(body, {"model", "messages", "add_generation_prompt", "continue_final_message",
                          "add_special_tokens", "chat_template_kwargs", "tools", "tool_choice",
                          "return_token_strs"}, "/tokenize")
        msgs = _messages(f, max_text_chars(ctx), ctx, [])
        kwargs = f.dict("chat_template_kwargs") or {}
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise bad_request(f"'chat_template_kwargs' may not set {reserved[0]!r}", param="chat_template_kwargs")
        tools = f.list("tools")
        if ctx.enable_thinking is not None:
            kwargs = {"enable_thinking": ctx.enable_thinking, **kwargs}
        from engine.errors import ChatTemplateError
        try:
            text = ctx.tokenizer.render_chat(msgs, add_generation_prompt=f.bool("add_generation_prompt", True),
                                             tools=tools, **kwargs)
        except ChatTemplateError as e:
            raise bad_request(f"the chat template could not render these messages: {e}", param="messages",
                              code="chat_template_error") from None
        check_text_length(ctx, text, "messages")
        (ids,) = encode_texts(ctx, [text], bool(f.bool("add_special_tokens", False)))
    else:
        f = Fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs"}, "/tokenize")
        prompt = f.body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' (or 'messages') is required", param="prompt",
                              code="missing_required_parameter")
        if not isinstance(prompt, str):
            raise _type_error("prompt", "a string", prompt)
        check_text_length(ctx, prompt, "prompt")
        (ids,) = encode_texts(ctx, [prompt], bool(f.bool("add_special_tokens", True)))
    return ids, bool(f.bool("return_token_strs", False)), f.str("model")


def parse_detokenize_request(body: dict, ctx: ServingContext) -> tuple:
    f = Fields(body, {"model", "tokens"}, "/detokenize")
    tokens = f.int_list("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required", param="tokens", code="missing_required_parameter")
    _check_token_ids(tokens, ctx.vocab_size, "tokens")
    return tokens, f.str("model")
