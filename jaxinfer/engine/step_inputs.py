"""Host-side step inputs: ragged batches padded to shape buckets, as numpy arrays (no jax calls here).

Every device call of the runner takes padded shapes so that a handful of shapes are compiled and then reused:
flat tokens, sequences, pages per sequence and the longest query run are rounded up to buckets (powers of two;
page-table widths in 4x steps). Padding is inert: padded tokens write to the null page 0, padded sequences have no
tokens, padded page-table entries point at the null page.

- `prepare_step`: the ragged batch of a step (prefill chunks and decodes, or a verify step's windows).
- `draft_inputs`: the drafting call of a draft model (one row per sequence and draft step).
- `build_page_table` and `kv_locations`: the one page-table builder and the one map from positions to cache
  locations (kv_loc); both of the above use them.
- `verify_draft_ids`, `padded_page_ids`: the verify step's draft arrays and the page moves' id lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxinfer.scheduler.chunk import ScheduledChunk
from models.llama import AttentionMetadata
from pallas_kernels import cpu_gemv


def min_rows(mesh_size: int = 1) -> int:
    """Fewest token and logits rows a step pads to: 1 where the native CPU kernels run the matmuls (a padding row
    is only extra work there: one device, kernels active), else 2 (XLA:CPU's one-row bf16 dot is ~10x slower than
    its two-row one)."""
    return 1 if mesh_size == 1 and cpu_gemv.active() else 2

NULL_PAGE = 0  # never allocated: padding reads and writes land here
MIN_PREFILL_TOKENS = 16  # smallest token bucket of a step with a prefill chunk
MIN_PAGES_PER_SEQ = 8  # smallest page-table width; widths grow 4x (8, 32, 128, ...)


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def page_bucket(n: int, max_pages_per_seq: int) -> int:
    """Page-table width for a step whose longest sequence needs n pages: 8 * 4**k >= n, capped at the maximum.

    4x steps keep the number of compiled shapes small; the reference attention then reads at most 4x the pages it
    needs (a small share of a decode step's bytes at these context lengths, BENCHMARKS.md).
    """
    width = MIN_PAGES_PER_SEQ
    while width < n:
        width *= 4
    return max(min(width, max_pages_per_seq), n)


def page_table_widths(max_pages_per_seq: int) -> list[int]:
    """Every width `page_bucket` returns for contexts up to max_pages_per_seq pages, smallest first."""
    widths, width = [], MIN_PAGES_PER_SEQ
    while True:
        widths.append(min(width, max_pages_per_seq))
        if width >= max_pages_per_seq:
            return widths
        width *= 4


def build_page_table(page_ids: Sequence[Sequence[int]], num_pages: Sequence[int], batch_pad: int,
                     width: int) -> np.ndarray:
    """The page table of a padded batch.

    Args:
      page_ids: each sequence's page ids (at least num_pages[b] of them).
      num_pages: pages of each sequence the step reads or writes.
      batch_pad: rows (>= len(page_ids)); rows past the sequences are padding.
      width: columns (>= every num_pages[b]).

    Returns:
      i32[batch_pad, width]: row b holds page_ids[b][:num_pages[b]], then the null page.

    Raises:
      ValueError: a sequence with fewer page ids than it needs, or a batch or width too small for them.
    """
    if len(page_ids) > batch_pad or max(num_pages, default=0) > width:
        raise ValueError(f"{len(page_ids)} sequences of up to {max(num_pages, default=0)} pages do not fit a "
                         f"page table of {batch_pad} x {width}")
    table = np.full((batch_pad, width), NULL_PAGE, np.int32)
    for b, (ids, n) in enumerate(zip(page_ids, num_pages)):
        if len(ids) < n:
            raise ValueError(f"sequence {b} needs {n} pages but has {len(ids)}")
        table[b, :n] = ids[:n]
    return table


def kv_locations(page_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat KV cache locations, kv_loc (page * page_size + offset), of the tokens at `positions` of sequences `rows`.

    Args:
      page_table: i32[B, P] from `build_page_table`.
      rows, positions: int arrays of one shape: each token's row of the page table and its position.
      page_size: tokens per page.

    Returns:
      i32 array of the same shape.
    """
    pages = page_table[rows, positions // page_size]
    return (pages * page_size + positions % page_size).astype(np.int32)


def _pages_needed(chunks: Sequence[ScheduledChunk], kv_lens: Sequence[int], page_size: int) -> list[int]:
    """Pages each chunk's sequence spans after the step; ValueError when it holds fewer."""
    needed = [-(-n // page_size) for n in kv_lens]
    for c, n, kv_len in zip(chunks, needed, kv_lens):
        if len(c.page_ids) < n:
            raise ValueError(f"sequence needs {n} pages for {kv_len} tokens but has {len(c.page_ids)}")
    return needed


def _token_buckets(q_lens: list[int], batch_pad: int, verify_width: int, verify_len: int, fewest: int
                   ) -> tuple[int, int, int]:
    """(padded flat tokens, longest query run as used, its padded bucket) of a step."""
    num_tokens, max_q = sum(q_lens), max(q_lens)
    tokens_pad = next_power_of_two(num_tokens, fewest)
    if verify_width:
        if verify_len:
            if max_q > verify_len:
                raise ValueError(f"a verify window of {max_q} tokens exceeds verify_len={verify_len}")
            tokens_pad, max_q = next_power_of_two(batch_pad * verify_len, 2), verify_len
        return tokens_pad, max_q, next_power_of_two(max_q)
    if max_q > 1:
        tokens_pad = next_power_of_two(num_tokens, MIN_PREFILL_TOKENS)
    max_q_pad = 1 if max_q == 1 else min(next_power_of_two(max_q, MIN_PREFILL_TOKENS), tokens_pad)
    return tokens_pad, max_q, max_q_pad


def _logits_indices(cu_q_lens: np.ndarray, q_lens: list[int], batch_pad: int, tokens_pad: int, all_rows: bool,
                    verify_width: int, fewest: int) -> tuple[np.ndarray, int]:
    """(which token rows the LM head reads, how many rows that is)."""
    n = len(q_lens)
    if verify_width:
        # row b * (k+1) + j: sequence b's token min(j, q_len - 1); padding sequences read row 0
        starts, last = np.zeros(batch_pad, np.int32), np.zeros(batch_pad, np.int32)
        starts[:n] = cu_q_lens[:n]
        last[:n] = np.array(q_lens) - 1
        offsets = np.minimum(np.arange(verify_width)[None, :], last[:, None])
        return (starts[:, None] + offsets).reshape(-1).astype(np.int32), batch_pad
    rows_pad = max(batch_pad, fewest)
    if all_rows:
        return np.arange(tokens_pad, dtype=np.int32), rows_pad
    indices = np.zeros(rows_pad, np.int32)
    indices[:n] = cu_q_lens[1 : n + 1] - 1
    return indices, rows_pad


def prepare_step(chunks: Sequence[ScheduledChunk], page_size: int, max_pages_per_seq: int, *, all_rows: bool,
                 flash: bool = False, verify_width: int = 0, verify_len: int = 0,
                 fewest_rows: int = 2) -> tuple[np.ndarray, AttentionMetadata, int]:
    """Pads a ragged batch to its shape buckets.

    Args:
      chunks: one entry per sequence: its new tokens, tokens already cached, its page ids.
      page_size: tokens per page.
      max_pages_per_seq: the widest page table.
      all_rows: logits for every token (`compute_logits`) instead of each sequence's last one.
      flash: the attention backend has a flash kernel: a batch of fresh prompts only (no cached context) is
        flagged `fresh_prefill` (otherwise the flag stays off, so the shape keys are the same as without it).
      verify_width: k + 1 > 0 for a verify step: each sequence gets k + 1 logits rows (its window's rows, the
        last repeated past its length) and the token buckets start at 2 instead of 16.
      verify_len: >= every verify window's length: pads the step as if every sequence of the padded batch had
        that many tokens, so that a verify step's shape depends on its batch bucket and verify_len alone (the
        shapes warm-up compiles); 0: no such padding.
      fewest_rows: the fewest token and logits rows of a step (`min_rows`).

    Returns:
      (tokens i32[T_pad], metadata, padded batch / logits rows).

    Raises:
      ValueError: an empty batch, a sequence without new tokens, one with too few pages, or a verify window
        longer than verify_len.
    """
    q_lens = [len(c.token_ids) for c in chunks]
    if not chunks or min(q_lens) < 1:
        raise ValueError("every sequence in a step needs at least one new token")
    num_tokens, batch_pad = sum(q_lens), next_power_of_two(len(chunks))
    tokens_pad, max_q, max_q_pad = _token_buckets(q_lens, batch_pad, verify_width, verify_len, fewest_rows)
    kv_lens = [c.num_computed_tokens + q for c, q in zip(chunks, q_lens)]
    pages_needed = _pages_needed(chunks, kv_lens, page_size)
    page_table = build_page_table([c.page_ids for c in chunks], pages_needed, batch_pad,
                                  page_bucket(max(pages_needed), max_pages_per_seq))
    fresh = flash and max_q > 1 and all(c.num_computed_tokens == 0 for c in chunks)

    real_positions = np.concatenate([np.arange(c.num_computed_tokens, n) for c, n in zip(chunks, kv_lens)])
    rows = np.repeat(np.arange(len(chunks)), q_lens)
    tokens = np.zeros(tokens_pad, np.int32)
    tokens[:num_tokens] = np.concatenate([c.token_ids for c in chunks])
    positions = np.zeros(tokens_pad, np.int32)
    positions[:num_tokens] = real_positions
    kv_loc = np.full(tokens_pad, NULL_PAGE * page_size, np.int32)
    kv_loc[:num_tokens] = kv_locations(page_table, rows, real_positions, page_size)
    cu_q_lens = np.full(batch_pad + 1, num_tokens, np.int32)
    cu_q_lens[: len(chunks) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens_arr = np.zeros(batch_pad, np.int32)
    kv_lens_arr[: len(chunks)] = kv_lens
    logits_indices, rows_pad = _logits_indices(cu_q_lens, q_lens, batch_pad, tokens_pad, all_rows, verify_width,
                                               fewest_rows)
    metadata = AttentionMetadata(positions=positions, cu_q_lens=cu_q_lens, kv_lens=kv_lens_arr,
                                 page_table=page_table, kv_loc=kv_loc, logits_indices=logits_indices,
                                 max_q_len=max_q_pad, fresh_prefill=fresh)
    return tokens, metadata, rows_pad


def draft_inputs(chunks: Sequence[ScheduledChunk], num_slots: Sequence[int], num_tokens: int, page_size: int,
                 max_pages_per_seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host inputs of the drafting call (`jaxinfer.engine.spec_decode.draft.propose`).

    Args:
      chunks: one decode chunk per sequence (its last token), pages covering positions
        `[0, num_computed_tokens + 1 + num_slots[b])`.
      num_slots: drafts wanted per sequence, in [0, num_tokens].
      num_tokens: k, the draft steps every row runs.
      page_size, max_pages_per_seq: as `prepare_step`.

    Returns:
      (tokens i32[B_pad], positions i32[k, B_pad], kv_loc i32[k, B_pad], page_table i32[B_pad, P]). Steps past a
      row's slots keep its last real position and write to the null page.

    Raises:
      ValueError: a sequence with too few pages for its slots.
    """
    batch_pad = next_power_of_two(len(chunks))
    pages = [-(-(c.num_computed_tokens + 1 + n) // page_size) for c, n in zip(chunks, num_slots)]
    page_table = build_page_table([c.page_ids for c in chunks], pages, batch_pad,
                                  page_bucket(max(pages), max_pages_per_seq))
    tokens = np.zeros(batch_pad, np.int32)
    tokens[: len(chunks)] = [c.token_ids[0] for c in chunks]
    computed = np.array([c.num_computed_tokens for c in chunks], np.int64)
    slots = np.array(num_slots, np.int64)
    steps = np.arange(num_tokens)[:, None]
    pos = computed[None, :] + steps  # [k, B]
    positions = np.zeros((num_tokens, batch_pad), np.int32)
    positions[:, : len(chunks)] = np.minimum(pos, computed + slots)  # steps past the slots stay in range
    kv_loc = np.full((num_tokens, batch_pad), NULL_PAGE * page_size, np.int32)
    step_ids, rows = np.nonzero(steps < slots[None, :])
    kv_loc[step_ids, rows] = kv_locations(page_table, rows, pos[step_ids, rows], page_size)
    return tokens, positions, kv_loc, page_table


def verify_draft_ids(draft_token_ids: Sequence[Sequence[int]], batch_pad: int,
                     num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids i32[batch_pad, k], zero past each row's drafts; draft counts i32[batch_pad]) of a verify step.

    Raises:
      ValueError: a sequence with more than k drafts.
    """
    if any(len(d) > num_tokens for d in draft_token_ids):
        raise ValueError(f"a sequence has more than k={num_tokens} drafts")
    ids = np.zeros((batch_pad, num_tokens), np.int32)
    num_drafts = np.zeros(batch_pad, np.int32)
    for b, drafts in enumerate(draft_token_ids):
        ids[b, : len(drafts)] = drafts
        num_drafts[b] = len(drafts)
    return ids, num_drafts


def num_padded_tokens(tokens: np.ndarray, chunks: Sequence[ScheduledChunk]) -> int:
    """Token rows a step computes beyond the real tokens of its chunks (bucket padding)."""
    return int(tokens.shape[0]) - sum(len(c.token_ids) for c in chunks)


def padded_page_ids(*id_lists: Sequence[int]) -> list[np.ndarray]:
    """Page id lists (all as long as the first) padded with the null page to a power of two: i32[n_pad] each.

    Few compiled shapes for the page moves; writes to page 0 are inert.
    """
    width = next_power_of_two(len(id_lists[0]))
    out = []
    for ids in id_lists:
        arr = np.full(width, NULL_PAGE, np.int32)
        arr[: len(ids)] = ids
        out.append(arr)
    return out
