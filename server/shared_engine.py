"""The engine process shared by the server's HTTP worker processes (`--api-server-count N`, vLLM's flag).

gunicorn's master starts it (server/gunicorn_conf.py on_starting) before it forks the workers, which inherit
`current()` and attach to it (server.app.build_engine -> DataParallelEngine(attach=...)). It runs as long as the
master: restarted when it dies (the workers reconnect by themselves), stopped in on_exit. Server-side metrics
(latency histograms, finished requests) live in each worker, so prometheus_client's multiprocess mode adds them
up over the workers at scrape time (server.metrics); the engine's own numbers are read from the engine.
"""
from __future__ import annotations

import os
import shutil
import tempfile

_shared = None
_metrics_dir = None


def current():
    """The SharedEngine of this server, or None (one worker: the worker starts its own engine)."""
    return _shared


def refusal(settings) -> str | None:
    """Why these settings cannot run with several API processes sharing one engine, or None."""
    if settings.engine_process is False:
        return ("--api-server-count (JITKERN_API_SERVER_COUNT) > 1 shares one engine process: drop "
                "--no-engine-process (JITKERN_ENGINE_PROCESS=0)")
    if (settings.data_parallel_size or 1) > 1 or settings.distributed_executor_backend == "ray":
        return "--api-server-count > 1 with data parallelism is not supported yet: use one of the two"
    if settings.enable_lora:
        return ("--api-server-count > 1 with --enable-lora is not supported yet (each API process would keep its "
                "own adapter list)")
    return None


def start(settings=None) -> None:
    """In gunicorn's master, before any worker exists. Settings it cannot serve stop the server with one line
    naming them (exit status 2), before any engine or worker starts."""
    global _shared, _metrics_dir
    import logging
    from server.settings import ServerSettings, SettingsError
    try:
        settings = settings or ServerSettings.from_env()
    except SettingsError as e:
        logging.getLogger("jitkern.server").error("%s", e)
        raise SystemExit(2) from None
    why = refusal(settings)
    if why is not None:
        logging.getLogger("jitkern.server").error("%s", why)
        raise SystemExit(2)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # must be set before prometheus_client is first imported (its value class is chosen then)
        _metrics_dir = tempfile.mkdtemp(prefix="jitkern-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir
    from engine.data_parallel import SharedEngine
    from engine.llm_engine import EngineArgs
    _shared = SharedEngine(EngineArgs(**settings.engine_kwargs()))


def stop() -> None:
    global _shared, _metrics_dir
    if _shared is not None:
        _shared.stop()
        _shared = None
    if _metrics_dir is not None:
        shutil.rmtree(_metrics_dir, ignore_errors=True)
        _metrics_dir = None
