"""Prompt-lookup n-gram drafting: propose the tokens that followed the last earlier occurrence of the suffix.

Speculative decoding needs a cheap guess of the next k tokens. Prompt lookup decoding (Saxena 2023, "Prompt
Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding; also vLLM's ngram speculator) takes the guess
from the sequence itself: when the output is copying from the prompt or from itself (code edits, quoting,
summaries, repetition loops), the tokens that followed the previous occurrence of the current suffix are likely
to follow again. No model runs; a wrong guess only costs verification work, since the target model checks every
draft token (verify.py), so the rule below affects speed, never the output.

**The rule.** Let `t = token_ids` (prompt + output so far), `L = len(t)`.
1. For n from `min(max_n, L - 1)` down to `min_n`: the suffix is `t[L-n:L]`. An *occurrence* is a start
   `i` with `0 <= i < L - n` and `t[i:i+n] == t[L-n:L]` (the suffix itself, `i = L - n`, does not count;
   occurrences may overlap it). The first n that has an occurrence wins: **the longest n-gram wins**, even over a
   more recent occurrence of a shorter one. No n in range has one: propose nothing (`[]`).
2. Among the occurrences of that n, **the most recent wins** (largest `i`).
3. Propose the k tokens after it, from `c = i + n`. The match ends before the suffix does, so `c <= L - 1` and
   at least one token follows. **Past the end the copy continues through the draft itself**: the draft assumes
   `t[L+m] = t[c+m]` as the copy goes on, so position `c + m >= L` reads a token just proposed; the draft is
   `t[c:L]` repeated, period `p = L - c`, cut to k tokens. A repetition loop ("a b a b") thus gets k drafts,
   where truncating at the end would give only `p`.

Worked example, `min_n=1, max_n=4`:
  t = [1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4]          (L = 11)
  n=4: suffix [7, 2, 3, 4]: no occurrence.
  n=3: suffix [2, 3, 4]: occurs at i=1 (the shorter [3, 4] at i=5 is more recent, but n=3 wins).
  c = 4: propose t[4:4+k] -> k=3: [9, 3, 4]; k=8: [9, 3, 4, 7, 2, 3, 4, 9] (t[4:11] has 7 tokens, then repeats).
  t = [1, 2, 1, 2, 1]: n=4 none; n=3 suffix [1, 2, 1] at i=0; c = 3, p = 2 -> k=5: [2, 1, 2, 1, 2].

**Two implementations, same proposals** (tests/jaxinfer/engine/spec_decode/test_ngram.py checks them against each
other and a brute-force reference):
- `NgramProposer.propose(token_ids, k)` is stateless: one numpy pass, O(L) per call. Converting a Python list
  of L ids to an array dominates: ~200-240 us per call on an 8k-token context (~7-9 us when `token_ids` is
  already an integer ndarray).
- `NgramIndex` is per sequence and incremental: a dict from each n-gram (`min_n <= n <= max_n`) to the end of
  its most recent occurrence, updated as tokens are appended. O(max_n) per appended token and per lookup:
  ~4.5 us per decode step (append one token, propose k=8) on an 8k-token context, whatever its length; building
  it from an 8k prompt once costs ~5.5 ms; it holds ~0.5 KB per token at `max_n=4` (tuple keys).
  **This is the faster one, for the engine**: keep one per decoding sequence (`NgramProposer.new_index()`).
Measured with `python -m timeit` (best of 5) on the 2-core CPU box (Python 3.12, numpy 2.5), 8192 random ids
from a 32000-id vocabulary, k=8; `randrange(200)` (many matches) gives the same times to within 20%:
  python -m timeit -s "import random; from jaxinfer.engine.spec_decode.ngram import NgramProposer as P; \
    r = random.Random(0); t = [r.randrange(32000) for _ in range(8192)]; p = P()" "p.propose(t, 8)"
  python -m timeit -s "import random; from jaxinfer.engine.spec_decode.ngram import NgramProposer as P; \
    r = random.Random(0); t = [r.randrange(32000) for _ in range(8192)]; x = P().new_index(); x.propose(t, 8)" \
    "t.append(r.randrange(32000)); x.propose(t, 8)"
  python -m timeit -s "..." "P().new_index().propose(t, 8)"    (the one-time build, same setup)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for one sequence; the engine calls `propose` once per decode step for each sequence."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Guesses the tokens that come after `token_ids`.

        Args:
          token_ids: the sequence so far (prompt + output), length L >= 0, ids in [0, vocab_size).
          k: the most draft tokens wanted, >= 0.

        Returns:
          0..k draft token ids (fewer, or none, when the proposer has no good guess), in order: the first is
          the guess for position L.

        Raises:
          ValueError: if k < 0.
        """
        ...


def _check_k(k: int) -> None:
    if k < 0:
        raise ValueError(f"{k=} must be >= 0")


def _check_n_range(min_n: int, max_n: int) -> None:
    if min_n < 1:
        raise ValueError(f"{min_n=} must be >= 1")
    if max_n < min_n:
        raise ValueError(f"{max_n=} must be >= {min_n=}")


