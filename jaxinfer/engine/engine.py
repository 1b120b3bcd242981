"""`Engine`: continuous batching over the paged KV cache.

1. `add_request` validates a request (a `ValueError` naming the field, before anything is queued), tokenizes it
   and hands `n` `Sequence`s to the scheduler.
2. `step` asks the scheduler for a plan: running decodes first, then prefill chunks within
   `max_num_batched_tokens`, preempting (recompute) when pages run out.
3. The plan runs as one device call for all decodes and one for the prefill chunks (the CPU reference attention
   pads every sequence to the longest query run, so keeping one-token decodes apart from long chunks saves work;
   the Pallas kernels take both in one call).
   With speculative decoding (`EngineConfig.speculative_config`, `jaxinfer.engine.spec_decode`), the policy first picks
   how many drafts each decoding sequence may have this step; the scheduler reserves pages and budget for them;
   the proposer drafts (n-gram lookup on the host, or the draft model on device); and the decodes run as one
   verify call, which emits each sequence's accepted drafts plus one token of the target's own.
4. A failing call is retried one sequence at a time so that only the sequence that fails is failed; rows whose
   logits are not finite fail alone too.
5. The scheduler appends sampled tokens (one at a time through the stop rules, also inside a verified block),
   frees the pages of finished sequences and those of rejected drafts; `step`
   returns a `RequestOutput` (cumulative text plus the new delta) for every request that moved.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from jaxinfer.engine import multihost
from jaxinfer.engine.config import (DEFAULT_KV_CACHE_DEVICE_FRACTION, DEFAULT_KV_CACHE_HOST_FRACTION,
                                    DEFAULT_OFFLOAD_MIN_PAGES, DTYPES, KV_CACHE_DTYPES, EngineConfig)
from jaxinfer.engine.runner import ModelRunner, StepResult, VerifyResult
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.loading import load_model, stored_quantization
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import KVOp, KVOpKind, PrefixCache
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.scheduler.scheduler import Scheduler, SchedulerConfig
from jaxinfer.scheduler.sequence import Sequence as Seq
from jaxinfer.engine.spec_decode import draft as draft_lib
from jaxinfer.engine.spec_decode.ngram import NgramIndex, NgramProposer
from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from jaxinfer.tokenizer import IncrementalDetokenizer
from models import quant
from models.llama import KVCache, Weights
from models.quant import QuantizationConfig
from pallas_kernels.dispatch import select_attention
from sharding.mesh import make_mesh
from sharding.partition import shard_model

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class EngineMetrics:
    """Counters and latency samples gathered by the engine (seconds and token counts)."""

    num_steps: int = 0
    num_device_calls: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_padded_tokens: int = 0
    num_finished: int = 0
    num_errors: int = 0
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    queue_time_s: list[float] = dataclasses.field(default_factory=list)
    step_time_s: float = 0.0
    host_time_s: float = 0.0


def _quantize(weights, cfg, qcfg: QuantizationConfig, dtype) -> Weights:
    """Quantizes one device's weights in a single compiled computation (no op-by-op dispatch)."""
    return jax.jit(functools.partial(quant.quantize_weights, cfg=cfg, qcfg=qcfg, dtype=dtype))(weights)


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache (unless the user set one): restarts skip XLA compiles."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("JAXINFER_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxinfer" / "xla"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Seq]
    arrival_time: float
    reported_finished: bool = False


