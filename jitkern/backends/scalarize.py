"""A scalarizer for the GPU lowering's LLVM IR text: every vector value becomes one scalar per lane.

LLVM 22's SPIR-V backend legalizes vectors of 2-4 elements (SPIR-V's own vectors) but fails on most wider
ones ("unable to legalize instruction" for G_SELECT / G_ICMP on <5 x ..>, <8 x i1>, <12 x ..>, <32 x i1>
...), and the tile lowering holds a thread's R elements as one <R x T> vector. llvmlite exposes no LLVM
scalarizer pass, so this rewrites the (small, regular) instruction set the lowering emits: binary ops,
fneg, icmp/fcmp, select, casts, insert/extractelement with constant lanes, shufflevector, phi and calls to
element-wise intrinsics. Lane i of vector value %v is %v.l<i>. Scalar SPIR-V is also what GPU drivers
prefer (their SIMT lanes are scalar).
"""
from __future__ import annotations

import re

from ..errors import CompileError

_VEC = re.compile(r"<(\d+) x ([^<>]+?)>")
_BINOPS = {"add", "sub", "mul", "udiv", "sdiv", "urem", "srem", "shl", "lshr", "ashr", "and", "or", "xor",
           "fadd", "fsub", "fmul", "fdiv", "frem"}
_CASTS = {"sext", "zext", "trunc", "bitcast", "fptosi", "fptoui", "sitofp", "uitofp", "fpext", "fptrunc"}
_FLAGS = {"nuw", "nsw", "exact", "disjoint", "nneg", "fast", "nnan", "ninf", "nsz", "arcp", "contract", "afn",
          "reassoc", "samesign"}
_SFX = re.compile(r"\.v\d+(i\d+|f16|f32|f64|p\d+)")


