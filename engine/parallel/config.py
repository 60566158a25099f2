"""The one place that decides whether `tensor_parallel_size` can run here (CLI, server and LLM(...) all ask it).

    N == 1                         -> the normal single-device engine
    N > 1 on the CPU device        -> refused: tensor parallelism is a GPU feature (one process per GPU, NCCL)
    N > 1 on Vulkan                -> refused: no multi-device Vulkan path
    N > 1 on CUDA, N > GPUs found  -> refused at start naming both numbers
    N > 1 on CUDA, N <= GPUs       -> the multi-process runtime (engine.parallel.runtime)
"""
from __future__ import annotations

from engine.errors import ModelLoadError


class TensorParallelError(ModelLoadError, ValueError):
    """A tensor_parallel_size that cannot run on this machine (one line, names the setting)."""


def parse_size(value, field: str = "tensor_parallel_size") -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, str) and value.isdigit()):
        raise TensorParallelError(f"{field}={value!r}: must be a positive integer", key=field)
    n = int(value)
    if n < 1:
        raise TensorParallelError(f"{field}={n}: must be >= 1", key=field)
    return n


def cuda_device_count() -> int:
    """CUDA devices that answer (0 without a driver or cuda-python). Tests replace it with a stub."""
    try:
        from jitkern.runtime.cuda import check, driver
        cu = driver()
        check(cu.cuInit(0), "cuInit")
        return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    except Exception:       # noqa: BLE001 - no driver / no binding: no GPUs
        return 0


BACKENDS = ("auto", "cpu-pipes")


def check_tensor_parallel(size, device: str | None, *, backend: str = "auto", gpu_count=None) -> int:
    """The tensor-parallel size to run with, or TensorParallelError saying why not. `device` is the device
    setting (auto | cpu | cuda | vulkan); `backend` "cpu-pipes" runs CPU ranks over pipes (tests of the
    runtime only); `gpu_count` overrides the CUDA device probe (tests)."""
    n = parse_size(size)
    if backend not in BACKENDS:
        raise TensorParallelError(f"tensor_parallel_backend={backend!r} is not one of {', '.join(BACKENDS)}",
                                  key="tensor_parallel_backend")
    if n == 1:
        return 1
    from engine.device import resolve_device
    device = resolve_device(device)
    if backend == "cpu-pipes":
        if device != "cpu":
            raise TensorParallelError("tensor_parallel_backend='cpu-pipes' runs CPU ranks: use device='cpu'",
                                      key="tensor_parallel_backend")
        return n
    if device == "cpu":
        raise TensorParallelError(f"tensor_parallel_size={n} needs CUDA GPUs (tensor parallelism is a GPU "
                                  "feature: one process per GPU over NCCL); on the CPU use "
                                  "--tensor-parallel-size 1", key="tensor_parallel_size")
    if device != "cuda":
        raise TensorParallelError(f"tensor_parallel_size={n} is not supported on device {device!r} (CUDA only)",
                                  key="tensor_parallel_size")
    have = cuda_device_count() if gpu_count is None else int(gpu_count)
    if n > have:
        raise TensorParallelError(f"tensor_parallel_size={n} but only {have} CUDA GPU"
                                  f"{'' if have == 1 else 's'} present: use at most {have}",
                                  key="tensor_parallel_size")
    raise TensorParallelError(f"tensor_parallel_size={n} on {have} GPUs: the multi-GPU runtime is designed "
                              "(docs/ARCHITECTURE.md) and its CPU twin tested, but its device side (NCCL "
                              "collectives in the CUDA graphs, the vocabulary-parallel kernels) is not finished "
                              "and has never run on a multi-GPU machine; use --tensor-parallel-size 1",
                              key="tensor_parallel_size")
