"""Checkpoint loading: a GGUF file or a safetensors model directory -> config, tokenizer and tensors
whose bytes stay in the file mapping.

``load_checkpoint(path)`` accepts
  * a ``.gguf`` file, or a directory holding exactly one ``.gguf``;
  * a directory with ``model.safetensors``, or a sharded ``model.safetensors.index.json``
    (plus ``config.json``, ``tokenizer.json`` / ``tokenizer_config.json``, optionally
    ``generation_config.json``).

Zero-copy
---------
Every ``TensorRef.raw`` is a numpy view into a read-only ``np.memmap`` of the file: nothing is
read or copied at load time, pages are faulted in when a kernel first touches them. A quantized
tensor's ``raw`` is its blocks, verbatim (uint8, shape ``(*rows, bytes_per_row)``); f32/f16 are
typed views; bf16 (no numpy dtype) is exposed as uint16 -- widen with ``bf16_to_f32``. Views are
not necessarily aligned to their element size (safetensors does not promise it); check
``raw.flags.aligned`` before handing a pointer to code that assumes alignment.
``to_numpy_f32()`` dequantizes (via ``gguf.quants``) into a new array: for references and tests.

Shapes are logical, row-major as the maths sees them: a Linear weight is ``(out_features,
in_features)``. GGUF stores dims fastest-first (ne0 = row length), so its dims are reversed here.

Layout facts the model code must honour (``Checkpoint.rope_layout`` and friends)
------------------------------------------------------------------------------
* **Q/K row permutation (GGUF, arch "llama").** llama.cpp's converter permutes the rows of
  ``attn_q`` / ``attn_k`` within each head so that RoPE rotates *adjacent* pairs (x[2i], x[2i+1])
  (GPT-J / ggml "NORM" rope), where HF's weights rotate the two *halves* (x[i], x[i+d/2])
  (NeoX / rotate_half). GGUF row ``2i`` of a head is HF row ``i``, GGUF row ``2i+1`` is HF row
  ``i + d/2``. Either apply rope on adjacent pairs to these weights (``rope_layout ==
  "adjacent_pairs"``), or un-permute with ``unpermute_qk_rows(w, n_heads)``. Qwen2/Qwen3/Gemma-3
  GGUFs are not permuted (llama.cpp runs them with NeoX rope): ``rope_layout == "halves"``, as for
  every safetensors checkpoint. The permutation moves whole rows, so it commutes with row-wise
  quantization: quantized rows can be used in place with the adjacent-pairs rope.
* **Gemma-3 norms.** HF's Gemma RMSNorm multiplies by ``(1 + w)``; llama.cpp's converter stores
  ``w + 1``. ``Checkpoint.norm_weight_offset`` is the constant to add to a stored norm weight
  (1.0 for a Gemma-3 safetensors checkpoint, 0.0 otherwise).
* **GPT-2.** HF stores its ``c_attn`` / ``c_proj`` / ``c_fc`` weights as ``(in, out)`` (Conv1D);
  GGUF stores ``(out, in)``. ``Checkpoint.linear_layout`` says which ("in_out" / "out_in").
* **Tied output.** A GGUF without ``output.weight`` (such as the embedded SmolLM2) shares
  ``token_embd.weight`` as the output projection; ``config.tie_word_embeddings`` says so.

Load statistics: ``JITKERN_LOAD_STATS=1`` prints one line per phase (open+index, config,
tokenizer, tensors) and the bytes borrowed from the mapping vs copied into host buffers, once at
load end and once at exit (later copies, e.g. a dequantized or transposed weight, are reported by
the model code through ``note_host_copy``).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.arch import arch_of

# ----------------------------------------------------------------------------------- dtypes

# GGUF tensor types this engine accepts, by ggml type name -> our dtype name.
GGUF_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",
              "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K",
              "Q5_K": "q5_K", "Q6_K": "q6_K", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs", "MXFP4": "mxfp4"}
# the quantised ones are computed on their compressed blocks (engine/ops/quant.py)
QUANT_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl",
                         "iq4_xs", "mxfp4"})

# safetensors dtype -> (our dtype name, numpy dtype of the raw view).
SAFETENSORS_DTYPES = {
    "F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16),
    "F64": ("f64", np.float64), "I64": ("i64", np.int64), "I32": ("i32", np.int32),
    "I16": ("i16", np.int16), "I8": ("i8", np.int8), "U8": ("u8", np.uint8), "BOOL": ("bool", np.bool_),
    "F8_E4M3": ("f8_e4m3", np.uint8),     # FP8 weights: bytes, scales in a sibling tensor (see attach_fp8_scales)
}
_RAW_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
# the dtypes above that weights are stored in (Checkpoint.weight_kinds; the integer / bool ones are buffers)
_WEIGHT_KINDS = frozenset({"f32", "f64", "f16", "bf16", "f8_e4m3"}) | QUANT_TYPES

ROPE_ADJACENT_PAIRS = "adjacent_pairs"
ROPE_HALVES = "halves"


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32 (a new array)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint16:
        raise TypeError(f"bf16 data must be uint16 bit patterns, got {raw.dtype}")
    return (raw.astype(np.uint32) << 16).view(np.float32)


def unpermute_qk_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGUF layout (adjacent rope pairs) -> HF layout (halves).

    ``weight`` has shape (n_heads * head_dim, ...) (rows may be quantized blocks: whole rows move).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows is not a multiple of 2 * n_heads ({n_heads})")
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


# ----------------------------------------------------------------------------------- tensors

@dataclass(eq=False)
class TensorRef:
    """One tensor of a checkpoint, its bytes borrowed from the file mapping.

    ``shape``: logical element shape (row-major, Linear weights (out, in)).
    ``dtype``: "f32" | "f16" | "bf16" | one of QUANT_TYPES ("q8_0", "q4_K", "iq4_xs", ...)
    (safetensors may also give "f64", "i64", "i32", "i16", "i8", "u8", "bool").
    ``raw``: read-only numpy view of the stored bytes (see module doc). ``file``/``offset``: where.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    raw: np.ndarray
    file: Path
    offset: int
    block_size: int = 1          # elements per quant block (1 for plain dtypes)
    block_bytes: int = 0         # bytes per quant block (itemsize for plain dtypes)
    scale: "TensorRef | None" = None   # f8_e4m3: the sibling scale tensor (`<name>_scale` or `<name>_scale_inv`)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANT_TYPES

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def to_numpy_f32(self) -> np.ndarray:
        """The values as a new float32 array of ``shape`` (dequantized / widened). Not zero-copy."""
        if self.dtype == "f32":
            return np.array(self.raw, dtype=np.float32)
        if self.dtype == "bf16":
            return bf16_to_f32(self.raw).reshape(self.shape)
        if self.is_quantized:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            qtype = GGMLQuantizationType[_GGML_NAME[self.dtype]]
            return np.asarray(dequantize(np.asarray(self.raw), qtype), dtype=np.float32).reshape(self.shape)
        return np.asarray(self.raw, dtype=np.float32).reshape(self.shape)

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r}, shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes})"


