"""Prefix caching on the real SmolLM2 (issue 7): every hit is asserted, and tokens equal caching off.

Two float32 engines with the same shapes, loaded once for the module: `on` (prefix caching plus a small host tier)
and `off` (no prefix caching). Every case runs the same requests, in the same batches, on both; the second
request's `num_cached_tokens` must equal the exact number the case means to hit (so a cache that never hits
cannot pass), and every output token must equal the uncached engine's. Greedy and seeded sampling (T=0.8) run
side by side in each batch, on different prompts. A small pool (preemption, eviction to the host tier) is made by
holding pages out of a roomy one (`held_pages`), not by a third model load.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.outputs import RequestOutput
from tests.jaxinfer.engine.test_engine import nan_embedding

pytestmark = pytest.mark.slow

PS = 16  # page size (the default)
PAGE_BYTES = 30 * 2 * 3 * PS * 64 * 4  # SmolLM2 f32: layers x (K, V) x KV heads x page x head dim x 4 bytes
NUM_PAGES = 64
HOST_PAGES = 8
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)

CORPUS = """\
The first bridges were fallen trees laid across streams, and for thousands of years most crossings stayed that
simple: a beam of wood, a slab of stone, a rope of twisted vines. The Romans changed the scale of the problem. Their
engineers learned to build semicircular arches of cut stone that carried their load in compression, and with
concrete made from volcanic ash they set piers in rivers that still stand today. Many of their aqueducts ran for
dozens of kilometres on such arches, falling a few centimetres in every hundred metres so that water would flow by
gravity alone into the public fountains and baths of the city.
After Rome the knowledge did not vanish, but it spread slowly. Medieval builders raised narrow pointed arches over
the rivers of Europe, often with houses, shops and chapels standing on the deck, and tolls paid for their upkeep.
Timber trusses appeared in the mountains, where long spans were needed and stone was hard to haul. In China,
craftsmen built the open spandrel arch at Zhaozhou more than fourteen centuries ago; its light side openings let
flood water pass and saved material, an idea that European builders rediscovered much later.
The industrial revolution brought cast iron, then wrought iron and steel. The iron bridge at Coalbrookdale showed
that metal could be cast into large ribs and joined like timber. Railways demanded bridges that could carry heavy,
moving loads without sagging, and engineers began to calculate forces instead of copying older designs. Tubular
girders, lattice trusses and the great cantilevers of the late nineteenth century followed, each tested by
failures that taught hard lessons about wind, fatigue and the quality of materials.
Suspension bridges hang their deck from cables draped between towers. They can span farther than any other form,
but they are light and flexible, and some early examples twisted themselves apart in steady winds. Modern designs
use stiffening trusses, aerodynamic deck sections and dampers, and they are checked in wind tunnels before a single
cable is spun. Cable stayed bridges, with straight cables running from the towers directly to the deck, have become
the usual choice for medium spans because they are stiff, quick to build and pleasing to the eye.
"""


def _ids(llm: LLM) -> list[int]:
    ids = llm.tokenizer.encode(CORPUS)
    assert len(ids) >= 450, len(ids)  # the tests slice windows up to token 412
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Engines and helpers


def _make(caching: bool) -> LLM:
    extra = {"kv_offload_bytes": HOST_PAGES * PAGE_BYTES} if caching else {}
    llm = LLM(dtype="float32", warmup=False, max_num_seqs=8, max_model_len=512,
              kv_cache_memory_bytes=NUM_PAGES * PAGE_BYTES, enable_prefix_caching=caching, **extra)
    assert llm.page_allocator.num_usable_pages == NUM_PAGES
    assert (llm.engine.prefix_cache is not None) == caching
    if caching:
        assert llm.engine.prefix_cache.host_capacity_pages == HOST_PAGES
    return llm


@pytest.fixture(scope="module")
def on() -> LLM:
    return _make(True)


@pytest.fixture(scope="module")
def off() -> LLM:
    return _make(False)


@pytest.fixture(scope="module")
def corpus(on: LLM) -> list[int]:
    return _ids(on)


@pytest.fixture(autouse=True)
def fresh_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts from an empty prefix cache and leaves both engines idle with every page free."""
    engines = [request.getfixturevalue(n) for n in ("on", "off") if n in request.fixturenames]
    for llm in engines:
        llm.reset_prefix_cache()
    yield
    for llm in engines:
        for seq in llm.engine.scheduler.running + llm.engine.scheduler.waiting:  # a failed test's leftovers
            llm.engine.abort(seq.request_id)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert_idle(llm)


