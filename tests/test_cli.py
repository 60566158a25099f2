"""The command lines (`python -m engine.cli`, `jitkern`): a user's mistake is one line on stderr naming the
setting or flag and the fix, exit status 2, no traceback; Ctrl-C is one line and status 130; every command
and option has help text.

The commands run as subprocesses. Most engine.cli runs go through a wrapper whose LLM class refuses to load
a model: the errors must be found before any model load or compile, which also keeps these tests fast.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# engine.cli with a model load that fails the test (status 99 and a marker) if it is ever reached.
NO_LOAD = textwrap.dedent("""
    import sys
    import engine.llm
    class NoLoad:
        def __init__(self, *a, **k):
            print("MODEL LOAD REACHED", file=sys.stderr)
            sys.exit(99)
    engine.llm.LLM = NoLoad
    from engine.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITKERN_")}
    env["JITKERN_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _run(argv, env, timeout=120):
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=timeout)


def _assert_one_line_error(r, *needles):
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, (r.returncode, err)
    assert "Traceback" not in err and "MODEL LOAD REACHED" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def _engine_cli(tmp_path, *args, **env):
    return _run([sys.executable, "-c", NO_LOAD, *args], _env(tmp_path, **env))


def _jitkern(tmp_path, *args, **env):
    return _run([sys.executable, "-m", "jitkern", *args], _env(tmp_path, **env))


# ------------------------------------------------------------------------------ settings before the load
@pytest.mark.parametrize("setting, value, needles", [
    ("JITKERN_CPU_TIER", "bogus", ["JITKERN_CPU_TIER='bogus'", "not a CPU tier", "set it to one of"]),
    ("JITKERN_NUM_THREADS", "abc", ["JITKERN_NUM_THREADS='abc'", "not an integer", "unset it"]),
    ("JITKERN_NUM_THREADS", "0", ["JITKERN_NUM_THREADS='0'", ">= 1"]),
    ("JITKERN_COMPILE_WORKERS", "many", ["JITKERN_COMPILE_WORKERS='many'", "not an integer"]),
    ("JITKERN_COMPILE_TIMEOUT", "-3", ["JITKERN_COMPILE_TIMEOUT='-3'", "> 0"]),
    ("JITKERN_COMPILE_TIMEOUT", "nan", ["JITKERN_COMPILE_TIMEOUT='nan'", "> 0"]),
    ("JITKERN_SPIN_US", "-1", ["JITKERN_SPIN_US='-1'", ">= 0"]),
    ("JITKERN_OVERLAP_OUTPUT", "maybe", ["JITKERN_OVERLAP_OUTPUT='maybe'", "not one of 0, 1"]),
    ("JITKERN_SPEC_BACKOFF", "slow", ["JITKERN_SPEC_BACKOFF='slow'", "not one of halve, reset, keep"]),
    ("JITKERN_CUDA_GRAPH_MAX_TOKENS", "-8", ["JITKERN_CUDA_GRAPH_MAX_TOKENS='-8'", ">= 0"]),
    ("JITKERN_POOL_SPLIT", "guided", ["JITKERN_POOL_SPLIT='guided'", "not one of static, dynamic"]),
])
def test_engine_cli_bad_setting(tmp_path, setting, value, needles):
    r = _engine_cli(tmp_path, "--prompt", "hi", **{setting: value})
    _assert_one_line_error(r, "python -m engine.cli: error:", *needles)


def test_engine_cli_tier_the_host_cannot_run(tmp_path):
    # Masking avx512f makes avx512 unrunnable on any host, so the check does not depend on this machine.
    r = _engine_cli(tmp_path, "--prompt", "hi", JITKERN_CPU_TIER="avx512", JITKERN_CPU_MASK_FEATURES="avx512f")
    _assert_one_line_error(r, "cannot run on this host", "avx512f", "JITKERN_CPU_TIER")


