"""The sparse per-request edits of a logits row, prepared once at admission in the caller's thread.

logit_bias, allowed_token_ids, bad_words and the min_tokens ban become numpy index arrays here, so a step
applies them with a few vectorised assignments and never tokenises or builds sets on the engine thread.
Everything is linear in the size of the request's lists (bounded by engine/limits.py).

Bad words follow vLLM's NoBadWordsLogitsProcessor: each word is tokenised as given and with one leading
space; a one-token word is always banned; a longer one bans its last token when the output so far ends
with the others. Longer words are indexed by the last token of their prefix, so a step only compares the
words whose prefix can match the token just generated.

`LogitEdits.build` refuses, with an InvalidRequestError naming the field, a request whose very first step
would mask every token (e.g. `allowed_token_ids: [eos]` with `min_tokens: 2`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from engine.errors import InvalidRequestError


@dataclass
class LogitEdits:
    bias_ids: Optional[np.ndarray] = None         # int64 token ids
    bias_values: Optional[np.ndarray] = None      # float32, same length
    allowed_ids: Optional[np.ndarray] = None      # int64, unique
    banned_ids: Optional[np.ndarray] = None       # one-token bad words, int64, unique
    # last token of a bad word's prefix -> ((prefix, banned token), ...)
    bad_sequences: dict = field(default_factory=dict)
    min_tokens: int = 0
    min_tokens_ban: Optional[np.ndarray] = None   # stop ids (and eos unless ignore_eos) until min_tokens

    @classmethod
    def build(cls, params, *, vocab_size: int, eos_token_ids=(), tokenizer=None) -> "LogitEdits":
        edits = cls(min_tokens=int(params.min_tokens or 0))
        if params.logit_bias:
            items = [(int(t), float(v)) for t, v in params.logit_bias.items()]
            edits.bias_ids = np.array([t for t, _ in items], np.int64)
            edits.bias_values = np.array([v for _, v in items], np.float32)
        if params.allowed_token_ids:
            edits.allowed_ids = np.unique(np.asarray(params.allowed_token_ids, np.int64))
        if params.bad_words:
            single, sequences = _tokenise_bad_words(params.bad_words, tokenizer, vocab_size)
            if single:
                edits.banned_ids = np.unique(np.asarray(single, np.int64))
            edits.bad_sequences = sequences
        if edits.min_tokens > 0:
            ban = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                ban.update(eos_token_ids)
            ban = [t for t in ban if 0 <= t < vocab_size]
            if ban:
                edits.min_tokens_ban = np.unique(np.asarray(ban, np.int64))
        edits._check_something_is_left(vocab_size)
        return edits

    def _check_something_is_left(self, vocab_size: int) -> None:
        """The first step must leave at least one token (later ones are checked by the sampler)."""
        candidates = self.allowed_ids if self.allowed_ids is not None else None
        if candidates is None:
            masked = 0
            for ids in (self.banned_ids, self.min_tokens_ban):
                masked += 0 if ids is None else len(ids)
            if masked < vocab_size:
                return
            candidates = np.arange(vocab_size, dtype=np.int64)
        left = candidates
        if self.banned_ids is not None:
            left = np.setdiff1d(left, self.banned_ids, assume_unique=True)
            if left.size == 0:
                raise InvalidRequestError(
                    "bad_words ban every token that allowed_token_ids allows: nothing could be generated.",
                    "bad_words")
        if self.min_tokens_ban is not None:
            left = np.setdiff1d(left, self.min_tokens_ban, assume_unique=True)
            if left.size == 0:
                raise InvalidRequestError(
                    "every allowed token is a stop or end-of-sequence token, which min_tokens forbids until "
                    f"{self.min_tokens} tokens were generated: nothing could be generated. Allow other tokens "
                    "or lower min_tokens.", "allowed_token_ids")

    # ---------------------------------------------------------------------------------- per step
    def active(self, num_output_tokens: int) -> bool:
        return (self.bias_ids is not None or self.allowed_ids is not None or self.banned_ids is not None
                or bool(self.bad_sequences)
                or (self.min_tokens_ban is not None and num_output_tokens < self.min_tokens))

    def apply(self, row: np.ndarray, output_ids: list) -> None:
        """Edits one logits row in place, in vLLM's order: bias, allowed ids, bad words, min_tokens."""
        if self.bias_ids is not None:
            row[self.bias_ids] += self.bias_values       # ids are unique (dict keys)
        if self.allowed_ids is not None:
            saved = row[self.allowed_ids]
            row[:] = -np.inf
            row[self.allowed_ids] = saved
        if self.banned_ids is not None:
            row[self.banned_ids] = -np.inf
        if self.bad_sequences and output_ids:
            for prefix, banned in self.bad_sequences.get(output_ids[-1], ()):
                n = len(prefix)
                if len(output_ids) >= n and tuple(output_ids[-n:]) == prefix:
                    row[banned] = -np.inf
        if self.min_tokens_ban is not None and len(output_ids) < self.min_tokens:
            row[self.min_tokens_ban] = -np.inf


def _tokenise_bad_words(words, tokenizer, vocab_size: int) -> tuple:
    """(one-token ids, {last prefix token: ((prefix, banned), ...)}) for the words and their spaced forms."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words need the model's tokenizer, which this engine does not have.",
                                  "bad_words")
    seen: set = set()
    single: list = []
    grouped: dict = {}
    for word in words:
        for variant in (word, " " + word.lstrip()):
            try:
                ids = tuple(int(t) for t in tokenizer.encode(variant, add_special_tokens=False))
            except Exception as e:  # noqa: BLE001 - the tokenizer's own error, named for the user
                raise InvalidRequestError(f"bad_words entry {word[:40]!r} cannot be tokenised: {e}",
                                          "bad_words") from None
            if not ids or ids in seen or not all(0 <= t < vocab_size for t in ids):
                continue
            seen.add(ids)
            if len(ids) == 1:
                single.append(ids[0])
            else:
                grouped.setdefault(ids[-2], []).append((ids[:-1], ids[-1]))
    return single, {k: tuple(v) for k, v in grouped.items()}