_GGML_NAME = {v: k for k, v in GGUF_TYPES.items()}


# ----------------------------------------------------------------------------------- load statistics

class LoadStats:
    """Per-phase wall time and bytes borrowed from the mapping vs copied into host memory."""

    def __init__(self):
        self.phases: list[tuple[str, float]] = []
        self.borrowed_bytes = 0
        self.copied_bytes = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, time.perf_counter() - t0))

    def lines(self, label: str = "load-end") -> list[str]:
        out = [f"[jitkern load] {name:<14} {secs:8.3f} s" for name, secs in self.phases]
        out.append(self.bytes_line(label))
        return out

    def bytes_line(self, label: str) -> str:
        gib = 1 << 30
        return (f"[jitkern load] bytes@{label:<8} host_copy={self.copied_bytes / gib:.3f} GiB "
                f"borrowed={self.borrowed_bytes / gib:.3f} GiB "
                f"(host_copy={self.copied_bytes} B borrowed={self.borrowed_bytes} B)")


# Process-wide byte totals across loads, printed again at exit (copies can happen after load).
PROCESS_LOAD_STATS = LoadStats()
_exit_hook_installed = False


def load_stats_enabled() -> bool:
    return os.environ.get("JITKERN_LOAD_STATS", "") not in ("", "0")


