"""Load generator for any OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency, throughput.

    python -m perf.bench_serving --base-url http://127.0.0.1:8000/v1 --num-prompts 64 --concurrency 16 \\
        --input-len 128 --output-len 64

It sends `--num-prompts` streaming requests (`/v1/completions`, or `/v1/chat/completions` with
`--endpoint chat`) from `--concurrency` threads, each over its own keep-alive HTTP connection
(http.client, so the client adds as little as possible to what is measured), and reports what
`vllm bench serve` reports: TTFT (time to the first token), TPOT (time per output token after the
first, per request), ITL (time between consecutive streamed chunks), E2EL (end-to-end latency) as
mean / median / p99, and request and token throughput.

Prompts: by default random token sequences of exactly `--input-len` tokens under the tokenizer of
`--tokenizer` (a .gguf, tokenizer.json or model dir; default the embedded SmolLM2), decoded to text so
any server takes them, distinct per request so no prefix cache turns them into hits. `--prompt-text`
instead repeats a fixed text up to the length. Output length: `max_tokens = --output-len` with
`ignore_eos` (a vLLM extension; servers that ignore it may stop early, and the report then shows the
token counts they really produced: from the `usage` the server returns when asked with
`stream_options.include_usage`, else one token per streamed chunk).

The same command measures llama.cpp's own server (`python -m llama_cpp.server --model <gguf>`, from
`make peers`): point --base-url at it. --no-usage / --no-ignore-eos drop those request fields for
servers that refuse them.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens_from_usage: bool = False
    ttft: float = 0.0                      # seconds to the first non-empty chunk
    latency: float = 0.0                   # seconds to the end of the stream
    itl: list = field(default_factory=list)  # seconds between consecutive non-empty chunks
    start: float = 0.0
    end: float = 0.0


# ------------------------------------------------------------------------------------------ prompts

def load_tokenizer(path: Optional[str]):
    from engine.tokenizer import Tokenizer
    if path is None:
        from engine.default_model import default_model_path
        path = str(default_model_path())
    from pathlib import Path
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_pretrained_dir(p)
    return Tokenizer.from_file(p)


def random_prompts(tokenizer, count: int, input_len: int, seed: int) -> list:
    """`count` distinct texts of exactly `input_len` tokens (re-encoding may merge tokens: trimmed and refilled)."""
    rng = random.Random(seed)
    special = set(tokenizer.special_token_ids)
    vocab = [i for i in range(min(tokenizer.vocab_size, 1 << 20)) if i not in special]
    prompts = []
    for _ in range(count):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        for _attempt in range(10):
            text = tokenizer.decode(ids)
            again = tokenizer.encode(text, add_special_tokens=False)
            if len(again) == input_len:
                break
            ids = again[:input_len] + [rng.choice(vocab) for _ in range(input_len - len(again))]
        prompts.append(text)
    return prompts


def fixed_prompts(tokenizer, text: str, count: int, input_len: int) -> list:
    ids = []
    while len(ids) < input_len:
        ids += tokenizer.encode(text + " ", add_special_tokens=False)
    prompt = tokenizer.decode(ids[:input_len])
    return [prompt] * count


# ------------------------------------------------------------------------------------------ one request

class Endpoint:
    def __init__(self, base_url: str, api_key: Optional[str], timeout: float):
        u = urllib.parse.urlsplit(base_url.rstrip("/"))
        if u.scheme not in ("http", "https"):
            raise SystemExit(f"--base-url {base_url!r}: expected http://host:port/v1")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path or ""
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str):
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {self.prefix + path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()


def run_request(ep: Endpoint, conn_box: list, body: dict, chat: bool) -> RequestResult:
    """One streaming request over the thread's connection (re-opened when the server closed it)."""
    res = RequestResult()
    path = ep.prefix + ("/chat/completions" if chat else "/completions")
    data = json.dumps(body).encode()
    res.start = time.perf_counter()
    try:
        for attempt in range(2):
            if conn_box[0] is None:
                conn_box[0] = ep.connect()
            conn = conn_box[0]
            try:
                res.start = time.perf_counter()
                conn.request("POST", path, body=data, headers=ep.headers)
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                conn_box[0] = None
                if attempt:
                    raise
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return res
        last = None
        chunks = 0
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line or line.startswith(b":"):
                continue                     # blank separator or SSE comment (keepalive)
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(payload)
            if "error" in event:
                res.error = f"stream error: {event['error']}"
                return res
            usage = event.get("usage")
            if usage:
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.tokens_from_usage = True
            text = ""
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                text += piece or ""
            if not text:
                continue
            chunks += 1
            if last is None:
                res.ttft = now - res.start
            else:
                res.itl.append(now - last)
            last = now
        resp.read()
        res.end = time.perf_counter()
        res.latency = res.end - res.start
        if not res.tokens_from_usage:
            res.output_tokens = chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "the stream carried no text"
    except Exception as e:  # noqa: BLE001 - one failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"
        if conn_box[0] is not None:
            conn_box[0].close()
            conn_box[0] = None
    return res


