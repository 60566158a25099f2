"""The tensor-parallel runtime: one process per rank, rank 0 (the engine's own process) owns the scheduler.

    LLMEngine (rank 0) --- ("step", batch arrays) ---> rank 1..N-1 worker processes (ctrl pipes)
         | forward(shard 0)                               | forward(shard r)
         +------- collectives (all-reduce / all-gather) ---+   (PipeComm on the CPU; NCCL on GPUs)

Rank 0 wraps its shard in `TPModel`: every call the ModelRunner makes on the model (allocate_kv,
set_max_model_len, forward, free_kv) is first sent to the workers, which replay it on their shard with
their own buffers, so all ranks run the same kernels on the same batch and meet at the same collectives.
The workers are started by the engine (multiprocessing "spawn": a fresh interpreter, no fork of the
kernel thread pool), load the checkpoint themselves, shard it and report ready or one line of error.

Failure: a rank that fails to start fails the engine's start with its message; a rank that dies later makes
the next collective on every live rank raise RankFailure (one line naming the rank and its exit code): on
rank 0 the engine re-raises it (LLMEngine does not retry a step whose error is `fatal`), a worker prints it
once to stderr and exits 1. Rank 0 exiting closes the pipes: the workers see EOF and exit.

Backends: "cpu-pipes" (tests: ranks on the CPU, PipeComm reducing in fixed rank order) runs end to end.
"nccl" (one GPU per rank, NcclComm) is designed in docs/ARCHITECTURE.md but refused at start: its device
pieces are not written and it has never run (no multi-GPU machine lent).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import sys

import numpy as np

from engine.parallel.comm import PipeComm, RankFailure

log = logging.getLogger("engine")

_BATCH_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start", "seq_lens", "block_table")
START_TIMEOUT_S = 300.0


def _batch_message(b, return_hidden: bool = False) -> tuple:
    """The step's batch as plain arrays (only the used prefix of each fixed-size array), and whether the step
    returns hidden states (embeddings, engine.pooling) instead of logits: every rank must skip the LM head
    and its all-gather alike."""
    T, S = b.num_tokens, b.num_seqs
    arrays = {"input_ids": b.input_ids[:T], "positions": b.positions[:T], "slot_mapping": b.slot_mapping[:T],
              "query_start": b.query_start[:S + 1], "seq_lens": b.seq_lens[:S], "block_table": b.block_table[:S]}
    return ("step", {k: np.array(v, copy=True) for k, v in arrays.items()}, T, S,
            np.array(b.logits_rows, np.int32, copy=True), bool(return_hidden))


def _batch_from(msg, pool):
    from engine.model_runner import Batch
    _, arrays, T, S, rows, _ = msg
    return Batch(buffers=pool, num_tokens=T, num_seqs=S, logits_rows=rows, **arrays)


class TPModel:
    """Rank 0's shard, mirrored onto the worker ranks call by call."""

    supports_graphs = False          # the CPU collectives run on the host between kernels

    def __init__(self, shard, procs: list, ctrls: list, comm):
        self.__dict__.update(_shard=shard, _procs=procs, _ctrls=ctrls, _comm=comm, _failed=None)
        self.tensor_parallel_size = comm.world

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def __setattr__(self, name, value):
        if name in ("tensor_parallel_size",):
            self.__dict__[name] = value
        else:
            setattr(self._shard, name, value)

    def _alive(self, r: int) -> bool:
        return self._procs[r - 1].is_alive()

    def _dead_message(self, r: int) -> str:
        p = self._procs[r - 1]
        p.join(0.5)
        return f"tensor-parallel rank {r} exited (exit code {p.exitcode})"

    def _bcast(self, msg, wait: bool = False) -> None:
        if self._failed is not None:
            raise RankFailure(self._failed)
        for r, c in enumerate(self._ctrls, start=1):
            try:
                c.send(msg)
            except (BrokenPipeError, OSError):
                self._fail(self._dead_message(r))
        if wait:
            for r, c in enumerate(self._ctrls, start=1):
                while not c.poll(0.5):
                    if not self._alive(r):
                        self._fail(self._dead_message(r))
                reply = c.recv()
                if reply[0] != "ok":
                    self._fail(f"tensor-parallel rank {r}: {reply[1]}")

    def _fail(self, why: str):
        self.__dict__["_failed"] = why
        raise RankFailure(why)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self._bcast(("alloc", num_blocks, block_size), wait=True)
        self._shard.allocate_kv(num_blocks, block_size)

    def set_max_model_len(self, n: int) -> None:
        self._bcast(("max_model_len", n), wait=True)
        self._shard.set_max_model_len(n)

    def forward(self, b):
        self._bcast(_batch_message(b, getattr(self._shard, "return_hidden", False)))
        try:
            return self._shard.forward(b)
        except RankFailure as e:
            import time
            for _ in range(50):            # the pipe closes a moment before the process is reaped
                dead = [r for r in range(1, len(self._procs) + 1) if not self._alive(r)]
                if dead:
                    break
                time.sleep(0.1)
            self._fail(self._dead_message(dead[0]) if dead else str(e))
        except Exception as e:  # noqa: BLE001
            # the workers are inside this step's collectives: another step would pair their partial sums
            # with the wrong step's, so a rank 0 failure is fatal too (the workers are told to exit)
            self._abort_workers("tensor-parallel rank 0 failed during a step")
            self._fail(f"tensor-parallel rank 0 failed during a step: {type(e).__name__}: {e}")

    def free_kv(self) -> None:
        self._shard.free_kv()
        self.shutdown()

    def _abort_workers(self, why: str) -> None:
        for k in self._comm.conns:            # a worker waiting in a collective raises RankFailure(why)
            try:
                k.send(("abort", why))
            except (BrokenPipeError, OSError):
                pass

    def shutdown(self) -> None:
        self._abort_workers("tensor-parallel rank 0 stopped")
        for c in self._ctrls:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.__dict__["_procs"], self.__dict__["_ctrls"] = [], []


