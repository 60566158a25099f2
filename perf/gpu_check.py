"""The GPU check's steps (perf/gpu_check.sh runs them in order and prints `table` last).

    python3 perf/gpu_check.py aot --model M [--target sm_90a] --json aot.json
        `jitkern build --target T --model M` into a fresh cache, then the CLI, the `LLM` API and the server on
        CUDA, each with that cache: every kernel specialisation a run compiles that the build did not is
        listed (kernel, target, spec); the check passes with zero.
    python3 perf/gpu_check.py serving --model M --concurrency 1 64 256 --json serving.json
        The engine alone (LLMEngine in a process of its own, a closed loop of C requests in flight, as
        perf/bench_serving.py keeps C streams open) against `python -m server` driven by perf/bench_serving.py
        on the same random prompts: output tok/s, TTFT and ITL P50/P99, served / engine. Each concurrency runs
        --waves x C requests (a single wave is mostly its ramp: the arrivals and the last stragglers), and the
        timed served run reports the CPU cores each of the server's processes (gunicorn worker, engine process)
        and the client kept busy. --profile-concurrency C also records py-spy flame data (only the threads
        holding the interpreter lock) of the worker and the engine process during that run, with a summary of
        the top frames beside it.
    python3 perf/gpu_check.py table DIR
        One summary table of every JSON result in DIR (pytest counts from DIR/pytest-*.txt).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:         # run as a script: the repo's packages (jitkern, engine, perf) first
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------------------ helpers
def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_entries(cache: Path) -> dict:
    """{(device tag, key): meta} of every complete entry of the kernel cache rooted at `cache`."""
    from jitkern.cache import KernelCache
    out = {}
    for e in KernelCache(cache).entries():
        try:
            meta = json.loads((e.path / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        out[(e.device_tag, e.key)] = meta
    return out


def _process_tree(root: int) -> dict:
    """{pid: role} for `root` and its descendants: 'engine' (the engine process), 'worker' (a gunicorn worker),
    'master' (the root) or 'other'."""
    kids: dict = {}
    for st in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(st).read_text()
        except OSError:
            continue
        kids.setdefault(int(text[text.rfind(")") + 2:].split()[1]), []).append(int(st.split("/")[2]))
    roles, todo = {}, [(root, None)]
    while todo:
        pid, parent = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "dp_replica" in cmd:
            roles[pid] = "engine"
        elif parent is None:
            roles[pid] = "master"
        elif "gunicorn" in cmd or "server" in cmd:
            roles[pid] = "worker"
        else:
            roles[pid] = "other"
        todo += [(k, pid) for k in kids.get(pid, [])]
    return roles


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = text[text.rfind(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU cores each role of a process tree (and this process, the client) kept busy between start and stop."""

    def __init__(self, root: int):
        self.roles = _process_tree(root)
        self.t0 = time.perf_counter()
        self.c0 = {pid: _cpu_seconds(pid) for pid in self.roles}
        self.self0 = sum(os.times()[:2])

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy: dict = {"client": (sum(os.times()[:2]) - self.self0) / wall}
        for pid, role in self.roles.items():
            busy[role] = busy.get(role, 0.0) + (_cpu_seconds(pid) - self.c0[pid]) / wall
        return {k: round(v, 2) for k, v in busy.items()}


