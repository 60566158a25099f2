"""Code-generation choices of a target: one table, carried by its `Target` (``target.tuning``).

Each default is the measured winner on the hardware it was tuned on (docs/BENCHMARKS.md records the runs); the
other values are experiments, kept where they are worth re-measuring on other hardware. A choice is data, not an
environment switch: to try a variant, compile or launch against ``tuned(target, name=value)``, a copy of the target
with that entry changed (``tags()`` puts every non-default entry that shapes code into the cache key).

Entries read by the GPU lowering (backends/gpu*.py, backends/nvptx.py) shape one kernel's code; the others are read
where the ops choose a launch (tiles, warps, constexprs: those are in the kernel's specialisation already) or where
the engine picks a kernel (engine/models/decoder.py), and the CPU tiers' attention launches (ops/attention.py).

Every target carries DEFAULT today (the GPU entries measured on an H200, the CPU ones on x86 hosts); a target
family whose winners differ gets its own Tuning in targets/registry.py.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional


class CachedHash:
    """For frozen dataclasses that sit in every launch's memo key (a Target and its Tuning): the hash is
    computed once. A frozen dataclass generates its own __hash__ unless its body names one: subclasses say
    `__hash__ = CachedHash.__hash__`."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        # the cached hash stays behind: str hashes differ between processes (compile workers unpickle targets)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclass(frozen=True)
class Tuning(CachedHash):
    __hash__ = CachedHash.__hash__     # a frozen dataclass would otherwise generate its own
    # ---- GPU lowering (one kernel's code; in the cache key through tags, as each backend lists them)
    ldmatrix: bool = True            # MMA fragments by ldmatrix where the target has it (else 32-bit shared loads)
    ldmatrix_trans: bool = True      # a (k, n) B operand staged in row order, read by ldmatrix .trans (no conflicts)
    a_from_rows: bool = True         # a dot's A taken from the previous dot's accumulator registers (flash P @ V)
    costage: bool = True             # the flash kernels' V tile staged together with K by the scores' dot
    wgmma_swizzle: int = 128         # warpgroup-MMA operands in 128-byte swizzled rows (0: plain core matrices)
    wgmma_pipe: bool = False         # experiment: a K loop's wgmma overlaps the next step's register staging
    tma_pipe: bool = True            # TMA-fed K loops keep their wgmma in flight into the next step (prefetch 2)
    frag_ops: bool = True            # elementwise ops on MMA accumulators in their registers, not through shared memory
    cp_async: Optional[bool] = None  # None: launches with num_stages >= 2 copy their dot operands by cp.async
    mma_unroll: int = 0              # MMA K loop unroll (0: the target's choice)
    row_slots: bool = False          # experiment: row vectors broadcast into fragments staged once, one barrier
    pin_operands: bool = True        # a loop's dot stages an A operand defined outside the loop once, before it
    pin_regs: bool = True            # ... and keeps its fragments in registers across the loop
    fast_exp: bool = True            # jk.exp_fast as the hardware exponential (NVPTX ex2.approx)
    reduce_direct: bool = True       # short-row reductions fold from the staged row, no staged partials
    reduce_one_each: bool = True     # CTA-wide reductions one work item a thread, final fold unrolled
    wg_sums: bool = True             # sums of warpgroup-MMA accumulators added in their registers

    # ---- launch choices of the ops (tiles, constexprs: already in each kernel's specialisation)
    linear_wgmma: bool = True        # the bf16 linear's tiles of linear_wgmma_min_bm+ tokens on warpgroup MMAs (sm_90a)
    linear_wgmma_min_bm: int = 64    # the M = 1 decode tile was slower on wgmma with register staging
    linear_tma: bool = True          # the wgmma tiles fed by the tensor memory accelerator instead of cp.async
    linear_prefetch: int = 2         # K steps ahead the TMA-fed tiles load (cp.async tiles load 1 ahead)
    serial_split_m: int = 1024       # tokens from which a split K's slabs are summed inside each program
    serial_maxnreg: Optional[int] = 128   # those launches' register cap (None: ptxas decides)
    serial_chain: bool = True        # those launches keep one copy chain through their K slabs
    flash_partition_blocks: int = 4  # cache blocks per flash-decoding partition (decode and prefill agree on it)
    flash_step_blocks: int = 2       # cache blocks per online-softmax step of the flash kernels
    flash_decode_wide: int = 1024    # flash decode launches of this many programs and more run 2 warps, not 4
    flash_decode_pipeline: bool = True   # the flash decode kernel loads the next cache block during the current one
    flash_warp_rows: bool = True     # the flash kernels' MMA tiles dealt so each warp owns whole rows (CUDA)
    flash_fold_skip: bool = True     # the flash prefill folds its partitions only in blocks where a row needs it
    flash_longest_first: bool = True  # the flash prefill grid starts the longest causal tiles first
    rope_tiles: bool = True          # rope + KV cache writes of long steps take a token's heads as one tile
    flash_prefill_pipeline: bool = True   # the flash prefill kernel loads the next cache block during the current one
    token_attention: bool = False    # experiment: GPU attention all on token_attention_kernel (the pre-flash path)
    quant_gemv_tokens: int = 8       # CUDA: tokens a program of the GPU-shaped GGUF linear takes (weights loaded once for them)
    quant_gemv_lanes: int = 32       # CUDA: most lanes (threads) over a row's 32-element blocks there (a power of 2)
    quant_gemv_warps: int = 4        # CUDA: warps a CTA of that linear (rows a CTA: 32 * warps / lanes)
    # CPU tiers' quantised GEMV (engine/ops/quant.py gemv_rows)
    cpu_gemv_rows: int = 4           # weight rows a decode GEMV tile takes in lockstep (1: each row alone)
    cpu_gemv_rows_max_bytes: int = 512   # ... only for rows of at most this many bytes (longer: 1 row)
    cpu_split_blocks: bool = True    # q4_0 / q4_1 / q8_0 linear weights regrouped into quant and scale planes at load
    # CPU tiers' attention launches (ops/attention.py)
    decode_skip_idle: bool = True    # decode / merge programs without work return at once
    decode_head_split: bool = True   # decode programs per KV head when there are fewer sequences than threads
    prefill_token_group: int = 16    # prefill tokens sharing a cache block scored together (0: every token alone)
    prefill_balance: bool = True     # prefill programs in _balanced_tile's order (off: grid order)
    prefill_merge: int = 1           # 1: merge a token's partitions over the smallest power of two that holds them

    # ---- the engine's kernel choices on CUDA (engine/models/decoder.py)
    x16_attn: bool = True            # the flash kernels write the o projection's input in 16 bits (it then takes TMA)
    gate_up16: bool = True           # the gate/up projection writes 16-bit output for the gated activation
    gated_linear: bool = False       # experiment: decode steps run gate/up + the gated activation as one kernel

    def tags(self, entries) -> tuple:
        """Cache-key tags of the named entries, in that order: a backend lists the entries that shape its code
        (jitkern/backends: `Backend.tuning_entries`), so a cache filled with one table never serves another. Most
        entries add a tag only away from their default; some are always recorded (see _TAGS)."""
        return tuple(tag for name in entries for tag in _TAGS[name](self))


