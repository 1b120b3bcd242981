"""The online softmax every attention kernel runs over its KV tiles (FlashAttention, arXiv:2205.14135, alg. 1).

A query tile keeps, per row, the running maximum m of its scores, the running sum l of exp(score - m) and the
unnormalised output acc = sum exp(score - m) v, all in f32. A new KV tile with scores s updates them as

    m' = max(m, max(s));  alpha = exp(m - m');  l' = alpha l + sum exp(s - m');  acc' = alpha acc + exp(s - m') V

and the output is acc / l once all tiles are seen (FlashAttention-2's deferred normalisation, arXiv:2307.08691,
section 3.1). These functions use only `jnp` / `lax` ops that both Pallas backends (Mosaic TPU, Triton) lower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import load_values
from pallas_kernels.ragged import DEFAULT_MASK_VALUE, soft_cap_scores

Carry = tuple[jax.Array, jax.Array, jax.Array]  # m f32[R, 1], l f32[R, 1], acc f32[R, H]


def init(rows: int, head_dim: int) -> Carry:
    """State before any KV tile: m = the mask value, l = 0, acc = 0."""
    return (jnp.full((rows, 1), DEFAULT_MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def update(carry: Carry, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, sm_scale: float,
           soft_cap: float | None, k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> Carry:
    """Folds one KV tile into the state.

    Args:
      carry: (m, l, acc) from `init` or the previous tile.
      q: [R, H] query tile; k, v: [block_kv, H] key/value tile (same dtype as q, or quantized values with
        scales, turned into q's dtype by `kv_quant.load_values` for the dots; products accumulate in f32).
      mask: bool, broadcastable to [R, block_kv]: which keys each row may see.
      sm_scale: score scale; soft_cap: Gemma 2 soft cap applied after scaling, or None.
      k_scale, v_scale: f32[1, block_kv] per-key scales of quantized k / v tiles, or None. Key scales multiply the
        raw scores, value scales the probabilities in the PV product (not the running sum l):
        `q . (k_int s_k) = (q . k_int) s_k`, `sum p (v_int s_v) = sum (p s_v) v_int`.

    A row that sees no key of this tile gains exp(MASK - m) terms: 1 each while m is still the mask value, but
    the row's first visible key raises m and its alpha = exp(MASK - m) = 0 erases them.
    """
    m_prev, l_prev, acc_prev = carry
    if k_scale is not None:
        k = load_values(k, q.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if k_scale is not None:
        s = s * k_scale
    s = soft_cap_scores(s * sm_scale, soft_cap)  # [R, block_kv]
    s = jnp.where(mask, s, DEFAULT_MASK_VALUE)
    m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    p = jnp.exp(s - m)
    alpha = jnp.exp(m_prev - m)
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if v_scale is not None:
        p, v = p * v_scale, load_values(v, q.dtype)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m, l, alpha * acc_prev + pv


def finish(carry: Carry) -> tuple[jax.Array, jax.Array]:
    """(output f32[R, H] = acc / l, log-sum-exp f32[R, 1] of the scores); rows that saw no key: 0 and MASK."""
    m, l, acc = carry
    safe_l = jnp.where(l > 0, l, 1.0)
    return acc / safe_l, jnp.where(l > 0, m + jnp.log(safe_l), DEFAULT_MASK_VALUE)