def _py_spy() -> str | None:
    """py-spy's binary: on PATH, or beside a PYTHONPATH entry (perf/gpu_check.sh installs .whl/ with --target)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found:
        return found
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        cand = Path(entry) / "bin" / "py-spy"
        if entry and cand.exists():
            return str(cand)
    return None


def flame_summary(raw: Path, top: int = 30) -> str:
    """The top frames of a py-spy raw (collapsed) file: by samples in the frame itself and with its callees."""
    own: dict = {}
    incl: dict = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        n = int(n)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "no samples"
    out = [f"{total} samples", "-- own"]
    out += [f"{n / total:6.1%} {f}" for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    out += ["-- with callees"]
    out += [f"{n / total:6.1%} {f}" for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(out)


class Profiler:
    """py-spy record (--gil: the samples of the thread holding the interpreter lock; --nonblocking: the processes
    are never paused, so the run measured is not slowed) of the server's worker and
    engine processes until stop(); raw flame files and their summaries land in `logs`."""

    def __init__(self, root: int, logs: Path, tag: str):
        self.procs = []
        exe = _py_spy()
        if exe is None:
            print("serving: no py-spy here (perf/device_wheels.sh brings it): no profile", flush=True)
            return
        for pid, role in _process_tree(root).items():
            if role in ("worker", "engine"):
                raw = logs / f"profile-{tag}-{role}-{pid}.txt"
                p = subprocess.Popen([exe, "record", "--gil", "--nonblocking", "-r", "250", "-f", "raw", "-o", str(raw),
                                      "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                self.procs.append((p, raw))

    def stop(self) -> None:
        for p, raw in self.procs:
            p.send_signal(signal.SIGINT)
        for p, raw in self.procs:
            try:
                _, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if raw.exists():
                summary = flame_summary(raw)
                raw.with_name(raw.stem + "-summary.txt").write_text(summary + "\n")
                print(f"serving: profile {raw.name}: " + "\n    ".join(summary.splitlines()[:14]), flush=True)
            else:
                print(f"serving: py-spy wrote no {raw.name}: {err.decode(errors='replace')[-400:]}", flush=True)


class Server:
    """`python -m server` on a free loopback port, ready once /health answers 200."""

    def __init__(self, model: str, extra: list, env: dict, log_path: Path, timeout: float = 900.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--disable-log-requests"] + list(extra),
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                                   + self.tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n" + self.tail())
            time.sleep(0.5)
        self.ready_s = time.monotonic() - t0

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------------- aot
# What the runs below ask of the engine: greedy and sampled requests, logprobs, a stop string, a prompt long
# enough to take a taller prefill tile, several at once (decode batches of more than one sequence).
_LLM_SCRIPT = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda")
words = " ".join(f"w{i}" for i in range(400))
llm.generate(["The capital of France is", words], SamplingParams(max_tokens=8, temperature=0))
llm.generate(["Once upon a time"] * 3, SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                                     logprobs=2))
llm.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.7, min_p=0.05, repetition_penalty=1.1,
                                       presence_penalty=0.2, stop=[" the"]))
print("llm ok")
"""


