"""Logprobs in OpenAI's two response shapes (legacy completions and chat), and vLLM's prompt_logprobs.

The engine gives, per generated token, `{token_id: Logprob(logprob, rank, decoded_token)}` holding the
sampled token and the top-N. -inf (a masked token) becomes -9999.0 as in vLLM, so the JSON stays valid.
"""
from __future__ import annotations

import math
from functools import lru_cache

MIN_LOGPROB = -9999.0


def clamp_logprob(value) -> float:
    if value is None:
        return MIN_LOGPROB
    value = float(value)
    if math.isnan(value) or value < MIN_LOGPROB:
        return MIN_LOGPROB
    return value


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict:
    """GPT-2's printable-unicode stand-ins for bytes, inverted (byte-level BPE vocabularies use them)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenStrings:
    """Token id -> the token text and raw bytes a client sees in logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = getattr(tokenizer, "special_token_ids", frozenset())

    def text(self, token_id: int, decoded: str | None = None, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int, decoded: str | None = None) -> list:
        """The token's own bytes: for byte-level BPE a token can be part of a UTF-8 character, which its
        decoded text (U+FFFD) cannot show."""
        if self.byte_level and token_id not in self._special:
            piece = self.tokenizer.id_to_token(token_id)
            table = _byte_level_decoder()
            if piece is not None and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self.text(token_id, decoded).encode("utf-8"))


def _top_n_limit(top_n: int) -> float:
    return math.inf if top_n is None or top_n < 0 else top_n


def completion_logprobs(token_ids: list, logprobs: list, top_n: int, strings: TokenStrings, *,
                        as_ids: bool = False, text_offset: int = 0) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset.

    `logprobs[i]` may be None (the first prompt token of an echoed prompt has no logprob)."""
    limit = _top_n_limit(top_n)
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry.get(tid) if entry else None
        token = strings.text(tid, sampled.decoded_token if sampled else None, as_ids)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamp_logprob(sampled.logprob) if sampled else None)
        top = {}
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= limit or t == tid:
                top[strings.text(t, lp.decoded_token, as_ids)] = clamp_logprob(lp.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(token_ids: list, logprobs: list, top_n: int, strings: TokenStrings, *, as_ids: bool = False) -> dict:
    """Chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    limit = _top_n_limit(top_n)
    content = []
    for tid, entry in zip(token_ids, logprobs):
        entry = entry or {}
        sampled = entry.get(tid)
        decoded = sampled.decoded_token if sampled else None
        top = []
        for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= limit and len(top) < limit:
                top.append({"token": strings.text(t, lp.decoded_token, as_ids), "logprob": clamp_logprob(lp.logprob),
                            "bytes": strings.bytes(t, lp.decoded_token)})
        content.append({"token": strings.text(tid, decoded, as_ids),
                        "logprob": clamp_logprob(sampled.logprob if sampled else None),
                        "bytes": strings.bytes(tid, decoded), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: [None, {"<id>": {logprob, rank, decoded_token}}, ...]."""
    if prompt_logprobs is None:
        return None
    out = []
    for entry in prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in entry.items()})
    return out
