"""Kernel micro-benchmark of `jaxinfer bench quant --gemv`: streaming GB/s of one native matmul call
(`pallas_kernels.cpu_gemv`) over one large weight, beside XLA's dot on the same weight and the roofline probe.

For each weight kind a weight of `mib` MiB of values (K = 4096 inputs, N outputs to fill it; random values,
positive scales) is made once; then, for each row count, the jitted call of the native kernel and the jitted
`models.quant_matmul.qeinsum` of the same activations and weight with the native kernels forbidden (XLA's dot, as
the engine runs it without them) are each timed (`--gemv-reps` calls after one warm-up, median; 2 where the warm-up took over `SLOW_S`). GB/s = bytes of the
weight's values + scales / median seconds, 1e9 bytes per second.

| kind              | weight                                        | native call                        |
|-------------------|-----------------------------------------------|------------------------------------|
| bf16              | bf16 [K, N] (the model's input-major layout)  | `float_matmul(input_major=True)`   |
| int8 weight-only  | int8 [N, K], f32 scale per output channel     | `int8_matmul`                      |
| int8 (w8a8)       | int8 [N, K], activations int8 per row         | `i8i8_matmul` (activations quantized outside the timed call) |
| int4 g32          | packed int4 [N, K / 2], f32 scale per 32      | `int4_matmul` (activations quantized to int8 per 32 inside) |
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.benchmarks.probe import median, time_calls
from models import quant_matmul
from models.quant import QuantizedWeight, quantize_rows
from pallas_kernels import cpu_gemv

logger = logging.getLogger(__name__)

KINDS = ("bf16", "int8 weight-only", "int8 (w8a8)", "int4 g32")
K = 4096  # inputs of every micro-benchmark weight (a multiple of the kernels' 64)
SLOW_S = 0.5  # a warm-up call slower than this gets at most 2 timed calls
EQ = "mk,kn->mn"  # the weight in its own (unquantized) layout [K, N], as the model's projections contract it


def make_weight(kind: str, mib: float, seed: int = 0) -> jax.Array | QuantizedWeight:
    """A random weight of `kind` (`KINDS`) whose values take `mib` MiB, in its unquantized layout [K, N].

    Returns:
      bf16 [K, N], or a `QuantizedWeight` with values int8 [N, K] (int8 kinds) or uint8 [N, K / 2] (int4 g32)
      and f32 scales in [0.5, 1) / 64.

    Raises:
      ValueError: an unknown kind, or `mib` too small for 8 output channels.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown micro-benchmark weight {kind!r}; known: {', '.join(KINDS)}")
    bytes_per_row = {"bf16": 2 * K, "int4 g32": K // 2}.get(kind, K)
    n = int(mib * 2**20) // bytes_per_row // 8 * 8
    if n < 8:
        raise ValueError(f"--gemv-mib {mib} holds fewer than 8 output channels of {K} inputs")
    rng = np.random.default_rng(seed)
    if kind == "bf16":
        return (jnp.asarray(rng.integers(-127, 128, (K, n), dtype=np.int8)).astype(jnp.bfloat16)
                * jnp.bfloat16(1 / 64))
    groups = K // 32 if kind == "int4 g32" else 1
    scale = jnp.asarray(rng.uniform(0.5, 1.0, (n, groups)).astype(np.float32) / 64)
    if kind == "int4 g32":
        values = jnp.asarray(rng.integers(0, 256, (n, K // 2), dtype=np.uint8))
        return QuantizedWeight(values, scale, contract_axes=(-2,), group_size=32)
    values = jnp.asarray(rng.integers(-127, 128, (n, K), dtype=np.int8))
    return QuantizedWeight(values, scale, contract_axes=(-2,), quantize_activations=kind == "int8 (w8a8)")


def weight_bytes(w: jax.Array | QuantizedWeight) -> int:
    """Bytes a matmul reads of the weight: values and scales (and an int4 min)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(w))


def native_call(kind: str, w: jax.Array | QuantizedWeight, x: jax.Array):
    """(the jitted native kernel call, its argument) for activations `x` bf16 [M, K]: `x` itself, or for w8a8
    its int8 rows (`models.quant.quantize_rows`, as `qeinsum` quantizes them)."""
    if kind == "bf16":
        return jax.jit(lambda x, w: cpu_gemv.float_matmul(x, w, input_major=True)), x
    if kind == "int8 weight-only":
        return jax.jit(lambda x, w: cpu_gemv.int8_matmul(x, w.values, w.scale)), x
    if kind == "int8 (w8a8)":
        return jax.jit(lambda xq, w: cpu_gemv.i8i8_matmul(xq, w.values)), quantize_rows(x, [1], "int8")[0]
    return jax.jit(lambda x, w: cpu_gemv.int4_matmul(x, w.values, w.scale)), x


def xla_call(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """XLA's product as the engine runs it with the native kernels off: `qeinsum(EQ, x, w)`, f32 [M, N]."""
    with quant_matmul.native_matmuls(False):
        return quant_matmul.qeinsum(EQ, x, w, preferred_element_type=jnp.float32)


def _seconds(fn, x, w, reps: int) -> float:
    """Median seconds of `fn(x, w)` over `reps` calls after a warm-up; 2 calls where the warm-up took over
    `SLOW_S` (XLA's int4 and weight-only int8 dots dequantize the whole weight first: seconds per call)."""
    t0 = time.perf_counter()
    fn(x, w).block_until_ready()
    slow = time.perf_counter() - t0 > SLOW_S
    return median(time_calls(lambda: fn(x, w).block_until_ready(), min(reps, 2) if slow else reps, warmup=0))


def measure(kinds: list[str], rows: list[int], mib: float, reps: int) -> list[dict]:
    """Times the native call and XLA's dot per weight kind and row count.

    Args:
      kinds: of `KINDS`.
      rows: activation rows per call, each in [1, `cpu_gemv.MAX_ROWS`].
      mib: MiB of each weight's values.
      reps: timed calls of each (median), after one warm-up call (which compiles).

    Returns:
      One dict per (kind, rows): "kind", "rows", "n", "k", "bytes" (values + scales), "native_ms" / "native_gb_s"
      (None when `cpu_gemv.active()` is false), "xla_ms", "xla_gb_s".
    """
    native = cpu_gemv.active()
    xla = jax.jit(xla_call)
    out = []
    for kind in kinds:
        w = make_weight(kind, mib)
        nbytes = weight_bytes(w)
        for m in rows:
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, K)), jnp.bfloat16)
            row = {"kind": kind, "rows": m, "n": int(w.shape[1]) if kind == "bf16" else int(w.values.shape[0]),
                   "k": K, "bytes": nbytes, "native_ms": None, "native_gb_s": None}
            if native:
                fn, arg = native_call(kind, w, x)
                secs = _seconds(fn, arg, w, reps)
                row.update(native_ms=1e3 * secs, native_gb_s=nbytes / secs / 1e9)
            secs = _seconds(xla, x, w, reps)
            row.update(xla_ms=1e3 * secs, xla_gb_s=nbytes / secs / 1e9)
            logger.info("gemv %s, %d rows: native %s GB/s, XLA %.1f GB/s", kind, m,
                        "-" if row["native_gb_s"] is None else f"{row['native_gb_s']:.1f}", row["xla_gb_s"])
            out.append(row)
        del w
    return out
