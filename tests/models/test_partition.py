"""Head padding for tensor parallelism (`models.partition`): runs on one device, since the padded model must compute
the same function as the original."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward, init_weights
from models.partition import pad_weights, padded_config, tp_layout

SMOL_SHAPED = ModelConfig(architecture="llama", vocab_size=101, hidden_size=48, intermediate_size=70, num_layers=2,
                          num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=64, name="9-over-3")


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 8, 9])
def test_tp_layout_places_every_query_head_once_beside_its_kv_head(tp):
    cfg = SMOL_SHAPED
    layout = tp_layout(cfg, tp)
    assert layout.num_kv_heads % tp == 0 and layout.num_heads % layout.num_kv_heads == 0
    per_slot = layout.num_heads // layout.num_kv_heads
    real = layout.q_source[layout.q_valid]
    assert sorted(real.tolist()) == list(range(cfg.num_heads))  # each original head exactly once
    slot_kv = layout.kv_source[np.arange(layout.num_heads) // per_slot]
    np.testing.assert_array_equal(slot_kv[layout.q_valid], real // cfg.num_queries_per_kv)  # beside its KV head
    assert layout.heads_identity == (cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0)


def test_tp_beyond_query_heads_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"tp=16 is more than the model's 9 query heads"):
        tp_layout(SMOL_SHAPED, 16)


def test_vocabulary_pads_to_its_own_shards():
    # pp = 3 x tp = 2: the vocabulary splits over 6 devices (101 -> 102 rows), the MLP over tp only (70 stays)
    layout = tp_layout(SMOL_SHAPED, 2, vocab_shards=6)
    pcfg = padded_config(SMOL_SHAPED, layout)
    assert (pcfg.vocab_size, pcfg.intermediate_size) == (102, 70)
    weights = jax.tree.map(np.asarray, init_weights(SMOL_SHAPED, jax.random.key(0), jnp.float32))
    padded = pad_weights(weights, Weights.abstract(SMOL_SHAPED), layout)
    assert padded.embed.shape == (102, 48) and padded.lm_head.shape == (48, 102)
    np.testing.assert_array_equal(padded.embed[:101], weights.embed)
    np.testing.assert_array_equal(padded.embed[101:], 0)
    np.testing.assert_array_equal(padded.lm_head[:, 101:], 0)
    assert tp_layout(SMOL_SHAPED, 2).vocab_shards == 2  # default: tp
    with pytest.raises(ValueError, match="vocab_shards=3 must be a positive multiple of tp=2"):
        tp_layout(SMOL_SHAPED, 2, vocab_shards=3)


def _tiny_batch(cfg, page_size=4):
    q_lens = [7, 3]
    pages = [[1, 2], [3, 0]]
    tokens = (np.arange(10, dtype=np.int32) * 13) % cfg.vocab_size
    positions = np.concatenate([np.arange(7), np.arange(3)]).astype(np.int32)
    kv_loc = np.array([pages[0][p // page_size] * page_size + p % page_size for p in range(7)]
                      + [pages[1][p // page_size] * page_size + p % page_size for p in range(3)], np.int32)
    return tokens, AttentionMetadata(positions=positions, cu_q_lens=np.array([0, 7, 10], np.int32),
                                     kv_lens=np.array(q_lens, np.int32), page_table=np.array(pages, np.int32),
                                     kv_loc=kv_loc, logits_indices=np.arange(10, dtype=np.int32), max_q_len=8)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("tied", [True, False])
def test_padded_model_computes_the_same_logits(tp, tied):
    cfg = dataclasses.replace(SMOL_SHAPED, tie_word_embeddings=tied)
    weights = jax.tree.map(np.asarray, init_weights(cfg, jax.random.key(1), jnp.float32))
    layout = tp_layout(cfg, tp)
    pcfg = padded_config(cfg, layout)
    assert pcfg.vocab_size % tp == 0 and pcfg.intermediate_size % tp == 0
    padded = pad_weights(weights, Weights.abstract(cfg), layout)
    tokens, meta = _tiny_batch(cfg)
    step = jax.jit(forward, static_argnames=("cfg",))
    want, _ = step(weights, tokens, meta, KVCache.zeros(cfg, 4, 4), cfg=cfg)
    got, _ = step(padded, tokens, meta, KVCache.zeros(pcfg, 4, 4), cfg=pcfg)
    got = np.asarray(got)
    np.testing.assert_allclose(got[:, : cfg.vocab_size], np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, cfg.vocab_size:], 0)  # padded ids: logit 0, masked by the sampler
    # Padding is real work for the padded heads, not a no-op: a wrong layout (heads not regrouped) must differ.
    if not layout.heads_identity:
        wrong = dataclasses.replace(padded.layers, wq=np.roll(padded.layers.wq, 1, axis=2))
        bad, _ = step(dataclasses.replace(padded, layers=wrong), tokens, meta, KVCache.zeros(pcfg, 4, 4), cfg=pcfg)
        assert not np.allclose(np.asarray(bad)[:, : cfg.vocab_size], np.asarray(want), atol=1e-3)
