"""Tests for the native CPU thread pool (jitkern/runtime/cpu_pool.py).

The kernels are small LLVM IR functions with the compiled-kernel ABI
``void(ptr args, i64 pid_begin, i64 pid_end)``; buffers are numpy arrays whose
addresses go into the packed argument block (slots 0..2 = grid, then params).
"""
import faulthandler
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jitkern.runtime import cpu_pool
from jitkern.runtime.cpu_pool import CpuPool, NativeLibrary, PoolError, get_pool

# A hang in native code cannot be interrupted by Python; faulthandler's watchdog
# runs on its own C thread, prints all stacks and exits instead of hanging CI.
HANG_LIMIT_S = 120


@pytest.fixture(autouse=True)
def _hang_watchdog():
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


KERNELS_IR = r"""
declare i32 @clock_gettime(i32, ptr)
declare i64 @pthread_self()
declare void @llvm.x86.sse2.pause()

; args: [g0, g1, g2, out, mul]   out[pid] = ((pid * mul) xor (pid >> 3)) + 7
define void @fill(ptr %args, i64 %b, i64 %e) {
entry:
  %po = getelementptr i64, ptr %args, i64 3
  %oi = load i64, ptr %po
  %out = inttoptr i64 %oi to ptr
  %pm = getelementptr i64, ptr %args, i64 4
  %mul = load i64, ptr %pm
  %c = icmp slt i64 %b, %e
  br i1 %c, label %loop, label %exit
loop:
  %i = phi i64 [%b, %entry], [%i1, %loop]
  %m = mul i64 %i, %mul
  %s = ashr i64 %i, 3
  %x = xor i64 %m, %s
  %v = add i64 %x, 7
  %p = getelementptr i64, ptr %out, i64 %i
  store i64 %v, ptr %p
  %i1 = add i64 %i, 1
  %c2 = icmp slt i64 %i1, %e
  br i1 %c2, label %loop, label %exit
exit:
  ret void
}

; args: [g0, g1, g2, counts]   counts[pid] += 1 (plain, not atomic: a program
; run twice leaves 2, a lost one leaves 0)
define void @count(ptr %args, i64 %b, i64 %e) {
entry:
  %po = getelementptr i64, ptr %args, i64 3
  %oi = load i64, ptr %po
  %out = inttoptr i64 %oi to ptr
  %c = icmp slt i64 %b, %e
  br i1 %c, label %loop, label %exit
loop:
  %i = phi i64 [%b, %entry], [%i1, %loop]
  %p = getelementptr i64, ptr %out, i64 %i
  %v = load i64, ptr %p
  %v1 = add i64 %v, 1
  store i64 %v1, ptr %p
  %i1 = add i64 %i, 1
  %c2 = icmp slt i64 %i1, %e
  br i1 %c2, label %loop, label %exit
exit:
  ret void
}

; args: [g0, g1, g2, owner]   owner[pid] = pthread_self()
define void @owner(ptr %args, i64 %b, i64 %e) {
entry:
  %po = getelementptr i64, ptr %args, i64 3
  %oi = load i64, ptr %po
  %out = inttoptr i64 %oi to ptr
  %me = call i64 @pthread_self()
  %c = icmp slt i64 %b, %e
  br i1 %c, label %loop, label %exit
loop:
  %i = phi i64 [%b, %entry], [%i1, %loop]
  %p = getelementptr i64, ptr %out, i64 %i
  store i64 %me, ptr %p
  %i1 = add i64 %i, 1
  %c2 = icmp slt i64 %i1, %e
  br i1 %c2, label %loop, label %exit
exit:
  ret void
}

; args: [g0, g1, g2, src, dst, addend]   dst[pid] = src[g0 - 1 - pid] * 3 + addend
; Program pid reads what another thread's chunk wrote in the previous task.
define void @reverse(ptr %args, i64 %b, i64 %e) {
entry:
  %n = load i64, ptr %args
  %ps = getelementptr i64, ptr %args, i64 3
  %si = load i64, ptr %ps
  %src = inttoptr i64 %si to ptr
  %pd = getelementptr i64, ptr %args, i64 4
  %di = load i64, ptr %pd
  %dst = inttoptr i64 %di to ptr
  %pa = getelementptr i64, ptr %args, i64 5
  %add = load i64, ptr %pa
  %nm1 = sub i64 %n, 1
  %c = icmp slt i64 %b, %e
  br i1 %c, label %loop, label %exit
loop:
  %i = phi i64 [%b, %entry], [%i1, %loop]
  %j = sub i64 %nm1, %i
  %q = getelementptr i64, ptr %src, i64 %j
  %v = load i64, ptr %q
  %v3 = mul i64 %v, 3
  %w = add i64 %v3, %add
  %p = getelementptr i64, ptr %dst, i64 %i
  store i64 %w, ptr %p
  %i1 = add i64 %i, 1
  %c2 = icmp slt i64 %i1, %e
  br i1 %c2, label %loop, label %exit
exit:
  ret void
}

; args: [g0, g1, g2, flag, result]: wait (<= 10 s) until another *Python*
; thread sets flag; result = 1 if it did. Proves the GIL is released.
define void @wait_flag(ptr %args, i64 %b, i64 %e) {
entry:
  %ts = alloca [2 x i64]
  %pf = getelementptr i64, ptr %args, i64 3
  %fi = load i64, ptr %pf
  %flag = inttoptr i64 %fi to ptr
  %pr = getelementptr i64, ptr %args, i64 4
  %ri = load i64, ptr %pr
  %res = inttoptr i64 %ri to ptr
  %r0 = call i32 @clock_gettime(i32 1, ptr %ts)
  %t0 = load i64, ptr %ts
  br label %loop
loop:
  %f = load atomic i64, ptr %flag acquire, align 8
  %set = icmp ne i64 %f, 0
  br i1 %set, label %seen, label %check
check:
  call void @llvm.x86.sse2.pause()
  %r1 = call i32 @clock_gettime(i32 1, ptr %ts)
  %t = load i64, ptr %ts
  %dt = sub i64 %t, %t0
  %late = icmp sgt i64 %dt, 10
  br i1 %late, label %exit, label %loop
seen:
  store i64 1, ptr %res
  br label %exit
exit:
  ret void
}

define void @empty(ptr %args, i64 %b, i64 %e) {
  ret void
}
"""

