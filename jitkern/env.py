"""Every JITKERN_* environment setting of the compiler, runtime and engine, parsed and checked in one place.

The modules that use a setting with a value to check call the reader here (the thread pool, the compile
workers, the kernel cache), so a bad value gives the same message wherever it is met; on/off flags and free
text (ALWAYS_COMPILE, LOAD_STATS, the hash seed, the CPU mask) are read where they are used and cannot be
wrong. The command-line tools call ``check_environment()`` first, before any model load or compile, and print
that message as one line with exit status 2. The server's CLI can do the same before starting gunicorn.

Settings (all optional):

    JITKERN_CPU_TIER            CPU tier kernels run on (``jitkern targets`` lists them); default: the best this
                                host can run. A tier the host cannot run is an error (fail closed).
    JITKERN_CPU_MASK_FEATURES   comma-separated LLVM feature names to treat as absent (testing lower tiers).
    JITKERN_NUM_THREADS         kernel launch threads, an integer >= 1; default: the physical cores.
    JITKERN_SPIN_US             microseconds idle pool workers spin before sleeping, an integer >= 0.
    JITKERN_POLLS_PER_YIELD     pool worker polls between yields, an integer >= 1.
    JITKERN_CACHE_DIR           kernel cache directory (must be a writable directory or creatable);
                                default: $XDG_CACHE_HOME/jitkern or ~/.cache/jitkern.
    JITKERN_COMPILE_WORKERS     compile worker processes, an integer >= 1 (default 1).
    JITKERN_COMPILE_TIMEOUT     seconds one compile may take in a worker, a number > 0.
    JITKERN_COMPILE_INPROCESS   1: compile in this process (no crash isolation).
    JITKERN_ALWAYS_COMPILE      1: ignore the kernel cache when looking kernels up (still writes it).
    JITKERN_LOAD_STATS          1: print model-load byte counts.
    JITKERN_GPU_PROFILE         1: time every GPU launch outside graph capture (synchronising around it) and
                                print device ms per kernel at exit (jitkern/runtime/gpu_profile.py).
    JITKERN_PREFIX_CACHING_HASH_SEED   seed of the prefix-cache block hashes (any text).
    JITKERN_LDMATRIX            0: NVIDIA MMA fragments by 32-bit shared loads instead of ldmatrix (A/B switch).
    JITKERN_OVERLAP_OUTPUT      0 or 1: the engine's output work overlapped with the next GPU step (default:
                                on for CUDA, off elsewhere).
    JITKERN_SPEC_ADAPTIVE       0: speculative decoding always drafts num_speculative_tokens (no levels).
    JITKERN_SPEC_BACKOFF        halve, reset or keep: the adaptive draft level after a rejection (default halve;
                                keep: a step that accepted at least half its drafts keeps the level).
    JITKERN_POOL_SPLIT          static or dynamic: how the CPU pool deals a launch's programs to its threads
                                (contiguous chunks, or chunks claimed from a shared counter).
    JITKERN_CUDA_GRAPH_MAX_TOKENS  the largest padded token count of a CUDA prefill / mixed step recorded as a
                                graph, an integer >= 0 (default 2048; 0: eager).
    JITKERN_WGMMA               0 or 1: the bf16 linear's dots as warpgroup MMAs on sm_90a (default 1, for
                                the tiles of JITKERN_WGMMA_MIN_BM+ tokens; 0: mma.sync everywhere).
    JITKERN_WGMMA_SWIZZLE       0 or 128: how warpgroup-MMA operands are staged (plain core matrices or
                                128-byte swizzled rows; default 128).
    JITKERN_WGMMA_PIPE          0 or 1: a K loop's warpgroup MMAs overlap the next step's staging (default 0).
    JITKERN_WGMMA_MIN_BM        wgmma only for linear tiles of at least this many tokens, an integer >= 0
                                (default 64: the tiles fed by cp.async; 0: every tile).
    JITKERN_CP_ASYNC            0 or 1: every K loop's prefetched dot operands go global -> shared memory by
                                cp.async into two buffers, or none do (default: the kernels launched with
                                num_stages=2, the tensor-core linear's tiles of 64+ tokens; an A/B switch).
    JITKERN_MMA_UNROLL          copies of an MMA K loop's step to unroll to, an integer >= 0 (default 0: the
                                target's choice; an A/B switch).
    JITKERN_SERIAL_SPLIT_M      the token count from which the tensor-core linear sums a split K's slabs inside
                                each program, an integer >= 0 (default 1024; the same bits either way).
    JITKERN_SERIAL_MAXNREG      those launches' register cap, an integer >= 0 (default 128; 0: ptxas decides).
    JITKERN_WG_SUMS             0 or 1: sums of warpgroup-MMA accumulators (the serial split's running sum of its
                                slabs) added in the MMA registers instead of through a C tile in shared memory
                                (default 1; the same bits either way; H200: the serial split at 1,024 tokens
                                0.67-0.85x -> 0.74-0.87x cuBLAS).
    JITKERN_SERIAL_CHAIN        0 or 1: those launches keep one copy chain through their K slabs instead of a
                                pipeline that restarts at each slab (default 1: the same bits; on the H200 the
                                narrow weights' GEMMs at 1,024 tokens 0.74-0.87x -> 0.78-0.90x cuBLAS).
    JITKERN_LINEAR_PREFETCH     1 or 2: how many K steps ahead the tensor-core linear's TMA-fed tiles load (2:
                                three buffers; default 2 with JITKERN_TMA on, else 1; the same bits; on the H200
                                the 8-layer prefill's linears 6.64 -> 6.45 ms; cp.async tiles load 1 ahead).
    JITKERN_FLASH_FOLD_SKIP     0 or 1: the flash prefill tile folds its partitions only in the blocks where some
                                row needs it (default 1: 1.15-1.24x prefill attention on the H200; the same
                                bits; 0 folds in every block).
    JITKERN_TMA                 0 or 1: the tensor-core linear's wgmma tiles fed by the tensor memory accelerator
                                (sm_90+; tensor maps from cuTensorMapEncodeTiled) instead of cp.async (default
                                1: 8-layer prefill linears 10.5 -> 8.1 ms on the H200; the same bits).
    JITKERN_TMA_PIPE            0 or 1: a TMA-fed K loop's warpgroup MMAs stay in flight into the next step (wait
                                for all but the latest group), and the step's copies are issued after them
                                (default: on with prefetch 2, off with 1, where it was slower; the same bits).
    JITKERN_PDL                 0 or 1: programmatic dependent launch on sm_90+ (kernels launched with the
                                programmatic stream serialization attribute; each waits for its predecessor with
                                griddepcontrol.wait) (default 0: on the H200 no faster at c=1, slower at c=64; an A/B switch).
    JITKERN_X16_ATTN            0 or 1: on CUDA with 16-bit compute the flash attention kernels write the o
                                projection's input in bf16 / f16 (engine/models/decoder.py GPU_X16_ATTN; the same
                                bits; default 1: the o projection then takes TMA, 8-layer prefill linears
                                8.06 -> 6.64 ms on the H200).
    JITKERN_FLASH_PARTITION_BLOCKS  cache blocks per flash-decoding partition on GPUs, one of 1, 2, 4, 8
                                (default 4; decode and prefill use the same, so a token's bits agree between
                                them at any setting; other settings give other bits; an A/B switch: on the
                                H200 1 or 2 cut a c=1 decode step's attention, but cost more at c=64).
    JITKERN_ROW_SLOTS           0 or 1: row vectors a fragment-layout op broadcasts are staged where they are
                                computed, one barrier for several (default 0: not yet run on a GPU).
    JITKERN_PIN_OPERANDS        0 or 1: a dot in a loop stages an A operand defined outside the loop once, before
                                the loop (default 1: the flash prefill 1.08x on the H200, session 16; 0 is the A/B).
    JITKERN_PIN_REGS            0 or 1: a pinned A operand (JITKERN_PIN_OPERANDS: the flash kernels' query tile) is
                                also read into the MMA fragment registers once before its loop, so its dot loads
                                only B each step (default 1: H200 prefill attention 0.191 -> 0.176 ms at B=1
                                S=1024, session 18; 0 is the A/B; the same bits).
    JITKERN_FRAG_OPS            0 or 1: elementwise ops on MMA accumulators run in the accumulators' registers
                                (default 1; 0 goes through the tile layout in shared memory, an A/B switch).
    JITKERN_FLASH_DECODE_WIDE   launches of at least this many flash-decode programs (sequences x KV heads x
                                partitions) run at 2 warps instead of 4 (ops/attention.py
                                FLASH_DECODE_WIDE_PROGRAMS, default 1024; 0: always 2; the same bits either way).
    JITKERN_FLASH_DECODE_PIPELINE 0 or 1: the flash decode kernel loads the next cache block while it computes the
                                current one (default 1: H200 decode B=64 ctx=1024 0.150 -> 0.138 ms, session 18;
                                the same bits either way).
    JITKERN_ROPE_TILES          0 or 1: rope + KV cache writes of GPU steps from 256 tokens take a token's heads as
                                one tile (ops/rope.py rope_cache_tile_kernel; default 1: H200, 8 layers of a
                                1,024-token prefill 258 -> 98 us, session 19; the same arithmetic).
    JITKERN_GATED_LINEAR        0 or 1: on CUDA decode-sized steps (up to 16 tokens) run the gate/up projection and the
                                gated activation as one kernel where the gate/up output is 16-bit (ops/matmul.py
                                gated_linear; engine/models/decoder.py GPU_GATED_LINEAR; the same bits; default 0:
                                H200, session 19, its first form (two dots a step) gave c=1 198-201 tok/s against
                                208 without; the one-dot form since is not yet measured).
    JITKERN_GATE_UP16           0 or 1: on CUDA the gate/up projection writes its output in the weights' 16-bit type
                                (rounded once as it stores, as HF's bf16 projections are) for the gated activation to
                                read, where the down projection takes 16-bit input (engine/models/decoder.py
                                GPU_GATE_UP16; default 1; 0 writes f32, the A/B).
    JITKERN_FLASH_LONGEST_FIRST 0 or 1: the flash prefill's grid starts the longest causal tiles first (default 1:
                                21% less flash prefill time on the H200 at 1,024 tokens; the same bits either way).
    JITKERN_REDUCE_DIRECT       0 or 1: GPU reductions of rows no longer than the CTA fold each output straight
                                from the staged row (default 1; 0 stages the partials first: the same operations in
                                the same order, so the same bits; an A/B switch).
    JITKERN_FLASH_STEP_BLOCKS   cache blocks per online-softmax step of the flash kernels on GPUs, one of 1, 2, 4
                                (ops/attention.py FLASH_STEP_BLOCKS; decode and prefill use the same, so a token's
                                bits agree between them at any setting; layers with a sliding window step by 1;
                                default 2).
    JITKERN_FAST_EXP            0 or 1: jk.exp_fast (the flash kernels' softmax exponentials) as the GPU's approximate
                                exponential where it has one (NVIDIA ex2.approx; default 1: with warp rows the
                                1,024-token prefill's flash kernels -38% on the H200); 0: the exp polynomial.
    JITKERN_FLASH_WARP_ROWS     0 or 1: the flash kernels on CUDA with warp-owned rows (their MMA tiles dealt
                                so each warp holds whole rows; the online softmax's row max / sum by lane shuffles,
                                no shared memory; the same bits). Default 1 (H200: prefill attention 1.15x alone,
                                1.54x with JITKERN_FAST_EXP; decode 1.09x); 0 is the A/B.
    JITKERN_LDMATRIX_TRANS      0 or 1: an NVIDIA MMA's (k, n) B operand (the flash kernels' V tile) staged in its own
                                row order with vector stores and read by ldmatrix .trans (default 1); 0 stages it
                                transposed element by element (16-bit stores, 16-way bank conflicts on the H200).
                                The same fragments either way, so the same bits; an A/B switch.
    JITKERN_REDUCE_ONE_EACH     0 or 1: a GPU kernel's CTA-wide reduction of up to a thread per (output, chunk) work
                                item runs one item a thread and unrolls its final fold (default 1; the same
                                items folded in the same order, so the same bits; 0 = the tile layout's 4-lane
                                chunks on a quarter of the threads; an A/B switch).
    JITKERN_GATED_X             0 or 1: at decode sizes the down projection applies the gated activation (SiLU /
                                GELU-tanh of gate times up) as it loads its x from the gate/up output (matmul
                                linear(gated_x=)) instead of an act_and_mul launch before it (the same bits;
                                default 0: on the H200 c=1 128-130 tok/s with it against 210-214).
    JITKERN_LINEAR_L2_PREFETCH  KiB >= 0: each program of the tensor-core linear's one-row-of-tiles launches (decode
                                sizes) first prefetches up to this much of its weight rows into L2 (sm_90+ bulk
                                prefetch, issued before the wait for the previous launch under JITKERN_PDL); 0 =
                                off (default: on the H200 c=1 202-203 tok/s at 64, 188-191 at 128, against 210-211).
                                A hint: the same bits.

The server's own settings (JITKERN_MODEL, JITKERN_PORT, ...) are parsed by server/settings.py.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional

from .errors import JitkernError

SETTINGS = ("JITKERN_CPU_TIER", "JITKERN_CPU_MASK_FEATURES", "JITKERN_NUM_THREADS", "JITKERN_SPIN_US",
            "JITKERN_POLLS_PER_YIELD", "JITKERN_CACHE_DIR", "JITKERN_COMPILE_WORKERS", "JITKERN_COMPILE_TIMEOUT",
            "JITKERN_COMPILE_INPROCESS", "JITKERN_ALWAYS_COMPILE", "JITKERN_LOAD_STATS",
            "JITKERN_PREFIX_CACHING_HASH_SEED", "JITKERN_GPU_PROFILE", "JITKERN_LDMATRIX",
            "JITKERN_OVERLAP_OUTPUT", "JITKERN_SPEC_ADAPTIVE", "JITKERN_SPEC_BACKOFF", "JITKERN_WGMMA",
            "JITKERN_WGMMA_SWIZZLE", "JITKERN_WGMMA_PIPE", "JITKERN_WGMMA_MIN_BM", "JITKERN_FRAG_OPS",
            "JITKERN_CP_ASYNC", "JITKERN_MMA_UNROLL", "JITKERN_ROW_SLOTS", "JITKERN_PIN_OPERANDS",
            "JITKERN_PIN_REGS", "JITKERN_SERIAL_SPLIT_M", "JITKERN_SERIAL_CHAIN", "JITKERN_WG_SUMS",
            "JITKERN_SERIAL_MAXNREG", "JITKERN_LINEAR_PREFETCH", "JITKERN_FLASH_FOLD_SKIP", "JITKERN_TMA",
            "JITKERN_TMA_PIPE", "JITKERN_PDL", "JITKERN_X16_ATTN", "JITKERN_FLASH_PARTITION_BLOCKS",
            "JITKERN_REDUCE_DIRECT", "JITKERN_FLASH_DECODE_WIDE", "JITKERN_FLASH_LONGEST_FIRST",
            "JITKERN_FLASH_DECODE_PIPELINE", "JITKERN_ROPE_TILES", "JITKERN_GATE_UP16", "JITKERN_GATED_LINEAR",
            "JITKERN_FLASH_STEP_BLOCKS",
            "JITKERN_FLASH_WARP_ROWS",
            "JITKERN_FAST_EXP", "JITKERN_LDMATRIX_TRANS", "JITKERN_LINEAR_L2_PREFETCH",
            "JITKERN_GATED_X", "JITKERN_REDUCE_ONE_EACH")


class SettingError(JitkernError, ValueError):
    """An environment setting has a value jitkern cannot use. ``name`` is the variable; the message says
    what is wrong and how to fix it, on one line."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _raw(name: str, environ=None) -> Optional[str]:
    raw = _environ(environ).get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def env_int(name: str, minimum: int = 1, environ=None) -> Optional[int]:
    """The integer value of `name`, or None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(name, f"{name}={raw!r} is not an integer; set it to a whole number >= {minimum} "
                                 f"or unset it") from None
    if value < minimum:
        raise SettingError(name, f"{name}={raw!r} must be >= {minimum}; set it to a whole number >= {minimum} "
                                 f"or unset it")
    return value


def env_seconds(name: str, environ=None) -> Optional[float]:
    """A positive number of seconds, or None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise SettingError(name, f"{name}={raw!r} is not a number of seconds > 0; set it to e.g. 60 or unset it")
    return value


