"""Data parallelism (vLLM's `--data-parallel-size N`): N engine replicas, each with its own process (or Ray
actor), KV cache and scheduler, behind one front end that the LLM API and the server use like one engine.

    LLM(model, data_parallel_size=2)                                    # multiprocessing (the default backend)
    LLM(model, data_parallel_size=2, distributed_executor_backend="ray")   # Ray actors in placement groups
    python -m server --data-parallel-size 2 [--distributed-executor-backend ray]

Placement. multiprocessing ("mp"): replica r runs in its own interpreter (`python -m engine.dp_replica`) pinned to the r-th of N equal, disjoint slices of
this process's cores when there are at least N of them; its kernel thread pool gets the slice's size (or the
threads split evenly: JITKERN_NUM_THREADS // N, at least 1, when the cores are fewer than N). Ray: one placement
group with one bundle of {"CPU": cores per replica} (and {"GPU": 1} on CUDA) per replica, strategy SPREAD (across
nodes where the cluster has several), each replica an actor in its bundle that Ray restarts when it dies.

Routing (`routing`): "prefix" (default when prefix caching is on) sends a request to the replica holding the
longest cached prefix of its prompt, as that replica's KV-cache events (engine.kv_events: BlockStored /
BlockRemoved / AllBlocksCleared) report it, plus the prefixes routed to it whose events are still on their way;
among replicas within `max_load_imbalance` unfinished requests of the least loaded one. No cached prefix (or a
tie): the fewest unfinished requests. "load": fewest unfinished only. "round_robin": in turn (the baseline).

Faults. A replica that dies (process exit, actor death, or its engine thread stopping) fails its in-flight
requests at once with ReplicaDeadError, an EngineUnavailableError naming the replica (the server answers 503
with that message; a stream ends with that error event); nothing is retried, since tokens may already have
been streamed. The other replicas keep serving, and the dead one is restarted (multiprocessing: a new process;
Ray: the actor's restart), then takes requests again. With every replica down, a submit fails with
EngineUnavailableError at once.
"""
from __future__ import annotations

import itertools
import logging
import operator
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from engine import limits
from engine.async_engine import (_DONE, EngineDeadError, EngineUnavailableError, RequestGroupStream,
                                 RequestStream)
from engine.dp_replica import READY_TIMEOUT_S, rebuild_error
from engine.output_wire import OutputDecoder
from engine.outputs import merge_deltas

log = logging.getLogger("engine.dp")

BACKENDS = ("mp", "ray")
ROUTINGS = ("prefix", "load", "round_robin")
_LIVENESS_POLL_S = 0.5
CONNECT_TIMEOUT_S = 5.0
# At most this many messages (a step's outputs each, under load) are taken from a replica before they are
# delivered: a front end that fell behind catches up with one hand-off per request for all of them.
_DRAIN_MAX = 64
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


class DataParallelUnavailableError(EngineUnavailableError):
    """No replica can take this request now (the server answers 503 with this message: it names no secret)."""

    @property
    def public_message(self) -> str:
        return str(self)


class ReplicaDeadError(DataParallelUnavailableError):
    """A data-parallel replica died while running this request (the message names the replica)."""


