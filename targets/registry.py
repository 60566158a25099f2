"""Every known target by name."""
from __future__ import annotations

from .base import Target, UnknownTargetError
from .cpu import ARM_TIERS, X86_TIERS

_NVPTX_DL = "e-p3:32:32-p4:32:32-p5:32:32-i64:64-i128:128-v16:16-v32:32-n16:32:64"
_AMDGPU_DL = ("e-p:64:64-p1:64:64-p2:32:32-p3:32:32-p4:64:64-p5:32:32-p6:32:32-p7:160:256:256:32-"
              "p8:128:128-p9:192:256:256:32-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-"
              "v256:256-v512:512-v1024:1024-v2048:2048-n32:64-S32-A5-G1-ni:7:8:9")
_SPIRV_DL = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-n8:16:32:64-G10"


# Per-CTA shared memory with the dynamic opt-in (CUDA programming guide, compute capabilities table), KiB
_CUDA_SMEM_KIB = {"sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90": 227, "sm_90a": 227, "sm_100a": 227,
                  "sm_120a": 99}


def _cuda(sm: str) -> Target:
    mma = {"sm_90a": "wgmma", "sm_100a": "tcgen05"}.get(sm, "mma.sync")
    return Target(name=sm, backend="cuda", triple="nvptx64-nvidia-cuda", cpu=sm, features=(),
                  vector_bits=0, warp_size=32, data_layout=_NVPTX_DL, arch="nvptx64",
                  description=f"NVIDIA {sm} PTX (loaded through cuda-python)",
                  shared_mem_bytes=_CUDA_SMEM_KIB[sm] * 1024, mma=mma,
                  async_copy="tma" if int(sm[3:].rstrip("a")) >= 90 else "cp.async")


def _hip(gfx: str) -> Target:
    wave = 32 if gfx.startswith("gfx1") else 64
    return Target(name=gfx, backend="hip", triple="amdgcn-amd-amdhsa", cpu=gfx, features=(),
                  vector_bits=0, warp_size=wave, data_layout=_AMDGPU_DL, arch="amdgcn",
                  description=f"AMD {gfx} code object v5 (loaded through hip-python)",
                  shared_mem_bytes=64 * 1024, mma="wmma" if gfx.startswith("gfx1") else "mfma")


_GPU = ([_cuda(s) for s in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120a")]
        + [_hip(g) for g in ("gfx90a", "gfx942", "gfx1100")]
        + [Target(name="vulkan", backend="vulkan", triple="spirv1.5-unknown-vulkan1.2-compute", cpu="",
                  vector_bits=0, warp_size=32, data_layout=_SPIRV_DL, arch="spirv",
                  description="Vulkan 1.2 SPIR-V compute (run through the vulkan package)",
                  # workgroup = num_warps x 32 invocations (lavapipe's subgroups are 8 wide, NVIDIA's 32);
                  # 48 KiB of workgroup memory (NVIDIA 48, AMD/Intel 64); lavapipe has 32: the runtime refuses a
                  # kernel over its device's limit by name (the engine's vocabulary-wide top-k needs 33 KiB)
                  shared_mem_bytes=48 * 1024)])


def all_targets() -> list[Target]:
    return list(X86_TIERS) + list(ARM_TIERS) + list(_GPU)


def target_names() -> list[str]:
    return [t.name if t.backend != "cpu" or t.arch == "x86_64" else f"arm64-{t.name}" for t in all_targets()]


def get_target(name: str) -> Target:
    """Look up a target by name. CPU tiers resolve for the host arch; `arm64-<tier>` names ARM tiers."""
    from .cpu import host_arch
    if name.startswith("arm64-") or name.startswith("aarch64-"):
        tiers = {t.name: t for t in ARM_TIERS}
        t = tiers.get(name.split("-", 1)[1])
        if t:
            return t
    if name.startswith("x86-") or name.startswith("x86_64-"):
        tiers = {t.name: t for t in X86_TIERS}
        t = tiers.get(name.split("-", 1)[1])
        if t:
            return t
    cpu_first = ARM_TIERS if host_arch() == "aarch64" else X86_TIERS
    for t in list(cpu_first) + list(_GPU):
        if t.name == name:
            return t
    raise UnknownTargetError(f"unknown target {name!r}; known: {', '.join(target_names())}")
