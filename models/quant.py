"""Quantized weights: int8, FP8 (e4m3), packed int4 values with f32 scales, the config that picks them, a model.

A quantized weight is its own pytree type, `QuantizedWeight`, holding the low-precision `values` and the f32
`scale`s; the model's einsums go through `models.quant_matmul.qeinsum`, which takes either a plain array or a
`QuantizedWeight`, so the model code is the same for every format. The format is chosen by config
(`QuantizationConfig`, from `EngineConfig.quantization`), never by file name.

Formats (symmetric, absmax scaling; Jacob et al. 2018 for int8 inference; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning", for e4m3):

| format | values          | scale                                          | scale = amax / |
|--------|-----------------|------------------------------------------------|----------------|
| int8   | int8 in [-127, 127] | f32 per output channel (GGUF Q8_0: per group of 32) | 127   |
| fp8    | float8_e4m3fn   | f32 per output channel, or per group of `group_size` input channels | 448 |
| int4   | uint8, 2 per byte (`models.quant4`) | f32 per group of 32 / 64 / 128, optional f32 min | 7    |

Layout: `values` keep the weight's non-contracted ("kept") axes in their order, then its contracted (input) axes:
a `wq` of [L, D, N, H] contracting D is stored [L, N, H, D]. Output-major is the fast layout for XLA:CPU's
int8 x int8 -> int32 dot (2.4x the input-major one, BENCHMARKS.md), and a leading layer axis stays leading, so
slicing or scanning stacked layers slices `values` and `scale` alike. `scale` is f32 [*kept, G], G = 1 per
output channel, G = C / group_size with groups along the flattened contracted axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import quant4
from models.config import options_from_value

FORMATS = ("int8", "fp8", "int4")
_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}  # int4: packed, models.quant4
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32  # GGUF Q4_0/Q4_1 and MX blocks; the quality bar is for group 32
_QMAX = {"int8": 127.0, "fp8": 448.0}  # int8 symmetric (no -128); largest finite e4m3fn


def format_of(dtype: jnp.dtype) -> str:
    """"int8", "fp8" or "int4" (uint8: packed) for a values dtype.

    Raises:
      ValueError: for any other dtype.
    """
    for name, d in _DTYPES.items():
        if jnp.dtype(dtype) == jnp.dtype(d):
            return name
    raise ValueError(f"{jnp.dtype(dtype)} is not a quantized weight dtype ({', '.join(FORMATS)})")


@flax.struct.dataclass
class QuantizedWeight:
    """A weight stored as low-precision values times f32 scales.

    Attributes:
      values: int8 or float8_e4m3fn, shape [*kept, *contracted] (module docstring: layout); for int4, uint8
        [*kept, *contracted[:-1], contracted[-1] / 2], two codes per byte (`models.quant4`).
      scale: f32 [*kept, G]; G = 1 (per output channel) or prod(contracted) / group_size (per group).
      min: int4 only: f32 [*kept, G], w = scale * q + min (asymmetric); None: symmetric, w = scale * (q - 8).
      contract_axes: static; the contracted (input) axes in the weight's own layout, as negative indices, so they
        stay valid when leading layer axes are sliced off.
      group_size: static; input channels per scale, 0 for one scale per output channel.
      quantize_activations: static; `qeinsum` quantizes activations per token and runs the native low-precision
        dot (per-channel weights only).
      activation_group_size: static; with `quantize_activations`, one activation scale per token per this many
        channels of the last contracted axis (0: one per token).
    """

    values: jax.Array
    scale: jax.Array
    min: jax.Array | None = None
    contract_axes: tuple[int, ...] = flax.struct.field(pytree_node=False, default=(-2,))
    group_size: int = flax.struct.field(pytree_node=False, default=0)
    quantize_activations: bool = flax.struct.field(pytree_node=False, default=False)
    activation_group_size: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def format(self) -> str:
        return format_of(self.values.dtype)

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
        packed = self.format == "int4"
        for src, size in zip(self._order(), quant4.unpacked_shape(self.values.shape) if packed else self.values.shape):
            out[src] = size
        return tuple(out)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The weight in its own layout and `dtype`: values * scale (materializes it; for references and tests)."""
        kept = self.values.shape[: self.ndim - self._num_contracted]
        groups = self.scale.shape[-1]
        if self.format == "int4":
            v = quant4.dequantize(self.values, self.scale, self.min, len(kept)).astype(dtype)
        else:
            v = self.values.reshape(*kept, groups, -1).astype(jnp.float32) * self.scale[..., None]
            v = v.reshape(self.values.shape).astype(dtype)
        return jnp.transpose(v, np.argsort(self._order()))

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes + (0 if self.min is None else self.min.nbytes)


