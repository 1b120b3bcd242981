"""orbax checkpoints restored onto meshes of 8 fake CPU devices: run by tests/jaxinfer/loading/test_orbax.py in a
child process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`.

The checkpoints are tiny_llama3 (4 query heads, 2 KV heads, MLP 128, vocabulary 128, two layers) and tiny_mixtral
(the same attention, 8 experts of width 32, top-2), converted from HF safetensors with a made-up character tokenizer. Each restore is checked three ways: every array's per-device shard
shape is what its target sharding says (the split is real, not a silent full replication), its values equal the
source's, and the logits of a ragged prefill batch equal the single-device source's within 1e-4 (float32).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from jax.sharding import NamedSharding

from jaxinfer.loading import convert, load_model, orbax
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward
from sharding.mesh import make_mesh
from models.partition import shard_model
from sharding.placement import put_sharded, replicated_where_indivisible

DATA = Path(__file__).resolve().parents[2] / "data"
TINY_SRC = DATA / "tiny_llama3"
PAGE_SIZE, NUM_PAGES = 4, 12


def make_tiny_hf_folder(folder: Path, src: Path = TINY_SRC) -> Path:
    """A copy of a tiny HF model folder (vocabulary 128) plus a character-level tokenizer (<unk>, <s>, </s>, then
    characters)."""
    shutil.copytree(src, folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 32 + 125):
        vocab[chr(code)] = len(vocab)
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
    return folder


def _batch(cfg: ModelConfig) -> tuple[np.ndarray, AttentionMetadata]:
    """Two prefill sequences of 7 and 4 tokens on pages [2, 5] and [9]."""
    lens, pages = [7, 4], [[2, 5], [9]]
    tokens = (np.arange(11, dtype=np.int32) * 13 + 5) % cfg.vocab_size
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    kv_loc = np.array([pages[s][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for s, n in enumerate(lens)
                       for p in range(n)], np.int32)
    meta = AttentionMetadata(positions=positions, cu_q_lens=np.array([0, 7, 11], np.int32),
                             kv_lens=np.array(lens, np.int32), page_table=np.array([[2, 5], [9, 0]], np.int32),
                             kv_loc=kv_loc, logits_indices=np.arange(11, dtype=np.int32), max_q_len=8)
    return tokens, meta


_step = jax.jit(forward, static_argnames=("cfg", "mesh"))


def _logits(cfg: ModelConfig, weights: Weights, cache_sharding: NamedSharding | None = None,
            mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    tokens, meta = _batch(cfg)
    cache = KVCache.zeros(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32)
    if cache_sharding is not None:
        cache = jax.device_put(cache, KVCache(k=cache_sharding, v=cache_sharding))
    logits, _ = _step(weights, tokens, meta, cache, cfg=cfg, mesh=mesh)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(folder, config, host weights, single-device logits) of the HF source."""
    folder = make_tiny_hf_folder(tmp_path_factory.mktemp("src") / "tiny")
    cfg, weights, _ = load_model(folder, np.dtype(np.float32))
    return folder, cfg, weights, _logits(cfg, weights)


@pytest.fixture(scope="module")
def host_checkpoint(source, tmp_path_factory):
    """Converted from the HF folder: saved unsharded from host numpy arrays."""
    return convert(source[0], tmp_path_factory.mktemp("ckpt") / "host")


@pytest.fixture(scope="module")
def sharded_checkpoint(source, tmp_path_factory):
    """Saved from jax arrays sharded over a tp=2 mesh (orbax writes each shard)."""
    folder, cfg, weights, _ = source
    mesh = make_mesh(tp=2)
    placed = put_sharded(weights, replicated_where_indivisible(Weights.abstract(cfg), mesh))
    assert placed.layers.wq.addressable_shards[0].data.shape[2] == cfg.num_heads // 2
    _, _, tokenizer = load_model(folder, np.dtype(np.float32))
    return orbax.save(tmp_path_factory.mktemp("ckpt") / "sharded", cfg, placed, tokenizer,
                      source="tp=2 mesh")


