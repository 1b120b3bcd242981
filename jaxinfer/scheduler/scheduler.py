"""Continuous batching: which sequences compute which tokens each step, with chunked prefill and preemption.

Each `schedule()` builds one ragged step within `max_num_batched_tokens` tokens and `max_num_seqs` sequences,
first come first served (by `arrival_time`, then `seq_id`):

1. Decodes. Every running sequence with only its newest token left to compute gets a 1-token chunk, oldest
   first. When the page for the new position cannot be allocated, the newest running sequence not yet scheduled
   this step is preempted (possibly the one asking): its pages are freed, `num_computed_tokens` drops to 0 and it
   goes to the front of the waiting queue with its output tokens kept, to be recomputed later.
2. Partial prefills. Running sequences still prefilling get `min(tokens left, budget left)` tokens, shrunk to
   the pages that can be had. When not even one token fits, a newer partial prefill is preempted; with none, the
   sequence waits a step.
3. Admission. Waiting sequences, in order, are admitted with a prefill chunk while budget, sequence slots and
   pages last; the first that gets no page stops admission (no skipping ahead). Nothing is admitted in a step
   that preempted: the pages just freed go to the running sequences.

With a `PrefixCache`, a sequence being admitted (fresh, or preempted and back) first takes the longest run of
cached full pages of its tokens (`prefix_cache.py`) and starts computing after them; every full page a step
completes is registered in the cache. Page transfers the cache decides (host-tier offloads and loads,
copy-on-write) come back in `SchedulerOutput.kv_ops`, to run before the step.

Pages are allocated on demand for positions `[0, num_computed_tokens + len(chunk))`. A chunk that reaches the
last known token has `samples=True`: the engine samples the next token from its last logits and hands it to
`update`, which advances `num_computed_tokens`, appends the token, applies the stop rules (`stop_checker`) and
frees the pages of sequences that finished.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from jaxinfer.scheduler.chunk import ScheduledChunk, SchedulerOutput
from jaxinfer.scheduler.config import SchedulerConfig
from jaxinfer.scheduler.draft_slots import draft_slots
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import PrefixCache
from jaxinfer.scheduler.sequence import FINISH_STATUS, Sequence, SequenceStatus
from jaxinfer.scheduler.sequence_pages import SequencePages
from jaxinfer.scheduler.stop_checker import append_token

logger = logging.getLogger(__name__)


def _emitted(value: int | list[int]) -> list[int]:
    """A `sampled` entry of `Scheduler.update` as a list of ids."""
    return [int(t) for t in value] if isinstance(value, (list, tuple)) else [int(value)]


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


class Scheduler:
    """Owns the waiting queue, the running set and their pages; see the module docstring for the policy.

    Args:
      config: limits.
      allocator: the KV pages; the scheduler is their only user.
      eos_ids: the model's end-of-sequence ids.
      clock: seconds, for `first_scheduled_time`, `first_token_time`, `last_token_time` and `finish_time`.
      prefix_cache: reuse cached full pages of earlier sequences (None disables prefix caching).
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, eos_ids: Iterable[int],
                 clock: Callable[[], float] = time.perf_counter, prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.pages = SequencePages(config, allocator, prefix_cache)
        self.eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._running: list[Sequence] = []  # sorted by _arrival_key
        self._waiting: deque[Sequence] = deque()
        self._live: dict[int, Sequence] = {}  # seq_id -> waiting or running sequence
        self._by_request: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0  # over the scheduler's life
        self.num_shared_prompt_pages = 0  # pages n > 1 samples took from their sample 0 instead of recomputing

    # --- queues -----------------------------------------------------------------------------------------------

    @property
    def running(self) -> list[Sequence]:
        """Running sequences, oldest first (a copy)."""
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        """Waiting sequences in admission order (a copy)."""
        return list(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self._live)

    def get_sequences(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request (empty if none)."""
        return list(self._by_request.get(request_id, ()))

    # --- requests in and out ----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence at the back of the waiting queue.

        Raises:
          ValueError: if the sequence is not fresh (status WAITING, nothing computed and no pages, or imported K/V:
            the pages of its first 0 < c < num_tokens positions), its prompt is empty or leaves no room for an
            output token in `max_model_len`, it could never fit the page pool even alone (pages for min(prompt +
            max_tokens, max_model_len) tokens), or its seq_id is live.
        """
        cfg = self.config
        n = len(seq.prompt_token_ids)
        imported = 0 < seq.num_computed_tokens < seq.num_tokens and len(seq.page_ids) == cfg.pages_for(
            seq.num_computed_tokens)  # pages holding its first num_computed_tokens K/V (`Engine.import_kv`)
        if seq.status is not SequenceStatus.WAITING or (seq.page_ids or seq.num_computed_tokens) and not imported:
            raise ValueError(f"sequence {seq.seq_id} is not fresh: status {seq.status.name}, "
                             f"{len(seq.page_ids)} pages, {seq.num_computed_tokens} computed tokens")
        if n == 0:
            raise ValueError(f"sequence {seq.seq_id}: prompt must not be empty")
        if seq.seq_id in self._live:
            raise ValueError(f"duplicate seq_id {seq.seq_id}: a live sequence already has it")
        if n >= cfg.max_model_len:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {cfg.max_model_len} tokens "
                             "(at least one token must be generated)")
        max_tokens = cfg.max_model_len if seq.params.max_tokens is None else seq.params.max_tokens
        pages = cfg.pages_for(min(n + max_tokens, cfg.max_model_len))
        if pages > self.allocator.num_usable_pages:  # named by max_tokens, the field that can make it fit
            asked = (f"max_tokens {seq.params.max_tokens}" if seq.params.max_tokens is not None
                     else f"max_tokens unset: the rest of the context, {cfg.max_model_len - n}")
            raise ValueError(f"max_tokens: the request needs {pages} KV pages (prompt {n} + {asked} tokens) but the "
                             f"cache has {self.allocator.num_usable_pages}; it can never fit")
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq
        self._by_request.setdefault(seq.request_id, []).append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finishes every live sequence of a request with "abort" and frees their pages now.

        Returns:
          The sequences aborted (empty for an unknown or finished request).
        """
        seqs = list(self._by_request.get(request_id, ()))
        now = self._clock()
        for seq in seqs:
            self._finish(seq, "abort", now)
        return seqs

    def fail(self, seq: Sequence, error: str, kind: str = "engine") -> None:
        """Finishes one sequence with "error" (FINISHED_ERROR, `seq.error`, `seq.error_kind = kind`: "request" or
        "engine") and frees its pages now.

        A sequence that already finished is left as it is.
        """
        if seq.is_finished:
            return
        seq.error, seq.error_kind = error, kind
        self._finish(seq, "error", self._clock())

    def suppressed_token_ids(self, seq: Sequence, ahead: int = 0) -> list[int]:
        """Ids the sampler must not pick for `seq` now (or `ahead` tokens later): EOS (unless ignore_eos) and stop
        ids, until min_tokens.

        Returns:
          Sorted ids; empty once `len(seq.output_token_ids) + ahead >= min_tokens`."""
        p = seq.params
        if len(seq.output_token_ids) + ahead >= p.min_tokens:
            return []
        eos = () if p.ignore_eos else self.eos_ids
        return sorted(set(eos) | set(p.stop_token_ids))

    # --- the step ---------------------------------------------------------------------------------------------

    def schedule(self, spec_slots: dict[int, int] | None = None) -> SchedulerOutput:
        """Picks this step's chunks (see the module docstring). Call `update` with the results before the next.

        Args:
          spec_slots: speculative decoding: {seq_id: drafts wanted} for decoding sequences. Each gets up to that
            many draft positions after its decode token, as the token budget (keeping one token for every
            decode still to schedule), the free pages (no preemption for drafts), the context, max_tokens and
            min_tokens allow: a block never reaches past max_tokens or the context, and while the output is
            shorter than min_tokens, it stays before min_tokens (EOS and stop ids are banned on every position
            of the block).

        Returns:
          The step; its `chunks` may be empty when nothing can run (e.g. nothing is left).
        """
        cfg = self.config
        now = self._clock()
        budget = cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        num_decode_seqs = num_spec_slots = 0
        spec_slots = spec_slots or {}
        decodes_left = sum(1 for s in self._running if s.status is SequenceStatus.RUNNING and s.is_decoding)

        # 1. decodes, oldest first
        for seq in list(self._running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            while cfg.pages_for(seq.num_tokens) > len(seq.page_ids) + self.allocator.num_free_pages:
                victim = self._newest_unscheduled(scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            decodes_left -= 1
            slots = draft_slots(seq, spec_slots.get(seq.seq_id, 0), budget - 1 - max(decodes_left, 0),
                                cfg.max_model_len, self.pages.capacity(seq))
            chunks.append(self._make_chunk(seq, 1, now, spec_slots=slots))
            scheduled.add(seq.seq_id)
            budget -= 1 + slots
            num_decode_seqs += 1
            num_spec_slots += slots

        # 2. running sequences that are still prefilling
        for seq in list(self._running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled:
                continue
            n = self.pages.fit(seq, min(seq.num_new_tokens_to_compute, budget))
            while n == 0:
                victim = self._newest_unscheduled(scheduled)
                if victim is seq:
                    break  # all that is newer runs this step; wait for pages to come back
                self._preempt(victim)
                preempted.append(victim)
                n = self.pages.fit(seq, min(seq.num_new_tokens_to_compute, budget))
            if n == 0:
                continue
            chunks.append(self._make_chunk(seq, n, now))
            scheduled.add(seq.seq_id)
            budget -= n

        # 3. admission, first come first served
        while not preempted and self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            sibling = self._prompt_sibling(seq)
            if sibling is not None and sibling.num_computed_tokens < self.pages.shareable_prompt_tokens(seq):
                break  # sample 0 is still computing the prompt this sample will share
            if sibling is not None:
                self.num_shared_prompt_pages += self.pages.share_prompt_pages(seq, sibling)
            elif self.prefix_cache is not None and not seq.page_ids and seq.params.prompt_logprobs is None:
                self.pages.take_cached_prefix(seq)  # prompt logprobs need every prompt row's logits: no cache
            n = self.pages.fit(seq, min(seq.num_new_tokens_to_compute, budget))
            if n == 0:
                if sibling is None and seq.page_ids:  # give the cached pages back; the lookup reruns next time
                    self.pages.release(seq)
                    seq.num_computed_tokens = 0
                break
            self._waiting.popleft()
            if self.prefix_cache is not None and sibling is None and (seq.cached_entries or not seq.page_ids):
                self.prefix_cache.stats.queried_tokens += seq.num_tokens
                self.prefix_cache.stats.hit_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_arrival_key)
            chunks.append(self._make_chunk(seq, n, now))
            scheduled.add(seq.seq_id)
            budget -= n

        num_batched = cfg.max_num_batched_tokens - budget
        kv_ops = self.prefix_cache.take_ops() if self.prefix_cache is not None else []
        return SchedulerOutput(chunks=chunks, preempted=preempted, num_batched_tokens=num_batched,
                               num_prefill_tokens=num_batched - num_decode_seqs - num_spec_slots,
                               num_decode_seqs=num_decode_seqs, num_spec_slots=num_spec_slots, kv_ops=kv_ops)

    def update(self, output: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Applies a finished step: advances every chunk, appends sampled tokens, applies stop rules.

        Sequences that finished meanwhile (aborted, failed) are skipped.

        A chunk with drafts (`num_draft_tokens` = m) gets the tokens its verification emitted: its n accepted
        drafts then the target's token (n + 1 ids). The cache then holds the last token and the n accepted
        drafts: `num_computed_tokens` advances by n + 1, and the pages past the new length (those of rejected
        drafts and unused slots) go back to the allocator. Tokens are appended one at a time through the stop
        rules: a stop (EOS, stop id, stop string, max_tokens) inside the block ends the sequence there and the
        tokens after it are dropped.

        Args:
          output: the step from the last `schedule()` (its chunks may have been replaced by `with_drafts`).
          sampled: seq_id -> sampled token id, or the list of emitted ids, for every chunk with `samples=True`
            (extra entries are ignored).

        Returns:
          The sequences that got a token this step, in chunk order (finished ones included, pages freed).

        Raises:
          ValueError: if a live sequence's sampled token is missing or the output is stale (already applied).
            Nothing changes then.
        """
        live = [ch for ch in output.chunks if not ch.seq.is_finished]
        for ch in live:
            if ch.seq.num_computed_tokens != ch.num_computed_tokens:
                raise ValueError(f"stale output: sequence {ch.seq.seq_id} has {ch.seq.num_computed_tokens} computed "
                                 f"tokens, the chunk starts at {ch.num_computed_tokens} (update applied twice?)")
            if ch.samples and ch.seq.seq_id not in sampled:
                raise ValueError(f"no sampled token for sequence {ch.seq.seq_id}")
            if ch.samples and not 1 <= len(_emitted(sampled[ch.seq.seq_id])) <= ch.num_draft_tokens + 1:
                raise ValueError(f"sequence {ch.seq.seq_id}: {len(_emitted(sampled[ch.seq.seq_id]))} emitted "
                                 f"tokens for a chunk with {ch.num_draft_tokens} drafts")
        now = self._clock()
        produced = []
        for ch in live:
            seq = ch.seq
            emitted = _emitted(sampled[seq.seq_id]) if ch.samples else [0]
            # the last token and the accepted drafts (all but the emitted last) are now in the cache
            seq.num_computed_tokens += len(ch.token_ids) - ch.num_draft_tokens + len(emitted) - 1
            reason = None
            if ch.samples:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                for token_id in emitted:
                    reason = append_token(seq, token_id, self.eos_ids, self.config.max_model_len)
                    if reason is not None:
                        break
                seq.last_token_time = now
                reason = reason or ("handoff" if seq.prefill_only else None)
                # a stop inside a block drops the drafts after it, whose K/V then holds no token of the sequence
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            if self.prefix_cache is not None:  # after the tokens: pages completed by accepted drafts have them
                self.pages.register_full_pages(seq)
            if not ch.samples:
                continue
            if reason is not None:
                self._finish(seq, reason, now)
            elif ch.spec_slots:
                self.pages.trim(seq)
            produced.append(seq)
        return produced

    # --- internals --------------------------------------------------------------------------------------------

    def _prompt_sibling(self, seq: Sequence) -> Sequence | None:
        """For a fresh sample i > 0 of an n > 1 request: its live sample 0, whose prompt pages it can share."""
        if seq.sample_index == 0 or seq.page_ids or seq.num_computed_tokens or seq.output_token_ids \
                or self.pages.shareable_prompt_tokens(seq) == 0:
            return None
        for other in self._by_request.get(seq.request_id, ()):
            if other.sample_index == 0 and other.prompt_token_ids == seq.prompt_token_ids \
                    and other.status is SequenceStatus.RUNNING:  # a waiting sample 0 may sit behind this one
                return other
        return None

    def _make_chunk(self, seq: Sequence, n: int, now: float, spec_slots: int = 0) -> ScheduledChunk:
        start = seq.num_computed_tokens
        self.pages.prepare(seq, start + n + spec_slots)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        return ScheduledChunk(seq=seq, token_ids=seq.token_slice(start, start + n), num_computed_tokens=start,
                              page_ids=list(seq.page_ids), samples=start + n == seq.num_tokens,
                              spec_slots=spec_slots)

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence:
        for seq in reversed(self._running):
            if seq.seq_id not in scheduled:
                return seq
        raise AssertionError("no unscheduled running sequence")  # the caller itself is one

    def _preempt(self, seq: Sequence) -> None:
        """Drops the sequence's K/V and puts it at the front of the waiting queue; its outputs are kept."""
        self.pages.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        logger.debug("preempted sequence %d (%d tokens to recompute)", seq.seq_id, seq.num_tokens)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq.seq_id in self._live:
            self._waiting.remove(seq)
        if seq.page_ids and reason != "handoff":  # a handoff's pages wait for the engine's export
            self.pages.release(seq)
        seq.status = FINISH_STATUS[reason]
        seq.finish_reason = reason
        seq.finish_time = now
        if self._live.pop(seq.seq_id, None) is not None:
            group = self._by_request[seq.request_id]
            group.remove(seq)
            if not group:
                del self._by_request[seq.request_id]
