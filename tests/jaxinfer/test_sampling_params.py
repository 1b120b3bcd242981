"""`SamplingParams` validation: every bad value raises a ValueError naming its field."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jaxinfer.request_limits import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                     MAX_N, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                     MAX_STOP_TOKEN_IDS, MIN_REPETITION_PENALTY)
from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams

BAD = [
    ("n", 0), ("n", 1.0), ("n", True),
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -3), ("top_k", 2.0),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", math.nan), ("min_p", math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf), ("repetition_penalty", 1e-300), ("repetition_penalty", 1e30),
    ("repetition_penalty", MIN_REPETITION_PENALTY / 2), ("repetition_penalty", MAX_REPETITION_PENALTY * 1.01),
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
    dict(top_k=-1), dict(seed=2**32 - 1), dict(repetition_penalty=MIN_REPETITION_PENALTY),
    dict(repetition_penalty=MAX_REPETITION_PENALTY),
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


def test_uses_penalties() -> None:
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.1).uses_penalties
    assert SamplingParams(frequency_penalty=0.1).uses_penalties


@pytest.mark.parametrize("field", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
@pytest.mark.parametrize("value", ["no", 5, 0, None, 1.0])
def test_boolean_fields_require_a_bool(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}=.*must be True or False"):
        SamplingParams(**{field: value})
    assert getattr(SamplingParams(**{field: np.bool_(False)}), field) is False  # a numpy bool is a bool


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=MAX_N + 1), rf"n={MAX_N + 1} must be an integer in \[1, {MAX_N}\]"),
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), rf"stop has {MAX_STOP_STRINGS + 1} strings; the limit is"),
    (dict(stop=["a" * (MAX_STOP_STRING_CHARS + 1)]), rf"stop\[0\] has {MAX_STOP_STRING_CHARS + 1} characters"),
    (dict(stop=["ok", "\ud800"]), r"stop\[1\] is not valid Unicode text: a lone surrogate"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
     rf"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids; the limit is {MAX_STOP_TOKEN_IDS}"),
    (dict(stop_token_ids=[3, 1.0]), r"stop_token_ids must hold integer token ids; got 1\.0"),
    (dict(stop_token_ids=[3, -1]), r"stop_token_ids contains ids outside"),
    (dict(stop_token_ids="12"), r"stop_token_ids must be a list of token ids, got str"),
])
def test_the_request_limits_hold_in_the_python_api(kwargs: dict, match: str) -> None:
    """The limits the gRPC server applied alone before (n, stop strings), and the new stop id limit."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_integers_are_token_ids() -> None:
    params = SamplingParams(stop_token_ids=np.array([7, 9]))
    assert params.stop_token_ids == (7, 9) and all(type(t) is int for t in params.stop_token_ids)
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)


def test_max_tokens_and_min_tokens_messages_name_the_field_and_the_range() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(max_tokens=0)
    assert str(info.value).startswith("max_tokens=0 must be an integer >= 1") and "None" not in str(info.value)
    with pytest.raises(ValueError) as info:
        SamplingParams(min_tokens=-1, max_tokens=None)
    assert str(info.value).startswith("min_tokens=-1 must be an integer >= 0") and "None" not in str(info.value)
    with pytest.raises(ValueError, match=r"min_tokens=5 must be an integer in \[0, max_tokens=2\]"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    """A numpy int / float in a numeric field is the Python number it holds (stored as that), and a numpy float
    where an integer is needed is still refused."""
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(3), max_tokens=np.int32(5),
                       seed=np.uint32(7), logprobs=np.int8(1), top_p=np.float16(0.5))
    assert (p.n, p.temperature, p.top_k, p.max_tokens, p.seed, p.logprobs, p.top_p) == (2, 0.5, 3, 5, 7, 1, 0.5)
    assert type(p.max_tokens) is int and type(p.temperature) is float
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=np.float32(5))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.float32("nan"))


FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@pytest.mark.parametrize("kwargs, unknown", [
    ({"temprature": 0}, "'temprature' (did you mean 'temperature'?)"),
    ({"max_token": 8, "top_k": 2}, "'max_token' (did you mean 'max_tokens'?)"),
    ({"best_of": 2}, "'best_of'"),
    ({"stop_ids": [1], "colour": "red"}, "'stop_ids' (did you mean 'stop_token_ids'?), 'colour'"),
])
def test_an_unknown_field_is_a_type_error_naming_it_and_the_fields(kwargs, unknown) -> None:
    """Found by a hostile-user trial: the dataclass's own TypeError named neither the close field nor the valid
    ones."""
    message = f"SamplingParams got unknown field(s) {unknown}; the fields are {', '.join(FIELDS)}"
    with pytest.raises(TypeError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message
    with pytest.raises(TypeError) as e:
        dataclasses.replace(SamplingParams(), **kwargs)
    assert str(e.value) == message


def test_replace_pickle_and_copy_keep_working() -> None:
    import copy
    import pickle

    params = SamplingParams(temperature=0.5, stop=["x"], seed=3)
    assert dataclasses.replace(params, temperature=0) == SamplingParams(temperature=0, stop=("x",), seed=3)
    assert pickle.loads(pickle.dumps(params)) == params == copy.deepcopy(params) == copy.copy(params)
    assert SamplingParams(1, 0.5).temperature == 0.5  # positional fields, as dataclasses take them


def test_repetition_penalty_bounds_keep_the_penalised_logits_finite() -> None:
    """CTRL's `logit / penalty` and `logit * penalty` in the sampler's float32, at the bounds, for logits far past
    what a model gives (|logit| = 1e4): finite. Just under the old lower bound (> 0) they were not."""
    logits = np.float32([-1e4, 1e4])
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        p = np.float32(penalty)
        assert np.isfinite(np.where(logits > 0, logits / p, logits * p)).all()
    with np.errstate(over="ignore", divide="ignore"):
        assert not np.isfinite(logits / np.float32(1e-40)).all()  # what the old check let through


@pytest.mark.parametrize("kwargs, match", [
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
     rf"^logit_bias has {MAX_LOGIT_BIAS + 1} entries; the limit is {MAX_LOGIT_BIAS}$"),
    (dict(logit_bias={5: 100.5}), r"^logit_bias\[5\]=100\.5 must be a finite number in \[-100, 100\]$"),
    (dict(logit_bias={5: -101}), r"^logit_bias\[5\]=-101 must be"),
    (dict(logit_bias={5: math.nan}), r"^logit_bias\[5\]=nan must be"),
    (dict(logit_bias={5: "1"}), r"^logit_bias\[5\]='1' must be"),
    (dict(logit_bias={"5": 1.0}), r"^logit_bias key '5' must be a token id, an integer >= 0$"),
    (dict(logit_bias={-1: 1.0}), r"^logit_bias key -1 must be a token id"),
    (dict(logit_bias={True: 1.0}), r"^logit_bias key True must be a token id"),
    (dict(logit_bias=[(5, 1.0)]), r"^logit_bias must be a dict of token id -> bias, got list$"),
    (dict(allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS + 1))),
     rf"^allowed_token_ids has {MAX_ALLOWED_TOKEN_IDS + 1} ids; it must have 1 to {MAX_ALLOWED_TOKEN_IDS}"),
    (dict(allowed_token_ids=[]), r"^allowed_token_ids has 0 ids; it must have 1 to .* \(None allows every token\)"),
    (dict(allowed_token_ids=[3, -2]), r"^allowed_token_ids contains ids outside"),
    (dict(allowed_token_ids=[3, 1.5]), r"^allowed_token_ids must hold integer token ids"),
    (dict(bad_words=["w"] * (MAX_BAD_WORDS + 1)), rf"^bad_words has {MAX_BAD_WORDS + 1} strings; the limit is "
                                                  rf"{MAX_BAD_WORDS}$"),
    (dict(bad_words=["ok", "a" * (MAX_BAD_WORD_CHARS + 1)]),
     rf"^bad_words\[1\] has {MAX_BAD_WORD_CHARS + 1} characters; bad words must have 1 to {MAX_BAD_WORD_CHARS}$"),
    (dict(bad_words=[""]), r"^bad_words\[0\] has 0 characters"),
    (dict(bad_words=["  "]), r"^bad_words\[0\]='  ' has only spaces"),
    (dict(bad_words=["\ud800"]), r"^bad_words\[0\] is not valid Unicode text"),
    (dict(bad_words=[3]), r"^bad_words\[0\] must be a string, got int$"),
    (dict(bad_words={"a"}), r"^bad_words=\{'a'\} must be a string or a list of strings$"),
])
def test_logit_bias_allowed_ids_and_bad_words_limits(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_allowed_ids_and_bad_words_at_their_limits_are_kept() -> None:
    bias = {i: (-100.0 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)}
    p = SamplingParams(logit_bias=bias, allowed_token_ids=np.arange(MAX_ALLOWED_TOKEN_IDS),
                       bad_words=["a" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS)
    assert p.logit_bias == bias and all(type(v) is float for v in p.logit_bias.values())
    assert p.allowed_token_ids == tuple(range(MAX_ALLOWED_TOKEN_IDS)) and len(p.bad_words) == MAX_BAD_WORDS
    q = SamplingParams(logit_bias={np.int64(3): np.float32(0.5)}, bad_words="hello")
    assert q.logit_bias == {3: 0.5} and type(next(iter(q.logit_bias))) is int and q.bad_words == ("hello",)
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams().bad_words == ()
    assert SamplingParams().allowed_token_ids is None


def test_logit_bias_is_read_only_and_params_stay_hashable_and_picklable() -> None:
    import copy
    import pickle

    p = SamplingParams(logit_bias={5: 1.0, 2: -3.0}, allowed_token_ids=[4, 5], bad_words=["x y"])
    same = SamplingParams(logit_bias={2: -3, 5: 1}, allowed_token_ids=(4, 5), bad_words=("x y",))
    assert p == same and hash(p) == hash(same) and p != SamplingParams(logit_bias={5: 1.0})
    assert pickle.loads(pickle.dumps(p)) == p == copy.deepcopy(p) and isinstance(p.logit_bias, dict)
    with pytest.raises(TypeError, match="cannot be changed"):
        p.logit_bias[7] = 1.0
    with pytest.raises(TypeError, match="cannot be changed"):
        p.logit_bias.update({7: 1.0})
    assert dataclasses.replace(p, logit_bias={9: 2.0}).logit_bias == {9: 2.0}
