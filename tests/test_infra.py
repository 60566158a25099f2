"""The test harness itself: under CI a missing oracle library fails the run; pytest-timeout ends a hang
inside native code. Each check runs pytest in a subprocess on a small generated test file."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Makes `torch` unimportable in the child (sys.modules[name] = None), then runs pytest with our plugin.
RUN_WITHOUT_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
""")


def _pytest(tmp_path, code, ci):
    test = tmp_path / "test_generated.py"
    test.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-c", RUN_WITHOUT_TORCH, "-p", "tests.ci_oracles", "-p", "no:cacheprovider", "-q",
            "--rootdir", str(tmp_path), "-c", os.devnull, str(test)]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


MODULE_SKIP = """
    import pytest
    torch = pytest.importorskip("torch")

    def test_needs_torch():
        assert torch.ones(1).item() == 1
"""

TEST_SKIP = """
    import pytest

    def test_free():
        assert 1 + 1 == 2

    def test_needs_torch():
        pytest.importorskip("torch")
"""


def test_without_ci_a_missing_oracle_skips(tmp_path):
    r = _pytest(tmp_path, TEST_SKIP, ci=False)
    assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout + r.stderr


def test_with_ci_a_missing_oracle_stops_the_run(tmp_path):
    r = _pytest(tmp_path, MODULE_SKIP, ci=True)
    assert r.returncode != 0
    assert "torch" in r.stderr and "CI is set" in r.stderr and "make install-test" in r.stderr, r.stderr


def test_with_ci_an_oracle_importorskip_is_a_failure(tmp_path):
    # A broken install: torch is found (the start-up check passes) but importing it fails, so
    # importorskip skips; under CI that skip must be reported as a failure (module level: a collection error).
    stub = tmp_path / "stubs" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError('broken torch install: no torch._C', name='torch._C')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(CI="true", PYTHONPATH=os.pathsep.join([str(tmp_path / "stubs"), str(ROOT)]))
    for code, rc, counts in ((MODULE_SKIP, 2, "1 error"), (TEST_SKIP, 1, "1 failed, 1 passed")):
        test = tmp_path / "test_generated.py"
        test.write_text(textwrap.dedent(code))
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_oracles", "-p", "no:cacheprovider", "-q",
                            "--rootdir", str(tmp_path), "-c", os.devnull, str(test)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == rc and counts in r.stdout, r.stdout + r.stderr
        assert "a missing test oracle is a failure" in r.stdout and "broken torch install" in r.stdout, r.stdout


def test_timeout_ends_a_hang_in_native_code(tmp_path):
    """setup.cfg's pytest-timeout method must end a test blocked in a C call that signals do not interrupt
    (a self-deadlocked pthread mutex): the signal method's Python-level handler would never run there (tried:
    it hangs), the thread method's watchdog ends the process."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    method = cfg["tool:pytest"]["timeout_method"]
    assert int(cfg["tool:pytest"]["timeout"]) > 0
    code = """
        import ctypes, pytest

        @pytest.mark.timeout(2)
        def test_hangs_in_c():
            libc = ctypes.CDLL(None)
            mutex = ctypes.create_string_buffer(64)   # zeroed = PTHREAD_MUTEX_INITIALIZER
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)            # deadlock
    """
    test = tmp_path / "test_hang.py"
    test.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o",
                        f"timeout_method={method}", "--rootdir", str(tmp_path), "-c", os.devnull, str(test)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and "Timeout" in (r.stdout + r.stderr) and "test_hangs_in_c" in (r.stdout + r.stderr)
