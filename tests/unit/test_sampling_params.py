"""SamplingParams validation follows vLLM's rules and names the offending value."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -3}, "got -3"),
        ({"min_p": 2.0}, "min_p must be in [0, 1], got 2.0"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be less than or equal to max_tokens=3, got 5"),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1"),
        ({"seed": 2**64}, "seed must fit in 64 bits"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": ["x"] * 65}, "at most 64 stop strings"),
    ],
)
def test_invalid_values_are_named(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_greedy_normalizes_other_knobs():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]


def test_vocab_check_names_ids():
    with pytest.raises(ValueError, match=r"stop_token_ids contains out-of-vocabulary token ids \[500\]"):
        SamplingParams(stop_token_ids=[500]).verify_vocab(100)
