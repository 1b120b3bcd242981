"""Host-side (numpy) checks and padding of `SamplingRow` fields into the arrays of `SamplingArrays.build`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.engine.sampling_math import BITMASK_BITS, bitmask_words
from jaxinfer.request_limits import SUPPRESS_WIDTH

if TYPE_CHECKING:
    from jaxinfer.engine.sampling import SamplingRow

__all__ = ["check_allowed", "check_batch", "check_row", "logit_bias", "pad_ids", "penalty_ids", "token_bitmask"]


def check_row(row: SamplingRow) -> None:
    """ValueError naming the field unless the row's seed is in [0, 2**32), its sample_index in [0, n), its step in
    [0, 2**31) and its `allowed` None or a 1-D int32 numpy array."""
    seed, sample_index, step = row.seed, row.sample_index, row.step
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"{seed=} must be an integer in [0, 2**32)")
    if not isinstance(sample_index, (int, np.integer)) or not 0 <= sample_index < row.params.n:
        raise ValueError(f"{sample_index=} must be an integer in [0, n={row.params.n})")
    if not isinstance(step, (int, np.integer)) or not 0 <= step < 2**31:
        raise ValueError(f"{step=} must be an integer in [0, 2**31)")
    check_allowed(row.allowed)


def check_batch(rows: Sequence[SamplingRow], batch: int, vocab: int, vocab_limit: int, penalty_width: int) -> None:
    """The checks of `SamplingArrays.build` on its arguments: ValueError naming the argument unless batch >=
    len(rows), vocab_limit in [1, vocab], penalty_width >= 1 and no row bans more than SUPPRESS_WIDTH ids."""
    if batch < len(rows):
        raise ValueError(f"{batch=} must be >= the number of rows ({len(rows)})")
    if not 1 <= vocab_limit <= vocab:
        raise ValueError(f"{vocab_limit=} must be in [1, {vocab=}]")
    if penalty_width < 1:
        raise ValueError(f"{penalty_width=} must be >= 1")
    if (widest := max((len(r.suppress) for r in rows), default=0)) > SUPPRESS_WIDTH:  # refused at admission
        raise ValueError(f"a row bans {widest} ids; at most {SUPPRESS_WIDTH=} can be banned")


def _checked_ids(ids: Sequence[int], vocab: int, row: int, name: str) -> np.ndarray:
    """i64[len(ids)] of a row's ids; ValueError naming the field unless they lie in [0, vocab)."""
    arr = np.asarray(ids, np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"{name} of row {row} must lie in [0, {vocab=}); got {list(ids)!r}")
    return arr


def pad_ids(id_lists: Sequence[Sequence[int]], batch: int, width: int, vocab: int, name: str) -> np.ndarray:
    """i32[batch, width] with row i = id_lists[i] followed by -1s.

    Raises:
      ValueError: if an id lies outside [0, vocab), naming `name` and the row.
    """
    out = np.full((batch, width), -1, np.int32)
    for row, ids in enumerate(id_lists):
        arr = _checked_ids(ids, vocab, row, name)
        out[row, : len(arr)] = arr
    return out


def penalty_ids(rows: Sequence[SamplingRow], batch: int, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[batch, width]: each penalised row's prompt ids then output ids, -1 padded; i32[batch]: how many of them
    are prompt ids). Rows without penalties hold only -1.

    Raises:
      ValueError: if an id lies outside [0, vocab) or a penalised row has more than `width` ids.
    """
    ids, num_prompt = np.full((batch, width), -1, np.int32), np.zeros(batch, np.int32)
    for i, r in enumerate(rows):
        if r.params.uses_penalties:
            prompt = _checked_ids(r.prompt_token_ids, vocab, i, "prompt_token_ids")
            output = _checked_ids(r.output_token_ids, vocab, i, "output_token_ids")
            if (n := len(prompt) + len(output)) > width:
                raise ValueError(f"row {i} has {n} prompt + output ids, more than penalty_width={width} (the "
                                 "longest context)")
            ids[i, :n], num_prompt[i] = np.concatenate([prompt, output]), len(prompt)
    return ids, num_prompt


def logit_bias(rows: Sequence[SamplingRow], batch: int, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[batch, width]: each row's `params.logit_bias` ids, -1 padded; f32[batch, width]: their biases, 0 padded).

    Raises:
      ValueError: naming the row, if a bias id lies outside [0, vocab) or a row has more than `width` biases.
    """
    ids, values = np.full((batch, width), -1, np.int32), np.zeros((batch, width), np.float32)
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if not bias:
            continue
        if len(bias) > width:
            raise ValueError(f"logit_bias of row {i} has {len(bias)} entries, more than the width {width}")
        ids[i, :len(bias)] = _checked_ids(list(bias), vocab, i, "logit_bias")
        values[i, :len(bias)] = list(bias.values())
    return ids, values


def check_allowed(allowed: object) -> None:
    """ValueError naming `allowed` unless it is None or a 1-D int32 numpy array (`SamplingRow.allowed`)."""
    if allowed is not None and not (isinstance(allowed, np.ndarray) and allowed.dtype == np.int32
                                    and allowed.ndim == 1):
        raise ValueError(f"allowed must be None or a 1-D int32 numpy array (a packed token bitmask); got "
                         f"{type(allowed).__name__} of dtype {getattr(allowed, 'dtype', None)}, shape "
                         f"{np.shape(allowed)}")


def token_bitmask(rows: Sequence[SamplingRow], batch: int, vocab: int, vocab_limit: int) -> np.ndarray:
    """i32[batch, ceil(vocab / 32)]: each row's `allowed`; -1 (every token allowed) for rows whose `allowed` is
    None and for padding rows.

    Raises:
      ValueError: if a row's `allowed` is not ceil(vocab / 32) words long, or allows no token below vocab_limit
        (in [1, vocab]), naming the row.
    """
    words = bitmask_words(vocab)
    out = np.full((batch, words), -1, np.int32)
    full, rest = divmod(vocab_limit, BITMASK_BITS)  # words wholly below vocab_limit, then bits of the next word
    for i, r in enumerate(rows):
        if r.allowed is None:
            continue
        if r.allowed.shape != (words,):
            raise ValueError(f"allowed of row {i} has shape {r.allowed.shape}; a bitmask over {vocab=} tokens has "
                             f"ceil(V / 32) = {words} int32 words")
        if not (r.allowed[:full].any() or rest and r.allowed[full] & ((1 << rest) - 1)):
            raise ValueError(f"allowed of row {i} allows no token below {vocab_limit=}")
        out[i] = r.allowed
    return out
