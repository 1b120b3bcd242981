"""Host-side step inputs (jaxinfer/engine/step_inputs.py): the one page-table builder and the kv_loc map against a
direct numpy construction, and the two batches built on them (a step's and the drafting call's)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine.step_inputs import (NULL_PAGE, build_page_table, draft_inputs, kv_locations, min_rows,
                                         padded_page_ids, page_bucket, page_table_widths, prepare_step,
                                         verify_draft_ids)
from jaxinfer.scheduler.chunk import ScheduledChunk

PAGE_SIZE = 4


def _direct_page_table(page_ids, num_pages, batch_pad, width):
    table = np.zeros((batch_pad, width), np.int32)  # NULL_PAGE is 0
    for b in range(len(page_ids)):
        for j in range(num_pages[b]):
            table[b, j] = page_ids[b][j]
    return table


def test_page_table_equals_a_direct_construction() -> None:
    rng = np.random.default_rng(0)
    page_ids = [list(rng.permutation(np.arange(1, 40))[: n]) for n in (3, 7, 1)]
    num_pages = [2, 7, 1]
    table = build_page_table(page_ids, num_pages, batch_pad=4, width=8)
    assert table.dtype == np.int32 and table.shape == (4, 8)
    np.testing.assert_array_equal(table, _direct_page_table(page_ids, num_pages, 4, 8))
    assert (table[3] == NULL_PAGE).all()


def test_kv_locations_equal_page_times_size_plus_offset() -> None:
    table = build_page_table([[5, 9, 2], [7]], [3, 1], batch_pad=2, width=8)
    rows = np.array([0, 0, 0, 0, 1, 1])
    positions = np.array([0, 3, 4, 11, 0, 2])
    want = [table[r, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for r, p in zip(rows, positions)]
    np.testing.assert_array_equal(kv_locations(table, rows, positions, PAGE_SIZE), want)
    assert list(kv_locations(table, rows, positions, PAGE_SIZE)) == [20, 23, 36, 11, 28, 30]


def test_page_table_refuses_too_few_pages_and_too_small_tables() -> None:
    with pytest.raises(ValueError, match="needs 3 pages but has 2"):
        build_page_table([[1, 2]], [3], batch_pad=1, width=8)
    with pytest.raises(ValueError, match="do not fit"):
        build_page_table([[1], [2]], [1, 1], batch_pad=1, width=8)


def test_prepare_step_uses_the_page_table_for_every_token() -> None:
    chunks = [ScheduledChunk([11, 12, 13], 5, [3, 8]), ScheduledChunk([21], 2, [6])]
    tokens, md, rows_pad = prepare_step(chunks, PAGE_SIZE, max_pages_per_seq=64, all_rows=False)
    assert tokens.shape == (16,) and rows_pad == 2 and md.page_table.shape == (2, page_bucket(2, 64))
    np.testing.assert_array_equal(md.page_table, _direct_page_table([[3, 8], [6]], [2, 1], 2, 8))
    np.testing.assert_array_equal(tokens[:4], [11, 12, 13, 21])
    np.testing.assert_array_equal(md.positions[:4], [5, 6, 7, 2])
    np.testing.assert_array_equal(md.kv_loc[:4], [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 6 * 4 + 2])
    assert (md.kv_loc[4:] == NULL_PAGE * PAGE_SIZE).all()
    np.testing.assert_array_equal(md.cu_q_lens, [0, 3, 4])
    np.testing.assert_array_equal(md.logits_indices, [2, 3])
    with pytest.raises(ValueError, match="needs 3 pages for 9 tokens but has 2"):
        prepare_step([ScheduledChunk([1], 8, [3, 8])], PAGE_SIZE, 64, all_rows=False)


def test_verify_step_pads_every_window_to_verify_len() -> None:
    chunks = [ScheduledChunk([1, 2, 3], 4, [5, 6]), ScheduledChunk([4], 1, [7])]
    tokens, md, rows_pad = prepare_step(chunks, PAGE_SIZE, 64, all_rows=False, verify_width=4, verify_len=3)
    assert tokens.shape == (8,) and rows_pad == 2 and md.max_q_len == 4
    np.testing.assert_array_equal(md.logits_indices, [0, 1, 2, 2, 3, 3, 3, 3])
    with pytest.raises(ValueError, match="exceeds verify_len=2"):
        prepare_step(chunks, PAGE_SIZE, 64, all_rows=False, verify_width=4, verify_len=2)
    ids, num_drafts = verify_draft_ids([[2, 3], []], batch_pad=2, num_tokens=3)
    np.testing.assert_array_equal(ids, [[2, 3, 0], [0, 0, 0]])
    np.testing.assert_array_equal(num_drafts, [2, 0])


def test_draft_inputs_write_only_the_reserved_slots() -> None:
    chunks = [ScheduledChunk([9], 6, [3, 8, 4]), ScheduledChunk([5], 0, [2])]
    tokens, positions, kv_loc, table = draft_inputs(chunks, [3, 1], num_tokens=3, page_size=PAGE_SIZE,
                                                    max_pages_per_seq=64)
    np.testing.assert_array_equal(table, _direct_page_table([[3, 8, 4], [2]], [3, 1], 2, 8))
    np.testing.assert_array_equal(tokens, [9, 5])
    np.testing.assert_array_equal(positions, [[6, 0], [7, 1], [8, 1]])  # past its slots a row keeps its last
    np.testing.assert_array_equal(kv_loc, [[8 * 4 + 2, 2 * 4], [8 * 4 + 3, NULL_PAGE], [4 * 4, NULL_PAGE]])


def test_widths_and_padded_ids() -> None:
    assert page_table_widths(200) == [8, 32, 128, 200]
    assert page_table_widths(8) == [8]
    assert [list(a) for a in padded_page_ids([4, 5, 6], [7, 8, 9])] == [[4, 5, 6, 0], [7, 8, 9, 0]]


def test_one_row_steps_pad_to_two_rows_unless_the_native_kernels_run(monkeypatch):
    """XLA:CPU's one-row dot is slow, so a lone decode pads to two rows; with the native CPU kernels (one device) it
    stays one row. A mesh of several devices runs XLA's dots: two rows."""
    chunk = [ScheduledChunk([5], 3, [1])]
    for fewest in (1, 2):
        tokens, md, rows_pad = prepare_step(chunk, PAGE_SIZE, 64, all_rows=False, fewest_rows=fewest)
        assert tokens.shape == (fewest,) and rows_pad == fewest and md.logits_indices.shape == (fewest,)
    assert min_rows(1) == 1 and min_rows(4) == 2  # this machine builds the kernels (tests/pallas_kernels)
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert min_rows(1) == 2
