"""Tokenizer smoke tool: ``python -m engine.tokenize <tokenizer.json | model.gguf | model-dir> FILE``.

Encodes FILE (UTF-8 text; ``-`` reads stdin) and prints the token ids on one line, space-separated,
then ``count: N``. Timing and the tokenizer's identity go to stderr. A GGUF whose
``tokenizer.ggml.pre`` is not recognised is refused by name.
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.errors import ChatTemplateError, ModelLoadError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tokenize", description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer", help="tokenizer.json, a .gguf file, or a model directory")
    ap.add_argument("file", help="UTF-8 text file to tokenize ('-' for stdin)")
    ap.add_argument("--add-special-tokens", action="store_true",
                    help="add BOS/EOS as the tokenizer would for a prompt (default: off)")
    ap.add_argument("--tokenizer-config", default=None, help="override tokenizer_config.json")
    ap.add_argument("--tokens", action="store_true", help="also print the token strings, one per line")
    args = ap.parse_args(argv)

    from engine.tokenizer import Tokenizer

    t0 = time.perf_counter()
    try:
        tok = Tokenizer.from_file(args.tokenizer, tokenizer_config=args.tokenizer_config)
    except (ModelLoadError, ChatTemplateError) as exc:
        print(f"tokenize: {exc}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"tokenize: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    ids = tok.encode(text, add_special_tokens=args.add_special_tokens)
    t2 = time.perf_counter()
    print(" ".join(map(str, ids)))
    print(f"count: {len(ids)}")
    if args.tokens:
        for i, piece in zip(ids, tok.convert_ids_to_tokens(ids)):
            print(f"{i}\t{piece!r}")
    print(f"tokenize: {tok.source}: vocab {tok.vocab_size}, load {t1 - t0:.3f} s, "
          f"encode {len(text)} chars in {t2 - t1:.3f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
