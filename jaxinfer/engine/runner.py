"""Model runner: the one place where host-side batches become padded device arrays.

1. The caller hands `execute` a list of `ScheduledChunk`s: each sequence's new tokens, how many of its tokens are
   already in the cache, and its page ids.
2. The runner pads to shape buckets (powers of two for flat tokens, sequences, pages per sequence and the longest
   query run), so a handful of shapes are compiled and then reused.
3. One jitted step runs the model forward over the ragged batch and samples a token per sequence; the KV cache
   is donated and replaced by the step's output.
4. Sampled tokens come back to the host as numpy; the logits stay on device unless asked for.

Speculative decoding adds two calls: `propose` (the draft model drafts k tokens per sequence on device) and
`execute_verify` (the target runs each sequence's last token plus its drafts, and `spec_decode.verify` picks the
accepted prefix and the next token from the k + 1 rows of logits of each sequence).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import multihost
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.engine.sampling import SampleOutput, SamplingArrays, SamplingRow, sample
from jaxinfer.engine.spec_decode import draft as draft_lib
from jaxinfer.engine.spec_decode.verify import VerifyOutput, verify
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward
from pallas_kernels.dispatch import REFERENCE_OPS, AttentionOps

logger = logging.getLogger(__name__)

NULL_PAGE = 0


MIN_PREFILL_TOKENS = 16  # smallest token bucket of a step with a prefill chunk
MIN_PAGES_PER_SEQ = 8  # smallest page-table width; widths grow 4x (8, 32, 128, ...)


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def page_bucket(n: int, max_pages_per_seq: int) -> int:
    """Page-table width for a step whose longest sequence needs n pages: 8 * 4**k >= n, capped at the maximum.

    4x steps keep the number of compiled shapes small; the reference attention then reads at most 4x the pages it
    needs (a small share of a decode step's bytes at these context lengths, BENCHMARKS.md).
    """
    width = MIN_PAGES_PER_SEQ
    while width < n:
        width *= 4
    return max(min(width, max_pages_per_seq), n)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host copy of one step's sampling output, one row per sequence of the step.

    Attributes:
      token_ids: i32[B] sampled tokens.
      logprobs: f32[B] raw log-probability of each sampled token.
      top_logprobs, top_token_ids: f32/i32[B, 20] top raw log-probabilities and their ids (filled when asked).
      finite: bool[B], False where the row's logits held NaN or inf (the row's token is meaningless then).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0  # token rows the step computed beyond the real tokens (bucket padding)

    def row_logprobs(self, row: int, n: int) -> dict[int, float]:
        """{token id: logprob} of row's top n raw tokens plus its sampled token."""
        out = {int(t): float(v) for t, v in zip(self.top_token_ids[row, :n], self.top_logprobs[row, :n]) if t >= 0}
        out[int(self.token_ids[row])] = float(self.logprobs[row])
        return out


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Host copy of a verify step (speculative decoding), one row per sequence.

    Attributes:
      num_accepted: i32[B], drafts accepted; the row emits num_accepted + 1 tokens.
      token_ids: i32[B, k+1], the emitted tokens at [0, num_accepted], then -1.
      logprobs: f32[B, k+1], their raw log-probabilities.
      top_logprobs, top_token_ids: f32/i32[B, k+1, 20], per position (filled when asked).
      finite: bool[B], False where any of the row's logits held NaN or inf.
    """

    num_accepted: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    finite: np.ndarray
    num_padded_tokens: int = 0

    def emitted(self, row: int) -> list[int]:
        """The row's emitted ids: its accepted drafts, then the target's token."""
        return self.token_ids[row, : int(self.num_accepted[row]) + 1].tolist()

    def row_logprobs(self, row: int, n: int) -> list[dict[int, float]]:
        """Per emitted token of the row: {token id: logprob} of the top n raw tokens plus the emitted token."""
        out = []
        for j in range(int(self.num_accepted[row]) + 1):
            entry = {int(t): float(v) for t, v in zip(self.top_token_ids[row, j, :n], self.top_logprobs[row, j, :n])
                     if t >= 0}
            entry[int(self.token_ids[row, j])] = float(self.logprobs[row, j])
            out.append(entry)
        return out


def _shape_key(args: tuple) -> tuple:
    """Pytree structure plus every leaf's shape and dtype: what a compiled step is specialised to."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(x), np.result_type(x)) for x in leaves)


def _mirror(draft_weights: Weights | None, tokens: jax.Array, metadata: AttentionMetadata,
            draft_cache: KVCache | None, draft_kwargs: dict) -> KVCache | None:
    """A draft model with a cache of its own computes the K/V of every token the target computes (draft.py)."""
    if draft_cache is None:
        return None
    one_row = metadata.replace(logits_indices=metadata.logits_indices[:1])  # its logits are not needed
    return forward(draft_weights, tokens, one_row, draft_cache, **draft_kwargs)[1]


def _step(
    weights: Weights,
    tokens: jax.Array,
    metadata: AttentionMetadata,
    kv_cache: KVCache,
    sampling: SamplingArrays,
    draft_weights: Weights | None = None,
    draft_cache: KVCache | None = None,
    *,
    draft_kwargs: dict | None = None,
    **model_kwargs,
) -> tuple[SampleOutput, jax.Array, KVCache, KVCache | None]:
    logits, kv_cache = forward(weights, tokens, metadata, kv_cache, **model_kwargs)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    draft_cache = _mirror(draft_weights, tokens, metadata, draft_cache, draft_kwargs)
    return sample(logits, sampling), finite, kv_cache, draft_cache


def _verify_step(
    weights: Weights,
    tokens: jax.Array,
    metadata: AttentionMetadata,
    kv_cache: KVCache,
    sampling: SamplingArrays,
    draft_ids: jax.Array,
    draft_probs: jax.Array | None,
    num_drafts: jax.Array,
    draft_weights: Weights | None = None,
    draft_cache: KVCache | None = None,
    *,
    draft_kwargs: dict | None = None,
    **model_kwargs,
) -> tuple[VerifyOutput, jax.Array, KVCache, KVCache | None]:
    logits, kv_cache = forward(weights, tokens, metadata, kv_cache, **model_kwargs)  # [B * (k+1), V]
    b, k = draft_ids.shape
    logits = logits.reshape(b, k + 1, -1)
    finite = jnp.all(jnp.isfinite(logits), axis=(1, 2))
    draft_cache = _mirror(draft_weights, tokens, metadata, draft_cache, draft_kwargs)
    return verify(logits, draft_ids, draft_probs, num_drafts, sampling), finite, kv_cache, draft_cache


# Page operations: every cache leaf (K, V and, for int8 / fp8 caches, their scales) leads with [L, P], so each is
# the same indexing on every leaf and a page's scales always travel with it.


def _clear_pages(kv_cache: KVCache, page_ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a.at[:, page_ids].set(0), kv_cache)


def _copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), kv_cache)


