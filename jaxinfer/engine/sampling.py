"""Batched token sampling on device: greedy, temperature, top-k, top-p, with per-request seeds."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling_params import SamplingParams


@flax.struct.dataclass
class SamplingArrays:
    """Per-row sampling inputs for a batch of B rows.

    Attributes:
      temperature: f32[B], >= 0; 0 selects argmax.
      top_k: i32[B], in [1, V]; V disables.
      top_p: f32[B], in (0, 1]; 1 disables.
      seed: u32[B], per-request seed.
      step: i32[B], index of the token being sampled within its request (folded into the key, so a request's
        draws do not depend on which other requests share the batch).
      suppress: i32[B, M], token ids whose logits are set to -inf (EOS and stop ids before `min_tokens`); -1 pads.
      vocab_limit: i32[], ids >= it are never sampled.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array
    suppress: jax.Array
    vocab_limit: jax.Array

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], steps: list[int], suppress: list[list[int]],
              batch: int, vocab: int, vocab_limit: int | None = None) -> SamplingArrays:
        """Host-side arrays for `len(params)` rows padded (greedy) to `batch` rows.

        `suppress[i]` lists row i's banned token ids; the column count is padded to a power of two (>= 4) so that
        few shapes get compiled.
        """
        pad = batch - len(params)
        width = max(4, 1 << max(0, max((len(s) for s in suppress), default=0) - 1).bit_length())
        banned = np.full((batch, width), -1, np.int32)
        for row, ids in enumerate(suppress):
            banned[row, : len(ids)] = ids
        temperature = np.array([p.temperature for p in params] + [0.0] * pad, np.float32)
        top_k = np.array([p.top_k if p.top_k > 0 else vocab for p in params] + [vocab] * pad, np.int32)
        top_p = np.array([p.top_p for p in params] + [1.0] * pad, np.float32)
        return SamplingArrays(temperature=temperature, top_k=np.minimum(top_k, vocab), top_p=top_p,
                              seed=np.array(list(seeds) + [0] * pad, np.uint32),
                              step=np.array(list(steps) + [0] * pad, np.int32), suppress=banned,
                              vocab_limit=np.int32(vocab if vocab_limit is None else vocab_limit))


def sample(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Samples one token per row.

    Top-k keeps the k largest logits; top-p then keeps the smallest prefix of the sorted distribution whose mass
    reaches p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"); sampling is
    `jax.random.categorical` with the key `fold_in(key(seed), step)`.

    Args:
      logits: f32[B, V].
      s: sampling arrays of B rows.

    Returns:
      i32[B] token ids in [0, V).
    """
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = jnp.where(s.suppress >= 0, s.suppress, vocab)  # out-of-range index: dropped by the scatter
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    logits = jnp.where(jnp.arange(vocab)[None, :] < s.vocab_limit, logits, -jnp.inf)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_t = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits / safe_t[:, None]

    def truncate(x: jax.Array) -> jax.Array:
        sorted_desc = -jnp.sort(-x, axis=-1)  # [B, V]
        kth = jnp.take_along_axis(sorted_desc, (s.top_k - 1)[:, None], axis=-1)  # [B, 1]
        sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < s.top_k[:, None], sorted_desc, -jnp.inf)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep = mass_before < s.top_p[:, None]
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # smallest kept logit
        return jnp.where((x >= jnp.maximum(kth, cutoff)), x, -jnp.inf)

    needs_truncation = jnp.any((s.top_k < vocab) | (s.top_p < 1.0))
    scaled = jax.lax.cond(needs_truncation, truncate, lambda x: x, scaled)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy_tokens)
