"""`Engine`: continuous batching over the paged KV cache: the request table and the step loop.

1. `add_request` checks a request against the model (`request_limits.check_against_model`: a `ValueError`
   naming the field, before anything is queued), tokenizes it and hands `n` `Sequence`s to the scheduler.
2. `step` asks the scheduler for a plan: running decodes first, then prefill chunks within the token budget,
   preempting (recompute) when pages run out. The plan's KV page moves run first.
3. The plan runs as one device call for all decodes and one for the prefill chunks (the CPU reference attention
   pads every sequence to the longest query run, so one-token decodes stay apart from long chunks). With
   speculative decoding (`jaxinfer.engine.spec_decode`) the policy picks each decoding sequence's drafts, the
   scheduler reserves pages and budget for them, the proposer drafts (n-gram lookup on the host, or the draft
   model on device), and the decodes run as one verify call, which emits each sequence's accepted drafts plus a
   token of the target's own. Without it, a step of decodes only dispatches the next before its tokens are read
   (`run_ahead`, async scheduling). A failing call is retried one sequence at a time (only the culprit fails);
   rows whose logits are not finite fail alone too.
4. The scheduler appends the sampled tokens through the stop rules (also inside a verify window) and frees the
   pages of finished sequences and rejected drafts; `step` returns a `RequestOutput` for each request that moved.

Start-up is `jaxinfer.engine.startup`, the counters `jaxinfer.engine.metrics`, the page moves `kv_cache`, the
device calls of a step `step_groups`, admission and resuming with output so far `admission`, and the KV handoff of
disaggregated prefill / decode (`prefill_only`, `export_kv`, `import_kv`) `kv_handoff`.
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
from jaxinfer.engine.admission import check_output_so_far, new_sequences, request_id_or_new
from jaxinfer.engine.auto_dtype import resolve_dtype
from jaxinfer.engine.config import DTYPES, EngineConfig
from jaxinfer.engine.grammar import Grammars
from jaxinfer.engine.kv_handoff import KVHandoff, check_handoff, export_handoff, resolve_wire_dtype, write_handoff
from jaxinfer.engine.metrics import EngineMetrics, engine_stats
from jaxinfer.engine.output_logprobs import OutputLogprobs
from jaxinfer.engine.prompt_logprobs import PromptLogprobs, wants
from jaxinfer.engine.request_outputs import request_output
from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from jaxinfer.engine.spec_decode.proposer import StepProposer
from jaxinfer.engine.step_groups import StepGroups
from jaxinfer.engine.token_rules import TokenRules
from jaxinfer.engine.warmup import start_warmup
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.prompt import Prompt, make_prompt
from jaxinfer.request_limits import check_against_model, show
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import Scheduler, SchedulerConfig
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.sequence import Sequence as Seq
from jaxinfer.scheduler.sequence import SequenceStatus

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

    def __init__(self, config: EngineConfig | None = None) -> None:
        # None, not a default instance: EngineConfig() checks the environment, which must not run at import
        config = EngineConfig() if config is None else config
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
        self._requests: dict[str, _Request] = {}
        self._handoffs: dict[str, tuple[str | None, Seq]] = {}  # prefill-only requests' (prompt text, sequence)
        self._seq_ids = itertools.count()
        self._logprobs = OutputLogprobs(self.tokenizer)
        self._prompt_logprobs = PromptLogprobs(self._logprobs.decode)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.token_rules = TokenRules(self.tokenizer, self.model_config.vocab_size, self.runner.vocab_limit)
        self._groups = StepGroups(self.runner, self.scheduler, self.metrics, self.grammars, self.token_rules,
                                  self._logprobs.decode, self._prompt_logprobs, self.spec_policy, self.prefix_cache,
                                  config.async_scheduling)
        self._auto_request_ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        # the start-up compile (None with warmup off); it may still be loading shapes in the background
        self.warmup = start_warmup(self.runner, config, self.spec_policy)
        self.runner.kv.wait_filled()  # overlapped with the above; a failed fill fails the start
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
        *,
        output_token_ids: Sequence[int] = (),
        prefill_only: bool = False,
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
          output_token_ids: tokens an earlier attempt of this request generated and streamed (its engine died):
            they count as output, not prompt, and the stream goes on after them (`jaxinfer.engine.admission`).
          prefill_only: prefill and sample the first token, then finish with finish_reason "handoff", keeping the
            KV pages for `export_kv` (`jaxinfer.engine.kv_handoff`); a first token that ends the request (EOS,
            max_tokens=1) finishes it as usual. Needs n = 1.

        Returns:
          The request id.

        Raises:
          ValueError: naming the field: duplicate request id, empty prompt, a prompt that leaves no room in the
            context, prompt + max_tokens (or min_tokens) beyond the context, a stop, logit_bias or allowed token id
            outside the vocabulary, min_tokens or bad_words banning every token, a request that never fits the KV
            cache, or bad params (`jaxinfer.request_limits.check_against_model`); output_token_ids that are not
            ids, reach max_tokens or already end the request (`jaxinfer.engine.admission`); n > 1 with
            output_token_ids or prefill_only. Nothing is queued then, nor when anything else raises (a
            tokenizer's own exception, say: it propagates as it is).
        """
        params = self._check_params(params)
        request_id = request_id_or_new(request_id, self._in_use, self._auto_request_ids)
        return self._admit(self.make_prompt(prompt, cache_salt), params, request_id, output_token_ids, prefill_only)

    def export_kv(self, request_id: str, wire_dtype: str | None = None) -> KVHandoff:
        """Reads the KV pages of a request that finished with "handoff" (`add_request(prefill_only=True)`) to the
        host as a `kv_handoff.KVHandoff` and frees them (full pages stay in the prefix cache).

        Args:
          request_id: the request.
          wire_dtype: page dtype of the payload, a `kv_handoff.WIRE_DTYPES` name ("float32", "bfloat16", "int8",
            "fp8": int8 / fp8 quantized per token, `pallas_kernels.kv_quant`), or None for the cache's own.

        Raises:
          ValueError: no request of that id holds pages for a handoff, an unknown wire_dtype, or a multi-process
            engine (the handoff runs in one process).
        """
        dtype = resolve_wire_dtype(wire_dtype, self.runner.kv.kv_dtype)
        if request_id not in self._handoffs or multihost.is_multi_process():
            raise ValueError("KV handoff runs in one process" if request_id in self._handoffs else
                             f"request_id={show(request_id)} holds no KV pages for a handoff (not a prefill_only "
                             "request that finished with 'handoff', or exported or aborted already)")
        text, seq = self._handoffs.pop(request_id)
        try:
            return export_handoff(self.runner.kv, self.model_config, self.mesh, seq, text, dtype)
        finally:
            self.scheduler.pages.release(seq)

    def import_kv(self, handoff: KVHandoff, params: SamplingParams, request_id: str | None = None) -> str:
        """Queues a request another engine prefilled (`export_kv`'s payload): its K/V goes into pages of this engine
        (converted to this engine's KV dtype, page size and TP layout), and it goes on from its output so far as if
        prefilled here (`jaxinfer.engine.kv_handoff`). With too few free pages, it is recomputed.

        Args:
          handoff: the payload.
          params: the request's sampling parameters (as given to the prefill engine).
          request_id: as `add_request`.

        Returns:
          The request id.

        Raises:
          ValueError: a payload for another model shape (layers, KV heads, head dim) or inconsistent in itself
            (`kv_handoff.check_handoff`), a multi-process engine, or as `add_request` with output_token_ids.
        """
        params = self._check_params(params)
        request_id = request_id_or_new(request_id, self._in_use, self._auto_request_ids)
        check_handoff(handoff, self.model_config)
        if multihost.is_multi_process():
            raise ValueError("KV handoff runs in one process")
        return self._admit(self.make_prompt(handoff.prompt), params, request_id, handoff.output_token_ids,
                           seed=handoff.seed, handoff=handoff)

    def _in_use(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._handoffs

    @staticmethod
    def _check_params(params: SamplingParams | None) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        return params

    def _admit(self, prompt: Prompt, params: SamplingParams, request_id: str, output_token_ids: Sequence[int],
               prefill_only: bool = False, seed: int | None = None, handoff: KVHandoff | None = None) -> str:
        ids = prompt.token_ids
        check_against_model(params, len(ids), self.model_config.vocab_size, self.tokenizer.eos_ids,
                            self.max_model_len, sampled_vocab_size=self.runner.vocab_limit)
        output = check_output_so_far(output_token_ids, params, self.runner.vocab_limit)
        rules = self.token_rules.compile(params)  # bad words that ban everything: ValueError, nothing queued
        now = time.perf_counter()
        seed = seed if seed is not None else params.seed if params.seed is not None else int(
            self._seed_rng.integers(0, 2**32))
        seqs = new_sequences(self.tokenizer, prompt, params, request_id, self._seq_ids, seed, now, output,
                             prefill_only, self.scheduler.eos_ids, self.max_model_len)
        self.grammars.add([s.seq_id for s in seqs], params)  # a grammar it cannot build: ValueError, nothing queued
        if output and (refused := self.grammars.consume(seqs[0].seq_id, output)) is not None:
            self.grammars.forget(seqs[0].seq_id)
            raise ValueError(f"output_token_ids: {refused}")
        added = []
        try:
            if handoff is not None and not write_handoff(self.runner.kv, self.model_config, self.mesh,
                                                         self.page_allocator, self.prefix_cache, seqs[0], handoff):
                logger.warning("KV handoff of request %s: too few free pages, its %d tokens are recomputed",
                               request_id, handoff.num_tokens)
            for seq in seqs:
                self.scheduler.add(seq)
                added.append(seq)
        except BaseException:  # whatever the exception, the request is queued whole or not at all
            if added:
                self.scheduler.abort(request_id)
            elif seqs[0].page_ids:
                self.scheduler.pages.release(seqs[0])
            raise
        self.token_rules.add([s.seq_id for s in seqs], rules)
        if output and params.logprobs is not None:  # the earlier tokens' entries are the earlier attempt's
            self._logprobs.extend(seqs[0].seq_id, [{}] * len(output))
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.start(request_id, len(ids))
        self._requests[request_id] = _Request(request_id, prompt.text, list(ids), params, seqs, now)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its pages (also those held for a handoff); its next output (from `step`)
        has finish_reason "abort"."""
        if request_id in self._requests:
            self.scheduler.abort(request_id)
        if (held := self._handoffs.pop(request_id, None)) is not None:
            self.scheduler.pages.release(held[1])

    def stats(self) -> dict[str, float | int]:
        """A snapshot of the engine's gauges and counters (for logs and the metrics exporter). Keys: running, waiting (sequences), kv_pages_used, kv_pages_total, preemptions, steps, device_calls,
        prefill_tokens, decode_tokens, tokens_per_step, finished, errors, host_time_share (host time over step
        time), ttft_s_mean, tpot_s_mean, queue_time_s_mean (seconds, over finished requests), run_ahead_steps /
        run_ahead_dropped_steps (async scheduling's steps dispatched ahead / not taken); with prefix caching also
        prefix_cache_queried_tokens / _hit_tokens / _hit_rate (tokens of admitted sequences), prefix_cache_pages
        (device pages holding cached prefixes), prefix_cache_evictions, prefix_cache_host_pages (pages in the
        host tier) and prefix_cache_host_hits (pages brought back).
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
        self._groups.ahead.begin_step()
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
        self._groups.spec_policy = self.spec_policy  # the engine's attribute may be swapped between steps
        self._groups.verify_len = 1 + max(spec_slots.values(), default=0) if spec_slots else 0
        if plan.num_spec_slots:
            t0 = time.perf_counter()
            decodes, draft_probs_row = self._proposer.propose(decodes, self._groups.sampling_rows)
            device_time += time.perf_counter() - t0
            if any(c.num_draft_tokens for c in decodes):
                self.spec_policy.stats.num_verify_steps += 1
            replaced = {id(c.seq): c for c in decodes}
            plan.chunks = [replaced.get(id(c.seq), c) for c in plan.chunks]
        for group, probs_row in ((decodes, draft_probs_row), (prefills, None), (prompt_lp, None)):
            if group:
                t0 = time.perf_counter()
                self._groups.run(group, sampled, logprobs, probs_row, decodes=group is decodes,
                                 launch=group is decodes and not prefills and not prompt_lp)
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
                    if seq.status is SequenceStatus.FINISHED_HANDOFF:  # its pages wait for `export_kv`
                        self._handoffs[request_id] = (req.prompt, seq)
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
