"""LoRA adapters with vLLM's surface: `LoRARequest`, PEFT adapters, several adapters in one batch.

    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate(prompts, sp, lora_request=LoRARequest("sql", 1, "/adapters/sql"))     # or one per prompt

An adapter is a PEFT folder: adapter_config.json (r, lora_alpha, target_modules, use_rslora) and
adapter_model.safetensors (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]),
on q/k/v/o_proj and gate/up/down_proj. Its delta is y += scale * (x A^T) B^T with scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora); the scale is folded into B at load, as vLLM does.

Serving (vLLM's design, on the CPU and CUDA): loaded adapters are kept in host memory (`LoRAManager.adapters`, by
lora_int_id); each step's adapters are copied into one of `max_loras` slots of every wrapped linear (least
recently used slot first; on a GPU the slots live in device memory and a slot's change is one upload per
linear); the scheduler admits requests of at most max_loras distinct adapters at a time. The
model's q/k/v, o, gate/up and down linears are wrapped (`LoRALinear`): the base product, then the segmented
low-rank products of engine.ops.lora over the step's tokens by each token's slot (tokens without an adapter
are skipped), so a batch mixes adapters and the base model in one forward pass. Prefix-cache blocks are keyed by
the adapter (a prompt cached under adapter A is not reused under B or the base model).

On a GPU the step's tiles go over in one copy per step; the engine runs LoRA steps eagerly (no recorded graphs:
a step's tile count is the launch grid, and whether any adapter applies is decided on the host).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field

import numpy as np

# PEFT module name -> (the model's fused linear, position of the module inside it)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be used; the message names the file and field or tensor at fault."""


@dataclass(eq=False)
class LoRARequest:
    """vLLM's `vllm.lora.request.LoRARequest`: an adapter by name, a positive integer id (unique per adapter
    in an engine) and the PEFT folder it is loaded from."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other) -> bool:       # vLLM compares by name
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: per (layer, PEFT module) its A [r, in] and scale * B [out, r], float32."""
    name: str
    int_id: int
    path: str
    rank: int
    scale: float
    weights: dict                # (layer, module) -> (A, B scaled)
    key: str = ""                # the prefix cache's key for this load (unique per load)

    @property
    def modules(self) -> set:
        return {m for _, m in self.weights}


# ------------------------------------------------------------------------------------------------ loading
def _read_safetensors(path: str) -> dict:
    """name -> float32 array of a safetensors file (F32 / F16 / BF16 / F64), read without a framework."""
    from engine.loader import bf16_to_f32
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError) as e:
        raise LoRAError(f"{path}: not a readable safetensors file ({e})") from None
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = dtypes.get(info.get("dtype"))
        if dt is None:
            raise LoRAError(f"{path}: tensor {name!r} has dtype {info.get('dtype')}; adapters are F32, F16 or BF16")
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dt).reshape(info["shape"])
        out[name] = bf16_to_f32(arr) if dt is np.uint16 else arr.astype(np.float32)
    return out


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"adapter folder {path!r} does not exist")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"{cfg_path}: missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise LoRAError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path}: expected a JSON object")
    return cfg


