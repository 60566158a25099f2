"""`python -m server --api-server-count 2`: two HTTP worker processes in front of one engine process
(server/shared_engine.py), on the CPU and (marked `gpu`) on CUDA.

Oracles: concurrent greedy streams equal their solo texts (both workers serve, one engine batches them),
/metrics adds up the workers' request counters (each request counted once, whichever worker served it), a
killed engine process fails the running stream with a 5xx naming the engine and is restarted, after which both
workers serve again; the flags that cannot go with it are refused before anything starts.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import openai

from tests.server_fakes import REPO_ROOT, ServerProcess, metrics_value
from tests.test_server_device import (API_KEY, BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, _cuda_ok, client_for,
                                      make_model_dir)

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
CONCURRENCY = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_model_dir(str(tmp_path_factory.mktemp("api-servers-llama")))


@pytest.fixture(scope="module", params=[pytest.param("cpu", id="cpu"),
                                        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def served(request, model_dir):
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device here")
    proc = ServerProcess("smollm2-tok", env={"JITKERN_DEVICE": request.param}, cli_args=[
        "--model", model_dir, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
        "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "32",
        "--api-server-count", "2"])
    try:
        proc.wait_ready()
    except RuntimeError as e:
        proc.kill()
        pytest.fail(str(e), pytrace=False)
    yield proc
    proc.kill()


def _metrics(proc) -> str:
    import http.client
    conn = http.client.HTTPConnection(proc.host, proc.port, timeout=60)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    return body


def _served_count(proc) -> float:
    return sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', _metrics(proc),
                                            re.MULTILINE))


def _concurrent_matches_solo(proc, tag):
    client = client_for(proc)
    model = client.models.list().data[0].id
    prompts = [f"{tag} {i}: the {w} of" for i, w in zip(range(CONCURRENCY), ["colour", "size", "price", "name"] * 6)]
    solo = [client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
    before = _served_count(proc)
    results, errors = {}, []
    barrier = threading.Barrier(CONCURRENCY)

    def worker(i):
        try:
            c = client_for(proc)          # a connection of its own: the kernel spreads them over both workers
            barrier.wait(60)
            chunks = list(c.completions.create(model=model, prompt=prompts[i], stream=True, **GREEDY))
            results[i] = "".join(ch.choices[0].text for ch in chunks)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors + [proc.log_tail(40)]
    assert [results[i] for i in range(CONCURRENCY)] == solo
    # every request counted once over the two workers' metrics
    assert _served_count(proc) - before == CONCURRENCY


def _pids(proc, pattern) -> list:
    return [int(p) for p in re.findall(pattern, proc.log_text())]


def test_two_workers_share_one_engine(served):
    deadline = time.monotonic() + 120      # the second worker may still be warming up when the first is ready
    while len(set(_pids(served, r"serving \S+ \(max_model_len \d+\) in pid (\d+)"))) < 2 and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    workers = set(_pids(served, r"serving \S+ \(max_model_len \d+\) in pid (\d+)"))
    engines = set(_pids(served, r"engine process (\d+): serving front ends"))
    attached = set(_pids(served, r"attached to the engine process (\d+)"))
    assert len(workers) == 2 and len(engines) == 1 and attached == engines, served.log_tail(40)
    _concurrent_matches_solo(served, "Item")


def test_a_killed_engine_process_is_restarted_and_both_workers_serve_again(served):
    client = client_for(served)
    model = client.models.list().data[0].id
    engine_pid = _pids(served, r"engine process (\d+): serving front ends")[-1]
    failed = []
    streaming = threading.Event()

    def long_stream():
        try:
            for _ in client.completions.create(model=model, prompt="Long story:", stream=True, max_tokens=900,
                                               temperature=0, extra_body={"ignore_eos": True}):
                streaming.set()
        except openai.APIError as e:
            failed.append(e)
        finally:
            streaming.set()
    t = threading.Thread(target=long_stream)
    t.start()
    # killed as soon as tokens flow (a fixed sleep let a fast host finish all 900 tokens first)
    assert streaming.wait(120), served.log_tail(40)
    os.kill(engine_pid, signal.SIGKILL)
    t.join(120)
    assert failed and "engine" in str(failed[0]), (failed, served.log_tail(40))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pids = _pids(served, r"engine process (\d+): serving front ends")
        if pids[-1] != engine_pid and len(re.findall(r"replica 0 is back", served.log_text())) >= 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the engine process was not restarted for both workers:\n" + served.log_tail(60))
    _concurrent_matches_solo(served, "Back")
    assert metrics_value(_metrics(served), "vllm:num_requests_running") == 0


@pytest.mark.parametrize("flags, message", [
    (["--no-engine-process"], "drop --no-engine-process"),
    (["--data-parallel-size", "2"], "data parallelism"),
    (["--enable-lora"], "--enable-lora"),
])
def test_flags_that_cannot_go_with_it_are_refused(flags, message):
    p = subprocess.run([sys.executable, "-m", "server", "--api-server-count", "2", *flags], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_gunicorn_with_settings_it_cannot_share_stops_with_one_line(model_dir):
    """The same refusal when gunicorn is started directly with JITKERN_* settings: exit 2, no engine started."""
    env = dict(os.environ, JITKERN_MODEL=model_dir, JITKERN_DEVICE="cpu", JITKERN_API_SERVER_COUNT="2",
               JITKERN_ENGINE_PROCESS="0", JITKERN_HOST="127.0.0.1", JITKERN_PORT="0")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "gunicorn", "--config", "python:server.gunicorn_conf", "server.app"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "drop --no-engine-process" in out and "Traceback" not in out, out
    assert "serving front ends" not in out          # no engine was started
