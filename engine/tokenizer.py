"""Tokenizer: HF ``tokenizers`` built from a tokenizer.json or from a GGUF's vocabulary, plus chat
templates, stop ids and an incremental detokenizer.

Sources
-------
* ``tokenizer.json`` (+ ``tokenizer_config.json``: chat_template, bos/eos tokens, add_bos_token;
  ``chat_template.jinja``, else a processor's ``chat_template.json``, beside it when the config has no
  template). The ``tokenizers`` library runs any tokenizer.json as HF does, so no pre-tokenizer whitelist is
  needed there.
* A GGUF's ``tokenizer.ggml.*`` metadata, rebuilt into a ``tokenizers`` object the way llama.cpp
  (llama-vocab.cpp) tokenizes that file:

  - ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` + ``merges``. The text is
    split by the regex list llama.cpp uses for ``tokenizer.ggml.pre`` (each regex splits the pieces
    of the previous one, unmatched gaps kept: a ``Sequence`` of ``Split(..., "isolated")``), then
    mapped to the byte alphabet. An unknown pre name is refused by name -- a near-miss regex would
    tokenize silently wrong.
  - ``tokenizer.ggml.model == "llama"``: SentencePiece. llama.cpp merges adjacent pieces greedily by
    the *score of the merged piece* and falls back to ``<0xXX>`` byte tokens; that is a BPE whose
    merge ranks are ordered by score, with ``byte_fallback``. Spaces become ``▁`` and one ``▁`` is
    prepended to each run of text (after BOS / any special token), as llama.cpp's add_space_prefix.

  Token types: CONTROL (3) tokens become special added tokens (matched whole in text, skipped by
  ``skip_special_tokens``), USER_DEFINED (4) become plain added tokens (matched whole, decoded).

``encode(text, add_special_tokens=True)`` follows HF: special tokens written in the text are parsed
(a rendered chat template relies on it), and BOS/EOS are added as the tokenizer says. A chat prompt
rendered by ``render_chat`` is encoded with ``add_special_tokens=False`` (the template writes them).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from engine.errors import ChatTemplateError, ModelLoadError, TokenizerLoadError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPIECE_UNDERLINE = "\u2581"

# --- llama.cpp's pre-tokenizer regexes, keyed by tokenizer.ggml.pre ------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5/3.6: combining marks (\p{M}) stay inside letter runs.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION +
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# name -> (regex list, ignore_merges). ignore_merges: a pre-token that is itself in the vocabulary
# is taken whole (llama.cpp sets it for the Llama-3 and Tekken families).
GGUF_PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": (_DEFAULT, False),
    "gpt-2": ([_GPT2], False), "phi-2": ([_GPT2], False), "mpt": ([_GPT2], False),
    "olmo": ([_GPT2], False), "jais": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False), "starcoder": ([r"\p{N}", _GPT2], False),
    "refact": ([r"\p{N}", _GPT2], False), "command-r": ([r"\p{N}", _GPT2], False),
    "codeshell": ([r"\p{N}", _GPT2], False), "exaone": ([r"\p{N}", _GPT2], False),
    "llama3": ([_LLAMA3], True), "llama-v3": ([_LLAMA3], True), "llama-bpe": ([_LLAMA3], True),
    "falcon3": ([_LLAMA3], True), "pixtral": ([_LLAMA3], True),
    "dbrx": ([_LLAMA3], False), "smaug-bpe": ([_LLAMA3], False),
    "qwen2": ([_QWEN2], False), "deepseek-r1-qwen": ([_QWEN2], False), "stablelm2": ([_QWEN2], False),
    "megrez": ([_QWEN2], False),
    "qwen35": ([_QWEN35], False),
    "tekken": ([_TEKKEN], True),
    "gpt-4o": ([_GPT4O], False), "llama4": ([_GPT4O], False),
    "kanana2": ([_GPT4O], False), "talkie": ([_GPT4O], False),
    "deepseek-v3": (_DEEPSEEK3, False), "deepseek-coder": (_DEEPSEEK_CODER, False),
}


# ==================================================================================== Tokenizer

class Tokenizer:
    """A loaded tokenizer: ids <-> text, special tokens, chat template.

    Build with ``Tokenizer.from_file`` (tokenizer.json or .gguf), ``from_pretrained_dir``,
    ``from_tokenizer_json`` or ``from_gguf``. ``backend`` is the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, backend, *, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 chat_template: str | dict | None = None, chat_template_source: str | None = None,
                 extra_special_ids: Iterable[int] = ()):
        self.backend = backend
        self.source = source
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._id_or_none(bos_token)
        self.eos_token_id = self._id_or_none(eos_token)
        self.pad_token_id = self._id_or_none(pad_token)
        self.unk_token_id = self._id_or_none(unk_token)
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source
        self._compiled_templates: dict[str, Any] = {}

        # What add_special_tokens=True adds, as the backend's post-processor does it...
        bare = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        prefix, suffix = _split_around(full, bare)
        # ...unless the tokenizer config states add_bos_token / add_eos_token explicitly.
        if add_bos_token is not None and self.bos_token_id is not None:
            has = bool(prefix) and prefix[0] == self.bos_token_id
            if add_bos_token and not has:
                prefix = [self.bos_token_id] + prefix
            elif not add_bos_token and has:
                prefix = prefix[1:]
        if add_eos_token is not None and self.eos_token_id is not None:
            has = bool(suffix) and suffix[-1] == self.eos_token_id
            if add_eos_token and not has:
                suffix = suffix + [self.eos_token_id]
            elif not add_eos_token and has:
                suffix = suffix[:-1]
        self._prefix, self._suffix = prefix, suffix

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
                       if i is not None)
        special.update(extra_special_ids)
        self.special_token_ids: frozenset[int] = frozenset(special)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer_config: str | os.PathLike | None = None) -> "Tokenizer":
        """A tokenizer.json, a .gguf, or a model directory (tokenizer.json, else its single .gguf)."""
        path = Path(path)
        if path.is_dir():
            return cls.from_pretrained_dir(path, tokenizer_config)
        if not path.exists():
            raise TokenizerLoadError("file not found", path=path)
        if path.suffix.lower() == ".gguf":
            return cls.from_gguf(path, tokenizer_config=tokenizer_config)
        return cls.from_tokenizer_json(path, tokenizer_config=tokenizer_config)

    @classmethod
    def from_pretrained_dir(cls, directory: str | os.PathLike,
                            tokenizer_config: str | os.PathLike | None = None) -> "Tokenizer":
        directory = Path(directory)
        tj = directory / "tokenizer.json"
        if tj.is_file():
            return cls.from_tokenizer_json(tj, tokenizer_config=tokenizer_config)
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) == 1:
            return cls.from_gguf(ggufs[0], tokenizer_config=tokenizer_config)
        raise TokenizerLoadError("no tokenizer.json (and not exactly one .gguf) in the model directory",
                                 path=tj)

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike,
                            tokenizer_config: str | os.PathLike | None = None) -> "Tokenizer":
        """Load tokenizer.json; read tokenizer_config.json (the override, else the sibling file)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise TokenizerLoadError("tokenizer.json not found", path=path)
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON / unknown types
            raise TokenizerLoadError(f"cannot load tokenizer: {exc}", path=path) from None
        cfg_path = Path(tokenizer_config) if tokenizer_config else path.with_name("tokenizer_config.json")
        cfg = _read_json(cfg_path, required=tokenizer_config is not None)
        template, template_src = _template_from_config(cfg, cfg_path)
        if template is None and (path.parent / "chat_template.jinja").is_file():
            tpl = path.parent / "chat_template.jinja"
            template, template_src = tpl.read_text(encoding="utf-8"), str(tpl)
        if template is None and (path.parent / "chat_template.json").is_file():
            # vision-language repos (llava-hf) keep their processor's template there: {"chat_template": "..."}
            tpl = path.parent / "chat_template.json"
            template, template_src = _template_from_config(_read_json(tpl, required=False), tpl)
        # Fallback ids from config.json when the tokenizer config names no bos/eos token.
        model_cfg = _read_json(path.with_name("config.json"), required=False)
        bos = _token_content(cfg.get("bos_token")) or _token_for_id(backend, model_cfg.get("bos_token_id"))
        eos = _token_content(cfg.get("eos_token")) or _token_for_id(backend, model_cfg.get("eos_token_id"))
        return cls(backend, source=str(path), bos_token=bos, eos_token=eos,
                   pad_token=_token_content(cfg.get("pad_token")), unk_token=_token_content(cfg.get("unk_token")),
                   add_bos_token=cfg.get("add_bos_token"), add_eos_token=cfg.get("add_eos_token"),
                   chat_template=template, chat_template_source=template_src)

    @classmethod
    def from_gguf(cls, reader_or_path: Any, *, path: str | os.PathLike | None = None,
                  tokenizer_config: str | os.PathLike | None = None) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF's ``tokenizer.ggml.*`` metadata describes (see module doc).

        ``reader_or_path`` is a ``gguf.GGUFReader`` (reused, e.g. by the loader) or a file path.
        """
        if isinstance(reader_or_path, (str, os.PathLike)):
            from engine.loader import open_gguf
            path = Path(reader_or_path)
            reader = open_gguf(path)
        else:
            reader = reader_or_path
        path = str(path or getattr(reader.data, "filename", "<gguf>"))
        meta = _GGUFTokenizerMeta(reader, path)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerLoadError("the file has no tokenizer (tokenizer.ggml.model is missing)",
                                     path=path, key="tokenizer.ggml.model")
        tokens = meta.strings("tokenizer.ggml.tokens")
        if tokens is None:
            raise TokenizerLoadError("tokenizer.ggml.tokens is missing", path=path, key="tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
        if len(set(tokens)) != len(tokens):
            raise TokenizerLoadError("tokenizer.ggml.tokens contains duplicate tokens", path=path,
                                     key="tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerLoadError(f"{len(types)} token types for {len(tokens)} tokens", path=path,
                                     key="tokenizer.ggml.token_type")

        if model == "gpt2":
            backend = _build_gguf_bpe(meta, tokens, types, path)
            add_bos_default = meta.get("tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                                                   "pixtral", "tekken", "chameleon")
            default_bos = default_eos = 11          # llama.cpp's defaults for a gpt2 vocabulary
            default_unk = None
        elif model == "llama":
            backend = _build_gguf_spm(meta, tokens, types, path)
            add_bos_default = True
            default_bos, default_eos, default_unk = 1, 2, 0
        else:
            raise TokenizerLoadError(f"unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')",
                                     path=path, key="tokenizer.ggml.model")

        def tok(key, default):
            i = meta.get(key, default)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos = tok("tokenizer.ggml.bos_token_id", default_bos)
        eos = tok("tokenizer.ggml.eos_token_id", default_eos)
        unk = tok("tokenizer.ggml.unknown_token_id", default_unk)
        pad = tok("tokenizer.ggml.padding_token_id", None)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        template = meta.get("tokenizer.chat_template")
        template_src = f"{path}:tokenizer.chat_template" if template is not None else None
        named = {k.rsplit(".", 1)[1]: meta.get(k) for k in meta.keys() if k.startswith("tokenizer.chat_template.")}
        if named:
            template = dict(named, **({"default": template} if template is not None else {}))
        if tokenizer_config:
            cfg_path = Path(tokenizer_config)
            cfg = _read_json(cfg_path, required=True)
            t, src = _template_from_config(cfg, cfg_path)
            if t is not None:
                template, template_src = t, src
            bos = _token_content(cfg.get("bos_token")) or bos
            eos = _token_content(cfg.get("eos_token")) or eos
            pad = _token_content(cfg.get("pad_token")) or pad
            unk = _token_content(cfg.get("unk_token")) or unk
            add_bos = cfg.get("add_bos_token", add_bos)
            add_eos = cfg.get("add_eos_token", add_eos)
        # The GGUF's own flags are authoritative: state them explicitly (no post-processor here).
        control = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
        return cls(backend, source=path, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
                   add_bos_token=bool(add_bos), add_eos_token=bool(add_eos), chat_template=template,
                   chat_template_source=template_src, extra_special_ids=control)

    # ------------------------------------------------------------------ ids <-> text

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (model vocab + added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def add_bos_token(self) -> bool:
        return bool(self._prefix) and self._prefix[0] == self.bos_token_id

    @property
    def add_eos_token(self) -> bool:
        return bool(self._suffix) and self._suffix[-1] == self.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            return self._prefix + ids + self._suffix
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        out = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens:
            out = [self._prefix + ids + self._suffix for ids in out]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat templates

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render a conversation with the model's chat template (HF's conventions).

        The template sees ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``,
        ``eos_token``, ``unk_token``, ``pad_token`` and any ``kwargs`` (e.g. ``enable_thinking``),
        plus the globals ``raise_exception`` and ``strftime_now`` and the ``tojson`` filter.
        A named-template dict uses ``tool_use`` when tools are given and present, else ``default``.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template; pass one with --tokenizer-config",
                                    source=self.source)
        name, text = _select_template(self.chat_template, tools, self.chat_template_source or self.source)
        source = self.chat_template_source or self.source
        if isinstance(self.chat_template, dict):
            source = f"{source} [{name}]"
        template = self._compiled_templates.get(name)
        if template is None:
            template = self._compiled_templates[name] = _compile_template(text, source)
        context = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                       unk_token=self.unk_token or "", pad_token=self.pad_token or "")
        context.update(kwargs)
        context.update(messages=list(messages), tools=list(tools) if tools is not None else None,
                       add_generation_prompt=add_generation_prompt)
        import jinja2

        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}", source=source) from None
        except Exception as exc:
            raise ChatTemplateError(f"rendering failed: {type(exc).__name__}: {exc}", source=source) from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools=None, **kwargs) -> list[int]:
        """``render_chat`` then encode without adding BOS/EOS (the template writes them)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **kwargs),
                           add_special_tokens=False)


def _split_around(full: list[int], bare: list[int]) -> tuple[list[int], list[int]]:
    """(prefix, suffix) such that full == prefix + bare + suffix."""
    n = len(bare)
    for start in range(len(full) - n + 1):
        if full[start:start + n] == bare:
            return full[:start], full[start + n:]
    return [], []     # a post-processor that rewrites the ids: do not guess


# ==================================================================================== GGUF builders

class _GGUFTokenizerMeta:
    """Metadata access for the tokenizer keys of a GGUFReader, with errors naming the file."""

    def __init__(self, reader, path: str):
        self._fields = reader.fields
        self.path = path

    def keys(self):
        return self._fields.keys()

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception as exc:
            raise TokenizerLoadError(f"cannot read metadata value: {exc}", path=self.path, key=key) from None
        return value.item() if hasattr(value, "item") else value

    def strings(self, key: str) -> list[str] | None:
        field = self._fields.get(key)
        if field is None:
            return None
        try:
            # Decode bytes ourselves: a token that is not valid UTF-8 on its own (a lone byte of a
            # multi-byte character) must not abort the load.
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        except Exception as exc:
            raise TokenizerLoadError(f"cannot read string array: {exc}", path=self.path, key=key) from None


def _build_gguf_bpe(meta: _GGUFTokenizerMeta, tokens: list[str], types: list[int], path: str):
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    pre_tokenizer, ignore_merges = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    merges_raw = meta.strings("tokenizer.ggml.merges")
    if merges_raw is None:
        raise TokenizerLoadError("a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges", path=path,
                                 key="tokenizer.ggml.merges")
    merges = []
    for i, m in enumerate(merges_raw):
        cut = m.find(" ", 1)          # llama.cpp: the first space after the first character
        if cut < 0:
            raise TokenizerLoadError(f"merge #{i} {m!r} has no space separator", path=path,
                                     key="tokenizer.ggml.merges")
        merges.append((m[:cut], m[cut + 1:]))
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False,
                           byte_fallback=False)
    except Exception as exc:
        raise TokenizerLoadError(f"cannot build the BPE model: {exc}", path=path,
                                 key="tokenizer.ggml.merges") from None
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, types, AddedToken)
    return backend


def gguf_pre_tokenizer(pre: str, path: str = "<gguf>"):
    """(``tokenizers`` pre-tokenizer, ignore_merges) for a GGUF ``tokenizer.ggml.pre`` name.

    Unknown names are refused by name: aliasing them onto a near-miss regex would tokenize wrong.
    """
    from tokenizers import Regex, pre_tokenizers

    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerLoadError(
            f"unrecognized pre-tokenizer {pre!r} (tokenizer.ggml.pre); accepted: "
            f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))}", path=path, key="tokenizer.ggml.pre")
    regexes, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
    seq = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return seq, ignore_merges


def _build_gguf_spm(meta: _GGUFTokenizerMeta, tokens: list[str], types: list[int], path: str):
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerLoadError("a llama (SentencePiece) vocabulary needs one score per token",
                                 path=path, key="tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = spm_merges_from_scores(tokens, scores, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = HFTokenizer(model)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPIECE_UNDERLINE)]
    if add_space_prefix:
        # Normalizers run on each stretch of text between special tokens, so this prepends "▁"
        # at the start and after every special token, as llama.cpp does.
        steps.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    backend.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    _add_gguf_special_tokens(backend, tokens, types, AddedToken)
    return backend


def spm_merges_from_scores(tokens: Sequence[str], scores: Sequence[float],
                           types: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece/llama.cpp's score-greedy piece merging.

    Every way to cut a mergeable piece into two pieces of the vocabulary is a merge; merges are
    ranked by the score of the piece they produce, best first (ties: lower piece id first).
    Control, byte and unknown pieces are never produced by merging.
    """
    skip = {TOKEN_CONTROL, TOKEN_BYTE, TOKEN_UNKNOWN}
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if len(piece) < 2 or (types is not None and types[i] in skip):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = ids.get(left), ids.get(right)
            if li is None or ri is None:
                continue
            if types is not None and (types[li] in skip or types[ri] in skip):
                continue
            ranked.append((-float(scores[i]), i, li, ri))
    ranked.sort()
    return [(tokens[li], tokens[ri]) for _, _, li, ri in ranked]