if not cpu_pool._IS_X86_64:  # the pause intrinsic above is x86-only
    KERNELS_IR = KERNELS_IR.replace("declare void @llvm.x86.sse2.pause()\n", "").replace(
        "  call void @llvm.x86.sse2.pause()\n", "")

KERNEL_NAMES = ("fill", "count", "owner", "reverse", "wait_flag", "empty")


@pytest.fixture(scope="module")
def k():
    return NativeLibrary(KERNELS_IR, KERNEL_NAMES, name="test_kernels")


def args_block(n, *params):
    """Packed argument block: grid (n, 1, 1) then one i64 slot per parameter."""
    return np.array([n, 1, 1, *params], dtype=np.int64)


def fill_ref(n, mul):
    i = np.arange(n, dtype=np.int64)
    return ((i * mul) ^ (i >> 3)) + 7


def split_ref(n, t):
    """Chunk [begin, end) of thread t of T as the pool's static split defines it."""
    def chunk(tid, nthreads):
        q, r = divmod(n, nthreads)
        begin = tid * q + min(tid, r)
        return begin, begin + q + (1 if tid < r else 0)
    return chunk


THREADS = [1, 2, 3, 4]
GRIDS = [1, 2, 3, 7, 1000, 100003]


@pytest.fixture(scope="module")
def pools():
    made = {t: CpuPool(t) for t in THREADS}
    yield made
    for p in made.values():
        p.close()


