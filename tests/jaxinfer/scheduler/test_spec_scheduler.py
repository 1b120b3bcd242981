"""Speculative decoding in the scheduler: draft slots, their caps, emitted blocks, stop rules and page rollback."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig
from jaxinfer.scheduler.prefix_cache import PrefixCache
from tests.jaxinfer.scheduler.fake_model import EOS_ID, make_seq

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64)


def make_scheduler(num_pages: int = 33, prefix_cache: bool = False, **overrides) -> Scheduler:
    allocator = PageAllocator(num_pages)
    cache = PrefixCache(allocator, CONFIG.page_size) if prefix_cache else None
    return Scheduler(dataclasses.replace(CONFIG, **overrides), allocator, frozenset({EOS_ID}), prefix_cache=cache)


def decoding(sched: Scheduler, seq_id: int, prompt_len: int = 6, **params):
    """Adds a sequence and runs its prefill: it is then decoding, with one output token (10)."""
    params.setdefault("ignore_eos", False)
    seq = make_seq(seq_id, list(range(20, 20 + prompt_len)), SamplingParams(**params))
    sched.add(seq)
    while not seq.output_token_ids:  # the prefill, in chunks when the budget is small
        out = sched.schedule()
        sched.update(out, {c.seq.seq_id: 10 for c in out.chunks if c.samples})
    assert seq.is_decoding
    return seq


def test_slots_reserve_pages_and_budget() -> None:
    sched = make_scheduler()
    seq = decoding(sched, 1)  # 7 tokens, 6 computed, 2 pages
    out = sched.schedule({1: 5})
    (chunk,) = out.chunks
    assert (chunk.token_ids, chunk.spec_slots, chunk.samples) == ([10], 5, True)
    assert len(chunk.page_ids) == 3  # positions [0, 6 + 1 + 5) = 12 tokens
    assert (out.num_batched_tokens, out.num_decode_seqs, out.num_spec_slots, out.num_prefill_tokens) == (6, 1, 5, 0)
    assert len(seq.page_ids) == 3


@pytest.mark.parametrize("params, budget, expected", [
    (dict(max_tokens=4), 32, 2),  # 1 output token: the block may produce at most 3 more (2 drafts + 1)
    (dict(min_tokens=4), 32, 2),  # the whole block stays before min_tokens (EOS is banned on all of it)
    (dict(min_tokens=2), 32, 0),  # the next token is the min_tokens-th: no room for a draft before it
    (dict(), 3, 2),  # the token budget
    (dict(), 32, 8),  # as wanted
])
def test_slots_are_capped(params, budget, expected) -> None:
    sched = make_scheduler(max_num_batched_tokens=budget)
    decoding(sched, 1, **params)
    (chunk,) = sched.schedule({1: 8}).chunks
    assert chunk.spec_slots == expected


def test_slots_are_capped_by_context_and_pages_without_preempting() -> None:
    sched = make_scheduler(max_model_len=10)
    decoding(sched, 1)  # 7 tokens of 10: a block may reach 9 tokens + the target's token
    assert sched.schedule({1: 8}).chunks[0].spec_slots == 2
    sched = make_scheduler(num_pages=5)  # 4 usable pages
    a = decoding(sched, 1, max_tokens=10)  # 2 pages
    b = decoding(sched, 2, prompt_len=2, max_tokens=2)  # 1 page
    out = sched.schedule({1: 8})
    # a decoded once more during b's prefill (8 tokens); one free page: 3 pages hold 12 positions
    assert a.num_tokens == 8 and [c.spec_slots for c in out.chunks] == [4, 0] and sched.num_preemptions == 0
    assert not out.preempted and a.status.name == b.status.name == "RUNNING"


def test_each_decode_keeps_a_budget_token() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    decoding(sched, 1)
    decoding(sched, 2)
    out = sched.schedule({1: 8, 2: 8})
    assert [c.spec_slots for c in out.chunks] == [4, 0] and out.num_batched_tokens == 6


def test_update_takes_emitted_block_and_rolls_back_pages() -> None:
    sched = make_scheduler()
    seq = decoding(sched, 1)  # tokens 20..25, 10; 6 computed
    out = sched.schedule({1: 6})
    (chunk,) = out.chunks
    out.chunks = [chunk.with_drafts([11, 12, 13, 14, 15, 16])]
    assert len(seq.page_ids) == 4  # positions [0, 13)
    sched.update(out, {1: [11, 12, 99]})  # two drafts accepted, then the target's own token
    assert seq.output_token_ids == [10, 11, 12, 99]
    assert seq.num_computed_tokens == 9 and seq.is_decoding  # last token 10 and drafts 11, 12 are cached
    assert len(seq.page_ids) == 3 and sched.allocator.num_used_pages == 3  # pages of rejected drafts freed


def test_update_rejects_more_tokens_than_drafts_and_changes_nothing() -> None:
    sched = make_scheduler()
    seq = decoding(sched, 1)
    out = sched.schedule({1: 2})
    out.chunks = [out.chunks[0].with_drafts([11, 12])]
    with pytest.raises(ValueError, match="4 emitted tokens for a chunk with 2 drafts"):
        sched.update(out, {1: [11, 12, 13, 14]})
    assert seq.output_token_ids == [10] and seq.num_computed_tokens == 6
    with pytest.raises(ValueError, match="3 drafts for 2 reserved slots"):
        out.chunks[0].with_drafts([1, 2, 3])


@pytest.mark.parametrize("emitted, params, tokens, reason", [
    ([11, EOS_ID, 13], dict(), [10, 11, EOS_ID], "stop"),  # EOS inside the block: nothing after it
    ([11, 12, 13], dict(stop_token_ids=[12]), [10, 11, 12], "stop"),
    ([11, 12, 13], dict(max_tokens=3), [10, 11, 12], "length"),
])
def test_stop_inside_a_block_ends_there(emitted, params, tokens, reason) -> None:
    sched = make_scheduler()
    seq = decoding(sched, 1, **params)
    out = sched.schedule({1: 2})
    slots = out.chunks[0].spec_slots
    out.chunks = [out.chunks[0].with_drafts(emitted[:slots])]
    sched.update(out, {1: emitted[: slots + 1]})
    assert seq.output_token_ids == tokens and seq.finish_reason == reason
    assert sched.allocator.num_used_pages == 0 and not sched.has_unfinished()


def test_stop_string_inside_a_block() -> None:
    sched = make_scheduler()
    seq = decoding(sched, 1, stop=["m"])  # the toy detokenizer writes "lll" for 11, "m" for 12, "nn" for 13
    out = sched.schedule({1: 3})
    out.chunks = [out.chunks[0].with_drafts([11, 12, 13])]
    sched.update(out, {1: [11, 12, 13, 14]})
    assert seq.output_token_ids == [10, 11, 12] and seq.finish_reason == "stop" and seq.text.endswith("lll")


def test_prefix_cache_registers_only_verified_pages() -> None:
    sched = make_scheduler(prefix_cache=True)
    seq = decoding(sched, 1, prompt_len=7)  # 8 tokens, 7 computed: page 0 cached
    assert sched.prefix_cache.num_cached_pages == 1
    out = sched.schedule({1: 8})
    out.chunks = [out.chunks[0].with_drafts(list(range(11, 19)))]  # positions 7..15 written: pages 1, 2, 3
    sched.update(out, {1: [11, 50]})  # one draft accepted: positions 0..8 valid
    assert seq.num_computed_tokens == 9
    assert sched.prefix_cache.num_cached_pages == 2  # page 1 (positions 4..7) is full and verified; page 2 is not
    assert len(seq.page_ids) == 3  # pages for the 10 tokens


def test_pages_completed_by_accepted_drafts_are_cached_with_their_tokens() -> None:
    sched = make_scheduler(prefix_cache=True)
    seq = decoding(sched, 1, prompt_len=7)  # 8 tokens, 7 computed
    out = sched.schedule({1: 8})
    out.chunks = [out.chunks[0].with_drafts(list(range(11, 19)))]
    sched.update(out, {1: [11, 12, 13, 14, 50]})  # positions 8..11 (page 2) hold accepted drafts 11..14
    assert seq.num_computed_tokens == 12 and sched.prefix_cache.num_cached_pages == 3
    # a later request with the same tokens finds all three pages
    hits = sched.prefix_cache.acquire(seq.token_ids, None, max_pages=3)
    assert [e.page for e in hits] == seq.page_ids[:3]


def test_stop_inside_a_block_caches_only_the_kept_tokens() -> None:
    sched = make_scheduler(prefix_cache=True)
    seq = decoding(sched, 1, prompt_len=7, stop_token_ids=[12])
    out = sched.schedule({1: 8})
    out.chunks = [out.chunks[0].with_drafts(list(range(11, 19)))]
    sched.update(out, {1: [11, 12, 13, 14, 50]})  # stops at 12: 13, 14 are dropped
    assert seq.output_token_ids == [10, 11, 12] and seq.finish_reason == "stop"
    assert seq.num_computed_tokens == seq.num_tokens == 10
    assert sched.prefix_cache.num_cached_pages == 2  # positions 0..7; page 2 would need tokens that were dropped
