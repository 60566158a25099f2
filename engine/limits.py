"""Bounds on what one request may cost the engine, and on what the engine keeps between requests.

One place for the numbers: `SamplingParams` validation, the engine's admission and the server read them
from here, and docs/SERVER.md ("Limits") lists them. A request over a per-request limit is refused at
admission with an `InvalidRequestError` naming the field (HTTP 400); nothing above a limit reaches the
engine thread. The cache bounds keep long-running servers at a steady size: each cache evicts its least
recently used entries past its bound.
"""
from __future__ import annotations

# ---------------------------------------------------------------------------------------- per request
# Choices per prompt (`n`; `best_of` must equal n). Each choice is a sequence in the scheduler.
MAX_N = 128
# Sequences one request may start: n x number of prompts (a batch of prompts is one request).
MAX_SEQUENCES_PER_REQUEST = 256
# Stop strings, and the length of each (the streaming hold-back buffer is as long as the longest).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Bad words: each is tokenised twice (with and without a leading space) at admission.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256
# Entries of allowed_token_ids (the largest vocabularies in use have 262,144 tokens).
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGITS_PROCESSORS = 64         # per-request logits processors (LLM API only)
# Seeds are 64-bit unsigned (numpy's PCG64 seed); -1 means "no seed".
MAX_SEED = 2**64 - 1
# Integer fields (max_tokens, min_tokens, top_k, ...) must fit a signed 64-bit integer.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# repetition_penalty divides positive logits and multiplies negative ones: bounded so that float32
# logits stay finite (vLLM only asks for > 0; 1e-39 made every logit overflow).
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3

# --------------------------------------------------------------------------------- caches (engine-wide)
# Recorded decode graphs, one per decode batch size (and buffer generation); least recently replayed
# evicted first. Re-recording an evicted graph costs one eager step.
MAX_DECODE_GRAPHS = 32
# How long a caller waits for the engine thread to take a command (admission, a call between steps)
# before giving up with EngineDeadError; a step never takes this long on a healthy engine.
ENGINE_COMMAND_TIMEOUT_S = 300.0


def check_batch(requests: list) -> None:
    """A batch of (request id, prompt, params) one API request starts: at least one prompt, and at most
    MAX_SEQUENCES_PER_REQUEST sequences counting each params' n (InvalidRequestError naming the field)."""
    from engine.errors import InvalidRequestError
    if not requests:
        raise InvalidRequestError("no prompts were given", param="prompt")
    num_seqs = sum(getattr(p, "n", 1) or 1 for _, _, p in requests)
    if num_seqs > MAX_SEQUENCES_PER_REQUEST:
        raise InvalidRequestError(
            f"{len(requests)} prompts x n make {num_seqs} sequences; one request may start at most "
            f"{MAX_SEQUENCES_PER_REQUEST}.", param="n")
