"""LoRA adapters, image input (LLaVA) and transcription (Whisper) with `device="cuda"`, against the oracles their
CPU tests use (tests/test_lora.py, tests/test_vision_llava.py, tests/test_whisper.py), at the same tolerances:

- LoRA: prompt logprobs of a batch mixing two adapters and the base model equal transformers' with each adapter
  merged into the weights, and greedy tokens equal transformers' generate, mixed batch and alone;
- LLaVA: prompt logprobs over a prompt whose chunked prefill splits the image's rows, and greedy tokens (an image
  alone; two images and a text-only prompt in one batch), against LlavaForConditionalGeneration; LLM.chat takes
  the image as an OpenAI image_url part (a data: URL) and as a PIL image;
- Whisper: encoder output and decoder logits against WhisperForConditionalGeneration, and the greedy tokens of
  a transcription against its generate.

Each runs on `fake` (tests/fake_cuda.py's host-memory device claiming sm_90a: every launch compiled for sm_90a,
ptxas included, then run on the CPU) and on `cuda` (a real GPU; marked `gpu`, run with `-m gpu`). The oracles
are transformers' (torch on the CPU): the CPU engine does not run in these tests.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.sampling_params import SamplingParams  # noqa: E402

WHERE = ["fake", pytest.param("cuda", marks=pytest.mark.gpu)]


def _on(where, monkeypatch):
    """The engine's CUDA device for the rest of the test: the fake sm_90a device, or a real GPU (else skip)."""
    if where == "fake":
        from tests.fake_cuda import install
        monkeypatch.setenv("JITKERN_FAKE_CUDA_TARGET", "sm_90a")
        install(monkeypatch)
        return
    from jitkern.runtime import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA device here")


def _on_device(x) -> bool:
    from jitkern.runtime.device import DeviceArray
    return isinstance(x, DeviceArray)


# ----------------------------------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("where", WHERE)
def test_lora_mixed_batches_on_the_device_match_merged_transformers(where, tmp_path, monkeypatch):
    from engine.llm import LLM
    from engine.lora import LoRARequest
    from tests.model_fixtures import make_model_dir
    from tests.model_compare import FLOAT_TOL, hf_greedy, hf_logprobs, prompt_logprob_rows
    from tests.test_lora import ATTN, MLP, _prompts, merged, write_adapter
    path = str(tmp_path / "model")
    hf = make_model_dir("llama", path)
    t1 = write_adapter(str(tmp_path / "a1"), hf, ("q_proj", "v_proj", "o_proj"), r=8, alpha=16, seed=1)
    t2 = write_adapter(str(tmp_path / "a2"), hf, ATTN + MLP, r=4, alpha=8, seed=2, rslora=True)
    refs = {None: hf, "a1": merged(hf, t1, 16 / 8), "a2": merged(hf, t2, 8 / np.sqrt(4))}
    reqs = {None: None, "a1": LoRARequest("a1", 1, str(tmp_path / "a1")),
            "a2": LoRARequest("a2", 2, str(tmp_path / "a2"))}
    _on(where, monkeypatch)
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=96, block_size=16,
              max_num_batched_tokens=256, max_logprobs=-1, device="cuda")
    try:
        assert llm.engine.model.device == "cuda"
        lin = llm.engine.lora.linears[0]["qkv"]
        assert _on_device(lin.lora_a) and _on_device(lin.lora_b)
        # logprobs: one step prefills all three prompts, decode steps mix both adapters and the base model
        prompts = _prompts(3, seed=5)
        names = [None, "a1", "a2"]
        sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=-1, detokenize=False)
        outs = llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])
        assert llm.engine.lora.step_slots == {0, 1}
        for p, name, o in zip(prompts, names, outs):
            np.testing.assert_allclose(prompt_logprob_rows(o.prompt_logprobs, p), hf_logprobs(refs[name], p)[:-1],
                                       **FLOAT_TOL)
        # greedy: a mixed batch, then one prompt alone
        prompts = _prompts(6, seed=6)
        names = [None, "a1", "a2", "a1", None, "a2"]
        sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False)
        want = [hf_greedy(refs[n], p, 10) for p, n in zip(prompts, names)]
        batch = llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])
        assert [o.outputs[0].token_ids for o in batch] == want
        solo = llm.generate([prompts[2]], sp, lora_request=reqs["a2"])[0].outputs[0].token_ids
        assert solo == want[2]
    finally:
        llm.close()


