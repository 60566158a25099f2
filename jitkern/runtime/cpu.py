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
        # JITLink, not RuntimeDyld (llvmlite's default): RuntimeDyld's SectionMemoryManager maps an object's code
        # and its constant pool with separate mmaps, which in a busy address space (CUDA, torch, many JIT
        # libraries) can land more than 2 GiB apart; the code's 32-bit PC-relative constant loads then trip
        # RuntimeDyldELF's `isInt<32>(RealOffset)` assertion, which aborts the process (the wheel has LLVM
        # assertions on; seen on the H200 host, tests/test_jit_link.py builds that layout). JITLink allocates
        # each object's segments in one block and reports a relocation out of range as an error.
        _lljit = llvm.create_lljit_compiler(tm, use_jit_link=True)
    return _lljit


def _elf_undefined_symbols(obj: bytes) -> list:
    """Names of the non-weak undefined symbols of an ELF64 little-endian object ([] for anything else)."""
    import struct
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    names = []
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", obj, shoff + i * shentsize + 4)
        if sh_type != 2:                                           # SHT_SYMTAB
            continue
        off, size, link = struct.unpack_from("<QQI", obj, shoff + i * shentsize + 24)
        stroff, = struct.unpack_from("<Q", obj, shoff + link * shentsize + 24)
        for e in range(off, off + size, 24):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", obj, e)
            if st_name and st_shndx == 0 and st_info >> 4 != 2:      # SHN_UNDEF, not STB_WEAK
                end = obj.index(b"\0", stroff + st_name)
                names.append(obj[stroff + st_name:end].decode("utf-8", "replace"))
    return names


def _missing_symbols(obj: bytes) -> list:
    """The object's undefined symbols this process cannot resolve (the JIT looks them up the same way: dlsym on
    the process's global scope)."""
    import ctypes
    proc = ctypes.CDLL(None)
    missing = []
    for name in _elf_undefined_symbols(obj):
        try:
            getattr(proc, name)
        except AttributeError:
            missing.append(name)
    return missing


def load_object(obj: bytes, symbol: str, describe: str = "") -> int:
    """Links an object file into the process JIT and returns the address of `symbol`.

    Raises CompileError (naming `describe`, e.g. kernel, specialisation and target, and the symbols) when the
    object needs symbols the process does not have or when the link fails, instead of the JIT's bare error."""
    global _counter
    import llvmlite.binding as llvm
    from ..errors import CompileError
    what = describe or f"object defining {symbol}"
    missing = _missing_symbols(obj)
    if missing:
        raise CompileError(f"cannot link {what}: it needs symbol(s) this process does not define: "
                           f"{', '.join(sorted(set(missing)))}", kernel=symbol)
    with _lock:
        lljit = _jit()
        _counter += 1
        try:
            rt = (llvm.JITLibraryBuilder().add_object_img(obj).add_current_process()
                  .export_symbol(symbol).link(lljit, f"jk{_counter}_{symbol}"))
        except RuntimeError as e:
            raise CompileError(f"cannot link {what} into the process JIT: {e} (the JIT's details are on stderr)",
                               kernel=symbol) from None
        _libs.append(rt)
        return rt[symbol]
