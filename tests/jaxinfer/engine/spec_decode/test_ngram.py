"""Prompt-lookup n-gram proposer (jaxinfer/engine/spec_decode/ngram.py): hand-worked cases, the stateless proposer and the
incremental index against a brute-force reference, and the index after every appended token."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.spec_decode.ngram import NgramIndex, NgramProposer, Proposer

ProposeFn = Callable[[list[int], int, int, int], list[int]]


def propose_reference(t: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The module docstring's rule, written out: longest n first, then the latest start, then copy on."""
    length = len(t)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = t[length - n :]
        for i in range(length - n - 1, -1, -1):  # latest start first; i = L - n is the suffix itself
            if t[i : i + n] == suffix:
                extended = list(t)
                for m in range(k):  # the copy continues: t[L+m] = t[i+n+m], possibly a token just drafted
                    extended.append(extended[i + n + m])
                return extended[length:]
    return []


def _stateless(t: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return NgramProposer(min_n, max_n).propose(t, k)


def _fresh_index(t: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return NgramIndex(min_n, max_n).propose(t, k)


IMPLS = [
    pytest.param(propose_reference, id="reference"),
    pytest.param(_stateless, id="stateless"),
    pytest.param(_fresh_index, id="index"),
]


# ---- hand-worked cases (min_n=1, max_n=4 unless stated) ----


@pytest.mark.parametrize("propose", IMPLS)
def test_worked_example_longest_ngram_wins(propose: ProposeFn) -> None:
    # L=11; n=4 suffix [7,2,3,4]: none. n=3 suffix [2,3,4] at i=1 wins over the more recent [3,4] at i=5
    # (which would propose 7). c = 4: t[4:] = [9,3,4,7,2,3,4], 7 tokens.
    t = [1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4]
    assert propose(t, 3, 1, 4) == [9, 3, 4]  # k caps the draft
    assert propose(t, 7, 1, 4) == [9, 3, 4, 7, 2, 3, 4]
    assert propose(t, 8, 1, 4) == [9, 3, 4, 7, 2, 3, 4, 9]  # past t[10] the copy repeats: t[11] = t[4]
    # max_n=2 cannot see the 3-gram: the most recent [3,4] (i=5) wins, c = 7: [7,2,3,4] then repeats
    assert propose(t, 5, 1, 2) == [7, 2, 3, 4, 7]


@pytest.mark.parametrize("propose", IMPLS)
def test_continuation_runs_through_the_end(propose: ProposeFn) -> None:
    # n=4 none; n=3 suffix [1,2,1] at i=0, c=3, period p = L - c = 2: t[3:5] = [2,1], then it repeats
    assert propose([1, 2, 1, 2, 1], 5, 1, 4) == [2, 1, 2, 1, 2]
    assert propose([1, 2, 1, 2, 1], 1, 1, 4) == [2]
    # n=2 suffix [7,7] at i=0, c=2, p=1
    assert propose([7, 7, 7], 4, 1, 4) == [7, 7, 7, 7]
    # one token: nothing before it; two equal tokens: n=1 at i=0, c=1, p=1
    assert propose([7], 3, 1, 4) == []
    assert propose([7, 7], 3, 1, 4) == [7, 7, 7]


@pytest.mark.parametrize("propose", IMPLS)
def test_most_recent_occurrence_wins_among_equal_n(propose: ProposeFn) -> None:
    # n=2 suffix [6,1]: none. n=1 suffix [1] at i=0 (-> 5) and i=2 (-> 6): i=2 wins, c=3, t[3:] = [6,1]
    t = [1, 5, 1, 6, 1]
    assert propose(t, 1, 1, 4) == [6]
    assert propose(t, 3, 1, 4) == [6, 1, 6]
    # min_n=2 forbids the 1-gram match
    assert propose(t, 3, 2, 4) == []


@pytest.mark.parametrize("propose", IMPLS)
def test_no_match_and_empty(propose: ProposeFn) -> None:
    assert propose([1, 2, 3, 4], 4, 1, 4) == []
    assert propose([], 4, 1, 4) == []
    assert propose([3, 1, 3], 0, 1, 4) == []  # k=0 although [3] matches


def test_stateless_takes_an_ndarray() -> None:
    t = np.array([1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4], dtype=np.int32)
    draft = NgramProposer().propose(t, 3)
    assert draft == [9, 3, 4] and all(type(x) is int for x in draft)
    with pytest.raises(ValueError, match="one-dimensional"):
        NgramProposer().propose(t.reshape(1, -1), 3)


def test_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="k=-1"):
        NgramProposer().propose([1, 1], -1)
    with pytest.raises(ValueError, match="k=-2"):
        NgramIndex().propose([1, 1], -2)
    for make in (NgramProposer, NgramIndex):
        with pytest.raises(ValueError, match="min_n=0"):
            make(0, 4)
        with pytest.raises(ValueError, match="max_n=2"):
            make(3, 2)
    assert NgramProposer(2, 2).propose([5, 6, 5, 6], 2) == [5, 6]  # min_n == max_n is allowed


def test_both_satisfy_the_protocol() -> None:
    assert isinstance(NgramProposer(), Proposer)
    assert isinstance(NgramIndex(), Proposer)
    index = NgramProposer(2, 3).new_index()
    assert (index.min_n, index.max_n) == (2, 3)


# ---- properties over random token lists from a small alphabet ----

_n_ranges = st.integers(1, 4).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 3)))


