"""Custom logits processors (vLLM's two interfaces) and vLLM's `logprobs_mode`.

Per request (vLLM v0's, still in `SamplingParams.logits_processors`): a callable
`fn(output_token_ids, logits) -> logits` or `fn(prompt_token_ids, output_token_ids, logits) -> logits`
(chosen by its number of parameters, as vLLM does). `logits` is the request's row as a float32 numpy array
of the vocabulary's size; the function may edit it in place and must return a row of that size. A function
that raises, or returns something else, fails its own request alone (finish_reason "error").

Engine-wide (vLLM v1's): a `LogitsProcessor` subclass, registered with `EngineArgs(logits_processors=[Class])`
or `LLM(logits_processors=[Class])` and built once as `Class(engine_config, device, is_pin_memory)`. Each step
it is told how the batch changed (`update_state(BatchUpdate | None)`: vLLM's persistent batch, rows removed,
added, then moved to keep it dense) and edits the batch's logits (`apply(logits [B, V]) -> logits`), row b
being the request it was told is at index b. `is_argmax_invariant()` says it can never change a greedy pick;
only then may greedy steps keep picking tokens on the device (where the processor is not run at all).

Order of a row's edits in the sampler: raw logits (raw_* logprobs are read here) -> logit_bias, allowed ids,
bad words, min_tokens -> per-request processors -> engine processors -> penalties -> structured outputs ->
greedy | temperature -> top-k -> top-p -> min-p (processed_* logprobs are read here) -> sample.

The built-in min-p, logit-bias and min-tokens stay in the sampler's own code (their arithmetic and batching
there is what the engine's outputs are pinned to); `MinPLogitsProcessor`, `LogitBiasLogitsProcessor` and
`MinTokensLogitsProcessor` expose the same edits through the v1 interface, for callers that compose processors
themselves (tests check they edit rows exactly as the sampler does).
"""
from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# vLLM's LogprobsMode values; raw_logprobs is its default.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's MAX_LOGPROB_TOKEN_IDS: how many explicit ids one request may score.
MAX_LOGPROB_TOKEN_IDS = 128


def check_logprobs_mode(mode) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r}: expected one of {', '.join(LOGPROBS_MODES)}")
    return mode


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = 0      # the row at a moves to b (a is empty after)
    SWAP = 1                # rows a and b trade places


@dataclass
class BatchUpdate:
    """vLLM v1's batch update: apply `removed`, then `added`, then `moved`, in that order."""
    batch_size: int
    removed: list = field(default_factory=list)     # [index, ...]
    # [(index, SamplingParams, prompt_token_ids, output_token_ids), ...]; output_token_ids is the request's own
    # list, which the engine appends to (a processor may keep the reference)
    added: list = field(default_factory=list)
    moved: list = field(default_factory=list)       # [(from, to, MoveDirectionality), ...]


