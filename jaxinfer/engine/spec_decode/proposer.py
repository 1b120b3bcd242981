"""`StepProposer`: one engine step's drafts, for the decode chunks that reserved draft slots.

"ngram" drafts on the host from one incremental `NgramIndex` per sequence; "draft_model" and "self_draft" draft
on device through the model runner (`ModelRunner.propose`), which keeps the draft probabilities there for the
verify step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.engine.spec_decode.config import SpeculativeConfig
from jaxinfer.engine.spec_decode.ngram import NgramIndex, NgramProposer
from jaxinfer.scheduler.chunk import ScheduledChunk

if TYPE_CHECKING:
    from jaxinfer.engine.runner import ModelRunner

logger = logging.getLogger(__name__)


class StepProposer:
    """Drafts per step (`propose`); remembers each sequence's n-gram index until `forget`.

    Args:
      config: the speculative decoding config.
      runner: the model runner that drafts with the draft model (unused for "ngram").
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.config = config
        self._runner = runner
        self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._ngram_indexes: dict[int, NgramIndex] = {}

    def propose(self, decodes: list[ScheduledChunk],
                sampling_rows: Callable[[list[ScheduledChunk]], list[SamplingRow]]
                ) -> tuple[list[ScheduledChunk], int | None]:
        """Drafts for the decode chunks that reserved slots (`spec_slots`).

        Args:
          decodes: the step's decode chunks, one token each.
          sampling_rows: the chunks' sampling rows (built only for the draft model).

        Returns:
          (the chunks with their drafts appended; 0 when the runner kept the draft model's probabilities for
          them, rows in chunk order, None when there are none: n-gram drafts, all-greedy rows). A failing draft
          model costs the step its drafts, never a request.
        """
        if self.config.method == "ngram":
            out = []
            for c in decodes:
                if c.spec_slots:
                    index = self._ngram_indexes.setdefault(c.seq.seq_id, self._ngram.new_index())
                    index.extend(c.seq.token_slice(len(index), c.seq.num_tokens))  # only the new ids
                    c = c.with_drafts(index.propose_next(c.spec_slots))
                out.append(c)
            return out, None
        try:
            ids, has_probs = self._runner.propose(decodes, sampling_rows(decodes), [c.spec_slots for c in decodes],
                                                  self.config.num_speculative_tokens)
        except Exception:  # noqa: BLE001 - drafts only ever save time; decode without them
            logger.exception("the draft model failed; decoding this step without drafts")
            return decodes, None
        return [c.with_drafts(ids[i, : c.spec_slots].tolist()) for i, c in enumerate(decodes)], 0 if has_probs else None

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's n-gram index."""
        self._ngram_indexes.pop(seq_id, None)
