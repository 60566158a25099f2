"""Image input on the OpenAI chat route (server/protocol.py): image_url parts with base64 data: URLs on a tiny
random LLaVA, checked against transformers' greedy tokens; the 400 answers for an http(s) URL, bad base64, bytes
that are no image, and a model without a vision tower, each naming the field."""
import base64
import io

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
falcon_testing = pytest.importorskip("falcon.testing")

from tests.vision_fixtures import (IMAGE_SIZE, IMAGE_TOKEN_ID, hf_greedy_with_images, make_llava_dir,  # noqa: E402
                                   num_features, random_image)


def data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineArgs
    from server.app import create_app
    from server.settings import ServerSettings
    path = str(tmp_path_factory.mktemp("srv-llava"))
    hf = make_llava_dir(path, "default", seed=5)
    engine = AsyncEngine(EngineArgs(model=path, num_blocks=64, block_size=16))
    app = create_app(engine=engine, settings=ServerSettings(log_requests=False, enable_metrics=False))
    yield path, hf, falcon_testing.TestClient(app)
    app.close()


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_chat_with_an_image_matches_transformers(srv):
    path, hf, client = srv
    from engine.multimodal import ImageProcessor
    img = random_image(40, (41, 52))
    body = {"messages": _user({"type": "text", "text": "t7 t8"},
                              {"type": "image_url", "image_url": {"url": data_url(img)}},
                              {"type": "text", "text": "t9 t10"}),
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = client.simulate_post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    # the template renders the parts in order, "<image>" where the image goes
    ids = [7, 8, IMAGE_TOKEN_ID, 9, 10]
    expanded = [7, 8] + [IMAGE_TOKEN_ID] * num_features("default") + [9, 10]
    choice = r.json["choices"][0]
    assert choice["prompt_token_ids"] == expanded
    px = ImageProcessor.from_dir(path, IMAGE_SIZE)(img)
    assert choice["token_ids"] == hf_greedy_with_images(hf, expanded, [px], 6)
    assert r.json["usage"]["prompt_tokens"] == len(expanded)
    assert ids != expanded
    # another image with the same text answers for that image (no prefix-cache hit across images)
    img2 = random_image(41, (41, 52))
    body["messages"][0]["content"][1]["image_url"]["url"] = data_url(img2, "JPEG")
    r2 = client.simulate_post("/v1/chat/completions", json=body)
    assert r2.status_code == 200, r2.text
    from PIL import Image
    decoded = Image.open(io.BytesIO(base64.b64decode(data_url(img2, "JPEG").split(",", 1)[1])))
    px2 = ImageProcessor.from_dir(path, IMAGE_SIZE)(decoded)
    assert r2.json["choices"][0]["token_ids"] == hf_greedy_with_images(hf, expanded, [px2], 6)


def test_image_part_errors_name_the_field(srv):
    _, _, client = srv
    text = {"type": "text", "text": "t7"}

    def post(part):
        return client.simulate_post("/v1/chat/completions", json={"messages": _user(text, part), "max_tokens": 2})

    r = post({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[0].content[1].image_url.url"
    assert "data: URL" in r.json["error"]["message"]
    r = post({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[0].content[1]"
    assert "base64" in r.json["error"]["message"]
    junk = base64.b64encode(b"these bytes are no image").decode()
    r = post({"type": "image_url", "image_url": {"url": "data:image/png;base64," + junk}})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[0].content[1]"
    assert "not a decodable image" in r.json["error"]["message"]
    r = post({"type": "image_url", "image_url": {"url": 7}})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[0].content[1].image_url.url"
    r = post({"type": "input_audio", "input_audio": {}})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[0].content[1].type"
    # a truncation that cuts the image's placeholder off the prompt leaves an image without a place
    url = data_url(random_image(3))
    r = client.simulate_post("/v1/chat/completions", json={
        "messages": _user({"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "t7 t8"}),
        "max_tokens": 2, "truncate_prompt_tokens": 1})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages"
    assert "placeholder" in r.json["error"]["message"]
    r = client.simulate_post("/v1/chat/completions", json={
        "messages": _user(text, {"type": "image_url", "image_url": {"url": url}}), "max_tokens": 2,
        "use_beam_search": True, "n": 2})
    assert r.status_code == 400 and r.json["error"]["param"] == "use_beam_search"


def test_text_only_model_refuses_images():
    from tests.test_server import make_server
    app, client = make_server(log_requests=False)
    try:
        part = {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}
        r = client.simulate_post("/v1/chat/completions", json={
            "messages": _user({"type": "text", "text": "hi"}, part), "max_tokens": 2})
        assert r.status_code == 400
        assert r.json["error"]["message"] == "this model does not take image input"
        assert r.json["error"]["param"] == "messages[0].content[1]"
    finally:
        app.close()


def test_string_only_template_gets_placeholder_lines():
    """A template that renders content only as a string (no parts) gets the image token, one line per image,
    before the message's text; a template that looks at the parts' types gets the parts."""
    from server.protocol import _fit_template_format
    parts = [{"type": "text", "text": "what is"}, {"type": "image"}, {"type": "image"}, {"type": "text", "text": "it"}]
    msgs = [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": "ok"}]
    _fit_template_format(msgs, "{% for m in messages %}{{ m['content'] }}{% endfor %}", "<image>")
    assert msgs[0]["content"] == "<image>\n<image>\nwhat is\nit" and msgs[1]["content"] == "ok"
    msgs = [{"role": "user", "content": list(parts)}]
    _fit_template_format(msgs, "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% endif %}", "<image>")
    assert msgs[0]["content"] == parts
