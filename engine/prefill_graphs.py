"""Prefill and mixed (prefill + decode) steps replayed as recorded graphs, one per token-count bucket.

A prefill step launches every kernel of the forward pass from Python (~600 launches for SmolLM2's 30 layers,
~10 us each): for short prompts that launch cost is as large as the arithmetic. Decode steps already replay
a `jk.capture()` graph per batch size (engine/model_runner.py); this module does the same for the other
steps, on the CPU:

- the step's token count T is padded up to a bucket (`token_bucket`: 8, 16, 24, 32, 40, 48, 56, 64, 80, ...,
  four buckets per octave, so at most ~25% padding) and its sequence count S up to a power of two
  (`seq_bucket`), so a handful of graphs serve every prompt length;
- padding tokens have slot_mapping -1 (reshape_and_cache writes nothing for them), position 0, token id 0,
  and belong to no sequence (they sit after query_start[S]); padding sequences have no tokens and length 0
  (the attention kernels skip them). Their rows of the activations hold values nobody reads: every kernel on
  the path computes a row from that row alone (batch invariance), so the real rows are bit-identical to the
  eager step over T tokens (tests/test_prefill_graphs.py compares the logits with assert_array_equal);
- the rows that need logits are gathered through a fixed int32 array (`rows`), padded with row 0, and the
  logits of the real rows are returned (a view of the graph's logits buffer, overwritten by the next step,
  as the decode graphs' are);
- everything else that changes per step (ids, positions, slots, query_start, seq_lens, block tables) is
  read by the kernels from the batch's fixed arrays, as for decode graphs; the padded T and S are the only
  scalars baked into a recording, and they are its key.

On CUDA the padding is written into the host arrays before the step's one staged copy (`pad`, then the
runner's `_send_step`, then `replay`), the rows go through the staged `logits_rows` array, and the graph is a
CUDA graph (`ModelRunner._capture_cuda`: an eager run, then the capture). Only steps of up to
CUDA_MAX_TOKENS padded tokens are recorded there: larger ones keep the GPU busy far longer than their
launches take, and every bucket recorded costs an eager run plus a capture. (Measured on the H200, 8 layers of
the Llama-3-8B shape: a 1,024-token step took 15.4 ms of wall eager against 12.3 ms as a graph, with 10.9 ms of
kernels: its 98 launches from Python cost more than the kernels hide, hence the cap of 2,048.)

Steps that need logits for more rows than sequences (prompt logprobs, speculative verification mixed with
a prefill) run eagerly; pure decode and speculative-verification steps keep their own graphs
(`ModelRunner._replay_decode`, keyed by batch size / ("spec", tokens, sequences)); prefill graphs are keyed
("prefill", padded tokens, padded sequences) in the same bounded LRU (engine.limits.MAX_DECODE_GRAPHS).
"""
from __future__ import annotations

import numpy as np