# ------------------------------------------------------------------------------------------ the run

def build_body(args, model: str, prompt: str, chat: bool) -> dict:
    body = {"model": model, "max_tokens": args.output_len, "stream": True, "temperature": args.temperature}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if not args.no_usage:
        body["stream_options"] = {"include_usage": True}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    return body


def run_benchmark(args) -> dict:
    ep = Endpoint(args.base_url, args.api_key, args.timeout)
    model = args.model
    if model is None:
        data = ep.get_json("/models").get("data") or []
        if not data:
            raise SystemExit(f"{args.base_url}/models lists no model; pass --model")
        model = data[0]["id"]
    tokenizer = load_tokenizer(args.tokenizer)
    total = args.num_prompts + args.warmup
    if args.prompt_text is not None:
        prompts = fixed_prompts(tokenizer, args.prompt_text, total, args.input_len)
    else:
        prompts = random_prompts(tokenizer, total, args.input_len, args.seed)
    input_tokens = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    chat = args.endpoint == "chat"

    # Warm-up requests (not measured): one-time work on the server should not count.
    box = [None]
    for p in prompts[:args.warmup]:
        r = run_request(ep, box, build_body(args, model, p, chat), chat)
        if not r.ok:
            raise SystemExit(f"warm-up request failed: {r.error}")
    if box[0] is not None:
        box[0].close()

    work = list(range(args.warmup, total))
    lock = threading.Lock()
    results: list = [None] * len(work)
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=len(work), desc=f"c={args.concurrency}", unit="req", file=sys.stderr)

    def worker():
        conn_box = [None]
        while True:
            with lock:
                if not work:
                    break
                i = work.pop(0)
            r = run_request(ep, conn_box, build_body(args, model, prompts[i], chat), chat)
            if not r.tokens_from_usage or not r.prompt_tokens:
                r.prompt_tokens = input_tokens[i]
            results[i - args.warmup] = r
            if bar is not None:
                bar.update(1)
        if conn_box[0] is not None:
            conn_box[0].close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return summarize(args, model, results, duration)


def _stats_ms(values: list, percentiles=(99,)) -> dict:
    if not values:
        return {"mean": None, "median": None, **{f"p{p}": None for p in percentiles}}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr))}
    for p in percentiles:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def summarize(args, model: str, results: list, duration: float) -> dict:
    ok = [r for r in results if r is not None and r.ok]
    failed = [r for r in results if r is None or not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    report = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "label": args.label,
        "concurrency": args.concurrency, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "successful_requests": len(ok), "failed_requests": len(failed),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "output_tokens_counted_from": "usage" if ok and all(r.tokens_from_usage for r in ok) else "chunks",
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok]), "tpot_ms": _stats_ms(tpot), "itl_ms": _stats_ms(itl),
        "e2el_ms": _stats_ms([r.latency for r in ok]),
        "errors": sorted({r.error for r in failed if r is not None})[:5],
        "mean_output_tokens": statistics.mean([r.output_tokens for r in ok]) if ok else 0,
    }
    return report


def format_report(rep: dict) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result "),
             f"{'Server:':<40}{rep['base_url']}",
             f"{'Model:':<40}{rep['model']}",
             f"{'Successful requests:':<40}{rep['successful_requests']}",
             f"{'Failed requests:':<40}{rep['failed_requests']}",
             f"{'Maximum request concurrency:':<40}{rep['concurrency']}",
             f"{'Benchmark duration (s):':<40}{rep['duration_s']:.2f}",
             f"{'Total input tokens:':<40}{rep['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{rep['total_output_tokens']} (from {rep['output_tokens_counted_from']})",
             f"{'Request throughput (req/s):':<40}{rep['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<40}{rep['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<40}{rep['total_token_throughput']:.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{:-^60}".format(title))
        short = key.split("_")[0].upper()
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            v = rep[key][stat]
            label = f"{name} {short} (ms):"
            lines.append(f"{label:<40}" + ("n/a" if v is None else f"{v:.2f}"))
    if rep["errors"]:
        lines.append("{:-^60}".format("Errors (first distinct)"))
        lines.extend(rep["errors"])
    lines.append("=" * 60)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (…/v1)")
    p.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", "--max-concurrency", type=int, default=1, dest="concurrency")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (with ignore_eos)")
    p.add_argument("--prompt-text", help="repeat this text to --input-len tokens instead of random tokens")
    p.add_argument("--tokenizer", help="tokenizer for building prompts (.gguf, tokenizer.json or model dir; "
                   "default: the embedded SmolLM2)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request socket timeout (s)")
    p.add_argument("--no-usage", action="store_true", help="do not send stream_options.include_usage")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--label", default="", help="free text stored with the JSON result")
    p.add_argument("--json", dest="json_out", help="also write the result as JSON to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be at least 0")
    report = run_benchmark(args)
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
