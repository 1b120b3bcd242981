"""Attention workload: one layer's reference paged-attention decode step on CPU, the baseline for the kernels.

For each dtype x context x batch, the jitted `paged_attention_reference` (q_len 1 per sequence) with the heads of
`--model` (its config; the weights are loaded only to read it), every sequence at the full context on pages handed
out in shuffled order, the page table exactly as wide as the context. Median of `--reps` calls after 3 warm-up
calls. About 10 s on 2 cores:

    .venv/bin/jaxinfer bench attention --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks import model_setup
from jaxinfer.benchmarks.decode_timing import PAGE_SIZE, pages_for
from jaxinfer.benchmarks.probe import median, time_calls
from jaxinfer.benchmarks.report import Report, int_list, machine_line, table
from models.config import ModelConfig
from pallas_kernels.paged_attention import paged_attention_reference

logger = logging.getLogger(__name__)

SECTION = ("<!-- attention-baseline: begin -->", "<!-- attention-baseline: end -->")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The attention workload's options."""
    parser.add_argument("--model", default=None,
                        help="the model whose heads are used (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--contexts", default="512,4096", help="contexts in tokens")
    parser.add_argument("--batches", default="1,32", help="batch sizes")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per shape")


def bench_attention(cfg: ModelConfig, dtypes: list[str], contexts: list[int], batches: list[int],
                    reps: int) -> list[dict]:
    """ms per jitted `paged_attention_reference` decode call (one layer, q_len 1) for each dtype x context x batch.

    Every sequence has exactly `context` cached tokens on `context / PAGE_SIZE` pages handed out in shuffled order,
    and the page table is exactly that wide (the engine pads it to a bucket of 8, 32, 128, 512 pages, so at
    context 4096 it would compute over 8192 slots: this is the reference's best case). The cache is a single
    layer's [P, K, page_size, H] with the model's KV heads and head dim.

    Returns:
      One dict per shape: "dtype", "context", "batch", "ms", "kv_bytes" (K and V read), "gb_s".
    """
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        dt = model_setup.DTYPES[dtype]
        for context in contexts:
            pages_per_seq = pages_for(context)
            for batch in batches:
                num_pages = 1 + batch * pages_per_seq
                page_table = (1 + rng.permutation(batch * pages_per_seq)).reshape(batch, pages_per_seq)
                page_table = jnp.asarray(page_table, jnp.int32)
                kv_lens = jnp.full(batch, context, jnp.int32)
                cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
                shape = (num_pages, kv_heads, PAGE_SIZE, head_dim)
                q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)), dt)
                k_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dt)
                v_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dt)
                fn = lambda: paged_attention_reference(  # noqa: E731
                    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=1,
                    sm_scale=head_dim**-0.5).block_until_ready()
                ms = 1e3 * median(time_calls(fn, reps, warmup=3))
                kv_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dt).itemsize
                row = {"dtype": dtype, "context": context, "batch": batch, "ms": ms, "kv_bytes": kv_bytes,
                       "gb_s": kv_bytes / ms / 1e6}
                logger.info("attention %s", row)
                rows.append(row)
                del q, k_pages, v_pages
    return rows


def render(rows: list[dict], cfg: ModelConfig, args: argparse.Namespace, elapsed_s: float,
           load: tuple[float, float]) -> str:
    """The section's markdown (without its markers)."""
    out = ["## Reference attention decode step on CPU (baseline for the kernels)\n"]
    out.append(
        f"One layer's decode attention (`paged_attention_reference`, jitted, q_len 1 per sequence) with "
        f"{cfg.name or 'the model'}'s heads ({cfg.num_heads} query / {cfg.num_kv_heads} KV heads, head dim "
        f"{cfg.head_dim}), page size {PAGE_SIZE}, every sequence at the full context, pages handed out in shuffled "
        "order, page table exactly as wide as the context (the engine pads it to a bucket of 8, 32, 128, ... pages, "
        "which makes the reference compute more); single-layer cache [P, K, page_size, H]. Median of "
        f"{args.reps} calls after 3 warm-up calls, each blocked until ready. GB/s = bytes of K and V the step must "
        "read / time. This is the CPU number the kernels are measured against. The Pallas kernels run on CPU only "
        "in interpret mode, whose timings measure the interpreter (about 0.15 ms per grid step in generic interpret "
        "mode), not the kernel: they are not a speed comparison. Command:\n")
    out.append(f"```\n{args.command}\n```\n")
    out.append(f"- date: {args.date}; backend {jax.default_backend()}; {machine_line()}; run "
               f"time {elapsed_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
               f"({os.cpu_count()} cores: above that, other jobs competed); a shared, noisy VM: numbers move by 20% "
               "or more between runs\n")
    out.append(table(["dtype", "batch", "context", "K+V read MB", "ms per call (median)", "GB/s of K+V"],
                     [[r["dtype"], str(r["batch"]), str(r["context"]), f"{r['kv_bytes'] / 1e6:.1f}",
                       f"{r['ms']:.3f}", f"{r['gb_s']:.1f}"] for r in rows]) + "\n")
    return "\n".join(out)


def run(args: argparse.Namespace) -> Report:
    """Times the reference decode attention for every shape of the options."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    dtypes = model_setup.parse_dtypes(args.dtypes)
    contexts, batches = int_list("--contexts", args.contexts), int_list("--batches", args.batches)
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps} must be >= 1")
    cfg, _ = model_setup.load_host_weights(args.model)
    rows = bench_attention(cfg, dtypes, contexts, batches, args.reps)
    elapsed, load = time.perf_counter() - t0, (load0, os.getloadavg()[0])
    data = {"model": model_setup.config_data(cfg), "page_size": PAGE_SIZE, "reps": args.reps, "rows": rows,
            "load_avg": list(load)}
    return Report("attention", render(rows, cfg, args, elapsed, load), data)
