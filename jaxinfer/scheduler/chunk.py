"""What the scheduler plans for a step: `ScheduledChunk`, one sequence's part of it (the one chunk type from the
scheduler to the model runner), and `SchedulerOutput`, the whole step."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.scheduler.prefix_cache import KVOp
    from jaxinfer.scheduler.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's part of a step: what the scheduler plans and what `jaxinfer.engine` runs.

    The runner reads only the first three fields, so warm-up, tests and benchmarks build chunks without a
    sequence: `ScheduledChunk(token_ids, num_computed_tokens, page_ids)`.

    Attributes:
      token_ids: tokens whose K/V this step computes: `[last token]` for a decode, a slice of `seq.token_ids`
        for a prefill chunk; >= 1 ids.
      num_computed_tokens: tokens already cached; the first of `token_ids` sits at this position.
      page_ids: pages holding positions `[0, num_computed_tokens + len(token_ids))`, in order, each in
        [1, num_pages); a snapshot taken at schedule time.
      seq: the sequence; None for a chunk built outside the scheduler.
      samples: the chunk ends at the sequence's last token, so a token is sampled from its last logits.
      spec_slots: draft positions reserved after the last token (speculative decoding): pages cover positions
        `[0, num_computed_tokens + 1 + spec_slots)` and the step's token budget counts them; 0 otherwise.
      num_draft_tokens: drafts the engine appended to `token_ids` (at most `spec_slots`; see
        `with_drafts`); the target verifies them and `Scheduler.update` takes the tokens it emitted.
    """

    token_ids: list[int]
    num_computed_tokens: int
    page_ids: list[int]
    seq: Sequence | None = None
    samples: bool = True
    spec_slots: int = 0
    num_draft_tokens: int = 0

    def with_drafts(self, draft_token_ids: list[int]) -> ScheduledChunk:
        """This decode chunk with drafts appended (at most `spec_slots` of them).

        Raises:
          ValueError: if there are more drafts than reserved slots.
        """
        if len(draft_token_ids) > self.spec_slots:
            raise ValueError(f"{len(draft_token_ids)} drafts for {self.spec_slots} reserved slots")
        return dataclasses.replace(self, token_ids=self.token_ids[:1] + list(draft_token_ids),
                                   num_draft_tokens=len(draft_token_ids))


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work.

    Attributes:
      chunks: decodes first (oldest sequence first), then prefill chunks.
      preempted: sequences preempted this step (now waiting, pages freed).
      num_batched_tokens: sum of chunk lengths, <= max_num_batched_tokens.
      num_prefill_tokens: tokens in chunks scheduled as prefill (phases 2 and 3).
      num_decode_seqs: chunks scheduled as decodes (phase 1).
      num_spec_slots: draft positions reserved by decode chunks (counted in num_batched_tokens).
      kv_ops: page transfers to run, in order, before the step's model call (prefix cache host tier and
        copy-on-write).
    """

    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    num_batched_tokens: int
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_spec_slots: int = 0
    kv_ops: list[KVOp] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.chunks
