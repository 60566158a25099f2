"""CPU ISA tiers and run-time tier selection.

Tiers (x86-64): portable < sse2 < sse2-f16c < avx2 < avx-vnni < avx512 < avx512-vnni (the best runnable one,
the last in this order, is selected: a host with AVX-VNNI but no AVX-512 gets avx-vnni, one with AVX-512 but
no VNNI avx512); (arm64): portable < neon < dotprod < i8mm.
`portable` is generic LLVM IR with no target intrinsics, compiled for the baseline CPU of the arch.
Availability comes from `llvmlite.binding.get_host_cpu_features()`: LLVM's host detection checks
CPUID *and* XGETBV, so AVX / AVX-512 are only reported when the OS saves their register state.
`JITKERN_CPU_TIER=<tier>` forces a tier; a forced tier this host cannot execute fails closed with
an error naming the tier and the missing features (never a silent narrowing, never a SIGILL).
"""
from __future__ import annotations

import functools
import os
import platform

from .base import Target, TargetUnavailableError, UnknownTargetError

_X86_TRIPLE = "x86_64-unknown-linux-gnu"
_ARM_TRIPLE = "aarch64-unknown-linux-gnu"

# (name, features LLVM may use, vector bits, host features required to run, description)
_X86_TIERS = [
    ("portable", (), 128, (), "generic IR, no target intrinsics, baseline x86-64"),
    ("sse2", ("sse2",), 128, ("sse2",), "SSE2 (x86-64 baseline) with SSE2 intrinsics"),
    ("sse2-f16c", ("avx", "f16c", "sse2"), 128, ("sse2", "avx", "f16c"),
     "128-bit vectors with F16C half conversions (F16C is VEX-encoded, so AVX state is needed)"),
    ("avx2", ("avx", "avx2", "f16c", "fma", "sse2"), 256, ("avx", "avx2", "fma", "f16c"), "AVX2 + FMA + F16C"),
    # AVX-VNNI (Alder Lake and later client cores, Zen 5): the VEX-encoded u8 x s8 -> i32 vpdpbusd on ymm
    ("avx-vnni", ("avx", "avx2", "avxvnni", "f16c", "fma", "sse2"), 256, ("avx", "avx2", "fma", "f16c", "avxvnni"),
     "AVX2 + FMA + F16C + AVX-VNNI (vpdpbusd on ymm, VEX)"),
    ("avx512", ("avx", "avx2", "avx512bw", "avx512dq", "avx512f", "avx512vl", "f16c", "fma", "sse2"), 512,
     ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
     "AVX-512 F/BW/VL/DQ with 512-bit vectors preferred"),
    # AVX512-VNNI (Cascade Lake / Ice Lake / Sapphire Rapids, Zen 4 and later): vpdpbusd on zmm
    ("avx512-vnni", ("avx", "avx2", "avx512bw", "avx512dq", "avx512f", "avx512vl", "avx512vnni", "f16c", "fma",
                     "sse2"), 512,
     ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma", "f16c"),
     "AVX-512 F/BW/VL/DQ + VNNI (vpdpbusd on zmm) with 512-bit vectors preferred"),
]
_ARM_TIERS = [
    ("portable", (), 128, (), "generic IR, no target intrinsics"),
    ("neon", ("neon",), 128, ("neon",), "NEON"),
    ("dotprod", ("dotprod", "neon"), 128, ("neon", "dotprod"), "NEON + SDOT/UDOT"),
    ("i8mm", ("dotprod", "i8mm", "neon"), 128, ("neon", "dotprod", "i8mm"), "NEON + DotProd + I8MM"),
]


def _make(arch: str, spec) -> Target:
    name, feats, bits, req, desc = spec
    if arch == "x86_64":
        triple, cpu = _X86_TRIPLE, "x86-64"
    else:
        triple, cpu = _ARM_TRIPLE, "generic"
    extra = (("prefer-vector-width", str(bits)),) if arch == "x86_64" else ()
    return Target(name=name, backend="cpu", triple=triple, cpu=cpu, features=tuple(sorted(feats)),
                  vector_bits=bits, arch=arch, requires=tuple(req), description=desc, extra=extra)


