"""Placing arrays on a mesh: shardings for a tree of weight specs whose sizes may not divide, and host arrays onto
devices. Model-free: callers hand in the tree of objects with `.shape` and `.logical_axes` (or the shardings)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding.rules import DEFAULT_RULES, Rules, logical_to_spec, mesh_axes_size


def replicated_where_indivisible(specs: Any, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """`NamedSharding`s of the *unpadded* weights: split as the rules say where sizes divide, else replicated.

    This is what a checkpoint is restored into before `models.partition.pad_weights` runs on device (sharded in,
    sharded out).
    """
    def one(spec: Any) -> NamedSharding:
        parts = [m if size % mesh_axes_size(mesh, m) == 0 else None
                 for size, m in zip(spec.shape, logical_to_spec(spec.logical_axes, rules))]
        return NamedSharding(mesh, PartitionSpec(*parts))

    return jax.tree.map(one, specs, is_leaf=lambda x: hasattr(x, "logical_axes"))


def put_sharded(tree: Any, shardings: Any) -> Any:
    """Places host (numpy) arrays with their shardings; works when the mesh spans several processes (each process
    holds the whole host array and copies only its addressable shards)."""
    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, tree, shardings)
