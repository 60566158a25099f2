"""vLLM's GPU memory sizing: on CUDA without --num-blocks / --kv-cache-memory the KV pool gets what the measured
weights and activation reserve leave of --gpu-memory-utilization x the card (engine.sizing.gpu_num_blocks, run by
LLMEngine after ModelRunner.reserve_buffers); vLLM's GPU defaults of max_num_seqs / max_num_batched_tokens; the
CPU's sizing and defaults unchanged.

The arithmetic is checked by hand at the Llama-3-8B shape, and end to end on tests/fake_cuda.py's device, whose
HostMemoryDevice.set_memory makes it report a card's (free, total) that falls as the engine allocates (a pool
that keeps freed memory, as CudaDevice's does)."""
import logging

import pytest

from engine.sizing import (GIB, GpuMemoryProfile, KVPoolTooSmallError, check_gpu_memory_utilization,
                           default_batch_limits, gpu_num_blocks, kv_block_bytes, kv_cache_log_line)

MIB = 1 << 20
# tests/model_fixtures.py's llama: 2 layers, 2 KV heads of 16, an f32 checkpoint (so an f32 cache), 512 positions
TINY_BLOCK = kv_block_bytes(2, 2, 16, 16, 4)


# ------------------------------------------------------------------------------------------------ arithmetic
def test_llama3_8b_shape_on_an_80gb_card():
    """The issue's case: an 8B model on an 80 GB card gets ~400k tokens of KV, not 8,192."""
    per_block = kv_block_bytes(32, 8, 128, 16, 2)
    assert per_block == 2 * MIB
    prof = GpuMemoryProfile(total=80 * GIB, free_at_start=int(79.5 * GIB), free_after_weights=int(64.5 * GIB),
                            free_after_reserve=int(62.5 * GIB))
    assert (prof.weights, prof.activation_reserve, prof.in_use) == (15 * GIB, 2 * GIB, int(17.5 * GIB))
    # 0.9 x 80 GiB = 72 GiB, less 17.5 GiB in use = 54.5 GiB of 2 MiB blocks
    assert gpu_num_blocks(prof, 0.9, per_block, 16) == 27904
    assert gpu_num_blocks(prof, 0.5, per_block, 16) == 11520         # 40 - 17.5 = 22.5 GiB
    line = kv_cache_log_line(27904, 16, per_block, 8192)
    assert "KV cache: 446,464 tokens" in line and "max concurrency 54.50x" in line and "8,192 tokens" in line


def test_too_small_names_every_size():
    per_block = kv_block_bytes(32, 8, 128, 16, 2)
    # 24 GiB card: 0.5 GiB context, 16 GiB weights, 2 GiB activation reserve
    prof = GpuMemoryProfile(total=24 * GIB, free_at_start=int(23.5 * GIB), free_after_weights=int(7.5 * GIB),
                            free_after_reserve=int(5.5 * GIB))
    # 0.75 x 24 = 18 GiB < 18.5 GiB in use: no block
    with pytest.raises(KVPoolTooSmallError) as e:
        gpu_num_blocks(prof, 0.75, per_block, 16)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in ("card total 24.00 GiB", "--gpu-memory-utilization 0.75", "= 18.00 GiB",
                   "in use after the load 18.50 GiB", "weights 16.00 GiB", "activation reserve 2.00 GiB",
                   "other processes 512.00 MiB", "left for the KV cache -512.00 MiB",
                   "one block of 16 tokens needs 2.00 MiB", "not even one block fits"):
        assert needle in msg, (needle, msg)
    # 0.9 x 24 = 21.6 GiB: 3.1 GiB left = 1587 blocks of 2 MiB (25,392 tokens)
    assert gpu_num_blocks(prof, 0.9, per_block, 16) == 1587
    assert gpu_num_blocks(prof, 0.9, per_block, 16, max_model_len=1587 * 16) == 1587      # exactly one sequence
    with pytest.raises(KVPoolTooSmallError) as e:
        gpu_num_blocks(prof, 0.9, per_block, 16, max_model_len=1587 * 16 + 1)
    assert "one sequence of --max-model-len 25393 needs 1588 blocks" in str(e.value)
    assert "left for the KV cache 3.10 GiB" in str(e.value)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), "abc", None])
def test_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        check_gpu_memory_utilization(value)


def test_utilization_accepts_fractions():
    assert check_gpu_memory_utilization("0.5") == 0.5
    assert check_gpu_memory_utilization(1) == 1.0


