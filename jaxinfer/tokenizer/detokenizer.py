"""`IncrementalDetokenizer`: generated ids, fed one at a time, -> text deltas (`str`).

Deltas never end in half a UTF-8 character; `"".join(deltas) + flush()` equals
`Tokenizer.decode(ids)` of the generated ids (but for a character begun by the prompt's last
tokens, which the deltas carry whole: `IncrementalDetokenizer`'s `prompt_ids`). With a
`tokenizers` backend each step runs through
`tokenizers.decoders.DecodeStream` (the same window algorithm, in Rust); with a SentencePiece
backend, or where `DecodeStream` cannot follow the window (see `IncrementalDetokenizer`), the
window is decoded here in Python. Both give the same text
(tests/jaxinfer/tokenizer/test_tokenizer.py compares them token by token).

Errors: `ValueError` for an id outside the vocabulary (from `step` and from `prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from jaxinfer.tokenizer.backends import _HFBackend

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

    With a `tokenizers` backend the window is decoded by `tokenizers.decoders.DecodeStream`,
    which runs the same algorithm. This class still keeps the window's ids (no decoding) for
    `flush`, and decodes the window itself from then on when the stream cannot follow it: prompt
    context that decodes to "" or ends mid-character, a step the stream rejects (its decoded
    window no longer starts with the previous one), or a `step` after `flush`.

    Args:
      tokenizer: the `Tokenizer`.
      skip_special_tokens: as in `Tokenizer.decode`.
      prompt_ids: optional prompt ids; the last few are used as left context so the first
        generated token decodes as it would mid-text (matters for SentencePiece, which drops
        the leading space of the first token of a sequence). They produce no output, except
        a character whose UTF-8 bytes begin in the prompt's last tokens and end in generated
        ones: the delta that completes it carries the whole character (so the deltas then
        hold one character more than `tokenizer.decode` of the generated ids alone, which
        would give U+FFFD for its orphaned continuation bytes).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window of ids being decoded: [0, read_offset) produced the last emitted text (or are
        # prompt context) and decode to `prefix_text`; [read_offset, len) are not yet emitted.
        self._ids = [tokenizer._check_id(i) for i in list(prompt_ids)[-_DETOK_CONTEXT:]]
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decoded on demand (the stream does not need it)
        self._emitted: list[str] = []
        context_text = self._decode(self._ids) if self._ids else ""
        if context_text.endswith("\ufffd"):
            # The prompt ends mid-character: the prefix leaves out the unfinished bytes' U+FFFD, so the delta
            # that completes the character carries all of it (else it would count as prompt text, never emitted).
            self._prefix_text = context_text.rstrip("\ufffd")
            self._stream = None
        else:
            self._stream = self._start_stream()

    @property
    def text(self) -> str:
        """Everything emitted so far (by `step` and `flush`)."""
        return "".join(self._emitted)

    def _start_stream(self) -> DecodeStream | None:
        """A `DecodeStream` in the same state as the window, or None to decode the window here."""
        backend = self._tok._backend
        if not isinstance(backend, _HFBackend):
            return None
        stream = DecodeStream(skip_special_tokens=self._skip)
        # Feeding the context as one step leaves the stream's prefix = decode(context), as ours,
        # when that text is non-empty and complete; otherwise the stream's window would differ.
        if self._ids and stream.step(backend._special, list(self._ids)) is None:
            return None
        return stream

    def _decode(self, ids: list[int]) -> str:
        return self._tok._backend.decode(ids, self._skip)

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read_offset])
        return self._prefix_text

    def _advance(self, delta: str) -> str:
        # The next window starts at the ids that produced this delta; older ids are dropped.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._emitted.append(delta)
        return delta

    def _emit(self, new_text: str) -> str:
        return self._advance(new_text[len(self._prefix()) :])

    def step(self, token_id: int) -> str:
        """Adds one generated id; returns the text it completes (possibly "").

        Raises:
          ValueError: `token_id` is outside the vocabulary.
        """
        self._ids.append(self._tok._check_id(token_id))
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._tok._backend._special, self._ids[-1])
            except Exception:  # the Rust stream's errors are plain Exceptions (e.g. its InvalidPrefix)
                self._stream = None  # its window holds the same ids as ours: go on decoding here
            else:
                return "" if chunk is None else self._advance(chunk)
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix()) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an unfinished UTF-8 sequence: wait for more tokens
        return self._emit(new_text)

    def flush(self) -> str:
        """Returns any held-back text (it may end in U+FFFD if generation stopped mid-character)."""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix()):
            return ""
        self._stream = None  # the stream still holds the flushed ids as pending: decode here from now on
        return self._emit(new_text)
