"""Weight-only int8 / int4 matmul at decode shapes (M <= 8 rows) for TPU (Pallas Mosaic).

Formats and the even/odd split of packed int4: `pallas_kernels.quant_matmul.reference`.

1. The wrapper pads x to 8 rows (one f32 sublane tile), splits it into even / odd columns for int4, and lays the
   scales (and mins) out as [G, N] so that a tile's scales are lane-dense along N like the output. Per-row scales
   [N, 1] are that layout already (a free reshape); grouped ones cost one XLA transpose per call (2 x their bytes,
   1/4 of int4 g32's weight bytes): store them transposed to avoid it.
2. Grid (N / block_n, K / block_k), K innermost ("arbitrary"): each step streams one [block_n, block_k] tile of
   values HBM -> VMEM through its BlockSpec (Pallas double-buffers it) and adds its partial product into the f32
   output block, which stays in VMEM across the K steps. An N edge tile reads past the last row; those outputs
   are dropped on write back.
3. The codes enter the MXU unscaled (integers up to 127 are exact in bf16), so nothing of the tile is dequantized
   elementwise but the integer -> float convert: scales are applied to the partial products. With groups, the
   tile's x is expanded block-diagonally, row (g, m) = x[m] masked to group g's columns ([groups_per_tile * 8,
   block_k]), one dot gives every group's partial sums at once ([groups_per_tile * 8, block_n]), and those are
   scaled by their group's scale row and summed over groups. At <= 128 LHS rows the MXU's cost is loading the
   weight tile, not the row count, so the expansion rides along. Asymmetric int4 adds
   sum_g min[n, g] * (sum of x over group g).
4. Tiles: block_k is a multiple of the group holding 16 or 8 groups (so the scale block's second-minor dim is a
   multiple of 8), a multiple of 128 lanes, or the whole K; block_n a multiple of 128 or the whole N (TPU
   block-shape rules: the last two block dims divisible by 8 and 128, or equal to the array's).

bf16 x: the MXU multiplies bf16 x by exact integer codes with f32 accumulation, and the f32 scales are applied
after, so this is closer to the f32 reference than XLA's path, which rounds each dequantized weight to bf16.
f32 x: the dot runs at `Precision.HIGHEST`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul.reference import (MAX_ROWS, SYMMETRIC_ZERO, MatmulShape, check_args, split_even_odd,
                                                   unpack_low_high)

ROWS = 8  # x is padded to one f32 sublane tile
assert ROWS >= MAX_ROWS
LANES = 128
MAX_EXPANDED_BYTES = 8 << 20  # the block-diagonal x of a whole-K tile (no aligned K tile) may not exceed this


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Tile sizes: block_n output rows (a multiple of 128, or N), block_k input columns of `values` (lanes)."""

    block_n: int = 512
    block_k: int | None = None  # None: `choose_block_k`


def choose_block_k(shape: MatmulShape, max_lanes: int = 1024) -> int:
    """Columns of `values` per tile (module docstring, 4); a ValueError if only a whole-K tile fits and its
    expanded x would exceed MAX_EXPANDED_BYTES."""
    lanes = shape.lanes
    if shape.groups == 1:  # one scale per row: any lane-aligned divisor of K
        for tile in range(max_lanes, LANES - 1, -LANES):
            if lanes % tile == 0:
                return tile
        return lanes
    for per_tile in (16, 8, *range(24, shape.groups, 8)):
        tile = per_tile * shape.group_lanes
        if lanes % tile == 0 and tile % LANES == 0:
            return tile
    if shape.groups * ROWS * lanes * 4 > MAX_EXPANDED_BYTES:
        raise ValueError(f"no TPU K tile for K={shape.cols}, group {shape.group}: a whole-K tile would expand x to "
                         f"{shape.groups * ROWS * lanes * 4} bytes")
    return lanes


def _block_diagonal(x: jax.Array, groups: int, group_lanes: int) -> jax.Array:
    """f32 [groups * ROWS, lanes]: row g * ROWS + m is x[m] with the columns outside group g zeroed."""
    lanes = x.shape[-1]
    col = jax.lax.broadcasted_iota(jnp.int32, (groups, lanes), 1)
    first = jax.lax.broadcasted_iota(jnp.int32, (groups, lanes), 0) * group_lanes
    mask = (col >= first) & (col < first + group_lanes)  # [g, lanes]
    out = jnp.where(mask[:, None, :], x.astype(jnp.float32)[None], 0.0)  # [g, ROWS, lanes]
    return out.reshape(groups * ROWS, lanes)


