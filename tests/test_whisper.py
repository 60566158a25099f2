"""Speech to text with a Whisper checkpoint (engine/audio.py, engine/models/whisper.py, engine/transcription.py)
against transformers on a tiny random WhisperForConditionalGeneration (float32), fed fresh random audio:

- the log-mel features equal WhisperFeatureExtractor's (80 and 128 mels, short, exact and over-long audio);
- the encoder output and the decoder's logits (a prefix in one step, then token by token) equal transformers';
- greedy tokens equal WhisperForConditionalGeneration.generate: a given language, a detected one, a prompt;
  audio longer than one window is decoded window by window;
- WAV files (16-bit PCM stereo at 44.1 kHz, 32-bit float mono at 8 kHz) decode, mix down and resample to what
  soxr gives for the same samples; seeded sampling repeats; bad requests name their field.
"""
import io
import wave

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from engine.errors import InvalidRequestError  # noqa: E402
from tests.whisper_fixtures import (CHUNK_SECONDS, IDS, LANGS, NO_TIMESTAMPS, SOT, WORDS,  # noqa: E402
                                    make_whisper_dir, random_audio)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from engine.llm import LLM
    path = str(tmp_path_factory.mktemp("whisper"))
    hf = make_whisper_dir(path, seed=1)
    llm = LLM(path)
    yield path, hf, llm
    llm.close()


def _features(path, audio):
    fe = tf.WhisperFeatureExtractor.from_pretrained(path)
    return fe(audio, sampling_rate=16000, return_tensors="pt").input_features


def _hf_generate(hf, feats, n, **kw):
    with torch.no_grad():
        return hf.generate(feats, max_new_tokens=n, task="transcribe", **kw)[0].tolist()


def wav_bytes(samples: np.ndarray, rate: int, sampwidth: int = 2) -> bytes:
    """A PCM WAV written by the stdlib (samples [frames, channels] in [-1, 1])."""
    a = np.asarray(samples, np.float64)
    a = a[:, None] if a.ndim == 1 else a
    q = np.clip(np.round(a * 32767), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(a.shape[1])
        w.setsampwidth(sampwidth)
        w.setframerate(rate)
        w.writeframes(q.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("mels,chunk,seconds", [(80, 30, 7.3), (128, 30, 31.0), (80, 2, 2.0), (80, 2, 0.05)])
def test_log_mel_matches_whisper_feature_extractor(mels, chunk, seconds):
    from engine.audio import LogMel
    a = random_audio(int(seconds * 100) + mels, seconds)
    ref = tf.WhisperFeatureExtractor(feature_size=mels, chunk_length=chunk)(a, sampling_rate=16000,
                                                                           return_tensors="np")["input_features"][0]
    got = LogMel(feature_size=mels, chunk_length=chunk)(a)
    assert got.shape == ref.shape == (mels, chunk * 100)
    # ours is float64 throughout; the extractor rounds its spectrogram to float32 (a few ulps of a log10 of a
    # small power: up to ~2e-5 on weak bins)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert np.abs(got - ref).mean() < 1e-6


def test_encoder_and_decoder_logits_match_transformers(whisper):
    path, hf, llm = whisper
    tr = llm.engine.transcriber
    feats = _features(path, random_audio(10, 1.3))
    enc = tr.model.encode(tr.features(random_audio(10, 1.3)))
    with torch.no_grad():
        want_enc = hf.model.encoder(feats).last_hidden_state[0].numpy()
    np.testing.assert_allclose(enc, want_enc, atol=2e-5, rtol=1e-4)
    rng = np.random.default_rng(11)
    ids = [SOT, IDS["<|fr|>"], IDS["<|transcribe|>"], NO_TIMESTAMPS] + rng.integers(0, 100, 6).tolist()
    with torch.no_grad():
        want = hf(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0].numpy()
    state = tr.model.start(enc)
    got = [tr.model.decode(state, ids[:5], all_logits=True)] + [tr.model.decode(state, [t])[None] for t in ids[5:]]
    np.testing.assert_allclose(np.concatenate(got), want, atol=5e-5, rtol=1e-4)


def test_greedy_tokens_match_transformers_generate(whisper):
    path, hf, llm = whisper
    for seed in (20, 21):
        a = random_audio(seed, 1.1 + 0.4 * (seed - 20))
        feats = _features(path, a)
        out = llm.transcribe(a, language="de", max_tokens=24)
        assert out.token_ids == _hf_generate(hf, feats, 24, language="de")
        assert out.language == "de" and out.duration == pytest.approx(a.shape[0] / 16000)
        assert out.text == " ".join(f"t{t}" for t in out.token_ids if t < WORDS)      # special tokens left out
        # no language: detected from the audio as generate's detect_language does
        with torch.no_grad():
            detected = int(hf.detect_language(feats)[0])
        out = llm.transcribe(a, max_tokens=24)
        assert out.language == {IDS[f"<|{c}|>"]: c for c in LANGS}[detected]
        assert out.token_ids == _hf_generate(hf, feats, 24, language=out.language)
        # a prompt: <|startofprev|> and its tokens before the start sequence
        out = llm.transcribe(a, language="en", prompt="t5 t6 t7", max_tokens=16)
        prompt_ids = torch.tensor([IDS["<|startofprev|>"], 5, 6, 7])
        assert out.token_ids == _hf_generate(hf, feats, 16, language="en", prompt_ids=prompt_ids)


def test_english_only_checkpoint(whisper, tmp_path):
    """is_multilingual false (whisper-*.en): the start sequence has no language or task token."""
    import json
    import shutil

    from engine.llm import LLM
    path, hf, _ = whisper
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "preprocessor_config.json"):
        shutil.copy(f"{path}/{f}", tmp_path / f)
    gen = json.loads(open(f"{path}/generation_config.json").read())
    gen["is_multilingual"] = False
    for k in ("lang_to_id", "task_to_id"):
        del gen[k]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(tmp_path))
    try:
        a = random_audio(25, 1.2)
        out = llm.transcribe(a, max_tokens=12)
        # (generate merges a generation_config argument into the model's own: the English-only one must be the
        # model's for its missing languages to count)
        own, hf.generation_config = hf.generation_config, tf.GenerationConfig(**gen)
        try:
            with torch.no_grad():
                want = hf.generate(_features(path, a), max_new_tokens=12)[0].tolist()
        finally:
            hf.generation_config = own
        assert out.language == "en" and out.token_ids == want
        with pytest.raises(InvalidRequestError, match="English only") as e:
            llm.transcribe(a, language="de")
        assert e.value.param == "language"
    finally:
        llm.close()


