"""Causal flash attention reference (plain `jnp`) over fresh packed tokens, and the segment arithmetic it shares.

A ragged batch of fresh tokens (no cached context) is packed back to back: sequence b owns flat rows
`cu_q_lens[b] : cu_q_lens[b + 1]`, and its token j sits at position j. A token attends causally within its own
sequence only. Flat row t therefore sees flat row s iff `start[t] <= s <= t` (and, with a sliding window W,
`t - s < W`), where `start[t]` is the first row of t's sequence: rows between the two are of the same sequence.

`segment_bounds` gives every row its sequence's row range; `query_block_schedule` turns it into the per-query-tile
KV ranges the kernels loop over (`pallas_kernels.flash_attention.tpu` and `.gpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import DEFAULT_MASK_VALUE, check_window_and_cap, soft_cap_scores, visible


def check_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> int:
    """Returns the GQA group N / K of q [T, N, H], k, v [T, K, H].

    Raises:
      ValueError: if N is not a multiple of K, head dims or token counts differ, or k and v differ in shape.
    """
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"q and k must be [T, heads, H]; got shapes {q.shape} and {k.shape}")
    (num_tokens, num_heads, head_dim), (kv_tokens, num_kv_heads, kv_head_dim) = q.shape, k.shape
    if num_tokens == 0:
        raise ValueError("q has no tokens (T = 0)")
    if k.shape != v.shape:
        raise ValueError(f"k shape {k.shape} != v shape {v.shape}")
    if num_tokens != kv_tokens:
        raise ValueError(f"query tokens {num_tokens} != key/value tokens {kv_tokens} (fresh tokens only)")
    if num_heads % num_kv_heads:
        raise ValueError(f"num query heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
    if head_dim != kv_head_dim:
        raise ValueError(f"query head dim {head_dim} != key/value head dim {kv_head_dim}")
    return num_heads // num_kv_heads


def segment_bounds(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Row range of each flat row's sequence.

    Args:
      cu_q_lens: i32[B + 1], B >= 1, non-decreasing, `cu_q_lens[0] == 0`, `cu_q_lens[-1] <= num_tokens`.
      num_tokens: T, static.

    Returns:
      (start, end): i32[T] each; row t belongs to rows `start[t] : end[t]`. Padding rows (t >= cu_q_lens[-1]) are
      one-row sequences `t : t + 1`, so they see only themselves.
    """
    num_seqs = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1)  # [T]; skips empty seqs
    padding = t >= cu_q_lens[-1]
    start = jnp.where(padding, t, cu_q_lens[seq]).astype(jnp.int32)
    end = jnp.where(padding, t + 1, cu_q_lens[seq + 1]).astype(jnp.int32)
    return start, end


def query_block_schedule(cu_q_lens: jax.Array, num_q_blocks: int, block_q: int, block_kv: int,
                         sliding_window: int | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What each query tile of `block_q` flat rows needs from the KV side.

    Rows `[first, first + block_q)` of tile i (first = i * block_q) see keys from `max(start[first], first - W + 1)`
    (both bounds are non-decreasing in the row, so the tile's first row has the smallest) up to its last real row.
    Tiles of padding rows only get an empty range: their output is zeroed anyway.

    Args:
      cu_q_lens: i32[B + 1] as in `segment_bounds`.
      num_q_blocks: static number of query tiles (T padded to whole tiles).
      block_q, block_kv: tile sizes in tokens.
      sliding_window: static window W or None.

    Returns:
      kv_lo, kv_hi: i32[num_q_blocks], the KV tiles `[kv_lo, kv_hi)` tile i visits (kv_lo == kv_hi: none).
      seq_lo, seq_hi: i32[num_q_blocks], indices into cu_q_lens: the tile's first row lies in sequence seq_lo, and
        the sequences starting inside the tile start at `cu_q_lens[b]` for b in `(seq_lo, seq_hi]`.
    """
    num_seqs = cu_q_lens.shape[0] - 1
    first = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    last = jnp.minimum(first + block_q, cu_q_lens[-1]) - 1  # last real row; < first for a padding tile
    seq_lo = jnp.clip(jnp.searchsorted(cu_q_lens, first, side="right") - 1, 0, num_seqs - 1)
    seq_hi = jnp.clip(jnp.searchsorted(cu_q_lens, last, side="right") - 1, seq_lo, num_seqs - 1)
    lo_row = cu_q_lens[seq_lo]
    if sliding_window is not None:
        lo_row = jnp.maximum(lo_row, first - sliding_window + 1)
    kv_lo = lo_row // block_kv
    kv_hi = jnp.where(last >= first, last // block_kv + 1, kv_lo)
    return (kv_lo.astype(jnp.int32), kv_hi.astype(jnp.int32), seq_lo.astype(jnp.int32),
            seq_hi.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of packed fresh sequences, each over its own tokens only (plain `jnp`, a [T, T] mask).

    Args:
      q: [T, N, H] queries (f32 or bf16); sequence b owns rows `cu_q_lens[b] : cu_q_lens[b + 1]`, its token j at
        position j; rows past `cu_q_lens[-1]` are padding.
      k, v: [T, K, H] keys and values of the same tokens, q's dtype; N must be a multiple of K (GQA).
      cu_q_lens: i32[B + 1], B >= 1, non-decreasing prefix sums of q_lens, `cu_q_lens[0] == 0`,
        `cu_q_lens[-1] <= T`.
      sm_scale: softmax scale, usually `H ** -0.5`.
      sliding_window: static; a query at position p sees keys at positions > p - sliding_window (None: all).
      soft_cap: static; scores become `soft_cap * tanh(scores / soft_cap)` after scaling (Gemma 2; None: off).

    Returns:
      [T, N, H] attention output in q's dtype; padding rows are 0.

    Raises:
      ValueError: if N is not a multiple of K, head dims or token counts differ, or sliding_window / soft_cap
        are out of range (at trace time).
    """
    num_tokens, num_heads, head_dim = q.shape
    group = check_heads(q, k, v)
    check_window_and_cap(sliding_window, soft_cap)
    num_kv_heads = num_heads // group

    start, end = segment_bounds(cu_q_lens, num_tokens)  # [T] each
    pos = jnp.arange(num_tokens) - start  # [T], position of each row in its sequence
    same_seq = start[:, None] == start[None, :]  # [T, T]
    mask = same_seq & visible(pos[:, None], pos[None, :], (end - start)[:, None], sliding_window)  # [T, S=T]

    # Query rows ordered (t, g) per kv head: the scores come out of the dot as [K, T, G, S] with no transposing
    # copy (ordered (g, t), XLA:CPU copied the whole f32 score tensor).
    q_g = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [K, T, G, H]
    k_t, v_t = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [K, S, H]: batch dims lead (XLA:CPU bf16 dots)
    scores = jnp.einsum("ktgh,ksh->ktgs", q_g, k_t, preferred_element_type=jnp.float32)
    scores = soft_cap_scores(scores * sm_scale, soft_cap)  # [K, T, G, S]
    scores = jnp.where(mask[:, None], scores, DEFAULT_MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("ktgs,ksh->ktgh", probs.astype(v.dtype), v_t, preferred_element_type=jnp.float32)
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)  # [T, N, H]
    real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
