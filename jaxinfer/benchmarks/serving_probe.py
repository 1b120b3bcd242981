"""What bounds a serving decode step: one batch decode step timed on its own at two contexts, beside only its
dense matmuls and only its attention (the runner's reference paged attention over the same page tables)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.dense_matmuls import dense_matmuls
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.step_inputs import NULL_PAGE, page_bucket
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk
from pallas_kernels.paged_attention import paged_attention_reference


def decode_probe(engine: Engine, batch: int, contexts: tuple[int, int], reps: int = 5) -> dict[str, float]:
    """Median ms of a batch decode step: `execute` at two contexts (two page buckets) and only its dense matmuls.

    Call it when no request is live: the dummy sequences get distinct real pages (so the attention gathers
    distinct memory, as in serving), whose contents are garbage; with too few pages they share the null page.

    Returns:
      ms: `execute_ctx{C}` and `attention_ctx{C}` (all layers) for each context C in tokens, `dense` (the dense
      matmuls of `rows` padded rows), and `rows`.
    """
    runner = engine.runner
    greedy = SamplingRow(SamplingParams(temperature=0.0), seed=0)
    out = {}
    for ctx in contexts:
        n = -(-ctx // runner.page_size)
        if engine.scheduler.has_unfinished() or 1 + batch * n > runner.num_pages:
            chunks = [ScheduledChunk([1], ctx - 1, [NULL_PAGE] * n)] * batch
        else:
            chunks = [ScheduledChunk([1], ctx - 1, list(range(1 + b * n, 1 + (b + 1) * n))) for b in range(batch)]
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            runner.execute(chunks, [greedy] * batch)
            ts.append(time.perf_counter() - t0)
        out[f"execute_ctx{ctx}"] = 1e3 * statistics.median(ts[1:])
    # The attention alone: `num_layers` calls of the runner's attention over the same page tables.
    cfg = engine.model_config
    rng = np.random.default_rng(0)
    for ctx in contexts:
        n = -(-ctx // runner.page_size)
        width = page_bucket(n, runner.max_pages_per_seq)
        table = np.zeros((batch, width), np.int32)
        table[:, :n] = 1 + np.arange(batch * n).reshape(batch, n)
        shape = (1 + batch * n, cfg.num_kv_heads, runner.page_size, cfg.head_dim)
        k_pages = jnp.asarray(rng.standard_normal(shape), engine.dtype)
        v_pages = jnp.asarray(rng.standard_normal(shape), engine.dtype)
        q = jnp.asarray(rng.standard_normal((batch, cfg.num_heads, cfg.head_dim)), engine.dtype)
        kv_lens, cu = np.full(batch, ctx, np.int32), np.arange(batch + 1, dtype=np.int32)

        def attn() -> None:
            paged_attention_reference(q, k_pages, v_pages, kv_lens, table, cu, max_q_len=1,
                                      sm_scale=cfg.head_dim ** -0.5).block_until_ready()

        attn()
        ts = []
        for _ in range(4 * reps):
            t0 = time.perf_counter()
            attn()
            ts.append(time.perf_counter() - t0)
        out[f"attention_ctx{ctx}"] = 1e3 * cfg.num_layers * statistics.median(ts)
        del k_pages, v_pages
    rows = max(2, 1 << (batch - 1).bit_length())
    x = jnp.ones((rows, engine.model_config.hidden_size), engine.dtype)
    fn = jax.jit(dense_matmuls)
    fn(x, runner.weights).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, runner.weights).block_until_ready()
        ts.append(time.perf_counter() - t0)
    out["dense"] = 1e3 * statistics.median(ts)
    out["rows"] = rows
    return out

