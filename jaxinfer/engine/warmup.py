"""Warm-up: which shape buckets a server meets, and compiling each of them ahead of time.

Decode buckets: batch 1, 2, 4, ... up to max_num_seqs, times every page-table width. Prefill buckets: one sequence
with 16, 32, ... up to max_num_batched_tokens new tokens, times every page-table width, and, when the attention
backend has a flash kernel, the same token counts as a fresh prompt's first chunk. With speculative decoding also
the verify step of every decode batch bucket that gets drafts, padded to that many drafts per sequence, times every
page-table width, and, with a draft model, its drafting call for the same buckets (greedy rows; sampling rows
compile on first use). Each of these twice: without penalty inputs (width 1) and with them (penalty ids as wide
as the longest context, logit bias MAX_LOGIT_BIAS wide, `SamplingArrays.build`), the only two shapes they take,
so a request with penalties or a logit bias compiles nothing either (allowed_token_ids and bad_words ride in the
always-present token bitmask). Other shapes (several prefill chunks at once) compile on first use. With the persistent
compilation cache a restart loads them all from disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.step_inputs import (MIN_PREFILL_TOKENS, NULL_PAGE, next_power_of_two, page_bucket,
                                         page_table_widths)
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk

logger = logging.getLogger(__name__)

Shape = tuple[str, int, int, bool]  # (kind, batch or new tokens, page-table width, penalties)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The padded batch sizes of decode steps of up to max_num_seqs sequences: 1, 2, 4, ..."""
    batches = [b for b in (2 ** k for k in range(0, 16)) if b < 2 * max_num_seqs and b // 2 < max_num_seqs]
    return sorted({min(b, next_power_of_two(max_num_seqs, 2)) for b in batches})


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The padded token counts of one-sequence prefill steps of up to max_num_batched_tokens tokens: 16, 32, ..."""
    return sorted({min(t, next_power_of_two(max_num_batched_tokens, MIN_PREFILL_TOKENS))
                   for t in (MIN_PREFILL_TOKENS * 2 ** k for k in range(12)) if t // 2 < max_num_batched_tokens})


def warmup_shapes(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
                  num_drafts_for: Callable[[int], int] | None = None) -> list[Shape]:
    """Every shape `warmup` compiles, as (kind, n, page-table width, penalties): kind "decode" (n sequences),
    "prefill" and "fresh" (one sequence of n new tokens, with and without cached context), "verify" and "propose"
    (n sequences); each with penalty inputs of width 1 (no row uses penalties) and, penalties True, of the
    runner's longest context (`SamplingArrays.build`)."""
    widths = page_table_widths(runner.max_pages_per_seq)
    batches, tokens = batch_buckets(max_num_seqs), token_buckets(max_num_batched_tokens)
    ps = runner.page_size
    shapes = [("decode", b, p) for p in widths for b in batches] + \
             [("prefill", t, p) for p in widths for t in tokens if t <= p * ps]
    if runner.attention.flash is not None:  # a fresh prompt's first chunk is its own bucket
        shapes += [("fresh", t, page_bucket(-(-t // ps), runner.max_pages_per_seq))
                   for t in tokens if t <= runner.max_pages_per_seq * ps]
    if num_drafts_for is not None:
        speculating = [b for b in batches if num_drafts_for(b) > 0]
        shapes += [("verify", b, p) for p in widths for b in speculating]
        if runner.draft is not None:
            shapes += [("propose", b, p) for p in widths for b in speculating]
    return [(kind, n, p, penalties) for penalties in (False, True) for kind, n, p in shapes]


def _compile_step(runner: ModelRunner, kind: str, n: int, width: int, row: SamplingRow) -> None:
    """Compiles one decode, prefill or fresh-prompt step shape."""
    context = width * runner.page_size
    if kind == "decode":
        chunks = [ScheduledChunk([0], context - 1, [NULL_PAGE] * width)] * n
    elif kind == "prefill":
        chunks = [ScheduledChunk([0] * n, context - n, [NULL_PAGE] * width)]
    else:
        chunks = [ScheduledChunk([0] * n, 0, [NULL_PAGE] * width)]
    runner.compile_ahead("step", runner.step_args(*runner.step_inputs(chunks, [row] * len(chunks))))


def _compile_spec(runner: ModelRunner, kind: str, batch: int, drafts: int, num_spec_tokens: int, width: int,
                  row: SamplingRow) -> None:
    """Compiles one verify or drafting shape (batch sequences of `drafts` drafts each, page-table width)."""
    context = width * runner.page_size - drafts - 1
    if context < 0:
        return
    if kind == "verify":
        chunks = [ScheduledChunk([0] * (drafts + 1), context, [NULL_PAGE] * width)] * batch
        inputs = runner.verify_inputs(chunks, [row] * batch, [[]] * batch, num_spec_tokens,
                                      verify_len=drafts + 1)
        runner.compile_ahead("verify", runner.verify_args(*inputs))
    else:
        chunks = [ScheduledChunk([0], context, [NULL_PAGE] * width)] * batch
        inputs = runner.propose_inputs(chunks, [row] * batch, [drafts] * batch, num_spec_tokens)
        runner.compile_ahead("propose", runner.propose_args(*inputs[:5]), num_tokens=num_spec_tokens,
                             with_probs=False)


def warmup(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
           num_drafts_for: Callable[[int], int] | None = None, num_spec_tokens: int = 0) -> float:
    """Compiles every shape of `warmup_shapes` ahead of time (`lower().compile()`, nothing runs) into the runner's
    executable table, so its calls run the compiled executables directly; returns the seconds taken.

    Args:
      runner: the model runner.
      max_num_seqs, max_num_batched_tokens: the engine's step limits.
      num_drafts_for: with speculative decoding, the drafts per sequence a step of padded batch b gets
        (`SpeculationPolicy.step_k`); verify steps are padded to that many + 1 tokens per sequence
        (`ModelRunner.execute_verify`'s verify_len). None without speculative decoding.
      num_spec_tokens: k, the draft width.
    """
    from tqdm import tqdm

    rows = {False: SamplingRow(SamplingParams(temperature=0), seed=0),  # greedy rows, with or without a penalty
            True: SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.1), seed=0)}
    shapes = warmup_shapes(runner, max_num_seqs, max_num_batched_tokens, num_drafts_for)
    t0 = time.perf_counter()
    for kind, n, width, penalties in tqdm(shapes, desc="compiling step shapes", unit="shape", leave=False):
        if kind in ("verify", "propose"):
            _compile_spec(runner, kind, n, num_drafts_for(n), num_spec_tokens, width, rows[penalties])
        else:
            _compile_step(runner, kind, n, width, rows[penalties])
    seconds = time.perf_counter() - t0
    logger.info("compiled %d step shapes in %.1f s", len(shapes), seconds)
    return seconds
