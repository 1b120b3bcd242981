"""`RunAhead`: async scheduling of decode steps. While step N runs on the device, the host already dispatches step
N + 1, so that the host's work of a step (its scheduling, its inputs, the dispatch, reading and filing the tokens,
the outputs) overlaps the device's instead of adding to it (vLLM's async scheduling, SGLang's overlap scheduler).

1. `launch`: after a step of decodes only is dispatched (`ModelRunner.submit`) and before its tokens are read,
   the next step is built as the scheduler will build it if every sequence goes on: each sequence one position
   further, its token a placeholder that the device fills with the sampled token of step N's row
   (`device_steps.fed_tokens`), a page added where the next position starts one. It is dispatched at once.
2. `take`: the next `Engine.step` schedules as always; each of its decode chunks that the step in flight computed
   (same sequence, position and pages) takes that step's row. When every chunk is one, no new step runs.
   Otherwise the step in flight is dropped: its K/V writes lie past every sequence's length, in pages that later
   steps overwrite or that went back to the allocator.
3. A step runs ahead only when its sequences' next sampling does not depend on the token just sampled (no
   grammar, no penalties, no bad word of several tokens) and none of them can end by length at step N; one
   process only (a multi-host follower replays host arrays). A sequence that stops on EOS or a stop string
   costs its row of the step in flight (`metrics.RunAheadStats.dropped_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from jaxinfer.engine import multihost
from jaxinfer.engine.grammar import Grammars
from jaxinfer.engine.metrics import RunAheadStats
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.step_results import PendingStep
from jaxinfer.engine.token_rules import TokenRules
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.scheduler.sequence import SequenceStatus

logger = logging.getLogger(__name__)


class RunAhead:
    """Dispatches a decode step before the previous one's tokens reach the host (module docstring).

    Args:
      runner, scheduler, grammars, token_rules: the engine's.
      sampling_rows: (chunks, ahead) -> their `SamplingRow`s as they will be `ahead` tokens later
        (`StepGroups.sampling_rows`).
      enabled: False: `launch` never dispatches (`EngineConfig.async_scheduling`).
      stats: the engine's counters to update (`EngineMetrics.run_ahead`).
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, grammars: Grammars, token_rules: TokenRules,
                 sampling_rows: Callable[[list[ScheduledChunk], int], list[SamplingRow]], enabled: bool,
                 stats: RunAheadStats) -> None:
        self.runner, self.scheduler, self.grammars, self.token_rules = runner, scheduler, grammars, token_rules
        self._sampling_rows, self.enabled = sampling_rows, enabled
        self.stats = stats
        self._pending: PendingStep | None = None
        self._rows: dict[tuple, int] = {}  # the step in flight's chunks: (seq_id, start, pages) -> row
        self._step = self._launched_at = 0

    def begin_step(self) -> None:
        """Marks an engine step's start: a step launched earlier than the previous engine step is never taken."""
        self._step += 1

    def take(self, chunks: list[ScheduledChunk]) -> tuple[PendingStep, list[int]] | None:
        """(the step in flight, its row for each chunk) when it computed every one of `chunks`, else None (the
        step in flight, if any, is dropped). Either way nothing is in flight afterwards."""
        pending, rows, self._pending, self._rows = self._pending, self._rows, None, {}
        if pending is None:
            return None
        picked = [rows.get(_key(c)) for c in chunks] if self._launched_at == self._step - 1 else [None]
        if None in picked:
            self._pending = pending
            self.drop()
            return None
        self.stats.used += 1
        self.stats.dropped_rows += pending.num_chunks - len(picked)
        return pending, picked

    def drop(self) -> None:
        """Forgets the step in flight, once it has run: nothing of ours runs on the device while a later call
        compiles or loads a program (loading one the running step also runs crashed a test process)."""
        if self._pending is not None:
            self.stats.dropped += 1
            self.stats.dropped_rows += self._pending.num_chunks
            try:
                self._pending.rows.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step ahead is dropped all the same; the step itself reports
                logger.debug("a dropped step ahead failed", exc_info=True)
        self._pending, self._rows = None, {}

    def launch(self, chunks: list[ScheduledChunk], step: PendingStep, rows: list[int] | None) -> None:
        """Dispatches the step after `step` when every chunk's sequence qualifies (module docstring, 3) and the
        pages it needs are free.

        Args:
          chunks: `step`'s decode chunks, the whole of this engine step.
          step: dispatched, not yet read.
          rows: `step`'s row of each chunk (None: row i is chunk i's).
        """
        if not self.enabled or multihost.is_multi_process() or not all(self._continues(c) for c in chunks):
            return
        pages = self.scheduler.pages
        need = sum(max(0, self.scheduler.config.pages_for(c.num_computed_tokens + 2) - len(c.seq.page_ids))
                   for c in chunks)
        if need > self.scheduler.allocator.num_free_pages:
            return
        for c in chunks:  # the page the next position starts, now instead of at the next schedule
            pages.prepare(c.seq, c.num_computed_tokens + 2)
        if pages.prefix_cache is not None:  # an allocation may evict a cached page: its offload runs first
            self.runner.kv.apply_ops(pages.prefix_cache.take_ops())
        ahead = [ScheduledChunk([0], c.num_computed_tokens + 1, list(c.seq.page_ids), seq=c.seq) for c in chunks]
        source = list(range(len(chunks))) if rows is None else rows
        try:
            self._pending = self.runner.submit(ahead, self._sampling_rows(ahead, 1), fed_from=(step, source))
        except Exception as e:  # noqa: BLE001 - the step itself, run the usual way next, reports what is wrong
            logger.warning("running a step ahead failed, the next step runs the usual way: %s", e)
            return
        self._rows = {_key(c): i for i, c in enumerate(ahead)}
        self._launched_at = self._step
        self.stats.launched += 1

    def _continues(self, chunk: ScheduledChunk) -> bool:
        """The chunk's sequence can have its next step built before this step's token is known."""
        seq = chunk.seq
        if seq is None or not chunk.samples or len(chunk.token_ids) != 1 or chunk.num_draft_tokens \
                or seq.status is not SequenceStatus.RUNNING or seq.prefill_only:
            return False
        p, outputs = seq.params, len(seq.output_token_ids) + 1  # after this step
        return (seq.seq_id not in self.grammars and self.token_rules.speculates(seq.seq_id)
                and not p.uses_penalties and (p.max_tokens is None or outputs < p.max_tokens)
                and seq.num_tokens + 1 < self.scheduler.config.max_model_len)


def _key(chunk: ScheduledChunk) -> tuple:
    return chunk.seq.seq_id, chunk.num_computed_tokens, tuple(chunk.page_ids)
