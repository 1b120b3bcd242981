"""Ragged-batch plumbing shared by the attention kernels: flat query rows <-> per-sequence blocks, split combining.

A ragged batch stores the new tokens of all sequences back to back: sequence b owns flat rows
`cu_q_lens[b] : cu_q_lens[b + 1]`. Kernels tile queries per sequence instead, so their wrappers regroup the rows
with `queries_by_sequence` (a gather, [T, N, H] -> [B, Tq, N, H], cheap next to the KV reads) and put results back
with `rows_from_sequences`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so that fully masked rows never produce inf - inf = NaN (as jax's own attention kernels do).
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def queries_by_sequence(q: jax.Array, cu_q_lens: jax.Array, max_q_len: int) -> jax.Array:
    """Regroups flat query rows per sequence.

    Args:
      q: [T, N, H] flat queries.
      cu_q_lens: i32[B + 1], non-decreasing, `cu_q_lens[0] == 0`, `cu_q_lens[-1] <= T`.
      max_q_len: static bound on every `q_len`.

    Returns:
      [B, max_q_len, N, H]: row j of sequence b is flat row `cu_q_lens[b] + j`; slots with j >= q_len are 0.
    """
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
    j = jnp.arange(max_q_len)
    valid = j[None, :] < q_lens[:, None]  # [B, Tq]
    rows = jnp.where(valid, cu_q_lens[:-1, None] + j[None, :], 0)  # [B, Tq]
    return jnp.where(valid[:, :, None, None], jnp.take(q, rows, axis=0), 0)


def rows_from_sequences(out: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Inverse of `queries_by_sequence`: [B, Tq, N, H] -> [T, N, H]; rows past `cu_q_lens[-1]` are 0."""
    num_seqs, max_q_len = out.shape[:2]
    t = jnp.arange(num_tokens)
    row_seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1)  # [T]
    row_j = t - cu_q_lens[row_seq]
    valid = (t < cu_q_lens[-1]) & (row_j < max_q_len)
    flat = out[row_seq, jnp.clip(row_j, 0, max_q_len - 1)]  # [T, N, H]
    return jnp.where(valid[:, None, None], flat, 0)


