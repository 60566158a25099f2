"""perf/bench_serving.py against a real gunicorn on the scripted model: counts, lengths and latency stats."""
from __future__ import annotations

import json

import pytest

from perf import bench_serving
from tests.server_fakes import ServerProcess, smollm2_tokenizer


def test_random_prompts_have_the_exact_token_length():
    tok = smollm2_tokenizer()
    prompts = bench_serving.random_prompts(tok, 6, 57, seed=3)
    assert len(set(prompts)) == 6
    assert [len(tok.encode(p, add_special_tokens=False)) for p in prompts] == [57] * 6
    assert bench_serving.random_prompts(tok, 2, 20, seed=3) != bench_serving.random_prompts(tok, 2, 20, seed=4)


@pytest.fixture(scope="module")
def fake_server():
    server = ServerProcess("fake", env={"JITKERN_LOG_REQUESTS": "0", "JITKERN_API_KEY": "bench-key",
                                        "JITKERN_FAKE_STEP_DELAY": "0.005"})
    try:
        server.wait_ready()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_against_the_server(fake_server, tmp_path, endpoint, capsys):
    out = tmp_path / "result.json"
    rc = bench_serving.main(["--base-url", fake_server.base_url + "/v1", "--api-key", "bench-key", "--endpoint",
                             endpoint, "--num-prompts", "12", "--concurrency", "4", "--input-len", "40",
                             "--output-len", "9", "-q", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["successful_requests"] == 12 and rep["failed_requests"] == 0
    assert rep["output_tokens_counted_from"] == "usage" and rep["total_output_tokens"] == 12 * 9
    if endpoint == "completions":
        assert rep["total_input_tokens"] == 12 * 40       # the server's own count agrees with the prompt builder
    else:
        assert rep["total_input_tokens"] > 12 * 40        # plus the chat template
    # Structure, not speed: every statistic is there and ordered. (A lower bound from the fake's 5 ms step
    # failed on a loaded host, where the client reads several SSE chunks at once and an interval is ~0.)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = rep[key]
        assert set(s) == {"mean", "median", "p99"}, (key, s)
        assert all(isinstance(v, float) for v in s.values()), (key, s)
        assert 0 <= s["median"] <= s["p99"] and s["mean"] >= 0, (key, s)
    assert rep["ttft_ms"]["median"] > 0 and rep["e2el_ms"]["median"] >= rep["ttft_ms"]["median"]
    assert rep["output_throughput"] == pytest.approx(rep["total_output_tokens"] / rep["duration_s"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_reports_failures(fake_server, tmp_path):
    out = tmp_path / "r.json"
    rc = bench_serving.main(["--base-url", fake_server.base_url + "/v1", "--api-key", "wrong", "--model", "fake-model",
                             "--num-prompts", "2", "--warmup", "0", "--input-len", "8", "--output-len", "2", "-q",
                             "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 1 and rep["failed_requests"] == 2 and "401" in rep["errors"][0]