@settings(max_examples=300, deadline=None)
@given(t=st.lists(st.integers(0, 3), max_size=40), k=st.integers(0, 10), n_range=_n_ranges)
def test_both_match_the_reference(t: list[int], k: int, n_range: tuple[int, int]) -> None:
    min_n, max_n = n_range
    expected = propose_reference(t, k, min_n, max_n)
    assert NgramProposer(min_n, max_n).propose(t, k) == expected
    assert NgramIndex(min_n, max_n).propose(t, k) == expected
    assert len(expected) in (0, k)


@settings(max_examples=100, deadline=None)
@given(t=st.lists(st.integers(0, 2), min_size=1, max_size=80), chunks=st.lists(st.integers(1, 24), max_size=20),
       k=st.integers(0, 6), n_range=_n_ranges)
def test_index_matches_stateless_after_every_append(t: list[int], chunks: list[int], k: int,
                                                    n_range: tuple[int, int]) -> None:
    min_n, max_n = n_range
    stateless = NgramProposer(min_n, max_n)
    one_at_a_time = stateless.new_index()
    for stop in range(len(t) + 1):
        assert one_at_a_time.propose(t[:stop], k) == stateless.propose(t[:stop], k), stop
    # chunks of several tokens: steps that accepted drafts (> 16 new tokens take the bulk indexing path)
    chunked, stop = stateless.new_index(), 0
    for size in chunks:
        stop = min(stop + size, len(t))
        assert chunked.propose(t[:stop], k) == stateless.propose(t[:stop], k), stop
        assert len(chunked) == stop


def test_index_rebuilds_when_the_ids_do_not_extend_it() -> None:
    index = NgramIndex()
    t = [1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4]
    assert index.propose(t, 3) == [9, 3, 4]
    shorter = t[:7]  # shorter: rebuilt. [1,2,3,4,9,3,4]: n=2 suffix [3,4] at i=2, c=4: [9,3]
    assert index.propose(shorter, 2) == NgramProposer().propose(shorter, 2) == [9, 3]
    changed = [1, 2, 3, 4, 9, 3, 5]  # same length, other last id: rebuilt
    assert index.propose(changed, 2) == NgramProposer().propose(changed, 2) == []
    index.reset()
    assert len(index) == 0 and index.propose([5, 5], 2) == [5, 5]
    index.extend([6, 5])  # [5,5,6,5]: n=1 suffix [5] at i=1, c=2: [6,5], then [6]
    assert index.propose_next(3) == [6, 5, 6]