@pytest.mark.parametrize("nthreads", THREADS)
@pytest.mark.parametrize("n", GRIDS)
def test_every_program_runs_exactly_once(k, pools, nthreads, n):
    pool = pools[nthreads]
    rng = np.random.default_rng(n * 10 + nthreads)
    counts = np.zeros(n, dtype=np.int64)
    a = args_block(n, counts.ctypes.data)
    pool.launch(k["count"], a.ctypes.data, n)
    assert np.array_equal(counts, np.ones(n, dtype=np.int64))

    mul = int(rng.integers(3, 1 << 20))
    out = rng.integers(-(1 << 40), 1 << 40, size=n + 2, dtype=np.int64)  # guard cells past n
    guard = out[n:].copy()
    a = args_block(n, out.ctypes.data, mul)
    pool.launch(k["fill"], a.ctypes.data, n)
    assert np.array_equal(out[:n], fill_ref(n, mul))
    assert np.array_equal(out[n:], guard), "a program wrote past num_programs"


@pytest.mark.parametrize("nthreads", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000])
def test_static_contiguous_split(k, pools, nthreads, n):
    pool = pools[nthreads]
    owner = np.zeros(n, dtype=np.int64)
    a = args_block(n, owner.ctypes.data)
    pool.launch(k["owner"], a.ctypes.data, n)
    chunk = split_ref(n, nthreads)
    ids = []
    for t in range(nthreads):
        b, e = chunk(t, nthreads)
        if b == e:
            continue
        seg = owner[b:e]
        assert (seg == seg[0]).all(), f"chunk {t} [{b},{e}) ran on several threads"
        ids.append(int(seg[0]) & 0xFFFFFFFFFFFFFFFF)  # pthread_t is unsigned
    # thread 0 is the calling Python thread (threading.get_ident() is pthread_self())
    assert ids[0] == threading.get_ident()
    assert len(set(ids)) == min(n, nthreads), "non-empty chunks must run on distinct threads"


@pytest.mark.parametrize("nthreads", THREADS)
def test_tasks_run_in_order_with_barriers(k, pools, nthreads):
    """A chain of 'reverse' tasks: task i+1 reads what *other* threads wrote in task i."""
    pool = pools[nthreads]
    rng = np.random.default_rng(7 + nthreads)
    n = 100003
    bufs = [rng.integers(-1000, 1000, size=n, dtype=np.int64) for _ in range(2)]
    expected = bufs[0].copy()
    steps = 24
    blocks, rows = [], []
    for s in range(steps):
        src, dst = bufs[s % 2], bufs[(s + 1) % 2]
        addend = int(rng.integers(-50, 50))
        blk = args_block(n, src.ctypes.data, dst.ctypes.data, addend)
        blocks.append(blk)
        rows.append((k["reverse"], blk.ctypes.data, n))
        expected = expected[::-1] * 3 + addend
    tasks = np.array(rows, dtype=np.int64)
    pool.launch_tasks(tasks)
    assert np.array_equal(bufs[steps % 2], expected)


@pytest.mark.parametrize("nthreads", THREADS)
def test_task_table_mixed_grids(k, pools, nthreads):
    pool = pools[nthreads]
    sizes = [0, 1, 5, 2, 100003, 3, 1, 0, 999]
    counts = [np.zeros(max(s, 1), dtype=np.int64) for s in sizes]
    blocks = [args_block(s, c.ctypes.data) for s, c in zip(sizes, counts)]
    tasks = np.array([(k["count"], b.ctypes.data, s) for s, b in zip(sizes, blocks)],
                     dtype=np.int64)
    for _ in range(3):
        pool.launch_tasks(tasks)
    for s, c in zip(sizes, counts):
        assert np.array_equal(c[:s], np.full(s, 3, dtype=np.int64))
        if s == 0:
            assert c[0] == 0
    # the unchecked pointer entry point does the same work
    pool.launch_tasks_ptr(tasks.ctypes.data, tasks.shape[0])
    assert np.array_equal(counts[4], np.full(sizes[4], 4, dtype=np.int64))
    # the same table object edited in place is re-read on every launch
    tasks[4, 2] = 10
    pool.launch_tasks(tasks)
    assert np.array_equal(counts[4][:10], np.full(10, 5, dtype=np.int64))
    assert np.array_equal(counts[4][10:], np.full(sizes[4] - 10, 4, dtype=np.int64))
    # an empty table is a no-op
    pool.launch_tasks(np.zeros((0, 3), dtype=np.int64))


