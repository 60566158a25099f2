"""Embeddings (engine/pooling.py, LLM.embed, /v1/embeddings) against transformers on tiny random bare decoders
(LlamaModel / Qwen3Model: no LM head), pooled here as sentence-transformers would (last token / mean / CLS,
optional Normalize module), computed from transformers' last_hidden_state."""
import json
import os

import numpy as np
import pytest

from tests.model_fixtures import (
    _tokenizer_json,
    init_weights,
    make_config,
    save_tiny_model,
)


def _sentence_transformers_layout(path: str, normalize: bool, pooling_config: dict) -> None:
    """modules.json (Transformer, Pooling, Normalize when `normalize`) and 1_Pooling/config.json."""
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(mods, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling_config, f)


def make_embedding_dir(arch: str, path: str, seed: int = 0, pooling: str | None = "last", normalize: bool = True,
                       matryoshka=None):
    """A bare HF model (`AutoModel`, no LM head) with a sentence-transformers layout when `pooling` is set."""
    cfg = make_config(arch)
    if matryoshka is not None:
        cfg.matryoshka_dimensions = matryoshka
    model = save_tiny_model(cfg, path, seed, init=lambda m: init_weights(arch, m), auto_class="AutoModel")
    if pooling is not None:
        _sentence_transformers_layout(path, normalize, {
            "word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": pooling == "last"})
    return model


def st_embed(hf, ids: list, pooling: str, normalize: bool) -> np.ndarray:
    """sentence-transformers' Pooling (+ Normalize) on transformers' outputs, one unpadded prompt."""
    import torch
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    v = {"last": h[-1], "cls": h[0], "mean": h.mean(axis=0)}[pooling]
    if normalize:
        v = v / np.linalg.norm(v)
    return v


PROMPTS = [[5, 17, 33, 2, 9, 100, 44], [7, 8, 9], [200, 3, 3, 3, 150, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71,
                                                     72, 73]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("emb-llama")
    hf = make_embedding_dir("llama", str(path), seed=3, pooling="last", normalize=True, matryoshka=[16, 32, 64])
    return str(path), hf


@pytest.fixture(scope="module")
def emb_llm(tiny_llama):
    from engine.llm import LLM
    m = LLM(tiny_llama[0], num_blocks=64, block_size=16, max_num_batched_tokens=64)
    yield m
    m.close()


def _close(a, b, tol=2e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < tol, err


def test_detected_as_embedding_model(emb_llm, tiny_llama):
    assert emb_llm.engine.task == "embed"
    from engine.pooling import load_pooling_config
    pc = load_pooling_config(tiny_llama[0], "llama")
    assert (pc.pooling, pc.normalize, pc.matryoshka_dimensions) == ("last", True, [16, 32, 64])
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams
    with pytest.raises(InvalidRequestError, match="embeddings"):
        emb_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))


def test_last_token_pooling_matches_transformers(emb_llm, tiny_llama):
    _, hf = tiny_llama
    outs = emb_llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for p, o in zip(PROMPTS, outs):
        v = np.array(o.outputs.embedding)
        _close(v, st_embed(hf, p, "last", True))
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        assert o.prompt_token_ids == p
    # alone == batched (batch invariance of the kernels), bit for bit
    alone = [emb_llm.embed([p])[0].outputs.embedding for p in PROMPTS]
    assert alone == [o.outputs.embedding for o in outs]
    # a text prompt goes through the tokenizer
    t = emb_llm.embed("t5 t17 t33")[0]
    assert t.prompt_token_ids == [5, 17, 33]


def test_matryoshka_dimensions(emb_llm, tiny_llama):
    from engine.errors import InvalidRequestError
    from engine.pooling import PoolingParams
    _, hf = tiny_llama
    v = np.array(emb_llm.embed([PROMPTS[0]], PoolingParams(dimensions=16))[0].outputs.embedding)
    full = st_embed(hf, PROMPTS[0], "last", False)[:16]
    _close(v, full / np.linalg.norm(full))
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        emb_llm.embed([PROMPTS[0]], PoolingParams(dimensions=20))


@pytest.mark.parametrize("arch,pooling,normalize", [("llama", "mean", False), ("qwen3", "cls", True),
                                                     ("qwen3", None, None)])
def test_pooling_modes_from_sentence_transformers_config(tmp_path, arch, pooling, normalize):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine.errors import InvalidRequestError
    from engine.llm import LLM
    from engine.pooling import PoolingParams
    hf = make_embedding_dir(arch, str(tmp_path), seed=7, pooling=pooling, normalize=bool(normalize))
    m = LLM(str(tmp_path), num_blocks=32, block_size=16, max_num_batched_tokens=64)
    try:
        outs = m.embed(PROMPTS)
        # no sentence-transformers config: vLLM's defaults for a decoder (last token, normalised)
        how, norm = (pooling, normalize) if pooling is not None else ("last", True)
        for p, o in zip(PROMPTS, outs):
            _close(o.outputs.embedding, st_embed(hf, p, how, norm))
        with pytest.raises(InvalidRequestError, match="Matryoshka"):        # no matryoshka_dimensions
            m.embed([PROMPTS[0]], PoolingParams(dimensions=8))
    finally:
        m.close()


def test_generation_model_refuses_embed(tmp_path):
    pytest.importorskip("torch")
    from engine.errors import InvalidRequestError
    from engine.llm import LLM
    from tests.model_fixtures import make_model_dir
    make_model_dir("llama", str(tmp_path), seed=1)
    m = LLM(str(tmp_path), num_blocks=16)
    try:
        assert m.engine.task == "generate"
        with pytest.raises(InvalidRequestError, match="embedding model"):
            m.embed([[1, 2, 3]])
    finally:
        m.close()


def make_bert_dir(path: str, seed: int = 0, pooling: str | None = "cls", normalize: bool = True, act="gelu"):
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.BertConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, type_vocab_size=2, hidden_act=act,
                        layer_norm_eps=1e-12)
    model = tf.BertModel(cfg, add_pooling_layer=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer_json(path)
    if pooling is not None:
        _sentence_transformers_layout(path, normalize, {
            "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_lasttoken": pooling == "last"})
    return model


@pytest.mark.parametrize("pooling,normalize,act", [("cls", True, "gelu"), ("mean", False, "gelu"),
                                                    (None, None, "gelu_new")])
def test_bert_encoder_matches_transformers(tmp_path, pooling, normalize, act):
    """Bidirectional attention (a token sees later tokens too), absolute positions, token type 0, post-norm
    LayerNorms, exact GELU: a BertModel vs transformers, pooled as sentence-transformers would."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine.llm import LLM
    hf = make_bert_dir(str(tmp_path), seed=9, pooling=pooling, normalize=bool(normalize), act=act)
    m = LLM(str(tmp_path), num_blocks=32, block_size=16, max_num_batched_tokens=64)
    try:
        assert m.engine.task == "embed"
        outs = m.embed(PROMPTS)
        how, norm = (pooling, normalize) if pooling is not None else ("cls", True)     # vLLM's BERT default
        for p, o in zip(PROMPTS, outs):
            _close(o.outputs.embedding, st_embed(hf, p, how, norm))
        # bidirectional: changing the last token changes the first token's (CLS) state
        a = m.embed([[5, 6, 7, 8]])[0].outputs.embedding
        b = m.embed([[5, 6, 7, 9]])[0].outputs.embedding
        if how == "cls":
            assert a != b
        alone = [m.embed([p])[0].outputs.embedding for p in PROMPTS]
        assert alone == [o.outputs.embedding for o in outs]
    finally:
        m.close()
