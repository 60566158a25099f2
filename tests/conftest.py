"""Shared test setup: a private kernel cache per test session, and CPU-tier parametrisation helpers."""
import os
import tempfile

import pytest

# A fresh cache per session keeps tests independent of the user's cache; set before jitkern is used.
if "JITKERN_TEST_KEEP_CACHE" not in os.environ:
    os.environ["JITKERN_CACHE_DIR"] = tempfile.mkdtemp(prefix="jitkern-test-cache-")


def runnable_tiers():
    """CPU tiers this host can execute (CI machines may lack AVX-512)."""
    from targets import cpu_tier_names, get_target
    from targets.cpu import can_run
    return [n for n in cpu_tier_names() if can_run(get_target(n))]


def tier_params():
    return [pytest.param(n, id=n) for n in runnable_tiers()]


@pytest.fixture(params=runnable_tiers())
def tier(request):
    """A runnable CPU tier's Target (parametrised over all of them)."""
    from targets import get_target
    return get_target(request.param)
