"""vocab_local_ids (tensor parallelism's vocabulary-parallel embedding) against numpy on every runnable tier:
odd token counts (masked tails), the slice's edges, ids owned by other ranks."""
import zlib

import numpy as np
import pytest

from engine.ops.parallel import vocab_local_ids


def _ref(ids, v0, v1):
    return np.where((ids >= v0) & (ids < v1), ids - v0, v1 - v0).astype(np.int32)


@pytest.mark.parametrize("n", [1, 7, 255, 256, 777])
@pytest.mark.parametrize("v0,v1", [(0, 251), (251, 502), (753, 1001), (5, 5)])
def test_vocab_local_ids(tier, n, v0, v1):
    rng = np.random.default_rng(zlib.crc32(f"{tier.name}/{n}/{v0}".encode()))
    ids = rng.integers(0, 1001, n).astype(np.int32)
    edges = np.array([v0, v1 - 1, v1, max(v0 - 1, 0), 0, 1000], np.int32)
    ids[:min(n, len(edges))] = edges[:min(n, len(edges))]
    out = np.full(n + 3, -7, np.int32)
    got = vocab_local_ids(ids, v0, v1, out=out[:n], target=tier)
    np.testing.assert_array_equal(got, _ref(ids, v0, v1))
    assert (out[n:] == -7).all()            # nothing written past the masked tail


def test_vocab_local_ids_bad_arguments():
    with pytest.raises(TypeError, match="int32"):
        vocab_local_ids(np.zeros(3, np.int64), 0, 4)
    with pytest.raises(ValueError, match="bad slice"):
        vocab_local_ids(np.zeros(3, np.int32), 5, 4)
