"""`CompileTimer`: how much of a stretch of wall time jax spent compiling, from jax's own monitoring events.

jax records a time span (`jax.monitoring`, event names under `/jax/core/compile/`) for each tracing to a jaxpr,
each lowering to an MLIR module, and each XLA compile, which includes a persistent-cache lookup and, on a hit, the
load of the stored executable instead of the compile. Spans can nest (an inner function traced inside an outer
one), so the timer counts their union. Only the spans of the thread that entered the timer count: compiles that
thread waited for, not the ones a background warm-up (`jaxinfer.engine.warmup`) runs meanwhile.
"""

from __future__ import annotations

import threading
import time

COMPILE_EVENT_PREFIX = "/jax/core/compile/"


class CompileTimer:
    """Records jax's compile spans on the entering thread while active (a context manager); `seconds(start, end)`
    sums them.

    Times are `time.perf_counter()` seconds, the engine's clock (`RequestMetrics`); jax reports `time.time()`, which
    the timer shifts by the offset between the two clocks at `__enter__`.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # (start, end) in perf_counter seconds
        self._offset = 0.0
        self._thread: int | None = None

    def __enter__(self) -> CompileTimer:
        import jax.monitoring

        self._offset = time.perf_counter() - time.time()
        self._thread = threading.get_ident()
        jax.monitoring.register_event_time_span_listener(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_time_span_listener(self._record)

    def _record(self, event: str, start_time: float, end_time: float, **_: object) -> None:
        if event.startswith(COMPILE_EVENT_PREFIX) and threading.get_ident() == self._thread:
            self.spans.append((start_time + self._offset, end_time + self._offset))

    def seconds(self, start: float = float("-inf"), end: float = float("inf")) -> float:
        """Seconds of [start, end] (perf_counter seconds) covered by at least one compile span: the union, so nested
        spans count once. 0.0 when nothing compiled then."""
        total, reach = 0.0, start
        for lo, hi in sorted(self.spans):
            lo, hi = max(lo, reach), min(hi, end)
            if hi > lo:
                total += hi - lo
                reach = hi
        return total
