"""Speculative decoding (engine/spec_decode.py): config parsing, n-gram lookup against a brute-force
reference, bit-identical logits of verified vs decoded tokens, greedy token identity with speculation off
(embedded SmolLM2 and tiny random models, n-gram and draft-model drafts), rejection sampling against exact
distributions, metrics."""
import functools

import numpy as np
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec_decode import (SpeculativeConfig, SpeculativeConfigError, ngram_lookup, ngram_propose,
                                rejection_sample, target_probs)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ------------------------------------------------------------------------------------------ config
def test_config_parses_vllm_json_and_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 4)


@pytest.mark.parametrize("value, field", [
    ("{not json", None),
    ("[1, 2]", None),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/no/such/model.gguf", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse(value)
    assert e.value.field == field
    if field:
        assert field in str(e.value)


# ------------------------------------------------------------------------------------------ n-gram
def _ngram_ref(tokens, lo, hi, k):
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):          # most recent earlier occurrence
            if tokens[start:start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_matches_brute_force():
    rng = np.random.default_rng(0)
    checked = hits = 0
    for trial in range(600):
        L = int(rng.integers(1, 60))
        toks = rng.integers(0, int(rng.integers(2, 6)), L).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        got = ngram_propose(np.array(toks), lo, hi, k).tolist()
        want = _ngram_ref(toks, lo, hi, k)
        assert got == want, (toks, lo, hi, k)
        checked += 1
        hits += bool(want)
    assert hits > 100 and checked - hits > 20        # both outcomes exercised


def _anchored_ref(tokens, lo, hi, anchor, window):
    """Brute force: the longest suffix n-gram with an occurrence that is near the anchor (continuation in
    [anchor, anchor + window): the first such) or, for n >= lo, any (the most recent); -1: none."""
    L = len(tokens)
    for n in range(min(hi, L - 1), 0, -1):
        suffix = tokens[L - n:]
        starts = [s for s in range(0, L - n) if tokens[s:s + n] == suffix]     # earlier occurrences
        near = [s + n for s in starts if anchor <= s + n < anchor + window]
        if near:
            return near[0]
        if n >= lo and starts:
            return starts[-1] + n
    return -1


def test_ngram_anchored_lookup_matches_brute_force():
    rng = np.random.default_rng(1)
    near_wins = 0
    for trial in range(800):
        L = int(rng.integers(1, 50))
        toks = rng.integers(0, int(rng.integers(2, 7)), L).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        anchor = int(rng.integers(0, L + 3))
        window = int(rng.integers(1, 10))
        got = ngram_lookup(np.array(toks), lo, hi, anchor, window)
        want = _anchored_ref(toks, lo, hi, anchor, window)
        assert got == want, (toks, lo, hi, anchor, window)
        plain = ngram_lookup(np.array(toks), lo, hi)
        near_wins += got != plain
    assert near_wins > 100                          # the anchor changed the answer often


def test_ngram_reanchors_after_a_corrected_word():
    """A source 'A B the x D E the y F G' copied with B corrected to Z: after 'A Z the' no 2-gram matches, the
    plain 1-gram lookup continues from the most recent 'the' (-> 'y F G'), the anchored one from where the copy
    was (-> 'x D E')."""
    A, B, THE, X, D, E, Y, F, G, Z = range(10, 20)
    src = [A, B, THE, X, D, E, THE, Y, F, G]
    toks = np.array(src + [A, Z, THE])
    # the last drafts were copied from right after 'A' (position 1) when the tokens ended at that 'A'; the
    # anchor moved on by one per token emitted since ('Z', 'the')
    anchor = 1 + 2
    assert ngram_propose(toks, 2, 4, 3).tolist() == []
    assert ngram_propose(toks, 1, 4, 3).tolist() == [Y, F, G]
    assert ngram_propose(toks, 2, 4, 3, anchor=anchor).tolist() == [X, D, E]
    assert ngram_propose(toks, 2, 4, 3, anchor=anchor + 8).tolist() == []         # out of the window


def test_draft_levels_adapt_to_acceptance():
    from engine.spec_decode import START_LEVEL, _DraftState
    st = _DraftState(level=min(7, START_LEVEL))
    seen = [st.level]
    for drafted, accepted in [(3, 3), (7, 7), (7, 7), (7, 2), (1, 1), (3, 0), (1, 0), (1, 1), (0, 0), (3, 3)]:
        st.update(drafted, accepted, 7)
        seen.append(st.level)
    # all accepted: 2l + 1 up to k; a rejection: back to 1; no drafts (no match): unchanged
    assert seen == [3, 7, 7, 7, 1, 3, 1, 1, 3, 3, 7]
    st.update(3, 3, 5)
    assert st.level == 5                            # capped at num_speculative_tokens
    # backoff "halve": a rejection steps one level down (15 -> 7 -> 3 -> 1) instead of back to 1
    st = _DraftState(level=3)
    seen = [st.level]
    for drafted, accepted in [(3, 3), (7, 7), (15, 4), (7, 0), (3, 3), (7, 6), (3, 1), (1, 0), (1, 0)]:
        st.update(drafted, accepted, 15, "halve")
        seen.append(st.level)
    assert seen == [3, 7, 15, 7, 3, 7, 3, 1, 1, 1]
    # backoff "keep": at least half the drafts accepted keeps the level, fewer step it down
    st = _DraftState(level=3)
    seen = [st.level]
    for drafted, accepted in [(3, 3), (7, 7), (15, 8), (15, 7), (7, 4), (7, 3), (3, 2), (3, 1), (1, 0), (1, 1)]:
        st.update(drafted, accepted, 15, "keep")
        seen.append(st.level)
    assert seen == [3, 7, 15, 15, 7, 7, 3, 3, 1, 1, 3]


def test_spec_backoff_setting(monkeypatch):
    """JITKERN_SPEC_BACKOFF picks the level after a rejection (default BACKOFF); anything else is refused
    naming the variable."""
    from types import SimpleNamespace
    from engine import spec_decode as sd
    cfg = sd.SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    eng = SimpleNamespace(max_model_len=64, config=SimpleNamespace(vocab_size=100), args=SimpleNamespace(seed=0))
    assert sd.SpecDecoder(cfg, eng).backoff == sd.BACKOFF
    monkeypatch.setenv("JITKERN_SPEC_BACKOFF", "halve")
    assert sd.SpecDecoder(cfg, eng).backoff == "halve"
    monkeypatch.setenv("JITKERN_SPEC_BACKOFF", "slow")
    with pytest.raises(ValueError, match="JITKERN_SPEC_BACKOFF"):
        sd.SpecDecoder(cfg, eng)


# -------------------------------------------------------------------------------- tiny random models
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tests.model_fixtures import tiny_model_dir
    return {arch: tiny_model_dir(tmp_path_factory, arch, arch.split("-")[0], seed=seed)[0]
            for arch, seed in (("llama", 3), ("gemma3", 4), ("llama-draft", 9))}


ENGINE = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
# prompts with repeats, so prompt lookup finds drafts (random models repeat themselves too)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23, 20, 21, 22, 23, 20],
           [100, 3, 100, 3, 100, 3, 7, 7, 7, 7], list(range(40, 70)) + list(range(40, 50))]


def _logit_log(llm, spec: bool) -> dict:
    """Records (request id, position) -> logits row of every token whose context is the true sequence."""
    eng = llm.engine
    log = {}
    if spec:
        orig = eng.spec.verify

        def verify(sched, result):
            out = orig(sched, result)
            by_id = sched.by_id()
            for rid, (r0, n) in result.spec_rows.items():
                s = by_id[rid]
                for j in range(len(out[rid].token_ids)):   # rows up to the first rejection see the true prefix
                    log[(rid, s.end - n + j)] = np.array(result.logits[r0 + j])
            return out
        eng.spec.verify = verify
    orig_sample = eng.sampler.sample

    def sample(sched, result):
        by_id = sched.by_id()
        for rid, row in result.sample_rows.items():
            log[(rid, by_id[rid].end - 1)] = np.array(result.logits[row])
        return orig_sample(sched, result)
    eng.sampler.sample = sample
    return log


def _run(path, prompts, params, spec=None, logits=False, **kw):
    with LLM(path, speculative_config=spec, **{**ENGINE, **kw}) as llm:
        log = _logit_log(llm, spec is not None) if logits else None
        outs = llm.generate(prompts, params)
        snap = llm.engine.metrics_snapshot()
    return [[o.token_ids for o in r.outputs] for r in outs], log, snap


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_verified_logits_are_bit_identical_to_decode_logits(tiny_models, arch):
    """The logits of a token computed in a 1 + k verification step (prefill attention kernel, GEMM) equal
    the ones from a single-token decode step (decode kernel, GEMV) bit for bit: the contexts cross block
    and flash-decoding partition boundaries (block_size 4: 16 blocks per partition = 64 tokens)."""
    sp = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, detokenize=False)
    for graphs in (True, False):
        base, log0, _ = _run(tiny_models[arch], PROMPTS, sp, logits=True, use_graphs=graphs)
        spec, log1, snap = _run(tiny_models[arch], PROMPTS, sp, spec=NGRAM, logits=True, use_graphs=graphs)
        assert spec == base
        assert snap["spec_decode_num_accepted_tokens"] > 20
        verified = [key for key in log1 if key in log0]
        assert len(verified) > 200
        for key in verified:
            np.testing.assert_array_equal(log1[key], log0[key], err_msg=str(key))


