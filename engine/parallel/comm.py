"""Communicators for tensor parallelism: all-reduce (sum) and all-gather along the last axis.

Every communicator reduces in a FIXED rank order (((r0 + r1) + r2) + r3), and every rank ends with the same
bits, so the ranks' greedy picks never disagree and a step is reproducible. The result differs from the
unsharded model's only in float rounding (the unsharded matmul sums its K terms in another order).

- ThreadComm: N ranks as threads of one process (tests: the sharding math with our kernels).
- PipeComm:  N ranks as processes, a "gloo-like" CPU star over multiprocessing pipes: rank 0 receives every
  partial, sums them in rank order and sends the result back (engine.parallel.runtime on the CPU, tests).
- NcclComm:  NCCL from the nvidia-nccl wheel's libnccl.so through ctypes, on a CUDA stream (the GPU path;
  written against the C API, not run yet: no multi-GPU machine was lent).
"""
from __future__ import annotations

import threading

import numpy as np


class RankFailure(RuntimeError):
    """Another rank died or failed: one line naming it, raised on every rank that is still alive."""
    fatal = True            # LLMEngine re-raises it instead of retrying the step request by request


class Communicator:
    rank: int
    world: int

    def all_reduce(self, x) -> None:          # in place, sum over ranks
        raise NotImplementedError

    def all_gather(self, local, out) -> None:  # out[..., slice of rank r] = rank r's local, sizes may differ
        raise NotImplementedError

    def close(self) -> None:
        pass


def to_host(x) -> np.ndarray:
    """A host copy of a numpy array or a DeviceArray (the CPU communicators stage device data through the host;
    NcclComm works on device pointers instead)."""
    return x.numpy() if type(x).__name__ == "DeviceArray" else np.array(x, copy=True)


def write_back(x, value: np.ndarray) -> None:
    if type(x).__name__ == "DeviceArray":
        x.copy_from_numpy(value)
    else:
        x[...] = value


def reduce_in_rank_order(parts: list) -> np.ndarray:
    """The reference all-reduce: partials summed as ((p0 + p1) + p2) + ...  in float32."""
    total = np.array(parts[0], np.float32, copy=True)
    for p in parts[1:]:
        total += p
    return total


def gather_last_axis(parts: list, out: np.ndarray) -> np.ndarray:
    col = 0
    for p in parts:
        out[..., col:col + p.shape[-1]] = p
        col += p.shape[-1]
    if col != out.shape[-1]:
        raise ValueError(f"all_gather: the ranks' slices cover {col} columns, the output has {out.shape[-1]}")
    return out


class ThreadGroup:
    """Shared state of N ThreadComms (one per rank thread)."""

    def __init__(self, world: int, timeout: float = 120.0):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: list = [None] * world

    def comms(self) -> list:
        return [ThreadComm(self, r) for r in range(self.world)]


