"""Sharding rules; the multi-device checks run in a child process with 8 fake CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharding.rules import HEADS, KV_HEADS, logical_to_spec

HERE = Path(__file__).resolve().parent


def test_logical_to_spec_maps_and_refuses_a_mesh_axis_twice():
    assert tuple(logical_to_spec(("layers", "embed", HEADS, "head_dim"))) == (None, None, "tp", None)
    with pytest.raises(ValueError, match="used twice"):
        logical_to_spec((HEADS, KV_HEADS))


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