def assert_idle(llm: LLM) -> None:
    """Nothing runs and every page is free (cached pages nobody owns count as free)."""
    alloc = llm.page_allocator
    assert not llm.engine.has_unfinished_requests()
    assert alloc.num_free_pages == alloc.num_usable_pages
    if llm.engine.prefix_cache is not None:
        assert len(llm.runner.kv.host_pages) == llm.engine.prefix_cache.num_host_pages <= HOST_PAGES


def prompt(ids: list[int], salt: str | None = None) -> dict:
    p: dict = {"prompt_token_ids": list(ids)}
    if salt is not None:
        p["cache_salt"] = salt
    return p


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def generate_both(on: LLM, off: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[RequestOutput]:
    """The same batch on both engines; asserts identical tokens (and text) and returns the cached engine's outputs."""
    got = on.generate(prompts, params)
    ref = off.generate(prompts, params)
    assert tokens(got) == tokens(ref)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in ref]
    assert all(o.num_cached_tokens == 0 for o in ref)
    return got


def with_prefix(corpus: list[int], base: list[int], shared: int, length: int, other: int) -> list[int]:
    """`base[:shared]` followed by corpus tokens from `other` on, `length` tokens in all; the first token after the
    shared part differs from base's, so exactly `shared` tokens are shared."""
    tail = corpus[other: other + length - shared]
    assert len(tail) == length - shared
    if shared < len(base):
        assert tail[0] != base[shared]
    return base[:shared] + tail


@contextlib.contextmanager
def held_pages(llm: LLM, keep_free: int) -> Iterator[None]:
    """Takes pages out of the pool so that only `keep_free` stay free: a small KV cache without another load."""
    alloc = llm.page_allocator
    assert alloc.num_evictable_pages == 0  # holding must not evict cached pages (call after a reset)
    held = alloc.allocate(alloc.num_free_pages - keep_free)
    try:
        yield
    finally:
        alloc.free(held)


@contextlib.contextmanager
def batch_budget(llm: LLM, tokens_per_step: int) -> Iterator[None]:
    """Temporarily lowers the engine's max_num_batched_tokens (chunked prefill)."""
    sched = llm.engine.scheduler
    old = sched.config
    sched.config = dataclasses.replace(old, max_num_batched_tokens=tokens_per_step)
    try:
        yield
    finally:
        sched.config = old


