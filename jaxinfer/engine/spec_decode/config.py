"""`SpeculativeConfig`: which proposer drafts tokens, how many, and when speculation switches itself off.

Given as vLLM users give it: `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`,
`EngineConfig.create(speculative_config=...)`, or `jaxinfer generate --speculative-config '{"method": "ngram", ...}'`.

Methods:
- "ngram": prompt-lookup drafting (`ngram.py`): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (`prompt_lookup_min <= n <= prompt_lookup_max`). No model runs.
- "draft_model": a smaller model with the target's tokenizer (`model`: a `.gguf` file or an HF folder) drafts
  autoregressively; it keeps its own paged KV cache on the target's page table (`draft.py`).
- "self_draft": the draft is the target's own first `num_draft_layers` layers plus its final norm and LM head
  (an early exit; no second checkpoint). Runs like "draft_model".

Policy (`policy.py`): speculation is lossless, so these only decide speed.
- Per step, the verify step computes B * (k + 1) tokens for B decoding sequences. While that stays within
  `max_step_tokens` the step is still bound by reading the weights and the drafts are nearly free; beyond it, k
  shrinks for the step (to max_step_tokens // B' - 1, B' = B rounded up to a power of two), and speculation is
  off while not even k = 1 fits. Default:
  a per-backend value (`policy.DEFAULT_MAX_STEP_TOKENS`). `disable_by_batch_size` (vLLM's name) also turns it off
  outright when more than that many sequences decode.
- Per sequence, drafts stop while the sequence's recent acceptance rate (accepted / proposed drafts, an
  exponential moving average) is below `min_acceptance_rate`; one step in `probe_interval` drafts anyway to
  measure again, so speculation comes back when the text turns predictable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models.config import options_from_value

METHODS = ("ngram", "draft_model", "self_draft")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding options (module docstring).

    Attributes:
      method: "ngram", "draft_model" or "self_draft".
      num_speculative_tokens: k, the most drafts per sequence per step, in [1, 16].
      model: the draft model for "draft_model" (`.gguf` file or HF folder); must be None for the others.
      num_draft_layers: "self_draft" only: target layers the draft runs, >= 1 and below the target's layer count
        (checked when the engine loads the model); default: a quarter of the layers, at least 1.
      prompt_lookup_min, prompt_lookup_max: "ngram" only: suffix n-gram lengths tried, 1 <= min <= max.
      max_step_tokens: tokens (B * (k + 1)) a verify step may hold before k shrinks; None: per backend.
      disable_by_batch_size: speculation off while more than this many sequences decode; None: no such limit.
      min_acceptance_rate: per-sequence acceptance (EMA) below which that sequence stops drafting, in [0, 1].
      probe_interval: steps between two probe drafts of a sequence whose acceptance is too low, >= 1.

    Raises:
      ValueError: naming the field, for an unknown method, an out-of-range number, or a field that does not
        belong to the method.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    num_draft_layers: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_step_tokens: int | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.1
    probe_interval: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method={self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer in [1, 16]")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative method 'draft_model' needs 'model': the draft's .gguf file or HF "
                                 f"folder as a non-empty string (got {self.model!r})")
        elif self.model is not None:
            raise ValueError(f"speculative 'model' is only for method 'draft_model', not {self.method!r}")
        if self.num_draft_layers is not None:
            if self.method != "self_draft":
                raise ValueError(f"num_draft_layers is only for method 'self_draft', not {self.method!r}")
            if not _is_int(self.num_draft_layers) or self.num_draft_layers < 1:
                raise ValueError(f"num_draft_layers={self.num_draft_layers!r} must be an integer >= 1")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(lo) or not _is_int(hi) or not 1 <= lo <= hi:
            raise ValueError(f"prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with "
                             "1 <= min <= max")
        for name in ("max_step_tokens", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be None or an integer >= 1")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"min_acceptance_rate={rate!r} must be a number in [0, 1]")
        if not _is_int(self.probe_interval) or self.probe_interval < 1:
            raise ValueError(f"probe_interval={self.probe_interval!r} must be an integer >= 1")

    @staticmethod
    def from_value(value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a `SpeculativeConfig`, a dict of its fields, a JSON object string, or None (off).

        Raises:
          ValueError: for JSON that does not parse or is not an object, unknown keys (named), or bad values.
        """
        return options_from_value(SpeculativeConfig, value, "speculative config")
