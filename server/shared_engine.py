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


def start(settings=None) -> None:
    """In gunicorn's master, before any worker exists."""
    global _shared, _metrics_dir
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # must be set before prometheus_client is first imported (its value class is chosen then)
        _metrics_dir = tempfile.mkdtemp(prefix="jitkern-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir
    from engine.data_parallel import SharedEngine
    from engine.llm_engine import EngineArgs
    from server.settings import ServerSettings
    settings = settings or ServerSettings.from_env()
    _shared = SharedEngine(EngineArgs(**settings.engine_kwargs()))


def stop() -> None:
    global _shared, _metrics_dir
    if _shared is not None:
        _shared.stop()
        _shared = None
    if _metrics_dir is not None:
        shutil.rmtree(_metrics_dir, ignore_errors=True)
        _metrics_dir = None
