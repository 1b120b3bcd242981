"""Drives an Engine-shaped server through a traffic profile on a clock, and stops a run as soon as a latency
target is certainly missed.

1. Requests are added (`add_request(prompt ids, params)`) when their arrival time has come on the `Clock`; an
   idle server sleeps until the next arrival. Every request is greedy with `ignore_eos` and `max_tokens` = its
   output length, so it produces exactly that many tokens.
2. `step()` runs until every request finished. A request's first token and finish time are the clock's time when
   the step that produced them returned; TTFT = first token - arrival, TPOT = (finish - first token) / (output
   tokens - 1), p50 / p99 over requests (numpy's linear percentile), as the serving benchmark defines them
   (`jaxinfer.benchmarks.serving_driver`).
3. After every step the run checks the targets (`Targets`). A p99 over N values is at least the
   (N - k)-th largest, k = floor(0.99 (N - 1)); so once N - k requests have certainly missed a target, the p99
   misses it whatever the rest do, and the run stops (pruned). A request certainly misses the TTFT target when
   it has waited longer than the target without a token, and the TPOT target when (now - first token) /
   (output - 1), a lower bound of its TPOT, is over it.

The clock is injected: `WallClock` for a real engine, `VirtualClock` for a simulation whose steps advance it
(`jaxinfer.tune.simulate`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Protocol

from jaxinfer.benchmarks.serving_driver import percentile
from jaxinfer.benchmarks.serving_scenarios import Request
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams

QUANTILE = 99.0  # the targets' percentile


class Clock(Protocol):
    """Seconds: `now()` reads the clock, `sleep(s)` waits (a virtual clock just moves on)."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """`time.perf_counter` and `time.sleep`."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))


class VirtualClock:
    """A clock that moves only when told: `sleep(s)` and `advance(s)` add s seconds (negative s: no move)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)

    advance = sleep


class Server(Protocol):
    """What the driver needs of `jaxinfer.engine.engine.Engine` (which is one)."""

    def add_request(self, prompt: list[int], params: SamplingParams) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Targets:
    """Latency targets: p99 TTFT and p99 TPOT at most these many seconds (None: no target)."""

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "tpot_p99_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0, or None")

    def met(self, ttft_p99_s: float, tpot_p99_s: float) -> bool:
        """Both targets hold (a NaN p99, from no values, meets any target)."""
        return not ((self.ttft_p99_s is not None and ttft_p99_s > self.ttft_p99_s)
                    or (self.tpot_p99_s is not None and tpot_p99_s > self.tpot_p99_s))


def misses_to_fail(n: int, q: float = QUANTILE) -> int:
    """How many of n values over a target make their q-th percentile (linear) miss it for sure: n - floor(q/100 *
    (n - 1)), so that the sorted value the percentile starts from is itself over the target."""
    return n - math.floor(q / 100 * (n - 1))


@dataclasses.dataclass
class Measurement:
    """One run of a profile.

    Attributes:
      ttft_s: per request that got a token, seconds.
      tpot_s: per finished request with more than one token, seconds.
      output_tokens: tokens produced (finished and unfinished requests).
      wall_s: first arrival to the last finish (or to the stop), seconds.
      num_finished: requests finished.
      stopped: why the run stopped before every request finished ("p99 TTFT > 2 s: ..."), else None.
      pruned: it stopped because a target was certainly missed (not for the time limit).
    """

    ttft_s: list[float]
    tpot_s: list[float]
    output_tokens: int
    wall_s: float
    num_finished: int
    stopped: str | None = None
    pruned: bool = False

    def summary(self) -> dict[str, float]:
        """output_tok_s (tokens / s), ttft_p50_s, ttft_p99_s, tpot_p50_s, tpot_p99_s (s; NaN without values)."""
        return {"output_tok_s": self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan"),
                "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p99_s": percentile(self.ttft_s, QUANTILE),
                "tpot_p50_s": percentile(self.tpot_s, 50), "tpot_p99_s": percentile(self.tpot_s, QUANTILE)}


def _certain_misses(targets: Targets, now: float, reqs: Sequence[Request], arrived: int, first: dict[int, float],
                    finish: dict[int, float]) -> tuple[int, int]:
    """(requests certainly over the TTFT target, over the TPOT target) at time `now` (see the module docstring)."""
    ttft = tpot = 0
    if targets.ttft_p99_s is not None:
        limit = targets.ttft_p99_s
        ttft = sum((first[i] if i in first else now) - reqs[i].arrival_s > limit for i in range(arrived))
    if targets.tpot_p99_s is not None:
        limit = targets.tpot_p99_s
        tpot = sum((finish.get(i, now) - t) / (reqs[i].output_len - 1) > limit
                   for i, t in first.items() if reqs[i].output_len > 1)
    return ttft, tpot


def drive(server: Server, requests: Sequence[Request], clock: Clock, targets: Targets = Targets(),
          max_run_s: float = math.inf) -> Measurement:
    """Runs the requests through `server` at their arrival times (module docstring).

    Args:
      server: an `Engine` or anything shaped like one (`Server`), idle.
      requests: arrival offsets (s, ascending), prompt ids and output lengths.
      clock: the clock arrivals and latencies are measured on.
      targets: stop as soon as one is certainly missed.
      max_run_s: stop after this many seconds on the clock.

    Returns:
      The measurement; `stopped` says why when the run stopped early.

    Raises:
      ValueError: no requests, or arrivals out of order.
    """
    if not requests:
        raise ValueError("drive: no requests")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:])):
        raise ValueError("drive: requests must be in arrival order")
    n = len(requests)
    need = misses_to_fail(n)
    ids: dict[str, int] = {}
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    produced: dict[int, int] = {}
    arrived = 0
    stopped = None
    pruned = False
    t0 = clock.now()
    now = 0.0
    while arrived < n or server.has_unfinished_requests():
        now = clock.now() - t0
        while arrived < n and requests[arrived].arrival_s <= now:
            r = requests[arrived]
            ids[server.add_request(list(r.prompt), SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                                  ignore_eos=True))] = arrived
            arrived += 1
        if not server.has_unfinished_requests():
            clock.sleep(requests[arrived].arrival_s - now)
            continue
        outputs = server.step()
        now = clock.now() - t0
        for out in outputs:
            i = ids[out.request_id]
            produced[i] = len(out.outputs[0].token_ids)
            if produced[i] and i not in first:
                first[i] = now
            if out.finished:
                finish[i] = now
        ttft_misses, tpot_misses = _certain_misses(targets, now, requests, arrived, first, finish)
        if ttft_misses >= need:
            stopped = f"p99 TTFT > {targets.ttft_p99_s:g} s: {ttft_misses} of {n} requests over it"
        elif tpot_misses >= need:
            stopped = f"p99 TPOT > {targets.tpot_p99_s:g} s: {tpot_misses} of {n} requests over it"
        pruned = stopped is not None
        if not pruned and now > max_run_s:
            stopped = f"ran past the {max_run_s:g} s limit"
        if stopped:
            break
    ttft = [first[i] - requests[i].arrival_s for i in sorted(first)]
    tpot = [(finish[i] - first[i]) / (produced[i] - 1) for i in sorted(finish) if produced[i] > 1]
    end = max(finish.values()) if stopped is None else now
    return Measurement(ttft_s=ttft, tpot_s=tpot, output_tokens=sum(produced.values()), wall_s=end,
                       num_finished=len(finish), stopped=stopped, pruned=pruned)
