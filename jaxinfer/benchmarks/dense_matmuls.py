"""The dense matmuls of a forward pass on their own, and their FLOP counts: the compute floor of a step.

Shared by the workloads that split a decode step into its parts (`serving`'s decode probe; the step breakdown).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.llama import Weights


def dense_layer(x: jax.Array, w) -> jax.Array:
    """One layer's projections and MLP matmuls (no norms, RoPE or attention), so that nothing is optimised away.

    Args:
      x: [rows, hidden] activations.
      w: one layer's weights (a slice of `Weights.layers`).

    Returns:
      [rows, hidden], same dtype as `x`.
    """
    q = jnp.einsum("td,dnh->tnh", x, w.wq)
    k = jnp.einsum("td,dkh->tkh", x, w.wk)
    v = jnp.einsum("td,dkh->tkh", x, w.wv)
    o = jnp.einsum("tnh,nhd->td", q, w.wo)
    h = jnp.einsum("td,df->tf", x, w.w_gate) * jnp.einsum("td,df->tf", x, w.w_up)
    return x + o + jnp.einsum("tf,fd->td", h, w.w_down) + (k.sum() + v.sum()).astype(x.dtype)


def dense_matmuls(x: jax.Array, weights: Weights) -> jax.Array:
    """Only the dense matmuls of one forward: every layer via `lax.scan`, then the tied LM head.

    Args:
      x: [rows, hidden] activations (rows >= 2: the engine pads decode to 2 rows).
      weights: the model's weights (stacked layers).

    Returns:
      f32[rows, vocab] logits-shaped output.
    """
    x, _ = jax.lax.scan(lambda x, w: (dense_layer(x, w), None), x, weights.layers)
    return jnp.einsum("rd,vd->rv", x, weights.embed, preferred_element_type=jnp.float32)


def model_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(dense matmul FLOPs per token through all layers, FLOPs per logits row of the LM head), from the config's
    hidden size, heads, head dim, MLP width, layers and vocabulary (2 FLOPs per multiply-add)."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return 2.0 * cfg.num_layers * per_layer, 2.0 * cfg.vocab_size * d
