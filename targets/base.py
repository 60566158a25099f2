"""The `Target` record every kernel is compiled against."""
from __future__ import annotations

from dataclasses import dataclass, field

from .tuning import DEFAULT as _DEFAULT_TUNING, CachedHash, Tuning


class UnknownTargetError(ValueError):
    pass


class TargetUnavailableError(RuntimeError):
    """A target exists but this host cannot execute code built for it."""


@dataclass(frozen=True)
class Target(CachedHash):
    __hash__ = CachedHash.__hash__     # a frozen dataclass would otherwise generate its own
    name: str                    # "avx2", "sm_90a", "gfx942", "vulkan"
    backend: str                 # "cpu" | "cuda" | "hip" | "vulkan"
    triple: str
    cpu: str                     # LLVM cpu / arch name
    features: tuple = ()         # LLVM feature names required (without "+"), sorted
    vector_bits: int = 128       # preferred SIMD width on CPUs; 0 on GPUs
    warp_size: int = 0           # threads per warp / wavefront / subgroup on GPUs
    data_layout: str = ""
    arch: str = ""               # "x86_64", "aarch64", "nvptx64", "amdgcn", "spirv"
    requires: tuple = ()         # host features (LLVM names) needed to *run* this target
    description: str = ""
    extra: tuple = field(default=())   # (key, value) pairs: backend-specific knobs
    # GPU capabilities (0 / "" on CPUs): what op code may ask `jk.target` instead of assuming a CPU
    shared_mem_bytes: int = 0    # shared memory one CTA / workgroup may use (dynamic opt-in maximum)
    mma: str = ""                # matrix unit: "mma.sync" (sm_80+), "wgmma" (sm_90a), "mfma", "wmma"
    async_copy: str = ""         # "cp.async" (sm_80+), "tma" (sm_90+)
    # code-generation choices (targets/tuning.py); in cache keys through Tuning.tags (jitkern/backends)
    tuning: Tuning = _DEFAULT_TUNING

    @property
    def is_cpu(self) -> bool:
        return self.backend == "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.backend in ("cuda", "hip", "vulkan")

    @property
    def is_cuda(self) -> bool:
        return self.backend == "cuda"

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"

    @property
    def is_vulkan(self) -> bool:
        return self.backend == "vulkan"

    @property
    def is_x86(self) -> bool:
        return self.arch == "x86_64"

    @property
    def is_arm(self) -> bool:
        return self.arch == "aarch64"

    # ---- capabilities: what op and engine code asks, named by what it means, instead of naming a family
    @property
    def costly_workgroups(self) -> bool:
        """Workgroups, their barriers and their programs cost much more than on a GPU's SIMT units: the Vulkan
        target is tuned for Mesa's lavapipe, which runs a workgroup as coroutines on the CPU (one suspend point
        per barrier) and compiles each barrier into that coroutine. Ops take barrier-light kernels (attention
        through the token kernel) and fewer, larger programs there."""
        return self.backend == "vulkan"

    @property
    def fast_workgroups(self) -> bool:
        """A GPU whose workgroups run on SIMT hardware (not `costly_workgroups`): the flash attention kernels, a
        row's groups spread over programs, whole-row tiles."""
        return self.is_gpu and not self.costly_workgroups

    @property
    def register_cap(self) -> bool:
        """Launches may cap the registers per thread (the `maxnreg` launch option; ptxas honours it)."""
        return self.backend == "cuda"

    @property
    def lane_shuffles(self) -> bool:
        """The lowering has lane shuffles, so a kernel may keep a tile's rows in the warps that own them (the
        `warp_rows` launch option)."""
        return self.backend == "cuda"

    @property
    def gpu_quant_linear(self) -> bool:
        """GGUF linears take the GPU-shaped dp4a kernel (warps over rows, lanes over blocks) instead of the
        CPU-shaped tiles: measured on CUDA (docs/BENCHMARKS.md); HIP and Vulkan keep the tiles until timed."""
        return self.backend == "cuda"

    def has(self, feature: str) -> bool:
        """Whether code for this target may use `feature` (an LLVM feature name such as "avx2")."""
        return feature in self.features

    @property
    def feature_string(self) -> str:
        return ",".join("+" + f for f in self.features)

    @property
    def device_tag(self) -> str:
        """Cache folder name: backend, arch and target name."""
        return f"{self.backend}-{self.arch}-{self.name}"

    def key(self) -> tuple:
        """Everything about the target that changes generated code (goes into cache keys)."""
        return (self.name, self.backend, self.triple, self.cpu, self.features, self.vector_bits,
                self.warp_size, self.data_layout, self.extra, self.shared_mem_bytes, self.mma, self.async_copy)

    def __str__(self) -> str:
        return self.name
