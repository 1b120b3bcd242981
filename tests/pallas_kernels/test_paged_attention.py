"""Tests for pallas_kernels.paged_attention: the reference attention and `write_kv`.

Oracles: small cases whose softmax is worked out by hand in the comments, and a dense causal attention over
contiguous K/V written here in numpy (no paging, no masking tricks: it simply slices the visible keys).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference, write_kv
from pallas_kernels.paged_attention.reference import SPLIT_MIN_Q_LEN

LN3 = math.log(3.0)


def _pages(entries: dict[tuple[int, int], list[float]], num_pages: int, page_size: int, head_dim: int,
           fill: float = 0.0) -> np.ndarray:
    """A single-layer, single-kv-head cache [P, 1, page_size, H]; `entries[(page, slot)]` is one vector."""
    pages = np.full((num_pages, 1, page_size, head_dim), fill, np.float32)
    for (page, slot), vec in entries.items():
        pages[page, 0, slot] = vec
    return pages


def _attend(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, *, max_q_len, sm_scale, layer=None, **blocks):
    out = paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_table, jnp.int32), jnp.asarray(cu_q_lens, jnp.int32), layer,
        max_q_len=max_q_len, sm_scale=sm_scale, **blocks)
    return np.asarray(out.astype(jnp.float32))


# --- (a) hand-computed cases ---------------------------------------------------------------------------------------


def test_hand_computed_prefill_two_tokens():
    # One sequence, two new tokens, 1 head, head_dim 2, page_size 2, its page is page 1, sm_scale 1.
    #   k0 = [0, 0], k1 = [1, 0];  v0 = [4, 0], v1 = [0, 8]
    # Query 0 (position 0) sees only key 0: softmax over one score is 1 -> out = v0 = [4, 0], whatever q0 is.
    # Query 1 (position 1), q1 = [ln 3, 0]: scores q1.k0 = 0, q1.k1 = ln 3
    #   -> exp: 1, 3 -> probs 1/4, 3/4 -> out = 1/4 * [4, 0] + 3/4 * [0, 8] = [1, 6].
    k = _pages({(1, 0): [0, 0], (1, 1): [1, 0]}, num_pages=2, page_size=2, head_dim=2, fill=50.0)
    v = _pages({(1, 0): [4, 0], (1, 1): [0, 8]}, num_pages=2, page_size=2, head_dim=2, fill=50.0)
    q = np.array([[[5.0, -7.0]], [[LN3, 0.0]]], np.float32)  # [T=2, N=1, H=2]
    out = _attend(q, k, v, kv_lens=[2], page_table=[[1]], cu_q_lens=[0, 2], max_q_len=2, sm_scale=1.0)
    np.testing.assert_allclose(out[:, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=1e-6, atol=1e-6)


def test_hand_computed_decode_across_pages_with_scale_and_gqa():
    # page_size 1, context of 3 tokens on pages [3, 1, 2] (out of order); the null page 0 and nothing else hold
    # garbage. 2 query heads share 1 kv head (GQA group 2); sm_scale 0.5; one decode token at position 2.
    #   k = [0, 0], [2 ln 3, 0], [0, 2 ln 3]  (positions 0, 1, 2);  v = [6, 0], [0, 6], [3, 3]
    # head 0, q = [1, 0]: scaled scores 0.5 * [0, 2 ln 3, 0] = [0, ln 3, 0] -> exp 1, 3, 1 -> probs 1/5, 3/5, 1/5
    #   -> out = [6/5, 0] + [0, 18/5] + [3/5, 3/5] = [9/5, 21/5] = [1.8, 4.2]
    # head 1, q = [0, 0]: all scores 0 -> uniform 1/3 -> out = [(6 + 0 + 3) / 3, (0 + 6 + 3) / 3] = [3, 3]
    k = _pages({(3, 0): [0, 0], (1, 0): [2 * LN3, 0], (2, 0): [0, 2 * LN3]}, 4, 1, 2)
    v = _pages({(3, 0): [6, 0], (1, 0): [0, 6], (2, 0): [3, 3]}, 4, 1, 2)
    k[0], v[0] = 99.0, 99.0
    q = np.array([[[1.0, 0.0], [0.0, 0.0]]], np.float32)  # [T=1, N=2, H=2]
    out = _attend(q, k, v, kv_lens=[3], page_table=[[3, 1, 2, 0]], cu_q_lens=[0, 1], max_q_len=1, sm_scale=0.5)
    np.testing.assert_allclose(out[0], [[1.8, 4.2], [3.0, 3.0]], rtol=1e-6, atol=1e-6)


def test_hand_computed_two_sequences_and_padding_rows():
    # Sequence 0: one decode token over a 2-token context on page 2 (page_size 2); sequence 1: one new token, no
    # cached context, on page 1. Row 2 is padding (past cu_q_lens[-1]) and must come out 0.
    #   seq 0: k = [0, 0], [ln 3, 0]; v = [8, 0], [0, 4]; q = [1, 0], sm_scale 1
    #     scores 0, ln 3 -> probs 1/4, 3/4 -> out = [2, 0] + [0, 3] = [2, 3]
    #   seq 1: a single visible key -> out = its value [-1, 5]
    k = _pages({(2, 0): [0, 0], (2, 1): [LN3, 0], (1, 0): [7, 7]}, 3, 2, 2, fill=-30.0)
    v = _pages({(2, 0): [8, 0], (2, 1): [0, 4], (1, 0): [-1, 5]}, 3, 2, 2, fill=-30.0)
    q = np.array([[[1.0, 0.0]], [[0.3, 0.2]], [[1.0, 1.0]]], np.float32)
    out = _attend(q, k, v, kv_lens=[2, 1], page_table=[[2], [1]], cu_q_lens=[0, 1, 2], max_q_len=1, sm_scale=1.0)
    np.testing.assert_allclose(out[:, 0], [[2.0, 3.0], [-1.0, 5.0], [0.0, 0.0]], rtol=1e-6, atol=1e-6)


# --- (b) against dense causal attention ----------------------------------------------------------------------------

PAGE_SIZE = 4
NUM_KV_HEADS = 2
HEAD_DIM = 8
# (new tokens, cached-context tokens) per sequence: decodes, prefills of page_size - 1 / page_size / page_size + 1
# tokens, with and without cached context, chunks that start mid-page and cross page boundaries.
SEQS = [(1, 0), (5, 0), (PAGE_SIZE - 1, 6), (PAGE_SIZE, 0), (PAGE_SIZE + 1, 2 * PAGE_SIZE), (1, 3 * PAGE_SIZE - 1),
        (PAGE_SIZE, PAGE_SIZE)]
MAX_PAGES = 4  # per sequence; the longest context is 2 * 4 + 5 = 13 tokens -> 4 pages


def _dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float) -> np.ndarray:
    """q[q_len, N, H] are the newest q_len of the kv_len tokens in k, v [kv_len, K, H]; returns [q_len, N, H]."""
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, np.float64)
    for j in range(q_len):
        pos = kv_len - q_len + j
        for n in range(num_heads):
            kk, vv = k[: pos + 1, n // group].astype(np.float64), v[: pos + 1, n // group].astype(np.float64)
            s = kk @ q[j, n].astype(np.float64) * sm_scale
            p = np.exp(s - s.max())
            out[j, n] = (p / p.sum()) @ vv
    return out


def _ragged_case(group: int, seed: int):
    """Random ragged batch: contiguous per-sequence K/V scattered into shuffled pages of a garbage-filled cache."""
    rng = np.random.default_rng(seed)
    num_heads = NUM_KV_HEADS * group
    num_pages = 1 + len(SEQS) * MAX_PAGES + 3  # null page + spare pages that nothing uses
    # Unused slots hold large finite garbage: any leak through the mask changes the result visibly.
    k_pages = rng.normal(0, 30, (num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
    v_pages = rng.normal(0, 30, (num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    num_seqs_pad = len(SEQS) + 1  # one trailing padding sequence (kv_len 0, null pages)
    page_table = np.zeros((num_seqs_pad, MAX_PAGES), np.int32)
    kv_lens = np.zeros(num_seqs_pad, np.int32)
    cu_q_lens = np.zeros(num_seqs_pad + 1, np.int32)
    qs, ks, vs = [], [], []
    for b, (q_len, ctx) in enumerate(SEQS):
        kv_len = ctx + q_len
        n_pages = -(-kv_len // PAGE_SIZE)
        page_table[b, :n_pages] = [free.pop() for _ in range(n_pages)]
        k = rng.normal(size=(kv_len, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.normal(size=(kv_len, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        for pos in range(kv_len):
            k_pages[page_table[b, pos // PAGE_SIZE], :, pos % PAGE_SIZE] = k[pos]
            v_pages[page_table[b, pos // PAGE_SIZE], :, pos % PAGE_SIZE] = v[pos]
        qs.append(rng.normal(size=(q_len, num_heads, HEAD_DIM)).astype(np.float32))
        ks.append(k)
        vs.append(v)
        kv_lens[b] = kv_len
        cu_q_lens[b + 1] = cu_q_lens[b] + q_len
    cu_q_lens[-1] = cu_q_lens[-2]
    num_tokens = int(cu_q_lens[-1])
    q = np.concatenate(qs + [rng.normal(size=(3, num_heads, HEAD_DIM)).astype(np.float32)])  # 3 padding rows
    return q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, (qs, ks, vs), num_tokens


# Below SPLIT_MIN_Q_LEN every sequence's query rows run in one batched pass; from it on (a step with prefill
# chunks) the first rows run batched and each sequence with more rows runs on its own.
MAX_Q_LENS = [8, SPLIT_MIN_Q_LEN]  # 8 sequences x 16 slots >= SPLIT_MIN_WASTE x 25 rows: split


@pytest.mark.parametrize("max_q_len", MAX_Q_LENS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_matches_dense_causal_attention_on_ragged_batch(group, dtype, max_q_len):
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, (qs, ks, vs), num_tokens = _ragged_case(group, seed=group)
    sm_scale = HEAD_DIM**-0.5
    if dtype == "bfloat16":
        bf16 = ml_dtypes.bfloat16
        # The reference sees the same bf16-rounded inputs the kernel gets.
        q, k_pages, v_pages = (a.astype(bf16) for a in (q, k_pages, v_pages))
        qs = [a.astype(bf16).astype(np.float32) for a in qs]
        ks = [a.astype(bf16).astype(np.float32) for a in ks]
        vs = [a.astype(bf16).astype(np.float32) for a in vs]
        # bf16 keeps 8 significant bits: output rounding (2^-9 relative) plus probabilities rounded to bf16
        # before the PV product; |v| ~ 1, so a few 1e-2 absolute covers it with margin.
        tol = dict(rtol=2e-2, atol=3e-2)
    else:
        tol = dict(rtol=1e-5, atol=1e-5)
    # max_q_len is a static bound above the longest run (5): the kernel must mask the extra query slots
    out = _attend(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=max_q_len, sm_scale=sm_scale)
    assert out.shape == q.shape
    for b in range(len(SEQS)):
        expected = _dense_attention(qs[b], ks[b], vs[b], sm_scale)
        np.testing.assert_allclose(out[cu_q_lens[b]: cu_q_lens[b + 1]], expected, **tol,
                                   err_msg=f"sequence {b} (q_len, ctx) = {SEQS[b]}")
    np.testing.assert_array_equal(out[num_tokens:], 0.0)  # padding rows


# Tiles of 1-3 query rows and KV blocks of 1-2 pages: every sequence spans several blocks, tiles skip blocks past
# their causal end, and the online softmax merges blocks (the defaults put these small cases in one block).
BLOCKINGS = [dict(block_q=1, block_kv_tokens=PAGE_SIZE), dict(block_q=3, block_kv_tokens=PAGE_SIZE),
             dict(block_q=2, block_kv_tokens=2 * PAGE_SIZE)]


@pytest.mark.parametrize("max_q_len", MAX_Q_LENS)
@pytest.mark.parametrize("blocks", BLOCKINGS, ids=lambda b: f"q{b['block_q']}-kv{b['block_kv_tokens']}")
def test_blocked_online_softmax_matches_dense_attention(blocks, max_q_len):
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, (qs, ks, vs), num_tokens = _ragged_case(3, seed=11)
    sm_scale = HEAD_DIM**-0.5
    out = _attend(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=max_q_len, sm_scale=sm_scale,
                  **blocks)
    for b in range(len(SEQS)):
        np.testing.assert_allclose(out[cu_q_lens[b]: cu_q_lens[b + 1]], _dense_attention(qs[b], ks[b], vs[b], sm_scale),
                                   rtol=1e-5, atol=1e-5, err_msg=f"sequence {b} (q_len, ctx) = {SEQS[b]}")
    np.testing.assert_array_equal(out[num_tokens:], 0.0)


@pytest.mark.parametrize("blocks", BLOCKINGS, ids=lambda b: f"q{b['block_q']}-kv{b['block_kv_tokens']}")
def test_blocking_leaves_window_and_soft_cap_unchanged(blocks):
    # Sliding windows make tiles start past block 0; the soft cap acts on every block's scores.
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, _, _ = _ragged_case(2, seed=12)
    args = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv_lens),
            jnp.asarray(page_table), jnp.asarray(cu_q_lens))
    kw = dict(sm_scale=HEAD_DIM**-0.5, sliding_window=3, soft_cap=2.0)
    one_block = paged_attention_reference(*args, **kw, max_q_len=8, block_q=8, block_kv_tokens=MAX_PAGES * PAGE_SIZE)
    for max_q_len in MAX_Q_LENS:  # the batched and the per-sequence passes agree
        np.testing.assert_allclose(paged_attention_reference(*args, **kw, max_q_len=max_q_len, **blocks), one_block,
                                   rtol=1e-5, atol=1e-5, err_msg=f"{max_q_len=}")


def test_stacked_cache_equals_single_layer():
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, _, _ = _ragged_case(group=2, seed=7)
    rng = np.random.default_rng(8)
    num_layers = 3
    k_all = rng.normal(size=(num_layers, *k_pages.shape)).astype(np.float32)
    v_all = rng.normal(size=(num_layers, *v_pages.shape)).astype(np.float32)
    k_all[1], v_all[1] = k_pages, v_pages
    args = (kv_lens, page_table, cu_q_lens)
    kw = dict(max_q_len=8, sm_scale=HEAD_DIM**-0.5)
    single = _attend(q, k_pages, v_pages, *args, **kw)
    np.testing.assert_array_equal(_attend(q, k_all, v_all, *args, layer=1, **kw), single)
    np.testing.assert_array_equal(_attend(q, k_all, v_all, *args, layer=jnp.int32(1), **kw), single)
    other = _attend(q, k_all[2], v_all[2], *args, **kw)
    np.testing.assert_array_equal(_attend(q, k_all, v_all, *args, layer=2, **kw), other)
    assert not np.allclose(single, other)  # the layer index really selects


def test_layer_index_required_exactly_for_stacked_cache():
    q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, _, _ = _ragged_case(group=1, seed=3)
    with pytest.raises(ValueError, match="layer"):
        _attend(q, k_pages[None], v_pages[None], kv_lens, page_table, cu_q_lens, max_q_len=8, sm_scale=1.0)
    with pytest.raises(ValueError, match="layer"):
        _attend(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, max_q_len=8, sm_scale=1.0, layer=0)


# --- (c) write_kv ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stacked", [False, True])
def test_write_kv_touches_only_addressed_slots(stacked):
    rng = np.random.default_rng(11)
    num_pages, page_size, layers, layer = 6, 4, 3, 2
    shape = (num_pages, NUM_KV_HEADS, page_size, HEAD_DIM)
    if stacked:
        shape = (layers, *shape)
    k_pages = rng.normal(size=shape).astype(np.float32)
    v_pages = rng.normal(size=shape).astype(np.float32)
    # Seven real tokens at distinct addresses across pages (incl. a page's first and last slot), then three
    # padding tokens addressed into the null page 0.
    real = [(3, 0), (3, 1), (5, 3), (1, 2), (2, 0), (4, 3), (5, 0)]
    loc = [p * page_size + s for p, s in real] + [0, 0, 1]
    new_k = rng.normal(size=(len(loc), NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    new_v = rng.normal(size=(len(loc), NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    out_k, out_v = write_kv(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(new_k), jnp.asarray(new_v),
                            jnp.asarray(loc, jnp.int32), layer=layer if stacked else None)
    out_k, out_v = np.array(out_k), np.array(out_v)
    assert out_k.shape == k_pages.shape and out_v.shape == v_pages.shape

    expected_k, expected_v = k_pages.copy(), v_pages.copy()
    ek = expected_k[layer] if stacked else expected_k
    ev = expected_v[layer] if stacked else expected_v
    for t, (p, s) in enumerate(real):
        ek[p, :, s] = new_k[t]
        ev[p, :, s] = new_v[t]
    # The null page takes padding writes: compare everything else exactly.
    if stacked:
        for a in (out_k, out_v, expected_k, expected_v):
            a[layer, 0] = 0.0
    else:
        for a in (out_k, out_v, expected_k, expected_v):
            a[0] = 0.0
    np.testing.assert_array_equal(out_k, expected_k)
    np.testing.assert_array_equal(out_v, expected_v)


def test_write_kv_casts_to_cache_dtype():
    k_pages = jnp.zeros((2, 1, 2, 2), jnp.bfloat16)
    new = jnp.asarray([[[1.0 + 2.0**-12, -3.0]]], jnp.float32)  # rounds to 1.0 in bf16
    out_k, out_v = write_kv(k_pages, k_pages, new, new, jnp.asarray([3], jnp.int32))
    assert out_k.dtype == jnp.bfloat16 and out_v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out_k[1, 0, 1], np.float32), [1.0, -3.0])
