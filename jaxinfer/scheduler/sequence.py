"""`Sequence`: the scheduler's state of one generated sequence (one of a request's n samples)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from jaxinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; the FINISHED_* states are final."""

    WAITING = enum.auto()  # queued: not yet admitted, or preempted and waiting to recompute
    RUNNING = enum.auto()  # admitted: holds pages, is prefilling or decoding
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or the context limit
    FINISHED_ABORTED = enum.auto()  # the client gave up on the request
    FINISHED_ERROR = enum.auto()  # the engine failed this sequence alone
    FINISHED_HANDOFF = enum.auto()  # prefill only: it holds its KV pages for another engine (`Engine.export_kv`)

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* states."""
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


FINISH_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
    "error": SequenceStatus.FINISHED_ERROR,
    "handoff": SequenceStatus.FINISHED_HANDOFF,
}


class Detokenizer(Protocol):
    """Turns generated ids, fed one at a time, into text (`jaxinfer.tokenizer.IncrementalDetokenizer`)."""

    def step(self, token_id: int) -> str:
        """Adds one id; returns the text it completes (possibly "")."""
        ...

    def flush(self) -> str:
        """Returns the text still held back (an unfinished character) at the end of generation."""
        ...


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated sequence: its tokens, pages, text and progress. Compared by identity.

    Attributes:
      seq_id: unique among live sequences; keys the `sampled` dict of `Scheduler.update`.
      request_id: the request it belongs to (n > 1 samples share it).
      prompt_token_ids: the prompt, >= 1 ids.
      params: sampling and stop rules.
      seed: resolved per-sample seed in [0, 2**32).
      detokenizer: fed every output token, in order, exactly once.
      arrival_time: when the request arrived, seconds on the scheduler's clock; orders FCFS and preemption.
      sample_index: which of the request's n samples this is, in [0, n).
      output_token_ids: generated ids, kept across preemptions.
      num_computed_tokens: leading tokens of `token_ids` whose K/V sit in the cache.
      status: see `SequenceStatus`.
      page_ids: pages holding positions [0, num_computed_tokens) and the positions scheduled this step, in order.
      text: detokenized output, truncated at a matched stop string.
      emitted_text_len: characters of `text` already returned by `stream_delta`.
      emitted_token_count: ids of `output_token_ids` already returned by `stream_delta`.
      finish_reason: "stop" | "length" | "abort" | "error" | "handoff", or None while live.
      stop_reason: the stop string or `stop_token_ids` id that ended it with "stop" (vLLM's); None otherwise.
      error: the message of a FINISHED_ERROR.
      error_kind: with `error`: "request" (its own values made it fail, as a ValueError would) or "engine".
      first_scheduled_time, first_token_time, last_token_time, finish_time: seconds on the scheduler's clock, or
        None; `last_token_time` is the step that appended the newest output token.
      num_preemptions: times this sequence was preempted (its K/V dropped and recomputed).
      cache_salt: requests with different salts never share prefix-cache pages (None is a salt too).
      cached_entries: prefix-cache entries of this sequence's full computed pages, in order (scheduler-owned).
      num_cached_tokens: prompt tokens taken from the prefix cache at first admission (vLLM's name).
      num_shared_pages: leading pages of `page_ids` taken read-only at admission (prefix cache hits, or sample
        0's prompt pages); the pages after them are this sequence's own.
      prefill_only: after its first sampled token, unless that ends it, it finishes with "handoff" and keeps its
        pages (`page_ids`, `cached_entries`) for the engine to export (disaggregated prefill).
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: Detokenizer
    arrival_time: float
    sample_index: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_text_len: int = 0
    emitted_token_count: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_kind: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None
    cached_entries: list = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    num_shared_pages: int = 0
    prefill_only: bool = False

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest token: the last output id, or the last prompt id before the first sample."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once the status is final."""
        return self.status.is_finished

    @property
    def num_new_tokens_to_compute(self) -> int:
        """Tokens whose K/V is not yet cached (1 in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when only the newest token is left to compute (a decode step samples the next one)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without building the whole list."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def stream_delta(self) -> tuple[list[int], str]:
        """New output since the last call, for streaming.

        While the sequence is live, the last `len(longest stop string) - 1` characters are held back, since they
        could still be the start of a stop string that would be cut from the text; once finished, everything
        left is returned. Joining every delta's text gives `text`. A sequence finished for a handoff goes on
        elsewhere and holds them back too: the receiving engine's first delta starts with them
        (`jaxinfer.engine.admission.replay_output`).

        Returns:
          (output ids added since the last call, text added since the last call).
        """
        ids = self.output_token_ids[self.emitted_token_count :]
        self.emitted_token_count = len(self.output_token_ids)
        live = not self.is_finished or self.status is SequenceStatus.FINISHED_HANDOFF
        hold = max((len(s) for s in self.params.stop), default=1) - 1 if live else 0
        upto = max(self.emitted_text_len, len(self.text) - hold)
        delta = self.text[self.emitted_text_len : upto]
        self.emitted_text_len = upto
        return ids, delta
