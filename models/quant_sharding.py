"""Quantized weights on a mesh: the shardings of a `QuantizedWeight`'s values and scale derived from the sharding of
the weight it quantizes, and quantization run on device over weights already placed on a mesh."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from models.quant import QuantizationConfig, QuantizedWeight, quantize_weights


def _quantized_spec(spec: jax.sharding.PartitionSpec, q: QuantizedWeight,
                    mesh: jax.sharding.Mesh | None = None) -> QuantizedWeight:
    """PartitionSpecs of a quantized weight's values and scale from the spec of the weight it quantizes.

    A per-group scale's group axis is split like the contracted axis when there is one contracted axis and (given
    `mesh`) the number of groups divides over it; otherwise it is replicated. nvfp4's tensor scale keeps the
    sharding of its stacked leading axes (experts over `ep`).
    """
    parts = list(spec) + [None] * (q.ndim - len(spec))
    order = q._order()
    kept = [parts[a] for a in order[: q.ndim - len(q.contract_axes)]]
    grouped = parts[order[-1]] if q.group_size and len(q.contract_axes) == 1 else None
    if grouped is not None and mesh is not None:
        names = grouped if isinstance(grouped, tuple) else (grouped,)
        if q.scale.shape[-1] % math.prod(mesh.shape[n] for n in names):
            grouped = None  # fewer groups than shards, or an uneven split: every device holds all groups
    scale = jax.sharding.PartitionSpec(*kept, grouped)
    tensor_scale = None
    if q.tensor_scale is not None:  # nvfp4: stacked axes (layers, experts) split like the values, size-1 axes not
        sizes = q.tensor_scale.shape
        tensor_scale = jax.sharding.PartitionSpec(
            *[p if sizes[i] == q.values.shape[i] and sizes[i] > 1 else None for i, p in enumerate(kept)], None)
    return q.replace(values=jax.sharding.PartitionSpec(*[parts[a] for a in order]), scale=scale,
                     min=None if q.min is None else scale,  # packed last axes split like the unpacked ones
                     tensor_scale=tensor_scale)


def quantized_sharding(sharding: jax.sharding.NamedSharding, q: QuantizedWeight) -> QuantizedWeight:
    """The `NamedSharding`s of a quantized weight's values and scale (a `QuantizedWeight` of shardings, with `q`'s
    static fields) from the sharding of the weight it quantizes, as `quantize_sharded` places them.

    Args:
      sharding: the sharding of the weight in its own layout.
      q: the quantized weight, or one of `jax.ShapeDtypeStruct`s (only shapes and static fields are read).
    """
    specs = _quantized_spec(sharding.spec, q, sharding.mesh)
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(sharding.mesh, s), specs)


def quantize_sharded(weights, cfg, qcfg: QuantizationConfig, dtype: jnp.dtype):
    """`quantize_weights` on device for weights placed on a mesh: each quantized weight's values and scales keep
    the sharding of the weight they quantize (kept axes as they were, the contracted axes moved last; a scale is
    replicated over contracted axes, whose absmax XLA reduces across shards).

    Args:
      weights: `models.llama.Weights` of `jax.Array`s with `NamedSharding`s (from `models.partition.shard_model`).

    Returns:
      Quantized `Weights` on the same mesh.
    """
    fn = functools.partial(quantize_weights, cfg=cfg, qcfg=qcfg, dtype=dtype)
    abstract = jax.eval_shape(fn, weights)
    mesh = weights.embed.sharding.mesh
    spec_of = lambda x: None if x is None else x.sharding.spec  # noqa: E731
    specs = jax.tree.map(spec_of, weights, is_leaf=lambda x: x is None)
    if abstract.lm_head is not None and weights.lm_head is None:  # tied head's own copy: the embed's spec, transposed
        embed_spec = list(weights.embed.sharding.spec) + [None] * 2
        specs = specs.replace(lm_head=jax.sharding.PartitionSpec(embed_spec[1], embed_spec[0]))
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731

    def one(a, spec):
        if a is None:
            return None
        out = _quantized_spec(spec, a, mesh) if is_q(a) else spec
        return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), out)

    shardings = jax.tree.map(one, abstract, specs, is_leaf=lambda x: x is None or is_q(x))
    return jax.jit(fn, out_shardings=shardings)(weights)