# Each code-shaping entry's cache-key tags.
_TAGS = {
    "ldmatrix": lambda t: () if t.ldmatrix else ("no-ldmatrix",),
    "ldmatrix_trans": lambda t: () if t.ldmatrix_trans else ("no-ldmatrix-trans",),
    "wgmma_swizzle": lambda t: (f"wgmma-swizzle-{t.wgmma_swizzle}",) if t.wgmma_swizzle else (),
    "wgmma_pipe": lambda t: ("wgmma-pipe",) if t.wgmma_pipe else (),
    "tma_pipe": lambda t: ("tma-pipe",) if t.tma_pipe else (),
    "frag_ops": lambda t: () if t.frag_ops else ("no-frag-ops",),
    "cp_async": lambda t: (f"cp-async-{int(t.cp_async)}",) if t.cp_async is not None else (),
    "mma_unroll": lambda t: (f"mma-unroll-{t.mma_unroll}",) if t.mma_unroll else (),
    "row_slots": lambda t: ("row-slots",) if t.row_slots else (),
    "pin_operands": lambda t: ("pin-operands",) if t.pin_operands else (),
    "pin_regs": lambda t: ("pin-regs",) if t.pin_regs and t.pin_operands else (),
    "a_from_rows": lambda t: () if t.a_from_rows else ("staged-rows-a",),
    "costage": lambda t: () if t.costage else ("no-costage",),
    "fast_exp": lambda t: () if t.fast_exp else ("no-fast-exp",),
    "reduce_direct": lambda t: () if t.reduce_direct else ("two-pass-reduce",),
    "reduce_one_each": lambda t: () if t.reduce_one_each else ("reduce-tiled",),
    "wg_sums": lambda t: () if t.wg_sums else ("no-wg-sums",),
}


DEFAULT = Tuning()


def tuned(target, **choices):
    """A copy of `target` with the named tuning entries changed (an experiment, or a test of the other path)."""
    names = {f.name for f in fields(Tuning)}
    unknown = sorted(set(choices) - names)
    if unknown:
        raise TypeError(f"unknown tuning entries {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return replace(target, tuning=replace(target.tuning, **choices))
