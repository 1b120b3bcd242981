"""Quantized KV pages: int8 or fp8 (float8_e4m3fn) values with one f32 scale per token per kv head.

Symmetric absmax quantization of each key (or value) vector, the H numbers one token writes for one kv head:

    scale = max_h |x_h| / QMAX          values = round(x / scale) clipped to [-127, 127]   (int8, QMAX 127)
                                        values = e4m3(x / scale) clipped to [-448, 448]    (fp8, QMAX 448)
    x ~ values * scale

A token's scale depends on its own vector only, so a page is written once per token and never rescaled: a page
reused from the prefix cache, copied, offloaded or brought back carries its scales and means the same numbers. An
all-zero vector gets scale 0 and values 0 and dequantizes to 0 (the division uses 1 there, never 0 / 0).

Error per element after a round trip (what `tests/pallas_kernels/test_kv_quant.py` checks): int8 rounds to the
nearest multiple of the scale, |error| <= scale / 2; e4m3 keeps 3 mantissa bits, so a scaled value in the normal
range (>= 2^-6) is off by at most half an ulp, 2^-4 of its magnitude, and one in the subnormal range by at most
2^-10 (half the subnormal step 2^-9): |error| <= 2^-4 |x| + 2^-10 scale.

**fp8 pages are stored as uint8 bit patterns** (`FP8_BITS`): XLA:CPU has no float8 data movement and converts the
whole f8 array to f16 and back around every scatter or dynamic-update-slice (measured: writing 8 tokens into each
layer of a 94 MB cache took 87 ms for float8_e4m3fn against 0.06 ms for int8), which would make each layer's
write cost the whole cache. As uint8 the pages move like int8 ones on every backend; `load_values` turns them
into numbers with integer ops and one bitcast (exact, and no float8 support needed from Mosaic or Triton).
Native float8_e4m3fn pages are accepted too.

Scale layout beside the pages (`reference` module docstring): `k_scale, v_scale: f32[P, K, page_size]` for one
layer, `f32[L, P, K, page_size]` stacked, i.e. the page arrays without their trailing head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_BITS = jnp.dtype(jnp.uint8)  # storage of fp8 pages: their float8_e4m3fn bit patterns
# Largest magnitude of each quantized page dtype: a vector's absmax maps onto it.
QMAX = {jnp.dtype(jnp.int8): 127.0, FP8: 448.0, FP8_BITS: 448.0}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def is_quantized(dtype: jnp.dtype) -> bool:
    """True for the page dtypes stored with scales: int8, float8_e4m3fn and its bit patterns (uint8)."""
    return jnp.dtype(dtype) in QMAX


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype pages of `dtype` are stored in: uint8 bit patterns for float8_e4m3fn, `dtype` otherwise."""
    return FP8_BITS if jnp.dtype(dtype) == FP8 else jnp.dtype(dtype)


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization over the last axis.

    Args:
      x: [..., H] float keys or values (any float dtype; computed in f32).
      dtype: int8, float8_e4m3fn, or uint8 for float8_e4m3fn bit patterns.

    Returns:
      (values [..., H] in `dtype`, scale f32[...]); scale 0 for an all-zero vector.

    Raises:
      ValueError: if dtype is not a quantized page dtype.
    """
    dtype = jnp.dtype(dtype)
    if not is_quantized(dtype):
        raise ValueError(f"dtype={dtype.name} is not a quantized KV dtype; choose int8, float8_e4m3fn or uint8 "
                         f"(float8_e4m3fn bits)")
    qmax = QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [...]
    scaled = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -qmax, qmax)
    if dtype == jnp.int8:
        return jnp.round(scaled).astype(dtype), scale
    values = scaled.astype(FP8)
    return (jax.lax.bitcast_convert_type(values, FP8_BITS) if dtype == FP8_BITS else values), scale


def load_values(values: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Quantized page values as numbers of `dtype` (exact for f32 and bf16: they need at most 8 bits), unscaled.

    uint8 (float8_e4m3fn bits, sign | 4 exponent bits, bias 7 | 3 mantissa bits) decode with integer ops: a normal
    number's exponent and mantissa bits shifted into place in an f32 with 120 (= 127 - 7) added to the exponent
    field; a subnormal one (exponent bits 0) is mantissa * 2^-9, computed apart because XLA:CPU flushes f32
    subnormals to zero. The NaN pattern (exponent and mantissa all ones) is not special-cased: only a NaN input
    writes it, and its scale is then NaN too.
    """
    if values.dtype != FP8_BITS:
        return values.astype(dtype)
    bits = values.astype(jnp.int32)
    magnitude = bits & 0x7F  # exponent and mantissa bits
    normal = jax.lax.bitcast_convert_type((magnitude << 20) + (120 << 23), jnp.float32)
    subnormal = (bits & 0x7).astype(jnp.float32) * 2.0**-9
    out = jnp.where(magnitude < 8, subnormal, normal)
    return jnp.where(bits >= 0x80, -out, out).astype(dtype)


def dequantize(values: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """values [..., H] * scale [...] in f32, returned in `dtype`."""
    return (load_values(values, jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def fake_quantize(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The numbers a quantized cache of `dtype` holds for x [..., H], in x's dtype (dequantize(quantize(x)))."""
    return dequantize(*quantize(x, dtype), dtype=x.dtype)


def convert(values: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array | None]:
    """K or V of a cache of one page dtype as those of another (a KV handoff between engines, the wire format).

    Args:
      values: [..., H], float (f32 / bf16) or quantized (int8, fp8 bits in uint8, float8_e4m3fn).
      scale: f32[...] with quantized values, None with float values.
      dtype: the page dtype wanted: float32 / bfloat16, or int8 / float8_e4m3fn (returned as uint8 bits, the
        storage of fp8 pages, `storage_dtype`).

    Returns:
      (values [..., H] in `storage_dtype(dtype)`, scale f32[...] or None for a float dtype). Quantized values of
      the wanted dtype are returned as they are (exact); otherwise quantized values are dequantized first, and
      float values are cast or quantized (`quantize`).
    """
    dtype = jnp.dtype(dtype)
    if scale is not None and values.dtype == storage_dtype(dtype):
        return values, scale
    x = values if scale is None else dequantize(values, scale)
    if is_quantized(dtype):
        return quantize(x, storage_dtype(dtype))
    return x.astype(dtype), None