def env_choice(name: str, choices: tuple, environ=None) -> Optional[str]:
    """The value of `name` if it is one of `choices`, None when unset or empty."""
    raw = _raw(name, environ)
    if raw is None or raw in choices:
        return raw
    raise SettingError(name, f"{name}={raw!r} is not one of {', '.join(choices)}; set it to one of them or unset it")


def overlap_output(environ=None) -> Optional[bool]:
    """JITKERN_OVERLAP_OUTPUT as True / False, or None when unset (the engine decides by device)."""
    v = env_choice("JITKERN_OVERLAP_OUTPUT", ("0", "1"), environ)
    return None if v is None else v == "1"


def spec_backoff(default: str, environ=None) -> str:
    """JITKERN_SPEC_BACKOFF ("halve" | "reset" | "keep"), or `default` when unset."""
    return env_choice("JITKERN_SPEC_BACKOFF", ("halve", "reset", "keep"), environ) or default


def pool_split(default: str, environ=None) -> str:
    return env_choice("JITKERN_POOL_SPLIT", ("static", "dynamic"), environ) or default


def cuda_graph_max_tokens(default: int, environ=None) -> int:
    v = env_int("JITKERN_CUDA_GRAPH_MAX_TOKENS", 0, environ)
    return default if v is None else v