def _order(nd: int, contract_axes: Sequence[int]) -> list[int]:
    """Axis i of a quantized weight's `values` is axis `order[i]` of the weight's own layout."""
    contracted = [a % nd for a in contract_axes]
    return [a for a in range(nd) if a not in contracted] + contracted


def quantize(w: jax.Array, fmt: str, contract_axes: Sequence[int], *, group_size: int = 0,
             quantize_activations: bool = False, activation_group_size: int = 0,
             asymmetric: bool = False) -> QuantizedWeight:
    """Quantizes one weight symmetrically (absmax) per output channel or per group of input channels.

    Args:
      w: float weight, any shape; `contract_axes` are the axes the model contracts against activations.
      fmt: "int8", "fp8" (float8_e4m3fn) or "int4" (packed, `models.quant4`; its last contracted axis even).
      contract_axes: the contracted axes of `w` (any sign; stored negative).
      group_size: 0 for one scale per output channel; else input channels per scale (fp8, int4), which must divide
        the last contracted axis, so no group spans two axes.
      asymmetric: int4 only: a min per group too (Q4_1-style, `models.quant4`).
      quantize_activations: recorded on the result for `qeinsum` (per-channel only).
      activation_group_size: recorded on the result for `qeinsum` (see `QuantizedWeight`).

    Returns:
      The `QuantizedWeight`; all-zero channels get scale 1 (and values 0), so nothing divides by zero.

    Raises:
      ValueError: unknown format, contract axes out of range, groups with int8, a group size that does not divide
        the last contracted axis, activation quantization with groups or int4, an odd last contracted axis for
        int4, or `asymmetric` for another format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r} is not one of {', '.join(FORMATS)}")
    nd = w.ndim
    if not contract_axes or any(not -nd <= a < nd for a in contract_axes):
        raise ValueError(f"contract_axes {tuple(contract_axes)} out of range for a weight of shape {w.shape}")
    neg = tuple(sorted({a % nd - nd for a in contract_axes}))
    if (fmt == "int4" and (quantize_activations or w.shape[neg[-1]] % 2)) or (asymmetric and fmt != "int4"):
        raise ValueError(f"{fmt} with asymmetric={asymmetric}, quantize_activations={quantize_activations} for "
                         f"shape {w.shape}, contract_axes {neg}: int4 is weight-only and packs its last contracted "
                         "axis in pairs (it must be even); only int4 is asymmetric")
    if group_size:
        if fmt == "int8":
            raise ValueError("per-group scales are for fp8 and int4; int8 uses one scale per output channel")
        if w.shape[neg[-1]] % group_size:
            raise ValueError(f"group_size {group_size} does not divide the contracted axis of size "
                             f"{w.shape[neg[-1]]} (weight shape {w.shape})")
        if quantize_activations:
            raise ValueError("activation quantization needs one scale per output channel (group_size 0)")
    wt = jnp.transpose(jnp.asarray(w, jnp.float32), _order(nd, neg))
    kept = wt.shape[: nd - len(neg)]
    contracted = math.prod(wt.shape[nd - len(neg):])
    groups = contracted // group_size if group_size else 1
    if fmt == "int4":
        codes, scale, mn = quant4.quantize_groups(wt.reshape(*kept, groups, -1), asymmetric)
        return QuantizedWeight(values=quant4.pack(codes.reshape(wt.shape)), scale=scale, min=mn, contract_axes=neg,
                               group_size=group_size)
    q, scale = quantize_rows(wt.reshape(*kept, groups, -1), (-1,), fmt)  # absmax per group, as for activations
    return QuantizedWeight(values=q.reshape(wt.shape), scale=scale[..., 0], contract_axes=neg, group_size=group_size,
                           quantize_activations=quantize_activations,
                           activation_group_size=activation_group_size if quantize_activations else 0)


def quantize_rows(x: jax.Array, axes: Sequence[int], fmt: str) -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric quantization of activations, one scale per slice over `axes` (per token).

    Returns:
      (values in the format's dtype, f32 scales with `axes` kept as size 1); an all-zero row gets scale 1.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=tuple(axes), keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX[fmt], 1.0)
    q = x32 / scale
    q = jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8) if fmt == "int8" else q.astype(jnp.float8_e4m3fn)
    return q, scale


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Which weights are quantized, and how.

    Attributes:
      format: "int8" (per output channel), "fp8" (e4m3), "int4" (`models.quant4`) or "gguf" (a GGUF's, as stored).
      group_size: fp8: input channels per scale (e.g. 128), 0 for per output channel. A weight whose last
        contracted axis it does not divide keeps per-channel scales (`quantize_weights` logs none; see
        `weight_bytes`). int4: 32, 64 or 128 (0 means 32); a weight whose last contracted axis it does not divide
        takes the largest group dividing both (a 16-wide head axis: 16).
      quantize_activations: dynamic per-token activation quantization with the native low-precision dot (w8a8);
        None or False: weight-only (the default: quality first). w8a8 is the fast int8 path on CPU (XLA:CPU's
        int8 x int8 -> int32 dot, and no full-precision weight copy), at a quality cost measured in
        BENCHMARKS.md.
      quantize_embedding: the embedding gather reads a quantized table; None: yes for int8, no for fp8 (int4: no).
      quantize_lm_head: the output projection is quantized (with tied embeddings and an unquantized gather, an
        extra quantized copy of the table serves the head); None: yes for int8, no for fp8 and int4 (as vLLM's fp8 keeps
        the head in full precision). On SmolLM2, fp8's perplexity is +3.4% over bf16 with them quantized and +1.5%
        without; int8's barely moves (BENCHMARKS.md).
      activation_group_size: with activation quantization, one activation scale per token per this many input
        channels instead of one per token: closer to the unquantized model, slower on CPU (BENCHMARKS.md).
    """

    format: str = "int8"
    group_size: int = 0
    quantize_activations: bool | None = None
    quantize_embedding: bool | None = None
    quantize_lm_head: bool | None = None
    activation_group_size: int = 0

    def __post_init__(self) -> None:
        if self.format not in (*FORMATS, "gguf"):
            raise ValueError(f"quantization format={self.format!r} is not one of {', '.join(FORMATS)}, gguf")
        if self.format == "gguf" and (self.activations or self.embedding or self.lm_head or self.activation_group_size):
            raise ValueError(f"quantization gguf keeps the GGUF file's own types: set no other field ({self})")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise ValueError(f"quantization group_size={self.group_size!r} must be an integer >= 0")
        if self.group_size and self.format in ("int8", "gguf"):
            raise ValueError(f"quantization group_size is for fp8 and int4; {self.format} sets its own scales")
        if self.format == "int4":
            object.__setattr__(self, "group_size", self.group_size or DEFAULT_INT4_GROUP_SIZE)
            quant4.check_config(self.group_size, INT4_GROUP_SIZES, self.quantize_activations,
                                self.quantize_embedding)
        if (not isinstance(self.activation_group_size, int) or isinstance(self.activation_group_size, bool)
                or self.activation_group_size < 0):
            raise ValueError(f"activation_group_size={self.activation_group_size!r} must be an integer >= 0")
        if self.group_size and self.quantize_activations:
            raise ValueError("activation quantization needs per-channel scales (group_size 0)")
        for name in ("quantize_activations", "quantize_embedding", "quantize_lm_head"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true, false or null")

    @staticmethod
    def from_value(value: QuantizationConfig | Mapping[str, Any] | str | None) -> QuantizationConfig | None:
        """A config from a format name ("int8", "fp8", "int4"), a dict of the fields, a JSON object string, an
        instance, or None (no quantization).

        Raises:
          ValueError: for an unknown format, JSON that does not parse or is not an object, unknown keys (named),
            or bad values.
        """
        if isinstance(value, str) and not value.lstrip().startswith("{"):
            if value.strip() not in FORMATS and value.strip()[:1] in ('[', '"', "-", *"0123456789"):
                raise ValueError(f"quantization {value!r} is neither a format name ({', '.join(FORMATS)}) nor a JSON "
                                 'object of QuantizationConfig fields (e.g. {"format": "int8"})')
            return QuantizationConfig(format=value)
        if value is not None and not isinstance(value, (str, Mapping, QuantizationConfig)):
            raise ValueError(f"quantization must be None, a format name, or a dict / JSON object, "
                             f"got {type(value).__name__}")
        return options_from_value(QuantizationConfig, value, "quantization config", required=("format",))

    @property
    def activations(self) -> bool:
        return bool(self.quantize_activations)

    @property
    def embedding(self) -> bool:
        return self.format == "int8" if self.quantize_embedding is None else self.quantize_embedding

    @property
    def lm_head(self) -> bool:
        return self.format == "int8" if self.quantize_lm_head is None else self.quantize_lm_head

    def resolved(self) -> QuantizationConfig:
        """This config with every None default decided (activations, embedding, LM head): two configs that
        quantize the same way compare equal once resolved. "gguf" (the file decides) stays as it is."""
        return self if self.format == "gguf" else dataclasses.replace(
            self, quantize_activations=self.activations, quantize_embedding=self.embedding, quantize_lm_head=self.lm_head)


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
    model's norm gains are folded into the projections first (`fold_norm_scales`).

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
            group = math.gcd(group, w.shape[axes[-1]]) if qcfg.format == "int4" else 0  # smaller / per-channel
        return group

    def q(w, axes, per_row_only=False):
        group = group_for(w, axes, per_row_only)
        return quantize(w, qcfg.format, axes, group_size=group, quantize_activations=qcfg.activations and not group,
                        activation_group_size=qcfg.activation_group_size)

    def cast(w):
        return None if w is None else jnp.asarray(w, dtype)

    layers = weights.layers
    if qcfg.activations and not cfg.is_moe:
        layers = fold_norm_scales(layers, cfg.norm_weight_offset)
    new_layers = {}
    for field in dataclasses.fields(layers):
        w = getattr(layers, field.name)
        if w is None:
            new_layers[field.name] = None
        elif field.name in CONTRACT_AXES and not (cfg.is_moe and field.name.startswith("e_")):
            new_layers[field.name] = q(w, CONTRACT_AXES[field.name])
        elif field.name in CONTRACT_AXES:  # routed experts: dequantized for ragged_dot, so no activation quant
            new_layers[field.name] = quantize(w, qcfg.format, CONTRACT_AXES[field.name], group_size=group_for(
                w, CONTRACT_AXES[field.name]) if qcfg.format == "int4" else 0)
        else:
            new_layers[field.name] = cast(w)
    embed = weights.embed
    q_embed = q(embed, (-1,), per_row_only=True) if qcfg.embedding else cast(embed)
    if weights.lm_head is not None:
        lm_head = q(weights.lm_head, (-2,)) if qcfg.lm_head else cast(weights.lm_head)
    elif qcfg.lm_head == qcfg.embedding:
        lm_head = None  # tied: one table serves the gather and the head
    else:  # tied, but only one of the two is quantized: the head gets its own [D, V] copy
        head = jnp.asarray(embed, jnp.float32).T
        lm_head = q(head, (-2,)) if qcfg.lm_head else cast(head)
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
