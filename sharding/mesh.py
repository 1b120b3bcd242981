"""Device meshes: the mesh axis names (defined here once) and mesh construction from parallelism sizes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

DP_AXIS = "dp"  # data parallel: independent replicas
EP_AXIS = "ep"  # expert parallel: MoE experts split
TP_AXIS = "tp"  # tensor parallel: heads and MLP hidden split
MESH_AXES = (DP_AXIS, EP_AXIS, TP_AXIS)


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A `(dp, ep, tp)` mesh over the first dp * ep * tp devices (tp innermost, so TP peers are neighbours).

    Axis types are Auto (the default of `jax.sharding.Mesh`): shardings are propagated by XLA's partitioner.

    Args:
      tp, ep, dp: sizes of the tensor, expert and data axes, each >= 1.
      devices: the devices to use; default `jax.devices()` (all processes' devices in a multi-host run).

    Raises:
      ValueError: a size below 1, or more devices asked for than there are.
    """
    for name, size in (("tp", tp), ("ep", ep), ("dp", dp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer")
    devices = list(jax.devices() if devices is None else devices)
    needed = dp * ep * tp
    if needed > len(devices):
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={needed} gives {needed} devices"
                if devices[0].platform == "cpu" else "")
        raise ValueError(f"a mesh of dp={dp} x ep={ep} x tp={tp} = {needed} devices needs more than the "
                         f"{len(devices)} available{hint}")
    return jax.sharding.Mesh(np.array(devices[:needed]).reshape(dp, ep, tp), MESH_AXES)
