"""The axis analysis (jitkern/analysis.py) on traced kernels: the facts the GPU lowering's vector accesses
rely on, checked against the values the index expressions really take (computed with numpy)."""
import numpy as np

import jitkern as jk
from jitkern.analysis import AxisAnalysis
from jitkern.frontend import trace
from targets import get_target


@jk.kernel
def _rows(x, out, n, stride, BM: jk.constexpr, BN: jk.constexpr):
    rows = jk.program_id(0) * BM + jk.arange(0, BM)
    cols = jk.arange(0, BN)
    m = (rows[:, None] < n) & (cols[None, :] < n)
    v = jk.load(x + rows[:, None] * stride + cols[None, :], mask=m, other=0.0)
    jk.store(out + rows[:, None] * stride + 2 * cols[None, :] + 1, v, mask=m)


def _facts(kernel, params, consts, hints):
    fn = trace(kernel, params, consts, get_target("sm_90a"), "k")
    a = AxisAnalysis(fn, hints)
    loads = [op for op in fn.body.ops if op.name == "load"]
    stores = [op for op in fn.body.ops if op.name == "store"]
    return a, loads, stores


def _params():
    from jitkern.jit import arg_type
    f32 = np.zeros(4, np.float32)
    return [("x", arg_type("x", f32)), ("out", arg_type("out", f32)), ("n", arg_type("n", 64)),
            ("stride", arg_type("stride", 64))]


def test_contiguous_aligned_rows_and_chunk_constant_masks():
    a, (ld,), (st,) = _facts(_rows, _params(), {"BM": 4, "BN": 32},
                             {"x": 16, "out": 16, "n": 16, "stride": 16})
    p = a.info(ld.operands[0])
    assert p.contig[-1] == 32 and p.div[-1] % 16 == 0        # rows of 32 contiguous f32, 16-byte aligned
    m = a.info(ld.operands[1])
    assert m.const[-1] % 4 == 0                              # the column test flips on multiples of 16
    q = a.info(st.operands[0])
    assert q.contig[-1] == 1                                 # 2 * cols + 1 is strided


def test_without_hints_nothing_is_claimed():
    a, (ld,), _ = _facts(_rows, _params(), {"BM": 4, "BN": 32}, {})
    p = a.info(ld.operands[0])
    assert p.div[-1] % 16 != 0                               # unknown base alignment and stride
    m = a.info(ld.operands[1])
    assert m.const[-1] < 4                                   # n may be anything


def test_facts_hold_on_the_values():
    """Brute force: for the load pointer's offsets, every run the analysis claims is really contiguous and
    starts at a multiple of the claimed divisor (n and stride multiples of 16, x 16-byte aligned)."""
    a, (ld,), _ = _facts(_rows, _params(), {"BM": 4, "BN": 32}, {"x": 16, "out": 16, "n": 16, "stride": 16})
    p = a.info(ld.operands[0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        pid, stride, base = int(rng.integers(0, 50)), 16 * int(rng.integers(1, 20)), 16 * int(rng.integers(0, 99))
        rows = pid * 4 + np.arange(4)
        addr = base + 4 * (rows[:, None] * stride + np.arange(32)[None, :])       # bytes
        c, d = p.contig[-1], p.div[-1]
        for r in range(4):
            for s in range(0, 32, c):
                run = addr[r, s:s + c]
                assert (np.diff(run) == 4).all() and run[0] % d == 0
