"""Async scheduling (`jaxinfer.engine.run_ahead`): a decode step dispatched before the previous step's tokens are
read gives the same outputs as the engine that waits for them, through every way a step ahead can be taken,
partly taken or dropped (stops on a sampled id, max_tokens, arrivals, aborts, preemption, penalties, n > 1,
logprobs); and the runner's token feed puts each chunk's token where the host would."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.compiled_calls import CompiledCalls
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import SamplingRow
from jaxinfer.outputs import RequestOutput
from jaxinfer.scheduler.chunk import ScheduledChunk
from models.llama import KVCache
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

PAGE_SIZE = 8
STOP_IDS = list(range(3, 128, 9))  # a random model's stream hits one every ~14 tokens: stops at varied steps


@dataclasses.dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams


def _engine(folder, async_scheduling: bool, kv_bytes: int) -> Engine:
    return Engine(EngineConfig(model=str(folder), warmup=False, page_size=PAGE_SIZE, max_num_seqs=8,
                               max_num_batched_tokens=256, max_model_len=96, async_scheduling=async_scheduling,
                               kv_cache_memory_bytes=kv_bytes))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """{(runs ahead, pool pages): engine}: each way with a roomy pool and with one that preempts."""
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("run_ahead"))
    first = _engine(folder, False, 1 << 20)
    page = KVCache.bytes_per_page(first.model_config, PAGE_SIZE, jnp.float32)
    made = {(a, p): _engine(folder, a, p * page + page // 2) for a in (False, True) for p in (96, 24)}
    for (_, p), e in made.items():
        assert e.page_allocator.num_usable_pages == p
    return made


def _params(i: int, **extra) -> SamplingParams:
    """Greedy or seeded sampling in turn; stop ids every third request (a stop decided by the sampled id)."""
    base = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.9, seed=500 + i)
    if i % 3 == 0:
        base["stop_token_ids"] = STOP_IDS
    return SamplingParams(**{**base, "max_tokens": 6 + 5 * (i % 4), "ignore_eos": True, **extra})


def _drive(engine: Engine, arrivals: dict[int, list[Req]], aborts: dict[int, list[str]]) -> dict[str, RequestOutput]:
    """Adds requests before their step, aborts others before theirs, steps until everything finished."""
    final, k = {}, 0
    while k <= max(arrivals) or engine.has_unfinished_requests():
        for r in arrivals.get(k, []):
            engine.add_request(r.prompt, r.params, request_id=r.rid)
        for rid in aborts.get(k, []):
            engine.abort(rid)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        k += 1
        assert k < 2000, "requests did not finish"
    assert engine.page_allocator.num_free_pages == engine.page_allocator.num_usable_pages
    return final


def _view(final: dict[str, RequestOutput]) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, None if c.logprobs is None else
                   [{t: round(lp.logprob, 5) for t, lp in entry.items()} for entry in c.logprobs])
                  for c in out.outputs] for rid, out in final.items()}


def _workload(seed: int) -> tuple[dict[int, list[Req]], dict[int, list[str]]]:
    prompts = random_prompts(14, seed=seed, min_len=3, max_len=30)
    reqs = [Req(f"r{i}", p, _params(i)) for i, p in enumerate(prompts[:10])]
    reqs[4] = dataclasses.replace(reqs[4], params=_params(4, logprobs=3))
    reqs[5] = dataclasses.replace(reqs[5], params=_params(5, n=2))
    late = [Req("late-penalty", prompts[10], _params(10, presence_penalty=0.5, max_tokens=4)),  # its batch waits for tokens
            Req("late-logprobs", prompts[11], _params(11, prompt_logprobs=2)),
            Req("late", prompts[12], _params(12)), Req("abort-me", prompts[13], _params(13, max_tokens=40))]
    arrivals = {0: reqs[:6], 3: reqs[6:8], 9: reqs[8:] + late[:1], 15: late[1:3], 16: late[3:]}
    return arrivals, {22: ["abort-me", "r1"]}


@pytest.mark.parametrize("pool", [96, 24], ids=["roomy", "preempting"])
def test_outputs_equal_with_and_without_running_ahead(engines, pool):
    arrivals, aborts = _workload(seed=3)
    waits, ahead = engines[False, pool], engines[True, pool]
    before = dataclasses.replace(ahead._groups.ahead.stats)
    preemptions = waits.scheduler.num_preemptions
    expected = _view(_drive(waits, arrivals, aborts))
    assert _view(_drive(ahead, arrivals, aborts)) == expected
    reasons = [c[1] for outs in expected.values() for c in outs]
    assert {"stop", "length", "abort"} <= set(reasons), reasons  # the workload reaches every ending
    stats, waited = ahead._groups.ahead.stats, waits._groups.ahead.stats
    assert waited.launched == 0
    assert stats.used - before.used >= 10 and stats.dropped_rows > before.dropped_rows, stats
    if pool == 24:
        assert waits.scheduler.num_preemptions > preemptions  # the small pool did preempt


def test_a_step_ahead_nobody_takes_is_dropped(engines):
    """A lone sequence (every decode step runs ahead) that stops on its sampled id, or is aborted, leaves its step
    run ahead untaken: dropped, and the outputs (the next request's too) are those of the engine that waits. One
    is banned its stop id, which a bias makes the top token, until its 5th token: the step run ahead at its 4th
    must be sampled as the 5th (allowed then), or the output changes. One with penalties never runs ahead (its
    next row needs the token)."""
    waits, ahead = engines[False, 96], engines[True, 96]
    prompts = random_prompts(3, seed=5)
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = _drive(waits, {0: [Req("g", prompts[0], SamplingParams(**greedy))]}, {})["g"].outputs[0].token_ids
    runs = [({0: [Req("stop", prompts[0], SamplingParams(**greedy, stop_token_ids=[first[4]]))]}, {}),
            ({0: [Req("abort", prompts[1], SamplingParams(**greedy))]}, {5: ["abort"]}),
            ({0: [Req("min", prompts[1], SamplingParams(**greedy, min_tokens=4, stop_token_ids=[50],
                                                      logit_bias={50: 50}))]}, {}),
            ({0: [Req("penalty", prompts[2], SamplingParams(**greedy, repetition_penalty=2.0,
                                                          frequency_penalty=2.0))]}, {}),
            ({0: [Req("after", prompts[2], SamplingParams(**greedy))]}, {})]
    stats = ahead._groups.ahead.stats
    dropped, launched = stats.dropped, []
    for arrivals, aborts in runs:
        before = stats.launched
        assert _view(_drive(ahead, arrivals, aborts)) == _view(_drive(waits, arrivals, aborts))
        launched.append(stats.launched - before)
    assert stats.dropped - dropped == 3
    assert ahead.stats()["run_ahead_steps"] == stats.launched and ahead.stats()["run_ahead_dropped_steps"] == stats.dropped
    assert min(launched[:3] + launched[4:]) > 0 and launched[3] == 0, launched  # [3]: the one with penalties


def test_a_fed_token_is_the_earlier_steps_sampled_token(engines):
    """A step fed on device from an earlier step's rows (in any order) equals the step given those tokens by the
    host: same tokens sampled, same logprobs."""
    runner = engines[False, 96].runner
    prompts = random_prompts(3, seed=8, min_len=4, max_len=12)
    pages = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(3)]
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), seed=i) for i in range(3)]
    first = runner.submit([ScheduledChunk(p, 0, pg) for p, pg in zip(prompts, pages)], rows)
    sampled = first.result().token_ids
    order = [2, 0, 1]  # chunk i continues sequence order[i]
    nxt = [ScheduledChunk([0], len(prompts[s]), pages[s]) for s in order]
    fed = runner.submit(nxt, rows, fed_from=(first, order)).result()
    by_host = runner.execute([dataclasses.replace(c, token_ids=[int(sampled[s])]) for c, s in zip(nxt, order)], rows)
    assert len(set(sampled.tolist())) > 1  # distinct tokens: a wrong row would show
    np.testing.assert_array_equal(fed.token_ids, by_host.token_ids)
    np.testing.assert_array_equal(fed.logprobs, by_host.logprobs)
    # One executable for both: jit's own cache, which keys a device token apart from a host one (the same program
    # loaded twice), holds none; every call ran an executable of the runner's table.
    assert runner._step._cache_size() == 0 and runner.fed_tokens._cache_size() == 0
    assert _kinds(runner).count("feed") >= 1
    with pytest.raises(ValueError, match="one token per sequence"):
        runner.submit([ScheduledChunk([1, 2], 0, pages[0])], rows[:1], fed_from=(first, [0]))


def _kinds(runner) -> list[str]:
    return [key[0] for key in runner._compiled]


def test_a_new_shape_compiles_once_after_the_runners_steps_have_run(engines):
    """A call of a new shape first waits for every step the runner dispatched (nothing of ours runs beside a compile
    or a load from the persistent cache), then compiles once: the same shapes again run the kept executable."""
    runner = engines[False, 96].runner
    events = []
    calls = CompiledCalls()
    fake = types.SimpleNamespace(lower=lambda *a: events.append("lower") or types.SimpleNamespace(
        compile=lambda: (lambda *args: len(args))))
    for shape in (3, 3, 4, 3):
        assert calls.call("step", fake, (None, np.zeros(shape)), lambda: events.append("wait")) == 2
    assert events == ["wait", "lower", "wait", "lower"]
    prompt = random_prompts(1, seed=11, min_len=37, max_len=37)[0]  # a prefill shape no other test runs
    row = [SamplingRow(SamplingParams(temperature=0.0), seed=0)]
    pending = runner.submit([ScheduledChunk(prompt, 0, [1, 2, 3, 4, 5])], row)
    runner._idle()
    assert pending.rows.is_ready()
    pending.result()


def test_discarding_a_failed_sequences_pages_includes_one_added_for_a_step_ahead(engines, monkeypatch):
    """A sequence whose logits are not finite has its own pages zeroed before reuse; the page a step run ahead
    added (and wrote NaN K/V into) is one of them, though its failing step's chunk predates it."""
    engine = engines[True, 96]
    shared, own, added = engine.page_allocator.allocate(3)
    engine.page_allocator.incref([shared])  # another sequence holds it too
    cleared = []
    monkeypatch.setattr(engine.runner.kv, "clear_pages", cleared.extend)
    seq = types.SimpleNamespace(page_ids=[shared, own, added], num_shared_pages=1)
    engine._groups.discard_pages(ScheduledChunk([7], 9, [shared, own], seq=seq))
    assert cleared == [own, added]
    engine.page_allocator.free([shared, shared, own, added])


def test_a_page_evicted_for_a_step_ahead_reaches_the_host_tier_intact(engines, tmp_path):
    """The page a step run ahead takes may evict a cached page to the host tier: its copy must be made before the
    step writes there. A prompt served again from the host tier then decodes as it did the first time."""
    folder = make_tiny_model_dir(tmp_path / "tiny")
    page = KVCache.bytes_per_page(engines[True, 96].model_config, PAGE_SIZE, jnp.float32)
    engine = Engine(EngineConfig(model=str(folder), warmup=False, page_size=PAGE_SIZE, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=96, kv_cache_memory_bytes=5 * page + 1,
                                 kv_offload_bytes=16 * page, kv_offload_min_pages=1))
    assert engine.page_allocator.num_usable_pages == 5
    cached, other = random_prompts(2, seed=11, min_len=26, max_len=26)
    greedy = dict(temperature=0.0, ignore_eos=True)
    first = _drive(engine, {0: [Req("a", cached, SamplingParams(**greedy, max_tokens=4))]}, {})
    evictions = engine.page_allocator.num_evictions  # b's decode at position 16 takes a page a's prompt held
    _drive(engine, {0: [Req("b", other[:5], SamplingParams(**greedy, max_tokens=16))]}, {})
    assert engine.page_allocator.num_evictions > evictions and engine._groups.ahead.stats.launched > 0
    again = _drive(engine, {0: [Req("c", cached, SamplingParams(**greedy, max_tokens=4))]}, {})
    assert engine.prefix_cache.stats.host_hit_pages > 0
    assert again["c"].outputs[0].token_ids == first["a"].outputs[0].token_ids