def _add_gguf_special_tokens(backend, tokens, types, AddedToken) -> None:
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    n_before = backend.get_vocab_size(with_added_tokens=True)
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    # Every added token is already in the vocabulary: adding must not grow it.
    assert backend.get_vocab_size(with_added_tokens=True) == n_before


# ==================================================================================== chat templates

def _template_from_config(cfg: Mapping[str, Any], cfg_path: Path) -> tuple[Any, str | None]:
    t = cfg.get("chat_template")
    if t is None:
        return None, None
    if isinstance(t, list):          # [{"name": "default", "template": "..."}, ...]
        try:
            t = {d["name"]: d["template"] for d in t}
        except (TypeError, KeyError):
            raise ChatTemplateError("chat_template list entries need 'name' and 'template'",
                                    source=str(cfg_path)) from None
    elif not isinstance(t, str):
        raise ChatTemplateError(f"chat_template must be a string or a list, got {type(t).__name__}",
                                source=str(cfg_path))
    return t, f"{cfg_path}:chat_template"


def _select_template(template: str | dict, tools, source: str) -> tuple[str, str]:
    if isinstance(template, str):
        return "default", template
    if tools is not None and "tool_use" in template:
        return "tool_use", template["tool_use"]
    if "default" in template:
        return "default", template["default"]
    raise ChatTemplateError(f"no 'default' template among {sorted(template)}", source=source)