def wgmma(environ=None) -> bool:
    return env_choice("JITKERN_WGMMA", ("0", "1"), environ) != "0"


def wgmma_swizzle(environ=None) -> int:
    return int(env_choice("JITKERN_WGMMA_SWIZZLE", ("0", "128"), environ) or 128)


def wgmma_pipe(environ=None) -> bool:
    return env_choice("JITKERN_WGMMA_PIPE", ("0", "1"), environ) == "1"


def cp_async(environ=None):
    """JITKERN_CP_ASYNC: 1 copies the tiles every K loop prefetches for its dot global -> shared memory by
    cp.async (backends/gpu.py AsyncTile), 0 never; unset (None): kernels launched with num_stages >= 2."""
    v = env_choice("JITKERN_CP_ASYNC", ("0", "1"), environ)
    return None if v is None else v == "1"


def mma_unroll(environ=None) -> int:
    """JITKERN_MMA_UNROLL=N: copies of an MMA K loop's step LLVM may unroll to (0: the target's default; an
    A/B switch, in the cache key)."""
    return env_int("JITKERN_MMA_UNROLL", 0, environ) or 0


def serial_split_m(environ=None) -> int:
    """JITKERN_SERIAL_SPLIT_M: tokens from which the tensor-core linear sums a split K's slabs in-program."""
    v = env_int("JITKERN_SERIAL_SPLIT_M", 0, environ)
    return 1024 if v is None else v