@contextlib.contextmanager
def recorded_plans(llm: LLM) -> Iterator[list]:
    """Records every step's plan (`SchedulerOutput`) of the engine while the block runs."""
    sched, plans = llm.engine.scheduler, []
    real = sched.schedule

    def schedule(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    sched.schedule = schedule
    try:
        yield plans
    finally:
        del sched.schedule  # back to the class's method


def drive(llm: LLM, prompts: list[dict], params: list[SamplingParams], check=None) -> list[RequestOutput]:
    """Adds the requests and steps the engine by hand until they finish, calling `check()` after every step."""
    engine = llm.engine
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    for _ in range(2000):
        if len(final) == len(rids):
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check()
    assert len(final) == len(rids), "requests did not finish"
    return [final[r] for r in rids]


# ---------------------------------------------------------------------------------------------------------------
# Sharing with one earlier request: greedy and seeded, token-identical to caching off


# (name, first prompt's length, tokens the second prompt shares with it, second prompt's length, expected hit)
SHARE_CASES = [
    ("one_page", 40, PS, 40, PS),
    ("one_page_plus_one", 40, PS + 1, 40, PS),
    ("one_page_minus_one", 40, PS - 1, 40, 0),
    ("two_pages", 40, 2 * PS, 45, 2 * PS),
    ("whole_prompt", 50, 50, 50, 3 * PS),  # same prompt twice, 50 tokens: 3 full pages cached
    ("whole_prompt_page_multiple", 48, 48, 48, 47),  # all 3 pages cached: the last token is recomputed (COW)
]


@dataclasses.dataclass
class ShareRuns:
    first: list[RequestOutput]  # per case: greedy, seeded
    second: list[RequestOutput]
    cow_copies: int  # copy-on-write copies while the second requests ran
    hit_tokens: int  # prefix-cache hit tokens while the second requests ran


@pytest.fixture(scope="module")
def share_runs(on: LLM, off: LLM, corpus: list[int]) -> ShareRuns:
    """Every case at once: all first requests in one batch; after they finished, all second requests in another.

    Case i's first prompts start at corpus token 10 * i (greedy) and 200 + 10 * i (seeded), so no two cases share
    a first page and every hit comes from the case's own first request. Checked on both engines: same tokens.
    """
    on.reset_prefix_cache()
    firsts, seconds, params = [], [], []
    for i, (_, len_a, shared, len_b, _) in enumerate(SHARE_CASES):
        for j, (start, sp) in enumerate(((10 * i, GREEDY), (200 + 10 * i, SEEDED))):
            a = corpus[start: start + len_a]
            firsts.append(a)
            seconds.append(a if shared == len_a == len_b else
                           with_prefix(corpus, a, shared, len_b, other=320 + 60 * j + 7 * i))
            params.append(sp)
    first = generate_both(on, off, [prompt(p) for p in firsts], params)
    cache = on.engine.prefix_cache
    cow0, hit0 = cache.stats.cow_copies, cache.stats.hit_tokens
    second = generate_both(on, off, [prompt(p) for p in seconds], params)
    return ShareRuns(first, second, cache.stats.cow_copies - cow0, cache.stats.hit_tokens - hit0)


def test_share_cases_hit_in_total(share_runs: ShareRuns) -> None:
    assert [o.num_cached_tokens for o in share_runs.first] == [0] * 2 * len(SHARE_CASES)
    assert share_runs.hit_tokens == sum(2 * c[-1] for c in SHARE_CASES)


@pytest.mark.parametrize("case", SHARE_CASES, ids=[c[0] for c in SHARE_CASES])
def test_second_request_shares_prefix(share_runs: ShareRuns, case: tuple) -> None:
    """Tokens equal caching off (checked in `share_runs`) and the second request hit exactly what it shares."""
    i = SHARE_CASES.index(case)
    _, len_a, shared, len_b, expected = case
    assert [o.num_cached_tokens for o in share_runs.second[2 * i: 2 * i + 2]] == [expected, expected]
    assert [len(o.outputs[0].token_ids) for o in share_runs.second[2 * i: 2 * i + 2]] == [MAX_TOKENS] * 2
    if len_b == shared == len_a and len_b % PS == 0:
        # only this case copies: one copy-on-write of the fully cached last page per request
        assert share_runs.cow_copies == 2


def _stop_string(llm: LLM, token_ids: list[int], text: str, first: int) -> str:
    """A 3-character piece of `text` that starts at token `first` or later and does not occur before it."""
    for k in range(first, len(token_ids)):
        start = len(llm.tokenizer.decode(token_ids[:k]))
        stop = text[start: start + 3]
        if len(stop) == 3 and stop.strip() and text.find(stop) == start:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_second_request_continues_after_stop_string(on: LLM, off: LLM, corpus: list[int]) -> None:
    firsts = [corpus[0:40], corpus[100:140]]
    long = [dataclasses.replace(p, max_tokens=24) for p in (GREEDY, SEEDED)]
    probe = off.generate([prompt(p) for p in firsts], long)
    stops = [_stop_string(off, o.outputs[0].token_ids, o.outputs[0].text, first=10) for o in probe]
    params = [dataclasses.replace(p, stop=[s]) for p, s in zip(long, stops)]
    first = generate_both(on, off, [prompt(p) for p in firsts], params)
    assert [o.outputs[0].finish_reason for o in first] == ["stop", "stop"]
    seconds, expected = [], []
    for i, (a, o) in enumerate(zip(firsts, first)):
        out_ids = o.outputs[0].token_ids
        assert 10 <= len(out_ids) < 24
        seconds.append(a + out_ids + corpus[300 + 30 * i: 310 + 30 * i])
        # K/V exists for the prompt and every output token but the last (sampled, never fed back)
        expected.append((len(a) + len(out_ids) - 1) // PS * PS)
        assert expected[-1] > len(a) // PS * PS  # the hit reaches into pages the first request's decode wrote
    second = generate_both(on, off, [prompt(p) for p in seconds], [GREEDY, SEEDED])
    assert [o.num_cached_tokens for o in second] == expected


# ---------------------------------------------------------------------------------------------------------------
# Preemption and chunked prefill


def _shared_family(corpus: list[int], n: int, shared: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens that share their first `shared` tokens and then differ."""
    return [with_prefix(corpus, corpus[0:shared + 1], shared, length, other=200 + 40 * i) for i in range(n)]


def test_preemption_with_shared_prefixes(on: LLM, off: LLM, corpus: list[int]) -> None:
    family = _shared_family(corpus, 5, shared=40, length=50)  # family[0] first, then 4 at once
    params = [dataclasses.replace(p, max_tokens=24) for p in (GREEDY, SEEDED) * 3]
    before = on.engine.scheduler.num_preemptions
    # 12 pages: the 4 requests need 2 shared + 4 x 3 own pages at their longest (74 tokens)
    with held_pages(on, keep_free=12), held_pages(off, keep_free=12):
        first = generate_both(on, off, [prompt(family[0])], params[:1])
        assert first[0].num_cached_tokens == 0
        rest = generate_both(on, off, [prompt(p) for p in family[1:]], params[1:5])
    assert on.engine.scheduler.num_preemptions > before
    assert [o.num_cached_tokens for o in rest] == [2 * PS] * 4


@pytest.mark.parametrize("budget", [16, 32])
def test_chunked_prefill_with_shared_prefixes(on: LLM, off: LLM, corpus: list[int], budget: int) -> None:
    family = _shared_family(corpus, 4, shared=50, length=100)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    with batch_budget(on, budget), batch_budget(off, budget):
        first = generate_both(on, off, [prompt(family[0])], params[:1])
        with recorded_plans(on) as plans:
            rest = generate_both(on, off, [prompt(p) for p in family[1:]], params[1:])
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [3 * PS] * 3
    # chunked: each second prompt's 52 uncached tokens take several steps, the first chunk starting after the hit
    chunks = [c for plan in plans for c in plan.chunks]
    assert all(plan.num_batched_tokens <= budget for plan in plans)
    assert any(not c.samples and c.num_computed_tokens == 3 * PS for c in chunks)
    assert any(c.samples and c.num_computed_tokens > 3 * PS and len(c.token_ids) > 1 for c in chunks)


def test_chunked_prefill_and_preemption_together(on: LLM, off: LLM, corpus: list[int]) -> None:
    family = _shared_family(corpus, 5, shared=40, length=60)
    params = [dataclasses.replace(p, max_tokens=20) for p in (GREEDY, SEEDED) * 3]
    before = on.engine.scheduler.num_preemptions
    with batch_budget(on, 16), batch_budget(off, 16), held_pages(on, keep_free=11), held_pages(off, keep_free=11):
        generate_both(on, off, [prompt(family[0])], params[:1])
        rest = generate_both(on, off, [prompt(p) for p in family[1:]], params[1:5])
    assert on.engine.scheduler.num_preemptions > before
    assert [o.num_cached_tokens for o in rest] == [2 * PS] * 4


# ---------------------------------------------------------------------------------------------------------------
# cache_salt


def test_cache_salt_separates_and_same_salt_hits(on: LLM, off: LLM, corpus: list[int]) -> None:
    ids = corpus[0:50]
    (first,) = generate_both(on, off, [prompt(ids, "tenant-a")], [GREEDY])
    # tenant-a's 3 pages are cached: other salts (None is one) miss them, tenant-a hits them
    salts = ["tenant-b", None, "tenant-a"]
    second = generate_both(on, off, [prompt(ids, s) for s in salts], [GREEDY] * 3)
    # now each salt has its own pages: all hit, the salt through add_request's keyword too
    third = generate_both(on, off, [prompt(ids, s) for s in salts], [GREEDY] * 3)
    on.engine.add_request(prompt(ids), GREEDY, request_id="kw", cache_salt="tenant-b")
    on.engine.add_request(prompt(ids), GREEDY, request_id="kw-new", cache_salt="tenant-c")
    final = {}
    while on.engine.has_unfinished_requests():
        final.update({o.request_id: o for o in on.engine.step() if o.finished})
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in second] == [0, 0, 3 * PS]
    assert [o.num_cached_tokens for o in third] == [3 * PS] * 3
    assert (final["kw"].num_cached_tokens, final["kw-new"].num_cached_tokens) == (3 * PS, 0)
    assert final["kw"].outputs[0].token_ids == first.outputs[0].token_ids


# ---------------------------------------------------------------------------------------------------------------
# Host tier


def test_host_tier_brings_evicted_prefix_back(on: LLM, off: LLM, corpus: list[int]) -> None:
    cache, runner = on.engine.prefix_cache, on.runner

    def check() -> None:
        assert len(runner.kv.host_pages) == cache.num_host_pages <= cache.host_capacity_pages

    a = corpus[0:60]  # 60 + 8 tokens: 4 full pages cached after it
    t1, t2 = corpus[100:200], corpus[250:350]  # 100 + 8 tokens: 7 pages each, no prefix in common with a
    b = with_prefix(corpus, a, 48, 60, other=400)
    stats0 = on.engine.stats()
    with held_pages(on, keep_free=12), held_pages(off, keep_free=12):
        outs = []
        for p in (a, t1, t2, b):
            (got,) = drive(on, [prompt(p)], [SEEDED], check)
            (ref,) = drive(off, [prompt(p)], [SEEDED])
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids
            outs.append(got)
            if p is t2:  # t2 evicted a's pages (the oldest evictable ones) to the host tier
                on_host = cache.match(b, None, 3)
                assert len(on_host) == 3 and all(e.page is None and e.on_host for e in on_host)
    stats = on.engine.stats()
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 3 * PS]
    assert stats["prefix_cache_host_hits"] - stats0["prefix_cache_host_hits"] == 3
    assert stats["prefix_cache_evictions"] > stats0["prefix_cache_evictions"]
    check()


def test_reset_empties_both_tiers(on: LLM, corpus: list[int]) -> None:
    with held_pages(on, keep_free=12):
        for p in (corpus[0:100], corpus[150:250], corpus[300:400]):  # the later ones evict the earlier
            on.generate([prompt(p)], [GREEDY])
    assert on.engine.prefix_cache.num_host_pages > 0 and len(on.runner.kv.host_pages) > 0
    on.reset_prefix_cache()
    assert on.engine.prefix_cache.num_host_pages == len(on.runner.kv.host_pages) == 0
    assert on.engine.prefix_cache.num_cached_pages == 0
    (out,) = on.generate([prompt(corpus[0:100])], [GREEDY])
    assert out.num_cached_tokens == 0


# ---------------------------------------------------------------------------------------------------------------
# A failing request must not damage the cached pages it only read (last: it poisons the weights for a moment)


def test_failed_request_leaves_shared_cached_pages_intact(on: LLM, off: LLM, corpus: list[int]) -> None:
    """B hits A's 2 cached pages, then fails on a NaN token: C, hitting the same pages next, must still get A's K/V.

    (The engine clears a failed sequence's pages so that no later owner inherits NaN; pages it shared read-only
    from the prefix cache hold valid K/V that other requests read.)
    """
    marker = next(t for t in range(49000, 49152) if t not in corpus)
    a = corpus[0:40]
    bad = corpus[0:2 * PS] + [marker] + corpus[200:207]
    c = with_prefix(corpus, a, 2 * PS, 40, other=300)
    (first,) = on.generate([prompt(a)], [GREEDY])
    with nan_embedding(on.engine, marker):
        (failed,) = on.generate([prompt(bad)], [GREEDY])
    assert failed.num_cached_tokens == 2 * PS
    assert failed.outputs[0].finish_reason == "error"
    (got,) = on.generate([prompt(c)], [GREEDY])
    (ref,) = off.generate([prompt(c)], [GREEDY])
    assert got.num_cached_tokens == 2 * PS
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
