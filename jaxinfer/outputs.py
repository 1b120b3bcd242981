"""Result types of `LLM.generate` (field names as in vLLM's `RequestOutput`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry in `CompletionOutput.logprobs` (vLLM's `Logprob`).

    Attributes:
      logprob: the token's log-probability under the model's raw distribution (log_softmax of the unprocessed
        logits: before penalties, temperature and truncation), <= 0.
      rank: its 1-based rank in that distribution (1 = most likely): position + 1 for the top tokens; for the
        sampled token when it is not among them, 1 + the number of tokens with a strictly larger logprob.
      decoded_token: the text of this one id as the tokenizer decodes it alone (special tokens included).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
      logprobs: per generated token, {token id: `Logprob`} of the top `SamplingParams.logprobs` tokens of the
        model's raw distribution plus the sampled token (first, as vLLM orders it); None unless asked for.
      error: why the request failed, when finish_reason is "error".
      error_kind: with `error`, "request" when the request's own values made it fail (HTTP 400, like an admission
        `ValueError`; sending it again fails again), "engine" when the engine did (HTTP 500).
      cumulative_logprob: the sum of the generated tokens' raw logprobs, when `logprobs` was asked for, else None
        (as vLLM V1).
      stop_reason: what ended the completion with "stop", as vLLM: the matched stop string, or the id from
        `stop_token_ids`; None for EOS, "length", "abort", "error" and while running.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None
    error_kind: str | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request, seconds from `time.perf_counter()` (the engine's clock).

    Attributes:
      arrival_time: when the engine admitted the request.
      first_token_time: when its first token (of any sample) was sampled, or None before.
      finish_time: when its last sample finished, or None while it runs.
      ttft_s: time to first token (arrival to first sampled token), seconds.
      decode_tokens_per_s: tokens after the first divided by the time after the first token.
      first_scheduled_time: when a step first computed any of its tokens (the end of its wait in the queue), or
        None before.
      last_token_time: when the step that made its newest token ran (of any sample; the time of this output's
        new tokens), or None before the first.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    ttft_s: float
    decode_tokens_per_s: float
    first_scheduled_time: float | None = None
    last_token_time: float | None = None


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
    # With SamplingParams.prompt_logprobs: per prompt position, {token id: Logprob} of the prompt token there
    # (first), then the top ones; None at position 0, which has no context (vLLM's shape). None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
