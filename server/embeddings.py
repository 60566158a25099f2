"""POST /v1/embeddings (registered only when the served model is an embedding model: engine.pooling).

OpenAI's request: `input` (a string, an array of strings, an array of token ids, or an array of token-id
arrays), `model`, `encoding_format` ("float" | "base64": little-endian float32 bytes, what the official
client asks for by default), `dimensions` (Matryoshka models only, else 400), `user` (accepted, unused);
vLLM's extras `add_special_tokens` (default true) and `normalize`. Texts are tokenised on the request's
thread; the forward pass and pooling run on the engine thread (AsyncEngine.call).
"""
from __future__ import annotations

import base64

import numpy as np

from engine.errors import InvalidRequestError
from server.errors import bad_request
from server.protocol import MAX_PROMPTS_PER_REQUEST, check_text_length, encode_texts
from server.resource_helpers import check_model as _check_model, json_response as _json, read_json as _read_json

FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "add_special_tokens", "normalize"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_embedding_request(body: dict, ctx) -> tuple:
    """(model, list of token-id lists, encoding_format, PoolingParams); a 400 naming the field otherwise."""
    from engine.pooling import PoolingParams
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", param=None)
    for k in body:
        if k not in FIELDS:
            raise bad_request(f"unknown field '{k}' for /v1/embeddings", param=k, code="unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise bad_request(f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise bad_request(f"'normalize' must be a boolean, got {normalize!r}", param="normalize")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("'add_special_tokens' must be a boolean", param="add_special_tokens")
    inp = body.get("input")
    if inp is None:
        raise bad_request("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(inp, str):
        items = [inp]
    elif isinstance(inp, list) and inp and all(_is_int(t) for t in inp):
        items = [list(inp)]
    elif isinstance(inp, list) and inp and all(isinstance(p, str) for p in inp):
        items = list(inp)
    elif isinstance(inp, list) and inp and all(isinstance(p, list) for p in inp):
        for i, p in enumerate(inp):
            if not p:
                raise bad_request(f"'input[{i}]' is an empty token array", param="input")
            bad = next((t for t in p if not _is_int(t)), None)
            if bad is not None:
                raise bad_request(f"'input[{i}]' must hold integer token ids, got {bad!r}", param="input")
        items = [list(p) for p in inp]
    elif isinstance(inp, list) and not inp:
        raise bad_request("'input' must not be an empty array", param="input")
    else:
        raise bad_request("'input' must be a string, an array of strings, an array of token ids or an array of "
                          "token-id arrays (not a mixture)", param="input", code="invalid_type")
    if len(items) > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} inputs per request, got {len(items)}", param="input")
    texts = [p for p in items if isinstance(p, str)]
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise bad_request(f"'input[{i}]' is an empty string", param="input")
            check_text_length(ctx, p, "input")
    encoded = iter(encode_texts(ctx, texts, add_special))
    ids = [list(next(encoded)) if isinstance(p, str) else p for p in items]
    return model, ids, fmt, PoolingParams(dimensions=dims, normalize=normalize)


def _embed_on_engine(engine, ids, params):
    from engine.pooling import embedder_of
    return embedder_of(engine).embed(ids, params)


def warm_up_embeddings(state, ids: list) -> None:
    state.engine.call(_embed_on_engine, [list(ids)], None)


class EmbeddingsResource:
    def __init__(self, state):
        self.state = state

    def on_post(self, req, resp) -> None:
        s = self.state
        model, ids, fmt, params = parse_embedding_request(_read_json(req, s), s.ctx)
        _check_model(s, model)
        try:
            vecs = s.engine.call(_embed_on_engine, ids, params)
        except InvalidRequestError as e:
            raise bad_request(e.message, param=e.param) from None
        data = []
        for i, v in enumerate(vecs):
            v = np.asarray(v, np.float32)
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(x) for x in ids)
        _json(resp, {"object": "list", "data": data, "model": s.served_model_name,
                     "usage": {"prompt_tokens": n, "total_tokens": n}})