def check_data_parallel(size, backend) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {size!r}")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def core_sets(n: int, cpus: Optional[list] = None) -> list:
    """n disjoint, equal, contiguous slices of `cpus` (this process's cores), or n Nones when there are fewer
    cores than replicas (then nothing is pinned)."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < n:
        return [None] * n
    per = len(cpus) // n
    return [cpus[r * per:(r + 1) * per] for r in range(n)]


def threads_per_replica(n: int, cores: Optional[list]) -> int:
    """The slice's core count, or JITKERN_NUM_THREADS (else this process's cores) split evenly."""
    from jitkern.env import num_threads
    total = num_threads()
    if total is None:
        total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores is not None:
        return max(1, min(len(cores), total // n) if total >= n else 1)
    return max(1, total // n)


# ================================================================================ transports
class _ConnectionTransport:
    """A replica's engine behind a multiprocessing connection: sending, receiving and the ready handshake;
    subclasses say how the connection is made and what a quiet or dead peer means (`_check_peer`)."""

    def __init__(self):
        self._send_lock = threading.Lock()
        self.proc = None
        self.conn = None

    def _check_peer(self, loading: bool) -> None:
        """Raises when the peer is known to be gone (loading: while the ready handshake waits)."""

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.conn.poll(0.2):
                for m in self.conn.recv():
                    if m[0] == "ready":
                        return m[1]
                    if m[0] == "failed":
                        raise rebuild_error(m[1])
            else:
                self._check_peer(loading=True)
        raise TimeoutError(f"the replica did not load within {timeout:g} s")

    def send(self, cmd) -> None:
        with self._send_lock:
            self.conn.send(cmd)

    def recv(self) -> list:
        """The next messages (an empty list after a quiet while); raises EOFError when the peer is gone."""
        if self.conn.poll(_LIVENESS_POLL_S):
            return self.conn.recv()
        self._check_peer(loading=False)
        return []

    def more(self) -> bool:
        """Whether more messages have arrived already (recv() would not wait)."""
        return self.conn.poll(0)


class _MPTransport(_ConnectionTransport):
    """A replica process (a fresh interpreter running engine.dp_replica) and its connection."""

    def __init__(self, rank: int, engine_kwargs: dict, cpus, threads):
        super().__init__()
        self.rank, self.kwargs, self.cpus, self.threads = rank, engine_kwargs, cpus, threads

    def start(self) -> None:
        import secrets
        import subprocess
        import sys
        import tempfile
        from multiprocessing.connection import Listener
        authkey = secrets.token_bytes(16)
        sock_dir = tempfile.mkdtemp(prefix="jitkern-dp")
        address = os.path.join(sock_dir, "replica.sock")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.dp_replica", address], env=env,
                                         stdin=subprocess.PIPE)
            self.proc.stdin.write((authkey.hex() + "\n").encode())
            self.proc.stdin.close()
            got: list = []
            t = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
            t.start()
            while t.is_alive() and self.proc.poll() is None:
                t.join(0.2)
            t.join(CONNECT_TIMEOUT_S)
            if not got:
                self.proc.kill()
                raise RuntimeError(f"replica {self.rank} did not connect (exit code {self.proc.poll()})")
            self.conn = got[0]
        try:
            os.rmdir(sock_dir)            # (the listener removed its socket file)
        except OSError:
            pass
        self.conn.send((self.rank, self.kwargs, self.cpus, self.threads))

    def _check_peer(self, loading: bool) -> None:
        if self.proc.poll() is not None:
            if loading:
                raise RuntimeError(f"the replica process exited with code {self.proc.returncode} while loading")
            raise EOFError(f"exit code {self.proc.returncode}")

    def describe_death(self, cause) -> str:
        code = self.proc.poll() if self.proc is not None else None
        if code is not None and code < 0:
            import signal
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}" if code is not None else str(cause)

    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def restart(self) -> None:
        self.close(timeout=0.0)
        self.start()

    def close(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        import subprocess
        try:
            if self.proc.poll() is None and timeout > 0:
                self.send(("stop",))
                self.proc.wait(timeout)
        except (OSError, EOFError, BrokenPipeError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        try:
            if self.conn is not None:
                self.conn.close()
        except OSError:
            pass


def replica_kwargs(args) -> dict:
    """EngineArgs (or a namespace of its fields) as the keyword arguments of one replica's engine."""
    from dataclasses import asdict, is_dataclass
    kw = asdict(args) if is_dataclass(args) else dict(vars(args))
    kw["data_parallel_size"] = 1
    kw["distributed_executor_backend"] = None
    return kw


