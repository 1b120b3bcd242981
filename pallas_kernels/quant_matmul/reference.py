"""Weight-only quantized matmul, `jnp` reference: the kernels' oracle, and the argument checks they all share.

Weight formats (plain arrays; the same layout as `models.quant.QuantizedWeight` with one kept and one contracted
axis, told apart by the values' dtype):

| values          | scale            | min            | weight                                              |
|-----------------|------------------|----------------|-----------------------------------------------------|
| int8 [N, K]     | f32 [N, G]       | (none)         | w[n, k] = scale[n, k // g] * q[n, k]                |
| uint8 [N, K/2]  | f32 [N, G]       | None           | w[n, k] = scale[n, k // g] * (q[n, k] - 8)          |
| uint8 [N, K/2]  | f32 [N, G]       | f32 [N, G]     | w[n, k] = scale[n, k // g] * q[n, k] + min[n, k//g] |

g = `group_size` (0: one scale per row, G = 1), G = K / g. Packed int4 (`models.quant4`, GPTQ / AWQ nibble order):
byte j of a row holds element 2j in its low nibble (bits 0-3) and element 2j + 1 in its high nibble (bits 4-7).
The product is `x @ w.T` with f32 accumulation: x [M, K] f32 or bf16 -> f32 [M, N].

The kernels never interleave nibbles: a row's even elements are the low nibbles and its odd ones the high nibbles,
so `split_even_odd` splits x's columns the same way once (x is a few rows) and
`x @ w.T = x_even @ w_low.T + x_odd @ w_high.T`. In packed (byte) coordinates a group is g / 2 consecutive bytes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SYMMETRIC_ZERO = 8  # symmetric int4 codes are q - 8 (models.quant4)
MAX_ROWS = 8  # activation rows the kernels take (decode shapes); above it XLA's dot reads the weights as well
X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class MatmulShape:
    """What `check_args` found. rows = M, cols = K (unpacked), out = N, groups = G, group = K / G (elements),
    packed: int4 values; asymmetric: a min is given."""

    rows: int
    cols: int
    out: int
    groups: int
    group: int
    packed: bool
    asymmetric: bool

    @property
    def lanes(self) -> int:
        """Columns of `values` (K, or K / 2 packed)."""
        return self.cols // 2 if self.packed else self.cols

    @property
    def group_lanes(self) -> int:
        """Columns of `values` per group (g, or g / 2 packed)."""
        return self.group // 2 if self.packed else self.group


def check_args(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None, group_size: int,
               max_rows: int | None = None) -> MatmulShape:
    """Checks the shapes and dtypes of a weight-only matmul (module docstring table) at trace time.

    Args:
      x, values, scale, min, group_size: as in `weight_only_matmul_reference`.
      max_rows: the most rows of x a kernel takes (None: any).

    Returns:
      The MatmulShape of the call.

    Raises:
      ValueError: naming the problem: x not 2-D f32 / bf16, too many rows, values neither int8 nor uint8 or not
        2-D, K not matching (int4: odd K, or values not K / 2 wide), a group_size that is negative or does not
        divide K (int4: odd), a scale or min whose shape or dtype is wrong, a min with int8 values.
    """
    if x.ndim != 2 or jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"x must be f32 or bf16 [M, K], got {x.dtype}{list(x.shape)}")
    rows, cols = x.shape
    if rows < 1 or (max_rows is not None and rows > max_rows):
        raise ValueError(f"x has {rows} rows; the kernels take 1 to {max_rows} (decode shapes; use XLA's dot above)")
    if values.ndim != 2 or jnp.dtype(values.dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        raise ValueError(f"values must be int8 [N, K] or packed int4 uint8 [N, K/2], got {values.dtype}"
                         f"{list(values.shape)}")
    packed = values.dtype == jnp.uint8
    if packed and cols % 2:
        raise ValueError(f"packed int4 values need an even K, got x with K={cols}")
    if values.shape[1] != (cols // 2 if packed else cols):
        raise ValueError(f"values {values.dtype}{list(values.shape)} do not match x's K={cols}"
                         + (" (packed int4: K/2 bytes per row)" if packed else ""))
    if group_size < 0 or (group_size and cols % group_size) or (packed and group_size % 2):
        raise ValueError(f"group_size={group_size} must be 0 (one scale per row) or divide K={cols}"
                         + (" and be even (packed int4)" if packed else ""))
    out = values.shape[0]
    groups = cols // group_size if group_size else 1
    if scale.shape != (out, groups) or scale.dtype != jnp.float32:
        raise ValueError(f"scale must be f32[{out}, {groups}] (N, K / group_size), got {scale.dtype}"
                         f"{list(scale.shape)}")
    if min is not None:
        if not packed:
            raise ValueError("min (asymmetric weights) is only for packed int4 values, not int8")
        if min.shape != scale.shape or min.dtype != jnp.float32:
            raise ValueError(f"min must be f32{list(scale.shape)} like scale, got {min.dtype}{list(min.shape)}")
    return MatmulShape(rows, cols, out, groups, cols // groups, packed, min is not None)


def unpack_low_high(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 codes in [0, 15] of packed bytes uint8 [..., n]: (low nibbles = even elements, high = odd), [..., n]."""
    v = values.astype(jnp.int32)
    return v & 0xF, v >> 4


def split_even_odd(x: jax.Array) -> jax.Array:
    """[2, M, K/2]: x's even columns, then its odd ones (the elements of low and high nibbles); x [M, K], K even."""
    return jnp.stack([x[:, 0::2], x[:, 1::2]])


def dequantize(values: jax.Array, scale: jax.Array, min: jax.Array | None = None, *, group_size: int) -> jax.Array:
    """f32 [N, K] weights of a format of the module docstring (no checks: see `check_args`)."""
    if values.dtype == jnp.uint8:
        low, high = unpack_low_high(values)
        codes = jnp.stack([low, high], axis=-1).reshape(values.shape[0], -1)  # [N, K]: 2j low, 2j + 1 high
        if min is None:
            codes = codes - SYMMETRIC_ZERO
    else:
        codes = values.astype(jnp.int32)
    n, k = codes.shape
    groups = scale.shape[1]
    w = codes.astype(jnp.float32).reshape(n, groups, k // groups) * scale[:, :, None]
    if min is not None:
        w = w + min[:, :, None]
    return w.reshape(n, k)


def weight_only_matmul_reference(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None = None,
                                 *, group_size: int) -> jax.Array:
    """x @ w.T for a weight-only quantized w (module docstring table), dequantized to f32 first.

    Args:
      x: f32 or bf16 [M, K] activations.
      values: int8 [N, K], or packed int4 uint8 [N, K/2] (the dtype picks the format).
      scale: f32 [N, G], G = K / group_size (group_size 0: G = 1, one scale per row).
      min: f32 [N, G] for asymmetric int4 (w = scale * q + min); None: symmetric (int4: w = scale * (q - 8)).
      group_size: input elements per scale (0: the whole row).

    Returns:
      f32 [M, N], products and sums in f32 (`Precision.HIGHEST`).

    Raises:
      ValueError: on the shape / dtype problems of `check_args`.
    """
    check_args(x, values, scale, min, group_size)
    w = dequantize(values, scale, min, group_size=group_size)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
