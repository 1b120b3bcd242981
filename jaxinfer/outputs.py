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
      finish_reason: "stop" (EOS, stop id or stop string), "length" (max_tokens or the context limit), "abort"
        (aborted by the caller) or "error" (this request failed; see `error`); None while running.
      delta_text, delta_token_ids: what is new since the previous output of this request (streaming).
      logprobs: per generated token, {token id: log-probability} of the top `SamplingParams.logprobs` tokens of
        the model's raw distribution plus the sampled token; None unless asked for.
      error: why the request failed, when finish_reason is "error".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None


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
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed (vLLM's name)