@pytest.mark.parametrize("nthreads", [2, 3, 4])
def test_dynamic_split(k, nthreads):
    """CpuPool.dynamic: chunks claimed from a shared counter. Every program still runs exactly once, in every task
    of a launch (alternating counters) and across launches (the counters start from 0 again), tasks stay ordered
    by barriers, pairs (2k, 2k + 1) stay on one thread, and switching back restores the static split."""
    with CpuPool(nthreads) as pool:
        pool.dynamic = True
        assert pool.dynamic
        sizes = [0, 1, 5, 2, 100003, 3, 1, 0, 999, 2 * nthreads, 2 * nthreads - 1, 64]
        counts = [np.zeros(max(s, 1), dtype=np.int64) for s in sizes]
        blocks = [args_block(s, c.ctypes.data) for s, c in zip(sizes, counts)]
        tasks = np.array([(k["count"], b.ctypes.data, s) for s, b in zip(sizes, blocks)], dtype=np.int64)
        for _ in range(5):
            pool.launch_tasks(tasks)
        for _ in range(3):
            pool.launch(k["count"], blocks[4].ctypes.data, sizes[4])
        for s, c in zip(sizes, counts):
            want = 8 if s == sizes[4] else 5
            assert np.array_equal(c[:s], np.full(s, want, dtype=np.int64)), s
        # barriers between tasks: each task reads what other threads wrote in the previous one
        rng = np.random.default_rng(nthreads)
        n = 4099
        bufs = [rng.integers(-1000, 1000, size=n, dtype=np.int64) for _ in range(2)]
        expected = bufs[0].copy()
        rows, keep = [], []
        for s in range(9):
            addend = int(rng.integers(-50, 50))
            blk = args_block(n, bufs[s % 2].ctypes.data, bufs[(s + 1) % 2].ctypes.data, addend)
            keep.append(blk)
            rows.append((k["reverse"], blk.ctypes.data, n))
            expected = expected[::-1] * 3 + addend
        pool.launch_tasks(np.array(rows, dtype=np.int64))
        assert np.array_equal(bufs[9 % 2], expected)
        # chunks of an even number of programs from an even start: pairs on one thread
        owner = np.zeros(1000, dtype=np.int64)
        a = args_block(1000, owner.ctypes.data)
        pool.launch(k["owner"], a.ctypes.data, 1000)
        assert (owner[0::2] == owner[1::2]).all()
        # (which threads claim chunks is up to the scheduler: on a loaded host the workers may take them all
        # before the calling thread claims one, so no thread's share is asserted here)
        # back to the static split: thread t runs the t-th contiguous chunk again
        pool.dynamic = False
        pool.launch(k["owner"], a.ctypes.data, 1000)
        chunk = split_ref(1000, nthreads)
        for t in range(nthreads):
            b, e = chunk(t, nthreads)
            assert (owner[b:e] == owner[b]).all()
        assert int(owner[0]) & 0xFFFFFFFFFFFFFFFF == threading.get_ident()
        assert len({int(owner[chunk(t, nthreads)[0]]) for t in range(nthreads)}) == nthreads


def test_split_setting(monkeypatch):
    monkeypatch.setenv("JITKERN_POOL_SPLIT", "dynamic")
    with CpuPool(2) as pool:
        assert pool.dynamic
    monkeypatch.setenv("JITKERN_POOL_SPLIT", "static")
    with CpuPool(2) as pool:
        assert not pool.dynamic
    monkeypatch.setenv("JITKERN_POOL_SPLIT", "guided")
    from jitkern.env import SettingError
    with pytest.raises(SettingError, match="JITKERN_POOL_SPLIT='guided' is not one of static, dynamic"):
        CpuPool(2)


@pytest.mark.parametrize("nthreads", [2, 4])
def test_many_launches_do_not_hang(k, nthreads):
    n = 7
    with CpuPool(nthreads) as pool:
        counts = np.zeros(n, dtype=np.int64)
        a = args_block(n, counts.ctypes.data)
        fn, ap = k["count"], a.ctypes.data
        for _ in range(10_000):
            pool.launch(fn, ap, n)
        assert np.array_equal(counts, np.full(n, 10_000, dtype=np.int64))


