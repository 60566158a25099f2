"""The launch path's memoised plans (jitkern/runtime/launch.py resolve): a call whose type signature was seen
before skips specialisation, also when constexprs are left at their defaults; what the plan returns is still
this call's run-time values, and the kernel it runs gives the reference's numbers."""
import numpy as np

import jitkern as jk
from jitkern.jit import Pointer
from jitkern.runtime import launch as launch_mod


@jk.kernel
def _scale_k(x, y, n, a, BLOCK: jk.constexpr, ADD: jk.constexpr = False, BIAS: jk.constexpr = 0.5):
    o = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
    m = o < n
    v = jk.load(x + o, mask=m, other=0.0) * a
    if ADD:
        v = v + BIAS
    jk.store(y + o, v, mask=m)


def _count_specialize(monkeypatch, kernel):
    calls = []
    real = kernel.specialize

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(kernel, "specialize", counting)
    monkeypatch.setattr(kernel, "_plans", {})
    return calls


def test_defaulted_constexprs_are_memoised_and_values_are_this_calls(monkeypatch):
    calls = _count_specialize(monkeypatch, _scale_k)
    rng = np.random.default_rng(7)
    for i, (n, a) in enumerate([(37, 1.5), (37, -2.25), (50, 0.75)]):
        x = rng.standard_normal(64).astype(np.float32)
        y = np.full(64, np.nan, np.float32)
        _scale_k[(4,)](x, y, n, a, BLOCK=16)                 # ADD and BIAS left at their defaults
        np.testing.assert_array_equal(y[:n], (x[:n] * np.float32(a)).astype(np.float32))
        assert np.isnan(y[n:]).all()
    # (37 and 50 are both not multiples of 16, the only thing an int adds to the key): one specialisation
    assert len(calls) == 1
    # a constexpr passed explicitly is another key (and another kernel)
    x = rng.standard_normal(64).astype(np.float32)
    y = np.zeros(64, np.float32)
    _scale_k[(4,)](x, y, 64, 2.0, BLOCK=16, ADD=True)
    np.testing.assert_array_equal(y, (x * np.float32(2.0) + np.float32(0.5)).astype(np.float32))
    assert len(calls) == 2


def test_a_runtime_argument_by_keyword_is_not_memoised(monkeypatch):
    """The plan picks run-time values by position: a call naming one by keyword specialises each time (and is
    still right)."""
    calls = _count_specialize(monkeypatch, _scale_k)
    x = np.arange(32, dtype=np.float32)
    for a in (1.0, 3.0):
        y = np.zeros(32, np.float32)
        _scale_k[(2,)](x, y, 32, a=a, BLOCK=16)
        np.testing.assert_array_equal(y, x * np.float32(a))
    assert len(calls) == 2


def test_pointer_tokens_carry_alignment():
    """A Pointer's 16-byte alignment is a GPU specialisation hint (jit.spec_hints), so it is in the memo key."""
    from jitkern import ir
    assert launch_mod._token(Pointer(4096, ir.f32)) != launch_mod._token(Pointer(4100, ir.f32))


def test_dry_launches_neither_compile_nor_run(monkeypatch):
    # runtime.launch.dry_launches: what ModelRunner.reserve_buffers drives the forward pass through
    calls = _count_specialize(monkeypatch, _scale_k)
    rng = np.random.default_rng(11)
    x = rng.standard_normal(64).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    with launch_mod.dry_launches():
        assert launch_mod.launches_are_dry()
        assert _scale_k[(4,)](x, y, 50, 1.5, BLOCK=16) is None
    assert not launch_mod.launches_are_dry()
    assert calls == [] and np.isnan(y).all()
    _scale_k[(4,)](x, y, 50, 1.5, BLOCK=16)           # and after it, launches run again
    assert calls == [1]
    np.testing.assert_array_equal(y[:50], (x[:50] * np.float32(1.5)).astype(np.float32))