def _compile_template(text: str, source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text); renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise ChatTemplateError(str(message), source=source)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's tojson: no HTML escaping, unicode kept (jinja's own filter escapes <, >, &, ').
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"syntax error at line {exc.lineno}: {exc.message}", source=source) from None


# ==================================================================================== stop ids

def stop_token_ids(config_json: str | os.PathLike | Mapping | None,
                   generation_config_json: str | os.PathLike | Mapping | None = None) -> list[int]:
    """The ids that end a generation: config.json's eos_token_id (int or list) first, then the
    ids generation_config.json's eos_token_id adds (usually a superset), without duplicates.

    Mirrors vLLM's ``--generation-config auto``. A missing or malformed generation_config.json is a
    silent no-op; an unreadable config.json path is a ModelLoadError.
    """
    primary: Any = None
    if isinstance(config_json, Mapping):
        cfg = config_json
    elif config_json is not None:
        cfg = _read_json(Path(config_json), required=False, strict=True)
    else:
        cfg = {}
    primary = cfg.get("eos_token_id")
    if primary is None and isinstance(cfg.get("text_config"), Mapping):
        primary = cfg["text_config"].get("eos_token_id")

    secondary: Any = None
    try:
        if isinstance(generation_config_json, Mapping):
            secondary = generation_config_json.get("eos_token_id")
        elif generation_config_json is not None:
            p = Path(generation_config_json)
            if p.is_file():
                data = json.loads(p.read_text(encoding="utf-8"))
                if isinstance(data, Mapping):
                    secondary = data.get("eos_token_id")
    except (OSError, ValueError):
        secondary = None

    out: list[int] = []
    for value in (primary, secondary):
        for i in _ids(value):
            if i not in out:
                out.append(i)
    return out