class SharedEngine:
    """An engine process several front ends attach to (engine.dp_replica.serve_main): the server's master
    process starts it before it forks its API processes (`--api-server-count N`), each of which attaches with
    DataParallelEngine(attach=shared.attach); restarted when it dies, stopped by stop()."""

    def __init__(self, args):
        import secrets
        import tempfile
        self._kw = replica_kwargs(args)
        self.address = os.path.join(tempfile.mkdtemp(prefix="jitkern-engine"), "engine.sock")
        self.authkey = secrets.token_bytes(16)
        self.restarts = 0
        self._stopping = threading.Event()
        self.proc = None
        self._spawn()
        threading.Thread(target=self._watch, daemon=True, name="shared-engine-watch").start()

    @property
    def attach(self) -> tuple:
        return self.address, self.authkey

    def _spawn(self) -> None:
        import pickle
        import subprocess
        import sys
        try:
            os.unlink(self.address)     # a dead engine's socket file: the new one listens at the same path
        except OSError:
            pass
        cores = core_sets(1)[0]
        setup = (0, self._kw, cores, threads_per_replica(1, cores))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.dp_replica", "--serve", self.address], env=env,
                                     stdin=subprocess.PIPE)
        self.proc.stdin.write((self.authkey.hex() + "\n" + pickle.dumps(setup).hex() + "\n").encode())
        self.proc.stdin.close()
        log.info("shared engine: process %d starting, front ends attach at %s", self.proc.pid, self.address)

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            code = self.proc.poll()
            if code is None:
                continue
            if self._stopping.is_set():
                return
            delay = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.error("shared engine: process %d exited with %s; restarting in %.1f s", self.proc.pid, code, delay)
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()

    def stop(self, timeout: float = 10.0) -> None:
        import subprocess
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            os.unlink(self.address)
            os.rmdir(os.path.dirname(self.address))
        except OSError:
            pass


class _AttachTransport(_ConnectionTransport):
    """A connection to a SharedEngine's process (another front end may share it): the engine is neither
    started nor stopped here; restart() reconnects once its owner has restarted it. A dead engine shows as
    the connection's end of file."""

    def __init__(self, rank: int, address: str, authkey: bytes):
        super().__init__()
        self.rank, self.address, self.authkey = rank, address, authkey
        self._pid = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        from multiprocessing.connection import Client
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
                return
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no engine process answered at {self.address} within {timeout:g} s: "
                                       f"{e}") from None
                time.sleep(0.2)

    def wait_ready(self, timeout: float) -> dict:
        facts = super().wait_ready(timeout)
        self._pid = facts.get("pid")
        return facts

    def describe_death(self, cause) -> str:
        return f"the engine process{f' {self._pid}' if self._pid else ''} closed its connection ({cause})"

    def pid(self) -> Optional[int]:
        return self._pid

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self, timeout: float = 5.0) -> None:
        if self.conn is None:
            return
        try:
            if timeout > 0:
                self.send(("stop",))        # this front end leaves; the engine serves the others
        except (OSError, EOFError, BrokenPipeError, ValueError):
            pass
        try:
            self.conn.close()
        except OSError:
            pass


