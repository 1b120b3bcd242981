"""Paged attention reference (plain `jnp`): the CPU path and the oracle the kernels are tested against.

KV cache layout (the one place it is defined; the engine, the model and the kernels follow it):

    k_pages, v_pages: [P, K, page_size, H]   one layer; the model stacks layers in front: [L, P, K, page_size, H]

Page 0 is the reserved null page: padding rows of `page_table` point at it and padding tokens write into it, so
every index stays valid; nothing reads it unmasked. Pages lead so that a sequence's pages gather in one indexed
read, and kv heads come before page positions so that one page of one kv head, `[page_size, H]`, is contiguous:
the kernels copy exactly that unit (one DMA on TPU, one load on GPU), and the reference's gathered context (one
KV block of every sequence) reshapes to `[B, K, block_kv, H]` (batch and kv heads leading, the fast order for
XLA:CPU einsums).

Quantized pages (int8, or fp8 stored as float8_e4m3fn bit patterns in uint8: `pallas_kernels.kv_quant`) come with
one f32 scale per token per kv head, laid out like the pages without their head dim, so that a page's scales
travel with it by the same page index:

    k_scale, v_scale: f32[P, K, page_size]   one layer; stacked: f32[L, P, K, page_size]

`write_kv` quantizes into them; the reference and the kernels apply them to the scores (key scales) and to the
probabilities (value scales), so no dequantized copy of the context is made:
`q . (k_int * k_scale) = (q . k_int) * k_scale` and `sum_s p_s (v_int_s * v_scale_s) = sum_s (p_s v_scale_s) v_int_s`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import SCALE_DTYPE, is_quantized, load_values, quantize
from pallas_kernels.ragged import (DEFAULT_MASK_VALUE, check_window_and_cap, kv_block_range, queries_by_sequence,
                                   rows_from_sequences, soft_cap_scores, visible)

BLOCK_KV_TOKENS = 128  # keys per KV block of the online softmax (whole pages; fewer when the page table is narrow)
BLOCK_Q = 128  # query rows per tile: a tile skips the KV blocks past its last row's causal end
# Sequences with several new tokens are attended one at a time when max_q_len >= SPLIT_MIN_Q_LEN and the batched
# pass would compute at least SPLIT_MIN_WASTE times the rows a step can hold (B x max_q_len vs T).
SPLIT_MIN_Q_LEN = 16
SPLIT_MIN_WASTE = 2


def check_paged_args(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                     page_table: jax.Array, cu_q_lens: jax.Array, layer: jax.Array | int | None,
                     sliding_window: int | None, soft_cap: float | None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None) -> None:
    """Trace-time (static shape) checks shared by the reference and the kernels.

    Raises:
      ValueError: naming the values, if q is not [T >= 1, N, H]; the cache is not [P, K, page_size, H] without a
        layer index or [L, P, K, page_size, H] with one (the index itself is traced, so not checked); k and v pages
        differ in shape; N is not a multiple of K; head dims differ; kv_lens, page_table and cu_q_lens do not
        describe the same B >= 1 sequences (i32[B], i32[B, W], i32[B + 1]); sliding_window / soft_cap are
        out of range; or the scales do not fit the pages (`check_scales`).
    """
    if q.ndim != 3 or q.shape[0] == 0:
        raise ValueError(f"q must be [T, N, H] with T >= 1; got shape {q.shape}")
    if k_pages.ndim not in (4, 5):
        raise ValueError(f"the cache must be [P, K, page_size, H] or [L, P, K, page_size, H]; got {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages shape {k_pages.shape} != v_pages shape {v_pages.shape}")
    if (k_pages.ndim == 5) != (layer is not None):
        raise ValueError(f"a stacked cache (ndim 5) needs a layer index and a single layer's (ndim 4) none; got "
                         f"ndim {k_pages.ndim} and {'a layer index' if layer is not None else 'no layer index'}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_head_dim = k_pages.shape[-3], k_pages.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num query heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
    if head_dim != kv_head_dim:
        raise ValueError(f"query head dim {head_dim} != cache head dim {kv_head_dim}")
    if (kv_lens.ndim != 1 or page_table.ndim != 2 or cu_q_lens.ndim != 1 or kv_lens.shape[0] < 1
            or page_table.shape[0] != kv_lens.shape[0] or cu_q_lens.shape[0] != kv_lens.shape[0] + 1):
        raise ValueError(f"kv_lens {kv_lens.shape}, page_table {page_table.shape} and cu_q_lens {cu_q_lens.shape} "
                         f"must be i32[B], i32[B, W] and i32[B + 1] for the same B >= 1")
    check_window_and_cap(sliding_window, soft_cap)
    check_scales(k_pages, k_scale, v_scale)


def check_scales(k_pages: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> None:
    """Trace-time check that a quantized cache comes with both scale arrays and an unquantized one with none.

    Raises:
      ValueError: naming the dtypes and shapes, if int8 / fp8 pages lack a scale array, float pages have one, or
        a scale array is not f32 shaped like the pages without their head dim (`[..., P, K, page_size]`).
    """
    quantized = is_quantized(k_pages.dtype)
    given = [s is not None for s in (k_scale, v_scale)]
    if quantized and not all(given):
        raise ValueError(f"{k_pages.dtype.name} pages need k_scale and v_scale (f32{list(k_pages.shape[:-1])})")
    if not quantized and any(given):
        raise ValueError(f"k_scale / v_scale are for int8 or fp8 pages; these pages are {k_pages.dtype.name}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and (s.shape != k_pages.shape[:-1] or s.dtype != SCALE_DTYPE):
            raise ValueError(f"{name} must be f32{list(k_pages.shape[:-1])} (the pages' shape without the head "
                             f"dim); got {s.dtype.name}{list(s.shape)}")


def validate_inputs(q_lens: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray, *, max_q_len: int,
                    page_size: int, num_pages: int) -> None:
    """Host-side value checks of one batch's metadata (the static/dynamic split: these need concrete values).

    The ops trust these invariants and do not check them on device: a violation gives wrong rows, not an error.
    `jaxinfer.engine.step_inputs` builds batches that satisfy them; call this when building batches by hand.

    Args:
      q_lens: i32[B], new tokens per sequence (`cu_q_lens[1:] - cu_q_lens[:-1]`).
      kv_lens: i32[B], cached + new tokens per sequence.
      page_table: i32[B, W].
      max_q_len: the static bound passed to the op.
      page_size: tokens per page; num_pages: pages in the cache.

    Raises:
      ValueError: if a q_len is negative or above max_q_len, a kv_len is below its q_len or above the page
        table's capacity W * page_size, or a page id needed by a sequence lies outside [0, num_pages).
    """
    q_lens, kv_lens, page_table = np.asarray(q_lens), np.asarray(kv_lens), np.asarray(page_table)
    capacity = page_table.shape[1] * page_size
    for b, (q_len, kv_len) in enumerate(zip(q_lens.tolist(), kv_lens.tolist())):
        if not 0 <= q_len <= max_q_len:
            raise ValueError(f"sequence {b}: q_len {q_len} is outside [0, {max_q_len=}]")
        if not q_len <= kv_len <= capacity:
            raise ValueError(f"sequence {b}: kv_len {kv_len} is outside [q_len {q_len}, page table capacity "
                             f"{capacity}]")
        pages = page_table[b, : -(-kv_len // page_size)]
        if pages.size and not (0 <= pages.min() and pages.max() < num_pages):
            raise ValueError(f"sequence {b}: page ids {pages.tolist()} are outside [0, {num_pages=})")


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_loc: jax.Array,
    layer: int | jax.Array | None = None,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Scatters new keys/values into their pages, quantizing them when the pages are int8 / fp8.

    Args:
      k_pages, v_pages: [P, K, page_size, H] one layer's cache, or [L, P, K, page_size, H] all layers' (then
        `layer` picks the layer written, so the stacked cache is updated in place without slicing it). Float
        pages take k / v cast to their dtype; quantized ones (int8, uint8 fp8 bits, float8_e4m3fn) take
        `kv_quant.quantize(k)` and its scales.
      k, v: [T, K, H] new keys/values, one row per flat token.
      kv_loc: i32[T], flat address `page * page_size + offset` of each token, in [0, P * page_size). Padding tokens
        point into the null page 0.
      layer: layer index (Python int or traced i32 scalar) when the cache is stacked.
      k_scale, v_scale: f32[P, K, page_size] (or [L, ...] stacked) scales of quantized pages; None for float pages.

    Returns:
      The updated `(k_pages, v_pages)` for float pages, `(k_pages, v_pages, k_scale, v_scale)` for quantized
      ones; same shapes.

    Raises:
      ValueError: at trace time, if quantized pages lack scales or float pages get them (`check_scales`).
    """
    check_scales(k_pages, k_scale, v_scale)
    page_size = k_pages.shape[-2]
    page, offset = kv_loc // page_size, kv_loc % page_size
    index = (page, slice(None), offset) if layer is None else (layer, page, slice(None), offset)
    if k_scale is None:
        k_pages = k_pages.at[index].set(k.astype(k_pages.dtype), mode="promise_in_bounds")
        v_pages = v_pages.at[index].set(v.astype(v_pages.dtype), mode="promise_in_bounds")
        return k_pages, v_pages
    (k_q, k_s), (v_q, v_s) = quantize(k, k_pages.dtype), quantize(v, v_pages.dtype)  # [T, K, H], f32[T, K]
    k_pages = k_pages.at[index].set(k_q, mode="promise_in_bounds")
    v_pages = v_pages.at[index].set(v_q, mode="promise_in_bounds")
    k_scale = k_scale.at[index].set(k_s, mode="promise_in_bounds")
    v_scale = v_scale.at[index].set(v_s, mode="promise_in_bounds")
    return k_pages, v_pages, k_scale, v_scale


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale", "sliding_window", "soft_cap", "block_q",
                                             "block_kv_tokens"))
