"""Native CPU row reductions of a decode step's logits (`logits.cc`, AVX2 + FMA, called through `jax.ffi`): the
greedy token among the allowed ids, the raw row's max and log-sum-exp, and whether the row is finite, in one call.

XLA:CPU runs a row reduction (`jnp.argmax`, `jnp.max`, a sum of exponentials) one element at a time: over
SmolLM2's 49,152 logits the sampling step took ~0.3 ms at batch 1, ~0.9 ms at batch 8 — a tenth of a quantized
decode step. The kernel reads each row twice in vectors, spread over the matmul kernels' threads.
`jaxinfer.engine.sampling.sample` calls `logit_rows` when `cpu_gemv.active()` and the native kernels are allowed.
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
