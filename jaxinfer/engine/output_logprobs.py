"""The engine's per-sequence logprobs: each output token's `Logprob` entries and their running sum.

1. `_run_group` builds each step's entries with `StepResult.row_logprobs` / `VerifyResult.row_logprobs`, passing
   `decode`, which gives a token id's `decoded_token` (the tokenizer's text of that one id, special tokens kept,
   as vLLM does), cached per id: only requests that asked for logprobs decode anything.
2. `extend` appends them once the scheduler has taken the step's tokens, with the prefix sums of the sampled
   tokens' logprobs (the first entry of each dict, `row_logprobs`' order).
3. `of` gives a request output the entries of a sequence's `num_tokens` output tokens and their sum (a verify
   step may have made entries for tokens that a stop then cut off).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.outputs import Logprob
from jaxinfer.tokenizer import Tokenizer


class OutputLogprobs:
    """Logprob entries of live sequences, by `seq_id`.

    Args:
      tokenizer: decodes each entry's token id once (`decode`).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._entries: dict[int, list[dict[int, Logprob]]] = {}
        self._sums: dict[int, list[float]] = {}  # per sequence, sums[j] = logprob sum of output tokens [0, j]

    def decode(self, token_id: int) -> str:
        """`tokenizer.decode([token_id], skip_special_tokens=False)`, cached.

        Raises:
          ValueError: the id is outside the tokenizer's vocabulary.
        """
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def extend(self, seq_id: int, entries: Sequence[dict[int, Logprob]]) -> None:
        """Appends a sequence's new output tokens' entries (the sampled token first in each dict)."""
        stored = self._entries.setdefault(seq_id, [])
        sums = self._sums.setdefault(seq_id, [])
        total = sums[-1] if sums else 0.0
        for entry in entries:
            total += next(iter(entry.values())).logprob if entry else 0.0  # {}: a resumed request's earlier token
            sums.append(total)
        stored.extend(entries)

    def of(self, seq_id: int, num_tokens: int) -> tuple[list[dict[int, Logprob]], float]:
        """The entries of the sequence's first num_tokens output tokens (a new list) and their sampled tokens'
        logprob sum (0.0 for none)."""
        entries = self._entries.get(seq_id, [])[:num_tokens]
        return entries, self._sums[seq_id][len(entries) - 1] if entries else 0.0

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's entries."""
        self._entries.pop(seq_id, None)
        self._sums.pop(seq_id, None)
