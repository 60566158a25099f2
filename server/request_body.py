"""Reading a request's JSON body: media type, size, transfer errors, then `protocol.parse_json_body`.

Only `application/json` bodies are read (415 otherwise): a browser can send text/plain, form and
multipart bodies cross-site without a preflight ("simple" requests), so accepting them would let any
web page drive the API of a server on the user's network.
"""
from __future__ import annotations

import falcon

from server.errors import APIError
from server.protocol import parse_json_body

JSON_MEDIA_TYPE = "application/json"


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the media type is application/json (a charset parameter, if any, must be UTF-8)."""
    if not content_type:
        raise APIError("the request has no Content-Type; send the body as JSON with 'Content-Type: "
                       "application/json'", status=415, param="Content-Type", code="unsupported_media_type")
    media, *params = content_type.split(";")
    if media.strip().lower() != JSON_MEDIA_TYPE:
        raise APIError(f"Content-Type {_short(media.strip())!r} is not supported; send the body as JSON with "
                       "'Content-Type: application/json'", status=415, param="Content-Type",
                       code="unsupported_media_type")
    for p in params:
        name, _, value = p.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(f"charset {_short(value.strip())!r} is not supported; send UTF-8 JSON with "
                           "'Content-Type: application/json'",
                           status=415, param="Content-Type", code="unsupported_media_type")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def read_json_body(req: falcon.Request, limit: int) -> dict:
    check_json_content_type(req.content_type)
    length = req.content_length
    if length is not None and length > limit:
        raise APIError(f"the request body is {length} bytes, more than this server's limit of {limit} bytes",
                       status=413, code="request_too_large")
    try:
        raw = (req.bounded_stream if length is not None else req.stream).read(limit + 1)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed chunked body, a read timeout, a peer that left
        # gunicorn raises its parse errors (InvalidChunkSize, ...) from the body stream; they are the
        # client's mistake, and their text names what was wrong.
        raise APIError(f"the request body could not be read: {_short(str(e) or type(e).__name__, 200)}",
                       status=400, code="invalid_body") from None
    if len(raw) > limit:
        raise APIError(f"the request body is larger than this server's limit of {limit} bytes", status=413,
                       code="request_too_large")
    return parse_json_body(raw)
