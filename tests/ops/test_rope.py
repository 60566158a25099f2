"""RoPE: the cos/sin cache against HF transformers' rope init functions (default, linear, llama3, yarn), and
the in-place kernel (NeoX and GPT-J layouts, partial rotary, strided q/k views of a fused qkv buffer,
f32/f16/bf16) against numpy on every runnable tier."""
import warnings
import zlib

import numpy as np
import pytest

import jitkern as jk
from engine.ops.rope import rope, rope_cos_sin_cache, rope_inv_freq

from .ref_basic import as_f64, assert_close, rope_ref, stored

ROPE_CONFIGS = [
    (128, {"rope_type": "default", "rope_theta": 10000.0}),
    (128, {"rope_type": "default", "rope_theta": 1000000.0}),
    (64, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}),
    (128, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
    (64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}),
    (128, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 2048,
           "attention_factor": 0.9, "partial_rotary_factor": 0.5}),
    (96, {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
          "truncate": False}),
]


def _hf(head_dim, params, max_pos):
    """(inv_freq, attention scaling, cos [P, rot/2], sin [P, rot/2]) from transformers."""
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.logging.set_verbosity_error()
        cfg = tr.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                             max_position_embeddings=max_pos, rope_parameters=dict(params))
        if params["rope_type"] == "default":
            inv, attn = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        else:
            inv, attn = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)
        emb = LlamaRotaryEmbedding(cfg)
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])
    half = inv.shape[0]
    return inv.numpy(), float(attn), cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


@pytest.mark.parametrize("head_dim,params", ROPE_CONFIGS,
                         ids=[f"{p['rope_type']}-{i}" for i, (_, p) in enumerate(ROPE_CONFIGS)])
def test_cos_sin_cache_matches_transformers(head_dim, params):
    max_pos = 8192
    inv_hf, attn_hf, cos_hf, sin_hf = _hf(head_dim, params, max_pos)
    rot = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv, attn = rope_inv_freq(rot, params["rope_theta"], params)
    assert inv.dtype == np.float32 and inv.shape == inv_hf.shape
    # float32 pow: ours is the correctly rounded one, torch's is within an ulp of it
    assert np.allclose(inv, inv_hf, rtol=2.5e-7, atol=0), np.abs(inv / inv_hf - 1).max()
    assert (inv == inv_hf).mean() >= 0.9
    assert attn == pytest.approx(attn_hf, rel=1e-12)
    cache = rope_cos_sin_cache(head_dim, rot, max_pos, params["rope_theta"], params)
    assert cache.shape == (max_pos, rot) and cache.dtype == np.float32
    half = rot // 2
    # bound: cos/sin rounding (torch's float32 cos/sin ~1 ulp) plus the angle difference from an ulp of
    # inv_freq at this position, plus the f32 angle rounding
    pos = np.arange(max_pos, dtype=np.float64)[:, None]
    tol = attn * (3e-7 + pos * np.abs(inv.astype(np.float64) - inv_hf) + pos * inv * 2 ** -23)
    tol_same = np.where(inv == inv_hf, attn * 3e-7, tol)
    assert (np.abs(cache[:, :half] - cos_hf) <= tol_same).all()
    assert (np.abs(cache[:, half:] - sin_hf) <= tol_same).all()


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_matches_transformers_short_and_long(partial):
    # Phi-3's LongRoPE: short factors up to original_max_position_embeddings, long ones past it (HF's seq_len)
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    head_dim, orig, max_pos = 64, 256, 4096
    rot = int(head_dim * partial)
    rng = np.random.default_rng(7)
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
              "original_max_position_embeddings": orig,
              "short_factor": (1 + rng.random(rot // 2)).tolist(), "long_factor": (1 + 8 * rng.random(rot // 2)).tolist()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.logging.set_verbosity_error()
        cfg = tr.Phi3Config(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=max_pos,
                            original_max_position_embeddings=orig, rope_parameters=dict(params))
        for seq_len in (None, orig, orig + 1):
            inv_hf, attn_hf = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=seq_len)
            inv, attn = rope_inv_freq(rot, 10000.0, params, max_position_embeddings=max_pos, seq_len=seq_len)
            assert np.allclose(inv, inv_hf.numpy(), rtol=2.5e-7, atol=0)
            assert attn == pytest.approx(attn_hf, rel=1e-12) and attn > 1.0
    short, _ = rope_inv_freq(rot, 10000.0, params, max_position_embeddings=max_pos)
    long_, _ = rope_inv_freq(rot, 10000.0, params, max_position_embeddings=max_pos, seq_len=orig + 1)
    assert not np.allclose(short, long_)
    cache = rope_cos_sin_cache(head_dim, rot, 8, 10000.0, params, max_position_embeddings=max_pos, seq_len=orig + 1)
    assert np.allclose(cache[5, : rot // 2], np.cos(5 * long_.astype(np.float64)) * attn_hf, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="long_factor"):
        rope_inv_freq(rot, 10000.0, {**params, "long_factor": [1.0] * 3})


def test_rope_scaling_old_format_and_errors():
    # HF's legacy rope_scaling {"type": ...}; unknown types and missing fields are clear errors
    a, _ = rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 4.0})
    b, _ = rope_inv_freq(64, 10000.0, None)
    assert np.allclose(a * 4, b, rtol=1e-7)
    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})


