"""Where a batch-1 decode step's time goes (step workload): the whole `execute`, the jitted step on
device-resident inputs, the forward alone, sampling alone, only the dense matmuls (scanned, unrolled with sliced
weights, unrolled over separate arrays) and the LM head with one and two rows."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.benchmarks import dense_matmuls as dm
from jaxinfer.benchmarks.decode_timing import GREEDY, run_step
from jaxinfer.benchmarks.model_setup import DTYPES
from jaxinfer.benchmarks.probe import median, time_calls
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow, sample
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig
from models.llama import forward

logger = logging.getLogger(__name__)

PARTS = ("execute", "step", "forward", "sample", "dense_scan", "dense_sliced", "dense_separate", "lm_head_1row",
         "lm_head_2rows")  # the keys of `breakdown`'s result, in report order


def part_labels(cfg: ModelConfig) -> dict[str, str]:
    """The report's description of each part, with the model's shapes."""
    head = f"[1, {cfg.hidden_size}] x [{cfg.vocab_size}, {cfg.hidden_size}]^T"
    return {
        "execute": "`execute` (host prep + transfer + jitted step + sync)",
        "step": "jitted step (forward + sampling), device-resident inputs",
        "forward": "forward only, no sampling",
        "sample": "sampling only (greedy)",
        "dense_scan": f"dense matmuls only, scan ({cfg.num_layers} layers + 2-row LM head)",
        "dense_sliced": "dense matmuls only, unrolled, weights sliced with `a[i]` inside the jit",
        "dense_separate": "dense matmuls only, unrolled, one input array per layer weight",
        "lm_head_1row": f"LM head only, 1 row ({head}), as batch-1 decode runs it",
        "lm_head_2rows": "LM head only, 2 rows",
    }


def device_step(runner: ModelRunner, chunk: list[ScheduledChunk]) -> tuple[Callable[[], None], tuple, int]:
    """(one call of the runner's jitted step on device-resident inputs, those inputs (tokens, metadata,
    sampling), the padded logits rows).

    The one reach into the runner's internals (`_step`): the jitted step on the inputs `execute` builds
    (`step_inputs`), without its host work. Re-point it here when the runner's modules move.
    """
    tokens, metadata, sampling, _ = runner.step_inputs(chunk, [SamplingRow(GREEDY, 0)])
    rows = sampling.temperature.shape[0]
    inputs = jax.device_put((tokens, metadata, sampling))

    def step() -> None:
        # The step returns (the sampled rows packed, prompt logprob rows, KV cache, draft cache); the cache is
        # donated.
        out, _, runner.kv_cache, _ = runner._step(runner.weights, *inputs[:2], runner.kv_cache, inputs[2])
        jax.block_until_ready(out)

    return step, inputs, rows


def breakdown(runner: ModelRunner, dtype: str, prompt: list[int], prefill_tokens: int, context: int,
              rounds: int = 4, per_round: int = 5) -> dict[str, float]:
    """Median ms of the parts of a batch-1 decode step with `context` cached tokens (scan mode), interleaved.

    The sequence's first `prefill_tokens` prompt tokens are prefilled and the rest up to `context` fed one per
    decode step, so that only shapes the caller's decode timing compiled run here. Every part runs `per_round`
    times in each of `rounds` rounds, so that slow phases of a noisy machine hit all parts alike. The step and
    forward parts repeat the same decode token (rewriting one KV slot).

    Args:
      runner: a scan-mode runner of a dense model, weights in `dtype`; its pages 1, 2, ... hold the sequence
        (their cache entries are overwritten).
      prefill_tokens: 1 <= prefill_tokens <= context.
      prompt: at least `context + 1` token ids.

    Returns:
      {part: ms} for every key of `PARTS`, and "logit_rows": the logits rows the runner pads batch-1 decode to.

    Raises:
      ValueError: for an MoE model (the dense-matmul parts need dense layers), or too few pages or prompt tokens.
    """
    cfg, weights = runner.cfg, runner.weights
    if cfg.is_moe:
        raise ValueError("the step breakdown times dense layers; an MoE model needs --no-breakdown")
    if not 1 <= prefill_tokens <= context < len(prompt):
        raise ValueError(f"the breakdown needs 1 <= prefill_tokens ({prefill_tokens}) <= context ({context}) < prompt "
                         f"length ({len(prompt)})")
    pages = list(range(1, runner.num_pages))
    if len(pages) * runner.page_size < context + 1:
        raise ValueError(f"the breakdown needs pages for {context + 1} tokens, the runner has {len(pages)}")
    run_step(runner, [ScheduledChunk(prompt[:prefill_tokens], 0, pages)])
    for n in range(prefill_tokens, context):
        run_step(runner, [ScheduledChunk([prompt[n]], n, pages)])
    chunk = [ScheduledChunk([prompt[context]], context, pages)]
    step, (tokens, metadata, sampling), logit_rows = device_step(runner, chunk)
    fwd = jax.jit(functools.partial(forward, cfg=cfg, scan_layers=True), donate_argnames=("kv_cache",))
    sample_jit = jax.jit(sample)
    dense, dense_sliced, dense_separate = (jax.jit(dm.dense_matmuls), jax.jit(dm.dense_matmuls_unrolled),
                                           jax.jit(dm.dense_matmuls_separate))
    head = jax.jit(dm.lm_head)
    logits = jnp.zeros((logit_rows, cfg.vocab_size), jnp.float32)
    x2 = jnp.ones((tokens.shape[0], cfg.hidden_size), DTYPES[dtype])
    x1 = jnp.ones((1, cfg.hidden_size), DTYPES[dtype])
    layers = [jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(cfg.num_layers)]

    def forward_only() -> None:
        out, runner.kv_cache = fwd(weights, tokens, metadata, runner.kv_cache)
        out.block_until_ready()

    parts: dict[str, Callable[[], object]] = {
        "execute": lambda: run_step(runner, chunk),
        "step": step,
        "forward": forward_only,
        "sample": lambda: jax.block_until_ready(sample_jit(logits, sampling)),
        "dense_scan": lambda: dense(x2, weights).block_until_ready(),
        "dense_sliced": lambda: dense_sliced(x2, weights).block_until_ready(),
        "dense_separate": lambda: dense_separate(x2, layers, weights).block_until_ready(),
        "lm_head_1row": lambda: head(x1, weights).block_until_ready(),
        "lm_head_2rows": lambda: head(x2, weights).block_until_ready(),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for fn in parts.values():
        time_calls(fn, 0, warmup=2)
    for _ in range(rounds):
        for k, fn in parts.items():
            times[k] += time_calls(fn, per_round, warmup=0)
    out: dict[str, float] = {k: 1e3 * median(v) for k, v in times.items()}
    out["logit_rows"] = logit_rows
    for k, v in out.items():
        logger.info("%s breakdown: %s: %.2f", dtype, k, v)
    return out
