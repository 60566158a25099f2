"""Speech to text with a Whisper checkpoint (engine/models/whisper.py): `LLM(whisper_dir).transcribe(audio)` and the
server's /v1/audio/transcriptions.

A request is decoded as transformers' WhisperForConditionalGeneration.generate does without timestamps:

  * the audio (engine.audio: decoded, mono, 16 kHz) is cut into windows of the feature extractor's chunk_length
    (30 s); each window is encoded and decoded on its own, and the texts are joined (one segment per window);
  * the decoder starts from <|startoftranscript|> <|lang|> <|task|> <|notimestamps|> (an English-only checkpoint:
    <|startoftranscript|> <|notimestamps|>), preceded by <|startofprev|> + the prompt's tokens when a prompt is
    given (first window only; at most max_target_positions / 2 - 1 of its last tokens);
  * without a language, the first window's language is detected: one decoder step on <|startoftranscript|>, the
    most likely language token (generate's detect_language);
  * each step suppresses generation_config.json's suppress_tokens, and at the first step its
    begin_suppress_tokens; temperature 0 takes the most likely token, a positive one samples from
    softmax(logits / temperature) (seeded when a seed is given); decoding stops at <|endoftext|> or when the
    decoder's max_target_positions is full (or after max_tokens tokens a window).

generation_config.json's legacy forced_decoder_ids ([[1, lang], [2, task], [3, notimestamps]]) give the language
when the request names none. Requests run one at a time (`Transcriber.lock`): the model's caches and
scratch are shared.
"""
from __future__ import annotations

import re
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import InvalidRequestError, ModelLoadError, read_json_object

TASKS = ("transcribe", "translate")
_LANG_TOKEN = re.compile(r"^<\|([a-z]{2,3}(?:-[A-Za-z]+)?)\|>$")


@dataclass
class Segment:
    """One window's transcription (OpenAI's verbose_json segment)."""
    id: int
    start: float
    end: float
    text: str
    tokens: list
    temperature: float
    avg_logprob: float
    compression_ratio: float

    def to_dict(self) -> dict:
        return {"id": self.id, "seek": int(round(self.start * 100)), "start": self.start, "end": self.end,
                "text": self.text, "tokens": list(self.tokens), "temperature": self.temperature,
                "avg_logprob": self.avg_logprob, "compression_ratio": self.compression_ratio}


@dataclass
class Transcription:
    """What `transcribe` returns: the text, the language (a code such as "en"; None for an English-only checkpoint
    without language tokens), the audio's duration in seconds, one segment per window, the generated ids."""
    text: str
    language: str | None
    duration: float
    segments: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)


class GenerationSettings:
    """The special tokens and rules of a Whisper checkpoint's decoding, from generation_config.json (falling back
    to config.json and the tokenizer's special tokens)."""

    def __init__(self, path, tokenizer, config):
        p = Path(path)
        d = p if p.is_dir() else p.parent
        raw = config.extra or {}
        f = d / "generation_config.json"
        gen = read_json_object(f)
        tid = tokenizer.token_to_id

        def pick(key, token=None):
            for src in (gen, raw):
                v = src.get(key)
                if v is not None:
                    return v
            return tid(token) if token else None

        def ids(key):
            v = pick(key)
            return sorted({int(x) for x in v}) if v else []

        self.sot = pick("decoder_start_token_id", "<|startoftranscript|>")
        eos = pick("eos_token_id", "<|endoftext|>")
        self.eos = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None
        if self.sot is None or self.eos is None:
            raise ModelLoadError("a Whisper checkpoint needs <|startoftranscript|> and <|endoftext|> (decoder_start_"
                                 "token_id / eos_token_id)", path=f, key="decoder_start_token_id")
        self.sot = int(self.sot)
        self.no_timestamps = pick("no_timestamps_token_id", "<|notimestamps|>")
        sop = pick("prev_sot_token_id", "<|startofprev|>")
        self.start_of_prev = int(sop) if sop is not None else None
        lang = gen.get("lang_to_id")
        if lang is None:        # a checkpoint without generation_config.json: the tokenizer's language tokens
            lang = {}
            for i in sorted(tokenizer.special_token_ids):
                tok = tokenizer.id_to_token(i)
                if tok and _LANG_TOKEN.match(tok) and tok not in ("<|nocaptions|>", "<|nospeech|>"):
                    lang[tok] = i
        self.lang_to_id = {str(k): int(v) for k, v in lang.items()}
        self.id_to_lang = {v: _LANG_TOKEN.match(k).group(1) if _LANG_TOKEN.match(k) else k
                           for k, v in self.lang_to_id.items()}
        task = gen.get("task_to_id") or {t: tid(f"<|{t}|>") for t in TASKS}
        self.task_to_id = {k: int(v) for k, v in task.items() if v is not None}
        multi = gen.get("is_multilingual")
        self.multilingual = bool(self.lang_to_id) if multi is None else bool(multi) and bool(self.lang_to_id)
        self.suppress = ids("suppress_tokens")
        self.begin_suppress = ids("begin_suppress_tokens")
        # legacy forced_decoder_ids [[1, lang], [2, task], [3, notimestamps]]: the language when a request names
        # none (a None language means "detect"); the task is the request's (transcribe unless asked)
        self.forced_lang = None
        for pos, tok in (gen.get("forced_decoder_ids") or raw.get("forced_decoder_ids") or []):
            if pos == 1 and tok is not None and int(tok) in self.id_to_lang:
                self.forced_lang = int(tok)

    def language_id(self, language: str) -> int:
        """The language token of a code ("en"), a token ("<|en|>") or a language's English name ("english")."""
        s = str(language).strip()
        key = s if s.startswith("<|") else f"<|{s.lower()}|>"
        if key not in self.lang_to_id:
            name = _NAMES.get(s.lower())
            key = f"<|{name}|>" if name else key
        if key not in self.lang_to_id:
            known = ", ".join(sorted(self.id_to_lang.values())) or "none"
            raise InvalidRequestError(f"language {language!r} is not one this model knows ({known})",
                                      param="language")
        return self.lang_to_id[key]