def test_long_audio_runs_window_by_window(whisper):
    path, hf, llm = whisper
    a = random_audio(30, 2 * CHUNK_SECONDS + 0.7)
    out = llm.transcribe(a, language="fr", max_tokens=8)
    n = CHUNK_SECONDS * 16000
    assert [(s.start, s.end) for s in out.segments] == [(0.0, 2.0), (2.0, 4.0), (4.0, 4.7)]
    want = []
    for i, seg in enumerate(out.segments):
        toks = _hf_generate(hf, _features(path, a[i * n:(i + 1) * n]), 8, language="fr")
        assert seg.tokens == toks
        want += toks
    assert out.token_ids == want
    assert out.text == " ".join(s.text.strip() for s in out.segments if s.text.strip())


def test_wav_files_decode_mix_down_and_resample(whisper, tmp_path):
    import soundfile
    import soxr
    path, hf, llm = whisper
    rng = np.random.default_rng(40)
    stereo = np.clip(rng.standard_normal((int(1.2 * 44100), 2)) * 0.3, -1, 1)
    data = wav_bytes(stereo, 44100)
    from engine.audio import load_audio
    pcm = np.frombuffer(data[44:], "<i2").reshape(-1, 2) / 32768.0
    want = soxr.resample(pcm.mean(axis=1).astype(np.float32), 44100, 16000, quality="HQ")
    got = load_audio(data)
    np.testing.assert_allclose(got, want, atol=1e-6)
    f = tmp_path / "stereo.wav"
    f.write_bytes(data)
    by_path = llm.transcribe(str(f), language="en", max_tokens=10)
    assert by_path.token_ids == llm.transcribe(got, language="en", max_tokens=10).token_ids
    assert by_path.token_ids == _hf_generate(hf, _features(path, want), 10, language="en")
    # 32-bit float, 8 kHz, mono
    mono = random_audio(41, 0.9, rate=8000)
    buf = io.BytesIO()
    soundfile.write(buf, mono, 8000, format="WAV", subtype="FLOAT")
    np.testing.assert_allclose(load_audio(buf.getvalue()), soxr.resample(mono, 8000, 16000, quality="HQ"),
                               atol=1e-6)
    # an (array, rate) pair is resampled the same way
    np.testing.assert_allclose(load_audio((mono, 8000)), soxr.resample(mono, 8000, 16000, quality="HQ"), atol=1e-6)


def test_sampling_with_a_seed_repeats(whisper):
    _, _, llm = whisper
    a = random_audio(50, 1.0)
    one = llm.transcribe(a, language="en", temperature=1.0, seed=7, max_tokens=20)
    two = llm.transcribe(a, language="en", temperature=1.0, seed=7, max_tokens=20)
    assert one.token_ids == two.token_ids
    greedy = llm.transcribe(a, language="en", max_tokens=20).token_ids
    others = {tuple(llm.transcribe(a, language="en", temperature=1.0, seed=s, max_tokens=20).token_ids)
              for s in range(4)}
    assert len(others | {tuple(greedy)}) > 1


def test_bad_requests_name_their_field(whisper):
    _, _, llm = whisper
    a = random_audio(60, 0.5)
    # (the Python API's argument is `audio`; the server names its form field, `file`)
    cases = [(dict(audio=b"RIFF not really a wave file"), "audio", "could not be decoded"),
             (dict(audio=b""), "audio", "empty"),
             (dict(audio=a, language="xx"), "language", "not one this model knows"),
             (dict(audio=a, temperature=-1.0), "temperature", "temperature"),
             (dict(audio=a, max_tokens=0), "max_tokens", "positive"),
             (dict(audio=(a, 0)), "audio", "sample rate"),
             (dict(audio=np.full(100, np.nan, np.float32)), "audio", "NaN")]
    for kw, param, text in cases:
        audio = kw.pop("audio")
        with pytest.raises(InvalidRequestError, match=text) as e:
            llm.transcribe(audio, **kw)
        assert e.value.param == param, (kw, e.value.param)
    from engine.sampling_params import SamplingParams
    with pytest.raises(InvalidRequestError, match="speech recognition") as e:
        llm.generate("t1 t2", SamplingParams(max_tokens=2))
    assert e.value.param == "model"


def test_a_text_model_does_not_transcribe(tmp_path):
    from engine.llm import LLM
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path))
    llm = LLM(str(tmp_path), num_blocks=16, block_size=16)
    try:
        with pytest.raises(InvalidRequestError, match="does not do transcription") as e:
            llm.transcribe(random_audio(1, 0.5))
        assert e.value.param == "model"
    finally:
        llm.close()
