"""Tiny random Llama models written to GGUF in llama.cpp-preset-style type mixes (Q4_K_M, Q3_K_M, Q5_K_M, Q2_K,
IQ4_XS, legacy 32-element types, float types; embeddings and output head in other types than the layers, fused
q/k/v and gate/up groups whose tensors differ in type) through the full engine (chunked prefill: GEMM; then
greedy decode: GEMV), against

1. a float64 numpy Llama forward on the dequantised weights (gguf.quants.dequantize of the very same blocks)
   that rounds the inputs of every quantised matmul to int8 blocks as the kernels do (ref_quantize_q8 of
   tests/ops/test_quant.py, checked bit-exact against quantize_q8 there). That rounding is discontinuous: the
   f32-vs-float64 differences upstream flip a few int8 roundings (each moves a hidden value by ~amax / 127 *
   |w|), so the bound is max |logprob difference| <= 0.1 (measured: 1e-6 where nothing flips, up to 0.05);
   a wrong decoder or a misplaced part of a fused group moves logprobs by several units.
2. the same model stored as float32 through the engine (the dense path): the int8 activation error
   compounded over 2 layers and the head stays below 3% of the logprob spread (measured 0.6-1.2%).

Blocks: `gguf.quants.quantize` where the package can (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4, bf16, f16), else random valid
blocks (random bytes with the f16 scale fields set so the weights have a chosen spread: every type here is linear
in its d / dmin).
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from engine.loader import load_checkpoint  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from tests.model_compare import engine_prompt_logprobs, greedy_on_devices  # noqa: E402
from tests.ops.test_quant import dequant_acts, ref_quantize_q8  # noqa: E402

HIDDEN, HEADS, KV, HD, FFN, VOCAB, LAYERS = 256, 4, 2, 64, 512, 256, 2
_QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4)
_F16_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
               QT.IQ4_NL: (0,), QT.IQ4_XS: (0,)}

# per preset: token_embd, output, then per layer {role: type} (roles as llama.cpp's llama_tensor_get_type sees
# them; layer 0 gets the "more bits" choices, as llama.cpp's use_more_bits does for the first layers)
_L = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _layer(default, **over):
    return {r: over.get(r, default) for r in _L}


MIXES = {
    "Q4_K_M": (QT.Q4_K, QT.Q6_K, [_layer(QT.Q4_K, attn_v=QT.Q6_K, ffn_down=QT.Q6_K),
                                  _layer(QT.Q4_K, ffn_down=QT.Q5_0)]),      # Q5_0: llama.cpp's fallback type
    "Q3_K_M": (QT.Q3_K, QT.Q6_K, [_layer(QT.Q3_K, attn_v=QT.Q5_K, attn_output=QT.Q4_K, ffn_down=QT.Q5_K),
                                  _layer(QT.Q3_K, attn_v=QT.Q4_K, attn_output=QT.Q4_K, ffn_down=QT.Q4_K)]),
    "Q5_K_M": (QT.Q5_K, QT.Q6_K, [_layer(QT.Q5_K, attn_v=QT.Q6_K, ffn_down=QT.Q6_K),
                                  _layer(QT.Q5_K, ffn_down=QT.Q5_1)]),
    "Q2_K": (QT.Q2_K, QT.Q6_K, [_layer(QT.Q2_K, attn_v=QT.Q4_K, attn_output=QT.Q3_K, ffn_down=QT.Q3_K),
                                _layer(QT.Q2_K, attn_v=QT.Q3_K, ffn_down=QT.Q3_K)]),
    "IQ4_XS": (QT.IQ4_XS, QT.Q6_K, [_layer(QT.IQ4_XS, attn_v=QT.IQ4_NL),
                                    _layer(QT.IQ4_XS, ffn_down=QT.IQ4_NL, attn_output=QT.MXFP4)]),   # gpt-oss-style
    "legacy": (QT.Q8_0, QT.BF16, [_layer(QT.Q4_0, attn_v=QT.Q8_0, ffn_down=QT.Q5_1),
                                  _layer(QT.Q4_1, attn_k=QT.Q5_0, ffn_up=QT.Q8_0)]),
    "float": (QT.F16, QT.BF16, [_layer(QT.F16, attn_k=QT.BF16, ffn_up=QT.F32), _layer(QT.BF16, attn_q=QT.F32)]),
}


def _shapes():
    q, kv = HEADS * HD, KV * HD
    per = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
           "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    return per


def _encode(qtype, shape, rng):
    """(what GGUFWriter.add_tensor takes, raw_dtype or None, the float32 values gguf dequantises it to)."""
    std = 1.0 / np.sqrt(shape[1])
    if qtype in _QUANTIZABLE:
        src = (rng.standard_normal(shape) * std).astype(np.float32)
        if qtype == QT.F32:
            return src, None, src
        if qtype == QT.F16:
            a = src.astype(np.float16)
            return a, None, a.astype(np.float32)
        raw = gguf.quants.quantize(src, qtype)
    else:
        block, tsize = gguf.GGML_QUANT_SIZES[qtype]
        nb = shape[1] // block
        raw = rng.integers(0, 256, (shape[0], nb, tsize), dtype=np.uint8)

        def with_fields(*vals):            # the blocks dequantised with these f16 values in the scale fields
            for off, v in zip(_F16_FIELDS[qtype], vals):
                f16 = np.ascontiguousarray(np.broadcast_to(np.asarray(v, np.float16), (shape[0], nb)))
                raw[:, :, off:off + 2] = f16.view(np.uint8).reshape(shape[0], nb, 2)
            return gguf.quants.dequantize(raw.reshape(shape[0], -1), qtype).reshape(shape[0], nb, block)

        a = with_fields(1.0, 0.0)
        ratio = 0.0
        if len(_F16_FIELDS[qtype]) == 2:
            # w = d * A - dmin * B: dmin / d chosen per block so that the block's weights are centred, as real
            # quantised weights are (random independent mins would give every row a large mean)
            b = -with_fields(0.0, 1.0)
            ratio = a.mean(-1) / np.maximum(b.mean(-1), 1e-6)
            a = a - ratio[:, :, None] * b
        scale = rng.uniform(0.7, 1.3, (shape[0], nb)) * std / a.std()
        scale[rng.random((shape[0], nb)) < 0.2] *= -1
        with_fields(scale, scale * ratio)
        raw = raw.reshape(shape[0], -1)
    vals = gguf.quants.dequantize(raw, qtype).reshape(shape).astype(np.float32)
    return raw, qtype, vals


def _write(path, tensors):
    """tensors: {name: (data, raw_dtype or None)}."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(VOCAB - 1)] + ["t1t2"])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["t1 t2"])
    w.add_eos_token_id(1)
    for name, (data, qt) in tensors.items():
        if qt is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _model_pair(tmp_path, mix, seed):
    """Writes the mix and its float32 twin; returns (quantised path, float path, {name: ggml type name},
    {name: float32 values})."""
    rng = np.random.default_rng(seed)
    embd_t, out_t, layers = MIXES[mix]
    quant, ref, types = {}, {}, {}

    def put(name, qt, shape):
        data, raw_dtype, vals = _encode(qt, shape, rng)
        quant[name] = (data, raw_dtype)
        ref[name] = (vals, None)
        types[name] = qt.name

    put("token_embd.weight", embd_t, (VOCAB, HIDDEN))
    put("output.weight", out_t, (VOCAB, HIDDEN))
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")]:
        v = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        quant[name] = ref[name] = (v, None)
    for i, roles in enumerate(layers):
        for role, shape in _shapes().items():
            put(f"blk.{i}.{role}.weight", roles[role], shape)
    return (_write(tmp_path / f"{mix}.gguf", quant), _write(tmp_path / f"{mix}-f32.gguf", ref), types,
            {n: v for n, (v, _) in ref.items()})