def _server_requests(server: Server, model_name: str) -> None:
    server.post("/v1/completions", {"model": model_name, "prompt": "The capital of France is", "max_tokens": 8,
                                    "temperature": 0})
    server.post("/v1/completions", {"model": model_name, "prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                                    "temperature": 0.8, "top_p": 0.9, "logprobs": 2, "seed": 3})
    server.post("/v1/chat/completions", {"model": model_name, "messages": [{"role": "user", "content": "Hi!"}],
                                         "max_tokens": 6, "temperature": 0.7, "frequency_penalty": 0.3})


def cmd_aot(args) -> int:
    cache = Path(args.cache or tempfile.mkdtemp(prefix="jitkern-aot-"))
    env = _env(JITKERN_CACHE_DIR=cache)
    logs = Path(args.logs or cache.parent)
    t0 = time.monotonic()
    build = subprocess.run([sys.executable, "-m", "jitkern", "build", "--target", args.target, "--model", args.model,
                            "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    build_s = time.monotonic() - t0
    print(build.stdout.strip() or build.stderr.strip()[-2000:], flush=True)
    result = {"step": "aot", "target": args.target, "build_s": round(build_s, 1), "build_rc": build.returncode,
              "runs": {}}
    if build.returncode != 0:
        result["ok"] = False
        _dump(args.json, result)
        return 1
    before = _cache_entries(cache)
    result["built"] = len(before)

    def diff(name, seen):
        now = _cache_entries(cache)
        new = [now[k] for k in now.keys() - seen.keys()]
        result["runs"][name] = {"compiled": len(new),
                                "kernels": sorted(f"{m.get('kernel')} [{m.get('target')}] {m.get('spec')}"[:300]
                                                  for m in new)}
        print(f"aot: {name}: {len(new)} specialisation(s) compiled after the build", flush=True)
        for line in result["runs"][name]["kernels"]:
            print(f"    {line}", flush=True)
        return now

    seen = before
    cli = subprocess.run([sys.executable, "-m", "engine.cli", "--model", args.model, "--device", "cuda", "--prompt",
                          "The capital of France is", "--max-tokens", "8"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    if cli.returncode != 0:
        print(cli.stderr[-3000:], flush=True)
    result["runs_rc"] = {"cli": cli.returncode}
    seen = diff("cli", seen)
    llm = subprocess.run([sys.executable, "-c", _LLM_SCRIPT, args.model], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    if llm.returncode != 0:
        print(llm.stderr[-3000:], flush=True)
    result["runs_rc"]["llm"] = llm.returncode
    seen = diff("llm", seen)
    try:
        server = Server(args.model, [], env, logs / "aot-server.log")     # --device auto: CUDA here
    except RuntimeError as e:
        print(e, flush=True)
        result["runs_rc"]["server"] = 1
    else:
        try:
            name = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=30).read())["data"][0]["id"]
            _server_requests(server, name)
            result["runs_rc"]["server"] = 0
        except Exception as e:  # noqa: BLE001 - reported in the table
            print(f"aot: server requests failed: {type(e).__name__}: {e}\n{server.tail()}", flush=True)
            result["runs_rc"]["server"] = 1
        finally:
            server.stop()
    diff("server", seen)
    result["ok"] = all(rc == 0 for rc in result["runs_rc"].values()) and \
        all(r["compiled"] == 0 for r in result["runs"].values())
    _dump(args.json, result)
    return 0 if result["ok"] else 1


# ------------------------------------------------------------------------------------------------ serving
def _closed_loop_engine(args, concurrency: int) -> dict:
    """The engine alone: num_prompts requests, at most `concurrency` in flight (a finished one is replaced
    at once, as bench_serving's client threads do); output tok/s over the whole run."""
    from engine.llm_engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams
    from perf.bench_serving import load_tokenizer, random_prompts
    # the server's settings: its max_num_seqs and vLLM's server batch limits (usage_context)
    kw = dict(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs or max(concurrency, 1),
              usage_context="openai_api_server")
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    engine = LLMEngine(EngineArgs(**kw))
    tok = load_tokenizer(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def wave(prompts, tag):
        pending = list(enumerate(prompts))
        inflight, tokens = 0, 0
        t0 = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and inflight < concurrency:
                i, p = pending.pop(0)
                engine.add_request(f"{tag}-{i}", p, params)
                inflight += 1
            for out in engine.step():
                if out.finished:
                    inflight -= 1
                    tokens += len(out.outputs[0].token_ids)
        return tokens, time.perf_counter() - t0

    n = args.num_prompts or max(args.waves * concurrency, 8)
    wave(random_prompts(tok, min(n, concurrency), args.input_len, args.seed + 1000), "warm")
    tokens, wall = wave(random_prompts(tok, n, args.input_len, args.seed), "run")
    engine.close()
    return {"output_throughput": tokens / wall, "tokens": tokens, "wall_s": wall}


def cmd_engine(args) -> int:
    res = _closed_loop_engine(args, args.concurrency[0])
    print(json.dumps(res))
    return 0


def cmd_serving(args) -> int:
    logs = Path(args.logs or tempfile.mkdtemp(prefix="jitkern-serving-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    # the engine alone first, each concurrency in a process of its own (a process holds the card's memory)
    engine = {}
    for c in ([] if args.skip_engine else args.concurrency):
        cmd = [sys.executable, str(Path(__file__)), "engine", "--model", args.model, "--concurrency", str(c),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed),
               "--device", args.device, "--max-num-seqs", str(max(args.concurrency))]
        cmd += ["--waves", str(args.waves)] + (["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])
        if args.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        if p.returncode != 0:
            print(f"serving: the engine alone at c={c} failed:\n{p.stderr[-3000:]}", flush=True)
            engine[c] = None
            continue
        engine[c] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"serving: engine alone c={c}: {engine[c]['output_throughput']:.1f} output tok/s", flush=True)
    preemptions, kv_log = None, None
    for i, variant in enumerate(args.server_args or [""]):
        got, preempt, kv = _serve_variant(args, variant, engine, logs, f"serving-server{i or ''}")
        rows += got
        preemptions = preempt if preemptions is None else max(preemptions, preempt or 0)
        kv_log = kv_log or kv
    result = {"step": "serving", "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
              "rows": rows, "preemptions": preemptions, "kv_log": kv_log}
    _dump(args.json, result)
    return 0 if rows and all(r["failed"] == 0 for r in rows) else 1


def _serve_variant(args, variant: str, engine: dict, logs: Path, log_name: str) -> tuple:
    """One server (`python -m server` with these extra flags) at every concurrency: (rows, preemptions, KV line)."""
    rows = []
    extra = ["--max-num-seqs", str(max(args.concurrency))] + shlex.split(variant)
    if args.gpu_memory_utilization is not None:
        extra += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    server = Server(args.model, extra, _env(JITKERN_DEVICE=args.device), logs / f"{log_name}.log")
    label = variant or "default"
    print(f"serving [{label}]: server ready in {server.ready_s:.1f} s", flush=True)
    try:
        from perf import bench_serving
        for c in args.concurrency:
            n = args.num_prompts or max(args.waves * c, 8)
            # an unmeasured wave at this concurrency first, as the engine alone gets one: the decode graphs of
            # its batch sizes and the prefill graphs of its step sizes are recorded there, not in the timed run
            warm = bench_serving.build_parser().parse_args([
                "--base-url", server.url + "/v1", "--num-prompts", str(c), "--concurrency", str(c),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--seed", str(args.seed + 1000), "--tokenizer", args.model, "--warmup", "0", "-q"])
            bench_serving.run_benchmark(warm)
            ns = bench_serving.build_parser().parse_args([
                "--base-url", server.url + "/v1", "--num-prompts", str(n), "--concurrency", str(c),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed),
                "--tokenizer", args.model, "--warmup", "0", "-q"])
            meter = CpuMeter(server.proc.pid)
            tag = f"c{c}" + (f"-{re.sub(r'[^A-Za-z0-9]+', '_', variant).strip('_')}" if variant else "")
            prof = Profiler(server.proc.pid, logs, tag) if c == args.profile_concurrency else None
            try:
                rep = bench_serving.run_benchmark(ns)
            finally:
                cpu = meter.stop()
                if prof is not None:
                    prof.stop()
            eng = engine.get(c)
            row = {"server": label, "concurrency": c, "served_tok_s": rep["output_throughput"],
                   "engine_tok_s": eng["output_throughput"] if eng else None,
                   "ttft_p50_ms": rep["ttft_ms"]["median"], "ttft_p99_ms": rep["ttft_ms"]["p99"],
                   "itl_p50_ms": rep["itl_ms"]["median"], "itl_p99_ms": rep["itl_ms"]["p99"],
                   "failed": rep["failed_requests"], "errors": rep["errors"], "cpu_cores": cpu,
                   "requests": n}
            row["ratio"] = row["served_tok_s"] / row["engine_tok_s"] if row["engine_tok_s"] else None
            rows.append(row)
            print(f"serving [{label}]: served c={c}: {row['served_tok_s']:.1f} output tok/s, TTFT P50/P99 "
                  f"{row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, {row['failed']} failed, CPU cores busy {cpu}",
                  flush=True)
        metrics = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
        preempt = re.search(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)", metrics, re.M)
        kv_line = [ln for ln in server.tail(400).splitlines() if "KV cache" in ln]
    finally:
        server.stop()
    return rows, float(preempt.group(1)) if preempt else None, kv_line[-1] if kv_line else None


# -------------------------------------------------------------------------------------------------- table
def _dump(path, obj) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1))


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def cmd_table(args) -> int:
    d = Path(args.dir)
    print("\n## GPU check summary")
    card = d / "card.txt"
    if card.exists():
        print(f"card: {card.read_text().strip()}")
    print("\n| check | result |\n|---|---|")
    for f in sorted(glob.glob(str(d / "pytest-*.txt"))):
        text = Path(f).read_text(errors="replace").strip().splitlines()
        summary = next((ln for ln in reversed(text) if re.search(r"\d+ (passed|failed|error)", ln)), "no summary")
        print(f"| {Path(f).stem} | {summary.strip('= ')} |")
    aot = d / "aot.json"
    if aot.exists():
        a = json.loads(aot.read_text())
        runs = ", ".join(f"{k} {v['compiled']}" for k, v in a.get("runs", {}).items())
        rcs = ", ".join(f"{k} rc {v}" for k, v in a.get("runs_rc", {}).items())
        print(f"| AOT `jitkern build --target {a['target']}` | {a.get('built', '-')} specialisations in "
              f"{a['build_s']} s; compiled after it: {runs or '-'} ({rcs}) -> {'PASS' if a.get('ok') else 'FAIL'} |")
    srv = d / "serving.json"
    if srv.exists():
        s = json.loads(srv.read_text())
        print(f"\nserved vs engine alone, {s['input_len']} in / {s['output_len']} out, ignore_eos, greedy; "
              f"preemptions {s.get('preemptions')}; {s.get('kv_log') or ''}")
        print("\n| server | c | requests | engine tok/s | served tok/s | served / engine | TTFT P50 ms | "
              "TTFT P99 ms | ITL P50 ms | ITL P99 ms | failed | CPU cores busy: workers / engine process / client |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in s["rows"]:
            cpu = r.get("cpu_cores") or {}
            print(f"| {r.get('server', 'default')} | {r['concurrency']} | {r.get('requests', '-')} | "
                  f"{_fmt(r['engine_tok_s'])} | "
                  f"{_fmt(r['served_tok_s'])} | {_fmt(r['ratio'], '.3f')} | {_fmt(r['ttft_p50_ms'])} | "
                  f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['itl_p50_ms'], '.2f')} | {_fmt(r['itl_p99_ms'], '.2f')} | "
                  f"{r['failed']} | {_fmt(cpu.get('worker'), '.2f')} / {_fmt(cpu.get('engine'), '.2f')} / "
                  f"{_fmt(cpu.get('client'), '.2f')} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perf/gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("aot", help="zero compiles after `jitkern build` for the CLI, LLM and the server")
    a.add_argument("--model", required=True)
    a.add_argument("--target", default="sm_90a")
    a.add_argument("--cache", help="kernel cache folder to build into (default: a new temporary one)")
    a.add_argument("--logs", help="folder for the server's log")
    a.add_argument("--json")
    a.set_defaults(fn=cmd_aot)
    for name, fn in (("serving", cmd_serving), ("engine", cmd_engine)):
        s = sub.add_parser(name, help="served vs engine alone" if name == "serving" else "the engine alone (one C)")
        s.add_argument("--model", required=True)
        s.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
        s.add_argument("--num-prompts", type=int, default=None,
                       help="requests per concurrency (default max(WAVES x C, 8))")
        s.add_argument("--waves", type=int, default=4, help="requests per concurrency, in multiples of C (default 4)")
        s.add_argument("--input-len", type=int, default=128)
        s.add_argument("--output-len", type=int, default=128)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--gpu-memory-utilization", type=float, default=None)
        s.add_argument("--device", default="cuda", help="the engine's device (cpu: a smoke run of the check itself)")
        s.add_argument("--max-num-seqs", type=int, default=None, help="engine: default max(concurrency)")
        s.add_argument("--logs", help="folder for the server's log")
        s.add_argument("--json")
        if name == "serving":
            s.add_argument("--server-args", action="append", default=None,
                           help="more `python -m server` flags, as one string joined to the option with '=' (it "
                                "starts with a dash): --server-args=--no-engine-process. Given several times, each is "
                                "a server of its own, measured one after the other against the same engine-alone "
                                "runs: --server-args= --server-args='--api-server-count 4'")
            s.add_argument("--skip-engine", action="store_true", help="the server only (no engine-alone runs)")
            s.add_argument("--profile-concurrency", type=int, default=None, metavar="C",
                           help="py-spy the server's worker and engine process during the timed run at C")
        s.set_defaults(fn=fn)
    t = sub.add_parser("table", help="the summary table of a results folder")
    t.add_argument("dir")
    t.set_defaults(fn=cmd_table)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
