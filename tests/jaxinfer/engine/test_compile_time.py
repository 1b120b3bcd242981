"""`CompileTimer`: the union of jax's compile spans, against a brute-force sum over the spans' breakpoints, and a real
compile seen once."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.compile_time import CompileTimer


def _covered_reference(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Sums the elementary segments between consecutive breakpoints that lie in [start, end] and in some span."""
    points = sorted({start, end, *(t for span in spans for t in span)})
    total = 0.0
    for a, b in zip(points, points[1:]):
        mid = (a + b) / 2
        if start <= mid <= end and any(lo <= mid <= hi for lo, hi in spans):
            total += b - a
    return total


span = st.tuples(st.integers(0, 40), st.integers(0, 10)).map(lambda t: (float(t[0]), float(t[0] + t[1])))


@settings(max_examples=30, deadline=None)
@given(st.lists(span, max_size=6), st.integers(-5, 45), st.integers(0, 50))
def test_seconds_is_the_union_of_the_spans_within_the_window(spans, start, length) -> None:
    timer = CompileTimer()
    timer.spans = list(spans)
    assert timer.seconds(start, start + length) == _covered_reference(spans, start, start + length)
    assert timer.seconds() == _covered_reference(spans, -1.0, 100.0)


def test_a_compile_is_timed_once_and_a_cached_call_not() -> None:
    x = jnp.arange(7.0)

    def f(v):
        return jnp.sin(v) * 3 + 1

    step = jax.jit(f)
    before = time.perf_counter()
    with CompileTimer() as timer:
        step(x).block_until_ready()
        first = timer.seconds()
        between = time.perf_counter()
        step(x).block_until_ready()  # the same shapes: no compile
    after = time.perf_counter()
    assert 0 < first <= between - before
    assert timer.seconds() == first and timer.seconds(between, after) == 0.0
    assert all(before - 0.05 <= lo <= hi <= between + 0.05 for lo, hi in timer.spans)  # the clocks agree
    step(jnp.arange(9.0)).block_until_ready()  # a new shape compiles, unseen
    assert timer.seconds() == first  # no longer listening


def test_compiles_on_other_threads_do_not_count() -> None:
    import threading

    step = jax.jit(lambda v: jnp.cos(v) - 2)
    with CompileTimer() as timer:
        worker = threading.Thread(target=lambda: step(jnp.arange(5.0)).block_until_ready())
        worker.start()
        worker.join()
        assert timer.seconds() == 0.0
        step(jnp.arange(6.0)).block_until_ready()
    assert timer.seconds() > 0
