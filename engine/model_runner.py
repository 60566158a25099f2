"""Turns a SchedulerOutput into one forward pass over a flat token batch and returns the logits.

The batch is laid out as vLLM's V1 runner does: the scheduled tokens of all requests back to back
(`input_ids`, `positions`, `slot_mapping`), `query_start` offsets per request, `seq_lens` (cached
context + new tokens), and the block table. All of these live in preallocated int32 arrays with fixed
addresses, and activations in a buffer pool with fixed addresses, so a decode step can be recorded once
per batch size as a jitkern graph and replayed with new values written into the arrays.

Recorded graphs are bounded (engine.limits.MAX_DECODE_GRAPHS, least recently replayed evicted first) and
all dropped when an activation buffer moves (they would point at the old buffers and keep them alive).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine.device import GPU_DEVICES
from engine.prefill_graphs import write_padding


def decode_bucket(n: int, cap: int) -> int:
    """The padded batch size of a CUDA decode step of n sequences: 1, 2, 4, then multiples of 8 (vLLM's
    cudagraph capture sizes), at most cap (max_num_seqs)."""
    b = n if n <= 2 else 4 if n <= 4 else -(-n // 8) * 8
    return min(b, cap)


def decode_buckets(cap: int) -> list:
    """Every padded batch size decode_bucket gives for 1..cap sequences (35 for vLLM's 256)."""
    return sorted({decode_bucket(n, cap) for n in range(1, cap + 1)})


class BufferPool:
    """Named activation buffers with stable addresses (grown, never shrunk)."""

    def __init__(self):
        self._bufs: dict = {}
        self.generation = 0           # bumps when any buffer moves (invalidates recorded graphs)

    def get(self, name: str, shape, dtype=np.float32) -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            cap = max(n, 2 * buf.size if buf is not None else n)
            buf = np.zeros(cap, dtype)
            self._bufs[name] = buf
            self.generation += 1
        return buf[:n].reshape(shape)

    def clear(self) -> None:
        self._bufs.clear()
        self.generation += 1


@dataclass
class Batch:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    buffers: BufferPool
    num_tokens: int = 0
    num_seqs: int = 0
    logits_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    host: "Batch | None" = None            # a device batch: its host twin (for host-side reads of lengths)
    device_rows: object = None              # a device batch: logits_rows staged on the device
    # image input (engine.multimodal): rows of the step's tokens whose embeddings are image features, and those
    # features [len(mm_rows), hidden]; None in steps without image tokens
    mm_rows: np.ndarray | None = None
    mm_embeds: np.ndarray | None = None


@dataclass
class StepResult:
    logits: np.ndarray                     # [R, V]
    sample_rows: dict                      # req_id -> row of `logits` for its next token
    prompt_rows: dict                      # req_id -> (first logits row, count, first position)
    # speculative decoding: req_id -> (first logits row, count = drafts + 1), rows of the verified positions
    spec_rows: dict = field(default_factory=dict)
    # device-side greedy (ModelRunner.device_greedy): each row's argmax token and its logit, computed where the
    # logits are; `logits` is then None (the [R, V] rows never leave the device)
    greedy_tokens: np.ndarray | None = None
    greedy_values: np.ndarray | None = None
    # CUDA: the replayed decode graph's picks (ids, then the logits' f32 bits) still on the device, between
    # ModelRunner.launch and finish
    device_picks: object = None


class ModelRunner:
    lora = None                 # engine.lora.LoRAManager when the engine serves LoRA adapters

    def __init__(self, model, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, use_graphs: bool = True, device_buffers=None):
        # device_buffers: a DeviceBufferPool to adopt (LLMEngine's GPU sizing hands over its measuring runner's
        # reserved buffers, so the step buffers are the ones measured, not new ones beside the KV cache)
        self.model = model
        self.block_size = block_size
        # greedy steps pick tokens on the device (set by LLMEngine for its own runner; draft-model runners of
        # speculative decoding read the logits themselves)
        self.device_greedy = False
        self._greedy_bufs: dict = {}
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size) + 1
        model.allocate_kv(num_blocks, block_size)
        maxT = max(max_num_batched_tokens, max_num_seqs)
        self.device = getattr(model, "device", "cpu")
        self.staging = None
        if self.device in GPU_DEVICES:
            # step inputs: filled on the host as on the CPU (views of one staging array), sent in one copy
            from engine.device import DeviceBufferPool, StepStaging
            self.staging = st = StepStaging(maxT, max_num_seqs, self.max_blocks_per_seq, self.device)
            h, d = st.host_views, st.dev_views
            h["slot_mapping"][:] = -1
            names = ("input_ids", "positions", "slot_mapping", "query_start", "seq_lens", "block_table")
            self.batch = Batch(**{k: h[k] for k in names}, buffers=BufferPool())
            self.fwd_batch = Batch(**{k: d[k] for k in names}, buffers=device_buffers or DeviceBufferPool(self.device),
                                   host=self.batch,
                                   device_rows=d["logits_rows"])
        else:
            self.batch = Batch(
                input_ids=np.zeros(maxT, np.int32), positions=np.zeros(maxT, np.int32),
                slot_mapping=np.full(maxT, -1, np.int32), query_start=np.zeros(max_num_seqs + 1, np.int32),
                seq_lens=np.zeros(max_num_seqs, np.int32),
                block_table=np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32), buffers=BufferPool())
            self.fwd_batch = self.batch          # the batch the forward pass reads
        self.use_graphs = use_graphs          # Vulkan: jk.capture() records a command buffer per batch size
        # models whose steps need host work between kernels (GGUF-quantised MoE experts) opt out of graphs
        self.use_graphs = self.use_graphs and getattr(model, "supports_graphs", True)
        from engine.limits import MAX_DECODE_GRAPHS
        # at least one graph per decode bucket of max_num_seqs: with vLLM's GPU default of 256 sequences there
        # are 35, and a bound below that would re-record graphs in turn under a steady mix of batch sizes
        self.max_graphs = max(MAX_DECODE_GRAPHS, len(decode_buckets(max_num_seqs)))
        self._graphs: OrderedDict = OrderedDict()   # decode batch size -> (graph, logits[, picks]), LRU order
        self._graph_greedy = None     # CPU: (argmax ids, their logits) the last replayed decode graph wrote
        self._graphs_generation = self.fwd_batch.buffers.generation
        from engine.prefill_graphs import PrefillGraphs
        self.prefill_graphs = PrefillGraphs(self)   # prefill / mixed steps: graphs per padded token count
        self._decode_rows = np.zeros(max_num_seqs, np.int32)     # a padded decode step's logits rows

    def reserve_buffers(self, measure: bool = False) -> bool:
        """Sizes the activation buffers for the largest steps before the first one runs: a step larger than any
        before would move a buffer, and a moved buffer drops every recorded graph (each is recorded again, an
        eager run plus a capture, in the middle of serving). vLLM sizes its buffers so with a profile run at
        start. Here the forward pass runs twice with its launches dry (runtime.launch.dry_launches: no kernel
        compiles or runs, only the host code between them, which asks the pool for its buffers): a mixed step
        of every token the batch arrays hold over every sequence, then a decode step of every sequence.

        Only where graphs are recorded (elsewhere a moved buffer costs nothing); not for tensor-parallel
        ranks (their forward talks to the other ranks between launches). measure=True runs it without graphs
        too: LLMEngine sizes the GPU's KV cache by the memory it takes. Returns whether it ran; a forward
        that fails dry leaves the buffers to grow as steps need them (logged)."""
        if not (self.use_graphs or measure) or getattr(self.model, "tp", None) is not None \
                or not hasattr(self.model, "forward"):
            return False
        import logging

        from jitkern.runtime.launch import dry_launches
        b, d = self.batch, self.fwd_batch
        maxT, maxS = len(b.input_ids), len(b.seq_lens)
        try:
            with dry_launches():
                for T, S in ((maxT, maxS), (maxS, maxS)):
                    # no sequence holds more than max_model_len tokens, so no step more than S of them
                    S = min(S, T)
                    T = min(T, S * self.max_model_len)
                    per, extra = divmod(T, S)
                    lens = np.full(S, per, np.int32)
                    lens[:extra] += 1
                    b.query_start[0] = 0
                    b.query_start[1:S + 1] = np.cumsum(lens)
                    b.seq_lens[:S] = lens                     # no cached context: every sequence starts here
                    b.positions[:T] = 0
                    b.slot_mapping[:T] = -1                   # (nothing runs; and were it to, no KV write)
                    b.block_table[:S] = 0
                    rows = (b.query_start[1:S + 1] - 1).astype(np.int32)
                    for x in (b, d) if d is not b else (b,):
                        x.num_tokens, x.num_seqs, x.logits_rows = T, S, rows
                    self.model.forward(d)
        except Exception as e:      # noqa: BLE001 - an optimisation: steps grow the buffers as before
            logging.getLogger("engine").warning("activation buffers not reserved (%s: %s): the first large steps "
                                                "size them", type(e).__name__, e)
            return False
        finally:
            b.query_start[:] = 0
            b.seq_lens[:] = 0
            b.positions[:] = 0
            b.slot_mapping[:] = -1
            for x in (b, d) if d is not b else (b,):
                x.num_tokens, x.num_seqs, x.logits_rows = 0, 0, np.zeros(0, np.int32)
            self._graphs.clear()
            self._graphs_generation = d.buffers.generation
        return True

    def close(self) -> None:
        self.model.free_kv()
        self.batch.buffers.clear()
        self.fwd_batch.buffers.clear()
        self._graphs.clear()

    def prepare(self, sched) -> StepResult:
        # Built as Python lists and written with one numpy assignment per array: a step's host time is on the
        # GPU's critical path (~7 small numpy writes per request cost ~0.5 ms at 64 requests).
        b = self.batch
        t = 0
        rows = []
        sample_rows, prompt_rows, spec_rows = {}, {}, {}
        ids, positions, slots, starts, lens, tables = [], [], [], [], [], []
        for s in sched.scheduled:
            n = s.num_tokens
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + n))
            slots.extend(s.slot_mapping)
            starts.append(t)
            lens.append(s.start + n)
            tables.append(s.block_table)
            req = s.request
            wants_plp = req.sampling_params.prompt_logprobs is not None and s.start < req.num_prompt_tokens
            if wants_plp:
                prompt_rows[s.req_id] = (len(rows), n, s.start)
                rows.extend(range(t, t + n))
                if s.sample:
                    sample_rows[s.req_id] = len(rows) - 1
            elif s.sample and s.spec_token_ids:
                ns = len(s.spec_token_ids)        # verified by engine.spec_decode, not the sampler
                spec_rows[s.req_id] = (len(rows), ns + 1)
                rows.extend(range(t + n - 1 - ns, t + n))
            elif s.sample:
                sample_rows[s.req_id] = len(rows)
                rows.append(t + n - 1)
            t += n
        R = len(starts)
        starts.append(t)
        b.input_ids[:t] = ids
        b.positions[:t] = positions
        b.slot_mapping[:t] = slots
        b.query_start[:R + 1] = starts
        b.seq_lens[:R] = lens
        b.block_table[:R] = 0
        width = max((len(bt) for bt in tables), default=0)
        if width:
            b.block_table[:R, :width] = [list(bt) + [0] * (width - len(bt)) for bt in tables]
        b.num_tokens = t
        b.num_seqs = R
        b.logits_rows = np.asarray(rows, np.int32)
        b.mm_rows = b.mm_embeds = None
        if any(s.request.mm_inputs for s in sched.scheduled):
            self._image_rows(sched, b)
        if self.lora is not None:             # engine.lora: the step's adapters in slots, tokens tiled by slot
            self.lora.prepare_step(sched.scheduled)
        return StepResult(None, sample_rows, prompt_rows, spec_rows)

    def _image_rows(self, sched, b) -> None:
        """The step's image-token rows and their features (Batch.mm_rows / mm_embeds): the vision tower runs
        here, on the engine thread, for images whose tokens this step computes and whose features are not
        computed yet (a prefix-cache hit over a whole image skips it)."""
        vision = getattr(self.model, "vision", None)
        if vision is None:
            return                     # a model without a vision tower (a draft model): token embeddings only
        from engine.multimodal import ensure_embeds
        t = 0
        spans = []
        for s in sched.scheduled:
            lo, hi = s.start, s.start + s.num_tokens
            for im in s.request.mm_inputs:
                a, e = max(lo, im.offset), min(hi, im.end)
                if a < e:
                    spans.append((im, t + a - lo, a - im.offset, e - a))
            t += s.num_tokens
        if not spans:
            return
        ensure_embeds(vision, [sp[0] for sp in spans])
        b.mm_rows = np.concatenate([np.arange(r, r + n, dtype=np.int32) for _, r, _, n in spans])
        b.mm_embeds = np.concatenate([im.embeds[f:f + n] for im, _, f, n in spans]) if len(spans) > 1 \
            else spans[0][0].embeds[spans[0][2]:spans[0][2] + spans[0][3]]

    def execute(self, sched) -> StepResult:
        return self.finish(sched, self.launch(sched))

    def launch(self, sched) -> StepResult:
        """The step's inputs staged and its forward pass launched. On CUDA this returns while the GPU runs
        (kernel launches and graph replays are asynchronous on the device's stream); `finish` waits for it and
        brings back what the sampler needs. The engine does other host work in between (LLMEngine's
        overlap_output). On the CPU the kernels run in the calling thread: everything is done on return."""
        res = self.prepare(sched)
        b = self.batch
        pure_decode = b.num_tokens == b.num_seqs and len(b.logits_rows) == b.num_tokens and not res.prompt_rows
        # speculative verification steps (1 + k tokens per request, logits for every token) replay graphs too,
        # one per (tokens, sequences): every kernel reads the step's layout from the batch arrays
        spec_step = bool(res.spec_rows) and not res.prompt_rows and len(b.logits_rows) == b.num_tokens \
            and self.staging is None and getattr(self.model, "supports_graphs", True)
        # (a one-token step of a prompt that ends in an image's rows scatters image features: eager, as prefills)
        decode_graph = self.use_graphs and pure_decode and getattr(self.model, "supports_graphs", True) \
            and b.mm_rows is None
        # prefill / mixed steps: padded to a bucket (before the staged copy on CUDA) and replayed as a graph
        padded = None
        if not decode_graph and not (self.use_graphs and spec_step) and self.prefill_graphs.eligible(res):
            padded = self.prefill_graphs.pad(res)
        # CUDA: a decode step replays the graph of its batch-size bucket (decode_bucket), padded; one graph per
        # exact size would record up to max_num_seqs of them (an eager step + a capture each) as requests end
        saved = self._pad_decode() if decode_graph and self.device == "cuda" else None
        if self.staging is not None:
            self._send_step()
        if decode_graph:
            try:
                res.logits = self._replay_decode()
            finally:
                if saved is not None:
                    self._unpad(saved)
            if saved is not None:
                res.logits = res.logits[:saved[1]]
            picks = self._graph_greedy
            if picks is not None and self.device_greedy and self._plain_greedy(sched, res):
                # the argmax ran inside the replayed graph (no separate launch waking the pool's threads; on
                # CUDA no launches from Python, and ids + logits come back in one copy, in `finish`)
                if isinstance(picks[0], np.ndarray):
                    res.greedy_tokens, res.greedy_values = picks[0].copy(), picks[1].copy()
                else:
                    res.device_picks = picks[2]
        elif self.use_graphs and spec_step:
            res.logits = self._replay_decode(("spec", b.num_tokens, b.num_seqs))
        elif padded is not None:
            res.logits = self.prefill_graphs.replay(padded)
        else:
            res.logits = self.model.forward(self.fwd_batch)
        return res

    def finish(self, sched, res) -> StepResult:
        """Waits for a launched step (device only) and copies back its picks or the logits rows the host
        sampler needs."""
        if res.device_picks is not None:
            both = res.device_picks.numpy()              # the one copy back (waits for the step)
            R = both.shape[0] // 2
            res.greedy_tokens, res.greedy_values = both[:R], both[R:].view(np.float32)
            res.logits, res.device_picks = None, None
        if self.staging is not None and res.greedy_tokens is None and not isinstance(res.logits, np.ndarray):
            if self.device_greedy and self._plain_greedy(sched, res):
                self._greedy_on_device(res)
            else:
                res.logits = res.logits.numpy()          # only the rows that need logits come back
        return res

    def _plain_greedy(self, sched, res) -> bool:
        """Every row of this step is a greedy pick that needs nothing but the argmax (no logprobs, no logit
        edits, penalties or grammar, no prompt logprobs, no speculative verification)."""
        if res.prompt_rows or res.spec_rows or not res.sample_rows:
            return False
        from engine.sampler import Sampler
        by_id = {s.req_id: s.request for s in sched.scheduled}
        for rid in res.sample_rows:
            req = by_id.get(rid)
            p = req.sampling_params if req is not None else None
            if p is None or p.temperature != 0 or p.logprobs is not None or Sampler._has_processors(req):
                return False
        return True

    def _greedy_on_device(self, res) -> None:
        """The argmax of each logits row (and its value, for the sampler's NaN guard) on the device: R ints and
        R floats come back instead of R x vocab floats (32 MB a step at batch 64 with a 128k vocabulary)."""
        from engine.ops.sampling import argmax_rows, gather_rows
        logits = res.logits
        R = logits.shape[0]
        bufs = self._greedy_bufs.get(R)
        if bufs is None:
            from engine.ops._hostargs import empty_like_dev
            bufs = self._greedy_bufs[R] = (empty_like_dev(logits, R, np.int32), empty_like_dev(logits, R, np.float32))
        ids, vals = bufs
        argmax_rows(logits, out=ids)
        gather_rows(logits, ids, out=vals)
        res.greedy_tokens, res.greedy_values = ids.numpy(), vals.numpy()
        res.logits = None

    def _send_step(self) -> None:
        """CUDA: the step's host inputs to the device batch (one copy; the host sampler gets the logits back)."""
        b, d = self.batch, self.fwd_batch
        R = len(b.logits_rows)
        self.staging.host_views["logits_rows"][:R] = b.logits_rows
        self.staging.send()
        d.num_tokens, d.num_seqs, d.logits_rows = b.num_tokens, b.num_seqs, b.logits_rows
        d.mm_rows = d.mm_embeds = None
        if b.mm_rows is not None:
            # image features: a step of their own shape (run eagerly, never recorded), so plain uploads
            from jitkern.runtime.device import to_device
            dev = self.staging.dev.device
            d.mm_rows, d.mm_embeds = to_device(b.mm_rows, device=dev), to_device(b.mm_embeds, device=dev)

    def _replay_decode(self, key=None) -> np.ndarray:
        """Decode steps of the same batch size replay one recorded graph (launch cost ~1 us per kernel
        instead of ~10 us through Python). Everything that changes between steps (ids, positions, slots,
        lengths, block tables) lives in the batch's fixed arrays, which the kernels read when they run."""
        import jitkern as jk
        b = self.fwd_batch
        if b.buffers.generation != self._graphs_generation:
            # a buffer moved: every graph points at (and keeps alive) the old ones
            self._graphs.clear()
            self._graphs_generation = b.buffers.generation
        key = b.num_tokens if key is None else key
        ent = self._graphs.get(key)
        if ent is None and self.device == "cuda":
            return self._capture_cuda(key)
        if ent is None:
            with jk.capture() as g:
                logits = self.model.forward(b)
                picks = self._record_greedy(logits, key)
            if b.buffers.generation != self._graphs_generation:
                # a buffer moved while recording: record again with the final addresses
                self._graphs.clear()
                self._graphs_generation = b.buffers.generation
                with jk.capture() as g:
                    logits = self.model.forward(b)
                    picks = self._record_greedy(logits, key)
            ent = self._graphs[key] = (g, logits, picks)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        g, logits = ent[0], ent[1]
        self._graph_greedy = ent[2] if len(ent) > 2 else None
        g.replay()
        return logits

    def _pad_decode(self):
        """Pads the host batch of a decode step of B sequences to decode_bucket(B) before its staged copy:
        padding tokens (id 0, position 0, slot -1: no KV write) after the real ones, in no sequence; padding
        sequences with no tokens and length 0 (the attention skips them); logits rows padded with row 0. Every
        kernel computes a row from that row alone (batch invariance), so the real rows are the unpadded step's
        bit for bit (tests/test_prefill_graphs.py). Returns what `_unpad` restores, or None (B is a bucket)."""
        b = self.batch
        B = b.num_seqs
        Bp = decode_bucket(B, len(b.seq_lens))
        if Bp <= B or Bp > len(b.input_ids):
            return None
        write_padding(b, B, Bp, B, Bp)
        rows = self._decode_rows
        rows[:B] = b.logits_rows
        rows[B:Bp] = 0
        saved = (b.num_tokens, b.num_seqs, b.logits_rows)
        b.num_tokens, b.num_seqs, b.logits_rows = Bp, Bp, rows[:Bp]
        return saved

    def _unpad(self, saved) -> None:
        b, d = self.batch, self.fwd_batch
        b.num_tokens, b.num_seqs, b.logits_rows = saved
        if d is not b:
            d.num_tokens, d.num_seqs, d.logits_rows = saved

    def _record_greedy(self, logits, key):
        """CPU decode graphs of the engine's own runner (device_greedy) end with each row's argmax and its logit
        (~0.1 ms for 16 x 49152 logits): plain greedy steps take their tokens from there instead of launching
        the argmax separately, a launch that wakes the pool's threads once more per step. Recorded into the
        active capture; None where not used (speculative steps, other runners, device logits)."""
        if not (self.device_greedy and isinstance(key, int) and isinstance(logits, np.ndarray)
                and logits.ndim == 2 and logits.flags.c_contiguous):
            return None
        from engine.ops.sampling import argmax_rows, gather_rows
        R = logits.shape[0]
        ids, vals = np.zeros(R, np.int32), np.zeros(R, np.float32)
        argmax_rows(logits, out=ids)
        gather_rows(logits, ids, out=vals)
        return ids, vals

    def _capture_cuda(self, key):
        """CUDA: this step runs eagerly (so buffers, attention scratch and kernel modules are all in place:
        stream capture must not allocate, load modules or synchronise), then is recorded as a CUDA graph
        for the next steps of this batch size. A capture the driver refuses turns graphs off (eager runs)."""
        import logging

        import jitkern as jk
        b = self.fwd_batch
        logits = self.model.forward(b)
        gen = b.buffers.generation
        if gen != self._graphs_generation:
            # the eager run moved a buffer (a larger step than any before): the other graphs point at the old
            # ones; this capture sees the final addresses, so it is kept (not recorded on the next step only)
            self._graphs.clear()
            self._graphs_generation = gen
        picks = self._cuda_greedy_bufs(logits, key)
        self._graph_greedy = None               # this step's picks (if any) come from the eager path
        try:
            with jk.capture() as g:
                self.model.forward(b)
                if picks is not None:
                    self._pick_greedy(logits, picks)
        except Exception as e:      # noqa: BLE001 - eager steps stay correct; say why once
            logging.getLogger("engine").warning("CUDA graph capture failed (%s): decode runs eagerly", e)
            self.use_graphs = False
            self._graphs.clear()
            return logits
        if b.buffers.generation != gen or b.buffers.generation != self._graphs_generation:
            self._graphs.clear()                   # a buffer moved while recording: record next time
            self._graphs_generation = b.buffers.generation
            return logits
        self._graphs[key] = (g, logits, picks)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return logits

    def _cuda_greedy_bufs(self, logits, key):
        """CUDA decode graphs of the engine's own runner end with each row's argmax and its logit, as the CPU's
        do (_record_greedy): (ids, values, both) on the device, `both` one int32 buffer of 2R entries (ids,
        then the logits' f32 bits) so that a plain greedy step copies back once; allocated before the capture
        (a capture must not allocate). None where not used."""
        if not (self.device_greedy and isinstance(key, int) and not isinstance(logits, np.ndarray)
                and len(logits.shape) == 2):
            return None
        from jitkern.runtime.device import DeviceArray
        R = logits.shape[0]
        both = DeviceArray.empty((2 * R,), np.int32, logits.device)
        ids = DeviceArray(both.ptr, (R,), np.int32, logits.device, both)
        vals = DeviceArray(both.ptr + 4 * R, (R,), np.float32, logits.device, both)
        return ids, vals, both

    @staticmethod
    def _pick_greedy(logits, picks) -> None:
        from engine.ops.sampling import argmax_rows, gather_rows
        argmax_rows(logits, out=picks[0])
        gather_rows(logits, picks[0], out=picks[1])

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


# LLMEngine's overlap_output drives launch and finish itself only while `execute` is this one: a runner whose
# execute was replaced (fault injection in tests, timing in perf tools) gets its steps through that.
PLAIN_EXECUTE = ModelRunner.execute
