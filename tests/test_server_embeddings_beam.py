"""The server's /v1/embeddings (embedding models only) and use_beam_search on /v1/completions, driven by the
official `openai` client over an in-process WSGI transport, on the real engine with tiny random models;
generation_config.json defaults for unset request fields."""
import base64
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")   # the HTTP library of the installed openai client

from tests.test_embeddings import PROMPTS, make_embedding_dir, st_embed  # noqa: E402
from tests.model_fixtures import make_model_dir  # noqa: E402


def _serve(path, **engine_kwargs):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    engine = AsyncEngine(EngineArgs(model=path, **engine_kwargs))
    app = create_app(engine=engine, settings=ServerSettings(log_requests=False, enable_metrics=False))
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://test")
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    return app, client, http


@pytest.fixture(scope="module")
def emb_server(tmp_path_factory):
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("srv-emb")
    hf = make_embedding_dir("llama", str(path), seed=3, pooling="mean", normalize=True, matryoshka=[16, 32])
    app, client, http = _serve(str(path), num_blocks=64, max_num_batched_tokens=64)
    from server.app import warm_up
    warm_up(app.state)               # an embedding server warms up with an embedding, not a generation
    yield hf, client, http
    app.close()


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory):
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("srv-gen")
    hf = make_model_dir("llama", str(path), seed=11)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5,
                                                             "max_new_tokens": 3}))
    app, client, http = _serve(str(path), num_blocks=128, max_logprobs=-1)
    yield hf, client, http
    app.close()


def test_embeddings_float_base64_and_token_inputs(emb_server):
    hf, client, _ = emb_server
    r = client.embeddings.create(model="srv-emb0", input=[PROMPTS[0], PROMPTS[1]], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1]
    for p, d in zip(PROMPTS, r.data):
        ref = st_embed(hf, p, "mean", True)
        assert np.max(np.abs(np.array(d.embedding) - ref)) < 2e-4
    assert r.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    # the client's default: base64, decoded by the client
    r64 = client.embeddings.create(model="srv-emb0", input=PROMPTS[2])
    assert np.array_equal(np.array(r64.data[0].embedding, np.float32),
                          np.array(client.embeddings.create(model="srv-emb0", input=PROMPTS[2],
                                                            encoding_format="float").data[0].embedding, np.float32))
    # strings (one and several) go through the tokenizer
    one = client.embeddings.create(model="srv-emb0", input="t5 t17 t33", encoding_format="float")
    ids = client.embeddings.create(model="srv-emb0", input=[5, 17, 33], encoding_format="float")
    assert one.data[0].embedding == ids.data[0].embedding
    two = client.embeddings.create(model="srv-emb0", input=["t5 t17 t33", "t7 t8 t9"], encoding_format="float")
    assert two.data[0].embedding == ids.data[0].embedding and len(two.data) == 2


def test_embeddings_dimensions_and_errors(emb_server):
    hf, client, http = emb_server
    r = client.embeddings.create(model="srv-emb0", input=PROMPTS[0], dimensions=16, encoding_format="float")
    v = np.array(r.data[0].embedding)
    full = st_embed(hf, PROMPTS[0], "mean", False)[:16]
    assert v.shape == (16,) and np.max(np.abs(v - full / np.linalg.norm(full))) < 2e-4
    for body, param in [({"input": PROMPTS[0], "dimensions": 20}, "dimensions"),
                        ({"input": PROMPTS[0], "dimensions": 0}, "dimensions"),
                        ({"input": PROMPTS[0], "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [[1, 2], "x"]}, "input"), ({"input": []}, "input"),
                        ({"input": [999999]}, "input"), ({"input": "x", "bogus": 1}, "bogus"), ({}, "input")]:
        resp = http.post("/v1/embeddings", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    # generation on an embedding server: a 400 naming the reason
    resp = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert resp.status_code == 400 and "embeddings" in resp.json()["error"]["message"]
    b64 = http.post("/v1/embeddings", json={"input": PROMPTS[1], "encoding_format": "base64"}).json()
    dec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    assert dec.shape == (64,) and abs(np.linalg.norm(dec) - 1) < 1e-5


def test_embeddings_route_is_404_on_a_generation_model(gen_server):
    _, _, http = gen_server
    resp = http.post("/v1/embeddings", json={"input": "t1"})
    assert resp.status_code == 404


def test_use_beam_search_on_completions(gen_server):
    import torch
    hf, client, http = gen_server
    prompt = [5, 17, 33, 2, 9, 100, 44]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                        max_new_tokens=5, min_new_tokens=5, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                        return_dict_in_generate=True, output_scores=True)
    ref = [s[len(prompt):].tolist() for s in g.sequences]
    r = client.completions.create(model="srv-gen0", prompt=prompt, max_tokens=5, n=3, temperature=0,
                                  extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 1.0,
                                              "return_token_ids": True})
    assert len(r.choices) == 3
    got = [http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True,
                                               "ignore_eos": True, "return_token_ids": True}).json()]
    toks = [c.get("token_ids") for c in got[0]["choices"]]
    assert toks == ref, (toks, ref)
    assert [c.text for c in r.choices] == [c["text"] for c in got[0]["choices"]]
    assert all(c.finish_reason == "length" for c in r.choices)
    # best_of = beam width, n = choices returned (the best of the wider search)
    r2 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "n": 1, "best_of": 3,
                                            "use_beam_search": True, "ignore_eos": True,
                                            "return_token_ids": True}).json()
    assert [c["token_ids"] for c in r2["choices"]] == ref[:1]
    for body, param in [({"stream": True}, "stream"), ({"best_of": 1, "n": 2}, "best_of"),
                        ({"length_penalty": "x"}, "length_penalty"), ({"stop": ["t3"]}, "stop")]:
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "use_beam_search": True,
                                                  **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
    # length_penalty without beam search is still refused
    resp = http.post("/v1/completions", json={"prompt": prompt, "length_penalty": 2.0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "length_penalty"


def test_generation_config_defaults_on_the_server(gen_server):
    _, client, _ = gen_server
    prompt = [7, 8, 9, 10, 11]
    # unset: generation_config.json's temperature 0 / top_k 5 / max_new_tokens 3 -> greedy, 3 tokens
    a = client.completions.create(model="srv-gen0", prompt=prompt, extra_body={"ignore_eos": True})
    b = client.completions.create(model="srv-gen0", prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 3 and a.choices[0].text == b.choices[0].text
    # a request's own value wins: 6 tokens
    c = client.completions.create(model="srv-gen0", prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 6


def test_generation_config_defaults_on_chat(gen_server):
    _, client, _ = gen_server
    msgs = [{"role": "user", "content": "t5 t6 t7"}]
    a = client.chat.completions.create(model="srv-gen0", messages=msgs, extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model="srv-gen0", messages=msgs, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 3 and a.choices[0].message.content == b.choices[0].message.content


def test_use_beam_search_on_chat(gen_server):
    _, client, http = gen_server
    msgs = [{"role": "user", "content": "t5 t6 t7"}]
    ids = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    ref = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "n": 2, "use_beam_search": True,
                                             "ignore_eos": True}).json()
    r = client.chat.completions.create(model="srv-gen0", messages=msgs, max_completion_tokens=4, n=2,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in r.choices] == [c["text"] for c in ref["choices"]]
    assert r.usage.completion_tokens == 8
