"""Kernel launches per decode step (and which kernels), recorded graph nodes, and decode steps/s for one model.

    python perf/count_step_kernels.py [--model GGUF_OR_DIR] [--random SHAPE [--layers N] [--smoke]]
        [--device cpu|cuda|vulkan|fake-cuda] [--batch 1 16] [--steps 32] [--prompt-len 16] [--json out.json]

Default model: the embedded SmolLM2-135M Q4_1 GGUF. --random SHAPE writes a random-weight bf16 checkpoint of
that shape (perf/peers/make_random_model.py: llama3-8b, qwen3-8b, smollm2-135m; --layers keeps the first N
layers; --smoke makes it a tiny model of the same family) into a temporary folder.

Per batch size B: B greedy requests of --prompt-len random token ids run through the engine (LLMEngine) until
all are decoding. Then one decode step runs eagerly with every kernel launch counted by kernel name (a launch
is one `jitkern.runtime.launch` call, on every device: CPU thread-pool dispatch, CUDA kernel, Vulkan dispatch);
then the decode steps replay a recorded graph (the engine's normal path) and the graph's node count is read
(CPU: its entries; CUDA: the launches recorded into the CUDA graph; Vulkan: its dispatches). Timed: --steps
decode steps of the engine (LLMEngine.step: scheduling + forward + sampling), and the forward alone
(ModelRunner.execute); steps/s = 1 / median step time. --compare alternates DecoderLM.fuse_decode on and off
(--rounds turns of --steps steps each, graphs re-recorded at each switch) in one run, so host load hits both
alike; --unfused measures the separate ops alone.

--device fake-cuda runs the CUDA code path (device arrays, staging, the wrappers' GPU choices when
JITKERN_FAKE_CUDA_TARGET=sm_90a is also set) on the host-memory stand-in device of tests/fake_cuda.py: the
launch count is the CUDA path's, the times are meaningless.

The per-layer breakdown: a kernel launched c times per step counts c // layers times per layer; the
remainder c % layers is listed outside the layers (embedding, final norm, LM head, sampling).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LaunchCounter:
    """Counts `jitkern.runtime.launch.resolve` calls (one per launch on every device) by kernel name while on."""

    def __init__(self):
        from jitkern.runtime import launch as launch_mod
        self.mod = launch_mod
        self.orig = launch_mod.resolve
        self.on = False
        self.names: list = []

        self.by_address: dict = {}            # compiled CPU code address -> kernel name (names graph entries)

        def counting_resolve(kernel, args, kwargs, target=None):
            if self.on:
                self.names.append(kernel.__name__)
            r = self.orig(kernel, args, kwargs, target)
            addr = getattr(r[0], "address", None)
            if addr is not None:
                self.by_address[addr] = kernel.__name__
            return r

        launch_mod.resolve = counting_resolve

    def close(self):
        self.mod.resolve = self.orig


def _graph_nodes(g) -> int:
    n = len(g.entries)
    if getattr(g, "cuda", None) is not None:
        n += int(getattr(g.cuda, "nodes", 0))
    if getattr(g, "vulkan", None) is not None:
        n += len(g.vulkan)
    return n


def _install_fake_cuda():
    import pytest
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from tests import fake_cuda
    mp = pytest.MonkeyPatch()
    fake_cuda.install(mp)
    return mp


def measure(model_path, device, batches, steps, prompt_len, seed=0, use_graphs=True, fused=True, compare=False,
            rounds=3):
    import numpy as np

    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    maxb = max(batches)
    turns = 2 * rounds if compare else 1
    max_len = prompt_len + (steps + 8) * turns + 32        # every timed step must still have work to do
    eng = LLMEngine(EngineArgs(model=model_path, device=device, num_blocks=maxb * (max_len // 16 + 2) + 16,
                               block_size=16, max_num_seqs=maxb, max_num_batched_tokens=max(512, prompt_len * maxb),
                               max_model_len=max_len, use_graphs=use_graphs, enable_prefix_caching=False))
    counter = LaunchCounter()
    runner = eng.runner
    model = runner.model
    layers = len(getattr(model, "layers", ())) or None
    rng = np.random.default_rng(seed)
    vocab = eng.config.vocab_size
    out = {"model": str(model_path or "embedded SmolLM2-135M Q4_1"), "device": device, "layers": layers,
           "arch": getattr(model, "arch", None), "results": []}
    exec_times: list = []
    orig_exec = runner.execute

    def timed_execute(sched):
        t0 = time.perf_counter()
        r = orig_exec(sched)
        exec_times.append(time.perf_counter() - t0)
        return r
    runner.execute = timed_execute
    try:
        for B in batches:
            modes = ["fused", "unfused"] * rounds if compare else ["fused" if fused else "unfused"]
            sp = SamplingParams(max_tokens=(steps + 8) * len(modes) + 8, temperature=0, ignore_eos=True,
                                detokenize=False)
            ids = [f"b{B}-{i}" for i in range(B)]
            for rid in ids:
                eng.add_request(rid, [int(t) for t in rng.integers(3, vocab, prompt_len)], sp.clone())
            for _ in range(64):                      # prefill until every request decodes
                eng.step()
                if all(len(eng._reqs[r].seqs[0].token_ids) >= 1 for r in ids if r in eng._reqs):
                    break
            per_mode: dict = {}
            for mode in modes:                       # compare: fused and unfused steps take turns
                if hasattr(model, "fuse_decode"):
                    model.fuse_decode = mode == "fused"
                runner._graphs.clear()               # graphs record the launches of the current mode
                # one eager step, every launch counted
                runner.use_graphs = False
                counter.names, counter.on = [], True
                eng.step()
                counter.on = False
                runner.use_graphs = use_graphs
                names = counter.names
                eng.step()                           # records the decode graph of this batch size (untimed)
                eng.step()
                ent = runner._graphs.get(B) if use_graphs else None
                nodes = _graph_nodes(ent[0]) if ent is not None else None
                if ent is not None and ent[0].entries and nodes != len(names) - 1:
                    extra = collections.Counter(counter.by_address.get(a, "?") for a, _, _ in ent[0].entries)
                    extra.subtract(collections.Counter(names))
                    print(f"  note: batch {B} {mode}: graph entries minus eager launches by kernel: "
                          f"{ {k: v for k, v in extra.items() if v} }", flush=True)
                step_t, fwd_t = [], []
                for _ in range(steps):
                    if len(eng._reqs) < B:
                        raise RuntimeError("a request finished before the timed steps ended (max_model_len)")
                    n0 = len(exec_times)
                    t0 = time.perf_counter()
                    eng.step()
                    step_t.append(time.perf_counter() - t0)
                    fwd_t.append(sum(exec_times[n0:]))       # this step's ModelRunner.execute time(s)
                m = per_mode.setdefault(mode, {"names": names, "nodes": nodes, "step": [], "fwd": []})
                m["step"] += step_t
                m["fwd"] += fwd_t
            for rid in ids:
                eng.abort_request(rid)
            while eng.has_unfinished_requests():
                eng.step()
            for mode, m in per_mode.items():
                by = collections.Counter(m["names"])
                per_layer, outside = {}, {}
                for k, c in by.items():
                    if layers and c >= layers:
                        per_layer[k] = c // layers
                    if not layers or c % layers:
                        outside[k] = c % layers if layers else c
                med, fmed = statistics.median(m["step"]), statistics.median(m["fwd"])
                out["results"].append({
                    "batch": B, "mode": mode, "launches_per_step": len(m["names"]), "graph_nodes_per_step": m["nodes"],
                    "per_layer": dict(sorted(per_layer.items(), key=lambda kv: -kv[1])),
                    "launches_per_layer": sum(per_layer.values()),
                    "outside_layers": dict(sorted(outside.items(), key=lambda kv: -kv[1])),
                    "engine_steps_per_s": round(1 / med, 2), "forward_steps_per_s": round(1 / fmed, 2),
                    "engine_step_ms_median": round(med * 1e3, 3), "forward_ms_median": round(fmed * 1e3, 3),
                    "engine_step_ms_min": round(min(m["step"]) * 1e3, 3), "forward_ms_min": round(min(m["fwd"]) * 1e3, 3),
                    "decode_tok_s": round(B / med, 1), "timed_steps": len(m["step"]), "timed_forwards": len(m["fwd"]),
                })
    finally:
        runner.execute = orig_exec
        counter.close()
        eng.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or model folder (default: the embedded SmolLM2)")
    ap.add_argument("--random", default=None, help="a random-weight model of this shape instead (llama3-8b, "
                                                   "qwen3-8b, smollm2-135m)")
    ap.add_argument("--layers", type=int, default=None, help="--random: keep the first N layers")
    ap.add_argument("--smoke", action="store_true", help="--random: a tiny model of the same family")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, vulkan or fake-cuda (default cpu)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--no-graphs", action="store_true", help="time eager steps (no graph replay)")
    ap.add_argument("--unfused", action="store_true",
                    help="DecoderLM.fuse_decode off: the separate norm / quantise / activation / RoPE / cache ops")
    ap.add_argument("--compare", action="store_true",
                    help="fused and unfused decode steps in turns (--rounds each, --steps steps a turn) in one run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device, mp = a.device, None
    if device == "fake-cuda":
        mp = _install_fake_cuda()
        device = "cuda"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    with tempfile.TemporaryDirectory(prefix="jk-count-") as d:
        model = a.model
        if a.random:
            from perf.peers.make_random_model import write_model
            write_model(d, a.random, layers=a.layers, smoke=a.smoke, quiet=True,
                        device="cuda" if device == "cuda" and mp is None else "cpu")
            model = d
        res = measure(model, device, a.batch, a.steps, a.prompt_len, use_graphs=not a.no_graphs,
                      fused=not a.unfused, compare=a.compare, rounds=a.rounds)
    if a.random:
        res["model"] = f"random {a.random}{' smoke' if a.smoke else ''}" + (f", {a.layers} layers" if a.layers else "")
    res["load_avg_1m_before"] = load
    if mp is not None:
        res["device"] = "fake-cuda (CUDA code path on host memory; times meaningless)"
        mp.undo()
    print(f"{res['model']} on {res['device']}: {res['layers']} layers (1-min load before: {load})")
    for r in res["results"]:
        print(f"  batch {r['batch']:3d} {r['mode']:>7}: {r['launches_per_step']} launches/step ({r['launches_per_layer']} per layer),"
              f" graph nodes {r['graph_nodes_per_step']}, engine {r['engine_steps_per_s']} steps/s"
              f" ({r['decode_tok_s']} tok/s), forward alone {r['forward_steps_per_s']} steps/s")
        print("    per layer: " + ", ".join(f"{k} x{v}" for k, v in r["per_layer"].items()))
        print("    outside layers: " + ", ".join(f"{k} x{v}" for k, v in r["outside_layers"].items()))
    if a.compare:
        for B in a.batch:
            f = [r for r in res["results"] if r["batch"] == B and r["mode"] == "fused"][0]
            u = [r for r in res["results"] if r["batch"] == B and r["mode"] == "unfused"][0]
            print(f"  batch {B}: launches {u['launches_per_step']} -> {f['launches_per_step']}; median step "
                  f"{u['engine_step_ms_median']} -> {f['engine_step_ms_median']} ms (fused/unfused steps/s "
                  f"{f['engine_steps_per_s'] / u['engine_steps_per_s']:.3f}x; forward alone "
                  f"{f['forward_steps_per_s'] / u['forward_steps_per_s']:.3f}x); fastest step {u['engine_step_ms_min']} -> "
                  f"{f['engine_step_ms_min']} ms")
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
