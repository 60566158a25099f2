"""pytest plugin (loaded by tests/conftest.py): under CI a missing oracle library fails the run.

Tests that compare against torch / transformers / sentencepiece call ``pytest.importorskip`` so a developer
without the test extras still runs the rest. In CI (``CI`` set to true/1/yes, as GitHub Actions and
.ci/run do) a skip there would hide a whole class of checks behind a green run, so:

- at start-up, an oracle library that cannot be found stops the run with a usage error naming it;
- an ``importorskip`` of an oracle that still skips (the package is there but fails to import) is reported
  as a failure, at collection (module-level) or in a test.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

ORACLES = ("torch", "transformers", "sentencepiece")


def ci_mode() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def missing_oracles() -> list[str]:
    missing = []
    for name in ORACLES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def pytest_configure(config):
    if ci_mode():
        missing = missing_oracles()
        if missing:
            raise pytest.UsageError(
                f"CI is set but the test oracle(s) {', '.join(missing)} cannot be imported; install the test "
                f"extras (make install-test, or pip install -e '.[test]'), or unset CI to skip those tests")


def _oracle_import_skip(report) -> str | None:
    """The skip reason if this skipped report is an importorskip of an oracle library."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    for name in ORACLES:
        if f"could not import '{name}'" in reason:
            return reason
    return None


def _fail_instead(report) -> None:
    if not (ci_mode() and report.skipped):
        return
    reason = _oracle_import_skip(report)
    if reason:
        report.outcome = "failed"
        report.longrepr = f"CI is set: a missing test oracle is a failure, not a skip ({reason})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_instead(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_instead(outcome.get_result())
