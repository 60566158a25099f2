import math

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.include_stop_str_in_output is False and p.ignore_eos is False
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.logit_bias is None and p.allowed_token_ids is None
    assert p.skip_special_tokens is True and p.detokenize is True
    p.validate(vocab_size=100)


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[5, 3, 5], seed=-1, logprobs=True,
                       logit_bias={"7": 250.0, 3: -1000})
    assert p.stop == ["END"]
    assert p.stop_token_ids == [5, 3]
    assert p.seed is None
    assert p.logprobs == 1
    assert p.logit_bias == {7: 100.0, 3: -100.0}


def test_tiny_temperature_is_raised_zero_is_greedy():
    assert SamplingParams(temperature=1e-4).temperature == pytest.approx(1e-2)
    p = SamplingParams(temperature=0.0)
    assert p.is_greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=0.5).is_greedy


@pytest.mark.parametrize("top_k", [0, -1, 1, 50])
def test_top_k_off_values_accepted(top_k):
    SamplingParams(top_k=top_k).validate(100)


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(n=2, temperature=0.0), "n"),
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-5), "prompt_logprobs"),
    (dict(logprobs=101), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=["x"], detokenize=False), "stop"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(stop_token_ids=[1, 100]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[0, 150]), "allowed_token_ids"),
    (dict(logit_bias={100: 1.0}), "logit_bias"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_fields_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_boundaries_accepted():
    SamplingParams(temperature=2.0, top_p=1e-3, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=1e-3, logprobs=-1, prompt_logprobs=0, stop_token_ids=[0, 99],
                   allowed_token_ids=[99], logit_bias={0: 5.0}).validate(vocab_size=100)


def test_max_logprobs_limit():
    SamplingParams(logprobs=20).validate(100, max_logprobs=20)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logprobs=21).validate(100, max_logprobs=20)
    assert info.value.param == "logprobs"
    with pytest.raises(InvalidRequestError):
        SamplingParams(logprobs=-1).validate(100, max_logprobs=20)  # -1 means all 100
    SamplingParams(logprobs=-1).validate(100, max_logprobs=-1)


@pytest.mark.parametrize("max_tokens", [None, 0, -1, -100])
def test_unset_max_tokens_means_rest_of_context(max_tokens):
    p = SamplingParams(max_tokens=max_tokens, min_tokens=3)
    p.validate(100)  # not an error, and min_tokens is not compared with it
    assert p.resolve_max_tokens(prompt_len=37, max_model_len=128) == 128 - 37


def test_set_max_tokens_capped_by_context():
    assert SamplingParams(max_tokens=10).resolve_max_tokens(37, 128) == 10
    assert SamplingParams(max_tokens=500).resolve_max_tokens(37, 128) == 91


def test_clone_is_deep():
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"]


# ------------------------------------------------------------------------- construction-time checks (issue 13)

from engine import limits  # noqa: E402


@pytest.mark.parametrize("kwargs,param", [
    (dict(seed=-2), "seed"),
    (dict(seed=-(2**63)), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=10**5000), "seed"),
    (dict(repetition_penalty=1e-39), "repetition_penalty"),
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=math.inf), "min_p"),
    (dict(presence_penalty=-math.inf), "presence_penalty"),
    (dict(n=limits.MAX_N + 1), "n"),
    (dict(n=True), "n"),
    (dict(top_k=2**63), "top_k"),
    (dict(max_tokens=2**70), "max_tokens"),
    (dict(max_tokens=-(2**70)), "max_tokens"),
    (dict(min_tokens=10**5000), "min_tokens"),
    (dict(logprobs=2**64), "logprobs"),
    (dict(bad_words=["\ud800"]), "bad_words"),
    (dict(bad_words=["ok", 5]), "bad_words"),
    (dict(bad_words=["w"] * 100_000), "bad_words"),
    (dict(bad_words=["x" * (limits.MAX_BAD_WORD_CHARS + 1)]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(stop=["a\udfff"]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop=[["nested"]]), "stop"),
    (dict(stop=["s"] * (limits.MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop=["s" * (limits.MAX_STOP_STRING_CHARS + 1)]), "stop"),
    (dict(stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(stop_token_ids=[[1]]), "stop_token_ids"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(allowed_token_ids=list(range(limits.MAX_ALLOWED_TOKEN_IDS + 1))), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(logit_bias={i: 1.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)}), "logit_bias"),
    (dict(logit_bias={1: math.inf}), "logit_bias"),
    (dict(logit_bias={1: "high"}), "logit_bias"),
    (dict(logit_bias={"9" * 5000: 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(detokenize=None), "detokenize"),
])
def test_construction_refuses_bad_fields_naming_them(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)
    assert param in str(info.value) and len(str(info.value)) < 400     # never echoes a huge value back


def test_limits_themselves_are_accepted():
    SamplingParams(n=limits.MAX_N, temperature=1.0, seed=limits.MAX_SEED,
                   bad_words=[f"w{i}" for i in range(limits.MAX_BAD_WORDS)],
                   stop=[f"s{i}" for i in range(limits.MAX_STOP_STRINGS)],
                   stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS)),
                   logit_bias={i: 1.0 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES)},
                   repetition_penalty=limits.MAX_REPETITION_PENALTY).validate(vocab_size=2000)
    assert SamplingParams(seed=-1).seed is None


def test_fields_changed_after_construction_are_checked_again():
    p = SamplingParams()
    p.seed = -5
    with pytest.raises(InvalidRequestError) as info:
        p.validate(100)
    assert info.value.param == "seed"
