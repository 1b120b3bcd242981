"""Quantized weights: int8, FP8 (e4m3), packed int4 and the microscaling formats MXFP8 / MXFP4 / NVFP4, and
quantizing a model's weights to them.

A quantized weight is its own pytree type, `QuantizedWeight`, holding the low-precision `values` and their
`scale`s; the model's einsums go through `models.quant_matmul.qeinsum`, which takes either a plain array or a
`QuantizedWeight`, so the model code is the same for every format. The format is chosen by config
(`QuantizationConfig`, in `models.quant_config` and re-exported here with `FORMATS`, from
`EngineConfig.quantization`), never by file name.

Formats (symmetric, absmax scaling; Jacob et al. 2018 for int8 inference; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning", for e4m3; OCP MX v1.0 and NVIDIA NVFP4 for the microscaling ones, `models.mxfp`):

| format | values                              | scale                                                 | scale =      |
|--------|-------------------------------------|-------------------------------------------------------|--------------|
| int8   | int8 in [-127, 127]                 | f32 per output channel (GGUF Q8_0: per group of 32)  | amax / 127   |
| fp8    | float8_e4m3fn                       | f32 per output channel, or per group of `group_size`  | amax / 448   |
| int4   | uint8, 2 per byte (`models.quant4`) | f32 per group of 32 / 64 / 128, optional f32 min      | amax / 7     |
| mxfp8  | float8_e4m3fn                       | float8_e8m0fnu per block of 32                        | 2^k          |
| mxfp4  | uint8, 2 E2M1 codes per byte        | float8_e8m0fnu per block of 32                        | 2^k          |
| nvfp4  | uint8, 2 E2M1 codes per byte        | float8_e4m3fn per block of 16, f32 `tensor_scale`     | models.mxfp  |

The format is the pair (values dtype, scale dtype) (`format_of`): no two formats share it, it travels with the
arrays (checkpoints, `jax.eval_shape`), and it cannot disagree with them as a separate field could.

Layout: `values` keep the weight's non-contracted ("kept") axes in their order, then its contracted (input) axes:
a `wq` of [L, D, N, H] contracting D is stored [L, N, H, D]. Output-major is the fast layout for XLA:CPU's
int8 x int8 -> int32 dot (2.4x the input-major one, BENCHMARKS.md), and a leading layer axis stays leading, so
slicing or scanning stacked layers slices `values` and `scale` alike. `scale` is [*kept, G], G = 1 per
output channel, G = C / group_size with groups along the flattened contracted axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import mxfp, pytree, quant4
from models.quant_config import (DEFAULT_INT4_GROUP_SIZE, FORMATS, GROUP_FALLBACK_FORMATS,  # noqa: F401 (re-exported)
                                 INT4_GROUP_SIZES, QuantizationConfig)

# (values dtype, scale dtype) of each format: the pair names the format (`format_of`)
_DTYPES = {"int8": (jnp.int8, jnp.float32), "fp8": (jnp.float8_e4m3fn, jnp.float32),
           "int4": (jnp.uint8, jnp.float32),  # packed, models.quant4
           **{f: (mxfp.VALUES_DTYPE[f], mxfp.SCALE_DTYPE[f]) for f in mxfp.FORMATS}}
PACKED_FORMATS = ("int4", *mxfp.PACKED)  # two 4-bit codes per byte along the last contracted axis
_QMAX = {"int8": 127.0, "fp8": 448.0}  # int8 symmetric (no -128); largest finite e4m3fn


def dtypes_of(fmt: str) -> tuple[jnp.dtype, jnp.dtype]:
    """(values dtype, scale dtype) of a format name (module docstring table).

    Raises:
      ValueError: for an unknown format.
    """
    if fmt not in _DTYPES:
        raise ValueError(f"quantization format {fmt!r} is not one of {', '.join(FORMATS)}")
    return tuple(jnp.dtype(d) for d in _DTYPES[fmt])


def format_of(dtype: jnp.dtype, scale_dtype: jnp.dtype = jnp.float32) -> str:
    """The format name of a quantized weight from its values dtype and scale dtype (default f32: int8, fp8, int4).

    Raises:
      ValueError: for a pair that is no format.
    """
    for name, (v, s) in _DTYPES.items():
        if jnp.dtype(dtype) == jnp.dtype(v) and jnp.dtype(scale_dtype) == jnp.dtype(s):
            return name
    raise ValueError(f"{jnp.dtype(dtype)} values with {jnp.dtype(scale_dtype)} scales are no quantized weight "
                     f"format ({', '.join(FORMATS)})")


@pytree.dataclass
class QuantizedWeight:
    """A weight stored as low-precision values times scales (the format: module docstring table, `format_of`).

    Attributes:
      values: int8 or float8_e4m3fn, shape [*kept, *contracted] (module docstring: layout); for int4, mxfp4 and
        nvfp4, uint8 [*kept, *contracted[:-1], contracted[-1] / 2], two codes per byte (`models.quant4`,
        `models.mxfp`).
      scale: [*kept, G], f32 (int8, fp8, int4), float8_e8m0fnu (mxfp8, mxfp4) or float8_e4m3fn (nvfp4);
        G = 1 (per output channel) or prod(contracted) / group_size (per group / block).
      min: int4 only: f32 [*kept, G], w = scale * q + min (asymmetric); None: symmetric, w = scale * (q - 8).
      tensor_scale: nvfp4 only: f32 with the rank of `scale`, one per tensor slice (the stacked leading axes kept,
        size 1 elsewhere; `models.mxfp`): w = value * scale * tensor_scale. None for the other formats.
      contract_axes: static; the contracted (input) axes in the weight's own layout, as negative indices, so they
        stay valid when leading layer axes are sliced off.
      group_size: static; input channels per scale, 0 for one scale per output channel (the block for mxfp8,
        mxfp4, nvfp4).
      quantize_activations: static; `qeinsum` quantizes activations per token and runs the native low-precision
        dot (per-channel weights, or mxfp8 blocks).
      activation_group_size: static; with `quantize_activations`, one activation scale per token per this many
        channels of the last contracted axis (0: one per token; mxfp8: its `group_size`).
    """

    values: jax.Array
    scale: jax.Array
    min: jax.Array | None = None
    tensor_scale: jax.Array | None = None
    contract_axes: tuple[int, ...] = pytree.field(static=True, default=(-2,))
    group_size: int = pytree.field(static=True, default=0)
    quantize_activations: bool = pytree.field(static=True, default=False)
    activation_group_size: int = pytree.field(static=True, default=0)

    @property
    def format(self) -> str:
        return format_of(self.values.dtype, self.scale.dtype)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def _num_contracted(self) -> int:
        return len(self.contract_axes)

    def _order(self) -> list[int]:
        return _order(self.ndim, self.contract_axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape in its own (unquantized) layout."""
        out = [0] * self.ndim
        packed = self.format in PACKED_FORMATS
        for src, size in zip(self._order(), quant4.unpacked_shape(self.values.shape) if packed else self.values.shape):
            out[src] = size
        return tuple(out)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The weight in its own layout and `dtype`: values * scale (materializes it; for references and tests,
        and inside the jitted weight-only matmul)."""
        kept = self.values.shape[: self.ndim - self._num_contracted]
        groups = self.scale.shape[-1]
        fmt = self.format
        if fmt == "int4":
            v = quant4.dequantize(self.values, self.scale, self.min, len(kept)).astype(dtype)
        elif fmt in mxfp.FORMATS:
            v = mxfp.dequantize(self.values, self.scale, self.tensor_scale, len(kept)).astype(dtype)
        else:
            v = self.values.reshape(*kept, groups, -1).astype(jnp.float32) * self.scale[..., None]
            v = v.reshape(self.values.shape).astype(dtype)
        return jnp.transpose(v, np.argsort(self._order()))

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.values, self.scale, self.min, self.tensor_scale) if x is not None)


def stacked_axes_of(q: QuantizedWeight) -> int:
    """The `stacked_axes` that rebuilds `q`'s tensor scale shape with `quantize` (nvfp4; 0 for the other formats):
    the leading axes of `tensor_scale` up to its last one longer than 1 (a stack of one layer gives 0 and the same
    shape)."""
    if q.tensor_scale is None:
        return 0
    return max((i + 1 for i, n in enumerate(q.tensor_scale.shape) if n != 1), default=0)


def _order(nd: int, contract_axes: Sequence[int]) -> list[int]:
    """Axis i of a quantized weight's `values` is axis `order[i]` of the weight's own layout."""
    contracted = [a % nd for a in contract_axes]
    return [a for a in range(nd) if a not in contracted] + contracted


def quantize(w: jax.Array, fmt: str, contract_axes: Sequence[int], *, group_size: int = 0,
             quantize_activations: bool = False, activation_group_size: int = 0,
             asymmetric: bool = False, stacked_axes: int = 0) -> QuantizedWeight:
    """Quantizes one weight symmetrically (absmax) per output channel or per group of input channels.

    Args:
      w: float weight, any shape; `contract_axes` are the axes the model contracts against activations.
      fmt: "int8", "fp8" (float8_e4m3fn), "int4" (packed, `models.quant4`), or "mxfp8", "mxfp4", "nvfp4"
        (`models.mxfp`); int4, mxfp4 and nvfp4 need an even last contracted axis.
      contract_axes: the contracted axes of `w` (any sign; stored negative).
      group_size: 0 for one scale per output channel; else input channels per scale (fp8, int4), which must divide
        the last contracted axis, so no group spans two axes. mxfp8 / mxfp4 / nvfp4: 0 for the format's block
        (32 / 32 / 16), or a divisor of it (the gcd fallback of `quantize_weights`).
      asymmetric: int4 only: a min per group too (Q4_1-style, `models.quant4`).
      quantize_activations: recorded on the result for `qeinsum` (int8 / fp8 per channel, or mxfp8).
      activation_group_size: recorded on the result for `qeinsum` (see `QuantizedWeight`); mxfp8 records its
        block instead.
      stacked_axes: nvfp4: how many leading axes of `w` stack separate tensors (1 for [L, ...] layers, 2 for
        [L, E, ...] experts); each slice gets its own `tensor_scale`. Ignored by the other formats.

    Returns:
      The `QuantizedWeight`; all-zero channels (blocks) get scale 1 (and values 0), so nothing divides by zero.

    Raises:
      ValueError: unknown format, contract axes out of range, groups with int8, a group size that does not divide
        the last contracted axis (or, for the microscaling formats, their block), activation quantization with
        groups (but mxfp8) or a weight-only format, an odd last contracted axis for a packed format, `asymmetric`
        for another format than int4, or `stacked_axes` reaching a contracted axis.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r} is not one of {', '.join(FORMATS)}")
    nd = w.ndim
    if not contract_axes or any(not -nd <= a < nd for a in contract_axes):
        raise ValueError(f"contract_axes {tuple(contract_axes)} out of range for a weight of shape {w.shape}")
    neg = tuple(sorted({a % nd - nd for a in contract_axes}))
    packed, weight_only = fmt in PACKED_FORMATS, fmt in ("int4", "mxfp4", "nvfp4")
    w4a8 = fmt == "int4" and quantize_activations and quant4.takes_int8_activations(group_size, asymmetric)
    if ((packed and w.shape[neg[-1]] % 2) or (weight_only and quantize_activations and not w4a8)
            or (asymmetric and fmt != "int4")):
        raise ValueError(f"{fmt} with asymmetric={asymmetric}, quantize_activations={quantize_activations} for "
                         f"shape {w.shape}, contract_axes {neg}: int4 (but symmetric groups of 32: w4a8), mxfp4 and "
                         "nvfp4 are weight-only and pack their last contracted axis in pairs (it must be even); only "
                         "int4 is asymmetric")
    if not 0 <= stacked_axes <= neg[0] + nd:
        raise ValueError(f"stacked_axes={stacked_axes} must count leading axes before the first contracted axis "
                         f"of a weight of shape {w.shape} with contract_axes {neg}")
    if fmt in mxfp.FORMATS:
        group_size = group_size or mxfp.BLOCK[fmt]
        if mxfp.BLOCK[fmt] % group_size:
            raise ValueError(f"{fmt} group_size {group_size} must divide the format's block of {mxfp.BLOCK[fmt]}")
    if group_size:
        if fmt == "int8":
            raise ValueError("per-group scales are for fp8 and int4; int8 uses one scale per output channel")
        if w.shape[neg[-1]] % group_size:
            raise ValueError(f"group_size {group_size} does not divide the contracted axis of size "
                             f"{w.shape[neg[-1]]} (weight shape {w.shape})")
        if quantize_activations and fmt not in ("mxfp8", "int4"):
            raise ValueError("activation quantization needs one scale per output channel (group_size 0)")
    wt = jnp.transpose(jnp.asarray(w, jnp.float32), _order(nd, neg))
    kept = wt.shape[: nd - len(neg)]
    contracted = math.prod(wt.shape[nd - len(neg):])
    groups = contracted // group_size if group_size else 1
    g = wt.reshape(*kept, groups, -1)  # [*kept, G, group]
    if fmt == "int4":
        codes, scale, mn = quant4.quantize_groups(g, asymmetric)
        return QuantizedWeight(values=quant4.pack(codes.reshape(wt.shape)), scale=scale, min=mn, contract_axes=neg,
                               group_size=group_size, quantize_activations=w4a8,
                               activation_group_size=quant4.W4A8_GROUP if w4a8 else 0)
    if fmt in mxfp.FORMATS:
        tensor_amax = jnp.max(jnp.abs(g), axis=tuple(range(stacked_axes, g.ndim)), keepdims=True)[..., 0]
        elements, scale, tensor_scale = mxfp.quantize_blocks(g, fmt, tensor_amax if fmt == "nvfp4" else None)
        elements = elements.reshape(wt.shape)
        return QuantizedWeight(values=quant4.pack(elements) if packed else elements, scale=scale,
                               tensor_scale=tensor_scale, contract_axes=neg, group_size=group_size,
                               quantize_activations=quantize_activations,
                               activation_group_size=group_size if quantize_activations else 0)
    q, scale = quantize_rows(g, (-1,), fmt)  # absmax per group, as for activations
    return QuantizedWeight(values=q.reshape(wt.shape), scale=scale[..., 0], contract_axes=neg, group_size=group_size,
                           quantize_activations=quantize_activations,
                           activation_group_size=activation_group_size if quantize_activations else 0)


