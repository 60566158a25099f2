"""The Vulkan runtime on the `vulkan` package (cffi bindings, the `[vulkan]` extra).

Imported lazily, and `import vulkan` itself raises OSError where no Vulkan loader is installed: every entry
point turns that into `VulkanUnavailable`. What lives here:
- `VulkanDevice`: one instance, one physical device (`JITKERN_VULKAN_DEVICE`: a substring of its name;
  else the first discrete GPU, else the first device: Mesa's lavapipe on a machine without a GPU), a logical
  device with a compute queue and the features the kernels use (8/16-bit storage, Int8/16/64, Float64);
- memory: every allocation is its own storage buffer in host-visible, coherent memory, mapped once. Device
  arrays are `runtime.device.DeviceArray`s whose `ptr` is a *virtual* address (each allocation gets a range of
  its own), so views, strides and offsets work as on CUDA; a launch turns an address back into (buffer,
  offset). Host-visible memory is right for lavapipe (all memory is host memory) and correct, not fast, on
  a discrete GPU (staging buffers are the next step);
- compute pipelines cached per device and SPIR-V module; a launch writes the argument slots, binds one
  descriptor set (slots at binding 0, pointer parameter k at binding 1 + k over its whole buffer, its element
  offset in its slot) and submits one dispatch, waiting for it (launches are synchronous).

`jk.capture()` records dispatches into a `VulkanGraph` (one command buffer, replayed with one submit). Not here
yet: the pipeline cache on disk, device-local memory + staging copies.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from ..errors import CompileError, JitkernError
from .device import Device, DeviceArray, has_host_arrays, pack_slots, run_staged

_ES = {"float": 4, "double": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8}
_VA_START = 1 << 40           # virtual addresses of device arrays: away from small integers
_VA_ALIGN = 4096



# spirv-val (SPIRV-Tools): why a driver rejected a pipeline, when it can tell
def find_spirv_val():
    return os.environ.get("JITKERN_SPIRV_VAL") or shutil.which("spirv-val")


def spirv_validate(spv: bytes, env: str = "vulkan1.2") -> str | None:
    """spirv-val's complaint about a module, None if it is valid; raises CompileError without spirv-val."""
    tool = find_spirv_val()
    if tool is None:
        raise CompileError("spirv-val not found (Debian: apt-get install spirv-tools)", target="vulkan")
    with tempfile.NamedTemporaryFile(suffix=".spv") as f:
        f.write(spv)
        f.flush()
        r = subprocess.run([tool, "--target-env", env, f.name], capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr or r.stdout).strip()


class VulkanError(JitkernError):
    pass


class VulkanUnavailable(VulkanError):
    """No `vulkan` package, no Vulkan loader, or no Vulkan device."""


_vk = None


def vk():
    """The `vulkan` module (imported on first use)."""
    global _vk
    if _vk is None:
        try:
            import vulkan as m
        except ImportError as e:
            raise VulkanUnavailable("the vulkan package is not installed (pip install 'jitkern[vulkan]')") from e
        except OSError as e:
            raise VulkanUnavailable(f"no Vulkan loader (Debian: apt-get install libvulkan1 "
                                    f"mesa-vulkan-drivers): {e}") from e
        _vk = m
    return _vk


def _name_of(props) -> str:
    n = props.deviceName
    if isinstance(n, str):
        return n
    return vk().ffi.string(n).decode(errors="replace")


class _Alloc:
    __slots__ = ("va", "nbytes", "buffer", "memory", "host")

    def __init__(self, va, nbytes, buffer, memory, host):
        self.va, self.nbytes, self.buffer, self.memory, self.host = va, nbytes, buffer, memory, host


class _Pipeline:
    __slots__ = ("module", "dsl", "layout", "pipeline", "bindings", "num_threads", "slots", "keep", "entry")


