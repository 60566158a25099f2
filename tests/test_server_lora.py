"""LoRA adapters on the OpenAI server (server.lora): --lora-modules, /v1/models, `model` naming an adapter, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, and their 4xx errors; through the official openai client."""
import json

import numpy as np
import pytest

from tests.model_compare import hf_greedy

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")   # the HTTP library of the installed openai client

from tests.model_fixtures import make_model_dir  # noqa: E402
from tests.test_lora import ATTN, MLP, merged, write_adapter  # noqa: E402


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    root = tmp_path_factory.mktemp("srv-lora")
    path = str(root / "base")
    hf = make_model_dir("llama", path, seed=4)
    t1 = write_adapter(str(root / "sql"), hf, ("q_proj", "v_proj"), r=8, alpha=16, seed=11)
    t2 = write_adapter(str(root / "chat"), hf, ATTN + MLP, r=4, alpha=4, seed=12)
    refs = {"base": hf, "sql": merged(hf, t1, 2.0), "chat": merged(hf, t2, 1.0)}
    engine = AsyncEngine(EngineArgs(model=path, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64))
    settings = ServerSettings(log_requests=False, enable_metrics=False,
                              lora_modules=json.dumps([{"name": "sql", "path": str(root / "sql")}]))
    app = create_app(engine=engine, settings=settings)
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://test")
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    yield root, refs, client, http
    app.close()


def _tokens(client, model, prompt, n=6):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    return [[int(t[1:]) for t in c.logprobs.tokens] for c in r.choices]


def test_models_list_adapters_with_parent(srv):
    _, _, client, _ = srv
    data = {m.id: m for m in client.models.list().data}
    assert set(data) == {"base", "sql"}
    assert data["sql"].parent == "base" and data["base"].parent is None
    assert client.models.retrieve("sql").parent == "base"


def test_model_names_the_adapter(srv):
    _, refs, client, _ = srv
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 256, 12).tolist() for _ in range(2)]
    want = [hf_greedy(refs["sql"], p, 6) for p in prompts]
    assert want != [hf_greedy(refs["base"], p, 6) for p in prompts]       # the adapter changes the tokens
    assert _tokens(client, "sql", prompts) == want
    assert _tokens(client, "base", prompts[:1]) == [hf_greedy(refs["base"], prompts[0], 6)]


def test_dynamic_load_use_unload(srv):
    root, refs, client, http = srv
    p = [9, 8, 7, 6, 5, 4, 3, 2]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")})
    assert r.status_code == 200 and "chat" in r.text
    assert "chat" in {m.id for m in client.models.list().data}
    assert hf_greedy(refs["chat"], p, 6) != hf_greedy(refs["base"], p, 6)
    assert _tokens(client, "chat", [p]) == [hf_greedy(refs["chat"], p, 6)]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=[p], max_tokens=1)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_bad_adapters_are_4xx_naming_the_field(srv):
    root, refs, _, http = srv
    write_adapter(str(root / "wide"), refs["base"], ("q_proj",), r=16, alpha=16, seed=5)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(root / "wide")})
    assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "nowhere")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = http.post("/v1/unload_lora_adapter", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_cli_flags_become_settings():
    from server.cli import build_parser, settings_from_args
    args = build_parser().parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}'])
    s = settings_from_args(args)
    assert s.engine_kwargs()["enable_lora"] is True and s.engine_kwargs()["max_loras"] == 3
    assert s.lora_module_list() == [{"name": "a", "path": "/x/a"}, {"name": "b", "path": "/x/b"}]
    from server.settings import ServerSettings
    assert ServerSettings.from_env(s.to_env()).lora_module_list() == s.lora_module_list()
    with pytest.raises(ValueError, match="name=path"):
        settings_from_args(build_parser().parse_args(["--enable-lora", "--lora-modules", "oops"]))


def test_without_enable_lora_the_routes_are_400_and_modules_refused():
    from types import SimpleNamespace

    from server.lora import ServerLoRA
    state = SimpleNamespace(engine_args={}, model_names={"base"})
    lora = ServerLoRA(state, [])
    for err in (lora.load("a", "/x"), lora.unload("a")):
        assert err.status == 400 and "--enable-lora" in err.message
    assert lora.request_for("a") is None and lora.cards() == []
    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServerLoRA(state, [{"name": "a", "path": "/x"}])
