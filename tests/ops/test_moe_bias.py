"""expert_bias_act (engine/ops/moe.py): per-pair expert biases + gated activation after matmuls that do not add
biases (the quantised experts' matmul_q; gpt-oss), against float64 numpy on every runnable tier, odd sizes,
and each row alone vs in the batch bit for bit."""
import zlib

import numpy as np
import pytest

from engine.ops.moe import expert_bias_act


def _rng(tier, *salt):
    return np.random.default_rng(zlib.crc32("/".join(map(str, (tier.name,) + salt)).encode()))


def _ref(y, pe, bias, gated, act):
    y, b = y.astype(np.float64), bias.astype(np.float64)[pe]
    if not gated:
        return y + b
    n = y.shape[1] // 2
    g, u = y[:, :n] + b[:, :n], y[:, n:] + b[:, n:]
    if act == "silu":
        return g / (1 + np.exp(-g)) * u
    g = np.minimum(g, 7.0)
    u = np.clip(u, -7.0, 7.0)
    return (u + 1) * g / (1 + np.exp(-1.702 * g))


@pytest.mark.parametrize("gated,act", [(True, "swiglu_oai"), (True, "silu"), (False, "silu")])
@pytest.mark.parametrize("P,N,E", [(1, 7, 3), (13, 67, 5), (40, 130, 4)])
def test_expert_bias_act(tier, gated, act, P, N, E):
    rng = _rng(tier, gated, act, P, N, E)
    W = 2 * N if gated else N
    y = (rng.standard_normal((P, W)) * 4).astype(np.float32)       # past the clamp at 7
    bias = (rng.standard_normal((E, W)) * 2).astype(np.float32)
    pe = rng.integers(0, E, P).astype(np.int32)
    out = expert_bias_act(y, pe, bias, gated=gated, act=act, target=tier)
    np.testing.assert_allclose(out, _ref(y, pe, bias, gated, act), rtol=2e-6, atol=2e-6)
    for p in (0, P - 1):
        alone = expert_bias_act(y[p:p + 1].copy(), pe[p:p + 1].copy(), bias, gated=gated, act=act, target=tier)
        np.testing.assert_array_equal(alone[0], out[p])
    if not gated:                        # in place, as the quantised down projection uses it
        y2 = y.copy()
        expert_bias_act(y2, pe, bias, out=y2, gated=False, target=tier)
        np.testing.assert_array_equal(y2, out)


def test_expert_bias_act_errors():
    y = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="bias"):
        expert_bias_act(y, np.zeros(3, np.int32), np.zeros((2, 6), np.float32))
    with pytest.raises(ValueError, match="pair_expert"):
        expert_bias_act(y, np.zeros(4, np.int32), np.zeros((2, 8), np.float32))
