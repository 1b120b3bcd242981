"""Quantized weights on a mesh (run by `test_sharding.py` in a child process with 8 fake CPU devices): scales shard
with their weights, and the sharded quantized model computes what the single-device quantized model does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.llama import KVCache, Weights, forward, init_weights
from models.partition import shard_model
from models.quant import QuantizationConfig, QuantizedWeight
from models.quant_sharding import quantize_sharded
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec
from tests.sharding.multi_device_checks import NUM_PAGES, PAGE_SIZE, TINY, _batch


@pytest.mark.parametrize("qcfg,tp", [(qcfg, tp) for qcfg in (
    QuantizationConfig("int8", quantize_activations=True), QuantizationConfig("fp8", group_size=16),
    QuantizationConfig("int8", quantize_embedding=False), QuantizationConfig("int4")) for tp in (2, 4)] + [
    (QuantizationConfig("mxfp8", quantize_activations=True), 4), (QuantizationConfig("nvfp4"), 4)])  # time: tp 4 only
def test_sharded_quantization_equals_single_device_and_scales_follow_their_weights(qcfg, tp):
    weights = init_weights(TINY, jax.random.key(0), jnp.float32)
    tokens, meta = _batch()
    step = jax.jit(forward, static_argnames=("cfg",))
    single = quant.quantize_weights(weights, TINY, qcfg, jnp.float32)
    expected, _ = step(single, tokens, meta, KVCache.zeros(TINY, NUM_PAGES, PAGE_SIZE, jnp.float32), cfg=TINY)

    model = shard_model(TINY, jax.tree.map(np.asarray, weights), make_mesh(tp=tp))
    sharded = quantize_sharded(model.weights, model.cfg, qcfg, jnp.float32)
    # values and scales are bit-identical to quantizing on one device (TINY divides every tp: no padding)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    wq = sharded.layers.wq  # [L, D, N, H] stored [L, N, H, D]: heads split tp ways, and so are their scales
    assert isinstance(wq, QuantizedWeight)
    packed = 2 if wq.format in quant.PACKED_FORMATS else 1  # two 4-bit codes per byte along the contracted axis
    assert wq.values.addressable_shards[0].data.shape == (TINY.num_layers, TINY.num_heads // tp, TINY.head_dim,
                                                          TINY.hidden_size // packed)
    groups = TINY.hidden_size // wq.group_size if wq.group_size else 1
    assert wq.scale.addressable_shards[0].data.shape == (TINY.num_layers, TINY.num_heads // tp, TINY.head_dim,
                                                         groups)
    down = sharded.layers.w_down  # [L, F, D] contracts F (split over tp): the scale is replicated over it
    assert down.values.addressable_shards[0].data.shape == (TINY.num_layers, TINY.hidden_size,
                                                            TINY.intermediate_size // tp // packed)
    assert down.scale.sharding.spec[-1] == (None if not down.group_size else "tp")
    if down.tensor_scale is not None:  # nvfp4: one per layer, replicated (layers are not split)
        assert down.tensor_scale.shape == (TINY.num_layers, 1, 1) and down.tensor_scale.sharding.is_fully_replicated
    mesh = model.mesh
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(KVCache.zeros(TINY, NUM_PAGES, PAGE_SIZE, jnp.float32),
                           KVCache(k=cache_sharding, v=cache_sharding))
    got, _ = step(sharded, tokens, meta, cache, cfg=model.cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("ep,tp", [(2, 1), (2, 2)])
def test_quantized_moe_on_an_expert_parallel_mesh_equals_single_device(ep, tp):
    from jaxinfer.loading.hf import load_hf_weights
    from tests.sharding.multi_device_moe_checks import DATA

    cfg, weights = load_hf_weights(DATA / "tiny_mixtral")
    weights = jax.tree.map(np.asarray, weights)
    qcfg = QuantizationConfig("int8")
    tokens, meta = _batch(cfg.vocab_size)
    step = jax.jit(forward, static_argnames=("cfg", "mesh"))
    single = quant.quantize_weights(jax.tree.map(jnp.asarray, weights), cfg, qcfg, jnp.float32)
    assert isinstance(single.layers.e_gate, QuantizedWeight)  # experts stored int8, dequantized for ragged_dot
    expected, _ = step(single, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32), cfg=cfg)

    mesh = make_mesh(tp=tp, ep=ep)
    model = shard_model(cfg, weights, mesh)
    sharded = quantize_sharded(model.weights, model.cfg, qcfg, jnp.float32)
    e_gate = sharded.layers.e_gate  # [L, E, D, Fe] stored [L, E, Fe, D]: experts split over ep, scales with them
    assert e_gate.values.sharding.spec[1] == "ep" and e_gate.scale.sharding.spec[1] == "ep"
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE, jnp.float32),
                           KVCache(k=cache_sharding, v=cache_sharding))
    got, _ = step(sharded, tokens, meta, cache, cfg=model.cfg, mesh=mesh)
    np.testing.assert_allclose(np.asarray(got)[:, : cfg.vocab_size], np.asarray(expected), rtol=2e-4, atol=2e-4)