X86_TIERS = [_make("x86_64", s) for s in _X86_TIERS]
ARM_TIERS = [_make("aarch64", s) for s in _ARM_TIERS]


def host_arch() -> str:
    m = platform.machine().lower()
    if m in ("x86_64", "amd64"):
        return "x86_64"
    if m in ("aarch64", "arm64"):
        return "aarch64"
    return m


def cpu_tiers(arch: str | None = None) -> list[Target]:
    arch = arch or host_arch()
    return X86_TIERS if arch == "x86_64" else ARM_TIERS if arch == "aarch64" else [X86_TIERS[0]]


def cpu_tier_names(arch: str | None = None) -> list[str]:
    return [t.name for t in cpu_tiers(arch)]


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset:
    """LLVM's view of this host's usable features (CPUID + OS register-state checks)."""
    import llvmlite.binding as llvm
    fm = llvm.get_host_cpu_features()
    feats = {k for k, v in fm.items() if v}
    if host_arch() == "aarch64":
        feats.add("neon")          # mandatory on AArch64; LLVM may name it fp-armv8/asimd
    if host_arch() == "x86_64":
        feats.add("sse2")          # x86-64 baseline
    # JITKERN_CPU_MASK_FEATURES=avx512f,avx2 pretends these are absent (to test fail-closed paths and
    # lower tiers on a rich host, like numba's NUMBA_CPU_FEATURES); masking can only remove features.
    masked = {f.strip().lstrip("+") for f in os.environ.get("JITKERN_CPU_MASK_FEATURES", "").split(",") if f.strip()}
    return frozenset(feats - masked)


def missing_features(target: Target, host: frozenset | None = None) -> list[str]:
    host = host_cpu_features() if host is None else host
    if target.arch != host_arch():
        return [f"arch {target.arch} (host is {host_arch()})"]
    return [f for f in target.requires if f not in host]


def can_run(target: Target) -> bool:
    return target.is_cpu and not missing_features(target)


def check_runnable(target: Target) -> None:
    missing = missing_features(target)
    if missing:
        raise TargetUnavailableError(
            f"CPU tier '{target.name}' cannot run on this host: missing {', '.join(missing)} "
            f"(host cpu {_host_cpu_name()}); unset JITKERN_CPU_TIER or choose one of: "
            f"{', '.join(t.name for t in cpu_tiers() if can_run(t))}")


def _host_cpu_name() -> str:
    import llvmlite.binding as llvm
    return llvm.get_host_cpu_name()


def select_cpu_tier(forced: str | None = None) -> tuple[Target, str]:
    """The tier kernels run on, and why. Reads JITKERN_CPU_TIER unless `forced` is given."""
    forced = forced if forced is not None else os.environ.get("JITKERN_CPU_TIER") or None
    tiers = cpu_tiers()
    if forced:
        by_name = {t.name: t for t in tiers}
        aliases = {"sse2+f16c": "sse2-f16c", "avx-512": "avx512", "avxvnni": "avx-vnni", "avx512vnni": "avx512-vnni",
                   "avx-512-vnni": "avx512-vnni"}
        t = by_name.get(aliases.get(forced, forced))
        if t is None:
            raise UnknownTargetError(
                f"JITKERN_CPU_TIER={forced!r} is not a CPU tier of {host_arch()}; set it to one of "
                f"{', '.join(t.name for t in tiers if can_run(t))} (those this host can run) or unset it")
        check_runnable(t)   # fail closed
        return t, f"forced by JITKERN_CPU_TIER={forced}"
    best = [t for t in tiers if can_run(t)][-1]
    return best, "best tier whose features this host (CPUID + OS state, via LLVM) reports"
