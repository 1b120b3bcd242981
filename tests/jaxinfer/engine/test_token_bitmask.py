"""The packed token bitmask of structured output inside the jitted sampler: constrained and unconstrained rows
in one call, against llguidance's numpy reference of applying the mask, and the mask an input of the compiled
function (no logits leave the device for masking)."""

from __future__ import annotations

import jax
import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from jaxinfer.engine.sampling import SamplingArrays, SamplingRow, sample
from jaxinfer.sampling_params import SamplingParams

V, B = 200, 4
WORDS = (V + 31) // 32


def _rows(masks):
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, top_p=0.9)]
    return [SamplingRow(p, seed=i, allowed=m) for i, (p, m) in enumerate(zip(params, masks))]


def test_masked_rows_sample_only_allowed_tokens_in_one_call_beside_unmasked_ones():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    masks = [rng.integers(-2**31, 2**31, WORDS, dtype=np.int64).astype(np.int32), None,
             np.zeros(WORDS, np.int32), None]
    masks[2][5] = 1 << 7  # exactly one token allowed: 5 * 32 + 7
    jitted = jax.jit(sample)
    s = SamplingArrays.build(_rows(masks), B, V, penalty_width=1)
    out = np.asarray(jitted(logits, s).token_ids)
    ref = logits.copy()
    full = np.stack([m if m is not None else np.full(WORDS, -1, np.int32) for m in masks])
    apply_token_bitmask_inplace(ref, full)
    assert out[0] == np.argmax(ref[0])  # greedy: the best allowed token
    assert out[2] == 5 * 32 + 7
    assert np.isfinite(ref[1, out[1]]) and np.isfinite(ref[3, out[3]])
    unmasked = np.asarray(jitted(logits, SamplingArrays.build(_rows([None] * B), B, V, penalty_width=1)).token_ids)
    assert out[1] == unmasked[1] and out[3] == unmasked[3]  # the unconstrained rows are as without any mask
    for seed in range(20):  # a sampled constrained row never leaves its mask
        rows = [SamplingRow(SamplingParams(temperature=1.5), seed=seed, allowed=masks[0])]
        token = int(jitted(logits[:1], SamplingArrays.build(rows, 1, V, penalty_width=1)).token_ids[0])
        assert np.isfinite(ref[0, token])


def test_the_bitmask_is_an_input_of_the_compiled_step():
    s = SamplingArrays.build(_rows([None] * B), B, V, penalty_width=1)
    assert s.token_bitmask.shape == (B, WORDS) and s.token_bitmask.dtype == np.int32 and (s.token_bitmask == -1).all()
    lowered = jax.jit(sample).lower(np.zeros((B, V), np.float32), s)
    text = lowered.as_text()
    assert f"tensor<{B}x{WORDS}xi32>" in text  # the packed mask goes in
    shapes = [x.shape for x in jax.tree.leaves(jax.eval_shape(sample, np.zeros((B, V), np.float32), s))]
    assert (B, V) not in shapes  # and no [B, V] logits come back to the host
