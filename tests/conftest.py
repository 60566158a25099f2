"""Shared test setup: a private kernel cache per test session, and CPU-tier parametrisation helpers."""
import os
import tempfile

import pytest

# Under CI=true a missing torch / transformers / sentencepiece fails the run instead of skipping (see there).
pytest_plugins = ("tests.ci_oracles",)

# A fresh kernel cache per run keeps tests independent of the user's cache; set before jitkern is used.
# The process that starts the run (plain pytest, or pytest-xdist's controller under `make test`'s `-n 2`) makes
# the directory and exports it; xdist's workers inherit the environment and share it, so a kernel compiled by one
# worker is a disk hit for the other (the cache's writes are atomic renames, made for concurrent processes). The
# creating process removes it at the end of the session (pytest_unconfigure below): a run's cache is ~1.7 GB.
# JITKERN_TEST_KEEP_CACHE=1 uses JITKERN_CACHE_DIR (or the default cache) as it is and never deletes it.
_RUN_CACHE_ENV = "JITKERN_TEST_RUN_CACHE"
_created_cache = None
if "JITKERN_TEST_KEEP_CACHE" not in os.environ:
    _dir = os.environ.get(_RUN_CACHE_ENV) if os.environ.get("PYTEST_XDIST_WORKER") else None
    if _dir is None and os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        # a worker whose controller did not export a directory (xdist started without this conftest in the
        # controller): one directory per run, keyed on the run's id; left for the OS's temporary-file cleanup
        _run = os.environ["PYTEST_XDIST_TESTRUNUID"]
        _dir = os.path.join(tempfile.gettempdir(), f"jitkern-test-cache-xdist-{_run}")
    if _dir is None:
        _dir = _created_cache = tempfile.mkdtemp(prefix="jitkern-test-cache-")
        os.environ[_RUN_CACHE_ENV] = _dir
    os.makedirs(_dir, exist_ok=True)
    os.environ["JITKERN_CACHE_DIR"] = _dir


def pytest_unconfigure(config):
    """Remove the run's kernel cache in the process that created it (the controller under xdist, after its
    workers have exited); never a directory the user named."""
    if _created_cache is not None:
        import shutil
        shutil.rmtree(_created_cache, ignore_errors=True)


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


def vulkan_tiers():
    """["vulkan"] where a Vulkan device answers (Mesa's lavapipe counts: CI installs it), unless
    JITKERN_TEST_VULKAN=0; never raises. JITKERN_TEST_VULKAN=all runs the whole op matrix there (see below)."""
    if os.environ.get("JITKERN_TEST_VULKAN", "1") == "0":
        return []
    try:
        from jitkern.runtime import vulkan
        return ["vulkan"] if vulkan.is_available() else []
    except Exception:       # noqa: BLE001
        return []


def all_tier_params():
    """CPU tiers, then the GPU (marked `gpu`: CI deselects it; run there with `-m gpu`), then Vulkan (marked
    `vulkan`, not deselected: lavapipe runs it in CI; `-m "not vulkan"` leaves it out)."""
    return (tier_params() + [pytest.param(n, id=n, marks=pytest.mark.gpu) for n in gpu_tiers()]
            + [pytest.param(n, id=n, marks=pytest.mark.vulkan) for n in vulkan_tiers()])


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def fake_or_cuda(request, monkeypatch):
    """"fake": tests/fake_cuda.py's host-memory device installed (CPU kernels on the engine's device path);
    "cuda": a real GPU (gpu-marked, skipped without one). The parameter's name."""
    if request.param == "fake":
        from tests.fake_cuda import install
        install(monkeypatch)
    else:
        from jitkern.runtime import cuda
        if not cuda.is_available():
            pytest.skip("no CUDA device here")
    return request.param


@pytest.fixture(params=all_tier_params())
def tier(request):
    """A runnable tier's Target: every CPU tier of this host, and the GPU where there is one. Kernels launched
    with `target=tier` on a GPU take numpy arrays through the staged launch (copied in and back)."""
    from targets import get_target
    return get_target(request.param)


# Vulkan on lavapipe costs ~1-3 s of shader compilation per kernel specialisation (launches after that are
# ~40 ms), so the default suite runs the DSL suite, the cheap op files and a representative case of each
# heavy op family on Vulkan; the rest of the op matrix is marked slow and skips unless JITKERN_TEST_VULKAN=all.
_VULKAN_DEFAULT_FILES = {"tests/test_dsl.py", "tests/test_vulkan.py", "tests/test_engine_vulkan.py",
                         "tests/ops/test_activation.py",
                         "tests/ops/test_softmax.py", "tests/ops/test_norm.py", "tests/ops/test_rope.py",
                         "tests/ops/test_embedding.py", "tests/ops/test_parallel.py", "tests/ops/test_moe_bias.py"}
