"""llguidance vs xgrammar on this machine: import cost, tokenizer build, JSON-schema compile, per-token mask time.

    .venv/bin/python perf/compare_grammar_engines.py llg      # llguidance (the engine's choice)
    .venv/bin/python perf/compare_grammar_engines.py xgr      # xgrammar (pip install xgrammar; needs torch)

Each run is a fresh process (so the import is cold), with the embedded SmolLM2 tokenizer (49152 tokens):
the schema below is compiled, then a valid document encoded by our tokenizer is walked token by token,
timing the bitmask fill before each token. The numbers are in docs/ARCHITECTURE.md (Structured outputs).
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "llg"
    from engine.default_model import default_model_path
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_file(default_model_path())
    V = 49152
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer", "minimum": 0},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                               "kind": {"enum": ["a", "b", "c"]}},
              "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
    text = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["x", "yy", "zzz"], "kind": "b"})
    ids = tok.encode(text, add_special_tokens=False)
    t0 = time.perf_counter()
    ts = []
    if which == "llg":
        import llguidance as llg
        import llguidance.numpy as lln
        t1 = time.perf_counter()
        lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=V, eos_token=tok.eos_token_id)
        t2 = time.perf_counter()
        g = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        m = llg.LLMatcher(lt, g)
        assert not m.is_error(), m.get_error()
        t3 = time.perf_counter()
        mask = lln.allocate_token_bitmask(1, V)
        for t in ids:
            a = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, 0)
            ts.append(time.perf_counter() - a)
            assert m.consume_token(t), m.get_error()
    else:
        import xgrammar as xgr
        t1 = time.perf_counter()
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V)
        comp = xgr.GrammarCompiler(info)
        t2 = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(cg)
        t3 = time.perf_counter()
        mask = xgr.allocate_token_bitmask(1, V)
        for t in ids:
            a = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            ts.append(time.perf_counter() - a)
            assert m.accept_token(t)
    print(f"{which}: import {t1 - t0:.3f}s tokenizer {t2 - t1:.3f}s schema compile {1000 * (t3 - t2):.1f}ms "
          f"mask mean {1e6 * np.mean(ts):.0f}us median {1e6 * np.median(ts):.0f}us max {1e6 * max(ts):.0f}us "
          f"over {len(ts)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
