"""Row-wise math of `jaxinfer.engine.sampling` on [B, V] logits.

- `scatter_ids`, `apply_logit_bias` and `apply_penalties`: each row's ids (-1 padded) as a [B, V] mask, count or
  value; the logit bias added at its ids; the repetition, presence and frequency penalties over them.
- `unpack_bitmask`: each row's packed token bitmask (llguidance's layout) as a [B, V] mask.
- Cheaper on XLA's CPU backend while returning what the plain jnp expression returns (the tests check each
  against it): `sort_descending`, the values of `-jnp.sort(-x, axis=-1)` sorted as int32 keys, and
  `token_logprobs`, one entry of `jax.nn.log_softmax` per row without the [B, V] result.
- `top_logprobs` / `top_logprobs_and_ranks`: the MAX_LOGPROBS largest raw log-probabilities of each row and the
  sampled token's rank (`SampleOutput`'s top logprobs and ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxinfer.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from jaxinfer.engine.sampling import SamplingArrays

__all__ = ["BITMASK_BITS", "apply_logit_bias", "apply_penalties", "bitmask_words", "limit_vocab", "no_top_logprobs",
           "scatter_ids", "sort_descending", "token_logprobs", "token_ranks", "top_logprobs", "top_logprobs_and_ranks",
           "unpack_bitmask"]

BITMASK_BITS = 32  # tokens per word of a packed token bitmask

_LOW_31_BITS = 0x7FFFFFFF


def _sort_key(x: jax.Array) -> jax.Array:
    """i32 keys of f32 `x` in the order of the floats' values, every NaN largest (as jnp.sort puts NaNs)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(_LOW_31_BITS), bits)  # negative floats: reverse their bit order
    return jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, key)


def _from_sort_key(key: jax.Array) -> jax.Array:
    """Inverse of `_sort_key` (every NaN comes back as one NaN)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(_LOW_31_BITS), key), jnp.float32)


def sort_descending(x: jax.Array) -> jax.Array:
    """The values of `-jnp.sort(-x, axis=-1)` for f32[B, V]: each row descending, NaNs last.

    Sorted as int32 keys, which XLA's CPU sort runs ~10x faster than jnp.sort's float comparator. The rows hold
    the same values in the same order, except among values that comparator finds equal and the keys do not: -0
    and +0, and on a backend that flushes subnormals to zero (XLA's CPU), the subnormals too. Those are equal to
    every comparison and arithmetic after the sort.
    """
    return -_from_sort_key(jax.lax.sort(_sort_key(-x), dimension=x.ndim - 1))


def limit_vocab(logits: jax.Array, vocab_limit: jax.Array) -> jax.Array:
    """f32[B, V] logits with -inf at ids >= vocab_limit (i32[])."""
    return jnp.where(jnp.arange(logits.shape[-1])[None, :] < vocab_limit, logits, -jnp.inf)


def token_ranks(raw_logprobs: jax.Array, token_ids: jax.Array) -> jax.Array:
    """i32[B]: 1 + how many entries of row b of f32[B, V] are strictly larger than its entry at token_ids[b]
    (i32[B]): vLLM's `Logprob.rank` of the sampled token (1 = the most likely)."""
    own = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)  # [B, 1]
    return (jnp.sum(raw_logprobs > own, axis=-1) + 1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, token_ids: jax.Array, vocab_limit: jax.Array) -> jax.Array:
    """f32[B] raw log-probability of token_ids[b] (i32[B]) in row b of f32[B, V] logits over [0, vocab_limit).

    The arithmetic of `jax.nn.log_softmax(logits)[b, token_ids[b]]` (shift by the row max, subtract the
    log-sum-exp of the shifted row), so the same value, with no [B, V] result written.
    """
    logits = limit_vocab(logits, vocab_limit)
    top = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
    log_sum_exp = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    return (jnp.take_along_axis(logits, token_ids[:, None], axis=-1) - top)[:, 0] - log_sum_exp


def bitmask_words(vocab: int) -> int:
    """ceil(vocab / 32): the int32 words of one row's packed token bitmask over `vocab` tokens."""
    return -(-vocab // BITMASK_BITS)


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """bool[B, vocab]: token t of row b is allowed iff bit t % 32 of word t // 32 of bitmask[b] is 1.

    Args:
      bitmask: i32[B, ceil(vocab / 32)], llguidance's layout: bit j (`(word >> j) & 1`) of word i is token 32 i + j.
      vocab: V, a static int.

    Raises:
      ValueError: at trace time, if bitmask is not i32[B, ceil(vocab / 32)], naming both.
    """
    if bitmask.ndim != 2 or bitmask.shape[1] != bitmask_words(vocab) or bitmask.dtype != jnp.int32:
        raise ValueError(f"token_bitmask must be i32[B, ceil(V / 32)] = i32[B, {bitmask_words(vocab)}] for {vocab=}; "
                         f"got {bitmask.dtype}{list(bitmask.shape)}")
    shifts = jnp.arange(BITMASK_BITS, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]; arithmetic shift: bit 31 too
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] != 0