class VulkanDevice(Device):
    kind = "vulkan"

    def __init__(self):
        v = vk()
        self.lock = threading.RLock()
        app = v.VkApplicationInfo(pApplicationName="jitkern", applicationVersion=1, pEngineName="jitkern",
                                  engineVersion=1, apiVersion=v.VK_MAKE_VERSION(1, 2, 0))
        try:
            self.instance = v.vkCreateInstance(v.VkInstanceCreateInfo(pApplicationInfo=app), None)
            pds = v.vkEnumeratePhysicalDevices(self.instance)
        except Exception as e:      # noqa: BLE001 - the package raises its own exception classes
            raise VulkanUnavailable(f"no Vulkan instance or device: {type(e).__name__}: {e}") from e
        if not pds:
            raise VulkanUnavailable("the Vulkan loader found no device (Debian: mesa-vulkan-drivers gives lavapipe)")
        want = os.environ.get("JITKERN_VULKAN_DEVICE", "").lower()
        cands = [(pd, v.vkGetPhysicalDeviceProperties(pd)) for pd in pds]
        pick = None
        if want:
            pick = next((c for c in cands if want in _name_of(c[1]).lower()), None)
            if pick is None:
                raise VulkanUnavailable(f"JITKERN_VULKAN_DEVICE={want!r} matches none of "
                                        f"{[_name_of(c[1]) for c in cands]}")
        if pick is None:
            pick = next((c for c in cands if c[1].deviceType == v.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU), cands[0])
        self.physical, props = pick
        self.name = _name_of(props)
        # a CPU implementation (lavapipe) runs dispatches on the host's cores: on a loaded host a heavy one can
        # take minutes, so its default dispatch timeout is longer
        self.is_cpu = props.deviceType == v.VK_PHYSICAL_DEVICE_TYPE_CPU
        self.broken = None              # why the device may not be used any more (a dispatch that did not finish)
        lim = props.limits
        self.max_groups = tuple(int(lim.maxComputeWorkGroupCount[i]) for i in range(3))
        self.max_threads = int(lim.maxComputeWorkGroupInvocations)
        self.max_shared = int(lim.maxComputeSharedMemorySize)
        self.max_range = int(lim.maxStorageBufferRange)
        self.min_offset_align = int(lim.minStorageBufferOffsetAlignment)
        fams = v.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        self.family = next((i for i, f in enumerate(fams) if f.queueFlags & v.VK_QUEUE_COMPUTE_BIT), None)
        if self.family is None:
            raise VulkanUnavailable(f"Vulkan device {self.name} has no compute queue")
        self.device = self._create_device()
        self.queue = v.vkGetDeviceQueue(self.device, self.family, 0)
        mp = v.vkGetPhysicalDeviceMemoryProperties(self.physical)
        want_flags = v.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | v.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        self.mem_types = [i for i in range(mp.memoryTypeCount)
                          if mp.memoryTypes[i].propertyFlags & want_flags == want_flags]
        self.cmd_pool = v.vkCreateCommandPool(self.device, v.VkCommandPoolCreateInfo(
            queueFamilyIndex=self.family, flags=v.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.cmd = v.vkAllocateCommandBuffers(self.device, v.VkCommandBufferAllocateInfo(
            commandPool=self.cmd_pool, level=v.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self.fence = v.vkCreateFence(self.device, v.VkFenceCreateInfo(), None)
        self.desc_pool = v.vkCreateDescriptorPool(self.device, v.VkDescriptorPoolCreateInfo(
            maxSets=1, poolSizeCount=1,
            pPoolSizes=[v.VkDescriptorPoolSize(type=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=256)]),
            None)
        self.allocs: dict = {}          # va -> _Alloc
        self._bases: list = []          # sorted vas
        self._next_va = _VA_START
        self.pipelines: dict = {}
        self._slots = None

    def _create_device(self):
        v = vk()
        prio = v.ffi.new("float[]", [1.0])
        qci = v.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, queueCount=1, pQueuePriorities=prio)
        # the kernels' 8/16/64-bit types; where a device lacks one, retry without the optional features
        attempts = [dict(f12=dict(shaderInt8=1, storageBuffer8BitAccess=1),
                         f11=dict(storageBuffer16BitAccess=1),
                         core=dict(shaderInt64=1, shaderFloat64=1, shaderInt16=1)),
                    dict(f12=dict(shaderInt8=1, storageBuffer8BitAccess=1), f11=dict(storageBuffer16BitAccess=1),
                         core=dict(shaderInt64=1, shaderInt16=1)),
                    dict(f12={}, f11={}, core={})]
        last = None
        for a in attempts:
            f11 = v.VkPhysicalDeviceVulkan11Features(**a["f11"])
            f12 = v.VkPhysicalDeviceVulkan12Features(pNext=f11, **a["f12"])
            core = v.VkPhysicalDeviceFeatures(**a["core"])
            ci = v.VkDeviceCreateInfo(pNext=f12, queueCreateInfoCount=1, pQueueCreateInfos=[qci],
                                      pEnabledFeatures=core)
            try:
                return v.vkCreateDevice(self.physical, ci, None)
            except Exception as e:      # noqa: BLE001
                last = e
        raise VulkanUnavailable(f"cannot create a Vulkan device on {self.name}: {last}")

    # ------------------------------------------------------------------------------------ target
    @property
    def target_name(self) -> str:
        return "vulkan"

    def target(self):
        from targets import get_target
        return get_target("vulkan")

    def activate(self) -> None:
        pass

    def synchronize(self) -> None:
        pass            # launches wait for their fence

    # ------------------------------------------------------------------------------------ memory
    def _memory_type(self, bits: int) -> int:
        for i in self.mem_types:
            if bits & (1 << i):
                return i
        raise VulkanError(f"no host-visible coherent memory type for a storage buffer on {self.name}")

    def alloc(self, nbytes: int) -> int:
        v = vk()
        size = max(-(-int(nbytes) // 16) * 16, 16)
        if size > self.max_range:
            raise VulkanError(f"a device array of {nbytes} bytes exceeds maxStorageBufferRange "
                              f"({self.max_range}) of {self.name}")
        with self.lock:
            buf = v.vkCreateBuffer(self.device, v.VkBufferCreateInfo(
                size=size, usage=(v.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | v.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                                  | v.VK_BUFFER_USAGE_TRANSFER_DST_BIT),
                sharingMode=v.VK_SHARING_MODE_EXCLUSIVE), None)
            req = v.vkGetBufferMemoryRequirements(self.device, buf)
            try:
                mem = v.vkAllocateMemory(self.device, v.VkMemoryAllocateInfo(
                    allocationSize=req.size, memoryTypeIndex=self._memory_type(req.memoryTypeBits)), None)
            except Exception as e:      # noqa: BLE001
                v.vkDestroyBuffer(self.device, buf, None)
                raise VulkanError(f"cannot allocate {size} bytes on {self.name}: {e}") from e
            v.vkBindBufferMemory(self.device, buf, mem, 0)
            mapped = v.vkMapMemory(self.device, mem, 0, size, 0)
            host = np.frombuffer(mapped, np.uint8, count=size)
            va = self._next_va
            self._next_va += -(-size // _VA_ALIGN) * _VA_ALIGN + _VA_ALIGN
            self.allocs[va] = _Alloc(va, size, buf, mem, host)
            bisect.insort(self._bases, va)
            return va

    def free(self, ptr: int) -> None:
        try:
            v = vk()
            with self.lock:
                a = self.allocs.pop(ptr, None)
                if a is None:
                    return
                self._bases.remove(ptr)
                if self.broken is not None:
                    # a dispatch that never finished may still use it: freeing it under the driver crashes
                    # lavapipe (segfault); the memory is left mapped for the life of the process
                    return
                a.host = None
                v.vkUnmapMemory(self.device, a.memory)
                v.vkDestroyBuffer(self.device, a.buffer, None)
                v.vkFreeMemory(self.device, a.memory, None)
        except Exception:               # noqa: BLE001 - interpreter shutdown
            pass

    def find(self, ptr: int) -> tuple:
        """(allocation, byte offset) of a device address."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            a = self.allocs[self._bases[i]]
            if ptr - a.va <= a.nbytes:
                return a, ptr - a.va
        raise VulkanError(f"address {ptr:#x} is not in a Vulkan device array of {self.name}")

    def _host(self, ptr: int, nbytes: int) -> np.ndarray:
        a, off = self.find(ptr)
        if off + nbytes > a.nbytes:
            raise VulkanError(f"access of {nbytes} bytes at offset {off} past a buffer of {a.nbytes} bytes")
        return a.host[off:off + nbytes]

    def upload(self, dst: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self._host(dst, host.nbytes)[...] = host.reshape(-1).view(np.uint8)

    def download(self, host: np.ndarray, src: int) -> None:
        host.reshape(-1).view(np.uint8)[...] = self._host(src, host.nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._host(dst, nbytes)[...] = self._host(src, nbytes)

    def memset8(self, dst: int, value: int, nbytes: int) -> None:
        self._host(dst, nbytes)[...] = value & 0xFF

    # --------------------------------------------------------------------------------- pipelines
    def pipeline(self, spv: bytes, meta: dict) -> _Pipeline:
        key = hashlib.sha256(spv).hexdigest() + meta["entry"]
        hit = self.pipelines.get(key)
        if hit is not None:
            return hit
        v = vk()
        if meta["num_threads"] > self.max_threads:
            raise VulkanError(f"kernel {meta['entry']} wants {meta['num_threads']} invocations per workgroup, "
                              f"{self.name} allows {self.max_threads}: use fewer num_warps")
        if meta.get("shared_bytes", 0) > self.max_shared:
            raise VulkanError(f"kernel {meta['entry']} needs {meta['shared_bytes']} bytes of workgroup memory, "
                              f"{self.name} has {self.max_shared}")
        with self.lock:
            p = _Pipeline()
            p.module = v.vkCreateShaderModule(self.device, v.VkShaderModuleCreateInfo(codeSize=len(spv), pCode=spv),
                                              None)
            nums = [0] + [b[1] for b in meta["bindings"]]
            binds = [v.VkDescriptorSetLayoutBinding(binding=b, descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                    descriptorCount=1, stageFlags=v.VK_SHADER_STAGE_COMPUTE_BIT)
                     for b in nums]
            p.dsl = v.vkCreateDescriptorSetLayout(self.device, v.VkDescriptorSetLayoutCreateInfo(
                bindingCount=len(binds), pBindings=binds), None)
            p.layout = v.vkCreatePipelineLayout(self.device, v.VkPipelineLayoutCreateInfo(
                setLayoutCount=1, pSetLayouts=[p.dsl]), None)
            # the entry-point name must stay alive until the pipeline exists (strings built inline in nested
            # structs are freed before the call: feasibility notes, section 1)
            name = v.ffi.new("char[]", meta["entry"].encode())
            stage = v.VkPipelineShaderStageCreateInfo(stage=v.VK_SHADER_STAGE_COMPUTE_BIT, module=p.module,
                                                      pName=name)
            ci = v.VkComputePipelineCreateInfo(stage=stage, layout=p.layout)
            try:
                p.pipeline = v.vkCreateComputePipelines(self.device, v.VK_NULL_HANDLE, 1, [ci], None)[0]
            except Exception as e:      # noqa: BLE001
                why = ""
                if os.environ.get("JITKERN_VULKAN_DUMP"):
                    with open(os.path.join(os.environ["JITKERN_VULKAN_DUMP"], meta["entry"] + ".spv"), "wb") as f:
                        f.write(spv)
                try:
                    why = spirv_validate(spv) or "spirv-val accepts the module"
                except Exception as ve:     # noqa: BLE001 - no spirv-val here
                    why = str(ve)
                raise VulkanError(f"{self.name} rejected the pipeline of {meta['entry']}: {type(e).__name__} "
                                  f"{e} ({why})") from e
            p.keep = (name, stage, ci)
            p.bindings = [tuple(b) for b in meta["bindings"]]
            p.num_threads = meta["num_threads"]
            p.slots = meta["slots"]
            p.entry = meta["entry"]
            self.pipelines[key] = p
            return p

    # ------------------------------------------------------------------------------------ launch
    def _resolve(self, p: _Pipeline, grid, values) -> tuple:
        """(grid, packed argument slots, [(binding, allocation)]) of one dispatch."""
        g = tuple(int(x) for x in grid)
        for ax in range(3):
            if g[ax] > self.max_groups[ax]:
                raise VulkanError(f"grid {g} exceeds {self.name}'s maxComputeWorkGroupCount {self.max_groups}")
        slots = np.zeros(3 + len(values), np.uint64)
        slots[:3] = g
        infos = []
        values = list(values)
        for k, b, st in p.bindings:
            a = values[k]
            if not isinstance(a, DeviceArray) or a.device is not self:
                raise VulkanError(f"argument {k} of a Vulkan kernel must be a Vulkan device array, "
                                  f"got {type(a).__name__}")
            alloc, off = self.find(a.ptr)
            if off % _ES[st]:
                raise VulkanError(f"argument {k}: a view at byte offset {off} is not aligned to its {st} elements")
            values[k] = off // _ES[st]
            infos.append((b, alloc))
        if len(values):
            slots[3:] = pack_slots(values)
        return g, slots, infos

    def _write_set(self, ds, slots_alloc, slots_off: int, slots_bytes: int, infos) -> None:
        v = vk()
        binfos = [(0, v.VkDescriptorBufferInfo(buffer=slots_alloc.buffer, offset=slots_off, range=slots_bytes))]
        binfos += [(b, v.VkDescriptorBufferInfo(buffer=al.buffer, offset=0, range=al.nbytes)) for b, al in infos]
        writes = [v.VkWriteDescriptorSet(dstSet=ds, dstBinding=b, dstArrayElement=0, descriptorCount=1,
                                         descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, pBufferInfo=[bi])
                  for b, bi in binfos]
        v.vkUpdateDescriptorSets(self.device, len(writes), writes, 0, None)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise VulkanError(f"{self.name} is unusable in this process: {self.broken}")

    def _submit_wait(self, cb, what: str) -> None:
        v = vk()
        self.check_usable()
        v.vkQueueSubmit(self.queue, 1, [v.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[cb])], self.fence)
        from ..env import env_seconds
        limit = env_seconds("JITKERN_VULKAN_TIMEOUT") or (600.0 if self.is_cpu else 120.0)
        try:
            v.vkWaitForFences(self.device, 1, [self.fence], v.VK_TRUE, int(limit * 1e9))
        except v.VkTimeout:
            # the command buffer may still be running: no later submit, re-recording or free may touch what it
            # uses (each crashed lavapipe), so the device fails closed from here on
            self.broken = f"{what} did not finish within {limit:g} s (JITKERN_VULKAN_TIMEOUT)"
            raise VulkanError(f"{what} on {self.name} did not finish within {limit:g} s "
                              f"(JITKERN_VULKAN_TIMEOUT); the device is unusable now") from None
        v.vkResetFences(self.device, 1, [self.fence])

    def launch(self, p: _Pipeline, grid, values) -> None:
        """One dispatch of `grid` workgroups with run-time argument `values` (DeviceArrays, ints, floats)."""
        v = vk()
        self.check_usable()
        g, slots, infos = self._resolve(p, grid, values)
        with self.lock:
            if self._slots is None or self.allocs.get(self._slots) is None or \
                    self.allocs[self._slots].nbytes < slots.nbytes:
                if self._slots is not None:
                    self.free(self._slots)
                self._slots = self.alloc(max(slots.nbytes, 1024))
            sa = self.allocs[self._slots]
            sa.host[:slots.nbytes] = slots.view(np.uint8)
            v.vkResetDescriptorPool(self.device, self.desc_pool, 0)
            ds = v.vkAllocateDescriptorSets(self.device, v.VkDescriptorSetAllocateInfo(
                descriptorPool=self.desc_pool, descriptorSetCount=1, pSetLayouts=[p.dsl]))[0]
            self._write_set(ds, sa, 0, sa.nbytes, infos)
            cb = self.cmd
            v.vkResetCommandBuffer(cb, 0)
            v.vkBeginCommandBuffer(cb, v.VkCommandBufferBeginInfo(
                flags=v.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
            v.vkCmdBindPipeline(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, p.pipeline)
            v.vkCmdBindDescriptorSets(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, p.layout, 0, 1, [ds], 0, None)
            v.vkCmdDispatch(cb, g[0], g[1], g[2])
            v.vkEndCommandBuffer(cb)
            self._submit_wait(cb, f"a dispatch of {p.entry}")

    def load_kernel(self, artifacts: dict, symbol: str, meta: dict) -> "LoadedKernel":
        return LoadedKernel(self, self.pipeline(artifacts["kernel.spv"], meta))


class VulkanGraph:
    """Dispatches recorded under `jk.capture()` and replayed as one command buffer (the Vulkan side of a
    `runtime.launch.Graph`). Recording runs nothing: each launch's argument slots (device addresses turned
    into element offsets, scalars as they were) are kept; the first `replay()` writes them into one buffer,
    gives every dispatch its own descriptor set and records a command buffer with a compute-to-compute memory
    barrier between consecutive dispatches; every replay submits it once and waits. Anything that changes
    between replays must live in the device arrays the kernels read (as for CUDA graphs)."""

    def __init__(self, device: VulkanDevice):
        self.device = device
        self.items: list = []           # (pipeline, grid, slots, infos, values kept alive)
        self.cmd = None
        self.pool = None
        self.slots_va = None

    def add(self, p: _Pipeline, grid, values) -> None:
        if self.cmd is not None:
            raise VulkanError("a Vulkan graph cannot be extended after its first replay")
        g, slots, infos = self.device._resolve(p, grid, values)
        self.items.append((p, g, slots, infos, tuple(values)))

    def __len__(self):
        return len(self.items)

    def _build(self) -> None:
        v = vk()
        dev = self.device
        align = max(int(dev.min_offset_align), 16)
        offs, total = [], 0
        for it in self.items:
            offs.append(total)
            total += -(-it[2].nbytes // align) * align
        with dev.lock:
            self.slots_va = dev.alloc(max(total, 16))
            sa = dev.allocs[self.slots_va]
            nsets = max(len(self.items), 1)
            nbind = sum(1 + len(it[3]) for it in self.items) or 1
            self.pool = v.vkCreateDescriptorPool(dev.device, v.VkDescriptorPoolCreateInfo(
                maxSets=nsets, poolSizeCount=1,
                pPoolSizes=[v.VkDescriptorPoolSize(type=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=nbind)]),
                None)
            self.cmd = v.vkAllocateCommandBuffers(dev.device, v.VkCommandBufferAllocateInfo(
                commandPool=dev.cmd_pool, level=v.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
            cb = self.cmd
            v.vkBeginCommandBuffer(cb, v.VkCommandBufferBeginInfo())
            between = v.VkMemoryBarrier(srcAccessMask=v.VK_ACCESS_SHADER_WRITE_BIT,
                                        dstAccessMask=v.VK_ACCESS_SHADER_READ_BIT | v.VK_ACCESS_SHADER_WRITE_BIT)
            for i, ((p, g, slots, infos, _), off) in enumerate(zip(self.items, offs)):
                sa.host[off:off + slots.nbytes] = slots.view(np.uint8)
                ds = v.vkAllocateDescriptorSets(dev.device, v.VkDescriptorSetAllocateInfo(
                    descriptorPool=self.pool, descriptorSetCount=1, pSetLayouts=[p.dsl]))[0]
                dev._write_set(ds, sa, off, slots.nbytes, infos)
                if i:
                    v.vkCmdPipelineBarrier(cb, v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                                           v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, [between], 0, None, 0, None)
                v.vkCmdBindPipeline(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, p.pipeline)
                v.vkCmdBindDescriptorSets(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, p.layout, 0, 1, [ds], 0, None)
                v.vkCmdDispatch(cb, g[0], g[1], g[2])
            to_host = v.VkMemoryBarrier(srcAccessMask=v.VK_ACCESS_SHADER_WRITE_BIT, dstAccessMask=v.VK_ACCESS_HOST_READ_BIT)
            v.vkCmdPipelineBarrier(cb, v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, v.VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                   [to_host], 0, None, 0, None)
            v.vkEndCommandBuffer(cb)

    def replay(self) -> None:
        if not self.items:
            return
        self.device.check_usable()
        if self.cmd is None:
            self._build()
        with self.device.lock:
            self.device._submit_wait(self.cmd, f"a replay of {len(self.items)} recorded dispatches")

    def __del__(self):
        try:
            v = vk()
            dev = self.device
            if dev.broken is not None:
                return                  # see VulkanDevice._submit_wait: nothing it may use is freed
            if self.cmd is not None:
                v.vkFreeCommandBuffers(dev.device, dev.cmd_pool, 1, [self.cmd])
            if self.pool is not None:
                v.vkDestroyDescriptorPool(dev.device, self.pool, None)
            if self.slots_va is not None:
                dev.free(self.slots_va)
        except Exception:               # noqa: BLE001 - interpreter shutdown
            pass


_device = None
_device_error = None
_dlock = threading.Lock()


def get_device() -> VulkanDevice:
    global _device, _device_error
    if _device is None:
        with _dlock:
            if _device is None:
                if _device_error is not None:
                    raise _device_error
                try:
                    _device = VulkanDevice()
                except VulkanUnavailable as e:
                    _device_error = e
                    raise
    return _device


class standing_in:
    """Context manager: `get_device()` answers with `device` until exit. `jitkern build --target vulkan` runs
    the engine's Vulkan path on a host-memory stand-in (runtime.cuda.HostMemoryDevice with the vulkan target)
    under compile-only launches, so the cache gets the specialisations a Vulkan engine asks for, with or
    without a Vulkan device on the build machine."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        global _device
        self.prev, _device = _device, self.device
        return self.device

    def __exit__(self, *exc):
        global _device
        _device = self.prev
        return False


def is_available() -> bool:
    try:
        get_device()
        return True
    except Exception:           # noqa: BLE001
        return False


# ------------------------------------------------------------------------------------ device arrays
def empty(shape, dtype, device: VulkanDevice | None = None):
    return DeviceArray.empty(shape, dtype, device or get_device())


def zeros(shape, dtype, device: VulkanDevice | None = None):
    return DeviceArray.zeros(shape, dtype, device or get_device())


def from_numpy(host, dtype=None, device: VulkanDevice | None = None):
    return DeviceArray.from_numpy(host, dtype, device or get_device())


def to_device(x, dtype=None, device: VulkanDevice | None = None):
    return x if isinstance(x, DeviceArray) else from_numpy(x, dtype, device)


def launch_args(kernel, grid, args, kwargs, target, jk_graph=None):
    """One dispatch on the Vulkan device (launch.py comes here for the vulkan target): synchronous; inside
    `jk.capture()` (`jk_graph`) recorded into the graph's VulkanGraph instead (replayed as one command buffer).
    Host (numpy) arguments are staged through device memory, outside a capture only."""
    if has_host_arrays(args):
        if jk_graph is not None:
            raise NotImplementedError("jk.capture() on Vulkan records launches on Vulkan device arrays; numpy "
                                      "arguments (a staged copy per launch) cannot be replayed")
        return run_staged(get_device(), args,
                          lambda dargs: launch_args(kernel, grid, dargs, kwargs, target, jk_graph))
    ck, values, g = kernel.resolve_launch(grid, args, kwargs, target)
    if g is None:
        return ck
    if jk_graph is not None:
        if jk_graph.vulkan is None:
            jk_graph.vulkan = VulkanGraph(ck.loaded.device)
        jk_graph.vulkan.add(ck.loaded.pipeline, g, values)
        return ck
    ck.loaded.device.launch(ck.loaded.pipeline, g, values)
    return ck


class LoadedKernel:
    """What a launch needs: the device's pipeline for the kernel's SPIR-V."""
    __slots__ = ("pipeline", "num_threads", "device")

    def __init__(self, device, pipeline):
        self.device, self.pipeline, self.num_threads = device, pipeline, pipeline.num_threads


def load_kernel(artifacts: dict, symbol: str, meta: dict, device: VulkanDevice | None = None) -> LoadedKernel:
    device = device or get_device()
    return LoadedKernel(device, device.pipeline(artifacts["kernel.spv"], meta))


__all__ = ["VulkanDevice", "VulkanGraph", "VulkanError", "VulkanUnavailable", "get_device", "is_available", "standing_in", "empty", "zeros",
           "from_numpy", "to_device", "load_kernel", "launch_args"]
