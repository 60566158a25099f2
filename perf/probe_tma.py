"""Probe of Hopper's tensor memory accelerator (TMA, sm_90a) before the linear's K loop is fed by it (issue 8).

    python3 perf/probe_tma.py                  # on the H200: every case below, one line each + a verdict
    python3 perf/probe_tma.py --ptxas-only     # anywhere with ptxas: generate and assemble the kernel only
    python3 perf/probe_tma.py --self-check     # anywhere: the host-side swizzle model against probe_wgmma's

Why: the cp.async linear (backends/nvidia/staging.py) has every thread compute and issue 8-byte copies (16 per
thread per K step on the (128, 128, 64, 8) tile) and covers one K step of memory latency; on the H200 it stays
well below cuBLAS at M >= 256. With TMA one thread issues one bulk copy per tile
and an mbarrier counts the bytes in. What this settles, on fresh random bf16 data (never zeros):
1. The tensor map: `cuTensorMapEncodeTiled` (jitkern.runtime.cuda.tensor_map_2d) of a row-major (rows, K) bf16
   matrix, box (64 elements of K = 128 bytes, BR rows), 128-byte swizzle, kept in global memory (the kernel takes
   its address).
2. The shared-memory image one `cp.async.bulk.tensor.2d` writes, completed through an mbarrier
   (`mbarrier.arrive.expect_tx` + `try_wait.parity`): it must equal probe_wgmma.pack_sw128 of the box, the
   layout the wgmma linear's staging already uses (nvidia/staging.py _core_elem: row r at r * 128 bytes, 16-byte chunk
   c at chunk c ^ (r % 8), 1024-byte aligned) - then TMA can write the warpgroup MMAs' operands in place.
3. Boxes past the matrix's last row (a tile's masked tokens) read as zeros (the out-of-bounds fill).
4. Two boxes on one mbarrier (x and w tiles of one K step) and a second phase of the same barrier (the next
   step), as a K loop would use them.

The kernel is PTX text generated here, assembled by ptxas (jitkern.backends.nvptx.ptx_to_cubin) and launched
through jitkern's CUDA runtime: one CTA of 128 threads; thread 0 initialises the barrier, arms it with the
expected bytes and issues the copies; every thread waits on the barrier's phase, then the CTA copies its shared
memory out byte for byte.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BOX_K = 64                  # elements of K per box: 128 bytes of bf16, one 128-byte swizzle atom


def sw128_image(box: np.ndarray) -> bytes:
    """The 128-byte swizzle image of a (BR, 64) bf16 box: row r at r * 128 bytes, 16-byte chunk c at c ^ (r % 8)."""
    rows, k = box.shape
    assert k == BOX_K
    out = np.zeros(rows * k, np.uint16)
    for r in range(rows):
        for c in range(8):
            dst = (r * 128 + (c ^ (r % 8)) * 16) // 2
            out[dst:dst + 8] = box[r, c * 8:c * 8 + 8]
    return out.tobytes()


def self_check() -> int:
    """sw128_image equals probe_wgmma.pack_sw128 (the layout the wgmma probe validated on the H200) for one atom."""
    from perf.probe_wgmma import pack_sw128
    rng = np.random.default_rng(7)
    for rows in (8, 64, 128):
        box = rng.integers(1, 1 << 15, (rows, BOX_K), dtype=np.uint16)
        if sw128_image(box) != pack_sw128(box):
            print(f"self-check: rows={rows} differs from probe_wgmma.pack_sw128")
            return 1
    print("self-check: the TMA 128-byte swizzle model is probe_wgmma's sw128 layout (one 64-element atom)")
    return 0


def tma_ptx(name: str, boxes: list, phases: int) -> str:
    """One CTA of 128 threads. boxes: [(tensor-map param index, shared byte offset, box bytes)] issued together
    on one mbarrier; `phases` times (phase p uses coordinates row0 + p * BR from the params). Then the whole
    shared window (every box of the last phase) is copied to out."""
    total = max(off + nb for _, off, nb in boxes)
    tx = sum(nb for _, _, nb in boxes)
    nmaps = max(i for i, _, _ in boxes) + 1
    L = [".version 8.0", ".target sm_90a", ".address_size 64", "",
         ".extern .shared .align 1024 .b8 jk_smem[];", ".shared .align 8 .b64 jk_bar;", ""]
    params = [f".param .u64 p_map{i}" for i in range(nmaps)] + [".param .u64 p_out", ".param .u64 p_k0",
                                                                ".param .u64 p_row0", ".param .u64 p_step"]
    L += [f".visible .entry {name}(" + ", ".join(params) + ")", "{",
          "  .reg .pred p0, pw;", "  .reg .b32 t, s, bar, k0, r0, st, rr, off, c<4>, ph;",
          "  .reg .b64 m<%d>, out, g, tmp, st64;" % nmaps]
    for i in range(nmaps):
        L.append(f"  ld.param.u64 m{i}, [p_map{i}];")
    L += ["  ld.param.u64 out, [p_out];",
          "  ld.param.u64 tmp, [p_k0];", "  cvt.u32.u64 k0, tmp;",
          "  ld.param.u64 tmp, [p_row0];", "  cvt.u32.u64 r0, tmp;",
          "  ld.param.u64 tmp, [p_step];", "  cvt.u32.u64 st, tmp;",
          "  mov.u32 t, %tid.x;", "  mov.u32 s, jk_smem;", "  mov.u32 bar, jk_bar;",
          "  setp.eq.u32 p0, t, 0;",
          "  @p0 mbarrier.init.shared::cta.b64 [bar], 1;",
          # the barrier's initialisation is visible to the async proxy (the TMA unit) before any copy uses it
          "  fence.mbarrier_init.release.cluster;", "  fence.proxy.async.shared::cta;",
          "  bar.sync 0;"]
    for p in range(phases):
        L += [f"  // phase {p}", f"  mad.lo.u32 rr, st, {p}, r0;",
              f"  @p0 mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], {tx};"]
        for i, off, _ in boxes:
            L += [f"  add.u32 off, s, {off};",
                  f"  @p0 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                  f"[off], [m{i}, {{k0, rr}}], [bar];"]
        L += [f"  mov.u32 ph, {p % 2};",
              f"WAIT{p}:", "  mbarrier.try_wait.parity.shared::cta.b64 pw, [bar], ph;",
              f"  @!pw bra WAIT{p};", "  bar.sync 0;"]
    for c in range(-(-total // (16 * 128))):
        L += ["  {", "  .reg .pred in;", f"  mad.lo.u32 off, t, 16, {c * 16 * 128};",
              f"  setp.lt.u32 in, off, {total};",
              "  add.u32 c0, s, off;",
              "  @in ld.shared.v4.u32 {c1, c2, c3, ph}, [c0];",
              "  cvt.u64.u32 g, off;", "  add.s64 g, g, out;",
              "  @in st.global.v4.u32 [g], {c1, c2, c3, ph};", "  }"]
    L += ["  ret;", "}", ""]
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ptxas-only", action="store_true", help="generate and assemble the kernel, run nothing")
    ap.add_argument("--self-check", action="store_true", help="check the host-side swizzle model, run nothing")
    args = ap.parse_args()
    if args.self_check:
        return self_check()
    from jitkern.backends.nvptx import ptx_to_cubin
    rng = np.random.default_rng(2026)
    # (case, box rows of x / of w, x rows in the matrix, w rows, K, x's first row, phases)
    cases = [("one box, 64 rows", 64, None, 256, 0, 512, 64, 1),
             ("one box, 128 rows", 128, None, 256, 0, 512, 128, 1),
             ("x past its last row (zero fill)", 128, None, 150, 0, 512, 64, 1),
             ("x and w on one barrier, two phases", 128, 128, 256, 512, 1024, 0, 2)]
    ok = True
    dev = None
    if not args.ptxas_only:
        from jitkern.runtime import cuda as jc
        dev = jc.get_device()
    for label, bx, bw, xrows, wrows, K, row0, phases in cases:
        boxes = [(0, 0, bx * 128)] + ([(1, -(-bx * 128 // 1024) * 1024, bw * 128)] if bw else [])
        name = "tma_probe_" + "".join(ch for ch in label if ch.isalnum())[:24]
        ptx = tma_ptx(name, boxes, phases)
        cubin = ptx_to_cubin(ptx.encode(), "sm_90a", describe=name)
        if args.ptxas_only:
            print(f"{label}: PTX {len(ptx)} bytes, cubin {len(cubin)} bytes")
            continue
        total = max(off + nb for _, off, nb in boxes)
        x = rng.integers(1, 1 << 15, (xrows, K), dtype=np.uint16)      # nonzero bf16 bit patterns
        w = rng.integers(1, 1 << 15, (max(wrows, 1), K), dtype=np.uint16)
        xd, wd = jc.DeviceArray.from_numpy(x), jc.DeviceArray.from_numpy(w)
        # the runtime's tensor maps (jitkern.runtime.cuda.tensor_map_2d, as the linear's launches make them): in
        # global memory, 64-byte aligned
        mds = [jc.tensor_map_2d(xd.ptr, xrows, K, K * 2, bx, BOX_K, "bf16")] + \
            ([jc.tensor_map_2d(wd.ptr, wrows, K, K * 2, bw, BOX_K, "bf16")] if bw else [])
        assert all(int(m) % 64 == 0 for m in mds)
        out = jc.DeviceArray.from_numpy(np.zeros(total, np.uint8))
        k0, step = 128 if K > 128 else 0, (bx if phases > 1 else 0)
        fn = dev.load_function(cubin, name, total + 1024)[1]
        dev.launch(fn, (1, 1, 1), 128, total + 1024,
                   np.array([int(m) for m in mds] + [out.ptr, k0, row0, step], np.uint64))
        dev.synchronize()
        got = out.numpy().tobytes()
        p = phases - 1
        r = row0 + p * step

        def box_of(mat, nrows, br, r_):
            b = np.zeros((br, BOX_K), np.uint16)
            have = max(0, min(br, nrows - r_))
            b[:have] = mat[r_:r_ + have, k0:k0 + BOX_K]
            return b
        want = bytearray(total)
        xi = sw128_image(box_of(x, xrows, bx, r))
        want[0:len(xi)] = xi
        if bw:
            wi = sw128_image(box_of(w, wrows, bw, p * step))
            want[boxes[1][1]:boxes[1][1] + len(wi)] = wi
        good = got == bytes(want)
        if not good:
            # where the bytes went: is it the unswizzled box (no swizzle applied)?
            plain = box_of(x, xrows, bx, r).tobytes()
            hint = "the box unswizzled" if got[:len(plain)] == plain else "neither model"
            print(f"{label}: MISMATCH (first {bx} rows look like {hint})")
        else:
            print(f"{label}: shared image = the wgmma staging's 128-byte swizzle layout ({total} bytes)")
        ok &= good
    if not args.ptxas_only:
        print("verdict: TMA writes the wgmma staging layout in place" if ok else
              "verdict: NOT the staging layout (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
