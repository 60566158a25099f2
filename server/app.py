"""The OpenAI-compatible WSGI app: `gunicorn server.app` serves `server.app.application`.

`create_app(engine=...)` builds an app around any AsyncEngine-like object (tests pass one with a fake
model). The module-level `application` is built lazily, on first access, from the JITKERN_* environment
(see server/settings.py): gunicorn looks it up inside its worker process, after the fork, so the engine
thread and the kernel thread pool are started in the process that serves requests.
"""
from __future__ import annotations

import importlib
import logging
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import falcon

from engine.async_engine import EngineUnavailableError
from server.errors import APIError
from server.guard import Guard
from server.logprobs import TokenStrings
from server.protocol import (ServingContext, parse_chat_request, parse_completion_request, parse_detokenize_request,
                             parse_tokenize_request)
from server.resource_helpers import check_model as _check_model, json_response as _json, read_json as _read_json
from server.serving import ClientGone, Generation, SSEBody
from server.settings import ServerSettings, SettingsError

log = logging.getLogger("jitkern.server")

WORKER_BOOT_ERROR = 3
GENERATION_KEY = "jitkern.generation"   # the WSGI environ entry holding a request's admitted Generation   # gunicorn's exit code for "this worker cannot start": the master then stops


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("jitkern")
    except Exception:  # noqa: BLE001 - running from a source tree without metadata
        return "0.0.0+unknown"


def _served_name(settings: ServerSettings, model_path: Optional[str]) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model and not os.path.exists(settings.model):
        return settings.model          # a Hugging Face id, as vLLM names it (not its cache folder's commit hash)
    if not model_path:
        return "jitkern"
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else p.name


def _engine_facts(llm_engine) -> dict:
    """What the server needs from the engine; run on the engine thread through AsyncEngine.call."""
    ckpt = getattr(llm_engine, "checkpoint", None)
    args = getattr(llm_engine, "args", None)
    cfg = getattr(llm_engine, "config", None)
    return {
        "tokenizer": llm_engine.tokenizer,
        "max_model_len": int(llm_engine.max_model_len),
        "vocab_size": int(cfg.vocab_size),
        "model_path": str(getattr(ckpt, "path", "") or getattr(args, "model", "") or ""),
        "args": dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {},
        "num_blocks": getattr(llm_engine, "num_blocks", None),
        "architecture": getattr(cfg, "architecture", None),
        "task": getattr(llm_engine, "task", "generate"),                    # "embed": /v1/embeddings only
        "default_sampling": dict(getattr(llm_engine, "default_sampling", None) or {}),   # generation_config.json
        # image input (engine.multimodal): the chat template's image placeholder text, None for text-only models
        "image_placeholder": getattr(getattr(llm_engine, "image_inputs", None), "token_text", None),
    }