def _ids(value) -> list[int]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ==================================================================================== detokenizer

# How many already-emitted tokens are re-decoded with each new one. Context is needed because a
# token's text can depend on its neighbours (SentencePiece's leading-space strip, byte pieces).
_DETOK_CONTEXT = 5


try:
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:                      # an older tokenizers: the window decode alone
    _HFTokenizer = _DecodeStream = None


def _is_hf_tokenizer(backend) -> bool:
    return _HFTokenizer is not None and isinstance(backend, _HFTokenizer)


class IncrementalDetokenizer:
    """Turn ids arriving one at a time into text deltas, as vLLM's ``detokenize_incrementally``.

    ``add(id) -> str`` returns the new text (possibly ""). A delta never ends inside a UTF-8
    sequence: while the decoded window ends in U+FFFD (an incomplete byte sequence) the text is held
    back until the bytes that complete it arrive. ``prompt_ids`` (optional) give the context the
    first generated token is decoded in. ``flush()`` returns whatever is still held back (with
    replacement characters) at the end of a stream. ``text`` is everything emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-(_DETOK_CONTEXT + 1):]) if prompt_ids else []
        self.prefix_offset = max(len(self.ids) - _DETOK_CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.text = ""
        # The same algorithm runs in the tokenizers library (DecodeStream: one call per token instead of two
        # decodes of the window from Python, ~3.5x less time a token), primed with the prompt's context. A
        # context that ends inside a UTF-8 sequence stays on the Python path: DecodeStream would emit that
        # partial character of the prompt with the first new token, which the window decode leaves out.
        self._stream = None
        if _DecodeStream is not None and _is_hf_tokenizer(tokenizer.backend) and not (
                self.ids and self._decode(self.ids).endswith("\ufffd")):
            stream = _DecodeStream(skip_special_tokens=skip_special_tokens)
            try:
                for t in self.ids:
                    stream.step(tokenizer.backend, t)
                self._stream = stream
            except Exception:       # see add()
                pass

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        delta = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self.tokenizer.backend, self.ids[-1]) or ""
            except Exception:       # the library gives up on some byte sequences: the window path goes on
                self._stream = None
            if delta is not None and "\ufffd" in delta:
                # invalid UTF-8 from the model: the two count its replacement characters differently, and the
                # window path is the reference (the rest of this stream stays on it)
                delta = self._stream = None
            if delta == "":
                return ""
        if delta is None:
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                return ""       # nothing new yet, or an incomplete UTF-8 sequence: wait for more bytes
            delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        # Keep the window short: only the context needs to stay.
        if self.prefix_offset > 4 * _DETOK_CONTEXT:
            cut = self.prefix_offset
            del self.ids[:cut]
            self.prefix_offset -= cut
            self.read_offset -= cut
        self.text += delta
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Text still held back (e.g. a stream that stopped inside a multi-byte character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._stream = None                 # it still holds the flushed bytes: any later id takes the window path
        self.text += delta
        return delta


# ==================================================================================== helpers

def _read_json(path: Path, required: bool, strict: bool = False) -> dict:
    """Parse a JSON object file. Missing: {} unless required. Malformed: error if required/strict."""
    if not path.is_file():
        if required:
            raise TokenizerLoadError("file not found", path=path)
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if required or strict:
            raise ModelLoadError(f"cannot parse JSON: {exc}", path=path) from None
        return {}
    if not isinstance(data, dict):
        if required or strict:
            raise ModelLoadError("expected a JSON object", path=path)
        return {}
    return data


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        c = value.get("content")
        return c if isinstance(c, str) else None
    return None


def _token_for_id(backend, value) -> str | None:
    ids = _ids(value)
    return backend.id_to_token(ids[0]) if ids else None