def wg_sums(environ=None) -> bool:
    """JITKERN_WG_SUMS (default 1): sums of warpgroup-MMA accumulators stay in their registers (backends/gpu.py)."""
    return env_choice("JITKERN_WG_SUMS", ("0", "1"), environ) != "0"


def serial_chain(environ=None) -> bool:
    """JITKERN_SERIAL_CHAIN (default 1): the serial split's slabs share one copy chain (ops/matmul.py)."""
    return env_choice("JITKERN_SERIAL_CHAIN", ("0", "1"), environ) != "0"


def serial_maxnreg(environ=None):
    """JITKERN_SERIAL_MAXNREG: the register cap of those launches (None: ptxas decides)."""
    v = env_int("JITKERN_SERIAL_MAXNREG", 0, environ)
    return 128 if v is None else (v or None)


def linear_prefetch(environ=None) -> int:
    """JITKERN_LINEAR_PREFETCH: K steps ahead the tensor-core linear's tiles load (1 or 2; default 2 where TMA is
    on: ops/matmul.py _tma_maps keeps prefetch 2 for TMA launches)."""
    v = env_choice("JITKERN_LINEAR_PREFETCH", ("1", "2"), environ)
    return int(v) if v else (2 if tma(environ) else 1)


def linear_l2_prefetch(environ=None) -> int:
    """JITKERN_LINEAR_L2_PREFETCH: KiB of weight rows each decode-size tensor-core linear program prefetches into
    L2 first (ops/matmul.py _l2_rows; 0 = off)."""
    v = env_int("JITKERN_LINEAR_L2_PREFETCH", 0, environ)
    return 0 if v is None else v


