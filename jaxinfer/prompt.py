"""`Prompt`: one request's prompt, tokenized once, as it travels from an API (`LLM`, `AsyncEngine`, the gRPC server)
to the engine.

A `Prompt` is built by `make_prompt` (`Engine.make_prompt` with the engine's tokenizer; it tokenizes text and checks token ids against the vocabulary) or
directly from ids the caller already has; `Engine.add_request` takes it as it is, without tokenizing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxinfer.request_limits import check_text, check_token_ids, show


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # vLLM's names; any other key is refused


def check_cache_salt(cache_salt: object) -> None:
    """Raises ValueError unless `cache_salt` is None or a non-empty string of valid Unicode text."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt={show(cache_salt)} must be a non-empty string or None")
    if cache_salt is not None:
        check_text("cache_salt", cache_salt)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A tokenized prompt; immutable.

    Attributes:
      token_ids: the prompt's token ids, a tuple of ints (lists, numpy integer arrays and numpy integer scalars are
        converted). The engine checks them against the vocabulary and the context at admission.
      text: the text the ids were encoded from, or None for a prompt given as ids (it is reported back in
        `RequestOutput.prompt`).
      cache_salt: requests with different salts never share prefix-cache pages (e.g. one salt per tenant); None
        for no salt.

    Raises:
      ValueError: token ids that are not integers or are negative, a text that is not a string of valid Unicode,
        or a cache salt that is not a non-empty string.
    """

    token_ids: tuple[int, ...]
    text: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", check_token_ids("Prompt token_ids", self.token_ids))  # frozen: once
        if self.text is not None:
            check_text("Prompt text", self.text)
        check_cache_salt(self.cache_salt)


def make_prompt(prompt: Prompt | str | dict | Sequence[int] | np.ndarray, encode: Callable[[str], list[int]],
                vocab_size: int, cache_salt: str | None = None) -> Prompt:
    """Turns a prompt into a `Prompt`, tokenizing text here, once.

    Args:
      prompt: text, token ids (ints or numpy integers, or a 1-D integer array), `{"prompt_token_ids": [...]}` or
        `{"prompt": text}` (one of the two; either dict may carry `"cache_salt"`; no other key), or a `Prompt`
        (not tokenized again; its ids are checked; `Prompt(ids, text=...)` carries both).
      encode: the tokenizer's text -> token ids.
      vocab_size: ids must lie in [0, vocab_size).
      cache_salt: the prompt's prefix-cache salt; when given, it wins over one the prompt carries.

    Raises:
      ValueError: naming the field: a cache salt that is not a non-empty string, an empty text, text that is not
        valid Unicode (a lone surrogate), ids outside the vocabulary, a dict with an unknown key, with both
        'prompt' and 'prompt_token_ids' (which of them would be the prompt?) or a value of the wrong type, or an
        unsupported prompt type.
    """
    if isinstance(prompt, dict):
        unknown = [k for k in prompt if k not in PROMPT_DICT_KEYS]
        if unknown:
            raise ValueError(f"prompt dict has unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                             f"{', '.join(PROMPT_DICT_KEYS)}")
        if "prompt" in prompt and "prompt_token_ids" in prompt:
            raise ValueError("a dict prompt has both 'prompt' and 'prompt_token_ids'; give one of them (a text "
                             "'prompt', tokenized here, or 'prompt_token_ids')")
        if "prompt_token_ids" not in prompt and not isinstance(prompt.get("prompt"), str):
            got = "" if "prompt" not in prompt else f" (its 'prompt' is of type {type(prompt['prompt']).__name__})"
            raise ValueError(f"a dict prompt needs 'prompt_token_ids' or a text 'prompt'{got}")
        cache_salt = prompt.get("cache_salt") if cache_salt is None else cache_salt
        if "prompt_token_ids" not in prompt:
            prompt = check_text("prompt['prompt']", prompt["prompt"])  # a text prompt dict, as vLLM's {"prompt": text}
        else:
            check_cache_salt(cache_salt)
            ids = check_token_ids("prompt_token_ids", prompt["prompt_token_ids"], vocab_size)
            return Prompt(ids, cache_salt=cache_salt)
    elif isinstance(prompt, Prompt) and cache_salt is None:
        cache_salt = prompt.cache_salt
    check_cache_salt(cache_salt)
    if isinstance(prompt, str):
        if not check_text("prompt", prompt):
            raise ValueError("prompt must not be empty")
        ids = tuple(encode(prompt))
        outside = [i for i in ids if not 0 <= i < vocab_size]
        if outside:  # a tokenizer with more ids than the model's embedding (found by a user trial: NaN logits)
            raise ValueError(f"prompt tokenizes to {len(outside)} id(s) outside the model's vocabulary "
                             f"[0, {vocab_size}), e.g. {outside[0]}: the tokenizer has ids the model lacks")
        return Prompt(ids, text=prompt, cache_salt=cache_salt)
    if isinstance(prompt, Prompt):
        return Prompt(check_token_ids("prompt_token_ids", prompt.token_ids, vocab_size), text=prompt.text,
                      cache_salt=cache_salt)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return Prompt(check_token_ids("prompt_token_ids", prompt, vocab_size), cache_salt=cache_salt)
    raise ValueError(f"prompt must be a string, token ids or a dict with 'prompt_token_ids', "
                     f"got {type(prompt).__name__}")
