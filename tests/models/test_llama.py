"""Tests for models.llama on a tiny random model: chunked prefill, scanned layers, ragged batches.

These are consistency properties (the same numbers however a prompt is split or batched); the RoPE schedules are
checked in test_rope.py; agreement with an independent implementation (HF transformers) is tested through the
golden checkpoints in tests/jaxinfer/loading/test_hf.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import ModelRunner
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig
from models.llama import check_weights, init_weights, unstack_layers

PAGE_SIZE = 16
NUM_PAGES = 24
PROMPT_LEN = 40

CFG = ModelConfig(
    architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def weights():
    w = init_weights(CFG, jax.random.key(0))
    check_weights(w, CFG)
    return w


@pytest.fixture(scope="module")
def runner(weights):
    return ModelRunner(CFG, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, CFG.vocab_size, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def full_logits(runner, prompt):
    """Logits of every prompt token from one prefill chunk on pages [5, 2, 9] (deliberately out of order)."""
    out = runner.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])
    assert out.shape == (PROMPT_LEN, CFG.vocab_size)
    assert np.isfinite(out).all() and out.std() > 0.1  # a model that computes something
    return out


def _run_in_chunks(runner: ModelRunner, tokens: list[int], chunk: int, pages: list[int]) -> np.ndarray:
    rows = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start: start + chunk]
        rows.append(runner.compute_logits([ScheduledChunk(piece, start, pages)]))
    return np.concatenate(rows)


@pytest.mark.parametrize("chunk", [1, 7, 16, 17])
def test_chunked_prefill_matches_one_chunk(runner, prompt, full_logits, chunk):
    # Other pages than the single-chunk run (whose stale K/V stays in the cache and must not leak in).
    pages = [11, 3, 17]
    np.testing.assert_allclose(_run_in_chunks(runner, prompt, chunk, pages), full_logits, rtol=1e-4, atol=1e-4)


def test_prefix_logits_do_not_depend_on_later_tokens(runner, prompt, full_logits):
    # Causality: the logits of a prefix are those of the full prompt's first rows.
    out = runner.compute_logits([ScheduledChunk(prompt[:21], 0, [4, 6])])
    np.testing.assert_allclose(out, full_logits[:21], rtol=1e-4, atol=1e-4)
    # ... and changing a token changes the rows from it on, not before.
    changed = list(prompt[:21])
    changed[12] = (changed[12] + 1) % CFG.vocab_size
    out2 = runner.compute_logits([ScheduledChunk(changed, 0, [4, 6])])
    np.testing.assert_allclose(out2[:12], full_logits[:12], rtol=1e-4, atol=1e-4)
    assert np.abs(out2[12:] - full_logits[12:21]).max(axis=-1).min() > 1e-3


def test_scan_layers_matches_unrolled(weights, prompt, full_logits):
    scanned = ModelRunner(CFG, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                          scan_layers=True)
    out = scanned.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])
    np.testing.assert_allclose(out, full_logits, rtol=1e-4, atol=1e-4)


def test_per_layer_weights_match_stacked(weights, prompt, full_logits):
    # The unrolled runner keeps one array per layer weight (unstack_layers); scan keeps the stack: same logits.
    unstacked = unstack_layers(weights)
    assert isinstance(unstacked.layers, tuple) and len(unstacked.layers) == CFG.num_layers
    np.testing.assert_array_equal(unstacked.layers[1].wq, weights.layers.wq[1])
    runner = ModelRunner(CFG, unstacked, num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_dtype=jnp.float32,
                         scan_layers=True)  # per-layer arrays run unrolled whatever the flag says
    out = runner.compute_logits([ScheduledChunk(prompt, 0, [5, 2, 9])])
    np.testing.assert_allclose(out, full_logits, rtol=1e-4, atol=1e-4)


def test_ragged_batch_matches_sequences_run_alone(runner, prompt, full_logits):
    # Three sequences in one step: A extends a 5-token cached context by 3 tokens (crossing no page), B decodes
    # one token after 20 cached tokens (second page), C is a fresh 12-token prefill.
    rng = np.random.default_rng(2)
    a = rng.integers(0, CFG.vocab_size, 8).tolist()
    b = prompt[:21]
    c = rng.integers(0, CFG.vocab_size, 12).tolist()
    pages_a, pages_b, pages_c = [7], [13, 1], [20]
    runner.compute_logits([ScheduledChunk(a[:5], 0, pages_a)])
    runner.compute_logits([ScheduledChunk(b[:20], 0, pages_b)])
    batch = runner.compute_logits([ScheduledChunk(a[5:], 5, pages_a), ScheduledChunk(b[20:], 20, pages_b),
                                   ScheduledChunk(c, 0, pages_c)])
    assert batch.shape == (3 + 1 + 12, CFG.vocab_size)
    alone_a = runner.compute_logits([ScheduledChunk(a[5:], 5, pages_a)])
    alone_b = runner.compute_logits([ScheduledChunk(b[20:], 20, pages_b)])
    alone_c = runner.compute_logits([ScheduledChunk(c, 0, pages_c)])
    np.testing.assert_allclose(batch, np.concatenate([alone_a, alone_b, alone_c]), rtol=1e-5, atol=1e-5)
    # B's decode row is the 21st row of the whole prompt's prefill.
    np.testing.assert_allclose(batch[3], full_logits[20], rtol=1e-4, atol=1e-4)


def test_execute_samples_greedy_argmax_of_last_rows(runner, prompt, full_logits):
    from jaxinfer.engine.sampling import SamplingRow
    from jaxinfer.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    result = runner.execute([ScheduledChunk(prompt, 0, [8, 10, 12]), ScheduledChunk(prompt[:17], 0, [14, 15])],
                            [SamplingRow(greedy, 0), SamplingRow(greedy, 1)])
    assert result.token_ids.tolist() == [int(np.argmax(full_logits[-1])), int(np.argmax(full_logits[16]))]
    assert result.finite.all()
    # The sampled tokens' raw logprobs are the log-softmax of the last rows' logits.
    for row, logits in enumerate([full_logits[-1], full_logits[16]]):
        expected = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
        np.testing.assert_allclose(result.logprobs[row], expected[result.token_ids[row]], atol=1e-4)
