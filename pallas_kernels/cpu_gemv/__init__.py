"""Native CPU matmul kernels for decode shapes (at most `MAX_ROWS` activation rows), called through `jax.ffi`.

XLA:CPU reads a weight at a fraction of the memory bandwidth when only one or a few activation rows multiply it
(a 1-row bf16 dot streams ~2 GB/s; weight-only int8 first writes a full-precision copy of the weight), and decode is
exactly that shape. These kernels (`gemv.cc`, AVX2 + FMA; 512-bit integer variants with AVX-512 VNNI; AMX tile
variants for bf16 and int8 weights from 4-6 rows where the CPU has AMX, `amx.h`) stream the
weight once, keep the outputs in registers and split the work over persistent worker threads (`threads.h`).
`float_matmuls`, `weight_only_matmuls` and `i8i8_matmuls` run several weights that share their activations (q, k
and v; gate and up) as one call. `models.quant_matmul.qeinsum` routes a matmul here when `active()` and the shapes
fit, up to `row_limit(kind)` activation rows; everything else stays on XLA.

| function        | weight                                     | activations                        | result       |
|-----------------|--------------------------------------------|------------------------------------|--------------|
| `float_matmul`  | bf16 or f32, [K, N] or [N, K]              | f32 / bf16                         | f32          |
| `int8_matmul`   | int8 [N, K], f32 scale [N, G]              | rounded here to int16 per row      | f32          |
| `i8i8_matmul`   | int8 [N, K]                                | int8 (w8a8, quantized by caller)   | int32, exact |
| `int4_matmul`   | packed int4 [N, K / 2] (`models.quant4`'s  | rounded here to int16 per row      | f32          |
|                 | order), f32 scale [N, G], optional f32 min |                                    |              |
| `weight_only_matmuls(..., int8_activations=True)` | symmetric int4, groups of 32 | int8 per block of 32 (w4a8) | f32 |

Environment (`pallas_kernels.cpu_features`; read when a matmul is traced, validated by `check_environment`): `JAXINFER_NATIVE_KERNELS=0` turns the
kernels off (XLA everywhere); `JAXINFER_NATIVE_ISA=avx2` (or `avx512_vnni`, `amx`) picks an ISA level (default: the highest this CPU runs;
`build.ISA_LEVELS`); `JAXINFER_NATIVE_THREADS=N` (a positive integer) caps the threads per call (default: the
CPUs this process may use; read once per process). The library is compiled at first use (`build`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_features import check_environment, isa_level  # noqa: F401 (re-exported)
from pallas_kernels.cpu_gemv import build

MAX_ROWS = 32  # the most activation rows a kernel takes; `row_limit` gives each kind's, where it beats XLA's dot
# Per kind and ISA level, the activation rows up to which SmolLM2's decode step ran faster with the kernels than
# with XLA's dots (BENCHMARKS.md, "Decode past 8 rows"); 8 where nothing more was measured faster. XLA converts a
# weight-only int8 / int4 weight in full every step, so those kernels win far past 8 rows; bf16 and w8a8 gain
# from AMX tiles (16 rows a tile op) and w8a8 from VNNI's 512-bit dots.
_ROW_LIMITS = {"int4": {"avx2": 32, "avx512_vnni": 32, "amx": 32},
               "int8": {"avx2": 16, "avx512_vnni": 32, "amx": 32},
               "w8a8": {"avx512_vnni": 16, "amx": 16},
               "bf16": {"amx": 16},
               "f32": {}}
_native_allowed = contextvars.ContextVar("native_kernels", default=True)


@contextlib.contextmanager
def native_kernels(allowed: bool) -> Iterator[None]:
    """Allows (the default) or forbids the native kernels (matmuls and attention) for what is traced inside the
    block (`models.quant_matmul.native_unless_sharded` forbids them on a multi-device mesh)."""
    token = _native_allowed.set(allowed)
    try:
        yield
    finally:
        _native_allowed.reset(token)


def native_allowed() -> bool:
    """Whether code traced now may call the native kernels (`native_kernels`; `active` tells if they run here)."""
    return _native_allowed.get()


def active() -> bool:
    """Whether matmuls traced now may use the kernels: the default backend is CPU, they are not turned off, and
    the library for the ISA level is built and registered (built at the first call)."""
    if jax.default_backend() != "cpu":
        return False
    check_environment()
    level = isa_level()
    return level is not None and build.load(level)


def row_limit(kind: str, level: str | None = None) -> int:
    """The most activation rows for which a decode step runs kernel `kind` rather than XLA's dot, at ISA `level`
    (default: the level traced now, `isa_level`); 8 where nothing else was measured better.

    kind: "int8" (weight-only), "int4" (weight-only or w4a8), "w8a8", "bf16" (bf16 weights and activations) or
    "f32" (f32 weights or activations).

    Raises:
      ValueError: an unknown kind.
    """
    if kind not in _ROW_LIMITS:
        raise ValueError(f"unknown kernel kind {kind!r} (one of {sorted(_ROW_LIMITS)})")
    return _ROW_LIMITS[kind].get(isa_level() if level is None else level, 8)


def _call(kernel: str, out: jax.ShapeDtypeStruct | list[jax.ShapeDtypeStruct], *args: jax.Array, **attrs) -> jax.Array:
    level = isa_level()
    if level is None or not build.load(level):
        raise RuntimeError("the native CPU matmul kernels are not available (see `pallas_kernels.cpu_gemv.active`)")
    return jax.ffi.ffi_call(build.target_name(kernel, level), out, vmap_method="sequential")(*args, **attrs)


def _activations(x: jax.Array) -> jax.Array:
    """f32 and bf16 activations go to the kernels as they are (they convert bf16 themselves), other real floats as
    f32.

    Raises:
      ValueError: activations that are not real floating point.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"activations must be floating point, got {x.dtype}")
    return x if x.dtype in (jnp.float32, jnp.bfloat16) else x.astype(jnp.float32)


