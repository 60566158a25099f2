"""`@jitkern.kernel` and `@jitkern.jit`: source capture, specialisation and launching.

    @jk.kernel
    def add(x, y, out, n, BLOCK: jk.constexpr):
        offs = jk.program_id(0) * BLOCK + jk.arange(0, BLOCK)
        jk.store(out + offs, jk.load(x + offs, mask=offs < n) + jk.load(y + offs, mask=offs < n), mask=offs < n)

    add[(jk.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)

A launch specialises on the dtype of every array argument, the int width of every integer argument
(i32 when it fits, else i64) and the value of every constexpr; each specialisation is compiled once per
target and cached (in process and on disk).
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

from . import ir
# the argument types, specialisation hints and launch options live below the compiler and the runtimes
# (args.py); kernels and callers name them here too
from .args import (_NP_TO_DTYPE, LAUNCH_OPTIONS, SPEC_HINTS, Pointer, _is_device_array, arg_type,  # noqa: F401
                   as_pointer, spec_hints)
from .frontend import Traceable
from .language import CompilationError, constexpr


class JitFunction(Traceable):
    """A Python function traced into kernels: a kernel itself or a device function it calls."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__module__ = fn.__module__
        self.__qualname__ = fn.__qualname__
        try:
            src = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as e:
            raise CompilationError(f"cannot read the source of {fn.__qualname__} ({e}): jitkern traces kernel "
                                   f"source, so define kernels in a .py file, not in an interactive prompt or exec()")
        self.source = src
        self.source_lines = src.splitlines()
        module = ast.parse(src)
        fdef = module.body[0]
        self.tree = fdef
        self.filename = inspect.getsourcefile(fn) or "<kernel>"
        self.first_line = fn.__code__.co_firstlineno
        # AST line numbers count from the top of `src`, which starts at the decorator line (co_firstlineno)
        self.signature = inspect.signature(fn)
        self.params = list(self.signature.parameters.values())
        self.constexpr_names = {p.name for p in self.params if self._is_constexpr(p)}
        self._cache_key = None

    @staticmethod
    def _is_constexpr(p) -> bool:
        ann = p.annotation
        return ann is constexpr or isinstance(ann, constexpr) or (isinstance(ann, str) and "constexpr" in ann)

    def globals_and_closure(self) -> dict:
        g = dict(self.fn.__globals__)
        if self.fn.__closure__:
            for name, cell in zip(self.fn.__code__.co_freevars, self.fn.__closure__):
                try:
                    g[name] = cell.cell_contents
                except ValueError:
                    pass
        return g

    def bind(self, args, kwargs, where=None) -> dict:
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise CompilationError(f"calling {self.__name__}: {e}", where) from None
        ba.apply_defaults()
        out = {}
        for k, v in ba.arguments.items():
            out[k] = v.value if isinstance(v, constexpr) else v
        return out

    @property
    def cache_key(self) -> str:
        """Hash of this function's source and of every jit function and constant global it refers to."""
        if self._cache_key is None:
            h = hashlib.sha256(self.source.encode())
            g = self.globals_and_closure()
            seen = set()
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Name) and node.id not in seen:
                    seen.add(node.id)
                    v = g.get(node.id)
                    if isinstance(v, JitFunction):
                        if v is not self:
                            h.update(f"{node.id}={v.cache_key}".encode())
                    elif isinstance(v, (int, float, str, bool, tuple, ir.DType)):
                        h.update(f"{node.id}={v!r}".encode())
            self._cache_key = h.hexdigest()
        return self._cache_key

    def __call__(self, *args, **kwargs):
        raise CompilationError(f"{self.__name__} is a jitkern function: call it from a kernel, "
                               f"or launch a kernel with kernel[grid](...)")


class Kernel(JitFunction):
    """A launchable kernel: `kernel[grid](*args, **constexprs)`."""

    def __init__(self, fn, do_not_specialize=()):
        super().__init__(fn)
        self._plans: dict = {}
        self._cx_positions = frozenset(i for i, p in enumerate(self.params) if p.name in self.constexpr_names)
        unknown = set(do_not_specialize) - {p.name for p in self.params}
        if unknown:
            raise CompilationError(f"{self.__name__}: do_not_specialize names no parameter: {sorted(unknown)}")
        # integers that change every engine step (token counts, offsets): never specialised on divisibility,
        # so one compiled kernel serves every step and `jitkern build` covers what a run will ask for
        self.do_not_specialize = frozenset(do_not_specialize)

    def __getitem__(self, grid):
        return _Launcher(self, grid)

    def specialize(self, args, kwargs, target=None):
        """Resolves a call's arguments into (runtime params, constexpr dict, runtime values)."""
        params, consts, values = [], {}, []
        for opt in LAUNCH_OPTIONS:
            # launch options are part of the specialisation (and so of the cache key) like constexprs
            if opt in kwargs and opt not in self.signature.parameters:
                kwargs = dict(kwargs)
                consts[opt] = int(kwargs.pop(opt))
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for p in self.params:
            if p.name not in bound.arguments:
                raise TypeError(f"{self.__name__}: missing argument '{p.name}'")
            v = bound.arguments[p.name]
            if p.name in self.constexpr_names:
                consts[p.name] = v.value if isinstance(v, constexpr) else v
            else:
                params.append((p.name, arg_type(p.name, v)))
                values.append(v)
        if target is not None and getattr(target, "is_gpu", False):
            hints = spec_hints(params, values, self.do_not_specialize)
            if hints:
                consts[SPEC_HINTS] = hints
        return params, consts, values

    def compile(self, *args, target=None, **kwargs):
        """Compiles for these arguments (without running) and returns the CompiledKernel."""
        from .compiler import compile_kernel
        params, consts, _ = self.specialize(args, kwargs)
        return compile_kernel(self, params, consts, target)

    def warmup(self, *args, target=None, **kwargs):
        return self.compile(*args, target=target, **kwargs)

    def resolve_launch(self, grid, args, kwargs, target):
        """(compiled kernel, run-time argument values, 3-D grid or None when empty) of a GPU launch: where the GPU
        runtimes' launch_args start (runtime/launch.py resolve_launch)."""
        from .runtime.launch import resolve_launch
        return resolve_launch(self, grid, args, kwargs, target)


class _Launcher:
    __slots__ = ("kernel", "grid")

    def __init__(self, kernel, grid):
        self.kernel = kernel
        self.grid = grid

    def __call__(self, *args, **kwargs):
        from .runtime.launch import launch
        return launch(self.kernel, self.grid, args, kwargs)


def kernel(fn=None, *, do_not_specialize=()):
    """Decorator: a launchable jitkern kernel. `@jk.kernel(do_not_specialize=("M",))` keeps integer
    arguments that change from launch to launch out of the GPU argument specialisation."""
    if fn is None:
        return lambda f: Kernel(f, do_not_specialize)
    return Kernel(fn, do_not_specialize)


def jit(fn=None):
    """Decorator: a jitkern device function, inlined into the kernels that call it."""
    if fn is None:
        return jit
    return JitFunction(fn)
