"""engine.ops.lora (the segmented multi-LoRA products) against a numpy float64 reference.

Tolerance: each output is an f32 dot product of length K (shrink) or R (expand), plus the add in place; the
standard bound (n + 2) * 2**-24 * (|x| @ |w|^T + |y|) for the float64 product of the same f32 values holds for the
lane-split FMA chain and its reduction tree. A token given another slot's adapter, a row written twice or a
token without an adapter touched is off by ~|x||w| (orders of magnitude over it).
"""
import numpy as np
import pytest

from engine.ops import lora

U32 = 2.0 ** -24


def _ref_apply(x, a, b, slots, y0):
    """float64 y0 + (x A^T) B^T per token by its slot; (result, magnitude bound terms)."""
    y = y0.astype(np.float64).copy()
    mag = np.abs(y0).astype(np.float64)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        v = a[s].astype(np.float64) @ x[t].astype(np.float64)
        y[t] += b[s].astype(np.float64) @ v
        mag[t] += np.abs(b[s]).astype(np.float64) @ (np.abs(a[s]).astype(np.float64) @ np.abs(x[t]))
    return y, mag


def test_lora_tiles_cut_runs_by_slot_and_block():
    slots = np.array([-1, 0, 0, 0, 1, 1, -1, -1, 0, 2, 2, 2, 2, 2], np.int32)
    ts, st, ln = lora.lora_tiles(slots, block_m=2)
    assert ts.tolist() == [0, 0, 1, 0, 2, 2, 2]
    assert st.tolist() == [1, 3, 4, 8, 9, 11, 13]
    assert ln.tolist() == [2, 1, 2, 1, 2, 2, 1]
    assert all(len(a) == 0 for a in lora.lora_tiles(np.full(5, -1)))


@pytest.mark.parametrize("T,K,N,R", [(1, 64, 96, 8), (13, 45, 37, 16), (40, 64, 160, 24)])
def test_lora_apply_mixed_slots(tier, T, K, N, R):
    rng = np.random.default_rng(T + K)
    L = 3
    x = rng.standard_normal((T, K)).astype(np.float32)
    a = rng.standard_normal((L, R, K)).astype(np.float32)
    b = rng.standard_normal((L, N, R)).astype(np.float32)
    # runs of each slot, tokens without an adapter between them, a long run cut into several tiles
    slots = rng.integers(-1, L, T).astype(np.int32)
    if T >= 20:
        slots[3:19] = 1
    y0 = rng.standard_normal((T, N)).astype(np.float32)
    y = y0.copy()
    v = np.full((T, R), np.nan, np.float32)
    lora.lora_apply(x, a, b, lora.lora_tiles(slots, 4), y, v, block_m=4, target=tier)
    ref, mag = _ref_apply(x, a, b, slots, y0)
    # the bound for the two chained products: the shrink's error, carried through |B|, plus the expand's own
    tol = (K + R + 4) * U32 * mag + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert np.isfinite(y).all()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"
    none = slots < 0
    assert np.array_equal(y[none], y0[none])          # untouched, bit for bit
    assert np.isnan(v[none]).all()                    # the shrink writes only adapter tokens


def test_lora_shrink_alone_strided_rows(tier):
    rng = np.random.default_rng(7)
    T, K, R = 9, 70, 12
    big = rng.standard_normal((T, K + 10)).astype(np.float32)
    x = big[:, 5:5 + K]                                  # rows further apart than K
    a = rng.standard_normal((2, R, K)).astype(np.float32)
    slots = np.array([0, 0, 1, 1, 1, -1, 0, 1, 1], np.int32)
    v = np.zeros((T, R), np.float32)
    lora.lora_shrink(x, a, lora.lora_tiles(slots), v, target=tier)
    for t, s in enumerate(slots):
        want = a[s].astype(np.float64) @ x[t].astype(np.float64) if s >= 0 else np.zeros(R)
        tol = (K + 2) * U32 * (np.abs(a[max(s, 0)]).astype(np.float64) @ np.abs(x[t])) + 1e-30
        assert (np.abs(v[t] - want) <= tol).all()
