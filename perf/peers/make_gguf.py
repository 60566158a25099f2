"""GGUF test files for the llama.cpp peer (perf/peers/llama_cpp_cuda.py) where a real file cannot be carried.

    python perf/peers/make_gguf.py --truncate SRC.gguf --layers 8 OUT.gguf
    python perf/peers/make_gguf.py --random-llama --shape llama3-8b --outtype f16 [--layers 32] OUT.gguf
    python perf/peers/make_gguf.py --random-llama --shape llama3-8b --outtype Q4_K_M OUT.gguf [--llama-dir DIR]

--truncate keeps the first --layers blocks of a GGUF file (every metadata key copied, {arch}.block_count set to
N, the tensors of later blocks dropped; the tensors are copied byte for byte, whatever their type).

--random-llama writes a Llama-architecture file with random weights (normal, std 0.02; norms 1) of a named
shape, streamed one tensor at a time (the 8B shape in f16 is 16 GB: nothing but the current tensor is held in
memory). gguf-py quantises f32, f16, bf16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 itself (2-D weights; norms stay f32).
Other types (K-quants such as Q4_K_M, Q6_K, IQ4_XS) are llama.cpp's llama-quantize presets: the file is written
as f16 first, then converted by the llama-quantize that `llama_cpp_cuda.py build` put under --llama-dir, and the
f16 file is deleted. The vocabulary is byte-level BPE: the 256 byte tokens (any text tokenizes), filler tokens
up to the shape's vocabulary size, and one end-of-text token, so llama.cpp and our engine both load it.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

# name: (vocab, hidden, layers, heads, kv heads, ffn, rope theta, context, tied embeddings)
SHAPES = {
    "llama3-8b": (128256, 4096, 32, 32, 8, 14336, 500000.0, 8192, False),
    "smollm2-135m": (49152, 576, 30, 9, 3, 1536, 100000.0, 8192, True),
}
PY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _die(msg: str):
    raise SystemExit(f"make_gguf.py: {msg}")


# ------------------------------------------------------------------------------------------------ truncate
def truncate(src: str, layers: int, out: str) -> None:
    import gguf
    r = gguf.GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    have = r.fields[key].contents()
    if not 0 < layers <= have:
        _die(f"--layers {layers}: {src} has {have} blocks")
    w = gguf.GGUFWriter(out, arch, endianess=r.endianess)
    for f in r.fields.values():
        # the writer writes the architecture and the GGUF.* header fields itself
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, layers if f.name == key else f.contents(), vt, sub_type=sub)
    blk = re.compile(r"blk\.(\d+)\.")
    keep = [t for t in r.tensors if not (m := blk.match(t.name)) or int(m.group(1)) < layers]
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    print(f"{out}: {layers} of {have} blocks, {len(keep)} of {len(r.tensors)} tensors, "
          f"{os.path.getsize(out) / 2**20:.1f} MiB")


# ------------------------------------------------------------------------------------------- random llama
def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _tensor_specs(shape: str, layers: int):
    V, H, _, nh, nkv, F, *_, tied = SHAPES[shape]
    D = H // nh
    specs = [("token_embd.weight", (V, H))]
    for i in range(layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (H,)), (p + "attn_q.weight", (nh * D, H)),
                  (p + "attn_k.weight", (nkv * D, H)), (p + "attn_v.weight", (nkv * D, H)),
                  (p + "attn_output.weight", (H, nh * D)), (p + "ffn_norm.weight", (H,)),
                  (p + "ffn_gate.weight", (F, H)), (p + "ffn_up.weight", (F, H)), (p + "ffn_down.weight", (H, F))]
    specs.append(("output_norm.weight", (H,)))
    if not tied:
        specs.append(("output.weight", (V, H)))
    return specs


def random_llama(shape: str, outtype: str, out: str, layers: int | None, seed: int) -> None:
    import gguf
    from gguf.quants import quant_shape_to_byte_shape, quantize
    V, H, L, nh, nkv, F, theta, ctx, _ = SHAPES[shape]
    L = layers or L
    qt = gguf.GGMLQuantizationType[outtype]
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random {shape}")
    w.add_block_count(L)
    w.add_context_length(ctx)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(H // nh)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
                     "BF16": 32}[outtype])
    tokens = _byte_tokens() + ["Ġt"]
    tokens += [f"<r{i}>" for i in range(V - len(tokens) - 1)] + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (V - 1) + [3])          # the last one is a control token
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(V - 1)
    w.add_eos_token_id(V - 1)
    w.add_add_bos_token(False)
    specs = _tensor_specs(shape, L)
    for name, shp in specs:
        t = qt if len(shp) == 2 else gguf.GGMLQuantizationType.F32
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor_info(name, shp, np.dtype(np.float16), int(np.prod(shp)) * 2)
        else:
            bshape = quant_shape_to_byte_shape(shp, t)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i, (name, shp) in enumerate(specs):
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
            continue
        a = rng.standard_normal(shp, dtype=np.float32)
        a *= 0.02
        if qt == gguf.GGMLQuantizationType.F16:
            a = a.astype(np.float16)
        elif qt != gguf.GGMLQuantizationType.F32:
            a = quantize(a, qt)
        w.write_tensor_data(a)
        if time.perf_counter() - t0 > 10 and i % 9 == 0:
            print(f"  {i + 1}/{len(specs)} tensors, {time.perf_counter() - t0:.0f} s", flush=True)
    w.close()
    print(f"{out}: random {shape}, {L} layers, {outtype}, {os.path.getsize(out) / 2**20:.1f} MiB "
          f"in {time.perf_counter() - t0:.0f} s")


def quantize_exe(llama_dir: str, qtype: str) -> str:
    exe = os.path.join(llama_dir, "build", "bin", "llama-quantize")
    if not os.access(exe, os.X_OK):
        _die(f"{exe} not found: {qtype} needs llama.cpp's llama-quantize (perf/peers/llama_cpp_cuda.py build)")
    return exe


def llama_quantize(exe: str, src: str, out: str, qtype: str) -> None:
    cmd = [exe, src, out, qtype]
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-4000:])
        _die(f"llama-quantize exited with {p.returncode}")
    print(f"{out}: {qtype}, {os.path.getsize(out) / 2**20:.1f} MiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--truncate", metavar="SRC", help="a GGUF file to keep the first --layers blocks of")
    mode.add_argument("--random-llama", action="store_true", help="a random-weights Llama file of --shape")
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--layers", type=int, default=None, help="blocks to keep / write (default: the shape's)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--outtype", default="f16",
                    help=f"{', '.join(t.lower() for t in PY_TYPES)} (gguf-py), or a llama-quantize preset "
                         "(Q4_K_M, Q6_K, IQ4_XS, ...: needs --llama-dir)")
    ap.add_argument("--llama-dir", default="/tmp/llama-cpp-cuda", help="where llama_cpp_cuda.py build put llama.cpp")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if os.path.abspath(a.out) == os.path.abspath(a.truncate or ""):
        _die("OUT must differ from SRC")
    if a.truncate:
        if a.layers is None:
            _die("--truncate needs --layers N")
        truncate(a.truncate, a.layers, a.out)
        return 0
    t = a.outtype.upper()
    if t in PY_TYPES:
        random_llama(a.shape, t, a.out, a.layers, a.seed)
        return 0
    exe = quantize_exe(a.llama_dir, a.outtype)         # before writing a multi-GB f16 file
    tmp = a.out + ".f16.part"
    try:
        random_llama(a.shape, "F16", tmp, a.layers, a.seed)
        llama_quantize(exe, tmp, a.out, a.outtype)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
