"""`StepGroups`: one step's groups of chunks on the model runner (`Engine.step` splits a step into decodes,
prefill chunks and prompt-logprob chunks).

1. `sampling_rows` gives each chunk's sampler inputs: params, seed, output step, penalties' ids, the tokens banned
   before min_tokens, and the allowed-token bitmask of its grammar and token rules.
2. `run` makes one device call for a group (a verify call when it carries drafts) and files each sequence's
   sampled token(s) and logprobs. A step of decodes may take the rows of a step dispatched ahead, and may
   dispatch the next one before reading its own (`run_ahead`, async scheduling).
3. A failing call is retried one sequence at a time so that only the sequence that fails is failed; rows whose
   logits are not finite fail alone too, and their own pages are discarded (`discard_pages`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from jaxinfer.engine.grammar import Grammars
from jaxinfer.engine.metrics import EngineMetrics
from jaxinfer.engine.prompt_logprobs import PromptLogprobs, wants
from jaxinfer.engine.run_ahead import RunAhead
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from jaxinfer.engine.step_results import StepResult, VerifyResult
from jaxinfer.engine.token_rules import TokenRules
from jaxinfer.outputs import Logprob
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.scheduler.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class _AfterTheStep(Exception):
    """Raised from `StepGroups._execute` for a failure after the step's own device call (launching the next step
    ahead: its page, the prefix cache's offloads): the engine's state, not these requests' values; `run` re-raises
    its cause to the engine loop instead of retrying the chunks one by one."""


class StepGroups:
    """Runs an engine's chunk groups on its runner; the arguments are the engine's parts.

    Attributes:
      spec_policy: the engine's speculative decoding policy, or None; set per step.
      verify_len: this step's verify window bound (drafts per sequence + 1), 0 without drafts; set per step.
      ahead: the decode steps dispatched ahead (`RunAhead`); enabled by `async_scheduling` without speculation.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, metrics: EngineMetrics, grammars: Grammars,
                 token_rules: TokenRules, decode: Callable[[int], str], prompt_logprobs: PromptLogprobs,
                 spec_policy: SpeculationPolicy | None, prefix_cache: PrefixCache | None,
                 async_scheduling: bool = False) -> None:
        self.runner, self.scheduler, self.metrics = runner, scheduler, metrics
        self.grammars, self.token_rules, self._decode = grammars, token_rules, decode
        self._prompt_logprobs, self.spec_policy, self.prefix_cache = prompt_logprobs, spec_policy, prefix_cache
        self.verify_len = 0
        self.ahead = RunAhead(runner, scheduler, grammars, token_rules, self.sampling_rows,
                              enabled=async_scheduling and spec_policy is None, stats=metrics.run_ahead)

    def run(self, chunks: list[ScheduledChunk], sampled: dict[int, int | list[int]],
            logprobs: dict[int, list[dict[int, Logprob]]], draft_probs_row: int | None = None,
            decodes: bool = False, launch: bool = False) -> None:
        """Runs chunks in one device call; on an exception retries them one by one and fails only the culprit.

        sampled, logprobs: filled per seq_id with the sampled token (or a verify step's emitted list) and its
        logprobs entries (when asked for).
        draft_probs_row: where these chunks' draft probabilities start among the runner's last proposal's rows
        (`ModelRunner.execute_verify`), or None.
        decodes: the step's decode chunks: they may take a step run ahead (`RunAhead.take`).
        launch: they are the whole step: the next one may run ahead (`RunAhead.launch`).
        """
        try:
            result = self._execute(chunks, draft_probs_row, decodes, launch)
        except _AfterTheStep as e:
            self.ahead.drop()
            raise e.__cause__ from None
        except Exception as e:  # noqa: BLE001 - isolate any failure of the step to the sequences that cause it
            self.ahead.drop()
            if len(chunks) == 1:  # a ValueError is the request's own values (no traceback for a client's error)
                (logger.warning if isinstance(e, ValueError) else logger.exception)(
                    "step failed for request %s: %s", chunks[0].seq.request_id, e)
                self.scheduler.fail(chunks[0].seq, *((str(e), "request") if isinstance(e, ValueError) else (
                    f"engine step failed: {type(e).__name__}: {e}", "engine")))
                self.metrics.num_errors += 1
                return
            for i, chunk in enumerate(chunks):
                self.run([chunk], sampled, logprobs, None if draft_probs_row is None else draft_probs_row + i)
            return
        self.metrics.num_padded_tokens += result.num_padded_tokens
        if isinstance(result, StepResult) and result.prompt_rows is not None:
            self._prompt_logprobs.record(chunks, result.prompt_rows)
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if not result.finite[i]:
                self.discard_pages(chunk)
                self.scheduler.fail(seq, "the model produced non-finite logits (NaN or inf)")
                self.metrics.num_errors += 1
                continue
            if not chunk.samples:
                continue
            if isinstance(result, VerifyResult):
                sampled[seq.seq_id] = result.emitted(i)
                if seq.params.logprobs is not None:
                    logprobs[seq.seq_id] = result.row_logprobs(i, seq.params.logprobs, self._decode)
            else:
                sampled[seq.seq_id] = int(result.token_ids[i])
                if seq.params.logprobs is not None:
                    logprobs[seq.seq_id] = [result.row_logprobs(i, seq.params.logprobs, self._decode)]
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

    def discard_pages(self, chunk: ScheduledChunk) -> None:
        """A sequence's own pages may hold NaN K/V: no later request may find them in the prefix cache, and those
        nobody else holds are zeroed before reuse (a masked 0 * NaN is still NaN). Pages it read from the cache
        or from its sample 0 were computed by others from the same tokens and stay as they are."""
        # and a page added for a step run ahead (`run_ahead`), which may have written there too
        own = (chunk.page_ids + chunk.seq.page_ids[len(chunk.page_ids):])[chunk.seq.num_shared_pages:]
        if self.prefix_cache is not None:
            self.prefix_cache.forget_pages(own)
        self.runner.kv.clear_pages([p for p in own if self.scheduler.allocator.refcount(p) == 1])

    def sampling_rows(self, chunks: list[ScheduledChunk], ahead: int = 0) -> list[SamplingRow]:
        """Each chunk's `SamplingRow` (an `allowed` bitmask only for chunks that sample); `ahead` > 0: as it will
        be that many tokens later, for a sequence whose sampling does not depend on them (`run_ahead`)."""
        masks = self.grammars.allowed_many([c.seq.seq_id for c in chunks if c.samples])  # in parallel
        return [SamplingRow(params=c.seq.params, seed=c.seq.seed, sample_index=c.seq.sample_index,
                            step=len(c.seq.output_token_ids) + ahead, prompt_token_ids=c.seq.prompt_token_ids,
                            output_token_ids=c.seq.output_token_ids,
                            suppress=(banned := self.scheduler.suppressed_token_ids(c.seq, ahead)),
                            allowed=self.token_rules.allowed(c.seq.seq_id, c.seq.output_token_ids,
                                                             masks.get(c.seq.seq_id), banned)
                            if c.samples else None) for c in chunks]

    def _execute(self, chunks: list[ScheduledChunk], draft_probs_row: int | None = None, decodes: bool = False,
                 launch: bool = False) -> StepResult | VerifyResult:
        if any(c.num_draft_tokens for c in chunks):
            self.metrics.num_device_calls += 1
            return self.runner.execute_verify(chunks, self.sampling_rows(chunks), [c.token_ids[1:] for c in chunks],
                                              self.spec_policy.config.num_speculative_tokens, draft_probs_row,
                                              verify_len=self.verify_len)
        self.metrics.num_device_calls += 1  # a step run ahead counts in the engine step that takes it
        if not decodes:
            self.ahead.drop()  # a step ahead no decode group took (this step has none): not running meanwhile
        taken = self.ahead.take(chunks) if decodes else None
        if taken is None:
            taken = self.runner.submit(chunks, self.sampling_rows(chunks),
                                       prompt_logprobs=any(wants(c) for c in chunks)), None
        step, rows = taken
        if launch:
            try:
                self.ahead.launch(chunks, step, rows)  # its own dispatch's failures it handles itself
            except Exception as e:
                raise _AfterTheStep() from e
        return step.result(rows)
