"""Quantized orbax checkpoints restored onto meshes of 8 fake CPU devices: run by
tests/jaxinfer/loading/test_orbax.py in a child process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`.

A quantized checkpoint restores onto the mesh (values and scales each read into the sharding of the weight they
quantize) and `shard_model` pads it as stored. Each case is checked against independent routes:
- the weights equal, bit for bit and sharding spec for sharding spec, those of quantizing at load on the mesh
  (`shard_model` of the float source, then `models.quant_sharding.quantize_sharded`), which quantizes the padded float
  weights: so padding the stored values and scales equals quantizing the padded weights;
- the logits of a ragged prefill batch equal the single-device quantized model's (the restored checkpoint without a
  mesh) within 1e-4 (float32; only the order of sums differs), and greedy tokens through the engine are the same.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer.loading import convert, load_model
from models.llama import KVCache
from models.quant import QuantizationConfig, QuantizedWeight
from models.quant_matmul import native_matmuls
from models.quant_sharding import quantize_sharded
from sharding.mesh import make_mesh
from models.partition import shard_model
from tests.jaxinfer.loading.multi_device_orbax_checks import (NUM_PAGES, PAGE_SIZE, _batch, _logits, _step,
                                                              make_tiny_hf_folder)

DATA = Path(__file__).resolve().parents[2] / "data"
F32 = np.dtype(np.float32)
INT8 = {"format": "int8"}
FP8_G16 = {"format": "fp8", "group_size": 16}
INT8_TIED_FLOAT_HEAD = {"format": "int8", "quantize_lm_head": False}

is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {name: make_tiny_hf_folder(root / name, DATA / name) for name in ("tiny_llama3", "tiny_qwen2")}


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory):
    """(source name, quantization as JSON) -> quantized checkpoint folder, converted once."""
    cache: dict = {}

    def get(name: str, quantization: dict) -> Path:
        key = (name, str(sorted(quantization.items())))
        if key not in cache:
            cache[key] = convert(sources[name], tmp_path_factory.mktemp("ckpt") / "q",
                                 quantization=quantization)
        return cache[key]

    return get


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


def _sharded_logits(cfg, sharded) -> np.ndarray:
    """Logits of `_batch(cfg)` (tokens drawn from the unpadded vocabulary) through the padded, sharded model."""
    tokens, meta = _batch(cfg)
    cache = KVCache.zeros(sharded.cfg, NUM_PAGES, PAGE_SIZE, jnp.float32)
    cache = jax.device_put(cache, KVCache(k=sharded.kv_cache_sharding(), v=sharded.kv_cache_sharding()))
    logits, _ = _step(sharded.weights, tokens, meta, cache, cfg=sharded.cfg)
    return np.asarray(logits)[:, :cfg.vocab_size]


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("name, quantization, tp", [
    ("tiny_llama3", FP8_G16, 2),  # per-group scales split with their weights' contracted axis
    # 2 groups of w_down's 128 inputs do not split 4 ways: its scale is replicated (quantize_sharded too); the 2 KV
    # heads are replicated into 4 slots
    ("tiny_llama3", {"format": "fp8", "group_size": 64}, 4),
    ("tiny_qwen2", INT8_TIED_FLOAT_HEAD, 2),  # tied, with the head a separate float weight
    ("tiny_llama3", INT8, 3),  # padded: 4 -> 6 query heads (2 zero slots), 2 -> 3 KV heads, MLP and vocab 128 -> 129
    ("tiny_llama3", {"format": "nvfp4"}, 2),  # packed values, e4m3 block scales, per-layer f32 tensor scales
], ids=["fp8-g16-tp2", "fp8-g64-tp4", "int8-tied-float-head-tp2", "int8-tp3-padded", "nvfp4-tp2"])
def test_quantized_checkpoint_restores_sharded(name, quantization, tp, sources, checkpoints):
    ckpt = checkpoints(name, quantization)
    mesh = make_mesh(tp=tp)
    cfg, restored, _ = load_model(ckpt, F32, mesh=mesh)
    assert restored.layers.wq.values.sharding.mesh == mesh  # restored straight onto the mesh, then padded
    sharded = shard_model(cfg, restored, mesh)

    # Quantizing at load on the mesh: the padded float weights quantized on device.
    src_cfg, src_weights, _ = load_model(sources[name], F32)
    reference = shard_model(src_cfg, src_weights, mesh)
    qref = quantize_sharded(reference.weights, reference.cfg, QuantizationConfig.from_value(quantization),
                            jnp.float32)
    assert sharded.cfg == reference.cfg
    assert jax.tree.structure(sharded.weights) == jax.tree.structure(qref)  # static fields included
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(sharded.weights)[0], jax.tree.leaves(qref)):
        where = jax.tree_util.keystr(path)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.sharding.spec == want.sharding.spec, (where, got.sharding.spec, want.sharding.spec)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=where)

    # Scales are split like their weights: explicitly, on the output-major layouts.
    L, D = cfg.num_layers, cfg.hidden_size
    N, K, F, V = (sharded.cfg.num_heads, sharded.cfg.num_kv_heads, sharded.cfg.intermediate_size,
                  sharded.cfg.vocab_size)
    wq, wk, w_up, w_down = (sharded.weights.layers.wq, sharded.weights.layers.wk, sharded.weights.layers.w_up,
                            sharded.weights.layers.w_down)
    assert wq.values.sharding.spec == P(None, "tp", None, None) == wq.scale.sharding.spec  # [L, N, H, D], [L, N, H, 1]
    assert wq.scale.addressable_shards[0].data.shape[:3] == (L, N // tp, cfg.head_dim)
    assert wk.scale.addressable_shards[0].data.shape[:3] == (L, K // tp, cfg.head_dim)
    assert w_up.values.sharding.spec == P(None, "tp", None) == w_up.scale.sharding.spec  # [L, F, D], [L, F, G]
    assert w_up.scale.addressable_shards[0].data.shape[:2] == (L, F // tp)
    assert w_down.values.sharding.spec == P(None, None, "tp")  # [L, D, F]: contracted F split (nvfp4: F / 2 bytes)
    if w_down.tensor_scale is not None:  # nvfp4: one f32 per layer, on every device
        assert w_down.tensor_scale.shape == (L, 1, 1) and w_down.tensor_scale.sharding.is_fully_replicated
    group_size = QuantizationConfig.from_value(quantization).group_size
    groups = F // group_size if group_size else 1
    assert w_down.scale.shape == (L, D, groups)
    assert w_down.scale.sharding.spec == (P(None, None, "tp") if groups % tp == 0 else P(None, None, None))
    head = sharded.weights.lm_head
    if is_q(sharded.weights.embed):
        assert sharded.weights.embed.scale.addressable_shards[0].data.shape == (V // tp, 1)
    if is_q(head):  # [D, V] stored [V, D], scale [V, G]
        assert head.values.sharding.spec == P("tp", None) and head.scale.sharding.spec == P("tp", None)
        assert head.scale.addressable_shards[0].data.shape[0] == V // tp
    elif head is not None:  # a float head (untied, fp8's default; or a tied model's separate head)
        assert head.addressable_shards[0].data.shape == (D, V // tp)

    # Logits: the single-device quantized model (the checkpoint restored to the host).
    _, host_weights, _ = load_model(ckpt, F32)
    with native_matmuls(False):  # XLA's dots on both sides (the native kernels round int4's activation rows)
        expected = _logits(cfg, jax.tree.map(jnp.asarray, host_weights))
        got = _sharded_logits(cfg, sharded)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_engine_tp2_and_pp2_generate_the_single_device_tokens(checkpoints):
    # pp = 2: the two layers' quantized values and scales restored straight into their stages
    # (tests/sharding/multi_device_pipeline_checks.py: uneven splits, int4)
    from jaxinfer import LLM, SamplingParams

    ckpt = checkpoints("tiny_llama3", INT8)
    params = SamplingParams(max_tokens=10, temperature=0)
    prompt = {"prompt_token_ids": [1, 40, 50, 60, 70, 33, 21]}
    outputs = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(str(ckpt), tensor_parallel_size=tp, pipeline_parallel_size=pp, warmup=False,
                  kv_cache_memory_bytes=1 << 20)
        assert llm.engine.quantization == QuantizationConfig.from_value(INT8).resolved()
        outputs[tp, pp] = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert len(outputs[1, 1]) == 10 and outputs[2, 1] == outputs[1, 1] and outputs[1, 2] == outputs[1, 1]
    assert llm.runner.weights.layers.wq.values.sharding.spec[0] == "pp"
    embed = llm.runner.weights.embed  # the int8 table's rows and their scales split over pp x tp, 64 a device
    assert embed.values.sharding.spec[0] == embed.scale.sharding.spec[0] == ("pp", "tp")
    assert embed.values.addressable_shards[0].data.shape[0] == embed.scale.addressable_shards[0].data.shape[0] == 64


def test_group_size_that_padding_would_split_is_refused(checkpoints):
    # tp=3 pads the MLP from 128 to 129: one zero input channel of w_down, not a whole group of 16.
    ckpt = checkpoints("tiny_llama3", FP8_G16)
    mesh = make_mesh(tp=3)
    cfg, restored, _ = load_model(ckpt, F32, mesh=mesh)
    with pytest.raises(ValueError, match="group_size 16 along its mlp axis of size 128 cannot be padded to 129"):
        shard_model(cfg, restored, mesh)
