"""Where the engine runs: `--device auto|cpu|cuda|vulkan` (EngineArgs.device, LLM(device=...)).

auto picks CUDA when cuda-python is installed and a CUDA device answers, else the CPU; asking for cuda
where there is none fails at start with one line naming the setting. On CUDA the model's weights are
uploaded once (GGUF quantised blocks stay compressed: the raw bytes go over as they are), the KV cache
and the activations live on the device, and the step inputs go over in one copy per step (StepStaging).
Vulkan (never picked by auto; Mesa's lavapipe counts as a device) takes the same path: its device arrays are
`jitkern.runtime.device.DeviceArray`s on a `jitkern.runtime.vulkan.VulkanDevice`, launches dispatch SPIR-V.
"""
from __future__ import annotations

import numpy as np

from engine.errors import ModelLoadError

DEVICES = ("auto", "cpu", "cuda", "vulkan")
GPU_DEVICES = ("cuda", "vulkan")        # device kinds whose forward pass runs on device arrays (weights uploaded,
                                        # KV cache and activations on the device, step inputs staged)


class DeviceUnavailableError(ModelLoadError):
    """The device setting asks for a device this machine does not have (or names none we know)."""


def resolve_device(setting: str | None) -> str:
    """'cpu', 'cuda' or 'vulkan' for a device setting (None means auto: CUDA where it answers, else the CPU)."""
    setting = (setting or "auto").strip().lower()
    if setting not in DEVICES:
        raise DeviceUnavailableError(f"device={setting!r} is not one of {', '.join(DEVICES)} (--device)")
    if setting == "cpu":
        return "cpu"
    if setting == "vulkan":
        from jitkern.runtime import vulkan
        try:
            vulkan.get_device()
        except Exception as e:      # noqa: BLE001 - the reason goes into the one-line message
            raise DeviceUnavailableError(f"device='vulkan' (--device vulkan) but no usable Vulkan device here: "
                                         f"{e}; use --device cpu or auto") from None
        return "vulkan"
    from jitkern.runtime import cuda
    try:
        cuda.get_device(0).target()          # a device that answers and that jitkern has a target for
    except Exception as e:          # noqa: BLE001 - the reason goes into the one-line message
        if setting == "auto":
            return "cpu"
        raise DeviceUnavailableError(f"device='cuda' (--device cuda) but no usable CUDA device here: {e}; "
                                     f"use --device cpu or auto") from None
    return "cuda"


def runtime_device(kind: str = "cuda"):
    """The jitkern runtime device of a device kind: CUDA device 0, or the Vulkan device."""
    if kind == "vulkan":
        from jitkern.runtime import vulkan
        return vulkan.get_device()
    from jitkern.runtime import cuda
    return cuda.get_device(0)


class Uploader:
    """Host arrays -> device arrays, each host array uploaded once (shared tables such as a tied
    embedding / lm_head or one RoPE cache for all layers stay shared on the device)."""

    def __init__(self, kind: str = "cuda"):
        self.device = runtime_device(kind)
        self._done: dict = {}
        self.nbytes = 0

    def __call__(self, a):
        from jitkern.runtime.device import DeviceArray
        if a is None or isinstance(a, DeviceArray):
            return a
        if not isinstance(a, np.ndarray):
            raise TypeError(f"cannot upload {type(a).__name__}")
        key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
        hit = self._done.get(key)
        if hit is None:
            hit = self._done[key] = (a, DeviceArray.from_numpy(a, device=self.device))
            self.nbytes += a.nbytes
        return hit[1]


class DeviceBufferPool:
    """engine.model_runner.BufferPool on the device: named activation buffers with stable addresses."""

    def __init__(self, kind: str = "cuda"):
        self.device = runtime_device(kind)
        self._bufs: dict = {}
        self.generation = 0

    def get(self, name: str, shape, dtype=np.float32):
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            cap = max(n, 2 * buf.size if buf is not None else n)
            from jitkern.runtime.device import DeviceArray
            buf = DeviceArray.zeros(cap, dtype, self.device)
            self._bufs[name] = buf
            self.generation += 1
        return buf[:n].reshape(shape)

    def clear(self) -> None:
        self._bufs.clear()
        self.generation += 1


class StepStaging:
    """The per-step int32 inputs (ids, positions, slots, query starts, lengths, block table, logits rows)
    as views of one host array mirrored by one device array: the host side is filled as on the CPU, then one
    copy per step sends it over. The device views have fixed addresses (what recorded CUDA graphs read)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, kind: str = "cuda"):
        from jitkern.runtime.device import DeviceArray
        sizes = [("input_ids", (max_tokens,)), ("positions", (max_tokens,)), ("slot_mapping", (max_tokens,)),
                 ("query_start", (max_seqs + 1,)), ("seq_lens", (max_seqs,)),
                 ("block_table", (max_seqs, max_blocks)), ("logits_rows", (max_tokens,))]
        total = sum(int(np.prod(s)) for _, s in sizes)
        self.host = np.zeros(total, np.int32)
        self.dev = DeviceArray.zeros(total, np.int32, runtime_device(kind))
        self.host_views, self.dev_views = {}, {}
        off = 0
        for name, shape in sizes:
            n = int(np.prod(shape))
            self.host_views[name] = self.host[off:off + n].reshape(shape)
            self.dev_views[name] = self.dev[off:off + n].reshape(shape)
            off += n

    def send(self) -> None:
        self.dev.copy_from_numpy(self.host)


class Arrays:
    """Where a model's own buffers and small index arrays go when it runs outside the engine's buffer pool (LLaVA's
    vision tower, Whisper): numpy on the CPU, device arrays on a GPU (`kind`: "cpu" or a GPU device kind)."""

    def __init__(self, kind: str = "cpu"):
        self.device = runtime_device(kind) if kind in GPU_DEVICES else None

    def empty(self, shape, dtype=np.float32):
        if self.device is None:
            return np.empty(shape, dtype)
        from jitkern.runtime.device import DeviceArray
        return DeviceArray.empty(shape, dtype, self.device)

    def zeros(self, shape, dtype=np.float32):
        if self.device is None:
            return np.zeros(shape, dtype)
        from jitkern.runtime.device import DeviceArray
        return DeviceArray.zeros(shape, dtype, self.device)

    def put(self, host: np.ndarray):
        """`host` where the kernels read it: itself on the CPU, a device copy on a GPU."""
        if self.device is None:
            return host
        from jitkern.runtime.device import DeviceArray
        return DeviceArray.from_numpy(np.ascontiguousarray(host), device=self.device)