def test_default_batch_limits_gpu_vs_cpu():
    # the CPU (and Vulkan) keep today's numbers whatever the context
    for ctx in ("llm_class", "openai_api_server"):
        assert default_batch_limits("cpu", ctx, 80 * GIB) == (64, 2048)
        assert default_batch_limits("vulkan", ctx, 80 * GIB) == (64, 2048)
    # CUDA: vLLM's 256 sequences; the token budget by context and card memory (>= 70 GiB)
    assert default_batch_limits("cuda", "llm_class", 80 * GIB) == (256, 16384)
    assert default_batch_limits("cuda", "openai_api_server", 80 * GIB) == (256, 8192)
    assert default_batch_limits("cuda", "llm_class", 70 * GIB) == (256, 16384)
    assert default_batch_limits("cuda", "llm_class", 70 * GIB - 1) == (256, 8192)
    assert default_batch_limits("cuda", "openai_api_server", 24 * GIB) == (256, 2048)
    assert default_batch_limits("cuda", "llm_class", None) == (256, 8192)
    with pytest.raises(ValueError, match="usage_context"):
        default_batch_limits("cuda", "benchmark", 80 * GIB)


def test_decode_buckets_cover_256_sequences():
    from engine.limits import MAX_DECODE_GRAPHS
    from engine.model_runner import decode_bucket, decode_buckets
    b = decode_buckets(256)
    assert b[:4] == [1, 2, 4, 8] and b[-1] == 256 and len(b) == 35
    assert all(decode_bucket(n, 256) >= n for n in range(1, 257))
    assert len(decode_buckets(64)) <= MAX_DECODE_GRAPHS          # (smaller caps keep the old bound)


