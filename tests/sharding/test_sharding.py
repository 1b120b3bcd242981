"""Sharding rules; the multi-device checks run in a child process with 8 fake CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from sharding.mesh import PIPELINE_MESH_AXES
from sharding.rules import (EMBED, HEADS, KV_HEADS, LAYERS, PIPELINE_RULES, VOCAB, check_divisible, logical_to_spec,
                            mesh_axes_size)

HERE = Path(__file__).resolve().parent


def test_logical_to_spec_maps_and_refuses_a_mesh_axis_twice():
    assert tuple(logical_to_spec(("layers", "embed", HEADS, "head_dim"))) == (None, None, "tp", None)
    with pytest.raises(ValueError, match="used twice"):
        logical_to_spec((HEADS, KV_HEADS))


def test_pipeline_rules_split_the_vocabulary_over_stages_and_tp():
    assert logical_to_spec((VOCAB, EMBED), PIPELINE_RULES) == P(("pp", "tp"), None)
    assert logical_to_spec((LAYERS, EMBED, HEADS), PIPELINE_RULES) == P("pp", None, "tp")
    with pytest.raises(ValueError, match="used twice"):  # pp inside a tuple counts too
        logical_to_spec((LAYERS, VOCAB), PIPELINE_RULES)
    mesh = jax.sharding.AbstractMesh((3, 1, 1, 2), PIPELINE_MESH_AXES)  # pp = 3 x tp = 2
    assert mesh_axes_size(mesh, ("pp", "tp")) == 6 and mesh_axes_size(mesh, "tp") == 2
    assert mesh_axes_size(mesh, None) == 1
    check_divisible((12, 5), (VOCAB, EMBED), mesh, PIPELINE_RULES)
    with pytest.raises(ValueError, match=r"vocab = 8 is not a multiple of \('pp', 'tp'\) = 6"):
        check_divisible((8, 5), (VOCAB, EMBED), mesh, PIPELINE_RULES)


@pytest.mark.parametrize("checks", ["multi_device_checks.py", "multi_device_moe_checks.py",
                                    "multi_device_quant_checks.py", "multi_device_family_checks.py",
                                    "multi_device_pipeline_checks.py"])
def test_on_eight_fake_devices(checks):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(HERE / checks)], capture_output=True, text=True, env=env,
                       cwd=HERE.parents[1], timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
