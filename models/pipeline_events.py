"""Execution events of `models.pipeline.pipeline_forward`: per stage and tick, the wall-clock interval of the
stage's work, recorded by the running program, and the bubble (idle share) they imply.

What the timestamps bracket. With `pipeline_forward(..., events=log)`, the active branch of every tick (the
`lax.cond` that runs a stage's layers on one micro-batch) is wrapped in two host callbacks
(`jax.experimental.io_callback`, unordered). The start callback takes an element of the stage's input (so it runs
only once the input, e.g. the activations `ppermute`d from the previous stage, has arrived) and returns a zero that
is added to the input (so the layers start only after it); the end callback takes the sum of the stage's output
(so it runs after the last layer's output exists) and returns a zero added to the output (so the `ppermute` to the
next stage waits for it). Each callback reads `time.perf_counter_ns()` on the host thread that runs the stage's
device (on fake CPU devices: the device's own thread of this process). The interval is the stage's layers on one
micro-batch, including its micro-batch metadata; the last layer's K/V write may finish after the end stamp. Idle
ticks (the `lax.cond`'s other branch) record nothing.

Overhead: two host callbacks per active stage-tick (a device -> host copy of a scalar and back, tens of
microseconds on CPU) plus one add over the micro-batch's activations and one sum; without `events` the program is
the one without recording (the flag is static).

The bubble, after GPipe (Huang et al. 2019): with M micro-batches of equal cost over N stages, each stage is busy
M of M + N - 1 ticks, idle a share (N - 1) / (M + N - 1) of the pipeline's span.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


@dataclasses.dataclass(frozen=True)
class Interval:
    """One stage's work on one micro-batch: stage, micro-batch, start and end in ns (`time.perf_counter_ns`)."""

    stage: int
    micro: int
    start_ns: int
    end_ns: int


class EventLog:
    """The host side: collects (stage, micro-batch, start / end) stamps from the callbacks of a running step.

    Pass one `EventLog` as the static `events` of `pipeline_forward` (it hashes by identity, so one log keeps one
    compiled program); after each step (block on its results first) `take()` returns and clears the intervals.
    Thread-safe: the fake CPU devices call back from their own threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, int], int] = {}
        self._done: list[Interval] = []

    def _stamp(self, kind: int, stage: np.ndarray, micro: np.ndarray, _probe: np.ndarray) -> np.ndarray:
        now = time.perf_counter_ns()
        key = (int(stage), int(micro))
        with self._lock:
            if kind == 0:
                self._open[key] = now
            else:
                self._done.append(Interval(key[0], key[1], self._open.pop(key), now))
        return np.zeros((), np.float32)

    def take(self) -> list[Interval]:
        """The intervals recorded since the last `take`, by (stage, micro-batch).

        Raises:
          RuntimeError: a stage started work it did not finish (a step still running: block on its results).
        """
        with self._lock:
            if self._open:
                raise RuntimeError(f"{len(self._open)} stage work intervals still open; block on the step first")
            done, self._done = sorted(self._done, key=lambda i: (i.stage, i.micro)), []
        return done

    def bracket(self, kind: int, stage: jax.Array, micro: jax.Array, x: jax.Array) -> jax.Array:
        """In-program: stamps the start (kind 0, x the stage's input) or end (kind 1, x its output) of a stage's
        work on a micro-batch; returns x plus a zero the callback returned (module docstring)."""
        probe = x.reshape(-1)[0] if kind == 0 else jnp.sum(x, dtype=jnp.float32)
        zero = io_callback(lambda s, m, p: self._stamp(kind, s, m, p), jax.ShapeDtypeStruct((), jnp.float32),
                           stage, micro, probe)
        return x + zero.astype(x.dtype)


def idle_shares(intervals: list[Interval], num_stages: int) -> dict:
    """The bubble of one step from its recorded intervals.

    The span is from the first start to the last end over all stages (the pipeline's ticks; the embedding and LM
    head outside them are not in it). A stage's idle share is 1 - (its busy time) / span.

    Returns:
      {"span_ms": float, "busy_ms": [per stage], "idle": [per stage, in [0, 1]], "micro": M' (intervals per stage)}.

    Raises:
      ValueError: no intervals, or stages with different numbers of intervals.
    """
    per_stage = [[i for i in intervals if i.stage == s] for s in range(num_stages)]
    counts = {len(p) for p in per_stage}
    if not intervals or len(counts) != 1:
        raise ValueError(f"every one of {num_stages} stages must record the same number of intervals; got "
                         f"{[len(p) for p in per_stage]}")
    t0, t1 = min(i.start_ns for i in intervals), max(i.end_ns for i in intervals)
    span = max(t1 - t0, 1)
    busy = [sum(i.end_ns - i.start_ns for i in p) for p in per_stage]
    return {"span_ms": span / 1e6, "busy_ms": [b / 1e6 for b in busy], "idle": [1 - b / span for b in busy],
            "micro": counts.pop()}


def textbook_idle(num_micro: int, num_stages: int) -> float:
    """(N - 1) / (M + N - 1): the idle share of every stage for M equal micro-batches over N stages (GPipe)."""
    return (num_stages - 1) / (num_micro + num_stages - 1)
