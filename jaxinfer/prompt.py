"""`Prompt`: one request's prompt, tokenized once, as it travels from an API (`LLM`, `AsyncEngine`, the gRPC server)
to the engine.

A `Prompt` is built by `Engine.make_prompt` (which tokenizes text and checks token ids against the vocabulary) or
directly from ids the caller already has; `Engine.add_request` takes it as it is, without tokenizing again.
"""

from __future__ import annotations

import dataclasses


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