def quantize_rows(x: jax.Array, axes: Sequence[int], fmt: str) -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric quantization of activations, one scale per slice over `axes` (per token).

    Args:
      x: float activations, any shape.
      axes: the axes each scale covers.
      fmt: "int8", "fp8" (scale amax / 127, amax / 448) or "mxfp8" (a power of two, `models.mxfp.mx_scale`;
        the caller makes the slices MX blocks).

    Returns:
      (values in the format's dtype, f32 scales with `axes` kept as size 1); an all-zero row gets scale 1.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=tuple(axes), keepdims=True)
    if fmt == "mxfp8":
        scale = mxfp.mx_scale(amax, fmt)
        return jnp.clip(x32 / scale, -mxfp.E4M3_MAX, mxfp.E4M3_MAX).astype(jnp.float8_e4m3fn), scale
    scale = jnp.where(amax > 0, amax / _QMAX[fmt], 1.0)
    q = x32 / scale
    q = jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8) if fmt == "int8" else q.astype(jnp.float8_e4m3fn)
    return q, scale


# Contracted axes of each quantized projection in its own layout (see models.llama.LayerWeights).
CONTRACT_AXES = {
    "wq": (-3,), "wk": (-3,), "wv": (-3,), "wo": (-3, -2),
    "w_gate": (-2,), "w_up": (-2,), "w_down": (-2,),
    "e_gate": (-2,), "e_up": (-2,), "e_down": (-2,),
    "s_gate": (-2,), "s_up": (-2,), "s_down": (-2,),
}


