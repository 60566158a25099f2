"""A fake model behind the real engine front, for server tests that must not need the model forward pass.

`FakeLLMEngine` is the real `LLMEngine` (scheduler, paged KV pool with prefix caching, detokenizer,
stop strings, n > 1 fan-out, RequestOutput deltas, metrics) with only the model runner and the
sampler replaced: the "model" plays back a fixed script of tokens, rotated by the prompt, so every
output is known in advance and depends on the prompt only -- never on what else is in the batch.
The tokenizer is the embedded SmolLM2's real one (byte-level BPE: the script contains characters
split over several tokens, so UTF-8 hold-back is exercised).

`make_engine(settings)` is a JITKERN_ENGINE_FACTORY for running a real gunicorn on the fake model.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from engine.async_engine import AsyncEngine
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import EngineArgs, LLMEngine
from engine.scheduler import Scheduler, SchedulerConfig

# Multi-byte characters (☕, é, 日本) are split across byte-level tokens by the SmolLM2 tokenizer.
SCRIPT_TEXT = (" The quick brown fox ☕ jumps over the lazy dog. Café au lait, 日本 and naïve résumé;"
               " then it rests. STOP here, or go on: one two three four five six seven eight nine ten.")
FAKE_VOCAB = 49152

_tokenizer_lock = threading.Lock()
_tokenizer = None


def smollm2_tokenizer():
    """The embedded model's tokenizer (loaded once per process, ~1 s)."""
    global _tokenizer
    with _tokenizer_lock:
        if _tokenizer is None:
            from engine.default_model import default_model_path
            from engine.tokenizer import Tokenizer
            _tokenizer = Tokenizer.from_file(default_model_path())
        return _tokenizer


@dataclass
class FakeSample:
    """What LLMEngine.step reads from a sampler result."""
    token_id: int
    logprob: float
    rank: int
    top_logprobs: list = field(default_factory=list)          # [(token_id, logprob, rank)]
    prompt_logprobs: Optional[list] = None                     # [(token_id, logprob, rank, top)]


class FakeRunner:
    """Stands in for ModelRunner.execute: sleeps like a model step would, can be told to fail."""

    def __init__(self, owner: "FakeLLMEngine"):
        self.owner = owner

    def execute(self, sched):
        o = self.owner
        if o.fail_steps > 0:
            o.fail_steps -= 1
            raise RuntimeError("injected model failure")
        delay = o.step_delay
        if any(s.is_prefill for s in sched.scheduled):
            delay += o.prefill_delay
        if delay:
            time.sleep(delay)
        # What LLMEngine._sample reads from a step result besides the sampler: no speculative rows.
        return SimpleNamespace(sched=sched, spec_rows={})

    def close(self):
        pass


class FakeSampler:
    """Plays back the script: output token k of a sequence is script[(offset + k) % len]."""

    def __init__(self, owner: "FakeLLMEngine"):
        self.owner = owner

    def sample(self, sched, result) -> dict:
        o = self.owner
        out = {}
        for s in sched.scheduled:
            if not s.sample:
                continue
            req = s.request
            params = req.sampling_params
            token = o.next_token(req)
            entry = FakeSample(token, -0.25, 1)
            if params.logprobs is not None:
                k = params.logprobs if params.logprobs >= 0 else 5
                alts = [token] + [(token + j) % FAKE_VOCAB for j in range(1, k + 1)]
                entry.top_logprobs = [(t, -0.25 * (r + 1), r + 1) for r, t in enumerate(alts[:k])]
            if params.prompt_logprobs is not None and not req.output_token_ids:
                ids = req.prompt_token_ids
                entry.prompt_logprobs = [(t, -1.5, 2, [((t + 1) % FAKE_VOCAB, -0.5, 1), (t, -1.5, 2)])
                                         for t in ids[1:]]
            out[req.request_id] = entry
        return out


class _NoGrammars:
    """The scripted model plays its script whatever a request's structured-output constraint says (a test
    scripts the constrained output itself): admission builds no matcher."""

    def matcher(self, *args, **kwargs):
        return None


