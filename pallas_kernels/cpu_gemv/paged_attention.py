"""Native CPU paged decode attention (`paged_attention.cc`, AVX2 + FMA, called through `jax.ffi`) and the CPU paged
op that routes each step to it or to the `jnp` reference.

Decode attention on CPU is memory-bound: each sequence's KV context is read once for a few query rows. XLA runs the
reference as page gathers (copies of the context) and small batched dots; the kernel reads the pages in place
(the stacked cache at a traced layer index, as the matmul kernels read stacked weights), keeps FlashAttention's
online softmax in f32 over the sequence's real context only, and splits the work over the matmul kernels' thread
pool by (sequence, kv head, span of context) with a fixed-order combine (flash-decoding), so results do not
depend on the thread count. `paged_attention_cpu` is what `pallas_kernels.dispatch` picks on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_gemv
from pallas_kernels.cpu_gemv import build
from pallas_kernels.cpu_features import isa_level
from pallas_kernels.kv_quant import is_quantized
from pallas_kernels.paged_attention.reference import check_paged_args, paged_attention_reference

MAX_Q_LEN = 8  # query rows per sequence up to which steps use the kernel (decode: 1; verify windows: k + 1)
PAGE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.float8_e4m3fn))


def supported(q: jax.Array, k_pages: jax.Array, *, max_q_len: int) -> bool:
    """Whether the kernel takes these shapes and dtypes: `max_q_len <= MAX_Q_LEN`, q f32 or bf16, pages in
    `PAGE_DTYPES`, head dim a multiple of 8 (it says nothing of whether the library is built: `cpu_gemv.active`)."""
    return (1 <= max_q_len <= MAX_Q_LEN and q.dtype in (jnp.float32, jnp.bfloat16) and k_pages.dtype in PAGE_DTYPES
            and q.shape[-1] % 8 == 0)


def paged_attention_native(
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
) -> jax.Array:
    """Ragged paged attention of a few new query rows per sequence, by the native kernel.

    Same arguments, semantics and result as `paged_attention_reference` (causal, GQA, sliding window, soft cap,
    quantized pages with their scales; padding rows and rows past `max_q_len` are 0), the probabilities rounded
    to the values' dtype as there; the sums run in another order (spans of the context combined at the end), so
    results agree to f32 rounding in f32 and to about bf16 rounding with bf16 pages or queries.

    Args:
      q: f32 or bf16 [T, N, H], H a multiple of 8.
      k_pages, v_pages: [P, K, page_size, H] or, with `layer`, [L, P, K, page_size, H] (layer `layer` is read in
        place; an index outside [0, L) is clamped); f32, bf16, int8, or fp8 (uint8 bit patterns or
        float8_e4m3fn).
      kv_lens, page_table, cu_q_lens, layer, sm_scale, sliding_window, soft_cap, k_scale, v_scale: as
        `paged_attention_reference`.
      max_q_len: static, 1 <= max_q_len <= MAX_Q_LEN.

    Returns:
      [T, N, H] in q's dtype.

    Raises:
      ValueError: the reference's trace-time checks (`check_paged_args`), or shapes and dtypes the kernel does
        not take (`supported`).
      RuntimeError: the library is not available (`cpu_gemv.active`).
    """
    level = isa_level()
    if level is None or not build.load(level):
        raise RuntimeError("the native CPU kernels are not available (see `pallas_kernels.cpu_gemv.active`)")
    return _native(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer, max_q_len=max_q_len, sm_scale=sm_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, level=level)


# The ISA level is a static argument: jit keeps one trace per argument shapes, and a level set later in the process
# (JAXINFER_NATIVE_ISA; `bench quant --isa`, the tests' levels) must name its own kernel, not the first one traced.
@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale", "sliding_window", "soft_cap", "level"))
def _native(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer, *, max_q_len, sm_scale, sliding_window,
            soft_cap, k_scale, v_scale, level: str) -> jax.Array:
    check_paged_args(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer, sliding_window, soft_cap,
                     k_scale, v_scale)
    if not supported(q, k_pages, max_q_len=max_q_len):
        raise ValueError(f"the native paged attention takes max_q_len in [1, {MAX_Q_LEN}], f32 / bf16 q, pages in "
                         f"{[d.name for d in PAGE_DTYPES]} and a head dim that is a multiple of 8; got "
                         f"{max_q_len=}, q {q.dtype.name}{list(q.shape)}, pages {k_pages.dtype.name}")
    if layer is None:
        index = jnp.zeros((1,), jnp.int32)
        k_pages, v_pages = k_pages[None], v_pages[None]
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])
    else:
        index = jnp.asarray(layer, jnp.int32).reshape(1)
    if not is_quantized(k_pages.dtype):
        k_scale = v_scale = jnp.zeros((1, 1, 1, 1), jnp.float32)  # unused placeholders
    call = jax.ffi.ffi_call(build.target_name("paged_attention", level), jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, index, k_pages, v_pages, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32), k_scale, v_scale, max_q_len=np.int64(max_q_len),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def uses_native(q: jax.Array, k_pages: jax.Array, *, max_q_len: int) -> bool:
    """Whether `paged_attention_cpu` traced now runs the kernel: the shapes fit (`supported`), the native kernels
    are allowed here (`cpu_gemv.native_kernels`: not on a multi-device mesh) and built (`cpu_gemv.active`: CPU,
    not turned off by `JAXINFER_NATIVE_KERNELS=0`, a compiler)."""
    return supported(q, k_pages, max_q_len=max_q_len) and cpu_gemv.native_allowed() and cpu_gemv.active()


def paged_attention_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                        page_table: jax.Array, cu_q_lens: jax.Array, layer: jax.Array | int | None = None, *,
                        max_q_len: int, **kwargs) -> jax.Array:
    """The paged attention op on CPU: `paged_attention_native` for steps it takes (`uses_native`: decodes and
    verify windows up to `MAX_Q_LEN` rows per sequence), `paged_attention_reference` otherwise (prefill chunks,
    kernels off or unavailable). Arguments, result and errors: `paged_attention_reference`'s."""
    args = (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer)
    if uses_native(q, k_pages, max_q_len=max_q_len):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("block_q", "block_kv_tokens")}  # reference tiling
        return paged_attention_native(*args, max_q_len=max_q_len, **kwargs)
    return paged_attention_reference(*args, max_q_len=max_q_len, **kwargs)