def _check_rows(x: jax.Array, k: int) -> tuple[int, int]:
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"activations must be [M, K] with 1 <= M <= {MAX_ROWS}, got shape {x.shape}")
    if x.shape[1] != k:
        raise ValueError(f"activations have K={x.shape[1]}, the weight {k}")
    return x.shape


def _stacked(layer: jax.Array | int | None, *arrays: jax.Array | None) -> tuple[jax.Array, list]:
    """(int32 [1] layer index, the arrays as [L, ...]): one layer's 2-D arrays get L = 1 and index 0; with a
    `layer`, the arrays are a scanned model's stacks [L, ...] and the kernel reads layer `layer` in place (an index
    outside [0, L) is clamped, as XLA clamps a dynamic slice).

    Raises:
      ValueError: `layer` not an integer scalar (or a Python int outside int32), or stacks of different L.
    """
    if layer is None:
        return jnp.zeros((1,), jnp.int32), [None if a is None else a[None] for a in arrays]
    if isinstance(layer, int) and not -2**31 <= layer < 2**31:
        raise ValueError(f"layer={layer} is outside int32")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{list(jnp.shape(layer))}")
    if len({a.shape[0] for a in arrays if a is not None}) > 1:
        raise ValueError(f"stacked arrays of different layer counts: {[a.shape for a in arrays if a is not None]}")
    return jnp.asarray(layer, jnp.int32).reshape(1), list(arrays)


def _check_stack(name: str, a: jax.Array, layer) -> None:
    if a.ndim != (2 if layer is None else 3):
        raise ValueError(f"{name} must be {'2-D' if layer is None else '[L, ...] (3-D) with a layer index'}, got "
                         f"shape {a.shape}")


def float_matmuls(x: jax.Array, ws: Sequence[jax.Array], *, input_major: bool,
                  layer: jax.Array | int | None = None) -> list[jax.Array]:
    """x @ w (input_major: w [K, N_i]) or x @ w.T (w [N_i, K]) for each bf16 or f32 weight w, f32 accumulation, in
    one kernel call (weights that share their activations: q, k and v; gate and up). Each product equals
    `float_matmul`'s bit for bit.

    Args:
      x: f32 or bf16 [M, K], M <= MAX_ROWS.
      ws: bf16 or f32 weights, [K, N_i] if `input_major` (K a multiple of 4) else [N_i, K] (K a multiple of 8);
        with `layer`, stacks [L, K, N_i] / [L, N_i, K] of which layer `layer` is read (no slice is copied).
      input_major: the weights' layout.
      layer: int32 scalar (may be traced), or None.

    Returns:
      f32 [M, N_i] for each weight, in order.

    Raises:
      ValueError: no weight, wrong ranks, dtypes or sizes.
    """
    if not ws:
        raise ValueError("float_matmuls needs at least one weight")
    shapes = []
    for w in ws:
        _check_stack("weight", w, layer)
        if w.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"weight must be bf16 or f32, got {w.dtype}")
        k, n = w.shape[-2:] if input_major else w.shape[-2:][::-1]
        m, _ = _check_rows(x, k)
        if k % (4 if input_major else 8):
            raise ValueError(f"K={k} must be a multiple of {4 if input_major else 8} for a "
                             f"{'[K, N]' if input_major else '[N, K]'} weight")
        shapes.append((m, n))
    index, ws = _stacked(layer, *ws)
    return list(_call("float_matmul", [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], _activations(x),
                      index, *ws, kn=bool(input_major)))