class Transcriber:
    """A Whisper model with its feature extractor, tokenizer and decoding rules."""

    def __init__(self, model, tokenizer, path):
        from engine.audio import LogMel
        self.model = model
        self.tokenizer = tokenizer
        self.features = LogMel.from_dir(path)
        c = model.cfg
        f = self.features
        if f.feature_size != c.num_mel_bins or f.nb_max_frames != c.num_frames:
            raise ModelLoadError(f"preprocessor_config.json gives {f.feature_size} mels x {f.nb_max_frames} frames; "
                                 f"the encoder takes {c.num_mel_bins} x {c.num_frames} (num_mel_bins, 2 x "
                                 "max_source_positions)", path=Path(path) / "preprocessor_config.json",
                                 key="feature_size")
        self.gen = GenerationSettings(path, tokenizer, model.ckpt.config)
        self.max_target = c.max_target_positions
        self.lock = threading.Lock()

    # ------------------------------------------------------------------------------------ requests
    def transcribe(self, audio, *, sampling_rate: int | None = None, language: str | None = None,
                   prompt: str | None = None, temperature: float = 0.0, seed: int | None = None,
                   max_tokens: int | None = None, task: str = "transcribe") -> Transcription:
        """Transcribes audio: a path or encoded bytes (WAV, FLAC, OGG), an (array, sample rate) pair, or a
        mono/multi-channel array at `sampling_rate` (default 16 kHz)."""
        from engine.audio import load_audio
        t = self._check(language, prompt, temperature, seed, max_tokens, task)
        signal = load_audio(audio, sampling_rate, target=self.features.sampling_rate)
        with self.lock:
            return self._run(signal, language, prompt, t, seed, max_tokens, task)

    def _check(self, language, prompt, temperature, seed, max_tokens, task) -> float:
        if task not in TASKS or (task not in self.gen.task_to_id and self.gen.multilingual):
            raise InvalidRequestError(f"task {task!r} is not one of {', '.join(TASKS)}", param="task")
        if language is not None:
            if not isinstance(language, str) or not language.strip():
                raise InvalidRequestError("language must be a language code such as 'en'", param="language")
            if self.gen.multilingual:
                self.gen.language_id(language)
            elif language.strip().lower() not in ("en", "english", "<|en|>"):
                raise InvalidRequestError(f"this model transcribes English only; language {language!r} cannot be "
                                          "asked for", param="language")
        if not self.gen.multilingual and task == "translate":
            raise InvalidRequestError("this model transcribes English only: it does not translate", param="task")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2 \
                or temperature != temperature:
            raise InvalidRequestError(f"temperature must be a number in [0, 2], got {temperature!r}",
                                      param="temperature")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequestError("seed must be an integer", param="seed")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise InvalidRequestError("max_tokens must be a positive integer", param="max_tokens")
        return float(temperature)

    def _prefix(self, lang_id, task, prompt) -> list:
        g = self.gen
        ids = [g.sot]
        if g.multilingual:
            ids.append(lang_id)
            ids.append(g.task_to_id[task])
        if g.no_timestamps is not None:
            ids.append(int(g.no_timestamps))
        if prompt and prompt.strip():
            text = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
            text = text[-(self.max_target // 2 - 1):]
            head = [g.start_of_prev] if g.start_of_prev is not None else []
            ids = head + text + ids
        return ids

    def _detect(self, enc) -> int:
        state = self.model.start(enc)
        logits = self.model.decode(state, [self.gen.sot])
        langs = np.array(sorted(self.gen.id_to_lang), np.int64)
        return int(langs[int(np.argmax(logits[langs]))])

    def _run(self, signal, language, prompt, temperature, seed, max_tokens, task) -> Transcription:
        f = self.features
        g = self.gen
        rate = f.sampling_rate
        n = f.n_samples
        duration = signal.shape[0] / rate
        rng = np.random.default_rng(seed)
        lang_id = None
        if g.multilingual:
            lang_id = g.language_id(language) if language is not None else g.forced_lang
        segments, all_ids, texts = [], [], []
        for w, start in enumerate(range(0, signal.shape[0], n)):
            enc = self.model.encode(f(signal[start:start + n]))
            if g.multilingual and lang_id is None:
                lang_id = self._detect(enc)
            prefix = self._prefix(lang_id, task, prompt if w == 0 else None)
            ids, logprob = self._decode(enc, prefix, temperature, rng, max_tokens)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            raw = text.encode("utf-8")
            segments.append(Segment(w, round(start / rate, 3), round(min(start + n, signal.shape[0]) / rate, 3),
                                    text, ids, temperature, logprob / max(len(ids), 1),
                                    len(raw) / max(len(zlib.compress(raw)), 1) if raw else 0.0))
            all_ids.extend(ids)
            texts.append(text.strip())
        language_code = g.id_to_lang.get(lang_id) if lang_id is not None else ("en" if not g.multilingual else None)
        return Transcription(" ".join(t for t in texts if t), language_code, duration, segments, all_ids)

    def _decode(self, enc, prefix, temperature, rng, max_tokens) -> tuple:
        """(generated ids without <|endoftext|>, their summed log-probabilities) of one window."""
        g = self.gen
        state = self.model.start(enc)
        limit = self.max_target - len(prefix)
        if limit < 1:
            raise InvalidRequestError(f"the prompt leaves no room to transcribe ({len(prefix)} of the decoder's "
                                      f"{self.max_target} positions)", param="prompt")
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        logits = self.model.decode(state, prefix)
        out, total = [], 0.0
        suppress = np.array(g.suppress, np.int64)
        begin = np.array(g.begin_suppress, np.int64)
        V = logits.shape[0]
        suppress = suppress[(suppress >= 0) & (suppress < V)]
        begin = begin[(begin >= 0) & (begin < V)]
        while True:
            z = logits.astype(np.float64)
            z[suppress] = -np.inf
            if not out:
                z[begin] = -np.inf
            if temperature > 0:
                s = z / temperature
                p = np.exp(s - s.max())
                p /= p.sum()
                tok = int(rng.choice(V, p=p))
            else:
                tok = int(np.argmax(z))
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            total += float(z[tok] - lse)
            if tok == g.eos:
                break
            out.append(tok)
            if len(out) >= limit:
                break
            logits = self.model.decode(state, [tok])
        return out, total


# English language names (OpenAI's and transformers' TO_LANGUAGE_CODE) -> codes, for `language="english"`
_NAMES = {
    "english": "en", "chinese": "zh", "german": "de", "spanish": "es", "russian": "ru", "korean": "ko",
    "french": "fr", "japanese": "ja", "portuguese": "pt", "turkish": "tr", "polish": "pl", "catalan": "ca",
    "dutch": "nl", "arabic": "ar", "swedish": "sv", "italian": "it", "indonesian": "id", "hindi": "hi",
    "finnish": "fi", "vietnamese": "vi", "hebrew": "he", "ukrainian": "uk", "greek": "el", "malay": "ms",
    "czech": "cs", "romanian": "ro", "danish": "da", "hungarian": "hu", "tamil": "ta", "norwegian": "no",
    "thai": "th", "urdu": "ur", "croatian": "hr", "bulgarian": "bg", "lithuanian": "lt", "latin": "la",
    "maori": "mi", "malayalam": "ml", "welsh": "cy", "slovak": "sk", "telugu": "te", "persian": "fa",
    "latvian": "lv", "bengali": "bn", "serbian": "sr", "azerbaijani": "az", "slovenian": "sl", "kannada": "kn",
    "estonian": "et", "macedonian": "mk", "breton": "br", "basque": "eu", "icelandic": "is", "armenian": "hy",
    "nepali": "ne", "mongolian": "mn", "bosnian": "bs", "kazakh": "kk", "albanian": "sq", "swahili": "sw",
    "galician": "gl", "marathi": "mr", "punjabi": "pa", "sinhala": "si", "khmer": "km", "shona": "sn",
    "yoruba": "yo", "somali": "so", "afrikaans": "af", "occitan": "oc", "georgian": "ka", "belarusian": "be",
    "tajik": "tg", "sindhi": "sd", "gujarati": "gu", "amharic": "am", "yiddish": "yi", "lao": "lo", "uzbek": "uz",
    "faroese": "fo", "haitian creole": "ht", "pashto": "ps", "turkmen": "tk", "nynorsk": "nn", "maltese": "mt",
    "sanskrit": "sa", "luxembourgish": "lb", "myanmar": "my", "tibetan": "bo", "tagalog": "tl", "malagasy": "mg",
    "assamese": "as", "tatar": "tt", "hawaiian": "haw", "lingala": "ln", "hausa": "ha", "bashkir": "ba",
    "javanese": "jw", "sundanese": "su", "cantonese": "yue",
}
