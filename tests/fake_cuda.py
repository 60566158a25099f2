"""A host-memory stand-in for a CUDA device, so the DeviceArray plumbing (views, strides, op wrappers taking
device arrays, the engine's device path: uploads, staging, device buffers, logits copied back) is tested on
machines without a GPU. Its "device memory" is host memory and its target is the CPU runtime tier, so the
launches run the CPU kernels on the arrays' addresses. What it cannot test (PTX, the driver, CUDA graphs)
the gpu-marked tests cover on a real GPU."""
from __future__ import annotations

from jitkern.runtime.cuda import HostMemoryDevice


class FakeDevice(HostMemoryDevice):
    """The runtime's host-memory device, targeting the CPU runtime tier so launches run the CPU kernels on
    the arrays' addresses; new allocations are poisoned (0xA5), as real device memory is not zeroed."""
    name = "fake (host memory)"

    def __init__(self):
        super().__init__(None, poison=0xA5)

    def target(self):
        from jitkern.runtime.cpu import runtime_target
        return runtime_target()


def install(monkeypatch) -> FakeDevice:
    """Makes jitkern.runtime.cuda answer with a FakeDevice for the rest of the test.

    JITKERN_FAKE_CUDA_TARGET=sm_90a (say) makes the fake device claim that GPU target: the op wrappers then
    pick that GPU's tiles and every launch compiles that GPU specialisation into the kernel cache (load=False,
    ptxas included) before running the same specialisation on the CPU. It fills a cache with exactly what
    the gpu-marked tests need, so a run on the real GPU compiles nothing."""
    import os

    from jitkern.runtime import cuda
    from jitkern.runtime import launch as launch_mod
    dev = FakeDevice()
    gpu_name = os.environ.get("JITKERN_FAKE_CUDA_TARGET")
    if gpu_name:
        from targets import get_target
        gpu = get_target(gpu_name)
        monkeypatch.setattr(dev, "target", lambda: gpu)
        launch = launch_mod.launch

        def dual_launch(kernel, grid, args, kwargs, target=None):
            if launch_mod.launches_are_dry():
                return None
            if target is None or target is gpu or getattr(target, "is_gpu", False):
                # (a test's tuned copy of the GPU target compiles with its own choices)
                co = launch_mod.compile_only(target=target if getattr(target, "is_gpu", False) else gpu)
                launch_mod._compile_only_launch(co, kernel, args, kwargs)
                from jitkern.runtime.cpu import runtime_target
                target = runtime_target()       # then run it on the CPU runtime tier
            return launch(kernel, grid, args, kwargs, target=target)

        monkeypatch.setattr(launch_mod, "launch", dual_launch)
        for mod in ("engine.ops._hostargs", "engine.ops.matmul"):
            import importlib
            monkeypatch.setattr(importlib.import_module(mod), "launch", dual_launch)
    # a GPU's tensor-core linear gives the same bits with its decode and its taller prefill tile (MMA
    # chains in K order); run on the CPU these kernels sum per K step, so the fake keeps one tile for every
    # M, or its batch-invariance checks would see the switch
    from engine.ops import matmul
    monkeypatch.setattr(matmul, "GPU_LINEAR_WIDE_M", 1 << 62)
    monkeypatch.setattr(cuda, "get_device", lambda ordinal=0: dev)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    pack = launch_mod.pack_args

    def pack_args(grid3, values):
        devs = tuple(v for v in values if isinstance(v, cuda.DeviceArray))
        graph = getattr(launch_mod._capture, "graph", None)
        if graph is not None and devs:
            graph._keep.append(devs)        # as CudaGraph.keep: recorded device arrays live as long as the graph
        return pack(grid3, [v.ptr if isinstance(v, cuda.DeviceArray) else v for v in values])

    monkeypatch.setattr(launch_mod, "pack_args", pack_args)
    return dev