class AppState:
    """Everything the resources share: engine, model facts, settings, metrics, requests in flight."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        facts = engine.call(_engine_facts)
        self.tokenizer = facts["tokenizer"]
        self.max_model_len = facts["max_model_len"]
        self.vocab_size = facts["vocab_size"]
        self.model_path = facts["model_path"] or settings.model or ""
        self.engine_args = facts["args"]
        self.num_blocks = facts["num_blocks"]
        self.architecture = facts["architecture"]
        self.task = facts.get("task", "generate")
        # a Whisper checkpoint's Transcriber, called from request threads (server/audio.py); None with the engine
        # in another process (transcriptions then go through engine.call) or for any other model
        self.transcriber = getattr(getattr(engine, "engine", None), "transcriber", None) \
            if self.task == "transcription" else None
        self.served_model_name = _served_name(settings, self.model_path)
        self.model_names = {self.served_model_name}
        if settings.model:
            self.model_names.add(settings.model)
        from server.lora import ServerLoRA
        self.lora = ServerLoRA(self, settings.lora_module_list())     # --lora-modules, loaded now
        self.token_strings = TokenStrings(self.tokenizer)
        self.policy = self.engine_args.get("scheduling_policy", settings.scheduling_policy) or "fcfs"
        max_logprobs = self.engine_args.get("max_logprobs", settings.max_logprobs)
        from server.tool_request import resolve_parsers
        tool_parser, reasoning_parser = resolve_parsers(settings.tool_call_parser, settings.reasoning_parser,
                                                        self.tokenizer)
        self.ctx = ServingContext(self.tokenizer, self.max_model_len, self.vocab_size,
                                  max_logprobs=20 if max_logprobs is None else max_logprobs,
                                  scheduling_policy=self.policy, tool_parser=tool_parser,
                                  reasoning_parser=reasoning_parser, enable_thinking=settings.enable_thinking,
                                  default_sampling=facts.get("default_sampling") or {},
                                  image_placeholder=facts.get("image_placeholder"))
        self.start_time = int(time.time())
        self.metrics = None
        if settings.enable_metrics:
            from server.metrics import ServerMetrics
            self.metrics = ServerMetrics(self.served_model_name, self._snapshot, self.max_model_len)
        self._active: dict[int, Generation] = {}
        self._lock = threading.Lock()
        self.draining = False
        self._drain_timer: Optional[threading.Timer] = None

    def _snapshot(self) -> dict:
        if hasattr(self.engine, "metrics_snapshot"):      # data parallelism: summed, with each replica's own
            return self.engine.metrics_snapshot()
        return self.engine.call(lambda e: e.metrics_snapshot())

    # --------------------------------------------------------------------------- in-flight requests
    def register(self, gen: Generation) -> None:
        with self._lock:
            self._active[id(gen)] = gen

    def unregister(self, gen: Generation) -> None:
        with self._lock:
            self._active.pop(id(gen), None)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def begin_drain(self, timeout: Optional[float] = None) -> None:
        """SIGTERM: refuse new generations; requests still running after `timeout` are ended cleanly
        (their streams get finish_reason "abort" and `data: [DONE]`)."""
        if self.draining:
            return
        self.draining = True
        timeout = self.settings.drain_timeout_s if timeout is None else timeout
        log.info("shutting down: %d request(s) in flight get %.0fs to finish", self.num_active, timeout)
        self._drain_timer = threading.Timer(timeout, self.abort_all)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def abort_all(self) -> None:
        with self._lock:
            active = list(self._active.values())
        if active:
            log.info("ending %d request(s) still in flight", len(active))
        for gen in active:
            gen.aborted_by_server = True
            gen.abort()

    def close(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.abort_all()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown(timeout=2.0)


# ====================================================================================== resources

class _GenerationResource:
    parse = None

    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        state = self.state
        body = _read_json(req, state)
        if state.task == "transcription":         # before parsing: a Whisper tokenizer has no chat template
            raise APIError("this model is a speech recognition model (Whisper): text generation is not available; "
                           "use /v1/audio/transcriptions", status=400, param="model", code="model_not_supported")
        gen_req = type(self).parse(body, state.ctx)
        _check_model(state, gen_req.model)
        if state.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down")
        gen = Generation(state, gen_req, req.env)
        # Once admitted, the engine holds KV blocks for this request: whatever fails before the response is
        # handed over (or while gunicorn sends it, see OpenAIServer.__call__) must end the generation.
        req.env[GENERATION_KEY] = gen
        try:
            gen.submit()
            resp.set_header("X-Request-Id", gen.id)
            if gen_req.stream:
                resp.status = falcon.HTTP_200
                resp.content_type = "text/event-stream; charset=utf-8"
                resp.set_header("Cache-Control", "no-cache")
                resp.set_header("X-Accel-Buffering", "no")
                resp.stream = SSEBody(gen)
                return
            try:
                _json(resp, gen.run_to_completion())
            except ClientGone:
                _json(resp, APIError("client disconnected", status=400).to_dict(), 400)
        except BaseException:
            gen.close()
            raise


class CompletionsResource(_GenerationResource):
    parse = staticmethod(parse_completion_request)


class ChatCompletionsResource(_GenerationResource):
    parse = staticmethod(parse_chat_request)


class ModelsResource:
    def __init__(self, state: AppState):
        self.state = state

    def _card(self) -> dict:
        s = self.state
        return {"id": s.served_model_name, "object": "model", "created": s.start_time, "owned_by": "jitkern",
                "root": s.model_path or s.served_model_name, "parent": None, "max_model_len": s.max_model_len,
                "permission": []}

    def on_get(self, req, resp) -> None:
        _json(resp, {"object": "list", "data": [self._card()] + self.state.lora.cards()})

    def on_get_one(self, req, resp, model_id: str) -> None:
        _check_model(self.state, model_id)
        adapter = [c for c in self.state.lora.cards() if c["id"] == model_id]
        _json(resp, adapter[0] if adapter else self._card())


class HealthResource:
    """Liveness: 200 while the engine thread runs (503 once it died or while shutting down)."""
    public = True     # open without the API key (load balancers probe it)

    def __init__(self, state: AppState):
        self.state = state

    def on_get(self, req, resp) -> None:
        engine = self.state.engine
        dead = getattr(engine, "_dead", None) is not None
        thread = getattr(engine, "_thread", None)
        if dead or (thread is not None and not thread.is_alive()):
            raise APIError("the engine has stopped", status=503, code="engine_dead")
        if self.state.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down")
        resp.status = falcon.HTTP_200
        resp.content_type = "text/plain"
        resp.data = b""

    on_post = on_get


class VersionResource:
    public = True

    def on_get(self, req, resp) -> None:
        _json(resp, {"version": _version()})


class MetricsResource:
    public = True     # Prometheus scrapes it without the key

    def __init__(self, state: AppState):
        self.state = state

    def on_get(self, req, resp) -> None:
        from server.metrics import CONTENT_TYPE_LATEST
        resp.status = falcon.HTTP_200
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = self.state.metrics.render()


class TokenizeResource:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req, resp) -> None:
        s = self.state
        ids, want_strs, model = parse_tokenize_request(_read_json(req, s), s.ctx)
        _check_model(s, model)
        out = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if want_strs:
            out["token_strs"] = s.tokenizer.convert_ids_to_tokens(ids)
        _json(resp, out)


class DetokenizeResource:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req, resp) -> None:
        s = self.state
        ids, model = parse_detokenize_request(_read_json(req, s), s.ctx)
        _check_model(s, model)
        _json(resp, {"prompt": s.tokenizer.decode(ids)})


def _plain(value):
    """A setting as JSON can carry it: config objects (a dataclass such as KVEventsConfig) as their fields."""
    import dataclasses
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


class ServerInfoResource:
    def __init__(self, state: AppState):
        self.state = state

    def on_get(self, req, resp) -> None:
        s = self.state
        settings = {k: v for k, v in vars(s.settings).items() if k != "api_key"}
        settings["api_key"] = "<set>" if s.settings.api_key else None
        engine_cfg = {k: _plain(v) for k, v in dict(s.engine_args).items()}
        engine_cfg.update(model=s.model_path, served_model_name=s.served_model_name, max_model_len=s.max_model_len,
                          num_blocks=s.num_blocks, vocab_size=s.vocab_size, architecture=s.architecture)
        env = {k: ("<set>" if "KEY" in k else v) for k, v in os.environ.items() if k.startswith("JITKERN_")}
        system = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
                  "cpu_count": os.cpu_count(), "pid": os.getpid()}
        _json(resp, {"version": _version(), "vllm_config": engine_cfg, "server_config": settings,
                     "vllm_env": env, "system_env": system})


class ResetPrefixCacheResource:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req, resp) -> None:
        engine = self.state.engine
        ok = bool(engine.reset_prefix_cache() if hasattr(engine, "reset_prefix_cache")
                  else engine.call(lambda e: e.reset_prefix_cache()))
        _json(resp, {"success": ok})


# ====================================================================================== errors

def _handle_api_error(req, resp, ex: APIError, params) -> None:
    if ex.status >= 500:
        log.error("%s %r -> %d: %r", req.method, req.path, ex.status, ex.message)
    for k, v in ex.headers.items():
        resp.set_header(k, v)
    _json(resp, ex.to_dict(), ex.status)


def _handle_http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    status = int(ex.status_code)
    if status == 404:
        message = f"Not found: {req.method} {req.path}"
    elif status == 405:
        message = f"Method {req.method} is not allowed on {req.path}"
    else:
        message = ex.description or ex.title or "request error"
    for k, v in (ex.headers or {}).items():
        resp.set_header(k, v)
    _json(resp, APIError(message, status=status, code=None).to_dict(), status)


def _handle_unexpected(req, resp, ex: Exception, params) -> None:
    if isinstance(ex, falcon.HTTPError):
        return _handle_http_error(req, resp, ex, params)
    if isinstance(ex, APIError):
        return _handle_api_error(req, resp, ex, params)
    if isinstance(ex, EngineUnavailableError):
        log.error("%s %r: the engine is unavailable: %r", req.method, req.path, str(ex))
        # (a data-parallel replica's death names the replica: engine.data_parallel.ReplicaDeadError)
        message = getattr(ex, "public_message", None) or "the engine is unavailable; try again later"
        return _handle_api_error(req, resp, APIError(message, status=503,
                                                     code="engine_unavailable"), params)
    # The details (exception, traceback) go to the log only; the client learns that the server failed.
    log.exception("%s %r failed", req.method, req.path)
    _json(resp, APIError("internal server error (the server log has the details)", status=500).to_dict(), 500)


# ====================================================================================== app

class _App(falcon.App):
    """A Falcon app that answers HEAD wherever GET works.

    Falcon maps only the responders a resource defines, so HEAD would be a 405 everywhere (load balancers
    and `curl -I` probe with it). The GET responder serves HEAD; Falcon then drops the body and keeps the
    Content-Length of the GET body. A route without GET (POST-only) stays a 405 with its Allow header.
    """

    def add_route(self, uri_template: str, resource, **kwargs) -> None:
        suffix = kwargs.get("suffix")
        get_name, head_name = ("on_get", "on_head") if not suffix else (f"on_get_{suffix}", f"on_head_{suffix}")
        get = getattr(resource, get_name, None)
        if get is not None and getattr(resource, head_name, None) is None:
            setattr(resource, head_name, get)
        super().add_route(uri_template, resource, **kwargs)


class OpenAIServer:
    """The WSGI callable (a Falcon app) plus the state it serves from."""

    def __init__(self, state: AppState):
        self.state = state
        app = _App(middleware=[Guard(state.settings.api_key, state.settings.max_body_bytes)])
        app.req_options.auto_parse_form_urlencoded = False
        app.add_error_handler(Exception, _handle_unexpected)
        app.add_error_handler(falcon.HTTPError, _handle_http_error)
        app.add_error_handler(APIError, _handle_api_error)
        app.add_route("/v1/completions", CompletionsResource(state))
        app.add_route("/v1/chat/completions", ChatCompletionsResource(state))
        models = ModelsResource(state)
        app.add_route("/v1/models", models)
        app.add_route("/v1/models/{model_id}", models, suffix="one")
        health = HealthResource(state)
        app.add_route("/health", health)
        app.add_route("/ping", health)
        app.add_route("/version", VersionResource())
        if state.metrics is not None:
            app.add_route("/metrics", MetricsResource(state))
        app.add_route("/tokenize", TokenizeResource(state))
        app.add_route("/detokenize", DetokenizeResource(state))
        app.add_route("/server_info", ServerInfoResource(state))
        app.add_route("/reset_prefix_cache", ResetPrefixCacheResource(state))
        if state.task == "embed":          # an embedding model: /v1/embeddings (404 at the route table otherwise)
            from server.embeddings import EmbeddingsResource
            app.add_route("/v1/embeddings", EmbeddingsResource(state))
        from server.audio import TranscriptionsResource
        # every model answers it: a model that does not transcribe gets a 400 saying so (not a 404)
        app.add_route("/v1/audio/transcriptions", TranscriptionsResource(state))
        from server import lora, webui
        lora.add_routes(app, state)    # /v1/load_lora_adapter, /v1/unload_lora_adapter
        webui.add_routes(app)          # GET /: the chat page (public; the /v1 routes it calls need the key)
        self.falcon_app = app

    def __call__(self, environ, start_response):
        try:
            return self.falcon_app(environ, start_response)
        except BaseException:
            # E.g. the server could not send the status line or headers (a client gone, a header value it
            # refuses): a generation admitted for this request must not run on with nobody to read it.
            gen = environ.get(GENERATION_KEY)
            if gen is not None:
                gen.close()
            raise

    def close(self) -> None:
        self.state.close()


def create_app(engine=None, settings: ServerSettings | None = None) -> OpenAIServer:
    """The server around `engine` (AsyncEngine-like: submit/abort/call/shutdown); without one, builds the
    engine the settings describe (JITKERN_* environment when `settings` is None)."""
    settings = settings or ServerSettings.from_env()
    if engine is None:
        engine = build_engine(settings)
    return OpenAIServer(AppState(engine, settings))


def build_engine(settings: ServerSettings):
    if settings.engine_factory:
        module, _, name = settings.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module), name or "make_engine")
        return factory(settings)
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    args = EngineArgs(**settings.engine_kwargs())
    from server import shared_engine
    if shared_engine.current() is not None:         # one of several API processes: attach to the master's engine
        from engine.data_parallel import DataParallelEngine
        return DataParallelEngine(args, attach=shared_engine.current().attach)
    if args.data_parallel_size != 1 or args.distributed_executor_backend == "ray" or engine_in_own_process(settings):
        from engine.data_parallel import DataParallelEngine
        return DataParallelEngine(args)
    return AsyncEngine(args)


def engine_in_own_process(settings: ServerSettings) -> bool:
    """Whether the engine runs apart from the HTTP threads (settings.engine_process; unset: on CUDA). In one
    process, each of the engine's waits on the device (a graph launch, a copy back) hands the interpreter lock
    to handler threads formatting tokens, and the step resumes only when they let go of it."""
    if settings.engine_process is not None:
        return settings.engine_process
    device = (settings.device or "auto").strip().lower()
    if device != "auto":
        return device == "cuda"
    # auto picks CUDA where a device answers; asked without making a context, which would hold memory on the card
    # in this process that never runs a kernel (the engine process checks the device itself)
    from engine.parallel.config import cuda_device_count
    return cuda_device_count() > 0


def configure_logging(verbose: bool) -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_jitkern", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._jitkern = True
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


_default_app: Optional[OpenAIServer] = None
_default_lock = threading.Lock()


def default_app() -> OpenAIServer:
    """The app gunicorn serves, built once per process from the environment. A bad setting or a model
    that cannot load stops the worker with gunicorn's boot-error code (the master then exits) after
    one clear line in the log, not a traceback."""
    global _default_app
    with _default_lock:
        if _default_app is not None:
            return _default_app
        try:
            settings = ServerSettings.from_env()
        except SettingsError as e:
            logging.getLogger("jitkern.server").error("bad server setting: %s", e)
            raise SystemExit(WORKER_BOOT_ERROR) from None
        configure_logging(settings.verbose)
        t0 = time.perf_counter()
        try:
            app = create_app(settings=settings)
        except Exception as e:  # noqa: BLE001 - reported as one line; the traceback only with -v
            log.error("could not start the engine: %s: %s", type(e).__name__, e, exc_info=settings.verbose)
            raise SystemExit(WORKER_BOOT_ERROR) from None
        if settings.warmup:
            try:
                warm_up(app.state)
            except Exception as e:  # noqa: BLE001
                why = str(e) if isinstance(e, WarmUpFailed) else f"{type(e).__name__}: {e}"
                log.error("the warm-up generation failed: %s", why, exc_info=settings.verbose)
                app.close()
                raise SystemExit(WORKER_BOOT_ERROR) from None
        log.info("serving %s (max_model_len %d) in pid %d, ready in %.1fs", app.state.served_model_name,
                 app.state.max_model_len, os.getpid(), time.perf_counter() - t0)
        _default_app = app
        return app


class WarmUpFailed(RuntimeError):
    """The warm-up request ended in an error (the message is the engine's "Type: message" of the cause)."""


def warm_up(state: AppState) -> None:
    """One short greedy generation, so that one-time work on the first step (kernel loading, graph
    recording) is paid before /health says ready, not by the first client's time to first token."""
    from engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    ids = state.tokenizer.encode("Hello", add_special_tokens=True) or [0]
    if state.task == "transcription":
        from server.audio import warm_up_transcription
        warm_up_transcription(state)
        log.info("warm-up transcription done in %.1fs", time.perf_counter() - t0)
        return
    if state.task == "embed":
        from server.embeddings import warm_up_embeddings
        warm_up_embeddings(state, ids)
        log.info("warm-up embedding done in %.1fs", time.perf_counter() - t0)
        return
    stream = state.engine.submit(f"warmup-{os.getpid()}", ids, SamplingParams(max_tokens=2, temperature=0.0,
                                                                              ignore_eos=True))
    last = None
    for last in stream:
        pass
    # the engine isolates a failing request (it ends with finish_reason "error" and the cause in the log)
    # instead of raising: a server whose one warm-up request failed can serve nothing, so it must not start
    if last is None:
        raise WarmUpFailed("the warm-up request produced no output")
    if last.error or any(o.finish_reason == "error" for o in last.outputs):
        cause = getattr(getattr(state.engine, "engine", None), "last_step_error", None)
        raise WarmUpFailed(cause or last.error or "the engine failed the request")
    log.info("warm-up generation done in %.1fs", time.perf_counter() - t0)


def install_drain_on_sigterm(app: OpenAIServer) -> None:
    """Chains the worker's SIGTERM handler (gunicorn's graceful stop) with the app's drain."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        app.state.begin_drain()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.siginterrupt(signal.SIGTERM, False)


def __getattr__(name: str):
    # `gunicorn server.app` looks up `application`: build it on first access (in the worker, after fork).
    if name in ("application", "app"):
        return default_app()
    raise AttributeError(f"module 'server.app' has no attribute {name!r}")
