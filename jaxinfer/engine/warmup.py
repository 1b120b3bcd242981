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
compilation cache a restart loads them all from disk, in the background while serving (`Warmup`).

`compile_prompt` compiles only the shapes one long prompt meets when it is prefilled alone (its chunks' token
buckets times the page-table widths its context passes through): what a long-context benchmark needs before timing.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxinfer.engine import compilation_cache, multihost
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import MAX_LOGPROBS, SamplingRow
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
    runner.compile_ahead("step", runner.step_args(*runner.step_inputs(chunks, [row] * len(chunks)), lowering=True))


def warm_token_feed(runner: ModelRunner, batches: list[int]) -> None:
    """Compiles the token feed of a decode step run ahead (`run_ahead`: its tokens taken on device from the step
    before, `ModelRunner.submit`) at each decode batch size, so that its compile (0.1-0.2 s on CPU) does not stall
    the first such step. The feed's inputs are placed as a step's are (the previous step's rows as its output)."""
    row = SamplingRow(SamplingParams(temperature=0), seed=0)
    for n in sorted(set(batches)):
        tokens, _, sampling, _ = runner.step_inputs([ScheduledChunk([0], 0, [NULL_PAGE])] * n, [row] * n)
        rows = np.zeros((len(sampling.temperature), 4 + 2 * MAX_LOGPROBS), np.int32)  # `pack_rows`' array
        rows = jax.device_put(rows, runner.kv.replicated)  # None: uncommitted, as a jitted step's output
        runner.compile_ahead("feed", (tokens, np.full(len(tokens), -1, np.int32), rows))


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


def prompt_shapes(runner: ModelRunner, num_tokens: int, max_num_batched_tokens: int) -> list[Shape]:
    """The step shapes a prompt of `num_tokens` tokens meets when the scheduler prefills it alone in chunks of
    `max_num_batched_tokens` (no cached prefix): per chunk, its token count and the page-table width of the context
    after it; the first chunk as "fresh" when the attention backend has a flash kernel. Deduplicated by padded
    bucket, in prefill order, no penalty inputs.

    Raises:
      ValueError: if num_tokens or max_num_batched_tokens is < 1, or the prompt exceeds the runner's widest page
        table.
    """
    if num_tokens < 1 or max_num_batched_tokens < 1:
        raise ValueError(f"{num_tokens=} and {max_num_batched_tokens=} must be >= 1")
    ps = runner.page_size
    if num_tokens > runner.max_pages_per_seq * ps:
        raise ValueError(f"a prompt of {num_tokens} tokens exceeds the context of {runner.max_pages_per_seq * ps}")
    shapes, seen = [], set()
    for start in range(0, num_tokens, max_num_batched_tokens):
        n = min(max_num_batched_tokens, num_tokens - start)
        width = page_bucket(-(-(start + n) // ps), runner.max_pages_per_seq)
        kind = "fresh" if start == 0 and runner.attention.flash is not None else "prefill"
        key = (kind, next_power_of_two(n, MIN_PREFILL_TOKENS), width)
        if key not in seen:
            seen.add(key)
            shapes.append((kind, n, width, False))
    return shapes


def compile_prompt(runner: ModelRunner, num_tokens: int, max_num_batched_tokens: int) -> float:
    """Compiles the shapes of `prompt_shapes` ahead of time (as `Warmup`, greedy rows without penalties), so that
    prefilling such a prompt compiles nothing; returns the seconds taken.

    Raises:
      ValueError: as `prompt_shapes`.
    """
    row = SamplingRow(SamplingParams(temperature=0), seed=0)
    t0 = time.perf_counter()
    for kind, n, width, _ in prompt_shapes(runner, num_tokens, max_num_batched_tokens):
        _compile_step(runner, kind, n, width, row)
    return time.perf_counter() - t0


def _compile_shape(runner: ModelRunner, shape: Shape, rows: dict, num_drafts_for, num_spec_tokens: int) -> None:
    kind, n, width, penalties = shape
    if kind in ("verify", "propose"):
        _compile_spec(runner, kind, n, num_drafts_for(n), num_spec_tokens, width, rows[penalties])
    else:
        _compile_step(runner, kind, n, width, rows[penalties])


class Warmup:
    """Compiles every shape of `warmup_shapes` ahead of time (`lower().compile()`, nothing runs) into the runner's
    executable table, so its calls run the compiled executables directly.

    `start` compiles the first shape (one-sequence decode at the narrowest page table) and asks the persistent
    compilation cache whether it held it. A hit means an earlier start of this configuration filled the cache: the
    rest load from it (tracing and lowering each, a few hundred milliseconds) in a background thread while the
    engine serves, and a request whose shape is not loaded yet compiles it on the spot, from the cache too. A miss
    (a cold cache, or none) compiles the rest before `start` returns, on `workers` threads: XLA compiles release
    the GIL, so they overlap (tracing does not). Multi-process runs always compile in the foreground.

    Args:
      runner: the model runner.
      max_num_seqs, max_num_batched_tokens: the engine's step limits.
      num_drafts_for: with speculative decoding, the drafts per sequence a step of padded batch b gets
        (`SpeculationPolicy.step_k`); verify steps are padded to that many + 1 tokens per sequence
        (`ModelRunner.execute_verify`'s verify_len). None without speculative decoding.
      num_spec_tokens: k, the draft width.
      workers: threads of a foreground warm-up (default: the CPU count, at most 4).
    """

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
                 num_drafts_for: Callable[[int], int] | None = None, num_spec_tokens: int = 0,
                 workers: int | None = None) -> None:
        self.runner, self.num_drafts_for, self.num_spec_tokens = runner, num_drafts_for, num_spec_tokens
        self.shapes = warmup_shapes(runner, max_num_seqs, max_num_batched_tokens, num_drafts_for)
        self.workers = workers or min(os.cpu_count() or 1, 4)
        self.rows = {False: SamplingRow(SamplingParams(temperature=0), seed=0),  # greedy, with or without a penalty
                     True: SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.1), seed=0)}
        self.background = False
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0
        self.cache_hits = self.cache_misses = 0
        self.token_feed = num_drafts_for is None  # decode steps may run ahead (`start_warmup`: async scheduling)

    def _compile(self, shape: Shape) -> None:
        _compile_shape(self.runner, shape, self.rows, self.num_drafts_for, self.num_spec_tokens)

    def start(self, allow_background: bool = True) -> None:
        """Compiles the first shape, then the rest in the foreground or (a warm cache, `allow_background`) in a
        background thread; see the class docstring."""
        t0 = time.perf_counter()
        if self.token_feed:  # not counted below: the counts are the step shapes
            warm_token_feed(self.runner, [n for kind, n, _, _ in self.shapes if kind == "decode"])
        hits0, misses0 = compilation_cache.counts()
        self._compile(self.shapes[0])
        hits, misses = compilation_cache.counts()
        warm = hits > hits0 and misses == misses0
        rest = self.shapes[1:]
        if warm and allow_background and rest:
            self.background = True
            context = contextvars.copy_context()  # the caller's trace-time switches (e.g. native kernels)
            self._thread = threading.Thread(target=context.run, args=(self._run_background, rest, t0, (hits0, misses0)),
                                            name="jaxinfer-warmup", daemon=True)
            _RUNNING.add(self)
            _stop_at_exit()
            self._thread.start()
            logger.info("warm-up: the compilation cache holds this configuration's shapes; loading the other %d of "
                        "%d in the background while serving", len(rest), len(self.shapes))
            return
        from tqdm import tqdm

        with ThreadPoolExecutor(self.workers, initializer=None) as pool, \
                tqdm(total=len(self.shapes), initial=1, desc="compiling step shapes", unit="shape",
                     leave=False) as bar:
            context = contextvars.copy_context()
            for future in [pool.submit(context.copy().run, self._compile, shape) for shape in rest]:
                future.result()
                bar.update()
        self._finish(t0, (hits0, misses0))

    def _run_background(self, shapes: list[Shape], t0: float, counts0: tuple[int, int]) -> None:
        try:
            for shape in shapes:
                if self._stop.is_set():
                    return
                self._compile(shape)
            self._finish(t0, counts0)
        except Exception:  # noqa: BLE001 - a failed background compile must not kill the process; steps compile
            logger.exception("background warm-up failed; the remaining shapes compile when first used")
            self.done.set()

    def _finish(self, t0: float, counts0: tuple[int, int]) -> None:
        self.seconds = time.perf_counter() - t0
        hits, misses = compilation_cache.counts()
        self.cache_hits, self.cache_misses = hits - counts0[0], misses - counts0[1]
        logger.info("compiled %d step shapes in %.1f s%s (%d loaded from the persistent compilation cache, %d "
                    "compiled and stored)", len(self.shapes), self.seconds, " in the background" if self.background
                    else f" on {self.workers} threads", self.cache_hits, self.cache_misses)
        self.done.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stops a background warm-up after the shape it is compiling (the rest compile when first used), waiting
        up to `timeout` seconds for that shape."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the warm-up to finish; returns whether it did."""
        return self.done.wait(timeout)


