"""Breakdown workload: where the time of a decode step (batch 1 and batch 32) and of a 512-token prefill goes.

For each dtype and shape, through a scan-mode `ModelRunner` on `--model` (SmolLM2-135M-Instruct by default), the
median ms of each part run on its own, the parts interleaved in rounds so that machine noise hits them alike:

- `execute`: the whole call (host-side padding, transfer, jitted step, sync);
- the jitted step (forward + sampling) on device-resident inputs; host = `execute` - step;
- sampling alone (greedy) on the step's logits rows;
- the dense matmuls alone: every layer's projections and MLP (`dense_matmuls.dense_layer`, scanned like the
  forward, so their per-layer weight copies included) on the step's padded token rows, then the LM head on its
  logits rows;
- attention alone: `paged_attention_reference` of every layer on the step's metadata and the runner's cache;
- rest = step - (dense + attention + sampling): norms, RoPE, KV writes, residuals, the embedding gather.

About 4 minutes on 2 cores:

    .venv/bin/jaxinfer bench breakdown --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks import dense_matmuls as dm
from jaxinfer.benchmarks import model_setup
from jaxinfer.benchmarks.decode_timing import PAGE_SIZE, PageIds, pages_for, run_step
from jaxinfer.benchmarks.probe import median, time_calls
from jaxinfer.benchmarks.report import Report, int_list, machine_line, table
from jaxinfer.benchmarks.step_breakdown import device_step
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import sample
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig
from pallas_kernels.paged_attention import paged_attention_reference

logger = logging.getLogger(__name__)

SECTION = ("<!-- breakdown: begin -->", "<!-- breakdown: end -->")
PARTS = ("execute", "step", "sample", "dense", "attention")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The breakdown workload's options."""
    parser.add_argument("--model", default=None, help="GGUF file, HF folder or checkpoint (default: SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence of the decode steps")
    parser.add_argument("--batches", default="1,32", help="decode batch sizes")
    parser.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill chunk (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each part runs 3 times a round")


def _dense(x: jax.Array, weights, logits_rows: jax.Array) -> jax.Array:
    """The forward's dense matmuls on rows x [T, D], scanned over layers; the LM head on the logits rows only."""
    x, _ = jax.lax.scan(lambda x, w: (dm.dense_layer(x, w), None), x, weights.layers)
    return dm.lm_head(jnp.take(x, logits_rows, axis=0), weights)


def _attention(q: jax.Array, cache, metadata, cfg: ModelConfig) -> jax.Array:
    """Every layer's paged attention on one step's metadata (the queries are the same each layer)."""
    def body(acc: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
        out = paged_attention_reference(q, cache.k, cache.v, metadata.kv_lens, metadata.page_table, metadata.cu_q_lens,
                                        layer, max_q_len=metadata.max_q_len, sm_scale=cfg.head_dim**-0.5)
        return acc + out, None
    return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(cfg.num_layers))[0]


def measure(runner: ModelRunner, chunks: list[ScheduledChunk], rounds: int) -> dict[str, float]:
    """Median ms of every part of `PARTS` for the step of `chunks` (whose context the runner already holds)."""
    cfg, weights = runner.cfg, runner.weights
    step, (tokens, metadata, sampling), rows = device_step(runner, chunks)
    dtype = weights.final_norm.dtype
    x = jnp.ones((tokens.shape[0], cfg.hidden_size), dtype)
    q = jnp.ones((tokens.shape[0], cfg.num_heads, cfg.head_dim), dtype)
    logits = jnp.zeros((rows, cfg.vocab_size), jnp.float32)
    dense, attention, sample_jit = jax.jit(_dense), jax.jit(functools.partial(_attention, cfg=cfg)), jax.jit(sample)
    parts = {
        "execute": lambda: run_step(runner, chunks),
        "step": step,
        "sample": lambda: jax.block_until_ready(sample_jit(logits, sampling)),
        "dense": lambda: dense(x, weights, metadata.logits_indices).block_until_ready(),
        "attention": lambda: attention(q, runner.kv_cache, metadata).block_until_ready(),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for fn in parts.values():
        time_calls(fn, 0, warmup=2)
    for _ in range(rounds):
        for k, fn in parts.items():
            times[k] += time_calls(fn, 3, warmup=0)
    return {k: 1e3 * median(v) for k, v in times.items()}


def _shapes(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(label, batch, new tokens per sequence) of every measured step."""
    batches = int_list("--batches", args.batches)
    for option, value, least in (("--context", args.context, 1), ("--prefill-len", args.prefill_len, 0),
                                 ("--rounds", args.rounds, 1)):
        if value < least:
            raise ValueError(f"{option} {value} must be >= {least}")
    shapes = [(f"decode batch {b}, context {args.context}", b, 1) for b in batches]
    return shapes + ([(f"prefill {args.prefill_len}", 1, args.prefill_len)] if args.prefill_len else [])


def run_dtype(cfg: ModelConfig, host, dtype: str, shapes: list[tuple[str, int, int]], args) -> list[dict]:
    """The rows of one dtype: a fresh runner, each shape's context prefilled, then its parts measured."""
    rng = np.random.default_rng(0)
    biggest = max(b for _, b, _ in shapes)
    longest = args.context + max(q for _, _, q in shapes) + 1
    runner = ModelRunner(cfg, model_setup.cast_weights(host, dtype), num_pages=2 + biggest * pages_for(longest),
                         page_size=PAGE_SIZE, kv_dtype=model_setup.DTYPES[dtype], scan_layers=True,
                         max_pages_per_seq=pages_for(longest))
    out = []
    for label, batch, q_len in shapes:
        pages = PageIds()
        seqs = [pages.take(pages_for(longest)) for _ in range(batch)]
        if q_len == 1:
            prompts = [rng.integers(3, cfg.vocab_size, args.context).tolist() for _ in range(batch)]
            run_step(runner, [ScheduledChunk(p, 0, pg) for p, pg in zip(prompts, seqs)])
            chunks = [ScheduledChunk([int(rng.integers(3, cfg.vocab_size))], args.context, pg) for pg in seqs]
        else:
            chunks = [ScheduledChunk(rng.integers(3, cfg.vocab_size, q_len).tolist(), 0, seqs[0])]
        ms = measure(runner, chunks, args.rounds)
        row = {"dtype": dtype, "shape": label, "batch": batch, **ms}
        logger.info("breakdown %s", row)
        out.append(row)
    return out


def render(rows: list[dict], cfg: ModelConfig, args: argparse.Namespace, elapsed_s: float) -> str:
    """The section's markdown (without its markers)."""
    out = ["## Step breakdown: decode steps and a prefill, ms per part\n",
           f"Median ms of each part of one step on {model_setup.describe(cfg)} (scan over layers, page size "
           f"{PAGE_SIZE}, greedy), each part run on its own, interleaved in {args.rounds} rounds (definitions in "
           "`jaxinfer/benchmarks/breakdown.py`). rest = step - (dense + attention + sampling); host = execute - step. "
           "The parts are timed separately, so they need not add up: a negative host or rest is noise of that size. "
           "The dense-matmul part scans over the stacked weights as the forward does, so it includes the copies "
           "XLA:CPU makes of each layer's weight slices. Command:\n", f"```\n{args.command}\n```\n",
           f"- date: {args.date}; {machine_line()}; run time {elapsed_s:.0f} s; a shared, noisy VM: compare rows "
           "of one run\n"]
    header = ["dtype", "step", "execute", "host", "jitted step", "dense matmuls", "attention", "sampling", "rest"]
    body = []
    for r in rows:
        rest = r["step"] - r["dense"] - r["attention"] - r["sample"]
        body.append([r["dtype"], r["shape"]] + [f"{v:.1f}" for v in (r["execute"], r["execute"] - r["step"],
                                                                       r["step"], r["dense"], r["attention"],
                                                                       r["sample"], rest)])
    out.append(table(header, body) + "\n")
    return "\n".join(out)


def run(args: argparse.Namespace) -> Report:
    """Measures every dtype x shape of the options."""
    t0 = time.perf_counter()
    dtypes, shapes = list(dict.fromkeys(model_setup.parse_dtypes(args.dtypes))), _shapes(args)
    cfg, host = model_setup.load_host_weights(args.model)
    if cfg.is_moe:
        raise ValueError("the breakdown times dense layers; give a dense model")
    longest = args.context + 2 if not args.prefill_len else max(args.context + 2, args.prefill_len + 1)
    if longest > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} / --prefill-len {args.prefill_len} exceed the model's context "
                         f"({cfg.max_position_embeddings} tokens)")
    rows = [row for dtype in dtypes for row in run_dtype(cfg, host, dtype, shapes, args)]
    elapsed = time.perf_counter() - t0
    data = {"model": model_setup.config_data(cfg), "rows": rows, "load_avg": os.getloadavg()[0]}
    return Report("breakdown", render(rows, cfg, args, elapsed), data)