def _check_shards(restored: Weights, source_weights: Weights, shardings: Weights) -> None:
    """Each restored array is laid out as its target sharding says and holds the source's values."""
    for x, ref, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(source_weights), jax.tree.leaves(shardings)):
        assert isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)
        assert x.addressable_shards[0].data.shape == sharding.shard_shape(x.shape)
        np.testing.assert_array_equal(np.asarray(x), ref)


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("which", ["host_checkpoint", "sharded_checkpoint"])
def test_restore_onto_tp4_then_shard_model(which, source, request):
    _, cfg, weights, expected = source
    mesh = make_mesh(tp=4)
    shardings = replicated_where_indivisible(Weights.abstract(cfg), mesh)
    _, restored, _ = load_model(request.getfixturevalue(which), np.dtype(np.float32), mesh=mesh)
    _check_shards(restored, weights, shardings)
    L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size)
    assert restored.layers.wq.addressable_shards[0].data.shape == (L, D, N // 4, H)
    assert restored.layers.wk.addressable_shards[0].data.shape == (L, D, K, H)  # 2 KV heads: replicated over 4
    assert restored.layers.w_down.addressable_shards[0].data.shape == (L, F // 4, D)
    assert restored.embed.addressable_shards[0].data.shape == (V // 4, D)
    assert restored.lm_head.addressable_shards[0].data.shape == (D, V // 4)

    sharded = shard_model(cfg, restored, mesh)  # pads KV heads to 4 slots on device
    assert sharded.weights.layers.wk.addressable_shards[0].data.shape == (L, D, 1, H)
    got = _logits(sharded.cfg, sharded.weights, sharded.kv_cache_sharding())
    np.testing.assert_allclose(got[:, :V], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["host_checkpoint", "sharded_checkpoint"])
def test_restore_onto_tp2_ep2(which, source, request):
    # A dense model has no expert axis to split, so shard_model refuses ep > 1: the restored weights (split over
    # tp, replicated over ep) run through a plain jitted forward; XLA partitions it from the inputs' shardings.
    _, cfg, weights, expected = source
    mesh = make_mesh(tp=2, ep=2)
    shardings = replicated_where_indivisible(Weights.abstract(cfg), mesh)
    _, restored, _ = load_model(request.getfixturevalue(which), np.dtype(np.float32), mesh=mesh)
    _check_shards(restored, weights, shardings)
    L, D, N, K, H = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert restored.layers.wq.addressable_shards[0].data.shape == (L, D, N // 2, H)
    assert restored.layers.wk.addressable_shards[0].data.shape == (L, D, K // 2, H)
    assert len(restored.layers.wq.sharding.device_set) == 4
    np.testing.assert_allclose(_logits(cfg, restored), expected, rtol=1e-4, atol=1e-4)


def test_restore_casts_to_bfloat16_on_the_mesh(host_checkpoint, source):
    _, cfg, weights, _ = source
    mesh = make_mesh(tp=4)
    _, restored, _ = load_model(host_checkpoint, np.dtype(jnp.bfloat16), mesh=mesh)
    assert restored.layers.w_up.dtype == jnp.bfloat16
    assert restored.layers.w_up.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size,
                                                                     cfg.intermediate_size // 4)
    np.testing.assert_array_equal(np.asarray(restored.layers.w_up), weights.layers.w_up.astype(jnp.bfloat16))


def test_moe_checkpoint_restores_onto_tp2_ep2(tmp_path):
    folder = make_tiny_hf_folder(tmp_path / "mixtral", DATA / "tiny_mixtral")
    cfg, weights, _ = load_model(folder, np.dtype(np.float32))
    assert cfg.num_experts == 8
    expected = _logits(cfg, weights)
    ckpt = convert(folder, tmp_path / "ckpt")
    mesh = make_mesh(tp=2, ep=2)
    _, restored, _ = load_model(ckpt, np.dtype(np.float32), mesh=mesh)
    _check_shards(restored, weights, replicated_where_indivisible(Weights.abstract(cfg), mesh))
    L, E, D, Fe = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert restored.layers.e_gate.addressable_shards[0].data.shape == (L, E // 2, D, Fe // 2)
    assert restored.layers.e_down.addressable_shards[0].data.shape == (L, E // 2, Fe // 2, D)
    sharded = shard_model(cfg, restored, mesh)
    got = _logits(sharded.cfg, sharded.weights, sharded.kv_cache_sharding(), mesh=mesh)
    np.testing.assert_allclose(got[:, :cfg.vocab_size], expected, rtol=1e-4, atol=1e-4)
