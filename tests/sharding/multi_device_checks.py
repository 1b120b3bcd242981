"""Sharding checks that need 8 devices: run by `test_sharding.py` in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (8 fake CPU devices for the whole suite would double the
time of every other test)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward, init_weights
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec, named_shardings

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=256, name="tiny")
PAGE_SIZE, NUM_PAGES = 4, 16


def _is_spec(x) -> bool:
    return hasattr(x, "logical_axes")


def _batch():
    """Two sequences: a 6-token prefill on pages [3, 5] and a 5-token prefill on pages [1, 2]."""
    q_lens, pages = [6, 5], [[3, 5], [1, 2]]
    tokens = np.arange(11, dtype=np.int32) * 7 % TINY.vocab_size
    positions = np.concatenate([np.arange(6), np.arange(5)]).astype(np.int32)
    kv_loc = np.array([pages[0][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(6)]
                      + [pages[1][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(5)], np.int32)
    meta = AttentionMetadata(positions=positions, cu_q_lens=np.array([0, 6, 11], np.int32),
                             kv_lens=np.array(q_lens, np.int32), page_table=np.array(pages, np.int32),
                             kv_loc=kv_loc, logits_indices=np.arange(11, dtype=np.int32), max_q_len=8)
    return tokens, meta


def test_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_single_device_and_shards_are_real(tp):
    weights = init_weights(TINY, jax.random.key(0), jnp.float32)
    tokens, meta = _batch()
    cache = KVCache.zeros(TINY, NUM_PAGES, PAGE_SIZE, jnp.float32)
    step = jax.jit(forward, static_argnames=("cfg",))
    expected, _ = step(weights, tokens, meta, cache, cfg=TINY)

    mesh = make_mesh(tp=tp)
    shardings = named_shardings(Weights.abstract(TINY), mesh, is_leaf=_is_spec)
    sharded = jax.device_put(weights, shardings)
    cache_sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES))
    cache = jax.device_put(cache, KVCache(k=cache_sharding, v=cache_sharding))
    # Per-device shards are what the rules say: heads, kv heads, MLP hidden and vocab split tp ways.
    L, D, N, K, H, F, V = (TINY.num_layers, TINY.hidden_size, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim,
                           TINY.intermediate_size, TINY.vocab_size)
    assert sharded.layers.wq.addressable_shards[0].data.shape == (L, D, N // tp, H)
    assert sharded.layers.wk.addressable_shards[0].data.shape == (L, D, K // tp, H)
    assert sharded.layers.wo.addressable_shards[0].data.shape == (L, N // tp, H, D)
    assert sharded.layers.w_down.addressable_shards[0].data.shape == (L, F // tp, D)
    assert sharded.embed.addressable_shards[0].data.shape == (V // tp, D)
    assert cache.k.addressable_shards[0].data.shape == (L, NUM_PAGES, K // tp, PAGE_SIZE, H)
    assert sharded.layers.attn_norm.addressable_shards[0].data.shape == (L, D)  # replicated
    got, new_cache = step(sharded, tokens, meta, cache, cfg=TINY)  # XLA partitions from the inputs' shardings
    assert new_cache.k.sharding.is_equivalent_to(cache.k.sharding, 5)  # the cache stays split over kv heads
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_indivisible_heads_are_refused_naming_the_numbers():
    cfg = dataclasses.replace(TINY, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_heads = 2 is not a multiple of tp = 4"):
        named_shardings(Weights.abstract(cfg), make_mesh(tp=4), is_leaf=_is_spec)


def test_mesh_sizes_are_checked():
    assert dict(make_mesh(tp=2, ep=2, dp=2).shape) == {"dp": 2, "ep": 2, "tp": 2}
    with pytest.raises(ValueError, match="16 devices"):
        make_mesh(tp=16)
    with pytest.raises(ValueError, match="tp=0"):
        make_mesh(tp=0)
