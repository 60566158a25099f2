"""Weights as the kernels want them: linear layers (dense or GGUF-quantised), norms, embeddings.

Checkpoint bytes are used in place where the kernels can read them (quantised blocks, f32/f16 rows);
fusing q/k/v or gate/up into one matrix, transposing GPT-2's Conv1D weights or widening bf16 vectors
copies, and those copies are reported through `note_host_copy` (JITKERN_LOAD_STATS).
"""
from __future__ import annotations

import numpy as np

from engine.errors import ModelLoadError
from engine.loader import QUANT_TYPES, TensorRef, bf16_to_f32, note_host_copy


def _aligned(a: np.ndarray, itemsize: int) -> np.ndarray:
    """Kernels assume element alignment; a mis-aligned mapped view is copied (and counted)."""
    if a.ctypes.data % itemsize == 0 and a.flags.c_contiguous:
        return a
    note_host_copy(a.nbytes)
    return np.ascontiguousarray(a).copy()


def vector_f32(t: TensorRef) -> np.ndarray:
    """A 1-D/2-D float tensor (norm weights, biases, small tables) as f32."""
    if t.dtype == "f32":
        return _aligned(t.raw, 4)
    if t.dtype == "f16":
        note_host_copy(t.raw.size * 4)
        return t.raw.astype(np.float32)
    if t.dtype == "bf16":
        note_host_copy(t.raw.size * 4)
        return bf16_to_f32(t.raw)
    if t.dtype in QUANT_TYPES:
        note_host_copy(int(np.prod(t.shape)) * 4)
        return t.to_numpy_f32().astype(np.float32)
    raise ModelLoadError(f"unsupported dtype {t.dtype} for a norm/bias vector", path=t.file, tensor=t.name)


class Linear:
    """y = x @ W^T (+ b). W is (N, K): f32 / f16 / bf16 (uint16 storage) or GGUF-quantised raw blocks."""

    def __init__(self, weight, kind: str, n: int, k: int, bias: np.ndarray | None = None, name: str = ""):
        self.weight = weight
        self.kind = kind            # "f32" | "f16" | "bf16" | one of QUANT_TYPES
        self.n, self.k = n, k
        self.bias = bias
        self.name = name
        self.activations = None     # 16-bit weights on a GPU with matrix units: "f32" | "16bit" (ops.matmul.linear)
        # the numpy storage of a 16-bit x this linear takes as it is (uint16 = bf16, float16), None: f32 only.
        # Set with activations "16bit" on the tensor-core GPU path, where the kernel rounds f32 x to the
        # weights' type first anyway: a producer writing x in that type gives the same bits from half the bytes
        self.x16 = None

    def to_device(self, upload) -> None:
        """Weight (raw GGUF blocks as they are, or f32/f16/bf16 rows) and bias onto the GPU (`upload`:
        engine.device.Uploader)."""
        self.weight = upload(self.weight)
        self.bias = upload(self.bias)

    def use_split_layout(self, target) -> None:
        """On a CPU tier, q4_0 / q4_1 / q8_0 weights regrouped into quant and scale planes (one copy at load,
        engine.ops.quant.split_blocks): the matmul kernels then load a step's quants and scales contiguously; the
        same results."""
        from engine.ops.quant import split_blocks, split_layout_for
        if type(self) is Linear and self.quantized and split_layout_for(self.kind, target):
            self.weight = split_blocks(self.weight, self.kind, self.n, self.k)
            note_host_copy(self.weight.nbytes)

    @property
    def quantized(self) -> bool:
        return self.kind in QUANT_TYPES

    @property
    def nbytes(self) -> int:
        return int(self.weight.nbytes)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None, fold_sum: bool = False):
        """y into `out`; fold_sum (dense GPU weights): possibly a engine.ops.matmul.SplitK instead, whose
        ordered sum the next op (rms_norm, act_and_mul) does itself (`out` then untouched)."""
        if self.quantized:
            from engine.ops.quant import matmul_q
            y = matmul_q(x, self.weight, self.kind, self.n, self.k, out=out)
            if self.bias is not None:
                from engine.ops.activation import add
                add(y, _bias_rows(self.bias, y.shape[0]), out=y)
            return y
        from engine.ops.matmul import linear
        xkw = {"x_dtype": self.kind} if x.dtype != np.float32 else {}
        return linear(x, self.weight, bias=self.bias, out=out, activations=self.activations,
                      **({"w_dtype": "bf16"} if self.kind == "bf16" else {}), **xkw,
                      **({"fold_sum": True} if fold_sum else {}))


    def q8_input(self, M: int):
        """(layout, rep4) of the int8 activations `call_q8` takes for an M-row input (what matmul_q would make
        with quantize_q8 on the way), or None when this linear does not take quantised activations (dense
        weights, FP8, stacked parts of different types). Lets the op before it write its output quantised
        (engine.ops.norm.rms_norm_q8, engine.ops.activation.act_and_mul_q8): one launch fewer."""
        if type(self) is not Linear or not self.quantized:
            return None
        from engine.ops._hostargs import is_device, resolve_target
        from engine.ops.quant import _qtype, act_layout, q8_rep4
        q = _qtype(self.kind)
        T = resolve_target(None, self.weight)
        return act_layout(q, M, T), q8_rep4(q, M, self.n, self.k, T, is_device(self.weight))

    def call_q8(self, xq, out):
        """y = x @ W^T (+ b) from x already quantised as `q8_input` says (a engine.ops.quant.Q8Activations)."""
        from engine.ops.quant import matmul_q8
        y = matmul_q8(xq, self.weight, self.kind, self.n, self.k, out=out)
        if self.bias is not None:
            from engine.ops.activation import add
            add(y, _bias_rows(self.bias, y.shape[0]), out=y)
        return y


