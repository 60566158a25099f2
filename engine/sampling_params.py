"""Per-request sampling parameters, with vLLM's field names, defaults and ranges.

Facts taken from vLLM's `vllm/sampling_params.py` (read at commit 00388f65): defaults
(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, penalties neutral, max_tokens=16),
ranges (presence/frequency penalty in [-2, 2], repetition_penalty > 0 and finite,
temperature in [0, 2], top_p in (0, 1], top_k >= -1 with 0 and -1 both meaning "off",
min_p in [0, 1], logprobs >= 0 or -1 for the whole vocabulary), greedy below 1e-5, tiny
positive temperatures raised to 1e-2, logit_bias values clamped to [-100, 100],
seed=-1 meaning "no seed", stop strings/bad words never empty.

Deliberate difference, following the vllm.cpp guide (seed 000, "max_tokens: what a
non-positive value means"): `max_tokens` None or <= 0 is *unset* and resolves to
max_model_len minus the prompt length (see `resolve_max_tokens`), never an error.

Construction normalises (a string `stop` becomes a list, JSON string keys of `logit_bias`
become ints, ...) and validates every field on its own, raising `InvalidRequestError` (a
ValueError) whose `param` names the offending field; `validate(vocab_size, max_logprobs)`
repeats that and adds the checks that need the model (token ids in the vocabulary, the
engine's logprobs limit). Lists are bounded by engine/limits.py, so that no request can make
admission or a step expensive.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from dataclasses import dataclass, field

from engine import limits
from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPSILON = 1e-5
# Positive temperatures below this are raised to it: dividing logits by a smaller
# number overflows to inf/nan (vLLM's _MAX_TEMP, same warning).
MIN_POSITIVE_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
LOGIT_BIAS_LIMIT = 100.0
MAX_N = limits.MAX_N


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None or <= 0: up to max_model_len - prompt length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # -1: whole vocabulary
    prompt_logprobs: int | None = None  # -1: whole vocabulary
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Constrained decoding (engine/structured_outputs.py): a StructuredOutputsParams, or a dict of its fields
    # (json / json_object / regex / choice / grammar); compiled and checked here, at construction.
    structured_outputs: object = None
    # vLLM v0's per-request logits processors: callables fn(output_ids, logits) or fn(prompt_ids, output_ids,
    # logits) returning the logits (engine/logits_process.py); not deep-copied by clone(), as in vLLM
    logits_processors: list | None = None
    # Score these vocabulary ids at every generated position (at most 128): each one's logprob (read from the
    # engine's logprobs_mode) and rank, plus the sampled token's. `logprobs` is derived from it (its count);
    # set explicitly, it must equal that count.
    logprob_token_ids: list[int] | None = None
    # vLLM's extra_args: per-request keys for engine extensions; read today: kv_cache_report_mode
    # ("incremental" | "full", engine/kv_events.py), checked when the engine admits the request
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            from engine.structured_outputs import StructuredOutputsParams
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.stop = self._as_list("stop", self.stop, limits.MAX_STOP_STRINGS, allow_str=True)
        # Duplicates are harmless but dedupe keeps order stable for the sampler (ints/strings only:
        # anything else is named by the checks below).
        self.stop_token_ids = _dedupe(self._as_list("stop_token_ids", self.stop_token_ids,
                                                    limits.MAX_STOP_TOKEN_IDS))
        self.bad_words = _dedupe(self._as_list("bad_words", self.bad_words, limits.MAX_BAD_WORDS))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _dedupe(self._as_list("allowed_token_ids", self.allowed_token_ids,
                                                           limits.MAX_ALLOWED_TOKEN_IDS))
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        if self.logits_processors is not None:
            self.logits_processors = self._as_list("logits_processors", self.logits_processors,
                                                   limits.MAX_LOGITS_PROCESSORS) or None
        if self.logprob_token_ids is not None:
            from engine.logits_process import MAX_LOGPROB_TOKEN_IDS
            self.logprob_token_ids = _dedupe(self._as_list("logprob_token_ids", self.logprob_token_ids,
                                                           MAX_LOGPROB_TOKEN_IDS))
        # OpenAI clients send booleans for these; True means "the sampled token only".
        if self.logprobs is True:
            self.logprobs = 1
        elif self.logprobs is False:
            self.logprobs = None
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        elif self.prompt_logprobs is False:
            self.prompt_logprobs = None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError(
                    f"logit_bias must be an object mapping token ids to numbers, got {type(self.logit_bias).__name__}.",
                    "logit_bias")
            if len(self.logit_bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
                raise InvalidRequestError(
                    f"logit_bias has {len(self.logit_bias)} entries; at most {limits.MAX_LOGIT_BIAS_ENTRIES} "
                    "are allowed.", "logit_bias")
            self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if _is_real(self.temperature) and 0.0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and would overflow the softmax; using %s",
                self.temperature, MIN_POSITIVE_TEMPERATURE, MIN_POSITIVE_TEMPERATURE)
            self.temperature = MIN_POSITIVE_TEMPERATURE
        self._validate_fields()

    @staticmethod
    def _as_list(name: str, value, max_len: int, allow_str: bool = False) -> list:
        """None -> [], a string -> [it] where allowed, a list/tuple -> a list of at most max_len items."""
        if value is None:
            return []
        if allow_str and isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            kind = "a string or a list of strings" if allow_str else "a list"
            raise InvalidRequestError(f"{name} must be {kind}, got {type(value).__name__}.", name)
        if len(value) > max_len:
            raise InvalidRequestError(f"{name} has {len(value)} entries; at most {max_len} are allowed.", name)
        return list(value)

    @staticmethod
    def _normalise_logit_bias(bias: dict) -> dict:
        """JSON object keys arrive as strings; values are clamped like OpenAI/vLLM do.

        Keys that are not integers are kept as-is so that `validate` can name them.
        """
        out: dict = {}
        for key, value in bias.items():
            token = key
            if _is_int(key):
                token = int(key)
            elif isinstance(key, str) and len(key) <= 24:   # int() of a huge digit string is quadratic
                try:
                    token = int(key)
                except ValueError:
                    pass
            if _is_real(value) and math.isfinite(value):
                value = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
            out[token] = value
        return out

    # ----------------------------------------------------------------- derived values

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def resolve_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """Number of output tokens this request may generate.

        Unset (None or <= 0) means "up to the context length"; a set value is also capped
        by the context, because the sequence can never grow past max_model_len.
        """
        room = max(0, max_model_len - prompt_len)
        if self.max_tokens is None or self.max_tokens <= 0:
            return room
        return min(self.max_tokens, room)

    def clone(self) -> "SamplingParams":
        # Logits processors are the caller's objects (often holding state or big tables): shared, not copied.
        memo = {id(fn): fn for fn in self.logits_processors or ()}
        return copy.deepcopy(self, memo)

    # ----------------------------------------------------------------- validation

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise InvalidRequestError naming the first invalid field.

        Repeats the construction checks (fields may have been changed since) and adds the ones that
        need the model. vocab_size: when given, token ids (stop_token_ids, logit_bias keys,
        allowed_token_ids) must lie in [0, vocab_size) and logprobs may not exceed it.
        max_logprobs: engine limit on logprobs/prompt_logprobs (-1: whole vocabulary), as vLLM's
        --max-logprobs; None means only the vocabulary bounds it.
        """
        self._validate_fields()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            wanted = vocab_size if value == -1 else value
            # explicit ids are bounded by their own limit (128), not --max-logprobs
            limit = None if name == "logprobs" and self.logprob_token_ids else max_logprobs
            if limit == -1:
                limit = vocab_size
            if limit is not None and wanted is not None and wanted > limit:
                raise InvalidRequestError(
                    f"Requested {name} of {wanted}, which is greater than max allowed: {limit}.",
                    name, value)
            if vocab_size is not None and value > vocab_size:
                raise InvalidRequestError(
                    f"{name}={value} exceeds the vocabulary size {vocab_size}.", name, value)
        if vocab_size is not None:
            self._check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
            if self.allowed_token_ids is not None:
                self._check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
            if self.logit_bias is not None:
                self._check_token_ids("logit_bias", list(self.logit_bias), vocab_size)
            if self.logprob_token_ids:
                self._check_token_ids("logprob_token_ids", self.logprob_token_ids, vocab_size)

    def _validate_fields(self) -> None:
        """Every check that needs nothing but the parameters themselves."""
        self._check_int("n", self.n, low=1, high=limits.MAX_N)
        self._check_finite("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.",
                "temperature", self.temperature)
        self._check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p", self.top_p)
        self._check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k}.", "top_k", self.top_k)
        self._check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check_finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}.", name, value)
        self._check_finite("repetition_penalty", self.repetition_penalty)
        lo, hi = limits.MIN_REPETITION_PENALTY, limits.MAX_REPETITION_PENALTY
        if not lo <= self.repetition_penalty <= hi:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 is off), got {self.repetition_penalty}.",
                "repetition_penalty", self.repetition_penalty)
        if self.seed is not None:
            self._check_int("seed", self.seed)
            if not 0 <= self.seed <= limits.MAX_SEED:
                raise InvalidRequestError(
                    f"seed must be -1 (no seed) or in [0, 2**64 - 1], got {_short(self.seed)}.", "seed", self.seed)
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens)
        self._check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.max_tokens > 0 and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.", "min_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            self._check_int(name, value)
            if value < -1:
                raise InvalidRequestError(f"{name} must be non-negative or -1, got {value}.", name, value)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {value!r}.", name)
        self._check_strings("stop", self.stop, limits.MAX_STOP_STRING_CHARS)
        if self.stop and not self.detokenize:
            raise InvalidRequestError(
                "stop strings are only supported when detokenize is True.", "stop")
        self._check_strings("bad_words", self.bad_words, limits.MAX_BAD_WORD_CHARS)
        self._check_token_ids("stop_token_ids", self.stop_token_ids, None)
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise InvalidRequestError("allowed_token_ids is set but empty.", "allowed_token_ids")
            self._check_token_ids("allowed_token_ids", self.allowed_token_ids, None)
        if self.logit_bias is not None:
            self._check_token_ids("logit_bias", list(self.logit_bias), None)
            for token, value in self.logit_bias.items():
                if not _is_real(value) or not math.isfinite(value):
                    raise InvalidRequestError(
                        f"logit_bias value for token {token} must be a finite number, got {value!r}.",
                        "logit_bias", value)
        if self.logits_processors is not None:
            bad = [fn for fn in self.logits_processors if not callable(fn)]
            if bad:
                raise InvalidRequestError(f"logits_processors must contain only callables fn(output_ids, logits) "
                                          f"or fn(prompt_ids, output_ids, logits), got {_short(bad[0])}.",
                                          "logits_processors")
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids:
                raise InvalidRequestError("logprob_token_ids is set but empty.", "logprob_token_ids")
            self._check_token_ids("logprob_token_ids", self.logprob_token_ids, None)
            n = len(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = n           # every "wants logprobs" path (host sampling, output lists) follows
            elif self.logprobs != n:
                raise InvalidRequestError(
                    f"logprob_token_ids has {n} ids but logprobs is {self.logprobs}: leave logprobs unset, or "
                    "set it to the number of ids.", "logprob_token_ids")
        if self.structured_outputs is not None:
            from engine.structured_outputs import StructuredOutputsParams
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams (or a dict of its "
                                          f"fields), got {type(self.structured_outputs).__name__}.",
                                          "structured_outputs")
        # Greedy sampling gives n identical answers; vLLM refuses it.
        if self.is_greedy and self.n > 1:
            raise InvalidRequestError(f"n must be 1 when using greedy sampling, got {self.n}.", "n", self.n)

    @staticmethod
    def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
        if not _is_int(value):
            raise InvalidRequestError(f"{name} must be an integer, got {_short(value)}.", name, value)
        if low is not None and value < low:
            raise InvalidRequestError(f"{name} must be at least {low}, got {_short(value)}.", name, value)
        if high is None and name != "seed":
            high = limits.INT64_MAX
        if high is not None and value > high:
            raise InvalidRequestError(f"{name} must be at most {high}, got {_short(value)}.", name, value)
        if value < limits.INT64_MIN:
            raise InvalidRequestError(f"{name} is out of range, got {_short(value)}.", name, value)

    @staticmethod
    def _check_finite(name: str, value: object) -> None:
        if not _is_real(value) or not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {_short(value)}.", name, value)

    @staticmethod
    def _check_strings(name: str, values: list, max_chars: int) -> None:
        """Non-empty strings of at most max_chars characters that UTF-8 can encode (no lone surrogates)."""
        for s in values:
            if not isinstance(s, str):
                raise InvalidRequestError(f"{name} must contain only strings, got {_short(s)}.", name)
            if not s:
                raise InvalidRequestError(f"{name} cannot contain an empty string.", name)
            if len(s) > max_chars:
                raise InvalidRequestError(
                    f"{name} entries may be at most {max_chars} characters long, got one of {len(s)}.", name)
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f"{name} contains a string that is not valid Unicode text (a lone surrogate).", name) from None

    @staticmethod
    def _check_token_ids(name: str, ids: list, vocab_size: int | None) -> None:
        bad_type = [t for t in ids if not _is_int(t)]
        if bad_type:
            raise InvalidRequestError(
                f"{name} must contain only integer token ids, got {_short(bad_type[:8])}.", name, bad_type[:8])
        out_of_range = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if out_of_range:
            where = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise InvalidRequestError(
                f"token id(s) {_short(out_of_range[:8])} in {name} are out of vocabulary; ids must be {where}"
                + (f" (vocabulary size {vocab_size})." if vocab_size is not None else "."), name,
                out_of_range[:8])


def _dedupe(items: list) -> list:
    """Order-preserving dedupe in linear time; unhashable items are kept for the checks to name."""
    try:
        return list(dict.fromkeys(items))
    except TypeError:
        return items


def _short(value, limit: int = 80) -> str:
    """repr of a value for an error message, truncated (a request can send megabytes)."""
    try:
        text = repr(value)
    except ValueError:      # an int past Python's digit limit for str()
        return "<a number too large to print>"
    return text if len(text) <= limit else text[:limit] + "..."