def _split(s: str) -> list:
    """Top-level comma-separated parts (brackets <> () [] nest)."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _typed(s: str) -> tuple:
    """'<4 x i32> %x' -> (4, 'i32', '%x'); 'i32 %x' -> (0, 'i32', '%x')."""
    s = s.strip()
    if s.startswith("<"):
        m = re.match(r"<(\d+) x ([^<>]+?)>\s*(.*)$", s)
        if not m:
            raise CompileError(f"scalarizer: cannot parse typed value {s!r}", target="vulkan")
        return int(m.group(1)), m.group(2).strip(), m.group(3).strip()
    ty, _, v = s.partition(" ")
    return 0, ty, v.strip()


def _zero(et: str) -> str:
    if et in ("float", "double", "half"):
        return "0.0"
    return "false" if et == "i1" else "0"


def _lane(v: str, et: str, i: int) -> str:
    """Lane i of a vector operand (an SSA name or a constant)."""
    v = v.strip()
    if v.startswith("%"):
        return f"{v}.l{i}"
    if v in ("poison", "undef"):
        return "poison"
    if v == "zeroinitializer":
        return _zero(et)
    if v.startswith("splat"):
        inner = v[v.index("(") + 1:v.rindex(")")]
        return _typed(inner)[2]
    if v.startswith("<"):
        parts = _split(v[1:-1])
        return _typed(parts[i])[2]
    raise CompileError(f"scalarizer: unknown vector operand {v!r}", target="vulkan")


def _const_index(v: str) -> int:
    v = v.strip()
    if not re.fullmatch(r"-?\d+", v):
        raise CompileError(f"scalarizer: a non-constant vector lane index ({v})", target="vulkan")
    return int(v)


def _line(line: str, decls: set) -> list:
    if "<" not in line or " x " not in line or not _VEC.search(line):
        return [line]
    m = re.match(r"^(\s*)(%[\w.]+) = (\w+) (.*)$", line)
    if not m:
        raise CompileError(f"scalarizer: an unexpected vector instruction: {line.strip()}", target="vulkan")
    ind, r, op, rest = m.groups()
    words = rest.split(" ")
    while words and words[0] in _FLAGS:
        words.pop(0)
    rest = " ".join(words)
    out = []
    if op in _BINOPS:
        a, b = _split(rest)
        n, et, av = _typed(a)
        for i in range(n):
            out.append(f"{ind}{r}.l{i} = {op} {et} {_lane(av, et, i)}, {_lane(b, et, i)}")
    elif op == "fneg":
        n, et, av = _typed(rest)
        for i in range(n):
            out.append(f"{ind}{r}.l{i} = fneg {et} {_lane(av, et, i)}")
    elif op in ("icmp", "fcmp"):
        pred, _, tail = rest.partition(" ")
        while pred in _FLAGS:
            pred, _, tail = tail.partition(" ")
        a, b = _split(tail)
        n, et, av = _typed(a)
        for i in range(n):
            out.append(f"{ind}{r}.l{i} = {op} {pred} {et} {_lane(av, et, i)}, {_lane(b, et, i)}")
    elif op == "select":
        c, a, b = _split(rest)
        cn, _, cv = _typed(c)
        n, et, av = _typed(a)
        _, _, bv = _typed(b)
        for i in range(n):
            ci = _lane(cv, "i1", i) if cn else cv
            out.append(f"{ind}{r}.l{i} = select i1 {ci}, {et} {_lane(av, et, i)}, {et} {_lane(bv, et, i)}")
    elif op in _CASTS:
        src, _, dst = rest.rpartition(" to ")
        n, et, av = _typed(src)
        dn, det, _ = _typed(dst + " x")
        if dn != n:
            raise CompileError(f"scalarizer: a cast between vector widths: {line.strip()}", target="vulkan")
        for i in range(n):
            lv = _lane(av, et, i)
            out.append(f"{ind}{r}.l{i} = {op} {et} {lv} to {det}")
    elif op == "insertelement":
        v, s, k = _split(rest)
        n, et, vv = _typed(v)
        _, _, sv = _typed(s)
        k = _const_index(_typed(k)[2])
        for i in range(n):
            src = sv if i == k else _lane(vv, et, i)
            out.append(_copy(ind, f"{r}.l{i}", et, src))
    elif op == "extractelement":
        v, k = _split(rest)
        n, et, vv = _typed(v)
        k = _const_index(_typed(k)[2])
        out.append(_copy(ind, r, et, _lane(vv, et, k)))
    elif op == "shufflevector":
        a, b, mask = _split(rest)
        n, et, av = _typed(a)
        _, _, bv = _typed(b)
        mn, _, mv = _typed(mask)
        for i in range(mn):
            j = _lane(mv, "i32", i)
            if j == "poison":
                src = "poison"
            else:
                j = int(j)
                src = _lane(av, et, j) if j < n else _lane(bv, et, j - n)
            out.append(_copy(ind, f"{r}.l{i}", et, src))
    elif op == "phi":
        m2 = re.match(r"<(\d+) x ([^<>]+?)>\s*(.*)$", rest)
        n, et, incoming = int(m2.group(1)), m2.group(2), m2.group(3)
        pairs = re.findall(r"\[\s*(.+?),\s*(%[\w.]+)\s*\]", incoming)
        for i in range(n):
            arms = ", ".join(f"[ {_lane(v, et, i)}, {bb} ]" for v, bb in pairs)
            out.append(f"{ind}{r}.l{i} = phi {et} {arms}")
    elif op == "call":
        m2 = re.match(r"<(\d+) x ([^<>]+?)> @([\w.]+)\((.*)\)\s*$", rest)
        if not m2:
            raise CompileError(f"scalarizer: an unexpected vector call: {line.strip()}", target="vulkan")
        n, et, fn, args = int(m2.group(1)), m2.group(2), m2.group(3), m2.group(4)
        sfn = _SFX.sub(lambda mm: "." + mm.group(1), fn)
        targs = [_typed(a) for a in _split(args)]
        decls.add(f"declare {et} @{sfn}({', '.join(t[1] for t in targs)})")
        for i in range(n):
            lanes = ", ".join(f"{t[1]} {_lane(t[2], t[1], i) if t[0] else t[2]}" for t in targs)
            out.append(f"{ind}{r}.l{i} = call {et} @{sfn}({lanes})")
    else:
        raise CompileError(f"scalarizer: no rule for vector instruction {op}: {line.strip()}", target="vulkan")
    return out


def _copy(ind: str, dst: str, et: str, src: str) -> str:
    """dst = src as an instruction (LLVM has no plain copy): a same-type bitcast, or a freeze of poison."""
    if src == "poison":
        return f"{ind}{dst} = freeze {et} poison"
    return f"{ind}{dst} = bitcast {et} {src} to {et}"


def scalarize(text: str) -> str:
    """The module text with every vector instruction split into per-lane scalar instructions; declarations
    of vector intrinsics are replaced by their scalar forms."""
    lines = text.split("\n")
    decls: set = set()
    out = []
    for line in lines:
        if line.startswith("declare"):
            if _VEC.search(line):
                continue            # re-declared in scalar form when used
            out.append(line)
            continue
        if line.startswith(("define", "attributes", "target", "@", ";", "}")) or not line.strip() \
                or line.rstrip().endswith(":"):
            out.append(line)
            continue
        out += _line(line, decls)
    have = {ln for ln in out if ln.startswith("declare")}
    extra = sorted(d for d in decls if d not in have)
    # declarations go before the function definition
    at = next(i for i, ln in enumerate(out) if ln.startswith("define"))
    return "\n".join(out[:at] + extra + out[at:])


__all__ = ["scalarize"]
