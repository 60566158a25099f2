"""engine.output_wire: every output an engine makes, sent as a delta through pickle and rebuilt on the other
side, equals the engine's own output field for field (text held back for stop strings, n > 1, logprobs,
prompt logprobs, penalties, ignore_eos, an abort)."""
from __future__ import annotations

import pickle

import pytest

from engine.output_wire import OutputDecoder, OutputEncoder
from engine.sampling_params import SamplingParams
from tests.model_fixtures import tiny_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine.llm_engine import EngineArgs, LLMEngine
    path = tiny_model_dir(tmp_path_factory, "tiny-llama-wire", seed=5)[0]
    eng = LLMEngine(EngineArgs(model=path, num_blocks=64, block_size=16, max_num_seqs=8))
    yield eng
    eng.close()


def _snapshot(out):
    """The output's fields as plain values, taken when it is made (later steps extend shared lists)."""
    return repr(out)


def test_round_trip_equals_the_engines_outputs(engine):
    # a stop string made of text the model is likely to produce: take a greedy run's own text
    probe = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("probe", [7, 8, 9, 10], probe)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3] or "zz"
    cases = [
        ("greedy", [5, 17, 33, 2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)),
        ("stop", [7, 8, 9, 10], SamplingParams(max_tokens=12, temperature=0, stop=[stop])),
        ("n3", [3, 4, 5], SamplingParams(n=3, max_tokens=7, temperature=0.9, seed=3, logprobs=2)),
        ("plp", [11, 12, 13, 14, 15], SamplingParams(max_tokens=5, temperature=0.7, seed=1, prompt_logprobs=1,
                                                     logprobs=0, repetition_penalty=1.2)),
        ("abort", [21, 22, 23], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)),
    ]
    for rid, prompt, params in cases:
        engine.add_request(rid, prompt, params)
    enc = {rid: OutputEncoder() for rid, _, _ in cases}
    dec = {rid: OutputDecoder() for rid, _, _ in cases}
    seen = {rid: 0 for rid, _, _ in cases}
    short = {rid: 0 for rid, _, _ in cases}
    whole_text_sent = 0
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            want = _snapshot(out)
            body = pickle.loads(pickle.dumps(enc[out.request_id].encode(out)))
            if len(body) == 4:
                short[out.request_id] += 1
            else:
                whole_text_sent += sum(c[8] is not None for c in body[5])
            got = dec[out.request_id].decode(out.request_id, body)
            assert _snapshot(got) == want, out.request_id
            seen[out.request_id] += 1
        steps += 1
        if steps == 3:
            engine.abort_request("abort")
    assert all(n > 0 for n in seen.values()), seen
    assert seen["n3"] > 1 and seen["stop"] > 1
    assert whole_text_sent > 0          # the stop string's held-back text took the whole-text path
    # a plain greedy stream's tokens after the first and before the last take the 4-tuple form; a request with
    # logprobs never does
    assert short["greedy"] == seen["greedy"] - 2 and short["abort"] > 0, short
    assert short["n3"] == short["plp"] == 0, short


def test_the_delta_is_smaller_than_the_output(engine):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request("size", list(range(3, 120)), params)
    enc = OutputEncoder()
    sizes = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            sizes.append((len(pickle.dumps(enc.encode(out))), len(pickle.dumps(out))))
    # after the first (which carries the prompt), each message is a fraction of the whole output
    assert all(d * 4 < full for d, full in sizes[1:]), sizes


def test_merge_deltas_joins_each_choices_delta_and_keeps_the_newer_totals():
    from engine.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas

    def out(step, finished=False):
        comps = []
        for i in range(2):
            ids = [10 * i + k for k in range(step + 1)]
            lps = [{t: Logprob(-0.1 * t, 1)} for t in ids]
            comps.append(CompletionOutput(index=i, text="".join(f"<{t}>" for t in ids), token_ids=ids,
                                          logprobs=lps, finish_reason="length" if finished and i == 1 else None,
                                          delta_text=f"<{ids[-1]}>", delta_token_ids=[ids[-1]],
                                          delta_logprobs=[lps[-1]]))
        return RequestOutput("r", "p", [1, 2], comps, finished=finished)
    a, b, c = out(0), out(1), out(2, finished=True)
    m = merge_deltas(merge_deltas(a, b), c)
    assert m.finished and [x.finish_reason for x in m.outputs] == [None, "length"]
    for i, x in enumerate(m.outputs):
        assert x.delta_token_ids == [10 * i, 10 * i + 1, 10 * i + 2]
        assert x.delta_text == "".join(f"<{t}>" for t in x.delta_token_ids) == x.text
        assert [list(d)[0] for d in x.delta_logprobs] == x.delta_token_ids
        assert x.token_ids == c.outputs[i].token_ids