def fold_norm_scales(layers, offset: float = 0.0):
    """Moves each RMSNorm's gain into the projections that read its output: wq/wk/wv take `attn_norm`, w_gate/w_up
    take `mlp_norm`, and the norms' gains become one. Exact in real arithmetic (rms_norm(x) * g @ W =
    rms_norm(x) @ (diag(g) W)). With dynamic per-token activation quantization it matters: a gain that is large in
    a few channels makes the normalized activations large there, and one per-token scale then leaves the other
    channels few int8 steps; folded, the weights' per-output-channel scales absorb it (perplexity in BENCHMARKS.md).

    Args:
      layers: dense `models.llama.LayerWeights` (f32), stacked over layers.
      offset: `ModelConfig.norm_weight_offset`: the gain is offset + w (Gemma: 1), and the folded norms hold
        1 - offset so that their gain is one.
    """
    attn = jnp.asarray(layers.attn_norm, jnp.float32) + offset  # [L, D] gains
    mlp = jnp.asarray(layers.mlp_norm, jnp.float32) + offset
    def scaled(w, g):
        w = jnp.asarray(w, jnp.float32)
        return w * g.reshape(g.shape + (1,) * (w.ndim - g.ndim))
    return layers.replace(wq=scaled(layers.wq, attn), wk=scaled(layers.wk, attn), wv=scaled(layers.wv, attn),
                          w_gate=scaled(layers.w_gate, mlp), w_up=scaled(layers.w_up, mlp),
                          attn_norm=jnp.full_like(attn, 1.0 - offset), mlp_norm=jnp.full_like(mlp, 1.0 - offset))


