"""Tokenizers from GGUF vocabularies and tokenizer.json, chat templates, stop ids, incremental detok.

Oracles are independent of engine/tokenizer.py: transformers' own GGUF tokenizer loader and chat
template code, a SentencePiece model trained here with the sentencepiece library, and the regex
tables transformers keeps for GGUF pre-tokenizer names.
"""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import gguf
import pytest

from engine.default_model import default_model_path
from engine.errors import ChatTemplateError, TokenizerLoadError
from engine.tokenizer import (GGUF_PRE_TOKENIZERS, IncrementalDetokenizer, Tokenizer, gguf_pre_tokenizer,
                              stop_token_ids)

SAMPLES = [
    "Hello world",
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "naïve café — 日本語のテキスト, Ελληνικά и русский",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 🤖",
    "Numbers: 12345, 3.14159, 1e-9, 2024-06-11, 1,000,000 and ½ ⅔",
    "   leading spaces\t\ttabs   and  runs  \n\n\n  trailing   ",
    "it's I'M we'll they've YOU'D don't",
    "x<y && y>z || a!=b; arr[i]+=1; {'k': \"v\"}",
    "zero\u200bwidth\u00a0nbsp\ufeffbom",
    "a" * 200 + " " + "ab" * 77,
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smol_reader():
    from engine.loader import open_gguf

    return open_gguf(default_model_path())


@pytest.fixture(scope="module")
def smol(smol_reader):
    return Tokenizer.from_gguf(smol_reader, path=default_model_path())


def _smol_with_config(reader, cfg: Path) -> Tokenizer:
    return Tokenizer.from_gguf(reader, path=default_model_path(), tokenizer_config=cfg)


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoTokenizer

    p = default_model_path()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


# ------------------------------------------------------------------------------- GGUF BPE (SmolLM2)

def test_embedded_tokenizer_facts(smol, smol_reader):
    assert smol.vocab_size == 49152
    assert (smol.bos_token, smol.bos_token_id, smol.eos_token, smol.eos_token_id) == \
        ("<|im_start|>", 1, "<|im_end|>", 2)
    assert smol.add_bos_token is False and smol.add_eos_token is False
    assert {0, 1, 2} <= smol.special_token_ids
    assert smol_reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert len(smol_reader.fields["tokenizer.ggml.merges"].data) == 48900


def _has_non_ascii_numeral(text: str) -> bool:
    import unicodedata

    return any(unicodedata.category(c).startswith("N") and not c.isascii() for c in text)


@pytest.fixture(scope="module")
def hf_smol_pipeline(hf_smol):
    """transformers' vocabulary and merges for the GGUF, with the pre-tokenizer of HF's own SmolLM2
    tokenizer.json (Digits(individual_digits) + ByteLevel) -- llama.cpp's "smollm" split."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    backend = HFTokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return backend


@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_bpe_matches_transformers(smol, hf_smol, hf_smol_pipeline, text):
    ids = smol.encode(text, add_special_tokens=False)
    assert ids == hf_smol_pipeline.encode(text, add_special_tokens=False).ids
    assert smol.encode(text) == ids                                  # add_bos_token is false
    if not _has_non_ascii_numeral(text):
        # transformers' GGUF loader has no regex for "smollm" and falls back to the plain GPT-2
        # split; that only agrees when the numerals are ASCII digits (the vocabulary has no merge
        # that joins a digit to anything, so isolating them changes nothing).
        assert ids == hf_smol.encode(text, add_special_tokens=False)
        assert smol.encode(text) == hf_smol.encode(text)


def test_non_ascii_numerals_are_isolated_as_llama_cpp_does(smol, hf_smol_pipeline):
    ids = smol.encode("and ½", add_special_tokens=False)
    assert smol.convert_ids_to_tokens(ids) == ["and", "Ġ", "Â½"]
    assert ids == hf_smol_pipeline.encode("and ½", add_special_tokens=False).ids


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trips(smol, hf_smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == text
    assert smol.decode(ids) == hf_smol.decode(ids)
    assert smol.decode(ids, skip_special_tokens=True) == hf_smol.decode(ids, skip_special_tokens=True)


def test_smollm_digits_are_split_one_by_one(smol):
    # llama.cpp's "smollm" pre-tokenizer isolates every \p{N} before the GPT-2 regex.
    digits = "90210"
    ids = smol.encode(digits, add_special_tokens=False)
    assert ids == [smol.token_to_id(d) for d in digits]


def test_special_tokens_in_text_are_parsed_whole(smol):
    ids = smol.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3


# ------------------------------------------------------------------------------- pre-tokenizer table

_PRE_SAMPLES = ["Hello, it's John's 12345th café!", "  x\n\n\ty  \r\n z", "ÀÉÎ naïve e\u0301 CamelCaseWORD don't",
                "数字 123 ４５６ 日本語 한국어", "a/b/c https://x.y/z?q=1&r=2", "WE'LL we'll 'S", "1234567 89"]


def test_pre_tokenizer_regexes_agree_with_transformers_table():
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    shared = sorted(set(GGUF_PRE_TOKENIZER_SPLITS) & set(GGUF_PRE_TOKENIZERS))
    assert {"llama-bpe", "qwen2", "qwen35", "gpt-4o", "llama4", "tekken"} <= set(shared)
    for name in shared:
        theirs = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[name]), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        ours, _ = gguf_pre_tokenizer(name)
        for text in _PRE_SAMPLES:
            assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text), (name, text)


@pytest.mark.parametrize("name,reference", [
    # HF's tokenizer.json pipelines for these families.
    ("gpt-2", "bytelevel"), ("smollm", "digits+bytelevel"), ("starcoder", "digits+bytelevel")])
def test_pre_tokenizer_matches_hf_pipeline(name, reference):
    from tokenizers import pre_tokenizers

    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if reference.startswith("digits"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    theirs = pre_tokenizers.Sequence(steps)
    ours, _ = gguf_pre_tokenizer(name)
    for text in _PRE_SAMPLES + SAMPLES:
        assert [p for p, _ in ours.pre_tokenize_str(text)] == [p for p, _ in theirs.pre_tokenize_str(text)], text


def _write_vocab_gguf(path: Path, pre: str | None, model: str = "gpt2") -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["<s>", "a", "b", "ab"])
    w.add_token_types([3, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_unrecognised_pre_tokenizer_is_refused_by_name(tmp_path):
    path = _write_vocab_gguf(tmp_path / "v.gguf", "not-a-real-pre")
    with pytest.raises(TokenizerLoadError) as info:
        Tokenizer.from_gguf(path)
    msg = str(info.value)
    assert "'not-a-real-pre'" in msg and "tokenizer.ggml.pre" in msg and str(path) in msg


def test_unknown_tokenizer_model_is_refused(tmp_path):
    path = _write_vocab_gguf(tmp_path / "m.gguf", "gpt-2", model="bert")
    with pytest.raises(TokenizerLoadError, match="'bert'"):
        Tokenizer.from_gguf(path)


# ------------------------------------------------------------------------------- GGUF SentencePiece

@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """A SentencePiece BPE model trained here, and the same vocabulary written as a GGUF the way
    llama.cpp's converter writes it (pieces, scores, token types)."""
    spm = pytest.importorskip("sentencepiece")
    rnd = random.Random(7)
    words = ("the quick brown fox jumps over lazy dog tokenizer piece merge score byte fallback "
             "llama model weights kernel compile python numpy").split()
    lines = [" ".join(rnd.choice(words) + rnd.choice(["", "s", "ed", "ing"]) for _ in range(12))
             + rnd.choice([".", "!", "?", ", 42."]) for _ in range(2000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=420,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=True,
                                   character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i)
             else 5 if sp.is_unused(i) else 1 for i in range(n)]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id()); w.add_eos_token_id(sp.eos_id()); w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return sp, Tokenizer.from_gguf(path)