def float_matmul(x: jax.Array, w: jax.Array, *, input_major: bool, layer: jax.Array | int | None = None
                 ) -> jax.Array:
    """x @ w (input_major: w [K, N]) or x @ w.T (w [N, K]) for a bf16 or f32 weight, f32 accumulation:
    `float_matmuls` of one weight.

    Args:
      x: f32 or bf16 [M, K], M <= MAX_ROWS.
      w: bf16 or f32, [K, N] if `input_major` (K a multiple of 4) else [N, K] (K a multiple of 8); with `layer`,
        a stack [L, K, N] / [L, N, K] of which layer `layer` is read (no slice is copied).
      layer: int32 scalar (may be traced), or None.

    Returns:
      f32 [M, N].

    Raises:
      ValueError: wrong ranks, dtypes or sizes.
    """
    return float_matmuls(x, [w], input_major=input_major, layer=layer)[0]


def _check_scales(n: int, k: int, values: jax.Array, scale: jax.Array, min: jax.Array | None, multiple: int,
                  what: str) -> int:
    groups = scale.shape[-1]
    if (scale.dtype != jnp.float32 or scale.shape[-2:] != (n, groups) or scale.ndim != values.ndim or k % groups
            or (k // groups) % multiple or (min is not None and (min.shape != scale.shape or min.dtype != jnp.float32))):
        raise ValueError(f"{what} with f32 scale (and min) [N, G], K / G a multiple of {multiple}; got "
                         f"{values.dtype}{list(values.shape)}, scale {scale.dtype}{list(scale.shape)}")
    return groups


def weight_only_matmuls(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array, jax.Array | None]], *,
                        layer: jax.Array | int | None = None, int8_activations: bool = False) -> list[jax.Array]:
    """Several int8 weight-only or several packed int4 weights times the same activation rows, in one kernel call:
    the rows are rounded to int16 once and every weight's rows go to the threads as one job (a decode layer's
    q, k and v, or gate and up). Each product is `int8_matmul`'s or `int4_matmul`'s, bit for bit.

    With `int8_activations` (w4a8; symmetric int4 with one scale a 32-input block only), each row is instead
    quantized per block of 32 inputs to int8 as `models.quant.quantize_rows` does (scale amax / 127, x / scale
    rounded to nearest even) and each block's exact int32 dot with the codes minus 8 is scaled by both blocks'
    scales into the f32 sum: GGUF Q4_0 x Q8_0, llama.cpp's CPU arithmetic (its `ggml_vec_dot_q4_0_q8_0`).

    Args:
      x: f32 or bf16 [M, K], M <= MAX_ROWS.
      weights: (values, scale, min) per weight, all int8 (`int8_matmul`'s arguments; min None) or all int4
        (`int4_matmul`'s; min None for all of them or given for all, then with the same group count).
      layer: as `float_matmul`; every weight is a stack of the same L with it.
      int8_activations: w4a8, as above.

    Returns:
      f32 [M, N_i] for each weight, in order.

    Raises:
      ValueError: an empty list, mixed formats or wrong dtypes and sizes; `int8_activations` for other weights
        than symmetric int4 with groups of 32.
    """
    if not weights:
        raise ValueError("weight_only_matmuls needs at least one weight")
    bits = {8 if values.dtype == jnp.int8 else 4 for values, _, _ in weights}
    with_min = {m is not None for _, _, m in weights}
    if len(bits) > 1 or len(with_min) > 1:
        raise ValueError("weight_only_matmuls takes weights of one format (all int8, all symmetric int4 or all int4 "
                         f"with a min), got {[(v.dtype, m is not None) for v, _, m in weights]}")
    operands, shapes = [], []
    for values, scale, min in weights:
        _check_stack("values", values, layer)
        n, k = values.shape[-2:]
        if bits == {4}:
            k *= 2
            if values.dtype != jnp.uint8 or k % 64:
                raise ValueError(f"packed int4 uint8 [N, K / 2] with K a multiple of 64; got {values.dtype}"
                                 f"{list(values.shape)}")
            groups = _check_scales(n, k, values, scale, min, 32, "packed int4 [N, K / 2]")
        else:
            _check_scales(n, k, values, scale, None, 16, "int8 weight [N, K]")
            groups = scale.shape[-1]
        m, _ = _check_rows(x, k)
        shapes.append((n, groups))
        operands += [values, scale, scale if min is None else min]
    if with_min == {True} and len({g for _, g in shapes}) > 1:
        raise ValueError(f"int4 weights with a min must have the same group count, got {[g for _, g in shapes]}")
    if int8_activations and (bits != {4} or with_min == {True} or any(32 * g != k for _, g in shapes)):
        raise ValueError("int8 activations (w4a8) need symmetric int4 weights with one scale a 32-input block")
    index, operands = _stacked(layer, *operands)
    return list(_call("weight_only_matmul", [jax.ShapeDtypeStruct((m, n), jnp.float32) for n, _ in shapes],
                      _activations(x), index, *operands, bits=np.int32(bits.pop()), symmetric=with_min == {False},
                      int8_activations=bool(int8_activations)))