@pytest.mark.parametrize("adaptive", ["1", "0"])
def test_greedy_is_token_identical_with_mixed_requests(tiny_models, adaptive, monkeypatch):
    """Spec-eligible and ineligible requests (logprobs, penalties) in one batch, stop strings and
    stop ids, max_tokens that cut a draft short: token-identical to speculation off (adaptive drafting on
    and off)."""
    monkeypatch.setenv("JITKERN_SPEC_ADAPTIVE", adaptive)
    path = tiny_models["llama"]
    sps = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
           SamplingParams(max_tokens=33, temperature=0, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, repetition_penalty=1.3),
           SamplingParams(max_tokens=37, temperature=0, ignore_eos=True, stop_token_ids=[1, 2])]
    base, _, _ = _run(path, PROMPTS, sps)
    spec, _, snap = _run(path, PROMPTS, sps, spec={**NGRAM, "num_speculative_tokens": 7})
    assert spec == base
    assert snap["spec_decode_num_drafts"] > 0
    # stop strings / stop token ids found inside an accepted run of drafts end the output at the same token
    toks = base[0][0]
    stop_tok = toks[20]
    sp = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_tok]),
          SamplingParams(max_tokens=40, temperature=0, stop=[f"t{toks[18]} t{toks[19]}"])]
    with LLM(path, **ENGINE) as llm:
        b = llm.generate([PROMPTS[0]] * 2, sp)
    with LLM(path, speculative_config=NGRAM, **ENGINE) as llm:
        s = llm.generate([PROMPTS[0]] * 2, sp)
    for x, y in zip(b, s):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason == "stop"