class FakeLLMEngine(LLMEngine):
    """The real LLMEngine with a scripted model (see the module docstring)."""

    def __init__(self, *, max_model_len: int = 512, num_blocks: int = 64, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 scheduling_policy: str = "fcfs", max_logprobs: int = 20, step_delay: float = 0.002,
                 prefill_delay: float = 0.0, script: str = SCRIPT_TEXT):
        self.args = EngineArgs(model="fake-model", block_size=block_size, num_blocks=num_blocks,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
                               max_logprobs=max_logprobs)
        self.tokenizer = smollm2_tokenizer()
        self.config = SimpleNamespace(vocab_size=FAKE_VOCAB, architecture="FakeScriptedLM", eos_token_ids=[2])
        self.checkpoint = SimpleNamespace(path=Path("/fake/fake-model"), stop_token_ids=[2])
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            policy=scheduling_policy, vocab_size=FAKE_VOCAB, max_logprobs=max_logprobs), self.kv)
        self.runner = FakeRunner(self)
        self.sampler = FakeSampler(self)
        self.spec = None              # no speculative decoding (LLMEngine.step looks at it)
        self.grammar_compiler = _NoGrammars()
        self.stop_ids = (2,)
        self._reqs = {}
        self._seq_of = {}
        self._counter = itertools.count()
        self.load_seconds = 0.0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}
        self.script = self.tokenizer.encode(script, add_special_tokens=False) + [2]   # ends with EOS
        # A playback may start only where a character starts (not on a UTF-8 continuation byte).
        from server.logprobs import TokenStrings
        strings = TokenStrings(self.tokenizer)
        self.starts = [k for k, t in enumerate(self.script[:-1]) if not 0x80 <= strings.bytes(t)[0] <= 0xBF]
        self.step_delay = step_delay
        self.prefill_delay = prefill_delay
        self.fail_steps = 0

    def offset(self, prompt_ids: list, index: int = 0) -> int:
        # n > 1: each choice plays from elsewhere in the script.
        return self.starts[(sum(prompt_ids) + 5 * index) % len(self.starts)]

    def next_token(self, req) -> int:
        index = int(req.request_id.rsplit("#", 1)[1]) if "#" in req.request_id else 0
        offset = self.offset(req.prompt_token_ids, index)
        k = len(req.output_token_ids)
        token = self.script[(offset + k) % len(self.script)]
        params = req.sampling_params
        if token in self.stop_ids and (params.ignore_eos or k < params.min_tokens):
            token = self.script[(offset + k + 1) % len(self.script)]
        return token

    def expected_tokens(self, prompt_ids: list, count: int, index: Optional[int] = None) -> list:
        """The tokens the script gives a prompt (ignoring EOS handling): for tests."""
        offset = self.offset(prompt_ids, index or 0)
        return [self.script[(offset + k) % len(self.script)] for k in range(count)]


def make_async_engine(**kwargs) -> AsyncEngine:
    return AsyncEngine(engine=FakeLLMEngine(**kwargs))


def make_engine(settings) -> AsyncEngine:
    """JITKERN_ENGINE_FACTORY=tests.server_fakes:make_engine (JITKERN_FAKE_* tune the fake)."""
    env = os.environ
    kwargs = dict(
        max_model_len=settings.max_model_len or 512, num_blocks=settings.num_blocks or 64,
        block_size=settings.block_size or 16, max_num_seqs=settings.max_num_seqs or 64,
        enable_prefix_caching=True if settings.enable_prefix_caching is None else settings.enable_prefix_caching,
        scheduling_policy=settings.scheduling_policy,
        # long enough that 32 concurrent 10-token requests overlap visibly in /metrics on a busy host
        step_delay=float(env.get("JITKERN_FAKE_STEP_DELAY", "0.015")),
        prefill_delay=float(env.get("JITKERN_FAKE_PREFILL_DELAY", "0")))
    engine = FakeLLMEngine(**kwargs)
    # the first N model steps raise (a GPU that cannot load its kernels fails every step this way)
    engine.fail_steps = int(env.get("JITKERN_FAKE_FAIL_STEPS", "0"))
    return AsyncEngine(engine=engine)


# ================================================================================ a real server process

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`gunicorn server.app` (or `python -m server ...`) on a free loopback port, from the repo root.

    backend "fake": the scripted model (JITKERN_ENGINE_FACTORY); "smollm2": the real embedded model.
    start() waits for /health; if the server dies or never gets healthy it raises with the log's tail,
    so a test that needs it fails (it is never skipped).
    """

    def __init__(self, backend: str = "fake", env: dict | None = None, cli_args: list | None = None,
                 boot_timeout: float | None = None):
        import subprocess
        import sys
        import tempfile
        self.backend = backend
        self.port = free_port()
        self.host = "127.0.0.1"
        self.log_file = tempfile.NamedTemporaryFile(prefix=f"jitkern-server-{backend}-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.pop("JITKERN_ENGINE_FACTORY", None)
        if backend == "fake":
            full_env["JITKERN_ENGINE_FACTORY"] = "tests.server_fakes:make_engine"
        full_env.update({k: str(v) for k, v in (env or {}).items()})
        full_env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        if cli_args is not None:
            cmd = [sys.executable, "-m", "server", "--host", self.host, "--port", str(self.port)] + list(cli_args)
        else:
            full_env["JITKERN_HOST"], full_env["JITKERN_PORT"] = self.host, str(self.port)
            cmd = [sys.executable, "-m", "gunicorn", "server.app"]
        self.cmd = cmd
        if boot_timeout is None:
            boot_timeout = float(os.environ.get("JITKERN_TEST_SERVER_BOOT_S", "60" if backend == "fake" else "900"))
        self.boot_timeout = boot_timeout
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_text(self) -> str:
        try:
            return Path(self.log_file.name).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_ready(self) -> "ServerProcess":
        import http.client
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.backend} server exited with status {self.proc.returncode} before "
                                   f"it was healthy; log tail:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return self
                conn.close()
            except OSError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the {self.backend} server was not healthy after {self.boot_timeout:.0f}s; "
                           f"log tail:\n{self.log_tail()}")

    def terminate(self, timeout: float = 40.0) -> int:
        """SIGTERM to the gunicorn master (graceful stop); returns its exit status."""
        import signal
        import subprocess
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the server did not exit within {timeout}s of SIGTERM; log tail:\n"
                                   f"{self.log_tail()}")
        return self.proc.returncode

    def kill(self) -> None:
        import signal
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def close(self) -> None:
        try:
            self.terminate()
        finally:
            self.kill()
            try:
                os.unlink(self.log_file.name)
            except OSError:
                pass


def metrics_value(text: str, name: str) -> float:
    """The value of an unlabelled-or-single-labelled sample `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