def reduce_one_each(environ=None) -> bool:
    """JITKERN_REDUCE_ONE_EACH (default 1): GPU CTA-wide reductions one work item a thread (backends/gpu.py)."""
    return env_choice("JITKERN_REDUCE_ONE_EACH", ("0", "1"), environ) != "0"


def gated_x(environ=None) -> bool:
    """JITKERN_GATED_X (default 0): the decode-size down projection takes the gate/up output and applies the gated
    activation in its x loads (ops/matmul.py takes_gated_x, engine/models/decoder.py)."""
    return env_choice("JITKERN_GATED_X", ("0", "1"), environ) == "1"


def tma(environ=None) -> bool:
    """JITKERN_TMA (default 1): the tensor-core linear's wgmma tiles copied by TMA (ops/matmul.py _tma_maps)."""
    return env_choice("JITKERN_TMA", ("0", "1"), environ) != "0"


def tma_pipe(environ=None) -> bool:
    """JITKERN_TMA_PIPE: TMA-fed K loops keep their warpgroup MMAs in flight (GpuLowering._dot_wgmma_async).
    Default: on with prefetch 2 (H200: the 8-layer prefill's linears 6.45 -> 6.29 ms), off with prefetch 1 (there
    it was 1.2x slower)."""
    v = env_choice("JITKERN_TMA_PIPE", ("0", "1"), environ)
    return v == "1" if v else linear_prefetch(environ) == 2


