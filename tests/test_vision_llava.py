"""Image input with a LLaVA checkpoint (engine/models/llava.py, engine/multimodal.py) against transformers'
LlavaForConditionalGeneration on a tiny random model (float32), fed the same processed pixel values:

- preprocessing equals transformers' CLIPImageProcessor (its Pillow backend) on a non-square image;
- the vision tower's selected features and the projected features equal transformers' (two variants: the
  penultimate layer without CLS and quick_gelu; two layers side by side with CLS and exact GELU);
- prompt logprobs over the whole prompt (image positions and the text after them) equal log_softmax of
  transformers' logits, with chunked prefill splitting the image's tokens;
- greedy tokens equal transformers' generate, alone and beside a text-only request and another image;
- the prefix cache never serves one image's blocks to a prompt with another image (same token ids), and does
  serve them to the same image again.
"""
import numpy as np
import pytest

from tests.model_compare import hf_greedy

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from engine.llm import LLM  # noqa: E402
from engine.multimodal import ImageProcessor  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.vision_fixtures import (IMAGE_SIZE, IMAGE_TOKEN_ID, VARIANTS, VOCAB, hf_greedy_with_images,  # noqa: E402
                                   make_llava_dir, num_features, random_image)


@pytest.fixture(scope="module", params=list(VARIANTS))
def llava(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = make_llava_dir(str(path), request.param, seed=3)
    return request.param, str(path), hf


def _pixels(path, img):
    return ImageProcessor.from_dir(path, IMAGE_SIZE)(img)


def _expanded(prompt, variant):
    """The prompt with its image token expanded as transformers' processor does."""
    out = []
    for t in prompt:
        out.extend([t] * num_features(variant) if t == IMAGE_TOKEN_ID else [t])
    return out


def _hf_logits(hf, ids, pixels):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(np.stack(pixels))).logits[0]


def test_preprocessing_matches_clip_image_processor(tmp_path):
    tf = pytest.importorskip("transformers")
    import json
    make_llava_dir(str(tmp_path), "default")
    cfg = json.loads((tmp_path / "preprocessor_config.json").read_text())
    cfg.pop("image_processor_type")
    ref_proc = tf.CLIPImageProcessorPil(**cfg)
    ours = ImageProcessor.from_dir(tmp_path, IMAGE_SIZE)
    for seed, size in ((1, (45, 37)), (2, (29, 61)), (3, (32, 32))):
        img = random_image(seed, size)
        ref = ref_proc(img, return_tensors="np")["pixel_values"][0]
        got = ours(img)
        assert got.shape == ref.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    # a grey-scale image is converted to RGB first
    assert ours(random_image(4).convert("L")).shape == (3, IMAGE_SIZE, IMAGE_SIZE)


def test_vision_features_match_transformers(llava):
    variant, path, hf = llava
    from engine.loader import load_checkpoint
    from engine.models import build_model
    model = build_model(load_checkpoint(path), device="cpu")
    px = np.stack([_pixels(path, random_image(s)) for s in (10, 11)])
    v = VARIANTS[variant]
    layers = v["vision_feature_layer"]
    layers = [layers] if isinstance(layers, int) else layers
    with torch.no_grad():
        hs = hf.model.vision_tower(torch.from_numpy(px), output_hidden_states=True).hidden_states
        want = torch.cat([hs[i] for i in layers], -1)
        if v["vision_feature_select_strategy"] == "default":
            want = want[:, 1:]
        proj = torch.stack(list(hf.model.get_image_features(torch.from_numpy(px)).pooler_output))
    got = model.vision.features(px)
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-4)
    emb = model.vision.encode(px)
    assert emb.shape == (2, num_features(variant), 64)
    np.testing.assert_allclose(emb, proj.numpy(), atol=2e-5, rtol=1e-4)


def test_prompt_logprobs_and_greedy_match_transformers(llava):
    variant, path, hf = llava
    img_a, img_b = random_image(20), random_image(21, (50, 40))
    pa, pb = _pixels(path, img_a), _pixels(path, img_b)
    prompt = [7, 8, IMAGE_TOKEN_ID, 9, 10, 11, 12]
    ids = _expanded(prompt, variant)
    ref = torch.log_softmax(_hf_logits(hf, ids, [pa]).double(), -1).numpy()
    # max_num_batched_tokens 8: the prefill runs in chunks that split the image's rows
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=8, max_logprobs=-1)
    try:
        out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_a}},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1, detokenize=False))[0]
        assert out.prompt_token_ids == ids
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(ids)
        got = np.array([[plp[i][t].logprob for t in range(VOCAB)] for i in range(1, len(ids))])
        np.testing.assert_allclose(got, ref[:-1], atol=2e-4, rtol=1e-4)

        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
        want_a = hf_greedy_with_images(hf, ids, [pa], 12)
        assert llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_a}},
                            sp)[0].outputs[0].token_ids == want_a
        # in one batch: another image, a text-only prompt, and a prompt with both images
        two = [5, IMAGE_TOKEN_ID, 6, IMAGE_TOKEN_ID, 4]
        text_only = [3, 4, 5, 6, 7, 8, 9]
        want = [hf_greedy_with_images(hf, ids, [pb], 12),
                hf_greedy_with_images(hf, _expanded(two, variant), [pa, pb], 12), hf_greedy(hf, text_only, 12)]
        outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": img_b}},
                             {"prompt_token_ids": two, "multi_modal_data": {"image": [img_a, img_b]}},
                             text_only], sp)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.close()


