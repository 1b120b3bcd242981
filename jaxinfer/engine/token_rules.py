"""The host side of `SamplingParams.allowed_token_ids` and `.bad_words` (vLLM's semantics): each request's rules as
a packed token bitmask, ANDed with structured output's mask into `SamplingRow.allowed`, so that they cost the
sampler no compiled shape of their own (`jaxinfer.engine.sampling` applies the bitmask with its other bans).

1. `TokenRules.add` compiles a request's rules once, at admission: its allowed ids as a bitmask (every token when
   None), each bad word tokenized as vLLM does (`bad_words_token_ids`), and the words of one token cleared from
   that bitmask for good. Rules that leave nothing to sample are a `ValueError` naming the field.
2. Before each step, `allowed(seq_id, output_token_ids, grammar_mask)` is that bitmask with the last token of
   every longer bad word cleared whose other tokens end the output so far (vLLM matches the output, not the
   prompt), ANDed with the grammar's mask.
3. `speculates(seq_id)` is False for a sequence with a bad word of several tokens: its bans depend on each token
   drafted before, so speculative decoding leaves it out (as it does constrained sequences); allowed ids and
   one-token words ban the same tokens at every position, so verify and drafting honour them as they are.

Source: vLLM `SamplingParams.update_from_tokenizer` (the tokenization) and `v1/sample/ops/bad_words.py` (the ban).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.sampling_math import BITMASK_BITS, bitmask_words
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

__all__ = ["TokenRules", "bad_words_token_ids"]


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences `words` ban, as vLLM builds them: each word with its leading spaces stripped, then with
    one leading space when that gives another first token and as many tokens (a word in mid-text); a variant that
    encodes to no token is skipped.

    Returns:
      One list of ids per variant, each of length >= 1, ids in [0, tokenizer.vocab_size).
    """
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_bos=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False)
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


@dataclasses.dataclass(frozen=True)
class _Rules:
    """One request's compiled rules: `base` i32[ceil(V / 32)] (allowed ids less one-token bad words), and the bad
    words of two or more tokens."""

    base: np.ndarray
    multi: tuple[tuple[int, ...], ...]


def _set_bits(mask: np.ndarray, ids: np.ndarray, on: bool) -> None:
    """Sets (on) or clears the bits of `ids` (i64[N] in [0, V)) in the uint32 view of a packed bitmask, in place."""
    words, bits = ids // BITMASK_BITS, (np.uint32(1) << (ids % BITMASK_BITS).astype(np.uint32))
    if on:
        np.bitwise_or.at(mask, words, bits)
    else:
        np.bitwise_and.at(mask, words, ~bits)


def _allows_some(mask: np.ndarray, limit: int) -> bool:
    """Whether the packed bitmask (uint32 view) allows some token below `limit`."""
    full, rest = divmod(limit, BITMASK_BITS)
    return bool(mask[:full].any() or rest and mask[full] & np.uint32((1 << rest) - 1))