def _ref_logprobs(vals, types, prompt):
    """log_softmax of the logits at every prompt position: float64 Llama (GGUF's adjacent-pair rope), the
    inputs of quantised matmuls rounded to int8 blocks first."""
    def mm(x, name):
        if types[name] not in ("F32", "F16", "BF16"):
            qx, xd, _ = ref_quantize_q8(x.astype(np.float32))
            x = dequant_acts(qx, xd)
        return x @ vals[name].astype(np.float64).T

    def rms(x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * vals[name]

    T = len(prompt)
    pos = np.arange(T)[:, None]
    ang = pos * 10000.0 ** (-np.arange(0, HD, 2) / HD)            # (T, HD / 2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):                                                  # (T, heads, HD), pairs (2j, 2j + 1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out

    h = vals["token_embd.weight"][prompt].astype(np.float64)
    causal = np.tril(np.ones((T, T), bool))
    for i in range(LAYERS):
        x = rms(h, f"blk.{i}.attn_norm.weight")
        q = rope(mm(x, f"blk.{i}.attn_q.weight").reshape(T, HEADS, HD))
        k = rope(mm(x, f"blk.{i}.attn_k.weight").reshape(T, KV, HD))
        v = mm(x, f"blk.{i}.attn_v.weight").reshape(T, KV, HD)
        att = np.empty((T, HEADS, HD))
        for hq in range(HEADS):
            kv = hq // (HEADS // KV)
            s = q[:, hq] @ k[:, kv].T / np.sqrt(HD)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, hq] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        h = h + mm(att.reshape(T, HEADS * HD), f"blk.{i}.attn_output.weight")
        x = rms(h, f"blk.{i}.ffn_norm.weight")
        g = mm(x, f"blk.{i}.ffn_gate.weight")
        u = mm(x, f"blk.{i}.ffn_up.weight")
        h = h + mm(g / (1 + np.exp(-g)) * u, f"blk.{i}.ffn_down.weight")
    logits = mm(rms(h, "output_norm.weight"), "output.weight")
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def _prompt_logprobs(path, prompt):
    return engine_prompt_logprobs(path, prompt, VOCAB, num_blocks=32, max_num_batched_tokens=64)


