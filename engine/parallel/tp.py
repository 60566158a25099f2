"""Weights of one tensor-parallel rank, split the way vLLM splits them (Megatron-LM's scheme).

For rank r of N:
- q/k/v (column-parallel, by heads): rank r owns query heads [r*H/N, (r+1)*H/N). KV heads are split the same
  way when KVH >= N (KVH % N == 0); when there are fewer KV heads than ranks (N % KVH == 0) each KV head is
  replicated on N/KVH ranks and rank r holds KV head r // (N/KVH), the one its query heads attend with.
  The KV cache of the rank then holds only those KV heads.
- o (row-parallel): the columns of rank r's query heads; each rank's output is a partial sum that an
  all-reduce adds. A bias is kept on rank 0 only (added once).
- gate/up (column-parallel): rows [r*I/N, (r+1)*I/N) of gate and of up; down (row-parallel): those columns,
  all-reduce after it.
- embedding (vocabulary-parallel): rank r owns rows [v0, v1) of the table; a token outside gets a zero row,
  and the all-reduce adds exactly one non-zero row per token (so the embedding is exact).
- LM head (vocabulary-parallel): rank r computes its vocabulary slice of the logits; an all-gather
  concatenates them in rank order.

Supported so far: dense f32 / f16 / bf16 weights of the dense decoder (Llama, Mistral, Qwen2/3, Gemma,
Granite, Phi-3, OLMo 2, GPT-2). Refused by name: GGUF-quantised or FP8 weights, mixed-type fused groups,
mixture-of-experts layers, full-width q/k norms (OLMoE).
"""
from __future__ import annotations

import numpy as np

from engine.errors import ModelLoadError
from engine.models.weights import Linear, StackedLinear


class ShardingError(ModelLoadError):
    """A model that cannot be split over the ranks asked for (names the reason)."""


def _split(n: int, world: int, rank: int) -> tuple:
    per = n // world
    return rank * per, (rank + 1) * per


