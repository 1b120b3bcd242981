"""KV layout micro-benchmark of the step workload: one layer's decode attention on our page layout
[P, K, page_size, H] (`paged_attention_reference`) against the same math on [P, page_size, K, H]."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.decode_timing import PAGE_SIZE, first_line
from jaxinfer.benchmarks.model_setup import DTYPES
from jaxinfer.benchmarks.probe import median, time_calls
from models.config import ModelConfig
from pallas_kernels.paged_attention import DEFAULT_MASK_VALUE, paged_attention_reference

logger = logging.getLogger(__name__)

ROUNDS = 10  # the two layouts alternate this many times, `reps` calls each


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale"))
def attention_token_major(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                          page_table: jax.Array, cu_q_lens: jax.Array, *, max_q_len: int,
                          sm_scale: float) -> jax.Array:
    """The alternative layout [P, page_size, K, H]: the same ragged causal math as `paged_attention_reference`.

    A sequence's pages gather to [B, Pmax, page_size, K, H], which reshapes to [B, S, K, H] without a transpose;
    the einsums then contract with KV heads inside the context axis instead of in front of it.

    Args:
      q: [T, N, H] queries; k_pages, v_pages: [P, page_size, K, H]; kv_lens: i32[B]; page_table: i32[B, Pmax];
        cu_q_lens: i32[B + 1].

    Returns:
      [T, N, H] in q's dtype (rows past the batch's tokens are 0).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = page_table.shape
    group, max_kv_len = num_heads // num_kv_heads, max_pages * page_size
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    j = jnp.arange(max_q_len)
    valid = j[None, :] < q_lens[:, None]
    q_seq = jnp.take(q, jnp.where(valid, cu_q_lens[:-1, None] + j[None, :], 0), axis=0)
    q_seq = q_seq.reshape(num_seqs, max_q_len, num_kv_heads, group, head_dim)
    k_ctx = k_pages[page_table].reshape(num_seqs, max_kv_len, num_kv_heads, head_dim)  # [B, S, K, H]
    v_ctx = v_pages[page_table].reshape(num_seqs, max_kv_len, num_kv_heads, head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_seq, k_ctx, preferred_element_type=jnp.float32) * sm_scale
    q_pos = kv_lens[:, None] - q_lens[:, None] + j[None, :]
    s = jnp.arange(max_kv_len)
    visible = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_lens[:, None, None])
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, DEFAULT_MASK_VALUE), axis=-1)
    out = jnp.einsum("bkgts,bskh->bkgth", probs.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, max_q_len, num_heads, head_dim)
    t = jnp.arange(num_tokens)
    row_seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, num_seqs - 1)
    row_j = t - cu_q_lens[row_seq]
    row_valid = (t < cu_q_lens[-1]) & (row_j < max_q_len)
    flat = out[row_seq, jnp.clip(row_j, 0, max_q_len - 1)]
    return jnp.where(row_valid[:, None, None], flat, 0).astype(q.dtype)


def bench_kv_layout(cfg: ModelConfig, dtypes: list[str], batch: int, context: int, reps: int) -> list[dict]:
    """ms per call of one layer's decode attention in both layouts, with the model's heads.

    Every sequence holds `context` tokens on pages handed out in shuffled order; the two layouts alternate in
    `ROUNDS` rounds of `reps` calls so that machine noise hits both alike.

    Returns:
      One dict per dtype: "dtype", "kv_bytes" (K and V read by one call), "ours_ms", "alt_ms", "max_abs_diff"
      (or "ours_error" / "alt_error" with the first line of an XLA error).

    Raises:
      ValueError: if `context` is not a positive multiple of the page size, or batch / reps < 1.
    """
    if context < PAGE_SIZE or context % PAGE_SIZE or batch < 1 or reps < 1:
        raise ValueError(f"--kv-context must be a positive multiple of {PAGE_SIZE} and --kv-batch, --kv-reps >= 1 "
                         f"(got {context}, {batch}, {reps})")
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pages_per_seq = context // PAGE_SIZE
    num_pages = 1 + batch * pages_per_seq
    rng = np.random.default_rng(0)
    page_table = (1 + rng.permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq).astype(np.int32)
    kv_lens = np.full(batch, context, np.int32)
    cu_q_lens = np.arange(batch + 1, dtype=np.int32)
    rows = []
    for dtype in dtypes:
        dt = DTYPES[dtype]
        q = jnp.asarray(rng.standard_normal((batch, n, h)), dt)
        k_ours = jnp.asarray(rng.standard_normal((num_pages, k, PAGE_SIZE, h)), dt)
        v_ours = jnp.asarray(rng.standard_normal((num_pages, k, PAGE_SIZE, h)), dt)
        k_alt, v_alt = k_ours.transpose(0, 2, 1, 3), v_ours.transpose(0, 2, 1, 3)
        common = dict(max_q_len=1, sm_scale=h**-0.5)
        calls = {
            "ours": lambda: paged_attention_reference(q, k_ours, v_ours, kv_lens, page_table, cu_q_lens,
                                                      **common).block_until_ready(),
            "alt": lambda: attention_token_major(q, k_alt, v_alt, kv_lens, page_table, cu_q_lens,
                                                 **common).block_until_ready(),
        }
        row = {"dtype": dtype, "kv_bytes": 2 * batch * context * k * h * jnp.dtype(dt).itemsize}
        outputs = {}
        for name, fn in calls.items():
            try:
                outputs[name] = fn()
            except jax.errors.JaxRuntimeError as e:
                logger.error("kv layout %s %s failed: %s", dtype, name, e)
                row[f"{name}_error"] = first_line(e)
        if len(outputs) == 2:
            row["max_abs_diff"] = float(jnp.max(jnp.abs(outputs["ours"].astype(jnp.float32)
                                                        - outputs["alt"].astype(jnp.float32))))
        times: dict[str, list[float]] = {name: [] for name in outputs}
        for name in outputs:
            time_calls(calls[name], 0, warmup=3)
        for _ in range(ROUNDS):
            for name in outputs:
                times[name] += time_calls(calls[name], reps, warmup=0)
        for name, ts in times.items():
            row[f"{name}_ms"] = 1e3 * median(ts)
        logger.info("kv layout %s: %s", dtype, row)
        rows.append(row)
    return rows
