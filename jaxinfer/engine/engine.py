"""`Engine`: continuous batching over the paged KV cache: the request table and the step loop.

1. `add_request` validates a request against the model (`jaxinfer.request_limits.check_against_model`: a
   `ValueError` naming the field, before anything is queued), tokenizes it and hands `n` `Sequence`s to the
   scheduler.
2. `step` asks the scheduler for a plan: running decodes first, then prefill chunks within
   `max_num_batched_tokens`, preempting (recompute) when pages run out. The plan's KV page moves run first.
3. The plan runs as one device call for all decodes and one for the prefill chunks (the CPU reference attention
   pads every sequence to the longest query run, so keeping one-token decodes apart from long chunks saves work;
   the Pallas kernels take both in one call). With speculative decoding (`jaxinfer.engine.spec_decode`), the
   policy first picks how many drafts each decoding sequence may have this step; the scheduler reserves pages and
   budget for them; the proposer drafts (n-gram lookup on the host, or the draft model on device); and the
   decodes run as one verify call, which emits each sequence's accepted drafts plus one token of the target's own.
4. A failing call is retried one sequence at a time so that only the sequence that fails is failed; rows whose
   logits are not finite fail alone too.
5. The scheduler appends sampled tokens (one at a time through the stop rules, also inside a verify window),
   frees the pages of finished sequences and those of rejected drafts; `step` returns a `RequestOutput`
   (cumulative text plus the new delta) for every request that moved.

Start-up is `jaxinfer.engine.startup`, the counters `jaxinfer.engine.metrics`, the page moves `kv_cache`.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxinfer.engine import multihost, startup
from jaxinfer.engine.auto_dtype import resolve_dtype
from jaxinfer.engine.config import DTYPES, EngineConfig
from jaxinfer.engine.grammar import Grammars
from jaxinfer.engine.metrics import EngineMetrics, engine_stats
from jaxinfer.engine.output_logprobs import OutputLogprobs
from jaxinfer.engine.prompt_logprobs import PromptLogprobs, wants
from jaxinfer.engine.request_outputs import request_output
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from jaxinfer.engine.spec_decode.proposer import StepProposer
from jaxinfer.engine.step_results import StepResult, VerifyResult
from jaxinfer.engine.token_rules import TokenRules
from jaxinfer.engine.warmup import start_warmup
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.prompt import Prompt, make_prompt
from jaxinfer.request_limits import check_against_model, check_text, show
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import Scheduler, SchedulerConfig
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.sequence import Sequence as Seq
from jaxinfer.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


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
        config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.model))  # "auto": the one run
        self.config = config
        self.dtype = DTYPES[config.dtype]
        started = startup.start(config)
        self.model_config = started.model_config  # as trained; the runner holds the TP-padded config
        self.tokenizer, self.quantization = started.tokenizer, started.quantization
        self.weight_bytes, self.mesh, self.max_model_len = started.weight_bytes, started.mesh, started.max_model_len
        self.page_size = config.page_size
        self.runner = started.runner
        self.page_allocator = PageAllocator(self.runner.num_pages)
        self.prefix_cache = startup.make_prefix_cache(config, self.page_allocator, started.page_bytes)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            page_size=config.page_size, max_model_len=self.max_model_len),
            self.page_allocator, eos_ids=frozenset(self.tokenizer.eos_ids), prefix_cache=self.prefix_cache)
        self.metrics = EngineMetrics()
        spec = self.spec_config = config.speculative_config
        self.spec_policy = None if spec is None else SpeculationPolicy(spec, jax.default_backend())
        self._proposer = None if spec is None else StepProposer(spec, self.runner)
        self._verify_len = 0  # this step's verify window bound (drafts per sequence + 1), 0 without drafts
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._logprobs = OutputLogprobs(self.tokenizer)
        self._prompt_logprobs = PromptLogprobs(self._logprobs.decode)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.token_rules = TokenRules(self.tokenizer, self.model_config.vocab_size, self.runner.vocab_limit)
        self._auto_request_ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        # the start-up compile (None with warmup off); it may still be loading shapes in the background
        self.warmup = start_warmup(self.runner, config, self.spec_policy)
        self._followers_released = False
        if multihost.is_multi_process() and multihost.is_leader():
            atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """Ends a multi-host run: the follower processes return from `follow_leader` (idempotent; no-op in one
        process)."""
        if not self._followers_released:
            self._followers_released = True
            multihost.release_followers()

    def follow_leader(self) -> None:
        """Follower processes (process index > 0) of a multi-host run: replay the leader's steps until it shuts
        down. See `jaxinfer.engine.multihost`.

        Raises:
          RuntimeError: when called on the leader.
        """
        if multihost.is_leader():
            raise RuntimeError("follow_leader runs on follower processes (process index > 0) only")
        multihost.follow(self.runner)

    # --- requests -----------------------------------------------------------------------------------------------

    def make_prompt(self, prompt: Prompt | str | dict | Sequence[int], cache_salt: str | None = None) -> Prompt:
        """`jaxinfer.prompt.make_prompt` with this engine's tokenizer and vocabulary (`runner.vocab_limit`: ids both
        the tokenizer and the embedding have; past the tokenizer's an id cannot be detokenized): text is tokenized
        here, once.

        Raises:
          ValueError: as `jaxinfer.prompt.make_prompt`.
        """
        return make_prompt(prompt, self.tokenizer.encode, self.runner.vocab_limit, cache_salt)

    def add_request(
        self,
        prompt: Prompt | str | dict | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queues a request; it joins the running batch at the next step.

        Args:
          prompt: a `Prompt` (taken as it is: not tokenized again), or anything `make_prompt` takes (text, token
            ids, `{"prompt_token_ids": [...]}` or `{"prompt": text}`, not both; either may carry `"cache_salt"`),
            which goes through `make_prompt` once.
          params: sampling parameters (default `SamplingParams()`).
          request_id: unique id; one is assigned when None.
          cache_salt: requests with different salts never share prefix-cache pages (e.g. one salt per tenant);
            when given, it wins over the prompt's own.

        Returns:
          The request id.

        Raises:
          ValueError: naming the field: duplicate request id, empty prompt, a prompt that leaves no room in the
            context, prompt + max_tokens (or min_tokens) beyond the context, a stop, logit_bias or allowed token id
            outside the vocabulary, min_tokens or bad_words banning every token, a request that never fits the KV
            cache, or bad params (`jaxinfer.request_limits.check_against_model`). Nothing is queued then, nor when
            anything else raises (a tokenizer's own exception, say: it propagates as it is).
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._auto_request_ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._auto_request_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={show(request_id)} must be a non-empty string")
        else:
            check_text("request_id", request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id={show(request_id)} is already in use")
        prompt = self.make_prompt(prompt, cache_salt)
        text, ids, cache_salt = prompt.text, list(prompt.token_ids), prompt.cache_salt
        check_against_model(params, len(ids), self.model_config.vocab_size, self.tokenizer.eos_ids,
                            self.max_model_len, sampled_vocab_size=self.runner.vocab_limit)
        rules = self.token_rules.compile(params)  # bad words that ban everything: ValueError, nothing queued
        now = time.perf_counter()
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
        seqs = []
        for index in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                           skip_special_tokens=params.skip_special_tokens)
            seqs.append(Seq(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=list(ids),
                            params=params, seed=base_seed, detokenizer=detok, arrival_time=now,
                            sample_index=index, cache_salt=cache_salt))
        self.grammars.add([s.seq_id for s in seqs], params)  # a grammar it cannot build: ValueError, nothing queued
        added = []
        try:
            for seq in seqs:
                self.scheduler.add(seq)
                added.append(seq)
        except BaseException:  # whatever the exception, the request is queued whole or not at all
            if added:
                self.scheduler.abort(request_id)
            raise
        self.token_rules.add([s.seq_id for s in seqs], rules)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.start(request_id, len(ids))
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
        return engine_stats(self.metrics, self.scheduler, self.page_allocator, self.prefix_cache, self.spec_policy)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix page (device and host tier); later requests recompute their prefixes."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
            self.runner.kv.apply_ops(self.prefix_cache.take_ops())

    def has_unfinished_requests(self) -> bool:
        """True while some request has not reported its final output."""
        return any(not r.reported_finished for r in self._requests.values())

    # --- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns outputs of the requests that produced tokens or finished."""
        t_start = time.perf_counter()
        spec_slots = None
        if self.spec_policy is not None:
            spec_slots = self.spec_policy.plan(s.seq_id for s in self.scheduler.running  # not constrained ones
                                               if s.is_decoding and s.seq_id not in self.grammars
                                               and self.token_rules.speculates(s.seq_id))
        plan = self.scheduler.schedule(spec_slots)
        self.runner.kv.apply_ops(plan.kv_ops)
        sampled: dict[int, int | list[int]] = {}
        logprobs: dict[int, list[dict[int, Logprob]]] = {}
        decodes = [c for c in plan.chunks if len(c.token_ids) == 1 and c.samples]
        rest = [c for c in plan.chunks if not (len(c.token_ids) == 1 and c.samples)]
        prefills, prompt_lp = [c for c in rest if not wants(c)], [c for c in rest if wants(c)]  # all rows' logits
        device_time = 0.0
        draft_probs_row = None
        self._verify_len = 1 + max(spec_slots.values(), default=0) if spec_slots else 0
        if plan.num_spec_slots:
            t0 = time.perf_counter()
            decodes, draft_probs_row = self._proposer.propose(decodes, self._sampling_rows)
            device_time += time.perf_counter() - t0
            if any(c.num_draft_tokens for c in decodes):
                self.spec_policy.stats.num_verify_steps += 1
            replaced = {id(c.seq): c for c in decodes}
            plan.chunks = [replaced.get(id(c.seq), c) for c in plan.chunks]
        for group, probs_row in ((decodes, draft_probs_row), (prefills, None), (prompt_lp, None)):
            if group:
                t0 = time.perf_counter()
                self._run_group(group, sampled, logprobs, probs_row)
                device_time += time.perf_counter() - t0
        self.scheduler.update(plan, sampled)  # skips sequences that failed or were aborted meanwhile
        if self.prefix_cache is not None:  # registering pages can free host-tier copies
            self.runner.kv.apply_ops(self.prefix_cache.take_ops())
        for seq_id, entries in logprobs.items():
            self._logprobs.extend(seq_id, entries)
        # Counted by the scheduler's phase, not by shape: a one-token prompt chunk rides in the decode call but
        # is prefill work.
        decode_tokens = sum(len(c.token_ids) for c in plan.chunks[:plan.num_decode_seqs])
        self.metrics.record_step(sum(len(c.token_ids) for c in plan.chunks) - decode_tokens, decode_tokens,
                                 time.perf_counter() - t_start, device_time)
        return self._collect_outputs()

    def _run_group(self, chunks: list[ScheduledChunk], sampled: dict[int, int | list[int]],
                   logprobs: dict[int, list[dict[int, Logprob]]], draft_probs_row: int | None = None) -> None:
        """Runs chunks in one device call; on an exception retries them one by one and fails only the culprit.

        draft_probs_row: where these chunks' draft probabilities start among the runner's last proposal's rows
        (`ModelRunner.execute_verify`), or None.
        """
        try:
            result = self._execute(chunks, draft_probs_row)
        except Exception as e:  # noqa: BLE001 - isolate any failure of the step to the sequences that cause it
            if len(chunks) == 1:  # a ValueError is the request's own values (no traceback for a client's error)
                (logger.warning if isinstance(e, ValueError) else logger.exception)(
                    "step failed for request %s: %s", chunks[0].seq.request_id, e)
                self.scheduler.fail(chunks[0].seq, *((str(e), "request") if isinstance(e, ValueError) else (
                    f"engine step failed: {type(e).__name__}: {e}", "engine")))
                self.metrics.num_errors += 1
                return
            for i, chunk in enumerate(chunks):
                self._run_group([chunk], sampled, logprobs,
                                None if draft_probs_row is None else draft_probs_row + i)
            return
        self.metrics.num_padded_tokens += result.num_padded_tokens
        if isinstance(result, StepResult) and result.prompt_rows is not None:
            self._prompt_logprobs.record(chunks, result.prompt_rows)
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
                    logprobs[seq.seq_id] = result.row_logprobs(i, seq.params.logprobs, self._logprobs.decode)
            else:
                sampled[seq.seq_id] = int(result.token_ids[i])
                if seq.params.logprobs is not None:
                    logprobs[seq.seq_id] = [result.row_logprobs(i, seq.params.logprobs, self._logprobs.decode)]
            # after a verify step too: a constrained row (never drafted) rides in it when other rows speculate
            if (refused := self.grammars.consume(seq.seq_id, sampled[seq.seq_id])) is not None:
                del sampled[seq.seq_id]
                self.scheduler.fail(seq, refused)
                continue
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
        self.runner.kv.clear_pages([p for p in own if self.page_allocator.refcount(p) == 1])

    def _sampling_rows(self, chunks: list[ScheduledChunk]) -> list[SamplingRow]:
        masks = self.grammars.allowed_many([c.seq.seq_id for c in chunks if c.samples])  # in parallel
        return [SamplingRow(params=c.seq.params, seed=c.seq.seed, sample_index=c.seq.sample_index,
                            step=len(c.seq.output_token_ids), prompt_token_ids=c.seq.prompt_token_ids,
                            output_token_ids=c.seq.output_token_ids,
                            suppress=(banned := self.scheduler.suppressed_token_ids(c.seq)),
                            allowed=self.token_rules.allowed(c.seq.seq_id, c.seq.output_token_ids,
                                                             masks.get(c.seq.seq_id), banned)
                            if c.samples else None) for c in chunks]

    def _execute(self, chunks: list[ScheduledChunk], draft_probs_row: int | None = None) -> StepResult | VerifyResult:
        rows = self._sampling_rows(chunks)
        self.metrics.num_device_calls += 1
        if any(c.num_draft_tokens for c in chunks):
            return self.runner.execute_verify(chunks, rows, [c.token_ids[1:] for c in chunks],
                                              self.spec_config.num_speculative_tokens, draft_probs_row,
                                              verify_len=self._verify_len)
        return self.runner.execute(chunks, rows, prompt_logprobs=any(wants(c) for c in chunks))

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
                self._prompt_logprobs.forget(request_id)
                for seq in req.seqs:
                    self._logprobs.forget(seq.seq_id)
                    self.grammars.forget(seq.seq_id)
                    self.token_rules.forget(seq.seq_id)
                    if self.spec_policy is not None:
                        self.spec_policy.forget(seq.seq_id)
                        self._proposer.forget(seq.seq_id)
                    self.metrics.record_finished(seq)
                del self._requests[request_id]
        return outputs

    def _request_output(self, req: _Request, deltas: list[tuple[list[int], str]], finished: bool) -> RequestOutput:
        logprobs = [self._logprobs.of(s.seq_id, len(s.output_token_ids)) if s.params.logprobs is not None else None
                    for s in req.seqs]
        return request_output(req.request_id, req.prompt, req.prompt_token_ids, req.seqs, req.arrival_time, deltas,
                              logprobs, finished, self._prompt_logprobs.of(req.request_id))
