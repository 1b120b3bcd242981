"""Prefix caching in the scheduler (no jax): the cache index, eviction, the host tier, copy-on-write, and the
scheduler driven by the fake model over a fake KV cache whose every slot records which prefix wrote it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig, Sequence
from jaxinfer.scheduler.prefix_cache import KVOp, KVOpKind, PrefixCache, prefix_page_keys
from tests.jaxinfer.scheduler.fake_model import EOS_ID, make_seq, next_token

PS = 4  # page size of the unit tests


def _cache(num_pages: int = 9, host: int = 0, min_pages: int = 1) -> tuple[PageAllocator, PrefixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, PrefixCache(alloc, PS, host_capacity_pages=host, host_min_pages=min_pages)


def _fill(alloc: PageAllocator, cache: PrefixCache, tokens: list[int], salt: str | None = None) -> list[int]:
    """Allocates pages for `tokens` (full pages only) and registers them as one sequence would."""
    pages = alloc.allocate(len(tokens) // PS)
    parent = None
    for i, page in enumerate(pages):
        parent = cache.register(page, parent, tokens[i * PS : (i + 1) * PS], salt)
    return pages


# --- the index --------------------------------------------------------------------------------------------------


def test_match_is_the_longest_run_of_exactly_equal_pages():
    alloc, cache = _cache()
    pages = _fill(alloc, cache, list(range(12)))
    assert [e.page for e in cache.match(list(range(12)), None, 3)] == pages
    assert [e.page for e in cache.match(list(range(12)) + [99], None, 3)] == pages
    assert [e.page for e in cache.match(list(range(8)) + [0, 9, 10, 11], None, 3)] == pages[:2]  # 3rd page differs
    assert cache.match([1, 0, 2, 3] + list(range(4, 12)), None, 3) == []  # first page differs: nothing after it
    assert len(cache.match(list(range(12)), None, 2)) == 2  # capped
    assert cache.match(list(range(7)), None, 3)[-1].page == pages[0]  # 7 tokens hold one full page


def test_salts_never_share():
    alloc, cache = _cache()
    _fill(alloc, cache, list(range(8)), salt="a")
    assert len(cache.match(list(range(8)), "a", 2)) == 2
    assert cache.match(list(range(8)), "b", 2) == []
    assert cache.match(list(range(8)), None, 2) == []


def test_prefix_page_keys_are_the_keys_the_cache_indexes_pages_by():
    """The chain a router computes away from the cache (`jaxinfer.cluster`) names the cache's own entries."""
    alloc, cache = _cache()
    tokens = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # two full pages and three tokens
    for salt in (None, "tenant"):
        _fill(alloc, cache, tokens, salt)
        entries = cache.match(tokens, salt, 3)
        assert prefix_page_keys(tokens, salt, PS) == [e.key for e in entries] and len(entries) == 2
    assert prefix_page_keys(tokens, None, PS) != prefix_page_keys(tokens, "tenant", PS)
    assert prefix_page_keys(tokens[:3], None, PS) == []
    assert prefix_page_keys([0] * 4 + tokens[4:], None, PS)[1] != prefix_page_keys(tokens, None, PS)[1]  # chained


