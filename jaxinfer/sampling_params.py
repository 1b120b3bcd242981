"""`SamplingParams`: how one request samples and when it stops (field names as in vLLM's offline API)."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request.

    Attributes:
      temperature: softmax temperature, >= 0; 0 means greedy (argmax).
      top_k: keep the k most likely tokens; 0 or -1 disables.
      top_p: nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
        probability mass reaches top_p; in (0, 1], 1 disables.
      max_tokens: most tokens to generate, >= 1.
      min_tokens: EOS and stop token ids are suppressed until this many tokens were generated.
      seed: per-request seed; the same seed gives the same tokens whatever else is in the batch. None draws one.
      stop: strings that end generation when they appear in the output text (not returned unless
        `include_stop_str_in_output`).
      stop_token_ids: extra token ids that end generation (returned in `token_ids`).
      ignore_eos: keep generating after the model's EOS token.
      include_stop_str_in_output: return the matched stop string at the end of the text.
      skip_special_tokens: leave special tokens out of the returned text.

    Raises:
      ValueError: on any out-of-range value, naming it.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        max_tokens, min_tokens, seed = self.max_tokens, self.min_tokens, self.seed
        if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
            raise ValueError(f"{temperature=} must be a number >= 0 (0 means greedy)")
        if not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"{top_k=} must be an integer >= 1, or 0 / -1 to disable")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"{top_p=} must be in (0, 1]")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{max_tokens=} must be an integer >= 1")
        if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"{min_tokens=} must be an integer in [0, max_tokens={max_tokens}]")
        if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(f"{seed=} must be an integer in [0, 2**32)")
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0
