"""Audio input for speech models (Whisper: engine/models/whisper.py, engine/transcription.py): decoding, mono
mix-down, resampling and the log-mel spectrogram, all on the host with numpy.

  * decoding: soundfile (libsndfile) reads WAV (8/16/24/32-bit PCM, 32/64-bit float), FLAC and OGG from bytes or
    a path; an upload it cannot read is an InvalidRequestError naming the field;
  * channels are averaged into one (librosa's and vLLM's mono mix-down);
  * any sample rate is resampled to the model's (16 kHz) with soxr (librosa's default resampler, "soxr_hq");
  * `LogMel` computes the features as transformers' WhisperFeatureExtractor does, driven by the checkpoint's
    preprocessor_config.json: the signal zero-padded (or cut) to chunk_length seconds, a centred STFT (reflect
    padding, periodic Hann window of n_fft, hop_length), the power spectrum through a Slaney-normalised mel
    filter bank (0-8 kHz), log10 of at least 1e-10, the last frame dropped, values clamped to max - 8, then
    (x + 4) / 4.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import InvalidRequestError

SAMPLE_RATE = 16000
# The longest audio one request may carry: longer uploads are refused before any model work (a transcription
# runs one 30 s window at a time, so this bounds how long one request can hold the model).
MAX_AUDIO_SECONDS = 30 * 60


def _soundfile():
    try:
        import soundfile
    except ImportError:     # pragma: no cover - a dependency
        raise InvalidRequestError("audio input needs the soundfile package (pip install soundfile)",
                                  param="file") from None
    return soundfile


def decode_audio(data, param: str = "file") -> tuple:
    """(float32 samples [frames, channels], sample rate) of an encoded audio file given as bytes or a path."""
    sf = _soundfile()
    if isinstance(data, (bytes, bytearray, memoryview)):
        if not len(data):
            raise InvalidRequestError("the audio file is empty", param=param)
        src = io.BytesIO(bytes(data))
    else:
        p = Path(data)
        if not p.is_file():
            raise InvalidRequestError(f"no such audio file: {str(p)!r}", param=param)
        src = str(p)
    try:
        samples, rate = sf.read(src, dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - libsndfile's errors (and soundfile's TypeError / RuntimeError)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidRequestError(f"the audio could not be decoded (WAV, FLAC or OGG expected): {why}",
                                  param=param) from None
    if samples.shape[0] == 0:
        raise InvalidRequestError("the audio holds no samples", param=param)
    return samples, int(rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[frames] f32: the channels' mean (a 1-D signal is already mono)."""
    a = np.asarray(samples, dtype=np.float32)
    if a.ndim == 1:
        return a
    if a.ndim != 2:
        raise InvalidRequestError(f"audio samples must be [frames] or [frames, channels], got {list(a.shape)}",
                                  param="audio")
    return a[:, 0].copy() if a.shape[1] == 1 else a.mean(axis=1, dtype=np.float64).astype(np.float32)


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """A mono f32 signal at `rate` Hz resampled to `target` Hz (soxr, high quality)."""
    if rate == target:
        return np.ascontiguousarray(samples, np.float32)
    if rate <= 0:
        raise InvalidRequestError(f"sample rate {rate} is not positive", param="audio")
    try:
        import soxr
    except ImportError:     # pragma: no cover - a dependency
        raise InvalidRequestError(f"audio at {rate} Hz needs resampling to {target} Hz, which needs the soxr "
                                  "package (pip install soxr)", param="audio") from None
    return np.ascontiguousarray(soxr.resample(np.asarray(samples, np.float32), rate, target, quality="HQ"),
                                np.float32)


