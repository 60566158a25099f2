"""Every JITKERN_* environment setting of the compiler and runtime, parsed and checked in one place.

The modules that use a setting with a value to check call the reader here (the thread pool, the compile
workers, the kernel cache), so a bad value gives the same message wherever it is met; on/off flags and free
text (ALWAYS_COMPILE, LOAD_STATS, the hash seed, the CPU mask) are read where they are used and cannot be
wrong. The command-line tools call ``check_environment()`` first, before any model load or compile, and print
that message as one line with exit status 2. The server's CLI can do the same before starting gunicorn.

Settings (all optional):

    JITKERN_CPU_TIER            CPU tier kernels run on (``jitkern targets`` lists them); default: the best this
                                host can run. A tier the host cannot run is an error (fail closed).
    JITKERN_CPU_MASK_FEATURES   comma-separated LLVM feature names to treat as absent (testing lower tiers).
    JITKERN_NUM_THREADS         kernel launch threads, an integer >= 1; default: the physical cores.
    JITKERN_SPIN_US             microseconds idle pool workers spin before sleeping, an integer >= 0.
    JITKERN_POLLS_PER_YIELD     pool worker polls between yields, an integer >= 1.
    JITKERN_CACHE_DIR           kernel cache directory (must be a writable directory or creatable);
                                default: $XDG_CACHE_HOME/jitkern or ~/.cache/jitkern.
    JITKERN_COMPILE_WORKERS     compile worker processes, an integer >= 1 (default 1).
    JITKERN_COMPILE_TIMEOUT     seconds one compile may take in a worker, a number > 0.
    JITKERN_COMPILE_INPROCESS   1: compile in this process (no crash isolation).
    JITKERN_ALWAYS_COMPILE      1: ignore the kernel cache when looking kernels up (still writes it).
    JITKERN_LOAD_STATS          1: print model-load byte counts.
    JITKERN_GPU_PROFILE         1: time every GPU launch outside graph capture (synchronising around it) and
                                print device ms per kernel at exit (jitkern/runtime/gpu_profile.py).
    JITKERN_PREFIX_CACHING_HASH_SEED   seed of the prefix-cache block hashes (any text).
    JITKERN_POOL_SPLIT          static or dynamic: how the CPU pool deals a launch's programs to its threads
                                (contiguous chunks, or chunks claimed from a shared counter).
    JITKERN_PTXAS               the ptxas to assemble CUDA kernels with (default: the nvidia-cuda-nvcc wheel's,
                                $CUDA_HOME's or PATH's); JITKERN_NO_PTXAS=1: cache PTX only (the driver JITs it).
    JITKERN_LLD                 the ld.lld that links AMD code objects (default: the ziglang wheel's, or PATH's).
    JITKERN_SPIRV_VAL           the spirv-val that checks Vulkan kernels (default: PATH's; none: no check).
    JITKERN_VULKAN_DEVICE       a substring of the Vulkan device's name to run on (default: the first).
    JITKERN_VULKAN_TIMEOUT      seconds a Vulkan submission may take before the device is given up, a number > 0
                                (default 120; 600 on a CPU implementation).
    JITKERN_VULKAN_DUMP         a directory each Vulkan kernel's SPIR-V is written to as it loads (debugging).

The engine's settings (overlapped output, speculative drafting, CUDA graph sizes) are parsed by
engine/settings.py, the server's own (JITKERN_MODEL, JITKERN_PORT, ...) by server/settings.py. Code-generation
choices (tiles, staging, pipelining) are not settings: they are each target's tuning table, targets/tuning.py.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional

from .errors import JitkernError

SETTINGS = ("JITKERN_CPU_TIER", "JITKERN_CPU_MASK_FEATURES", "JITKERN_NUM_THREADS", "JITKERN_SPIN_US",
            "JITKERN_POLLS_PER_YIELD", "JITKERN_CACHE_DIR", "JITKERN_COMPILE_WORKERS", "JITKERN_COMPILE_TIMEOUT",
            "JITKERN_COMPILE_INPROCESS", "JITKERN_ALWAYS_COMPILE", "JITKERN_LOAD_STATS",
            "JITKERN_PREFIX_CACHING_HASH_SEED", "JITKERN_GPU_PROFILE", "JITKERN_POOL_SPLIT", "JITKERN_PTXAS",
            "JITKERN_NO_PTXAS", "JITKERN_LLD", "JITKERN_SPIRV_VAL", "JITKERN_VULKAN_DEVICE", "JITKERN_VULKAN_TIMEOUT",
            "JITKERN_VULKAN_DUMP")


class SettingError(JitkernError, ValueError):
    """An environment setting has a value jitkern cannot use. ``name`` is the variable; the message says
    what is wrong and how to fix it, on one line."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _raw(name: str, environ=None) -> Optional[str]:
    raw = _environ(environ).get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def env_int(name: str, minimum: int = 1, environ=None) -> Optional[int]:
    """The integer value of `name`, or None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(name, f"{name}={raw!r} is not an integer; set it to a whole number >= {minimum} "
                                 f"or unset it") from None
    if value < minimum:
        raise SettingError(name, f"{name}={raw!r} must be >= {minimum}; set it to a whole number >= {minimum} "
                                 f"or unset it")
    return value


def env_seconds(name: str, environ=None) -> Optional[float]:
    """A positive number of seconds, or None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise SettingError(name, f"{name}={raw!r} is not a number of seconds > 0; set it to e.g. 60 or unset it")
    return value