SPM_SAMPLES = ["the quick brown fox", "  two  spaces  ", "jumps over the lazy dogs!", "tokenizing 12345 weights.",
               "emoji 😀 and 日本 (byte fallback)", "\n new line\tTab", "x", "kernelcompile", "QUICK Brown",
               "ïñţëŕñåţîöñåļ"]


@pytest.mark.parametrize("text", SPM_SAMPLES)
def test_gguf_sentencepiece_matches_sentencepiece(spm_pair, text):
    sp, tok = spm_pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)      # llama vocab: add_bos by default


def test_gguf_sentencepiece_byte_fallback_pieces(spm_pair):
    sp, tok = spm_pair
    ids = tok.encode("😀", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


# ------------------------------------------------------------------------------- incremental detok

def _run_detok(det: IncrementalDetokenizer, ids):
    return [det.add(i) for i in ids]


def test_incremental_detok_holds_back_split_emoji(smol):
    text = "Hi 😀👍🏽 naïve 日本 done"
    ids = smol.encode(text, add_special_tokens=False)
    # The emoji really is split across several byte-level tokens.
    assert any(smol.decode([i]).endswith("\ufffd") for i in ids)
    deltas = _run_detok(smol.detokenizer(), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas                       # something was held back ...
    for d in deltas:                          # ... and every delta is valid text on its own
        d.encode("utf-8")


def test_incremental_detok_skip_special_tokens(smol):
    ids = smol.encode("<|im_start|>assistant\nOK 👍<|im_end|>", add_special_tokens=False)
    assert "".join(_run_detok(smol.detokenizer(skip_special_tokens=True), ids)) == "assistant\nOK 👍"
    assert "".join(_run_detok(smol.detokenizer(skip_special_tokens=False), ids)) == \
        "<|im_start|>assistant\nOK 👍<|im_end|>"


def test_incremental_detok_flush_returns_an_incomplete_tail(smol):
    ids = smol.encode("ok 😀", add_special_tokens=False)
    det = smol.detokenizer()
    out = "".join(_run_detok(det, ids[:-1]))
    assert out == "ok"
    assert "\ufffd" in det.flush()


def test_incremental_detok_long_stream_matches_decode(smol):
    text = " ".join(SAMPLES[:10]) * 3
    ids = smol.encode(text, add_special_tokens=False)
    det = smol.detokenizer(skip_special_tokens=False)
    assert "".join(_run_detok(det, ids)) == smol.decode(ids) == det.text


def test_incremental_detok_sentencepiece_leading_space_uses_prompt_context(spm_pair):
    _, tok = spm_pair
    prompt = tok.encode("the quick brown", add_special_tokens=True)
    gen = tok.encode(" fox jumps", add_special_tokens=False)[1:]   # drop the "▁" of the dummy prefix
    assert tok.convert_ids_to_tokens(gen)[0].startswith("\u2581")
    with_ctx = "".join(_run_detok(tok.detokenizer(prompt_ids=prompt), gen))
    assert with_ctx == tok.decode(prompt + gen)[len(tok.decode(prompt)):]
    assert with_ctx.startswith(" ")


# ------------------------------------------------------------------------------- chat templates

CONVERSATION = [{"role": "user", "content": "What is 2+2? Answer with one word."},
                {"role": "assistant", "content": "Four."}]


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(smol, hf_smol, gen_prompt):
    ours = smol.render_chat(CONVERSATION, add_generation_prompt=gen_prompt)
    theirs = hf_smol.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen_prompt)
    assert ours == theirs
    with_system = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    assert smol.render_chat(with_system) == hf_smol.apply_chat_template(with_system, tokenize=False,
                                                                        add_generation_prompt=True)
    ids = hf_smol.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=gen_prompt)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert smol.encode_chat(CONVERSATION, add_generation_prompt=gen_prompt) == list(ids)