class ThreadComm(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world

    def _exchange(self, x) -> list:
        g = self.group
        try:
            g.slots[self.rank] = to_host(x)
            g.barrier.wait()
            parts = list(g.slots)
            g.barrier.wait()          # nobody overwrites a slot before every rank has read them all
        except threading.BrokenBarrierError:
            raise RankFailure(f"tensor-parallel rank {self.rank}: another rank failed during a collective") from None
        return parts

    def all_reduce(self, x) -> None:
        write_back(x, reduce_in_rank_order(self._exchange(x)))

    def all_gather(self, local, out) -> None:
        write_back(out, gather_last_axis(self._exchange(local), np.empty(out.shape, np.float32)))

    def abort(self) -> None:
        self.group.barrier.abort()


class PipeComm(Communicator):
    """Rank 0 is the hub. `conns`: on rank 0, one connection per worker rank 1..N-1 (in rank order); on a
    worker, [its connection to rank 0]. `alive` (rank 0): callables telling whether worker r still runs, so a
    dead peer is reported instead of waiting forever."""

    def __init__(self, rank: int, world: int, conns: list, alive=None, poll_s: float = 0.5):
        self.rank, self.world, self.conns = rank, world, conns
        self.alive = alive
        self.poll_s = poll_s

    def _recv(self, conn, peer: int):
        while not conn.poll(self.poll_s):
            if self.alive is not None and not self.alive(peer):
                raise RankFailure(f"tensor-parallel rank {peer} exited during a collective")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            raise RankFailure(f"tensor-parallel rank {peer} exited during a collective") from None
        if isinstance(msg, tuple) and msg and msg[0] == "abort":
            raise RankFailure(msg[1])
        return msg

    def _send(self, conn, peer: int, obj) -> None:
        try:
            conn.send(obj)
        except (BrokenPipeError, EOFError, OSError):
            raise RankFailure(f"tensor-parallel rank {peer} exited during a collective") from None

    def _data(self, conn, peer: int):
        """The next collective payload from `peer`, checked to belong to this rank's current collective
        (a rank out of step would otherwise add another step's partial sums silently)."""
        msg = self._recv(conn, peer)
        if not (isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "data") or msg[1] != self._seq:
            got = msg[1] if isinstance(msg, tuple) and len(msg) == 3 else "?"
            raise RankFailure(f"tensor-parallel rank {peer} is out of step (collective #{got}, rank {self.rank} is "
                              f"at #{self._seq})")
        return msg[2]

    def _exchange(self, x, combine):
        x = to_host(x)
        self._seq = getattr(self, "_seq", 0) + 1
        if self.rank == 0:
            parts = [x] + [self._data(c, r + 1) for r, c in enumerate(self.conns)]
            result = combine(parts)
            for r, c in enumerate(self.conns):
                self._send(c, r + 1, ("data", self._seq, result))
            return result
        self._send(self.conns[0], 0, ("data", self._seq, x))
        return self._data(self.conns[0], 0)

    def all_reduce(self, x) -> None:
        write_back(x, self._exchange(x, reduce_in_rank_order))

    def all_gather(self, local, out) -> None:
        write_back(out, self._exchange(local, lambda parts: gather_last_axis(parts, np.empty(out.shape, np.float32))))


class EqualChunkGather(Communicator):
    """all_gather for libraries that gather equal rank-major chunks (NCCL): the rank's [R, n_r] logits slice
    (the vocabulary split of engine.parallel.tp.vocab_range: ceil(V/N) columns, the last rank fewer) is staged
    into a [R, P] buffer (P = ceil(V/N); its pad columns are never read), gathered into [N, R, P], and each
    rank's first n_r columns copied into out[:, v0_r:v1_r]. All copies are kernels on the arrays' device, into
    buffers kept per shape (stable addresses for recorded graphs). Subclasses give `_raw_all_gather`."""

    def _raw_all_gather(self, send, recv) -> None:       # recv[r] = rank r's send, all ranks
        raise NotImplementedError

    def _scratch(self, name, like, shape):
        from engine.ops._hostargs import empty_like_dev
        bufs = self.__dict__.setdefault("_gather_bufs", {})
        key = (name, tuple(shape), type(like).__name__)
        if key not in bufs:
            bufs[key] = empty_like_dev(like, shape, np.float32)
        return bufs[key]

    def all_gather(self, local, out) -> None:
        from engine.ops.activation import copy
        R, V = out.shape
        P = -(-V // self.world)
        widths = [min((r + 1) * P, V) - min(r * P, V) for r in range(self.world)]
        if tuple(local.shape) != (R, widths[self.rank]):
            raise ValueError(f"all_gather: rank {self.rank}'s slice is {tuple(local.shape)}, expected "
                             f"{(R, widths[self.rank])}")
        send = self._scratch("send", local, (R, P))
        recv = self._scratch("recv", local, (self.world, R, P))
        if widths[self.rank]:
            copy(local, send[:, :widths[self.rank]])
        self._raw_all_gather(send, recv)
        for r, n in enumerate(widths):
            if n:
                copy(recv[r][:, :n], out[:, r * P:r * P + n])


# ------------------------------------------------------------------------------------------------ NCCL
_NCCL_FLOAT32 = 7          # ncclDataType_t ncclFloat32 (nccl.h)
_NCCL_SUM = 0              # ncclRedOp_t ncclSum
_NCCL_UNIQUE_ID_BYTES = 128


def load_libnccl():
    """libnccl.so.2 from the nvidia-nccl-cu12 wheel (nvidia/nccl/lib), else the system's. Loaded lazily: the
    CPU engine never touches it."""
    import ctypes
    import os
    cands = []
    try:
        import nvidia.nccl
        base = os.path.join(list(nvidia.nccl.__path__)[0], "lib")
        cands.append(os.path.join(base, "libnccl.so.2"))
    except ImportError:
        pass
    cands.append("libnccl.so.2")
    last = None
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            last = e
    raise RankFailure(f"tensor parallelism needs NCCL: install the nvidia-nccl-cu12 wheel ({last})")


class NcclComm(EqualChunkGather):
    """One NCCL communicator per rank process, on that rank's CUDA stream, so collectives are recorded into
    the rank's CUDA graphs like any kernel. The unique id comes from rank 0 (ncclGetUniqueId) through the
    runtime's control pipes. NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set before init.
    NOT RUN YET: written against nccl.h; its test (tests/test_tensor_parallel.py, marked gpu) needs 2 GPUs."""

    @staticmethod
    def unique_id() -> bytes:
        import ctypes
        lib = load_libnccl()
        buf = ctypes.create_string_buffer(_NCCL_UNIQUE_ID_BYTES)
        _nccl_check(lib, lib.ncclGetUniqueId(buf), "ncclGetUniqueId")
        return buf.raw

    def __init__(self, rank: int, world: int, unique_id: bytes, stream: int):
        import ctypes
        import os
        os.environ["NCCL_NVLS_ENABLE"] = "0"          # NVLink multicast off (the lent machines require it)
        self.rank, self.world, self.stream = rank, world, int(stream or 0)
        self.lib = load_libnccl()
        self.comm = ctypes.c_void_p()
        class NcclUniqueId(ctypes.Structure):     # a struct, so ctypes passes it by value (an array would decay)
            _fields_ = [("internal", ctypes.c_char * _NCCL_UNIQUE_ID_BYTES)]
        uid = NcclUniqueId.from_buffer_copy(unique_id)
        # ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank): the id by value
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId,
                                              ctypes.c_int]
        _nccl_check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(self.comm), world, uid, rank),
                    "ncclCommInitRank")
        for fn in (self.lib.ncclAllReduce, self.lib.ncclAllGather):
            fn.restype = ctypes.c_int

    def all_reduce(self, x) -> None:
        # ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream): in place on a DeviceArray
        import ctypes
        ptr = ctypes.c_void_p(int(x.ptr))
        _nccl_check(self.lib, self.lib.ncclAllReduce(ptr, ptr, ctypes.c_size_t(int(x.size)), _NCCL_FLOAT32,
                                                     _NCCL_SUM, self.comm, ctypes.c_void_p(self.stream)),
                    "ncclAllReduce")

    def _raw_all_gather(self, send, recv) -> None:
        # ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream): rank-major equal chunks
        import ctypes
        _nccl_check(self.lib, self.lib.ncclAllGather(ctypes.c_void_p(int(send.ptr)), ctypes.c_void_p(int(recv.ptr)),
                                                     ctypes.c_size_t(int(send.size)), _NCCL_FLOAT32, self.comm,
                                                     ctypes.c_void_p(self.stream)), "ncclAllGather")

    def close(self) -> None:
        if getattr(self, "comm", None):
            self.lib.ncclCommDestroy(self.comm)
            self.comm = None


def _nccl_check(lib, rc: int, call: str) -> None:
    if rc != 0:
        import ctypes
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise RankFailure(f"{call} failed: {lib.ncclGetErrorString(rc).decode()} (NCCL error {rc})")