def test_prefix_cache_keys_blocks_by_image(llava):
    variant, path, hf = llava
    img_a, img_b = random_image(30), random_image(31)
    # the image starts inside the first block: every block of the prompt holds image tokens or follows them
    prompt = [7, 8, IMAGE_TOKEN_ID] + list(range(20, 50))
    ids = _expanded(prompt, variant)
    want_b = hf_greedy_with_images(hf, ids, [_pixels(path, img_b)], 6)
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    try:
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
        first = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_a}}, sp)[0]
        assert first.metrics.num_cached_tokens == 0
        other = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_b}}, sp)[0]
        assert other.metrics.num_cached_tokens == 0          # same ids, another image: no shared block
        assert other.outputs[0].token_ids == want_b
        again = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_b}}, sp)[0]
        assert again.metrics.num_cached_tokens >= 16        # the same image again: its blocks are hits
        assert again.outputs[0].token_ids == want_b
        # the same token ids as text only (the image token's own embedding) share nothing either
        plain = llm.generate({"prompt_token_ids": ids}, sp)[0]
        assert plain.metrics.num_cached_tokens == 0
    finally:
        llm.close()


def test_bad_image_requests(llava, tmp_path):
    variant, path, hf = llava
    from engine.errors import InvalidRequestError
    llm = LLM(path, num_blocks=32, block_size=16, max_num_batched_tokens=64)
    try:
        sp = SamplingParams(max_tokens=1)
        with pytest.raises(InvalidRequestError, match="placeholder") as e:     # one image, no image token
            llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(1)}}, sp)
        assert e.value.param == "prompt"
        with pytest.raises(InvalidRequestError, match="not a PIL image"):
            llm.generate({"prompt_token_ids": [5, IMAGE_TOKEN_ID], "multi_modal_data": {"image": b"png"}}, sp)
        with pytest.raises(InvalidRequestError, match="only 'image'"):
            llm.generate({"prompt_token_ids": [5], "multi_modal_data": {"audio": 1}}, sp)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path))
    text = LLM(str(tmp_path), num_blocks=16, block_size=16)
    try:
        with pytest.raises(InvalidRequestError, match="does not take image input"):
            text.generate({"prompt": "t5 t6", "multi_modal_data": {"image": random_image(1)}}, SamplingParams())
    finally:
        text.close()


def test_chat_takes_image_parts(llava, tmp_path):
    """LLM.chat as vLLM's: OpenAI image_url parts (a base64 data: URL) and image_pil parts give the tokens of the
    rendered prompt with the image (transformers' greedy); a bad part is refused naming it, and an image part to a
    text-only model too."""
    import base64
    import io

    from engine.errors import InvalidRequestError
    from tests.model_fixtures import make_model_dir
    variant, path, hf = llava
    img = random_image(22)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "t7 t8"}
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    with LLM(path, num_blocks=32, block_size=16, max_num_batched_tokens=64) as llm:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": [text, {"type": "image"}]}])
        want = hf_greedy_with_images(hf, _expanded(ids, variant), [_pixels(path, img)], 6)
        for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_pil", "image_pil": img}):
            out = llm.chat([{"role": "user", "content": [text, part]}], sp)[0]
            assert out.outputs[0].token_ids == want, part["type"]
        with pytest.raises(InvalidRequestError, match="must be a data: URL") as e:
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}], sp)
        assert e.value.param == "messages[0].content[0].image_url.url"
        with pytest.raises(InvalidRequestError, match="not a PIL image"):
            llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": b"png"}]}], sp)
        with pytest.raises(InvalidRequestError, match="'audio_url' is not supported"):
            llm.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}], sp)
    make_model_dir("llama", str(tmp_path))
    with LLM(str(tmp_path), num_blocks=16, block_size=16) as text_llm:
        with pytest.raises(InvalidRequestError, match="does not take image input"):
            text_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img}]}], sp)


def test_chat_template_json_beside_the_tokenizer(tmp_path):
    """llava-hf repos keep the processor's chat template in chat_template.json, not in tokenizer_config.json."""
    import json

    from engine.tokenizer import Tokenizer
    from tests.vision_fixtures import CHAT_TEMPLATE, _tokenizer
    _tokenizer(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image"}]}]
    assert tok.encode_chat(msgs) == [5, IMAGE_TOKEN_ID]
