"""Quantized KV pages: int8 or fp8 (float8_e4m3fn) values with one f32 scale per token per kv head.

Symmetric absmax quantization of each key (or value) vector, the H numbers one token writes for one kv head:

    scale = max_h |x_h| / QMAX          values = round(x / scale) clipped to [-127, 127]   (int8, QMAX 127)
                                        values = cast(x / scale) clipped to [-448, 448]    (e4m3, QMAX 448)
    x ~ values * scale

A token's scale depends on its own vector only, so a page is written once per token and never rescaled: a page
reused from the prefix cache, copied, offloaded or brought back carries its scales and means the same numbers. An
all-zero vector gets scale 0 and values 0 and dequantizes to 0 (the division uses 1 there, never 0 / 0).

Error per element after a round trip (what `tests/pallas_kernels/test_kv_quant.py` checks): int8 rounds to the
nearest multiple of the scale, |error| <= scale / 2; e4m3 keeps 3 mantissa bits, so a scaled value in the normal
range (>= 2^-6) is off by at most half an ulp, 2^-4 of its magnitude, and one in the subnormal range by at most
2^-10 (half the subnormal step 2^-9): |error| <= 2^-4 |x| + 2^-10 scale.

Scale layout beside the pages (`reference` module docstring): `k_scale, v_scale: f32[P, K, page_size]` for one
layer, `f32[L, P, K, page_size]` stacked, i.e. the page arrays without their trailing head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Largest magnitude each quantized cache dtype represents: the absmax of a vector maps onto it.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.float32


def is_quantized(dtype: jnp.dtype) -> bool:
    """True for the cache dtypes stored with scales (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QMAX


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization over the last axis.

    Args:
      x: [..., H] float keys or values (any float dtype; computed in f32).
      dtype: int8 or float8_e4m3fn.

    Returns:
      (values [..., H] in `dtype`, scale f32[...]); scale 0 for an all-zero vector.

    Raises:
      ValueError: if dtype is not a quantized cache dtype.
    """
    if not is_quantized(dtype):
        raise ValueError(f"dtype={jnp.dtype(dtype).name} is not a quantized KV dtype; choose int8 or float8_e4m3fn")
    qmax = QMAX[jnp.dtype(dtype)]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [...]
    scaled = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale.astype(SCALE_DTYPE)


def dequantize(values: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """values [..., H] * scale [...] in f32, returned in `dtype`."""
    return (values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def fake_quantize(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The numbers a quantized cache of `dtype` holds for x [..., H], in x's dtype (dequantize(quantize(x)))."""
    return dequantize(*quantize(x, dtype), dtype=x.dtype)
