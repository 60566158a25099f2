"""Hugging Face model ids (engine/hub.py) for the engine CLI, LLM(model=...) and the server's --model.

Nothing is downloaded: a Hugging Face cache is laid out by hand under tmp (HF_HUB_CACHE) the way the hub
client writes it (models--org--name/snapshots/<commit>/..., refs/main), holding a tiny random model, and
HF_HUB_OFFLINE=1 keeps every lookup local. The oracle for "the id resolved to the right model" is the same
model loaded from its own folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.hub import HubModelError, parse_model_id, resolve_model

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ST_ID = "tiny-org/tiny-llama"
GGUF_ID = "tiny-org/tiny-llama-GGUF"


def _cache_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """The hub client's cache layout: blobs are plain copies here (the client uses symlinks to blobs/)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("huggingface_hub")
    from tests.gguf_export import write_gguf
    from tests.model_fixtures import make_model_dir
    base = tmp_path_factory.mktemp("hub")
    local = base / "local-tiny-llama"
    hf = make_model_dir("llama", str(local), seed=5)
    gguf_a = write_gguf(hf, str(base / "tiny-llama-F32.gguf"))
    gguf_b = write_gguf(hf, str(base / "tiny-llama-Q8_0.gguf"), qtype="Q8_0")
    cache = base / "cache"
    st_snap = _cache_repo(cache, ST_ID, {p.name: p for p in local.iterdir()})
    gguf_snap = _cache_repo(cache, GGUF_ID, {"tiny-llama-F32.gguf": Path(gguf_a),
                                             "tiny-llama-Q8_0.gguf": Path(gguf_b)})
    return {"local": local, "cache": cache, "st_snap": st_snap, "gguf_snap": gguf_snap, "gguf_a": gguf_a}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def _env(hub, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITKERN_", "HF_"))}
    env.update(HF_HUB_CACHE=str(hub["cache"]), HF_HUB_OFFLINE="1", JITKERN_CACHE_DIR=str(hub["cache"].parent / "jk"))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


@pytest.mark.parametrize("text, want", [
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None, None)),
    ("org/repo-GGUF:model-Q4_K_M.gguf", ("org/repo-GGUF", "model-Q4_K_M.gguf", None)),
    ("org/repo-GGUF/model-Q4_K_M.gguf", ("org/repo-GGUF", "model-Q4_K_M.gguf", None)),
    ("org/repo-GGUF:Q4_K_M", ("org/repo-GGUF", None, "Q4_K_M")),
    ("./org/repo", None), ("/abs/org", None), ("a/b/c", None), ("model.gguf", None), ("a--b/c", None),
    ("-a/b", None), ("a/b.", None), ("org/repo:", None), ("org/repo:x/y.gguf", None),
])
def test_which_strings_are_hub_ids(text, want):
    assert parse_model_id(text) == want


def test_resolve_from_the_cache_offline(offline, monkeypatch):
    assert resolve_model(ST_ID) == str(offline["st_snap"])
    for form in (f"{GGUF_ID}:tiny-llama-Q8_0.gguf", f"{GGUF_ID}/tiny-llama-Q8_0.gguf", f"{GGUF_ID}:Q8_0",
                 f"{GGUF_ID}:q8_0"):
        assert resolve_model(form) == str(offline["gguf_snap"] / "tiny-llama-Q8_0.gguf"), form
    # A GGUF repo with two files: which one is not guessed.
    with pytest.raises(HubModelError) as info:
        resolve_model(GGUF_ID)
    msg = str(info.value)
    assert GGUF_ID in msg and "tiny-llama-F32.gguf" in msg and "tiny-llama-Q8_0.gguf" in msg and "\n" not in msg
    # Not cached, offline: one line naming the id and what to do.
    for missing in ("tiny-org/not-cached", f"{GGUF_ID}:Q4_K_M", f"{GGUF_ID}:nope.gguf"):
        with pytest.raises(HubModelError) as info:
            resolve_model(missing)
        msg = str(info.value)
        assert msg.startswith(missing + ": ") and "HF_HUB_OFFLINE" in msg and "\n" not in msg, msg
    # Neither a path nor an id.
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model("/no/such/model")


