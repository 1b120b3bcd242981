"""`IncrementalDetokenizer`: generated ids, fed one at a time, -> text deltas (`str`).

Deltas never end in half a UTF-8 character; `"".join(deltas) + flush()` equals
`Tokenizer.decode(ids)` of the generated ids.

Errors: `ValueError` for an id outside the vocabulary (from `step` and from `prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.tokenizer.tokenizer import Tokenizer

_DETOK_CONTEXT = 6  # prompt ids kept as left context by IncrementalDetokenizer


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas.

    Each `step` decodes a short window (the previously emitted tokens plus the new ones) and
    returns what the new tokens added. Text is held back while it ends in an incomplete UTF-8
    sequence (an emoji or CJK character split across byte tokens), so deltas never carry a
    half character. `"".join(deltas) + flush()` equals `tokenizer.decode(all_ids)` (without
    `prompt_ids`), leading spaces included.

    Args:
      tokenizer: the `Tokenizer`.
      skip_special_tokens: as in `Tokenizer.decode`.
      prompt_ids: optional prompt ids; the last few are used as left context so the first
        generated token decodes as it would mid-text (matters for SentencePiece, which drops
        the leading space of the first token of a sequence). They produce no output.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window of ids being decoded: [0, read_offset) produced the last emitted text (or are
        # prompt context) and decode to `prefix_text`; [read_offset, len) are not yet emitted.
        self._ids = [tokenizer._check_id(i) for i in list(prompt_ids)[-_DETOK_CONTEXT:]]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (by `step` and `flush`)."""
        return "".join(self._emitted)

    def _decode(self, ids: list[int]) -> str:
        return self._tok._backend.decode(ids, self._skip)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # The next window starts at the ids that produced this delta; older ids are dropped.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._emitted.append(delta)
        return delta

    def step(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes (possibly "").

        Raises:
          ValueError: `token_id` is outside the vocabulary.
        """
        self._ids.append(self._tok._check_id(token_id))
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an unfinished UTF-8 sequence: wait for more tokens
        return self._emit(new_text)

    def flush(self) -> str:
        """Returns any held-back text (it may end in U+FFFD if generation stopped mid-character)."""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)
