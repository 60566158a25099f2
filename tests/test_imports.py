"""The import graph of jitkern/: no cycle (imports inside functions included) and no import of the packages
built on it (engine/, server/); the AMDGPU and SPIR-V lowerings never load the NVIDIA-only paths."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict:
    out = {}
    for p in (ROOT / "jitkern").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mods: dict) -> dict:
    """module -> the jitkern modules (and outside top-level packages) it imports anywhere in its text."""
    edges = {}
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        names = []
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Import):
                names += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = ".".join(pkg[:len(pkg) - n.level + 1] + ([n.module] if n.module else [])) if n.level \
                    else n.module
                names += [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names]
        found = set()
        for name in names:
            t = name
            while t and t not in mods:
                t = t.rpartition(".")[0]
            found.add(t or name.split(".")[0])
        found.discard(m)
        edges[m] = found
    return edges


def test_no_import_cycle_in_jitkern():
    mods = _modules()
    edges = _imports(mods)
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if t not in mods:
                continue
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_jitkern_imports_nothing_built_on_it():
    edges = _imports(_modules())
    up = {m: sorted(t for t in ts if t.split(".")[0] in ("engine", "server")) for m, ts in edges.items()}
    assert not {m: ts for m, ts in up.items() if ts}


def test_amdgpu_and_spirv_lowerings_leave_the_nvidia_paths_unloaded():
    code = ("import sys, jitkern.backends.amdgpu, jitkern.backends.spirv; "
            "print(sorted(m for m in sys.modules if m.startswith(('jitkern.backends.nvidia', 'jitkern.backends.nvptx'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
