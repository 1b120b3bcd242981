"""What a device step hands back to the host: `StepResult` (one token per sequence), `PendingStep` (a step still
on device) and `VerifyResult` (speculative decoding: each sequence's accepted drafts plus the target's own token)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.outputs import Logprob

if TYPE_CHECKING:
    from jaxinfer.engine.prompt_logprobs import PromptLogprobRows
    from jaxinfer.engine.sampling import SampleOutput

TokenText = Callable[[int], str]


def entry(token_id: int, logprob: float, rank: int, top_ids: np.ndarray, top_values: np.ndarray,
           decode: TokenText) -> dict[int, Logprob]:
    """vLLM's entry: the sampled token first, then the top tokens (rank = position + 1); a top token that is the
    sampled one keeps the first place and takes the top entry's rank."""
    out = {token_id: Logprob(logprob, rank, decode(token_id))}
    for position, (t, v) in enumerate(zip(top_ids.tolist(), top_values.tolist())):
        if t >= 0:
            out[t] = Logprob(v, position + 1, decode(t))
    return out


def pack_rows(out: SampleOutput, finite: jax.Array) -> jax.Array:
    """A step's sampling output as one array, so the host fetches one buffer a step (six took ~0.16 ms on CPU).

    Args:
      out: the sampled rows (`SampleOutput`: i32 ids and ranks, f32 logprobs, [B, k] top logprobs and ids).
      finite: bool[B].

    Returns:
      i32[B, 4 + 2k], per row: token id, logprob (its f32 bits), rank, finite (0 / 1), the k top logprobs (f32
      bits), their k ids. `StepResult.unpack` reads it.
    """
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([out.token_ids[:, None].astype(jnp.int32), bits(out.logprobs)[:, None],
                            out.ranks[:, None].astype(jnp.int32), finite[:, None].astype(jnp.int32),
                            bits(out.top_logprobs), out.top_token_ids.astype(jnp.int32)], axis=1)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copy of one step's sampling output, one row per sequence of the step.

    Attributes:
      token_ids: i32[B] sampled tokens.
      logprobs: f32[B] raw log-probability of each sampled token.
      top_logprobs, top_token_ids: f32/i32[B, 20] top raw log-probabilities and their ids (filled when asked).
      ranks: i32[B], the sampled tokens' ranks in the raw distribution (filled when asked, else 0).
      finite: bool[B], False where the row's logits held NaN or inf (the row's token is meaningless then).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    ranks: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0  # token rows the step computed beyond the real tokens (bucket padding)
    prompt_rows: PromptLogprobRows | None = None  # a prompt-logprobs step's, one per token row (padded)

    @classmethod
    def unpack(cls, rows: np.ndarray, n: int, **extra) -> StepResult:
        """The first `n` rows of `pack_rows`'s array (on the host); `extra`: num_padded_tokens, prompt_rows."""
        r = np.asarray(rows)[:n]
        k = (r.shape[1] - 4) // 2
        return cls(token_ids=r[:, 0], logprobs=r[:, 1].view(np.float32), top_logprobs=r[:, 4:4 + k].view(np.float32),
                   top_token_ids=r[:, 4 + k:], ranks=r[:, 2], finite=r[:, 3] != 0, **extra)

    def row_logprobs(self, row: int, n: int, decode: TokenText) -> dict[int, Logprob]:
        """{token id: Logprob} of the row's sampled token, then its top n raw tokens (`CompletionOutput.logprobs`);
        decode(id) gives each entry's `decoded_token`."""
        return entry(int(self.token_ids[row]), float(self.logprobs[row]), int(self.ranks[row]),
                      self.top_token_ids[row, :n], self.top_logprobs[row, :n], decode)


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step the device may still be running (`ModelRunner.submit`); `result` waits for it.

    Attributes:
      rows: i32[R, 4 + 2k] on device, `pack_rows`' array (R >= num_chunks, the padded rows); a later step can take
        its sampled tokens (column 0) without a trip to the host (`ModelRunner.submit`'s `fed_from`).
      prompt_rows: a prompt-logprobs step's rows on device, else None.
      num_chunks: the step's sequences; row i is chunk i's.
      num_padded_tokens: token rows computed beyond the real tokens.
    """

    rows: jax.Array
    prompt_rows: PromptLogprobRows | None
    num_chunks: int
    num_padded_tokens: int = 0

    def result(self, rows: Sequence[int] | None = None) -> StepResult:
        """Waits for the step and returns its host copy: every chunk's row, or only `rows` (chunk indices, in that
        order). np.asarray reads a CPU buffer in place (`jax.device_get` hands it to another thread first)."""
        packed = np.asarray(self.rows)
        packed = packed[: self.num_chunks] if rows is None else packed[np.asarray(rows, np.int64)]
        return StepResult.unpack(packed, len(packed), num_padded_tokens=self.num_padded_tokens,
                                 prompt_rows=jax.tree.map(np.asarray, self.prompt_rows))


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Host copy of a verify step (speculative decoding), one row per sequence.

    Attributes:
      num_accepted: i32[B], drafts accepted; the row emits num_accepted + 1 tokens.
      token_ids: i32[B, k+1], the emitted tokens at [0, num_accepted], then -1.
      logprobs: f32[B, k+1], their raw log-probabilities.
      top_logprobs, top_token_ids: f32/i32[B, k+1, 20], per position (filled when asked).
      ranks: i32[B, k+1], the emitted tokens' ranks (filled when asked, else 0).
      finite: bool[B], False where any of the row's logits held NaN or inf.
    """

    num_accepted: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    ranks: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0

    def emitted(self, row: int) -> list[int]:
        """The row's emitted ids: its accepted drafts, then the target's token."""
        return self.token_ids[row, : int(self.num_accepted[row]) + 1].tolist()

    def row_logprobs(self, row: int, n: int, decode: TokenText) -> list[dict[int, Logprob]]:
        """Per emitted token of the row, as `StepResult.row_logprobs`: the emitted token, then the top n."""
        return [entry(int(self.token_ids[row, j]), float(self.logprobs[row, j]), int(self.ranks[row, j]),
                       self.top_token_ids[row, j, :n], self.top_logprobs[row, j, :n], decode)
                for j in range(int(self.num_accepted[row]) + 1)]

