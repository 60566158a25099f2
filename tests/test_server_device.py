"""The real server process on a real device, driven by the official `openai` client.

Each device (cpu; cuda and vulkan, both marked `gpu`: `-m gpu` runs them) starts two servers once, serving
the same tiny random Llama with the embedded SmolLM2's tokenizer (a real 49152-token byte-level vocabulary, so
JSON constraints and tool calls meet realistic tokens, while a step costs milliseconds):
- "env": `gunicorn server.app` configured by JITKERN_* variables (JITKERN_DEVICE picks the device), the engine in
  the worker process (JITKERN_ENGINE_PROCESS=0);
- "cli": `python -m server --model ... --num-blocks ... --engine-process` with JITKERN_DEVICE in its environment,
  the engine in a process of its own.

Oracles are computed, never hard-coded: greedy text equals the engine alone (`engine.LLM` on the same
device in this process), streaming equals non-streaming, seeded sampling repeats, a stop string cuts the
unstopped text where it first occurs, constrained output validates against its schema, a dropped client's
request is aborted and its KV blocks freed, and concurrent greedy streams equal their solo runs (the
engine promises bit-identical greedy results alone and batched on every device).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import threading
import time

import pytest

import openai  # `make install-test`; a missing client is a failure here, not a skip

from tests.server_fakes import ServerProcess, metrics_value

jsonschema = pytest.importorskip("jsonschema")

API_KEY = "device-test-key"
MAX_MODEL_LEN = 1024        # room for the disconnect test's long stream
NUM_BLOCKS = 512            # x 16 tokens: 64 concurrent short streams plus the long one fit without preemption
BLOCK_SIZE = 16
MAX_NUM_SEQS = 64


def _cuda_ok() -> bool:
    if os.environ.get("JITKERN_TEST_GPU", "1") == "0":
        return False
    try:
        from jitkern.runtime import cuda
        return cuda.is_available()
    except Exception:       # noqa: BLE001 - no cuda-python / no driver: the variant skips
        return False


def _vulkan_ok() -> bool:
    # as tests/test_engine_vulkan.py detects it (on a machine without an NVIDIA Vulkan driver Mesa's lavapipe
    # may answer: then this variant runs there too, slowly)
    if os.environ.get("JITKERN_TEST_VULKAN", "1") == "0":
        return False
    try:
        from jitkern.runtime import vulkan
        return vulkan.is_available()
    except Exception:       # noqa: BLE001
        return False


DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
           pytest.param("vulkan", id="vulkan", marks=pytest.mark.gpu)]
# concurrent streams of the batch-invariance test (the CPU variant's 64 cost ~10 s on a 2-core host)
CONCURRENCY = 64


def make_model_dir(path: str, seed: int = 1) -> str:
    """A tiny random Llama (2 layers, hidden 64) with the embedded SmolLM2's tokenizer. Its weights are scaled so
    that outputs are informative: layer weights at 1/sqrt(fan-in) make attention carry the context (with HF's
    0.02 init the continuation depends on the last token alone, so prompts ending alike would continue alike),
    and an lm_head whose logits spread ~3 keeps temperature-1 samples varied without being uniform."""
    import transformers as tf
    from tests.model_fixtures import save_tiny_model
    from tests.structured_fixtures import SMOLLM2_VOCAB, write_smollm2_tokenizer
    tok = write_smollm2_tokenizer(path)
    cfg = tf.LlamaConfig(vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         rope_theta=10000.0, rms_norm_eps=1e-5)

    def init(model):
        model.get_input_embeddings().weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 3.0 / cfg.hidden_size ** 0.5)
        for p in model.model.layers.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    save_tiny_model(cfg, path, seed, init=init, tokenizer=False)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_model_dir(str(tmp_path_factory.mktemp("device-llama")))


class Served:
    """One running server with its client; `explain()` adds the server log's tail to a failure."""

    def __init__(self, name: str, proc: ServerProcess, device: str):
        self.name, self.proc, self.device = name, proc, device
        self.client = client_for(proc)
        self.model = self.client.models.list().data[0].id

    @contextlib.contextmanager
    def explain(self):
        try:
            yield
        except Exception as e:      # noqa: BLE001 - re-raised with the log (pytest's outcomes are not Exceptions)
            raise AssertionError(f"[{self.device} / {self.name} server: {' '.join(self.proc.cmd[1:4])}] "
                                 f"{type(e).__name__}: {e}\n--- server log tail ---\n{self.proc.log_tail(60)}") from e

    def metrics(self) -> str:
        conn = http.client.HTTPConnection(self.proc.host, self.proc.port, timeout=60)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
        assert resp.status == 200, body
        return body

    def server_info(self) -> dict:
        conn = http.client.HTTPConnection(self.proc.host, self.proc.port, timeout=60)
        conn.request("GET", "/server_info", headers={"Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert resp.status == 200, body
        return json.loads(body)


def client_for(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _start(proc: ServerProcess) -> ServerProcess:
    try:
        return proc.wait_ready()
    except RuntimeError as e:
        proc.kill()
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module", params=DEVICES)
def dev(request):
    """(device, {"env": Served, "cli": Served}): both servers of one device, started once."""
    device = request.param
    if device == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device here (jitkern.runtime.cuda.is_available() is false)")
    if device == "vulkan" and not _vulkan_ok():
        pytest.skip("no Vulkan device here (or JITKERN_TEST_VULKAN=0)")
    model_dir = request.getfixturevalue("model_dir")      # after the skips: a skipped device builds nothing
    env = {"JITKERN_MODEL": model_dir, "JITKERN_DEVICE": device, "JITKERN_API_KEY": API_KEY,
           "JITKERN_MAX_MODEL_LEN": MAX_MODEL_LEN, "JITKERN_NUM_BLOCKS": NUM_BLOCKS,
           "JITKERN_BLOCK_SIZE": BLOCK_SIZE, "JITKERN_MAX_NUM_SEQS": MAX_NUM_SEQS, "JITKERN_ENGINE_PROCESS": "0"}
    # the two ways the engine runs beside the HTTP threads, on every device: in the worker ("env") and in a
    # process of its own ("cli"; the CUDA default)
    cli = ["--model", model_dir, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
           "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--engine-process"]
    # One after the other: the second start finds the first one's compiled kernels in the shared cache.
    servers = {}
    try:
        servers["env"] = _start(ServerProcess(f"{device}-env", env=env))
        # the flags say everything else; JITKERN_DEVICE is how `python -m server` is told the device today
        servers["cli"] = _start(ServerProcess(f"{device}-cli", env={"JITKERN_DEVICE": device}, cli_args=cli))
        served = {name: Served(name, proc, device) for name, proc in servers.items()}
        yield device, served
    finally:
        for proc in servers.values():
            proc.close()


def test_device_setting(monkeypatch):
    """JITKERN_DEVICE is what picks the device of both launch modes here (no server needed)."""
    from server.cli import build_parser, gunicorn_command
    from server.settings import ServerSettings, SettingsError
    assert ServerSettings.from_env({"JITKERN_DEVICE": "Vulkan"}).engine_kwargs()["device"] == "vulkan"
    assert "device" not in ServerSettings.from_env({}).engine_kwargs()      # the engine's default: auto
    with pytest.raises(SettingsError, match="JITKERN_DEVICE"):
        ServerSettings.from_env({"JITKERN_DEVICE": "tpu"})
    # `python -m server` starts gunicorn from a clean slate of JITKERN_* settings: the device must survive it
    monkeypatch.setenv("JITKERN_DEVICE", "cpu")
    _, env = gunicorn_command(build_parser().parse_args([]))
    assert ServerSettings.from_env(env).device == "cpu"


def test_engine_process_setting(monkeypatch):
    """Where the engine runs: the flag when given; else its own process exactly when the device is CUDA (auto: a
    CUDA device answers), decided without making a CUDA context in the front end."""
    from engine.parallel import config as parallel_config
    from server.app import engine_in_own_process
    from server.settings import ServerSettings, SettingsError
    monkeypatch.setattr(parallel_config, "cuda_device_count", lambda: 0)
    assert not engine_in_own_process(ServerSettings(device="auto"))
    assert not engine_in_own_process(ServerSettings(device="cpu"))
    assert not engine_in_own_process(ServerSettings(device="vulkan"))
    assert engine_in_own_process(ServerSettings(device="cuda"))
    assert engine_in_own_process(ServerSettings(device="cpu", engine_process=True))
    monkeypatch.setattr(parallel_config, "cuda_device_count", lambda: 2)
    assert engine_in_own_process(ServerSettings())
    assert not engine_in_own_process(ServerSettings(engine_process=False))
    assert ServerSettings.from_env({"JITKERN_ENGINE_PROCESS": "0"}).engine_process is False
    with pytest.raises(SettingsError, match="JITKERN_ENGINE_PROCESS"):
        ServerSettings.from_env({"JITKERN_ENGINE_PROCESS": "maybe"})


GREEDY = dict(temperature=0.0)
IGNORE_EOS = {"ignore_eos": True}


def test_the_server_runs_on_the_device_it_was_told(dev):
    device, served = dev
    for s in served.values():
        with s.explain():
            # the setting reached the engine (an explicit device that is missing fails the start instead)
            assert s.server_info()["vllm_config"]["device"] == device


def test_greedy_completion_equals_the_engine_alone_on_the_same_device(dev, model_dir):
    """Both launch modes' greedy text and token count equal `engine.LLM` in this process on the same device."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    device, served = dev
    prompts = ["The weather today is", "def fibonacci(n):"]
    llm = LLM(model_dir, device=device, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS)
    try:
        alone = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    finally:
        llm.close()
    for s in served.values():
        with s.explain():
            for prompt, want in zip(prompts, alone):
                r = s.client.completions.create(model=s.model, prompt=prompt, max_tokens=24, extra_body=IGNORE_EOS,
                                                **GREEDY)
                assert r.usage.prompt_tokens == len(want.prompt_token_ids)
                assert r.usage.completion_tokens == len(want.outputs[0].token_ids) == 24
                assert r.choices[0].text == want.outputs[0].text, prompt
                assert r.choices[0].finish_reason == "length"


def test_chat_stream_concatenates_to_the_whole_answer(dev):
    _, served = dev
    s = served["env"]
    with s.explain():
        kwargs = dict(model=s.model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=20,
                      extra_body=IGNORE_EOS, **GREEDY)
        whole = s.client.chat.completions.create(**kwargs)
        chunks = list(s.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and text == whole.choices[0].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [whole.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_n_choices_are_reproducible_with_a_seed(dev):
    _, served = dev
    s = served["cli"]
    with s.explain():
        kwargs = dict(model=s.model, prompt="My favourite food is", max_tokens=12, n=4, temperature=1.0,
                      extra_body=IGNORE_EOS)
        first = s.client.completions.create(seed=1234, **kwargs)
        again = s.client.completions.create(seed=1234, **kwargs)
        other = s.client.completions.create(seed=4321, **kwargs)
        assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
        texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
        assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
        # each choice samples its own tokens: sampled at temperature 1 over a wide random distribution, four
        # 12-token texts coincide only if the choices share one random stream
        assert len(set(texts)) > 1, texts
        assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
        assert first.usage.completion_tokens == 4 * 12


def test_chat_logprobs(dev):
    _, served = dev
    s = served["env"]
    with s.explain():
        c = s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "Count to five."}],
                                             max_tokens=8, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS,
                                             **GREEDY)
        content = c.choices[0].logprobs.content
        assert len(content) == c.usage.completion_tokens == 8
        for e in content:
            values = [t.logprob for t in e.top_logprobs]
            assert len(values) == 3 and all(math.isfinite(v) and v <= 0.0 for v in values + [e.logprob])
            assert values == sorted(values, reverse=True)
            # greedy: the sampled token is the most likely one, listed with its own logprob
            assert e.logprob == pytest.approx(values[0], abs=1e-5)
            assert any(t.token == e.token and t.logprob == pytest.approx(e.logprob, abs=1e-6) for t in e.top_logprobs)


def test_stop_string_ends_the_text_before_it(dev):
    _, served = dev
    s = served["cli"]
    with s.explain():
        kwargs = dict(model=s.model, prompt="The first ten letters of the alphabet are", max_tokens=24,
                      extra_body=IGNORE_EOS, **GREEDY)
        text = s.client.completions.create(**kwargs).choices[0].text
        # a stop string taken from the middle of the unstopped text: the stopped text is everything before
        # its first occurrence
        stop = text[len(text) // 2:len(text) // 2 + 3]
        assert stop.strip(), f"no usable stop string in {text!r}"
        cut = text.index(stop)
        r = s.client.completions.create(stop=[stop], **kwargs)
        assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
        streamed = s.client.completions.create(stop=[stop], stream=True, **kwargs)
        assert "".join(ch.choices[0].text for ch in streamed) == text[:cut]


SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
                         "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 2}},
          "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_is_schema_valid(dev, temperature):
    _, served = dev
    s = served["env"]
    with s.explain():
        r = s.client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": "Describe a city."}], temperature=temperature,
            seed=3, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}]


def test_named_tool_choice_gives_a_call_with_json_arguments(dev):
    """A named function: the output is held to its parameters schema and parsed into a tool call, streamed
    and not."""
    _, served = dev
    s = served["cli"]
    with s.explain():
        kwargs = dict(model=s.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      max_tokens=100, **GREEDY)
        r = s.client.chat.completions.create(**kwargs)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls", r
        assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER)
        name, streamed, finish = None, "", None
        for chunk in s.client.chat.completions.create(stream=True, **kwargs):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = name or tc.function.name
                streamed += tc.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert (name, finish) == ("get_weather", "tool_calls")
        assert json.loads(streamed) == arguments          # greedy: the same call streamed


def test_metrics_has_vllm_gauges(dev):
    _, served = dev
    for s in served.values():
        with s.explain():
            text = s.metrics()
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                assert f"# TYPE {name} gauge" in text, name
                assert math.isfinite(metrics_value(text, name))


def _abort_count(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_frees_its_blocks(dev):
    """A long stream whose client goes away mid-way is aborted: its blocks go back (the KV usage gauge returns
    to its idle value), well before it could have run to max_tokens."""
    _, served = dev
    s = served["env"]
    with s.explain():
        deadline_idle = time.monotonic() + 60
        while metrics_value(s.metrics(), "vllm:num_requests_running") != 0:       # earlier tests' requests
            assert time.monotonic() < deadline_idle, "the server never went idle"
            time.sleep(0.1)
        before = s.metrics()
        idle_usage = metrics_value(before, "vllm:kv_cache_usage_perc")
        tokens_before = metrics_value(before, "vllm:generation_tokens_total")
        max_tokens = MAX_MODEL_LEN - 32
        conn = http.client.HTTPConnection(s.proc.host, s.proc.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": s.model, "prompt": "Tell me a very long story about", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = 0
        while events < 3:
            line = resp.fp.readline()
            assert line, "the stream ended early"
            events += line.startswith(b"data: {")
        # the request holds blocks while it runs (so the gauge can show them coming back)
        busy = s.metrics()
        assert metrics_value(busy, "vllm:num_requests_running") == 1
        assert metrics_value(busy, "vllm:kv_cache_usage_perc") > idle_usage
        resp.close()
        conn.close()
        deadline = time.monotonic() + 60
        while True:
            now = s.metrics()
            if (metrics_value(now, "vllm:num_requests_running") == 0
                    and metrics_value(now, "vllm:kv_cache_usage_perc") == idle_usage):
                break
            assert time.monotonic() < deadline, f"blocks not freed 60 s after the disconnect:\n{now}"
            time.sleep(0.05)
        # aborted, not run to the end: fewer tokens than asked for, counted as an abort
        assert metrics_value(now, "vllm:generation_tokens_total") - tokens_before < max_tokens
        assert _abort_count(now) == _abort_count(before) + 1


def test_concurrent_greedy_streams_equal_their_solo_runs(dev):
    """Batch invariance through the server: 64 distinct prompts streamed at once give each prompt's solo text."""
    _, served = dev
    concurrency = CONCURRENCY
    s = served["cli"]
    prompts = [f"Item {i}: the {w} of" for i, w in zip(range(concurrency),
                                                       ["colour", "size", "price", "name", "shape", "age", "speed",
                                                        "weight"] * 8)]
    kwargs = dict(model=s.model, max_tokens=16, extra_body=IGNORE_EOS, **GREEDY)
    with s.explain():
        t0 = time.monotonic()
        solo = [s.client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
        solo_s = time.monotonic() - t0
        # distinct prompts with (mostly) distinct texts: a stream given another one's tokens would show
        assert len(set(solo)) >= concurrency // 2, solo
        results, errors = {}, []
        barrier = threading.Barrier(concurrency)
        running = []

        def worker(i):
            try:
                c = client_for(s.proc)
                barrier.wait(120)
                chunks = list(c.completions.create(prompt=prompts[i], stream=True, **kwargs))
                results[i] = ("".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason)
            except Exception as e:      # noqa: BLE001 - reported below
                errors.append(f"{i}: {type(e).__name__}: {e}")

        def watch():
            while len(results) + len(errors) < concurrency:
                running.append(metrics_value(s.metrics(), "vllm:num_requests_running"))
                time.sleep(0.02)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
        watcher = threading.Thread(target=watch)
        t0 = time.monotonic()
        for t in threads:
            t.start()
        watcher.start()
        for t in threads:
            t.join(300)
        wave_s = time.monotonic() - t0
        watcher.join(60)
        assert not errors, errors
        assert len(results) == concurrency
        wrong = [(prompts[i], solo[i], results[i][0]) for i in range(concurrency) if results[i][0] != solo[i]]
        assert not wrong, f"{len(wrong)} of {concurrency} streams differ from their solo text: {wrong[:3]}"
        assert all(finish == "length" for _, finish in results.values())
        # they were batched: several requests ran in one engine at once (seen by the gauge, or, where a fast
        # engine finished between two samples of a busy server's /metrics, by the wave taking less than half
        # the time the same requests took one after another)
        assert max(running, default=0) > 1 or wave_s < 0.5 * solo_s, (running, wave_s, solo_s)