def note_host_copy(nbytes: int) -> None:
    """Record bytes materialized from a checkpoint into a host buffer after load (dequantize, merge,
    transpose): they show in the ``bytes@exit`` line of JITKERN_LOAD_STATS."""
    PROCESS_LOAD_STATS.copied_bytes += int(nbytes)


def _print_exit_stats() -> None:
    if load_stats_enabled():
        print(PROCESS_LOAD_STATS.bytes_line("exit"), file=sys.stderr)


# ----------------------------------------------------------------------------------- checkpoint

@dataclass(eq=False)
class Checkpoint:
    """A loaded checkpoint. ``tensors`` maps the file's own tensor names to ``TensorRef``s."""

    path: Path
    format: str                                  # "gguf" | "safetensors"
    files: list[Path]
    config: ModelConfig
    tensors: dict[str, TensorRef]
    tokenizer: Any = None                        # engine.tokenizer.Tokenizer, or None if not loaded
    stop_token_ids: list[int] = field(default_factory=list)
    rope_layout: str | None = ROPE_HALVES        # ROPE_ADJACENT_PAIRS | ROPE_HALVES | None (no rope)
    norm_weight_offset: float = 0.0
    linear_layout: str = "out_in"
    metadata: dict = field(default_factory=dict)  # GGUF general.* keys / safetensors __metadata__
    stats: LoadStats = field(default_factory=LoadStats)
    gguf_reader: Any = None

    def __getitem__(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError("tensor not found in the checkpoint", path=self.path, tensor=name) from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> TensorRef | None:
        return self.tensors.get(name)

    @property
    def borrowed_bytes(self) -> int:
        return self.stats.borrowed_bytes

    def weight_kinds(self) -> frozenset[str]:
        """The storage types of the weight matrices (tensors of two or more dimensions that hold weights: 1-D
        norms and biases, integer and bool buffers left out), as the loader named them on each TensorRef:
        "f32", "f64", "f16", "bf16", "f8_e4m3" or a GGUF quant type; gpt-oss's MXFP4 safetensors experts
        (uint8 `*_blocks`, engine.models.moe._gpt_oss_experts) count as "mxfp4", as their GGUF conversion does.
        What "auto" settings are decided from before the model is built (engine.sizing.resolve_kv_cache_dtype)."""
        kinds = set()
        for t in self.tensors.values():
            if len(t.shape) < 2:
                continue
            if t.dtype in _WEIGHT_KINDS:
                kinds.add(t.dtype)
            elif t.dtype == "u8" and t.name.endswith("_blocks"):
                kinds.add("mxfp4")
        return frozenset(kinds)


def load_checkpoint(path: str | os.PathLike, *, tokenizer_config: str | os.PathLike | None = None,
                    load_tokenizer: bool = True, check_shapes: bool = True) -> Checkpoint:
    """Open a checkpoint (see module doc). Raises ``ModelLoadError`` naming file/tensor/key.

    ``tokenizer_config``: a tokenizer_config.json overriding the checkpoint's (chat template,
    bos/eos, add_bos_token) -- the CLI's ``--tokenizer-config``.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError("no such file or directory", path=path)
    stats = LoadStats()
    t0 = time.perf_counter()
    if path.is_dir():
        if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
            ckpt = _load_safetensors_dir(path, stats, tokenizer_config, load_tokenizer)
        else:
            ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
            if len(ggufs) == 1:
                ckpt = _load_gguf(ggufs[0], stats, tokenizer_config, load_tokenizer)
                ckpt.path = path
            elif len(ggufs) > 1:
                raise ModelLoadError(f"the directory holds {len(ggufs)} .gguf files "
                                     f"({', '.join(p.name for p in ggufs)}); pass the one to load", path=path)
            else:
                raise ModelLoadError("no checkpoint found: expected model.safetensors, "
                                     "model.safetensors.index.json or one .gguf file", path=path)
    elif path.suffix.lower() == ".gguf":
        ckpt = _load_gguf(path, stats, tokenizer_config, load_tokenizer)
    elif path.suffix.lower() == ".safetensors":
        ckpt = _load_safetensors_dir(path.parent, stats, tokenizer_config, load_tokenizer, only_file=path)
    else:
        raise ModelLoadError("not a checkpoint: expected a .gguf file or a model directory", path=path)

    if check_shapes:
        check_tensor_shapes(ckpt)
    PROCESS_LOAD_STATS.borrowed_bytes += stats.borrowed_bytes
    PROCESS_LOAD_STATS.copied_bytes += stats.copied_bytes
    if load_stats_enabled():
        global _exit_hook_installed
        for line in stats.lines("load-end"):
            print(line, file=sys.stderr)
        print(f"[jitkern load] {'total':<14} {time.perf_counter() - t0:8.3f} s", file=sys.stderr)
        if not _exit_hook_installed:
            atexit.register(_print_exit_stats)
            _exit_hook_installed = True
    return ckpt


def _progress(items, total: int, desc: str):
    """A tqdm bar over tensors that only shows when the phase takes over a second, on a terminal."""
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", disable=None, delay=1.0, leave=False)


# ----------------------------------------------------------------------------------- GGUF

def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` (memory-mapped) over ``path``, with every header problem turned into a
    ``ModelLoadError`` naming the file (and tensor): truncated data, unknown/unsupported tensor type,
    unreadable header."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError("file not found", path=path)
    size = path.stat().st_size
    if size < 24:
        raise ModelLoadError(f"file too small to be GGUF ({size} bytes)", path=path)

    class CheckedReader(GGUFReader):
        # GGUFReader builds its tensor views in _build_tensors; vet each tensor-info record first so
        # a bad one fails with a message naming it, not with a numpy reshape error.
        def _build_tensors(self, start_offs, fields):
            _vet_gguf_tensor_infos(path, len(self.data), start_offs, fields)
            return super()._build_tensors(start_offs, fields)

        # The same reads as GGUFReader._get, sliced from a plain ndarray view of the mapping instead
        # of the np.memmap: np.memmap's __getitem__/__array_finalize__ cost ~2/3 of the header parse
        # (~250k small reads for a 49k-token vocabulary: 2.0 s -> 0.6 s). Same bytes, same dtypes;
        # tests/test_loader.py compares the result with the stock reader.
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    try:
        return CheckedReader(path, "r")
    except ModelLoadError:
        raise
    except Exception as exc:   # ValueError/IndexError/KeyError/UnicodeDecodeError from deep inside gguf
        raise ModelLoadError(f"unreadable GGUF header ({type(exc).__name__}: {exc}); the file is "
                             f"{size} bytes -- truncated or not a GGUF file?", path=path) from None


def _vet_gguf_tensor_infos(path: Path, file_size: int, data_start: int, fields) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for f in fields:
        _, name_data, _, dims, raw_type, rel_offset = f.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        code = int(raw_type[0])
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise ModelLoadError(f"unknown tensor type code {code}", path=path, tensor=name) from None
        if qtype.name not in GGUF_TYPES:
            raise ModelLoadError(f"tensor type {qtype.name} is not supported (supported: "
                                 f"{', '.join(GGUF_TYPES)})", path=path, tensor=name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        dims_l = [int(d) for d in dims.tolist()]
        if dims_l and dims_l[0] % block:
            raise ModelLoadError(f"row length {dims_l[0]} is not a multiple of the {qtype.name} block "
                                 f"size {block}", path=path, tensor=name)
        n_elem = int(np.prod(dims_l, dtype=np.int64)) if dims_l else 1
        start = data_start + int(rel_offset[0])
        end = start + n_elem // block * type_size
        if end > file_size:
            raise ModelLoadError(f"truncated file: the tensor's data spans bytes {start}..{end} but the "
                                 f"file has only {file_size} bytes", path=path, tensor=name)


def _load_gguf(path: Path, stats: LoadStats, tokenizer_config, load_tokenizer: bool) -> Checkpoint:
    from engine.config import gguf_field_value

    with stats.phase("mmap+index"):
        reader = open_gguf(path)
    with stats.phase("config"):
        config = ModelConfig.from_gguf_metadata(reader, source=str(path))
        metadata = {k: gguf_field_value(f) for k, f in reader.fields.items() if k.startswith("general.")}
    tokenizer = None
    with stats.phase("tokenizer"):
        if load_tokenizer:
            from engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(reader, path=path, tokenizer_config=tokenizer_config)
    tensors: dict[str, TensorRef] = {}
    with stats.phase("tensors"):
        for t in _progress(reader.tensors, len(reader.tensors), "mapping tensors"):
            ref = _gguf_tensor_ref(path, reader, t)
            tensors[t.name] = ref
            stats.borrowed_bytes += ref.nbytes

    stops = list(config.eos_token_ids)
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = reader.fields.get(key)
        if f is not None and int(gguf_field_value(f)) not in stops:
            stops.append(int(gguf_field_value(f)))
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    # the architectures whose Q/K rows llama.cpp's converter permutes (ggml rope type NORM): Arch.gguf_qk_permuted
    return Checkpoint(
        path=path, format="gguf", files=[path], config=config, tensors=tensors, tokenizer=tokenizer,
        stop_token_ids=stops,
        rope_layout=None if config.rope_theta is None else (
            ROPE_ADJACENT_PAIRS if arch_of(config.architecture).gguf_qk_permuted else ROPE_HALVES),
        norm_weight_offset=0.0, linear_layout="out_in", metadata=metadata, stats=stats, gguf_reader=reader)


def _gguf_tensor_ref(path: Path, reader, t) -> TensorRef:
    from gguf import GGML_QUANT_SIZES

    dtype = GGUF_TYPES[t.tensor_type.name]
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))     # ggml ne0 (row length) is last here
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    buf = reader.data[t.data_offset:t.data_offset + t.n_bytes]      # np.memmap slice: no copy
    if dtype in _RAW_DTYPES:
        raw = buf.view(_RAW_DTYPES[dtype]).reshape(shape)
    else:
        raw = buf.reshape(*shape[:-1], shape[-1] // block * type_size)
    return TensorRef(name=t.name, shape=shape, dtype=dtype, raw=raw, file=path, offset=int(t.data_offset),
                     block_size=block, block_bytes=type_size)


# ----------------------------------------------------------------------------------- safetensors
#
# safetensors' own numpy API (safe_open(..., framework="numpy").get_tensor, safetensors.numpy.load)
# returns *copies*: it reads the bytes into a fresh buffer. The format is simple -- a little-endian
# u64 header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then the raw
# data -- so we parse the header and hand out np.memmap views, and use the library only to validate
# the header (offsets contiguous, in bounds, no overlap) with its own checks.

def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section). Errors name the file."""
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError(f"file too small to be safetensors ({size} bytes)", path=path)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if 8 + n > size:
            raise ModelLoadError(f"unreadable safetensors header: it claims {n} bytes but the file has "
                                 f"{size} bytes -- truncated or not a safetensors file?", path=path)
        blob = fh.read(n)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"unreadable safetensors header: {exc}", path=path) from None
    if not isinstance(header, dict):
        raise ModelLoadError("unreadable safetensors header: not a JSON object", path=path)
    return header, 8 + n


