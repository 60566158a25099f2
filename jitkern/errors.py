"""Exception classes shared by the jitkern compiler and runtime.

Kept dependency-free so any module (including the compile worker process) can import it cheaply.
"""

from __future__ import annotations

from typing import Optional


class JitkernError(Exception):
    """Base class of every error jitkern raises on purpose."""


class BuildInputError(JitkernError):
    """`jitkern build` was given an input its kernel set cannot use (a kernel set raises it for a bad --model)."""


class CompileError(JitkernError):
    """A kernel failed to compile (LLVM error, verifier error, crashed or timed-out worker).

    Attributes:
        kernel: kernel name, when the caller knows it.
        specialization: the specialisation being compiled (free-form text), when known.
        target: target description (e.g. "x86_64-unknown-linux-gnu cpu=x86-64 features=+avx2").
        stderr_tail: the last lines the compile worker wrote to stderr for this request
            ("LLVM ERROR: ..." or the failed assertion live there); "" if none.
    """

    def __init__(
        self,
        message: str,
        *,
        kernel: Optional[str] = None,
        specialization: Optional[str] = None,
        target: Optional[str] = None,
        stderr_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.kernel = kernel
        self.specialization = specialization
        self.target = target
        self.stderr_tail = stderr_tail

    def __reduce__(self):
        # Keep the keyword attributes when pickled (e.g. sent between processes).
        return (
            _rebuild_compile_error,
            (type(self), str(self), self.kernel, self.specialization, self.target, self.stderr_tail),
        )


def _rebuild_compile_error(cls, message, kernel, specialization, target, stderr_tail):
    return cls(
        message, kernel=kernel, specialization=specialization, target=target, stderr_tail=stderr_tail
    )