def vocab_range(vocab: int, world: int, rank: int) -> tuple:
    """[v0, v1) of rank r: ceil(V/N) rows each, the last rank the remainder (vLLM pads instead; the CPU
    all-gather takes uneven slices)."""
    per = -(-vocab // world)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def head_plan(H: int, KVH: int, world: int, rank: int) -> dict:
    """Which query heads and KV heads rank r holds."""
    if H % world:
        raise ShardingError(f"tensor_parallel_size={world} does not divide the {H} attention heads",
                            key="tensor_parallel_size")
    if KVH % world and world % KVH:
        raise ShardingError(f"tensor_parallel_size={world} and the {KVH} KV heads: one must divide the other",
                            key="tensor_parallel_size")
    q0, q1 = _split(H, world, rank)
    if KVH >= world:
        k0, k1 = _split(KVH, world, rank)
    else:
        k0 = rank // (world // KVH)
        k1 = k0 + 1
    # the rank's query heads must all attend with its KV heads (GQA groups are contiguous)
    group = H // KVH
    if not (q0 // group >= k0 and (q1 - 1) // group < k1):
        raise ShardingError(f"query heads {q0}..{q1 - 1} of rank {rank} do not map onto its KV heads {k0}..{k1 - 1}",
                            key="tensor_parallel_size")
    return {"q": (q0, q1), "kv": (k0, k1), "replicas": max(1, world // KVH)}


def _dense(lin, what: str):
    if isinstance(lin, StackedLinear) or type(lin) is not Linear or lin.kind not in ("f32", "f16", "bf16"):
        raise ShardingError(f"tensor parallelism shards dense f32/f16/bf16 weights only so far; {what} is "
                            f"{lin.kind} ({lin.name})", tensor=lin.name)
    if not isinstance(lin.weight, np.ndarray):
        raise ShardingError("shard the host weights before they are uploaded to a device", tensor=lin.name)
    return lin.weight


def _rows(lin: Linear, idx: np.ndarray, what: str) -> Linear:
    w = _dense(lin, what)
    b = None if lin.bias is None else np.ascontiguousarray(lin.bias[idx])
    sw = np.ascontiguousarray(w[idx])
    return Linear(sw, lin.kind, sw.shape[0], sw.shape[1], b, f"{lin.name}[tp rows]")


def _cols(lin: Linear, c0: int, c1: int, keep_bias: bool, what: str) -> Linear:
    w = _dense(lin, what)
    sw = np.ascontiguousarray(w[:, c0:c1])
    return Linear(sw, lin.kind, sw.shape[0], sw.shape[1], lin.bias if keep_bias else None, f"{lin.name}[tp cols]")


class VocabParallelHead:
    """The LM head of one rank: its vocabulary slice of the logits, then an all-gather into the full row."""

    def __init__(self, lin: Linear, v0: int, v1: int, comm):
        self.lin = _rows(lin, np.arange(v0, v1), "the LM head")
        self.v0, self.v1, self.comm = v0, v1, comm
        self.n, self.k = lin.n, lin.k
        self._buf = None

    def __call__(self, x, out=None):
        rows = x.shape[0]
        if out is None:
            out = np.empty((rows, self.n), np.float32)
        if self._buf is None or self._buf.shape[0] < rows or type(self._buf) is not type(x):
            from engine.ops._hostargs import empty_like_dev
            self._buf = empty_like_dev(x, (max(rows, 16), self.lin.n), np.float32)
        local = self._buf[:rows]
        self.lin(x, out=local)
        self.comm.all_gather(local, out)
        return out


class TPShard:
    """What DecoderLM.forward consults when the model is one rank's shard (`model.tp`)."""

    def __init__(self, comm, vocab: int):
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.v0, self.v1 = vocab_range(vocab, self.world, self.rank)
        self.lm_head = None
        self._ids = None

    def local_ids(self, ids):
        """Token ids as rows of this rank's embedding slice; ids outside it read the appended zero row (a
        kernel: runs on device ids; the output buffer keeps its address while it is large enough)."""
        from engine.ops._hostargs import empty_like_dev
        from engine.ops.parallel import vocab_local_ids
        n = ids.shape[0]
        if self._ids is None or self._ids.shape[0] < n or type(self._ids) is not type(ids):
            self._ids = empty_like_dev(ids, (max(n, 256),), np.int32)
        return vocab_local_ids(ids, self.v0, self.v1, out=self._ids[:n])

    def all_reduce(self, x) -> None:
        self.comm.all_reduce(x)


def shard_model(model, comm, device: str = "cpu") -> object:
    """Turns a freshly loaded host DecoderLM (built with device="cpu") into rank `comm.rank`'s shard of
    `comm.world`, in place; then uploads the shard's weights when `device` is a GPU kind (only the rank's
    slices ever reach its device)."""
    rank, world = comm.rank, comm.world
    if model.device != "cpu":
        raise ShardingError("shard the host weights before they are uploaded to a device (build with device='cpu')")
    if model.moe_spec is not None:
        raise ShardingError("tensor parallelism for mixture-of-experts layers is not written yet",
                            key="tensor_parallel_size")
    if model.embed_table is None:
        raise ShardingError(f"tensor parallelism shards float embeddings only so far (this one is "
                            f"{model.embed.dtype})", tensor=model.embed.name)
    H, KVH, D = model.H, model.KVH, model.D
    plan = head_plan(H, KVH, world, rank)
    (q0, q1), (k0, k1) = plan["q"], plan["kv"]
    qkv_rows = np.concatenate([np.arange(q0 * D, q1 * D), H * D + np.arange(k0 * D, k1 * D),
                               (H + KVH) * D + np.arange(k0 * D, k1 * D)])
    for i, L in enumerate(model.layers):
        if L.q_norm is not None and L.q_norm.shape[0] != D:
            raise ShardingError("full-width q/k norms (OLMoE) are not split by heads yet", key="tensor_parallel_size")
        L.qkv = _rows(L.qkv, qkv_rows, f"layer {i} q/k/v")
        L.o = _cols(L.o, q0 * D, q1 * D, rank == 0, f"layer {i} o")
        if L.sinks is not None:
            L.sinks = np.ascontiguousarray(L.sinks[q0:q1])
        if L.gate_up is not None:
            inter = L.gate_up.n // 2
            if inter % world:
                raise ShardingError(f"tensor_parallel_size={world} does not divide the MLP width {inter}",
                                    key="tensor_parallel_size")
            i0, i1 = _split(inter, world, rank)
            L.gate_up = _rows(L.gate_up, np.concatenate([np.arange(i0, i1), inter + np.arange(i0, i1)]),
                              f"layer {i} gate/up")
        else:
            inter = L.up.n
            if inter % world:
                raise ShardingError(f"tensor_parallel_size={world} does not divide the MLP width {inter}",
                                    key="tensor_parallel_size")
            i0, i1 = _split(inter, world, rank)
            L.up = _rows(L.up, np.arange(i0, i1), f"layer {i} up")
        L.down = _cols(L.down, i0, i1, rank == 0, f"layer {i} down")
    tp = TPShard(comm, model.vocab)
    table = model.embed_table
    zero = np.zeros((1, table.shape[1]), table.dtype)
    model.embed_table = np.ascontiguousarray(np.concatenate([table[tp.v0:tp.v1], zero]))
    tp.lm_head = VocabParallelHead(model.lm_head, tp.v0, tp.v1, comm)
    model.H, model.KVH = q1 - q0, k1 - k0
    model.tp = tp
    # a recorded graph would replay the kernels without the host-side collectives between them
    model.supports_graphs = False
    model.lm_head = tp.lm_head.lin           # the rank's vocabulary slice (what gets uploaded)
    if device != "cpu":
        model.device = device
        model._to_device()
    return model
