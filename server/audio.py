"""POST /v1/audio/transcriptions: OpenAI's (and vLLM's) speech-to-text route, served by a Whisper checkpoint
(engine/transcription.py).

The body is multipart/form-data, parsed by Falcon's multipart handler within the server's body limit: `file` (the
audio: WAV, FLAC or OGG; any sample rate, any channel count), `model`, `language`, `prompt`, `response_format`
(json | text | verbose_json; srt and vtt are refused), `temperature`, `seed` (sampling with temperature > 0),
`max_tokens` (a cap per 30 s window) and `timestamp_granularities[]` ("segment" only); other fields are ignored.

A transcription runs in the request's own thread, not on the engine thread: the model's kernels release the
interpreter lock, so the other routes (health, models, metrics) keep answering while it runs. Transcriptions run
one at a time (the Transcriber's lock); a request waits for the one before it. With the engine in another
process (data parallelism) the transcription runs on a replica's engine thread instead.

Like the JSON routes this one needs the API key when the server has one. Unlike them it takes a body type that a
browser may send cross-site without asking first (multipart): without an API key, a web page could have a
visitor's browser start transcriptions on a server it reaches (costing time; the answer is not readable by it).
"""
from __future__ import annotations

import math

import falcon

from engine.errors import InvalidRequestError
from server.errors import APIError, bad_request
from server.resource_helpers import check_model, json_response

RESPONSE_FORMATS = ("json", "text", "verbose_json")
_FIELDS_TEXT_LIMIT = 64 << 10          # a form field other than the file (a prompt, a language) is text


def _transcribe_on_engine(engine, audio: bytes, kwargs: dict):
    """Runs on the engine (a data-parallel replica's thread): picklable, unlike a bound method."""
    return engine.transcribe(audio, **kwargs)


def _read_form(req: falcon.Request, limit: int) -> dict:
    """{field name: str, or bytes for a part with a filename} of a multipart/form-data body."""
    media = (req.content_type or "").split(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise APIError(f"Content-Type {media or 'none'!r} is not supported here; send the audio as "
                       "multipart/form-data with a 'file' field", status=415, param="Content-Type",
                       code="unsupported_media_type")
    if req.content_length is not None and req.content_length > limit:
        raise APIError(f"the request body is {req.content_length} bytes, more than this server's limit of {limit} "
                       "bytes", status=413, code="request_too_large")
    out, total = {}, 0
    try:
        for part in req.get_media():
            name = part.name or ""
            data = part.stream.read(limit + 1 - total)
            total += len(data)
            if total > limit:
                raise APIError(f"the request body is larger than this server's limit of {limit} bytes", status=413,
                               code="request_too_large")
            if part.filename is not None or name == "file":
                out[name] = bytes(data)
            else:
                if len(data) > _FIELDS_TEXT_LIMIT:
                    raise bad_request(f"form field {name!r} is longer than {_FIELDS_TEXT_LIMIT} bytes", param=name)
                try:
                    out[name] = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise bad_request(f"form field {name!r} is not UTF-8 text", param=name) from None
    except APIError:
        raise
    except falcon.HTTPError as e:       # a body that is not valid multipart (no boundary, truncated parts)
        raise bad_request(f"the multipart body could not be parsed: {e.description or e.title}",
                          param="file") from None
    return out


def _number(form: dict, name: str, kind, default):
    v = form.get(name)
    if v is None or (isinstance(v, str) and not v.strip()):
        return default
    try:
        x = kind(v.strip()) if isinstance(v, str) else None
    except ValueError:
        x = None
    if x is None or (kind is float and not math.isfinite(x)):
        raise bad_request(f"{name} must be {'a number' if kind is float else 'an integer'}, got {str(v)[:40]!r}",
                          param=name)
    return x


class TranscriptionsResource:
    def __init__(self, state):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        s = self.state
        form = _read_form(req, s.settings.max_body_bytes)
        model = form.get("model")
        check_model(s, model if isinstance(model, str) and model else None)
        if s.task != "transcription":
            raise bad_request(f"this model does not do transcription (`{s.served_model_name}` is not a speech "
                              "recognition model such as Whisper)", param="model", code="model_not_supported")
        audio = form.get("file")
        if not isinstance(audio, bytes):
            raise bad_request("the request needs the audio as a 'file' field (multipart/form-data)", param="file")
        fmt = (form.get("response_format") or "json").strip()
        if fmt not in RESPONSE_FORMATS:
            extra = " (subtitle formats are not produced)" if fmt in ("srt", "vtt") else ""
            raise bad_request(f"response_format {fmt!r} is not supported{extra}: use one of "
                              f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
        if (form.get("stream") or "false").strip().lower() not in ("false", "0", ""):
            raise bad_request("streamed transcriptions are not supported", param="stream")
        gran = form.get("timestamp_granularities[]", form.get("timestamp_granularities"))
        if gran is not None and gran.strip() not in ("", "segment"):
            raise bad_request(f"timestamp_granularities {gran!r}: only 'segment' is supported",
                              param="timestamp_granularities")
        kwargs = dict(language=(form.get("language") or "").strip() or None, prompt=form.get("prompt") or None,
                      temperature=_number(form, "temperature", float, 0.0),
                      seed=_number(form, "seed", int, None), max_tokens=_number(form, "max_tokens", int, None))
        if s.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down")
        try:
            if s.transcriber is not None:
                out = s.transcriber.transcribe(audio, **kwargs)
            else:
                out = s.engine.call(_transcribe_on_engine, audio, kwargs)
        except InvalidRequestError as e:
            raise bad_request(e.message, param="file" if e.param in ("audio", None) else e.param) from None
        usage = {"type": "duration", "seconds": int(math.ceil(out.duration))}
        if fmt == "text":
            resp.status = falcon.HTTP_200
            resp.content_type = "text/plain; charset=utf-8"
            resp.data = (out.text + "\n").encode("utf-8")
            return
        if fmt == "json":
            json_response(resp, {"text": out.text, "usage": usage})
            return
        from engine.transcription import _NAMES
        names = {v: k for k, v in _NAMES.items()}
        json_response(resp, {"task": "transcribe", "language": names.get(out.language, out.language),
                             "duration": round(out.duration, 3), "text": out.text,
                             "segments": [seg.to_dict() for seg in out.segments], "usage": usage})


def warm_up_transcription(state) -> None:
    """One short transcription of noise, so that the kernels' one-time loading is paid before /health says ready."""
    import numpy as np
    noise = (np.random.default_rng(0).standard_normal(16000) * 0.1).astype(np.float32)
    if state.transcriber is not None:
        state.transcriber.transcribe(noise, max_tokens=2)
    else:
        state.engine.call(_transcribe_on_engine, (noise, 16000), {"max_tokens": 2})
