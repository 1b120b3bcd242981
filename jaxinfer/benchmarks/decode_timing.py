"""Timing prefill and greedy decode steps through `ModelRunner.execute`: the engine's real per-step cost (host-side
padding, transfer, jitted step, sampling, sync). Shared by the workloads that drive a runner directly."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxinfer.benchmarks.probe import median, time_calls
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk

PAGE_SIZE = 16  # tokens per KV page, the engine's default
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


class PageIds:
    """Hands out consecutive page ids, starting after the null page 0."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        """The next `n` unused page ids."""
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


@dataclasses.dataclass
class DecodeResult:
    """Timed decode steps of one batch.

    Attributes:
      batch: sequences per step.
      context: (first, last) timed step's context length in tokens, per sequence.
      step_ms: median wall ms of one whole `execute` call.
      compile_s: the first (warm-up) step's extra seconds over the median: compilation.
    """

    batch: int
    context: tuple[int, int]
    step_ms: float
    compile_s: float

    @property
    def tok_s(self) -> float:
        """Aggregate decode tokens per second (batch / step time)."""
        return self.batch * 1e3 / self.step_ms

    @property
    def mean_context(self) -> float:
        """Mean context length of the timed steps, tokens."""
        return (self.context[0] + self.context[1]) / 2


@dataclasses.dataclass
class Failure:
    """A measurement that raised (e.g. an XLA error); reported instead of a number."""

    batch: int
    error: str


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, at most 160 characters, for a report."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def run_step(runner: ModelRunner, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, float]:
    """One greedy `execute` of `chunks`: (the sampled token ids [len(chunks)], wall seconds)."""
    t0 = time.perf_counter()
    result = runner.execute(chunks, [SamplingRow(GREEDY, seed) for seed in range(len(chunks))])
    return result.token_ids, time.perf_counter() - t0


def time_decode(runner: ModelRunner, prompts: list[list[int]], pages: list[list[int]], warmup: int,
                steps: int) -> DecodeResult:
    """Prefills `prompts` (one step, untimed), then times `warmup + steps` greedy decode steps of the whole batch
    (the median of the last `steps`).

    Args:
      runner: a runner with room for every prompt plus `warmup + steps` tokens on its `pages`.
      prompts: token ids, one list per sequence.
      pages: page ids, one list per sequence.
      warmup: untimed steps (the first compiles).
      steps: timed steps (>= 1).
    """
    tokens, _ = run_step(runner, [ScheduledChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
    done = [len(p) for p in prompts]
    times = []
    for _ in range(warmup + steps):
        chunks = [ScheduledChunk([int(t)], n, pg) for t, n, pg in zip(tokens, done, pages)]
        tokens, dt = run_step(runner, chunks)
        done = [n + 1 for n in done]
        times.append(dt)
    step = median(times[warmup:])
    return DecodeResult(batch=len(prompts), context=(done[0] - steps + 1, done[0]), step_ms=1e3 * step,
                        compile_s=max(times[0] - step, 0.0))


class ChainedSteps:
    """One decode step of fixed chunks per call, as the engine runs decode steps with async scheduling
    (`jaxinfer.engine.run_ahead`): a call dispatches the next step, its tokens fed on device from the step before
    (`ModelRunner.submit`), then reads the step before. In a run of calls, one call's time is one step of the
    steady state; the first call of a run only dispatches, and `flush` reads the last step.

    Args:
      runner: the engine's runner.
      chunks: one decode chunk per sequence, the same every call (the same KV slots rewritten).
      rows: their sampling rows.
    """

    def __init__(self, runner: ModelRunner, chunks: list[ScheduledChunk], rows: list[SamplingRow]) -> None:
        self.runner, self.chunks, self.rows = runner, chunks, rows
        self.pending = None

    def __call__(self) -> None:
        fed = None if self.pending is None else (self.pending, list(range(len(self.chunks))))
        step = self.runner.submit(self.chunks, self.rows, fed_from=fed)
        self.flush()
        self.pending = step

    def flush(self) -> None:
        """Waits for the step in flight, if any."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def timed_calls(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of `n` calls of `fn`, one sample each; for a `ChainedSteps`, whose steps overlap (a call may return
    early, the next wait for two steps), one sample: the calls' mean, the chain's throughput; its last step is read
    afterwards, untimed."""
    if not isinstance(fn, ChainedSteps):
        return time_calls(fn, n, warmup=0)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    mean = (time.perf_counter() - t0) / n
    fn.flush()
    return [mean]
