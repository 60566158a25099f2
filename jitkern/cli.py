"""The `jitkern` command: targets, build, ir, asm, cache.

    jitkern targets
    jitkern build --target avx2 [--model DIR]
    jitkern ir  KERNEL --sig 'x=*f32,n=i32' --const BLOCK=64 [--target T] [--llvm]
    jitkern asm KERNEL --sig 'x=*f32,n=i32' --const BLOCK=64 --target avx512
    jitkern cache [info|list|clear]

KERNEL is `package.module:name` or `path/to/file.py:name`.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys


def _fail(msg: str, prog: str = "jitkern") -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------ shared by every jitkern command line
class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): "prog: error: <what>; see prog --help". Subcommand
    parsers made by add_subparsers() are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_settings(prog: str, *, also=(), **what) -> int | None:
    """jitkern.env.check_environment(**what), then each of `also` (a client's own checks, e.g. engine/settings.py's
    for the commands that run the engine: jitkern imports nothing above it); on a bad JITKERN_* setting prints one
    line and returns 2."""
    from .env import SettingError, check_environment
    try:
        check_environment(**what)
        for check in also:
            check()
    except SettingError as e:
        return _fail(str(e), prog)
    return None


def run_main(main, argv, prog: str) -> int:
    """Runs a command's main(argv): Ctrl-C is one line and status 130 (128 + SIGINT), a closed stdout pipe
    (`... | head`) is a quiet 0."""
    try:
        return main(argv) or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


# -------------------------------------------------------------------------------------------- targets
def cmd_targets(args) -> int:
    from .backends import FAMILIES, backend_of
    from targets import all_targets
    from targets.cpu import can_run, host_arch, host_cpu_features, missing_features, select_cpu_tier
    import llvmlite.binding as llvm
    try:
        sel, why = select_cpu_tier()
        sel_name, sel_err = sel.name, None
    except Exception as e:  # a forced tier this host cannot run
        sel_name, why, sel_err = None, "", str(e)
    print(f"host: {host_arch()} cpu {llvm.get_host_cpu_name()}, LLVM {'.'.join(map(str, llvm.llvm_version_info))}")
    feats = sorted(f for f in host_cpu_features() if f.startswith(("sse", "avx", "fma", "f16c", "neon", "dotprod",
                                                                      "i8mm")))
    print(f"host features used for tiers: {' '.join(feats)}")
    if sel_err:
        print(f"selected CPU tier: NONE — {sel_err}")
    else:
        print(f"selected CPU tier: {sel_name} ({why})")
    print()
    print(f"{'target':<16}{'backend':<8}{'lowering':<10}{'run here':<34}{'width':<9}features / notes")
    for t in all_targets():
        name = t.name if t.arch in ("x86_64",) or not t.is_cpu else f"arm64-{t.name}"
        if t.is_cpu:
            lowering = "yes"
            if can_run(t):
                run = "yes" + (" (selected)" if t.name == sel_name and t.arch == host_arch() else "")
            else:
                run = "compile-only: missing " + ",".join(missing_features(t))
            width = f"{t.vector_bits}b"
            notes = t.feature_string or "(baseline)"
        elif t.backend in FAMILIES:
            lowering = "yes"
            run = backend_of(t).runs(t)
            width = f"warp {t.warp_size}"
            notes = t.description
        else:
            lowering = "not yet"
            run = "no (no lowering yet)"
            width = f"warp {t.warp_size}" if t.warp_size else "-"
            notes = t.description
        if len(run) > 33:
            run = run[:30] + "..."
        print(f"{name:<16}{t.backend:<8}{lowering:<10}{run:<34}{width:<9}{notes}")
    return 0


# --------------------------------------------------------------------------------------- kernel loading
def load_kernel(spec: str):
    from .jit import Kernel
    if ":" not in spec:
        raise ValueError(f"KERNEL must be 'module:name' or 'file.py:name', got {spec!r}")
    mod, name = spec.rsplit(":", 1)
    if mod.endswith(".py") or os.path.sep in mod:
        path = os.path.abspath(mod)
        if not os.path.exists(path):
            raise ValueError(f"no such file: {mod}")
        sys.path.insert(0, os.path.dirname(path))
        s = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        m = importlib.util.module_from_spec(s)
        try:
            s.loader.exec_module(m)
        except Exception as e:   # the user's file: say which and why, not a traceback through importlib
            raise ValueError(f"cannot load {mod}: {type(e).__name__}: {e}") from None
    else:
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"cannot import module {mod!r} ({e}); KERNEL is 'package.module:name' or "
                             f"'path/to/file.py:name'") from None
    k = getattr(m, name, None)
    if not isinstance(k, Kernel):
        raise ValueError(f"{spec} is not a @jitkern.kernel (found {type(k).__name__})")
    return k


def parse_sig(kernel, sig: str, consts: list) -> tuple:
    from . import ir
    types = {}
    hinted = set()
    for part in filter(None, (p.strip() for p in (sig or "").split(","))):
        if "=" not in part:
            raise ValueError(f"--sig entries look like name=*f32 or name=i32, got {part!r}")
        n, t = (x.strip() for x in part.split("=", 1))
        if t.endswith(":16"):
            # GPU argument specialisation, as a launch would find it: a 16-byte aligned pointer, an int % 16 == 0
            t = t[:-3]
            hinted.add(n)
        ptr = t.startswith("*")
        d = ir.DTYPES.get(t.lstrip("*"))
        if d is None:
            raise ValueError(f"unknown dtype {t!r} for '{n}' (known: {', '.join(ir.DTYPES)})")
        types[n] = ir.TileType(ir.PtrType(d)) if ptr else ir.TileType(d)
    cx = {}
    for c in consts or []:
        if "=" not in c:
            raise ValueError(f"--const entries look like NAME=VALUE, got {c!r}")
        n, v = c.split("=", 1)
        try:
            cx[n] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            cx[n] = getattr(ir, v, None) or ir.DTYPES.get(v) or v
    params = []
    for p in kernel.params:
        if p.name in kernel.constexpr_names:
            if p.name not in cx:
                if p.default is not p.empty:
                    cx[p.name] = p.default
                else:
                    raise ValueError(f"constexpr '{p.name}' needs --const {p.name}=VALUE")
            continue
        if p.name not in types:
            need = ", ".join(q.name for q in kernel.params if q.name not in kernel.constexpr_names)
            raise ValueError(f"parameter '{p.name}' needs a type in --sig (run-time parameters: {need})")
        params.append((p.name, types[p.name]))
    extra = set(types) - {n for n, _ in params}
    if extra:
        raise ValueError(f"--sig names unknown parameters: {', '.join(sorted(extra))}")
    if hinted:
        from .args import SPEC_HINTS
        cx[SPEC_HINTS] = tuple((n, 16) for n, _ in params if n in hinted)
    return params, cx


def _target(name):
    if name is None:
        from .runtime.cpu import runtime_target
        return runtime_target()
    from targets import get_target
    return get_target(name)


def cmd_ir(args) -> int:
    from .compiler import build_ir, lower
    from .ir import format_function
    k = load_kernel(args.kernel)
    params, consts = parse_sig(k, args.sig, args.const)
    t = _target(args.target)
    fn = build_ir(k, params, consts, t)
    print(format_function(fn))
    if args.llvm:
        print()
        print(lower(fn, t))
    return 0


def cmd_asm(args) -> int:
    from .compiler import compile_kernel
    k = load_kernel(args.kernel)
    params, consts = parse_sig(k, args.sig, args.const)
    t = _target(args.target)
    ck = compile_kernel(k, params, consts, t, load=False, emit=("obj", "asm"))
    print(ck.asm())
    return 0


# ---------------------------------------------------------------------------------------------- build
# What `jitkern build` compiles is registered by the package that launches the kernels (the engine registers
# its warm-up in setup.cfg), so the compiler never imports its clients: an entry point of this group names a
# callable (model, device) that drives the kernels' launches, raising BuildInputError for an unusable model.
KERNEL_SET_GROUP = "jitkern.kernel_sets"


def kernel_set():
    """The registered kernel set's driver (LookupError naming the group when none is installed)."""
    from importlib.metadata import entry_points
    found = sorted(entry_points(group=KERNEL_SET_GROUP), key=lambda e: e.name)
    if not found:
        raise LookupError(f"no kernel set is registered (entry point group {KERNEL_SET_GROUP}); install the "
                          f"package with `pip install -e .` so the engine's registration is seen")
    return found[0].load()