def _quant_matmul_kernel(
    # inputs
    x_ref,  # [ROWS, bk], or [2, ROWS, bk] even / odd columns for int4
    v_ref,  # [bn, bk] int8, or uint8 packed int4
    s_ref,  # f32[gpt, bn] scales of this tile's groups (gpt = 1: per row)
    *rest,  # asymmetric: m_ref f32[gpt, bn]; then o_ref
    packed: bool,
    asymmetric: bool,
    groups: int,  # per tile (gpt)
    group_lanes: int,
    compute_dtype: jnp.dtype,
    precision: jax.lax.Precision | None,
):
    m_ref, o_ref = rest if asymmetric else (None, *rest)  # o_ref: f32[ROWS, bn], resident across the K steps

    @pl.when(pl.program_id(1) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    if packed:
        low, high = unpack_low_high(v_ref[...])  # i32[bn, bk] each: even / odd elements
        if not asymmetric:
            low, high = low - SYMMETRIC_ZERO, high - SYMMETRIC_ZERO
        pairs = ((x_ref[0], low), (x_ref[1], high))
    else:
        pairs = ((x_ref[...], v_ref[...].astype(jnp.int32)),)
    bn = o_ref.shape[1]
    partial = jnp.zeros((groups * ROWS, bn), jnp.float32)
    x_sums = jnp.zeros((groups * ROWS, 1), jnp.float32)
    for x, codes in pairs:
        xb = x.astype(jnp.float32) if groups == 1 else _block_diagonal(x, groups, group_lanes)  # [gpt * ROWS, bk]
        codes = codes.astype(jnp.float32).astype(compute_dtype)  # exact: |codes| <= 127
        partial += jax.lax.dot_general(xb.astype(compute_dtype), codes,
                                       (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)  # [gpt * ROWS, bn]
        if asymmetric:
            x_sums += jnp.sum(xb, axis=1, keepdims=True)
    if groups == 1:
        y = partial * s_ref[...]  # [ROWS, bn] * [1, bn]
        if asymmetric:
            y += x_sums * m_ref[...]
    else:
        y = jnp.sum(partial.reshape(groups, ROWS, bn) * s_ref[...][:, None, :], axis=0)
        if asymmetric:
            y += jnp.sum(x_sums.reshape(groups, ROWS, 1) * m_ref[...][:, None, :], axis=0)
    o_ref[...] += y


@functools.partial(jax.jit, static_argnames=("group_size", "blocks", "interpret"))
def weight_only_matmul_tpu(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None = None, *,
                           group_size: int, blocks: TpuBlocks = TpuBlocks(),
                           interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """x @ w.T for a weight-only int8 / int4 w on TPU; same contract as `weight_only_matmul_reference`.

    Args:
      x: f32 or bf16 [M, K], 1 <= M <= 8.
      values: int8 [N, K] or packed int4 uint8 [N, K/2].
      scale: f32 [N, G]; min: f32 [N, G] (asymmetric int4) or None.
      group_size: elements per scale (0: per row).
      blocks: tile sizes (`TpuBlocks`; block_n a multiple of 128 unless it is >= N).
      interpret: False on TPU; `pltpu.InterpretParams()` (or True, generic) runs it on CPU.

    Returns:
      f32 [M, N].

    Raises:
      ValueError: on `reference.check_args`'s problems (M > 8 included), a block_n that is no multiple of 128,
        or no K tile (`choose_block_k`).
    """
    shape = check_args(x, values, scale, min, group_size, max_rows=MAX_ROWS)
    n = shape.out
    bn = n if blocks.block_n >= n else blocks.block_n
    if bn != n and bn % LANES:
        raise ValueError(f"block_n={blocks.block_n} must be a multiple of {LANES} (or >= N={n})")
    bk = blocks.block_k or choose_block_k(shape)
    if shape.lanes % bk or (bk != shape.lanes and bk % LANES):
        raise ValueError(f"block_k={bk} must divide K's {shape.lanes} columns of values and be a multiple of {LANES}")
    groups = 1 if shape.groups == 1 else bk // shape.group_lanes
    if groups > 1 and groups % 8 and groups != shape.groups:
        raise ValueError(f"block_k={bk} holds {groups} groups: want a multiple of 8 or all {shape.groups}")

    xp = jnp.zeros((ROWS, shape.cols), x.dtype).at[:shape.rows].set(x)  # [8, K]
    if shape.packed:
        xp = split_even_odd(xp)  # [2, 8, K/2]
        x_spec = pl.BlockSpec((2, ROWS, bk), lambda j, k: (0, 0, k))
    else:
        x_spec = pl.BlockSpec((ROWS, bk), lambda j, k: (0, k))
    per_tile = [scale.T] + ([min.T] if min is not None else [])  # f32[G, N]
    if groups == 1:
        s_spec = pl.BlockSpec((1, bn), lambda j, k: (0, j))
    else:
        s_spec = pl.BlockSpec((groups, bn), lambda j, k: (k, j))
    kernel = functools.partial(
        _quant_matmul_kernel, packed=shape.packed, asymmetric=shape.asymmetric, groups=groups,
        group_lanes=shape.group_lanes, compute_dtype=x.dtype,
        precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, bn), shape.lanes // bk),
        in_specs=[x_spec, pl.BlockSpec((bn, bk), lambda j, k: (j, k))] + [s_spec] * len(per_tile),
        out_specs=pl.BlockSpec((ROWS, bn), lambda j, k: (0, j)),
        out_shape=jax.ShapeDtypeStruct((ROWS, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="weight_only_matmul_tpu",
    )(xp, values, *per_tile)
    return out[:shape.rows]