def pdl(environ=None) -> bool:
    """JITKERN_PDL=1: programmatic dependent launch on sm_90+ (backends/nvptx.py entry, runtime/cuda.py launch)."""
    return env_choice("JITKERN_PDL", ("0", "1"), environ) == "1"


def x16_attn(environ=None) -> bool:
    """JITKERN_X16_ATTN (default 1): attention writes the o projection's 16-bit input (engine/models/decoder.py)."""
    return env_choice("JITKERN_X16_ATTN", ("0", "1"), environ) != "0"


def flash_partition_blocks(environ=None) -> int:
    """JITKERN_FLASH_PARTITION_BLOCKS: cache blocks per flash-decoding partition on GPUs (ops/attention.py
    GPU_PARTITION_BLOCKS; default 4)."""
    return int(env_choice("JITKERN_FLASH_PARTITION_BLOCKS", ("1", "2", "4", "8"), environ) or 4)

def flash_step_blocks(default: int, environ=None) -> int:
    """JITKERN_FLASH_STEP_BLOCKS: cache blocks per online-softmax step of the GPU flash kernels (ops/attention.py
    FLASH_STEP_BLOCKS)."""
    return int(env_choice("JITKERN_FLASH_STEP_BLOCKS", ("1", "2", "4"), environ) or default)


def flash_decode_wide(default: int, environ=None) -> int:
    """JITKERN_FLASH_DECODE_WIDE: the program count from which flash decode launches take 2 warps (ops/attention.py
    FLASH_DECODE_WIDE_PROGRAMS)."""
    v = env_int("JITKERN_FLASH_DECODE_WIDE", 0, environ)
    return default if v is None else v


def flash_decode_pipeline(environ=None) -> bool:
    """JITKERN_FLASH_DECODE_PIPELINE (default 1): the flash decode kernel prefetches the next cache block."""
    return env_choice("JITKERN_FLASH_DECODE_PIPELINE", ("0", "1"), environ) != "0"


def rope_tiles(environ=None) -> bool:
    """JITKERN_ROPE_TILES (default 1): GPU rope + cache of long steps with a token's heads as one tile."""
    return env_choice("JITKERN_ROPE_TILES", ("0", "1"), environ) != "0"


