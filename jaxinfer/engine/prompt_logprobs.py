"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): each prompt token's raw log-probability given the
tokens before it, its rank, and the top log-probabilities at its position.

1. A prefill chunk of a request that asks for them (`wants`) runs in a step of its own whose forward returns the
   logits of every token row (`ModelRunner.execute` with `prompt_logprobs=True`); the sampled rows are gathered
   from them on device, so it samples as the plain step does.
2. Row j of a chunk sits at position p = num_computed_tokens + j; its logits predict the prompt token at p + 1
   (`chunk_targets`; -1 past the prompt's second-last position, whose logits give the first output token).
   On device `prompt_logprob_rows` takes the log_softmax of each row (over [0, vocab_limit)), the target's value
   and rank, and the top MAX_LOGPROBS values.
3. `PromptLogprobs` keeps one list per request, filled position by position; a recompute after preemption
   writes the same positions again. Such a request takes no pages from the prefix cache (cached positions have
   no logits; vLLM V1 does the same), so the list is complete once its prompt is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling_math import limit_vocab, top_logprobs_and_ranks
from jaxinfer.engine.step_results import entry
from jaxinfer.outputs import Logprob
from jaxinfer.scheduler.chunk import ScheduledChunk


def wants(chunk: ScheduledChunk) -> bool:
    """The chunk has a row whose logits give one of its request's prompt logprobs."""
    seq = chunk.seq
    return (seq is not None and seq.params.prompt_logprobs is not None
            and chunk.num_computed_tokens < len(seq.prompt_token_ids) - 1)


def chunk_targets(chunk: ScheduledChunk) -> np.ndarray:
    """i32[len(chunk.token_ids)]: the prompt token each row's logits predict, -1 where none (past the prompt)."""
    prompt = chunk.seq.prompt_token_ids
    positions = chunk.num_computed_tokens + 1 + np.arange(len(chunk.token_ids))
    out = np.full(len(positions), -1, np.int32)
    inside = positions < len(prompt)
    out[inside] = np.asarray(prompt, np.int32)[positions[inside]]
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """Per token row of a prompt-logprobs step (device arrays, or their host copies).

    Attributes:
      logprobs: f32[T], the raw log-probability of the row's target token.
      ranks: i32[T], the target's rank in the row's raw distribution (1 = the most likely).
      top_logprobs, top_token_ids: f32/i32[T, MAX_LOGPROBS], the row's largest raw log-probabilities and their ids
        (-1 where the vocabulary has fewer tokens).
    """

    logprobs: jax.Array
    ranks: jax.Array
    top_logprobs: jax.Array
    top_token_ids: jax.Array


def prompt_logprob_rows(logits: jax.Array, targets: jax.Array, vocab_limit: jax.Array) -> PromptLogprobRows:
    """The prompt logprobs of every row of f32[T, V] logits; targets i32[T] in [0, V) (padding rows: any id), ids
    at or past vocab_limit (i32[]) get no probability."""
    raw = jax.nn.log_softmax(limit_vocab(logits.astype(jnp.float32), vocab_limit), axis=-1)
    top_values, top_ids, ranks = top_logprobs_and_ranks(raw, targets)
    own = jnp.take_along_axis(raw, targets[:, None], axis=-1)[:, 0]
    return PromptLogprobRows(logprobs=own, ranks=ranks, top_logprobs=top_values, top_token_ids=top_ids)


class PromptLogprobs:
    """The prompt logprobs of the requests in flight that asked for them, position by position.

    Args:
      decode: token id -> its text (`Logprob.decoded_token`).
    """

    def __init__(self, decode: Callable[[int], str]) -> None:
        self._decode = decode
        self._lists: dict[str, list[dict[int, Logprob] | None]] = {}

    def start(self, request_id: str, num_prompt_tokens: int) -> None:
        """A new request asking for prompt logprobs: its list starts as None at every position."""
        self._lists[request_id] = [None] * num_prompt_tokens

    def record(self, chunks: Sequence[ScheduledChunk], rows: PromptLogprobRows) -> None:
        """Takes the rows of one prompt-logprobs step (host arrays; chunk i's rows follow chunk i - 1's)."""
        start = 0
        for chunk in chunks:
            end = start + len(chunk.token_ids)
            entries = self._lists.get(chunk.seq.request_id) if chunk.seq is not None else None
            if entries is not None:
                n = chunk.seq.params.prompt_logprobs
                for j, target in enumerate(chunk_targets(chunk).tolist()):
                    if target >= 0:
                        r = start + j
                        entries[chunk.num_computed_tokens + 1 + j] = entry(
                            target, float(rows.logprobs[r]), int(rows.ranks[r]), rows.top_token_ids[r, :n],
                            rows.top_logprobs[r, :n], self._decode)
            start = end

    def of(self, request_id: str) -> list[dict[int, Logprob] | None] | None:
        """The request's list (the one this object fills: complete once the prompt is computed, which is before the
        request's first output; not copied per output): None at position 0; None if it asked for none."""
        return self._lists.get(request_id)

    def forget(self, request_id: str) -> None:
        self._lists.pop(request_id, None)