def _cycle(segment: list[int], k: int) -> list[int]:
    """`segment` (= t[c:c+k], non-empty) continued through itself to k tokens (rule 3 of the module docstring)."""
    if len(segment) >= k:
        return segment
    reps = -(-k // len(segment))
    return (segment * reps)[:k]


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Stateless prompt-lookup proposer (the rule of the module docstring), one numpy pass per call.

    Attributes:
      min_n: shortest suffix n-gram tried, >= 1.
      max_n: longest suffix n-gram tried, >= min_n.

    Raises:
      ValueError: if min_n < 1 or max_n < min_n.
    """

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        _check_n_range(self.min_n, self.max_n)

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Drafts up to k tokens by prompt lookup, O(L) time and memory.

        Args:
          token_ids: prompt + output so far, length L >= 0: a sequence of ints or an integer ndarray of shape
            [L] (which skips the list-to-array conversion that dominates the cost).
          k: the most draft tokens wanted, >= 0.

        Returns:
          The draft: exactly k ids if some n-gram in [min_n, max_n] matches (and k > 0), else [].

        Raises:
          ValueError: if k < 0, or if token_ids is not one-dimensional.
        """
        _check_k(k)
        t = np.asarray(token_ids)
        if t.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {t.shape}")
        length = t.shape[0]
        n_cap = min(self.max_n, length - 1)
        if k == 0 or n_cap < self.min_n:
            return []
        # ends: last positions j <= L-2 of earlier occurrences of the suffix of length m+1, growing m;
        # occurrences of a longer n-gram are a subset of those of its suffixes, so the set only shrinks.
        ends = np.flatnonzero(t[: length - 1] == t[length - 1])
        best_end = int(ends[-1]) if ends.size and self.min_n <= 1 else -1
        for m in range(1, n_cap):
            ends = ends[ends >= m]
            ends = ends[t[ends - m] == t[length - 1 - m]]
            if not ends.size:
                break
            if m + 1 >= self.min_n:
                best_end = int(ends[-1])
        if best_end < 0:
            return []
        c = best_end + 1
        return _cycle(t[c : c + k].tolist(), k)

    def new_index(self) -> NgramIndex:
        """A fresh incremental index with this proposer's n range (one per decoding sequence)."""
        return NgramIndex(self.min_n, self.max_n)


class NgramIndex:
    """Incremental prompt-lookup proposer for one sequence: same proposals as `NgramProposer`, O(1) per token.

    Holds the sequence's ids and a dict from every n-gram (`min_n <= n <= max_n`) that ends at position
    j <= L-2 to its largest such j (the most recent occurrence; the n-grams ending at L-1 are indexed lazily at
    the next lookup, so the suffix never finds itself). Keys of different n are tuples of different lengths, so
    one dict holds all n.

    Use `propose(token_ids, k)` (the `Proposer` protocol) with the sequence's whole ids each step: the ids
    beyond those already held are appended. The sequence must only grow, as `Sequence.token_ids` does
    (rejected drafts never enter it); if `token_ids` is shorter than what is held, or its id at the last held
    position differs, the index is rebuilt from scratch (O(L)). Only that one position is checked, so an edit
    further back goes unnoticed: call `reset()` after one. `Sequence.token_ids` builds a new list (~20 us at
    8k ids); an engine that knows the step's new ids can skip that with `extend(new_ids)` + `propose_next(k)`.

    Args:
      min_n: shortest suffix n-gram tried, >= 1.
      max_n: longest suffix n-gram tried, >= min_n.

    Raises:
      ValueError: if min_n < 1 or max_n < min_n.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check_n_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._num_ends_indexed = 0  # n-grams ending at positions < this are in _last_end

    def __len__(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        """Forgets all ids."""
        self._tokens = []
        self._last_end = {}
        self._num_ends_indexed = 0

    def extend(self, new_token_ids: Sequence[int]) -> None:
        """Appends ids to the held sequence; O(len(new_token_ids) * (max_n - min_n + 1)) at the next lookup."""
        self._tokens.extend(map(int, new_token_ids))

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Brings the index up to `token_ids` (see the class docstring), then drafts as `NgramProposer` would.

        Args:
          token_ids: the sequence's ids so far, length L >= 0; it extends the ids of the previous call.
          k: the most draft tokens wanted, >= 0.

        Returns:
          The draft: exactly k ids if some n-gram in [min_n, max_n] matches (and k > 0), else [].

        Raises:
          ValueError: if k < 0.
        """
        _check_k(k)
        held = len(self._tokens)
        if len(token_ids) < held or (held and token_ids[held - 1] != self._tokens[-1]):
            self.reset()
            held = 0
        self.extend(token_ids[held:])
        return self.propose_next(k)

    def propose_next(self, k: int) -> list[int]:
        """Drafts up to k tokens after the held ids (what `propose` does once it has synced)."""
        _check_k(k)
        t = self._tokens
        length = len(t)
        self._index_ends_below(length - 1)
        if k == 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(t[length - n :]))
            if end is not None:
                c = end + 1
                return _cycle(t[c : c + k], k)
        return []

    def _index_ends_below(self, stop: int) -> None:
        """Indexes the n-grams that end at positions in [_num_ends_indexed, stop)."""
        first = self._num_ends_indexed
        if stop <= first:
            return
        t = self._tokens
        if stop - first <= 16:  # a decode step: a plain loop beats building the zips (~3 us vs ~9 us)
            for end in range(first, stop):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    self._last_end[tuple(t[end - n + 1 : end + 1])] = end
            self._num_ends_indexed = stop
            return
        for n in range(self.min_n, self.max_n + 1):
            start = max(0, first - n + 1)  # n-grams t[i:i+n] with end i+n-1 in [first, stop)
            stop_start = stop - n + 1
            if stop_start <= start:
                continue
            keys = zip(*(t[start + s : stop_start + s] for s in range(n)))
            # later (more recent) ends overwrite earlier ones
            self._last_end.update(zip(keys, range(start + n - 1, stop)))
        self._num_ends_indexed = stop
