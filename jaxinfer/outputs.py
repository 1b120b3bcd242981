"""Result types of `LLM.generate` (field names as in vLLM's `RequestOutput`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated completion.

    Attributes:
      index: completion index within its request.
      text: generated text (special tokens skipped unless asked; stop string removed unless asked).
      token_ids: generated token ids, including the EOS / stop token that ended generation.
      finish_reason: "stop" (EOS, stop id or stop string) or "length" (max_tokens or the context limit).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request, seconds from `time.perf_counter()`.

    Attributes:
      ttft_s: time to first token (arrival to first sampled token), seconds.
      decode_tokens_per_s: tokens after the first divided by the time after the first token.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    ttft_s: float
    decode_tokens_per_s: float


@dataclasses.dataclass
class RequestOutput:
    """Everything one request produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