def test_engine_cli_unusable_cache_dir(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    r = _engine_cli(tmp_path, "--prompt", "hi", JITKERN_CACHE_DIR=str(a_file))
    _assert_one_line_error(r, "JITKERN_CACHE_DIR", "is not a directory", "writable directory")
    r = _engine_cli(tmp_path, "--prompt", "hi", JITKERN_CACHE_DIR=str(a_file / "below"))
    _assert_one_line_error(r, "JITKERN_CACHE_DIR", "not usable", "writable directory")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write to a read-only directory")
def test_engine_cli_read_only_cache_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = _engine_cli(tmp_path, "--prompt", "hi", JITKERN_CACHE_DIR=str(ro))
        _assert_one_line_error(r, "JITKERN_CACHE_DIR", "not usable", "writable directory")
    finally:
        ro.chmod(0o700)


def test_engine_cli_unwritable_cache_dir_even_for_root(tmp_path):
    # /proc refuses new directories to everyone, root included.
    r = _engine_cli(tmp_path, "--prompt", "hi", JITKERN_CACHE_DIR="/proc/jitkern-cache-test")
    _assert_one_line_error(r, "JITKERN_CACHE_DIR='/proc/jitkern-cache-test'", "not usable")


@pytest.mark.parametrize("args, needles", [
    (["--max-num-seqs", "0"], ["--max-num-seqs", "at least 1"]),
    (["--max-num-seqs", "x"], ["--max-num-seqs", "whole number"]),
    (["--repeat", "0"], ["--repeat", "at least 1"]),
    (["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "must be > 0 and <= 1"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "must be > 0 and <= 1"]),
    (["--top-p", "2"], ["--top-p", "top_p"]),
    (["--top-k", "-5"], ["--top-k", "top_k"]),
    (["--temperature", "nan"], ["--temperature", "temperature"]),
    (["--model", "/nonexistent/model"], ["--model", "/nonexistent/model", "no such file"]),
    (["--tokenizer-config", "/nonexistent/tc.json"], ["--tokenizer-config", "no such file"]),
    (["--bogus-flag"], ["unrecognized arguments", "--help"]),
])
def test_engine_cli_bad_flag(tmp_path, args, needles):
    r = _engine_cli(tmp_path, "--prompt", "hi", *args)
    _assert_one_line_error(r, "python -m engine.cli: error:", *needles)


def test_engine_cli_prompt_not_utf8(tmp_path):
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape).
    r = _run([sys.executable, "-c", NO_LOAD, "--prompt", b"caf\xe9 \xff"], _env(tmp_path))
    _assert_one_line_error(r, "--prompt", "not valid UTF-8", "0xe9")


def test_engine_cli_real_entry_point(tmp_path):
    """`python -m engine.cli` itself (no wrapper) stops on a bad setting before loading anything."""
    r = _run([sys.executable, "-m", "engine.cli", "--prompt", "hi"], _env(tmp_path, JITKERN_CPU_TIER="bogus"))
    _assert_one_line_error(r, "JITKERN_CPU_TIER")


# ---------------------------------------------------------------------------------------------- jitkern
@pytest.mark.parametrize("args, env, needles", [
    (["build", "--target", "avx2", "--model", "/nonexistent/m.gguf"], {}, ["jitkern build", "--model",
                                                                           "no such file"]),
    (["build", "--target", "bogus"], {}, ["jitkern build", "bogus"]),
    (["build"], {}, ["--target", "required"]),
    (["cache"], {"JITKERN_NUM_THREADS": "abc"}, ["jitkern cache", "JITKERN_NUM_THREADS"]),
    (["cache", "clear"], {"JITKERN_CACHE_DIR": "/proc/jitkern-cache-test"}, ["JITKERN_CACHE_DIR", "not usable"]),
    (["ir", "tests/test_compiler.py:_scale", "--sig", "x=*f32,out=*f32,n=i32", "--const", "BLOCK=16"],
     {"JITKERN_CPU_TIER": "bogus"}, ["jitkern ir", "JITKERN_CPU_TIER"]),
    (["ir", "no_such_module_xyz:k"], {}, ["jitkern ir", "no_such_module_xyz"]),
    (["frobnicate"], {}, ["invalid choice", "frobnicate"]),
])
def test_jitkern_errors(tmp_path, args, env, needles):
    _assert_one_line_error(_jitkern(tmp_path, *args, **env), *needles)


def test_jitkern_targets_reports_a_bad_tier_instead_of_failing(tmp_path):
    r = _jitkern(tmp_path, "targets", JITKERN_CPU_TIER="bogus")
    assert r.returncode == 0, r.stderr
    assert b"selected CPU tier: NONE" in r.stdout and b"JITKERN_CPU_TIER='bogus'" in r.stdout


def test_jitkern_cache_on_a_file_fails_cleanly(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    _assert_one_line_error(_jitkern(tmp_path, "cache", JITKERN_CACHE_DIR=str(a_file)),
                           "JITKERN_CACHE_DIR", "is not a directory")


# ----------------------------------------------------------------------------------------------- Ctrl-C
SLOW_ENGINE = textwrap.dedent("""
    import sys, time
    import engine.llm
    class SlowLoad:
        def __init__(self, *a, **k):
            print("loading", flush=True)
            time.sleep(60)
    engine.llm.LLM = SlowLoad
    from engine.cli import main
    sys.exit(main(["--prompt", "hi"]))
""")

SLOW_JITKERN = textwrap.dedent("""
    import sys, time
    import jitkern.cli
    def slow(args):
        print("working", flush=True)
        time.sleep(60)
    jitkern.cli.cmd_targets = slow
    sys.exit(jitkern.cli.main(["targets"]))
""")


@pytest.mark.parametrize("script, prog", [(SLOW_ENGINE, "python -m engine.cli"), (SLOW_JITKERN, "jitkern")],
                         ids=["engine.cli", "jitkern"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, script, prog):
    # A run started in the background of a non-interactive shell inherits SIGINT ignored, and Python keeps an
    # ignored SIGINT ignored; a terminal's Ctrl-C reaches a process with the default disposition, so restore it.
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline().strip() in (b"loading", b"working")
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert err.strip() == f"{prog}: interrupted", err


# ------------------------------------------------------------------------------------------------- help
def _all_parsers(parser):
    import argparse
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


@pytest.mark.parametrize("module", ["engine.cli", "jitkern.cli"])
def test_every_command_and_option_has_help(module):
    import importlib
    build_parser = importlib.import_module(module).build_parser
    for parser in _all_parsers(build_parser()):
        assert parser.description, f"{parser.prog} has no description"
        for action in parser._actions:
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help text"


@pytest.mark.parametrize("argv", [
    ["-m", "engine.cli", "--help"], ["-m", "jitkern", "--help"], ["-m", "jitkern", "targets", "--help"],
    ["-m", "jitkern", "build", "--help"], ["-m", "jitkern", "ir", "--help"], ["-m", "jitkern", "asm", "--help"],
    ["-m", "jitkern", "cache", "--help"], ["-m", "server", "--help"],
])
def test_help_runs(tmp_path, argv):
    r = _run([sys.executable, *argv], _env(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith(b"usage:") and not r.stderr, r.stderr
    assert len(r.stdout.splitlines()) > 4


def test_server_checks_settings_before_gunicorn(tmp_path):
    r = _run([sys.executable, "-m", "server", "--port", "1"], _env(tmp_path, JITKERN_CPU_TIER="bogus"))
    _assert_one_line_error(r, "JITKERN_CPU_TIER", "bogus")
    r = _run([sys.executable, "-m", "server", "--port", "1"], _env(tmp_path, JITKERN_NUM_THREADS="abc"))
    _assert_one_line_error(r, "JITKERN_NUM_THREADS")
