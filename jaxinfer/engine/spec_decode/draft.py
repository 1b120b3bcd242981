"""Model drafters: a small model (or the target's first layers) proposes k tokens autoregressively on device.

**Which KV cache the draft uses.**
- "self_draft": the draft is the target's first N layers, its final norm and LM head, run by
  `models.llama.forward` with `num_layers = N` on the target's own weights and KV cache (no copy of either). Its
  layer-i K/V for a token equals the target's layer-i K/V for that token, so the target's prefill already filled
  the draft's cache, and prefix caching, copy-on-write, the host tier and preemption need nothing extra. The
  draft writes layers [0, N) at the positions of the block it drafts; the target's verify step rewrites exactly
  those positions (the block is the verify chunk), before any attention reads them.
- "draft_model": the draft has a cache of its own with the target's page count and page size, addressed by the
  target's page table: page p of a sequence holds the same positions in both. Every step the target runs
  (prefill chunks, decodes, verify blocks) also runs the draft over the same tokens into that cache
  (`ModelRunner`), so it is always in step with the target, and rejected positions need no rollback in either
  (both caches are read only up to the sequence's length; the scheduler frees pages past it). Copy-on-write and
  page clears apply to both caches; pages brought back from the prefix cache's host tier carry target K/V only,
  so the draft's K/V there is stale: that lowers acceptance but never changes an output, since the target
  verifies every draft.

**Drafting** (`propose`): for rows b with `num_slots[b] > 0`, k draft forwards of q_len 1 (a `lax.fori_loop` in
one jitted call): step j feeds the row's token at position `start[b] + j` (its last token, then its drafts) and
picks draft j from the draft's logits processed like the target's (`process_logits` with the row's sampling
arrays at output step `step + j`): greedy rows take the argmax, sampling rows sample from
q_j = softmax(truncated logits) under a key of their own stream, so `verify` can accept with the exact q_j.
Steps j >= num_slots[b] of a row write no cache entry (their K/V goes to the null page) and their drafts are
ignored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import SamplingArrays, process_logits
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward
from pallas_kernels.dispatch import REFERENCE_OPS, AttentionOps

DRAFT_STREAM = np.uint32(2**32 - 2)  # fold_in tag of the draft sampling keys (verify.ACCEPT_STREAM is 2**32 - 1)


@dataclasses.dataclass
class DraftModel:
    """A drafter's model on device.

    Attributes:
      cfg: the draft's config (for "self_draft", the target's with `num_layers = N`).
      weights: its weights (for "self_draft", the target's own weight tree).
      shares_target_cache: True for "self_draft": the draft reads and writes the target's KV cache (layers
        [0, N)); False: `ModelRunner` keeps a cache of its own for it.
    """

    cfg: ModelConfig
    weights: Weights
    shares_target_cache: bool


def self_draft_layers(target_layers: int, num_layers: int | None) -> int:
    """Layers of a self-draft: `num_layers`, or a quarter of the target's (at least 1).

    Raises:
      ValueError: if that is not in [1, target_layers).
    """
    n = max(1, target_layers // 4) if num_layers is None else num_layers
    if not 1 <= n < target_layers:
        raise ValueError(f"num_draft_layers={n} must be in [1, {target_layers}) for a target of {target_layers} "
                         "layers")
    return n


def self_draft(target_cfg: ModelConfig, target_weights: Weights, num_layers: int | None) -> DraftModel:
    """The target's first `num_layers` layers + final norm + LM head as a drafter (default: a quarter, >= 1).

    Raises:
      ValueError: if num_layers is not in [1, target layers).
    """
    n = self_draft_layers(target_cfg.num_layers, num_layers)
    return DraftModel(cfg=target_cfg.first_layers(n), weights=target_weights,
                      shares_target_cache=True)


def check_draft_model(draft_cfg: ModelConfig, target_cfg: ModelConfig, draft_vocab: int, target_vocab: int) -> None:
    """A separate draft must share the target's vocabulary (ids mean the same tokens).

    Args:
      draft_vocab, target_vocab: the tokenizers' vocabulary sizes.

    Raises:
      ValueError: naming both sizes when the logits widths or the tokenizers differ.
    """
    if draft_cfg.vocab_size != target_cfg.vocab_size or draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size} logits, tokenizer {draft_vocab}) "
                         f"differs from the target's ({target_cfg.vocab_size} logits, tokenizer {target_vocab}); "
                         "a draft model must use the target's tokenizer")


def draft_keys(seed: jax.Array, sample_index: jax.Array, step: jax.Array) -> jax.Array:
    """Key[B] of each row's draft at output step `step`: fold_in(fold_in(fold_in(key(seed), index), DRAFT_STREAM),
    step); independent of the target's sampling and accept-test keys."""
    def one(seed: jax.Array, index: jax.Array, step: jax.Array) -> jax.Array:
        request = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.fold_in(jax.random.fold_in(request, DRAFT_STREAM), step)
    return jax.vmap(one)(seed, sample_index, step)


