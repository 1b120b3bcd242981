"""The engine's side of structured output: one llguidance matcher per constrained sequence, its packed token mask
for the next step, and the tokens it consumes.

1. `Grammars.add` builds a matcher per sequence of a request whose `SamplingParams.structured_outputs` is set
   (at admission: a grammar llguidance cannot build for this tokenizer is a `ValueError`, nothing queued).
2. Before a step, `allowed_many` computes the constrained rows' next-token masks (in parallel over the cores),
   each int32[ceil(V/32)] (bit j of word i allows id 32 i + j, llguidance's layout); it rides in
   `SamplingRow.allowed` into the jitted sampler, which sets the other logits to -inf (`jaxinfer.engine.sampling`),
   so constrained and unconstrained rows share one batch and one device call, and no logits come back to the host.
3. After the step, `consume(seq, token)` advances the matcher; a token it refuses (possible only if the mask was
   bypassed, e.g. `min_tokens` banning the EOS the grammar needs) fails that request with the matcher's error.
   The mask allows EOS only where the constraint is complete, so a constrained output ends with EOS there.
4. Speculative decoding is off for constrained sequences (`Engine.step` leaves them out of the plan). They still
   ride, without drafts, in the verify step of a batch whose other rows speculate: their token is consumed then
   too (it was not, before: the matcher fell behind and the output broke its constraint).

Source: llguidance (https://github.com/guidance-ai/llguidance), its `LLMatcher` / `LLTokenizer` API.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _short(error: str) -> str:
    """llguidance's error text on one line, without the parser state and grammar it appends (kilobytes)."""
    head = error.split("<state>")[0].split("<grammar>")[0]
    message = " ".join(line.strip() for line in head.strip().splitlines())
    return message if len(message) <= 300 else message[:297] + "..."


class _PieceTokens:
    """A sentencepiece vocabulary as llguidance's `TokenizerWrapper` wants it: each id's bytes ("▁" is a space,
    `<0xNN>` pieces are that byte, special pieces are empty) and an encode function."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        tokens = []
        for i in range(vocab_size):
            piece = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else ""
            if i in tokenizer.special_ids:
                tokens.append(b"")
            elif m := _BYTE_PIECE.fullmatch(piece):
                tokens.append(bytes([int(m.group(1), 16)]))
            else:
                tokens.append(piece.replace("\u2581", " ").encode())
        self.tokens = tokens

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


class Grammars:
    """The matchers of an engine's constrained sequences.

    Args:
      tokenizer: the model's tokenizer (its token table is built on the first constrained request, ~0.3 s).
      vocab_size: V, the logits' last dimension (ids past the tokenizer's vocabulary are never allowed).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self.words = (vocab_size + 31) // 32
        self._ll = None
        self._matchers: dict[int, object] = {}
        self._executor = None  # llguidance's thread pool for `allowed_many`, made on first use

    def _ll_tokenizer(self):
        if self._ll is None:
            from llguidance import LLTokenizer, TokenizerWrapper  # noqa: PLC0415 - only with constrained requests

            eos = sorted(self._tokenizer.eos_ids)
            source = self._tokenizer.hf_json
            if source is None:
                source = TokenizerWrapper(_PieceTokens(self._tokenizer, self.vocab_size))
            try:
                self._ll = LLTokenizer(source, n_vocab=self.vocab_size, eos_token=eos or None)
            except (ValueError, RuntimeError) as e:  # e.g. a tokenizer.json without a decoder
                raise ValueError(f"structured_outputs: llguidance cannot read this model's tokenizer ({e})") from None
        return self._ll

    def add(self, seq_ids: Sequence[int], params: SamplingParams) -> None:
        """Builds a matcher for each of a request's sequences (none without `structured_outputs`).

        Raises:
          ValueError: naming the field, when llguidance cannot build the grammar for this tokenizer.
        """
        so = params.structured_outputs
        if so is None:
            return
        from llguidance import LLMatcher  # noqa: PLC0415

        first = LLMatcher(self._ll_tokenizer(), so.llguidance_grammar(), log_level=0)
        if first.is_error():
            raise ValueError(f"structured_outputs.{so.kind} is not valid: {_short(first.get_error())}")
        self._probe(first, so.kind)
        for i, seq_id in enumerate(seq_ids):
            self._matchers[seq_id] = first if i == 0 else first.deep_copy()

    def _probe(self, matcher, kind: str) -> None:
        """ValueError naming the field when the grammar fails on its first token: llguidance builds its lexer
        lazily, so a regex such as `a{1000000}` passes the build and fails with "too many expressions" only when
        a token is consumed (found by a user trial: it was a failed request, an HTTP 500). A copy of the matcher
        consumes the first token its mask allows; the request's own matcher is untouched."""
        mask = np.zeros(self.words, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} cannot be used: {_short(matcher.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if allowed.size == 0:
            return  # nothing allowed: the step fails the request naming the constraint
        probe = matcher.deep_copy()
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise ValueError(f"structured_outputs.{kind} cannot be used: {_short(probe.get_error())}")

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def allowed(self, seq_id: int) -> np.ndarray | None:
        """int32[ceil(V/32)]: the sequence's packed next-token mask; None for an unconstrained sequence."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return None
        mask = np.zeros(self.words, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def allowed_many(self, seq_ids: Sequence[int]) -> dict[int, np.ndarray]:
        """{seq id: `allowed(seq id)`} for the constrained ones among seq_ids (the others are left out), computed
        in one call that spreads the matchers over llguidance's threads (`LLExecutor`, one per core: the host
        waits for these masks before the step, with the cores otherwise idle)."""
        ids = [s for s in seq_ids if s in self._matchers]
        if len(ids) < 2:
            return {s: self.allowed(s) for s in ids}
        if self._executor is None:
            from llguidance import LLExecutor  # noqa: PLC0415

            self._executor = LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))
        masks = np.zeros((len(ids), self.words), np.int32)
        self._executor.unsafe_compute_mask_ptr([(self._matchers[s], i) for i, s in enumerate(ids)],
                                               masks.ctypes.data, self.words * 4, len(ids))
        return dict(zip(ids, masks))

    def consume(self, seq_id: int, token_ids: int | Sequence[int]) -> str | None:
        """Advances the sequence's matcher by the tokens a step emitted for it (one sampled token, or a verify
        step's list); the matcher's error if it refuses one, else None."""
        matcher = self._matchers.get(seq_id)
        for token_id in [token_ids] if isinstance(token_ids, int) else token_ids:
            if matcher is None or matcher.is_stopped():
                return None
            if not matcher.consume_token(token_id):
                return f"the constrained output cannot continue with token {token_id}: {_short(matcher.get_error())}"
        return None

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's matcher."""
        self._matchers.pop(seq_id, None)
