"""`SamplingParams` validation: every bad value raises a ValueError naming its field."""

from __future__ import annotations

import math

import pytest

from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams

BAD = [
    ("n", 0), ("n", 1.0), ("n", True),
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -3), ("top_k", 2.0),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", math.nan), ("min_p", math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5), ("presence_penalty", math.nan),
    ("presence_penalty", -math.inf),
    ("frequency_penalty", -3.0), ("frequency_penalty", 2.01), ("frequency_penalty", math.nan),
    ("frequency_penalty", math.inf),
    ("max_tokens", 0),
    ("seed", -1), ("seed", 2**32), ("seed", 1.5),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True),
]


@pytest.mark.parametrize("field, value", BAD)
def test_bad_value_raises_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}=") as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_min_tokens_above_max_tokens_raises() -> None:
    with pytest.raises(ValueError, match="min_tokens="):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.mark.parametrize("kwargs", [
    dict(n=4), dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=0.5), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(temperature=0),
    dict(top_k=-1), dict(seed=2**32 - 1),
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


def test_uses_penalties() -> None:
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.1).uses_penalties
    assert SamplingParams(frequency_penalty=0.1).uses_penalties