def test_greedy_is_token_identical_on_the_device_path(tiny_models, fake_or_cuda):
    """Speculative decoding on the engine's device path (device arrays, staged inputs, the verification step
    run eagerly there; `fake`: the host-memory stand-in device, `cuda`: the GPU): greedy tokens equal
    speculation off on the same device, and drafts are accepted."""
    path = tiny_models["llama"]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, detokenize=False)
    base, _, _ = _run(path, PROMPTS, sp, device="cuda")
    spec, _, snap = _run(path, PROMPTS, sp, spec={**NGRAM, "num_speculative_tokens": 7}, device="cuda")
    assert spec == base
    assert snap["spec_decode_num_accepted_tokens"] > 20


def test_adaptive_draft_counts_follow_acceptance(tiny_models):
    """With adaptive drafting each request starts at START_LEVEL drafts, and the drafts of its next step are
    2l + 1 after a step that accepted all of its l drafts and, after a rejection, l // 2 (backoff "halve") or 1
    ("reset") (bounded by k and by what the lookup found); with it off every step asks for k. Tokens equal
    speculation off either way."""
    from engine.spec_decode import START_LEVEL
    path = tiny_models["llama"]
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, detokenize=False)
    base, _, _ = _run(path, PROMPTS, sp)
    k = 7
    for adaptive, backoff in ((True, "halve"), (True, "reset"), (False, "reset")):
        with LLM(path, speculative_config={**NGRAM, "num_speculative_tokens": k}, **ENGINE) as llm:
            spec = llm.engine.spec
            spec.adaptive = adaptive
            spec.backoff = backoff
            steps = {}                          # req_id -> [(level asked, drafts, accepted)]
            orig = spec.verify

            def verify(sched, result, orig=orig, spec=spec):
                asked = {rid: (spec._states[rid].level if adaptive else k) for rid in result.spec_rows}
                out = orig(sched, result)
                for rid, res in out.items():
                    steps.setdefault(rid, []).append((asked[rid], res.num_drafts, len(res.token_ids) - 1))
                return out
            spec.verify = verify
            outs = llm.generate(PROMPTS, sp)
        assert [[o.token_ids for o in r.outputs] for r in outs] == base
        rows = [s for v in steps.values() for s in v]
        assert len(rows) > 20
        if not adaptive:
            assert all(asked == k for asked, _, _ in rows)
            continue
        for v in steps.values():
            assert v[0][0] == min(k, START_LEVEL)
            for (asked, nd, acc), (nxt, _, _) in zip(v, v[1:]):
                assert nd <= asked
                assert nxt == (min(k, 2 * asked + 1) if acc == nd else
                               max(1, asked // 2) if backoff == "halve" else 1)
        assert {a for a, _, _ in rows} >= {1, 3, 7}       # every level was visited


def test_draft_model_greedy_is_token_identical(tiny_models):
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, detokenize=False)
    base, _, _ = _run(tiny_models["llama"], PROMPTS, sp)
    # the target as its own draft accepts everything; an unrelated model accepts little; both are exact
    same, _, snap = _run(tiny_models["llama"], PROMPTS, sp, spec={"method": "draft_model", "num_speculative_tokens": 3,
                                                                  "model": tiny_models["llama"]})
    assert same == base
    assert snap["spec_decode_num_accepted_tokens"] == snap["spec_decode_num_draft_tokens"] > 50
    other, _, snap = _run(tiny_models["llama"], PROMPTS, sp,
                          spec={"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_models["llama-draft"]})
    assert other == base
    assert snap["spec_decode_num_accepted_tokens"] < snap["spec_decode_num_draft_tokens"]


def test_draft_model_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    from engine.default_model import default_model_path
    with pytest.raises(SpeculativeConfigError) as e:
        LLM(tiny_models["llama"], speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                      "model": str(default_model_path())}, **ENGINE)
    assert e.value.field == "model" and "vocab" in str(e.value)


@pytest.mark.slow      # two engines on the embedded SmolLM2 (~15 s quiet, ~1 min on a loaded host)
def test_embedded_smollm2_greedy_is_token_identical():
    text = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
            "the members agreed to increase funding for the public library.")
    sp = SamplingParams(max_tokens=40, temperature=0)
    with LLM() as llm:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Repeat the following text exactly:\n\n" + text}])
        base = llm.generate([ids, ids[:-3]], sp)
    with LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}) as llm:
        spec = llm.generate([ids, ids[:-3]], sp)
        snap = llm.engine.metrics_snapshot()
    for b, s in zip(base, spec):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert b.outputs[0].text == s.outputs[0].text
    assert snap["spec_decode_num_accepted_tokens"] > 20


