"""The bandwidth probe every roofline divides by, other probes reported beside it, and timing helpers.

The roofline probe (`ROOFLINE_PROBE`) is a jitted f32 sum over >= 1 GiB, run on all of the machine's cores (both
of this machine kind's 2), measured in the same run as the numbers it is compared with: bandwidth drifts by
+-15% from run to run (`../shared/JAX_ON_CPU.md`), so a roofline from another run means little.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

ROOFLINE_PROBE = "sum"  # the key of `measure_bandwidth`'s result that rooflines use


def median(xs: list[float]) -> float:
    """The median of a non-empty list, as a float."""
    return float(statistics.median(xs))


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `reps` calls of `fn` (which must block until its result is ready), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_bandwidth(gib: float = 1.0, reps: int = 7, others: bool = True) -> dict[str, dict]:
    """Memory read bandwidth: the roofline probe and, with `others`, 2-row f32 matrix-vector products.

    Args:
      gib: GiB each probe reads (>= 1 for the roofline; smaller only in smoke tests).
      reps: timed calls per probe (median).
      others: also time `x @ W` and `W @ x^T` with 2 rows over a `gib` GiB matrix (XLA:CPU runs the two
        orientations at different speeds; they are reported, never used as the roofline).

    Returns:
      {key: {"label", "bytes", "ms", "gb_s", "threads"}}; `ROOFLINE_PROBE` ("sum") is always there. GB/s are
      1e9 bytes per second.
    """
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 4
    threads = os.cpu_count() or 1
    results = {}
    x = jnp.ones((n,), jnp.float32) * 1.5
    x.block_until_ready()
    total = jax.jit(jnp.sum)
    secs = median(time_calls(lambda: total(x).block_until_ready(), reps))
    results[ROOFLINE_PROBE] = {"label": f"jitted f32 sum over {x.nbytes / 2**30:.2f} GiB, {threads} threads",
                               "bytes": int(x.nbytes), "ms": 1e3 * secs, "gb_s": x.nbytes / secs / 1e9,
                               "threads": threads}
    del x
    if others:
        cols = 16384
        rows = max(n // cols, 1)
        w = jnp.ones((rows, cols), jnp.float32) * 0.5
        w.block_until_ready()
        for key, label, fn, vec in (
                ("matvec", f"2-row f32 matrix-vector x @ W, [2, {rows}] x [{rows}, {cols}]", lambda v, w: v @ w,
                 jnp.ones((2, rows), jnp.float32)),
                ("matvec_t", f"2-row f32 matrix-vector W @ x^T, [{rows}, {cols}] x [{cols}, 2]",
                 lambda v, w: w @ v.T, jnp.ones((2, cols), jnp.float32))):
            fn = jax.jit(fn)
            secs = median(time_calls(lambda: fn(vec, w).block_until_ready(), reps))
            results[key] = {"label": label, "bytes": int(w.nbytes), "ms": 1e3 * secs,
                            "gb_s": w.nbytes / secs / 1e9, "threads": threads}
        del w
    for r in results.values():
        logger.info("bandwidth %s: %.1f GB/s", r["label"], r["gb_s"])
    return results


def roofline_gb_s(bandwidth: dict[str, dict]) -> float:
    """The bandwidth rooflines divide by (GB/s): the `ROOFLINE_PROBE` entry of `measure_bandwidth`'s result."""
    return bandwidth[ROOFLINE_PROBE]["gb_s"]