def _map_safetensors_file(path: Path, stats: LoadStats, wanted: set[str] | None) -> tuple[dict, dict]:
    """TensorRefs for the tensors of one .safetensors file (all, or those in ``wanted``)."""
    if not path.is_file():
        raise ModelLoadError("file not found", path=path)
    header, data_start = read_safetensors_header(path)
    file_size = path.stat().st_size
    metadata = header.pop("__metadata__", None) or {}
    refs: dict[str, TensorRef] = {}
    entries = []
    for name, info in header.items():
        try:
            st_dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ModelLoadError(f"malformed header entry {info!r}", path=path, tensor=name) from None
        if st_dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(f"unsupported dtype {st_dtype} (supported: {', '.join(SAFETENSORS_DTYPES)})",
                                 path=path, tensor=name)
        dtype, np_dtype = SAFETENSORS_DTYPES[st_dtype]
        expect = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if end - begin != expect or begin < 0:
            raise ModelLoadError(f"header gives {end - begin} bytes (offsets {begin}..{end}) for shape "
                                 f"{list(shape)} of {st_dtype}, which needs {expect}", path=path, tensor=name)
        if data_start + end > file_size:
            raise ModelLoadError(f"truncated file: the tensor's data spans bytes {data_start + begin}.."
                                 f"{data_start + end} but the file has only {file_size} bytes",
                                 path=path, tensor=name)
        entries.append((name, dtype, np_dtype, shape, begin, end))

    # The library's validation (contiguity, overlaps, trailing data ...), reported with the file name.
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            lib_keys = set(f.keys())
    except Exception as exc:
        raise ModelLoadError(f"invalid safetensors file: {exc}", path=path) from None
    if lib_keys != {e[0] for e in entries}:
        raise ModelLoadError("safetensors header disagrees with the library's reading of it", path=path)

    mm = np.memmap(path, dtype=np.uint8, mode="r") if file_size > 0 else None
    for name, dtype, np_dtype, shape, begin, end in entries:
        if wanted is not None and name not in wanted:
            continue
        buf = mm[data_start + begin:data_start + end]
        raw = buf.view(np_dtype).reshape(shape)
        itemsize = np.dtype(np_dtype).itemsize
        refs[name] = TensorRef(name=name, shape=shape, dtype=dtype, raw=raw, file=path,
                               offset=data_start + begin, block_size=1, block_bytes=itemsize)
        stats.borrowed_bytes += raw.nbytes
    return refs, metadata


