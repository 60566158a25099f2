"""`@jk.autotune` (jitkern/autotune.py) on the CPU tiers: every config gives numpy's numbers, the choice is kept
per key in memory and on disk (per target), a new key tunes again, failing configs are skipped, reset_to_zero /
restore_value keep outputs right, and compile-only launches (`jitkern build`) compile every config.

Timings are counted through the `do_bench` hook (a scripted timer), not measured, so the choice is known."""
import logging

import numpy as np
import pytest

import jitkern as jk
from jitkern.compiler import kernel_cache
from jitkern.runtime.cpu import runtime_target
from jitkern.runtime.launch import compile_only
from targets import get_target


@jk.kernel
def _mm(a, b, c, M, N, K, BM: jk.constexpr, BN: jk.constexpr, BK: jk.constexpr):
    jk.static_assert(BK <= 16, "BK wider than this kernel allows")
    rm = jk.program_id(0) * BM + jk.arange(0, BM)
    rn = jk.program_id(1) * BN + jk.arange(0, BN)
    rk = jk.arange(0, BK)
    acc = jk.zeros((BM, BN), jk.f32)
    for k in range(0, K, BK):
        x = jk.load(a + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K),
                    other=0.0)
        y = jk.load(b + (k + rk)[:, None] * N + rn[None, :], mask=((k + rk)[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc = jk.dot(x, y, acc)
    jk.store(c + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


CONFIGS = [jk.Config({"BM": 16, "BN": 16, "BK": 16}),
           jk.Config({"BM": 32, "BN": 16, "BK": 8}, num_warps=4),
           jk.Config({"BM": 16, "BN": 32, "BK": 16}, num_warps=8, num_stages=2)]
BAD = jk.Config({"BM": 16, "BN": 16, "BK": 32})        # fails the kernel's static_assert


def _grid(M, N):
    return lambda meta: (jk.cdiv(M, meta["BM"]), jk.cdiv(N, meta["BN"]))


class ScriptedBench:
    """A do_bench that runs each launch once and answers scripted milliseconds, counting the calls."""

    def __init__(self, times):
        self.times = list(times)
        self.calls = 0

    def __call__(self, launch):
        launch()
        t = self.times[self.calls % len(self.times)]
        self.calls += 1
        return t


@pytest.fixture
def records(tmp_path, monkeypatch):
    """Tuning records go to a private folder (laid out as under the kernel cache) while kernels stay cached."""
    real = jk.Autotuner.record_path

    def private(self, target):
        return tmp_path / real(self, target).relative_to(kernel_cache().path)
    monkeypatch.setattr(jk.Autotuner, "record_path", private)
    return tmp_path


def _tuned(configs=CONFIGS, times=(3.0, 1.0, 2.0), **kw):
    bench = ScriptedBench(times)
    return jk.autotune(configs=configs, key=["M", "N", "K"], do_bench=bench, **kw)(_mm), bench


def _inputs(rng, M, N, K):
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    return a, b, np.full((M, N), np.nan, np.float32)


def _check(tuned, rng, M, N, K, target=None):
    a, b, c = _inputs(rng, M, N, K)
    tuned.run(_grid(M, N), (a, b, c, M, N, K), {}, target)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_every_config_matches_numpy_and_the_fastest_is_launched(records):
    rng = np.random.default_rng(0)
    for i, cfg in enumerate(CONFIGS):
        times = [5.0] * len(CONFIGS)
        times[i] = 1.0                   # config i is the fastest this time
        tuned, bench = _tuned(times=times, cache_results=False)
        _check(tuned, rng, 37, 45, 29)
        assert tuned.best_config is cfg and bench.calls == len(CONFIGS)
        # the tuning launches ran too: config i again, on fresh inputs, now without timing
        _check(tuned, rng, 37, 45, 29)
        assert bench.calls == len(CONFIGS)


def test_a_key_is_timed_once_and_a_new_key_tunes_again(records):
    rng = np.random.default_rng(1)
    tuned, bench = _tuned()
    _check(tuned, rng, 40, 24, 33)
    assert bench.calls == 3 and tuned.tunings == 1 and tuned.best_config is CONFIGS[1]
    _check(tuned, rng, 40, 24, 33)
    assert bench.calls == 3 and tuned.tunings == 1          # same key: nothing timed
    a, b, c = _inputs(rng, 40, 24, 33)
    tuned[_grid(40, 24)](a, b, c, np.int64(40), 24, 33)
    assert bench.calls == 3                                   # a numpy integer is the same key
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    _check(tuned, rng, 41, 24, 33)
    assert bench.calls == 6 and tuned.tunings == 2          # M is part of the key
    with pytest.raises(ValueError, match="set by the autotune configs"):
        tuned[_grid(8, 8)](*_inputs(rng, 8, 8, 8), 8, 8, 8, BM=16)


def test_disk_records_serve_a_fresh_autotuner_per_target(records):
    rng = np.random.default_rng(2)
    here, other = runtime_target(), get_target("sse2")
    first, bench = _tuned()
    _check(first, rng, 33, 20, 17)
    path = first.record_path(here)
    assert path.is_file() and path.parent.name == "autotune" and path.parent.parent.name == here.device_tag
    import json
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    assert data["format"] == "jitkern-autotune-v1" and data["target"] == here.name
    assert entry["best"] == 1 and entry["config"] == CONFIGS[1].text() and entry["timings_ms"] == [3.0, 1.0, 2.0]
    assert "M=33" in entry["key"]

    # a second process: a fresh autotuner over the same kernel and configs reads the record, timing nothing
    second, bench2 = _tuned(times=(1.0, 9.0, 9.0))
    _check(second, rng, 33, 20, 17)
    assert bench2.calls == 0 and second.best_config is CONFIGS[1]

    # another target has its own record: tuned there (its scripted choice differs), leaving this one alone
    _check(second, rng, 33, 20, 17, target=other)
    assert bench2.calls == 3 and second.best_config is CONFIGS[0]
    assert second.record_path(other) != path and second.record_path(other).is_file()
    third, bench3 = _tuned(times=(9.0,))
    _check(third, rng, 33, 20, 17, target=other)
    _check(third, rng, 33, 20, 17)
    assert bench3.calls == 0 and third.best_config is CONFIGS[1]


def test_record_lives_beside_the_kernel_cache():
    tuned, _ = _tuned()
    t = runtime_target()
    p = tuned.record_path(t)
    assert p.relative_to(kernel_cache().path).parts[:3] == ("v1", t.device_tag, "autotune")
    assert p.name.startswith("_mm-") and p.suffix == ".json"
    # another config list is another record (an index into a changed list would be a wrong choice)
    assert _tuned(configs=CONFIGS[:2])[0].record_path(t) != p


def test_a_config_that_does_not_compile_is_skipped(records, caplog):
    rng = np.random.default_rng(3)
    tuned, bench = _tuned(configs=[BAD] + CONFIGS[:2], times=(2.0, 1.0))
    with caplog.at_level(logging.WARNING, logger="jitkern.autotune"):
        _check(tuned, rng, 25, 19, 30)
    assert bench.calls == 2 and tuned.best_config is CONFIGS[1]
    assert "does not compile" in tuned.skipped[BAD] and "static_assert" in tuned.skipped[BAD]
    assert any("skipped" in r.getMessage() for r in caplog.records)
    assert tuned.configs_timings[BAD] == float("inf")
    only_bad, _ = _tuned(configs=[BAD, jk.Config({"BM": 16, "BN": 16, "BK": 64})])
    with pytest.raises(jk.AutotuneError, match="no config of _mm ran"):
        _check(only_bad, rng, 25, 19, 30)


def test_the_real_timer_and_pruning(records):
    rng = np.random.default_rng(4)
    seen = []

    def early(configs, named, **kw):
        seen.append(named["M"])
        return configs[:2]

    tuned = jk.autotune(configs=CONFIGS, key=["M"], warmup=0.5, rep=1.0,
                        prune_configs_by={"early_config_prune": early, "perf_model": lambda **kw: kw["BM"],
                                          "top_k": 1})(_mm)
    _check(tuned, rng, 30, 30, 30)
    # pruned to the first two, then to the one the model ranks first (smallest BM): nothing left to time
    assert seen == [30] and tuned.best_config is CONFIGS[0] and tuned.benchmarks == 0
    timed = jk.autotune(configs=CONFIGS[:2], key=["M"], warmup=0.5, rep=1.0)(_mm)
    _check(timed, rng, 30, 30, 30)
    assert timed.benchmarks == 2 and all(0 < t < 1e3 for t in timed.configs_timings.values())


@jk.kernel
def _accumulate(x, out, n, BLOCK: jk.constexpr):
    o = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = o < n
    jk.store(out + o, jk.load(out + o, mask=m) + jk.load(x + o, mask=m), mask=m)


@jk.kernel
def _double(x, n, BLOCK: jk.constexpr):
    o = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = o < n
    jk.store(x + o, jk.load(x + o, mask=m) * 2.0, mask=m)


def test_reset_to_zero_and_restore_value(records):
    rng = np.random.default_rng(5)
    n = 100
    cfgs = [jk.Config({"BLOCK": 16}), jk.Config({"BLOCK": 64})]
    grid = lambda meta: (jk.cdiv(n, meta["BLOCK"]),)     # noqa: E731
    acc = jk.autotune(configs=cfgs, key=["n"], reset_to_zero=["out"], do_bench=ScriptedBench([2.0, 1.0]))(_accumulate)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(n, np.float32)
    acc[grid](x, out, n)
    np.testing.assert_array_equal(out, x)                  # the timed launches' sums were reset before this one
    dbl = jk.autotune(configs=cfgs, key=["n"], restore_value=["x"], warmup=0.2, rep=0.5)(_double)
    x0 = rng.standard_normal(n).astype(np.float32)
    x = x0.copy()
    dbl[grid](x, n)
    np.testing.assert_array_equal(x, x0 * 2)               # every timed launch was undone
    assert dbl.benchmarks == 2


def test_capture_needs_a_tuned_key(records):
    rng = np.random.default_rng(6)
    tuned, bench = _tuned()
    a, b, c = _inputs(rng, 20, 20, 20)
    with jk.capture():
        with pytest.raises(jk.AutotuneError, match="inside jk.capture"):
            tuned[_grid(20, 20)](a, b, c, 20, 20, 20)
    tuned[_grid(20, 20)](a, b, c, 20, 20, 20)
    with jk.capture() as g:
        tuned[_grid(20, 20)](a, b, c, 20, 20, 20)
    c[...] = np.nan
    g.replay()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_compile_only_launches_compile_every_config(records):
    """What `jitkern build` does with an autotuned launch: every config that compiles goes into the cache, a
    failing one is no build error, nothing runs and nothing is timed."""
    rng = np.random.default_rng(7)
    tuned, bench = _tuned(configs=CONFIGS[:2] + [BAD])
    a, b, c = _inputs(rng, 18, 18, 18)
    target = get_target("sse2")
    with compile_only(target) as co:
        tuned[_grid(18, 18)](a, b, c, 18, 18, 18)
    assert not co.errors and bench.calls == 0 and np.isnan(c).all()
    got = {(ck.constexprs["BM"], ck.constexprs["BN"], ck.constexprs["BK"]) for ck in co.compiled}
    assert got == {(16, 16, 16), (32, 16, 8)} and all(ck.target is target for ck in co.compiled)
    cks = tuned.compile(a, b, c, 18, 18, 18, target="sse2")     # the same, from Python
    assert sorted(ck.constexprs["BM"] for ck in cks) == [16, 32] and bench.calls == 0
    only_bad, _ = _tuned(configs=[BAD])
    with compile_only(target) as co, pytest.raises(jk.CompilationError):
        only_bad[_grid(18, 18)](a, b, c, 18, 18, 18)
    assert len(co.errors) == 1


def test_device_arrays_on_the_fake_device(records, monkeypatch):
    """Device arrays (host memory standing in for a GPU): reset_to_zero / restore_value act on device memory,
    and the device's timer (host clock around synchronisations, Device.time_calls) gives positive times."""
    from tests.fake_cuda import install
    dev = install(monkeypatch)
    from jitkern.runtime.cuda import DeviceArray
    rng = np.random.default_rng(8)
    n = 70
    cfgs = [jk.Config({"BLOCK": 16}), jk.Config({"BLOCK": 32})]
    grid = lambda meta: (jk.cdiv(n, meta["BLOCK"]),)     # noqa: E731
    x = rng.standard_normal(n).astype(np.float32)
    out = DeviceArray.from_numpy(np.full(n, 5.0, np.float32))
    acc = jk.autotune(configs=cfgs, key=["n"], reset_to_zero=["out"], do_bench=ScriptedBench([1.0, 2.0]))(_accumulate)
    acc[grid](DeviceArray.from_numpy(x), out, n)
    np.testing.assert_array_equal(out.numpy(), x)
    x0 = rng.standard_normal(n).astype(np.float32)
    d = DeviceArray.from_numpy(x0)
    dbl = jk.autotune(configs=cfgs, key=["n"], restore_value=["x"], warmup=0.2, rep=0.5)(_double)
    dbl[grid](d, n)
    np.testing.assert_array_equal(d.numpy(), x0 * 2)
    times = dev.time_calls(lambda: dbl[grid](d, n), 3)
    assert len(times) == 3 and all(t > 0 for t in times)