class TokenRules:
    """The compiled allowed ids and bad words of an engine's sequences.

    Args:
      tokenizer: the model's tokenizer (bad words are encoded with it, without BOS).
      vocab_size: V, the logits' last dimension (the bitmask covers [0, V)).
      sampled_vocab_size: ids the sampler may pick are [0, sampled_vocab_size); rules must leave one of them.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, sampled_vocab_size: int) -> None:
        self._tokenizer, self.vocab_size, self.sampled_vocab_size = tokenizer, vocab_size, sampled_vocab_size
        self.words = bitmask_words(vocab_size)
        self._rules: dict[int, _Rules] = {}

    def compile(self, params: SamplingParams) -> _Rules | None:
        """A request's rules, or None when it has neither allowed_token_ids nor bad_words. Call it before the
        request is queued; `add` registers the result.

        Raises:
          ValueError: naming the field: a bad word's token outside [0, V), or rules that leave no token below
            sampled_vocab_size (every allowed id, or every token, is a one-token bad word).
        """
        if params.allowed_token_ids is None and not params.bad_words:
            return None
        base = np.zeros(self.words, np.uint32)
        if params.allowed_token_ids is None:
            base[:] = np.uint32(0xFFFFFFFF)
        else:
            _set_bits(base, np.asarray(params.allowed_token_ids, np.int64), on=True)
        multi = []
        for ids in bad_words_token_ids(self._tokenizer, params.bad_words):
            if max(ids) >= self.vocab_size:
                raise ValueError(f"bad_words encode to token ids outside [0, {self.vocab_size}): {ids}")
            if len(ids) == 1:
                _set_bits(base, np.asarray(ids, np.int64), on=False)
            else:
                multi.append(tuple(ids))
        if not _allows_some(base, self.sampled_vocab_size):
            field = "bad_words" if params.allowed_token_ids is None else "allowed_token_ids with bad_words"
            raise ValueError(f"{field}: the bad words ban every token that could be sampled")
        return _Rules(base.view(np.int32), tuple(multi))

    def add(self, seq_ids: Sequence[int], rules: _Rules | None) -> None:
        """Registers `compile`'s rules for each of a request's sequences (nothing for None)."""
        if rules is not None:
            self._rules.update(dict.fromkeys(seq_ids, rules))

    def allowed(self, seq_id: int, output_token_ids: Sequence[int], grammar_mask: np.ndarray | None,
                suppress: Sequence[int] = ()) -> np.ndarray | None:
        """i32[ceil(V / 32)]: the sequence's allowed tokens this step (module docstring, 2) ANDed with
        `grammar_mask` (same layout, or None); None when neither restricts anything. `suppress`: the ids the
        sampler bans this step besides (EOS and stop ids before `min_tokens`).

        Raises:
          ValueError: naming the fields, when they leave no token to sample at this step (a bad word's last
            token the only one allowed_token_ids or the output constraint leaves; a completed constraint that
            allows only EOS while min_tokens bans it): the engine fails that request.
        """
        rules = self._rules.get(seq_id)
        if rules is None:
            if grammar_mask is not None and suppress:
                self._check_suppressed(grammar_mask, suppress)
            return grammar_mask
        mask = rules.base.copy() if grammar_mask is None else rules.base & grammar_mask
        banned = [word[-1] for word in rules.multi
                  if len(output_token_ids) >= len(word) - 1
                  and tuple(output_token_ids[len(output_token_ids) - len(word) + 1:]) == word[:-1]]
        if banned:
            _set_bits(mask.view(np.uint32), np.asarray(banned, np.int64), on=False)
        if not _allows_some(mask.view(np.uint32), self.sampled_vocab_size):
            raise ValueError("bad_words leave no token that allowed_token_ids or structured_outputs allow at this step "
                             "(the output ends with a bad word's other tokens)" if banned else
                             "allowed_token_ids and structured_outputs allow no common token at this step")
        if suppress:
            self._check_suppressed(mask, suppress)
        return mask

    def _check_suppressed(self, mask: np.ndarray, suppress: Sequence[int]) -> None:
        """ValueError naming min_tokens when `mask` allows only ids in `suppress` (an all-banned row would sample
        id 0: SmolLM2's <|endoftext|> after a completed constraint, found by a user trial)."""
        left = mask.view(np.uint32).copy()
        _set_bits(left, np.asarray(suppress, np.int64), on=False)
        if not _allows_some(left, self.sampled_vocab_size):
            raise ValueError("min_tokens: the output constraint (structured_outputs / allowed_token_ids) allows only "
                             "EOS or stop token ids here, which min_tokens bans until that many tokens were generated")

    def speculates(self, seq_id: int) -> bool:
        """False for a sequence with a bad word of several tokens (module docstring, 3)."""
        rules = self._rules.get(seq_id)
        return rules is None or not rules.multi

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's rules."""
        self._rules.pop(seq_id, None)
