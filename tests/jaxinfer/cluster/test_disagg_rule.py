"""The conditional-disaggregation rule and its counters (`jaxinfer.cluster.disagg`): no Ray, no engine."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.cluster.disagg import WIRE_DTYPE_NAMES, Buckets, DisaggConfig, LocalReason, local_prefill_reason

RULE = DisaggConfig(min_prefill_tokens=64, local_cached_share=0.75)
PARAMS = SamplingParams()


@pytest.mark.parametrize("num_tokens, held, params, prefill_up, reason", [
    (1000, 0, PARAMS, False, LocalReason.NO_PREFILL_REPLICA),
    (1000, 0, SamplingParams(n=2), True, LocalReason.PARAMS),
    (1000, 0, SamplingParams(prompt_logprobs=1), True, LocalReason.PARAMS),
    (1000, 752, PARAMS, True, LocalReason.CACHED),  # 752 >= 0.75 * 1000 although 248 tokens are left
    (1000, 744, PARAMS, True, None),  # 744 < 750 and 256 left >= 64: it crosses
    (63, 0, PARAMS, True, LocalReason.SHORT),  # 63 uncached < 64
    (64, 0, PARAMS, True, None),
    (200, 136, PARAMS, True, None),  # 64 uncached: not under the threshold; 136 < 150
    (200, 144, PARAMS, True, LocalReason.SHORT),  # 56 uncached; 144 < 150, so not "cached"
])
def test_local_prefill_reason(num_tokens, held, params, prefill_up, reason):
    assert local_prefill_reason(RULE, num_tokens, held, params, prefill_up) is reason


def test_threshold_zero_and_share_one_send_every_prompt_not_held_whole():
    rule = DisaggConfig(min_prefill_tokens=0, local_cached_share=1.0)
    assert local_prefill_reason(rule, 9, 0, PARAMS, True) is None
    assert local_prefill_reason(rule, 16, 8, PARAMS, True) is None
    assert local_prefill_reason(rule, 16, 16, PARAMS, True) is LocalReason.CACHED


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_prefill_tokens=-1), "--disagg-min-prefill-tokens -1 must be an integer >= 0"),
    (dict(min_prefill_tokens=1.5), "--disagg-min-prefill-tokens 1.5 must be an integer >= 0"),
    (dict(local_cached_share=1.5), r"--disagg-local-cached-share 1.5 must be in \[0, 1\]"),
    (dict(wire_dtype="float16"), "--kv-wire-dtype 'float16' is not one of float32, bfloat16, int8, fp8"),
])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DisaggConfig(**kwargs)


def test_wire_dtype_names_are_the_handoffs():
    from jaxinfer.engine.kv_handoff import WIRE_DTYPES

    assert WIRE_DTYPE_NAMES == tuple(WIRE_DTYPES)


def test_buckets_count_cumulatively():
    b = Buckets((0.01, 0.1))
    for value in (0.005, 0.01, 0.05, 2.0):  # <= 0.01 twice (le is inclusive), <= 0.1 once more, one above
        b.observe(value)
    assert b.cumulative() == [("0.01", 2), ("0.1", 3), ("+Inf", 4)] and b.sum == pytest.approx(2.065)
