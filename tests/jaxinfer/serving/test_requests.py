"""`jaxinfer.serving.requests`: the gRPC sampling values go through the Python API's checks, limits included."""

from __future__ import annotations

import pytest

from jaxinfer.request_limits import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from jaxinfer.serving.requests import sampling_params_from_proto
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb


@pytest.mark.parametrize("value", [0.0, MIN_REPETITION_PENALTY / 2, 1e-30, MAX_REPETITION_PENALTY * 2, 1e30])
def test_a_repetition_penalty_out_of_bounds_is_refused_naming_it(value: float) -> None:
    with pytest.raises(ValueError) as e:
        sampling_params_from_proto(pb.SamplingParams(repetition_penalty=value))
    assert str(e.value).startswith("sampling: repetition_penalty=") and \
        f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]" in str(e.value)


@pytest.mark.parametrize("value", [MIN_REPETITION_PENALTY, 1.0, MAX_REPETITION_PENALTY])
def test_the_repetition_penalty_bounds_pass_as_float32(value: float) -> None:
    """The wire's floats are float32: a bound sent as written must still be inside (0.01 would round below)."""
    params = sampling_params_from_proto(pb.SamplingParams(repetition_penalty=value))
    assert params.repetition_penalty == pytest.approx(value, rel=1e-6)


def test_logit_bias_allowed_ids_and_bad_words_map_to_sampling_params() -> None:
    params = sampling_params_from_proto(pb.SamplingParams(logit_bias={5: 1.5, 9: -100.0}, allowed_token_ids=[5, 9, 11],
                                                          bad_words=["hello", "big cat"]))
    assert params.logit_bias == {5: 1.5, 9: -100.0}
    assert params.allowed_token_ids == (5, 9, 11) and params.bad_words == ("hello", "big cat")
    unset = sampling_params_from_proto(pb.SamplingParams())
    assert unset.logit_bias is None and unset.allowed_token_ids is None and unset.bad_words == ()


@pytest.mark.parametrize("sampling, start", [
    (pb.SamplingParams(logit_bias={5: 100.5}), "sampling: logit_bias[5]=100.5 must be a finite number in [-100, 100]"),
    (pb.SamplingParams(logit_bias={-2: 1.0}), "sampling: logit_bias key -2 must be a token id"),
    (pb.SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "sampling: logit_bias has"),
    (pb.SamplingParams(allowed_token_ids=[-1]), "sampling: allowed_token_ids contains ids outside"),
    (pb.SamplingParams(bad_words=[" "]), "sampling: bad_words[0]=' ' has only spaces"),
    (pb.SamplingParams(bad_words=["x"] * (MAX_BAD_WORDS + 1)), "sampling: bad_words has"),
])
def test_bad_logit_bias_allowed_ids_and_bad_words_are_refused_naming_them(sampling, start: str) -> None:
    with pytest.raises(ValueError) as e:
        sampling_params_from_proto(sampling)
    assert str(e.value).startswith(start), str(e.value)