def _qkv(rng, T, H, KVH, D, dtype):
    qkv = stored(rng.standard_normal((T, (H + 2 * KVH) * D)), dtype)
    q = qkv[:, :H * D].reshape(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D)
    return qkv, q, k


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("D,rot,dtype", [(128, 128, "f32"), (64, 32, "f32"), (80, 40, "f32"), (128, 128, "f16"),
                                         (64, 64, "bf16")])
def test_rope_kernel(tier, neox, D, rot, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/{neox}/{D}/{rot}/{dtype}".encode()))
    T, H, KVH = 9, 5, 2
    qkv, q, k = _qkv(rng, T, H, KVH, D, dtype)
    before = as_f64(qkv).copy()
    cache = rope_cos_sin_cache(D, rot, 3000, 10000.0, {"rope_type": "yarn", "factor": 2.0,
                                                       "original_max_position_embeddings": 1500})
    pos = rng.integers(0, 3000, T).astype(np.int32)
    rope(q, k, pos, cache, D, rot, neox, target=tier)
    want_q = rope_ref(before[:, :H * D].reshape(T, H, D), pos, cache, rot, neox)
    want_k = rope_ref(before[:, H * D:(H + KVH) * D].reshape(T, KVH, D), pos, cache, rot, neox)
    scale = np.abs(before).max() * 2
    assert_close(q, want_q, dtype, "q", scale=np.full(want_q.shape, scale))
    assert_close(k, want_k, dtype, "k", scale=np.full(want_k.shape, scale))
    # v and the un-rotated tail of each head are bit-identical
    assert np.array_equal(as_f64(qkv[:, (H + KVH) * D:]), before[:, (H + KVH) * D:])
    if rot < D:
        assert np.array_equal(as_f64(q[..., rot:]), before[:, :H * D].reshape(T, H, D)[..., rot:])


def test_rope_q_only_and_position_check(tier):
    rng = np.random.default_rng(3)
    T, H, D = 4, 3, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q0 = q.astype(np.float64).copy()
    cache = rope_cos_sin_cache(D, D, 100, 10000.0)
    pos = np.array([0, 99, 5, 42], np.int32)
    rope(q, None, pos, cache, D, D, True, target=tier)
    assert_close(q, rope_ref(q0, pos, cache, D, True), "f32", "q", scale=np.full(q.shape, 8.0))
    assert np.array_equal(q[0], q0[0].astype(np.float32))        # position 0 is the identity
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 100\)"):
        rope(q, None, np.array([0, 100, 1, 2], np.int32), cache, D, D, True, target=tier)
    with pytest.raises(TypeError, match="positions"):
        rope(q, None, pos.astype(np.int64), cache, D, D, True, target=tier)


