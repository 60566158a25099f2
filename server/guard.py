"""Request checks that run before a resource's responder: the API key and the body-size limit.

The key is checked on the resource Falcon resolved, not on the path string: the router normalises
paths (`//v1/models`, absolute-form targets `POST http://host/v1/completions HTTP/1.1`), so a check
on the raw path could be bypassed by spelling the same route differently. Resources that stay open
without a key say so with `public = True` (liveness, version, metrics); every other route needs it.
A path that matches no route is answered 404 without running anything.
"""
from __future__ import annotations

import hmac

import falcon

from server.errors import APIError


def is_public(resource) -> bool:
    return bool(getattr(resource, "public", False))


class Guard:
    """Falcon middleware: bearer key on every non-public resource, and the body-size limit."""

    def __init__(self, api_key: str | None, max_body_bytes: int):
        self._key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        limit = self.max_body_bytes
        if req.content_length is not None and req.content_length > limit:
            raise APIError(f"the request body is {req.content_length} bytes, more than this server's limit of "
                           f"{limit} bytes", status=413, code="request_too_large")

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        # Runs only when a route matched (an unknown path gets the router's 404 and nothing else).
        if self._key is None or is_public(resource):
            return
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        try:
            token_bytes = token.strip().encode("utf-8")
        except UnicodeEncodeError:      # header bytes that are not text: simply a wrong key
            token_bytes = b""
        if scheme.lower() != "bearer" or not hmac.compare_digest(token_bytes, self._key):
            raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key the "
                           "server was started with (--api-key / JITKERN_API_KEY).", status=401,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
