"""One data-parallel replica: an AsyncEngine in its own process (multiprocessing) or Ray actor, talking to the
front end (engine.data_parallel) in messages.

This module is imported first in a fresh replica process, before anything that starts kernel threads, so its
top level stays light: the thread count and the core set are applied before `engine.async_engine` is imported.

Front end -> replica (commands, in order):
    ("add", tag, [(request id, prompt, params), ...], priority, lora_request)   admitted together or not at all
    ("abort", [request id, ...])
    ("call", tag, fn, args)             fn(LLMEngine, *args) between steps (fn must pickle: a module-level
                                        function or an operator.methodcaller / attrgetter)
    ("stop",)
A shared engine (`python -m engine.dp_replica --serve ADDRESS`, serve_main) listens instead and serves several
front ends at once, the same messages on each connection.

Replica -> front end (a list of messages per send, in order):
    ("ready", facts)                    once, after the engine loaded
    ("added", tag, error | None)        the add's validation (prepare_request) result
    ("reply", tag, ok, value | error)
    ("out", request id, delta)          a RequestOutput as engine.output_wire encodes it (the step's delta)
    ("end", request id): aborted; ("fail", request id, error)
    ("kv", KVEventBatch)                the prefix cache's events, every step that changed it

Errors travel as (class name, message, param) and are rebuilt on the other side (see wire_error/rebuild_error):
exception classes with keyword arguments do not survive pickling.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Optional

log = logging.getLogger("engine.dp")

READY_TIMEOUT_S = 600.0


def wire_error(e: BaseException) -> tuple:
    return (type(e).__name__, str(e), getattr(e, "param", None))


def rebuild_error(w) -> BaseException:
    name, message, param = w
    if name == "InvalidRequestError":
        from engine.errors import InvalidRequestError
        return InvalidRequestError(message, param=param)
    if name in ("EngineDeadError", "EngineTimeoutError", "EngineUnavailableError"):
        from engine import async_engine
        return getattr(async_engine, name)(message)
    return RuntimeError(message if name == "RuntimeError" else f"{name}: {message}")


def apply_placement(cpus, threads) -> None:
    """Pins this process to `cpus` (a list of core ids, or None) and sizes the kernel thread pool; must run
    before jitkern's thread pool starts."""
    if threads:
        os.environ["JITKERN_NUM_THREADS"] = str(int(threads))
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError as e:
            log.warning("data-parallel replica: could not pin to cores %s: %s", cpus, e)


def replica_facts(llm_engine) -> dict:
    """What the front end keeps of a replica's engine (its first replica's): for routing and the LLM API."""
    args = llm_engine.args
    return {
        "tokenizer": llm_engine.tokenizer,
        "max_model_len": int(llm_engine.max_model_len),
        "stop_ids": list(llm_engine.stop_ids),
        "default_sampling": dict(getattr(llm_engine, "default_sampling", None) or {}),
        "block_size": int(args.block_size),
        "enable_prefix_caching": bool(args.enable_prefix_caching),
        "max_num_seqs": int(args.max_num_seqs or 0),
        "args": args,
        "pid": os.getpid(),
    }


class _ForwardingPublisher:
    """Stands in for the engine's KV-event publisher: each batch goes to the front end (the router), and to
    the publisher the user configured, if any."""

    def __init__(self, emit, rank: int, inner=None):
        self.emit = emit
        self.rank = rank
        self.inner = inner

    def publish(self, batch) -> None:
        batch.data_parallel_rank = self.rank
        self.emit(("kv", batch))
        if self.inner is not None:
            self.inner.publish(batch)

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()


class _Sink:
    """Where the replica's AsyncEngine delivers one request's outputs: into the outbox, tagged, as deltas.
    `owned`: the set of request ids of the front end that added it (a shared engine's), left when it ends."""
    __slots__ = ("outbox", "request_id", "encoder", "owned")

    def __init__(self, outbox: queue.Queue, request_id: str, owned: Optional[set] = None):
        from engine.output_wire import OutputEncoder
        self.outbox = outbox
        self.request_id = request_id
        self.encoder = OutputEncoder()
        self.owned = owned

    def _put(self, item) -> None:
        from engine.async_engine import _DONE
        if item is _DONE:
            self.outbox.put(("end", self.request_id))
        elif isinstance(item, BaseException):
            self.outbox.put(("fail", self.request_id, wire_error(item)))
        else:
            self.outbox.put(("out", self.request_id, self.encoder.encode(item)))
            if not item.finished:
                return
        if self.owned is not None:
            self.owned.discard(self.request_id)