def _tokenizer_config(tmp_path: Path, template, **extra) -> Path:
    p = tmp_path / "tokenizer_config.json"
    p.write_text(json.dumps({"chat_template": template, **extra}))
    return p


def test_tokenizer_config_overrides_the_gguf_template(tmp_path, smol_reader):
    tpl = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
           "{% if tools %}TOOLS={{ tools | tojson }}{% endif %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
           "{{ extra_flag }}")
    cfg = _tokenizer_config(tmp_path, tpl, bos_token="<|endoftext|>")
    tok = _smol_with_config(smol_reader, cfg)
    assert tok.chat_template_source == f"{cfg}:chat_template"
    out = tok.render_chat(CONVERSATION, tools=[{"name": "f", "description": "ü"}], extra_flag="!")
    assert out == ("<|endoftext|>[USER] What is 2+2? Answer with one word.\n[ASSISTANT] Four.\n"
                   'TOOLS=[{"name": "f", "description": "ü"}][ASSISTANT]!')
    assert tok.bos_token_id == 0


def test_template_syntax_error_names_its_source(tmp_path, smol_reader):
    cfg = _tokenizer_config(tmp_path, "{% for m in messages %}{{ m['content'] }")
    tok = _smol_with_config(smol_reader, cfg)
    with pytest.raises(ChatTemplateError) as info:
        tok.render_chat(CONVERSATION)
    assert str(cfg) in str(info.value) and "syntax error" in str(info.value)


def test_raise_exception_names_its_source(tmp_path, smol_reader):
    cfg = _tokenizer_config(tmp_path, "{% if messages[0]['role'] != 'system' %}"
                                      "{{ raise_exception('first message must be system') }}{% endif %}")
    tok = _smol_with_config(smol_reader, cfg)
    with pytest.raises(ChatTemplateError, match="first message must be system") as info:
        tok.render_chat(CONVERSATION)
    assert str(cfg) in str(info.value)


