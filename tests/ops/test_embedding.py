"""Embedding gather (f32/f16/bf16 tables, optional scale, strided out) against numpy on every runnable tier.
Gathers are exact (the f32 result of a half value is exact); with `scale` one f32 multiply (exact reference
computed the same way)."""
import zlib

import numpy as np
import pytest

import jitkern as jk
from engine.ops.embedding import embedding

from .ref_basic import as_f64, stored


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("hidden", [577, 2048])
def test_embedding(tier, dtype, hidden):
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/{dtype}/{hidden}".encode()))
    V = 1001
    table = stored(rng.standard_normal((V, hidden)), dtype)
    ids = rng.integers(0, V, 13).astype(np.int32)
    ids[:2] = [0, V - 1]
    out = embedding(ids, table, target=tier)
    assert out.dtype == np.float32 and out.shape == (13, hidden)
    assert np.array_equal(out, as_f64(table)[ids].astype(np.float32))
    # Gemma: scaled by sqrt(hidden) in f32, into a row-strided f32 view
    s = float(np.float32(hidden ** 0.5))
    buf = np.full((13, hidden + 5), -3.0, np.float32)
    embedding(ids, table, out=buf[:, 5:], scale=s, target=tier)
    assert np.array_equal(buf[:, 5:], as_f64(table)[ids].astype(np.float32) * np.float32(s))
    assert (buf[:, :5] == -3.0).all()


def test_embedding_half_out_and_bad_ids(tier):
    rng = np.random.default_rng(2)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    ids = np.array([3, 49, 0], np.int32)
    out = embedding(ids, table, out_dtype=np.float16, target=tier)
    assert out.dtype == np.float16 and np.array_equal(out, table[ids].astype(np.float16))
    with pytest.raises(ValueError, match="token id 50"):
        embedding(np.array([1, 50], np.int32), table, target=tier)
    with pytest.raises(TypeError, match="ids"):
        embedding(ids.astype(np.int64), table, target=tier)
    # unchecked out-of-range ids (as a replayed graph could see) give zero rows, never a stray read
    out = embedding(np.array([-1, 2, 1 << 30], np.int32), table, check_ids=False, target=tier)
    assert (out[0] == 0).all() and (out[2] == 0).all() and np.array_equal(out[1], table[2])


def test_embedding_replay_reads_new_ids():
    table = np.random.default_rng(3).standard_normal((20, 48)).astype(np.float32)
    ids = np.zeros(4, np.int32)
    out = np.empty((4, 48), np.float32)
    with jk.capture() as g:
        embedding(ids, table, out=out)
    ids[:] = [5, 1, 19, 5]
    g.replay()
    assert np.array_equal(out, table[ids])