def _rank_main(rank: int, world: int, path: str, kv_dtype: str, ctrl, coll, fail_at_step) -> None:
    """A worker rank: load, shard, then replay rank 0's calls until told to stop or rank 0 goes away."""
    try:
        from engine.loader import load_checkpoint
        from engine.models import build_model
        from engine.parallel.tp import shard_model
        if fail_at_step == 0:               # tests: a rank failing to start
            raise RuntimeError("injected failure at start")
        model = build_model(load_checkpoint(path), kv_dtype=kv_dtype, device="cpu")
        shard_model(model, PipeComm(rank, world, [coll]))
        ctrl.send(("ready", rank))
    except Exception as e:          # noqa: BLE001 - one line back to rank 0
        ctrl.send(("error", f"{type(e).__name__}: {e}"))
        return
    from engine.model_runner import BufferPool
    pool = BufferPool()
    steps = 0
    while True:
        try:
            msg = ctrl.recv()
        except (EOFError, OSError):
            print(f"tensor-parallel rank {rank}: rank 0 went away; exiting", file=sys.stderr)
            sys.exit(1)
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "alloc":
                model.allocate_kv(msg[1], msg[2])
                ctrl.send(("ok",))
            elif msg[0] == "max_model_len":
                model.set_max_model_len(msg[1])
                ctrl.send(("ok",))
            elif msg[0] == "step":
                steps += 1
                if fail_at_step is not None and steps == fail_at_step:      # tests: a rank dying mid-run
                    raise RuntimeError(f"injected failure at step {steps}")
                model.return_hidden = msg[5]
                model.forward(_batch_from(msg, pool))
        except Exception as e:      # noqa: BLE001 - one line, then exit: every other rank reports us
            print(f"tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)


def start_ranks(path: str, *, world: int, kv_dtype: str = "f32", backend: str = "cpu-pipes", ckpt=None,
                fail_rank_at_step: tuple | None = None):
    """Starts ranks 1..N-1, builds rank 0's shard here, and returns rank 0's TPModel. `fail_rank_at_step`
    (tests): (rank, step) at which that rank raises (step 0: while starting)."""
    if backend != "cpu-pipes":
        raise RankFailure(f"tensor-parallel backend {backend!r} is not available")
    from engine.loader import load_checkpoint
    from engine.models import build_model
    from engine.parallel.tp import shard_model
    ctx = mp.get_context("spawn")
    procs, ctrls, colls = [], [], []
    for r in range(1, world):
        c0, c1 = ctx.Pipe()
        k0, k1 = ctx.Pipe()
        fail = fail_rank_at_step[1] if fail_rank_at_step and fail_rank_at_step[0] == r else None
        p = ctx.Process(target=_rank_main, args=(r, world, path, kv_dtype, c1, k1, fail), daemon=True,
                        name=f"jitkern-tp-rank{r}")
        p.start()
        c1.close()
        k1.close()
        procs.append(p)
        ctrls.append(c0)
        colls.append(k0)
    try:
        comm = PipeComm(0, world, colls, alive=lambda r: procs[r - 1].is_alive())
        shard = shard_model(build_model(ckpt or load_checkpoint(path), kv_dtype=kv_dtype, device="cpu"), comm)
        for r, c in enumerate(ctrls, start=1):
            waited = 0.0
            while not c.poll(0.5):
                waited += 0.5
                if not procs[r - 1].is_alive() or waited > START_TIMEOUT_S:
                    raise RankFailure(f"tensor-parallel rank {r} failed to start (exit code {procs[r - 1].exitcode})")
            try:
                reply = c.recv()
            except EOFError:
                raise RankFailure(f"tensor-parallel rank {r} failed to start") from None
            if reply[0] != "ready":
                raise RankFailure(f"tensor-parallel rank {r} failed to start: {reply[1]}")
    except BaseException:
        for c in ctrls:
            c.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
        raise
    log.info("tensor parallel: %d ranks (%s) ready", world, backend)
    return TPModel(shard, procs, ctrls, comm)
