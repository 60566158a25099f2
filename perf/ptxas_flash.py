"""Registers, spills, CTA barriers and lane shuffles (ptxas -v, sm_90a) of the flash prefill / decode kernels at the
engine's Llama-3-8B constants (f16 cache, 16-bit operands), per tile setting. Needs ptxas, not a GPU.

    python3 perf/ptxas_flash.py prefill:8:16:1 prefill:4:8:0 prefill:8:16:1:SB=2 decode:2:1
        (kernel:warps:BM (prefill; decode: omitted):warp_rows 0/1[:CONST=VALUE ...])
The lowering's choices are sm_90a's tuning table (targets/tuning.py), as in the engine.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ptxas_regs import DECODE_SIG  # noqa: E402  (the decode kernel's signature, {c}: the cache dtype)


def main(argv) -> int:
    from jitkern.backends.nvptx import find_ptxas
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    from test_gpu_registers import FLASH_COMMON, FLASH_PREFILL_SIG
    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas (the [cuda] extra or /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    if not argv:
        print(__doc__)
        return 2
    for spec in argv:
        parts = spec.split(":")
        kind = parts[0]
        if kind == "prefill":
            w, bm, wr, extra = parts[1], parts[2], parts[3], parts[4:]
            k = load_kernel("engine.ops.attention:flash_prefill_kernel")
            sig = FLASH_PREFILL_SIG
            consts = [f"num_warps={w}", "GP=4", f"BM={bm}", "SKIP_DECODE=True", "FOLD_SKIP=True", "LONGEST_FIRST=True"]
        elif kind == "decode":
            w, wr, extra = parts[1], parts[2], parts[3:]
            k = load_kernel("engine.ops.attention:flash_decode_kernel")
            sig = DECODE_SIG.format(c="f16")
            consts = [f"num_warps={w}", "R=16", "NUM_PARTS=16", "PIPE=False"]
        else:
            print(f"unknown kernel {kind!r} in {spec!r}: prefill or decode", file=sys.stderr)
            return 2
        names = {c.split("=")[0] for c in consts + extra}
        common = [c for c in FLASH_COMMON if c.split("=")[0] not in names]
        params, cx = parse_sig(k, sig, common + consts + extra + (["warp_rows=True"] if wr == "1" else []))
        ptx = compile_kernel(k, params, cx, get_target("sm_90a"), load=False).artifacts["kernel.ptx"].decode()
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
        m = re.search(r"Used (\d+) registers", r.stderr)
        s = re.search(r"(\d+) bytes spill stores", r.stderr)
        print(f"{spec}: registers {m and m.group(1)}, spill stores {s and s.group(1)} B, "
              f"bar.sync {len(re.findall(r'bar(rier)?.sync', ptx))}, shfl {ptx.count('shfl.sync')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