def test_a_hash_collision_is_never_a_hit(monkeypatch):
    """Every key collides: matching still compares token ids, salt and the parent entry."""
    monkeypatch.setattr(PrefixCache, "_key", staticmethod(lambda parent, tokens, salt: 7))
    alloc, cache = _cache()
    a = _fill(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = _fill(alloc, cache, [9, 9, 9, 9, 5, 6, 7, 8])  # same second page after a different first page
    assert [e.page for e in cache.match([9, 9, 9, 9, 5, 6, 7, 8], None, 2)] == b
    assert [e.page for e in cache.match([1, 2, 3, 4, 5, 6, 7, 8], None, 2)] == a
    assert cache.match([5, 6, 7, 8, 5, 6, 7, 8], None, 2) == []
    assert len(cache.match([1, 2, 3, 4, 5, 6, 7, 8], "salt", 2)) == 0


def test_registering_a_prefix_twice_keeps_the_first_copy():
    alloc, cache = _cache()
    first = _fill(alloc, cache, list(range(8)))
    second = _fill(alloc, cache, list(range(8)))
    assert [e.page for e in cache.match(list(range(8)), None, 2)] == first
    assert not any(cache.is_cached_page(p) for p in second)
    alloc.free(second)  # uncached pages go straight back to the free list
    assert alloc.num_evictable_pages == 0


# --- eviction and the host tier -----------------------------------------------------------------------------------


def test_cached_pages_survive_until_the_free_list_runs_out_then_go_least_recently_freed_first():
    alloc, cache = _cache(num_pages=7)  # 6 usable pages
    a = _fill(alloc, cache, list(range(8)))  # 2 pages
    b = _fill(alloc, cache, list(range(100, 108)))  # 2 pages
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free_pages == 6 and alloc.num_evictable_pages == 4
    assert alloc.allocate(2) and alloc.num_evictions == 0  # the 2 plain free pages first
    assert len(cache.match(list(range(8)), None, 2)) == 2
    alloc.allocate(1)  # evicts a's first page (freed first)
    assert alloc.num_evictions == 1 and cache.match(list(range(8)), None, 2) == []
    assert len(cache.match(list(range(100, 108)), None, 2)) == 2


def test_a_hit_on_an_unowned_page_revives_it_and_an_owned_page_is_shared():
    alloc, cache = _cache()
    pages = _fill(alloc, cache, list(range(8)))
    alloc.free(pages[1:])  # page 0 still owned, page 1 evictable
    got = cache.acquire(list(range(8)), None, 2)
    assert [e.page for e in got] == pages
    assert alloc.refcount(pages[0]) == 2 and alloc.refcount(pages[1]) == 1 and alloc.num_evictable_pages == 0


def test_host_tier_offloads_on_eviction_loads_on_a_hit_and_drops_when_full():
    alloc, cache = _cache(num_pages=3, host=1)  # 2 usable device pages, 1 host page
    a = _fill(alloc, cache, [1, 2, 3, 4])
    alloc.free(a)
    b = _fill(alloc, cache, [5, 6, 7, 8])
    alloc.free(b)
    taken = alloc.allocate(2)  # evicts both: a goes to the host, then b pushes a out of the full host tier
    ops = cache.take_ops()
    ea, eb = ops[0].dst, ops[1].dst
    assert ops == [KVOp(KVOpKind.OFFLOAD, a[0], ea), KVOp(KVOpKind.OFFLOAD, b[0], eb), KVOp(KVOpKind.DROP, ea)]
    assert cache.num_host_pages == 1 and cache.match([1, 2, 3, 4], None, 1) == []
    assert len(cache.match([5, 6, 7, 8], None, 1)) == 1  # still findable on the host
    alloc.free(taken[:1])  # one device page comes back (uncached: a plain free page)
    got = cache.acquire([5, 6, 7, 8, 9], None, 1)
    assert got[0].page == taken[0] and cache.take_ops() == [KVOp(KVOpKind.LOAD, eb, taken[0])]
    assert cache.num_host_pages == 0 and cache.stats.host_hit_pages == 1 and cache.is_cached_page(taken[0])


def test_host_runs_shorter_than_the_threshold_are_recomputed():
    alloc, cache = _cache(num_pages=5, host=4, min_pages=2)
    pages = _fill(alloc, cache, list(range(8)))
    alloc.free(list(reversed(pages)))
    alloc.allocate(4)  # evicts the second page (freed first), then the first
    alloc.free([1, 2, 3, 4])
    assert cache.num_host_pages == 2
    assert cache.acquire(list(range(4)) + [50], None, 1) == []  # one host page < 2: recompute it
    assert cache.num_host_pages == 2
    assert len(cache.acquire(list(range(8)) + [50], None, 2)) == 2  # two host pages: load them


def test_reset_forgets_everything():
    alloc, cache = _cache(num_pages=4, host=2)
    pages = _fill(alloc, cache, list(range(12)))
    alloc.free(pages)
    alloc.allocate(1)
    cache.take_ops()
    cache.reset()
    assert cache.match(list(range(12)), None, 3) == []
    assert alloc.num_evictable_pages == 0 and cache.num_cached_pages == 0 and cache.num_host_pages == 0
    assert [op.kind for op in cache.take_ops()] == [KVOpKind.DROP]


# --- the scheduler over a fake KV cache that records who wrote each slot ----------------------------------------


class PrefixFakeEngine:
    """Runs a `Scheduler` with the fake model. Slot (page, offset) of the fake cache holds what real K/V would
    depend on: the salt and every token up to that position. Before each chunk runs, every cached position it
    attends to must hold its own (salt, prefix): a sequence can never read K/V written for another prefix."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.ps = scheduler.config.page_size
        self.cache: dict[tuple[int, int], tuple] = {}
        self.host: dict[int, dict[int, tuple]] = {}

    def _page(self, page: int) -> dict[int, tuple]:
        return {o: self.cache[(page, o)] for o in range(self.ps) if (page, o) in self.cache}

    def _set_page(self, page: int, content: dict[int, tuple]) -> None:
        for o in range(self.ps):
            self.cache.pop((page, o), None)
        for o, v in content.items():
            self.cache[(page, o)] = v

    def step(self) -> None:
        s, ps = self.s, self.ps
        out = s.schedule()
        for op in out.kv_ops:
            if op.kind is KVOpKind.OFFLOAD:
                self.host[op.dst] = self._page(op.src)
            elif op.kind is KVOpKind.LOAD:
                self._set_page(op.dst, self.host.pop(op.src))
            elif op.kind is KVOpKind.COPY:
                self._set_page(op.dst, self._page(op.src))
            else:
                del self.host[op.src]
        sampled = {}
        for ch in out.chunks:
            seq, tokens = ch.seq, ch.seq.token_ids
            for p in range(ch.num_computed_tokens):  # what attention reads
                got = self.cache.get((ch.page_ids[p // ps], p % ps))
                assert got == (seq.cache_salt, tuple(tokens[: p + 1])), \
                    f"sequence {seq.seq_id} would read K/V of another prefix at position {p}"
            for i in range(len(ch.token_ids)):
                p = ch.num_computed_tokens + i
                self.cache[(ch.page_ids[p // ps], p % ps)] = (seq.cache_salt, tuple(tokens[: p + 1]))
            if ch.samples:
                sampled[seq.seq_id] = next_token(tokens, s.suppressed_token_ids(seq))
        s.update(out, sampled)
        self.check_accounting()

    def check_accounting(self) -> None:
        """Every page is owned, plain free, or evictable-and-cached, exactly once; refcounts equal the owners."""
        s, alloc, cache = self.s, self.s.allocator, self.s.prefix_cache
        owners = [0] * alloc.num_pages
        for seq in s.running + s.waiting:
            for page in seq.page_ids:
                owners[page] += 1
        free, evictable = list(alloc._free), list(alloc._evictable)
        assert len(free) + len(evictable) == alloc.num_free_pages
        assert len(set(free) | set(evictable)) == len(free) + len(evictable)  # disjoint, no duplicates
        for page in range(1, alloc.num_pages):
            assert alloc.refcount(page) == owners[page], page
            assert (owners[page] > 0) + (page in set(free)) + (page in alloc._evictable) == 1, page
            if page in alloc._evictable:
                assert cache is not None and cache.is_cached_page(page)
        if cache is not None:
            for page, entry in cache._on_device.items():
                assert entry.page == page and not entry.on_host and (owners[page] or page in alloc._evictable)
            pending_drops = {op.src for op in cache._ops if op.kind is KVOpKind.DROP}  # from `update`, run next step
            assert set(self.host) - pending_drops == {e.uid for e in cache.host_entries()}
            assert cache.num_host_pages <= cache.host_capacity_pages


def _run(requests, arrivals, *, prefix: bool, num_pages: int, page_size: int, host: int = 0, min_pages: int = 1,
         budget: int = 64) -> tuple[list[Sequence], Scheduler]:
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, page_size=page_size, max_model_len=64)
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, page_size, host_capacity_pages=host, host_min_pages=min_pages) if prefix else None
    sched = Scheduler(cfg, alloc, frozenset({EOS_ID}), prefix_cache=cache)
    engine = PrefixFakeEngine(sched)
    seqs = []
    for i, (prompt, params, salt) in enumerate(requests):
        seq = make_seq(i, prompt, params, arrival_time=float(i))
        seq.cache_salt = salt
        seqs.append(seq)
    by_step: dict[int, list[Sequence]] = {}
    for seq, at in zip(seqs, arrivals):
        by_step.setdefault(at, []).append(seq)
    step = 0
    while by_step or sched.has_unfinished():
        for seq in by_step.pop(step, []):
            sched.add(seq)
        engine.step()
        step += 1
        assert step < 5000
    assert alloc.num_free_pages == alloc.num_usable_pages
    return seqs, sched


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([2, 4]))
    families = [draw(st.lists(st.integers(1, 9), min_size=0, max_size=14)) for _ in range(3)]
    n = draw(st.integers(2, 9))
    requests, arrivals = [], []
    for _ in range(n):
        prompt = draw(st.sampled_from(families)) + draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
        params = SamplingParams(max_tokens=draw(st.integers(1, 8)), ignore_eos=draw(st.booleans()),
                                stop=draw(st.sampled_from([(), ("ii",)])))
        requests.append((prompt, params, draw(st.sampled_from([None, None, "a"]))))
        arrivals.append(draw(st.integers(0, 6)))
    return dict(requests=requests, arrivals=arrivals, page_size=page_size,
                num_pages=draw(st.integers(16, 40)), host=draw(st.sampled_from([0, 0, 3, 8])),
                min_pages=draw(st.integers(1, 2)), budget=draw(st.sampled_from([3, 8, 64])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_read_only_their_own_prefix_and_match_caching_off(w):
    """Property test over random prompt families, salts, arrivals, small caches (eviction, preemption, the host
    tier) and step budgets (chunked prefill): no sequence reads another prefix's K/V, page accounting stays exact
    after every step, and every output equals the run without prefix caching."""
    kwargs = dict(num_pages=w["num_pages"], page_size=w["page_size"], budget=w["budget"])
    with_cache, sched = _run(w["requests"], w["arrivals"], prefix=True, host=w["host"], min_pages=w["min_pages"],
                             **kwargs)
    without, _ = _run(w["requests"], w["arrivals"], prefix=False, **kwargs)
    assert [(s.output_token_ids, s.finish_reason) for s in with_cache] == \
        [(s.output_token_ids, s.finish_reason) for s in without]


def test_hits_are_counted_exactly_and_copy_on_write_protects_a_fully_cached_page():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # two full pages of 4
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    requests = [(prompt, greedy, None), (prompt, greedy, None), (prompt[:7] + [9], greedy, None),
                (prompt, greedy, "other")]
    seqs, sched = _run(requests, [0, 5, 10, 15], prefix=True, num_pages=20, page_size=4)
    assert [s.num_cached_tokens for s in seqs] == [0, 7, 4, 0]  # all-but-last, one page, another salt
    assert sched.prefix_cache.stats.cow_copies == 1  # the second request's last page was copied, then written
    assert seqs[1].output_token_ids == seqs[0].output_token_ids


def test_a_preempted_sequence_resumes_from_its_cached_pages():
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [([1, 2, 3, 4, 5, 6, 7, 8, 9], greedy, None), ([3, 1, 4, 1, 5, 9, 2, 6, 5], greedy, None)]
    seqs, sched = _run(requests, [0, 0], prefix=True, num_pages=9, page_size=4)
    without, _ = _run(requests, [0, 0], prefix=False, num_pages=9, page_size=4)
    assert sched.num_preemptions > 0
    assert sched.prefix_cache.stats.hit_tokens > 0  # the preempted one took its own pages back
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in without]


@pytest.mark.parametrize("bad", [dict(host_capacity_pages=-1), dict(host_min_pages=0)])
def test_bad_cache_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PrefixCache(PageAllocator(4), 4, **bad)


def test_dataclass_fields_of_sequence_default_to_no_cache():
    seq = make_seq(0, [1, 2], SamplingParams())
    assert seq.cache_salt is None and seq.cached_entries == [] and seq.num_cached_tokens == 0
    assert dataclasses.fields(seq)


def test_the_fake_cache_catches_a_cache_that_ignores_the_salt_or_the_parent(monkeypatch):
    """The checks above can fail: a cache whose lookup forgets the salt, or the parent page, is caught reading
    another prefix's K/V."""
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    same_page_other_salt = [([1, 2, 3, 4, 5], greedy, "a"), ([1, 2, 3, 4, 5], greedy, "b")]
    # The third request's first page is the second's, its second page the first's (after another first page).
    same_page_other_parent = [([1, 2, 3, 4, 5, 6, 7, 8, 9], greedy, None), ([9, 9, 9, 9, 1, 1, 1, 1, 9], greedy, None),
                              ([9, 9, 9, 9, 5, 6, 7, 8, 9], greedy, None)]

    def forgetful(ignore: str):
        def find(self, parent, token_ids, salt):
            for bucket in self._index.values():
                for entry in bucket:
                    if entry.token_ids == token_ids and (ignore == "salt" or entry.salt == salt) and \
                            (ignore == "parent" or entry.parent is parent):
                        return entry
            return None
        return find

    for ignore, requests in (("salt", same_page_other_salt), ("parent", same_page_other_parent)):
        arrivals = [0, 5, 10][: len(requests)]
        _run(requests, arrivals, prefix=True, num_pages=20, page_size=4)  # the real cache is fine
        with monkeypatch.context() as m:
            m.setattr(PrefixCache, "_find", forgetful(ignore))
            with pytest.raises(AssertionError, match="another prefix"):
                _run(requests, arrivals, prefix=True, num_pages=20, page_size=4)


def test_random_workloads_do_hit():
    """The property test's workloads exercise hits, evictions and the host tier (not a vacuous pass)."""
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    system = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = [(system + [i, i + 1, i + 2], greedy, None) for i in range(1, 9)]
    _, sched = _run(requests, [0, 0, 3, 3, 6, 6, 9, 9], prefix=True, num_pages=14, page_size=2, host=6)
    stats = sched.prefix_cache.stats
    assert stats.hit_tokens >= 6 * len(system) // 2 and sched.allocator.num_evictions > 0
    assert stats.offloaded_pages > 0
