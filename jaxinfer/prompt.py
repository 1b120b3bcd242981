"""`Prompt`: one request's prompt, tokenized once, as it travels from an API (`LLM`, `AsyncEngine`, the gRPC server)
to the engine.

A `Prompt` is built by `make_prompt` (`Engine.make_prompt` with the engine's tokenizer; it tokenizes text and checks token ids against the vocabulary) or
directly from ids the caller already has; `Engine.add_request` takes it as it is, without tokenizing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


def check_cache_salt(cache_salt: object) -> None:
    """Raises ValueError unless `cache_salt` is None or a non-empty string."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt={cache_salt!r} must be a non-empty string or None")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A tokenized prompt; immutable.

    Attributes:
      token_ids: the prompt's token ids, a tuple of ints (lists are converted). The engine checks them against
        the vocabulary and the context at admission.
      text: the text the ids were encoded from, or None for a prompt given as ids (it is reported back in
        `RequestOutput.prompt`).
      cache_salt: requests with different salts never share prefix-cache pages (e.g. one salt per tenant); None
        for no salt.

    Raises:
      ValueError: token ids that are not ints, a text that is not a string, or a cache salt that is not a
        non-empty string.
    """

    token_ids: tuple[int, ...]
    text: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, (tuple, list)):
            raise ValueError(f"Prompt token_ids must be a tuple of token ids, got {type(self.token_ids).__name__}")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.token_ids):
            raise ValueError("Prompt token_ids must all be ints")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))  # frozen: set once, here
        if self.text is not None and not isinstance(self.text, str):
            raise ValueError(f"Prompt text must be a string or None, got {type(self.text).__name__}")
        check_cache_salt(self.cache_salt)


def make_prompt(prompt: Prompt | str | dict | Sequence[int], encode: Callable[[str], list[int]], vocab_size: int,
                cache_salt: str | None = None) -> Prompt:
    """Turns a prompt into a `Prompt`, tokenizing text here, once.

    Args:
      prompt: text, token ids, `{"prompt_token_ids": [...], "prompt": text}` or `{"prompt": text}` (either
        dict may carry `"cache_salt"`), or a `Prompt` (not tokenized again; its ids are checked).
      encode: the tokenizer's text -> token ids.
      vocab_size: ids must lie in [0, vocab_size).
      cache_salt: the prompt's prefix-cache salt; when given, it wins over one the prompt carries.

    Raises:
      ValueError: a cache salt that is not a non-empty string, an empty prompt, ids outside the vocabulary, or
        an unsupported prompt type.
    """
    if isinstance(prompt, dict) and "cache_salt" in prompt:
        cache_salt = prompt["cache_salt"] if cache_salt is None else cache_salt
        prompt = {k: v for k, v in prompt.items() if k != "cache_salt"}
    elif isinstance(prompt, Prompt) and cache_salt is None:
        cache_salt = prompt.cache_salt
    check_cache_salt(cache_salt)
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        prompt = prompt["prompt"]  # a text prompt dict, as vLLM's {"prompt": text}
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return Prompt(tuple(encode(prompt)), text=prompt, cache_salt=cache_salt)
    if isinstance(prompt, Prompt):
        text, ids = prompt.text, prompt.token_ids
    elif isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or a text 'prompt'")
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, prompt
    else:
        raise ValueError(f"prompt must be a string, token ids or a dict with 'prompt_token_ids', "
                         f"got {type(prompt).__name__}")
    vocab = vocab_size
    bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
    return Prompt(tuple(int(t) for t in ids), text=text, cache_salt=cache_salt)
