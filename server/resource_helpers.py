"""What every HTTP resource of the server does with a request body, a model name and a JSON reply (the app's
resources and the embeddings resource share them; server.app imports them from here)."""
from __future__ import annotations

from typing import Optional

import falcon

from server.errors import APIError
from server.request_body import read_json_body
from server.serving import dumps


def read_json(req: falcon.Request, state) -> dict:
    """The request's JSON object body, within the server's body-size limit (`state` is server.app's AppState)."""
    return read_json_body(req, state.settings.max_body_bytes)


def check_model(state, model: Optional[str]) -> None:
    """A 404 naming the model unless it is a served name or a loaded LoRA adapter (None: the default)."""
    if model is not None and model not in state.model_names and state.lora.request_for(model) is None:
        raise APIError(f"The model `{model}` does not exist. This server serves `{state.served_model_name}`.",
                       status=404, param="model", code="model_not_found")


def json_response(resp: falcon.Response, obj, status: int = 200) -> None:
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = "application/json"
    resp.data = dumps(obj)
