"""Native CPU thread pool that launches compiled kernels with very low overhead.

Why native: an engine step makes hundreds of kernel launches, and waking Python
threads costs tens of microseconds each. Here the whole pool (worker loop,
barrier, futex sleep/wake, task splitting) is LLVM IR built with ``llvmlite.ir``,
JIT-compiled for the host with ORC LLJIT, and the workers are created with
``pthread_create`` from that JIT code, so they never touch the GIL. The calling
Python thread joins in as worker 0 through one ctypes call (ctypes releases the
GIL for the duration of the call).

Kernel ABI (see docs/ARCHITECTURE.md, "The CPU kernel ABI")::

    void kernel(ptr args, i64 pid_begin, i64 pid_end)

A *task* is ``(fn_addr, args_addr, num_programs)``. A launch runs a list of
tasks in order with a barrier after each one, so a task sees every write made by
the tasks before it ("graph replay": many launches in one native call). Within
a task, ``[0, num_programs)`` is split statically into ``num_threads``
contiguous chunks whose sizes differ by at most one; thread ``t`` runs chunk
``t`` and threads with an empty chunk only pass the barrier. With
``num_programs == 1`` only thread 0 (the caller) runs; a launch in which no
task has more than one program runs inline without waking the workers.

Errors: a kernel cannot raise. Kernels must not fail; a crash in a kernel
(segfault, illegal instruction) takes the whole process down, exactly as it
would on the calling thread. A kernel must not launch on the pool that runs it
(that would deadlock on the pool's launch lock).

Waiting threads (idle workers, and every thread at a barrier) poll a
generation counter with ``pause`` (x86), call ``sched_yield`` every few dozen
polls (so a thread that shares our CPU can finish its chunk), and after
``spin_us`` microseconds sleep on a futex, so an idle engine uses no CPU.

Environment: ``JITKERN_NUM_THREADS`` (default: physical cores),
``JITKERN_SPIN_US`` (default 200), ``JITKERN_POLLS_PER_YIELD`` (default 32).

Public API: :class:`CpuPool`, :func:`get_pool`, :func:`physical_core_count`,
and :class:`NativeLibrary` (compile LLVM IR text and get symbol addresses;
used by the pool itself and by tests/benchmarks to make small kernels).
"""
from __future__ import annotations

import ctypes
import itertools
import operator
import os
import platform
import subprocess
import threading
import weakref

import numpy as np
from llvmlite import ir
import llvmlite.binding as llvm

__all__ = [
    "CpuPool",
    "PoolError",
    "NativeLibrary",
    "get_pool",
    "physical_core_count",
    "default_num_threads",
]


class PoolError(RuntimeError):
    """A launch or pool setup failed (closed pool, null kernel, bad task table)."""


# --------------------------------------------------------------------------
# Host facts the native code depends on
# --------------------------------------------------------------------------

_MACHINE = platform.machine().lower()
_IS_X86_64 = _MACHINE in ("x86_64", "amd64")
_IS_AARCH64 = _MACHINE in ("aarch64", "arm64")
# SYS_futex differs per architecture; only Linux is supported.
_SYS_FUTEX = 202 if _IS_X86_64 else (98 if _IS_AARCH64 else None)
_FUTEX_WAIT_PRIVATE = 128  # FUTEX_WAIT | FUTEX_PRIVATE_FLAG
_FUTEX_WAKE_PRIVATE = 129  # FUTEX_WAKE | FUTEX_PRIVATE_FLAG
_CLOCK_MONOTONIC = 1
_SIG_BLOCK = 0  # Linux generic values (x86_64, aarch64)
_SIG_SETMASK = 2
_INT_MAX = 2**31 - 1
_SIGSET_BYTES = 128  # glibc / musl sigset_t is 1024 bits

DEFAULT_SPIN_US = 200
# Polls of the futex word (each followed by `pause`, ~25 ns on the dev VM)
# between two sched_yield calls (~0.5 us there) while spinning; override with
# JITKERN_POLLS_PER_YIELD (read when the pool code is compiled, once per process).
# Measured on 2 vCPUs, empty kernel, 2 threads (us/launch, free cores / both
# threads forced onto one CPU): 64 -> 0.77 / 7.1, 32 -> 0.77 / 5.4,
# 16 -> 1.05 / 4.7, 8 -> 0.84 / 4.3 (noisy).
DEFAULT_POLLS_PER_YIELD = 32
# the split of a task's programs over the threads (JITKERN_POOL_SPLIT): "static" or "dynamic" (CpuPool.dynamic)
DEFAULT_SPLIT = "static"

# --------------------------------------------------------------------------
# Layout of the shared pool state block (byte offsets). Fields that different
# threads hammer at different times live on separate 64-byte cache lines.
# --------------------------------------------------------------------------
_CACHE_LINE = 64
# line 0: dispatch word and the per-launch parameters workers read right after it
OFF_GEN = 0            # i32  launch generation; workers wait for it to change (futex word)
OFF_SLEEPERS = 4       # i32  number of workers asleep (or about to be) on OFF_GEN
OFF_SHUTDOWN = 8       # i32  1 -> workers exit at the next generation change
OFF_CLOSED = 12        # i32  1 -> launches fail with rc=1
OFF_TASKS = 16         # ptr  task table of the current launch
OFF_NTASKS = 24        # i64  number of tasks in it
OFF_NTHREADS = 32      # i64  T, including the caller
OFF_SPIN_NS = 40       # i64  how long to spin before sleeping on a futex
OFF_STARTED = 48       # i64  worker threads created (T-1 on success)
OFF_DYNAMIC_REQ = 56   # i64  split requested by CpuPool.dynamic; copied to OFF_DYNAMIC by the next launch
# line 1: barrier arrival counter
OFF_BAR_COUNT = 64     # i64
# line 2: barrier generation (futex word) and its sleeper count
OFF_BAR_GEN = 128      # i32
OFF_BAR_SLEEPERS = 132  # i32
# line 3: launch lock (serialises launches from several Python threads)
OFF_MUTEX = 192        # i32  0 free, 1 locked, 2 locked with waiters
# line 4: the one-task table used by launch()
OFF_INLINE_TASK = 256  # 3 x i64
# line 5: the split of a task's programs: 0 static (thread t runs the t-th contiguous chunk), 1 dynamic
OFF_DYNAMIC = 320      # i64
# lines 6 and 7: dynamic split counters (next unclaimed program), task i of a launch uses line 6 + i % 2
OFF_COUNTERS = 384     # i64 each, 64 bytes apart
# per worker slot: pthread_t handle, state ptr, thread index
OFF_THREADS = 512
THREAD_SLOT = 32
SLOT_HANDLE, SLOT_STATE, SLOT_TID = 0, 8, 16
TASK_BYTES = 24

RC_OK, RC_CLOSED, RC_NULL_KERNEL = 0, 1, 2


def state_bytes(num_threads: int) -> int:
    return OFF_THREADS + THREAD_SLOT * num_threads


# --------------------------------------------------------------------------
# IR construction
# --------------------------------------------------------------------------

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_PTR = ir.PointerType()
_VOID = ir.VoidType()
KERNEL_FNTY = ir.FunctionType(_VOID, [_PTR, _I64, _I64])


