"""Causal flash attention over fresh packed tokens for GPU (Pallas, Triton backend): the prefill of new sequences.

Backend: the generic Pallas API (`pl.pallas_call` with a grid and `BlockSpec`s, ref indexing, `jnp` / `lax` ops in
the body) lowered through Pallas' Triton backend, selected by `jax.experimental.pallas.triton.CompilerParams`.
Why not Mosaic GPU: the CPU jaxlib has no Mosaic GPU lowering rule (lowering a Mosaic GPU kernel for an abstract
GPU on CPU fails in the pallas_call GPU lowering), so such a kernel could be neither lowered nor tested where CI
runs; and jax-triton 0.4.1's `triton_call` fails with jax 0.12.0.1. The Triton backend is deprecated since jax
0.11 but present and working in both pinned versions (0.11.2 on the GPU machine, 0.12.0.1 here), runs on every
CUDA GPU (not only Hopper), and the same kernel runs in generic interpret mode on CPU. Migrating to Mosaic GPU is
the follow-up once the Triton backend is removed.

1. Triton tiles must have power-of-two sizes and `tl.dot` needs every dim >= 16. The wrapper pads the GQA group G
   to a power of two G_pad (padded heads are zero queries, dropped on unpack), pads T to whole query tiles and KV
   tiles, and regroups the queries per kv head into `[K, Tq * G_pad, H]` (row `t * G_pad + g` is token t of head
   g), so one program's query tile `[block_q * G_pad, H]` is a plain block; K/V become `[K, Tk, H]`.
2. Grid `(Tq / block_q, K)`. Triton has no scalar prefetch: `cu_q_lens` and the per-tile schedule
   (`reference.query_block_schedule`) are whole-array inputs read as scalars; K/V are whole-array inputs that each
   loop step slices one `[block_kv, H]` tile from. Triton's software pipelining (`num_stages`) overlaps the load
   of tile j + 1 with the compute of tile j.
3. Each program walks only KV tiles `[kv_lo, kv_hi)`: tiles entirely in the future of its last row, entirely
   before its first row's sequence start, or entirely outside the sliding window are never loaded. Inside a tile,
   row t sees key s iff `start[t] <= s <= t` and `t - s < W`; the per-row sequence start is built once per
   program from the sequence starts inside the tile.
4. Online softmax over the tiles (FlashAttention, arXiv:2205.14135, algorithm 1; FlashAttention-2's deferred
   normalisation, arXiv:2307.08691), carries in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels import online_softmax
from pallas_kernels.block_sizes import BlockSizes, flash_block_sizes
from pallas_kernels.flash_attention.reference import check_heads, query_block_schedule
from pallas_kernels.ragged import check_window_and_cap, is_pow2, next_pow2, visible

MIN_DOT_DIM = 16  # tl.dot needs M, N, K >= 16


def _flash_attention_kernel(
    # inputs
    cu_q_lens_ref,  # i32[B + 1]
    kv_lo_ref,  # i32[num_q_blocks]
    kv_hi_ref,  # i32[num_q_blocks]
    seq_lo_ref,  # i32[num_q_blocks]
    seq_hi_ref,  # i32[num_q_blocks]
    q_ref,  # [block_q * G_pad, H]
    k_ref,  # [K, Tk, H] (whole array)
    v_ref,  # [K, Tk, H] (whole array)
    # outputs
    o_ref,  # [block_q * G_pad, H]
    *,
    group_pad: int,
    block_q: int,
    block_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    q_block, kv_head = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    lo, hi = kv_lo_ref[q_block], kv_hi_ref[q_block]

    # Flat token of each row (non-negative operands: lax.div is floor division).
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    t = q_block * block_q + jax.lax.div(row, group_pad)  # [rows, 1]

    # Sequence start of each row: the first row's, then each later start inside the tile that the row has passed.
    def take_start(b, start):
        cu = cu_q_lens_ref[b]
        return jnp.where(t >= cu, cu, start)

    start = jax.lax.fori_loop(seq_lo_ref[q_block] + 1, seq_hi_ref[q_block] + 1, take_start,
                              jnp.full((rows, 1), cu_q_lens_ref[seq_lo_ref[q_block]], jnp.int32))
    q_pos = t - start  # [rows, 1], position of each row in its sequence
    q = q_ref[...]  # [rows, H]

    def body(j, carry):
        k = k_ref[kv_head, pl.ds(j * block_kv, block_kv), :]  # [block_kv, H]
        v = v_ref[kv_head, pl.ds(j * block_kv, block_kv), :]
        kv_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1) - start  # [rows, block_kv]
        # kv_pos < 0: an earlier sequence's key. A fresh token's context is the q_pos + 1 tokens up to it.
        ok = (kv_pos >= 0) & visible(q_pos, kv_pos, q_pos + 1, sliding_window)
        return online_softmax.update(carry, q, k, v, ok, sm_scale=sm_scale, soft_cap=soft_cap)

    out, _ = online_softmax.finish(jax.lax.fori_loop(lo, hi, body, online_softmax.init(rows, head_dim)))
    o_ref[...] = out.astype(o_ref.dtype)



def gpu_tiles(num_tokens: int, group: int, block_sizes: BlockSizes | None, interpret: bool) -> tuple[int, int, int]:
    """(block_q, block_kv, G_pad) the GPU kernel runs with.

    The default comes from `flash_block_sizes("gpu", ...)` (in tokens; the table keeps GPU query tiles small
    because a tile's f32 accumulator, block_q x G_pad x H, lives in registers). Both tiles become powers of two;
    block_q is raised until a tile has >= 16 rows.

    Raises:
      ValueError: if an explicit block_q or block_kv is not a power of two, or block_kv < 16 when not
        interpreting.
    """
    group_pad = next_pow2(group)
    if block_sizes is None:
        bs = flash_block_sizes("gpu", num_tokens=num_tokens)
        block_q = next_pow2(bs.block_q)
        block_kv = max(MIN_DOT_DIM, next_pow2(bs.block_kv))
    else:
        block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
        if not (is_pow2(block_q) and is_pow2(block_kv)):
            raise ValueError(f"{block_q=} and {block_kv=} must be powers of two (Triton tile sizes)")
        if not interpret and block_kv < MIN_DOT_DIM:
            raise ValueError(f"{block_kv=} must be >= {MIN_DOT_DIM} for tl.dot")
    block_q = max(block_q, MIN_DOT_DIM // group_pad, 1)
    return block_q, block_kv, group_pad


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret"))
def flash_attention_gpu(q: jax.Array, k: jax.Array, v: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Causal attention of packed fresh sequences on GPU; same contract as `flash_attention_reference`.

    Args:
      q: [T, N, H] queries (f32 or bf16); rows past `cu_q_lens[-1]` are padding. H a power of two >= 16.
      k, v: [T, K, H] keys and values of the same tokens, q's dtype; N a multiple of K.
      cu_q_lens: i32[B + 1], B >= 1, non-decreasing prefix sums of q_lens, `cu_q_lens[0] == 0`,
        `cu_q_lens[-1] <= T`.
      sm_scale: softmax scale.
      sliding_window, soft_cap: as in `flash_attention_reference`.
      block_sizes: tiles in tokens, powers of two (block_kv >= 16 on hardware); block_q is raised until
        `block_q * G_pad >= 16`. Default: see `gpu_tiles`.
      interpret: False on GPU; True runs the same kernel in Pallas' generic interpret mode (CPU).

    Returns:
      [T, N, H] in q's dtype; padding rows are 0.

    Raises:
      ValueError: on mismatched heads, head dims or token counts, a head dim that is not a power of two, bad
        tiles (see `gpu_tiles`), or bad sliding_window / soft_cap (at trace time).
    """
    num_tokens, num_heads, head_dim = q.shape
    group = check_heads(q, k, v)
    check_window_and_cap(sliding_window, soft_cap)
    if not is_pow2(head_dim):
        raise ValueError(f"{head_dim=} must be a power of two (Triton tile sizes)")
    num_kv_heads = num_heads // group
    block_q, block_kv, group_pad = gpu_tiles(num_tokens, group, block_sizes, bool(interpret))
    q_pad = -(-num_tokens // block_q) * block_q
    kv_pad = -(-num_tokens // block_kv) * block_kv
    num_q_blocks = q_pad // block_q
    rows = block_q * group_pad

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    schedule = query_block_schedule(cu_q_lens, num_q_blocks, block_q, block_kv, sliding_window)
    q_rows = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                     ((0, q_pad - num_tokens), (0, 0), (0, group_pad - group), (0, 0)))
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, q_pad * group_pad, head_dim)  # [K, Tq * G_pad, H]
    k_t, v_t = (jnp.pad(a, ((0, kv_pad - num_tokens), (0, 0), (0, 0))).transpose(1, 0, 2)
                for a in (k, v))  # [K, Tk, H]

    q_spec = pl.BlockSpec((None, rows, head_dim), lambda i, h: (h, i, 0))
    whole = pl.BlockSpec()  # no block shape: the whole array, indexed in the kernel
    kernel = functools.partial(_flash_attention_kernel, group_pad=group_pad, block_q=block_q, block_kv=block_kv,
                               sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads),
        in_specs=[whole] * 5 + [q_spec, whole, whole],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=4 if rows * head_dim <= 64 * 128 else 8,
                                                    num_stages=2),
        interpret=interpret,
        name="flash_attention_gpu",
    )(cu_q_lens, *schedule, q_rows, k_t, v_t)
    out = out.reshape(num_kv_heads, q_pad, group_pad, head_dim)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)  # [T, N, H]
    real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