def test_workers_sleep_and_wake(k):
    """spin 0 and a tiny spin: workers go to the futex, launches must still wake them."""
    for spin in (0, 50):
        with CpuPool(3, spin_us=spin) as pool:
            n = 1000
            counts = np.zeros(n, dtype=np.int64)
            a = args_block(n, counts.ctypes.data)
            for i in range(200):
                if i % 50 == 0:
                    time.sleep(0.01)  # well past the spin window: everyone sleeps
                pool.launch(k["count"], a.ctypes.data, n)
            assert np.array_equal(counts, np.full(n, 200, dtype=np.int64))


def test_concurrent_launches_from_python_threads(k):
    """Two Python threads share one pool: the native launch lock serialises them."""
    pool = CpuPool(2)
    n, reps, nthreads = 1001, 300, 3
    counts = [np.zeros(n, dtype=np.int64) for _ in range(nthreads)]
    blocks = [args_block(n, c.ctypes.data) for c in counts]
    errors = []

    def worker(i):
        try:
            for _ in range(reps):
                pool.launch(k["count"], blocks[i].ctypes.data, n)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    pool.close()
    assert not errors
    for c in counts:
        assert np.array_equal(c, np.full(n, reps, dtype=np.int64))


def test_gil_is_released_during_launch(k):
    flag = np.zeros(1, dtype=np.int64)
    result = np.zeros(1, dtype=np.int64)
    a = args_block(1, flag.ctypes.data, result.ctypes.data)

    def setter():
        time.sleep(0.05)
        flag[0] = 1

    t = threading.Thread(target=setter)
    with CpuPool(2) as pool:
        t.start()
        pool.launch(k["wait_flag"], a.ctypes.data, 1)
    t.join()
    assert result[0] == 1


def test_close_is_idempotent_and_recreate_works(k):
    for nthreads in (1, 2, 3):
        for _ in range(20):
            p = CpuPool(nthreads)  # never launched: close must not deadlock
            p.close()
            p.close()
            assert p.closed
            with pytest.raises(PoolError, match="closed"):
                p.launch(k["empty"], 0, 5)
            with pytest.raises(PoolError, match="closed"):
                p.launch_tasks(np.array([[k["empty"], 0, 4]], dtype=np.int64))
        p = CpuPool(nthreads)
        n = 333
        out = np.zeros(n, dtype=np.int64)
        a = args_block(n, out.ctypes.data, 5)
        p.launch(k["fill"], a.ctypes.data, n)
        p.close()
        assert np.array_equal(out, fill_ref(n, 5))


