"""Logical axis names and the one table that maps them to mesh axes; every sharding derives from it.

Weights declare logical axes once (`models.llama.Weights.abstract`); `logical_to_spec` turns a tuple of logical
axes into a `PartitionSpec` through `DEFAULT_RULES`, and `named_shardings` does it for a whole tree of specs.
The KV cache shards over kv heads like the K/V projections, so attention needs no communication; the output
projection and the MLP down projection contract a sharded axis, which XLA completes with one all-reduce each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import EP_AXIS, PP_AXIS, TP_AXIS, pipeline_stages

# Logical axis names, declared by weights and activations.
LAYERS, VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, EXPERTS, BATCH = (
    "layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "batch")

# The router's expert axis (router [L, D, E], shared-expert gate [L, D, 1]) is deliberately absent from the rules:
# every rank routes every token, so the router stays whole on every device.
ROUTER = "router_experts"

# A logical axis maps to one mesh axis, to several (split over their product, the first outermost), or to None.
MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Megatron-style TP (Shoeybi et al. 2019): attention heads and the MLP hidden dimension split over `tp`; the
# vocabulary too (embedding rows, LM head columns); experts over `ep`. Unlisted logical axes are replicated.
DEFAULT_RULES: Rules = (
    (HEADS, TP_AXIS),
    (KV_HEADS, TP_AXIS),
    (MLP, TP_AXIS),
    (VOCAB, TP_AXIS),
    (EXPERTS, EP_AXIS),
)
# With pipeline stages (`sharding.mesh.make_mesh(pp=...)`), stacked layers (weights and KV pages) split over them
# too: stage s holds the s-th block of the stack (`models.pipeline`). The vocabulary (embedding rows, LM head
# columns) splits over every device, pp x tp: in one SPMD program an array lives on all devices, so a table "on the
# first stage only" would leave zero-filled copies on the others; split, each device holds 1 / (pp * tp) of it.
PIPELINE_RULES: Rules = (*((name, axes) for name, axes in DEFAULT_RULES if name != VOCAB),
                         (VOCAB, (PP_AXIS, TP_AXIS)), (LAYERS, PP_AXIS))


def mesh_rules(mesh: jax.sharding.Mesh | None) -> Rules:
    """The rules of a mesh: `PIPELINE_RULES` where it has a stage axis of size > 1, else `DEFAULT_RULES`."""
    return PIPELINE_RULES if pipeline_stages(mesh) > 1 else DEFAULT_RULES


def mesh_axes_size(mesh: jax.sharding.Mesh, axes: MeshAxes) -> int:
    """The number of shards a `PartitionSpec` entry makes on `mesh`: the product of its mesh axes' sizes (1 for
    None)."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[name] for name in names)


def logical_to_spec(axes: Sequence[str], rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """The `PartitionSpec` of an array whose dimensions have logical names `axes`.

    Raises:
      ValueError: if two dimensions map to the same mesh axis (an array cannot be split twice over one axis).
    """
    table = dict(rules)
    spec = [table.get(axis) for axis in axes]
    used = [m for entry in spec if entry is not None for m in ((entry,) if isinstance(entry, str) else entry)]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {tuple(axes)} map to mesh axes {tuple(spec)}: a mesh axis is used twice")
    return PartitionSpec(*spec)


def check_divisible(shape: Sequence[int], axes: Sequence[str], mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES,
                    what: str = "array") -> None:
    """Raises ValueError, naming the numbers, if a dimension is not a multiple of its mesh axis size."""
    for size, axis, mesh_axes in zip(shape, axes, logical_to_spec(axes, rules)):
        if size % mesh_axes_size(mesh, mesh_axes):
            raise ValueError(f"{what}: {axis} = {size} is not a multiple of {mesh_axes} = "
                             f"{mesh_axes_size(mesh, mesh_axes)}")


def named_shardings(specs: Any, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES,
                    is_leaf: Any = None) -> Any:
    """A tree of `NamedSharding`s for a tree of objects with `.shape` and `.logical_axes` (e.g. `WeightSpec`).

    Raises:
      ValueError: from `logical_to_spec` or `check_divisible`, naming the offending leaf's path.
    """
    def one(path, spec) -> NamedSharding:
        what = jax.tree_util.keystr(path)
        check_divisible(spec.shape, spec.logical_axes, mesh, rules, what)
        return NamedSharding(mesh, logical_to_spec(spec.logical_axes, rules))

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_leaf)
