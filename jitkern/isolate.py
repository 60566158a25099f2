"""Crash-isolated LLVM compilation.

The llvmlite 0.50 wheel is built with LLVM assertions enabled, and LLVM reports backend failures
("LLVM ERROR: Cannot select ...", failed assertions, some SPIR-V/AMDGPU misuse) by aborting the
whole process. So the last LLVM steps -- parse the IR text, verify, run the new-pass-manager
pipeline, emit object / assembly -- run in persistent worker processes. A crash there costs one
CompileError (naming the kernel, the signal and LLVM's last words) instead of the caller's process.

Workers are started lazily with ``subprocess.Popen([sys.executable, "-m", "jitkern.isolate"])``
(never a fork: the parent may have threads) and reused, so a compile costs the parent only the IPC.
Protocol: every message is an 8-byte big-endian length followed by a pickle, requests on the
worker's stdin, replies on its stdout. The worker moves its own fd 1 onto stderr so a stray print
cannot corrupt the reply stream.

Public API:
    compile_llvm_ir(llvm_ir, *, triple, cpu, features, opt=3, emit=("obj",), ...) -> dict[str, bytes]
    run_isolated("module:function", *args) -> whatever the function returns (must pickle)
    worker_pids(), shutdown_workers()

Environment:
    JITKERN_COMPILE_WORKERS   number of worker processes (default 1); read when the pool starts.
    JITKERN_COMPILE_TIMEOUT   seconds per request (default 300); on expiry the worker is killed.
    JITKERN_COMPILE_INPROCESS=1  run everything in this process instead (debugging; no isolation,
                              no timeout). Workers themselves run with this set, so code executed
                              through run_isolated may call compile_llvm_ir without nesting workers.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import logging
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from jitkern.errors import CompileError

__all__ = [
    "EMIT_KINDS",
    "compile_llvm_ir",
    "run_isolated",
    "worker_pids",
    "shutdown_workers",
]

log = logging.getLogger(__name__)

EMIT_KINDS = ("obj", "asm", "opt_ll")
DEFAULT_TIMEOUT_S = 300.0
STDERR_TAIL_LINES = 20
_HEADER = struct.Struct("!Q")
# Lines worth quoting even when they are above the last-N-lines tail.
_IMPORTANT_MARKERS = ("LLVM ERROR", "Assertion", "UNREACHABLE", "Fatal Python error")


# --------------------------------------------------------------------------------------------
# The LLVM work itself (runs inside the worker, or in-process with JITKERN_COMPILE_INPROCESS=1)
# --------------------------------------------------------------------------------------------

_llvm_ready = False


def _llvm():
    """Import llvmlite.binding and register every target once per process."""
    global _llvm_ready
    import llvmlite.binding as llvm

    if not _llvm_ready:
        # llvmlite 0.50: llvm.initialize() is deprecated and raises; targets still need registering.
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _llvm_ready = True
    return llvm


# SPIR-V codegen keeps pointers to IR and target objects in state that outlives a module (LLVM 22: ids
# of a later module collide with an earlier one's, "Id 1 is defined more than once", once the earlier module's
# memory is reused), so a worker keeps every SPIR-V module and TargetMachine it made alive.
_SPIRV_KEEP: list = []


_NVPTX_OPTIONS_SET = False


def _nvptx_short_pointers(llvm) -> None:
    """32-bit shared/const/local pointers in the NVPTX backend (the layout targets/registry.py declares,
    p3:32:32): shared-memory addresses then take one 32-bit register and fold constant offsets into the
    instruction ([%r + 4368]) instead of a 64-bit register pair per address, which at 255 registers a
    thread was a good part of the MMA kernels' pressure. A process-wide LLVM option that only NVPTX
    target machines read; set once per worker."""
    global _NVPTX_OPTIONS_SET
    if not _NVPTX_OPTIONS_SET:
        llvm.set_option("jitkern", "--nvptx-short-ptr")
        _NVPTX_OPTIONS_SET = True


# x86 codegen of a very large function with LLVM's register coalescer joining copies across blocks (its x86
# default) is superlinear: the CPU tiers' largest kernels (the flash attention kernels' unrolled tiles on AVX2's
# 16 registers, ~1 MB of IR) spent ~80% of a ~165 s codegen there, ~40 s without it (and smaller objects).
# LLVM options are process-wide and a worker compiles for every target, so a worker that compiled with it exits
# after its reply and the pool starts a fresh one: no other compile sees the option. The in-process fallback
# (no workers) keeps LLVM's defaults. Register choices change; no instruction's arithmetic does.
LARGE_X86_IR_CHARS = 400_000
_IN_WORKER = False
_exit_after_reply = False


def _codegen_options(llvm, triple: str, ir_chars: int) -> None:
    global _exit_after_reply
    if _IN_WORKER and ir_chars > LARGE_X86_IR_CHARS and triple.startswith(("x86_64", "i686", "i386")):
        llvm.set_option("jitkern", "-join-globalcopies=false")
        _exit_after_reply = True


def _compile_impl(
    llvm_ir: str, triple: str, cpu: str, features: str, opt: int, emit: Sequence[str]
) -> dict[str, bytes]:
    llvm = _llvm()
    target = llvm.Target.from_triple(triple)
    if triple.startswith("nvptx"):
        _nvptx_short_pointers(llvm)
    _codegen_options(llvm, triple, len(llvm_ir))

    def fresh_tm():
        # A fresh TargetMachine per module: SPIR-V TMs cache IR pointers and segfault when reused.
        # reloc='pic' + codemodel='default' gives objects ORC's JITLibraryBuilder().add_object_img loads.
        return target.create_target_machine(
            cpu=cpu, features=features, opt=opt, reloc="pic", codemodel="default"
        )

    def parse(text: str, tm):
        mod = llvm.parse_assembly(text)
        # The caller's target is authoritative; the data layout must match the TM for codegen.
        mod.triple = triple
        mod.data_layout = str(tm.target_data)
        mod.verify()
        return mod

    tm = fresh_tm()
    mod = parse(llvm_ir, tm)
    if opt > 0:
        pto = llvm.create_pipeline_tuning_options(speed_level=opt)
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
    opt_text = str(mod)
    if triple.startswith("spirv"):
        _SPIRV_KEEP.append((mod, tm))
    del mod, tm

    out: dict[str, bytes] = {}
    for kind in emit:
        if kind == "opt_ll":
            out[kind] = opt_text.encode()
            continue
        # emit_object mutates the module (codegen IR passes), so every emission re-parses the
        # optimised text into a fresh module with a fresh TM; obj and asm then describe the same code.
        etm = fresh_tm()
        emod = parse(opt_text, etm)
        if kind == "obj":
            out[kind] = bytes(etm.emit_object(emod))
        else:  # "asm"
            out[kind] = etm.emit_assembly(emod).encode()
        if triple.startswith("spirv"):
            _SPIRV_KEEP.append((emod, etm))
        del emod, etm
    return out


def _resolve_callable(func_path: str):
    module_name, sep, attr = func_path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"run_isolated: expected 'module:function', got {func_path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"run_isolated: {func_path!r} is not callable")
    return obj


def _handle(request: tuple) -> Any:
    op = request[0]
    if op == "compile":
        return _compile_impl(**request[1])
    if op == "call":
        _, func_path, args, kwargs = request
        return _resolve_callable(func_path)(*args, **kwargs)
    if op == "ping":
        return os.getpid()
    raise ValueError(f"unknown request {op!r}")


# --------------------------------------------------------------------------------------------
# Worker process side
# --------------------------------------------------------------------------------------------


def _read_exact_blocking(fd: int, n: int) -> Optional[bytes]:
    """Read exactly n bytes; None on EOF before the first byte, EOFError on a torn message."""
    chunks = []
    got = 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            if got == 0:
                return None
            raise EOFError("request stream ended mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _worker_main() -> int:
    global _IN_WORKER
    _IN_WORKER = True
    # Ctrl-C in a terminal reaches the whole process group; the parent decides what to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Python-level tracebacks on SIGSEGV/SIGABRT land in stderr too (after LLVM's own message).
    faulthandler.enable(file=sys.stderr)
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints (ours or LLVM's) go to stderr, never into the reply stream
    request_fd = 0
    while True:
        header = _read_exact_blocking(request_fd, _HEADER.size)
        if header is None:
            return 0
        (length,) = _HEADER.unpack(header)
        payload = _read_exact_blocking(request_fd, length)
        if payload is None:
            return 1
        try:
            reply = ("ok", _handle(pickle.loads(payload)))
            if _exit_after_reply:
                reply = reply + ("restart",)       # the parent reaps this worker; a fresh one takes the next job
        except BaseException as exc:  # noqa: BLE001 -- everything goes back to the parent
            reply = ("err", type(exc).__qualname__, str(exc), traceback.format_exc())
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001
            data = pickle.dumps(
                ("err", type(exc).__qualname__, f"reply could not be pickled: {exc}", ""),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        sys.stderr.flush()
        _write_all(reply_fd, _HEADER.pack(len(data)) + data)
        if _exit_after_reply:
            return 0


# --------------------------------------------------------------------------------------------
# Parent side: one worker process
# --------------------------------------------------------------------------------------------


class _WorkerCrashed(Exception):
    def __init__(self, why: str, stderr_text: str) -> None:
        super().__init__(why)
        self.why = why
        self.stderr_text = stderr_text


class _RemoteError(Exception):
    def __init__(self, type_name: str, message: str, tb: str, stderr_text: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.message = message
        self.tb = tb
        self.stderr_text = stderr_text


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _describe_exit(returncode: Optional[int]) -> str:
    if returncode is None:
        return "worker closed its reply pipe but is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = (
            " (abort: LLVM reports fatal errors and failed assertions this way)"
            if name == "SIGABRT"
            else ""
        )
        return f"worker killed by {name}{hint}"
    return f"worker exited with code {returncode}"


class _Worker:
    """One persistent worker process. Not thread-safe by itself: the pool hands it to one caller."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self._stderr_fd: Optional[int] = None  # parent's read handle on the worker's stderr file

    # -- lifecycle --

    def _start(self) -> None:
        # stderr goes to an unlinked temp file opened O_APPEND by the worker, so the parent can
        # truncate it before each request and read back exactly that request's messages.
        fd, path = tempfile.mkstemp(prefix="jitkern-worker-", suffix=".stderr")
        try:
            child_err = os.open(path, os.O_WRONLY | os.O_APPEND)
        finally:
            os.unlink(path)
        env = dict(os.environ)
        env["JITKERN_COMPILE_INPROCESS"] = "1"  # nested compiles inside the worker run inline
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_package_root(), env.get("PYTHONPATH", "")) if p
        )
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jitkern.isolate"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=child_err,
                env=env,
                close_fds=True,
                bufsize=0,
            )
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(child_err)
        self._stderr_fd = fd
        log.debug("started compile worker pid %d", self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> Optional[int]:
        """Kill (if needed) and reap the process; returns its exit status."""
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = None
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
        if self._stderr_fd is not None:
            os.close(self._stderr_fd)
            self._stderr_fd = None
        return rc

    def close(self) -> None:
        """Polite shutdown: EOF on stdin, short wait, then kill."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    # -- stderr capture --

    def _reset_stderr(self) -> None:
        os.ftruncate(self._stderr_fd, 0)

    def _read_stderr(self) -> str:
        fd = self._stderr_fd
        if fd is None:
            return ""
        size = os.fstat(fd).st_size
        data = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
        return data.decode("utf-8", "replace")

    # -- one request --

    def _read_exact(self, fd: int, n: int, deadline: float) -> bytes:
        chunks = []
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def request(self, req: tuple, timeout: float) -> Any:
        payload = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
        message = _HEADER.pack(len(payload)) + payload
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            if not self.alive():
                if self.proc is not None:
                    self.kill()  # died while idle (e.g. killed from outside): reap, start fresh
                self._start()
            self._reset_stderr()
            try:
                _write_all(self.proc.stdin.fileno(), message)
                break
            except (BrokenPipeError, ConnectionResetError):
                # The worker was already dead before it saw this request (poll() can lag a
                # kill by a moment): not this request's fault, so retry once on a fresh one.
                self.kill()
                if attempt:
                    raise _WorkerCrashed("worker died before reading the request", "") from None
            except BaseException:
                self.kill()
                raise
        try:
            try:
                fd = self.proc.stdout.fileno()
                (length,) = _HEADER.unpack(self._read_exact(fd, _HEADER.size, deadline))
                reply = pickle.loads(self._read_exact(fd, length, deadline))
            except TimeoutError:
                stderr_text = self._read_stderr()
                self.kill()
                raise _WorkerCrashed(
                    f"timed out after {timeout:g} s (JITKERN_COMPILE_TIMEOUT / timeout=); worker killed",
                    stderr_text,
                ) from None
            except EOFError:
                proc = self.proc
                try:
                    rc = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                stderr_text = self._read_stderr()
                self.kill()
                raise _WorkerCrashed(_describe_exit(rc), stderr_text) from None
        except _WorkerCrashed:
            raise
        except BaseException:
            # Anything else (KeyboardInterrupt, unpickling trouble) leaves the stream out of step.
            self.kill()
            raise
        stderr_text = self._read_stderr()
        if reply[0] == "ok":
            if stderr_text.strip():
                log.warning("compile worker stderr:\n%s", stderr_text.rstrip())
            if len(reply) > 2 and reply[2] == "restart":
                self.kill()         # it set process-wide LLVM options for that compile (_codegen_options)
            return reply[1]
        _, type_name, message, tb = reply
        raise _RemoteError(type_name, message, tb, stderr_text)


# --------------------------------------------------------------------------------------------
# Parent side: the pool
# --------------------------------------------------------------------------------------------


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.workers = [_Worker() for _ in range(size)]
        self.idle: "queue.LifoQueue[_Worker]" = queue.LifoQueue()
        for w in self.workers:
            self.idle.put(w)

    def run(self, req: tuple, timeout: float) -> Any:
        worker = self.idle.get()
        try:
            return worker.request(req, timeout)
        finally:
            self.idle.put(worker)

    def close(self) -> None:
        for w in self.workers:
            w.close()


_pool: Optional[_Pool] = None
_pool_lock = threading.Lock()


def _env_timeout() -> float:
    from .env import compile_timeout   # the one parser of JITKERN_* settings
    return compile_timeout(default=DEFAULT_TIMEOUT_S)


def _inprocess() -> bool:
    return os.environ.get("JITKERN_COMPILE_INPROCESS", "").strip() not in ("", "0")


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            from .env import compile_workers   # the one parser of JITKERN_* settings
            _pool = _Pool(compile_workers())
        return _pool


def shutdown_workers() -> None:
    """Stop all worker processes; the next request starts a new pool (re-reading the env)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def worker_pids() -> list[int]:
    """Pids of the live worker processes (diagnostics and tests)."""
    pool = _pool
    if pool is None:
        return []
    return [w.proc.pid for w in pool.workers if w.proc is not None and w.alive()]


def _forget_pool_in_child() -> None:
    # A forked child must not talk to the parent's workers through inherited pipes.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


atexit.register(shutdown_workers)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


# --------------------------------------------------------------------------------------------
# Error formatting
# --------------------------------------------------------------------------------------------


def _stderr_tail(text: str, n: int = STDERR_TAIL_LINES) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # faulthandler's Python stack after an LLVM abort is noise: keep its first line (it names the
    # signal) but drop the frames when something (LLVM) spoke before it.
    for i, ln in enumerate(lines):
        if ln.startswith("Fatal Python error:"):
            if i > 0:
                lines = lines[: i + 1]
            break
    tail = lines[-n:]
    # Keep LLVM's verdict even when it scrolled above the tail.
    earlier = [ln for ln in lines[:-n] if any(m in ln for m in _IMPORTANT_MARKERS)]
    if earlier:
        tail = earlier[-3:] + ["..."] + tail
    return "\n".join(tail)


def _make_error(
    headline: str,
    describe: str,
    *,
    detail: str = "",
    stderr_text: str = "",
    kernel: Optional[str] = None,
    specialization: Optional[str] = None,
    target: Optional[str] = None,
    note: Optional[str] = None,
) -> CompileError:
    what = describe or "(no description)"
    parts = [f"compiling {what} failed: {headline}"]
    if detail:
        parts.append(detail.rstrip())
    if note:
        parts.append(f"function attributes: {note}")
    tail = _stderr_tail(stderr_text)
    if tail:
        parts.append(f"--- worker stderr (last lines) ---\n{tail}")
    return CompileError(
        "\n".join(parts),
        kernel=kernel,
        specialization=specialization,
        target=target,
        stderr_tail=tail,
    )


def _run(
    req: tuple,
    *,
    describe: str,
    timeout: Optional[float],
    kernel: Optional[str] = None,
    specialization: Optional[str] = None,
    target: Optional[str] = None,
    note: Optional[str] = None,
    fresh: bool = False,
) -> Any:
    ctx = dict(kernel=kernel, specialization=specialization, target=target, note=note)
    if _inprocess():
        try:
            return _handle(req)
        except Exception as exc:
            raise _make_error(f"{type(exc).__name__}: {exc}", describe, **ctx) from exc
    limit = _env_timeout() if timeout is None else float(timeout)
    try:
        if fresh:
            # a worker of its own, stopped afterwards: no LLVM state left by earlier compiles
            worker = _Worker()
            try:
                return worker.request(req, limit)
            finally:
                worker.close()
        return _get_pool().run(req, limit)
    except _WorkerCrashed as exc:
        raise _make_error(exc.why, describe, stderr_text=exc.stderr_text, **ctx) from None
    except _RemoteError as exc:
        raise _make_error(
            f"{exc.type_name}: {exc.message}",
            describe,
            detail=f"--- worker traceback ---\n{exc.tb}" if _wants_traceback(exc.type_name) else "",
            stderr_text=exc.stderr_text,
            **ctx,
        ) from None


def _wants_traceback(type_name: str) -> bool:
    # LLVM parse/verify errors arrive as RuntimeError with a self-explaining message; a worker-side
    # traceback only helps for unexpected Python errors (e.g. in a run_isolated function).
    return type_name not in ("RuntimeError",)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def compile_llvm_ir(
    llvm_ir: str,
    *,
    triple: str,
    cpu: str,
    features: str,
    opt: int = 3,
    emit: Iterable[str] = ("obj",),
    fn_attrs_note: Optional[str] = None,
    describe: str = "",
    kernel: Optional[str] = None,
    specialization: Optional[str] = None,
    timeout: Optional[float] = None,
    fresh: bool = False,
) -> dict[str, bytes]:
    """Parse, verify, optimise (new PM, speed level ``opt``) and emit LLVM IR text, isolated.

    Returns ``{kind: bytes}`` for each requested kind: "obj" (relocatable object, reloc=pic,
    codemodel=default -- loadable with ORC ``JITLibraryBuilder().add_object_img``), "asm"
    (assembly text, utf-8) and "opt_ll" (the optimised IR text, utf-8). The module's triple and
    data layout are set from ``triple`` / the target machine.

    ``describe`` (kernel name, specialisation, target) names the compile in error messages;
    ``fn_attrs_note`` is an optional free-form note (e.g. per-function target attributes) quoted in
    errors. ``kernel`` / ``specialization`` are copied onto the CompileError. Raises CompileError on
    any failure: LLVM parse/verify errors, a worker killed by an LLVM abort, or a timeout. ``fresh``:
    compile in a new worker process that is stopped afterwards (LLVM state of earlier compiles, such as
    the SPIR-V backend's, cannot leak into this one).
    """
    kinds = tuple(emit)
    bad = [k for k in kinds if k not in EMIT_KINDS]
    if bad or not kinds:
        raise ValueError(f"emit must be a non-empty subset of {EMIT_KINDS}, got {kinds!r}")
    if not isinstance(opt, int) or not 0 <= opt <= 3:
        raise ValueError(f"opt must be 0, 1, 2 or 3, got {opt!r}")
    if not isinstance(llvm_ir, str):
        raise TypeError(f"llvm_ir must be str, got {type(llvm_ir).__name__}")
    kinds = tuple(dict.fromkeys(kinds))  # drop duplicates, keep order
    req = (
        "compile",
        dict(llvm_ir=llvm_ir, triple=triple, cpu=cpu, features=features, opt=opt, emit=kinds),
    )
    target = f"{triple} cpu={cpu or '(default)'} features={features or '(none)'}"
    return _run(
        req,
        describe=describe,
        timeout=timeout,
        kernel=kernel,
        specialization=specialization,
        target=target,
        note=fn_attrs_note,
        fresh=fresh,
    )


def run_isolated(
    func_path: str, *args: Any, describe: str = "", timeout: Optional[float] = None
) -> Any:
    """Import ``"module:function"`` in a worker, call it with ``args`` and return its result.

    Arguments and result travel by pickle. Exceptions raised by the function come back as
    CompileError (with the worker-side traceback); a crash or timeout as for compile_llvm_ir.
    """
    return _run(("call", func_path, args, {}), describe=describe or func_path, timeout=timeout)


if __name__ == "__main__":
    sys.exit(_worker_main())