def test_rope_replays_with_new_positions():
    """Positions are read from the array: a captured launch replays with the values written later."""
    rng = np.random.default_rng(4)
    T, H, KVH, D = 3, 2, 1, 64
    _, q, k = _qkv(rng, T, H, KVH, D, "f32")
    cache = rope_cos_sin_cache(D, D, 64, 10000.0)
    pos = np.zeros(T, np.int32)
    with jk.capture() as g:
        rope(q, k, pos, cache, D, D, True)
    q0 = q.astype(np.float64).copy()
    pos[:] = [7, 8, 63]
    g.replay()
    assert_close(q, rope_ref(q0, pos, cache, D, True), "f32", "replayed q", scale=np.full(q.shape, 8.0))


# ------------------------------------------------------------------------ RoPE fused with the KV-cache write
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("D,rot,cache_dtype", [(64, 64, np.float32), (80, 40, np.float32), (128, 128, np.float16),
                                               (48, 48, np.float16)])
def test_rope_and_cache_is_rope_then_reshape_and_cache(tier, neox, D, rot, cache_dtype):
    """rope_and_cache leaves q and both caches bit-identical to rope + reshape_and_cache (the engine's unfused
    path) on strided views of a fused qkv buffer: slot -1 writes nothing, partial rotary copies the tail; the
    cached keys match the float64 rotation; one token alone writes what it writes in the batch."""
    from engine.ops.attention import reshape_and_cache
    from engine.ops.rope import rope_and_cache
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/cache/{neox}/{D}/{rot}/{cache_dtype}".encode()))
    T, H, KVH, BS, NB = 7, 5, 3, 16, 4
    cache = rope_cos_sin_cache(D, rot, 500, 10000.0)
    pos = rng.integers(0, 500, T).astype(np.int32)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[2] = -1

    def views(buf):
        # reshaped slices (views whose base is `buf`: a staged GPU launch copies the whole buffer)
        return [buf[:, c:c + n * D].reshape(T, n, D) for c, n in ((0, H), (H * D, KVH), ((H + KVH) * D, KVH))]

    qkv = rng.standard_normal((T, (H + 2 * KVH) * D + 3)).astype(np.float32)
    kc0 = rng.standard_normal((NB, BS, KVH, D)).astype(cache_dtype)
    vc0 = rng.standard_normal((NB, BS, KVH, D)).astype(cache_dtype)
    a = qkv.copy()
    q, k, v = views(a)
    kc, vc = kc0.copy(), vc0.copy()
    rope(q, k, pos, cache, D, rot, neox, target=tier)
    reshape_and_cache(k, v, kc, vc, slots, target=tier)
    b = qkv.copy()
    q2, k2, v2 = views(b)
    kc2, vc2 = kc0.copy(), vc0.copy()
    rope_and_cache(q2, k2, v2, pos, cache, D, rot, neox, kc2, vc2, slots, target=tier)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(kc2, kc)
    np.testing.assert_array_equal(vc2, vc)
    np.testing.assert_array_equal(b[:, H * D:], qkv[:, H * D:])          # k and v themselves untouched
    # the oracle: cached keys are the float64 rotation, values copied; the skipped token's slot keeps its data
    want_k = rope_ref(qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D), pos, cache, rot, neox)
    flat_k, flat_v = kc2.reshape(-1, KVH, D), vc2.reshape(-1, KVH, D)
    tol = 1e-5 if cache_dtype == np.float32 else 2e-3
    for t in range(T):
        if slots[t] < 0:
            continue
        assert np.allclose(flat_k[slots[t]], want_k[t], rtol=tol, atol=tol * 8)
        np.testing.assert_array_equal(flat_v[slots[t]], qkv[t, (H + KVH) * D:(H + 2 * KVH) * D].reshape(KVH, D)
                                      .astype(cache_dtype))
    untouched = np.setdiff1d(np.arange(NB * BS), slots[slots >= 0])
    np.testing.assert_array_equal(kc2.reshape(-1, KVH, D)[untouched], kc0.reshape(-1, KVH, D)[untouched])
    # one token alone
    t = 4
    c = qkv[t:t + 1].copy()
    kc3, vc3 = kc0.copy(), vc0.copy()
    q3, k3, v3 = [c[:, o:o + n * D].reshape(1, n, D) for o, n in ((0, H), (H * D, KVH), ((H + KVH) * D, KVH))]
    rope_and_cache(q3, k3, v3, pos[t:t + 1], cache, D, rot, neox, kc3, vc3, slots[t:t + 1], target=tier)
    np.testing.assert_array_equal(q3[0], q2[t])
    np.testing.assert_array_equal(kc3.reshape(-1, KVH, D)[slots[t]], flat_k[slots[t]])