# ------------------------------------------------------------------------------------ rejection sampling
V = 40


def _tv_bound(want, n):
    return 2.5 * 0.5 * np.sqrt(2 / (np.pi * n)) * np.sqrt(want).sum()


@functools.lru_cache(maxsize=None)
def _row(prefix):
    """Target logits after `prefix` (a fixed pseudo-random function of the prefix)."""
    return np.random.default_rng([11, *prefix]).standard_normal(V) * 1.5


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=12),
                                dict(temperature=1.2, top_p=0.85), dict(temperature=1.0, min_p=0.05)])
@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_rejection_sampling_follows_the_target_distribution(kw, draft):
    """One verification of 2 drafts: the first emitted token ~ p(.|()); given the first token t and that the
    step went on, the second ~ p(.|t); given (t, s), the third ~ p(.|t, s): exact target distributions.
    n-gram drafts are fixed tokens (point masses); model drafts are drawn from a draft distribution q."""
    params = SamplingParams(max_tokens=4, **kw)
    p0 = target_probs(_row(()), params)
    qrng = np.random.default_rng(5)
    qs = np.stack([target_probs(qrng.standard_normal(V) * 1.5, SamplingParams(temperature=1.0)) for _ in range(2)])
    qcdf = np.cumsum(qs, axis=1)
    fixed = [int(np.argmax(p0))]                       # likely drafts, so that every branch is exercised ...
    fixed.append(int(np.argmax(target_probs(_row(tuple(fixed)), params))))     # ... and a likely second
    rng = np.random.default_rng(1)
    n = 20000
    outs = []
    for _ in range(n):
        d = fixed if draft == "ngram" else [int(np.searchsorted(qcdf[j], rng.random() * qcdf[j][-1], side="right"))
                                            for j in range(2)]
        rows = np.stack([_row(()), _row(tuple(d[:1])), _row(tuple(d[:2]))])
        outs.append(tuple(rejection_sample(d, None if draft == "ngram" else qs, rows, params, rng)))
    assert all(1 <= len(o) <= 3 for o in outs)

    def check(samples, want):
        got = np.bincount(samples, minlength=V) / len(samples)
        assert (got[want == 0] == 0).all(), "a truncated-away token was emitted"
        bound = 2.5 * 0.5 * np.sqrt(2 / (np.pi * len(samples))) * np.sqrt(want).sum()
        assert 0.5 * np.abs(got - want).sum() < bound
        return bound

    bound = check([o[0] for o in outs], p0)
    # the bound has power: the n-gram draft's point mass, or q itself, is far outside it
    wrong = np.eye(V)[fixed[0]] if draft == "ngram" else qs[0]
    assert 0.5 * np.abs(wrong - p0).sum() > 2 * bound
    cont = [o for o in outs if len(o) >= 2]
    t = max(set(o[0] for o in cont), key=[o[0] for o in cont].count)
    seconds = [o[1] for o in cont if o[0] == t]
    assert len(seconds) > 500
    check(seconds, target_probs(_row((t,)), params))
    if draft == "ngram":
        thirds = [o[2] for o in outs if len(o) == 3]
        assert len(thirds) > 300
        check(thirds, target_probs(_row(tuple(fixed)), params))


