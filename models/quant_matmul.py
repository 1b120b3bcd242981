"""Matmuls and lookups that read weights plain or quantized (`models.quant.QuantizedWeight`), so the model code is
the same for every format.

Matmul paths (`qeinsum`):
- **dynamic activation quantization** (w8a8, `quantize_activations=True`): each token row of the activation is
  quantized to the weight's format with its own absmax scale, the dot runs natively in low precision
  (int8 x int8 -> int32, fp8 x fp8 -> f32 via `preferred_element_type`), and the two scales multiply the
  accumulator. Per output channel only. No full-precision copy of the weight exists at any point.
- **weight only**: the values (int4: unpacked codes times group scales, plus mins;
  `models.quant4`) are converted to the activation dtype inside the dot's computation. XLA:GPU and
  XLA:TPU fuse that convert into the matmul; XLA:CPU has no fused convert-dot and materializes one weight at a time
  as a temporary (XLA's memory analysis in BENCHMARKS.md shows the size).
- **native CPU kernels** (`pallas_kernels.cpu_gemv`): on the CPU backend, a matmul with at most
  `cpu_gemv.row_limit(kind)` activation rows (decode: 8 to 32 by weight kind and ISA level) and a weight the kernels read (bf16 / f32, int8 weight-only and
  w8a8, packed int4) runs through them instead of XLA's dot, which streams such shapes far below the memory
  bandwidth. bf16 / f32 and w8a8: the same results up to f32 summation order (w8a8: the same int32 sums); int8
  weight-only and int4 round the activation rows to int16 (1 / 65534 of a row's largest input at most) and
  multiply the codes exactly. `qeinsums` runs quantized weights that share their activations (q, k and v; gate
  and up) as one kernel call. `JAXINFER_NATIVE_KERNELS=0` turns them off; `native_matmuls(False)`
  does for what is traced inside it (`models.llama.forward` on a multi-device mesh: XLA partitions the dot, it
  cannot partition a custom call).
- **Pallas kernels on GPU / TPU** (`pallas_kernels.quant_matmul`, opt-in with `JAXINFER_PALLAS_QMATMUL=1` until
  measured on hardware): weight-only int8 and int4 at the same decode shapes, dequantizing inside the kernel.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models import quant4
from models.quant import QuantizedWeight, quantize_rows
from pallas_kernels import cpu_gemv, quant_matmul

native_matmuls = cpu_gemv.native_kernels  # allows or forbids the native kernels (matmuls and paged attention)


def native_unless_sharded(fn: Callable) -> Callable:
    """Decorates a function with a keyword `mesh`: its matmuls and attention may use the native kernels only
    without a mesh of more than one device."""
    @functools.wraps(fn)
    def wrapper(*args, mesh: jax.sharding.Mesh | None = None, **kwargs):
        with native_matmuls(cpu_gemv.native_allowed() and (mesh is None or mesh.size == 1)):
            return fn(*args, mesh=mesh, **kwargs)
    return wrapper


def _f32_output_is_faster(x: jax.Array, w: jax.Array) -> bool:
    """Whether a bf16 x bf16 dot should write f32 and round afterwards (XLA:CPU only).

    XLA:CPU's bf16 dot accumulates in f32 either way, so the results are bit-identical, but asking for the f32
    output runs a faster kernel: a 512-token bf16 prefill of SmolLM2 took 0.88x the time on an Intel Xeon with AMX
    (BENCHMARKS.md, issue 18). GPU and TPU keep the plain bf16 dot.
    """
    return x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _parse(eq: str) -> tuple[str, str, str]:
    inputs, out = eq.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def _to_layout(x: jax.Array, labels: str, out: str) -> jax.Array:
    """Reorders `x` (axes named by `labels`, all of which appear in `out`) to broadcast against an `out` array."""
    present = [c for c in out if c in labels]
    x = jnp.transpose(x, [labels.index(c) for c in present])
    return x.reshape([x.shape[present.index(c)] if c in present else 1 for c in out])


def qeinsum(eq: str, x: jax.Array, w: jax.Array | QuantizedWeight, *,
            preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """`jnp.einsum(eq, x, w)` for a plain or quantized weight `w` (two operands, activation first).

    Args:
      eq: an einsum "lhs,rhs->out" with `rhs` naming `w`'s axes in its own (unquantized) layout; the quantized
        weight's contract axes must be summed over (in lhs, not in out).
      x: activations, f32 or bf16.
      w: a plain array (then this is `jnp.einsum`) or a `QuantizedWeight`.
      preferred_element_type: output dtype (default x's dtype).

    Returns:
      The einsum's result in `preferred_element_type` or x's dtype.

    Raises:
      ValueError: if the equation does not contract exactly the quantized weight's contract axes.
    """
    native = _native(eq, x, w)
    if native is not None:
        return native.astype(preferred_element_type or x.dtype)
    if isinstance(w, LayerRef):
        w = w.get()
    if not isinstance(w, QuantizedWeight):
        if preferred_element_type is None and _f32_output_is_faster(x, w):
            return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or x.dtype
    lhs, rhs, out = _parse(eq)
    if len(rhs) != w.ndim:
        raise ValueError(f"einsum {eq!r}: weight has {w.ndim} axes, equation names {len(rhs)}")
    contracted = "".join(rhs[a] for a in w.contract_axes)
    if any(c not in lhs or c in out for c in contracted):
        raise ValueError(f"einsum {eq!r} must contract the quantized weight's axes {contracted!r}")
    kept = "".join(c for c in rhs if c not in contracted)
    vals = kept + contracted  # the labels of w.values
    if w.format == "int4" and w.quantize_activations:  # w4a8: the codes minus 8 as int8 blocks of 32 inputs
        w = w.replace(values=quant4.unpack(w.values).astype(jnp.int8) - 8)
    if w.quantize_activations and w.group_size:  # mxfp8, w4a8 blocks: the weight's scales are applied per block
        return _activation_quantized(lhs, vals, out, contracted, x, w).astype(out_dtype)
    if w.group_size or w.format == "int4":  # grouped scales (int4: also its codes' offset or min) do not factor
        # out of the sum: dequantize inside the computation (int4: unpack, scale, cast to x's dtype, then the dot)
        return jnp.einsum(eq, x, w.dequantize(x.dtype), preferred_element_type=out_dtype).astype(out_dtype)
    w_scale = _to_layout(w.scale[..., 0], kept, out)
    if w.quantize_activations:
        return (_activation_quantized(lhs, vals, out, contracted, x, w) * w_scale).astype(out_dtype)
    y = jnp.einsum(f"{lhs},{vals}->{out}", x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w_scale).astype(out_dtype)


class LayerRef:
    """Layer `index` of a stacked [L, ...] weight (array or `QuantizedWeight`), not sliced: `qeinsum`'s native CPU
    kernels read that layer inside the stack, so a scanned model copies no weight; every other use takes `get()`,
    the slice. `models.llama.forward` passes the dense projections of its scanned layers this way on CPU."""

    def __init__(self, stacked: jax.Array | QuantizedWeight, index: jax.Array) -> None:
        self.stacked, self.index = stacked, index

    def get(self) -> jax.Array | QuantizedWeight:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stacked)


def slice_layer(layers, index: jax.Array, refs: Sequence[str] = ()):
    """Layer `index` of stacked layer weights (a pytree dataclass of [L, ...] leaves): the fields named in `refs` as
    `LayerRef`s, every other leaf sliced."""
    sliced = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False),
                          layers.replace(**{f: None for f in refs}))
    return sliced.replace(**{f: LayerRef(getattr(layers, f), index) for f in refs if getattr(layers, f) is not None})


def layer_refs_apply(rows: int) -> bool:
    """Whether `LayerRef`s pay off for a step of `rows` token rows traced now: the native CPU kernels may run its
    matmuls (else XLA's dots take a slice anyway, and the usual scan over sliced layers is as good)."""
    return (rows <= cpu_gemv.MAX_ROWS and cpu_gemv.native_allowed() and jax.default_backend() == "cpu"
            and cpu_gemv.active())


class _Plan(NamedTuple):
    """How `_native` runs one einsum: x as [M, K], the weight's one-layer shapes `w`, its layout ("kn" / "nk"),
    the `LayerRef` it reads (or None) and the einsum's output shape."""
    x: jax.Array
    w: jax.Array | QuantizedWeight
    layout: str
    k: int
    ref: LayerRef | None
    out_shape: tuple[int, ...]


def _plan(eq: str, x: jax.Array, w: jax.Array | QuantizedWeight | LayerRef) -> _Plan | None:
    """The einsum as a 2-D matmul for the native or Pallas kernels, or None where none applies: not on CPU (or a
    Pallas platform), turned off, more than `MAX_ROWS` activation rows (a kind's own `row_limit` is checked by
    `_kernel_operands`), an equation that is not "batch axes +
    contracted axes, weight -> batch axes + weight's kept axes"."""
    if not cpu_gemv.native_allowed():
        return None
    ref = w if isinstance(w, LayerRef) else None
    if ref is not None:
        w = jax.eval_shape(ref.get)  # one layer's shapes; the kernels read ref.stacked at ref.index
    lhs, rhs, out = _parse(eq)
    summed = [c for c in rhs if c in lhs and c not in out]
    if isinstance(w, QuantizedWeight):  # values are [*kept, *contracted in contract_axes order]
        contracted = [rhs[a] for a in w.contract_axes] if len(rhs) == w.ndim else []
        layout = "nk"
    else:
        contracted = summed
        kept = [c for c in rhs if c not in summed]
        layout = ("kn" if rhs == "".join(summed + kept) else "nk" if rhs == "".join(kept + summed) else None)
    kept = [c for c in rhs if c not in contracted]
    batch = [c for c in lhs if c not in contracted]
    if (layout is None or sorted(contracted) != sorted(summed) or lhs != "".join(batch + contracted)
            or out != "".join(batch + kept) or math.prod(x.shape[:len(batch)]) > cpu_gemv.MAX_ROWS):
        return None
    platform = jax.default_backend()
    if platform != "cpu":
        if platform not in PALLAS_PLATFORMS or not _pallas_enabled() or not isinstance(w, QuantizedWeight):
            return None
    elif not cpu_gemv.active():
        return None
    rows, k = math.prod(x.shape[:len(batch)]), math.prod(x.shape[len(batch):])
    return _Plan(x.reshape(rows, k), w, layout, k, ref,
                 (*x.shape[:len(batch)], *(w.shape[rhs.index(c)] for c in kept)))


def _native(eq: str, x: jax.Array, w: jax.Array | QuantizedWeight | LayerRef) -> jax.Array | None:
    """The einsum through `pallas_kernels.cpu_gemv` (f32, or int32 -> f32 for w8a8) or the Pallas kernels, or None
    where no kernel applies (`_plan`, or a format or size the kernels do not take: they fall back to XLA)."""
    plan = _plan(eq, x, w)
    if plan is None:
        return None
    if jax.default_backend() == "cpu":
        y = _native_2d(plan)
    else:
        y = _pallas_2d(plan.x, plan.w if plan.ref is None else plan.ref.get(), plan.k)
    return None if y is None else y.reshape(plan.out_shape)


def qeinsums(eqs: Sequence[str], x: jax.Array, ws: Sequence[jax.Array | QuantizedWeight | LayerRef], *,
             preferred_element_type: jnp.dtype | None = None) -> tuple[jax.Array, ...]:
    """`qeinsum(eq, x, w)` for each (eq, w): several weights applied to the same activations (q, k and v; gate and
    up). Where the native CPU kernels take them all as weights of one kind (bf16 / f32 of one layout, int8
    weight-only, int4 of one form, w4a8 or w8a8) and one layer index, they run as one kernel call
    (`cpu_gemv.float_matmuls`, `weight_only_matmuls`, `i8i8_matmuls`: the same numbers, fewer calls; w8a8
    quantizes the activations once); otherwise as separate `qeinsum`s.

    Raises:
      ValueError: as `qeinsum`, or `eqs` and `ws` of different lengths.
    """
    if len(eqs) != len(ws):
        raise ValueError(f"{len(eqs)} equations for {len(ws)} weights")
    plans = [_plan(eq, x, w) for eq, w in zip(eqs, ws)] if jax.default_backend() == "cpu" else [None]
    found = [None if p is None else _kernel_operands(p) for p in plans]
    refs = {id(p.ref.index) if p.ref is not None else None for p in plans if p is not None}
    if len(ws) < 2 or None in found or len(refs) != 1 or len({kind for kind, _ in found}) != 1:
        return tuple(qeinsum(eq, x, w, preferred_element_type=preferred_element_type) for eq, w in zip(eqs, ws))
    ys = _run_kernels(found[0][0], plans, [operands for _, operands in found])
    return tuple(y.reshape(p.out_shape).astype(preferred_element_type or x.dtype) for y, p in zip(ys, plans))


def _flat(plan: _Plan, a: jax.Array, *shape: int) -> jax.Array:
    """One layer's array as 2-D `shape`, a stack's (with `plan.ref`) as [L, *shape]."""
    return a.reshape(*a.shape[:0 if plan.ref is None else 1], *shape)


def _kernel_operands(plan: _Plan) -> tuple[tuple, object] | None:
    """(kind, operands) of a weight for the native kernels, stacked with `plan.ref`: kind ("float", layout) with the
    bf16 / f32 weight as [K, N] ("kn") or [N, K]; ("weight_only", values dtype, with a min, w4a8) with (values
    [N, K] or [N, K / 2], f32 scale [N, G], min or None) for int8 weight-only and int4; ("w8a8",) with int8 values
    [N, K]; None for other weights or sizes."""
    w, k, rows = plan.w, plan.k, plan.x.shape[0]
    src = w if plan.ref is None else plan.ref.stacked
    if not isinstance(w, QuantizedWeight):
        bf16 = w.dtype == plan.x.dtype == jnp.bfloat16
        if (w.dtype not in (jnp.bfloat16, jnp.float32) or k % (4 if plan.layout == "kn" else 8)
                or rows > cpu_gemv.row_limit("bf16" if bf16 else "f32")):
            return None
        return ("float", plan.layout), _flat(plan, src, k, -1) if plan.layout == "kn" else _flat(plan, src, -1, k)
    if w.scale.dtype != jnp.float32:
        return None
    n, groups = math.prod(w.scale.shape[:-1]), w.scale.shape[-1]
    if w.format == "int8" and w.quantize_activations:
        ok = not w.activation_group_size and groups == 1 and k % 32 == 0 and rows <= cpu_gemv.row_limit("w8a8")
        return (("w8a8",), _flat(plan, src.values, n, k)) if ok else None
    if rows > cpu_gemv.row_limit("int8" if w.format == "int8" else "int4") or (
            w.quantize_activations and (w.format != "int4"
                                        or not quant4.takes_int8_activations(w.group_size, w.min is not None))):
        return None
    kind = ("weight_only", w.values.dtype, w.min is not None, w.quantize_activations)
    scale = _flat(plan, src.scale, n, groups)
    if w.format == "int8" and (k // groups) % 16 == 0:
        return kind, (_flat(plan, src.values, n, k), scale, None)
    if w.format == "int4" and k % 64 == 0 and (k // groups) % 32 == 0:
        return kind, (_flat(plan, src.values, n, k // 2), scale,
                      None if w.min is None else _flat(plan, src.min, n, groups))
    return None


def _run_kernels(kind: tuple, plans: Sequence[_Plan], operands: Sequence) -> list[jax.Array]:
    """f32 [M, N_i] for each plan (all of `kind`, sharing x and the layer index) from one native kernel call."""
    x, ref = plans[0].x, plans[0].ref
    layer = None if ref is None else ref.index
    if kind[0] == "float":
        return cpu_gemv.float_matmuls(x, operands, input_major=kind[1] == "kn", layer=layer)
    if kind[0] == "w8a8":
        xq, x_scale = quantize_rows(x, [1], "int8")  # as `_activation_quantized`: the same numbers
        accs = cpu_gemv.i8i8_matmuls(xq, operands, layer=layer)
        return [acc.astype(jnp.float32) * x_scale * (p.w.scale if p.ref is None else p.ref.get().scale).reshape(-1)
                for acc, p in zip(accs, plans)]  # [N] weight scales: a slice is cheap
    return cpu_gemv.weight_only_matmuls(x, operands, layer=layer, int8_activations=kind[3])


def _native_2d(plan: _Plan) -> jax.Array | None:
    """x [M, K] times the weight flattened to [K, N] ("kn") or [N, K] ("nk") by a native kernel, f32 [M, N].
    `plan.w` gives one layer's shapes; with `plan.ref` the kernel reads layer `ref.index` of `ref.stacked` in
    place."""
    found = _kernel_operands(plan)
    return None if found is None else _run_kernels(found[0], [plan], [found[1]])[0]


PALLAS_PLATFORMS = ("gpu", "tpu")
_PALLAS_INTERPRET = False  # tests run the GPU kernel's routing on CPU in interpret mode


def _pallas_enabled() -> bool:
    return os.environ.get("JAXINFER_PALLAS_QMATMUL", "0").strip().lower() in ("1", "on", "true", "yes")


def _pallas_2d(x: jax.Array, w: QuantizedWeight, k: int) -> jax.Array | None:
    """x [M, K] times a weight-only int8 / int4 weight through `pallas_kernels.quant_matmul`, f32 [M, N]."""
    if w.quantize_activations or w.format not in ("int8", "int4"):
        return None
    n = math.prod(w.scale.shape[:-1])
    scale = w.scale.reshape(n, -1).astype(jnp.float32)
    group = 0 if scale.shape[1] == 1 and w.format == "int8" else k // scale.shape[1]
    values = w.values.reshape(n, -1)
    return quant_matmul.weight_only_matmul(x, values, scale, None if w.min is None else w.min.reshape(n, -1),
                                           group_size=group, backend="auto" if not _PALLAS_INTERPRET else "gpu",
                                           interpret=_PALLAS_INTERPRET)


def _activation_quantized(lhs: str, vals: str, out: str, contracted: str, x: jax.Array,
                          w: QuantizedWeight) -> jax.Array:
    """f32 sum over `contracted` of x * w.values with x quantized dynamically to w's format (w's per-channel scales
    not applied; an mxfp8 weight's block scales are).

    Activations get one scale per token per group of `w.activation_group_size` channels of the last contracted
    axis (0: per token over all contracted channels; mxfp8: its blocks, power-of-two scales). Each group's dot runs
    natively in low precision (int8 x int8 -> int32, e4m3 x e4m3 -> f32) and the groups are summed in f32 after
    their scales (mxfp8: the activation's and the weight's block scale) are applied.
    """
    acc_type = jnp.int32 if w.format == "int8" else jnp.float32
    last, group = contracted[-1], w.activation_group_size
    size = x.shape[lhs.index(last)]
    values = w.values
    if group and size > group and size % group == 0:  # split the last contracted axis into (groups, group)
        outer, inner = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in lhs + vals + out][:2]
        i = lhs.index(last)
        x = x.reshape(*x.shape[:i], size // group, group, *x.shape[i + 1:])
        values = values.reshape(*values.shape[:-1], size // group, group)
        lhs, vals = lhs.replace(last, outer + inner), vals.replace(last, outer + inner)
        contracted = contracted.replace(last, outer + inner)
        last = inner
    quantized_axes = contracted if not group else last
    xq, x_scale = quantize_rows(x, [lhs.index(c) for c in quantized_axes], w.format)
    grouped = "".join(c for c in contracted if c not in quantized_axes)  # summed after scaling
    acc = jnp.einsum(f"{lhs},{vals}->{out}{grouped}", xq, values, preferred_element_type=acc_type)
    x_scale = _to_layout(jnp.squeeze(x_scale, [lhs.index(c) for c in quantized_axes]),
                         "".join(c for c in lhs if c not in quantized_axes), out + grouped)
    y = acc.astype(jnp.float32) * x_scale
    if w.group_size:  # mxfp8: the weight's block scales [*kept, G] as [*kept, *contracted[:-1], blocks of the last]
        num_kept = len(vals) - len(contracted)
        w_scale = w.scale.astype(jnp.float32).reshape(*w.values.shape[:num_kept],
                                                      *(x.shape[lhs.index(c)] for c in grouped))
        y = y * _to_layout(w_scale, vals[:num_kept] + grouped, out + grouped)
    return jnp.sum(y, axis=tuple(range(len(out), len(out) + len(grouped)))) if grouped else y


def dequantize_if_quantized(w: jax.Array | QuantizedWeight, dtype: jnp.dtype) -> jax.Array:
    """A plain array for ops without a quantized path (MoE `ragged_dot`): dequantizes a `QuantizedWeight`."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w


def lookup_supports(table: QuantizedWeight) -> bool:
    """Whether `embed_lookup` reads this quantized table: int8 or fp8 values [V, D] (contract_axes (-1,)) with
    one scale per row or per group of a row (GGUF Q8_0's 32); not packed int4."""
    return table.contract_axes == (-1,) and table.format != "int4"


def embed_lookup(table: jax.Array | QuantizedWeight, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `tokens` of an embedding table [V, D] (plain, or quantized as `lookup_supports` says), in `dtype`.

    Raises:
      ValueError: a quantized table that `lookup_supports` refuses (int4, or other contract axes).
    """
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0).astype(dtype)
    if not lookup_supports(table):
        raise ValueError("a quantized embedding table needs contract_axes (-1,) and int8 or fp8 values, got "
                         f"{table.format} with contract_axes {table.contract_axes}")
    rows = jnp.take(table.values, tokens, axis=0).astype(jnp.float32)  # [T, D]
    scale = jnp.take(table.scale, tokens, axis=0)  # [T, G]: G = 1 per row, D / group_size per group
    rows = rows.reshape(*rows.shape[:-1], scale.shape[-1], -1) * scale[..., None]  # [T, G, D / G]
    return rows.reshape(*rows.shape[:-2], -1).astype(dtype)