def test_rope_and_cache_errors_name_the_field():
    from engine.ops.rope import rope_and_cache
    T, H, KVH, D = 2, 2, 1, 32
    q = np.ones((T, H, D), np.float32)
    k = np.ones((T, KVH, D), np.float32)
    kc = np.zeros((2, 16, KVH, D), np.float32)
    cache = rope_cos_sin_cache(D, D, 10, 10000.0)
    pos = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\)"):
        rope_and_cache(q, k, k, np.array([0, 10], np.int32), cache, D, D, True, kc, kc.copy(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_cache(q, k, k, pos, cache, D, D, True, kc, kc.copy(), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="cache"):
        rope_and_cache(q, k, k, pos, cache, D, D, True, np.zeros((2, 16, 2, D), np.float32),
                       np.zeros((2, 16, 2, D), np.float32), slots)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("D,rot,cache_dtype", [(80, 40, np.float32), (128, 128, np.float16)])
def test_rope_cache_tile_kernel_gives_the_head_loops_bits(tier, neox, D, rot, cache_dtype):
    """rope_cache_tile_kernel (a token's heads as one tile, tuning.rope_tiles for GPU steps of 256+ tokens) leaves
    q and both caches bit-identical to rope_cache_kernel (the loop over heads): head counts that are not powers of
    two (masked tile rows), a skipped slot, partial rotary's tail, f32 and f16 caches."""
    from engine.ops import rope as R
    from engine.ops._hostargs import fptr, pow2_at_least, run
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/tile/{neox}/{D}/{rot}/{cache_dtype}".encode()))
    T, H, KVH, BS, NB = 6, 5, 3, 16, 4
    cache = rope_cos_sin_cache(D, rot, 300, 10000.0)
    pos = rng.integers(0, 300, T).astype(np.int32)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[1] = -1
    qkv0 = rng.standard_normal((T, (H + 2 * KVH) * D)).astype(np.float32)
    kc0 = rng.standard_normal((NB, BS, KVH, D)).astype(cache_dtype)
    vc0 = rng.standard_normal((NB, BS, KVH, D)).astype(cache_dtype)
    got = {}
    for tiles in (False, True):
        qkv, kc, vc = qkv0.copy(), kc0.copy(), vc0.copy()
        q, k, v = (qkv[:, c:c + n * D].reshape(T, n, D) for c, n in ((0, H), (H * D, KVH), ((H + KVH) * D, KVH)))
        args = (fptr(q, "q"), q.strides[0] // 4, q.strides[1] // 4, H, fptr(k, "k"), k.strides[0] // 4,
                k.strides[1] // 4, fptr(v, "v"), v.strides[0] // 4, v.strides[1] // 4, KVH, pos, cache,
                cache.shape[0], kc, vc, slots)
        consts = dict(HALF=rot // 2, NEOX=neox, BLOCK=pow2_at_least(rot // 2 if neox else rot, 16), D=D,
                      BD=pow2_at_least(D, 16), TAIL=rot < D)
        if tiles:
            consts.update(HQ=pow2_at_least(H, 1), HK=pow2_at_least(KVH, 1))
        run(R.rope_cache_tile_kernel if tiles else R.rope_cache_kernel, (T,), args, tier, **consts)
        got[tiles] = (qkv, kc, vc)
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got[True][1], kc0) and not np.array_equal(got[True][0], qkv0)