def test_sampled_generation_runs_with_speculation(tiny_models):
    """Seeded sampling with ngram drafts: valid outputs, drafts drawn and some accepted, same length."""
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=3, ignore_eos=True, detokenize=False)
    out, _, snap = _run(tiny_models["llama"], PROMPTS, sp, spec=NGRAM)
    assert all(len(o[0]) == 30 for o in out)
    assert snap["spec_decode_num_draft_tokens"] > 0


# ------------------------------------------------------------------------------------------- metrics
def test_metrics_expose_spec_decode_counters():
    from server.metrics import ServerMetrics
    snap = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 7,
            "spec_decode_num_accepted_tokens_per_pos": [3, 2, 1, 1]}
    text = ServerMetrics("m", lambda: snap, 128).render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    # speculation off: no spec series
    assert "spec_decode" not in ServerMetrics("m", lambda: {}, 128).render().decode()


def test_preemption_and_prefix_cache_with_speculation(tiny_models):
    """A pool too small for every request at once: requests with drafts get preempted and recomputed, and
    shared prefixes hit the cache; greedy tokens still equal speculation off."""
    path = tiny_models["llama"]
    sp = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True, detokenize=False)
    prompts = PROMPTS + [PROMPTS[0] + [11, 12], PROMPTS[1] + [13]]
    kw = dict(num_blocks=40)
    base, _, snap0 = _run(path, prompts, sp, **kw)
    spec, _, snap = _run(path, prompts, sp, spec={**NGRAM, "num_speculative_tokens": 4}, **kw)
    assert spec == base
    assert snap["num_preemptions"] > 0 and snap["prefix_cache_hits"] > 0
    assert snap["spec_decode_num_accepted_tokens"] > 0


def test_verify_friendly_draft_lengths():
    from engine.spec_decode import verify_friendly
    assert [verify_friendly(n) for n in range(0, 17)] == [0, 1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 7, 7, 7, 7, 15, 15]
