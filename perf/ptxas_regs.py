"""Registers and spills (ptxas -v) of the engine's big NVIDIA kernels: the tensor-core linear's tiles and the
flash attention kernels. Needs ptxas, not a GPU.

    python3 perf/ptxas_regs.py [--arch sm_90a] [--maxnreg 168] [--16bit] [--wgmma] [--tiles 64,256,32,4 ...]

--wgmma: the linear tiles with the `wgmma` launch option (warpgroup MMAs; staging as the target's tuning table
says: targets/tuning.py wgmma_swizzle / wgmma_pipe).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LINEAR_SIG = ("x=*f32:16,w=*bf16:16,bias=*f32:16,y=*f32:16,M=i32,N=i32:16,K=i32:16,ldx=i32:16,ldy=i32:16,"
              "xmap=i64,wmap=i64")
DECODE_SIG = ("q=*f32:16,k_cache=*{c}:16,v_cache=*{c}:16,out=*f32:16,ws_m=*f32:16,ws_l=*f32:16,ws_acc=*f32:16,"
              "query_start=*i32:16,seq_lens=*i32,block_table=*i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
              "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
PREFILL_SIG = ("q=*f32:16,k_cache=*{c}:16,v_cache=*{c}:16,out=*f32:16,query_start=*i32:16,seq_lens=*i32,"
               "block_table=*i32,num_seqs=i32,search_steps=i32,q_ts=i32:16,q_hs=i32:16,o_ts=i32:16,o_hs=i32:16,"
               "bt_stride=i32,scale=f32,window=i32:16,softcap=f32,sinks=*f32:16")
_FLASH = ["PB=4", "MAXP=16", "SOFTCAP=False", "SINKS=False", "SPLIT=True", "PIPE=True", "BS=16"]


LINEAR_TILES = ((16, 64, 128, 4), (32, 64, 64, 4), (32, 128, 64, 4), (64, 256, 64, 8))


def cases(tiles=LINEAR_TILES, flash=True):
    for bm, bn, bk, nw in tiles:
        yield (f"linear ({bm},{bn},{bk},{nw},2)", "engine.ops.matmul:_gpu_linear_mma_kernel", LINEAR_SIG,
               ["HAS_BIAS=False", f"BM={bm}", f"BN={bn}", f"BK={bk}", "EVEN=True", "SPLIT=2", f"num_warps={nw}"])
    for c, kvh, g, d in (("f32", 3, 3, 64), ("f16", 8, 4, 128)) if flash else ():
        yield (f"flash decode {c} cache D={d}", "engine.ops.attention:flash_decode_kernel", DECODE_SIG.format(c=c),
               ["num_warps=4", f"KVH={kvh}", f"G={g}", "R=16", f"D={d}", "NUM_PARTS=16"] + _FLASH)
        yield (f"flash prefill 64 rows {c} D={d}", "engine.ops.attention:flash_prefill_kernel",
               PREFILL_SIG.format(c=c),
               ["num_warps=8", f"KVH={kvh}", f"G={g}", "GP=4", "BM=16", f"D={d}", "SKIP_DECODE=True"] + _FLASH)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--maxnreg", type=int, default=None, help="compile with this `maxnreg` launch option")
    ap.add_argument("--16bit", dest="sixteen", action="store_true",
                    help="16-bit matrix-unit inputs (the engine's dtype auto): ACT16=1 / OPS16=True")
    ap.add_argument("--wgmma", action="store_true", help="the linear tiles as warpgroup MMAs (sm_90a)")
    ap.add_argument("--tiles", nargs="*", default=None, metavar="BM,BN,BK,WARPS",
                    help="only these linear tiles (no flash kernels), e.g. 64,256,32,4")
    args = ap.parse_args(argv)
    from jitkern.backends.nvptx import find_ptxas
    from jitkern.cli import load_kernel, parse_sig
    from jitkern.compiler import compile_kernel
    from targets import get_target
    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas (install the [cuda] extra or set JITKERN_PTXAS)")
        return 1
    t = get_target(args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        todo = cases(tuple(tuple(int(v) for v in t.split(",")) for t in args.tiles), flash=False) \
            if args.tiles else cases()
        for name, kname, sig, consts in todo:
            if args.maxnreg:
                consts = consts + [f"maxnreg={args.maxnreg}"]
            if args.wgmma and name.startswith("linear"):
                consts = consts + ["wgmma=1"]
            if args.sixteen:
                consts = consts + (["ACT16=1"] if name.startswith("linear") else ["OPS16=True"])
            k = load_kernel(kname)
            params, cx = parse_sig(k, sig, consts)
            ptx = compile_kernel(k, params, cx, t, load=False).artifacts["kernel.ptx"]
            src = os.path.join(tmp, "k.ptx")
            with open(src, "wb") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, f"-arch={args.arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                               capture_output=True, text=True, timeout=600)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
            if r.returncode or not regs or not sp:
                print(f"{name:34s} ptxas failed: {r.stderr.strip()[-300:]}")
                continue
            print(f"{name:34s} {int(regs.group(1)):4d} registers, spill stores/loads {sp.group(1)}/{sp.group(2)} B",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