def load_adapter(req: LoRARequest, shapes: dict, max_rank: int, num_layers: int) -> LoRAAdapter:
    """Reads and checks the PEFT adapter at req.lora_path against the model: `shapes` maps each PEFT module the
    model has to its (out, in) features. Raises LoRAError naming the field, file or tensor."""
    path = req.lora_path
    cfg = read_adapter_config(path)
    cfg_path = os.path.join(path, CONFIG_FILE)
    if cfg.get("peft_type", "LORA") not in ("LORA", None):
        raise LoRAError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_path}: field 'r' must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAError(f"{cfg_path}: field 'r' is {r}, above max_lora_rank={max_rank} (start the engine with "
                        f"max_lora_rank >= {r})")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{cfg_path}: field 'lora_alpha' must be a number, got {alpha!r}")
    for fld, ok in (("use_dora", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
                    ("bias", lambda v: v in (None, "none")), ("modules_to_save", lambda v: not v),
                    ("rank_pattern", lambda v: not v), ("alpha_pattern", lambda v: not v)):
        if fld in cfg and not ok(cfg[fld]):
            raise LoRAError(f"{cfg_path}: field {fld!r} = {cfg[fld]!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for t in targets:
            if t not in MODULES:
                raise LoRAError(f"{cfg_path}: field 'target_modules' names {t!r}; supported modules: "
                                f"{', '.join(MODULES)}")
            if t not in shapes:
                raise LoRAError(f"{cfg_path}: field 'target_modules' names {t!r}, which this model does not have "
                                "as a separate projection")
    elif targets is not None and not isinstance(targets, str):
        raise LoRAError(f"{cfg_path}: field 'target_modules' must be a list of module names or a string")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        other = " (adapter_model.bin is not read: convert it to safetensors)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAError(f"{wpath}: missing{other}")
    tensors = _read_safetensors(wpath)
    halves: dict = {}
    for name, arr in tensors.items():
        m = _TENSOR.search(name)
        if m is None or m.group(2) not in MODULES:
            raise LoRAError(f"{wpath}: tensor {name!r} is not a LoRA weight of "
                            f"{'/'.join(MODULES)} in a decoder layer")
        layer, mod, ab = int(m.group(1)), m.group(2), m.group(3)
        if mod not in shapes:
            raise LoRAError(f"{wpath}: tensor {name!r}: this model has no separate {mod}")
        if isinstance(targets, (list, tuple)) and mod not in targets:
            raise LoRAError(f"{wpath}: tensor {name!r}: {mod} is not in target_modules {list(targets)}")
        if not 0 <= layer < num_layers:
            raise LoRAError(f"{wpath}: tensor {name!r}: layer {layer} is out of range (the model has {num_layers})")
        n_out, n_in = shapes[mod]
        want = (r, n_in) if ab == "A" else (n_out, r)
        if arr.shape != want:
            raise LoRAError(f"{wpath}: tensor {name!r} has shape {list(arr.shape)}, expected {list(want)} "
                            f"(r={r}, {mod} maps {n_in} -> {n_out})")
        halves.setdefault((layer, mod), {})[ab] = arr
    weights = {}
    for (layer, mod), h in sorted(halves.items()):
        if set(h) != {"A", "B"}:
            miss = "lora_B" if "A" in h else "lora_A"
            raise LoRAError(f"{wpath}: layer {layer} {mod} has no {miss} weight")
        weights[(layer, mod)] = (np.ascontiguousarray(h["A"], np.float32),
                                 np.ascontiguousarray(h["B"] * np.float32(scale), np.float32))
    if not weights:
        raise LoRAError(f"{wpath}: no LoRA weights in it")
    return LoRAAdapter(req.lora_name, req.lora_int_id, path, r, float(scale), weights)


# ----------------------------------------------------------------------------------------------- serving
class LoRALinear:
    """One of the model's linears with its LoRA slots: the base product, then y += (x A_s^T) B_s^T per token by
    its slot. A fused linear (q/k/v, gate/up) stacks its modules' A rows ([S*R, K]) and gives each module's output
    rows of B only that module's R columns. Everything else is the base Linear's (attribute access falls through);
    q8_input is None, so the forward always hands it f32 x (the GGUF decode fusions that quantise x inside the
    norm or the activation are skipped where an adapter may apply). x16 is None for the same reason: the 16-bit
    input a GPU tensor-core linear may take would reach the low-rank kernels, which read f32 x."""

    x16 = None

    def __init__(self, base, modules: tuple, out_sizes: tuple, manager: "LoRAManager"):
        self.base = base
        self.lora_modules = modules
        self.offsets = tuple(itertools.accumulate((0,) + out_sizes))
        self._mgr = manager
        R, S = manager.max_rank, len(modules)
        # host copies of the slots (filled here), and what the kernels read: the same arrays on the CPU, their
        # device twins on a GPU (a changed slot is uploaded whole)
        self.host_a = np.zeros((manager.max_loras, S * R, base.k), np.float32)
        self.host_b = np.zeros((manager.max_loras, base.n, S * R), np.float32)
        self.lora_a, self.lora_b = manager.arrays.put(self.host_a), manager.arrays.put(self.host_b)
        self.live = set()             # slots whose adapter has weights here

    def __getattr__(self, name):
        return getattr(self.base, name)

    def q8_input(self, T):
        return None

    def load_slot(self, slot: int, adapter: LoRAAdapter | None, layer: int) -> None:
        R = self._mgr.max_rank
        ha, hb = self.host_a, self.host_b
        ha[slot] = 0
        hb[slot] = 0
        self.live.discard(slot)
        for i, mod in enumerate(self.lora_modules):
            w = adapter.weights.get((layer, mod)) if adapter is not None else None
            if w is None:
                continue
            A, B = w
            r = A.shape[0]
            ha[slot, i * R:i * R + r] = A
            hb[slot, self.offsets[i]:self.offsets[i + 1], i * R:i * R + r] = B
            self.live.add(slot)
        if self.lora_a is not ha:
            self.lora_a[slot].copy_from_numpy(ha[slot])
            self.lora_b[slot].copy_from_numpy(hb[slot])

    def __call__(self, x, out=None, **_kw):
        y = self.base(x, out=out)
        mgr = self._mgr
        if mgr.step_slots & self.live:
            from engine.ops.lora import lora_apply
            T = x.shape[0]
            v = mgr.scratch(T, self.lora_a.shape[1])
            lora_apply(x, self.lora_a, self.lora_b, mgr.tiles, y, v)
        return y


_EMPTY = (np.zeros(0, np.int32),) * 3
LORA_DEVICES = ("cpu", "cuda")         # where the low-rank kernels are wired (Vulkan: not yet)


class LoRAManager:
    """The engine's adapters: loaded ones by lora_int_id (host memory), max_loras slots in the model's wrapped
    linears, and each step's token -> slot tiles."""

    def __init__(self, model, max_loras: int, max_rank: int):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        if not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_lora_rank must be a positive integer, got {max_rank!r}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.model = model
        self.adapters: dict[int, LoRAAdapter] = {}
        self._lock = threading.Lock()
        self._loads = itertools.count(1)
        self.slot_of: dict[int, int] = {}           # id(adapter) -> slot
        self.slots: list = [None] * max_loras        # slot -> adapter
        self._lru = list(range(max_loras))          # least recently used first
        self.tiles = _EMPTY
        self.step_slots: set = set()
        # a GPU model: the slots, the step's tiles and the scratch live on its device
        from engine.device import Arrays
        self.arrays = Arrays(getattr(model, "device", "cpu"))
        self.device = self.arrays.device
        self._v = self.arrays.zeros(0)
        self.shapes, self.linears = self._wrap(model)

    # -------------------------------------------------------------------- the model
    def _wrap(self, model):
        if type(model).__name__ != "DecoderLM" or getattr(model, "gpt2", False):
            raise ValueError(f"enable_lora: LoRA adapters are supported on the Llama-family decoder models with "
                             f"separate q/k/v projections, not on {model.cfg.architecture}")
        if model._t("q", 0, False) is None:
            raise ValueError(f"enable_lora: {model.cfg.architecture} stores q/k/v fused (qkv_proj); LoRA adapters "
                             "need separate q_proj/k_proj/v_proj")
        H, KVH, D, hid = model.H, model.KVH, model.D, model.hidden
        shapes = {"q_proj": (H * D, hid), "k_proj": (KVH * D, hid), "v_proj": (KVH * D, hid), "o_proj": (hid, H * D)}
        mlp = all(L.gate_up is not None and L.moe is None for L in model.layers) and \
            model._t("gate", 0, False) is not None
        if mlp:
            inter = model.layers[0].gate_up.n // 2
            shapes.update(gate_proj=(inter, hid), up_proj=(inter, hid), down_proj=(hid, inter))
        linears = []
        for L in model.layers:
            row = {}
            L.qkv = row["qkv"] = LoRALinear(L.qkv, _FUSED["qkv"], (H * D, KVH * D, KVH * D), self)
            L.o = row["o"] = LoRALinear(L.o, _FUSED["o"], (L.o.n,), self)
            if mlp:
                I = L.gate_up.n // 2
                L.gate_up = row["gate_up"] = LoRALinear(L.gate_up, _FUSED["gate_up"], (I, I), self)
                L.down = row["down"] = LoRALinear(L.down, _FUSED["down"], (L.down.n,), self)
            linears.append(row)
        return shapes, linears

    # -------------------------------------------------------------------- adapters
    def get_or_load(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of `req` (by lora_int_id), loaded from req.lora_path the first time."""
        if not isinstance(req, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        ad = self.adapters.get(req.lora_int_id)
        if ad is not None:
            return ad
        ad = load_adapter(req, self.shapes, self.max_rank, len(self.model.layers))
        self._to_model_layout(ad)
        with self._lock:
            have = self.adapters.get(req.lora_int_id)
            if have is not None:
                return have
            ad.key = f"lora:{ad.name}:{ad.int_id}:{next(self._loads)}"
            self.adapters[req.lora_int_id] = ad
        return ad

    def _to_model_layout(self, ad: LoRAAdapter) -> None:
        """A GGUF llama-family checkpoint has its q/k rows permuted for rope on adjacent pairs (engine.loader):
        the adapter's q/k output rows (B's rows) get the same permutation (llama.cpp's converter's)."""
        from engine.loader import ROPE_ADJACENT_PAIRS
        if getattr(self.model.ckpt, "rope_layout", None) != ROPE_ADJACENT_PAIRS:
            return
        heads = {"q_proj": self.model.H, "k_proj": self.model.KVH}
        for (layer, mod), (A, B) in list(ad.weights.items()):
            if mod in heads:
                n = heads[mod]
                B = B.reshape(n, 2, B.shape[0] // n // 2, B.shape[1]).swapaxes(1, 2).reshape(B.shape)
                ad.weights[(layer, mod)] = (A, np.ascontiguousarray(B))

    def remove(self, int_id: int) -> bool:
        """Forgets the adapter (running requests keep theirs until they finish)."""
        with self._lock:
            return self.adapters.pop(int_id, None) is not None

    def by_name(self, name: str) -> LoRAAdapter | None:
        for ad in list(self.adapters.values()):
            if ad.name == name:
                return ad
        return None

    # -------------------------------------------------------------------- steps
    def scratch(self, T: int, R: int):
        if self._v.size < T * R:
            self._v = self.arrays.zeros(max(T * R, 2 * self._v.size))
        return self._v[:T * R].reshape(T, R)

    def _slot_for(self, ad: LoRAAdapter, busy: set) -> int:
        slot = self.slot_of.get(id(ad))
        if slot is None or self.slots[slot] is not ad:
            free = [s for s in self._lru if s not in busy]
            if not free:
                raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
            slot = free[0]
            old = self.slots[slot]
            if old is not None:
                self.slot_of.pop(id(old), None)
            self.slots[slot] = ad
            self.slot_of[id(ad)] = slot
            for layer, row in enumerate(self.linears):
                for lin in row.values():
                    lin.load_slot(slot, ad, layer)
        self._lru.remove(slot)
        self._lru.append(slot)
        return slot

    def prepare_step(self, scheduled) -> None:
        """Puts the step's adapters in slots and cuts its tokens into tiles by slot (scheduled: the step's
        ScheduledRequests in batch order)."""
        counts, slots, busy = [], [], set()
        for s in scheduled:
            ad = getattr(s.request, "lora", None)
            slot = -1 if ad is None else self._slot_for(ad, busy)
            if slot >= 0:
                busy.add(slot)
            counts.append(s.num_tokens)
            slots.append(slot)
        self.step_slots = busy
        if not busy:
            self.tiles = _EMPTY
            return
        from engine.ops.lora import lora_tiles
        tiles = lora_tiles(np.repeat(np.asarray(slots, np.int32), counts))
        if self.device is not None:        # one copy of the three arrays; the kernels read views of it
            dev = self.arrays.put(np.stack(tiles))
            tiles = (dev[0], dev[1], dev[2])
        self.tiles = tiles


def check_lora_args(args) -> None:
    """EngineArgs with enable_lora checked before the model loads: ValueError naming the setting."""
    for name in ("max_loras", "max_lora_rank"):
        v = getattr(args, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    from engine.device import resolve_device
    dev = resolve_device(args.device)
    if dev not in LORA_DEVICES:
        raise ValueError(f"enable_lora: LoRA adapters run on the CPU and CUDA only for now; device={args.device!r} "
                         f"resolves to {dev!r} (pass device='cpu' or 'cuda')")
    if args.tensor_parallel_size not in (None, 1):
        raise ValueError("enable_lora cannot be combined with tensor_parallel_size > 1")
    if args.speculative_config is not None:
        raise ValueError("enable_lora cannot be combined with speculative_config")


def enable_lora(engine, args) -> LoRAManager:
    """The engine's LoRAManager for EngineArgs with enable_lora, or a ValueError naming what cannot have one."""
    dev = getattr(engine.model, "device", "cpu")
    if dev not in LORA_DEVICES:
        raise ValueError(f"enable_lora: LoRA adapters run on the CPU and CUDA only for now (device {dev!r}); use "
                         "device='cpu' or 'cuda'")
    if getattr(engine, "tensor_parallel_size", 1) != 1:
        raise ValueError("enable_lora cannot be combined with tensor_parallel_size > 1")
    if args.speculative_config is not None:
        raise ValueError("enable_lora cannot be combined with speculative_config")
    if getattr(engine, "task", "generate") == "embed":
        raise ValueError("enable_lora: LoRA adapters are for generation models, not embeddings")
    return LoRAManager(engine.model, args.max_loras, args.max_lora_rank)