def _cpu_lora_greedy(path, adapter, names, prompts, n):
    """The CPU engine's greedy tokens of `prompts`, each with the adapter at `adapter` or none (names[i] None)."""
    from engine.llm import LLM
    from engine.lora import LoRARequest
    req = LoRARequest("a", 1, adapter)
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64, device="cpu") as llm:
        outs = llm.generate(prompts, sp, lora_request=[req if m else None for m in names])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("where", WHERE)
def test_lora_on_a_bf16_checkpoint_on_the_device(where, tmp_path, monkeypatch):
    """A bf16 checkpoint: with dtype "float32" the device's greedy tokens are the CPU engine's; with vLLM's default
    dtype (16-bit matrix-unit inputs: the base linears take bf16 x, Linear.x16) the wrapped linears still get
    f32 x (LoRALinear.x16 is None), and a prompt alone gives the tokens it gives in the mixed batch."""
    from engine.llm import LLM
    from engine.lora import LoRARequest
    from tests.model_fixtures import make_model_dir
    from tests.test_engine_cuda import _cpu_side
    from tests.test_lora import ATTN, MLP, _prompts, write_adapter
    path, adapter = str(tmp_path / "model"), str(tmp_path / "a")
    hf = make_model_dir("llama", path)
    write_adapter(adapter, hf, ATTN + MLP, r=4, alpha=8, seed=2)
    hf.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    prompts, names = _prompts(4, seed=6), ["a", None, "a", "a"]
    cpu = _cpu_side("_cpu_lora_greedy", path, adapter, names, prompts, 8, module="tests.test_multimodal_cuda")
    _on(where, monkeypatch)
    req = LoRARequest("a", 1, adapter)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
    for dtype in ("float32", "auto"):
        with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64, device="cuda",
                 dtype=dtype) as llm:
            assert llm.engine.model.compute16 is (dtype == "auto")
            batch = [list(o.outputs[0].token_ids)
                     for o in llm.generate(prompts, sp, lora_request=[req if m else None for m in names])]
            solo = list(llm.generate([prompts[2]], sp, lora_request=req)[0].outputs[0].token_ids)
        assert solo == batch[2], dtype
        if dtype == "float32":
            assert batch == cpu