def _gather_pages(kv_cache: KVCache, page_ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda a: a[:, page_ids], kv_cache)  # leaves [L, n, ...]


def _scatter_pages(kv_cache: KVCache, page_ids: jax.Array, pages: KVCache) -> KVCache:
    return jax.tree.map(lambda a, x: a.at[:, page_ids].set(x), kv_cache, pages)


class ModelRunner:
    """Owns the weights and the paged KV cache on device and runs jitted steps over ragged batches.

    Args:
      cfg: model config.
      weights: device weights.
      num_pages: pages in the cache, including the null page 0.
      page_size: tokens per page.
      kv_dtype: cache dtype: float32 / bfloat16, or int8 / float8_e4m3fn for a quantized cache with per-token
        scales (`models.llama.KVCache`); a draft model's own cache takes the same dtype.
      scan_layers: scan over layers instead of unrolling them (see `models.llama.forward`).
      attention: attention functions (`pallas_kernels.dispatch.select_attention`); with a flash kernel,
        prefill steps of fresh prompts only (no cached context) compile as their own shape bucket.
      vocab_limit: ids at or above it are never sampled (a model's embedding table may be padded past the
        tokenizer's vocabulary); default: the model's vocabulary size.
      max_pages_per_seq: widest page table (context limit / page size); default from the model's context.
      mesh: the device mesh the weights are sharded on (`sharding.partition.shard_model`), or None for one
        device. With a mesh the KV cache is split over KV heads, and every step's outputs (sampled tokens,
        logits) come back replicated, so each process of a multi-host run can read them.
      output_vocab: logits columns `compute_logits` returns; default V. A model padded for TP has a larger V.
      draft: speculative decoding's draft model (`jaxinfer.engine.spec_decode.draft`), or None. One with a cache of
        its own gets one here (same pages), and every step also runs it over the step's tokens; copies and
        clears of pages apply to its cache too (host-tier offloads do not: its K/V there goes stale, which only
        lowers acceptance).
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
        attention: AttentionOps = REFERENCE_OPS,
        vocab_limit: int | None = None,
        max_pages_per_seq: int | None = None,
        mesh: jax.sharding.Mesh | None = None,
        output_vocab: int | None = None,
        draft: draft_lib.DraftModel | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.cfg = cfg
        self.weights = weights
        self.vocab_limit = cfg.vocab_size if vocab_limit is None else vocab_limit
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_seq = max_pages_per_seq or -(-cfg.max_position_embeddings // page_size)
        self.output_vocab = cfg.vocab_size if output_vocab is None else output_vocab
        self._released = False
        self.mesh = mesh
        self.attention = attention
        # On a mesh the cache stays split over KV heads and everything else the step returns is replicated.
        cache_out = replicated = None
        if mesh is not None:
            from sharding.rules import logical_to_spec

            cache_out = KVCache.per_leaf(jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.LOGICAL_AXES)),
                                         jax.sharding.NamedSharding(mesh, logical_to_spec(KVCache.SCALE_LOGICAL_AXES)),
                                         kv_dtype)
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.kv_cache = jax.jit(functools.partial(KVCache.zeros, cfg, num_pages, page_size, kv_dtype),
                                out_shardings=cache_out)()
        model_kwargs = dict(cfg=cfg, scan_layers=scan_layers, attention=attention)
        if mesh is not None:
            model_kwargs["mesh"] = mesh  # MoE layers run their experts in a shard_map over it
        self.draft = draft
        self.draft_cache = None
        draft_kwargs = None
        self._draft_probs = None
        if draft is not None:
            draft_kwargs = dict(model_kwargs, cfg=draft.cfg)
            if not draft.shares_target_cache:
                self.draft_cache = jax.jit(functools.partial(KVCache.zeros, draft.cfg, num_pages, page_size,
                                                             kv_dtype))()
            propose_cache_out = cache_out if draft.shares_target_cache else None
            self._propose = jax.jit(functools.partial(draft_lib.propose, **draft_kwargs),
                                    static_argnames=("num_tokens", "with_probs"), donate_argnames=("kv_cache",),
                                    out_shardings=None if mesh is None else (replicated, replicated,
                                                                             propose_cache_out))

        self._step = jax.jit(
            functools.partial(_step, draft_kwargs=draft_kwargs, **model_kwargs),
            donate_argnames=("kv_cache", "draft_cache"),
            out_shardings=None if mesh is None else (replicated, replicated, cache_out, None),
        )
        self._verify_step = jax.jit(
            functools.partial(_verify_step, draft_kwargs=draft_kwargs, **model_kwargs),
            donate_argnames=("kv_cache", "draft_cache"),
            out_shardings=None if mesh is None else (replicated, replicated, cache_out, None),
        )
        self._clear_pages = jax.jit(_clear_pages, donate_argnums=0, out_shardings=cache_out)
        self._copy_pages = jax.jit(_copy_pages, donate_argnums=0, out_shardings=cache_out)
        self._scatter_pages = jax.jit(_scatter_pages, donate_argnums=0, out_shardings=cache_out)
        self._gather_pages = jax.jit(_gather_pages, out_shardings=replicated)
        # Host tier of the prefix cache: slot id -> one page, a `KVCache` of numpy leaves without the page axis
        # (k, v [L, K, page_size, H], scales f32[L, K, page_size] for int8 / fp8). Pages start as (device batch
        # being copied to the host asynchronously, index in it) and become numpy when next touched.
        self.host_pages: dict[int, KVCache | tuple[KVCache, int]] = {}
        self._unsettled: list[int] = []  # slots whose pages are still device arrays in flight to the host
        self._compiled: dict[tuple, Callable] = {}  # ahead-of-time compiled steps by `_shape_key`
        self._forward_all = jax.jit(
            functools.partial(forward, **model_kwargs), donate_argnames=("kv_cache",),
            out_shardings=None if mesh is None else (replicated, cache_out),
        )

    def _prepare(self, chunks: Sequence[ScheduledChunk], all_rows: bool, verify_width: int = 0,
                 max_block: int = 0) -> tuple[np.ndarray, AttentionMetadata, int]:
        """Pads a batch to its shape buckets; returns (tokens, metadata, padded batch / logits rows).

        verify_width = k + 1 > 0: a verify step of decode blocks; each sequence gets k + 1 logits rows (its block's
        rows, the last repeated past its length) and the token buckets start at 2 instead of 16. max_block >= every
        block's length pads the step as if every sequence of the padded batch had that many tokens, so that a
        step's shape depends on its batch bucket and max_block alone (the shapes `warmup` compiles).
        """
        ps = self.page_size
        q_lens = [len(c.token_ids) for c in chunks]
        if not chunks or min(q_lens) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        num_tokens = sum(q_lens)
        t_pad = next_power_of_two(num_tokens, 2)  # >= 2 rows: bf16 matrix-vector with one row is slow on CPU
        b_pad = next_power_of_two(len(chunks))
        r_pad = max(b_pad, 2)  # >= 2 logits rows: the one-row bf16 LM head is 10x slower on CPU
        max_q = max(q_lens)
        if verify_width:
            if max_block:
                if max_q > max_block:
                    raise ValueError(f"a verify block of {max_q} tokens exceeds max_block={max_block}")
                t_pad, max_q = next_power_of_two(b_pad * max_block, 2), max_block
            max_q_pad = next_power_of_two(max_q)
        else:
            if max_q > 1:
                t_pad = next_power_of_two(num_tokens, MIN_PREFILL_TOKENS)
            max_q_pad = 1 if max_q == 1 else min(next_power_of_two(max_q, MIN_PREFILL_TOKENS), t_pad)
        kv_lens = [c.num_computed_tokens + q for c, q in zip(chunks, q_lens)]
        pages_needed = [-(-n // ps) for n in kv_lens]
        for c, n in zip(chunks, pages_needed):
            if len(c.page_ids) < n:
                raise ValueError(f"sequence needs {n} pages for {c.num_computed_tokens + len(c.token_ids)} tokens "
                                 f"but has {len(c.page_ids)}")
        p_pad = page_bucket(max(pages_needed), self.max_pages_per_seq)
        # Fresh prompts take the flash kernel when the backend has one; otherwise the flag stays off so that the
        # shape keys (and compiled steps) are the same as without it.
        fresh = self.attention.flash is not None and max_q > 1 and all(c.num_computed_tokens == 0 for c in chunks)

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
        if verify_width:
            # row b * (k+1) + j: sequence b's token min(j, q_len - 1); padding sequences read row 0
            starts, last = np.zeros(b_pad, np.int32), np.zeros(b_pad, np.int32)
            starts[: len(chunks)] = cu_q_lens[: len(chunks)]
            last[: len(chunks)] = np.array(q_lens) - 1
            block = np.minimum(np.arange(verify_width)[None, :], last[:, None])
            logits_indices = (starts[:, None] + block).reshape(-1).astype(np.int32)
            r_pad = b_pad
        elif all_rows:
            logits_indices = np.arange(t_pad, dtype=np.int32)
        else:
            logits_indices = np.zeros(r_pad, np.int32)
            logits_indices[: len(chunks)] = cu_q_lens[1 : len(chunks) + 1] - 1
        metadata = AttentionMetadata(positions=positions, cu_q_lens=cu_q_lens, kv_lens=kv_lens_arr,
                                     page_table=page_table, kv_loc=kv_loc, logits_indices=logits_indices,
                                     max_q_len=max_q_pad, fresh_prefill=fresh)
        return tokens, metadata, r_pad

    def execute(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow]) -> StepResult:
        """Runs one step and samples the next token of every sequence.

        Args:
          chunks: the batch, one entry per sequence.
          rows: per-sequence sampling inputs, same order.

        Returns:
          The step's sampling output on the host, one row per chunk.

        Raises:
          ValueError: if a sequence has no new token or too few pages, or rows and chunks differ in length.
        """
        if len(rows) != len(chunks):
            raise ValueError(f"{len(rows)} sampling rows for {len(chunks)} sequences")
        tokens, metadata, b_pad = self._prepare(chunks, all_rows=False)
        sampling = SamplingArrays.build(rows, b_pad, self.cfg.vocab_size, self.vocab_limit)
        multihost.send(multihost.Op.STEP, (tokens, metadata, sampling))
        out, finite = self._run_step(tokens, metadata, sampling)
        n = len(chunks)
        padded = int(tokens.shape[0]) - sum(len(c.token_ids) for c in chunks)
        out, finite = jax.device_get((out, finite))
        return StepResult(token_ids=out.token_ids[:n], logprobs=out.logprobs[:n], top_logprobs=out.top_logprobs[:n],
                          top_token_ids=out.top_token_ids[:n], finite=finite[:n],
                          num_padded_tokens=padded)

    def compile_step(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow]) -> jax.stages.Compiled:
        """The compiled step `execute` runs for this batch's shapes, without running it: for XLA's memory analysis
        (`.memory_analysis()`) and the optimized HLO (`.as_text()`)."""
        tokens, metadata, b_pad = self._prepare(chunks, all_rows=False)
        sampling = SamplingArrays.build(rows, b_pad, self.cfg.vocab_size, self.vocab_limit)
        tokens, metadata, sampling = self._global_inputs((tokens, metadata, sampling))
        return self._step.lower(self.weights, tokens, metadata, self.kv_cache, sampling,
                                *self._draft_args()).compile()

    def _run_step(self, tokens: np.ndarray, metadata: AttentionMetadata,
                  sampling: SamplingArrays) -> tuple[SampleOutput, jax.Array]:
        tokens, metadata, sampling = self._global_inputs((tokens, metadata, sampling))
        out, finite, self.kv_cache, self.draft_cache = self._call(
            "step", self.weights, tokens, metadata, self.kv_cache, sampling, *self._draft_args())
        return out, finite

    def _draft_args(self) -> tuple:
        """(draft weights, draft cache) for a step that keeps a draft's own cache in step, else ()."""
        return () if self.draft_cache is None else (self.draft.weights, self.draft_cache)

    # --- speculative decoding ---------------------------------------------------------------------------------

    def propose(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow], num_slots: Sequence[int],
                num_tokens: int) -> tuple[np.ndarray, jax.Array | None]:
        """Drafts tokens with the draft model for decode chunks (`jaxinfer.engine.spec_decode.draft.propose`).

        Args:
          chunks: one decode chunk per sequence (its last token), pages covering its whole block: positions
            `[0, num_computed_tokens + 1 + num_slots[b])`.
          rows: the sequences' sampling rows at the block's first output step.
          num_slots: drafts wanted per sequence, in [0, num_tokens].
          num_tokens: k, the draft steps run (static; every row runs them, rows past their slots write nothing).

        Returns:
          (draft ids i32[len(chunks), k] on the host, whether draft probabilities were kept: False when every row
          is greedy). The probabilities, f32[B_pad, k, V], stay on device for `execute_verify`. Row b's drafts
          past num_slots[b] are meaningless.

        Raises:
          ValueError: without a draft model, or for chunks that are not single decode tokens.
        """
        if self.draft is None:
            raise ValueError("this runner has no draft model")
        if any(len(c.token_ids) != 1 for c in chunks):
            raise ValueError("drafting starts from decode chunks of one token each")
        inputs = self._propose_inputs(chunks, rows, num_slots, num_tokens)
        multihost.send(multihost.Op.PROPOSE, inputs)
        ids = self._run_propose(*inputs)
        return np.asarray(ids)[: len(chunks)], self._draft_probs is not None

    def _propose_inputs(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow], num_slots: Sequence[int],
                        num_tokens: int) -> tuple:
        """The drafting call's host inputs: (tokens, positions, kv_loc, page_table, sampling, k, with_probs)."""
        ps = self.page_size
        b_pad = next_power_of_two(len(chunks))
        pages = [-(-(c.num_computed_tokens + 1 + n) // ps) for c, n in zip(chunks, num_slots)]
        p_pad = page_bucket(max(pages), self.max_pages_per_seq)
        page_table = np.full((b_pad, p_pad), NULL_PAGE, np.int32)
        tokens = np.zeros(b_pad, np.int32)
        positions = np.zeros((num_tokens, b_pad), np.int32)
        kv_loc = np.zeros((num_tokens, b_pad), np.int32)  # null page
        for b, (c, n, used) in enumerate(zip(chunks, num_slots, pages)):
            page_table[b, :used] = c.page_ids[:used]
            tokens[b] = c.token_ids[0]
            pos = c.num_computed_tokens + np.arange(num_tokens)
            positions[:, b] = np.minimum(pos, c.num_computed_tokens + n)  # steps past the slots stay in range
            real = np.arange(num_tokens) < n
            kv_loc[real, b] = page_table[b, pos[real] // ps] * ps + pos[real] % ps
        sampling = SamplingArrays.build(rows, b_pad, self.cfg.vocab_size, self.vocab_limit)
        return tokens, positions, kv_loc, page_table, sampling, num_tokens, any(r.params.temperature > 0 for r in rows)

    def _propose_args(self, tokens: np.ndarray, positions: np.ndarray, kv_loc: np.ndarray, page_table: np.ndarray,
                      sampling: SamplingArrays) -> tuple:
        """The drafting call's dynamic arguments: draft weights, the cache it runs on, then the inputs."""
        cache = self.kv_cache if self.draft.shares_target_cache else self.draft_cache
        return (self.draft.weights, cache, *self._global_inputs((tokens, positions, kv_loc, page_table, sampling)))

    def _run_propose(self, tokens: np.ndarray, positions: np.ndarray, kv_loc: np.ndarray, page_table: np.ndarray,
                     sampling: SamplingArrays, num_tokens: int, with_probs: bool) -> jax.Array:
        """The drafting call; keeps the draft probabilities on device for the verify step that follows."""
        args = self._propose_args(tokens, positions, kv_loc, page_table, sampling)
        compiled = self._compiled.get(("propose", _shape_key(args), num_tokens, with_probs)) if self._compiled else None
        if compiled is not None:
            ids, self._draft_probs, cache = compiled(*args)
        else:
            ids, self._draft_probs, cache = self._propose(*args, num_tokens=num_tokens, with_probs=with_probs)
        if self.draft.shares_target_cache:
            self.kv_cache = cache
        else:
            self.draft_cache = cache
        return ids

    def _run_verify(self, tokens: np.ndarray, metadata: AttentionMetadata, sampling: SamplingArrays, ids: np.ndarray,
                    num_drafts: np.ndarray, draft_probs_row: int | None) -> tuple[VerifyOutput, jax.Array]:
        probs = None
        if draft_probs_row is not None:
            if self._draft_probs is None:
                raise ValueError("draft probabilities were asked for but the last proposal kept none")
            probs = self._draft_probs[draft_probs_row : draft_probs_row + ids.shape[0]]
        tokens, metadata, sampling, ids, num_drafts = self._global_inputs((tokens, metadata, sampling, ids, num_drafts))
        out, finite, self.kv_cache, self.draft_cache = self._call(
            "verify", self.weights, tokens, metadata, self.kv_cache, sampling, ids, probs, num_drafts,
            *self._draft_args())
        return out, finite

    def execute_verify(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                       draft_token_ids: Sequence[Sequence[int]], num_tokens: int,
                       draft_probs_row: int | None = None, max_block: int = 0) -> VerifyResult:
        """Runs one verify step: each sequence's last token plus its drafts, and `verify` on their logits.

        Args:
          chunks: one chunk per sequence: token_ids = [last token] + its drafts (0..k of them), pages covering them.
          rows: per-sequence sampling rows at the block's first output step.
          draft_token_ids: each sequence's drafts (the chunk's token_ids after the first).
          num_tokens: k, the draft width (static shape; >= every sequence's draft count).
          draft_probs_row: None for deterministic drafts (n-gram) or all-greedy rows; else these chunks' drafts
            are rows `draft_probs_row`, ... of the last `propose` call (which kept their probabilities on device):
            0 for the whole batch of that call in the same order, i for its i-th chunk alone.
          max_block: pad as if every block had this many tokens (>= the longest; 0: no such padding), e.g. the
          step's drafts per sequence + 1, so the step hits a shape `warmup` compiled.

        Returns:
          The verification on the host, one row per chunk.

        Raises:
          ValueError: if rows, chunks and drafts differ in length, or a chunk has more than k drafts.
        """
        if not len(rows) == len(chunks) == len(draft_token_ids):
            raise ValueError(f"{len(rows)} sampling rows and {len(draft_token_ids)} draft lists for "
                             f"{len(chunks)} sequences")
        if any(len(d) > num_tokens for d in draft_token_ids):
            raise ValueError(f"a sequence has more than k={num_tokens} drafts")
        tokens, metadata, b_pad = self._prepare(chunks, all_rows=False, verify_width=num_tokens + 1,
                                                max_block=max_block)
        sampling = SamplingArrays.build(rows, b_pad, self.cfg.vocab_size, self.vocab_limit)
        ids = np.zeros((b_pad, num_tokens), np.int32)
        num_drafts = np.zeros(b_pad, np.int32)
        for b, d in enumerate(draft_token_ids):
            ids[b, : len(d)] = d
            num_drafts[b] = len(d)
        inputs = (tokens, metadata, sampling, ids, num_drafts, draft_probs_row)
        multihost.send(multihost.Op.VERIFY, inputs)
        out, finite = jax.device_get(self._run_verify(*inputs))
        n = len(chunks)
        padded = int(tokens.shape[0]) - sum(len(c.token_ids) for c in chunks)
        return VerifyResult(num_accepted=out.num_accepted[:n], token_ids=out.token_ids[:n], logprobs=out.logprobs[:n],
                            top_logprobs=out.top_logprobs[:n], top_token_ids=out.top_token_ids[:n],
                            finite=finite[:n], num_padded_tokens=padded)

    def _global_inputs(self, tree):
        """Host arrays as jax arrays replicated over the mesh when the mesh spans several processes (a multi-process
        program takes no host-local numpy inputs); unchanged otherwise."""
        if self.mesh is None or not multihost.is_multi_process():
            return tree
        from sharding.partition import put_sharded

        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return put_sharded(tree, jax.tree.map(lambda _: replicated, tree))

    def follow(self) -> None:
        """Follower processes of a multi-host run: replays the leader's device calls until it sends STOP.

        See `jaxinfer.engine.multihost` for the protocol. A call that fails here is logged and skipped (the leader,
        running the same call, reports the failure to its request).
        """
        while True:
            op, payload = multihost.receive()
            if op is multihost.Op.STOP:
                return
            try:
                if op is multihost.Op.STEP:
                    jax.block_until_ready(self._run_step(*payload))
                elif op is multihost.Op.LOGITS:
                    self._logits(*payload)
                elif op is multihost.Op.CLEAR_PAGES:
                    self._clear(payload)
                elif op is multihost.Op.COPY_PAGES:
                    self.copy_pages(*payload)
                elif op is multihost.Op.OFFLOAD_PAGES:
                    self.offload_pages(*payload)
                elif op is multihost.Op.LOAD_PAGES:
                    self.load_pages(*payload)
                elif op is multihost.Op.DROP_PAGES:
                    self.drop_host_pages(payload)
                elif op is multihost.Op.PROPOSE:
                    jax.block_until_ready(self._run_propose(*payload))
                elif op is multihost.Op.VERIFY:
                    jax.block_until_ready(self._run_verify(*payload))
                else:
                    raise RuntimeError(f"unexpected operation {op.name} from the leader")
            except Exception:  # noqa: BLE001 - the leader sees the same failure and fails the request
                logger.exception("follower: %s failed", op.name)

    def release_followers(self) -> None:
        """Leader of a multi-host run: tells the followers to return from `follow` (idempotent)."""
        if multihost.is_multi_process() and multihost.is_leader() and not self._released:
            self._released = True
            multihost.send(multihost.Op.STOP)

    # --- page transfers of the prefix cache (see jaxinfer.scheduler.prefix_cache.KVOp) ------------------------

    @staticmethod
    def _padded_ids(*id_lists: Sequence[int]) -> list[np.ndarray]:
        """Id lists padded with the null page to a power of two (few compiled shapes; writes to page 0 are inert)."""
        width = next_power_of_two(len(id_lists[0]))
        out = []
        for ids in id_lists:
            arr = np.full(width, NULL_PAGE, np.int32)
            arr[: len(ids)] = ids
            out.append(arr)
        return out

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies device pages src[i] -> dst[i] (all layers, K and V and their scales): copy-on-write of shared
        pages."""
        multihost.send(multihost.Op.COPY_PAGES, (list(src), list(dst)))
        s, d = self._padded_ids(src, dst)
        self.kv_cache = self._copy_pages(self.kv_cache, *self._global_inputs((s, d)))
        if self.draft_cache is not None:
            self.draft_cache = self._copy_pages(self.draft_cache, s, d)

    def offload_pages(self, page_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copies device pages to host slots (device-to-host, started asynchronously; the step may run meanwhile)."""
        multihost.send(multihost.Op.OFFLOAD_PAGES, (list(page_ids), list(slots)))
        self.settle_host_pages()  # earlier offloads have landed (on followers too, which run no engine loop)
        (ids,) = self._padded_ids(page_ids)
        batch = self._gather_pages(self.kv_cache, self._global_inputs(ids))
        for x in jax.tree.leaves(batch):
            x.copy_to_host_async()
        for i, slot in enumerate(slots):
            self.host_pages[slot] = (batch, i)
        self._unsettled += slots

    def _host_page(self, slot: int) -> KVCache:
        entry = self.host_pages[slot]
        if isinstance(entry, tuple):  # still the device batch it was gathered in: materialize this page on the host
            batch, i = entry
            entry = jax.tree.map(lambda x: np.asarray(x)[:, i], batch)
            self.host_pages[slot] = entry
        return entry

    def settle_host_pages(self) -> None:
        """Turns pages offloaded by earlier steps into host numpy arrays, releasing their device copies."""
        for slot in self._unsettled:
            if slot in self.host_pages:  # not loaded back or dropped meanwhile
                self._host_page(slot)
        self._unsettled = []

    def load_pages(self, slots: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copies host slots back into device pages (host-to-device) and frees the slots."""
        multihost.send(multihost.Op.LOAD_PAGES, (list(slots), list(page_ids)))
        pages = [self._host_page(slot) for slot in slots]
        (ids,) = self._padded_ids(page_ids)

        def stack(cache_leaf: jax.Array, *page_leaves: np.ndarray) -> np.ndarray:
            out = np.zeros((cache_leaf.shape[0], len(ids), *cache_leaf.shape[2:]), cache_leaf.dtype)  # [L, n, ...]
            for i, x in enumerate(page_leaves):
                out[:, i] = x
            return out

        batch = jax.tree.map(stack, self.kv_cache, *pages)
        self.kv_cache = self._scatter_pages(self.kv_cache, *self._global_inputs((ids, batch)))
        self.drop_host_pages(slots, broadcast=False)

    def drop_host_pages(self, slots: Sequence[int], broadcast: bool = True) -> None:
        """Frees host slots."""
        if broadcast:
            multihost.send(multihost.Op.DROP_PAGES, list(slots))
        for slot in slots:
            self.host_pages.pop(slot, None)

    def clear_pages(self, page_ids: Sequence[int]) -> None:
        """Zeroes pages (all layers, K and V and their scales), e.g. those a sequence filled with NaN K/V, before
        they are reused.

        Attention masks the slots past a sequence's length, but a masked weight of 0 times a stale NaN is still
        NaN: without this, the next owner of such a page would inherit the failure.
        """
        if not page_ids:
            return
        (ids,) = self._padded_ids(page_ids)
        multihost.send(multihost.Op.CLEAR_PAGES, ids)
        self._clear(ids)

    def _clear(self, ids: np.ndarray) -> None:
        self.kv_cache = self._clear_pages(self.kv_cache, self._global_inputs(ids))
        if self.draft_cache is not None:
            self.draft_cache = self._clear_pages(self.draft_cache, ids)

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
               spec_block: Callable[[int], int] | None = None, num_spec_tokens: int = 0) -> float:
        """Compiles the step for every decode and single-sequence prefill shape bucket; returns seconds taken.

        With speculative decoding (`spec_block(b)`: the drafts per sequence a step of batch bucket b gets, and
        `num_spec_tokens` = k), also the verify step of every decode batch bucket with drafts, padded to that
        many drafts per sequence (`execute_verify`'s max_block), times every page-table width, and, with a draft
        model, its drafting call for the same buckets (greedy rows; sampling rows compile on first use).

        Decode buckets: batch 1, 2, 4, ... up to max_num_seqs, times every page-table width. Prefill buckets: one
        sequence with 16, 32, ... up to max_num_batched_tokens new tokens, times every page-table width, and, when
        the attention backend has a flash kernel, the same token counts as a fresh prompt's first chunk. Each shape
        is compiled ahead of time (`lower().compile()`, nothing runs) and kept, so `execute` calls the compiled
        step directly. Other shapes (several prefill chunks at once, long suppress lists, penalties) compile on
        first use. With the persistent compilation cache a restart loads them from disk.
        """
        from tqdm import tqdm

        from jaxinfer.sampling_params import SamplingParams

        widths, w = [], MIN_PAGES_PER_SEQ
        while True:
            widths.append(min(w, self.max_pages_per_seq))
            if w >= self.max_pages_per_seq:
                break
            w *= 4
        batches = [b for b in (2 ** k for k in range(0, 16)) if b < 2 * max_num_seqs and b // 2 < max_num_seqs]
        batches = sorted({min(b, next_power_of_two(max_num_seqs, 2)) for b in batches})
        tokens = sorted({min(t, next_power_of_two(max_num_batched_tokens, MIN_PREFILL_TOKENS))
                         for t in (MIN_PREFILL_TOKENS * 2 ** k for k in range(12))
                         if t // 2 < max_num_batched_tokens})
        greedy = SamplingRow(SamplingParams(temperature=0), seed=0)
        shapes = [("decode", b, p) for p in widths for b in batches] + \
                 [("prefill", t, p) for p in widths for t in tokens if t <= p * self.page_size]
        if self.attention.flash is not None:  # a fresh prompt's first chunk is its own bucket
            shapes += [("fresh", t, page_bucket(-(-t // self.page_size), self.max_pages_per_seq))
                       for t in tokens if t <= self.max_pages_per_seq * self.page_size]
        if spec_block is not None:
            spec = [(b, spec_block(b)) for b in batches if spec_block(b) > 0]
            shapes += [("verify", b, p) for p in widths for b, _ in spec]
            if self.draft is not None:
                shapes += [("propose", b, p) for p in widths for b, _ in spec]
        t0 = time.perf_counter()
        for kind, n, p in tqdm(shapes, desc="compiling step shapes", unit="shape", leave=False):
            context = p * self.page_size
            if kind in ("verify", "propose"):
                self._warm_spec(kind, n, spec_block(n), num_spec_tokens, p, greedy)
                continue
            if kind == "decode":
                chunks = [ScheduledChunk([0], context - 1, [NULL_PAGE] * p)] * n
            elif kind == "prefill":
                chunks = [ScheduledChunk([0] * n, context - n, [NULL_PAGE] * p)]
            else:
                chunks = [ScheduledChunk([0] * n, 0, [NULL_PAGE] * p)]
            tokens, metadata, rows_pad = self._prepare(chunks, all_rows=False)
            sampling = SamplingArrays.build([greedy] * len(chunks), rows_pad, self.cfg.vocab_size, self.vocab_limit)
            args = (self.weights, *self._global_inputs((tokens, metadata)), self.kv_cache,
                    self._global_inputs(sampling), *self._draft_args())
            self._compiled[("step", _shape_key(args))] = self._step.lower(*args).compile()
        seconds = time.perf_counter() - t0
        logger.info("compiled %d step shapes in %.1f s", len(shapes), seconds)
        return seconds

    def _warm_spec(self, kind: str, batch: int, drafts: int, num_spec_tokens: int, width: int,
                   greedy: SamplingRow) -> None:
        """Compiles one verify or drafting shape of `warmup` (batch sequences of `drafts` drafts, page width)."""
        context = width * self.page_size - drafts - 1
        if context < 0:
            return
        if kind == "verify":
            chunks = [ScheduledChunk([0] * (drafts + 1), context, [NULL_PAGE] * width)] * batch
            tokens, metadata, b_pad = self._prepare(chunks, all_rows=False, verify_width=num_spec_tokens + 1,
                                                    max_block=drafts + 1)
            sampling = SamplingArrays.build([greedy] * batch, b_pad, self.cfg.vocab_size, self.vocab_limit)
            ids, num_drafts = np.zeros((b_pad, num_spec_tokens), np.int32), np.zeros(b_pad, np.int32)
            args = (self.weights, *self._global_inputs((tokens, metadata)), self.kv_cache,
                    *self._global_inputs((sampling, ids)), None, self._global_inputs(num_drafts),
                    *self._draft_args())
            self._compiled[("verify", _shape_key(args))] = self._verify_step.lower(*args).compile()
        else:
            chunks = [ScheduledChunk([0], context, [NULL_PAGE] * width)] * batch
            inputs = self._propose_inputs(chunks, [greedy] * batch, [drafts] * batch, num_spec_tokens)
            args = self._propose_args(*inputs[:5])
            static = dict(num_tokens=num_spec_tokens, with_probs=False)
            self._compiled[("propose", _shape_key(args), num_spec_tokens, False)] = \
                self._propose.lower(*args, **static).compile()

    def _call(self, kind: str, *args):
        """The "step" or "verify" call, through an ahead-of-time compiled executable when warm-up made one for
        these shapes."""
        compiled = self._compiled.get((kind, _shape_key(args))) if self._compiled else None
        return (compiled or {"step": self._step, "verify": self._verify_step}[kind])(*args)

    def compute_logits(self, chunks: Sequence[ScheduledChunk]) -> np.ndarray:
        """Runs one step and returns the logits of every new token (for tests and evaluation).

        Returns:
          f32[sum of new tokens, V], rows in the order of `chunks` and their tokens.
        """
        tokens, metadata, _ = self._prepare(chunks, all_rows=True)
        multihost.send(multihost.Op.LOGITS, (tokens, metadata))
        logits = self._logits(tokens, metadata)
        return np.asarray(logits)[: sum(len(c.token_ids) for c in chunks), : self.output_vocab]

    def _logits(self, tokens: np.ndarray, metadata: AttentionMetadata) -> jax.Array:
        tokens, metadata = self._global_inputs((tokens, metadata))
        logits, self.kv_cache = self._forward_all(self.weights, tokens, metadata, self.kv_cache)
        return logits
