"""Weight-only int8 / int4 matmul at decode shapes (M <= 8 rows) for GPU (Pallas, Triton backend).

Formats and the even/odd split of packed int4: `pallas_kernels.quant_matmul.reference`. Why the Triton backend
(deprecated since jax 0.11, but the one that lowers on CPU and runs on every CUDA GPU):
`pallas_kernels.paged_attention.gpu`.

1. The wrapper pads x to 16 rows (`tl.dot` needs M >= 16) and splits it into even / odd columns for int4; per-row
   scales [N, 1] become a [1, N] row (a free reshape).
2. Grid (N / block_n, split_k). Each program owns block_n rows of the weight (one `BlockSpec` block; an N edge
   block is masked by Pallas) and walks its share of K, block_k columns of `values` at a time, in a `fori_loop`
   that Triton software-pipelines (`num_stages`): load the [block_n, block_k] tile, unpack nibbles, dequantize in
   f32 (grouped scales: the tile viewed as [block_n, groups, group] times the groups' scales), cast to x's dtype,
   one `tl.dot` with x's [16, block_k] slice, f32 accumulator. Per-row scales multiply the accumulator at the end
   instead. With split_k > 1 the programs write partial sums [split_k, 16, N] that the wrapper adds (enough
   programs to fill the GPU when N is small, e.g. a down projection).
3. Triton tiles must have power-of-two sizes: block_n, block_k and (grouped) the group's columns of `values`
   are powers of two, block_k divides K's columns (at least 16 on hardware), and a group's columns divide block_k
   or are a multiple of it.

bf16 x: weights are dequantized in f32 and rounded to bf16 before the dot (what XLA's path, `qeinsum`, does).
f32 x: the dot runs at `Precision.HIGHEST` (IEEE f32, not TF32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.quant_matmul.reference import (MAX_ROWS, SYMMETRIC_ZERO, MatmulShape, check_args, split_even_odd,
                                                   unpack_low_high)
from pallas_kernels.ragged import is_pow2

ROWS = 16  # x is padded to tl.dot's smallest M
MIN_DOT_DIM = 16
TARGET_PROGRAMS = 264  # split K until about this many programs run (2 per SM of an H100 / H200)


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """Tile sizes (powers of two): block_n weight rows per program, block_k columns of `values` per loop step
    (None: `choose_block_k`), split_k (None: `choose_split_k`). Defaults untuned: `scripts/gpu_check.py` times a
    few on a GPU."""

    block_n: int = 64
    block_k: int | None = None
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3


def choose_block_k(shape: MatmulShape, max_elements: int = 128) -> int:
    """The largest power of two dividing K's columns of `values` that covers at most `max_elements` of K (int8:
    128 bytes per weight row, int4: 64)."""
    tile = max_elements // 2 if shape.packed else max_elements
    while shape.lanes % tile:
        tile //= 2
    return tile


def choose_split_k(num_blocks_n: int, num_chunks: int) -> int:
    """Powers of two that keep >= 4 loop steps per program, until TARGET_PROGRAMS programs run."""
    split = 1
    while num_blocks_n * split < TARGET_PROGRAMS and num_chunks % (2 * split) == 0 and num_chunks // (2 * split) >= 4:
        split *= 2
    return split


def _quant_matmul_kernel(
    # inputs
    x_ref,  # [ROWS, Kv], or [2, ROWS, Kv] even / odd columns for int4 (whole array; Kv = K's columns of values)
    v_ref,  # [bn, Kv] int8, or uint8 packed int4
    s_ref,  # f32[bn, G] group scales, or f32[1, bn] per-row scales
    *rest,  # asymmetric: m_ref f32[bn, G]; then o_ref f32[ROWS, bn]
    packed: bool,
    asymmetric: bool,
    per_row: bool,
    group_lanes: int,
    block_k: int,
    steps: int,  # loop steps per program
    compute_dtype: jnp.dtype,
    precision: jax.lax.Precision | None,
):
    m_ref, o_ref = rest if asymmetric else (None, *rest)
    bn = v_ref.shape[0]
    first = pl.program_id(1) * steps

    def dequantize(codes, k0):  # codes i32[bn, bk] -> [bn, bk] compute_dtype
        w = codes.astype(jnp.float32)
        if per_row:
            return w.astype(compute_dtype)
        if group_lanes <= block_k:  # whole groups in the tile: view it as [bn, groups, group]
            groups = block_k // group_lanes
            cols = pl.ds(k0 // group_lanes, groups)
            w = w.reshape(bn, groups, group_lanes) * s_ref[:, cols][:, :, None]
            if asymmetric:
                w += m_ref[:, cols][:, :, None]
            return w.reshape(bn, block_k).astype(compute_dtype)
        col = pl.ds(k0 // group_lanes, 1)  # the tile lies inside one group
        w = w * s_ref[:, col]
        if asymmetric:
            w += m_ref[:, col]
        return w.astype(compute_dtype)

    def body(i, acc):
        k0 = (first + i) * block_k
        cols = pl.ds(k0, block_k)
        if packed:
            low, high = unpack_low_high(v_ref[:, cols])  # i32[bn, bk]: even / odd elements
            if not asymmetric:
                low, high = low - SYMMETRIC_ZERO, high - SYMMETRIC_ZERO
            pairs = ((x_ref[0, :, cols], low), (x_ref[1, :, cols], high))
        else:
            pairs = ((x_ref[:, cols], v_ref[:, cols].astype(jnp.int32)),)
        for x, codes in pairs:
            acc += jax.lax.dot_general(x.astype(compute_dtype), dequantize(codes, k0), (((1,), (1,)), ((), ())),
                                       precision=precision, preferred_element_type=jnp.float32)  # [ROWS, bn]
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((ROWS, bn), jnp.float32))
    if per_row:
        acc = acc * s_ref[...]  # [1, bn]
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("group_size", "blocks", "interpret"))
def weight_only_matmul_gpu(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None = None, *,
                           group_size: int, blocks: GpuBlocks = GpuBlocks(), interpret: bool = False) -> jax.Array:
    """x @ w.T for a weight-only int8 / int4 w on GPU; same contract as `weight_only_matmul_reference`.

    Args:
      x: f32 or bf16 [M, K], 1 <= M <= 8.
      values: int8 [N, K] or packed int4 uint8 [N, K/2].
      scale: f32 [N, G]; min: f32 [N, G] (asymmetric int4) or None.
      group_size: elements per scale (0: per row); its columns of values (int4: g / 2) a power of two or a
        multiple of block_k.
      blocks: tile sizes and Triton launch options (`GpuBlocks`).
      interpret: False on GPU; True runs the same kernel in Pallas' generic interpret mode (CPU).

    Returns:
      f32 [M, N].

    Raises:
      ValueError: on `reference.check_args`'s problems (M > 8 included), tiles that are not powers of two, a
        block_k that does not divide K's columns or (on hardware) is below 16, a group that neither divides
        block_k nor is a multiple of it, or a split_k that does not divide the loop steps.
    """
    shape = check_args(x, values, scale, min, group_size, max_rows=MAX_ROWS)
    n, lanes = shape.out, shape.lanes
    per_row = shape.groups == 1 and not shape.asymmetric  # scale the accumulator; a min needs the grouped path
    bn, bk = blocks.block_n, blocks.block_k or choose_block_k(shape)
    if not (is_pow2(bn) and is_pow2(bk)) or lanes % bk:
        raise ValueError(f"block_n={bn} and block_k={bk} must be powers of two, block_k dividing K's {lanes} columns "
                         "of values (Triton tiles)")
    if not interpret and (bn < MIN_DOT_DIM or bk < MIN_DOT_DIM):
        raise ValueError(f"block_n={bn} and block_k={bk} must be >= {MIN_DOT_DIM} for tl.dot (K's columns {lanes})")
    if not per_row and shape.group_lanes % bk and bk % shape.group_lanes:
        raise ValueError(f"group_size={group_size} must be a power of two or a multiple of block_k={bk} columns of "
                         "values on GPU (Triton tiles)")
    num_n, chunks = pl.cdiv(n, bn), lanes // bk
    split = blocks.split_k or choose_split_k(num_n, chunks)
    if chunks % split:
        raise ValueError(f"split_k={split} must divide K's {chunks} steps of block_k={bk}")

    xp = jnp.zeros((ROWS, shape.cols), x.dtype).at[:shape.rows].set(x)  # [16, K]
    if shape.packed:
        xp = split_even_odd(xp)  # [2, 16, K/2]
    scales = [scale.reshape(1, n)] if per_row else [scale] + ([min] if min is not None else [])
    s_spec = pl.BlockSpec((1, bn), lambda j, s: (0, j)) if per_row else \
        pl.BlockSpec((bn, shape.groups), lambda j, s: (j, 0))
    if split > 1:
        out_shape = jax.ShapeDtypeStruct((split, ROWS, n), jnp.float32)
        out_spec = pl.BlockSpec((None, ROWS, bn), lambda j, s: (s, 0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((ROWS, n), jnp.float32)
        out_spec = pl.BlockSpec((ROWS, bn), lambda j, s: (0, j))
    kernel = functools.partial(
        _quant_matmul_kernel, packed=shape.packed, asymmetric=shape.asymmetric, per_row=per_row,
        group_lanes=shape.group_lanes, block_k=bk, steps=chunks // split, compute_dtype=x.dtype,
        precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    out = pl.pallas_call(
        kernel,
        grid=(num_n, split),
        in_specs=[pl.BlockSpec(), pl.BlockSpec((bn, lanes), lambda j, s: (j, 0))] + [s_spec] * len(scales),
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="weight_only_matmul_gpu",
    )(xp, values, *scales)
    if split > 1:
        out = jnp.sum(out, axis=0)
    return out[:shape.rows]
