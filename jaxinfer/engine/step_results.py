"""What a device step hands back to the host: `StepResult` (one token per sequence) and `VerifyResult`
(speculative decoding: each sequence's accepted drafts plus the target's own token)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copy of one step's sampling output, one row per sequence of the step.

    Attributes:
      token_ids: i32[B] sampled tokens.
      logprobs: f32[B] raw log-probability of each sampled token.
      top_logprobs, top_token_ids: f32/i32[B, 20] top raw log-probabilities and their ids (filled when asked).
      finite: bool[B], False where the row's logits held NaN or inf (the row's token is meaningless then).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0  # token rows the step computed beyond the real tokens (bucket padding)

    def row_logprobs(self, row: int, n: int) -> dict[int, float]:
        """{token id: logprob} of row's top n raw tokens plus its sampled token."""
        out = {int(t): float(v) for t, v in zip(self.top_token_ids[row, :n], self.top_logprobs[row, :n]) if t >= 0}
        out[int(self.token_ids[row])] = float(self.logprobs[row])
        return out


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Host copy of a verify step (speculative decoding), one row per sequence.

    Attributes:
      num_accepted: i32[B], drafts accepted; the row emits num_accepted + 1 tokens.
      token_ids: i32[B, k+1], the emitted tokens at [0, num_accepted], then -1.
      logprobs: f32[B, k+1], their raw log-probabilities.
      top_logprobs, top_token_ids: f32/i32[B, k+1, 20], per position (filled when asked).
      finite: bool[B], False where any of the row's logits held NaN or inf.
    """

    num_accepted: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0

    def emitted(self, row: int) -> list[int]:
        """The row's emitted ids: its accepted drafts, then the target's token."""
        return self.token_ids[row, : int(self.num_accepted[row]) + 1].tolist()

    def row_logprobs(self, row: int, n: int) -> list[dict[int, float]]:
        """Per emitted token of the row: {token id: logprob} of the top n raw tokens plus the emitted token."""
        out = []
        for j in range(int(self.num_accepted[row]) + 1):
            entry = {int(t): float(v) for t, v in zip(self.top_token_ids[row, j, :n], self.top_logprobs[row, j, :n])
                     if t >= 0}
            entry[int(self.token_ids[row, j])] = float(self.logprobs[row, j])
            out.append(entry)
        return out

