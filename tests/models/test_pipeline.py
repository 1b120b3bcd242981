"""Pipeline stage layout, the no-op padding layers and the micro-batches' view of a step, on one device (the stages
themselves run in tests/sharding/multi_device_pipeline_checks.py, on 8 fake devices)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, forward, init_weights
from models.pipeline import (check_pipeline, microbatch_metadata, num_microbatches_for, pad_layers, stage_layout,
                             staged_config)

TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, name="tiny")


@pytest.mark.parametrize("num_layers,pp,counts", [(10, 4, (3, 3, 2, 2)), (3, 2, (2, 1)), (4, 4, (1, 1, 1, 1)),
                                                  (30, 1, (30,))])
def test_stage_layout_splits_evenly_earlier_stages_first(num_layers, pp, counts):
    layout = stage_layout(num_layers, pp)
    assert layout.counts == counts and layout.layers_per_stage == max(counts)
    source = layout.source()
    assert len(source) == pp * max(counts)
    assert sorted(source[source >= 0].tolist()) == list(range(num_layers))  # every layer once, in order
    for s, n in enumerate(counts):  # stage s: its n layers, consecutive, then padding
        block = source[s * max(counts) : (s + 1) * max(counts)]
        assert block[:n].tolist() == list(range(sum(counts[:s]), sum(counts[: s + 1]))) and (block[n:] == -1).all()


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more than the model's 3 layers"):
        stage_layout(3, 4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0"):
        stage_layout(3, 0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more than the model's 3 layers"):
        check_pipeline(TINY, 4)


def _batch():
    """One sequence of 5 new tokens after 2 cached ones (pages 1, 2 of 4 tokens), 8 rows."""
    positions = np.array([2, 3, 4, 5, 6, 0, 0, 0], np.int32)
    kv_loc = np.array([6, 7, 8, 9, 10, 0, 0, 0], np.int32)
    meta = AttentionMetadata(positions=positions, cu_q_lens=np.array([0, 5, 5], np.int32),
                             kv_lens=np.array([7, 0], np.int32), page_table=np.array([[1, 2], [0, 0]], np.int32),
                             kv_loc=kv_loc, logits_indices=np.array([4, 0], np.int32), max_q_len=8)
    return np.array([5, 9, 11, 3, 7, 0, 0, 0], np.int32), meta


# Gemma 2-style windows: a window of 2 (the batch's context is 7) on layers 0 and 2, full attention on layer 1;
# MoE layers with a shared expert (a zero router still picks experts, whose zero weights add nothing)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


@pytest.mark.parametrize("windows,moe", [(None, {}), ((2, None, 2), {}), (None, MOE)])
def test_zero_padding_layers_are_exact_no_ops(windows, moe):
    # 3 layers over 2 stages: slots [0, 1 | 2, pad]; the padded stack run as one model gives the same logits
    model = dataclasses.replace(TINY, layer_sliding_windows=windows, **moe)
    weights = init_weights(model, jax.random.key(0))
    layout = stage_layout(3, 2)
    cfg = staged_config(model, layout)
    assert cfg.layer_sliding_windows == (None if windows is None else (2, None, 2, 2))  # each slot its layer's
    tokens, meta = _batch()
    run = jax.jit(forward, static_argnames=("cfg", "scan_layers"))
    want, want_cache = run(weights, tokens, meta, KVCache.zeros(model, 4, 4), cfg=model, scan_layers=True)
    got, got_cache = run(pad_layers(weights, layout), tokens, meta, KVCache.zeros(cfg, 4, 4), cfg=cfg,
                         scan_layers=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_cache.k)[:3], np.asarray(want_cache.k), rtol=1e-6, atol=1e-6)
    assert not np.asarray(got_cache.k)[3].any()  # the padding layer's K are zeros


@pytest.mark.parametrize("num_layers,pp,blocks", [(5, 2, [0, 1, 2, 3, 4, -1]), (5, 4, [0, 1, 2, 3, 4, -1, -1, -1]),
                                                  (4, 2, [0, 1, 2, 3])])
def test_blocks_are_the_stack_padded_at_its_end(num_layers, pp, blocks):
    layout = stage_layout(num_layers, pp)
    assert layout.blocks().tolist() == blocks
    assert (layout.blocks() == layout.source()).all() == (pp == 2 or num_layers % pp == 0)


def test_padding_layers_of_quantized_weights_have_zero_bits_on_host_and_device():
    # found here: jnp.zeros of float8_e8m0fnu (mxfp8 / mxfp4 scales) is NaN, which made a padding layer's weights
    # NaN (NaN scale times zero values) when the weights were jax arrays; numpy gives bits 0 (2^-127)
    qcfg = quant.QuantizationConfig.from_value({"format": "mxfp8"})
    weights = quant.quantize_weights(init_weights(TINY, jax.random.key(1)), cfg=TINY, qcfg=qcfg, dtype=jnp.float32)
    layout = stage_layout(3, 2)
    on_device, on_host = pad_layers(weights, layout), pad_layers(jax.tree.map(np.asarray, weights), layout)
    for got, want in zip(jax.tree.leaves(on_device.layers), jax.tree.leaves(on_host.layers), strict=True):
        view = lambda x: np.asarray(x).view(np.uint8) if np.asarray(x).dtype.itemsize == 1 else np.asarray(x)  # noqa: E731
        np.testing.assert_array_equal(view(got), view(want))
    padding = np.asarray(on_device.layers.wq.dequantize())[3]  # slot 3: stage 1's padding layer
    assert np.isfinite(padding).all() and not padding.any()


def test_microbatches_see_their_rows_as_chunks():
    # rows of 2 sequences: a (6 new tokens after 3 cached: kv_len 9) at rows 0-5, b (5 new, none cached) at 6-10,
    # padding rows 11-15; micro-batches of 4 rows
    meta = AttentionMetadata(positions=np.arange(16, dtype=np.int32), cu_q_lens=np.array([0, 6, 11, 11], np.int32),
                             kv_lens=np.array([9, 5, 0], np.int32), page_table=np.zeros((3, 4), np.int32),
                             kv_loc=np.arange(16, dtype=np.int32) + 100, logits_indices=np.array([5, 10], np.int32),
                             max_q_len=8, fresh_prefill=True)
    views = [microbatch_metadata(meta, np.int32(m), 4) for m in range(4)]
    # rows 0-3: a's first 4 (context 3 + 4 = 7); rows 4-7: a's last 2 (context 9) and b's first 2 (context 2);
    # rows 8-11: b's last 3 (context 5) and a padding row; rows 12-15: padding only
    assert [np.asarray(v.cu_q_lens).tolist() for v in views] == [[0, 4, 4, 4], [0, 2, 4, 4], [0, 0, 3, 3],
                                                                 [0, 0, 0, 0]]
    assert [np.asarray(v.kv_lens).tolist() for v in views] == [[7, 0, 0], [9, 2, 0], [9, 5, 0], [9, 5, 0]]
    assert np.asarray(views[1].positions).tolist() == [4, 5, 6, 7]
    assert np.asarray(views[2].kv_loc).tolist() == [108, 109, 110, 111]
    assert all(v.max_q_len == 4 and not v.fresh_prefill for v in views)


def test_microbatches_of_a_decode_batch_hold_only_the_sequences_that_can_own_their_rows():
    # 7 decodes (one row each, contexts 10..16) and a padding sequence, 8 rows: micro-batches of 2 rows hold a
    # window of 3 sequences (one that began before, then one a row), cut from the last 3 at the end
    meta = AttentionMetadata(positions=np.arange(8, dtype=np.int32), cu_q_lens=np.array([0, 1, 2, 3, 4, 5, 6, 7, 7,
                                                                                          7], np.int32),
                             kv_lens=np.array([10, 11, 12, 13, 14, 15, 16, 0, 0], np.int32),
                             page_table=np.arange(9, dtype=np.int32)[:, None] * np.ones((1, 2), np.int32),
                             kv_loc=np.arange(8, dtype=np.int32), logits_indices=np.arange(7, dtype=np.int32))
    views = [microbatch_metadata(meta, np.int32(m), 2) for m in range(4)]
    firsts = [0, 2, 4, 6]  # the first sequence at or past each micro-batch's start row
    for v, first in zip(views, firsts):
        assert np.asarray(v.page_table)[:, 0].tolist() == list(range(first, first + 3))
    # each micro-batch's rows belong to the sequences the full-batch view gives them: its own 2 decodes
    assert [np.asarray(v.cu_q_lens).tolist() for v in views] == [[0, 1, 2, 2], [0, 1, 2, 2], [0, 1, 2, 2],
                                                                 [0, 1, 1, 1]]
    # contexts end at each sequence's last row inside the micro-batch: the window's third decode has none yet
    assert [np.asarray(v.kv_lens).tolist() for v in views] == [[10, 11, 11], [12, 13, 13], [14, 15, 15],
                                                               [16, 0, 0]]


@pytest.mark.parametrize("rows,wanted,got", [(16, 4, 4), (2, 4, 2), (16, 3, 2), (12, 8, 6), (1, 4, 1)])
def test_microbatch_count_divides_the_rows(rows, wanted, got):
    assert num_microbatches_for(rows, wanted) == got