# Left to JITKERN_TEST_VULKAN=all (lavapipe, this 2-core host, 2026-12-01): test_route_sigmoid_group[vulkan-64-8-8-4-True]
# 178 s and test_route_softmax_group_limited[vulkan-64-6-8-3] 88 s (the group-routing kernels' sorts: hundreds of
# barriers, each a coroutine suspend point in llvmpipe's compile), test_matmul_fp8[vulkan-tensor] 20 s, the f16/bf16
# MoE and the other group-routing cases 10-30 s each; the default runs one case of each new family instead.
_VULKAN_DEFAULT_CASES = {
    "test_matmul[vulkan]", "test_linear[vulkan-f16]",
    "test_argmax_rows[vulkan]", "test_topk_rows[vulkan-37-5]", "test_sample_from_logits[vulkan]",
    "test_quantize_q8_exact[vulkan]", "test_dequantize_rows_exact[vulkan-q4_K]", "test_matmul_q[vulkan-q8_0]",
    "test_matmul_q[vulkan-q4_K]", "test_decode_partition_axis[vulkan]",
    "test_route_topk[vulkan-8-2-True-0]", "test_moe_mlp_matches_numpy_and_is_batch_invariant[vulkan-f32]",
    "test_head_linear[vulkan-9-2-17-33]", "test_copy_heads[vulkan-3-4-8]", "test_matmul_fp8[vulkan-channel]",
    "test_matmul_fp8_batch_invariant[vulkan-channel]"}
# Tests of the default files above whose Vulkan cases are heavy on lavapipe: only the listed cases run by default,
# the rest with JITKERN_TEST_VULKAN=all. act_and_mul_q8 (2026-12-01, CPU seconds on this loaded host): the 24
# Vulkan cases cost ~230 s (gelu q4x4 1504/1536 ~63 s each); kept: every op x layout at I=96 (3 blocks: a q4x4
# pair + one) and silu q4x4 at I=1504 (whole groups of 4 blocks + a pair + one).
_VULKAN_DEFAULT_SUBSETS = {
    "test_act_and_mul_q8_is_act_then_quantize": {f"vulkan-{op}-{layout}-96" for op in ("silu", "gelu")
                                                 for layout in ("natural", "q4", "q4x4")} | {"vulkan-silu-q4x4-1504"},
}
# known not to work on Vulkan yet (skipped even with JITKERN_TEST_VULKAN=all, with the reason)
_VULKAN_BROKEN: dict = {}


# The CPU tiers: the default suite runs every op test on two of them, `portable` (the baseline any CPU of the
# architecture runs) and the best tier this host runs (what the engine uses here), each compile of which is a
# few seconds to minutes on a 2-core machine. The tiers between them (sse2, sse2-f16c; on an AVX-512 host also
# avx2, avx-vnni, avx512) share those two's lowering and differ in vector width and f16 conversion: they run the
# DSL suite and the cheap op files (the Vulkan default's files), the whole op matrix with JITKERN_TEST_FULL=1.
# Cases whose host-CPU run is minutes long run with JITKERN_TEST_FULL=1 as well: the GPU tensor-core linear's
# bit-identity checks on the host-memory stand-in device (`fake`: their kernels emulate MMA fragments and are the
# largest the host compiles; their `cuda` cases run on a GPU, and the stand-in keeps the float64 and batch-
# invariance checks of the same kernels), the GPU flash kernels' same-bits checks of tuning variants on the CPU
# tier (their GPU cases run on a GPU; the float64 checks of those kernels stay), and the largest portable-tier
# cases of the CPU attention kernels (the same kernels run there in the file's other cases and on the best tier).
# name -> the parameter sets it applies to: a case is left out when its id has every token of one of them
# ("cpu": its `tier` is a CPU tier; "secondary": a tier between portable and the best). The float64 checks of the
# GPU flash kernels keep f32 and f16 caches, GQA and softcap / sinks on the CPU tier; the DSL's 16-bit dots
# keep portable and the best tier.
_HEAVY_CASES = {
    # the GPU-shaped GGUF linear on the stand-in device: q4_K / q6_K (a Q4_K_M file's types) and the 32-element
    # types q8_0 / q4_0 / q4_1 stay in the default suite; every type runs on a GPU and with JITKERN_TEST_FULL=1
    "test_gpu_linear_matches_the_float64_reference": [(t, "fake") for t in (
        "q2_K", "q3_K", "q5_K", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "mxfp4")],
    "test_lora_on_a_bf16_checkpoint_on_the_device": [("fake",)],
    "test_linear_serial_chain_gives_the_serial_splits_bits": [("fake",)],
    "test_linear_16bit_out_is_the_f32_result_rounded": [("fake",)],
    "test_linear_prefetch_2_gives_the_same_bits": [("fake",)],
    "test_linear_serial_split_gives_the_slab_paths_bits": [("fake",)],
    "test_linear_16bit_x_gives_the_16bit_activations_bits": [("fake",)],
    "test_split_k_sum_folded_into_the_norm_and_the_activation": [("fake",)],
    "test_linear_tma_gives_the_same_bits": [("fake",)],
    "test_gated_linear_is_linear_then_act_and_mul": [("fake",)],
    "test_linear_big_tile_gives_the_decode_tiles_bits": [("fake",)],
    "test_linear_huge_tile_gives_the_decode_tiles_bits": [("fake",)],
    "test_linear_xl_tile_gives_the_decode_tiles_bits": [("fake",)],
    "test_linear_tall_tile_gives_the_decode_tiles_bits": [("fake",)],
    "test_split_k_qkv_folded_into_rope_and_cache": [("fake",)],
    "test_gate_up_writes_16bit_for_the_activation": [("engine", "tiles", "fake")],
    "test_paged_attention_on_device_arrays_alone_equals_batched": [("fake",)],
    "test_flash_fragment_ops_give_the_same_bits": [("cpu",)],
    "test_flash_row_slots_give_the_same_bits": [("cpu",)],
    "test_flash_warp_rows_give_the_same_bits": [("cpu",)],
    "test_flash_fold_skip_gives_the_same_bits": [("cpu",)],
    "test_flash_longest_first_gives_the_same_bits": [("cpu",)],
    "test_flash_pipelined_loads_give_the_same_bits": [("cpu",)],
    "test_flash_decode_warps_give_the_same_bits": [("cpu",)],
    "test_flash_step_blocks": [("cpu",)],
    "test_flash_16bit_operands": [("cpu",)],
    "test_flash_block_size_32": [("cpu",)],
    "test_flash_batch_invariance": [("cpu",)],
    "test_flash_matches_reference": [("cpu", "split"), ("cpu", "f16")],
    "test_flash_merge_writes_the_q8_input": [("cpu", "q4x4")],
    "test_flash_16bit_out": [("cpu", "bf16")],
    "test_rope_cache_tile_kernel_gives_the_head_loops_bits": [("secondary",)],
    "test_jitkern_build_compiles_every_engine_kernel": [("sm_80",)],
    "test_flash_head_groups": [("cpu", "mqa5"), ("cpu", "mha")],
    "test_prefill_merge_rows_is_bit_identical": [("portable",)],
    "test_dot_f32_by_bf16_rows_work_splits": [("secondary",)],
    "test_dot_of_16_bit_inputs": [("secondary",)],
    "test_dot_of_a_dot_with_a_tile_accumulator": [("secondary",)],
    "test_strided_tile_chunk_addresses": [("secondary",)],
    "test_prefill_token_groups_are_bit_identical_to_single_tokens": [("portable",)],
    "test_mixed_step_gqa": [("portable", "f16")],
    "test_mixed_step_head_layouts": [("portable", "gqa128")],
    "test_attention_sinks": [("portable",)],
}