class _RayTransport:
    """A replica as a Ray actor in its placement-group bundle; Ray restarts it when it dies."""

    def __init__(self, rank: int, actor_cls, engine_kwargs: dict, threads, options: dict):
        self.rank, self.actor_cls, self.kwargs, self.threads, self.options = rank, actor_cls, engine_kwargs, threads, options
        self.actor = None

    def start(self) -> None:
        self.actor = self.actor_cls.options(**self.options).remote(self.rank, self.kwargs, self.threads)

    def wait_ready(self, timeout: float) -> dict:
        import ray
        deadline = time.monotonic() + timeout
        while True:
            try:
                return ray.get(self.actor.ready.options(concurrency_group="io").remote(),
                               timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"the replica did not load within {timeout:g} s") from None
            except ray.exceptions.RayActorError as e:
                # still restarting (or its constructor failed: then it keeps failing until the deadline)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the replica actor cannot start: {e}") from None
                time.sleep(1.0)

    def send(self, cmd) -> None:
        self.actor.command.remote(cmd)

    def recv(self) -> list:
        import ray
        try:
            return ray.get(self.actor.poll.options(concurrency_group="io").remote(_LIVENESS_POLL_S),
                           timeout=60.0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise EOFError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    def more(self) -> bool:
        return False            # each poll() call already returns everything the actor has queued

    def describe_death(self, cause) -> str:
        return f"actor died: {cause}"

    def pid(self) -> Optional[int]:
        import ray
        try:
            return ray.get(self.actor.pid.options(concurrency_group="io").remote(), timeout=10)
        except Exception:  # noqa: BLE001
            return None

    def restart(self) -> None:
        return              # Ray restarts the actor (max_restarts); wait_ready waits for it

    def close(self, timeout: float = 5.0) -> None:
        import ray
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            self.actor = None


# ================================================================================ replicas
class _SyncSink:
    """Delivers one request's outputs to the LLM-API side of the front end (step())."""
    __slots__ = ("q", "request_id")

    def __init__(self, q: queue.SimpleQueue, request_id: str):
        self.q = q
        self.request_id = request_id

    def _put(self, item) -> None:
        self.q.put((self.request_id, item))


class _Replica:
    def __init__(self, rank: int, transport):
        self.rank = rank
        self.transport = transport
        self.state = "starting"          # starting | up | down | closed
        self.inflight: dict = {}         # request id -> sink
        self.decoders: dict = {}         # request id -> OutputDecoder (its outputs arrive as deltas)
        self.pending: dict = {}          # tag -> Future (add / call replies)
        self.cached: set = set()         # block hashes the replica holds (events) or was sent (routing)
        self.lock = threading.Lock()
        self.restarts = 0
        self.routed = 0
        self.routed_by_prefix = 0
        self.deaths = 0
        self.last_error: Optional[str] = None
        self.generation = 0              # incremented at each (re)start: a stale receiver thread stops

    @property
    def load(self) -> int:
        return len(self.inflight)


class _AnyReplicaUp:
    """Stands where the server's /health looks for the engine thread (AsyncEngine._thread): "alive" while at
    least one replica serves, so a load balancer stops sending while every replica is restarting."""

    def __init__(self, engine: "DataParallelEngine"):
        self.engine = engine

    def is_alive(self) -> bool:
        return any(r.state == "up" for r in self.engine.replicas)


class DataParallelEngine:
    """N replicas behind one AsyncEngine-like front end (submit / submit_batch / abort / call, for the
    server) that is also LLMEngine-like (add_request / step / has_unfinished_requests, for the LLM API)."""

    def __init__(self, args=None, *, routing: Optional[str] = None, max_load_imbalance: Optional[int] = None,
                 restart: bool = True, attach: Optional[tuple] = None, **kwargs):
        from engine.llm_engine import EngineArgs
        args = args if args is not None else EngineArgs(**kwargs)
        self.args = args
        n = int(getattr(args, "data_parallel_size", 1) or 1)
        backend = getattr(args, "distributed_executor_backend", None) or "mp"
        check_data_parallel(n, backend)
        # attach: (address, authkey) of a SharedEngine's process, the one replica, shared with other front ends
        self._attach = attach
        if attach is not None:
            n, backend = 1, "mp"
        self.size, self.backend = n, backend
        kw = replica_kwargs(args)
        self._replica_kwargs = kw
        self.restart_enabled = restart
        self.command_timeout_s = limits.ENGINE_COMMAND_TIMEOUT_S
        self._tags = itertools.count()
        self._rr = itertools.count()
        self._sync_q: queue.SimpleQueue = queue.SimpleQueue()
        self._sync_ids: set = set()
        self._owner: dict = {}           # request id -> _Replica
        self._lock = threading.Lock()
        self._closed = False
        self._dead: Optional[BaseException] = None
        self._ray_pg = None
        # (request id, replica rank, cached blocks matched) of the latest routings: what /metrics counts, per request
        self.route_log: deque = deque(maxlen=4096)
        self.replicas = self._make_replicas(kw)
        self._thread = _AnyReplicaUp(self)
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise
        f = self.facts
        self.tokenizer = f["tokenizer"]
        self.max_model_len = f["max_model_len"]
        self.stop_ids = f["stop_ids"]
        self.default_sampling = f["default_sampling"]
        self.block_size = f["block_size"]
        self.prefix_caching = f["enable_prefix_caching"]
        self.max_num_seqs = f["max_num_seqs"]
        self.routing = routing or ("prefix" if self.prefix_caching else "load")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.routing == "prefix" and not self.prefix_caching:
            raise ValueError("prefix-aware routing needs prefix caching (enable_prefix_caching)")
        self.max_load_imbalance = max_load_imbalance if max_load_imbalance is not None else \
            max(8, (self.max_num_seqs or 32) // 2)
        from engine.kv_cache_manager import root_hash
        self._root_hash = root_hash()
        if attach is not None:
            log.info("attached to the engine process %s at %s", self.replicas[0].transport.pid(), attach[0])
        elif n == 1:
            log.info("the engine runs in its own process (%s)", backend)
        else:
            log.info("data parallelism: %d replicas on %s, routing %s", n, backend, self.routing)

    # ----------------------------------------------------------------------------- start / stop
    def _make_replicas(self, kw: dict) -> list:
        if self._attach is not None:
            return [_Replica(0, _AttachTransport(0, *self._attach))]
        if self.backend == "mp":
            sets = core_sets(self.size)
            return [_Replica(r, _MPTransport(r, kw, sets[r], threads_per_replica(self.size, sets[r])))
                    for r in range(self.size)]
        return self._make_ray_replicas(kw)

    def _make_ray_replicas(self, kw: dict) -> list:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'jitkern[distributed]'") \
                from None
        from engine.dp_replica import RayReplica
        if not ray.is_initialized():
            # an existing cluster (`ray start --head`, RAY_ADDRESS) when there is one, else a local one
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            ray.init(ignore_reinit_error=True, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
        cpus = int(ray.cluster_resources().get("CPU", 1))
        per = max(1, cpus // self.size)
        bundle = {"CPU": per}
        if kw.get("device") == "cuda":
            bundle["GPU"] = 1
        self._ray_pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="SPREAD")
        try:
            ray.get(self._ray_pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray could not place {self.size} replicas of {bundle} (cluster: "
                               f"{ray.cluster_resources()})") from None
        actor_cls = ray.remote(concurrency_groups={"io": 2})(RayReplica)
        out = []
        for r in range(self.size):
            opts = dict(num_cpus=per, num_gpus=bundle.get("GPU", 0), max_restarts=-1, max_task_retries=0,
                        name=None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self._ray_pg, placement_group_bundle_index=r))
            out.append(_Replica(r, _RayTransport(r, actor_cls, kw, per, opts)))
        return out

    def _start_all(self) -> None:
        for rep in self.replicas:
            rep.transport.start()
        self.facts = None
        for rep in self.replicas:
            facts = rep.transport.wait_ready(READY_TIMEOUT_S)
            if self.facts is None:
                self.facts = facts
            self._up(rep)

    def _up(self, rep: _Replica) -> None:
        with rep.lock:
            rep.generation += 1
            rep.state = "up"
            rep.cached.clear()
            gen = rep.generation
        threading.Thread(target=self._receive, args=(rep, gen), daemon=True, name=f"dp{rep.rank}-recv").start()

    def close(self) -> None:
        self._closed = True
        for rep in getattr(self, "replicas", []):
            rep.state = "closed"
            try:
                rep.transport.close()
            except Exception:  # noqa: BLE001
                pass
        if self._ray_pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self._ray_pg)
            except Exception:  # noqa: BLE001
                pass
            self._ray_pg = None
        self._dead = self._dead or EngineDeadError("the engine was shut down")

    def shutdown(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        self.close()

    # ----------------------------------------------------------------------------- receiving
    def _receive(self, rep: _Replica, gen: int) -> None:
        while rep.generation == gen and rep.state == "up":
            try:
                msgs = rep.transport.recv()
            except Exception as e:  # noqa: BLE001 - EOFError / OSError: the replica is gone
                if rep.generation == gen and rep.state == "up" and not self._closed:
                    self._on_death(rep, rep.transport.describe_death(e))
                return
            try:
                while len(msgs) < _DRAIN_MAX and rep.transport.more():
                    msgs += rep.transport.recv()
            except Exception:  # noqa: BLE001 - the next recv() reports a dead replica
                pass
            self._dispatch_all(rep, msgs)

    def _dispatch_all(self, rep: _Replica, msgs: list) -> None:
        """Handles messages in order, except that a request's outputs among them reach its stream as one output
        (their deltas merged, engine.outputs.merge_deltas), delivered after the batch or before that request's
        end: each delivery wakes the thread reading the stream, and under load a batch holds several steps."""
        pending: dict = {}
        for m in msgs:
            try:
                kind = m[0]
                if kind == "out":
                    _, rid, body = m
                    if rid not in rep.inflight:
                        continue
                    dec = rep.decoders.get(rid)
                    if dec is None:
                        dec = rep.decoders[rid] = OutputDecoder()
                    out = dec.decode(rid, body)
                    prev = pending.get(rid)
                    pending[rid] = out if prev is None else merge_deltas(prev, out)
                    continue
                if kind in ("end", "fail") and m[1] in pending:
                    self._deliver(rep, m[1], pending.pop(m[1]))
                self._dispatch(rep, m)
            except Exception:  # noqa: BLE001 - one bad message must not stop the replica's stream
                log.exception("replica %d: could not handle a %r message", rep.rank, m[0])
        for rid, out in pending.items():
            try:
                self._deliver(rep, rid, out)
            except Exception:  # noqa: BLE001
                log.exception("replica %d: could not deliver an output of %s", rep.rank, rid)

    def _deliver(self, rep: _Replica, rid: str, out) -> None:
        sink = rep.inflight.get(rid)
        if sink is not None:
            sink._put(out)
            if out.finished:
                self._forget(rep, rid)

    def _dispatch(self, rep: _Replica, m) -> None:
        kind = m[0]
        if kind == "out":
            self._dispatch_all(rep, [m])
        elif kind in ("end", "fail"):
            rid = m[1]
            sink = rep.inflight.get(rid)
            if sink is not None:
                sink._put(_DONE if kind == "end" else rebuild_error(m[2]))
                self._forget(rep, rid)
        elif kind in ("added", "reply"):
            fut = rep.pending.pop(m[1], None)
            if fut is None:
                return
            if kind == "added":
                if m[2] is None:
                    fut.set_result(True)
                else:
                    fut.set_exception(rebuild_error(m[2]))
            elif m[2]:
                fut.set_result(m[3])
            else:
                fut.set_exception(rebuild_error(m[3]))
        elif kind == "kv":
            self._apply_events(rep, m[1])

    def _forget(self, rep: _Replica, rid: str) -> None:
        with rep.lock:
            rep.inflight.pop(rid, None)
            rep.decoders.pop(rid, None)
        with self._lock:
            self._owner.pop(rid, None)

    def _apply_events(self, rep: _Replica, batch) -> None:
        from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        with rep.lock:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    rep.cached.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    rep.cached.difference_update(ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    rep.cached.clear()

    # ----------------------------------------------------------------------------- faults
    def _on_death(self, rep: _Replica, why: str) -> None:
        err = ReplicaDeadError(f"data-parallel replica {rep.rank} died ({why}) while running this request; the "
                               f"other replicas keep serving and this one is restarting: retry the request")
        with rep.lock:
            if rep.state != "up":
                return
            rep.state = "down"
            rep.deaths += 1
            rep.last_error = why
            rep.generation += 1
            sinks, rep.inflight = rep.inflight, {}
            rep.decoders = {}
            pending, rep.pending = rep.pending, {}
            rep.cached.clear()
        log.error("data-parallel replica %d died (%s): %d request(s) failed; restarting it", rep.rank, why,
                  len(sinks))
        with self._lock:
            for rid in sinks:
                self._owner.pop(rid, None)
        for sink in sinks.values():
            sink._put(err)
        for fut in pending.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        if self.restart_enabled and not self._closed:
            threading.Thread(target=self._restart, args=(rep,), daemon=True, name=f"dp{rep.rank}-restart").start()

    def _restart(self, rep: _Replica) -> None:
        for attempt in itertools.count():
            if self._closed:
                return
            try:
                rep.transport.restart()
                rep.transport.wait_ready(READY_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - tried again after a pause
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                log.error("data-parallel replica %d did not restart (%s); again in %.1f s", rep.rank, e, delay)
                time.sleep(delay)
                continue
            if self._closed:
                return
            rep.restarts += 1
            self._up(rep)
            log.info("data-parallel replica %d is back (restart %d)", rep.rank, rep.restarts)
            return

    @property
    def dead(self) -> Optional[BaseException]:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead if isinstance(self._dead, EngineDeadError) else EngineDeadError(str(self._dead))

    # ----------------------------------------------------------------------------- routing
    def _block_hashes(self, ids: list) -> list:
        from engine.kv_cache_manager import hash_block_tokens
        from engine.kv_events import external_hash
        bs = self.block_size
        out, parent = [], self._root_hash
        # the engine reuses at most len - 1 tokens of a prompt: a block ending at the last token never hits
        for i in range((len(ids) - 1) // bs):
            parent = hash_block_tokens(parent, ids[i * bs:(i + 1) * bs])
            out.append(external_hash(parent))
        return out

    def _prompt_ids(self, prompt) -> Optional[list]:
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            except Exception:  # noqa: BLE001 - the replica reports what is wrong with the prompt
                return None
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        return None

    def route(self, prompt) -> tuple:
        """(replica, block hashes of the prompt, matched blocks) for a new request."""
        up = [r for r in self.replicas if r.state == "up"]
        if not up:
            states = ", ".join(f"{r.rank}: {r.state}" for r in self.replicas)
            raise DataParallelUnavailableError(f"no data-parallel replica is serving ({states}); try again later")
        if self.routing == "round_robin" or len(self.replicas) == 1:
            return up[next(self._rr) % len(up)], [], 0
        turn = next(self._rr)
        least = min(r.load for r in up)
        # ties on load go in turn, so an idle pool spreads new prefixes instead of piling them on replica 0
        by_load = sorted(up, key=lambda r: (r.load, (r.rank - turn) % len(self.replicas)))
        if self.routing == "load":
            return by_load[0], [], 0
        ids = self._prompt_ids(prompt)
        hashes = self._block_hashes(ids) if ids else []
        best, best_n = by_load[0], 0
        if hashes:
            for r in by_load:
                if r.load > least + self.max_load_imbalance:
                    continue
                n = 0
                cached = r.cached
                for h in hashes:
                    if h not in cached:
                        break
                    n += 1
                if n > best_n:
                    best, best_n = r, n
        return best, hashes, best_n

    # ----------------------------------------------------------------------------- client side (server)
    def _admit(self, reqs: list, sinks: list, priority: int, lora_request=None) -> None:
        """Routes the requests (one HTTP request's prompts go to one replica, as they are admitted together)
        and waits for the replica's validation."""
        self._check_alive()
        tag = next(self._tags)
        fut: Future = Future()
        for attempt in range(len(self.replicas)):
            rep, hashes, matched = self.route(reqs[0][1])
            with rep.lock:
                if rep.state == "up":
                    break
        else:
            raise DataParallelUnavailableError("the data-parallel replicas went down while routing; try again later")
        with rep.lock:
            rep.pending[tag] = fut
            for (rid, _, _), sink in zip(reqs, sinks):
                rep.inflight[rid] = sink
            if hashes:
                rep.cached.update(hashes)        # its events confirm (or evict) these once it has computed them
            rep.routed += len(reqs)
            rep.routed_by_prefix += len(reqs) if matched else 0
            self.route_log.extend((rid, rep.rank, matched) for rid, _, _ in reqs)
        with self._lock:
            for rid, _, _ in reqs:
                self._owner[rid] = rep
        try:
            rep.transport.send(("add", tag, reqs, priority, lora_request))
            self._wait(fut, rep, "add")
        except BaseException:
            for rid, _, _ in reqs:
                self._forget(rep, rid)
            raise

    def _wait(self, fut: Future, rep: _Replica, what: str):
        deadline = time.monotonic() + self.command_timeout_s
        while True:
            try:
                return fut.result(timeout=_LIVENESS_POLL_S)
            except FutureTimeout:
                pass
            if time.monotonic() > deadline:
                from engine.async_engine import EngineTimeoutError
                raise EngineTimeoutError(f"data-parallel replica {rep.rank} did not answer the {what!r} command "
                                         f"within {self.command_timeout_s:g} s")

    def submit(self, request_id: str, prompt, params, *, priority: int = 0, lora_request=None) -> RequestStream:
        stream = RequestStream(self, request_id)
        self._admit([(request_id, prompt, params)], [stream], priority, lora_request)
        return stream

    def submit_batch(self, requests: list, *, priority: int = 0, lora_request=None) -> RequestGroupStream:
        limits.check_batch(requests)
        group = RequestGroupStream(self, [rid for rid, _, _ in requests])
        self._admit(list(requests), group.members, priority, lora_request)
        return group

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list) -> None:
        by_rep: dict = {}
        with self._lock:
            for rid in request_ids:
                rep = self._owner.get(rid)
                if rep is not None:
                    by_rep.setdefault(rep, []).append(rid)
        for rep, rids in by_rep.items():
            try:
                rep.transport.send(("abort", rids))
            except Exception:  # noqa: BLE001 - a replica that is gone has nothing left to abort
                pass

    def _call_on(self, rep: _Replica, fn, args):
        tag = next(self._tags)
        fut: Future = Future()
        with rep.lock:
            if rep.state != "up":
                raise EngineUnavailableError(f"data-parallel replica {rep.rank} is {rep.state}")
            rep.pending[tag] = fut
        rep.transport.send(("call", tag, fn, tuple(args)))
        return self._wait(fut, rep, "call")

    def call(self, fn, *args):
        """fn(LLMEngine, *args) on one serving replica (the lowest rank up); fn must pickle."""
        self._check_alive()
        for rep in self.replicas:
            if rep.state == "up":
                return self._call_on(rep, fn, args)
        raise EngineUnavailableError("no data-parallel replica is serving; try again later")

    def call_all(self, fn, *args) -> dict:
        """{rank: fn(LLMEngine, *args)} on every serving replica."""
        self._check_alive()
        return {rep.rank: self._call_on(rep, fn, args) for rep in self.replicas if rep.state == "up"}

    @property
    def num_in_flight(self) -> int:
        return sum(r.load for r in self.replicas)

    def _wait_on(self, q: queue.Queue, timeout: Optional[float]):
        """For RequestStream / RequestGroupStream: a replica that dies puts ReplicaDeadError in its requests'
        queues, so a plain wait never hangs on one."""
        if timeout is not None:
            return q.get(timeout=timeout)
        while True:
            try:
                return q.get(timeout=_LIVENESS_POLL_S)
            except queue.Empty:
                if self._closed:
                    try:
                        return q.get_nowait()
                    except queue.Empty:
                        raise EngineDeadError("the engine was shut down") from None

    # ----------------------------------------------------------------------------- metrics
    def metrics_snapshot(self) -> dict:
        """The replicas' LLMEngine.metrics_snapshot() summed (KV-cache usage: their mean), with each replica's
        own under "replicas" (rank -> snapshot, routing counters and state added)."""
        per = {}
        for rep in self.replicas:
            snap = {}
            if rep.state == "up":
                try:
                    snap = dict(self._call_on(rep, operator.methodcaller("metrics_snapshot"), ()))
                except Exception as e:  # noqa: BLE001 - a replica going down while scraped
                    log.warning("metrics: replica %d: %s", rep.rank, e)
            snap.update(dp_replica_up=1 if rep.state == "up" else 0, dp_replica_restarts=rep.restarts,
                        dp_routed_requests=rep.routed, dp_routed_by_prefix_requests=rep.routed_by_prefix,
                        dp_in_flight=rep.load)
            per[rep.rank] = snap
        total: dict = {}
        for snap in per.values():
            for k, v in snap.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        if per:
            total["kv_cache_usage"] = total.get("kv_cache_usage", 0.0) / len(per)
        total["replicas"] = per
        return total

    def reset_prefix_cache(self) -> bool:
        return all(self.call_all(operator.methodcaller("reset_prefix_cache")).values())

    # ----------------------------------------------------------------------------- LLMEngine-like (LLM API)
    def add_request(self, request_id: str, prompt, params=None, *, priority: int = 0, **_ignored) -> None:
        from engine.sampling_params import SamplingParams
        params = params or SamplingParams()
        self._sync_ids.add(request_id)
        try:
            self._admit([(request_id, prompt, params)], [_SyncSink(self._sync_q, request_id)], priority)
        except BaseException:
            self._sync_ids.discard(request_id)
            raise

    def has_unfinished_requests(self) -> bool:
        return bool(self._sync_ids)

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self._sync_ids:
            return False
        self._sync_ids.discard(request_id)
        self.abort(request_id)
        return True

    def step(self) -> list:
        """The outputs that arrived from any replica (waits for the first while requests are unfinished);
        raises a replica's error for a request that failed."""
        outs, err = [], None
        timeout = 1.0
        while self._sync_ids:
            try:
                rid, item = self._sync_q.get(timeout=timeout)
            except queue.Empty:
                if outs or err:
                    break
                if self._closed:
                    raise EngineDeadError("the engine was shut down")
                continue
            timeout = 0.0 if self._sync_q.qsize() else 0.001
            if rid not in self._sync_ids:
                continue
            if item is _DONE:
                self._sync_ids.discard(rid)
            elif isinstance(item, BaseException):
                self._sync_ids.discard(rid)
                err = err or item
            else:
                outs.append(item)
                if item.finished:
                    self._sync_ids.discard(rid)
            if self._sync_q.empty():
                break
        if err is not None:
            raise err
        return outs

    def num_requests(self) -> int:
        return len(self._sync_ids)
