"""perf/bandwidth_cpu.py: its DSL loops compute what they claim (against numpy in float64 on fresh random arrays), on
every thread count's split, and the decode byte count it feeds perf/bench.py adds up the checkpoint's tensors."""
import numpy as np
import pytest

from perf import bandwidth_cpu as bw


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stream_kernels_against_numpy(threads):
    # a size no thread count splits evenly: each run covers whole unrolled steps per thread, nothing past them
    arr = bw.Arrays((1 << 20) + 4 * 999, seed=threads)
    n = arr.elements(threads)
    assert 0 < arr.n - n < threads * bw.BLOCK * bw.UNROLL + 1
    a0, b0, c0 = (x.astype(np.float64) for x in (arr.a, arr.b, arr.c))
    arr.jitkern_call("read", threads)()
    np.testing.assert_allclose(arr.out[:threads].astype(np.float64).sum(), a0[:n].sum(), rtol=1e-4)
    arr.jitkern_call("copy", threads)()
    np.testing.assert_array_equal(arr.c[:n], arr.a[:n])
    np.testing.assert_array_equal(arr.c[n:], c0[n:])                 # the tail is not touched
    arr.jitkern_call("add", threads)()
    np.testing.assert_allclose(arr.a[:n], a0[:n] + b0[:n], rtol=1e-6)
    arr.jitkern_call("triad", threads)()
    np.testing.assert_allclose(arr.a[:n], b0[:n] + 0.5 * a0[:n], rtol=1e-6)   # c holds the copy of the first a


def test_decode_bytes_per_token_adds_up_the_checkpoint():
    from engine.default_model import default_model_path
    from engine.loader import load_checkpoint
    path = default_model_path()
    ck = load_checkpoint(path, load_tokenizer=False, check_shapes=False)
    got = bw.decode_bytes_per_token(path, context_tokens=100)
    emb = ck.tensors["token_embd.weight"]
    tied = "output.weight" not in ck.tensors
    rest = sum(t.nbytes for n, t in ck.tensors.items() if n != "token_embd.weight")
    one_row = emb.nbytes // max(emb.shape)           # the embedding lookup reads one row of the vocabulary's
    assert got["weights"] == rest + one_row + (emb.nbytes if tied else 0)
    cfg = ck.config
    assert got["kv"] == 100 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert got["total"] == got["weights"] + got["kv"]
