"""POST /v1/audio/transcriptions (server/audio.py) on a tiny random Whisper through Falcon's test client: a WAV
upload transcribed as transformers' generate does (json, text, verbose_json), /v1/models, chat refused, and the
400 / 413 / 415 answers naming the field (no file, undecodable audio, srt, a bad temperature or language, a model
that does not transcribe)."""
import io
import wave

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("soundfile")
pytest.importorskip("soxr")
falcon_testing = pytest.importorskip("falcon.testing")

from tests.whisper_fixtures import WORDS, make_whisper_dir, random_audio  # noqa: E402

BOUNDARY = "jitkern-test-boundary"


def multipart(fields: dict, files: dict) -> tuple:
    """(body, headers) of a multipart/form-data request."""
    out = io.BytesIO()
    for name, value in fields.items():
        out.write(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, data, ctype) in files.items():
        out.write(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                  f"Content-Type: {ctype}\r\n\r\n".encode())
        out.write(data)
        out.write(b"\r\n")
    out.write(f"--{BOUNDARY}--\r\n".encode())
    return out.getvalue(), {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    q = np.clip(np.round(np.asarray(samples, np.float64) * 32767), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(q.tobytes())
    return buf.getvalue()


def pcm16(samples):
    """The samples as the WAV holds them (16-bit), back in [-1, 1)."""
    return (np.clip(np.round(np.asarray(samples, np.float64) * 32767), -32768, 32767) / 32768.0).astype(np.float32)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    path = str(tmp_path_factory.mktemp("srv-whisper"))
    hf = make_whisper_dir(path, seed=2)
    engine = AsyncEngine(EngineArgs(model=path))
    app = create_app(engine=engine, settings=ServerSettings(log_requests=False, enable_metrics=False,
                                                            max_body_bytes=1 << 20))
    yield path, hf, falcon_testing.TestClient(app)
    app.close()


def _post(client, fields, files=None, **kw):
    body, headers = multipart(fields, files or {})
    return client.simulate_post("/v1/audio/transcriptions", body=body, headers=headers, **kw)


def _hf_tokens(path, hf, samples, n, language):
    fe = tf.WhisperFeatureExtractor.from_pretrained(path)
    feats = fe(samples, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        return hf.generate(feats, language=language, task="transcribe", max_new_tokens=n)[0].tolist()


def test_transcription_matches_transformers(srv):
    path, hf, client = srv
    a = random_audio(70, 1.4)
    files = {"file": ("speech.wav", wav(a), "audio/wav")}
    want = _hf_tokens(path, hf, pcm16(a), 12, "de")
    text = " ".join(f"t{t}" for t in want if t < WORDS)
    r = _post(client, {"model": client.app.state.served_model_name, "language": "de", "max_tokens": "12"}, files)
    assert r.status_code == 200, r.text
    assert r.json == {"text": text, "usage": {"type": "duration", "seconds": 2}}
    r = _post(client, {"language": "de", "max_tokens": "12", "response_format": "text"}, files)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == text + "\n"
    r = _post(client, {"language": "de", "max_tokens": "12", "response_format": "verbose_json",
                       "timestamp_granularities[]": "segment", "temperature": "0"}, files)
    assert r.status_code == 200, r.text
    v = r.json
    assert v["language"] == "german" and v["duration"] == pytest.approx(1.4) and v["text"] == text
    assert v["task"] == "transcribe" and len(v["segments"]) == 1
    seg = v["segments"][0]
    assert seg["tokens"] == want and seg["start"] == 0.0 and seg["end"] == pytest.approx(1.4)
    assert seg["avg_logprob"] < 0
    # without a language: detected
    r = _post(client, {"response_format": "verbose_json", "max_tokens": "4"}, files)
    assert r.status_code == 200 and r.json["language"] in ("english", "german", "french")


def test_models_and_chat_on_a_whisper_server(srv):
    _, _, client = srv
    r = client.simulate_get("/v1/models")
    assert r.status_code == 200 and r.json["data"][0]["id"] == client.app.state.served_model_name
    r = client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5"}]})
    assert r.status_code == 400 and "speech recognition" in r.json["error"]["message"]
    r = client.simulate_post("/v1/completions", json={"prompt": "t5 t6", "max_tokens": 2})
    assert r.status_code == 400 and r.json["error"]["param"] == "model"
    assert client.simulate_get("/health").status_code == 200


def test_transcription_errors_name_the_field(srv):
    _, _, client = srv
    good = {"file": ("a.wav", wav(random_audio(71, 0.3)), "audio/wav")}
    cases = [({}, {}, "file", "'file' field"),
             ({}, {"file": ("a.wav", b"RIFF....WAVEfmt garbage", "audio/wav")}, "file", "could not be decoded"),
             ({}, {"file": ("a.wav", b"", "audio/wav")}, "file", "empty"),
             ({"response_format": "srt"}, good, "response_format", "not supported"),
             ({"response_format": "yaml"}, good, "response_format", "not supported"),
             ({"temperature": "hot"}, good, "temperature", "number"),
             ({"temperature": "3"}, good, "temperature", "temperature"),
             ({"language": "klingon"}, good, "language", "not one this model knows"),
             ({"stream": "true"}, good, "stream", "not supported"),
             ({"timestamp_granularities[]": "word"}, good, "timestamp_granularities", "segment")]
    for fields, files, param, text in cases:
        r = _post(client, fields, files)
        assert r.status_code == 400, (fields, r.text)
        err = r.json["error"]
        assert err["param"] == param and text in err["message"], (fields, err)
    r = _post(client, {"model": "whisper-large-v9"}, good)
    assert r.status_code == 404 and r.json["error"]["param"] == "model"
    # JSON is not how audio is sent
    r = client.simulate_post("/v1/audio/transcriptions", json={"file": "abc"})
    assert r.status_code == 415
    # the server's body limit (1 MiB here)
    r = _post(client, {}, {"file": ("big.wav", wav(np.zeros(600_000, np.float32) + 0.1), "audio/wav")})
    assert r.status_code == 413
    r = client.simulate_post("/v1/audio/transcriptions", body=b"--x\r\nnot multipart",
                             headers={"Content-Type": "multipart/form-data; boundary=other"})
    assert r.status_code == 400 and r.json["error"]["param"] == "file"


def test_a_text_model_answers_400(tmp_path):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path))
    app = create_app(engine=AsyncEngine(EngineArgs(model=str(tmp_path), num_blocks=16, block_size=16)),
                     settings=ServerSettings(log_requests=False, enable_metrics=False))
    try:
        client = falcon_testing.TestClient(app)
        r = _post(client, {}, {"file": ("a.wav", wav(random_audio(72, 0.3)), "audio/wav")})
        assert r.status_code == 400
        assert r.json["error"]["param"] == "model" and "does not do transcription" in r.json["error"]["message"]
    finally:
        app.close()


def test_transcription_with_the_engine_in_its_own_process(srv):
    """`--engine-process` (the CUDA default, also under --device auto on a CUDA host): the transcriber runs in the
    engine's process, reached through engine.call, and answers as the in-process server does."""
    from engine.data_parallel import DataParallelEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    path, _, client = srv
    files = {"file": ("speech.wav", wav(random_audio(71, 1.2)), "audio/wav")}
    fields = {"language": "de", "max_tokens": "10", "response_format": "verbose_json"}
    want = _post(client, fields, files)
    assert want.status_code == 200, want.text
    app = create_app(engine=DataParallelEngine(EngineArgs(model=path)),
                     settings=ServerSettings(log_requests=False, enable_metrics=False, max_body_bytes=1 << 20))
    try:
        got = _post(falcon_testing.TestClient(app), fields, files)
        assert got.status_code == 200, got.text
        assert got.json == want.json
    finally:
        app.close()