def propose(weights: Weights, kv_cache: KVCache, tokens: jax.Array, positions: jax.Array, kv_loc: jax.Array,
            page_table: jax.Array, sampling: SamplingArrays, *, cfg: ModelConfig, num_tokens: int,
            with_probs: bool, scan_layers: bool = True, attention: AttentionOps = REFERENCE_OPS,
            mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Drafts `num_tokens` tokens for each of B rows (module docstring). Jittable; donate `kv_cache`.

    Args:
      weights, cfg: the draft model.
      kv_cache: the cache it runs on (the target's for self-drafting).
      tokens: i32[B], each row's last token (the first draft step's input).
      positions: i32[num_tokens, B], position of draft step j's input token (start + j).
      kv_loc: i32[num_tokens, B], flat cache address step j writes to; the null page for steps past the row's
        slots and for padding rows.
      page_table: i32[B, P], the rows' pages, as the verify step will use them.
      sampling: `SamplingArrays` of the B rows at the block's first output step.
      num_tokens: static k.
      with_probs: static; return q (needed when some row samples).

    Returns:
      (draft ids i32[B, k], draft probabilities f32[B, k, V] or None, the updated cache).
    """
    b = tokens.shape[0]
    vocab = cfg.vocab_size
    rows = jnp.arange(b, dtype=jnp.int32)

    def body(j: jax.Array, carry: tuple) -> tuple:
        token, cache, ids, probs = carry
        pos = positions[j]
        metadata = AttentionMetadata(positions=pos, cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32), kv_lens=pos + 1,
                                     page_table=page_table, kv_loc=kv_loc[j], logits_indices=rows, max_q_len=1)
        logits, cache = forward(weights, token, metadata, cache, cfg, scan_layers=scan_layers, attention=attention,
                                mesh=mesh)
        s = sampling.replace(step=sampling.step + j)
        _, penalised, truncated = process_logits(logits[:, :vocab], s)
        sampled = jax.vmap(jax.random.categorical)(draft_keys(s.seed, s.sample_index, s.step), truncated)
        nxt = jnp.where(s.temperature > 0, sampled.astype(jnp.int32), jnp.argmax(penalised, axis=-1).astype(jnp.int32))
        ids = ids.at[:, j].set(nxt)
        if probs is not None:
            probs = probs.at[:, j].set(jax.nn.softmax(truncated, axis=-1))
        return nxt, cache, ids, probs

    ids = jnp.zeros((b, num_tokens), jnp.int32)
    probs = jnp.zeros((b, num_tokens, vocab), jnp.float32) if with_probs else None
    _, kv_cache, ids, probs = jax.lax.fori_loop(0, num_tokens, body, (tokens.astype(jnp.int32), kv_cache, ids, probs))
    return ids, probs, kv_cache