# Background warm-ups still running: stopped at interpreter exit, so that no compile runs while jax shuts down.
_RUNNING: weakref.WeakSet[Warmup] = weakref.WeakSet()
_stop_registered = False


def _stop_running() -> None:
    for w in list(_RUNNING):
        w.stop(timeout=60)


def _stop_at_exit() -> None:
    """Registers `_stop_running` with atexit once, when the first background warm-up starts: after jax registered
    its own clean-up (at backend start-up), so that ours runs first (atexit runs last-in, first-out); a shape
    lowering while jax cleans up fails (KeyError inside jax)."""
    global _stop_registered
    if not _stop_registered:
        _stop_registered = True
        atexit.register(_stop_running)


def start_warmup(runner: ModelRunner, config, spec_policy) -> Warmup | None:
    """The engine's warm-up (None when `config.warmup` is off), started: in the background only in one process
    (every process of a multi-host run compiles the same shapes in step).

    Args:
      runner: the model runner.
      config: the `EngineConfig` (its step limits and speculative config).
      spec_policy: the engine's `SpeculationPolicy`, or None without speculative decoding.
    """
    if not config.warmup:
        return None
    spec = config.speculative_config
    w = Warmup(runner, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
               num_drafts_for=None if spec is None else spec_policy.step_k,
               num_spec_tokens=0 if spec is None else spec.num_speculative_tokens)
    w.token_feed = config.async_scheduling and spec is None and not multihost.is_multi_process()
    w.start(allow_background=not multihost.is_multi_process())
    return w


def warmup(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int,
           num_drafts_for: Callable[[int], int] | None = None, num_spec_tokens: int = 0) -> float:
    """Compiles every shape of `warmup_shapes` in the foreground (`Warmup` with no background phase); returns the
    seconds taken."""
    w = Warmup(runner, max_num_seqs, max_num_batched_tokens, num_drafts_for, num_spec_tokens)
    w.start(allow_background=False)
    return w.seconds
