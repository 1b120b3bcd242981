"""Pre-quantized HF folders (tests/data/prequantized) on meshes of 4 fake CPU devices: run by
tests/jaxinfer/loading/test_prequantized.py in a child process with `XLA_FLAGS=--xla_force_host_platform_device_count=4`.

At tp=2 tiny_llama3's 4 query heads, 2 KV heads and MLP width 128 split evenly, so `shard_model` moves the stored
values and scales as they are: the logits equal the single-device model's within 1e-4 (float32; only the order of
sums differs). At tp=4 the 2 KV heads would be replicated into 4 slots and the query heads regrouped: packed int4
weights and fp8 groups spanning heads are then refused with a `ValueError` naming tp (per-channel fp8 pads exactly,
as for quantized orbax checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer.loading.hf import load_hf_weights
from models.partition import shard_model
from models.quant_matmul import native_matmuls
from sharding.mesh import make_mesh
from tests.jaxinfer.loading.multi_device_orbax_checks import _logits

PREQUANTIZED = Path(__file__).resolve().parents[2] / "data" / "prequantized"


def test_four_devices():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize("case", ["gptq_asym", "fp8_block"])
def test_prequantized_weights_shard_as_stored(case, tp=2):
    cfg, weights = load_hf_weights(PREQUANTIZED / case)
    with native_matmuls(False):  # XLA's dots on both sides (the native kernels round int4's activation rows)
        expected = _logits(cfg, weights)
        sharded = shard_model(cfg, weights, make_mesh(tp=tp))
        assert sharded.weights.layers.wq.values.dtype == weights.layers.wq.values.dtype
        got = _logits(sharded.cfg, sharded.weights, sharded.kv_cache_sharding())
    np.testing.assert_allclose(got[:, :cfg.vocab_size], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case, message", [
    ("gptq", r"a int4 weight of shape \(2, 4, 16, 64\) stored with group_size 32 cannot be padded for tp=4 "
             r"\(its groups span more than its last input axis\)"),
    ("fp8_block", r"cannot be padded for tp=4 \(its groups span more than its last input axis\)"),
])
def test_padding_that_would_split_spanning_groups_is_refused(case, message):
    cfg, weights = load_hf_weights(PREQUANTIZED / case)
    with pytest.raises(ValueError, match=message):
        shard_model(cfg, weights, make_mesh(tp=4))
