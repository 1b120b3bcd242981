"""`jaxinfer.serving.requests`: the gRPC sampling values go through the Python API's checks, limits included."""

from __future__ import annotations

import pytest

from jaxinfer.request_limits import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
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
