"""Loading compiled CPU kernels into this process and choosing the CPU tier they are built for."""
from __future__ import annotations

import threading

_lock = threading.Lock()
_lljit = None
_libs = []            # keep resource trackers alive: dropping one unloads its code
_counter = 0
_target = None
_reason = ""


def runtime_target():
    """The CPU tier launches use: JITKERN_CPU_TIER if set (failing closed), else the best runnable one."""
    global _target, _reason
    if _target is None:
        from targets import select_cpu_tier
        _target, _reason = select_cpu_tier()
    return _target


def runtime_target_reason() -> str:
    runtime_target()
    return _reason


def reset_runtime_target() -> None:
    global _target
    _target = None


def _jit():
    global _lljit
    if _lljit is None:
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        tm = llvm.Target.from_default_triple().create_target_machine(jit=True)
        _lljit = llvm.create_lljit_compiler(tm)
    return _lljit


def load_object(obj: bytes, symbol: str) -> int:
    """Links an object file into the process JIT and returns the address of `symbol`."""
    global _counter
    import llvmlite.binding as llvm
    with _lock:
        lljit = _jit()
        _counter += 1
        rt = (llvm.JITLibraryBuilder().add_object_img(obj).add_current_process()
              .export_symbol(symbol).link(lljit, f"jk{_counter}_{symbol}"))
        _libs.append(rt)
        return rt[symbol]
