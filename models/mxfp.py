"""The microscaling weight formats MXFP8, MXFP4 and NVFP4 ("mxfp8", "mxfp4", "nvfp4" in `models.quant`): small
floats in blocks of consecutive input elements, one shared low-precision scale per block.

Sources: OCP Microscaling Formats (MX) Specification v1.0 (2023), sections 5 (E8M0 scale, blocks of 32) and 6.3
(conversion); NVIDIA's NVFP4 as documented for Blackwell and TensorRT Model Optimizer (E2M1 values, one E4M3
scale per 16, one f32 scale per tensor). Each is a format of `models.quant.QuantizedWeight` (same layout rules and
static fields; `group_size` is the block), told apart from int8 / fp8 / int4 by the pair (values dtype, scale
dtype), see `models.quant.format_of`:

| format | values                                      | scale (one per block)            | block | tensor_scale     |
|--------|---------------------------------------------|----------------------------------|-------|------------------|
| mxfp8  | float8_e4m3fn [*kept, *contracted]          | float8_e8m0fnu [*kept, G]: 2^k   | 32    | None             |
| mxfp4  | uint8 [*kept, *contracted[:-1], C_last/2]:  | float8_e8m0fnu [*kept, G]: 2^k   | 32    | None             |
|        | two E2M1 codes per byte, as int4 (below)    |                                  |       |                  |
| nvfp4  | uint8, packed as mxfp4                      | float8_e4m3fn [*kept, G]         | 16    | f32, one per     |
|        |                                             |                                  |       | stacked slice    |

w = value * scale (* tensor_scale). Blocks run along the flattened contracted axes and never span two of them
(the block divides the last one; `models.quant.quantize_weights` falls back to gcd(block, axis) for a weight whose
last contracted axis it does not divide, as int4 does, and records it in `group_size`; real models' head dims and
widths take the format's block, the tiny test models' 16-wide head axis gets blocks of 16 under MX).

E2M1 codes (4 bits: sign, 2 exponent bits with bias 1, 1 mantissa bit): code c in [0, 15] is
sign (bit 3) and magnitude index c & 7 into (0, 0.5, 1, 1.5, 2, 3, 4, 6); `E2M1_VALUES` is the 16-entry decode table.
Two codes per byte as int4 (`models.quant4.pack`): element 2j in the low nibble, 2j+1 in the high one, so the
resident bytes are the format's arithmetic (4.25 bits per weight for MXFP4, 4.5 + 32 per tensor slice for NVFP4).
jax holds float4_e2m1fn arrays at one byte per element and cannot bitcast them to uint8, hence the packing.

Scales. MX (E8M0 = 2^(bits - 127), bits 255 = NaN): the spec's shared exponent is
X = floor(log2(amax)) - emax_elem (emax_elem 8 for e4m3, 2 for e2m1), after which elements above the largest
normal (448 / 6) saturate to it. We use X + 1 when amax / 2^X would exceed that largest normal, i.e.
X = ceil(log2(amax / max_normal)): no element ever saturates, so every error is at most half an element step (the
round-up variant of Mishra et al. 2025, "Recipes for Pre-training LLMs with MXFP8"). Measured on 20,000 blocks of
32 (relative RMS error, spec / round-up): e4m3 normal 0.0294 / 0.0265, normal with 1% 20x outliers 0.0381 / 0.0267,
Laplace 0.0319 / 0.0265, uniform 0.0488 / 0.0236; e2m1 normal 0.1151 / 0.1155, outliers 0.1685 / 0.1718, Laplace
0.1270 / 0.1322, uniform 0.1440 / 0.0989, and the largest error is lower with round-up on all eight (the spec clips
a block's largest weights by up to 25%, the ones that matter most). X is clamped to [-126, 127]: 2^-127 (bits 0)
is an f32 subnormal, which XLA:CPU flushes to zero; an all-zero block gets X = 0 (scale 1), as zero channels do in
`models.quant`. Element conversion: round to nearest even (the float8_e4m3fn / float4_e2m1fn casts), after
clipping to the largest normal.

NVFP4: tensor_scale s = amax / (448 * 6) over the whole tensor (1 if it is all zero); block scale
e4m3(block_amax / (6 s)) (round to nearest; 1 for an all-zero block); elements e2m1(w / (block scale * s)),
saturating at 6 (a block scale rounded down puts its largest element up to 1/16 above 6). A block scale that
underflows e4m3 (block_amax < 2^-10 * 6 s) is 0 and its elements 0. With stacked weights ([L, ...] layers,
[L, E, ...] experts) "the tensor" is one slice: `tensor_scale` is f32 with the rank of `scale`, the stacked leading
axes kept and size 1 elsewhere ([L, 1, 1, 1] for wq), so slicing a layer slices it like the other leaves.

The scale dtypes are the formats' own, 1 byte each: this jax (0.11.2 and 0.12) holds float8_e8m0fnu and
float4_e2m1fn arrays and converts them to and from f32 under jit on CPU.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from models import quant4

FORMATS = ("mxfp8", "mxfp4", "nvfp4")
BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}  # elements per scale, fixed by each format
VALUES_DTYPE = {"mxfp8": jnp.float8_e4m3fn, "mxfp4": jnp.uint8, "nvfp4": jnp.uint8}  # uint8: two E2M1 codes
SCALE_DTYPE = {"mxfp8": jnp.float8_e8m0fnu, "mxfp4": jnp.float8_e8m0fnu, "nvfp4": jnp.float8_e4m3fn}
PACKED = ("mxfp4", "nvfp4")
E4M3_MAX, E2M1_MAX = 448.0, 6.0  # largest normal element values
_ELEMENT = {"mxfp8": (E4M3_MAX, 8), "mxfp4": (E2M1_MAX, 2)}  # (largest normal, emax_elem) of the MX elements
E8M0_EXPONENTS = (-126, 127)  # the exponents we write (module docstring: why not -127)
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # by code


def _xp(x: Any):
    return np if isinstance(x, np.ndarray) else jnp


def e2m1_codes(v: Any) -> Any:
    """E2M1 codes uint8 in [0, 15] of f32 values already scaled into [-6, 6], rounded to nearest even (jax in, jax out).

    The magnitude index of a representable m is 2m below 2, m + 2 for 2 and 3, m / 2 + 4 for 4 and 6.
    """
    r = jnp.asarray(v, jnp.float32).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    m = jnp.abs(r)
    index = jnp.where(m < 2, 2 * m, jnp.where(m < 4, m + 2, m / 2 + 4))
    return (index + 8 * jnp.signbit(r)).astype(jnp.uint8)


def e2m1_values(codes: Any) -> Any:
    """f32 values of E2M1 codes (uint8 in [0, 15], any shape; numpy in, numpy out): the 16-entry table."""
    xp = _xp(codes)
    return xp.asarray(E2M1_VALUES)[codes.astype(xp.int32) & 0xF]


def mx_scale(amax: Any, fmt: str) -> Any:
    """The MX block scale 2^X for block maxima `amax` (f32, any shape): X = ceil(log2(amax / largest normal)),
    computed exactly as the spec's floor(log2(amax)) - emax_elem plus one where that would saturate, clamped to
    `E8M0_EXPONENTS`; 1 for amax 0. Returns f32 powers of two (exact in float8_e8m0fnu)."""
    largest, emax = _ELEMENT[fmt]
    amax = jnp.asarray(amax, jnp.float32)
    _, e = jnp.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    x = e - 1 - emax
    x = jnp.where(amax > largest * jnp.ldexp(jnp.float32(1), x), x + 1, x)  # largest * 2^x is exact in f32
    x = jnp.where(amax > 0, jnp.clip(x, *E8M0_EXPONENTS), 0)
    return jnp.ldexp(jnp.float32(1), x)


def quantize_blocks(g: Any, fmt: str, tensor_amax: Any = None) -> tuple[Any, Any, Any]:
    """Quantizes blocks of a float array (module docstring: the scale rules).

    Args:
      g: float [..., G, block]: the blocks along the last axis (jax).
      fmt: "mxfp8", "mxfp4" or "nvfp4".
      tensor_amax: nvfp4 only: f32 absolute maximum of each tensor, broadcastable to [..., G].

    Returns:
      (elements [..., G, block]: float8_e4m3fn (mxfp8) or unpacked E2M1 codes uint8 in [0, 15];
       scale [..., G] in `SCALE_DTYPE[fmt]`; tensor_scale f32 shaped like `tensor_amax` (nvfp4) or None).
    """
    g = jnp.asarray(g, jnp.float32)
    amax = jnp.max(jnp.abs(g), axis=-1)  # [..., G]
    tensor_scale = None
    if fmt == "nvfp4":
        tensor_scale = jnp.where(tensor_amax > 0, tensor_amax / (E4M3_MAX * E2M1_MAX), 1.0)
        block = jnp.minimum(amax / (E2M1_MAX * tensor_scale), E4M3_MAX).astype(jnp.float8_e4m3fn)
        scale = jnp.where(amax > 0, block, jnp.ones((), jnp.float8_e4m3fn))
        divisor = scale.astype(jnp.float32) * tensor_scale
        v = jnp.where(divisor[..., None] > 0, g / jnp.where(divisor > 0, divisor, 1.0)[..., None], 0.0)
    else:
        scale32 = mx_scale(amax, fmt)
        scale = scale32.astype(SCALE_DTYPE[fmt])
        v = g / scale32[..., None]
    if fmt == "mxfp8":
        return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), scale, tensor_scale
    return e2m1_codes(jnp.clip(v, -E2M1_MAX, E2M1_MAX)), scale, tensor_scale


def dequantize(values: Any, scale: Any, tensor_scale: Any, num_kept: int) -> Any:
    """f32 weights in the values' (output-major) layout from values [*kept, *contracted] (float8_e4m3fn) or packed
    uint8 [*kept, *contracted[:-1], C/2], scale [*kept, G] (float8_e8m0fnu / float8_e4m3fn) and tensor_scale (f32,
    rank of `scale`, or None); `num_kept` counts the kept axes."""
    elements = e2m1_values(quant4.unpack(values)) if values.dtype == jnp.uint8 else values.astype(jnp.float32)
    s = scale.astype(jnp.float32)
    if tensor_scale is not None:
        s = s * tensor_scale
    blocks = elements.reshape(*elements.shape[:num_kept], s.shape[-1], -1)
    return (blocks * s[..., None]).reshape(elements.shape)


def check_config(fmt: str, group_size: int, quantize_activations: Any, quantize_embedding: Any,
                 activation_group_size: int) -> None:
    """Checks a `QuantizationConfig` of one of these formats (group size already defaulted to the block).

    Raises:
      ValueError: naming the field: a group size other than the format's block, activations quantized for mxfp4 /
        nvfp4 (weight-only), an activation group size (mxfp8's activations use its blocks), or the embedding
        quantized (its lookup takes no block-scaled table).
    """
    if group_size != BLOCK[fmt]:
        raise ValueError(f"{fmt} quantization group_size={group_size}: the format's block is {BLOCK[fmt]} "
                         f"(0 or unset: the block)")
    if quantize_activations and fmt != "mxfp8":
        raise ValueError(f"{fmt} quantization is weight-only: quantize_activations must be false or unset "
                         "(mxfp8 has w8a8)")
    if activation_group_size:
        raise ValueError(f"{fmt} quantization: activation_group_size={activation_group_size} must be 0 (mxfp8 "
                         f"quantizes activations in its own blocks of {BLOCK[fmt]})")
    if quantize_embedding:
        raise ValueError(f"{fmt} quantization keeps the embedding unquantized: quantize_embedding must be false or "
                         "unset")