@pytest.mark.parametrize("mix", list(MIXES))
def test_preset_mix_logits_match_float32(tmp_path, mix):
    qpath, fpath, types, vals = _model_pair(tmp_path, mix, seed=list(MIXES).index(mix))
    ckpt = load_checkpoint(qpath, load_tokenizer=False)
    assert {n: ckpt.tensors[n].dtype.upper() for n in types} == {n: t.upper() for n, t in types.items()}
    del ckpt
    prompt = np.random.default_rng(7).integers(2, VOCAB, 21).tolist()
    got = _prompt_logprobs(qpath, prompt)
    ref = _ref_logprobs(vals, types, prompt)[:-1]
    err = np.abs(got - ref).max()
    assert err <= 0.1, f"{mix}: max |logprob - float64 reference with int8 activations| {err:.3g}"
    want = _prompt_logprobs(fpath, prompt)
    spread = want.max() - want.min()
    err = np.abs(got - want).max()
    assert err <= 0.03 * spread, f"{mix}: max |logprob - float32 model| {err:.4g} (spread {spread:.3g})"


def test_unsupported_type_in_a_mix_names_tensor_and_type(tmp_path):
    rng = np.random.default_rng(3)
    qpath = _model_pair(tmp_path, "Q4_K_M", seed=3)[0]
    tensors = {}
    reader = gguf.GGUFReader(qpath)
    for t in reader.tensors:
        data = np.array(t.data)
        tensors[t.name] = (data, None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    # IQ2_XXS: a real llama.cpp type the engine does not compute (random bytes are enough to be refused)
    block, tsize = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS]
    tensors["blk.1.ffn_up.weight"] = (rng.integers(0, 256, (FFN, HIDDEN // block * tsize), dtype=np.uint8),
                                      QT.IQ2_XXS)
    del reader
    path = _write(tmp_path / "iq2.gguf", tensors)
    with pytest.raises(ModelLoadError, match="IQ2_XXS.*not supported") as info:
        load_checkpoint(path, load_tokenizer=False)
    assert info.value.tensor == "blk.1.ffn_up.weight"


@pytest.mark.parametrize("backend", ["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mixed_fused_groups_on_the_device_equal_the_cpu(tmp_path, monkeypatch, backend):
    """Q4_K_M's fused q/k/v holds Q4_K and Q6_K tensors (one matmul per part, each written into its columns):
    the same greedy tokens on the device (`fake`: tests/fake_cuda.py, host memory standing in; `cuda`: a GPU)
    as on the CPU, alone and batched, with decode graphs recorded and replayed."""
    if backend == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    qpath = _model_pair(tmp_path, "Q4_K_M", seed=5)[0]
    rng = np.random.default_rng(9)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (13, 4, 9)]
    got = greedy_on_devices(qpath, prompts, 12, num_blocks=32)
    assert got["cuda"] == got["cpu"]
    assert got["cpu"][0] == got["cpu"][1]
