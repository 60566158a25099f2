"""Numpy references and dtype helpers for the basic ops' tests (norm, rope, activation, embedding, softmax,
sampling). References compute in float64 from the exact stored inputs."""
import numpy as np


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even (as torch)."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, np.float32))
    r[nan] = 0x7FC0
    return r


def from_bf16(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """`a` stored as dtype 'f32' | 'f16' | 'bf16' (uint16 storage)."""
    if dtype == "f32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f16":
        return np.ascontiguousarray(a, dtype=np.float16)
    if dtype == "bf16":
        return to_bf16(a)
    raise ValueError(dtype)


def as_f64(a: np.ndarray) -> np.ndarray:
    """The exact values an array stores (uint16 = bf16) as float64."""
    if a.dtype == np.uint16:
        return from_bf16(a).astype(np.float64)
    return a.astype(np.float64)


# Tolerances on results rounded to each dtype, relative to the result's magnitude scale: f32 math with
# f32 accumulation (~1e-6 relative), plus one rounding of the stored output (f16: 2^-11, bf16: 2^-8).
RTOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}


def assert_close(got, ref, dtype, what="", scale=None):
    g = as_f64(got)
    ref = np.asarray(ref, np.float64)
    s = np.abs(ref) if scale is None else scale
    tol = RTOL[dtype] * (s + 1e-6 if scale is None else s)
    bad = np.abs(g - ref) > tol + RTOL[dtype] * 1e-3
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches, first at {tuple(i)}: got {g[tuple(i)]}, "
                             f"want {ref[tuple(i)]} (rtol {RTOL[dtype]})")


def rms_norm_ref(x, w, eps, w_off=0.0):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (np.asarray(w, np.float64) + w_off)


def layer_norm_ref(x, w, b, eps):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return y + b if b is not None else y


def gelu_tanh_ref(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def silu_ref(x):
    x = np.asarray(x, np.float64)
    return x / (1 + np.exp(-x))


def rope_ref(x, pos, cache, rot, neox):
    """x [T, H, D] (float64 copy returned), cache f32 [max_pos, rot]."""
    x = np.array(x, np.float64)
    half = rot // 2
    c = cache[pos][:, None, :half].astype(np.float64)
    s = cache[pos][:, None, half:].astype(np.float64)
    if neox:
        x1, x2 = x[..., :half].copy(), x[..., half:rot].copy()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:rot] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
        x[..., 0:rot:2] = x1 * c - x2 * s
        x[..., 1:rot:2] = x2 * c + x1 * s
    return x


def penalties_ref(logits, prompts, outputs, rep, pres, freq):
    """vLLM's apply_penalties (model_executor/layers/utils.py) in float64."""
    out = np.array(logits, np.float64)
    B, V = out.shape
    for b in range(B):
        seen = np.zeros(V, bool)
        seen[np.asarray(prompts[b], np.int64)] = True
        cnt = np.bincount(np.asarray(outputs[b], np.int64), minlength=V)
        seen |= cnt > 0
        pen = np.where(seen, rep[b], 1.0)
        out[b] = np.where(out[b] > 0, out[b] / pen, out[b] * pen)
        out[b] -= freq[b] * cnt
        out[b] -= pres[b] * (cnt > 0)
    return out


def topk_ref(row, k):
    """Indices of the k largest, ties by smaller index first (as topk_rows)."""
    return np.lexsort((np.arange(row.shape[0]), -row.astype(np.float64)))[:k]