def scatter_ids(ids: jax.Array, vocab: int, value: jax.Array | int, shape_dtype: jnp.dtype, add: bool) -> jax.Array:
    """[B, V] array of `shape_dtype`: zeros, with `value` set (or added) at each row's ids (i32[B, W], entries in
    [0, V) or -1, which is dropped)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    safe = jnp.where(ids >= 0, ids, vocab)  # out of range: dropped by the scatter (-1 would wrap to V - 1)
    at = jnp.zeros((ids.shape[0], vocab), shape_dtype).at[rows, safe]
    return at.add(value, mode="drop") if add else at.set(value, mode="drop")


def apply_logit_bias(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """f32[B, V] logits plus each row's bias at its ids (`s.bias_ids` i32[B, W], -1 padded, distinct within a row;
    `s.bias_values` f32[B, W]); -inf (banned) stays -inf, rows without a bias keep their values."""
    bias = scatter_ids(s.bias_ids, logits.shape[-1], s.bias_values, jnp.float32, add=True)  # [B, V]
    return logits + bias


def apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Repetition, then presence and frequency penalties.

    Repetition (Keskar et al. 2019, CTRL, as in vLLM): for every token seen in the prompt or the output,
    `l / r if l > 0 else l * r`. Presence and frequency (OpenAI): `l - presence * (c > 0) - frequency * c` with c
    the token's count in the output. Rows whose penalties are neutral come back bit-identical.

    Args:
      logits: f32[B, V].
      s: sampling arrays of B rows; row b's `penalty_ids` are its prompt ids (the first `num_prompt_ids[b]`), then
        its output ids, then -1. Columns past the prompt count as output wherever they are (verify appends drafts).

    Returns:
      f32[B, V] penalised logits.
    """
    vocab, width = logits.shape[-1], s.penalty_ids.shape[-1]
    in_output = jnp.arange(width)[None, :] >= s.num_prompt_ids[:, None]  # [B, W]
    counts = scatter_ids(jnp.where(in_output, s.penalty_ids, -1), vocab, 1.0, jnp.float32, add=True)  # [B, V]
    seen = scatter_ids(s.penalty_ids, vocab, True, jnp.bool_, add=False)  # [B, V]: in the prompt or the output
    r = s.repetition_penalty[:, None]
    logits = jnp.where(seen & (r != 1), jnp.where(logits > 0, logits / r, logits * r), logits)
    penalty = s.frequency_penalty[:, None] * counts + s.presence_penalty[:, None] * (counts > 0)
    return jnp.where(counts > 0, logits - penalty, logits)


def _top_logprobs(raw_logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS largest entries of each row of f32[B, V]; (-inf, -1) where fewer than that are in the vocab."""
    k = min(MAX_LOGPROBS, raw_logprobs.shape[-1])
    values, ids = jax.lax.top_k(raw_logprobs, k)
    ids = jnp.where(values > -jnp.inf, ids, -1)  # ids >= vocab_limit
    pad = ((0, 0), (0, MAX_LOGPROBS - k))
    return jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(ids.astype(jnp.int32), pad, constant_values=-1)


def top_logprobs_and_ranks(raw_logprobs: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(top values f32[B, MAX_LOGPROBS], their ids i32[B, MAX_LOGPROBS], ranks of token_ids i32[B]) of f32[B, V]."""
    return *_top_logprobs(raw_logprobs), token_ranks(raw_logprobs, token_ids)


def no_top_logprobs(x: jax.Array, *_) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`top_logprobs_and_ranks`' shapes, unfilled (zeros, ids -1, ranks 0), for B rows of x [B, ...]."""
    b = x.shape[0]
    return (jnp.zeros((b, MAX_LOGPROBS), jnp.float32), jnp.full((b, MAX_LOGPROBS), -1, jnp.int32),
            jnp.zeros((b,), jnp.int32))


def top_logprobs(raw_logprobs: jax.Array, num_logprobs: jax.Array,
                 token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`SampleOutput.top_logprobs`, `.top_token_ids` and `.ranks` of raw log-probabilities f32[B, V].

    Args:
      raw_logprobs: f32[B, V], -inf at ids >= vocab_limit.
      num_logprobs: i32[B], the top log-probabilities each row wants, -1 for none (`SamplingArrays`).
      token_ids: i32[B], in [0, V): the token whose rank each row reports.

    Returns:
      f32[B, MAX_LOGPROBS], i32[B, MAX_LOGPROBS] and i32[B], filled only when some row has num_logprobs >= 0.
    """
    return jax.lax.cond(jnp.any(num_logprobs >= 0), top_logprobs_and_ranks, no_top_logprobs, raw_logprobs,
                        token_ids)