# ---------------------------------------------------------------------------------------------------- LLaVA
def _data_url(img) -> str:
    import base64
    import io
    buf = io.BytesIO()
    img.save(buf, format="PNG")                 # lossless: the server's decode gives the same pixels back
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("variant", ["default", "full-multi"])
def test_llava_on_the_device_matches_transformers(where, variant, tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    from engine.llm import LLM
    from tests.test_vision_llava import _expanded, _hf_logits, _pixels
    from tests.vision_fixtures import hf_greedy_with_images
    from tests.vision_fixtures import IMAGE_TOKEN_ID, VOCAB, make_llava_dir, random_image
    path = str(tmp_path)
    hf = make_llava_dir(path, variant, seed=3)
    img_a, img_b = random_image(20), random_image(21, (50, 40))
    pa, pb = _pixels(path, img_a), _pixels(path, img_b)
    prompt = [7, 8, IMAGE_TOKEN_ID, 9, 10, 11, 12]
    ids = _expanded(prompt, variant)
    ref = torch.log_softmax(_hf_logits(hf, ids, [pa]).double(), -1).numpy()
    two = [5, IMAGE_TOKEN_ID, 6, IMAGE_TOKEN_ID, 4]
    text_only = [3, 4, 5, 6, 7, 8, 9]
    want_a = hf_greedy_with_images(hf, ids, [pa], 12)
    want = [hf_greedy_with_images(hf, ids, [pb], 12), hf_greedy_with_images(hf, _expanded(two, variant), [pa, pb], 12)]
    with torch.no_grad():
        want.append(hf.generate(input_ids=torch.tensor([text_only]), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(text_only):].tolist())
    _on(where, monkeypatch)
    # max_num_batched_tokens 8: the prefill runs in chunks that split the image's rows
    llm = LLM(path, num_blocks=64, block_size=16, max_num_batched_tokens=8, max_logprobs=-1, device="cuda")
    try:
        vision = llm.engine.model.vision
        assert llm.engine.model.device == "cuda" and _on_device(vision.layers[0]["qkv"].weight)
        out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_a}},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1, detokenize=False))[0]
        assert out.prompt_token_ids == ids
        plp = out.prompt_logprobs
        got = np.array([[plp[i][t].logprob for t in range(VOCAB)] for i in range(1, len(ids))])
        np.testing.assert_allclose(got, ref[:-1], atol=2e-4, rtol=1e-4)
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
        assert llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img_a}},
                            sp)[0].outputs[0].token_ids == want_a
        # in one batch: another image, a prompt with both images, a text-only prompt
        outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": img_b}},
                             {"prompt_token_ids": two, "multi_modal_data": {"image": [img_a, img_b]}},
                             text_only], sp)
        assert [o.outputs[0].token_ids for o in outs] == want
        # LLM.chat: the image as an OpenAI image_url part (a PNG data: URL) and as vLLM's image_pil part
        text = {"type": "text", "text": "t7 t8"}
        chat_ids = llm.tokenizer.encode_chat([{"role": "user", "content": [text, {"type": "image"}]}])
        assert chat_ids.count(IMAGE_TOKEN_ID) == 1
        want_chat = hf_greedy_with_images(hf, _expanded(chat_ids, variant), [pb], 12)
        for part in ({"type": "image_url", "image_url": {"url": _data_url(img_b)}},
                     {"type": "image_pil", "image_pil": img_b}):
            got = llm.chat([{"role": "user", "content": [text, part]}], sp)[0]
            assert got.prompt_token_ids == _expanded(chat_ids, variant)
            assert got.outputs[0].token_ids == want_chat, part["type"]
    finally:
        llm.close()


# -------------------------------------------------------------------------------------------------- Whisper
@pytest.mark.parametrize("where", WHERE)
def test_whisper_on_the_device_matches_transformers(where, tmp_path, monkeypatch):
    from engine.llm import LLM
    from engine.ops._hostargs import host_copy
    from tests.test_whisper import _features, _hf_generate
    from tests.whisper_fixtures import IDS, LANGS, NO_TIMESTAMPS, SOT, make_whisper_dir, random_audio
    path = str(tmp_path)
    hf = make_whisper_dir(path, seed=1)
    audio = random_audio(10, 1.3)
    feats = _features(path, audio)
    rng = np.random.default_rng(11)
    ids = [SOT, IDS["<|fr|>"], IDS["<|transcribe|>"], NO_TIMESTAMPS] + rng.integers(0, 100, 6).tolist()
    with torch.no_grad():
        want_enc = hf.model.encoder(feats).last_hidden_state[0].numpy()
        want = hf(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0].numpy()
    _on(where, monkeypatch)
    llm = LLM(path, device="cuda")
    try:
        tr = llm.engine.transcriber
        assert tr.model.device == "cuda" and _on_device(tr.model.embed)
        enc = tr.model.encode(tr.features(audio))
        assert _on_device(enc)
        np.testing.assert_allclose(host_copy(enc), want_enc, atol=2e-5, rtol=1e-4)
        state = tr.model.start(enc)
        got = [tr.model.decode(state, ids[:5], all_logits=True)] + \
            [tr.model.decode(state, [t])[None] for t in ids[5:]]
        np.testing.assert_allclose(np.concatenate(got), want, atol=5e-5, rtol=1e-4)
        for seed in (20, 21):
            a = random_audio(seed, 1.1 + 0.4 * (seed - 20))
            f = _features(path, a)
            out = llm.transcribe(a, language="de", max_tokens=24)
            assert out.token_ids == _hf_generate(hf, f, 24, language="de")
            # no language: detected from the audio as generate's detect_language does
            with torch.no_grad():
                detected = int(hf.detect_language(f)[0])
            out = llm.transcribe(a, max_tokens=24)
            assert out.language == {IDS[f"<|{c}|>"]: c for c in LANGS}[detected]
            assert out.token_ids == _hf_generate(hf, f, 24, language=out.language)
    finally:
        llm.close()
