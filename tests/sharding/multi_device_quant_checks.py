"""Quantized weights on a mesh (run by `test_sharding.py` in a child process with 8 fake CPU devices): scales shard
with their weights, and the sharded quantized model computes what the single-device quantized model does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.config import ModelConfig
from models.llama import KVCache, Weights, forward, init_weights
from models.partition import shard_model
from models.quant import QuantizationConfig, QuantizedWeight
from models.quant_matmul import native_matmuls
from models.quant_sharding import quantize_sharded
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec
from tests.sharding.multi_device_checks import NUM_PAGES, PAGE_SIZE, TINY, _batch


@pytest.fixture(autouse=True)
def _xla_dots():
    """The single-device references on XLA's dots, as the meshes run them: the native CPU kernels (off on a mesh)
    round int8 / int4 activation rows to int16, and take steps of up to 32 rows (`cpu_gemv.row_limit`)."""
    with native_matmuls(False):
        yield


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


def test_int4_quantized_before_sharding_pads_and_shards_as_the_single_device_model():
    # Asymmetric int4 weights that arrive quantized (a GGUF's Q4_1 kept as stored): 9 query heads over 3 KV heads,
    # an MLP of 70 and a vocabulary of 101 are padded for tp=4 as stored (zero slots: code 0 with min 0; w_down's
    # groups of 2 along its packed MLP axis padded in bytes), then sharded with their mins. The symmetric zero
    # code and the bits of every padded weight: tests/jaxinfer/loading/test_orbax_quant.py.
    cfg = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=70, num_layers=2,
                      num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=64, name="9-over-3")
    weights = init_weights(cfg, jax.random.key(3), jnp.float32)
    single = quant.quantize_weights(weights, cfg, QuantizationConfig("int4"), jnp.float32)
    asym = lambda q, w: quant.quantize(w, "int4", q.contract_axes, group_size=q.group_size,  # noqa: E731
                                       asymmetric=True) if isinstance(q, QuantizedWeight) else q
    single = single.replace(layers=jax.tree.map(asym, single.layers, weights.layers,
                                                is_leaf=lambda x: isinstance(x, QuantizedWeight)))
    assert single.layers.wq.min is not None and single.layers.w_down.group_size == 2
    tokens, meta = _batch(cfg.vocab_size)
    step = jax.jit(forward, static_argnames=("cfg",))
    expected, _ = step(single, tokens, meta, KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32), cfg=cfg)

    model = shard_model(cfg, jax.tree.map(np.asarray, single), make_mesh(tp=4))
    assert model.cfg.num_heads > cfg.num_heads and model.cfg.intermediate_size == 72
    cache_sharding = jax.sharding.NamedSharding(model.mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(KVCache.zeros(model.cfg, NUM_PAGES, PAGE_SIZE, jnp.float32),
                           KVCache(k=cache_sharding, v=cache_sharding))
    assert model.weights.layers.wq.min.sharding.spec == model.weights.layers.wq.scale.sharding.spec
    got, _ = step(model.weights, tokens, meta, cache, cfg=model.cfg)
    np.testing.assert_allclose(np.asarray(got)[:, : cfg.vocab_size], np.asarray(expected), rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(got)[:, cfg.vocab_size:], 0)
