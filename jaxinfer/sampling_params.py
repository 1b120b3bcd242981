"""`SamplingParams`: how one request samples and when it stops (field names and semantics as in vLLM's offline API)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer.structured_outputs import StructuredOutputsParams, structured_outputs_from
from jaxinfer.request_limits import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                     MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY,
                                     MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                     MIN_REPETITION_PENALTY, check_text, check_token_ids, name_hint, show)

__all__ = ["MAX_LOGPROBS", "MAX_TEMPERATURE", "SamplingParams"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    # An int is finite however large (math.isfinite would overflow converting it to a float).
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and math.isfinite(x)


class _FrozenBias(dict):
    """`SamplingParams.logit_bias`: a dict (token id -> bias) that cannot change, so that the frozen
    `SamplingParams` stays hashable; it compares equal to a plain dict of the same items."""

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple:  # unpickling would otherwise go through the refused __setitem__
        return _FrozenBias, (dict(self),)

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("SamplingParams.logit_bias cannot be changed (SamplingParams is frozen); build new params "
                        "with dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse


_NUMERIC_FIELDS = ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_tokens", "min_tokens", "seed", "logprobs",
                   "prompt_logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request.

    The engine applies the logit processors in this order (as vLLM V1's sampler does): allowed_token_ids and
    bad_words (and a structured output constraint) mask, logit_bias, repetition penalty, presence/frequency
    penalties, temperature, min_p, top_k, top_p; see `jaxinfer.engine.sampling`.

    Attributes:
      n: number of independent samples (output sequences) for the prompt, in [1, MAX_N]. They share the seed and differ by
        their sample index, which is folded into the random key.
      temperature: softmax temperature, finite and >= 0; 0 means greedy (argmax).
      top_k: keep the k most likely tokens; 0 or -1 disables.
      top_p: nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
        probability mass reaches top_p; in (0, 1], 1 disables.
      min_p: keep tokens whose probability (after temperature) is >= min_p times the most likely token's; in
        [0, 1], 0 disables.
      repetition_penalty: CTRL penalty (Keskar et al. 2019) for tokens that appear in the prompt or the output:
        a positive logit is divided by it, a negative one multiplied; in [MIN_REPETITION_PENALTY,
        MAX_REPETITION_PENALTY] ([0.05, 10]), 1 disables.
      presence_penalty: subtracted once from the logit of every token that appears in the output (OpenAI
        semantics); in [-2, 2].
      frequency_penalty: subtracted from a token's logit once per time it appears in the output; in [-2, 2].
      max_tokens: most tokens to generate, >= 1; None generates until the context limit. A request whose prompt
        plus max_tokens exceeds the context is rejected by the engine.
      min_tokens: EOS and stop token ids are suppressed until this many tokens were generated.
      seed: per-request seed in [0, 2**32); the same seed gives the same tokens whatever else is in the batch.
        None draws one.
      logprobs: number of top log-probabilities to return per output token, in [0, MAX_LOGPROBS], besides the
        sampled token's own; they come from the model's raw distribution (log_softmax of the logits before
        penalties, temperature and truncation). None returns none.
      prompt_logprobs: for every prompt token after the first, its log-probability given the tokens before it,
        its rank, and this many top log-probabilities (raw, as `logprobs`), in [0, MAX_LOGPROBS]
        (`RequestOutput.prompt_logprobs`, vLLM's). Such a request computes its whole prompt (it takes nothing
        from the prefix cache) and its prefill returns every row's logits. None returns none.
      stop: strings that end generation when they appear in the output text (not returned unless
        `include_stop_str_in_output`); at most MAX_STOP_STRINGS, each of 1 to MAX_STOP_STRING_CHARS characters.
      stop_token_ids: extra token ids that end generation (returned in `token_ids`); at most MAX_STOP_TOKEN_IDS
        (ints or numpy integers); `Engine.add_request` checks them against the vocabulary.
      ignore_eos: keep generating after the model's EOS token.
      include_stop_str_in_output: return the matched stop string at the end of the text.
      skip_special_tokens: leave special tokens out of the returned text.
      structured_outputs: a constraint on the output (a JSON schema, any JSON object, a regex, a choice of
        strings, or a grammar): a `jaxinfer.structured_outputs.StructuredOutputsParams` or a dict of its fields,
        checked here (an invalid schema or grammar raises). None: unconstrained.
      logit_bias: token id -> bias added to that token's raw logit before the penalties (OpenAI / vLLM
        semantics): at most MAX_LOGIT_BIAS (300) entries, ids ints >= 0 (`Engine.add_request` checks them against
        the vocabulary), biases finite in [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE] ([-100, 100]). Stored as
        a read-only dict; an empty one is None.
      allowed_token_ids: only these ids may be sampled (vLLM); None allows every token. Non-empty, at most
        MAX_ALLOWED_TOKEN_IDS ids; checked against the vocabulary by `Engine.add_request`.
      bad_words: words never generated (vLLM): each is tokenized with and without a leading space; a word of one
        token bans that token, a longer word bans its last token whenever the output so far ends with its other
        tokens. At most MAX_BAD_WORDS, each of 1 to MAX_BAD_WORD_CHARS characters with a non-space one; a string
        is one word.

    The limits are those of `jaxinfer.request_limits`, the same for every front end.

    Raises:
      ValueError: on any out-of-range value (NaN and infinities included) or wrong type (a bool field given
        anything but True / False), naming the field and the value.
      TypeError: an unknown keyword (Python's error for one), naming it with the closest field and listing the
        fields; `dataclasses.replace` raises the same.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | str | None = None

    def __new__(cls, *args: object, **kwargs: object) -> SamplingParams:
        # Before the dataclass __init__, whose TypeError for an unknown keyword names neither the close field nor
        # the valid ones.
        unknown = [name for name in kwargs if name not in _FIELD_NAMES]
        if unknown:
            hints = [name_hint(name, _FIELD_NAMES) for name in unknown]
            raise TypeError(f"SamplingParams got unknown field(s) {', '.join(hints)}; the fields are "
                            f"{', '.join(_FIELD_NAMES)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in _NUMERIC_FIELDS:  # numpy scalars are stored as the Python numbers they hold
            value = getattr(self, name)
            if isinstance(value, (np.integer, np.floating)) and not isinstance(value, np.bool_):
                object.__setattr__(self, name, value.item())
        n, temperature, top_k, top_p, min_p = self.n, self.temperature, self.top_k, self.top_p, self.min_p
        repetition_penalty = self.repetition_penalty
        presence_penalty, frequency_penalty = self.presence_penalty, self.frequency_penalty
        max_tokens, min_tokens, seed = self.max_tokens, self.min_tokens, self.seed
        if not _is_int(n) or not 1 <= n <= MAX_N:
            raise ValueError(f"n={show(n)} must be an integer in [1, {MAX_N}]")
        if not _is_finite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={show(temperature)} must be a finite number in [0, {MAX_TEMPERATURE:g}] "
                             "(0 means greedy)")
        if not _is_int(top_k) or top_k < -1:
            raise ValueError(f"top_k={show(top_k)} must be an integer >= 1, or 0 / -1 to disable")
        if not _is_finite(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p={show(top_p)} must be in (0, 1]")
        if not _is_finite(min_p) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p={show(min_p)} must be in [0, 1]")
        lo, hi = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if not _is_finite(repetition_penalty) or not lo <= repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty={show(repetition_penalty)} must be in [{lo:g}, {hi:g}] (1 disables)")
        if not _is_finite(presence_penalty) or not -2 <= presence_penalty <= 2:
            raise ValueError(f"presence_penalty={show(presence_penalty)} must be in [-2, 2]")
        if not _is_finite(frequency_penalty) or not -2 <= frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty={show(frequency_penalty)} must be in [-2, 2]")
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise ValueError(f"max_tokens={show(max_tokens)} must be an integer >= 1 (and the prompt plus "
                             "max_tokens must fit the context)")
        if not _is_int(min_tokens) or min_tokens < 0:
            raise ValueError(f"min_tokens={show(min_tokens)} must be an integer >= 0" +
                             ("" if max_tokens is None else f" and <= max_tokens={max_tokens}"))
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens={show(min_tokens)} must be an integer in [0, max_tokens={show(max_tokens)}]")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**32):
            raise ValueError(f"seed={show(seed)} must be an integer in [0, 2**32)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={show(value)} must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}={show(value)} must be True or False")
            object.__setattr__(self, name, bool(value))
        object.__setattr__(self, "stop", self._checked_stop())
        stop_ids = () if self.stop_token_ids is None else check_token_ids("stop_token_ids", self.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(stop_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "structured_outputs", structured_outputs_from(self.structured_outputs))
        object.__setattr__(self, "logit_bias", self._checked_logit_bias())
        if self.allowed_token_ids is not None:
            allowed = check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids has {len(allowed)} ids; it must have 1 to {MAX_ALLOWED_TOKEN_IDS} "
                                 "(None allows every token)")
            object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "bad_words", self._checked_strings("bad_words", self.bad_words, MAX_BAD_WORDS,
                                                                    MAX_BAD_WORD_CHARS))

    def _checked_stop(self) -> tuple[str, ...]:
        return self._checked_strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)

    @staticmethod
    def _checked_strings(name: str, value: object, max_count: int, max_chars: int) -> tuple[str, ...]:
        """`stop` or `bad_words` as a tuple of 1 to max_chars characters each (bad words need a non-space one)."""
        kind = "stop strings" if name == "stop" else "bad words"
        if value is not None and not isinstance(value, (str, list, tuple)):
            raise ValueError(f"{name}={show(value)} must be a string or a list of strings")
        value = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        if len(value) > max_count:
            raise ValueError(f"{name} has {len(value)} strings; the limit is {max_count}")
        for i, s in enumerate(value):
            check_text(f"{name}[{i}]", s)
            if not 1 <= len(s) <= max_chars:
                raise ValueError(f"{name}[{i}] has {len(s)} characters; {kind} must have 1 to {max_chars}")
            if name == "bad_words" and not s.strip():
                raise ValueError(f"{name}[{i}]={show(s)} has only spaces; a bad word needs a character besides them")
        return value

    def _checked_logit_bias(self) -> _FrozenBias | None:
        bias = self.logit_bias
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}")
        out, lim = {}, MAX_LOGIT_BIAS_VALUE
        for token, value in bias.items():
            if not isinstance(token, (int, np.integer)) or isinstance(token, (bool, np.bool_)) or token < 0:
                raise ValueError(f"logit_bias key {show(token)} must be a token id, an integer >= 0")
            if isinstance(value, (np.integer, np.floating)) and not isinstance(value, np.bool_):
                value = value.item()
            if not _is_finite(value) or not -lim <= value <= lim:
                raise ValueError(f"logit_bias[{show(token)}]={show(value)} must be a finite number in [{-lim:g}, "
                                 f"{lim:g}]")
            out[int(token)] = float(value)
        return _FrozenBias(out) if out else None

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is active."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