class StackedLinear(Linear):
    """Linears of different weight types stacked along N (a fused q/k/v or gate/up whose tensors differ in type):
    each part runs on its own weight, its output written into its columns of `out`."""

    def __init__(self, parts: list, name: str = ""):
        super().__init__(None, "mixed:" + "+".join(p.kind for p in parts), sum(p.n for p in parts), parts[0].k,
                         None, name)
        self.parts = parts
        # per part: every output buffer made so far (kept alive: recorded decode graphs point into them) and the
        # largest; a call uses the first M rows of the largest
        self._bufs: list = [[] for _ in parts]

    def to_device(self, upload) -> None:
        for p in self.parts:
            p.to_device(upload)

    @property
    def quantized(self) -> bool:
        return any(p.quantized for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        from engine.ops.activation import copy
        if out is None:
            out = np.empty(x.shape[:-1] + (self.n,), np.float32)
        from engine.ops._hostargs import empty_like_dev
        rows = x.shape[0] if len(x.shape) == 2 else 1
        col = 0
        for j, p in enumerate(self.parts):
            bufs = self._bufs[j]
            if not bufs or bufs[-1].shape[0] < rows:
                bufs.append(empty_like_dev(x, (max(rows, 16), p.n), np.float32))
            y = bufs[-1][:rows] if len(x.shape) == 2 else bufs[-1][0]
            p(x, out=y)
            copy(y, out[:, col:col + p.n] if len(out.shape) == 2 else out[col:col + p.n])
            col += p.n
        return out


class Fp8Linear(Linear):
    """y = x @ (W * scales)^T (+ b) with W the FP8 e4m3 bytes as stored (engine/ops/fp8.py: per-tensor,
    per-channel or 128 x 128 block scales)."""

    def __init__(self, weight, scale, n: int, k: int, bias=None, name: str = ""):
        super().__init__(weight, "f8_e4m3", n, k, bias, name)
        self.scale = scale

    def to_device(self, upload) -> None:
        super().to_device(upload)
        self.scale = upload(self.scale)

    @property
    def quantized(self) -> bool:
        return True

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        from engine.ops.fp8 import matmul_fp8
        y = matmul_fp8(x, self.weight, self.scale, out=out)
        if self.bias is not None:
            from engine.ops.activation import add
            add(y, _bias_rows(self.bias, y.shape[0]), out=y)
        return y


def _fp8_linear(tensors: list, name: str, transpose: bool, biases) -> Linear:
    """FP8 weights: one Fp8Linear per tensor (their scales differ; fused groups run as a StackedLinear)."""
    from engine.ops.fp8 import scale_kind
    if len(tensors) > 1:
        return StackedLinear([_fp8_linear([t], f"{name}[{t.name}]", transpose, [biases[j]] if biases else None)
                              for j, t in enumerate(tensors)], name)
    t = tensors[0]
    if transpose:
        raise ModelLoadError("a transposed (in, out) FP8 weight is not supported", path=t.file, tensor=t.name)
    if t.scale is None or len(t.shape) != 2:
        raise ModelLoadError("an FP8 weight needs a 2-D shape and a scale tensor", path=t.file, tensor=t.name)
    n, k = t.shape
    s = t.scale
    if s.dtype not in ("f32", "bf16", "f16"):
        raise ModelLoadError(f"FP8 scale of dtype {s.dtype} (f32, bf16 or f16 expected)", path=s.file, tensor=s.name)
    scale = vector_f32(s).reshape(s.shape) if s.shape else vector_f32(s).reshape(1)
    try:
        scale_kind(scale, n, k)
    except ValueError as exc:
        raise ModelLoadError(str(exc), path=s.file, tensor=s.name) from None
    if k % 32:
        raise ModelLoadError(f"FP8 weight rows of {k} elements (a multiple of 32 is needed)", path=t.file,
                             tensor=t.name)
    bias = vector_f32(biases[0]) if biases else None
    return Fp8Linear(_aligned(t.raw.reshape(n, k), 1), np.ascontiguousarray(scale, np.float32), n, k, bias, t.name)


def _bias_rows(b: np.ndarray, rows: int) -> np.ndarray:
    """A (rows, N) broadcast view of a bias (stride 0) for the add kernel."""
    if not isinstance(b, np.ndarray):          # a GPU DeviceArray
        return b.as_strided((rows, b.shape[0]), (0, b.strides[0]))
    return np.lib.stride_tricks.as_strided(b, shape=(rows, b.shape[0]), strides=(0, b.strides[0]))


def linear_from(tensors: list, name: str, transpose: bool = False, biases: list | None = None) -> Linear:
    """One Linear from one or more (N_i, K) tensors stacked along N (fused qkv / gate_up)."""
    kinds = {t.dtype for t in tensors}
    if len(kinds) != 1:
        # llama.cpp's presets mix types inside one fused group (Q4_K_M: attn_q/k Q4_K, attn_v Q6_K): one Linear
        # per run of equal types, outputs side by side
        groups, bgroups = [], []
        for j, t in enumerate(tensors):
            if groups and groups[-1][-1].dtype == t.dtype:
                groups[-1].append(t)
                if biases:
                    bgroups[-1].append(biases[j])
            else:
                groups.append([t])
                bgroups.append([biases[j]] if biases else None)
        return StackedLinear([linear_from(g, f"{name}[{g[0].name}]", transpose, bg) for g, bg in
                              zip(groups, bgroups)], name)
    kind = kinds.pop()
    if kind == "f8_e4m3":
        return _fp8_linear(tensors, name, transpose, biases)
    bias = None
    if biases:
        bias = np.concatenate([vector_f32(b) for b in biases]).astype(np.float32) if len(biases) > 1 \
            else vector_f32(biases[0])
    if kind in QUANT_TYPES:
        if transpose:
            raise ModelLoadError("a transposed quantised weight is not supported", path=tensors[0].file,
                                 tensor=tensors[0].name)
        k = tensors[0].shape[-1]
        for t in tensors:
            if t.shape[-1] != k:
                raise ModelLoadError(f"fused tensors disagree on the input size ({t.shape[-1]} vs {k})",
                                     path=t.file, tensor=t.name)
        raws = [t.raw.reshape(t.shape[0], -1) for t in tensors]
        if len(raws) == 1:
            w = raws[0]
        else:
            w = np.concatenate(raws, axis=0)
            note_host_copy(w.nbytes)
        return Linear(np.ascontiguousarray(w), kind, sum(t.shape[0] for t in tensors), k, bias, name)
    if kind not in ("f32", "f16", "bf16"):
        raise ModelLoadError(f"unsupported weight dtype {kind}", path=tensors[0].file, tensor=tensors[0].name)
    mats = []
    for t in tensors:
        a = t.raw.reshape(t.shape)
        if transpose:
            a = np.ascontiguousarray(a.T)
            note_host_copy(a.nbytes)
        mats.append(a)
    if len(mats) == 1:
        w = _aligned(mats[0], mats[0].itemsize)
    else:
        w = np.concatenate(mats, axis=0)
        note_host_copy(w.nbytes)
    return Linear(w, kind, w.shape[0], w.shape[1], bias, name)
