"""The packed 4-bit weight format ("int4" in `models.quant`): two 4-bit codes per byte, group scales, optional mins.

Every 4-bit source is meant to land in this one layout (today our own `quantize(..., "int4")` and GGUF Q4_0 / Q4_1
kept as stored, `jaxinfer.loading.gguf_quant`; GPTQ and AWQ converters later), and the quantized matmul kernels read
it. It is a format of
`models.quant.QuantizedWeight` (same layout rules, scales and static fields), told apart by its `uint8` values:

| field  | dtype, shape                              | meaning                                                    |
|--------|-------------------------------------------|------------------------------------------------------------|
| values | uint8 [*kept, *contracted[:-1], C_last/2] | codes q in [0, 15]; byte j holds element 2j in its low     |
|        |                                           | nibble (bits 0-3), element 2j+1 in its high nibble (4-7)   |
| scale  | f32 [*kept, G]                            | one per group of `group_size` contracted elements (C / g)  |
| min    | f32 [*kept, G], or None                   | asymmetric: w = scale * q + min                            |
|        |                                           | None (symmetric): w = scale * (q - 8)                      |

Packing runs along the last contracted (input) axis, in the output-major layout of `models.quant` (kept axes
first), so a group of g consecutive input elements is g/2 consecutive bytes and one scale (and min). The nibble
order is GPTQ's and AWQ's little-endian int32 words read as bytes (AWQ's interleave and GGUF's "j, j+16" block
order are reorderings a converter does once). Group sizes 32 / 64 / 128 are what checkpoints use; any size that
divides the last contracted axis works here.

Scales and mins are f32, like every `QuantizedWeight` scale: f16 scales (GGUF, GPTQ, AWQ) and their products with
integer zero points (GPTQ/AWQ's min = -scale * zero) convert to f32 exactly, which bf16 (the usual activation dtype)
cannot hold; the cost is 32 bits per group (1 bit per weight at group 32, 0.25 at 128).

Our quantizer: symmetric absmax, scale = amax / 7, codes q = round(w / scale) + 8 in [1, 15] (code 0, i.e. -8, is
unused so that the error is at most scale / 2 everywhere); asymmetric (Q4_1-style) min = group minimum,
scale = (max - min) / 15, q = round((w - min) / scale) in [0, 15]. A group with no spread gets scale 1.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

SYMMETRIC_ZERO = 8  # symmetric codes are q - 8


def _xp(x: Any):
    return np if isinstance(x, np.ndarray) else jnp


def pack(codes: Any) -> Any:
    """Packs 4-bit codes two per byte along the last axis (element 2j low nibble, 2j+1 high).

    Args:
      codes: integer array [..., 2n] with values in [0, 15] (numpy in, numpy out; jax in, jax out). Higher bits are
        dropped.

    Returns:
      uint8 [..., n].

    Raises:
      ValueError: if the last axis is odd (or the array is 0-d).
    """
    xp = _xp(codes)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last axis, got shape {tuple(codes.shape)}")
    c = codes.astype(xp.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: Any) -> Any:
    """The codes of `pack`: uint8 [..., n] -> uint8 [..., 2n] with values in [0, 15]."""
    xp = _xp(packed)
    p = packed.astype(xp.uint8)
    return xp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def quantize_groups(g: Any, asymmetric: bool = False) -> tuple[Any, Any, Any]:
    """Quantizes groups of a float array to 4-bit codes (module docstring: the two schemes).

    Args:
      g: float [..., G, group]: the groups along the last axis (jax).
      asymmetric: store a min per group (w = scale * q + min) instead of symmetric codes (w = scale * (q - 8)).

    Returns:
      (codes uint8 [..., G, group] in [0, 15], scale f32 [..., G], min f32 [..., G] or None).
    """
    g = jnp.asarray(g, jnp.float32)
    if asymmetric:
        lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)
        scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)
        codes = jnp.clip(jnp.round((g - lo[..., None]) / scale[..., None]), 0, 15)
        return codes.astype(jnp.uint8), scale, lo
    amax = jnp.max(jnp.abs(g), axis=-1)
    scale = jnp.where(amax > 0, amax / 7.0, 1.0)
    codes = jnp.clip(jnp.round(g / scale[..., None]), -7, 7) + SYMMETRIC_ZERO
    return codes.astype(jnp.uint8), scale, None


def dequantize_groups(codes: Any, scale: Any, min_: Any = None) -> Any:
    """f32 [..., G, group] from codes uint8 [..., G, group], scale f32 [..., G] and min f32 [..., G] (or None)."""
    xp = _xp(codes)
    q = codes.astype(xp.float32)
    if min_ is None:
        return (q - SYMMETRIC_ZERO) * scale[..., None]
    return q * scale[..., None] + min_[..., None]


def unpacked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the codes that packed values of `shape` hold (the last axis doubled)."""
    return (*shape[:-1], 2 * shape[-1])


def dequantize(values: Any, scale: Any, min_: Any, num_kept: int) -> Any:
    """f32 weights in the values' (output-major) layout from packed uint8 values [*kept, *contracted[:-1], C/2],
    scale f32 [*kept, G] and min f32 [*kept, G] (or None); `num_kept` counts the kept axes."""
    codes = unpack(values)
    groups = codes.reshape(*codes.shape[:num_kept], scale.shape[-1], -1)
    return dequantize_groups(groups, scale, min_).reshape(codes.shape)


W4A8_GROUP = 32  # w4a8's activation blocks: the weight's own groups of 32 (GGUF Q4_0 x Q8_0)


def takes_int8_activations(group_size: int, asymmetric: bool) -> bool:
    """Whether int4 weights of `group_size` (symmetric unless `asymmetric`) can run w4a8: activations quantized
    to int8 per block of their groups of 32, the blocks llama.cpp's Q4_0 x Q8_0 dot uses."""
    return group_size == W4A8_GROUP and not asymmetric


def check_config(group_size: int, group_sizes: tuple[int, ...], quantize_activations: Any,
                 quantize_embedding: Any, asymmetric: bool = False, activation_group_size: int = 0) -> None:
    """Checks an int4 `QuantizationConfig`'s fields (group size already defaulted).

    Raises:
      ValueError: naming the field: a group size not in `group_sizes`, activations quantized (w4a8) with other
        than symmetric groups of 32 or with an activation group of their own (the blocks are the weight's
        groups), or the embedding quantized (its lookup takes no packed table).
    """
    if group_size not in group_sizes:
        raise ValueError(f"int4 quantization group_size={group_size} must be one of {', '.join(map(str, group_sizes))}"
                         " (0 or unset: the default, 32)")
    if quantize_activations and (not takes_int8_activations(group_size, asymmetric) or activation_group_size):
        raise ValueError("int4 with quantize_activations (w4a8: int8 activations per block of 32 inputs, GGUF Q4_0 x "
                         "Q8_0) needs group_size 32, symmetric codes (asymmetric false) and no activation_group_size; "
                         f"got group_size={group_size}, asymmetric={asymmetric}, "
                         f"activation_group_size={activation_group_size}")
    if quantize_embedding:
        raise ValueError("int4 quantization keeps the embedding unquantized: quantize_embedding must be false or unset "
                         "(an int8 embedding and LM head beside int4 layers: embedding_format \"int8\")")
