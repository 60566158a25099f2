"""jitkern: a tile DSL compiled by our own llvmlite code generator.

    import jitkern as jk

    @jk.kernel
    def scale(x, out, n, alpha, BLOCK: jk.constexpr):
        offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
        m = offs < n
        jk.store(out + offs, jk.load(x + offs, mask=m) * alpha, mask=m)
"""
from .language import (  # noqa: F401
    CompilationError, constexpr, target, static_range, static_assert, cdiv,
    program_id, num_programs, arange, zeros, full, load, store, prefetch, tma, where, maximum, minimum, fma,
    exp, exp_fast, exp2, log, log2, sqrt, rsqrt, tanh, sigmoid, floor, ceil, erf, sin, cos, abs,
    sum, max, min, argmax, argmin, dot, dot4, dp4a, madd, trans, expand_dims, reshape, broadcast_to, cast, barrier,
    f64, f32, f16, bf16, i1, i8, u8, i16, u16, i32, u32, i64,
    float32, float16, bfloat16, float64, int8, uint8, int16, uint16, int32, uint32, int64,
)
from .jit import kernel, jit, Pointer, as_pointer  # noqa: F401
from .autotune import autotune, Config, Autotuner, AutotuneError  # noqa: F401
from .runtime.launch import capture, Graph  # noqa: F401
from .errors import JitkernError, CompileError  # noqa: F401

__version__ = "0.1.0"
