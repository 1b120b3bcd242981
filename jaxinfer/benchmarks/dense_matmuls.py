"""Only the dense matmuls of a decode forward (projections, MLP, LM head): the floor a step's weight reads set.

Shared by the step workload (its breakdown) and the serving workload (its decode probe). Same weights and shapes
as `models.llama.forward`, without attention, norms, RoPE or the KV write; dense (non-MoE) models with
unquantized weights only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.llama import Weights


def dense_layer(x: jax.Array, w) -> jax.Array:
    """One layer's q / k / v / o projections and gated MLP on rows x [T, D] (the weights' dtype); returns [T, D].

    k and v feed the result through their sums so that XLA cannot drop them.
    """
    q = jnp.einsum("td,dnh->tnh", x, w.wq)
    k = jnp.einsum("td,dkh->tkh", x, w.wk)
    v = jnp.einsum("td,dkh->tkh", x, w.wv)
    o = jnp.einsum("tnh,nhd->td", q, w.wo)
    h = jnp.einsum("td,df->tf", x, w.w_gate) * jnp.einsum("td,df->tf", x, w.w_up)
    return x + o + jnp.einsum("tf,fd->td", h, w.w_down) + (k.sum() + v.sum()).astype(x.dtype)


def lm_head(x: jax.Array, weights: Weights) -> jax.Array:
    """f32 logits [T, V] of rows x [T, D] (the untied head when the model has one, else the embedding table)."""
    head = weights.embed if weights.lm_head is None else weights.lm_head
    pattern = "rd,vd->rv" if weights.lm_head is None else "rd,dv->rv"
    return jnp.einsum(pattern, x, head, preferred_element_type=jnp.float32)


def dense_matmuls(x: jax.Array, weights: Weights) -> jax.Array:
    """The dense matmuls of one forward over rows x [T, D]: every layer via `lax.scan`, then the LM head; f32 [T, V]."""
    x, _ = jax.lax.scan(lambda x, w: (dense_layer(x, w), None), x, weights.layers)
    return lm_head(x, weights)


def dense_matmuls_unrolled(x: jax.Array, weights: Weights) -> jax.Array:
    """As `dense_matmuls` but unrolled, each layer's weights sliced from the stacked arrays (`a[i]`, as `forward`
    does when not scanning)."""
    for i in range(weights.layers.wq.shape[0]):
        x = dense_layer(x, jax.tree.map(lambda a, i=i: a[i], weights.layers))
    return lm_head(x, weights)


def dense_matmuls_separate(x: jax.Array, layers: list, weights: Weights) -> jax.Array:
    """As `dense_matmuls_unrolled` but each layer's weights are separate input arrays (`layers`, one per layer: no
    slicing inside the jit)."""
    for w in layers:
        x = dense_layer(x, w)
    return lm_head(x, weights)