def gated_linear(environ=None) -> bool:
    """JITKERN_GATED_LINEAR (default 0): CUDA decode steps run gate/up + the gated activation as one kernel."""
    return env_choice("JITKERN_GATED_LINEAR", ("0", "1"), environ) == "1"


def gate_up16(environ=None) -> bool:
    """JITKERN_GATE_UP16 (default 1): the CUDA gate/up projection writes 16-bit output (engine/models/decoder.py)."""
    return env_choice("JITKERN_GATE_UP16", ("0", "1"), environ) != "0"


def flash_longest_first(environ=None) -> bool:
    """JITKERN_FLASH_LONGEST_FIRST (default 1): the flash prefill grid longest tiles first; 0 shortest first."""
    return env_choice("JITKERN_FLASH_LONGEST_FIRST", ("0", "1"), environ) != "0"


def fast_exp(environ=None) -> bool:
    """JITKERN_FAST_EXP (default 1): jk.exp_fast as the GPU's hardware exponential; 0: exp's polynomial."""
    return env_choice("JITKERN_FAST_EXP", ("0", "1"), environ) != "0"


def ldmatrix_trans(environ=None) -> bool:
    """JITKERN_LDMATRIX_TRANS (default 1): (k, n) MMA B operands staged in row order, read by ldmatrix .trans."""
    return env_choice("JITKERN_LDMATRIX_TRANS", ("0", "1"), environ) != "0"


def flash_warp_rows(environ=None) -> bool:
    """JITKERN_FLASH_WARP_ROWS (default 1): the flash kernels launched with warp-owned rows on CUDA; 0: the tile
    path (same bits)."""
    return env_choice("JITKERN_FLASH_WARP_ROWS", ("0", "1"), environ) != "0"


def flash_fold_skip(environ=None) -> bool:
    """JITKERN_FLASH_FOLD_SKIP (default 1): the flash prefill's partition fold only where a row of the tile needs
    it; 0 folds in every block."""
    return env_choice("JITKERN_FLASH_FOLD_SKIP", ("0", "1"), environ) != "0"


def row_slots(environ=None) -> bool:
    """JITKERN_ROW_SLOTS=1: row vectors broadcast into MMA fragment layouts are written to shared memory where
    they are computed, so one barrier serves several (backends/gpu.py _row_slots; default 0: A/B switch)."""
    return env_choice("JITKERN_ROW_SLOTS", ("0", "1"), environ) == "1"


def pin_regs(environ=None) -> bool:
    """JITKERN_PIN_REGS (default 1): pinned A operands also held in fragment registers across their loop."""
    return env_choice("JITKERN_PIN_REGS", ("0", "1"), environ) != "0"


def pin_operands(environ=None) -> bool:
    """JITKERN_PIN_OPERANDS (default 1): a loop's dots stage an A operand defined outside the loop once, before it
    (backends/gpu.py _pin_analysis; 0 stages it every step: the A/B)."""
    return env_choice("JITKERN_PIN_OPERANDS", ("0", "1"), environ) != "0"


def reduce_direct(environ=None) -> bool:
    """JITKERN_REDUCE_DIRECT (default 1): reductions of at most one element a chunk skip staging their partials
    (backends/gpu.py GpuLowering._reduce_direct); 0 is the two-pass form (A/B switch)."""
    return env_choice("JITKERN_REDUCE_DIRECT", ("0", "1"), environ) != "0"


def frag_ops(environ=None) -> bool:
    """JITKERN_FRAG_OPS=0: elementwise ops on MMA accumulators go through the tile layout (shared memory), as
    before fragment-layout values (backends/gpu.py FragV); an A/B switch, default on."""
    return env_choice("JITKERN_FRAG_OPS", ("0", "1"), environ) != "0"


def wgmma_min_bm(environ=None) -> int:
    v = env_int("JITKERN_WGMMA_MIN_BM", 0, environ)
    return 64 if v is None else v


def env_flag(name: str, environ=None) -> bool:
    """True unless unset, empty or "0"."""
    return (_raw(name, environ) or "0") != "0"


# --------------------------------------------------------------------------------------------- readers
def num_threads(environ=None) -> Optional[int]:
    """JITKERN_NUM_THREADS, or None (then the pool uses the physical core count)."""
    return env_int("JITKERN_NUM_THREADS", 1, environ)


