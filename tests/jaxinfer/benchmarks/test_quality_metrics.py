"""The quality metrics against numpy references written from their definitions (KL divergence in probability space,
percentiles by rank, counts by loops) and hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.benchmarks.quality_metrics import (count_flips, kl_divergence, log_softmax, percentile, token_nll,
                                                 top1_agreement)


def kl_reference(base_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) = sum_v P(v) log(P(v) / Q(v)) per row, P and Q the softmax of each row, in f64."""
    out = []
    for a, b in zip(base_logits.astype(np.float64), logits.astype(np.float64)):
        p = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        q = np.exp(b - b.max()) / np.exp(b - b.max()).sum()
        out.append(sum(pv * math.log(pv / qv) for pv, qv in zip(p, q) if pv > 0))
    return np.array(out)


def test_kl_hand_computed():
    # P = (1/2, 1/2) (equal logits); Q = (3/4, 1/4) (logits ln 3, 0):
    # KL = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) = 0.143841...
    base = np.array([[0.0, 0.0]], np.float32)
    q = np.array([[math.log(3.0), 0.0]], np.float32)
    assert kl_divergence(log_softmax(base), log_softmax(q))[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    # and the other way: KL(Q || P) = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812...
    assert kl_divergence(log_softmax(q), log_softmax(base))[0] == pytest.approx(
        0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-6)


def test_kl_of_a_distribution_with_itself_is_exactly_zero():
    logits = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32) * 4
    assert np.all(kl_divergence(log_softmax(logits), log_softmax(logits)) == 0.0)


def test_kl_ignores_what_the_baseline_gives_no_probability():
    # P = (1, 0, 0) (the others -inf): KL = 1 * ln(1 / Q(0)) = -log_softmax(q)[0]
    base = np.array([[0.0, -np.inf, -np.inf]], np.float32)
    q = np.array([[1.0, 2.0, 3.0]], np.float32)
    assert kl_divergence(log_softmax(base), log_softmax(q))[0] == pytest.approx(
        -(1.0 - math.log(math.e + math.e**2 + math.e**3)), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 200), st.floats(0.0, 3.0), st.integers(0, 2**31 - 1))
def test_kl_of_a_perturbed_distribution_matches_numpy(rows, vocab, scale, seed):
    rng = np.random.default_rng(seed)
    base = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    perturbed = (base + scale * rng.normal(size=base.shape)).astype(np.float32)
    got = kl_divergence(log_softmax(base), log_softmax(perturbed))
    np.testing.assert_allclose(got, kl_reference(base, perturbed), rtol=1e-4, atol=1e-6)
    assert np.all(got >= -1e-6)


def test_log_softmax_rows_sum_to_one_and_reject_bad_shapes():
    logits = np.random.default_rng(1).normal(size=(3, 50)).astype(np.float32) * 30
    lp = log_softmax(logits)
    assert lp.dtype == np.float32
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(-1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="must be"):
        log_softmax(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="differ in shape"):
        kl_divergence(lp, lp[:2])


def test_token_nll():
    # rows softmax((0, ln 3)) = (1/4, 3/4): NLL of id 1 is ln(4/3), of id 0 is ln 4
    lp = log_softmax(np.array([[0.0, math.log(3)], [0.0, math.log(3)]], np.float32))
    np.testing.assert_allclose(token_nll(lp, np.array([1, 0])), [math.log(4 / 3), math.log(4)], rtol=1e-6)
    with pytest.raises(ValueError, match="one target per row"):
        token_nll(lp, np.array([1]))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=300), st.floats(0, 100))
def test_percentile_is_linear_between_ranks(values, q):
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    expected = s[lo] + (s[hi] - s[lo]) * (rank - lo)
    assert percentile(np.array(values), q) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_percentile_hand_cases():
    assert percentile(np.arange(101), 99) == 99.0  # rank 0.99 * 100 = 99
    assert percentile(np.array([0.0, 10.0]), 99) == pytest.approx(9.9)  # rank 0.99: 0 + 0.99 * 10
    with pytest.raises(ValueError):
        percentile(np.array([]), 99)
    with pytest.raises(ValueError):
        percentile(np.array([1.0]), 101)


def test_top1_agreement_and_flips():
    assert top1_agreement(np.array([1, 2, 3, 4]), np.array([1, 0, 3, 0])) == 0.5
    base = np.array([[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9]])
    other = np.array([[1, 2, 3], [1, 2, 4], [0, 0, 0], [7, 8, 9]])  # rows 1 (last token) and 2 (all) differ
    expected = sum(any(a != b for a, b in zip(r, s)) for r, s in zip(base.tolist(), other.tolist()))
    assert count_flips(base, other) == expected == 2
    assert count_flips(base, base) == 0
    with pytest.raises(ValueError, match="one equal"):
        top1_agreement(np.array([1]), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"\[N, steps\]"):
        count_flips(base, other[:2])