def cmd_build(args) -> int:
    from targets import get_target
    from .runtime.launch import compile_only
    if args.model is not None and not os.path.exists(args.model):
        return _fail(f"--model {args.model}: no such file or directory; pass a model directory or .gguf file "
                     f"(or leave --model out for the embedded SmolLM2)", "jitkern build")
    t = get_target(args.target)
    from .backends import FAMILIES, backend_of
    if t.backend not in FAMILIES:
        return _fail(f"target {t.name} ({t.backend}) has no lowering yet; CPU tiers, CUDA targets "
                     f"(sm_80 ... sm_120a), AMD targets (gfx90a, gfx942, gfx1100) and vulkan can be built now")
    backend = backend_of(t)
    problem = backend.build_problem(t)
    if problem is not None:
        return _fail(problem, "jitkern build")
    from tqdm import tqdm
    bar = tqdm(desc=f"compiling for {t.name}", unit="kernel", disable=args.quiet)
    seen, cached = set(), set()

    def on_compile(ck):
        key = (ck.target.name, ck.symbol)
        if key in seen:
            return
        seen.add(key)
        if ck.from_cache:
            cached.add(key)
        bar.update(1)
        bar.set_postfix_str(ck.name)

    from .errors import BuildInputError
    try:
        drive = kernel_set()
    except LookupError as e:
        bar.close()
        return _fail(str(e), "jitkern build")
    co = compile_only(t, on_compile)
    try:
        # GPU targets: the engine's device-array path on a host-memory stand-in for the device
        # (backend.build_device): the cache gets what an engine on that GPU will ask for, so it loads with no compile
        with co, backend.build_device(t):
            drive(args.model, device=backend.engine_device)
    except BuildInputError as e:
        return _fail(f"--model: {e}", "jitkern build")
    finally:
        bar.close()
    if co.errors:
        name, err = co.errors[0]
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return _fail(f"{len(co.errors)} kernel specialisation(s) failed to compile for {t.name}; first: "
                     f"{name}: {first[:500]}")
    from .compiler import kernel_cache
    own = sum(1 for name, _ in seen if name == t.name)
    host = {name for name, _ in seen if name != t.name}
    also = f" (and {len(seen) - own} for this host's {', '.join(sorted(host))} tier: the kernels that run on " \
        f"the host, such as the sampler's on logits copied back)" if host else ""
    print(f"{own} kernel specialisations for {args.target} are in the cache{also} ({len(cached)} were already "
          f"there) at {kernel_cache().path}")
    return 0


