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
