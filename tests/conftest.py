"""Shared test setup: a private kernel cache per test session, and CPU-tier parametrisation helpers."""
import os
import tempfile

import pytest

# Under CI=true a missing torch / transformers / sentencepiece fails the run instead of skipping (see there).
pytest_plugins = ("tests.ci_oracles",)

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


def gpu_tiers():
    """The GPU target of the CUDA device here, if any (never raises; empty without cuda-python or a GPU).
    JITKERN_TEST_GPU=0 leaves GPUs out."""
    if os.environ.get("JITKERN_TEST_GPU", "1") == "0":
        return []
    try:
        from jitkern.runtime import cuda
        return [cuda.get_device().target_name] if cuda.is_available() else []
    except Exception:       # noqa: BLE001
        return []


def all_tier_params():
    """CPU tiers, then the GPU (marked `gpu`: CI deselects it; run there with `-m gpu`)."""
    return tier_params() + [pytest.param(n, id=n, marks=pytest.mark.gpu) for n in gpu_tiers()]


@pytest.fixture(params=all_tier_params())
def tier(request):
    """A runnable tier's Target: every CPU tier of this host, and the GPU where there is one. Kernels launched
    with `target=tier` on a GPU take numpy arrays through the staged launch (copied in and back)."""
    from targets import get_target
    return get_target(request.param)