def load_audio(audio, sampling_rate: int | None = None, *, target: int = SAMPLE_RATE, param: str = "audio"):
    """A mono f32 signal at `target` Hz from what the Python API and the server take: a path, encoded bytes, an
    (array, sample rate) pair, or an array with `sampling_rate` (default: already at `target`)."""
    if isinstance(audio, (str, Path, bytes, bytearray, memoryview)):
        samples, rate = decode_audio(audio, param=param)
    elif isinstance(audio, tuple):
        if len(audio) != 2:
            raise InvalidRequestError("audio as a tuple must be (samples, sample_rate)", param=param)
        samples, rate = audio
    else:
        samples, rate = audio, sampling_rate if sampling_rate is not None else target
    try:
        a = np.asarray(samples, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"audio samples must be numbers, got {type(samples).__name__}",
                                  param=param) from None
    if a.ndim == 2 and a.shape[0] < a.shape[1] and a.shape[0] <= 8 and not isinstance(audio, (str, Path, bytes)):
        a = a.T                 # [channels, frames] (torchaudio's and librosa's layout) -> [frames, channels]
    a = to_mono(a)
    if a.size == 0:
        raise InvalidRequestError("the audio holds no samples", param=param)
    if not np.all(np.isfinite(a)):
        raise InvalidRequestError("the audio holds NaN or infinite samples", param=param)
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise InvalidRequestError(f"sample rate {rate!r} must be a positive integer", param=param)
    if a.shape[0] > MAX_AUDIO_SECONDS * int(rate):
        raise InvalidRequestError(f"the audio is {a.shape[0] / int(rate):.0f} s long; at most "
                                  f"{MAX_AUDIO_SECONDS} s are transcribed in one request", param=param)
    return resample(a, int(rate), target)


# ------------------------------------------------------------------------------------------ log-mel features

def _hz_to_mel(f):
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, np.float64)
    mel = 3.0 * f / 200.0
    log = f >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mel)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    f = 200.0 * m / 3.0
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), f)


def mel_filter_bank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                    f_max: float = 8000.0) -> np.ndarray:
    """[n_freqs, n_mels] triangular filters on the Slaney mel scale with Slaney's area normalisation (librosa's
    `filters.mel(htk=False, norm="slaney")`, transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2))
    fft_freqs = np.linspace(0, sample_rate // 2, n_freqs)
    slopes = edges[None, :] - fft_freqs[:, None]
    diff = np.diff(edges)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (edges[2:n_mels + 2] - edges[:n_mels]))[None, :]


@dataclass
class LogMel:
    """Whisper's log-mel front end (WhisperFeatureExtractor's keys and defaults)."""
    feature_size: int = 80
    sampling_rate: int = SAMPLE_RATE
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400

    def __post_init__(self):
        for k in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            v = getattr(self, k)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"preprocessor_config.json: {k} must be a positive integer, got {v!r}")
        self.n_samples = self.chunk_length * self.sampling_rate
        self.nb_max_frames = self.n_samples // self.hop_length
        self.mel_filters = mel_filter_bank(1 + self.n_fft // 2, self.feature_size, self.sampling_rate)
        # transformers' window_function(n_fft, "hann"): the periodic Hann window
        self.window = np.hanning(self.n_fft + 1)[:-1]

    @classmethod
    def from_dir(cls, path) -> "LogMel":
        """From a model folder's preprocessor_config.json (missing keys: the extractor's defaults)."""
        p = Path(path)
        f = (p if p.is_dir() else p.parent) / "preprocessor_config.json"
        if not f.is_file():
            return cls()
        from engine.errors import ModelLoadError, read_json_object
        cfg = read_json_object(f)
        keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft")
        try:
            return cls(**{k: cfg[k] for k in keys if k in cfg})
        except ValueError as e:
            raise ModelLoadError(str(e), path=f) from None

    @property
    def seconds(self) -> float:
        """The length of one window of audio (what one encoder pass reads)."""
        return self.n_samples / self.sampling_rate

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        """f32 [feature_size, nb_max_frames] features of one window: a mono signal at sampling_rate, cut to or
        zero-padded to chunk_length seconds."""
        x = np.zeros(self.n_samples, np.float64)
        a = np.asarray(audio, np.float64)[:self.n_samples]
        x[:a.shape[0]] = a
        half = self.n_fft // 2
        x = np.pad(x, (half, half), mode="reflect")
        n_frames = 1 + (x.shape[0] - self.n_fft) // self.hop_length
        frames = np.lib.stride_tricks.as_strided(x, shape=(n_frames, self.n_fft),
                                                 strides=(x.strides[0] * self.hop_length, x.strides[0]))
        power = np.abs(np.fft.rfft(frames * self.window, n=self.n_fft, axis=-1)) ** 2    # [frames, freqs]
        mel = np.maximum(power @ self.mel_filters, 1e-10).T                              # [mels, frames]
        spec = np.log10(mel)[:, :-1]
        spec = np.maximum(spec, spec.max() - 8.0)
        return np.ascontiguousarray((spec + 4.0) / 4.0, np.float32)