class Engine:
    """Serves many requests at once: `add_request`, then `step` until `has_unfinished_requests()` is False.

    Raises:
      ValueError: from `EngineConfig`, the model loader, or a KV budget too small for one page.
    """

    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and not Path(spec.model).exists():
            raise ValueError(f"speculative draft model path {spec.model!r} does not exist")  # before loading the target
        enable_compilation_cache()
        self.config = config
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        t0 = time.perf_counter()
        tp, ep = config.tensor_parallel_size, config.expert_parallel_size
        self.mesh = make_mesh(tp=tp, ep=ep) if tp * ep > 1 else None
        # numpy weights; for an orbax checkpoint and a mesh, arrays restored straight onto the mesh
        self.quantization, quantize_at_load = self._quantization(config)
        qcfg = self.quantization
        load_dtype = np.float32 if quantize_at_load else np.dtype(self.dtype)  # quantized from f32
        cfg, np_weights, self.tokenizer = load_model(config.model, load_dtype, mesh=self.mesh)
        self.model_config = cfg  # as trained; the runner gets the TP-padded config
        if self.mesh is None:
            run_cfg, weights = cfg, jax.tree.map(jnp.asarray, np_weights)
            if quantize_at_load:
                weights = _quantize(weights, cfg, qcfg, self.dtype)
        else:
            sharded = shard_model(cfg, np_weights, self.mesh)  # a quantized checkpoint's weights padded as stored
            run_cfg, weights = sharded.cfg, sharded.weights
            if quantize_at_load:
                weights = quant.quantize_sharded(weights, run_cfg, qcfg, self.dtype)
            padded = "" if sharded.layout.heads_identity else \
                f" (padded from {cfg.num_heads} / {cfg.num_kv_heads}: KV heads replicated, so a KV page holds " \
                f"{run_cfg.num_kv_heads / cfg.num_kv_heads:.2g}x the bytes)"
            logger.info("sharded over tp=%d x ep=%d devices: %d query heads, %d KV heads%s", tp, ep,
                        run_cfg.num_heads, run_cfg.num_kv_heads, padded)
        del np_weights
        self.weight_bytes = quant.weight_bytes(weights)
        logger.info("loaded %s (%s%s) in %.1f s: %.1f MiB of weights", cfg.name, config.dtype,
                    "" if qcfg is None else f", {qcfg.format} weights ({self.weight_bytes['quantized_share']:.2%} of "
                    f"parameters quantized{'' if quantize_at_load else ', as stored in the checkpoint'})",
                    time.perf_counter() - t0, self.weight_bytes["bytes"] / 2**20)
        if qcfg is not None:
            logger.info("quantization: %s", qcfg)

        self.max_model_len = cfg.max_position_embeddings if config.max_model_len is None else config.max_model_len
        if not 1 <= self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} must be in [1, {cfg.max_position_embeddings}]")
        self.spec_config = config.speculative_config
        draft = self._load_draft(run_cfg, weights) if self.spec_config is not None else None
        page_bytes = KVCache.bytes_per_page(run_cfg, config.page_size, self.kv_dtype)  # over all devices
        if draft is not None and not draft.shares_target_cache:  # the draft's cache has a page for every page
            page_bytes += KVCache.bytes_per_page(draft.cfg, config.page_size, self.kv_dtype)
        if self.mesh is not None and jax.default_backend() != "cpu":
            page_bytes //= tp  # the budget is per device there (CPU devices share the host's memory)
        budget = config.kv_cache_memory_bytes or self._default_kv_budget()
        max_useful_pages = config.max_num_seqs * -(-self.max_model_len // config.page_size)
        num_pages = multihost.agree(min(int(budget) // page_bytes, max_useful_pages) + 1)  # same on every host
        if num_pages < 2:
            raise ValueError(f"kv_cache_memory_bytes={budget} is smaller than one KV page ({page_bytes} bytes)")
        self.page_size = config.page_size
        self.runner = ModelRunner(run_cfg, weights, num_pages=num_pages, page_size=config.page_size,
                                  kv_dtype=self.kv_dtype, scan_layers=config.scan_layers,
                                  attention=select_attention(config.attention_backend),
                                  vocab_limit=min(cfg.vocab_size, self.tokenizer.vocab_size),
                                  max_pages_per_seq=-(-self.max_model_len // config.page_size),
                                  mesh=self.mesh, output_vocab=cfg.vocab_size, draft=draft)
        self.page_allocator = PageAllocator(num_pages)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            min_pages = config.kv_offload_min_pages or DEFAULT_OFFLOAD_MIN_PAGES.get(jax.default_backend(), 1)
            if 0 < config.kv_offload_bytes < page_bytes:
                raise ValueError(f"kv_offload_bytes={config.kv_offload_bytes} is smaller than one KV page "
                                 f"({page_bytes} bytes)")
            self.prefix_cache = PrefixCache(self.page_allocator, config.page_size,
                                            host_capacity_pages=config.kv_offload_bytes // page_bytes,
                                            host_min_pages=min_pages)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            page_size=config.page_size, max_model_len=self.max_model_len),
            self.page_allocator, eos_ids=frozenset(self.tokenizer.eos_ids), prefix_cache=self.prefix_cache)
        self.metrics = EngineMetrics()
        self.spec_policy = None
        self._max_block = 0  # this step's verify block bound (drafts per sequence + 1), 0 without drafts
        if self.spec_config is not None:
            self.spec_policy = SpeculationPolicy(self.spec_config, jax.default_backend())
            self._ngram = NgramProposer(self.spec_config.prompt_lookup_min, self.spec_config.prompt_lookup_max)
            self._ngram_indexes: dict[int, NgramIndex] = {}
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._seq_logprobs: dict[int, list[dict[int, float]]] = {}
        self._auto_request_ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        logger.info("KV cache: %d pages of %d tokens, %s (%.1f MiB)", num_pages, config.page_size,
                    jnp.dtype(self.kv_dtype).name, num_pages * page_bytes / 2**20)
        if config.warmup:
            spec = self.spec_config
            self.runner.warmup(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                               spec_block=None if spec is None else self.spec_policy.step_k,
                               num_spec_tokens=0 if spec is None else spec.num_speculative_tokens)
        if multihost.is_multi_process() and multihost.is_leader():
            atexit.register(self.runner.release_followers)

    @staticmethod
    def _quantization(config: EngineConfig) -> tuple[QuantizationConfig | None, bool]:
        """(the effective quantization, resolved, or None; whether the weights are quantized at load).

        A quantized checkpoint's own quantization wins: `config.quantization` None takes it, an equal one is
        accepted, a different one is refused.

        Raises:
          ValueError: `config.quantization` differs from the checkpoint's (both named), or a malformed checkpoint.
        """
        stored = stored_quantization(config.model)
        wanted = None if config.quantization is None else config.quantization.resolved()
        if stored is None:
            return wanted, wanted is not None
        if wanted is not None and wanted != stored:
            raise ValueError(f"quantization={wanted} differs from the quantization the checkpoint {config.model!r} "
                             f"is stored with, {stored}; pass quantization=None (leave out --quantization) to use the "
                             f"checkpoint's, or convert "
                             f"the original model again")
        return stored, False

    def _load_draft(self, run_cfg, weights) -> draft_lib.DraftModel | None:
        """The draft model of "self_draft" / "draft_model" (None for "ngram").

        Raises:
          ValueError: for "draft_model" in a multi-process run, or a draft model whose vocabulary differs from the
            target's.
        """
        spec = self.spec_config
        if spec.method == "self_draft":
            return draft_lib.self_draft(run_cfg, weights, spec.num_draft_layers)
        if spec.method != "draft_model":
            return None
        if multihost.is_multi_process():
            raise ValueError("speculative method 'draft_model' runs in one process; use 'ngram' or 'self_draft'")
        try:
            # a quantized draft checkpoint is used as stored; other drafts are quantized like the target
            qcfg = None if stored_quantization(spec.model) is not None else self.quantization
            draft_cfg, draft_weights, draft_tokenizer = load_model(
                spec.model, np.float32 if qcfg is not None else np.dtype(self.dtype))
        except ValueError as e:
            raise ValueError(f"speculative draft model: {e}") from None
        draft_lib.check_draft_model(draft_cfg, run_cfg, draft_tokenizer.vocab_size, self.tokenizer.vocab_size)
        logger.info("draft model %s: %d layers", draft_cfg.name, draft_cfg.num_layers)
        draft_weights = jax.tree.map(jnp.asarray, draft_weights)
        if qcfg is not None:
            draft_weights = _quantize(draft_weights, draft_cfg, qcfg, self.dtype)
        return draft_lib.DraftModel(cfg=draft_cfg, weights=draft_weights,
                                    shares_target_cache=False)

    def shutdown(self) -> None:
        """Ends a multi-host run: the follower processes return from `follow_leader` (no-op in one process)."""
        self.runner.release_followers()

    def follow_leader(self) -> None:
        """Follower processes (process index > 0) of a multi-host run: replay the leader's steps until it shuts
        down. See `jaxinfer.engine.multihost`.

        Raises:
          RuntimeError: when called on the leader.
        """
        if multihost.is_leader():
            raise RuntimeError("follow_leader runs on follower processes (process index > 0) only")
        self.runner.follow()

    @staticmethod
    def _default_kv_budget() -> int:
        # From total memory (capped by half of what is available), rounded to 64 MiB, so that the cache shape,
        # and with it the persistent compilation cache's keys, stay the same from one start to the next.
        if jax.default_backend() == "cpu":
            mem = psutil.virtual_memory()
            budget = min(mem.total * DEFAULT_KV_CACHE_HOST_FRACTION, mem.available * 0.5)
            return max(int(budget) // (64 << 20) * (64 << 20), 64 << 20)
        stats = jax.devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return int(max(free, 0) * DEFAULT_KV_CACHE_DEVICE_FRACTION)

    # --- requests -----------------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | dict | Sequence[int]) -> tuple[str | None, list[int]]:
        """Turns a prompt (text, token ids, or `{"prompt_token_ids": [...]}`) into token ids.

        Raises:
          ValueError: an empty prompt, ids outside the vocabulary, or an unsupported prompt type.
        """
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            return self.tokenize_prompt(prompt["prompt"])  # a text prompt dict, as vLLM's {"prompt": text}
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or a text 'prompt'")
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string, token ids or a dict with 'prompt_token_ids', "
                             f"got {type(prompt).__name__}")
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
        return text, [int(t) for t in ids]

    def add_request(
        self,
        prompt: str | dict | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queues a request; it joins the running batch at the next step.

        Args:
          prompt: text, token ids, or `{"prompt_token_ids": [...], "prompt": text}` (either dict may carry
            `"cache_salt"`).
          params: sampling parameters (default `SamplingParams()`).
          request_id: unique id; one is assigned when None.
          cache_salt: requests with different salts never share prefix-cache pages (e.g. one salt per tenant).

        Returns:
          The request id.

        Raises:
          ValueError: duplicate request id, empty prompt, a prompt that leaves no room in the context, prompt +
            max_tokens beyond the context, a request that could never fit the KV cache, or bad params. Nothing is
            queued then.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._auto_request_ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._auto_request_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            cache_salt = prompt["cache_salt"] if cache_salt is None else cache_salt
            prompt = {k: v for k, v in prompt.items() if k != "cache_salt"}
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r} must be a non-empty string or None")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt must not be empty (it encodes to no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} tokens "
                             "(at least one token must be generated)")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens}: the prompt ({len(ids)} tokens) plus max_tokens exceeds "
                             f"the context of {self.max_model_len} tokens (max_tokens=None generates up to it)")
        now = time.perf_counter()
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
        seqs = []
        for index in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                           skip_special_tokens=params.skip_special_tokens)
            seqs.append(Seq(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=list(ids),
                            params=params, seed=base_seed, detokenizer=detok, arrival_time=now,
                            sample_index=index, cache_salt=cache_salt))
        added = []
        try:
            for seq in seqs:
                self.scheduler.add(seq)
                added.append(seq)
        except ValueError:
            if added:
                self.scheduler.abort(request_id)
            raise
        self._requests[request_id] = _Request(request_id, text, ids, params, seqs, now)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its pages; its next output (from `step`) has finish_reason "abort"."""
        if request_id in self._requests:
            self.scheduler.abort(request_id)

    def stats(self) -> dict[str, float | int]:
        """A snapshot of the engine's gauges and counters (for logs and the metrics exporter).

        Keys: running, waiting (sequences), kv_pages_used, kv_pages_total, preemptions, steps, device_calls,
        prefill_tokens, decode_tokens, tokens_per_step, finished, errors, host_time_share (host time over
        step time), ttft_s_mean, tpot_s_mean, queue_time_s_mean (seconds, over finished requests); with prefix
        caching also prefix_cache_queried_tokens / _hit_tokens / _hit_rate (tokens of admitted sequences),
        prefix_cache_pages (device pages holding cached prefixes), prefix_cache_evictions,
        prefix_cache_host_pages (pages in the host tier) and prefix_cache_host_hits (pages brought back).
        """
        m = self.metrics

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_pages_used": self.page_allocator.num_usable_pages - self.page_allocator.num_free_pages,
            "kv_pages_total": self.page_allocator.num_usable_pages,
            "preemptions": self.scheduler.num_preemptions,
            "steps": m.num_steps,
            "device_calls": m.num_device_calls,
            "prefill_tokens": m.num_prefill_tokens,
            "decode_tokens": m.num_decode_tokens,
            "tokens_per_step": (m.num_prefill_tokens + m.num_decode_tokens) / m.num_steps if m.num_steps else 0.0,
            "finished": m.num_finished,
            "errors": m.num_errors,
            "host_time_share": m.host_time_s / m.step_time_s if m.step_time_s else 0.0,
            "ttft_s_mean": mean(m.ttft_s),
            "tpot_s_mean": mean(m.tpot_s),
            "queue_time_s_mean": mean(m.queue_time_s),
            **self._prefix_cache_stats(),
            **(self.spec_policy.stats.as_dict() if self.spec_policy is not None else {}),
        }

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix page (device and host tier); later requests recompute their prefixes."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
            self._apply_kv_ops(self.prefix_cache.take_ops())

    def _prefix_cache_stats(self) -> dict[str, float | int]:
        if self.prefix_cache is None:
            return {}
        c = self.prefix_cache.stats
        return {
            "prefix_cache_queried_tokens": c.queried_tokens,
            "prefix_cache_hit_tokens": c.hit_tokens,
            "prefix_cache_hit_rate": c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0,
            "prefix_cache_pages": self.prefix_cache.num_cached_pages,
            "prefix_cache_evictions": self.page_allocator.num_evictions,
            "prefix_cache_host_pages": self.prefix_cache.num_host_pages,
            "prefix_cache_host_hits": c.host_hit_pages,
        }

    def has_unfinished_requests(self) -> bool:
        """True while some request has not reported its final output."""
        return any(not r.reported_finished for r in self._requests.values())

    # --- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns outputs of the requests that produced tokens or finished."""
        t_start = time.perf_counter()
        spec_slots = None
        if self.spec_policy is not None:
            spec_slots = self.spec_policy.plan(s.seq_id for s in self.scheduler.running if s.is_decoding)
        plan = self.scheduler.schedule(spec_slots)
        self._apply_kv_ops(plan.kv_ops)
        sampled: dict[int, int | list[int]] = {}
        logprobs: dict[int, list[dict[int, float]]] = {}
        decodes = [c for c in plan.chunks if len(c.token_ids) == 1 and c.samples]
        prefills = [c for c in plan.chunks if not (len(c.token_ids) == 1 and c.samples)]
        device_time = 0.0
        draft_probs_row = None
        self._max_block = 1 + max(spec_slots.values(), default=0) if spec_slots else 0
        if plan.num_spec_slots:
            t0 = time.perf_counter()
            decodes, draft_probs_row = self._propose(decodes)
            device_time += time.perf_counter() - t0
            if any(c.num_draft_tokens for c in decodes):
                self.spec_policy.stats.num_verify_steps += 1
            replaced = {id(c.seq): c for c in decodes}
            plan.chunks = [replaced.get(id(c.seq), c) for c in plan.chunks]
        for group, probs_row in ((decodes, draft_probs_row), (prefills, None)):
            if group:
                t0 = time.perf_counter()
                self._run_group(group, sampled, logprobs, probs_row)
                device_time += time.perf_counter() - t0
        self.scheduler.update(plan, sampled)  # skips sequences that failed or were aborted meanwhile
        if self.prefix_cache is not None:  # registering pages can free host-tier copies
            self._apply_kv_ops(self.prefix_cache.take_ops())
        for seq_id, entries in logprobs.items():
            self._seq_logprobs.setdefault(seq_id, []).extend(entries)
        self.metrics.num_steps += 1
        self.metrics.num_prefill_tokens += sum(len(c.token_ids) for c in prefills)
        self.metrics.num_decode_tokens += sum(len(c.token_ids) for c in decodes)
        total = time.perf_counter() - t_start
        self.metrics.step_time_s += total
        self.metrics.host_time_s += total - device_time
        return self._collect_outputs()

    def _apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Runs the prefix cache's page transfers in order, batching runs of the same kind into one call."""
        self.runner.settle_host_pages()  # offloads of earlier steps have reached the host by now
        calls = {KVOpKind.OFFLOAD: self.runner.offload_pages, KVOpKind.LOAD: self.runner.load_pages,
                 KVOpKind.COPY: self.runner.copy_pages}
        i = 0
        while i < len(ops):
            kind, j = ops[i].kind, i
            while j < len(ops) and ops[j].kind is kind:
                j += 1
            run = ops[i:j]
            if kind is KVOpKind.DROP:
                self.runner.drop_host_pages([op.src for op in run])
            else:
                calls[kind]([op.src for op in run], [op.dst for op in run])
            i = j

    def _propose(self, decodes: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], int | None]:
        """Drafts for the decode chunks that reserved slots; returns the chunks with their drafts appended and 0
        when the runner kept the draft model's probabilities for them (rows in chunk order), None when there are
        none (n-gram drafts, all-greedy rows). A failing draft model costs the step its drafts, never a request."""
        spec = self.spec_config
        if spec.method == "ngram":
            out = []
            for c in decodes:
                if c.spec_slots:
                    index = self._ngram_indexes.setdefault(c.seq.seq_id, self._ngram.new_index())
                    index.extend(c.seq.token_slice(len(index), c.seq.num_tokens))  # only the new ids
                    c = c.with_drafts(index.propose_next(c.spec_slots))
                out.append(c)
            return out, None
        try:
            ids, has_probs = self.runner.propose(decodes, self._sampling_rows(decodes),
                                             [c.spec_slots for c in decodes], spec.num_speculative_tokens)
        except Exception:  # noqa: BLE001 - drafts only ever save time; decode without them
            logger.exception("the draft model failed; decoding this step without drafts")
            return decodes, None
        return [c.with_drafts(ids[i, : c.spec_slots].tolist()) for i, c in enumerate(decodes)], 0 if has_probs else None

    def _run_group(self, chunks: list[ScheduledChunk], sampled: dict[int, int | list[int]],
                   logprobs: dict[int, list[dict[int, float]]], draft_probs_row: int | None = None) -> None:
        """Runs chunks in one device call; on an exception retries them one by one and fails only the culprit.

        draft_probs_row: where these chunks' draft probabilities start among the runner's last proposal's rows
        (`ModelRunner.execute_verify`), or None.
        """
        try:
            result = self._execute(chunks, draft_probs_row)
        except Exception as e:  # noqa: BLE001 - isolate any failure of the step to the sequences that cause it
            if len(chunks) == 1:
                logger.exception("step failed for request %s", chunks[0].seq.request_id)
                self.scheduler.fail(chunks[0].seq, f"engine step failed: {type(e).__name__}: {e}")
                self.metrics.num_errors += 1
                return
            for i, chunk in enumerate(chunks):
                self._run_group([chunk], sampled, logprobs,
                                None if draft_probs_row is None else draft_probs_row + i)
            return
        self.metrics.num_padded_tokens += result.num_padded_tokens
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if not result.finite[i]:
                self._discard_pages(chunk)
                self.scheduler.fail(seq, "the model produced non-finite logits (NaN or inf)")
                self.metrics.num_errors += 1
                continue
            if not chunk.samples:
                continue
            if isinstance(result, VerifyResult):
                sampled[seq.seq_id] = result.emitted(i)
                if seq.params.logprobs is not None:
                    logprobs[seq.seq_id] = result.row_logprobs(i, seq.params.logprobs)
            else:
                sampled[seq.seq_id] = int(result.token_ids[i])
                if seq.params.logprobs is not None:
                    logprobs[seq.seq_id] = [result.row_logprobs(i, seq.params.logprobs)]
            if self.spec_policy is not None and seq.is_decoding:
                emitted = sampled[seq.seq_id]
                self.spec_policy.record(seq.seq_id, chunk.num_draft_tokens,
                                        len(emitted) - 1 if isinstance(emitted, list) else 0,
                                        len(emitted) if isinstance(emitted, list) else 1)

    def _discard_pages(self, chunk: ScheduledChunk) -> None:
        """A sequence's own pages may hold NaN K/V: no later request may find them in the prefix cache, and those
        nobody else holds are zeroed before reuse (a masked 0 * NaN is still NaN). Pages it read from the cache
        or from its sample 0 were computed by others from the same tokens and stay as they are."""
        own = chunk.page_ids[chunk.seq.num_shared_pages:]
        if self.prefix_cache is not None:
            self.prefix_cache.forget_pages(own)
        self.runner.clear_pages([p for p in own if self.page_allocator.refcount(p) == 1])

    def _sampling_rows(self, chunks: list[ScheduledChunk]) -> list[SamplingRow]:
        return [SamplingRow(params=c.seq.params, seed=c.seq.seed, sample_index=c.seq.sample_index,
                            step=len(c.seq.output_token_ids), prompt_token_ids=c.seq.prompt_token_ids,
                            output_token_ids=c.seq.output_token_ids,
                            suppress=self.scheduler.suppressed_token_ids(c.seq)) for c in chunks]

    def _execute(self, chunks: list[ScheduledChunk], draft_probs_row: int | None = None) -> StepResult | VerifyResult:
        rows = self._sampling_rows(chunks)
        self.metrics.num_device_calls += 1
        if any(c.num_draft_tokens for c in chunks):
            return self.runner.execute_verify(chunks, rows, [c.token_ids[1:] for c in chunks],
                                              self.spec_config.num_speculative_tokens, draft_probs_row,
                                              max_block=self._max_block)
        return self.runner.execute(chunks, rows)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id, req in list(self._requests.items()):
            if req.reported_finished:
                continue
            deltas = [seq.stream_delta() for seq in req.seqs]
            finished = all(seq.is_finished for seq in req.seqs)
            if not finished and not any(ids or text for ids, text in deltas):
                continue
            outputs.append(self._request_output(req, deltas, finished))
            if finished:
                req.reported_finished = True
                self.metrics.num_finished += 1
                for seq in req.seqs:
                    if self.spec_policy is not None:
                        self.spec_policy.forget(seq.seq_id)
                        self._ngram_indexes.pop(seq.seq_id, None)
                    if seq.first_token_time is not None:
                        self.metrics.ttft_s.append(seq.first_token_time - seq.arrival_time)
                        if len(seq.output_token_ids) > 1 and seq.finish_time is not None:
                            self.metrics.tpot_s.append((seq.finish_time - seq.first_token_time)
                                                       / (len(seq.output_token_ids) - 1))
                    if seq.first_scheduled_time is not None:
                        self.metrics.queue_time_s.append(seq.first_scheduled_time - seq.arrival_time)
                del self._requests[request_id]
        return outputs

    def _request_output(self, req: _Request, deltas: list[tuple[list[int], str]], finished: bool) -> RequestOutput:
        completions = []
        for seq, (delta_ids, delta_text) in zip(req.seqs, deltas):
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = self._seq_logprobs.get(seq.seq_id, [])[: len(seq.output_token_ids)]
                if finished:
                    self._seq_logprobs.pop(seq.seq_id, None)
            completions.append(CompletionOutput(
                index=seq.sample_index, text=seq.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, delta_text=delta_text, delta_token_ids=delta_ids,
                logprobs=logprobs, error=seq.error))
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        ends = [s.finish_time for s in req.seqs if s.finish_time is not None]
        num_out = max((len(s.output_token_ids) for s in req.seqs), default=0)
        ttft = (min(first) - req.arrival_time) if first else 0.0
        decode_time = (max(ends) - min(first)) if first and ends and finished else 0.0
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_token_time=min(first) if first else None,
            finish_time=max(ends) if ends and finished else None, ttft_s=ttft,
            decode_tokens_per_s=(num_out - 1) / decode_time if num_out > 1 and decode_time > 0 else 0.0)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_token_ids), outputs=completions,
                             finished=finished, metrics=metrics,
                             num_cached_tokens=max(s.num_cached_tokens for s in req.seqs))