def token_bucket(n: int, cap: int) -> int:
    """The padded token count of a step of n tokens: 8, 16, then four buckets per octave (multiples of 8 up
    to 64, of 16 up to 128, ...), at most cap (the batch arrays' length)."""
    if n <= 8:
        b = 8
    else:
        p = 1 << (n - 1).bit_length()          # the next power of two >= n
        step = max(8, p // 8)
        b = -(-n // step) * step
    return min(b, cap)


def seq_bucket(s: int, cap: int) -> int:
    """The padded sequence count: the next power of two, at most cap (max_num_seqs)."""
    return min(1 << max(s - 1, 0).bit_length(), cap)


def write_padding(b, T: int, T_pad: int, S: int, S_pad: int) -> None:
    """Pads the host batch b of T tokens in S sequences to T_pad tokens in S_pad sequences (a recorded
    graph's step; the decode graphs' batch-size buckets too)."""
    # padding tokens: no KV write (slot -1), a valid id and position, after every sequence's tokens
    b.input_ids[T:T_pad] = 0
    b.positions[T:T_pad] = 0
    b.slot_mapping[T:T_pad] = -1
    # padding sequences: no tokens, length 0 (the attention kernels skip them)
    b.query_start[S + 1:S_pad + 1] = T
    b.seq_lens[S:S_pad] = 0
    b.block_table[S:S_pad] = 0


def _gathers_rows_from_array(model) -> bool:
    """Whether the model's forward is DecoderLM.forward, which gathers the logits rows through
    `b.device_rows` (a fixed array) when set; other forwards (MLA, encoders) index with a temporary array
    or on the host, which a recorded graph would bake in."""
    from engine.models.decoder import DecoderLM
    return getattr(type(model), "forward", None) is DecoderLM.forward


# CUDA: the largest padded token count recorded as a graph (see the module docstring; vLLM's max_capture_size
# is 512, but our eager launch path costs more per launch than vLLM's); JITKERN_CUDA_GRAPH_MAX_TOKENS overrides
# it (0: CUDA prefill / mixed steps run eagerly)
CUDA_MAX_TOKENS = 2048


class PrefillGraphs:
    """Records and replays the prefill / mixed steps of one CPU or CUDA ModelRunner (see the module
    docstring)."""

    def __init__(self, runner):
        self.runner = runner
        b = runner.batch
        self.rows = np.zeros(len(b.seq_lens), np.int32)      # the logits rows of a padded step (fixed address)
        self.replays = 0                                     # steps served by a graph (tests, metrics)
        # CUDA: the largest padded step recorded (read once: a bad value is refused here, naming the variable,
        # not in the middle of a step)
        from engine.settings import cuda_graph_max_tokens
        self.cuda_max_tokens = cuda_graph_max_tokens(CUDA_MAX_TOKENS)

    def eligible(self, res) -> bool:
        r = self.runner
        b = r.batch
        if not r.use_graphs or r.device not in ("cpu", "cuda") or (r.staging is not None) != (r.device == "cuda"):
            return False
        if not getattr(r.model, "supports_graphs", True) or not _gathers_rows_from_array(r.model):
            return False
        if res.prompt_rows or res.spec_rows or b.num_tokens == 0 or b.mm_rows is not None:
            return False            # (image features are scattered by a launch of their own shape: eager)
        R, S = len(b.logits_rows), b.num_seqs
        if not (R <= S and b.num_tokens > S):        # one row per sampling sequence; some sequence prefills
            return False
        if r.device == "cpu":
            return True
        return self._padded(b)[0] <= self.cuda_max_tokens

    @staticmethod
    def _padded(b):
        """(T_pad, S_pad) of the host batch's step."""
        maxT, maxS = len(b.input_ids), len(b.seq_lens)
        S_pad = seq_bucket(b.num_seqs, maxS)
        return token_bucket(max(b.num_tokens, S_pad + 1), maxT), S_pad

    def pad(self, res):
        """Pads the host batch to its bucket (before a CUDA step's staged copy); returns what `replay` needs,
        or None where there is no room to pad (tiny max_num_batched_tokens: the step runs eagerly)."""
        b = self.runner.batch
        T, S, rows = b.num_tokens, b.num_seqs, b.logits_rows
        R = len(rows)
        T_pad, S_pad = self._padded(b)
        if T_pad <= S_pad or T_pad < T:
            return None
        write_padding(b, T, T_pad, S, S_pad)
        self.rows[:R] = rows
        self.rows[R:S_pad] = 0
        saved = (b.num_tokens, b.num_seqs, b.logits_rows, b.device_rows)
        b.num_tokens, b.num_seqs, b.logits_rows = T_pad, S_pad, self.rows[:S_pad]
        if self.runner.staging is None:
            b.device_rows = self.rows           # the decoder gathers the logits rows from this fixed array
        return ("prefill", T_pad, S_pad), R, saved

    def replay(self, padded):
        """The padded step's graph replayed (recorded first if new); the host batch restored; the logits of the
        real rows (a view of the graph's buffer)."""
        r = self.runner
        b = r.batch
        key, R, saved = padded
        try:
            logits = r._replay_decode(key)
        finally:
            b.num_tokens, b.num_seqs, b.logits_rows, b.device_rows = saved
            if r.staging is not None:
                d = r.fwd_batch
                d.num_tokens, d.num_seqs, d.logits_rows = saved[:3]
        self.replays += 1
        return logits[:R]
