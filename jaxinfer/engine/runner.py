"""`ModelRunner`: the jitted device calls over padded ragged batches, and the table of their compiled executables.

1. The caller hands `execute` a list of `ScheduledChunk`s: each sequence's new tokens, how many of its tokens are
   already in the cache, and its page ids.
2. `jaxinfer.engine.step_inputs` pads them to shape buckets (powers of two for flat tokens, sequences, pages per
   sequence and the longest query run), so a handful of shapes are compiled and then reused.
3. One jitted step runs the model forward and samples a token per sequence; the KV cache (`kv_cache.PagedKVCache`)
   is donated and replaced by the step's output (the jitted functions are `jaxinfer.engine.device_steps`).
   Sampled tokens come back as numpy (`step_results`). A step for prompt logprobs returns every row's logits
   and their logprobs too (`jaxinfer.engine.prompt_logprobs`).

Speculative decoding adds two calls: `propose` (the draft model drafts k tokens per sequence on device) and
`execute_verify` (the target runs each sequence's last token plus its drafts, and `spec_decode.verify` picks the
accepted prefix and the next token from the k + 1 rows of logits of each sequence).

Each call is split in three so that a multi-host follower (`jaxinfer.engine.multihost.follow`) replays exactly
what the leader runs: `*_inputs` builds the host arrays (the broadcast payload), `run_*` makes the device call on
them, and the public method does both and brings the result to the host.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import multihost
from jaxinfer.engine.compiled_calls import CompiledCalls
from jaxinfer.engine.device_steps import fed_tokens
from jaxinfer.engine.device_steps import step as _step
from jaxinfer.engine.device_steps import verify_step as _verify_step
from jaxinfer.engine.kv_cache import PagedKVCache
from jaxinfer.engine.prompt_logprobs import PromptLogprobRows, chunk_targets
from jaxinfer.engine.sampling import SamplingArrays, SamplingRow
from jaxinfer.engine.spec_decode import draft as draft_lib
from jaxinfer.engine.spec_decode.verify import VerifyOutput
from jaxinfer.engine.step_inputs import (draft_inputs, min_rows, next_power_of_two, num_padded_tokens, prepare_step,
                                         verify_draft_ids)
from jaxinfer.engine.step_results import PendingStep, StepResult, VerifyResult
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.config import ModelConfig
from models.llama import AttentionMetadata, KVCache, Weights, forward, unstack_layers
from models.pipeline import pipeline_forward
from pallas_kernels.dispatch import REFERENCE_OPS, AttentionOps
from sharding.mesh import pipeline_stages

logger = logging.getLogger(__name__)

# call kind -> jitted attribute (`CompiledCalls` keys by the shapes after the first argument: weights; feed's tokens)
_JITTED = {"step": "_step", "verify": "_verify_step", "propose": "_propose", "feed": "fed_tokens"}


class ModelRunner:
    """Owns the weights and the paged KV cache on device and runs jitted calls over ragged batches.

    Args:
      cfg: model config.
      weights: device weights.
      num_pages: pages in the cache, including the null page 0.
      page_size: tokens per page.
      kv_dtype: cache dtype (`jaxinfer.engine.kv_cache.PagedKVCache`).
      scan_layers: scan over stacked layers instead of unrolling them; unrolled, the runner keeps one array per
        layer weight (`models.llama.unstack_layers`; see `models.llama.forward`).
      attention: attention functions (`pallas_kernels.dispatch.select_attention`); with a flash kernel,
        prefill steps of fresh prompts only (no cached context) compile as their own shape bucket.
      vocab_limit: ids at or above it are never sampled (a model's embedding table may be padded past the
        tokenizer's vocabulary); default: the model's vocabulary size.
      max_pages_per_seq: widest page table (context limit / page size); default from the model's context. Times
        page_size, it is the width of the penalty ids of a batch with penalties (`SamplingArrays.build`).
      mesh: the device mesh the weights are sharded on (`models.partition.shard_model`), or None for one
        device. With a mesh the KV cache is split over KV heads, and every step's outputs (sampled tokens,
        logits) come back replicated, so each process of a multi-host run can read them.
      output_vocab: logits columns `compute_logits` returns; default V. A model padded for TP has a larger V.
      draft: speculative decoding's draft model (`jaxinfer.engine.spec_decode.draft`), or None. One with a cache
        of its own gets one in `kv` (same pages), and every step also runs it over the step's tokens.
      kv: a `PagedKVCache` built beforehand for these arguments (start-up allocates it before the weights load,
        `jaxinfer.engine.startup`), or None to build one here.
      pipeline_microbatches: micro-batches per step when the mesh has pipeline stages (`models.pipeline`; the
        weights then laid out by `models.pipeline.pad_layers`); unused without stages.

    Attributes:
      kv: the `PagedKVCache`: device caches (`kv_cache`, `draft_cache` are its), host tier, page moves.

    Raises:
      ValueError: num_pages < 2.
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, *, num_pages: int, page_size: int, kv_dtype: jnp.dtype,
                 scan_layers: bool = False, attention: AttentionOps = REFERENCE_OPS, vocab_limit: int | None = None,
                 max_pages_per_seq: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 output_vocab: int | None = None, draft: draft_lib.DraftModel | None = None,
                 kv: PagedKVCache | None = None, pipeline_microbatches: int = 1) -> None:
        self.cfg = cfg
        self.model = forward
        if pipeline_stages(mesh) > 1:  # the target's forward runs over the stages
            self.model = functools.partial(pipeline_forward, num_microbatches=pipeline_microbatches)
        # Unrolled: one array per layer weight, so no layer's weights are sliced (copied) out of a stack per step.
        self.weights = weights if scan_layers else unstack_layers(weights)
        self.vocab_limit = cfg.vocab_size if vocab_limit is None else vocab_limit
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_seq = max_pages_per_seq or -(-cfg.max_position_embeddings // page_size)
        self._sampling_arrays = functools.partial(  # penalty ids as wide as the longest context: 2 shapes a batch
            SamplingArrays.build, vocab=cfg.vocab_size, vocab_limit=self.vocab_limit,
            penalty_width=self.max_pages_per_seq * page_size)
        self.output_vocab = cfg.vocab_size if output_vocab is None else output_vocab
        self.mesh = mesh
        self.fewest_rows = min_rows(1 if mesh is None else mesh.size)  # 1 with the native CPU kernels
        self.attention = attention
        self.draft = draft
        own_draft_cache = draft is not None and not draft.shares_target_cache
        self.kv = kv or PagedKVCache(cfg, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype, mesh=mesh,
                                     draft_cfg=draft.cfg if own_draft_cache else None)
        self._compiled = CompiledCalls()  # ahead-of-time compiled calls
        self._draft_probs = None  # the last proposal's draft probabilities, on device, for the verify step
        self._jit_calls(scan_layers)

    def _jit_calls(self, scan_layers: bool) -> None:
        """The jitted calls. On a mesh the cache stays split over KV heads and everything else is replicated."""
        model_kwargs = dict(cfg=self.cfg, scan_layers=scan_layers, attention=self.attention)
        if self.mesh is not None:
            model_kwargs["mesh"] = self.mesh  # MoE layers run their experts in a shard_map over it
        cache_out, replicated = self.kv.sharding, self.kv.replicated
        on_mesh = self.mesh is not None
        draft_kwargs = None
        if self.draft is not None:
            draft_kwargs = dict(model_kwargs, cfg=self.draft.cfg)
            propose_cache_out = cache_out if self.draft.shares_target_cache else None
            self._propose = jax.jit(functools.partial(draft_lib.propose, **draft_kwargs),
                                    static_argnames=("num_tokens", "with_probs"), donate_argnames=("kv_cache",),
                                    out_shardings=(replicated, replicated, propose_cache_out) if on_mesh else None)
        step_out = (replicated, replicated, cache_out, None) if on_mesh else None  # also verify's: its 4 results
        self._step = jax.jit(functools.partial(_step, draft_kwargs=draft_kwargs, model=self.model, **model_kwargs),
                             donate_argnames=("kv_cache", "draft_cache"), out_shardings=step_out)
        self._verify_step = jax.jit(functools.partial(_verify_step, draft_kwargs=draft_kwargs, model=self.model,
                                                      **model_kwargs),
                                    donate_argnames=("kv_cache", "draft_cache"),
                                    out_shardings=step_out)
        self.fed_tokens = jax.jit(fed_tokens, out_shardings=replicated if on_mesh else None)
        self._forward_all = jax.jit(functools.partial(self.model, **model_kwargs), donate_argnames=("kv_cache",),
                                    out_shardings=(replicated, cache_out) if on_mesh else None)

    @property
    def kv_cache(self) -> KVCache:
        """The target's device KV cache (`PagedKVCache.cache`)."""
        return self.kv.cache

    @kv_cache.setter
    def kv_cache(self, cache: KVCache) -> None:
        self.kv.cache = cache

    @property
    def draft_cache(self) -> KVCache | None:
        """A draft model's own device KV cache, or None (`PagedKVCache.draft_cache`)."""
        return self.kv.draft_cache

    @draft_cache.setter
    def draft_cache(self, cache: KVCache | None) -> None:
        self.kv.draft_cache = cache

    def _draft_args(self) -> tuple:
        """(draft weights, draft cache) for a call that keeps a draft's own cache in step, else ()."""
        return () if self.draft_cache is None else (self.draft.weights, self.draft_cache)

    # --- the compiled-executable table ------------------------------------------------------------------------

    def compile_ahead(self, kind: str, args: tuple, **static) -> None:
        """Compiles the "step", "verify", "propose" or "feed" call for these arguments' shapes (nothing runs) and
        keeps the executable: later calls with the same shapes run it directly (`CompiledCalls`)."""
        self._compiled.add(kind, getattr(self, _JITTED[kind]), args, **static)

    def _call(self, kind: str, *args, **static):
        return self._compiled.call(kind, getattr(self, _JITTED[kind]), args, self._idle, **static)

    def _idle(self) -> None:
        """Waits for every step this runner dispatched (each writes the KV cache): a compile, or a load from the
        persistent cache, never runs beside a step of ours (one that did crashed a test process)."""
        jax.block_until_ready((self.kv_cache, self.draft_cache))

    # --- one step ---------------------------------------------------------------------------------------------

    def _prepare(self, chunks: Sequence[ScheduledChunk], all_rows: bool, verify_width: int = 0,
                 verify_len: int = 0) -> tuple[np.ndarray, AttentionMetadata, int]:
        """`step_inputs.prepare_step` with this runner's page size, widest page table and attention backend."""
        return prepare_step(chunks, self.page_size, self.max_pages_per_seq, all_rows=all_rows,
                            flash=self.attention.flash is not None, verify_width=verify_width, verify_len=verify_len,
                            fewest_rows=self.fewest_rows)

    def step_inputs(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                    prompt_logprobs: bool = False) -> tuple:
        """The host arrays of one step (the `multihost.Op.STEP` payload): (tokens, metadata, sampling, prompt);
        prompt is None, or with `prompt_logprobs` (every chunk has a sequence) `_step`'s (targets, sampled rows)."""
        tokens, metadata, rows_pad = self._prepare(chunks, all_rows=prompt_logprobs)
        prompt = None
        if prompt_logprobs:
            targets = np.zeros(len(tokens), np.int32)
            targets[: sum(len(c.token_ids) for c in chunks)] = np.maximum(
                np.concatenate([chunk_targets(c) for c in chunks]), 0)
            sampled = np.zeros(rows_pad, np.int32)
            sampled[: len(chunks)] = metadata.cu_q_lens[1 : len(chunks) + 1] - 1
            prompt = targets, sampled
        return tokens, metadata, self._sampling_arrays(rows, rows_pad), prompt

    def step_args(self, tokens: np.ndarray, metadata: AttentionMetadata, sampling: SamplingArrays,
                  prompt: tuple | None = None, lowering: bool = False) -> tuple:
        """The jitted step's arguments for these host arrays (`lowering`: for `compile_ahead`, which does not wait
        for the KV cache's zero fill, `PagedKVCache.cache_for_lowering`)."""
        tokens, metadata, sampling, prompt = multihost.global_inputs((tokens, metadata, sampling, prompt), self.mesh)
        cache = self.kv.cache_for_lowering() if lowering else self.kv_cache
        return self.weights, tokens, metadata, cache, sampling, prompt, *self._draft_args()

    def run_step(self, tokens: np.ndarray, metadata: AttentionMetadata, sampling: SamplingArrays,
                 prompt: tuple | None = None) -> tuple[jax.Array, PromptLogprobRows | None]:
        """Runs one step on its host arrays (leader and followers); returns (the sampled rows packed as
        `step_results.pack_rows`, prompt logprob rows or None) on device."""
        rows, prompt_rows, self.kv_cache, self.draft_cache = self._call(
            "step", *self.step_args(tokens, metadata, sampling, prompt))
        return rows, prompt_rows

    def execute(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                prompt_logprobs: bool = False) -> StepResult:
        """Runs one step and samples the next token of every sequence (`submit`, then its `result`): one row per
        chunk on the host; with `prompt_logprobs` (every chunk with its sequence) their prompt logprobs too
        (`prompt_rows`, `jaxinfer.engine.prompt_logprobs`). Raises ValueError if a sequence has no new token or too
        few pages, or rows and chunks differ in length."""
        return self.submit(chunks, rows, prompt_logprobs).result()

    def submit(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow], prompt_logprobs: bool = False,
               fed_from: tuple[PendingStep, Sequence[int]] | None = None) -> PendingStep:
        """Dispatches one step (as `execute`) and returns without waiting for the device, so that the host can
        prepare the next step meanwhile (async scheduling, as vLLM's and SGLang's overlap schedulers).

        fed_from: (an earlier step, a row of it per chunk): chunk i's one token is that step's sampled token of
        row i, taken on device (`device_steps.fed_tokens`); the chunk's own token id is a placeholder. One
        process only (a multi-host follower replays host arrays).

        Raises:
          ValueError: as `execute`; `fed_from` in a multi-process run or with a chunk of several tokens.
        """
        if len(rows) != len(chunks):
            raise ValueError(f"{len(rows)} sampling rows for {len(chunks)} sequences")
        inputs = self.step_inputs(chunks, rows, prompt_logprobs)
        padded = num_padded_tokens(inputs[0], chunks)
        if fed_from is None:
            multihost.send(multihost.Op.STEP, inputs)
        else:
            if multihost.is_multi_process() or any(len(c.token_ids) != 1 for c in chunks):
                raise ValueError("a step fed from an earlier one runs in one process, one token per sequence")
            earlier, source = fed_from
            feed = np.full(len(inputs[0]), -1, np.int32)
            feed[inputs[1].cu_q_lens[: len(chunks)]] = source
            inputs = (self._call("feed", inputs[0], feed, earlier.rows), *inputs[1:])
        rows, prompt_rows = self.run_step(*inputs)
        return PendingStep(rows, prompt_rows, len(chunks), padded)

    def compile_step(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow]) -> jax.stages.Compiled:
        """The compiled step `execute` runs for this batch's shapes, without running it: for XLA's memory analysis
        (`.memory_analysis()`) and the optimized HLO (`.as_text()`)."""
        return self._step.lower(*self.step_args(*self.step_inputs(chunks, rows))).compile()

    def compute_logits(self, chunks: Sequence[ScheduledChunk]) -> np.ndarray:
        """Runs one step and returns the logits of every new token (for tests and evaluation).

        Returns:
          f32[sum of new tokens, V], rows in the order of `chunks` and their tokens.
        """
        tokens, metadata, _ = self._prepare(chunks, all_rows=True)
        multihost.send(multihost.Op.LOGITS, (tokens, metadata))
        logits = self.run_logits(tokens, metadata)
        return np.asarray(logits)[: sum(len(c.token_ids) for c in chunks), : self.output_vocab]

    def run_logits(self, tokens: np.ndarray, metadata: AttentionMetadata) -> jax.Array:
        """The forward of `compute_logits` on its host arrays; the logits stay on device."""
        tokens, metadata = multihost.global_inputs((tokens, metadata), self.mesh)
        logits, self.kv_cache = self._forward_all(self.weights, tokens, metadata, self.kv_cache)
        return logits

    # --- speculative decoding ---------------------------------------------------------------------------------

    def propose(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow], num_slots: Sequence[int],
                num_tokens: int) -> tuple[np.ndarray, bool]:
        """Drafts tokens with the draft model for decode chunks (`jaxinfer.engine.spec_decode.draft.propose`).

        Args:
          chunks: one decode chunk per sequence (its last token), pages covering its whole verify window:
            positions `[0, num_computed_tokens + 1 + num_slots[b])`.
          rows: the sequences' sampling rows at the window's first output step.
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
        inputs = self.propose_inputs(chunks, rows, num_slots, num_tokens)
        multihost.send(multihost.Op.PROPOSE, inputs)
        ids = self.run_propose(*inputs)
        return np.asarray(ids)[: len(chunks)], self._draft_probs is not None

    def propose_inputs(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                       num_slots: Sequence[int], num_tokens: int) -> tuple:
        """The drafting call's host inputs (the `multihost.Op.PROPOSE` payload): (tokens, positions, kv_loc,
        page_table, sampling, k, with_probs), see `step_inputs.draft_inputs`."""
        arrays = draft_inputs(chunks, num_slots, num_tokens, self.page_size, self.max_pages_per_seq)
        sampling = self._sampling_arrays(rows, arrays[0].shape[0])
        return *arrays, sampling, num_tokens, any(r.params.temperature > 0 for r in rows)

    def propose_args(self, tokens: np.ndarray, positions: np.ndarray, kv_loc: np.ndarray, page_table: np.ndarray,
                     sampling: SamplingArrays) -> tuple:
        """The drafting call's dynamic arguments: draft weights, the cache it runs on, then the inputs."""
        cache = self.kv_cache if self.draft.shares_target_cache else self.draft_cache
        inputs = multihost.global_inputs((tokens, positions, kv_loc, page_table, sampling), self.mesh)
        return self.draft.weights, cache, *inputs

    def run_propose(self, tokens: np.ndarray, positions: np.ndarray, kv_loc: np.ndarray, page_table: np.ndarray,
                    sampling: SamplingArrays, num_tokens: int, with_probs: bool) -> jax.Array:
        """The drafting call; keeps the draft probabilities on device for the verify step that follows."""
        args = self.propose_args(tokens, positions, kv_loc, page_table, sampling)
        ids, self._draft_probs, cache = self._call("propose", *args, num_tokens=num_tokens, with_probs=with_probs)
        if self.draft.shares_target_cache:
            self.kv_cache = cache
        else:
            self.draft_cache = cache
        return ids

    def verify_inputs(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                      draft_token_ids: Sequence[Sequence[int]], num_tokens: int, draft_probs_row: int | None = None,
                      verify_len: int = 0) -> tuple:
        """The verify step's host inputs (the `multihost.Op.VERIFY` payload): (tokens, metadata, sampling, draft
        ids, draft counts, draft_probs_row); arguments as `execute_verify`."""
        ids, num_drafts = verify_draft_ids(draft_token_ids, next_power_of_two(len(chunks)), num_tokens)
        tokens, metadata, rows_pad = self._prepare(chunks, all_rows=False, verify_width=num_tokens + 1,
                                                   verify_len=verify_len)
        return tokens, metadata, self._sampling_arrays(rows, rows_pad), ids, num_drafts, draft_probs_row

    def verify_args(self, tokens: np.ndarray, metadata: AttentionMetadata, sampling: SamplingArrays,
                    ids: np.ndarray, num_drafts: np.ndarray, draft_probs_row: int | None) -> tuple:
        """The jitted verify step's arguments; the draft probabilities are rows `draft_probs_row`, ... of the last
        proposal's (None: no probabilities)."""
        probs = None
        if draft_probs_row is not None:
            if self._draft_probs is None:
                raise ValueError("draft probabilities were asked for but the last proposal kept none")
            probs = self._draft_probs[draft_probs_row : draft_probs_row + ids.shape[0]]
        tokens, metadata, sampling, ids, num_drafts = multihost.global_inputs(
            (tokens, metadata, sampling, ids, num_drafts), self.mesh)
        return (self.weights, tokens, metadata, self.kv_cache, sampling, ids, probs, num_drafts,
                *self._draft_args())

    def run_verify(self, *inputs) -> tuple[VerifyOutput, jax.Array]:
        """Runs one verify step on its host inputs (`verify_inputs`); returns (verification, finite rows)."""
        out, finite, self.kv_cache, self.draft_cache = self._call("verify", *self.verify_args(*inputs))
        return out, finite

    def execute_verify(self, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
                       draft_token_ids: Sequence[Sequence[int]], num_tokens: int,
                       draft_probs_row: int | None = None, verify_len: int = 0) -> VerifyResult:
        """Runs one verify step: each sequence's last token plus its drafts, and `verify` on their logits.

        Args:
          chunks: one chunk per sequence: token_ids = [last token] + its drafts (0..k of them), pages covering them.
          rows: per-sequence sampling rows at the window's first output step.
          draft_token_ids: each sequence's drafts (the chunk's token_ids after the first).
          num_tokens: k, the draft width (static shape; >= every sequence's draft count).
          draft_probs_row: None for deterministic drafts (n-gram) or all-greedy rows; else these chunks' drafts
            are rows `draft_probs_row`, ... of the last `propose` call (which kept their probabilities on device):
            0 for the whole batch of that call in the same order, i for its i-th chunk alone.
          verify_len: pad as if every verify window had this many tokens (>= the longest; 0: no such padding),
            e.g. the step's drafts per sequence + 1, so the step hits a shape warm-up compiled.

        Returns:
          The verification on the host, one row per chunk.

        Raises:
          ValueError: if rows, chunks and drafts differ in length, or a chunk has more than k drafts.
        """
        if not len(rows) == len(chunks) == len(draft_token_ids):
            raise ValueError(f"{len(rows)} sampling rows and {len(draft_token_ids)} draft lists for "
                             f"{len(chunks)} sequences")
        inputs = self.verify_inputs(chunks, rows, draft_token_ids, num_tokens, draft_probs_row, verify_len)
        multihost.send(multihost.Op.VERIFY, inputs)
        out, finite = jax.tree.map(np.asarray, self.run_verify(*inputs))  # in place, as `execute`
        n = len(chunks)
        return VerifyResult(num_accepted=out.num_accepted[:n], token_ids=out.token_ids[:n], logprobs=out.logprobs[:n],
                            top_logprobs=out.top_logprobs[:n], top_token_ids=out.top_token_ids[:n],
                            ranks=out.ranks[:n], finite=finite[:n],
                            num_padded_tokens=num_padded_tokens(inputs[0], chunks))
