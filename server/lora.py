"""LoRA adapters on the server, as vLLM serves them (engine.lora does the work).

- `--enable-lora --lora-modules name=path ...` (or vLLM's JSON form `{"name": ..., "path": ...}`): adapters loaded
  at start; each is a model of its own in /v1/models (`parent`: the base model) and a request whose `model` names
  it generates with it.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`:
  vLLM's dynamic loading (answered in plain text as vLLM does; errors are OpenAI error objects: 400 for a bad
  body or adapter, 404 for an unknown name).
"""
from __future__ import annotations

import itertools
import json
import threading

from server.errors import APIError

ENABLE_HINT = "LoRA adapters are not enabled on this server (start it with --enable-lora)"


def parse_lora_modules(items) -> list:
    """[{"name", "path"[, "base_model_name"]}] from vLLM's --lora-modules entries (`name=path` or a JSON
    object); raises ValueError naming the bad entry."""
    out = []
    for item in items or ():
        item = item.strip()
        if item.startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-modules {item!r}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules {item!r}: a JSON entry needs string fields 'name' and 'path'")
            out.append({k: obj[k] for k in ("name", "path", "base_model_name") if k in obj})
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
        out.append({"name": name, "path": path})
    names = [m["name"] for m in out]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"--lora-modules: the name {n!r} is given twice")
    return out


class ServerLoRA:
    """The server's adapters by name (LoRARequests with ids it assigns), kept in step with the engine's."""

    def __init__(self, state, modules: list):
        self.state = state
        self.enabled = bool(state.engine_args.get("enable_lora"))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.by_name: dict = {}
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in modules:
            err = self.load(m["name"], m["path"])
            if err is not None:
                raise ValueError(f"--lora-modules {m['name']}={m['path']}: {err.message}")

    def request_for(self, model):
        """The LoRARequest a request's `model` names, or None (the base model)."""
        return self.by_name.get(model) if model else None

    def load(self, name, path):
        """None, or the APIError that loading (name, path) gives."""
        if not self.enabled:
            return APIError(ENABLE_HINT, status=400, param="lora_name")
        if not isinstance(name, str) or not name:
            return APIError("lora_name must be a non-empty string", status=400, param="lora_name")
        if not isinstance(path, str) or not path:
            return APIError("lora_path must be a non-empty string", status=400, param="lora_path")
        if name in self.state.model_names:
            return APIError(f"lora_name {name!r} is the base model's name", status=400, param="lora_name")
        from engine.lora import LoRAError, LoRARequest
        with self._lock:
            if name in self.by_name:
                return APIError(f"The lora adapter '{name}' has already been loaded.", status=400, param="lora_name",
                                code="lora_adapter_exists")
            req = LoRARequest(name, next(self._ids), path)
            try:
                self.state.engine.call(lambda e: e.lora.get_or_load(req))   # read and checked now, not per request
            except LoRAError as e:
                return APIError(str(e), status=400, param="lora_path")
            self.by_name[name] = req
        return None

    def unload(self, name):
        if not self.enabled:
            return APIError(ENABLE_HINT, status=400, param="lora_name")
        if not isinstance(name, str) or not name:
            return APIError("lora_name must be a non-empty string", status=400, param="lora_name")
        with self._lock:
            req = self.by_name.pop(name, None)
            if req is None:
                return APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                                code="lora_adapter_not_found")
            self.state.engine.call(lambda e: e.lora.remove(req.lora_int_id))
        return None

    def cards(self) -> list:
        s = self.state
        return [{"id": name, "object": "model", "created": s.start_time, "owned_by": "jitkern", "root": r.lora_path,
                 "parent": s.served_model_name, "max_model_len": s.max_model_len, "permission": []}
                for name, r in list(self.by_name.items())]


def _body(req, state) -> dict:
    from server.request_body import read_json_body
    body = read_json_body(req, state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", status=400)
    return body


def _text(resp, text: str) -> None:
    import falcon
    resp.status = falcon.HTTP_200
    resp.content_type = "text/plain; charset=utf-8"
    resp.text = text


class LoadLoRAResource:
    def __init__(self, state):
        self.state = state

    def on_post(self, req, resp) -> None:
        body = _body(req, self.state)
        name = body.get("lora_name")
        err = self.state.lora.load(name, body.get("lora_path"))
        if err is not None:
            raise err
        _text(resp, f"Success: LoRA adapter '{name}' added successfully.")


class UnloadLoRAResource:
    def __init__(self, state):
        self.state = state

    def on_post(self, req, resp) -> None:
        body = _body(req, self.state)
        name = body.get("lora_name")
        err = self.state.lora.unload(name)
        if err is not None:
            raise err
        _text(resp, f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app, state) -> None:
    app.add_route("/v1/load_lora_adapter", LoadLoRAResource(state))
    app.add_route("/v1/unload_lora_adapter", UnloadLoRAResource(state))