def test_a_local_path_wins_over_an_id(offline, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(offline["local"], tmp_path / ST_ID)
    assert resolve_model(ST_ID) == ST_ID


def test_a_local_path_never_imports_huggingface_hub(hub):
    code = ("import sys; from engine.hub import resolve_model; p = resolve_model(sys.argv[1]); "
            "assert 'huggingface_hub' not in sys.modules, 'imported'; print(p)")
    r = subprocess.run([sys.executable, "-c", code, str(hub["local"])], cwd=ROOT, env=_env(hub),
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout.decode().strip() == str(hub["local"]), r.stderr.decode()


def _greedy_ids(model: str) -> list:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    with LLM(model, num_blocks=64, block_size=16, max_num_batched_tokens=256) as llm:
        out = llm.generate([[5, 17, 33, 2, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return list(out[0].outputs[0].token_ids)


def test_llm_takes_an_id(offline):
    assert _greedy_ids(ST_ID) == _greedy_ids(str(offline["local"]))
    assert _greedy_ids(f"{GGUF_ID}:F32") == _greedy_ids(offline["gguf_a"])
    with pytest.raises(HubModelError, match="tiny-org/not-cached"):
        _greedy_ids("tiny-org/not-cached")


def _engine_cli(hub, model: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "--model", model, "--prompt", "t5 t17 t33",
                           "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--device", "cpu"],
                          cwd=ROOT, env=_env(hub), capture_output=True, timeout=300)


def test_engine_cli_takes_an_id(hub):
    by_id, by_path = _engine_cli(hub, ST_ID), _engine_cli(hub, str(hub["local"]))
    assert by_path.returncode == 0, by_path.stderr.decode()
    assert by_id.returncode == 0, by_id.stderr.decode()
    assert by_id.stdout == by_path.stdout and by_id.stdout.strip()


def test_engine_cli_uncached_id_offline_is_one_line(hub):
    r = _engine_cli(hub, "tiny-org/not-cached")
    err = r.stderr.decode()
    assert r.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--model" in lines[0] and "tiny-org/not-cached" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_server_flag_resolves_an_id(offline, monkeypatch, capsys):
    from server import cli
    from server.app import _served_name
    from server.settings import ServerSettings
    seen = {}

    def fake_execve(path, argv, env):
        seen["env"] = env
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execve", fake_execve)
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", ST_ID])
    assert e.value.code == 0 and seen["env"]["JITKERN_MODEL"] == ST_ID
    # The id names the model in /v1/models (as vLLM), not the cache folder's commit hash.
    assert _served_name(ServerSettings(model=ST_ID), str(offline["st_snap"])) == ST_ID
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "tiny-org/not-cached"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "tiny-org/not-cached" in err and "HF_HUB_OFFLINE" in err, err


def test_server_serves_an_id_from_jitkern_model(hub):
    import http.client
    import json
    from tests.server_fakes import ServerProcess
    srv = ServerProcess("tiny", env={"JITKERN_MODEL": ST_ID, "JITKERN_NUM_BLOCKS": 64, "JITKERN_DEVICE": "cpu",
                                     "HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1"})
    try:
        try:
            srv.wait_ready()
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        conn.request("GET", "/v1/models")
        models = json.loads(conn.getresponse().read())
        assert [m["id"] for m in models["data"]] == [ST_ID]
        body = json.dumps({"model": ST_ID, "prompt": [5, 17, 33, 2, 9], "max_tokens": 6, "temperature": 0,
                           "ignore_eos": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200, out
        conn.close()
    finally:
        srv.close()
    assert out["choices"][0]["text"] == _expected_text(hub)


def _expected_text(hub) -> str:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    with LLM(str(hub["local"]), num_blocks=64, block_size=16) as llm:
        out = llm.generate([[5, 17, 33, 2, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return out[0].outputs[0].text


def test_download_fetches_only_what_the_loader_reads(monkeypatch, tmp_path):
    """The online path, with the hub client's two calls replaced (nothing leaves this host): which files a
    download asks for, and how the hub's refusals read."""
    import huggingface_hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    repos = {
        "org/st": ["config.json", "model.safetensors", "tokenizer.json", "model-Q4_K_M.gguf", "README.md"],
        "org/gguf": ["config.json", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "README.md"],
        "org/one": ["m-Q4_K_M.gguf", "README.md"],
    }
    calls = []

    class RepositoryNotFoundError(Exception):
        pass

    class FakeApi:
        def list_repo_files(self, repo_id):
            if repo_id not in repos:
                raise RepositoryNotFoundError("404 Client Error")
            return repos[repo_id]

    def fake_snapshot(repo_id, allow_patterns=None, local_files_only=False, cache_dir=None, **kw):
        calls.append((repo_id, list(allow_patterns), local_files_only))
        if local_files_only:
            raise FileNotFoundError("not cached")          # the client raises LocalEntryNotFoundError
        return str(tmp_path / repo_id)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model("org/st") == str(tmp_path / "org/st")
    assert calls[-1] == ("org/st", ["*.json", "*.safetensors", "tokenizer*", "*.model"], False)   # no GGUF
    assert resolve_model("org/gguf:Q8_0") == str(tmp_path / "org/gguf" / "m-Q8_0.gguf")
    assert calls[-1] == ("org/gguf", ["m-Q8_0.gguf"], False)
    assert resolve_model("org/one") == str(tmp_path / "org/one")
    assert calls[-1][1][-1] == "m-Q4_K_M.gguf"
    for model, needle in (("org/gguf", "2 .gguf files"), ("org/gguf:Q2_K", "no such .gguf file"),
                          ("org/missing", "no such model on the Hugging Face Hub")):
        with pytest.raises(HubModelError) as info:
            resolve_model(model)
        assert str(info.value).startswith(model + ": ") and needle in str(info.value), str(info.value)