def _load_safetensors_dir(directory: Path, stats: LoadStats, tokenizer_config, load_tokenizer: bool,
                          only_file: Path | None = None) -> Checkpoint:
    from engine.tokenizer import Tokenizer, stop_token_ids

    with stats.phase("mmap+index"):
        index_path = directory / "model.safetensors.index.json"
        if only_file is not None:
            shards = {only_file: None}
        elif (directory / "model.safetensors").is_file():
            shards = {directory / "model.safetensors": None}
        else:
            try:
                index = json.loads(index_path.read_text(encoding="utf-8"))
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"unreadable shard index: {type(exc).__name__}: {exc}",
                                     path=index_path) from None
            shards: dict[Path, set[str] | None] = {}
            for name, shard in weight_map.items():
                shards.setdefault(directory / shard, set()).add(name)
            for shard in shards:
                if not shard.is_file():
                    raise ModelLoadError(f"shard named in {index_path.name} is missing", path=shard)
    with stats.phase("config"):
        config = ModelConfig.from_hf_config_file(directory / "config.json")
    tokenizer = None
    with stats.phase("tokenizer"):
        if load_tokenizer:
            tokenizer = Tokenizer.from_pretrained_dir(directory, tokenizer_config=tokenizer_config)
    tensors: dict[str, TensorRef] = {}
    metadata: dict = {}
    with stats.phase("tensors"):
        for shard, wanted in _progress(list(shards.items()), len(shards), "mapping shards"):
            refs, meta = _map_safetensors_file(shard, stats, wanted)
            if wanted is not None:
                missing = sorted(wanted - refs.keys())
                if missing:
                    raise ModelLoadError(f"the shard index places this tensor in {shard.name}, which does "
                                         "not contain it", path=shard, tensor=missing[0])
            for name in refs:
                if name in tensors:
                    raise ModelLoadError("tensor appears in two shards", path=shard, tensor=name)
            tensors.update(refs)
            metadata.update(meta)

    attach_fp8_scales(tensors)
    from engine.models.llava import is_llava, rename_tensors
    if is_llava(config):
        tensors = rename_tensors(tensors)      # the language model under its own names, beside the vision tower
    rec = arch_of(config.architecture)
    stops = stop_token_ids(directory / "config.json", directory / "generation_config.json")
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return Checkpoint(
        path=directory, format="safetensors", files=list(shards), config=config, tensors=tensors,
        tokenizer=tokenizer, stop_token_ids=stops,
        rope_layout=None if config.rope_theta is None else ROPE_HALVES,
        norm_weight_offset=rec.hf_norm_offset, linear_layout=rec.hf_linear_layout,
        metadata=metadata, stats=stats)


