"""`SchedulerConfig`: the static limits of the scheduler (batch rows, tokens per step, page size, context)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Static limits of the scheduler.

    Attributes:
      max_num_seqs: most running sequences (rows of the batch).
      max_num_batched_tokens: most tokens computed in one step, decodes and prefill chunks together, >= 1.
      page_size: tokens per KV page.
      max_model_len: context limit, tokens (prompt + output).

    Raises:
      ValueError: if any field is not a positive integer.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be an integer >= 1")

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` positions."""
        return -(-num_tokens // self.page_size)