def test_template_is_sandboxed(tmp_path, smol_reader):
    cfg = _tokenizer_config(tmp_path, "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    tok = _smol_with_config(smol_reader, cfg)
    with pytest.raises(ChatTemplateError):
        tok.render_chat(CONVERSATION)
    cfg = _tokenizer_config(tmp_path, "{% set x = messages.append({'role': 'x'}) %}")
    with pytest.raises(ChatTemplateError):
        _smol_with_config(smol_reader, cfg).render_chat(CONVERSATION)


def test_gguf_template_error_names_the_gguf(smol):
    with pytest.raises(ChatTemplateError) as info:
        smol.render_chat([{"role": "user"}])      # the template reads message['content']
    assert str(default_model_path()) in str(info.value) and "tokenizer.chat_template" in str(info.value)


# ------------------------------------------------------------------------------- tokenizer.json

def test_tokenizer_json_with_config_matches_transformers(tmp_path, smol):
    from transformers import AutoTokenizer

    d = tmp_path / "tj"
    d.mkdir()
    smol.backend.save(str(d / "tokenizer.json"))
    tpl = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": True, "chat_template": tpl, "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours = Tokenizer.from_file(d)
    theirs = AutoTokenizer.from_pretrained(str(d))
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2 and ours.add_bos_token
    for text in SAMPLES[:8]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == [1] + ours.encode(text, add_special_tokens=False)
    assert ours.render_chat(CONVERSATION) == theirs.apply_chat_template(CONVERSATION, tokenize=False)


def test_tokenizer_config_added_token_dicts_and_add_bos_false(tmp_path, smol):
    d = tmp_path / "tj2"
    d.mkdir()
    smol.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>"},
        "eos_token": {"content": "<|endoftext|>", "special": True}, "add_bos_token": False}))
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_file(d / "tokenizer.json")
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 0, False)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.render_chat(CONVERSATION) == CONVERSATION[0]["content"] + "!"
    assert tok.chat_template_source == str(d / "chat_template.jinja")


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerLoadError) as info:
        Tokenizer.from_file(tmp_path)
    assert "tokenizer.json" in str(info.value)


# ------------------------------------------------------------------------------- stop ids

def test_stop_ids_merge_config_and_generation_config(tmp_path):
    cfg, gen = tmp_path / "config.json", tmp_path / "generation_config.json"
    cfg.write_text(json.dumps({"eos_token_id": [1, 106]}))
    gen.write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    assert stop_token_ids(cfg, gen) == [1, 106, 50]
    cfg.write_text(json.dumps({"eos_token_id": 7}))
    gen.write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(cfg, gen) == [7, 9]
    gen.write_text("{not json")
    assert stop_token_ids(cfg, gen) == [7]                      # malformed: silent no-op
    assert stop_token_ids(cfg, tmp_path / "absent.json") == [7]  # missing: silent no-op
    assert stop_token_ids({"text_config": {"eos_token_id": [3]}}, {"eos_token_id": [4, 3]}) == [3, 4]
    assert stop_token_ids(None, None) == []


# ------------------------------------------------------------------------------- the tokenize tool

def test_tokenize_tool_prints_ids_and_count(tmp_path, capsys, smol):
    from engine.tokenize import main

    corpus = tmp_path / "corpus.txt"
    text = "\n".join(SAMPLES[:6])
    corpus.write_text(text, encoding="utf-8")
    assert main([str(default_model_path()), str(corpus)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = smol.encode(text, add_special_tokens=False)
    assert lines[0] == " ".join(map(str, ids))
    assert lines[1] == f"count: {len(ids)}"


def test_tokenize_tool_refuses_unknown_pre_by_name(tmp_path, capsys):
    from engine.tokenize import main

    path = _write_vocab_gguf(tmp_path / "bad.gguf", "llama-bpe-ish")
    corpus = tmp_path / "c.txt"
    corpus.write_text("ab")
    assert main([str(path), str(corpus)]) == 2
    assert "'llama-bpe-ish'" in capsys.readouterr().err


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detok_stream_equals_the_window_decode(smol, spm_pair, skip):
    # the DecodeStream path (one library call a token) gives the window algorithm's deltas token for token, on
    # random ids after random prompt contexts (contexts that end inside a character included), for a byte-level
    # BPE and a SentencePiece tokenizer
    import random
    rng = random.Random(11)
    for tok in (smol, spm_pair[1]):
        V = tok.vocab_size
        for _ in range(60):
            ids = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
            prompt = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
            fast = tok.detokenizer(skip_special_tokens=skip, prompt_ids=prompt)
            slow = tok.detokenizer(skip_special_tokens=skip, prompt_ids=prompt)
            slow._stream = None
            assert [fast.add(i) for i in ids] == [slow.add(i) for i in ids], (ids, prompt)
            assert fast.flush() == slow.flush() and fast.text == slow.text
    assert smol.detokenizer()._stream is not None
