"""Ragged paged attention for GPU (Pallas, Triton backend): decodes, prefill chunks and verification windows.

Backend: the generic Pallas API (`pl.pallas_call` with a grid and `BlockSpec`s, ref indexing, `jnp` / `lax` ops in
the body) lowered through Pallas' Triton backend, selected by `jax.experimental.pallas.triton.CompilerParams`.
Why not Mosaic GPU: the CPU jaxlib has no Mosaic GPU lowering rule (lowering for an abstract GPU on CPU fails
with an AssertionError in the pallas_call GPU lowering), so such a kernel could be neither lowered nor tested
where CI runs; and jax-triton 0.4.1's `triton_call` fails with jax 0.12.0.1. The Triton backend is deprecated
since jax 0.11 but present and working in both pinned versions (0.11.2 on the GPU machine, 0.12.0.1 here), runs
on every CUDA GPU (not only Hopper), and the same kernel runs in generic interpret mode on CPU. Migrating to
Mosaic GPU is the follow-up once the Triton backend is removed.

1. The wrapper regroups the flat queries per sequence and per kv head into `[B, K, Tq * G_pad, H]` (row
   `t * G_pad + g` is query token t of head g of that kv head). Triton tiles must have power-of-two sizes and
   `tl.dot` needs every dim >= 16, so the group G is padded to a power of two G_pad, raised until
   `block_q * G_pad >= 16` (decode with G = 3: G_pad = 16); padded heads are zero queries, dropped on unpack.
2. Grid `(B, K, Tq / block_q * num_splits)`. Triton has no scalar prefetch: lengths, the flattened page table
   and the layer index are ordinary whole-array inputs read as scalars in the kernel, and the stacked KV cache
   is one whole-array input indexed in place.
3. Each program walks only the KV blocks its queries can see (causal end, sliding-window start, its split's
   share), `block_kv` tokens at a time: one gather-load of the block's `block_kv / page_size` pages of its kv
   head (`[page_size, H]` each, contiguous in the cache layout). Triton's software pipelining (`num_stages`)
   overlaps the loads of block j + 1 with the compute of block j.
4. Online softmax over the blocks (FlashAttention, arXiv:2205.14135, algorithm 1; FlashAttention-2's deferred
   normalisation, arXiv:2307.08691), carries in f32. With `num_splits > 1` each split writes its normalised
   partial output and log-sum-exp, and the wrapper merges them (`pallas_kernels.ragged.combine_splits`,
   FlashDecoding).
5. Quantized pages (int8 / fp8, `pallas_kernels.kv_quant`): the block's key and value scales,
   `[block_kv / page_size, page_size]` f32, are gather-loaded beside its pages and flattened to one `[1, block_kv]`
   row each; key scales multiply the scores, value scales the probabilities, and the values enter the dots in q's
   dtype (`kv_quant.load_values`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import online_softmax
from pallas_kernels.block_sizes import BlockSizes, paged_block_sizes
from pallas_kernels.paged_attention.reference import check_paged_args
from pallas_kernels.ragged import (combine_splits, flatten_page_table, is_pow2, kv_block_range, next_pow2,
                                   pack_queries, unpack_outputs, visible)

MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16


def _paged_attention_kernel(
    # inputs
    kv_lens_ref,  # i32[B]
    q_lens_ref,  # i32[B]
    page_table_ref,  # i32[B * W], row-major [B, W]
    layer_ref,  # i32[1]
    q_ref,  # [block_q * G_pad, H]
    k_ref,  # [L, P, K, page_size, H] (whole cache)
    v_ref,  # [L, P, K, page_size, H] (whole cache)
    *rest,  # quantized: k_scale_ref, v_scale_ref f32[L, P, K, page_size] (whole); then the outputs
    quantized: bool,
    group_pad: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    scale_refs, (o_ref, *lse_refs) = (rest[:2], rest[2:]) if quantized else ((), rest)
    # outputs: o_ref [block_q * G_pad, H] (q's dtype, or f32 when split); lse_refs (f32[block_q * G_pad],) when
    # split, else ()
    b, kv_head, i = (pl.program_id(a) for a in range(3))
    q_block, split = jax.lax.div(i, num_splits), jax.lax.rem(i, num_splits)
    block_kv = pages_per_block * page_size
    rows, head_dim = q_ref.shape
    kv_len, q_len, layer = kv_lens_ref[b], q_lens_ref[b], layer_ref[0]

    first_t = q_block * block_q
    lo, hi, context_start = kv_block_range(first_t=first_t, block_q=block_q, q_len=q_len, kv_len=kv_len,
                                           block_kv=block_kv, split=split, num_splits=num_splits,
                                           sliding_window=sliding_window)

    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_pos = context_start + first_t + jax.lax.div(row, group_pad)  # [rows, 1]
    q = q_ref[...]  # [rows, H]

    def body(j, carry):
        pages = page_table_ref[pl.ds(b * pages_per_seq + j * pages_per_block, pages_per_block)]  # i32[ppb]
        k = k_ref[layer, pages, kv_head].reshape(block_kv, head_dim)  # [ppb, page_size, H] -> [block_kv, H]
        v = v_ref[layer, pages, kv_head].reshape(block_kv, head_dim)
        kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        mask = visible(q_pos, kv_pos, kv_len, sliding_window)
        k_scale = v_scale = None
        if quantized:  # f32[1, block_kv] each
            k_scale, v_scale = (ref[layer, pages, kv_head].reshape(1, block_kv) for ref in scale_refs)
        return online_softmax.update(carry, q, k, v, mask, sm_scale=sm_scale, soft_cap=soft_cap, k_scale=k_scale,
                                     v_scale=v_scale)

    out, lse = online_softmax.finish(jax.lax.fori_loop(lo, hi, body, online_softmax.init(rows, head_dim)))
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_refs:
        lse_refs[0][...] = lse.reshape(rows)


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale", "sliding_window", "soft_cap", "block_sizes",
                                             "interpret"))
def paged_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array, page_table: jax.Array,
                        cu_q_lens: jax.Array, layer: jax.Array | int | None = None, *, max_q_len: int, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False,
                        k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """Causal paged attention of a ragged batch on GPU; same contract as `paged_attention_reference`.

    Args:
      q: [T, N, H] flat queries (f32 or bf16); rows past `cu_q_lens[-1]` are padding.
      k_pages, v_pages: [P, K, page_size, H] one layer's cache, or [L, P, K, page_size, H] with `layer`.
        page_size and H must be powers of two (Triton tiles); on hardware also H >= 16.
      kv_lens: i32[B], cached + new tokens per sequence, in [0, max_pages_per_seq * page_size]; 0 = padding.
      page_table: i32[B, max_pages_per_seq], entries in [0, P).
      cu_q_lens: i32[B + 1], prefix sums of q_lens; `cu_q_lens[-1] <= T`.
      layer: i32 scalar in [0, L) for a stacked cache, None for a single layer's.
      max_q_len: static bound on every q_len (1 for a pure decode batch); not checked on device: query
        rows past it are not computed (`validate_inputs` checks it, and the other value invariants, on host).
      sm_scale: softmax scale.
      sliding_window, soft_cap: as in `paged_attention_reference`.
      block_sizes: tiles (block_q and block_kv powers of two, block_kv a multiple of page_size, on hardware
        >= 16); default from `pallas_kernels.block_sizes.paged_block_sizes("gpu", ...)`, block_q rounded up
        to a power of two and block_kv down to a power-of-two number of pages.
      interpret: False on GPU; True runs the same kernel in Pallas' generic interpret mode (CPU).
      k_scale, v_scale: f32[P, K, page_size] (or [L, ...] with `layer`) scales of int8 / fp8 pages; None for
        float pages (see `reference`).

    Returns:
      [T, N, H] in q's dtype; padding rows are 0.

    Raises:
      ValueError: at trace time, on the shape errors of `reference.check_paged_args` (mismatched heads, head
        dims, k/v shapes, batch sizes, cache rank vs layer index, bad sliding_window / soft_cap, missing or
        misshapen scales), a page_size,
        head dim, block_q or block_kv that is not a power of two, a `block_kv` that is not a multiple of
        page_size, or a head dim or block_kv below 16 when not interpreting.
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
    if not (is_pow2(page_size) and is_pow2(head_dim)):
        raise ValueError(f"{page_size=} and {head_dim=} must be powers of two (Triton tile sizes)")
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    if block_sizes is None:
        bs = paged_block_sizes("gpu", max_q_len=max_q_len, page_size=page_size,
                               max_kv_len=pages_per_seq * page_size, num_seqs=num_seqs)
        # The table clamps to the call's shape (block_q 3, 3 pages); Triton tiles need powers of two.
        pages = 1 << ((bs.block_kv // page_size).bit_length() - 1)
        bs = BlockSizes(next_pow2(bs.block_q), pages * page_size, bs.num_splits)
    else:
        bs = block_sizes
    if bs.block_kv % page_size or not is_pow2(bs.block_kv):
        raise ValueError(f"block_kv={bs.block_kv} must be a power of two and a multiple of {page_size=}")
    if not is_pow2(bs.block_q):
        raise ValueError(f"block_q={bs.block_q} must be a power of two (Triton tile sizes)")
    if not interpret and min(head_dim, bs.block_kv) < MIN_DOT_DIM:
        raise ValueError(f"{head_dim=} and block_kv={bs.block_kv} must be >= {MIN_DOT_DIM} for tl.dot")
    pages_per_block = bs.block_kv // page_size
    block_q = min(bs.block_q, next_pow2(max_q_len))
    q_pad = -(-max_q_len // block_q) * block_q
    num_q_blocks = q_pad // block_q
    group_pad = max(next_pow2(group), MIN_DOT_DIM // block_q)
    rows = block_q * group_pad

    table, width = flatten_page_table(page_table, pages_per_block)  # i32[B * W']
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q_seq = pack_queries(q, cu_q_lens, q_pad, num_kv_heads, group_pad)  # [B, K, Tq * G_pad, H]

    splits = bs.num_splits
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, k, i: (b, k, jax.lax.div(i, splits), 0))
    if splits > 1:
        out_shape = (jax.ShapeDtypeStruct((splits, *q_seq.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *q_seq.shape[:3]), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, rows, head_dim),
                                  lambda b, k, i: (jax.lax.rem(i, splits), b, k, jax.lax.div(i, splits), 0)),
                     pl.BlockSpec((None, None, None, rows),
                                  lambda b, k, i: (jax.lax.rem(i, splits), b, k, jax.lax.div(i, splits))))
    else:
        out_shape, out_specs = jax.ShapeDtypeStruct(q_seq.shape, q.dtype), q_spec
    whole = pl.BlockSpec()  # no block shape: the whole array, indexed in the kernel
    kernel = functools.partial(
        _paged_attention_kernel, quantized=quantized, group_pad=group_pad, block_q=block_q, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=width, num_splits=splits, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_q_blocks * splits),
        in_specs=[whole, whole, whole, whole, q_spec, whole, whole] + [whole] * len(scales),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu_triton.CompilerParams(num_warps=4 if rows * head_dim <= 64 * 128 else 8,
                                                    num_stages=2),
        interpret=interpret,
        name="paged_attention_gpu",
    )(kv_lens.astype(jnp.int32), q_lens, table, layer_arr, q_seq, k_pages, v_pages, *scales)
    if splits > 1:
        out = combine_splits(*out)  # [B, K, Tq * G_pad, H]
    return unpack_outputs(out, cu_q_lens, num_tokens, group, group_pad).astype(q.dtype)
