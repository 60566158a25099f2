"""OpenAI-shaped errors: every failure the server reports is `{"error": {message, type, param, code}}`.

Client mistakes are 400 (401 auth, 404 unknown model/route, 405 wrong method, 413 body too large);
only a fault of ours is 500, and it never carries a traceback to the client.
"""
from __future__ import annotations

import json

# OpenAI's `type` strings (its API answers invalid requests, auth and unknown models all with
# invalid_request_error; a 5xx is server_error).
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

class APIError(Exception):
    """An error answered to the client as OpenAI's error object with HTTP `status`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers or {}

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)
