"""Scheduler policy on small hand-traced cases: chunks, pages, preemption, abort/fail, bad input."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig, SequenceStatus
from tests.jaxinfer.scheduler.fake_model import EOS_ID, make_seq

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_model_len=64)


def make_scheduler(num_pages: int = 33, clock=time.perf_counter, **overrides) -> Scheduler:
    return Scheduler(dataclasses.replace(CONFIG, **overrides), PageAllocator(num_pages), frozenset({EOS_ID}), clock)


def step(sched: Scheduler, token: int = 9):
    """Schedules and updates with `token` for every sampling chunk; returns the output."""
    out = sched.schedule()
    sched.update(out, {c.seq.seq_id: token for c in out.chunks if c.samples})
    return out


def describe(out) -> list[tuple[int, list[int], int, int, bool]]:
    return [(c.seq.seq_id, c.token_ids, c.num_computed_tokens, len(c.page_ids), c.samples) for c in out.chunks]


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "page_size", "max_model_len"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_config_rejects_non_positive_integers(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CONFIG, **{field: value})


def test_add_rejects_what_could_never_run() -> None:
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    with pytest.raises(ValueError, match="prompt of 64 tokens does not fit the context of 64"):
        sched.add(make_seq(1, [1] * 64, SamplingParams()))
    with pytest.raises(ValueError, match=r"needs 5 KV pages \(prompt 10 \+ max_tokens 7 tokens\).* has 4"):
        sched.add(make_seq(1, [1] * 10, SamplingParams(max_tokens=7)))  # 17 tokens
    with pytest.raises(ValueError, match="prompt must not be empty"):
        sched.add(make_seq(1, [], SamplingParams()))
    sched.add(make_seq(1, [1] * 10, SamplingParams(max_tokens=6)))  # 16 tokens: exactly 4 pages
    with pytest.raises(ValueError, match="duplicate seq_id 1"):
        sched.add(make_seq(1, [1], SamplingParams()))
    sched.abort("1")
    sched.add(make_seq(1, [1], SamplingParams(max_tokens=1)))  # the id is free again once finished
    assert sched.num_waiting == 1
    capped = make_scheduler(num_pages=5, max_model_len=16)
    capped.add(make_seq(2, [1] * 15, SamplingParams(max_tokens=100)))  # max_model_len caps it at 16 tokens


def test_chunked_prefill_then_decode_allocates_pages_on_demand() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_seq(1, list(range(1, 11)), SamplingParams(max_tokens=5, ignore_eos=True)))
    assert describe(step(sched)) == [(1, [1, 2, 3, 4], 0, 1, False)]
    assert describe(step(sched)) == [(1, [5, 6, 7, 8], 4, 2, False)]
    out = step(sched, token=21)
    assert describe(out) == [(1, [9, 10], 8, 3, True)] and out.num_prefill_tokens == 2
    out = step(sched, token=22)
    assert describe(out) == [(1, [21], 10, 3, True)] and (out.num_decode_seqs, out.num_prefill_tokens) == (1, 0)
    assert describe(step(sched, token=23)) == [(1, [22], 11, 3, True)]
    assert describe(step(sched, token=24)) == [(1, [23], 12, 4, True)]  # position 12 opens the 4th page
    (seq,) = sched.running
    assert seq.output_token_ids == [21, 22, 23, 24] and sched.allocator.num_used_pages == 4
    step(sched)
    assert seq.finish_reason == "length" and seq.output_token_ids == [21, 22, 23, 24, 9]
    assert sched.allocator.num_used_pages == 0 and not sched.has_unfinished()


def test_decodes_go_first_and_prefills_share_the_rest_of_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_seq(1, [1, 2], SamplingParams(ignore_eos=True)))
    step(sched)
    sched.add(make_seq(2, list(range(1, 21)), SamplingParams()))
    sched.add(make_seq(3, [5], SamplingParams()))
    out = step(sched)
    assert describe(out) == [(1, [9], 2, 1, True), (2, list(range(1, 8)), 0, 2, False)]
    out = step(sched)  # seq 2 keeps its place ahead of seq 3 (FCFS)
    assert describe(out) == [(1, [9], 3, 1, True), (2, list(range(8, 15)), 7, 4, False)]


def test_max_num_seqs_caps_admission() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, [1, 2], SamplingParams()))
    out = step(sched)
    assert [c.seq.seq_id for c in out.chunks] == [0, 1] and sched.num_waiting == 1


def test_chunk_shrinks_to_the_free_pages() -> None:
    sched = make_scheduler(num_pages=4, max_model_len=12)  # 3 usable pages
    sched.add(make_seq(1, [1] * 6, SamplingParams(max_tokens=2)))  # 2 pages: 1 left
    sched.add(make_seq(2, [2] * 9, SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert describe(out) == [(1, [1] * 6, 0, 2, True), (2, [2] * 4, 0, 1, False)]


def test_out_of_pages_preempts_the_newest_and_it_resumes_by_recompute() -> None:
    # 3 usable pages of 2 tokens. Seq 1: prompt 3 (2 pages); seq 2 arrives later: prompt 1 (1 page); seq 3 waits
    # for a sequence slot.
    sched = make_scheduler(num_pages=4, page_size=2, max_model_len=8, max_num_seqs=2)
    one = make_seq(1, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0)
    two = make_seq(2, [4], SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=1.0)
    three = make_seq(3, [5], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=2.0)
    for seq in (one, two, three):
        sched.add(seq)
    step(sched, token=10)
    step(sched, token=11)  # seq 1 writes position 3 (page 2 of 2), seq 2 position 1
    assert sched.allocator.num_free_pages == 0
    out = step(sched, token=12)  # seq 1 needs a 3rd page for position 4: seq 2 (newest) goes
    assert describe(out) == [(1, [11], 4, 3, True)] and out.preempted == [two]
    assert (two.status, two.num_computed_tokens, two.page_ids, two.output_token_ids) == \
        (SequenceStatus.WAITING, 0, [], [10, 11])
    assert sched.waiting == [two, three] and sched.num_preemptions == 1 and two.num_preemptions == 1
    assert one.finish_reason == "length" and sched.allocator.num_free_pages == 3
    out = step(sched, token=13)  # seq 2 recomputes prompt + outputs; its next token is output number 3
    assert describe(out) == [(2, [4, 10, 11], 0, 2, True), (3, [5], 0, 1, True)]
    assert two.output_token_ids == [10, 11, 13]


def test_a_decode_that_is_the_newest_preempts_itself() -> None:
    sched = make_scheduler(num_pages=4, page_size=2, max_model_len=8)
    one = make_seq(1, [1, 2], SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    two = make_seq(2, [3, 4], SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=1.0)
    sched.add(one)
    sched.add(two)
    step(sched)  # 1 page each; both now need a 2nd page for position 2
    out = step(sched)
    assert describe(out) == [(1, [9], 2, 2, True)] and out.preempted == [two]
    assert sched.num_preemptions == 1 and sched.waiting == [two]


def test_abort_frees_pages_at_once_even_between_schedule_and_update() -> None:
    sched = make_scheduler()
    a = make_seq(1, [1, 2, 3], SamplingParams(), request_id="r")
    b = make_seq(2, [1, 2, 3], SamplingParams(), request_id="r")
    c = make_seq(3, [4, 5, 6, 7, 8], SamplingParams(), request_id="other")
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    used = sched.allocator.num_used_pages
    assert sched.abort("r") == [a, b]
    assert sched.allocator.num_used_pages == used - 2
    assert (a.status, a.finish_reason, b.status) == (SequenceStatus.FINISHED_ABORTED, "abort",
                                                      SequenceStatus.FINISHED_ABORTED)
    produced = sched.update(out, {c.seq.seq_id: 9 for c in out.chunks if c.samples})
    assert produced == [c] and a.output_token_ids == [] and a.num_computed_tokens == 0
    assert sched.abort("r") == [] and sched.abort("nope") == []


def test_abort_of_a_waiting_sequence_removes_it_from_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_seq(1, [1], SamplingParams()))
    sched.add(make_seq(2, [1], SamplingParams()))
    step(sched)
    (two,) = sched.abort("2")
    assert two.status is SequenceStatus.FINISHED_ABORTED and sched.num_waiting == 0


def test_fail_isolates_one_sequence() -> None:
    sched = make_scheduler()
    a, b = make_seq(1, [1, 2], SamplingParams()), make_seq(2, [3, 4], SamplingParams())
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.fail(a, "NaN logits")
    assert (a.status, a.finish_reason, a.error, a.page_ids) == (SequenceStatus.FINISHED_ERROR, "error",
                                                                "NaN logits", [])
    sched.fail(a, "again")  # already finished: no change
    assert a.error == "NaN logits" and sched.running == [b] and sched.allocator.num_used_pages == 1


def test_suppressed_token_ids_until_min_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq(1, [1], SamplingParams(min_tokens=2, stop_token_ids=[7, 3]))
    assert sched.suppressed_token_ids(seq) == [EOS_ID, 3, 7]
    seq.output_token_ids.append(5)
    assert sched.suppressed_token_ids(seq) == [EOS_ID, 3, 7]
    seq.output_token_ids.append(5)
    assert sched.suppressed_token_ids(seq) == []
    ignoring = make_seq(2, [1], SamplingParams(min_tokens=1, ignore_eos=True))
    assert sched.suppressed_token_ids(ignoring) == []


def test_update_rejects_a_missing_token_or_a_stale_output_and_changes_nothing() -> None:
    sched = make_scheduler()
    seq = make_seq(1, [1, 2], SamplingParams())
    sched.add(seq)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for sequence 1"):
        sched.update(out, {})
    assert seq.num_computed_tokens == 0
    sched.update(out, {1: 5})
    with pytest.raises(ValueError, match="stale output"):
        sched.update(out, {1: 5})
    assert seq.output_token_ids == [5]


def test_update_returns_the_sequences_that_got_a_token() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_seq(1, [1] * 3, SamplingParams()))
    sched.add(make_seq(2, [1] * 6, SamplingParams()))
    out = sched.schedule()
    produced = sched.update(out, {1: EOS_ID})
    assert [s.seq_id for s in produced] == [1] and produced[0].finish_reason == "stop"
    assert sched.num_running == 1


def test_times_come_from_the_clock_and_survive_preemption() -> None:
    ticks = itertools.count(100)
    sched = make_scheduler(num_pages=4, page_size=2, max_model_len=8, clock=lambda: float(next(ticks)))
    one = make_seq(1, [1, 2], SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    two = make_seq(2, [3, 4], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=1.0)
    sched.add(one)
    sched.add(two)
    step(sched)  # schedule at 100, update at 101
    assert (one.first_scheduled_time, one.first_token_time, two.first_token_time) == (100.0, 101.0, 101.0)
    assert (one.last_token_time, two.last_token_time) == (101.0, 101.0)
    out = step(sched)  # two preempts itself at 102; one samples at 103
    assert out.preempted == [two] and one.first_token_time == 101.0
    assert (one.last_token_time, two.last_token_time) == (103.0, 101.0)  # a preempted sequence keeps its own
    step(sched)  # 104, 105: one's 3rd token; two is readmitted with the 2 tokens its 1 free page holds
    assert (two.first_scheduled_time, two.first_token_time, two.finish_time) == (100.0, 101.0, None)
    step(sched)  # 106, 107: one needs that page back (two is preempted again) and finishes (4 tokens)
    assert one.finish_time == one.last_token_time == 107.0 and one.finish_reason == "length"
    assert two.num_preemptions == 2
    step(sched)  # 108, 109: two recomputes and samples its 2nd and last token
    assert (two.first_token_time, two.finish_time, two.output_token_ids) == (101.0, 109.0, [9, 9])
    assert two.last_token_time == 109.0


def test_parallel_samples_share_the_prompt_pages_of_sample_0() -> None:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.scheduler.page_allocator import PageAllocator
    from jaxinfer.scheduler import Scheduler, SchedulerConfig
    from jaxinfer.scheduler.sequence import Sequence

    class Detok:
        def step(self, token_id: int) -> str:
            return "x"

        def flush(self) -> str:
            return ""

    page_size, prompt = 4, list(range(3, 14))  # 11 tokens: pages [0-3], [4-7] full, [8-10] partial
    allocator = PageAllocator(40)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=page_size,
                                      max_model_len=64), allocator, eos_ids=frozenset())
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1)
    seqs = [Sequence(seq_id=i, request_id="r", prompt_token_ids=list(prompt), params=params, seed=1,
                     detokenizer=Detok(), arrival_time=0.0, sample_index=i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [0]  # samples 1, 2 wait for sample 0's prompt
    sched.update(first, {0: 5})
    second = sched.schedule()
    by_id = {c.seq.seq_id: c for c in second.chunks}
    # Samples 1 and 2 start on sample 0's two full prompt pages and compute only the last 3 prompt tokens.
    for i in (1, 2):
        assert by_id[i].num_computed_tokens == 8 and by_id[i].token_ids == prompt[8:]
        assert by_id[i].page_ids[:2] == seqs[0].page_ids[:2]
        assert by_id[i].page_ids[2] not in seqs[0].page_ids
    assert all(allocator.refcount(p) == 3 for p in seqs[0].page_ids[:2])
    assert sched.num_shared_prompt_pages == 4
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {c.seq.seq_id: 7 for c in out.chunks if c.samples})
    assert allocator.num_free_pages == allocator.num_usable_pages