# ---------------------------------------------------------------------------------------------- cache
def cmd_cache(args) -> int:
    from .cache import KernelCache
    c = KernelCache()
    action = args.action or "info"
    if action == "clear":
        before = c.size_bytes()
        c.clear()
        print(f"cleared {before / 1e6:.2f} MB from {c.path}")
        return 0
    entries = c.entries()
    if action == "list":
        for e in entries:
            print(f"{e.device_tag:<28} {e.key[:16]}  {e.size_bytes / 1e3:8.1f} kB")
    by_dev = {}
    for e in entries:
        d = by_dev.setdefault(e.device_tag, [0, 0])
        d[0] += 1
        d[1] += e.size_bytes
    print(f"cache: {c.path}")
    print(f"total: {len(entries)} entries, {c.size_bytes() / 1e6:.2f} MB")
    for dev, (n, b) in sorted(by_dev.items()):
        print(f"  {dev:<28} {n:5d} entries {b / 1e6:8.2f} MB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="jitkern", description="jitkern: tile-DSL kernels compiled by llvmlite for "
                       "every processor. Inspect targets, fill the kernel cache, look at IR and assembly.",
                       epilog="Settings come from JITKERN_* environment variables (CPU tier, threads, cache "
                       "directory): see jitkern/env.py. Run `jitkern COMMAND --help` for a command's options.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", help="what to do (COMMAND --help for its options)")

    def add(name, hlp):
        return sub.add_parser(name, help=hlp, description=hlp[0].upper() + hlp[1:] + ".")

    s = add("targets", "list every known target, whether this host can run it, and the CPU tier selected (and "
                       "why)")
    s.set_defaults(fn=cmd_targets)
    s = add("build", "compile every kernel the engine uses into the cache (every config of an autotuned kernel: "
                     "the first run on the device times them, compiling nothing)")
    s.add_argument("--target", required=True, help="target name (jitkern targets lists them), e.g. avx2, sm_90a")
    s.add_argument("--model", default=None, help="model file or directory: compile the specialisations it needs "
                   "(default: the embedded SmolLM2)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_build)
    for name, fn, hlp in (("ir", cmd_ir, "print a kernel's jitkern IR (and LLVM IR with --llvm)"),
                          ("asm", cmd_asm, "print a kernel's assembly for a target")):
        s = add(name, hlp)
        s.add_argument("kernel", help="module:name or file.py:name of a @jitkern.kernel")
        s.add_argument("--sig", default="", help="run-time parameter types, e.g. 'x=*f32,y=*f16,n=i32'; a ':16' suffix "
                       "('x=*f32:16', 'n=i32:16') specialises as a GPU launch would for a 16-byte aligned pointer "
                       "or an int divisible by 16")
        s.add_argument("--const", action="append", default=[], metavar="NAME=VALUE", help="constexpr value "
                       "(repeatable)")
        s.add_argument("--target", default=None, help="target name (default: this host's selected CPU tier)")
        if name == "ir":
            s.add_argument("--llvm", action="store_true", help="also print the LLVM IR of the lowering")
        s.set_defaults(fn=fn)
    s = add("cache", "show where the kernel cache is and how big, list its entries, or clear it")
    s.add_argument("action", nargs="?", choices=("info", "list", "clear"), help="info (default), list, clear")
    s.set_defaults(fn=cmd_cache)
    return p


def main(argv=None) -> int:
    return run_main(_main, argv, "jitkern")


def _main(argv) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "fn", None):
        p.print_help()
        return 0
    # Settings are checked before any kernel is loaded or compiled. `targets` reports a bad JITKERN_CPU_TIER
    # in its listing; commands that name their --target do not use it; only commands that write check the cache.
    checks = {"targets": dict(tier=False, cache=False),
              "build": dict(tier=False),
              "ir": dict(tier=args.cmd == "ir" and args.target is None, cache=False),
              "asm": dict(tier=args.cmd == "asm" and args.target is None),
              "cache": dict(tier=False)}[args.cmd]
    also = ()
    if args.cmd == "build":
        # the registered kernel set's own setting checks (the engine's), before anything compiles
        try:
            also = tuple(c for c in (getattr(kernel_set(), "check_environment", None),) if c is not None)
        except LookupError:
            pass                # (cmd_build reports the missing registration)
    rc = check_settings(f"jitkern {args.cmd}", also=also, **checks)
    if rc is not None:
        return rc
    from .errors import JitkernError
    from .language import CompilationError
    try:
        return args.fn(args) or 0
    except (ValueError, JitkernError, CompilationError, RuntimeError) as e:
        return _fail(str(e), f"jitkern {args.cmd}")


if __name__ == "__main__":
    sys.exit(main())