def test_dropping_an_open_pool_joins_its_workers():
    # In a fresh process: other tests leave threads (compile workers' readers, engine threads) that come and
    # go on their own and would make a thread count in this process meaningless.
    code = textwrap.dedent("""
        import gc, os, threading
        from jitkern.runtime.cpu_pool import CpuPool
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before, native_before = threading.active_count(), tasks()
        p1 = CpuPool(1)           # one thread: no workers at all, tasks run in the caller
        assert tasks() == native_before, (tasks(), native_before)
        p1.close()
        p = CpuPool(4)
        assert tasks() == native_before + 3, (tasks(), native_before)
        del p
        gc.collect()
        assert tasks() == native_before, (tasks(), native_before)
        assert threading.active_count() == before   # natives never show up as Python threads
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_idle_pool_uses_no_cpu(k):
    """After the spin window the workers sleep on the futex: no CPU while idle."""
    with CpuPool(3, spin_us=1000) as pool:
        n = 3000
        counts = np.zeros(n, dtype=np.int64)
        a = args_block(n, counts.ctypes.data)
        pool.launch(k["count"], a.ctypes.data, n)
        time.sleep(0.05)  # 50x the spin window
        c0 = time.process_time()  # CPU time of all threads of the process
        time.sleep(0.3)
        used = time.process_time() - c0
        assert used < 0.03, f"idle pool burned {used:.3f} s CPU in 0.3 s"
        pool.launch(k["count"], a.ctypes.data, n)  # and still wakes up
        assert np.array_equal(counts, np.full(n, 2, dtype=np.int64))


def test_numpy_integer_arguments_are_accepted(k, pools):
    n = 101
    out = np.zeros(n, dtype=np.int64)
    a = args_block(n, out.ctypes.data, 9)
    pools[2].launch(np.int64(k["fill"]), np.uint64(a.ctypes.data), np.int32(n))
    assert np.array_equal(out, fill_ref(n, 9))
    with pytest.raises(PoolError, match="num_programs must be an integer"):
        pools[2].launch(k["fill"], a.ctypes.data, 2.0)
    with pytest.raises(PoolError, match="args_addr must be an integer"):
        pools[2].launch(k["fill"], "0x1000", 2)
    with pytest.raises(PoolError, match="num_programs=.* does not fit in int64"):
        pools[2].launch(k["fill"], a.ctypes.data, np.uint64(2**63))


def test_bad_inputs_raise_clear_errors(k):
    with CpuPool(2) as pool:
        with pytest.raises(PoolError, match="fn"):
            pool.launch(0, 0, 10)
        bad = np.array([[k["empty"], 0, 3], [0, 0, 3]], dtype=np.int64)
        with pytest.raises(PoolError, match="fn"):
            pool.launch_tasks(bad)
        for wrong in (np.zeros((2, 3), dtype=np.int32), np.zeros((2, 4), dtype=np.int64),
                      np.zeros((3, 2), dtype=np.int64).T, [[1, 2, 3]]):
            with pytest.raises(PoolError, match="int64 array of shape"):
                pool.launch_tasks(wrong)
        # zero or negative grids run nothing and are not errors
        pool.launch(k["empty"], 0, 0)
        pool.launch(k["empty"], 0, -5)
    for wrong in (0, -1, 2.5, "2", True):
        with pytest.raises(PoolError, match="num_threads"):
            CpuPool(wrong)
    with pytest.raises(PoolError, match="spin_us"):
        CpuPool(2, spin_us=-1)


def test_thread_count_defaults(monkeypatch):
    cores = cpu_pool.physical_core_count()
    assert 1 <= cores <= (os.cpu_count() or 1)
    monkeypatch.delenv("JITKERN_NUM_THREADS", raising=False)
    assert cpu_pool.default_num_threads() == cores
    monkeypatch.setenv("JITKERN_NUM_THREADS", "3")
    with CpuPool() as p:
        assert p.num_threads == 3
    monkeypatch.setenv("JITKERN_NUM_THREADS", "lots")
    with pytest.raises(PoolError, match="JITKERN_NUM_THREADS"):
        CpuPool()
    monkeypatch.setenv("JITKERN_NUM_THREADS", "0")
    with pytest.raises(PoolError, match="JITKERN_NUM_THREADS"):
        CpuPool()


def test_physical_cores_match_lscpu():
    try:
        out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True,
                             check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("lscpu not available for the cross-check")
    allowed = os.sched_getaffinity(0)
    cores = set()
    for line in out.splitlines():
        if line and not line.startswith("#"):
            cpu, core, sock = line.split(",")
            if int(cpu) in allowed:
                cores.add((sock, core))
    assert cpu_pool.physical_core_count() == len(cores)


def test_get_pool_is_a_singleton():
    p = get_pool()
    assert get_pool() is p
    assert p.num_threads >= 1
    p.close()
    q = get_pool()
    assert q is not p and not q.closed


def test_fork_child_gets_working_pool(k):
    pool = CpuPool(3)
    n = 5000
    out = np.zeros(n, dtype=np.int64)
    a = args_block(n, out.ctypes.data, 11)
    pool.launch(k["fill"], a.ctypes.data, n)
    pid = os.fork()
    if pid == 0:  # child: workers were re-created after fork
        code = 1
        try:
            out[:] = 0
            pool.launch(k["fill"], a.ctypes.data, n)
            code = 0 if np.array_equal(out, fill_ref(n, 11)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    pool.close()


def test_interpreter_exit_with_open_pools():
    """Open pools (and the singleton) are joined by atexit; the process exits 0."""
    script = textwrap.dedent("""
        import numpy as np
        from jitkern.runtime.cpu_pool import CpuPool, get_pool
        pools = [CpuPool(3), CpuPool(2), get_pool()]
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