def _i32(v):
    return ir.Constant(_I32, v)


def _i64(v):
    return ir.Constant(_I64, v)


_NULL = ir.Constant(_PTR, None)


def _store_atomic(b, value, ptr, ordering, align):
    # IRBuilder.store_atomic reads ptr.type.pointee, which opaque pointers lack
    # (llvmlite 0.50); the instruction itself prints fine, so insert it directly.
    st = ir.instructions.StoreAtomicInstr(b.block, value, ptr, ordering, align)
    b._insert(st)
    return st


class _PoolIRBuilder:
    """Builds the pool module. Every function is small; the comments on the
    atomics explain the ordering argument."""

    def __init__(self, triple: str, data_layout: str, polls_per_yield: int):
        self.polls_per_yield = polls_per_yield
        m = ir.Module(name="jitkern_cpu_pool")
        m.triple = triple
        m.data_layout = data_layout
        self.m = m
        # libc (resolved from the process by the JIT linker)
        self.syscall = ir.Function(m, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
        self.clock_gettime = ir.Function(m, ir.FunctionType(_I32, [_I32, _PTR]), "clock_gettime")
        self.pthread_create = ir.Function(
            m, ir.FunctionType(_I32, [_PTR, _PTR, _PTR, _PTR]), "pthread_create")
        # pthread_t is `unsigned long` on Linux (glibc and musl): pass it as i64
        self.pthread_join = ir.Function(m, ir.FunctionType(_I32, [_I64, _PTR]), "pthread_join")
        self.sigfillset = ir.Function(m, ir.FunctionType(_I32, [_PTR]), "sigfillset")
        self.sched_yield = ir.Function(m, ir.FunctionType(_I32, []), "sched_yield")
        self.pthread_sigmask = ir.Function(
            m, ir.FunctionType(_I32, [_I32, _PTR, _PTR]), "pthread_sigmask")
        self.pause = None
        if _IS_X86_64:
            self.pause = ir.Function(m, ir.FunctionType(_VOID, []), "llvm.x86.sse2.pause")

        self._build_helpers()
        self._build_sync()
        self._build_run_tasks()
        self._build_worker()
        self._build_exports()

    # -- small utilities -------------------------------------------------
    def _define(self, name, ret, args, exported=False):
        f = ir.Function(self.m, ir.FunctionType(ret, args), name)
        if not exported:
            f.linkage = "internal"
        b = ir.IRBuilder(f.append_basic_block("entry"))
        return f, b

    @staticmethod
    def field(b, state, off):
        return b.gep(state, [_i64(off)], source_etype=_I8)

    def load(self, b, state, off, ty, ordering=None):
        p = self.field(b, state, off)
        if ordering is None:
            return b.load(p, typ=ty, align=ty.width // 8 if isinstance(ty, ir.IntType) else 8)
        return b.load_atomic(p, ordering, ty.width // 8, typ=ty)

    def store(self, b, state, off, val, ordering=None):
        p = self.field(b, state, off)
        width = val.type.width // 8 if isinstance(val.type, ir.IntType) else 8
        if ordering is None:
            b.store(val, p, align=width)
        else:
            _store_atomic(b, val, p, ordering, width)

    # -- time, pause, futex ------------------------------------------------
    def _build_helpers(self):
        # now_ns(): CLOCK_MONOTONIC in ns (vDSO call, ~20 ns; only used while spinning)
        f, b = self._define("jk_now_ns", _I64, [])
        ts = b.alloca(ir.ArrayType(_I64, 2))
        b.call(self.clock_gettime, [_i32(_CLOCK_MONOTONIC), ts])
        sec = b.load(b.gep(ts, [_i64(0), _i64(0)], source_etype=ir.ArrayType(_I64, 2)), typ=_I64)
        nsec = b.load(b.gep(ts, [_i64(0), _i64(1)], source_etype=ir.ArrayType(_I64, 2)), typ=_I64)
        b.ret(b.add(b.mul(sec, _i64(1_000_000_000)), nsec))
        self.now_ns = f

        # cpu_relax(): `pause` on x86 (saves power, frees the sibling hyperthread,
        # avoids the memory-order-violation pipeline flush when the spin ends).
        f, b = self._define("jk_cpu_relax", _VOID, [])
        if self.pause is not None:
            b.call(self.pause, [])
        b.ret_void()
        self.cpu_relax = f

        # futex_wait(word, expected): sleeps only if *word == expected at the time
        # the kernel looks (checked atomically in the kernel), so a wake that
        # raced ahead of us is never lost. Spurious returns are fine: callers loop.
        f, b = self._define("jk_futex_wait", _VOID, [_PTR, _I32])
        word, val = f.args
        b.call(self.syscall, [_i64(_SYS_FUTEX), word, _i64(_FUTEX_WAIT_PRIVATE),
                              b.zext(val, _I64), _NULL, _NULL, _i64(0)])
        b.ret_void()
        self.futex_wait = f

        f, b = self._define("jk_futex_wake", _VOID, [_PTR, _I32])
        word, n = f.args
        b.call(self.syscall, [_i64(_SYS_FUTEX), word, _i64(_FUTEX_WAKE_PRIVATE),
                              b.zext(n, _I64), _NULL, _NULL, _i64(0)])
        b.ret_void()
        self.futex_wake = f

    # -- wait/wake, barrier, mutex -----------------------------------------
    def _build_sync(self):
        # wait_change(word, old, sleepers, spin_ns) -> new value of *word (!= old)
        #
        # Spin phase: acquire loads, so once we see the new value we also see
        # everything the publisher wrote before its release store of it.
        # Sleep phase (Dekker-style handshake with wake_if_sleepers):
        #   waiter: sleepers += 1 (seq_cst); v = load word (seq_cst); futex_wait
        #   waker:  store word (seq_cst);    s = load sleepers (seq_cst); wake if s
        # In the single total order of seq_cst operations either the waiter's
        # load sees the new word, or the waker's load sees sleepers > 0 and
        # issues FUTEX_WAKE; futex_wait itself re-checks the word in the kernel.
        f, b = self._define("jk_wait_change", _I32, [_PTR, _I32, _PTR, _I64])
        word, old, sleepers, spin_ns = f.args
        fast_done = f.append_basic_block("fast_done")
        start_spin = f.append_basic_block("start_spin")
        spin_round = f.append_basic_block("spin_round")
        spin = f.append_basic_block("spin")
        spin_next = f.append_basic_block("spin_next")
        check_clock = f.append_basic_block("check_clock")
        spin_done = f.append_basic_block("spin_done")
        sleep = f.append_basic_block("sleep")
        sleep_loop = f.append_basic_block("sleep_loop")
        sleep_wait = f.append_basic_block("sleep_wait")
        woke = f.append_basic_block("woke")

        v0 = b.load_atomic(word, "acquire", 4, typ=_I32)
        b.cbranch(b.icmp_unsigned("!=", v0, old), fast_done, start_spin)
        b.position_at_end(fast_done)
        b.ret(v0)

        b.position_at_end(start_spin)
        deadline = b.add(b.call(self.now_ns, []), spin_ns)
        b.branch(spin_round)

        b.position_at_end(spin_round)
        b.branch(spin)

        b.position_at_end(spin)
        k = b.phi(_I64)
        k.add_incoming(_i64(0), spin_round)
        v = b.load_atomic(word, "acquire", 4, typ=_I32)
        b.cbranch(b.icmp_unsigned("!=", v, old), spin_done, spin_next)
        b.position_at_end(spin_done)
        b.ret(v)

        b.position_at_end(spin_next)
        b.call(self.cpu_relax, [])
        k1 = b.add(k, _i64(1))
        k.add_incoming(k1, spin_next)
        b.cbranch(b.icmp_unsigned("<", k1, _i64(self.polls_per_yield)), spin, check_clock)

        # Every polls_per_yield polls: sched_yield, then check the spin deadline. The yield
        # costs one syscall when this CPU has nothing else to run, and it is what
        # keeps an oversubscribed pool (more threads than CPUs, or a busy host)
        # fast: the thread we are waiting for may be queued behind us on this
        # CPU (measured on 2 CPUs, 4 threads: 400 us -> 7 us per launch).
        b.position_at_end(check_clock)
        b.call(self.sched_yield, [])
        now = b.call(self.now_ns, [])
        b.cbranch(b.icmp_signed("<", now, deadline), spin_round, sleep)

        b.position_at_end(sleep)
        b.atomic_rmw("add", sleepers, _i32(1), "seq_cst")
        b.branch(sleep_loop)

        b.position_at_end(sleep_loop)
        v2 = b.load_atomic(word, "seq_cst", 4, typ=_I32)
        b.cbranch(b.icmp_unsigned("!=", v2, old), woke, sleep_wait)
        b.position_at_end(sleep_wait)
        b.call(self.futex_wait, [word, old])
        b.branch(sleep_loop)

        b.position_at_end(woke)
        b.atomic_rmw("sub", sleepers, _i32(1), "seq_cst")
        b.ret(v2)
        self.wait_change = f

        # publish(word, sleepers, new): the waker half of the handshake above.
        # The seq_cst store is also a release: everything written before it is
        # visible to whoever acquires the new value.
        f, b = self._define("jk_publish", _VOID, [_PTR, _PTR, _I32])
        word, sleepers, new = f.args
        _store_atomic(b, new, word, "seq_cst", 4)
        s = b.load_atomic(sleepers, "seq_cst", 4, typ=_I32)
        do_wake = f.append_basic_block("do_wake")
        done = f.append_basic_block("done")
        b.cbranch(b.icmp_unsigned("!=", s, _i32(0)), do_wake, done)
        b.position_at_end(do_wake)
        b.call(self.futex_wake, [word, _i32(_INT_MAX)])
        b.branch(done)
        b.position_at_end(done)
        b.ret_void()
        self.publish = f

        # barrier(state, T, spin_ns): centralised counter + generation barrier.
        #  * g is read (acquire) before arriving: the generation cannot move
        #    until we arrive, so g is the generation of *this* barrier.
        #  * arrival is an acq_rel RMW on the counter. RMWs extend release
        #    sequences, so the last arriver's RMW synchronises with every earlier
        #    arrival: it sees all writes made by all threads before the barrier.
        #  * the last arriver resets the counter, then publishes g+1 (release);
        #    the others acquire g+1, so they see the reset and all the writes.
        #    Nobody can arrive at the next barrier before seeing g+1, so the
        #    reset is never lost.
        f, b = self._define("jk_barrier", _VOID, [_PTR, _I64, _I64])
        state, nthreads, spin_ns = f.args
        bar_gen = self.field(b, state, OFF_BAR_GEN)
        bar_sleepers = self.field(b, state, OFF_BAR_SLEEPERS)
        bar_count = self.field(b, state, OFF_BAR_COUNT)
        g = b.load_atomic(bar_gen, "acquire", 4, typ=_I32)
        n = b.atomic_rmw("add", bar_count, _i64(1), "acq_rel")
        last = f.append_basic_block("last")
        wait = f.append_basic_block("wait")
        b.cbranch(b.icmp_signed("==", n, b.sub(nthreads, _i64(1))), last, wait)
        b.position_at_end(last)
        _store_atomic(b, _i64(0), bar_count, "monotonic", 8)
        b.call(self.publish, [bar_gen, bar_sleepers, b.add(g, _i32(1))])
        b.ret_void()
        b.position_at_end(wait)
        b.call(self.wait_change, [bar_gen, g, bar_sleepers, spin_ns])
        b.ret_void()
        self.barrier = f

        # Launch lock: a three-state futex mutex (0 free, 1 locked, 2 locked with
        # possible waiters), after U. Drepper, "Futexes Are Tricky", mutex #2.
        # acquire on lock / release on unlock order the pool fields between
        # successive lock holders (two Python threads launching on one pool).
        f, b = self._define("jk_mutex_lock", _VOID, [_PTR])
        (mx,) = f.args
        got = f.append_basic_block("got")
        contended = f.append_basic_block("contended")
        loop = f.append_basic_block("loop")
        sleep = f.append_basic_block("sleep")
        pair = b.cmpxchg(mx, _i32(0), _i32(1), "acquire", "acquire")
        c0 = b.extract_value(pair, 0)
        b.cbranch(b.icmp_unsigned("==", c0, _i32(0)), got, contended)
        b.position_at_end(got)
        b.ret_void()
        b.position_at_end(contended)
        # announce a waiter (state 2) before sleeping, so unlock knows to wake
        c1 = b.atomic_rmw("xchg", mx, _i32(2), "acquire")
        b.branch(loop)
        b.position_at_end(loop)
        c = b.phi(_I32)
        c.add_incoming(c1, contended)
        b.cbranch(b.icmp_unsigned("==", c, _i32(0)), got, sleep)
        b.position_at_end(sleep)
        b.call(self.futex_wait, [mx, _i32(2)])
        c2 = b.atomic_rmw("xchg", mx, _i32(2), "acquire")
        c.add_incoming(c2, sleep)
        b.branch(loop)
        self.mutex_lock = f

        f, b = self._define("jk_mutex_unlock", _VOID, [_PTR])
        (mx,) = f.args
        wake = f.append_basic_block("wake")
        done = f.append_basic_block("done")
        prev = b.atomic_rmw("sub", mx, _i32(1), "release")
        b.cbranch(b.icmp_unsigned("!=", prev, _i32(1)), wake, done)
        b.position_at_end(wake)
        _store_atomic(b, _i32(0), mx, "release", 4)
        b.call(self.futex_wake, [mx, _i32(1)])
        b.branch(done)
        b.position_at_end(done)
        b.ret_void()
        self.mutex_unlock = f

    # -- running a task table ----------------------------------------------
    def _build_run_tasks(self):
        # run_tasks(state, tid, T, tasks, ntasks, spin_ns)
        # Static even split: q = n / T, r = n % T; thread t runs
        # [t*q + min(t, r), that + q + (t < r)). With n == 1 only t = 0 runs.
        # Dynamic split (OFF_DYNAMIC != 0, T > 1, n >= 2T): threads claim chunks of G programs (n / 4T rounded up
        # to even, so pairs 2k, 2k + 1 stay on one thread) from a shared counter until none is left, so a thread
        # that runs slower (a busier core, slower memory) takes fewer chunks instead of holding the barrier.
        # Task i uses counter i % 2; in every task (dynamic or not) thread 0 zeroes the other one before the
        # task's barrier (its last user, task i - 1, finished before the previous barrier), and both after the
        # launch's last barrier.
        f, b = self._define("jk_run_tasks", _VOID, [_PTR, _I64, _I64, _PTR, _I64, _I64])
        state, tid, nthreads, tasks, ntasks, spin_ns = f.args
        entry = b.block
        head = f.append_basic_block("head")
        body = f.append_basic_block("body")
        pick = f.append_basic_block("pick")
        split = f.append_basic_block("split")
        call = f.append_basic_block("call")
        dyn = f.append_basic_block("dynamic")
        claim = f.append_basic_block("claim")
        dcall = f.append_basic_block("dynamic_call")
        dzero = f.append_basic_block("dynamic_zero")
        after = f.append_basic_block("after")
        zt_skip = f.append_basic_block("barrier_or_not")
        do_bar = f.append_basic_block("do_barrier")
        nxt = f.append_basic_block("next")
        done = f.append_basic_block("done")
        zero_all = f.append_basic_block("zero_counters")
        ret = f.append_basic_block("ret")
        multi = b.icmp_signed(">", nthreads, _i64(1))
        dynamic = b.and_(multi, b.icmp_signed("!=", self.load(b, state, OFF_DYNAMIC, _I64), _i64(0)))
        b.branch(head)

        b.position_at_end(head)
        i = b.phi(_I64)
        i.add_incoming(_i64(0), entry)
        b.cbranch(b.icmp_signed("<", i, ntasks), body, done)

        b.position_at_end(body)
        row = b.gep(tasks, [b.mul(i, _i64(3))], source_etype=_I64)
        fn = b.load(row, typ=KERNEL_FNTY.as_pointer(), align=8)
        args = b.load(b.gep(row, [_i64(1)], source_etype=_I64), typ=_PTR, align=8)
        nprog = b.load(b.gep(row, [_i64(2)], source_etype=_I64), typ=_I64, align=8)
        b.cbranch(b.icmp_signed(">", nprog, _i64(0)), pick, after)

        b.position_at_end(pick)
        many = b.icmp_signed(">=", nprog, b.mul(nthreads, _i64(2)))
        b.cbranch(b.and_(dynamic, many), dyn, split)

        b.position_at_end(dyn)
        parity = b.and_(i, _i64(1))
        ctr = b.gep(self.field(b, state, OFF_COUNTERS), [b.mul(parity, _i64(_CACHE_LINE))], source_etype=_I8)
        t4 = b.mul(nthreads, _i64(4))
        g0 = b.sdiv(b.add(nprog, b.sub(t4, _i64(1))), t4)
        grain = b.and_(b.add(g0, _i64(1)), _i64(-2))
        b.branch(claim)

        b.position_at_end(claim)
        c0 = b.atomic_rmw("add", ctr, grain, "monotonic")
        b.cbranch(b.icmp_signed("<", c0, nprog), dcall, dzero)

        b.position_at_end(dcall)
        c1 = b.add(c0, grain)
        b.call(fn, [args, c0, b.select(b.icmp_signed("<", c1, nprog), c1, nprog)])
        b.branch(claim)

        b.position_at_end(dzero)
        b.branch(after)

        b.position_at_end(split)
        q = b.sdiv(nprog, nthreads)
        r = b.srem(nprog, nthreads)
        lt = b.icmp_signed("<", tid, r)
        begin = b.add(b.mul(tid, q), b.select(lt, tid, r))
        end = b.add(b.add(begin, q), b.zext(lt, _I64))
        b.cbranch(b.icmp_signed("<", begin, end), call, after)

        b.position_at_end(call)
        b.call(fn, [args, begin, end])
        b.branch(after)

        b.position_at_end(after)
        zt = f.append_basic_block("zero_next_counter")
        b.cbranch(b.and_(dynamic, b.icmp_signed("==", tid, _i64(0))), zt, zt_skip)
        b.position_at_end(zt)
        # the counter task i + 1 claims from: its last user, task i - 1, finished before the previous barrier
        nxt_ctr = b.gep(self.field(b, state, OFF_COUNTERS), [b.mul(b.xor(b.and_(i, _i64(1)), _i64(1)),
                                                                   _i64(_CACHE_LINE))], source_etype=_I8)
        _store_atomic(b, _i64(0), nxt_ctr, "monotonic", 8)
        b.branch(zt_skip)
        b.position_at_end(zt_skip)
        b.cbranch(multi, do_bar, nxt)
        b.position_at_end(do_bar)
        b.call(self.barrier, [state, nthreads, spin_ns])
        b.branch(nxt)

        b.position_at_end(nxt)
        i1 = b.add(i, _i64(1))
        i.add_incoming(i1, nxt)
        b.branch(head)

        b.position_at_end(done)
        b.cbranch(b.and_(dynamic, b.icmp_signed("==", tid, _i64(0))), zero_all, ret)
        b.position_at_end(zero_all)
        for k in range(2):
            _store_atomic(b, _i64(0), self.field(b, state, OFF_COUNTERS + k * _CACHE_LINE), "monotonic", 8)
        b.branch(ret)
        b.position_at_end(ret)
        b.ret_void()
        self.run_tasks = f

    # -- worker thread -----------------------------------------------------
    def _build_worker(self):
        # worker_main(slot) -> null. `seen` starts at 0, the generation of a
        # fresh state block, not at whatever gen is when the thread first runs:
        # a launch published before the thread got scheduled is not missed.
        # A worker cannot miss a generation later either: every launch ends with
        # a barrier that needs all T threads, so gen moves by at most one
        # between two of our reads.
        f, b = self._define("jk_worker_main", _PTR, [_PTR])
        (slot,) = f.args
        entry = b.block
        loop = f.append_basic_block("loop")
        work = f.append_basic_block("work")
        leave = f.append_basic_block("exit")
        state = b.load(b.gep(slot, [_i64(SLOT_STATE)], source_etype=_I8), typ=_PTR, align=8)
        tid = b.load(b.gep(slot, [_i64(SLOT_TID)], source_etype=_I8), typ=_I64, align=8)
        # set before pthread_create (which synchronises-with the new thread)
        nthreads = self.load(b, state, OFF_NTHREADS, _I64)
        spin_ns = self.load(b, state, OFF_SPIN_NS, _I64)
        gen_p = self.field(b, state, OFF_GEN)
        sleepers_p = self.field(b, state, OFF_SLEEPERS)
        b.branch(loop)

        b.position_at_end(loop)
        seen = b.phi(_I32)
        seen.add_incoming(_i32(0), entry)
        g = b.call(self.wait_change, [gen_p, seen, sleepers_p, spin_ns])
        # ordered after the acquire of the new generation
        shutdown = self.load(b, state, OFF_SHUTDOWN, _I32, "monotonic")
        b.cbranch(b.icmp_unsigned("!=", shutdown, _i32(0)), leave, work)

        b.position_at_end(work)
        # Plain loads: written by the caller before its release of `g`, and not
        # rewritten until this thread has arrived at the launch's last barrier.
        tasks = self.load(b, state, OFF_TASKS, _PTR)
        ntasks = self.load(b, state, OFF_NTASKS, _I64)
        b.call(self.run_tasks, [state, tid, nthreads, tasks, ntasks, spin_ns])
        seen.add_incoming(g, work)
        b.branch(loop)

        b.position_at_end(leave)
        b.ret(_NULL)
        self.worker_main = f

    # -- entry points called from Python -----------------------------------
    def _build_exports(self):
        # dispatch(state, tasks, ntasks): launch lock held, T > 1
        f, b = self._define("jk_dispatch", _VOID, [_PTR, _PTR, _I64])
        state, tasks, ntasks = f.args
        nthreads = self.load(b, state, OFF_NTHREADS, _I64)
        spin_ns = self.load(b, state, OFF_SPIN_NS, _I64)
        self.store(b, state, OFF_TASKS, tasks)
        self.store(b, state, OFF_NTASKS, ntasks)
        # the split is fixed per launch (published with it): every thread of a launch reads the same one
        self.store(b, state, OFF_DYNAMIC, self.load(b, state, OFF_DYNAMIC_REQ, _I64))
        gen_p = self.field(b, state, OFF_GEN)
        g = b.load_atomic(gen_p, "monotonic", 4, typ=_I32)  # only we write gen
        b.call(self.publish, [gen_p, self.field(b, state, OFF_SLEEPERS), b.add(g, _i32(1))])
        b.call(self.run_tasks, [state, _i64(0), nthreads, tasks, ntasks, spin_ns])
        b.ret_void()
        dispatch = f

        # shutdown_and_join(state): launch lock held (or pool never published)
        f, b = self._define("jk_shutdown_and_join", _VOID, [_PTR])
        (state,) = f.args
        started = self.load(b, state, OFF_STARTED, _I64)
        entry = b.block
        go = f.append_basic_block("go")
        head = f.append_basic_block("head")
        body = f.append_basic_block("body")
        done = f.append_basic_block("done")
        b.cbranch(b.icmp_signed(">", started, _i64(0)), go, done)
        b.position_at_end(go)
        self.store(b, state, OFF_SHUTDOWN, _i32(1), "monotonic")
        gen_p = self.field(b, state, OFF_GEN)
        g = b.load_atomic(gen_p, "monotonic", 4, typ=_I32)
        # the release in this store orders the shutdown flag before the new gen
        _store_atomic(b, b.add(g, _i32(1)), gen_p, "seq_cst", 4)
        b.call(self.futex_wake, [gen_p, _i32(_INT_MAX)])  # unconditional
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(_I64)
        i.add_incoming(_i64(1), go)
        b.cbranch(b.icmp_signed("<=", i, started), body, done)
        b.position_at_end(body)
        slot = self.field(b, state, OFF_THREADS)
        slot = b.gep(slot, [b.mul(i, _i64(THREAD_SLOT))], source_etype=_I8)
        handle = b.load(slot, typ=_I64, align=8)
        b.call(self.pthread_join, [handle, _NULL])
        i1 = b.add(i, _i64(1))
        i.add_incoming(i1, body)
        b.branch(head)
        b.position_at_end(done)
        self.store(b, state, OFF_STARTED, _i64(0))
        b.ret_void()
        del entry
        shutdown_and_join = f

        # jk_pool_start(state) -> 0 or the pthread_create error number.
        # All signals are blocked while creating the workers (they inherit the
        # mask), so asynchronous signals such as SIGINT are delivered to Python
        # threads, never to a worker.
        f, b = self._define("jk_pool_start", _I32, [_PTR], exported=True)
        (state,) = f.args
        entry = b.block
        sigset_ty = ir.ArrayType(_I8, _SIGSET_BYTES)
        allsig = b.alloca(sigset_ty)
        allsig.align = 16
        oldsig = b.alloca(sigset_ty)
        oldsig.align = 16
        b.call(self.sigfillset, [allsig])
        b.call(self.pthread_sigmask, [_i32(_SIG_BLOCK), allsig, oldsig])
        nthreads = self.load(b, state, OFF_NTHREADS, _I64)
        head = f.append_basic_block("head")
        body = f.append_basic_block("body")
        ok = f.append_basic_block("created")
        fail = f.append_basic_block("fail")
        done = f.append_basic_block("done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(_I64)
        i.add_incoming(_i64(1), entry)
        b.cbranch(b.icmp_signed("<", i, nthreads), body, done)
        b.position_at_end(body)
        slot = b.gep(self.field(b, state, OFF_THREADS), [b.mul(i, _i64(THREAD_SLOT))],
                     source_etype=_I8)
        b.store(state, b.gep(slot, [_i64(SLOT_STATE)], source_etype=_I8), align=8)
        b.store(i, b.gep(slot, [_i64(SLOT_TID)], source_etype=_I8), align=8)
        rc = b.call(self.pthread_create, [slot, _NULL, self.worker_main, slot])
        b.cbranch(b.icmp_signed("==", rc, _i32(0)), ok, fail)
        b.position_at_end(ok)
        self.store(b, state, OFF_STARTED, i)
        i1 = b.add(i, _i64(1))
        i.add_incoming(i1, ok)
        b.branch(head)
        b.position_at_end(fail)
        b.call(self.pthread_sigmask, [_i32(_SIG_SETMASK), oldsig, _NULL])
        b.call(shutdown_and_join, [state])
        self.store(b, state, OFF_CLOSED, _i32(1), "monotonic")
        b.ret(rc)
        b.position_at_end(done)
        b.call(self.pthread_sigmask, [_i32(_SIG_SETMASK), oldsig, _NULL])
        b.ret(_i32(0))

        # jk_pool_stop(state) -> 0. Idempotent. Waits for a running launch
        # (launch lock), then wakes every worker with shutdown=1 and joins them.
        f, b = self._define("jk_pool_stop", _I32, [_PTR], exported=True)
        (state,) = f.args
        mx = self.field(b, state, OFF_MUTEX)
        b.call(self.mutex_lock, [mx])
        closed = self.load(b, state, OFF_CLOSED, _I32, "monotonic")
        already = f.append_basic_block("already")
        stop = f.append_basic_block("stop")
        b.cbranch(b.icmp_unsigned("!=", closed, _i32(0)), already, stop)
        b.position_at_end(already)
        b.call(self.mutex_unlock, [mx])
        b.ret(_i32(0))
        b.position_at_end(stop)
        self.store(b, state, OFF_CLOSED, _i32(1), "monotonic")
        b.call(shutdown_and_join, [state])
        b.call(self.mutex_unlock, [mx])
        b.ret(_i32(0))

        # jk_pool_launch_tasks(state, tasks, ntasks) -> RC_*
        f, b = self._define("jk_pool_launch_tasks", _I32, [_PTR, _PTR, _I64], exported=True)
        state, tasks, ntasks = f.args
        entry = b.block
        scan = f.append_basic_block("scan")
        scan_body = f.append_basic_block("scan_body")
        scan_next = f.append_basic_block("scan_next")
        null_fn = f.append_basic_block("null_fn")
        scanned = f.append_basic_block("scanned")
        inline_chk = f.append_basic_block("inline_check")
        inline = f.append_basic_block("inline")
        closed_rc = f.append_basic_block("closed")
        pooled = f.append_basic_block("pooled")
        closed_unlock = f.append_basic_block("closed_unlock")
        go = f.append_basic_block("go")
        b.branch(scan)
        # validate first (no kernel has run yet if we return an error) and find
        # the largest grid: if no task has 2+ programs, every chunk lands on
        # thread 0 anyway, so run inline without waking anyone.
        b.position_at_end(scan)
        i = b.phi(_I64)
        mx_np = b.phi(_I64)
        i.add_incoming(_i64(0), entry)
        mx_np.add_incoming(_i64(0), entry)
        b.cbranch(b.icmp_signed("<", i, ntasks), scan_body, scanned)
        b.position_at_end(scan_body)
        row = b.gep(tasks, [b.mul(i, _i64(3))], source_etype=_I64)
        fnv = b.load(row, typ=_I64, align=8)
        npv = b.load(b.gep(row, [_i64(2)], source_etype=_I64), typ=_I64, align=8)
        b.cbranch(b.icmp_unsigned("==", fnv, _i64(0)), null_fn, scan_next)
        b.position_at_end(scan_next)
        bigger = b.icmp_signed(">", npv, mx_np)
        mx1 = b.select(bigger, npv, mx_np)
        i1 = b.add(i, _i64(1))
        i.add_incoming(i1, scan_next)
        mx_np.add_incoming(mx1, scan_next)
        b.branch(scan)
        b.position_at_end(null_fn)
        b.ret(_i32(RC_NULL_KERNEL))

        b.position_at_end(scanned)
        nthreads = self.load(b, state, OFF_NTHREADS, _I64)
        serial = b.or_(b.icmp_signed("<=", nthreads, _i64(1)), b.icmp_signed("<=", mx_np, _i64(1)))
        b.cbranch(serial, inline_chk, pooled)

        b.position_at_end(inline_chk)
        closed = self.load(b, state, OFF_CLOSED, _I32, "monotonic")
        b.cbranch(b.icmp_unsigned("!=", closed, _i32(0)), closed_rc, inline)
        b.position_at_end(inline)
        b.call(self.run_tasks, [state, _i64(0), _i64(1), tasks, ntasks, _i64(0)])
        b.ret(_i32(RC_OK))
        b.position_at_end(closed_rc)
        b.ret(_i32(RC_CLOSED))

        b.position_at_end(pooled)
        mxp = self.field(b, state, OFF_MUTEX)
        b.call(self.mutex_lock, [mxp])
        closed2 = self.load(b, state, OFF_CLOSED, _I32, "monotonic")
        b.cbranch(b.icmp_unsigned("!=", closed2, _i32(0)), closed_unlock, go)
        b.position_at_end(closed_unlock)
        b.call(self.mutex_unlock, [mxp])
        b.ret(_i32(RC_CLOSED))
        b.position_at_end(go)
        b.call(dispatch, [state, tasks, ntasks])
        b.call(self.mutex_unlock, [mxp])
        b.ret(_i32(RC_OK))

        # jk_pool_launch(state, fn, args, nprog) -> RC_*: one task.
        f, b = self._define("jk_pool_launch", _I32, [_PTR, _PTR, _PTR, _I64], exported=True)
        state, fn, args, nprog = f.args
        null_fn = f.append_basic_block("null_fn")
        nonnull = f.append_basic_block("nonnull")
        inline_chk = f.append_basic_block("inline_check")
        inline = f.append_basic_block("inline")
        inline_call = f.append_basic_block("inline_call")
        inline_done = f.append_basic_block("inline_done")
        closed_rc = f.append_basic_block("closed")
        pooled = f.append_basic_block("pooled")
        closed_unlock = f.append_basic_block("closed_unlock")
        go = f.append_basic_block("go")
        b.cbranch(b.icmp_unsigned("==", b.ptrtoint(fn, _I64), _i64(0)), null_fn, nonnull)
        b.position_at_end(null_fn)
        b.ret(_i32(RC_NULL_KERNEL))
        b.position_at_end(nonnull)
        nthreads = self.load(b, state, OFF_NTHREADS, _I64)
        serial = b.or_(b.icmp_signed("<=", nthreads, _i64(1)), b.icmp_signed("<=", nprog, _i64(1)))
        b.cbranch(serial, inline_chk, pooled)

        b.position_at_end(inline_chk)
        closed = self.load(b, state, OFF_CLOSED, _I32, "monotonic")
        b.cbranch(b.icmp_unsigned("!=", closed, _i32(0)), closed_rc, inline)
        b.position_at_end(inline)
        b.cbranch(b.icmp_signed(">", nprog, _i64(0)), inline_call, inline_done)
        b.position_at_end(inline_call)
        # a typed function pointer tells llvmlite the callee's signature; the
        # bitcast is inserted by hand because IRBuilder.bitcast drops it
        # (it treats typed and opaque pointers as equal types)
        fnp = ir.instructions.CastInstr(b.block, "bitcast", fn, KERNEL_FNTY.as_pointer())
        b._insert(fnp)
        b.call(fnp, [args, _i64(0), nprog])
        b.branch(inline_done)
        b.position_at_end(inline_done)
        b.ret(_i32(RC_OK))
        b.position_at_end(closed_rc)
        b.ret(_i32(RC_CLOSED))

        b.position_at_end(pooled)
        mxp = self.field(b, state, OFF_MUTEX)
        b.call(self.mutex_lock, [mxp])
        closed2 = self.load(b, state, OFF_CLOSED, _I32, "monotonic")
        b.cbranch(b.icmp_unsigned("!=", closed2, _i32(0)), closed_unlock, go)
        b.position_at_end(closed_unlock)
        b.call(self.mutex_unlock, [mxp])
        b.ret(_i32(RC_CLOSED))
        b.position_at_end(go)
        task = self.field(b, state, OFF_INLINE_TASK)
        b.store(b.ptrtoint(fn, _I64), task, align=8)
        b.store(b.ptrtoint(args, _I64), b.gep(task, [_i64(8)], source_etype=_I8), align=8)
        b.store(nprog, b.gep(task, [_i64(16)], source_etype=_I8), align=8)
        b.call(dispatch, [state, task, _i64(1)])
        b.call(self.mutex_unlock, [mxp])
        b.ret(_i32(RC_OK))


EXPORTS = ("jk_pool_start", "jk_pool_stop", "jk_pool_launch", "jk_pool_launch_tasks")


# --------------------------------------------------------------------------
# JIT plumbing
# --------------------------------------------------------------------------

_jit_lock = threading.Lock()
_jit_state: dict = {}
_lib_counter = itertools.count()


def _host_target_machine():
    """One generic host TargetMachine + LLJIT for the process (x86/AArch64 TMs
    may be reused across modules)."""
    with _jit_lock:
        if "lljit" not in _jit_state:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            triple = llvm.get_process_triple()
            target = llvm.Target.from_triple(triple)
            # Generic CPU: the pool code needs no ISA extensions and the kernels
            # it calls are compiled elsewhere with their own features.
            tm = target.create_target_machine(opt=2, reloc="pic", codemodel="jitdefault", jit=True)
            _jit_state["triple"] = triple
            _jit_state["tm"] = tm
            # JITLink: RuntimeDyld can place code and constants > 2 GiB apart and then abort on an LLVM assertion
            # (see jitkern/runtime/cpu.py _jit)
            _jit_state["lljit"] = llvm.create_lljit_compiler(tm, use_jit_link=True)
        return _jit_state["tm"], _jit_state["lljit"]


class NativeLibrary:
    """LLVM IR text JIT-compiled for the host; ``lib[name]`` is a symbol's address.

    The code stays valid as long as this object is alive. Symbols from the
    process (libc, libm) are resolvable from the IR.
    """

    def __init__(self, ir_text: str, symbols, *, name: str = "lib", optimize: bool = True):
        tm, lljit = _host_target_machine()
        try:
            mod = llvm.parse_assembly(ir_text)
            mod.verify()
        except RuntimeError as exc:
            raise PoolError(f"NativeLibrary {name!r}: invalid LLVM IR: {exc}") from None
        if not mod.triple or mod.triple.startswith("unknown"):
            mod.triple = _jit_state["triple"]
        mod.data_layout = str(tm.target_data)
        if optimize:
            pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=2))
            pb.getModulePassManager().run(mod, pb)
        builder = llvm.JITLibraryBuilder().add_ir(str(mod)).add_current_process()
        symbols = tuple(symbols)
        for s in symbols:
            builder.export_symbol(s)
        libname = f"jitkern_{name}_{next(_lib_counter)}"
        with _jit_lock:
            try:
                self._tracker = builder.link(lljit, libname)
            except RuntimeError as exc:
                raise PoolError(f"NativeLibrary {name!r}: JIT link failed: {exc}") from None
        self._lljit = lljit  # keep the JIT alive while the code may run
        self.name = libname
        self.addresses = {s: int(self._tracker[s]) for s in symbols}
        for s, a in self.addresses.items():
            if not a:
                raise PoolError(f"NativeLibrary {name!r}: symbol {s!r} not defined")

    def __getitem__(self, symbol: str) -> int:
        return self.addresses[symbol]


class _PoolNative:
    """The compiled pool module and prebuilt ctypes function objects."""

    def __init__(self):
        if _SYS_FUTEX is None or not os.uname().sysname == "Linux":
            raise PoolError(
                f"CpuPool: native pool supports Linux on x86_64/aarch64 only "
                f"(this host: {os.uname().sysname} {platform.machine()})")
        tm, _ = _host_target_machine()
        polls = _env_int("JITKERN_POLLS_PER_YIELD", 1)
        self.polls_per_yield = DEFAULT_POLLS_PER_YIELD if polls is None else polls
        module = _PoolIRBuilder(_jit_state["triple"], str(tm.target_data),
                                self.polls_per_yield).m
        self.ir_text = str(module)
        self.lib = NativeLibrary(self.ir_text, EXPORTS, name="cpu_pool")
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        # CFUNCTYPE (not PYFUNCTYPE): ctypes releases the GIL around the call,
        # so other Python threads keep running while kernels execute.
        self.start = ctypes.CFUNCTYPE(i32, vp)(self.lib["jk_pool_start"])
        self.stop = ctypes.CFUNCTYPE(i32, vp)(self.lib["jk_pool_stop"])
        self.launch = ctypes.CFUNCTYPE(i32, vp, vp, vp, i64)(self.lib["jk_pool_launch"])
        self.launch_tasks = ctypes.CFUNCTYPE(i32, vp, vp, i64)(self.lib["jk_pool_launch_tasks"])


_native_lock = threading.Lock()
_native_obj: _PoolNative | None = None


def _native() -> _PoolNative:
    global _native_obj
    with _native_lock:
        if _native_obj is None:
            _native_obj = _PoolNative()
        return _native_obj


# --------------------------------------------------------------------------
# Thread count
# --------------------------------------------------------------------------

def _read_int(path):
    with open(path) as f:
        return int(f.read().strip())


def physical_core_count() -> int:
    """Physical cores this process may run on (SMT siblings counted once).

    Reads /sys/devices/system/cpu/cpuN/topology/{core_id,physical_package_id}
    for the CPUs in the affinity mask, else ``lscpu -p``, else os.cpu_count().
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    try:
        cores = set()
        for cpu in allowed:
            base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            cores.add((_read_int(f"{base}/physical_package_id"), _read_int(f"{base}/core_id")))
        if cores:
            return len(cores)
    except (OSError, ValueError):
        pass
    try:
        out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True,
                             timeout=5, check=True).stdout
        allowed_set = set(allowed)
        cores = set()
        for line in out.splitlines():
            if not line or line.startswith("#"):
                continue
            cpu, core, sock = (int(x) if x else 0 for x in line.split(",")[:3])
            if cpu in allowed_set:
                cores.add((sock, core))
        if cores:
            return len(cores)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return max(1, len(allowed) or os.cpu_count() or 1)


def _env_int(name, minimum):
    from jitkern.env import SettingError, env_int   # the one parser of JITKERN_* settings
    try:
        return env_int(name, minimum)
    except SettingError as e:
        raise PoolError(str(e)) from None


def default_num_threads() -> int:
    """``JITKERN_NUM_THREADS`` if set, else the number of physical cores."""
    n = _env_int("JITKERN_NUM_THREADS", 1)
    return n if n is not None else physical_core_count()


# --------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------

_ERRORS = {
    RC_CLOSED: "CpuPool: launch on a closed pool",
    RC_NULL_KERNEL: "CpuPool: kernel address (fn) is 0",
}


def _close_native(stop, state_addr, _keepalive):
    # Runs from close(), from garbage collection, or at interpreter exit
    # (weakref.finalize registers with atexit). `_keepalive` holds the state
    # buffer and the JIT code until the workers are joined.
    stop(state_addr)


_live_pools: "weakref.WeakSet[CpuPool]" = weakref.WeakSet()
_INT64 = np.dtype(np.int64)


def _as_ints(where, **values):
    """Slow path when ctypes rejected an argument: accept numpy integers etc.,
    or name the bad one."""
    out = []
    for name, v in values.items():
        try:
            iv = operator.index(v)
        except TypeError:
            raise PoolError(f"CpuPool.{where}: {name} must be an integer, got "
                            f"{type(v).__name__} {v!r}") from None
        if name.endswith("_addr"):
            if not 0 <= iv < 2**64:
                raise PoolError(f"CpuPool.{where}: {name}={iv} is not an address")
        elif not -2**63 <= iv < 2**63:
            raise PoolError(f"CpuPool.{where}: {name}={iv} does not fit in int64")
        out.append(iv)
    return out


class CpuPool:
    """A pool of ``num_threads`` threads (the caller is thread 0) that runs kernels.

    ``num_threads`` defaults to ``JITKERN_NUM_THREADS`` or the number of physical
    cores. ``spin_us`` (default ``JITKERN_SPIN_US`` or 200) is how long idle
    threads spin before sleeping on a futex; 0 sleeps at once.
    With ``num_threads == 1`` no worker threads exist and tasks run inline.

    One launch runs at a time per pool; launches from several Python threads are
    serialised by a native lock. Kernels cannot report errors.
    """

    def __init__(self, num_threads: int | None = None, *, spin_us: int | None = None):
        if num_threads is None:
            num_threads = default_num_threads()
        if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) \
                or num_threads < 1:
            raise PoolError(f"CpuPool: num_threads must be an integer >= 1, got {num_threads!r}")
        if spin_us is None:
            spin_us = _env_int("JITKERN_SPIN_US", 0)
            spin_us = DEFAULT_SPIN_US if spin_us is None else spin_us
        if not isinstance(spin_us, (int, np.integer)) or spin_us < 0:
            raise PoolError(f"CpuPool: spin_us must be an integer >= 0, got {spin_us!r}")
        self.num_threads = int(num_threads)
        self.spin_us = int(spin_us)
        from jitkern.env import pool_split
        self._dynamic = pool_split(DEFAULT_SPLIT) == "dynamic"
        self._nat = _native()
        self._c_launch = self._nat.launch
        self._c_launch_tasks = self._nat.launch_tasks
        self._last_tasks = None
        self._last_tasks_addr = 0
        self._start_native()
        _live_pools.add(self)

    def _start_native(self):
        nbytes = state_bytes(self.num_threads)
        buf = ctypes.create_string_buffer(nbytes + _CACHE_LINE)  # zeroed
        addr = (ctypes.addressof(buf) + _CACHE_LINE - 1) & ~(_CACHE_LINE - 1)
        ctypes.c_int64.from_address(addr + OFF_NTHREADS).value = self.num_threads
        ctypes.c_int64.from_address(addr + OFF_SPIN_NS).value = self.spin_us * 1000
        ctypes.c_int64.from_address(addr + OFF_DYNAMIC_REQ).value = int(self._dynamic)
        self._buf = buf
        self._state = addr
        if self.num_threads > 1:
            rc = self._nat.start(addr)
            if rc:
                raise PoolError(f"CpuPool: pthread_create failed for a worker thread: "
                                f"{os.strerror(rc)} (errno {rc}, num_threads={self.num_threads})")
        self._finalizer = weakref.finalize(self, _close_native, self._nat.stop, addr,
                                           (buf, self._nat))

    @property
    def dynamic(self) -> bool:
        """How a task's programs are dealt to the threads: False, the static split (thread t runs the t-th of T
        contiguous chunks); True, chunks claimed from a shared counter (tasks of at least 2T programs), so a
        slower thread takes fewer. Either way every program runs once and the outputs are the same; the next
        launch takes a change."""
        return self._dynamic

    @dynamic.setter
    def dynamic(self, on: bool) -> None:
        self._dynamic = bool(on)
        ctypes.c_int64.from_address(self._state + OFF_DYNAMIC_REQ).value = int(self._dynamic)

    # -- launching ----------------------------------------------------------
    # The hot paths below are kept tiny: one prebuilt ctypes call with plain
    # ints (ctypes converts them through the argtypes; no per-call wrappers).
    def launch(self, fn_addr: int, args_addr: int, num_programs: int) -> None:
        """Run programs [0, num_programs) of kernel ``fn_addr`` on the pool with the
        packed argument block at ``args_addr``; returns when all are done."""
        # c_void_p is ctypes' cheapest argument conversion but would also pass
        # str/bytes as pointers, hence the exact-int check (numpy ints and bad
        # values take the slow path, which converts or raises a clear error).
        if type(fn_addr) is not int or type(args_addr) is not int \
                or type(num_programs) is not int:
            fn_addr, args_addr, num_programs = _as_ints(
                "launch", fn_addr=fn_addr, args_addr=args_addr, num_programs=num_programs)
        try:
            rc = self._c_launch(self._state, fn_addr, args_addr, num_programs)
        except ctypes.ArgumentError:  # an int out of range
            rc = self._c_launch(self._state, *_as_ints("launch", fn_addr=fn_addr,
                                                       args_addr=args_addr,
                                                       num_programs=num_programs))
        if rc:
            raise PoolError(_ERRORS[rc])

    def launch_tasks(self, tasks: np.ndarray) -> None:
        """Run a table of tasks, a C-contiguous int64 array of shape (n, 3) with rows
        (fn, args, num_programs), in order with a barrier after each: one native
        call. All fn are checked for 0 before anything runs."""
        if (type(tasks) is not np.ndarray or tasks.dtype is not _INT64 or tasks.ndim != 2
                or tasks.shape[1] != 3 or not tasks.flags.c_contiguous):
            if not (isinstance(tasks, np.ndarray) and tasks.dtype == np.int64
                    and tasks.ndim == 2 and tasks.shape[1] == 3 and tasks.flags.c_contiguous):
                raise PoolError(
                    "CpuPool.launch_tasks: tasks must be a C-contiguous numpy int64 array of "
                    f"shape (n, 3) (fn, args, num_programs); got {type(tasks).__name__} "
                    f"{getattr(tasks, 'dtype', '')} {getattr(tasks, 'shape', '')}")
        # `.ctypes.data` costs ~1 us; a replayed table is usually the same object,
        # and while we hold it its buffer cannot move (resize checks references).
        if tasks is self._last_tasks:
            addr = self._last_tasks_addr
        else:
            addr = tasks.ctypes.data
            self._last_tasks, self._last_tasks_addr = tasks, addr
        rc = self._c_launch_tasks(self._state, addr, tasks.shape[0])
        if rc:
            raise PoolError(_ERRORS[rc])

    def launch_tasks_ptr(self, tasks_addr: int, num_tasks: int) -> None:
        """Unchecked fast path of :meth:`launch_tasks` for a table whose address the
        caller cached (e.g. a replayed graph); the table must stay alive and hold
        ``num_tasks`` rows of three int64."""
        if type(tasks_addr) is not int or type(num_tasks) is not int:
            tasks_addr, num_tasks = _as_ints("launch_tasks_ptr", tasks_addr=tasks_addr,
                                             num_tasks=num_tasks)
        try:
            rc = self._c_launch_tasks(self._state, tasks_addr, num_tasks)
        except ctypes.ArgumentError:
            rc = self._c_launch_tasks(self._state, *_as_ints("launch_tasks_ptr",
                                                             tasks_addr=tasks_addr,
                                                             num_tasks=num_tasks))
        if rc:
            raise PoolError(_ERRORS[rc])

    # -- lifetime ---------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Join the worker threads. Idempotent; waits for a launch in progress."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"CpuPool(num_threads={self.num_threads}, spin_us={self.spin_us}, {state})"

    def _reinit_after_fork(self):
        # The child has no worker threads and may hold a copy of a half-done
        # launch. Mark the old copy closed first (a launch on it would wait
        # forever for workers that do not exist), never join its threads, and
        # start afresh.
        if not self._finalizer.alive:
            return
        ctypes.c_int32.from_address(self._state + OFF_CLOSED).value = 1
        self._finalizer.detach()
        self._last_tasks = None
        self._start_native()


_pool_lock = threading.Lock()
_pool: CpuPool | None = None


def get_pool() -> CpuPool:
    """The process-wide pool (created on first use with the default thread count;
    re-created if it was closed)."""
    global _pool
    pool = _pool
    if pool is not None and not pool.closed:
        return pool
    with _pool_lock:
        if _pool is None or _pool.closed:
            _pool = CpuPool()
        return _pool


def _after_fork_in_child():
    global _native_lock, _pool_lock, _jit_lock
    _native_lock = threading.Lock()
    _pool_lock = threading.Lock()
    _jit_lock = threading.Lock()
    for pool in list(_live_pools):
        pool._reinit_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
