"""The chat request's tool fields: `tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` in
the history, reasoning options -> what the template sees and a ChatOutputSpec for the response.

Rules (vLLM's and OpenAI's): `tool_choice` defaults to "auto" when tools are given and needs tools when
it is not "none"; a named choice must name one of the tools; `tools: []` is refused. "auto" needs a
tool-call parser (`--tool-call-parser`, default auto-detected); "required" and a named function are
enforced with structured outputs (a JSON schema: for a named function, its `parameters`; for
"required", an array of `{"name", "parameters"}` objects, one of the tools each, at most one element
with `parallel_tool_calls: false`), so any model produces a valid call.
"""
from __future__ import annotations

import json
from typing import Optional

from server.chat_output import ChatOutputSpec, special_strings
from server.errors import bad_request

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _where_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


def template_tool_calls(tool_calls, where: str) -> list:
    """An assistant message's `tool_calls` as chat templates expect them: `function.arguments` parsed
    from its JSON text into an object (HF templates write it with `tojson`)."""
    if not isinstance(tool_calls, list):
        raise bad_request(f"'{where}' must be an array, got {_where_type(tool_calls)}", param=where,
                          code="invalid_type")
    out = []
    for j, call in enumerate(tool_calls):
        w = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad_request(f"'{w}' must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"arguments\": ...}}", param=w)
        fn = call["function"]
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"'{w}.function.name' must be a string", param=f"{w}.function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise bad_request(f"'{w}.function.arguments' is not valid JSON: {e}",
                                  param=f"{w}.function.arguments") from None
        elif args is None:
            args = {}
        elif not isinstance(args, dict):
            raise bad_request(f"'{w}.function.arguments' must be a JSON string (or an object)",
                              param=f"{w}.function.arguments")
        copy = dict(call)
        copy["function"] = dict(fn, arguments=args)
        out.append(copy)
    return out


def parse_tools(body: dict) -> tuple:
    """(tools for the template or None, tool_choice: "none" | "auto" | "required" | ("named", name),
    parallel_tool_calls). 400s name the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"'parallel_tool_calls' must be a boolean, got {_where_type(parallel)}",
                          param="parallel_tool_calls", code="invalid_type")
    parallel = True if parallel is None else parallel
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None, "none", parallel
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array, got {_where_type(tools)}", param="tools", code="invalid_type")
    if not tools:
        raise bad_request("'tools' must not be an empty array (leave it out instead)", param="tools")
    names = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str) or not t["function"]["name"]:
            raise bad_request(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              param=f"tools[{i}]")
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object",
                              param=f"tools[{i}].function.parameters")
        names.append(t["function"]["name"])
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
        return tools, choice, parallel
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"),
                                                                                             dict) \
            or not isinstance(choice["function"].get("name"), str):
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", param="tool_choice")
    name = choice["function"]["name"]
    if name not in names:
        raise bad_request(f"'tool_choice' names function {name!r}, which is not among 'tools' ({', '.join(names)})",
                          param="tool_choice")
    return tools, ("named", name), parallel


def forced_call_schema(tools: list, choice, parallel: bool) -> tuple:
    """(JSON schema, field to blame) that a "required" or named tool_choice constrains the output to."""
    by_name = {t["function"]["name"]: (i, t["function"].get("parameters") or _EMPTY_PARAMETERS)
               for i, t in enumerate(tools)}
    if isinstance(choice, tuple):
        i, params = by_name[choice[1]]
        return params, f"tools[{i}].function.parameters"
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, (_, params) in by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema, "tools"


def chat_output_spec(body: dict, ctx, tools, choice, parallel: bool, *, prompt_text: str, template_kwargs: dict,
                     skip_special_tokens: bool) -> Optional[ChatOutputSpec]:
    """The response parsing this request needs (None: plain text, as without tools)."""
    include_reasoning = body.get("include_reasoning")
    include_reasoning = True if include_reasoning is None else bool(include_reasoning)
    spec = ChatOutputSpec(reasoning_parser=ctx.reasoning_parser, include_reasoning=include_reasoning,
                          strip_special=skip_special_tokens, prompt_text=prompt_text,
                          template_kwargs=dict(template_kwargs), max_calls=None if parallel else 1)
    if tools is not None and choice != "none":
        if isinstance(choice, tuple):
            spec.tool_mode, spec.named_function = "named", choice[1]
        else:
            spec.tool_mode = choice
        if choice == "auto":
            if ctx.tool_parser is None:
                raise bad_request("tool_choice \"auto\" needs a tool-call parser, and this server runs with "
                                  "--tool-call-parser none: set 'tool_choice' to \"none\" (tools shown to the model "
                                  "only), \"required\" or a named function", param="tool_choice",
                                  code="unsupported_parameter")
            spec.tool_parser = ctx.tool_parser
    if not spec.active:
        return None
    spec.special_strings = special_strings(ctx.tokenizer)
    return spec


def enforce_forced_call(params, tools: list, choice, parallel: bool) -> None:
    """Constrains `params` (a SamplingParams) to the call a "required"/named tool_choice asks for."""
    try:
        from engine.structured_outputs import StructuredOutputsParams
    except ImportError:
        StructuredOutputsParams = None
    if StructuredOutputsParams is None or not hasattr(params, "structured_outputs"):
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'with a named function'} needs "
                          "structured outputs, which this engine does not have", param="tool_choice",
                          code="unsupported_parameter")
    if params.structured_outputs is not None:
        raise bad_request("a structured-output constraint and a \"required\" or named 'tool_choice' cannot be "
                          "combined (both constrain the whole output)", param="tool_choice")
    from engine.errors import InvalidRequestError
    schema, source = forced_call_schema(tools, choice, parallel)
    try:
        params.structured_outputs = StructuredOutputsParams(json=schema, source=source)
    except InvalidRequestError as e:
        raise bad_request(e.message, param=e.param or source) from None


def resolve_parsers(tool_call_parser: Optional[str], reasoning_parser: Optional[str], tokenizer) -> tuple:
    """(tool parser, reasoning parser) names for the served model: "auto" looks at the chat template's
    text, "none"/None turns the parser off."""
    from server.reasoning import detect_reasoning_parser
    from server.tool_parsers import detect_tool_parser
    import logging
    template = getattr(tokenizer, "chat_template", None)
    text = "\n".join(template.values()) if isinstance(template, dict) else (template or "")
    tool = None if tool_call_parser in (None, "none") else tool_call_parser
    if tool == "auto":
        tool = detect_tool_parser(text)
        logging.getLogger("jitkern.server").info("tool-call parser (auto, from the chat template): %s", tool)
    reasoning = None if reasoning_parser in (None, "none") else reasoning_parser
    if reasoning == "auto":
        reasoning = detect_reasoning_parser(text)
        logging.getLogger("jitkern.server").info("reasoning parser (auto, from the chat template): %s",
                                                 reasoning or "none")
    return tool, reasoning
