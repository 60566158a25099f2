"""Next-token selection in vLLM's order.

    raw logits -> (logprobs are taken here, vLLM's default "raw_logprobs" mode)
    -> logit_bias, allowed_token_ids, bad_words, min_tokens (stop ids masked until reached)
    -> repetition / presence / frequency penalties
    -> greedy (temperature 0)  |  temperature -> top-k -> top-p -> min-p -> sample

Seeded requests draw from their own generator (`Request.rng()`), so the same seed gives the same tokens
whatever else is in the batch. Full-vocabulary work on the batch (argmax, log-softmax, top-k) runs as
jitkern kernels; the per-request masking and the draw over the few surviving candidates are numpy glue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class SampleResult:
    token_id: int
    logprob: float = 0.0
    rank: int = 1
    top_logprobs: tuple = ()               # ((token id, logprob, rank), ...)
    prompt_logprobs: Optional[list] = None  # [(token id, logprob, rank, top), ...] for this chunk's prompt tokens


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, tokenizer=None):
        self.vocab = vocab_size
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self._bad_words_cache: dict = {}

    # --------------------------------------------------------------------------------- batch entry
    def sample(self, sched, result) -> dict:
        logits = result.logits
        out: dict = {}
        by_id = {s.req_id: s for s in sched.scheduled}
        if not result.sample_rows and not result.prompt_rows:
            return out
        # greedy rows without any processor: one argmax kernel over them all
        plain, others = [], []
        for rid, row in result.sample_rows.items():
            req = by_id[rid].request
            p = req.sampling_params
            if p.temperature == 0 and not self._has_processors(req) and p.logprobs is None:
                plain.append((rid, row))
            else:
                others.append((rid, row))
        if plain:
            from jitkern.ops.sampling import argmax_rows
            rows = np.array([r for _, r in plain], np.int64)
            sub = logits if len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows))) \
                else np.ascontiguousarray(logits[rows])
            ids = argmax_rows(sub)
            for (rid, _), t in zip(plain, ids):
                out[rid] = SampleResult(int(t))
        need_lp = [rid for rid, _ in others if by_id[rid].request.sampling_params.logprobs is not None]
        lp_rows = {}
        if need_lp:
            from jitkern.ops.softmax import log_softmax
            rows = np.array([result.sample_rows[r] for r in need_lp], np.int64)
            lps = log_softmax(np.ascontiguousarray(logits[rows]))
            lp_rows = {r: lps[i] for i, r in enumerate(need_lp)}
        for rid, row in others:
            req = by_id[rid].request
            out[rid] = self._sample_one(req, logits[row], lp_rows.get(rid))
        for rid, (r0, n, start) in result.prompt_rows.items():
            # a prompt chunk that does not end the prompt samples nothing: token_id -1 carries only logprobs
            res = out.setdefault(rid, SampleResult(-1))
            res.prompt_logprobs = self._prompt_logprobs(by_id[rid].request, logits[r0:r0 + n], start)
        return out

    # ----------------------------------------------------------------------------------- one row
    @staticmethod
    def _has_processors(req) -> bool:
        p = req.sampling_params
        return bool(p.logit_bias or p.allowed_token_ids or p.bad_words or
                    (p.min_tokens and len(req.output_token_ids) < p.min_tokens) or
                    p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)

    def _bad_word_ids(self, words) -> list:
        key = tuple(words)
        if key not in self._bad_words_cache:
            ids = []
            if self.tokenizer is not None:
                for w in words:
                    for variant in (w, " " + w.lstrip()):
                        t = self.tokenizer.encode(variant, add_special_tokens=False)
                        if t and t not in ids:
                            ids.append(t)
            self._bad_words_cache[key] = ids
        return self._bad_words_cache[key]

    def _process(self, req, logits: np.ndarray) -> np.ndarray:
        p = req.sampling_params
        x = logits.astype(np.float64, copy=True)
        out_ids = req.output_token_ids
        if p.logit_bias:
            for t, bval in p.logit_bias.items():
                x[int(t)] += bval
        if p.allowed_token_ids:
            keep = np.full(self.vocab, -np.inf)
            idx = np.asarray(list(p.allowed_token_ids), np.int64)
            keep[idx] = x[idx]
            x = keep
        if p.bad_words:
            for seq in self._bad_word_ids(p.bad_words):
                prefix = seq[:-1]
                if not prefix or list(out_ids[-len(prefix):]) == prefix:
                    x[seq[-1]] = -np.inf
        if p.min_tokens and len(out_ids) < p.min_tokens:
            ban = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                ban.update(req.eos_token_ids)
            for t in ban:
                if 0 <= t < self.vocab:
                    x[t] = -np.inf
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            if p.repetition_penalty != 1.0:
                seen = np.unique(np.asarray(list(req.prompt_token_ids) + list(out_ids), np.int64))
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            if out_ids and (p.presence_penalty or p.frequency_penalty):
                ids, counts = np.unique(np.asarray(out_ids, np.int64), return_counts=True)
                x[ids] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return x

    def _sample_one(self, req, raw: np.ndarray, lp_row) -> SampleResult:
        p = req.sampling_params
        x = self._process(req, raw)
        if p.temperature == 0:
            tok = int(np.argmax(x))
        else:
            x = x / p.temperature
            k = p.top_k if p.top_k and p.top_k > 0 else 0
            if k and k < self.vocab:
                cand = np.argpartition(-x, k - 1)[:k]
            else:
                cand = np.arange(self.vocab)
            cand = cand[np.isfinite(x[cand])]
            if cand.size == 0:
                cand = np.array([int(np.argmax(raw))])
            order = cand[np.argsort(-x[cand], kind="stable")]
            v = x[order]
            probs = np.exp(v - v[0])
            probs /= probs.sum()
            if p.top_p < 1.0:
                cum = np.cumsum(probs)
                cut = int(np.searchsorted(cum, p.top_p, side="left")) + 1
                order, probs = order[:cut], probs[:cut]
                probs = probs / probs.sum()
            if p.min_p > 0.0:
                keep = probs >= p.min_p * probs[0]
                order, probs = order[keep], probs[keep]
                probs = probs / probs.sum()
            rng = req.rng() or self.rng
            u = rng.random()
            i = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
            tok = int(order[min(i, len(order) - 1)])
        res = SampleResult(tok)
        if p.logprobs is not None and lp_row is not None:
            lp = lp_row.astype(np.float64)
            res.logprob = float(lp[tok])
            res.rank = int(np.count_nonzero(lp > lp[tok])) + 1
            n = self.vocab if p.logprobs == -1 else p.logprobs
            if n:
                top = np.argpartition(-lp, min(n, self.vocab) - 1)[:n] if n < self.vocab else np.arange(self.vocab)
                top = top[np.argsort(-lp[top], kind="stable")]
                res.top_logprobs = tuple((int(t), float(lp[t]), r + 1) for r, t in enumerate(top))
        return res

    def _prompt_logprobs(self, req, rows: np.ndarray, start: int) -> list:
        """Logprobs of the prompt tokens at positions start+1 .. predicted by these rows."""
        from jitkern.ops.softmax import log_softmax
        prompt = req.prompt_token_ids
        n = min(len(rows), len(prompt) - 1 - start)
        if n <= 0:
            return []
        lps = log_softmax(np.ascontiguousarray(rows[:n]))
        k = req.sampling_params.prompt_logprobs
        out = []
        for j in range(n):
            tid = prompt[start + 1 + j]
            lp = lps[j].astype(np.float64)
            rank = int(np.count_nonzero(lp > lp[tid])) + 1
            top = ()
            kk = self.vocab if k == -1 else k
            if kk:
                t = np.argpartition(-lp, kk - 1)[:kk] if kk < self.vocab else np.arange(self.vocab)
                t = t[np.argsort(-lp[t], kind="stable")]
                top = tuple((int(a), float(lp[a]), r + 1) for r, a in enumerate(t))
            out.append((tid, float(lp[tid]), rank, top))
        return out
