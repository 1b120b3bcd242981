"""Ragged paged attention for TPU (Pallas Mosaic): decodes, prefill chunks and verification windows in one call.

1. The wrapper regroups the flat queries per sequence and per kv head into `[B, K, Tq * G, H]` (row `t * G + g`
   is query token t of head g of that kv head), so one program's query tile `[block_q * G, H]` is a plain block.
2. Grid `(B, K, Tq / block_q, num_splits)`. Lengths, the flattened page table and the layer index arrive
   through scalar prefetch (SMEM); the stacked KV cache stays in HBM (`pl.ANY`).
3. Each program walks only the KV blocks its queries can see (causal end, sliding-window start, its split's
   share), `block_kv` tokens = `block_kv / page_size` pages at a time. Page copies are manual DMAs, one per page
   of its kv head (`[page_size, H]`, contiguous in the cache layout), double buffered: block j + 1 is in flight
   while block j is computed.
4. Online softmax over the blocks (FlashAttention, arXiv:2205.14135, algorithm 1; FlashAttention-2's deferred
   normalisation, arXiv:2307.08691). With `num_splits > 1` each split writes its normalised partial output and
   log-sum-exp, and the wrapper merges them (`pallas_kernels.ragged.combine_splits`, FlashDecoding).

Quantized pages (int8 / fp8, `pallas_kernels.kv_quant`): each page's key and value scale rows (`[1, page_size]` f32
of its kv head) are DMA'd beside the page into buffers of their own, and the online softmax runs page by page
inside a KV block, each page's scores multiplied by its key scale row and its probabilities by its value scale row
(a row vector per page needs no lane relayout, which a `[1, block_kv]` row gathered from several pages would).
Values enter the dots in q's dtype (`kv_quant.load_values`: fp8 bit patterns decode with integer ops, so no
float8 support is needed from the chip).

Head dim 64 (SmolLM2) lowers because no block has a last dim below the array's: the query/output tiles and the
page buffers span the whole head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.block_sizes import BlockSizes, paged_block_sizes
from pallas_kernels.paged_attention.reference import check_paged_args
from pallas_kernels.ragged import (combine_splits, flatten_page_table, kv_block_range, pack_queries, unpack_outputs,
                                   visible)
from pallas_kernels.tpu_pipeline import next_tile, start_first

LANES = 128  # TPU vector lane width: the split kernel's log-sum-exp output is lane-replicated to this width


def _paged_attention_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # i32[B]
    q_lens_ref,  # i32[B]
    page_table_ref,  # i32[B * W], row-major [B, W]
    layer_ref,  # i32[1]
    # inputs
    q_ref,  # [block_q * G, H] (VMEM)
    k_hbm_ref,  # [L, P, K, page_size, H] (HBM)
    v_hbm_ref,  # [L, P, K, page_size, H] (HBM)
    *rest,  # quantized: k_scale_hbm_ref, v_scale_hbm_ref f32[L, P, K, page_size] (HBM); then outputs, scratch
    quantized: bool,
    group: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    rest = list(rest)
    scale_hbm_refs = (rest.pop(0), rest.pop(0)) if quantized else ()
    # outputs
    o_ref = rest.pop(0)  # [block_q * G, H] (VMEM)
    lse_ref = rest.pop(0) if num_splits > 1 else None  # f32[block_q * G, LANES]
    # scratch: k_buf, v_buf [2, pages_per_block, page_size, H] (VMEM, double buffer); quantized: ks_buf, vs_buf
    # f32[2, pages_per_block, page_size]; sems DMA[2 or 4, 2] (k, v[, k scale, v scale]; slot)
    k_buf, v_buf = rest.pop(0), rest.pop(0)
    scale_bufs = (rest.pop(0), rest.pop(0)) if quantized else ()
    (sems,) = rest
    b, kv_head, q_block, split = (pl.program_id(i) for i in range(4))
    block_kv = pages_per_block * page_size
    rows, head_dim = q_ref.shape
    kv_len, q_len, layer = kv_lens_ref[b], q_lens_ref[b], layer_ref[0]

    first_t = q_block * block_q
    lo, hi, context_start = kv_block_range(first_t=first_t, block_q=block_q, q_len=q_len, kv_len=kv_len,
                                           block_kv=block_kv, split=split, num_splits=num_splits,
                                           sliding_window=sliding_window)

    def copies(j, slot):
        out = []
        for p in range(pages_per_block):
            page = page_table_ref[b * pages_per_seq + j * pages_per_block + p]
            for i, (src, dst) in enumerate(((k_hbm_ref, k_buf), (v_hbm_ref, v_buf))):
                out.append(pltpu.make_async_copy(src.at[layer, page, kv_head], dst.at[slot, p], sems.at[i, slot]))
            for i, (src, dst) in enumerate(zip(scale_hbm_refs, scale_bufs), start=2):  # [1, page_size] rows
                out.append(pltpu.make_async_copy(src.at[layer, page, pl.ds(kv_head, 1)], dst.at[slot, pl.ds(p, 1)],
                                                 sems.at[i, slot]))
        return out

    start_first(copies, lo, hi)

    # A tile is a whole KV block, or one page of it with quantized pages (module docstring).
    tile = page_size if quantized else block_kv
    # Query token of each row, row // G, in f32 (exact: rows < 2**20) to keep integer division off the vector unit.
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 0).astype(jnp.float32)
    row_t = first_t + jnp.floor((row + 0.5) * (1.0 / group)).astype(jnp.int32)
    q_pos = context_start + row_t
    q = q_ref[...]

    def body(j, carry):
        slot = next_tile(copies, j, lo, hi)
        if not quantized:
            k = k_buf[slot].reshape(block_kv, head_dim)  # [block_kv, H]
            v = v_buf[slot].reshape(block_kv, head_dim)
            kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
            mask = visible(q_pos, kv_pos, kv_len, sliding_window)
            return online_softmax.update(carry, q, k, v, mask, sm_scale=sm_scale, soft_cap=soft_cap)
        ks_buf, vs_buf = scale_bufs
        for p in range(pages_per_block):
            kv_pos = j * block_kv + p * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
            mask = visible(q_pos, kv_pos, kv_len, sliding_window)
            carry = online_softmax.update(carry, q, k_buf[slot, p], v_buf[slot, p], mask, sm_scale=sm_scale,
                                          soft_cap=soft_cap, k_scale=ks_buf[slot, pl.ds(p, 1)],
                                          v_scale=vs_buf[slot, pl.ds(p, 1)])  # scales f32[1, page_size]
        return carry

    out, lse = online_softmax.finish(jax.lax.fori_loop(lo, hi, body, online_softmax.init(rows, head_dim)))
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale", "sliding_window", "soft_cap", "block_sizes",
                                             "interpret"))
def paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array, page_table: jax.Array,
                        cu_q_lens: jax.Array, layer: jax.Array | int | None = None, *, max_q_len: int, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool | pltpu.InterpretParams = False,
                        k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """Causal paged attention of a ragged batch on TPU; same contract as `paged_attention_reference`.

    Args:
      q: [T, N, H] flat queries (f32 or bf16); rows past `cu_q_lens[-1]` are padding.
      k_pages, v_pages: [P, K, page_size, H] one layer's cache, or [L, P, K, page_size, H] with `layer`.
      kv_lens: i32[B], cached + new tokens per sequence, in [0, max_pages_per_seq * page_size]; 0 = padding.
      page_table: i32[B, max_pages_per_seq], entries in [0, P).
      cu_q_lens: i32[B + 1], prefix sums of q_lens; `cu_q_lens[-1] <= T`.
      layer: i32 scalar in [0, L) for a stacked cache, None for a single layer's.
      max_q_len: static bound on every q_len (1 for a pure decode batch); not checked on device: query
        rows past it are not computed (`validate_inputs` checks it, and the other value invariants, on host).
      sm_scale: softmax scale.
      sliding_window, soft_cap: as in `paged_attention_reference`.
      block_sizes: tiles; default from `pallas_kernels.block_sizes.paged_block_sizes("tpu", ...)`.
      interpret: False on TPU; True (generic) or `pltpu.InterpretParams()` (TPU memory, DMA and race
        simulation) to run on CPU.
      k_scale, v_scale: f32[P, K, page_size] (or [L, ...] with `layer`) scales of int8 / fp8 pages; None for
        float pages (see `reference`).

    Returns:
      [T, N, H] in q's dtype; padding rows are 0.

    Raises:
      ValueError: at trace time, on the shape errors of `reference.check_paged_args` (mismatched heads, head
        dims, k/v shapes, batch sizes, cache rank vs layer index, bad sliding_window / soft_cap, missing or
        misshapen scales) or a `block_kv` that is not a multiple of page_size.
    """
    check_paged_args(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer, sliding_window, soft_cap,
                     k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    quantized = k_scale is not None
    scales = (k_scale, v_scale) if quantized else ()
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        scales = tuple(x[None] for x in scales)
    _, _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    bs = block_sizes or paged_block_sizes("tpu", max_q_len=max_q_len, page_size=page_size,
                                          max_kv_len=pages_per_seq * page_size, num_seqs=num_seqs)
    if bs.block_kv % page_size:
        raise ValueError(f"block_kv={bs.block_kv} is not a multiple of {page_size=}")
    pages_per_block = bs.block_kv // page_size
    block_q = min(bs.block_q, max_q_len)
    q_pad = -(-max_q_len // block_q) * block_q
    num_q_blocks = q_pad // block_q

    table, width = flatten_page_table(page_table, pages_per_block)  # i32[B * W'] for SMEM
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q_seq = pack_queries(q, cu_q_lens, q_pad, num_kv_heads, group)  # [B, K, Tq * G, H]
    rows = block_q * group

    split = bs.num_splits > 1
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, k, i, s, *_: (b, k, i, 0))
    if split:
        out_shape = (jax.ShapeDtypeStruct((bs.num_splits, num_seqs, num_kv_heads, q_pad * group, head_dim),
                                          jnp.float32),
                     jax.ShapeDtypeStruct((bs.num_splits, num_seqs, num_kv_heads, q_pad * group, LANES),
                                          jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, rows, head_dim), lambda b, k, i, s, *_: (s, b, k, i, 0)),
                     pl.BlockSpec((None, None, None, rows, LANES), lambda b, k, i, s, *_: (s, b, k, i, 0)))
    else:
        out_shape = jax.ShapeDtypeStruct(q_seq.shape, q.dtype)
        out_specs = q_spec
    kernel = functools.partial(
        _paged_attention_kernel, quantized=quantized, group=group, block_q=block_q, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=width, num_splits=bs.num_splits, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_seqs, num_kv_heads, num_q_blocks, bs.num_splits),
        in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(scales)),
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, pages_per_block, page_size, head_dim), v_pages.dtype),
                        *[pltpu.VMEM((2, pages_per_block, page_size), x.dtype) for x in scales],
                        pltpu.SemaphoreType.DMA((2 + len(scales), 2))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4),
        interpret=interpret,
        name="paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), q_lens, table, layer_arr, q_seq, k_pages, v_pages, *scales)
    if split:
        out = combine_splits(out[0], out[1][..., 0])  # [B, K, Tq * G, H]
    return unpack_outputs(out, cu_q_lens, num_tokens, group, group).astype(q.dtype)