class ReplicaCore:
    """The replica's engine and its message handling, the same under multiprocessing and Ray."""

    def __init__(self, rank: int, engine_kwargs: dict):
        from engine.async_engine import AsyncEngine
        from engine.llm_engine import EngineArgs, LLMEngine
        self.rank = rank
        self.outbox: queue.Queue = queue.Queue()
        # where the prefix cache's events go: this outbox, or every attached front end's (serve_main)
        self.kv_outboxes: list = [self.outbox]
        kw = dict(engine_kwargs)
        user_events = kw.get("kv_events_config")
        if kw.get("enable_prefix_caching", True):
            # the router learns what this replica caches from its KV-cache events: record them always
            from engine.kv_events import KVEventsConfig
            cfg = KVEventsConfig.parse(user_events)
            if cfg is None or not cfg.enabled:
                kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            else:
                kw["kv_events_config"] = _rank_endpoint(cfg, rank)
        llm_engine = LLMEngine(EngineArgs(**kw))
        if llm_engine.kv_events_publisher is not None:
            inner = llm_engine.kv_events_publisher
            llm_engine.kv_events_publisher = _ForwardingPublisher(
                self._emit_kv, rank, None if type(inner).__name__ == "NullEventPublisher" else inner)
        self.engine = AsyncEngine(engine=llm_engine)
        self.facts = replica_facts(llm_engine)

    @property
    def dead(self):
        return self.engine.dead

    def _emit_kv(self, msg) -> None:
        for outbox in list(self.kv_outboxes):
            outbox.put(msg)

    def handle(self, cmd, outbox: Optional[queue.Queue] = None, owned: Optional[set] = None) -> bool:
        """Runs one command, answering into `outbox` (default: this core's own); False for "stop". `owned`
        collects the ids of the requests added through it while they run."""
        outbox = self.outbox if outbox is None else outbox
        kind = cmd[0]
        if kind == "add":
            _, tag, reqs, priority, lora = cmd
            self._add(tag, reqs, priority, lora, outbox, owned)
        elif kind == "abort":
            self.engine.abort_many(cmd[1])
        elif kind == "call":
            _, tag, fn, args = cmd
            self._call(tag, fn, args, outbox)
        elif kind == "stop":
            return False
        return True

    def _add(self, tag, reqs, priority, lora=None, outbox=None, owned=None) -> None:
        from concurrent.futures import Future
        outbox = self.outbox if outbox is None else outbox
        eng = self.engine
        try:
            eng._check_alive()
            preps = [eng.engine.prepare_request(rid, prompt, params, priority=priority, lora_request=lora)
                     for rid, prompt, params in reqs]
        except Exception as e:  # noqa: BLE001 - the caller's error (usually InvalidRequestError)
            outbox.put(("added", tag, wire_error(e)))
            return
        if owned is not None:
            owned.update(rid for rid, _, _ in reqs)
        sinks = [_Sink(outbox, rid, owned) for rid, _, _ in reqs]
        fut: Future = Future()

        def added(f) -> None:
            # registered by the engine thread (or refused there: e.g. an id in use) -> one "fail" per request
            err = f.exception() if not f.cancelled() else RuntimeError("the add was withdrawn")
            if err is not None:
                for s in sinks:
                    s._put(err)
        fut.add_done_callback(added)
        # validated: answered now, without waiting for the engine thread's next step boundary
        outbox.put(("added", tag, None))
        eng._cmds.put(("add", (preps, sinks), fut))
        eng._wake.set()

    def _call(self, tag, fn, args, outbox=None) -> None:
        outbox = self.outbox if outbox is None else outbox

        def run():
            try:
                value = self.engine.call(fn, *args)
                outbox.put(("reply", tag, True, value))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                outbox.put(("reply", tag, False, wire_error(e)))
        threading.Thread(target=run, daemon=True, name="dp-call").start()

    def take(self, timeout: float, outbox: Optional[queue.Queue] = None) -> list:
        """The messages queued since the last take (waits up to timeout for the first)."""
        outbox = self.outbox if outbox is None else outbox
        try:
            out = [outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(outbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        try:
            self.engine.shutdown(timeout=0.0)
        finally:
            self.engine.engine.close()


def _rank_endpoint(cfg, rank: int):
    """A user's zmq endpoint per replica (vLLM offsets the port by the data-parallel rank): tcp://host:P -> P+rank."""
    import dataclasses
    ep = cfg.endpoint
    head, _, port = ep.rpartition(":")
    if rank and ep.startswith("tcp://") and port.isdigit():
        return dataclasses.replace(cfg, endpoint=f"{head}:{int(port) + rank}")
    return cfg


# ------------------------------------------------------------------------------------------ local processes
def mp_main(address: str, authkey: bytes) -> None:
    """A replica process (`python -m engine.dp_replica ADDRESS`, the authkey on stdin): connects back to the
    front end, takes (rank, engine kwargs, cores, threads), and serves commands until "stop" or the front end
    goes away (then it exits: a replica never outlives its server). A fresh interpreter, not a multiprocessing
    spawn: the user's __main__ (a script without an `if __name__ == "__main__"` guard) is never re-run."""
    from multiprocessing.connection import Client
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    rank, engine_kwargs, cpus, threads = conn.recv()
    apply_placement(cpus, threads)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s dp{rank} %(name)s: %(message)s")
    try:
        core = ReplicaCore(rank, engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - the front end reports it
        try:
            conn.send([("failed", wire_error(e))])
        finally:
            os._exit(3)
    send_lock = threading.Lock()
    stopping = threading.Event()

    def sender() -> None:
        with send_lock:
            conn.send([("ready", core.facts)])
        while not stopping.is_set():
            msgs = core.take(0.5)
            if core.dead is not None and not msgs:
                log.error("replica %d: the engine thread stopped (%s); exiting", rank, core.dead)
                os._exit(4)
            if msgs:
                try:
                    with send_lock:
                        conn.send(msgs)
                except (OSError, EOFError, BrokenPipeError):
                    os._exit(0)
    threading.Thread(target=sender, daemon=True, name=f"dp{rank}-send").start()
    try:
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                break                           # the front end is gone
            if not core.handle(cmd):
                break
    finally:
        stopping.set()
        try:
            core.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        os._exit(0)


# ------------------------------------------------------------------------------------ a shared engine
def serve_main(address: str, authkey: bytes, setup) -> None:
    """An engine shared by several front ends (the server's API processes, `--api-server-count`): loads the
    engine of `setup` (rank, engine kwargs, cores, threads), then listens on the AF_UNIX `address` and serves
    every front end that connects with `authkey`, each with its own outbox and sender thread. A front end that
    leaves ("stop" or a closed connection) has its running requests aborted; the engine stays for the others.
    Exits when the engine thread dies (whoever started it restarts it) or when its parent is gone."""
    from multiprocessing.connection import Listener
    rank, engine_kwargs, cpus, threads = setup
    apply_placement(cpus, threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    parent = os.getppid()
    core = ReplicaCore(rank, engine_kwargs)
    core.kv_outboxes.clear()            # no front end yet; each one that connects gets the events
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    log.info("engine process %d: serving front ends at %s", os.getpid(), address)

    def watch() -> None:
        # the starter (the server's master process) is gone: so is the server, and so goes this engine
        while os.getppid() == parent:
            if core.dead is not None:
                log.error("the engine thread stopped (%s); exiting", core.dead)
                os._exit(4)
            threading.Event().wait(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="engine-watch").start()
    while True:
        try:
            conn = listener.accept()
        except OSError as e:            # a client that failed the handshake (AuthenticationError is an OSError)
            log.warning("engine process: refused a connection: %s", e)
            continue
        threading.Thread(target=_serve_front_end, args=(core, conn), daemon=True, name="engine-link").start()


def _serve_front_end(core: ReplicaCore, conn) -> None:
    outbox: queue.Queue = queue.Queue()
    owned: set = set()
    gone = threading.Event()

    def sender() -> None:
        try:
            conn.send([("ready", core.facts)])
            core.kv_outboxes.append(outbox)
            while not gone.is_set():
                msgs = core.take(0.5, outbox)
                if msgs:
                    conn.send(msgs)
        except (OSError, EOFError, BrokenPipeError, ValueError):
            gone.set()
    threading.Thread(target=sender, daemon=True, name="engine-link-send").start()
    try:
        while not gone.is_set():
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                break
            if not core.handle(cmd, outbox, owned):
                break                   # this front end leaves; the engine serves the others
    finally:
        gone.set()
        try:
            core.kv_outboxes.remove(outbox)
        except ValueError:
            pass
        if owned:
            core.engine.abort_many(list(owned))
        try:
            conn.close()
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ Ray
class RayReplica:
    """The Ray actor (wrapped with ray.remote by engine.data_parallel): `command` runs in the default
    concurrency group (one at a time, in the order sent), `poll` and `ready` in the "io" group."""

    def __init__(self, rank: int, engine_kwargs: dict, threads):
        apply_placement(None, threads)
        self.core = ReplicaCore(rank, engine_kwargs)

    def ready(self) -> dict:
        return self.core.facts

    def command(self, cmd) -> None:
        self.core.handle(cmd)

    def poll(self, timeout: float) -> list:
        msgs = self.core.take(timeout)
        if self.core.dead is not None and not msgs:
            # the engine thread stopped: end the actor so Ray restarts it
            os._exit(4)
        return msgs

    def pid(self) -> int:
        return os.getpid()


if __name__ == "__main__":
    import sys
    if sys.argv[1] == "--serve":
        # the authkey, then the pickled setup, each as one hex line on stdin
        import pickle
        key = bytes.fromhex(sys.stdin.readline().strip())
        serve_main(sys.argv[2], key, pickle.loads(bytes.fromhex(sys.stdin.readline().strip())))
    else:
        mp_main(sys.argv[1], bytes.fromhex(sys.stdin.readline().strip()))