def attach_fp8_scales(tensors: dict) -> None:
    """FP8 (F8_E4M3) weights get their scale tensor: compressed-tensors' `<name>_scale` (per-tensor or
    per-channel) or DeepSeek/Qwen FP8's `<name>_scale_inv` (128 x 128 blocks; a multiplier despite the name).
    A FP8 weight without either fails naming it."""
    for name, ref in tensors.items():
        if ref.dtype != "f8_e4m3":
            continue
        scale = tensors.get(name + "_scale") or tensors.get(name + "_scale_inv")
        if scale is None:
            raise ModelLoadError(f"FP8 weight without a scale tensor (looked for '{name}_scale' and "
                                 f"'{name}_scale_inv')", path=ref.file, tensor=name)
        ref.scale = scale


# ----------------------------------------------------------------------------------- shape checks

_LAYER_RE = re.compile(r"^(?:blk|layers|h)\.(\d+)\.(.+)$")
# Prefixes under which HF checkpoints keep the text model (Gemma-3 multimodal nests it); tensors
# under any other prefix (a vision tower, a projector) are not checked against the text config.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "transformer.")


def _core_name(name: str) -> str:
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def expected_shapes(config: ModelConfig, fmt: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(global tensors, per-layer tensor suffixes) -> expected logical shape, for known families."""
    H, V, F = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv, hd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.head_dim
    P = config.max_position_embeddings
    if arch_of(config.architecture).position == "learned":          # GPT-2's layout
        if fmt == "gguf":
            return ({"token_embd.weight": (V, H), "position_embd.weight": (P, H), "output_norm.weight": (H,),
                     "output.weight": (V, H)},
                    {"attn_qkv.weight": (3 * H, H), "attn_output.weight": (H, H), "ffn_up.weight": (F, H),
                     "ffn_down.weight": (H, F), "attn_norm.weight": (H,), "ffn_norm.weight": (H,)})
        return ({"wte.weight": (V, H), "wpe.weight": (P, H), "ln_f.weight": (H,)},
                {"attn.c_attn.weight": (H, 3 * H), "attn.c_proj.weight": (H, H), "mlp.c_fc.weight": (H, F),
                 "mlp.c_proj.weight": (F, H), "ln_1.weight": (H,), "ln_2.weight": (H,)})
    if fmt == "gguf":
        return ({"token_embd.weight": (V, H), "output.weight": (V, H), "output_norm.weight": (H,)},
                {"attn_q.weight": (q, H), "attn_k.weight": (kv, H), "attn_v.weight": (kv, H),
                 "attn_output.weight": (H, q), "ffn_gate.weight": (F, H), "ffn_up.weight": (F, H),
                 "ffn_down.weight": (H, F), "attn_norm.weight": (H,), "ffn_norm.weight": (H,),
                 "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                 "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                 "post_attention_norm.weight": (H,), "post_ffw_norm.weight": (H,)})
    return ({"embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,)},
            {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
             "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
             "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
             "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
             "pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,),
             "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})


_REQUIRED_LAYER = {
    "gguf": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_up.weight",
             "ffn_down.weight", "attn_norm.weight", "ffn_norm.weight"),
    "safetensors": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                    "input_layernorm.weight", "post_attention_layernorm.weight"),
}
def _arch_layer_shapes(cfg: ModelConfig, fmt: str) -> dict[str, tuple]:
    """Per-layer shapes that differ from the llama layout: Phi-3's fused q/k/v and gate/up, OLMo 2's q/k
    norms over all heads at once."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gguf = fmt == "gguf"
    rec = arch_of(cfg.architecture)
    if rec.fused_gate_up:
        return {("attn_qkv.weight" if gguf else "self_attn.qkv_proj.weight"): (q + 2 * kv, H),
                ("ffn_up.weight" if gguf else "mlp.gate_up_proj.weight"): (2 * F, H)}
    if rec.mla:
        # multi-head latent attention: q is heads x (qk_nope + qk_rope) wide, o reads heads x v_head_dim
        # (engine/models/mla.py checks the MLA projections themselves)
        ex = cfg.extra or {}
        nope, rope, v = (int(ex.get(k) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        return {("attn_q.weight" if gguf else "self_attn.q_proj.weight"): (cfg.num_heads * (nope + rope), H),
                ("attn_output.weight" if gguf else "self_attn.o_proj.weight"): (H, cfg.num_heads * v)}
    if rec.qk_norm_full_width:
        return {("attn_q_norm.weight" if gguf else "self_attn.q_norm.weight"): (q,),
                ("attn_k_norm.weight" if gguf else "self_attn.k_norm.weight"): (kv,)}
    return {}



def check_tensor_shapes(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint whose tensors disagree with its config (naming tensor, expected, found):
    known tensor names must have the shape the config implies, layer indices must be < num_layers,
    and for the llama-like families every layer's attention/MLP weights must be present."""
    cfg = ckpt.config
    rec = arch_of(cfg.architecture)
    glob, per_layer = expected_shapes(cfg, ckpt.format)
    per_layer = {**per_layer, **_arch_layer_shapes(cfg, ckpt.format)}
    seen_layers: dict[int, set[str]] = {}
    for name, ref in ckpt.tensors.items():
        core = _core_name(name)
        m = _LAYER_RE.match(core)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if layer >= cfg.num_layers and rec.mla and ckpt.format != "gguf" and \
                    layer < cfg.num_layers + int((cfg.extra or {}).get("num_nextn_predict_layers") or 0):
                continue            # DeepSeek-V3's multi-token-prediction layers (not run; transformers skips them too)
            if layer >= cfg.num_layers:
                raise ModelLoadError(f"layer index {layer} but the config says {cfg.num_layers} layers",
                                     path=ref.file, tensor=name)
            seen_layers.setdefault(layer, set()).add(suffix)
            want = per_layer.get(suffix)
        else:
            want = glob.get(core)
        if want is not None and m and "q_norm" in suffix and len(ref.shape) == 1 and \
                ref.shape[0] == cfg.num_heads * cfg.head_dim:
            want = None        # OLMoE: q_norm over all heads at once (k_norm likewise, checked below)
        if want is not None and m and "k_norm" in suffix and len(ref.shape) == 1 and \
                ref.shape[0] == cfg.num_kv_heads * cfg.head_dim:
            want = None
        if want is not None and tuple(ref.shape) != tuple(want):
            raise ModelLoadError(f"shape disagrees with the config: expected {list(want)}, found "
                                 f"{list(ref.shape)}", path=ref.file, tensor=name)
    if rec.llama_layout:
        required = _REQUIRED_LAYER[ckpt.format]
        for layer in range(cfg.num_layers):
            have = seen_layers.get(layer, set())
            # a mixture-of-experts layer (Mixtral GGUFs are arch "llama") has expert tensors, not ffn_up/down
            moe_layer = "ffn_gate_inp.weight" in have
            for suffix in required:
                if suffix not in have and not (moe_layer and suffix.startswith("ffn_")):
                    name = f"blk.{layer}.{suffix}" if ckpt.format == "gguf" else f"model.layers.{layer}.{suffix}"
                    raise ModelLoadError(f"missing tensor for layer {layer} (config: {cfg.num_layers} layers)",
                                         path=ckpt.files[0] if len(ckpt.files) == 1 else ckpt.path, tensor=name)