def test_stand_in_device_reports_memory_as_a_pool():
    from jitkern.runtime.cuda import HostMemoryDevice
    dev = HostMemoryDevice(None)
    assert dev.mem_info() is None                    # no card size: the engine keeps its fixed budget
    dev.set_memory(total=10 * MIB, free=8 * MIB)
    assert dev.mem_info() == (8 * MIB, 10 * MIB)
    a = dev.alloc(MIB)
    assert dev.mem_info() == (7 * MIB, 10 * MIB)
    dev.free(a)
    assert dev.mem_info() == (7 * MIB, 10 * MIB)     # the pool keeps freed memory
    b = dev.alloc(MIB // 2)
    assert dev.mem_info() == (7 * MIB, 10 * MIB)     # ... and reuses it
    dev.alloc(MIB)
    assert dev.mem_info() == (8 * MIB - (MIB + MIB // 2), 10 * MIB)
    dev.free(b)
    with pytest.raises(ValueError):
        dev.set_memory(total=MIB, free=2 * MIB)


# ------------------------------------------------------------------------------------ the engine on the fake
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.model_fixtures import tiny_model_dir
    return tiny_model_dir(tmp_path_factory, "llama", seed=3)[0]


def _card(monkeypatch, total, free):
    """A fresh fake device (nothing held) reporting a card of `total` bytes with `free` of them free."""
    from tests.fake_cuda import install
    dev = install(monkeypatch)
    dev.set_memory(total=total, free=free)
    return dev


PROMPTS = [[5, 9, 12, 40, 7], [3, 3, 80, 100, 2, 17, 9, 9], [200, 11]]


def _greedy(llm, n=8):
    from engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp)]


def test_fake_card_pool_fills_the_utilization(tiny_llama, monkeypatch, caplog):
    """No --num-blocks / --kv-cache-memory on CUDA: the pool is floor((util x total - in use after weights and
    reserve) / block), the engine then holds at most util x total (and less than a couple of blocks under it),
    logs the KV line, runs with vLLM's 256-sequence default, and decodes what the CPU engine decodes."""
    from engine.llm import LLM
    total, free = 2 * GIB, int(1.9 * GIB)
    dev = _card(monkeypatch, total, free)
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.2)
    try:
        e = llm.engine
        p = e.gpu_memory
        assert (p.total, p.free_at_start) == (total, free)
        assert p.weights > 0 and p.activation_reserve > 0
        expect = (int(0.2 * total) - (total - p.free_after_reserve)) // TINY_BLOCK
        assert e.num_blocks == expect > 0
        held = total - dev.mem_info()[0]
        assert int(0.2 * total) - 2 * TINY_BLOCK - MIB < held <= int(0.2 * total)
        assert e.max_model_len == 512                          # the model's: the pool holds far more
        tokens = e.num_blocks * 16
        assert f"KV cache: {tokens:,} tokens" in caplog.text
        assert f"max concurrency {tokens / 512:.2f}x" in caplog.text
        # vLLM's GPU defaults (a card under 70 GiB, the LLM class); the runner keeps a graph per decode bucket
        assert (e.args.max_num_seqs, e.args.max_num_batched_tokens) == (256, 8192)
        assert e.runner.max_graphs >= 35
        got = _greedy(llm)
    finally:
        llm.close()
    cpu = LLM(tiny_llama, device="cpu", num_blocks=64)
    try:
        assert got == _greedy(cpu)
    finally:
        cpu.close()
    # a larger fraction: more blocks, by 0.1 x total of them (the same weights and reserve on a fresh card)
    _card(monkeypatch, total, free)
    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.3)
    try:
        assert llm.engine.num_blocks - expect in (int(0.1 * total) // TINY_BLOCK, int(0.1 * total) // TINY_BLOCK + 1)
    finally:
        llm.close()


def test_fake_card_too_small(tiny_llama, monkeypatch):
    """Left < one --max-model-len sequence: one line naming the sizes; exactly one sequence: starts."""
    from engine.llm import LLM
    kw = dict(device="cuda", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, enforce_eager=True)
    _card(monkeypatch, GIB, GIB)
    probe = LLM(tiny_llama, gpu_memory_utilization=1.0, **kw)
    p = probe.engine.gpu_memory
    used = p.weights + p.activation_reserve
    probe.close()
    need = 512 // 16
    # 10 blocks short of one 512-token sequence
    _card(monkeypatch, 4 * GIB, used + (need - 10) * TINY_BLOCK)
    with pytest.raises(KVPoolTooSmallError) as e:
        LLM(tiny_llama, gpu_memory_utilization=1.0, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "--max-model-len 512 needs 32 blocks" in msg
    assert f"one block of 16 tokens needs {TINY_BLOCK} bytes" in msg and "card total 4.00 GiB" in msg
    # exactly one sequence: the pool is that
    _card(monkeypatch, 4 * GIB, used + need * TINY_BLOCK)
    llm = LLM(tiny_llama, gpu_memory_utilization=1.0, **kw)
    try:
        assert llm.engine.num_blocks == need
    finally:
        llm.close()
    # the weights alone over the fraction: no block at all
    _card(monkeypatch, 4 * GIB, 4 * GIB)
    with pytest.raises(KVPoolTooSmallError, match="not even one block fits"):
        LLM(tiny_llama, gpu_memory_utilization=used / (4 * GIB) / 2, **{**kw, "max_model_len": None})


def test_overrides_win_over_the_gpu_sizing(tiny_llama, monkeypatch):
    """--num-blocks, else --kv-cache-memory, decide the pool on CUDA too; the card's size still picks the default
    token budget (>= 70 GiB: vLLM's 16384 for the LLM class, 8192 for the server)."""
    from engine.llm import LLM
    from engine.llm_engine import EngineArgs, LLMEngine
    kw = dict(device="cuda", enforce_eager=True)
    _card(monkeypatch, 80 * GIB, 79 * GIB)
    for extra, blocks in (({"num_blocks": 40}, 40), ({"kv_cache_memory": 50 * TINY_BLOCK + 5}, 50),
                          ({"num_blocks": 40, "kv_cache_memory": 50 * TINY_BLOCK}, 40)):
        llm = LLM(tiny_llama, gpu_memory_utilization=0.01, **kw, **extra)   # 0.01 x 80 GiB would size otherwise
        try:
            assert llm.engine.num_blocks == blocks and llm.engine.gpu_memory is None
            assert (llm.engine.args.max_num_seqs, llm.engine.args.max_num_batched_tokens) == (256, 16384)
        finally:
            llm.close()
    eng = LLMEngine(EngineArgs(model=tiny_llama, device="cuda", use_graphs=False, num_blocks=40,
                               usage_context="openai_api_server"))
    try:
        assert (eng.args.max_num_seqs, eng.args.max_num_batched_tokens) == (256, 8192)
    finally:
        eng.close()


def test_cpu_sizing_and_defaults_unchanged(tiny_llama):
    from engine.llm import LLM
    from engine.llm_engine import _DEFAULT_KV_MEMORY
    outs = []
    for util in (0.9, 0.3):
        llm = LLM(tiny_llama, device="cpu", gpu_memory_utilization=util)
        try:
            e = llm.engine
            assert e.gpu_memory is None and e.num_blocks == _DEFAULT_KV_MEMORY // TINY_BLOCK
            assert (e.args.max_num_seqs, e.args.max_num_batched_tokens) == (64, 2048)
            outs.append(_greedy(llm))
        finally:
            llm.close()
    assert outs[0] == outs[1]
