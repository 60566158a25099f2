"""The backend interface: one object per target family, which the compile driver, the launch path and the CLI
dispatch through instead of asking which family a target is.

A family (`Backend.family`, a Target's `backend` field: "cpu", "cuda", "hip", "vulkan") owns
- its options (`options(target)`, a frozen dataclass): what it adds to a kernel's cache key beyond the target
  record and the specialisation: tools outside LLVM whose output is an artifact, and the tags of the target's
  tuning entries that shape its code (targets/tuning.py, `Tuning.tags` of `tuning_entries`);
- its lowering (`lower`: traced IR -> LLVM IR text and launch metadata);
- its toolchain and artifact format (`compile`: the cache entry's files and the entry's metadata);
- its loader (`load`: a compiled kernel made launchable: a CPU function address, or a GPU runtime's loaded
  kernel) and its runtime (`runtime()`, the module with `get_device()` for GPU families);
- what `jitkern build` and `jitkern targets` need to know (`build_problem`, `build_device`, `runs`).

`jitkern.backends.backend_of(target)` gives a target's family object. Adding a backend is one module here with
its hooks and lowering, a `BACKEND` object, and a line in `backends/__init__.py` (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from .. import ir
from ..errors import CompileError


@dataclass(frozen=True)
class Options:
    """What a family adds to a kernel's cache key: the tags of the target's tuning entries that shape its code."""
    tuning: tuple = ()

    def key(self) -> tuple:
        return self.tuning


class Backend:
    family = ""                 # the Target.backend this object serves
    artifact = ""               # the cache entry's file a launch loads
    python_in_key = True        # whether the artifacts depend on the Python that made them (CPU objects do)
    tuning_entries: tuple = ()  # the Tuning entries its lowering reads, in the order their tags enter the key
    engine_device = "cpu"       # the engine's --device that runs this family's kernels

    # ------------------------------------------------------------------------------------ options
    def options(self, target) -> Options:
        return Options(target.tuning.tags(self.tuning_entries))

    def cache_emit(self, emit: tuple) -> tuple:
        """The artifact kinds a cache entry holds for a request of `emit` (the CPU's obj / asm / opt_ll)."""
        return emit

    # ------------------------------------------------------------------------------ compile, load
    def lower(self, fn: ir.Function, target) -> tuple:
        """(LLVM IR text, launch metadata) for one traced kernel."""
        raise NotImplementedError

    def compile(self, fn: ir.Function, target, emit: tuple, describe: str, kernel_name: str, spec: str) -> tuple:
        """(artifacts: file name -> bytes, metadata for the cache entry beyond kernel / symbol / target / spec)."""
        raise NotImplementedError

    def load(self, ck, describe: str, spec: str) -> None:
        """Makes a compiled kernel launchable: sets `ck.address` (and `ck.loaded` on GPUs)."""
        raise NotImplementedError

    def runtime(self):
        """The runtime module this family's kernels run on (None: the CPU's thread pool)."""
        return None

    # --------------------------------------------------------------------------------------- CLI
    def runs(self, target) -> str:
        """Where code for `target` runs (the `jitkern targets` column)."""
        raise NotImplementedError

    def build_problem(self, target):
        """Why `jitkern build --target` cannot build here (a missing tool), or None."""
        return None

    def build_device(self, target):
        """A context manager `jitkern build` drives the engine's path for `target` in (GPU families: a host-memory
        stand-in for the device, so the cache gets what an engine there asks for)."""
        return nullcontext()

    # ---------------------------------------------------------------------------------- helpers
    @staticmethod
    def llvm(llvm_ir: str, target, emit: tuple, describe: str, kernel_name: str, spec: str) -> dict:
        """LLVM IR -> the `emit` kinds (obj / asm / opt_ll) through an isolated LLVM; errors name the target."""
        from ..isolate import compile_llvm_ir
        try:
            return compile_llvm_ir(llvm_ir, triple=target.triple, cpu=target.cpu, features=target.feature_string,
                                   opt=3, emit=tuple(emit), describe=describe, kernel=kernel_name,
                                   specialization=spec)
        except CompileError as e:
            if e.target is None:
                e.target = target.name
            raise

    @staticmethod
    def sources(fn: ir.Function, llvm_ir: str) -> dict:
        """The artifacts every entry keeps: our IR, printed, and the LLVM IR of the lowering."""
        return {"kernel.jkir": ir.format_function(fn).encode(), "kernel.ll": llvm_ir.encode()}


class GpuBackend(Backend):
    """A GPU family: artifacts independent of the Python, one launchable kernel per entry loaded by its runtime."""
    python_in_key = False
    engine_device = "cuda"

    def cache_emit(self, emit: tuple) -> tuple:
        return ("gpu",)

    def load(self, ck, describe: str, spec: str) -> None:
        ck.loaded = self.runtime().load_kernel(ck.artifacts, ck.symbol, ck.launch_meta)
        ck.address = id(ck.loaded)

    def build_device(self, target):
        # the engine's device-array path (its tiles, device buffers and their alignment) on a host-memory stand-in
        # for the GPU, under compile-only launches: nothing runs, and no GPU is needed to build
        from ..runtime.cuda import HostMemoryDevice
        return self.runtime().standing_in(HostMemoryDevice(target))
