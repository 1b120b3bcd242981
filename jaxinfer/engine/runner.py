"""Model runner: the one place where host-side batches become padded device arrays.

1. The caller hands `execute` a list of `SequenceChunk`s: each sequence's new tokens, how many of its tokens are
   already in the cache, and its page ids.
2. The runner pads to shape buckets (powers of two for flat tokens, sequences, pages per sequence and the longest
   query run), so a handful of shapes are compiled and then reused.
3. One jitted step runs the model forward over the ragged batch and samples a token per sequence; the KV cache
   is donated and replaced by the step's output.
4. Sampled tokens come back to the host as numpy; the logits stay on device unless asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import SamplingArrays, sample
from jaxinfer.sampling_params import SamplingParams
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward
from pallas_kernels.paged_attention import paged_attention_reference

logger = logging.getLogger(__name__)

NULL_PAGE = 0


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step.

    Attributes:
      token_ids: the new tokens whose K/V this step computes (1 for a decode, several for a prefill chunk).
      num_computed_tokens: tokens of this sequence already in the cache; the first new token sits at this
        position.
      page_ids: pages holding positions `[0, num_computed_tokens + len(token_ids))`, in order, each in
        [1, num_pages).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    page_ids: Sequence[int]


def _step(
    weights: Weights,
    tokens: jax.Array,
    metadata: AttentionMetadata,
    kv_cache: KVCache,
    sampling: SamplingArrays,
    *,
    cfg: ModelConfig,
    scan_layers: bool,
    attention_fn: Callable[..., jax.Array],
) -> tuple[jax.Array, jax.Array, KVCache]:
    logits, kv_cache = forward(weights, tokens, metadata, kv_cache, cfg, scan_layers=scan_layers,
                               attention_fn=attention_fn)
    return sample(logits, sampling), logits, kv_cache


class ModelRunner:
    """Owns the weights and the paged KV cache on device and runs jitted steps over ragged batches.

    Args:
      cfg: model config.
      weights: device weights.
      num_pages: pages in the cache, including the null page 0.
      page_size: tokens per page.
      kv_dtype: cache dtype.
      scan_layers: scan over layers instead of unrolling them (see `models.llama.forward`).
      attention_fn: attention op (signature of `paged_attention_reference`).
      vocab_limit: ids at or above it are never sampled (a model's embedding table may be padded past the
        tokenizer's vocabulary); default: the model's vocabulary size.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        *,
        num_pages: int,
        page_size: int,
        kv_dtype: jnp.dtype,
        scan_layers: bool = False,
        attention_fn: Callable[..., jax.Array] = paged_attention_reference,
        vocab_limit: int | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.cfg = cfg
        self.weights = weights
        self.vocab_limit = cfg.vocab_size if vocab_limit is None else vocab_limit
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_cache = KVCache.zeros(cfg, num_pages, page_size, kv_dtype)
        self._step = jax.jit(
            functools.partial(_step, cfg=cfg, scan_layers=scan_layers, attention_fn=attention_fn),
            donate_argnames=("kv_cache",),
        )
        self._forward_all = jax.jit(
            functools.partial(forward, cfg=cfg, scan_layers=scan_layers, attention_fn=attention_fn),
            donate_argnames=("kv_cache",),
        )

    def _prepare(self, chunks: Sequence[SequenceChunk], all_rows: bool) -> tuple[np.ndarray, AttentionMetadata, int]:
        """Pads a batch to its shape buckets; returns (tokens, metadata, padded sequence count)."""
        ps = self.page_size
        q_lens = [len(c.token_ids) for c in chunks]
        if not chunks or min(q_lens) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        num_tokens = sum(q_lens)
        t_pad = next_power_of_two(num_tokens, 2)  # >= 2 rows: bf16 matrix-vector with one row is slow on CPU
        b_pad = next_power_of_two(len(chunks), 2)  # >= 2 logits rows: the one-row LM head is slow in bf16
        max_q = max(q_lens)
        max_q_pad = 1 if max_q == 1 else min(next_power_of_two(max_q, 16), t_pad)
        kv_lens = [c.num_computed_tokens + q for c, q in zip(chunks, q_lens)]
        pages_needed = [-(-n // ps) for n in kv_lens]
        for c, n in zip(chunks, pages_needed):
            if len(c.page_ids) < n:
                raise ValueError(f"sequence needs {n} pages for {c.num_computed_tokens + len(c.token_ids)} tokens "
                                 f"but has {len(c.page_ids)}")
        p_pad = next_power_of_two(max(pages_needed))

        tokens = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        kv_loc = np.full(t_pad, NULL_PAGE * ps, np.int32)
        cu_q_lens = np.full(b_pad + 1, num_tokens, np.int32)
        cu_q_lens[: len(chunks) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
        kv_lens_arr = np.zeros(b_pad, np.int32)
        kv_lens_arr[: len(chunks)] = kv_lens
        page_table = np.full((b_pad, p_pad), NULL_PAGE, np.int32)
        for b, (c, n) in enumerate(zip(chunks, pages_needed)):
            page_table[b, :n] = c.page_ids[:n]
            start = cu_q_lens[b]
            pos = np.arange(c.num_computed_tokens, c.num_computed_tokens + q_lens[b])
            tokens[start : start + q_lens[b]] = c.token_ids
            positions[start : start + q_lens[b]] = pos
            kv_loc[start : start + q_lens[b]] = page_table[b, pos // ps] * ps + pos % ps
        if all_rows:
            logits_indices = np.arange(t_pad, dtype=np.int32)
        else:
            logits_indices = np.zeros(b_pad, np.int32)
            logits_indices[: len(chunks)] = cu_q_lens[1 : len(chunks) + 1] - 1
        metadata = AttentionMetadata(positions=positions, cu_q_lens=cu_q_lens, kv_lens=kv_lens_arr,
                                     page_table=page_table, kv_loc=kv_loc, logits_indices=logits_indices,
                                     max_q_len=max_q_pad)
        return tokens, metadata, b_pad

    def execute(
        self,
        chunks: Sequence[SequenceChunk],
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        suppress: Sequence[Sequence[int]],
    ) -> tuple[np.ndarray, jax.Array]:
        """Runs one step and samples the next token of every sequence.

        Args:
          chunks: the batch, one entry per sequence.
          params, seeds, steps, suppress: per-sequence sampling inputs (see `SamplingArrays`).

        Returns:
          (i32[len(chunks)] sampled tokens on the host, f32[B_pad, V] last-token logits on device).

        Raises:
          ValueError: if a sequence has no new token or too few pages.
        """
        tokens, metadata, b_pad = self._prepare(chunks, all_rows=False)
        sampling = SamplingArrays.build(list(params), list(seeds), list(steps), [list(s) for s in suppress],
                                        b_pad, self.cfg.vocab_size, self.vocab_limit)
        next_tokens, logits, self.kv_cache = self._step(self.weights, tokens, metadata, self.kv_cache, sampling)
        return np.asarray(next_tokens)[: len(chunks)], logits

    def compute_logits(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Runs one step and returns the logits of every new token (for tests and evaluation).

        Returns:
          f32[sum of new tokens, V], rows in the order of `chunks` and their tokens.
        """
        tokens, metadata, _ = self._prepare(chunks, all_rows=True)
        logits, self.kv_cache = self._forward_all(self.weights, tokens, metadata, self.kv_cache)
        return np.asarray(logits)[: sum(len(c.token_ids) for c in chunks)]