def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    layer: jax.Array | int | None = None,
    *,
    max_q_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    block_q: int = BLOCK_Q,
    block_kv_tokens: int = BLOCK_KV_TOKENS,
) -> jax.Array:
    """Causal attention of each sequence's new query tokens over its whole paged context (plain `jnp`).

    Blocked like the kernels (FlashAttention's online softmax, `pallas_kernels.online_softmax`): query rows in
    tiles of `block_q`, keys in blocks of whole pages (`block_kv_tokens`), and each tile loops (`fori_loop` with
    traced bounds, `pallas_kernels.ragged.kv_block_range`) only over the KV blocks some sequence's rows of the tile
    can see. A decode step therefore reads the real context of its longest sequence, not the padded page-table
    width, and a prefill skips the fully masked blocks above the causal diagonal. Decodes, verify windows and
    batches whose B x max_q_len query slots are not much more than T run all sequences' rows in one batched pass.
    Otherwise (a long chunk beside short ones: `SPLIT_MIN_Q_LEN`, `SPLIT_MIN_WASTE`) every sequence's first new row
    runs in a batched pass, then each sequence with more rows runs alone (a loop with a traced trip count), so short
    ones do not pad to the longest: 31 decodes beside a 481-token chunk took 32 x 512 query slots for 512 real rows
    (30x slower a layer on CPU), a 422-token chunk beside two new prompts of 50 and 38 tokens 3.4x.

    Sequence b owns flat query rows `cu_q_lens[b] : cu_q_lens[b+1]` (its `q_len` newest tokens) and attends over
    its first `kv_lens[b]` cached positions (which already include those new tokens); query j of b sits at position
    `kv_lens[b] - q_len + j` and sees keys at positions `<=` its own (causal).

    Args:
      q: [T, N, H] flat queries of all sequences, any float dtype; rows past `cu_q_lens[-1]` are padding.
      k_pages, v_pages: [P, K, page_size, H] one layer's cache (layout in the module docstring), or
        [L, P, K, page_size, H] all layers' with `layer` choosing one (read in place, no slice copy).
      kv_lens: i32[B], in [0, max_pages_per_seq * page_size]; 0 marks a padding sequence.
      page_table: i32[B, max_pages_per_seq], entries in [0, P).
      cu_q_lens: i32[B + 1], non-decreasing prefix sums of q_lens, `cu_q_lens[0] == 0`, `cu_q_lens[-1] <= T`.
      layer: i32 scalar in [0, L) for a stacked cache; None for a single layer's.
      max_q_len: static bound on every q_len (1 for a pure decode batch); not checked on device: query
        rows past it are not computed (`validate_inputs` checks it, and the other value invariants, on host).
      sm_scale: softmax scale, usually `H ** -0.5`.
      sliding_window: static; a query at position p sees keys at positions > p - sliding_window (None: all).
      soft_cap: static; scores become `soft_cap * tanh(scores / soft_cap)` after scaling (Gemma 2; None: off).
      k_scale, v_scale: f32[P, K, page_size] (or [L, ...] stacked) scales of int8 / fp8 pages (module docstring);
        None for float pages. Key scales multiply the raw scores, value scales the probabilities.
      block_q: static query rows per tile (>= 1).
      block_kv_tokens: static keys per KV block, rounded down to whole pages (at least one page, at most the page
        table's width).

    Returns:
      [T, N, H] attention output in q's dtype; padding rows are 0.

    Raises:
      ValueError: if N is not a multiple of K, head dims differ, the layer index does not match the cache's rank,
        sliding_window / soft_cap are out of range, or scales are missing, unexpected or misshapen (at trace
        time).
    """
    check_paged_args(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer, sliding_window, soft_cap,
                     k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[-3:-1]
    num_seqs = page_table.shape[0]
    group = num_heads // num_kv_heads
    pages_per_block = max(1, min(block_kv_tokens // page_size, page_table.shape[1]))
    width = -(-page_table.shape[1] // pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))  # whole KV blocks (null page)
    block_kv = pages_per_block * page_size

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
    context_start = kv_lens - q_lens  # [B], position of each sequence's first new token

    def attend(q_sub: jax.Array, sub: jax.Array | None, tile_rows: int) -> jax.Array:
        """Attention of sequences `sub` (all when None), queries [b, K, Tq, G, H] (rows (t, g) inside each kv head:
        the score dots then come out as [b, K, Tq, G, S] with no transposing copy of the f32 scores) in tiles of
        `tile_rows`; returns f32 [b, K, Tq, G, H]."""
        pick = (lambda x: x) if sub is None else (lambda x: x[sub])
        table, lens, q_len, start = pick(page_table), pick(kv_lens), pick(q_lens), pick(context_start)
        b, tq_all = q_sub.shape[0], q_sub.shape[2]

        def gather(pages: jax.Array, block: jax.Array) -> jax.Array:
            """KV block `block[i]` of each sequence i: [b, K, block_kv, H] (or scales [b, K, block_kv])."""
            cols = block[:, None] * pages_per_block + jnp.arange(pages_per_block)[None, :]  # [b, pages_per_block]
            cols = jnp.minimum(cols, width - 1)  # an inactive sequence's block may sit at the table's end
            ids = jnp.take_along_axis(table, cols, axis=1)
            ctx = pages[ids] if layer is None else pages[layer, ids]  # [b, pages_per_block, K, page_size, ...]
            ctx = jnp.moveaxis(ctx, 2, 1)  # [b, K, pages_per_block, page_size, ...]
            return ctx.reshape(b, num_kv_heads, block_kv, *ctx.shape[4:])

        def attend_block(q_blk: jax.Array, q_pos: jax.Array, block: jax.Array, active: jax.Array,
                         carry: tuple) -> tuple:
            """Online-softmax update (`pallas_kernels.online_softmax`) of one query tile [b, K, tq, G, H] with
            each sequence's KV block `block` (i32[b]; sequences where `active` is false take no part);
            carry (m, l, acc) is f32 [b, K, tq, G, 1], [..., 1], [..., H]."""
            m_prev, l_prev, acc_prev = carry
            k_ctx, v_ctx = gather(k_pages, block), gather(v_pages, block)
            if k_scale is not None:  # int8 / fp8 values take part in the dots in q's dtype (exactly: <= 8 bits)
                k_ctx, v_ctx = load_values(k_ctx, q.dtype), load_values(v_ctx, q.dtype)
            s = jnp.einsum("bktgh,bksh->bktgs", q_blk, k_ctx, preferred_element_type=jnp.float32)
            if k_scale is not None:
                s = s * gather(k_scale, block)[:, :, None, None, :]  # q . (k_int * k_scale)
            s = soft_cap_scores(s * sm_scale, soft_cap)
            kv_pos = block[:, None] * block_kv + jnp.arange(block_kv)[None, :]  # [b, S]
            mask = visible(q_pos[:, :, None], kv_pos[:, None, :], lens[:, None, None], sliding_window)
            mask &= active[:, None, None]
            s = jnp.where(mask[:, None, :, None, :], s, DEFAULT_MASK_VALUE)  # [b, K, tq, G, S]
            m = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.exp(s - m)
            alpha = jnp.exp(m_prev - m)
            l = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
            if v_scale is not None:
                p = p * gather(v_scale, block)[:, :, None, None, :]  # sum_s p_s v_scale_s v_int_s
            pv = jnp.einsum("bktgs,bksh->bktgh", p.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
            return m, l, alpha * acc_prev + pv

        outs = []
        # Query tiles; in each, sequence i visits only its own KV blocks [lo_i, hi_i) (its causal end, the start of
        # its window): step j reads block lo_i + j of every sequence, so a sequence whose window starts late never
        # reads the pages before it, whatever the other sequences' contexts (a local layer reads only its window).
        for first_t in range(0, tq_all, tile_rows):
            tq = min(tile_rows, tq_all - first_t)
            q_pos = start[:, None] + first_t + jnp.arange(tq)[None, :]  # [b, tq]
            lo, hi, _ = jax.vmap(functools.partial(kv_block_range, first_t=first_t, block_q=tq, block_kv=block_kv,
                                                   split=0, num_splits=1, sliding_window=sliding_window))(
                q_len=q_len, kv_len=lens)
            rows = (b, num_kv_heads, tq, group)
            carry = (jnp.full((*rows, 1), DEFAULT_MASK_VALUE, jnp.float32), jnp.zeros((*rows, 1), jnp.float32),
                     jnp.zeros((*rows, head_dim), jnp.float32))
            steps = hi - lo  # 0 for sequences without a real query in this tile

            def step(j: jax.Array, c: tuple, q_blk=q_sub[:, :, first_t : first_t + tq], q_pos=q_pos, lo=lo,
                     steps=steps) -> tuple:
                active = j < steps
                return attend_block(q_blk, q_pos, jnp.where(active, lo + j, lo), active, c)

            m, l, acc = jax.lax.fori_loop(0, jnp.max(steps), step, carry)
            outs.append(acc / jnp.where(l > 0, l, 1.0))
        return jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]

    def by_kv_head(x: jax.Array) -> jax.Array:  # [b, Tq, N, H] -> [b, K, Tq, G, H]
        return x.reshape(x.shape[0], x.shape[1], num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)

    def by_head(x: jax.Array) -> jax.Array:  # [b, K, Tq, G, H] -> [b, Tq, N, H]
        return x.transpose(0, 2, 1, 3, 4).reshape(x.shape[0], x.shape[2], num_heads, head_dim)

    if max_q_len < SPLIT_MIN_Q_LEN or num_seqs * max_q_len < SPLIT_MIN_WASTE * num_tokens:
        # Decodes, verify windows, and batches of chunks of similar length: every sequence's rows in one pass.
        out = by_head(attend(by_kv_head(queries_by_sequence(q, cu_q_lens, max_q_len)), None, block_q))
        return rows_from_sequences(out, cu_q_lens, num_tokens).astype(q.dtype)

    # A step with prefill chunks: a batched pass over every sequence's first new token (all of a decode's), then
    # each sequence with more rows on its own (a loop with a traced trip count), so a decode's single row never
    # pads to the longest chunk: B x max_q_len query rows would cost up to B times the real ones.
    first_row = jnp.where(q_lens > 0, cu_q_lens[:-1], num_tokens)  # padding sequences: dropped by the scatter
    first = by_head(attend(by_kv_head(q[jnp.minimum(first_row, num_tokens - 1)][:, None]), None, 1))[:, 0]
    out = jnp.zeros((num_tokens + max_q_len, num_heads, head_dim), jnp.float32).at[first_row].set(first, mode="drop")
    q_rows = jnp.pad(q, ((0, max_q_len), (0, 0), (0, 0)))  # a chunk's window of max_q_len rows stays in bounds
    chunked = q_lens > 1
    chunk_seqs = jnp.nonzero(chunked, size=num_seqs, fill_value=0)[0]

    def one_chunk(i: jax.Array, out: jax.Array) -> jax.Array:
        seq = chunk_seqs[i]
        begin = cu_q_lens[seq]
        rows = jax.lax.dynamic_slice_in_dim(q_rows, begin, max_q_len)  # [Tq, N, H]; rows past q_len: ignored
        res = by_head(attend(by_kv_head(rows[None]), seq[None], block_q))[0]
        keep = (jnp.arange(max_q_len) < q_lens[seq])[:, None, None]
        old = jax.lax.dynamic_slice_in_dim(out, begin, max_q_len)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, res, old), begin, axis=0)

    out = jax.lax.fori_loop(0, jnp.sum(chunked), one_chunk, out)
    return out[:num_tokens].astype(q.dtype)
