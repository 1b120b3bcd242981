"""The jitted device calls of `jaxinfer.engine.runner.ModelRunner`: one step (the forward over a ragged batch,
then `sample`) and one verify step (speculative decoding: the forward over every verify window, then
`spec_decode.verify`). A draft model with a cache of its own runs over the same tokens in both (`_mirror`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.engine.prompt_logprobs import PromptLogprobRows, prompt_logprob_rows
from jaxinfer.engine.sampling import SampleOutput, SamplingArrays, sample_and_check
from jaxinfer.engine.spec_decode.verify import VerifyOutput, verify
from jaxinfer.engine.step_results import pack_rows
from models.llama import AttentionMetadata, KVCache, Weights, forward
from models.quant_matmul import native_unless_sharded


def _mirror(draft_weights: Weights | None, tokens: jax.Array, metadata: AttentionMetadata,
            draft_cache: KVCache | None, draft_kwargs: dict) -> KVCache | None:
    """A draft model with a cache of its own computes the K/V of every token the target computes (draft.py)."""
    if draft_cache is None:
        return None
    one_row = metadata.replace(logits_indices=metadata.logits_indices[:1])  # its logits are not needed
    return forward(draft_weights, tokens, one_row, draft_cache, **draft_kwargs)[1]


@native_unless_sharded
def _sample(logits: jax.Array, sampling: SamplingArrays, *,
            mesh: jax.sharding.Mesh | None = None) -> tuple[SampleOutput, jax.Array]:
    """`sample_and_check`, with the native CPU row reductions only off a multi-device mesh (as the model's kernels)."""
    return sample_and_check(logits, sampling)


def step(weights: Weights, tokens: jax.Array, metadata: AttentionMetadata, kv_cache: KVCache,
          sampling: SamplingArrays, prompt: tuple[jax.Array, jax.Array] | None = None,
          draft_weights: Weights | None = None, draft_cache: KVCache | None = None, *, draft_kwargs: dict | None = None,
          model: Callable = forward,
          **model_kwargs) -> tuple[jax.Array, PromptLogprobRows | None, KVCache, KVCache | None]:
    """One step: the forward over the ragged batch, a sampled token per sequence and whether its row was finite,
    packed into one array for the host (`step_results.pack_rows`).

    model: the target's forward, `models.llama.forward` or `models.pipeline.pipeline_forward` (same signature).
    prompt: None, or for a step whose forward returns every token row's logits (prompt logprobs): (each row's
    target token i32[T_pad], the rows sampled from i32[R]); the step then also returns `PromptLogprobRows`.
    """
    logits, kv_cache = model(weights, tokens, metadata, kv_cache, **model_kwargs)
    rows = None
    if prompt is not None:
        rows = prompt_logprob_rows(logits, prompt[0], sampling.vocab_limit)
        logits = jnp.take(logits, prompt[1], axis=0)
    draft_cache = _mirror(draft_weights, tokens, metadata, draft_cache, draft_kwargs)
    out, finite = _sample(logits, sampling, mesh=model_kwargs.get("mesh"))
    return pack_rows(out, finite), rows, kv_cache, draft_cache


def fed_tokens(tokens: jax.Array, feed: jax.Array, rows: jax.Array) -> jax.Array:
    """A step's tokens, some taken on device from an earlier step's sampled rows (async scheduling: the step is
    dispatched before the earlier one's tokens reach the host; `ModelRunner.submit`).

    Args:
      tokens: i32[T], the host's token ids (placeholders where fed).
      feed: i32[T], per position the row of `rows` whose sampled token goes there, or -1 to keep the host's.
      rows: i32[R, 4 + 2k], the earlier step's `pack_rows` array (column 0: the sampled ids).

    Returns:
      i32[T].
    """
    return jnp.where(feed >= 0, rows[jnp.maximum(feed, 0), 0], tokens)


def verify_step(weights: Weights, tokens: jax.Array, metadata: AttentionMetadata, kv_cache: KVCache,
                 sampling: SamplingArrays, draft_ids: jax.Array, draft_probs: jax.Array | None, num_drafts: jax.Array,
                 draft_weights: Weights | None = None, draft_cache: KVCache | None = None, *,
                 draft_kwargs: dict | None = None, model: Callable = forward,
                 **model_kwargs) -> tuple[VerifyOutput, jax.Array, KVCache, KVCache | None]:
    """One verify step: the forward (`model`, as `step`) over every sequence's verify window, then `verify` on
    its k + 1 rows."""
    logits, kv_cache = model(weights, tokens, metadata, kv_cache, **model_kwargs)  # [B * (k+1), V]
    b, k = draft_ids.shape
    logits = logits.reshape(b, k + 1, -1)
    finite = jnp.all(jnp.isfinite(logits), axis=(1, 2))
    draft_cache = _mirror(draft_weights, tokens, metadata, draft_cache, draft_kwargs)
    return verify(logits, draft_ids, draft_probs, num_drafts, sampling), finite, kv_cache, draft_cache
