"""`@jk.autotune`: pick a kernel's launch configuration by timing, once per target, device and shape key.

    @jk.autotune(configs=[jk.Config({"BM": 32, "BN": 32}, num_warps=4),
                          jk.Config({"BM": 64, "BN": 64}, num_warps=8, num_stages=3)],
                 key=["M", "N", "K"])
    @jk.kernel
    def matmul(a, b, c, M, N, K, BM: jk.constexpr, BN: jk.constexpr, BK: jk.constexpr = 32): ...

    matmul[lambda meta: (jk.cdiv(M, meta["BM"]), jk.cdiv(N, meta["BN"]))](a, b, c, M, N, K)

Triton's semantics (triton.autotune / triton.Config): a launch whose key (the values of the `key` arguments,
the element types of every array argument and any other constexpr the caller passes) is new compiles each
config through the normal compile path and cache, times it (warm-up, then timed launches: CUDA events on CUDA,
the host clock around device synchronisations elsewhere, the CPU pool's launches returning when done), keeps the
fastest and launches it. A config that fails to compile or to launch is skipped with a logged reason.

Differences from Triton, on purpose: a Config's `num_warps` / `num_stages` / `maxnreg` default to None (the
target's own default, not 4 and 3); results are kept on disk by default (Triton's `cache_results=True`), as one
small JSON per kernel and target beside the kernel cache, so a second process neither compiles nor times; the
disk record is per device (a CPU model and its thread count, a GPU's name), since the fastest config of one
H100 need not be an H200's.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from .args import LAUNCH_OPTIONS, Pointer, _is_device_array, arg_type
from .errors import JitkernError
from .runtime.launch import _token

log = logging.getLogger(__name__)

FORMAT = "jitkern-autotune-v1"
# timed launches per config are capped, so a tiny kernel's tuning stays bounded in time whatever `rep` says
MAX_TIMED = 1000


class AutotuneError(JitkernError):
    """No config of an autotuned kernel could run, or tuning was asked for where it cannot happen."""


class Config:
    """One launch configuration: constexpr values plus launch options (None: the target's default).
    `pre_hook(named_args)` runs before every launch with this config (timed ones included), as in Triton."""

    __slots__ = ("kwargs", "num_warps", "num_stages", "maxnreg", "pre_hook")

    def __init__(self, kwargs=None, num_warps=None, num_stages=None, maxnreg=None, pre_hook=None):
        self.kwargs = dict(kwargs or {})
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.maxnreg = maxnreg
        self.pre_hook = pre_hook

    def all_kwargs(self) -> dict:
        """The keyword arguments this config adds to a launch."""
        out = dict(self.kwargs)
        for opt in ("num_warps", "num_stages", "maxnreg"):
            v = getattr(self, opt)
            if v is not None:
                out[opt] = v
        return out

    def text(self) -> str:
        """A canonical one-line form: identifies the config in the disk records."""
        from .compiler import _constexpr_repr
        parts = [f"{k}={_constexpr_repr(v)}" for k, v in sorted(self.all_kwargs().items())]
        if self.pre_hook is not None:
            parts.append(f"pre_hook={getattr(self.pre_hook, '__qualname__', repr(self.pre_hook))}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"Config({self.text()})"


# ------------------------------------------------------------------------------------------------ timing
def _host_time_calls(call, n, before=None, after=None) -> list:
    """Seconds per call on the host clock: CPU launches return when every program is done."""
    out = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return out


def bench(call, time_calls=_host_time_calls, *, warmup: float = 25, rep: float = 100, before=None,
          after=None) -> float:
    """Median milliseconds of `call` (Triton's do_bench budgets): `warmup` and `rep` are milliseconds of
    launches, the counts estimated from five timed launches after one untimed one (which loads the module);
    `before`/`after` run around every launch outside the timed span (resetting or restoring outputs)."""
    if before is not None:
        before()
    call()
    if after is not None:
        after()
    est = max(statistics.median(time_calls(call, 5, before, after)), 1e-9)
    n_warm = min(MAX_TIMED, max(1, int(warmup / 1e3 / est)))
    n_rep = min(MAX_TIMED, max(1, int(rep / 1e3 / est)))
    time_calls(call, n_warm, before, after)
    return statistics.median(time_calls(call, n_rep, before, after)) * 1e3


def _device_of(target, args):
    """The GPU device a launch runs on: its first device array's, else the target's runtime's default."""
    for a in args:
        if _is_device_array(a):
            return a.device
    from .backends import backend_of
    return backend_of(target).runtime().get_device()


# ------------------------------------------------------------------------------------------ disk records
def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"tmp.{os.getpid()}.{uuid.uuid4().hex}.json"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_records(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError("not a tuning record")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("autotune: unreadable tuning record %s (%s); it will be rewritten", path, e)
        return {}


# --------------------------------------------------------------------------------------------- autotuner
class Autotuner:
    """A kernel with a list of Configs: `tuned[grid](*args, **kwargs)` launches the best config for the key."""

    def __init__(self, kernel, configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None,
                 warmup: float = 25, rep: float = 100, do_bench=None, cache_results: bool = True):
        from .jit import Kernel
        if not isinstance(kernel, Kernel):
            kernel = Kernel(kernel)
        self.kernel = kernel
        self.__name__ = kernel.__name__
        self.__doc__ = kernel.__doc__
        self.configs = list(configs) or [Config({})]
        self.key = list(key)
        names = [p.name for p in kernel.params]
        self.arg_names = names
        self._defaults = {p.name: p.default for p in kernel.params if p.default is not p.empty}
        self.reset_to_zero = list(reset_to_zero or ())
        self.restore_value = list(restore_value or ())
        for what, given in (("key", self.key), ("reset_to_zero", self.reset_to_zero),
                            ("restore_value", self.restore_value)):
            unknown = [n for n in given if n not in names]
            if unknown:
                raise ValueError(f"autotune of {kernel.__name__}: {what} names no parameter: {unknown}")
        tunable = kernel.constexpr_names | set(LAUNCH_OPTIONS)
        self._tuned_names = set()
        for c in self.configs:
            bad = [k for k in c.kwargs if k not in tunable]
            if bad:
                raise ValueError(f"autotune of {kernel.__name__}: {c} sets {bad}, which are neither constexpr "
                                 f"parameters nor launch options ({', '.join(LAUNCH_OPTIONS)})")
            self._tuned_names |= set(c.all_kwargs())
        prune = prune_configs_by or {}
        self.perf_model = prune.get("perf_model")
        self.top_k = prune.get("top_k", 1.0)
        self.early_config_prune = prune.get("early_config_prune")
        self.warmup, self.rep = warmup, rep
        self.do_bench = do_bench
        self.cache_results = cache_results
        self.cache: dict = {}               # (target name, key) -> Config
        self.best_config = None
        self.configs_timings: dict = {}     # Config -> ms (inf: skipped) of the last tuning
        self.skipped: dict = {}             # Config -> reason, of the last tuning
        self.tunings = 0                    # keys timed in this process (not those read from disk)
        self.benchmarks = 0                 # configs timed in this process
        self._fast: dict = {}               # (target, key values, argument tokens, kwargs) -> (Config, its kwargs)
        self._key_pos = [(n, names.index(n)) for n in self.key]
        self._lock = threading.RLock()

    def __getitem__(self, grid):
        return _TunedLauncher(self, grid)

    def compile(self, *args, target=None, **kwargs) -> list:
        """Compiles every config (after pruning) for these arguments without running or timing anything, and
        returns the CompiledKernels: what `jitkern build` does for an autotuned launch."""
        from .runtime.launch import compile_only
        if isinstance(target, str):
            from targets import get_target
            target = get_target(target)
        with compile_only(target) as co:
            self.run(None, args, kwargs)
        return co.compiled

    def __call__(self, *args, **kwargs):
        raise JitkernError(f"{self.__name__} is an autotuned kernel: launch it with kernel[grid](...)")

    # ------------------------------------------------------------------------------------------ keys
    def _named(self, args, kwargs) -> dict:
        named = dict(self._defaults)
        named.update(zip(self.arg_names, args))
        named.update(kwargs)
        return named

    def _key(self, named: dict) -> tuple:
        """What a tuning is valid for: the key arguments' values, every array argument's element type, and the
        other constexprs passed (another ACTIVATION may want another config)."""
        from .compiler import _constexpr_repr
        cx = self.kernel.constexpr_names
        parts = []
        for name in self.key:
            v = named.get(name)
            if isinstance(v, np.ndarray) or _is_device_array(v):
                v = f"{tuple(v.shape)}:{arg_type(name, v)}"
            elif isinstance(v, np.generic):
                v = v.item()            # np.int64(33) is the key of 33
            parts.append(f"{name}={v!r}" if not isinstance(v, str) else f"{name}={v}")
        for name in self.arg_names:
            if name not in named or name in self.key:
                continue
            v = named[name]
            if isinstance(v, (np.ndarray, Pointer)) or _is_device_array(v):
                parts.append(f"{name}:{arg_type(name, v)}")
            elif name in cx and name not in self._tuned_names:
                parts.append(f"{name}={_constexpr_repr(v)}")
        return tuple(parts)

    def _device_name(self, target, args) -> str:
        if not getattr(target, "is_gpu", False):
            import llvmlite.binding as llvm
            from .runtime.cpu_pool import get_pool
            return f"{llvm.get_host_cpu_name()} x{get_pool().num_threads}"
        dev = _device_of(target, args)
        return str(getattr(dev, "name", None) or getattr(dev, "kind", "gpu"))

    def record_path(self, target) -> Path:
        """This kernel's tuning records for `target`: `<kernel cache>/v1/<device tag>/autotune/<name>-<hash>.json`,
        the hash over the compiler's sources, the kernel's source, the target and the config list (a change to
        any of them starts a new record, as the kernel cache does)."""
        from .backends import backend_of
        from .cache import compiler_source_hash, hash_key
        from .compiler import _toolchain_key, kernel_cache
        backend = backend_of(target)
        h = hash_key(FORMAT, compiler_source_hash(python=backend.python_in_key), self.kernel.__qualname__,
                     self.kernel.cache_key, target.key(), _toolchain_key(target), [c.text() for c in self.configs])
        return kernel_cache().path / "v1" / target.device_tag / "autotune" / f"{self.kernel.__name__}-{h[:16]}.json"

    def _load_record(self, path: Path, entry: str):
        rec = _read_records(path).get("entries", {}).get(entry)
        if not isinstance(rec, dict):
            return None
        best = rec.get("best")
        if isinstance(best, int) and 0 <= best < len(self.configs) and self.configs[best].text() == rec.get("config"):
            return self.configs[best]
        return None

    def _save_record(self, path: Path, entry: str, target, device: str, key: tuple, best: Config,
                     timings: dict, skipped: dict) -> None:
        try:
            data = _read_records(path) or {"format": FORMAT, "kernel": self.kernel.__qualname__,
                                           "target": target.name, "configs": [c.text() for c in self.configs],
                                           "entries": {}}
            ms = [timings.get(c) for c in self.configs]
            data["entries"][entry] = {
                "device": device, "key": list(key), "best": self.configs.index(best), "config": best.text(),
                "timings_ms": [None if t is None or t == float("inf") else round(t, 6) for t in ms],
                "skipped": {str(self.configs.index(c)): r for c, r in skipped.items()},
                "created": time.time()}
            # read-merge-replace: records of other keys made meanwhile by another process survive unless it
            # writes between our read and our rename (then one key is timed again later, nothing worse)
            _atomic_write(path, json.dumps(data, indent=1, sort_keys=True))
        except OSError as e:
            log.warning("autotune: cannot write tuning record %s (%s); this process keeps its choice", path, e)

    # --------------------------------------------------------------------------------------- pruning
    def prune_configs(self, named: dict, kwargs: dict) -> list:
        configs = self.configs
        if self.early_config_prune is not None:
            configs = list(self.early_config_prune(configs, named, **kwargs))
            if not configs:
                raise AutotuneError(f"autotune of {self.__name__}: early_config_prune returned no config")
        if self.perf_model is not None:
            k = self.top_k
            if isinstance(k, float) and k <= 1.0:
                k = max(1, int(len(configs) * k))
            elif not isinstance(k, int):
                raise TypeError("autotune prune_configs_by top_k must be an int or a float <= 1.0")
            if len(configs) > k:
                est = {id(c): self.perf_model(**named, **c.all_kwargs()) for c in configs}
                configs = sorted(configs, key=lambda c: est[id(c)])[:k]
        return configs

    # ---------------------------------------------------------------------------------------- launch
    def run(self, grid, args, kwargs, target=None):
        from .runtime import launch as L
        if isinstance(target, str):
            from targets import get_target
            target = get_target(target)
        cap = L._capture
        if target is None and not getattr(cap, "dry", False) and getattr(cap, "compile_only", None) is None:
            target = L._device_target(args)
        # the hot path: a launch whose argument tokens were seen before costs one dict lookup more than a plain
        # launch (the key's text is only built on a miss)
        try:
            fkey = (target, tuple([args[i] if i < len(args) else kwargs.get(n, self._defaults.get(n))
                                   for n, i in self._key_pos]),
                    tuple([a if i in self.kernel._cx_positions else _token(a) for i, a in enumerate(args)]),
                    tuple(kwargs.items()) if kwargs else ())
            hit = self._fast.get(fkey)
        except TypeError:           # an unhashable argument (an array named in `key`)
            fkey = hit = None
        if hit is not None and not getattr(cap, "dry", False) and getattr(cap, "compile_only", None) is None:
            cfg, kw = hit
            self.best_config = cfg
            if cfg.pre_hook is not None:
                cfg.pre_hook({**self._named(args, kwargs), **kw})
            return L.launch(self.kernel, grid, args, {**kwargs, **kw}, target)
        if L.launches_are_dry():
            return None
        clash = self._tuned_names & set(kwargs)
        if clash:
            raise ValueError(f"{self.__name__}: {sorted(clash)} are set by the autotune configs; do not pass them")
        co = getattr(cap, "compile_only", None)
        if co is not None:
            return self._compile_all(co, grid, args, kwargs, L._compile_only_target(co, target, args))
        named = self._named(args, kwargs)
        key = self._key(named)
        mkey = (getattr(target, "name", None), key)
        cfg = self.cache.get(mkey)
        if cfg is None:
            with self._lock:
                cfg = self.cache.get(mkey)
                if cfg is None:
                    cfg = self._tune(grid, args, kwargs, target, named, key)
                    self.cache[mkey] = cfg
        self.best_config = cfg
        if fkey is not None:
            self._fast[fkey] = (cfg, cfg.all_kwargs())
        kw = {**kwargs, **cfg.all_kwargs()}
        if cfg.pre_hook is not None:
            cfg.pre_hook({**named, **kw})
        return L.launch(self.kernel, grid, args, kw, target)

    def _tune(self, grid, args, kwargs, target, named, key) -> Config:
        from .compiler import default_target
        from .runtime import launch as L
        tgt = target if target is not None else default_target()
        if len(self.configs) == 1:
            return self.configs[0]
        device = self._device_name(tgt, args)
        entry = f"{device} | {'; '.join(key)}"
        path = self.record_path(tgt) if self.cache_results else None
        if path is not None:
            cfg = self._load_record(path, entry)
            if cfg is not None:
                log.info("autotune %s: %s for %s from %s", self.__name__, cfg, entry, path)
                return cfg
        configs = self.prune_configs(named, kwargs)
        if len(configs) == 1:
            return configs[0]
        if getattr(L._capture, "graph", None) is not None:
            raise AutotuneError(f"{self.__name__} has no tuned config for {entry} on {tgt.name} and cannot time "
                                f"configs inside jk.capture(): launch it once with these arguments before capturing")
        before, after, finish = self._hooks(named)
        timings, skipped = {}, {}
        t0 = time.perf_counter()
        try:
            for c in configs:
                timings[c] = self._bench(c, grid, args, kwargs, target, tgt, named, before, after, skipped)
        finally:
            finish()
        ok = {c: t for c, t in timings.items() if t != float("inf")}
        self.configs_timings, self.skipped = timings, skipped
        if not ok:
            reasons = "; ".join(f"{c}: {r}" for c, r in skipped.items())
            raise AutotuneError(f"no config of {self.__name__} ran on {tgt.name} for {entry}: {reasons}")
        best = min(ok, key=ok.get)
        self.tunings += 1
        log.info("autotune %s: %s for %s (%.3f ms; %d configs timed in %.2f s)", self.__name__, best, entry,
                 ok[best], len(timings), time.perf_counter() - t0)
        if path is not None:
            self._save_record(path, entry, tgt, device, key, best, timings, skipped)
        return best

    def _bench(self, c, grid, args, kwargs, target, tgt, named, before, after, skipped) -> float:
        from .compiler import compile_kernel
        from .runtime import launch as L
        kw = {**kwargs, **c.all_kwargs()}
        try:
            # compiled (or fetched from the cache) here, so a config that cannot compile is told apart from one
            # that cannot launch, and compile time stays out of the timing
            params, consts, _ = self.kernel.specialize(args, kw, tgt)
            compile_kernel(self.kernel, params, consts, tgt)
        except Exception as e:      # noqa: BLE001 - any compile failure skips the config (all failing raises)
            skipped[c] = f"does not compile: {_one_line(e)}"
            log.warning("autotune %s: %s skipped, %s", self.__name__, c, skipped[c])
            return float("inf")
        pre = c.pre_hook
        full = {**named, **kw}

        def call():
            if pre is not None:
                pre(full)
            L.launch(self.kernel, grid, args, kw, target)

        self.benchmarks += 1
        try:
            if self.do_bench is not None:
                # a caller's benchmark (Triton's do_bench hook): it gets the launch, resets included
                def whole():
                    before()
                    call()
                    after()
                return float(self.do_bench(whole))
            time_calls = _host_time_calls if not tgt.is_gpu else _device_of(tgt, args).time_calls
            return bench(call, time_calls, warmup=self.warmup, rep=self.rep, before=before, after=after)
        except Exception as e:      # noqa: BLE001 - a launch failure skips the config, as a compile failure does
            skipped[c] = f"fails to launch: {_one_line(e)}"
            log.warning("autotune %s: %s skipped, %s", self.__name__, c, skipped[c])
            return float("inf")

    def _hooks(self, named):
        """(before each timed launch, after it, at the end of tuning): reset_to_zero zeroes its arguments before
        every launch (and once more at the end, for the real launch); restore_value puts its arguments back to
        what they held when tuning began after every launch."""
        for n in self.reset_to_zero:
            _check_array(n, named.get(n), "reset_to_zero")
        zero = [named[n] for n in self.reset_to_zero if named.get(n) is not None]
        keep = [(named[n], _snapshot(n, named[n])) for n in self.restore_value if named.get(n) is not None]

        def before():
            for a in zero:
                _zero(a)

        def after():
            for a, snap in keep:
                _restore(a, snap)

        def finish():
            after()
            before()

        return before, after, finish

    def _compile_all(self, co, grid, args, kwargs, target):
        """Under compile-only launches (`jitkern build`): compile every config (after pruning) so the run on the
        device compiles nothing and only times; a config that fails is left out, as tuning would skip it."""
        from .runtime import launch as L
        named = self._named(args, kwargs)
        configs = self.prune_configs(named, kwargs)
        done, errors = [], []
        for c in configs:
            try:
                done.append(L._compile_only_launch(co, self.kernel, args, {**kwargs, **c.all_kwargs()}, target,
                                                   record_errors=False))
            except Exception as e:  # noqa: BLE001
                errors.append((c, e))
                log.info("autotune %s: %s does not compile for %s: %s", self.__name__, c,
                         getattr(target, "name", target), _one_line(e))
        if not done:
            c, e = errors[-1]
            co.errors.append((self.kernel.__name__, e))
            raise e
        return done[0]


class _TunedLauncher:
    __slots__ = ("tuner", "grid")

    def __init__(self, tuner, grid):
        self.tuner = tuner
        self.grid = grid

    def __call__(self, *args, **kwargs):
        return self.tuner.run(self.grid, args, kwargs)


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _check_array(name, v, what) -> None:
    if v is not None and not (isinstance(v, np.ndarray) or _is_device_array(v)):
        raise AutotuneError(f"autotune {what}: argument '{name}' is a {type(v).__name__}; only numpy and device "
                            f"arrays can be reset or restored")


def _zero(a) -> None:
    if isinstance(a, np.ndarray):
        a[...] = 0
    else:
        a.fill_zero()


def _snapshot(name, a):
    _check_array(name, a, "restore_value")
    return a.copy() if isinstance(a, np.ndarray) else a.numpy()


def _restore(a, snap) -> None:
    if isinstance(a, np.ndarray):
        np.copyto(a, snap)
    else:
        a.copy_from_numpy(snap)


def autotune(configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None, warmup: float = 25,
             rep: float = 100, do_bench=None, cache_results: bool = True):
    """Decorator over a `@jk.kernel` (Triton's `triton.autotune`): see this module's docstring.

    configs: the Configs to choose from. key: argument names whose values start a new tuning.
    prune_configs_by: {"early_config_prune": f(configs, named_args, **kwargs) -> configs, "perf_model":
    f(**named_args, **config_kwargs) -> estimated time, "top_k": how many of the best estimates to time (an int,
    or a fraction <= 1.0)}. reset_to_zero / restore_value: array arguments zeroed before each timed launch /
    put back after it. warmup / rep: milliseconds of warm-up and of timed launches per config. do_bench:
    f(launch) -> ms, replacing the timer. cache_results: keep the choices on disk beside the kernel cache."""
    def decorate(kernel):
        return Autotuner(kernel, configs, key, prune_configs_by, reset_to_zero, restore_value, warmup, rep,
                         do_bench, cache_results)
    return decorate
