"""Causal flash attention over fresh packed tokens for TPU (Pallas Mosaic): the prefill of new sequences.

1. The wrapper pads T to whole query tiles (`block_q` tokens) and whole KV tiles (`block_kv` tokens), regroups the
   queries per kv head into `[K, Tq * G, H]` (row `t * G + g` is token t of query head g of that kv head), so one
   program's query tile `[block_q * G, H]` is a plain block, and lays K/V out as `[K, Tk, H]`.
2. Grid `(K, Tq / block_q)`. `cu_q_lens` and a per-tile schedule (`reference.query_block_schedule`: the KV tiles
   the tile can see, the sequences starting inside it) arrive through scalar prefetch (SMEM); K/V stay in HBM
   (`pl.ANY`).
3. Each program walks only KV tiles `[kv_lo, kv_hi)`: tiles entirely in the future of its last row, entirely before
   its first row's sequence start, or entirely outside the sliding window are never loaded. Each step copies one
   `[block_kv, H]` tile of K and of V of its kv head by manual DMA, double buffered: tile j + 1 is in flight while
   tile j is computed.
4. Inside a tile, row t sees key s iff `start[t] <= s <= t` and `t - s < W` (segment, causal, window). The per-row
   sequence start is built once per program from the few sequence starts inside the tile (scalars), so no
   per-token vector is loaded.
5. Online softmax over the tiles (FlashAttention, arXiv:2205.14135, algorithm 1; FlashAttention-2's deferred
   normalisation, arXiv:2307.08691), carries in f32.

Head dim 64 (SmolLM2) lowers because no block has a last dim below the array's: the query/output tiles and the
K/V buffers span the whole head dim. `block_q * G` must be a multiple of 8 (Mosaic's sublane tiling) unless one
tile covers all of T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.block_sizes import BlockSizes, flash_block_sizes
from pallas_kernels.flash_attention.reference import check_heads, query_block_schedule
from pallas_kernels.ragged import check_window_and_cap, visible
from pallas_kernels.tpu_pipeline import next_tile, start_first


def _flash_attention_kernel(
    # scalar prefetch (SMEM)
    cu_q_lens_ref,  # i32[B + 1]
    kv_lo_ref,  # i32[num_q_blocks]
    kv_hi_ref,  # i32[num_q_blocks]
    seq_lo_ref,  # i32[num_q_blocks]
    seq_hi_ref,  # i32[num_q_blocks]
    # inputs
    q_ref,  # [block_q * G, H] (VMEM)
    k_hbm_ref,  # [K, Tk, H] (HBM)
    v_hbm_ref,  # [K, Tk, H] (HBM)
    # outputs
    o_ref,  # [block_q * G, H] (VMEM)
    # scratch
    k_buf,  # [2, block_kv, H] (VMEM, double buffer)
    v_buf,  # [2, block_kv, H]
    sems,  # DMA[2, 2] (k/v, slot)
    *,
    group: int,
    block_q: int,
    block_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    kv_head, q_block = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    lo, hi = kv_lo_ref[q_block], kv_hi_ref[q_block]

    def copies(j, slot):
        return [pltpu.make_async_copy(src.at[kv_head, pl.ds(j * block_kv, block_kv)], dst.at[slot], sems.at[i, slot])
                for i, (src, dst) in enumerate(((k_hbm_ref, k_buf), (v_hbm_ref, v_buf)))]

    start_first(copies, lo, hi)

    # Flat token of each row, first_t + row // G, in f32 (exact: rows < 2**20) to keep integer division off the
    # vector unit.
    first_t = q_block * block_q
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0).astype(jnp.float32)
    t = first_t + jnp.floor((row + 0.5) * (1.0 / group)).astype(jnp.int32)  # [rows, 1]

    # Sequence start of each row: the first row's, then each later start inside the tile that the row has passed.
    def take_start(b, start):
        cu = cu_q_lens_ref[b]
        return jnp.where(t >= cu, cu, start)

    start = jax.lax.fori_loop(seq_lo_ref[q_block] + 1, seq_hi_ref[q_block] + 1, take_start,
                              jnp.full((rows, 1), cu_q_lens_ref[seq_lo_ref[q_block]], jnp.int32))
    q_pos = t - start  # [rows, 1], position of each row in its sequence
    q = q_ref[...]

    def body(j, carry):
        slot = next_tile(copies, j, lo, hi)
        k, v = k_buf[slot], v_buf[slot]  # [block_kv, H]
        kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1) - start
        # kv_pos < 0: an earlier sequence's key. A fresh token's context is the q_pos + 1 tokens up to it.
        ok = (kv_pos >= 0) & visible(q_pos, kv_pos, q_pos + 1, sliding_window)
        return online_softmax.update(carry, q, k, v, ok, sm_scale=sm_scale, soft_cap=soft_cap)

    out, _ = online_softmax.finish(jax.lax.fori_loop(lo, hi, body, online_softmax.init(rows, head_dim)))
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret"))
def flash_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        block_sizes: BlockSizes | None = None,
                        interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Causal attention of packed fresh sequences on TPU; same contract as `flash_attention_reference`.

    Args:
      q: [T, N, H] queries (f32 or bf16); rows past `cu_q_lens[-1]` are padding.
      k, v: [T, K, H] keys and values of the same tokens, q's dtype; N a multiple of K.
      cu_q_lens: i32[B + 1], B >= 1, non-decreasing prefix sums of q_lens, `cu_q_lens[0] == 0`,
        `cu_q_lens[-1] <= T`.
      sm_scale: softmax scale.
      sliding_window, soft_cap: as in `flash_attention_reference`.
      block_sizes: tiles in tokens (`block_q * G` a multiple of 8 on TPU unless `block_q >= T`); default from
        `pallas_kernels.block_sizes.flash_block_sizes("tpu", num_tokens=T)`.
      interpret: False on TPU; True (generic) or `pltpu.InterpretParams()` (TPU memory, DMA and race
        simulation) to run on CPU.

    Returns:
      [T, N, H] in q's dtype; padding rows are 0.

    Raises:
      ValueError: on mismatched heads, head dims or token counts, or bad sliding_window / soft_cap (at trace
        time). Mosaic raises at lowering for tiles that break its block rules.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = check_heads(q, k, v)
    check_window_and_cap(sliding_window, soft_cap)
    num_kv_heads = num_heads // group
    bs = block_sizes or flash_block_sizes("tpu", num_tokens=num_tokens)
    block_q, block_kv = min(bs.block_q, num_tokens), min(bs.block_kv, num_tokens)
    q_pad = -(-num_tokens // block_q) * block_q
    kv_pad = -(-num_tokens // block_kv) * block_kv
    num_q_blocks = q_pad // block_q
    rows = block_q * group

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    schedule = query_block_schedule(cu_q_lens, num_q_blocks, block_q, block_kv, sliding_window)
    q_rows = jnp.pad(q, ((0, q_pad - num_tokens), (0, 0), (0, 0))).reshape(q_pad, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, q_pad * group, head_dim)  # [K, Tq * G, H]
    k_t, v_t = (jnp.pad(a, ((0, kv_pad - num_tokens), (0, 0), (0, 0))).transpose(1, 0, 2) for a in (k, v))  # [K, Tk, H]

    q_spec = pl.BlockSpec((None, rows, head_dim), lambda h, i, *_: (h, i, 0))
    kernel = functools.partial(_flash_attention_kernel, group=group, block_q=block_q, block_kv=block_kv,
                               sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_kv_heads, num_q_blocks),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2, block_kv, head_dim), k.dtype), pltpu.VMEM((2, block_kv, head_dim), v.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="flash_attention_tpu",
    )(cu_q_lens, *schedule, q_rows, k_t, v_t)
    out = out.reshape(num_kv_heads, q_pad, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(q_pad, num_heads, head_dim)[:num_tokens]  # [T, N, H]
    real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
