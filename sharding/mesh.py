"""Device meshes: the mesh axis names (defined here once) and mesh construction from parallelism sizes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

DP_AXIS = "dp"  # data parallel: independent replicas
EP_AXIS = "ep"  # expert parallel: MoE experts split
TP_AXIS = "tp"  # tensor parallel: heads and MLP hidden split
PP_AXIS = "pp"  # pipeline parallel: the stage axis, consecutive layers split (models.pipeline)
MESH_AXES = (DP_AXIS, EP_AXIS, TP_AXIS)
PIPELINE_MESH_AXES = (PP_AXIS, *MESH_AXES)


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None,
              pp: int = 1) -> jax.sharding.Mesh:
    """A `(dp, ep, tp)` mesh over the first dp * ep * tp devices (tp innermost, so TP peers are neighbours); with
    pp > 1 a `(pp, dp, ep, tp)` mesh over pp * dp * ep * tp devices, stage s on the s-th block of consecutive
    devices (`PIPELINE_MESH_AXES`; in a multi-host run with one stage per host, a stage's devices are one host's).

    Axis types are Auto (the default of `jax.sharding.Mesh`): shardings are propagated by XLA's partitioner.

    Args:
      tp, ep, dp, pp: sizes of the tensor, expert, data and pipeline axes, each >= 1.
      devices: the devices to use; default `jax.devices()` (all processes' devices in a multi-host run).

    Raises:
      ValueError: a size below 1, or more devices asked for than there are.
    """
    for name, size in (("tp", tp), ("ep", ep), ("dp", dp), ("pp", pp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer")
    devices = list(jax.devices() if devices is None else devices)
    needed = pp * dp * ep * tp
    if needed > len(devices):
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={needed} gives {needed} devices"
                if devices[0].platform == "cpu" else "")
        stages = f"pp={pp} x " if pp > 1 else ""
        raise ValueError(f"a mesh of {stages}dp={dp} x ep={ep} x tp={tp} = {needed} devices needs more than the "
                         f"{len(devices)} available{hint}")
    if pp == 1:
        return jax.sharding.Mesh(np.array(devices[:needed]).reshape(dp, ep, tp), MESH_AXES)
    return jax.sharding.Mesh(np.array(devices[:needed]).reshape(pp, dp, ep, tp), PIPELINE_MESH_AXES)


def pipeline_stages(mesh: jax.sharding.Mesh | None) -> int:
    """The size of the mesh's stage axis (1 without a mesh or without one)."""
    return 1 if mesh is None or PP_AXIS not in mesh.axis_names else mesh.shape[PP_AXIS]