def _is_heavy(item, cpu_tiers, secondary) -> bool:
    sets = _HEAVY_CASES.get(getattr(item, "originalname", None))
    callspec = getattr(item, "callspec", None)
    if not sets or callspec is None:
        return False
    tokens = set(callspec.id.split("-"))
    if callspec.params.get("tier") in cpu_tiers:
        tokens.add("cpu")
    if callspec.params.get("tier") in secondary:
        tokens.add("secondary")
    return any(all(t in tokens for t in want) for want in sets)


def _full_suite() -> bool:
    return os.environ.get("JITKERN_TEST_FULL", "0") not in ("", "0")


def _secondary_cpu_tiers() -> set:
    tiers = runnable_tiers()
    return set(tiers[1:-1])


def pytest_collection_modifyitems(config, items):
    if not _full_suite():
        secondary = _secondary_cpu_tiers()
        cpu_tiers = set(runnable_tiers())
        skip_tier = pytest.mark.skip(reason="a CPU tier between portable and this host's best: the full op matrix "
                                            "there runs with JITKERN_TEST_FULL=1")
        skip_heavy = pytest.mark.skip(reason="minutes of host-CPU compile: runs with JITKERN_TEST_FULL=1 (a GPU "
                                             "case of it runs on a GPU)")
        for item in items:
            callspec = getattr(item, "callspec", None)
            params = callspec.params if callspec is not None else {}
            path = item.nodeid.split("::")[0]
            if secondary and params.get("tier") in secondary and path not in _VULKAN_DEFAULT_FILES:
                item.add_marker(pytest.mark.slow)
                item.add_marker(skip_tier)
            if _is_heavy(item, cpu_tiers, secondary):
                item.add_marker(pytest.mark.slow)
                item.add_marker(skip_heavy)
    full = _full_suite() or os.environ.get("JITKERN_TEST_VULKAN", "1") == "all"
    skip = pytest.mark.skip(reason="Vulkan: the full op matrix on lavapipe runs with JITKERN_TEST_VULKAN=all")
    for item in items:
        if item.get_closest_marker("vulkan") is None:
            continue
        path = item.nodeid.split("::")[0]
        if path in _VULKAN_BROKEN:
            item.add_marker(pytest.mark.skip(reason=_VULKAN_BROKEN[path]))
            continue
        subset = _VULKAN_DEFAULT_SUBSETS.get(getattr(item, "originalname", None))
        if subset is not None and not full:
            if item.callspec.id in subset:
                continue
        elif full or path in _VULKAN_DEFAULT_FILES or item.name in _VULKAN_DEFAULT_CASES:
            continue
        item.add_marker(pytest.mark.slow)
        item.add_marker(skip)