class LogitsProcessor:
    """vLLM v1's interface. Subclasses take (engine_config, device, is_pin_memory) in their constructor."""

    def __init__(self, engine_config=None, device=None, is_pin_memory: bool = False):
        pass

    def apply(self, logits: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        raise NotImplementedError


@dataclass
class EngineConfigView:
    """What an engine-wide processor is built with (in place of vLLM's VllmConfig)."""
    vocab_size: int
    max_num_seqs: int
    model_config: object = None
    engine_args: object = None
    eos_token_ids: tuple = ()


def build_engine_processors(specs, config: EngineConfigView, device: str) -> list:
    """Instances for EngineArgs.logits_processors: classes are built, instances are used as they are."""
    out = []
    for spec in specs or ():
        proc = spec(config, device, False) if isinstance(spec, type) else spec
        for name in ("apply", "update_state", "is_argmax_invariant"):
            if not callable(getattr(proc, name, None)):
                raise ValueError(f"logits_processors: {getattr(spec, '__name__', spec)!r} has no {name}() method "
                                 "(a LogitsProcessor subclass is expected)")
        out.append(proc)
    return out


class BatchSlots:
    """The persistent batch the engine-wide processors see: one slot per request, kept dense as vLLM keeps it
    (new requests take the lowest free slots, then the last rows move into any holes left)."""

    def __init__(self):
        self.reqs: list = []        # slot -> Request

    def update(self, reqs: list) -> tuple:
        """(BatchUpdate or None when nothing changed, [position in `reqs` of slot 0, 1, ...])."""
        pos = {id(r): k for k, r in enumerate(reqs)}
        slots = list(self.reqs)
        removed = [s for s, r in enumerate(slots) if id(r) not in pos]
        for s in removed:
            slots[s] = None
        present = {id(r) for r in slots if r is not None}
        free = sorted(removed)
        added = []
        for r in reqs:
            if id(r) in present:
                continue
            if free:
                s = free.pop(0)
                slots[s] = r
            else:
                s = len(slots)
                slots.append(r)
            added.append((s, r.sampling_params, r.prompt_token_ids, r.output_token_ids))
        moved = []
        while True:
            while slots and slots[-1] is None:
                slots.pop()
            if None not in slots:
                break
            hole = slots.index(None)
            moved.append((len(slots) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
            slots[hole] = slots.pop()
        self.reqs = slots
        update = BatchUpdate(len(slots), removed, added, moved) if (removed or added or moved) else None
        return update, [pos[id(r)] for r in slots]


# ------------------------------------------------------------------------------- per-request callables
def processor_arity(fn) -> int:
    """3 for fn(prompt_ids, output_ids, logits), else 2 (vLLM v0 counts the signature's parameters)."""
    try:
        return 3 if len(inspect.signature(fn).parameters) == 3 else 2
    except (TypeError, ValueError):
        return 2


def processor_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def run_request_processors(procs, prompt_ids: list, output_ids: list, row: np.ndarray) -> np.ndarray:
    """The row after the request's processors, in order; raises ValueError naming a processor that returned
    something other than a row of the vocabulary's size (a processor's own exception propagates)."""
    for fn in procs:
        args = (prompt_ids, output_ids, row) if processor_arity(fn) == 3 else (output_ids, row)
        try:
            out = fn(*args)
        except Exception as e:
            try:
                e.logits_processor_name = processor_name(fn)     # for the request's one-line error
            except AttributeError:
                pass
            raise
        if out is None:
            raise ValueError(f"logits processor {processor_name(fn)!r} returned None; it must return the logits")
        out = np.asarray(out)
        if out.shape != row.shape or not np.issubdtype(out.dtype, np.number):
            raise ValueError(f"logits processor {processor_name(fn)!r} returned an array of shape {out.shape} "
                             f"({out.dtype}); expected {row.shape} numbers")
        if out is not row:
            row[...] = out          # (numpy buffers an overlapping source)
    return row


# ------------------------------------------------------------------------ built-ins on the v1 interface
class _PerRowProcessor(LogitsProcessor):
    """Tracks slot -> (params, prompt ids, output ids) from the batch updates."""

    def __init__(self, engine_config=None, device=None, is_pin_memory: bool = False):
        self.vocab_size = getattr(engine_config, "vocab_size", None)
        self.rows: dict = {}

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        for s in batch_update.removed:
            self.rows.pop(s, None)
        for s, params, prompt_ids, output_ids in batch_update.added:
            state = self._state(params, prompt_ids, output_ids)
            if state is None:
                self.rows.pop(s, None)
            else:
                self.rows[s] = state
        for a, b, how in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def _state(self, params, prompt_ids, output_ids):
        raise NotImplementedError


class LogitBiasLogitsProcessor(_PerRowProcessor):
    """`logit_bias`: added to the raw logits (not argmax-invariant)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def _state(self, params, prompt_ids, output_ids):
        if not params.logit_bias:
            return None
        items = [(int(t), float(v)) for t, v in params.logit_bias.items()]
        return np.array([t for t, _ in items], np.int64), np.array([v for _, v in items], np.float32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for s, (ids, values) in self.rows.items():
            logits[s, ids] += values
        return logits


class MinTokensLogitsProcessor(_PerRowProcessor):
    """`min_tokens`: stop ids (and end-of-sequence ids unless ignore_eos) are -inf until that many tokens.
    The end-of-sequence ids are the model's; vLLM reads them from the params' internal all_stop_token_ids,
    here they are `eos_token_ids` of the engine config (or of this constructor)."""

    def __init__(self, engine_config=None, device=None, is_pin_memory: bool = False, eos_token_ids=None):
        super().__init__(engine_config, device, is_pin_memory)
        self.eos = tuple(eos_token_ids if eos_token_ids is not None else getattr(engine_config, "eos_token_ids", ()))

    def is_argmax_invariant(self) -> bool:
        return False

    def _state(self, params, prompt_ids, output_ids):
        if not params.min_tokens:
            return None
        ban = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ban.update(self.eos)
        ban = sorted(t for t in ban if self.vocab_size is None or 0 <= t < self.vocab_size)
        return (int(params.min_tokens), output_ids, np.asarray(ban, np.int64)) if ban else None

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for s, (n, output_ids, ban) in self.rows.items():
            if len(output_ids) < n:
                logits[s, ban] = -np.inf
        return logits


class MinPLogitsProcessor(_PerRowProcessor):
    """`min_p`: tokens whose probability is below min_p times the top token's become -inf. It keeps the top
    token, so it is argmax-invariant. (The sampler applies min-p last, over the candidates top-k/top-p leave,
    in float64; this full-row form applied to a row without top-k/top-p keeps the same tokens.)"""

    def is_argmax_invariant(self) -> bool:
        return True

    def _state(self, params, prompt_ids, output_ids):
        return float(params.min_p) if params.min_p and params.min_p > 0 else None

    def apply(self, logits: np.ndarray) -> np.ndarray:
        for s, min_p in self.rows.items():
            row = logits[s].astype(np.float64)
            top = row.max()
            if not np.isfinite(top):
                continue
            probs = np.exp(row - top)
            probs /= probs.sum()
            logits[s, probs < min_p * probs.max()] = -np.inf
        return logits


BUILTIN_LOGITS_PROCESSORS = (MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor)