def compile_workers(environ=None, default: int = 1) -> int:
    n = env_int("JITKERN_COMPILE_WORKERS", 1, environ)
    return default if n is None else n


def compile_timeout(environ=None, default: Optional[float] = None) -> Optional[float]:
    t = env_seconds("JITKERN_COMPILE_TIMEOUT", environ)
    return default if t is None else t


def cpu_tier(environ=None) -> Optional[str]:
    """The forced CPU tier name, or None (choose the best runnable)."""
    return _raw("JITKERN_CPU_TIER", environ)


def cache_dir(environ=None) -> Path:
    """The kernel cache root: $JITKERN_CACHE_DIR, else $XDG_CACHE_HOME/jitkern, else ~/.cache/jitkern."""
    env = _environ(environ)
    if env.get("JITKERN_CACHE_DIR"):
        return Path(env["JITKERN_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "jitkern"
    return Path.home() / ".cache" / "jitkern"


# --------------------------------------------------------------------------------------------- checks
def check_cache_dir(environ=None) -> Path:
    """The cache root, created if missing, after proving a file can be written there."""
    root = cache_dir(environ)
    named = _environ(environ).get("JITKERN_CACHE_DIR")
    what = f"JITKERN_CACHE_DIR={named!r}" if named else f"the kernel cache directory {str(root)!r}"
    fix = "set JITKERN_CACHE_DIR to a writable directory"
    if root.exists() and not root.is_dir():
        raise SettingError("JITKERN_CACHE_DIR", f"{what} is not a directory; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        # os.access() says yes to root on a read-only mount: write a file to be sure.
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SettingError("JITKERN_CACHE_DIR", f"{what} is not usable ({e.strerror or e}); {fix}") from None
    return root


def check_cpu_tier(environ=None):
    """The (Target, reason) kernels will run on; JITKERN_CPU_TIER problems become a SettingError."""
    from targets.base import TargetUnavailableError, UnknownTargetError
    from targets.cpu import select_cpu_tier
    forced = cpu_tier(environ)
    try:
        return select_cpu_tier(forced) if forced else select_cpu_tier("")
    except (UnknownTargetError, TargetUnavailableError) as e:
        raise SettingError("JITKERN_CPU_TIER", str(e)) from None


def check_environment(*, tier: bool = True, cache: bool = True, environ=None) -> None:
    """Raise SettingError for the first JITKERN_* setting that cannot be used. Cheap: no model, no compile.

    tier=False skips JITKERN_CPU_TIER (commands that name their target explicitly); cache=False skips
    the cache directory probe (commands that write nothing).
    """
    num_threads(environ)
    env_int("JITKERN_SPIN_US", 0, environ)
    env_int("JITKERN_POLLS_PER_YIELD", 1, environ)
    compile_workers(environ)
    compile_timeout(environ)
    overlap_output(environ)
    spec_backoff("halve", environ)
    cuda_graph_max_tokens(0, environ)
    pool_split("static", environ)
    wgmma(environ)
    wgmma_swizzle(environ)
    wgmma_pipe(environ)
    wgmma_min_bm(environ)
    frag_ops(environ)
    cp_async(environ)
    mma_unroll(environ)
    serial_split_m(environ)
    serial_chain(environ)
    wg_sums(environ)
    serial_maxnreg(environ)
    linear_prefetch(environ)
    linear_l2_prefetch(environ)
    gated_x(environ)
    reduce_one_each(environ)
    flash_fold_skip(environ)
    tma(environ)
    tma_pipe(environ)
    pdl(environ)
    x16_attn(environ)
    flash_partition_blocks(environ)
    flash_step_blocks(1, environ)
    flash_decode_wide(0, environ)
    reduce_direct(environ)
    flash_longest_first(environ)
    flash_decode_pipeline(environ)
    rope_tiles(environ)
    gate_up16(environ)
    gated_linear(environ)
    flash_warp_rows(environ)
    fast_exp(environ)
    ldmatrix_trans(environ)
    row_slots(environ)
    pin_operands(environ)
    pin_regs(environ)
    if tier:
        check_cpu_tier(environ)
    if cache:
        check_cache_dir(environ)