def combine_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merges attention computed over disjoint KV ranges (FlashDecoding's reduction).

    Each split s holds its own softmax-normalised output and log-sum-exp of its scores; the full softmax weighs
    split s by exp(lse_s - logsumexp_s(lse_s)). Source: Dao et al., "Flash-Decoding for long-context inference"
    (2023), and the log-sum-exp merge of FlashAttention-2 (arXiv:2307.08691, section 3.1).

    Args:
      out: f32[S, ..., H] per-split normalised outputs (0 where a split saw no key).
      lse: f32[S, ...] per-split log-sum-exp of the scaled scores (very negative where a split saw no key).

    Returns:
      f32[..., H].
    """
    m = jnp.max(lse, axis=0, keepdims=True)
    w = jnp.exp(lse - m)  # [S, ...]
    total = jnp.sum(w, axis=0)
    return jnp.sum(w[..., None] * out, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def visible(q_pos: jax.Array, kv_pos: jax.Array, kv_len: jax.Array, sliding_window: int | None) -> jax.Array:
    """The attention mask rule every kernel and reference shares: causal, inside the context, inside the window.

    Key position s is visible to a query at position p iff `s <= p`, `s < kv_len` and, with a sliding window W,
    `p - s < W` (Mistral / Gemma 2 convention: a query sees itself and the W - 1 keys before it). Arguments
    broadcast against each other.
    """
    ok = (kv_pos <= q_pos) & (kv_pos < kv_len)
    if sliding_window is not None:
        ok &= q_pos - kv_pos < sliding_window
    return ok


def soft_cap_scores(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma 2 logit soft-capping, `cap * tanh(scores / cap)` (arXiv:2408.00118, section 2); identity for None."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    """Raises ValueError unless `sliding_window` is None or an int >= 1 and `soft_cap` is None or finite and > 0."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
                                       or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be None or an integer >= 1")
    if soft_cap is not None and not 0 < soft_cap < float("inf"):
        raise ValueError(f"{soft_cap=} must be None or a finite number > 0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): Triton tile sizes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kv_block_range(*, first_t: jax.Array, block_q: int, q_len: jax.Array, kv_len: jax.Array, block_kv: int,
                   split: jax.Array, num_splits: int,
                   sliding_window: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The KV blocks `[lo, hi)` that one paged-attention program must visit (scalar math, inside a kernel).

    The program holds query tokens `first_t : first_t + block_q` of a sequence with `q_len` new tokens and
    `kv_len` tokens in all; token t sits at position `kv_len - q_len + t`. Blocks past the causal end of its last
    valid token, before the sliding window of its first, and those of other splits (split `split` of
    `num_splits` takes an equal contiguous share) are skipped; a tile with no valid token gets an empty range.
    All operands are non-negative, so truncating `lax.div` is floor division.

    Returns:
      (lo, hi, context_start) as i32 scalars; context_start = kv_len - q_len.
    """
    context_start = kv_len - q_len
    last_t = jnp.minimum(first_t + block_q, q_len) - 1
    kv_end = jnp.minimum(kv_len, context_start + last_t + 1)  # exclusive; causal bound of the tile's last query
    kv_begin = 0 if sliding_window is None else jnp.maximum(0, context_start + first_t - sliding_window + 1)
    lo_all = jax.lax.div(kv_begin, block_kv)
    hi_all = jnp.where(first_t < q_len, jax.lax.div(jnp.maximum(kv_end, 0) + block_kv - 1, block_kv), lo_all)
    per_split = jax.lax.div(hi_all - lo_all + num_splits - 1, num_splits)
    lo = jnp.minimum(lo_all + split * per_split, hi_all)
    return lo, jnp.minimum(lo + per_split, hi_all), context_start


def pack_queries(q: jax.Array, cu_q_lens: jax.Array, q_pad: int, num_kv_heads: int, group_pad: int) -> jax.Array:
    """Flat queries -> the kernels' tile layout `[B, K, q_pad * G_pad, H]`, row `t * G_pad + g` = token t, head g.

    Args:
      q: [T, N, H]; N = K * G.
      cu_q_lens: i32[B + 1].
      q_pad: static query slots per sequence (>= every q_len).
      num_kv_heads: K.
      group_pad: G_pad >= G; the extra heads are zero queries (Triton needs power-of-two tiles).
    """
    num_heads, head_dim = q.shape[1:]
    group = num_heads // num_kv_heads
    q_seq = queries_by_sequence(q, cu_q_lens, q_pad)  # [B, Tq, N, H]
    q_seq = q_seq.reshape(-1, q_pad, num_kv_heads, group, head_dim)
    q_seq = jnp.pad(q_seq, ((0, 0), (0, 0), (0, 0), (0, group_pad - group), (0, 0))).transpose(0, 2, 1, 3, 4)
    return q_seq.reshape(-1, num_kv_heads, q_pad * group_pad, head_dim)  # [B, K, Tq * G_pad, H]


def unpack_outputs(out: jax.Array, cu_q_lens: jax.Array, num_tokens: int, group: int, group_pad: int) -> jax.Array:
    """Inverse of `pack_queries`: [B, K, q_pad * G_pad, H] -> flat [T, N, H]; padded heads dropped, padding rows 0."""
    num_seqs, num_kv_heads, rows, head_dim = out.shape
    q_pad = rows // group_pad
    out = out.reshape(num_seqs, num_kv_heads, q_pad, group_pad, head_dim)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_seqs, q_pad, num_kv_heads * group, head_dim)  # [B, Tq, N, H]
    return rows_from_sequences(out, cu_q_lens, num_tokens)


def flatten_page_table(page_table: jax.Array, pages_per_block: int) -> tuple[jax.Array, int]:
    """Page table padded with the null page to whole KV blocks and flattened (SMEM pads 2-D arrays; a block's
    pages become one 1-D slice); returns (i32[B * W'], W')."""
    pages_per_seq = page_table.shape[1]
    width = -(-pages_per_seq // pages_per_block) * pages_per_block
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - pages_per_seq))).reshape(-1), width