def quantize_weights(weights, cfg, qcfg: QuantizationConfig, dtype: jnp.dtype):
    """Quantizes a model's projections (and, as configured, its embedding and LM head).

    Norms, biases and routers stay in `dtype` (they are small and sensitive). MoE expert weights are quantized
    too; their `ragged_dot` dequantizes them (no quantized ragged dot yet). With activation quantization, a dense
    model's norm gains are folded into the projections first (`fold_norm_scales`). A group (int4) or block
    (mxfp8, mxfp4, nvfp4) that does not divide a weight's last contracted axis becomes gcd(group, axis) for that
    weight (fp8: per channel). nvfp4's tensor scales are per layer (per layer and expert for routed experts).

    Args:
      weights: `models.llama.Weights` with float arrays (numpy or jax); quantized from f32.
      cfg: the model's `ModelConfig`.
      qcfg: what to quantize and how.
      dtype: the activation dtype; every weight that is not quantized is cast to it.

    Returns:
      `Weights` with `QuantizedWeight` leaves. For tied embeddings where the gather and the head differ in
      whether they are quantized, `lm_head` becomes the head's own [D, V] weight (quantized or not).
    """
    def group_for(w, axes, per_row_only=False):
        group = 0 if per_row_only else qcfg.group_size
        if group and w.shape[axes[-1]] % group:  # the group does not divide this weight's input axis:
            group = math.gcd(group, w.shape[axes[-1]]) if qcfg.format in GROUP_FALLBACK_FORMATS else 0
        return group

    def q(w, axes, per_row_only=False, stacked_axes=0):
        group = group_for(w, axes, per_row_only)
        w4a8 = qcfg.format == "int4" and quant4.takes_int8_activations(group, qcfg.asymmetric)
        acts = qcfg.activations and (not group or qcfg.format == "mxfp8" or w4a8)  # fp8 groups: weight-only
        return quantize(w, qcfg.format, axes, group_size=group, quantize_activations=acts,
                        activation_group_size=qcfg.activation_group_size, stacked_axes=stacked_axes,
                        asymmetric=qcfg.asymmetric)

    def q_table(w, axes, per_row_only=False):  # the embedding table or the LM head: `embedding_format` if set
        return quantize(w, qcfg.embedding_format, axes) if qcfg.embedding_format else q(w, axes, per_row_only)

    def cast(w):
        return None if w is None else jnp.asarray(w, dtype)

    layers = weights.layers
    if qcfg.activations and not cfg.is_moe and qcfg.format != "int4":  # w4a8 keeps int4's weights
        layers = fold_norm_scales(layers, cfg.norm_weight_offset)
    new_layers = {}
    for field in dataclasses.fields(layers):
        w = getattr(layers, field.name)
        if w is None:
            new_layers[field.name] = None
        elif field.name in CONTRACT_AXES and not (cfg.is_moe and field.name.startswith("e_")):
            new_layers[field.name] = q(w, CONTRACT_AXES[field.name], stacked_axes=1)  # [L, ...]
        elif field.name in CONTRACT_AXES:  # routed experts: dequantized for ragged_dot, so no activation quant
            grouped = qcfg.format in GROUP_FALLBACK_FORMATS
            new_layers[field.name] = quantize(w, qcfg.format, CONTRACT_AXES[field.name], group_size=group_for(
                w, CONTRACT_AXES[field.name]) if grouped else 0, stacked_axes=2,  # [L, E, ...]
                asymmetric=qcfg.asymmetric)
        else:
            new_layers[field.name] = cast(w)
    embed = weights.embed
    q_embed = q_table(embed, (-1,), per_row_only=True) if qcfg.embedding else cast(embed)
    if weights.lm_head is not None:
        lm_head = q_table(weights.lm_head, (-2,)) if qcfg.lm_head else cast(weights.lm_head)
    elif qcfg.lm_head == qcfg.embedding:
        lm_head = None  # tied: one table serves the gather and the head
    else:  # tied, but only one of the two is quantized: the head gets its own [D, V] copy
        head = jnp.asarray(embed, jnp.float32).T
        lm_head = q_table(head, (-2,)) if qcfg.lm_head else cast(head)
    return weights.replace(embed=q_embed, layers=layers.replace(**new_layers), final_norm=cast(weights.final_norm),
                           lm_head=lm_head)


def weight_bytes(weights) -> dict[str, float]:
    """Bytes of a model's weights, and the share of parameters that are quantized.

    Returns:
      {"bytes": total bytes held (values + scales + unquantized), "quantized_params": parameters stored
      quantized, "params": all parameters, "quantized_share": their ratio, "quantized_bytes": bytes of the
      quantized weights (values + scales + int4 mins)}.
    """
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    total = quantized = nbytes = qbytes = 0
    for leaf in leaves:
        if isinstance(leaf, QuantizedWeight):
            quantized += math.prod(leaf.shape)  # int4: two per byte of values
            total += math.prod(leaf.shape)
            qbytes += leaf.nbytes
            nbytes += leaf.nbytes
        else:
            total += leaf.size
            nbytes += leaf.nbytes
    return {"bytes": int(nbytes), "params": int(total), "quantized_params": int(quantized),
            "quantized_share": quantized / total if total else 0.0, "quantized_bytes": int(qbytes)}
