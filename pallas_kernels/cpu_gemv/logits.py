"""Native CPU row reductions of a decode step's logits (`logits.cc`, AVX2 + FMA, called through `jax.ffi`):
`logit_rows` (the greedy token among the allowed ids, the raw row's max and log-sum-exp, and whether the row is
finite, in one call) and `truncation_threshold` (top-k / top-p without sorting the row).

XLA:CPU runs a row reduction (`jnp.argmax`, `jnp.max`, a sum of exponentials) one element at a time, and top-k /
top-p by sorting the row: over SmolLM2's 49,152 logits the greedy sampling took ~0.4 ms at batch 1 (~1.2 ms at
batch 8), a top-p sample call 3.2 ms (14.6 ms). The kernels read each row in vectors, spread over the matmul
kernels' threads. `jaxinfer.engine.sampling.sample` calls them when `cpu_gemv.active()` and the native kernels are
allowed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_gemv


def logit_rows(logits: jax.Array, suppress: jax.Array, bitmask: jax.Array,
               vocab_limit: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Greedy tokens, log-softmax normalizers and finiteness of B rows of logits, by the native kernel.

    Args:
      logits: f32[B, V] (other float dtypes are upcast).
      suppress: i32[B, S], ids in [0, V) that row b may not take; -1 pads (`SamplingArrays.suppress`).
      bitmask: i32[B, ceil(V / 32)], the allowed tokens: bit t % 32 of word t // 32 (`SamplingArrays.token_bitmask`).
      vocab_limit: i32[] (or an int), in [1, V]: ids at or above it are neither allowed nor counted.

    Returns:
      argmax: i32[B], the first index of the largest logit among the allowed ids (below vocab_limit, not in
        suppress, bit set): `jnp.argmax` of the logits with -inf elsewhere, a NaN counting as the largest, 0 when
        no id is allowed.
      row_max: f32[B], the max of each row over [0, vocab_limit); NaN if one of those logits is NaN or +inf, or
        all are -inf (where the `jnp` log-sum-exp is NaN).
      log_sum_exp: f32[B], log(sum(exp(logits - row_max))) over [0, vocab_limit) (NaN where row_max is); agrees
        with the `jnp` expression to f32 rounding (sums in another order, a ~1-ulp exp).
      finite: bool[B], whether all V logits of the row (past vocab_limit too) are finite.

    Raises:
      ValueError: at trace time, if the shapes do not fit each other.
      RuntimeError: if the native kernels are not available (`cpu_gemv.active()` is false).
    """
    logits = logits.astype(jnp.float32)
    if logits.ndim != 2 or suppress.ndim != 2 or suppress.shape[0] != logits.shape[0]:
        raise ValueError(f"logits must be [B, V] and suppress [B, S], got {logits.shape} and {suppress.shape}")
    b, v = logits.shape
    if bitmask.shape != (b, -(-v // 32)):
        raise ValueError(f"bitmask must be [B, ceil(V / 32)] = {(b, -(-v // 32))}, got {bitmask.shape}")
    outs = [jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.bool_)]
    return tuple(cpu_gemv._call("logit_rows", outs, logits, suppress.astype(jnp.int32), bitmask.astype(jnp.int32),
                                jnp.asarray(vocab_limit, jnp.int32)))


def truncation_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p of B rows of temperature-scaled logits, by the native kernel: the value below which each
    row's logits are dropped.

    The threshold `jaxinfer.engine.sampling`'s sort path keeps (`_truncate`: kth = the k-th largest logit, -inf
    when top_k == V; the descending prefix of the top-k set's softmax whose mass before each token is below top_p,
    its first token always; threshold = max(kth, that prefix's smallest logit)), found by sorting only the logits
    above a floor lowered from the row's max (by 1, 2, 4, ... 64, then none) until they number top_k or hold top_p
    of the top-k set's mass. The softmax sum and the prefix's mass run in f64, the sort path's in f32 in another
    order: a token whose mass-before lies within ~1e-6 of top_p can fall on the other side.

    Args:
      scaled: f32[B, V], -inf where dropped already; NaN counts as below every value.
      top_k: i32[B], in [1, V]; V keeps every token.
      top_p: f32[B]; >= 1 keeps the top-k set whole.

    Returns:
      f32[B]: keep `scaled >= threshold` (-inf when the row is all -inf; NaN when the row has fewer than top_k
      non-NaN logits, as the sort path's k-th entry is then a NaN).

    Raises:
      ValueError: at trace time, if the shapes do not fit each other.
      RuntimeError: if the native kernels are not available (`cpu_gemv.active()` is false).
    """
    if scaled.ndim != 2 or top_k.shape != scaled.shape[:1] or top_p.shape != scaled.shape[:1]:
        raise ValueError(f"scaled must be [B, V], top_k and top_p [B]; got {scaled.shape}, {top_k.shape}, "
                         f"{top_p.shape}")
    out = jax.ShapeDtypeStruct(scaled.shape[:1], jnp.float32)
    return cpu_gemv._call("truncation_threshold", out, scaled.astype(jnp.float32), top_k.astype(jnp.int32),
                          top_p.astype(jnp.float32))