def env_choice(name: str, choices: tuple, environ=None) -> Optional[str]:
    """The value of `name` if it is one of `choices`, None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None or raw in choices:
        return raw
    raise SettingError(name, f"{name}={raw!r} is not one of {', '.join(choices)}; set it to one of them or unset it")


def pool_split(default: str, environ=None) -> str:
    return env_choice("JITKERN_POOL_SPLIT", ("static", "dynamic"), environ) or default


def env_flag(name: str, environ=None) -> bool:
    """True unless unset, empty or "0"."""
    return (_raw(name, environ) or "0") != "0"


# --------------------------------------------------------------------------------------------- readers
def num_threads(environ=None) -> Optional[int]:
    """JITKERN_NUM_THREADS, or None (then the pool uses the physical core count)."""
    return env_int("JITKERN_NUM_THREADS", 1, environ)


def compile_workers(environ=None, default: int = 1) -> int:
    n = env_int("JITKERN_COMPILE_WORKERS", 1, environ)
    return default if n is None else n


def compile_timeout(environ=None, default: Optional[float] = None) -> Optional[float]:
    t = env_seconds("JITKERN_COMPILE_TIMEOUT", environ)
    return default if t is None else t


def cpu_tier(environ=None) -> Optional[str]:
    """The forced CPU tier name, or None (choose the best runnable)."""
    return _raw("JITKERN_CPU_TIER", environ)


def cache_dir(environ=None) -> Path:
    """The kernel cache root: $JITKERN_CACHE_DIR, else $XDG_CACHE_HOME/jitkern, else ~/.cache/jitkern."""
    env = _environ(environ)
    if env.get("JITKERN_CACHE_DIR"):
        return Path(env["JITKERN_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "jitkern"
    return Path.home() / ".cache" / "jitkern"


# --------------------------------------------------------------------------------------------- checks
def check_cache_dir(environ=None) -> Path:
    """The cache root, created if missing, after proving a file can be written there."""
    root = cache_dir(environ)
    named = _environ(environ).get("JITKERN_CACHE_DIR")
    what = f"JITKERN_CACHE_DIR={named!r}" if named else f"the kernel cache directory {str(root)!r}"
    fix = "set JITKERN_CACHE_DIR to a writable directory"
    if root.exists() and not root.is_dir():
        raise SettingError("JITKERN_CACHE_DIR", f"{what} is not a directory; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        # os.access() says yes to root on a read-only mount: write a file to be sure.
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SettingError("JITKERN_CACHE_DIR", f"{what} is not usable ({e.strerror or e}); {fix}") from None
    return root


def check_cpu_tier(environ=None):
    """The (Target, reason) kernels will run on; JITKERN_CPU_TIER problems become a SettingError."""
    from targets.base import TargetUnavailableError, UnknownTargetError
    from targets.cpu import select_cpu_tier
    forced = cpu_tier(environ)
    try:
        return select_cpu_tier(forced) if forced else select_cpu_tier("")
    except (UnknownTargetError, TargetUnavailableError) as e:
        raise SettingError("JITKERN_CPU_TIER", str(e)) from None


def check_environment(*, tier: bool = True, cache: bool = True, environ=None) -> None:
    """Raise SettingError for the first JITKERN_* setting that cannot be used. Cheap: no model, no compile.

    tier=False skips JITKERN_CPU_TIER (commands that name their target explicitly); cache=False skips
    the cache directory probe (commands that write nothing).
    """
    num_threads(environ)
    env_int("JITKERN_SPIN_US", 0, environ)
    env_int("JITKERN_POLLS_PER_YIELD", 1, environ)
    compile_workers(environ)
    compile_timeout(environ)
    pool_split("static", environ)
    env_seconds("JITKERN_VULKAN_TIMEOUT", environ)
    if tier:
        check_cpu_tier(environ)
    if cache:
        check_cache_dir(environ)

