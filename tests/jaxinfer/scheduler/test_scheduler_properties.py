"""Property test: random add / abort / fail / step interleavings keep the page and lifecycle invariants."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig, Sequence, SequenceStatus
from tests.jaxinfer.scheduler.fake_model import EOS_ID, FakeEngine, make_seq, reference_generate

params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 20),
    stop=st.sampled_from([None, ["mm"], ["ii", "Xp"]]),
    stop_token_ids=st.sampled_from([None, [3], [8, 21]]),
    ignore_eos=st.booleans(),
    include_stop_str_in_output=st.booleans(),
)
prompts = st.one_of(st.lists(st.integers(1, 49), min_size=1, max_size=12),  # mostly fits
                    st.lists(st.integers(1, 49), min_size=1, max_size=45))  # may be too long
adds = st.tuples(st.just("add"), prompts, params)
ops = st.one_of(
    adds,
    adds,
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("fail"), st.integers(0, 30)),
)


@st.composite
def setups(draw: st.DrawFn) -> tuple[SchedulerConfig, int]:
    """A config and a page count (null page included) that fits about one 12-token request: preemption is common."""
    cfg = SchedulerConfig(max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(1, 24)),
                          page_size=draw(st.integers(1, 5)), max_model_len=draw(st.integers(2, 40)))
    need = cfg.pages_for(min(12, cfg.max_model_len))
    return cfg, max(2, need + 1 + draw(st.integers(-1, 2)))


def check_invariants(sched: Scheduler, seqs: list[Sequence]) -> None:
    alloc, cfg = sched.allocator, sched.config
    owned = [p for s in seqs for p in s.page_ids]
    assert len(owned) == len(set(owned)), "a page is owned by two sequences"
    assert len(owned) + alloc.num_free_pages == alloc.num_usable_pages
    for p in range(1, alloc.num_pages):
        assert alloc.refcount(p) == (1 if p in set(owned) else 0)
    for s in seqs:
        if s.status is SequenceStatus.RUNNING:
            assert s in sched.running and len(s.page_ids) == cfg.pages_for(s.num_computed_tokens)
        elif s.status is SequenceStatus.WAITING:
            assert s in sched.waiting and not s.page_ids and s.num_computed_tokens == 0
        else:
            assert not s.page_ids and s.finish_reason is not None
    assert sched.num_running + sched.num_waiting == sum(not s.is_finished for s in seqs)
    assert sched.num_running <= cfg.max_num_seqs


@settings(max_examples=200, deadline=None)
@given(setup=setups(), first=st.lists(adds, min_size=1, max_size=6), then=st.lists(ops, max_size=40))
def test_random_interleavings_keep_pages_and_lifecycles_consistent(setup: tuple[SchedulerConfig, int],
                                                                   first: list[tuple], then: list[tuple]) -> None:
    cfg, num_pages = setup
    script = first + then
    sched = Scheduler(cfg, PageAllocator(num_pages), frozenset({EOS_ID}))
    engine = FakeEngine(num_pages, cfg.page_size)
    seqs: list[Sequence] = []
    finishes: dict[int, int] = {}

    def record(finished: list[Sequence]) -> None:
        for s in finished:
            if s.is_finished:
                finishes[s.seq_id] = finishes.get(s.seq_id, 0) + 1

    for op in script:
        if op[0] == "add":
            seq = make_seq(len(seqs), op[1], op[2], arrival_time=float(len(seqs)))
            fits = (len(op[1]) < cfg.max_model_len and
                    cfg.pages_for(min(len(op[1]) + op[2].max_tokens, cfg.max_model_len)) < num_pages)
            try:
                sched.add(seq)
                seqs.append(seq)
                assert fits
            except ValueError:
                assert not fits
        elif op[0] == "step":
            record(engine.step(sched))
        elif seqs:
            seq = seqs[op[1] % len(seqs)]
            live = seq.is_finished is False
            free_before, held = sched.allocator.num_free_pages, len(seq.page_ids)
            event(f"{op[0]} a {seq.status.name.lower()} sequence")
            if op[0] == "abort":
                aborted = sched.abort(seq.request_id)
                assert aborted == ([seq] if live else [])
                record(aborted)
            else:
                sched.fail(seq, "boom")
                if live:
                    record([seq])
            assert sched.allocator.num_free_pages == free_before + held
            assert seq.is_finished and not seq.page_ids
        check_invariants(sched, seqs)

    for _ in range(2000):  # drain: everything left must finish
        if not sched.has_unfinished():
            break
        record(engine.step(sched))
        check_invariants(sched, seqs)
    assert not sched.has_unfinished()
    event(f"sequences: {min(len(seqs), 5)}{'+' if len(seqs) >= 5 else ''}")
    event("preempted" if sched.num_preemptions else "no preemption")
    event("chunked prefill" if engine.stats.num_partial_chunks else "no partial chunk")
    assert finishes == {s.seq_id: 1 for s in seqs}, "every sequence finishes exactly once"
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    for s in seqs:
        if s.finish_reason in ("stop", "length"):
            expected = reference_generate(s.prompt_token_ids, s.params, cfg.max_model_len)
            assert (s.output_token_ids, s.text, s.finish_reason) == \
                (expected.token_ids, expected.text, expected.finish_reason)