def int8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, layer: jax.Array | int | None = None
                ) -> jax.Array:
    """Weight-only int8: x @ (values * scale).T with the weight's groups of K / G inputs each scaled.

    The kernel rounds each activation row to int16 (absmax / 32767, nearest even: at most 1 / 65534 of the row's
    largest input per element, finer than bf16) and multiplies it exactly with the int8 values (vpmaddwd), so the
    result differs from the float product by that rounding alone.

    Args:
      x: f32 or bf16 [M, K], M <= MAX_ROWS.
      values: int8 [N, K] ([L, N, K] with `layer`).
      scale: f32 [N, G] ([L, N, G]), G = 1 (per output channel) or K / group with group a multiple of 16.
      layer: as `float_matmul`.

    Returns:
      f32 [M, N].

    Raises:
      ValueError: wrong dtypes or sizes.
    """
    if values.dtype != jnp.int8:
        raise ValueError(f"int8 values expected, got {values.dtype}")
    return weight_only_matmuls(x, [(values, scale, None)], layer=layer)[0]


def i8i8_matmuls(xq: jax.Array, values: Sequence[jax.Array], *, layer: jax.Array | int | None = None
                 ) -> list[jax.Array]:
    """Exact int8 x int8 -> int32 products xq @ v.T for each weight v (w8a8; both in [-127, 127]), in one kernel
    call (weights that share their activations: q, k and v; gate and up).

    Args:
      xq: int8 [M, K], M <= MAX_ROWS, K a multiple of 32.
      values: int8 [N_i, K] each ([L, N_i, K] with `layer`).
      layer: as `float_matmul`.

    Returns:
      int32 [M, N_i] for each weight, in order.

    Raises:
      ValueError: no weight, wrong dtypes or sizes.
    """
    if not values:
        raise ValueError("i8i8_matmuls needs at least one weight")
    shapes = []
    for v in values:
        _check_stack("values", v, layer)
        n, k = v.shape[-2:]
        m, _ = _check_rows(xq, k)
        if xq.dtype != jnp.int8 or v.dtype != jnp.int8 or k % 32:
            raise ValueError(f"int8 activations and weights with K a multiple of 32; got {xq.dtype}, {v.dtype}, "
                             f"K={k}")
        shapes.append((m, n))
    index, values = _stacked(layer, *values)
    return list(_call("i8i8_matmul", [jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes], xq, index, *values))


def i8i8_matmul(xq: jax.Array, values: jax.Array, *, layer: jax.Array | int | None = None) -> jax.Array:
    """Exact int8 x int8 -> int32 products: xq @ values.T (w8a8; both in [-127, 127]); `i8i8_matmuls` of one weight.

    Args:
      xq: int8 [M, K], M <= MAX_ROWS, K a multiple of 32.
      values: int8 [N, K] ([L, N, K] with `layer`).
      layer: as `float_matmul`.

    Returns:
      int32 [M, N].

    Raises:
      ValueError: wrong dtypes or sizes.
    """
    return i8i8_matmuls(xq, [values], layer=layer)[0]


def int4_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, min: jax.Array | None = None, *,
                layer: jax.Array | int | None = None) -> jax.Array:
    """Packed int4 weight times activations rounded (in the kernel) to int16 per row, as `int8_matmul`.

    The weight is `models.quant4`'s: uint8 [N, K / 2], input 2j in the low nibble of byte j and 2j + 1 in the
    high one; w = scale * (q - 8) (symmetric) or scale * q + min per group of K / G inputs. The codes multiply the
    int16 activations exactly (vpmaddwd at the avx2 level; at avx512_vnni each activation split into its high and
    low byte, vpdpbusd) and the -8 offset or the min multiplies the rounded rows' group sums, so
    the result differs from the float weight-only product only by the activations' rounding (at most 1 / 65534 of
    the row's largest input each).

    Args:
      x: f32 or bf16 [M, K], M <= MAX_ROWS, K a multiple of 64.
      values: uint8 [N, K / 2] ([L, N, K / 2] with `layer`).
      scale: f32 [N, G] ([L, N, G]), K / G a multiple of 32.
      min: f32, scale's shape, or None.
      layer: as `float_matmul`.

    Returns:
      f32 [M, N].

    Raises:
      ValueError: wrong dtypes or sizes.
    """
    if values.dtype != jnp.uint8:
        raise ValueError(f"packed int4 uint8 [N, K / 2] expected, got {values.dtype}{list(values.shape)}")
    return weight_only_matmuls(x, [(values, scale, min)], layer=layer)[0]
