"""gunicorn settings for the OpenAI server (the repo root's gunicorn.conf.py imports these).

One worker process owns the engine; its threads serve concurrent requests, which the one engine batches. With
JITKERN_API_SERVER_COUNT > 1, that many workers share one engine process started by the master.
There is no worker timeout: a gthread worker's heartbeat does not depend on request length, and loading
the model (kernel compilation on a cold cache) may take long before the first heartbeat.
Everything here can be changed through JITKERN_* variables (set by `python -m server`) or gunicorn's own
command-line flags, which take precedence over this file.
"""
import os

from server.settings import env_int

_host = os.environ.get("JITKERN_HOST") or "0.0.0.0"
_port = env_int("JITKERN_PORT", 8000, low=0)
# [::1]-style IPv6 literals need brackets in a gunicorn bind address.
bind = [f"[{_host}]:{_port}" if ":" in _host and not _host.startswith("[") else f"{_host}:{_port}"]

# JITKERN_API_SERVER_COUNT (--api-server-count): more than one worker share one engine process, which the master
# starts before it forks them (server/shared_engine.py); one worker starts its own engine.
workers = env_int("JITKERN_API_SERVER_COUNT", 1, low=1)
# gthread, with request heads and bodies read in the event loop (a slow client never holds a thread) and
# gunicorn's own error pages as OpenAI JSON: see server/http_worker.py.
worker_class = "server.http_worker.ServerWorker"
# A thread per in-flight request: enough for a full batch plus room for /metrics, /health and queued clients.
# Without JITKERN_MAX_NUM_SEQS the engine's default is 64 on the CPU and 256 on CUDA; the master does not touch
# the GPU (the engine starts in the worker), so unless JITKERN_DEVICE says cpu the threads cover 256 (gthread
# starts its threads as connections need them: idle ones cost nothing).
_default_seqs = 64 if os.environ.get("JITKERN_DEVICE", "").strip().lower() == "cpu" else 256
threads = env_int("JITKERN_THREADS", max(env_int("JITKERN_MAX_NUM_SEQS", _default_seqs, low=1), 32) + 32, low=1)
timeout = 0
graceful_timeout = env_int("JITKERN_GRACEFUL_TIMEOUT", 30, low=1)
keepalive = 5
preload_app = False          # the engine (threads) must start in the worker, never in the master before fork
loglevel = "debug" if os.environ.get("JITKERN_VERBOSE", "").lower() in ("1", "true", "yes", "on") else "info"
accesslog = "-" if loglevel == "debug" else None
errorlog = "-"
proc_name = "jitkern-server"


def on_starting(server):
    if server.cfg.workers > 1:
        from server import shared_engine
        shared_engine.start()


def on_exit(server):
    from server import shared_engine
    shared_engine.stop()


def post_worker_init(worker):
    # The worker has its signal handlers now and its app loaded (the engine is up): chain SIGTERM so that
    # in-flight streams get a bounded time to finish and are then ended cleanly.
    from server.app import install_drain_on_sigterm
    if hasattr(worker.wsgi, "state"):
        # The drain must end streams before gunicorn's graceful timeout cuts the connections.
        state = worker.wsgi.state
        state.settings.drain_timeout_s = min(state.settings.drain_timeout_s,
                                             max(worker.cfg.graceful_timeout - 3.0, 0.0))
        install_drain_on_sigterm(worker.wsgi)


def worker_exit(server, worker):
    wsgi = getattr(worker, "wsgi", None)
    if wsgi is not None and hasattr(wsgi, "close"):
        wsgi.close()

# gunicorn >= 25's runtime control socket is one fixed path per user: two servers on one host would fight
# over it, and nothing here needs it.
control_socket_disable = True
