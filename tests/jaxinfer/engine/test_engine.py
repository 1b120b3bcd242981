"""Engine-level tests of continuous batching: one device call per step group, batch invariance (alone, together,
staggered, chunked prefill, preemption), fault isolation, bad input, abort, n > 1 and logprobs.

Two models: a tiny random Llama-3 (tests/data/tiny_llama3, fast, every configuration) and the real SmolLM2-135M
(float32, the session `smollm2_llm` engine, the main configurations). Engines are shared per module and the
step shapes are reused, so that few XLA compiles are needed. Each request's reference output is its output when
it runs alone; every other configuration must reproduce it token for token (greedy and seeded sampling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.scheduler.chunk import ScheduledChunk
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.scheduler.chunk import SchedulerOutput
from models.llama import KVCache
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

MAX_TOKENS = 12
CHUNK_BUDGETS = (1, 7, 16, 17, 64)
TINY_PAGE_SIZE = 8
TINY_MAX_MODEL_LEN = 64  # prompts <= 40 tokens + 12 outputs fit one page-table width (8 pages)


# ---------------------------------------------------------------------------------------------------------------
# Helpers


@dataclasses.dataclass(frozen=True)
class Req:
    rid: str
    prompt: str | list[int]
    params: SamplingParams


@dataclasses.dataclass
class StepRecord:
    plan: SchedulerOutput
    device_calls: int
    outputs: list[RequestOutput]


@dataclasses.dataclass
class Run:
    final: dict[str, RequestOutput]
    steps: list[StepRecord]

    def tokens(self) -> dict[str, list[list[int]]]:
        return {rid: [c.token_ids for c in out.outputs] for rid, out in self.final.items()}


def mixed_params(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Even requests greedy, odd ones sampled with their own seed."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)


def run(engine: Engine, reqs: list[Req], arrivals: dict[int, list[Req]] | None = None,
        max_steps: int = 5000) -> Run:
    """Adds `reqs` (and `arrivals[k]` before step k), steps until all finish, and records every step.

    Checks the streaming contract on the way: a request reports `finished` once and nothing after, and its
    concatenated `delta_token_ids` equal the final `token_ids` of each completion.
    """
    pending = {k: list(v) for k, v in (arrivals or {}).items()}
    pending[0] = list(reqs) + pending.get(0, [])
    plans: list[SchedulerOutput] = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule(*args, **kwargs) -> SchedulerOutput:
        plan = real_schedule(*args, **kwargs)
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording_schedule
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, list[list[int]]] = {}
    steps: list[StepRecord] = []
    added: list[str] = []
    ok = False
    try:
        k = 0
        while pending or engine.has_unfinished_requests():
            for r in pending.pop(k, []):
                added.append(engine.add_request(r.prompt, r.params, request_id=r.rid))
            k += 1
            if not engine.has_unfinished_requests():
                continue
            calls = engine.metrics.num_device_calls
            outs = engine.step()
            steps.append(StepRecord(plans[-1], engine.metrics.num_device_calls - calls, outs))
            for out in outs:
                assert out.request_id not in final, f"{out.request_id} reported after it finished"
                acc = streamed.setdefault(out.request_id, [[] for _ in out.outputs])
                for c in out.outputs:
                    acc[c.index] += c.delta_token_ids
                if out.finished:
                    final[out.request_id] = out
            assert len(steps) < max_steps, "requests did not finish"
        ok = True
    finally:
        del engine.scheduler.schedule  # back to the class's method
        if not ok:  # leave a shared engine clean for the next test
            for rid in added:
                engine.abort(rid)
            while engine.has_unfinished_requests():
                engine.step()
    assert set(final) == set(added)
    for rid, out in final.items():
        assert [c.token_ids for c in out.outputs] == streamed[rid], f"{rid}: streamed ids differ from final ids"
    return Run(final, steps)


def drain(engine: Engine) -> dict[str, RequestOutput]:
    """Steps until every request finished; returns the final outputs of those that finished meanwhile."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def assert_one_call_per_group(r: Run) -> None:
    """Every step ran its decodes in one device call and its prefill chunks in one more."""
    for i, s in enumerate(r.steps):
        has_decodes = any(len(c.token_ids) == 1 and c.samples for c in s.plan.chunks)
        has_prefills = any(not (len(c.token_ids) == 1 and c.samples) for c in s.plan.chunks)
        assert s.device_calls == has_decodes + has_prefills, f"step {i}: {s.device_calls} device calls"


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished()
    assert engine.page_allocator.num_free_pages == engine.page_allocator.num_usable_pages


@contextlib.contextmanager
def scheduler_limits(engine: Engine, **limits: int) -> Iterator[None]:
    """Temporarily changes the scheduler's limits (max_num_seqs, max_num_batched_tokens) of a shared engine."""
    old = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(old, **limits)
    try:
        yield
    finally:
        engine.scheduler.config = old


@contextlib.contextmanager
def held_pages(engine: Engine, keep_free: int) -> Iterator[None]:
    """Takes pages out of the pool so that only `keep_free` stay free (a small pool without a new engine)."""
    alloc = engine.page_allocator
    held = alloc.allocate(alloc.num_free_pages - keep_free)
    try:
        yield
    finally:
        alloc.free(held)


def staggered_arrivals(reqs: list[Req]) -> tuple[list[Req], dict[int, list[Req]]]:
    """3 requests at step 0, 5 more at step 2, 4 at step 5, the rest at step 6 (joining running decodes)."""
    return reqs[:3], {2: reqs[3:8], 5: reqs[8:12], 6: reqs[12:]}


def check_chunked(engine: Engine, reqs: list[Req], alone: dict[str, list[list[int]]], budget: int) -> None:
    engine.reset_prefix_cache()  # these prompts ran before: without a reset their prefixes would be cache hits
    with scheduler_limits(engine, max_num_batched_tokens=budget):
        r = run(engine, reqs)
    assert r.tokens() == alone
    assert all(s.plan.num_batched_tokens <= budget for s in r.steps)
    # Prefill really was chunked: some prompt took several steps, with a partial (non-sampling) chunk.
    partial = [c for s in r.steps for c in s.plan.chunks if not c.samples]
    assert partial
    if budget > 1:
        assert any(len(c.token_ids) > 1 for c in partial)
    assert any(c.num_computed_tokens > 0 and c.num_computed_tokens < len(c.seq.prompt_token_ids)
               for s in r.steps for c in s.plan.chunks)
    assert_one_call_per_group(r)
    assert_idle(engine)


def pages_for(engine: Engine, num_tokens: int) -> int:
    return -(-num_tokens // engine.page_size)


@pytest.fixture(autouse=True)
def leave_engines_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, aborts and drains whatever a failed test left in the shared engines."""
    yield
    for name in ("tiny", "tiny_small", "smol"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            for seq in engine.scheduler.running + engine.scheduler.waiting:
                engine.abort(seq.request_id)
            drain(engine)


# ---------------------------------------------------------------------------------------------------------------
# Tiny random model


TINY_PROMPTS = random_prompts(16, seed=0, min_len=5, max_len=40)
TINY_REQS = [Req(f"t{i}", p, mixed_params(i)) for i, p in enumerate(TINY_PROMPTS)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3"))


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Engine:
    """The shared tiny engine: 16 sequences, a roomy pool (128 pages of 8 tokens)."""
    return Engine(EngineConfig(model=str(tiny_dir), warmup=False, page_size=TINY_PAGE_SIZE, max_num_seqs=16,
                               max_num_batched_tokens=512, max_model_len=TINY_MAX_MODEL_LEN,
                               kv_cache_memory_bytes=1 << 20))


@pytest.fixture(scope="module")
def tiny_small(tiny_dir, tiny: Engine) -> Engine:
    """A tiny engine whose pool holds just one request at its longest (7 pages: 40 + 12 tokens)."""
    page_bytes = KVCache.bytes_per_page(tiny.model_config, TINY_PAGE_SIZE, jnp.float32)
    need = max(pages_for(tiny, len(p) + MAX_TOKENS) for p in TINY_PROMPTS)
    engine = Engine(EngineConfig(model=str(tiny_dir), warmup=False, page_size=TINY_PAGE_SIZE, max_num_seqs=16,
                                 max_num_batched_tokens=512, max_model_len=TINY_MAX_MODEL_LEN,
                                 kv_cache_memory_bytes=need * page_bytes + page_bytes // 2))
    assert engine.page_allocator.num_usable_pages == need
    return engine


@pytest.fixture(scope="module")
def tiny_alone(tiny) -> dict[str, list[list[int]]]:
    """Each tiny request run alone: the references."""
    ref = {}
    for r in TINY_REQS:
        ref.update(run(tiny, [r]).tokens())
    assert all(len(t[0]) == MAX_TOKENS for t in ref.values())
    assert len({tuple(t[0]) for t in ref.values()}) == len(ref)  # distinct streams: the comparison has teeth
    assert_idle(tiny)
    return ref


def test_sixteen_decodes_share_one_device_call(tiny: Engine, tiny_alone) -> None:
    for r in TINY_REQS:
        tiny.add_request(r.prompt, r.params, request_id=r.rid)
    outputs: dict[str, list[int]] = {r.rid: [] for r in TINY_REQS}
    while not (tiny.scheduler.num_running == 16 and all(s.is_decoding for s in tiny.scheduler.running)):
        for out in tiny.step():
            outputs[out.request_id] += out.outputs[0].delta_token_ids
    before = dataclasses.replace(tiny.metrics)
    outs = tiny.step()
    assert tiny.metrics.num_device_calls - before.num_device_calls == 1
    assert tiny.metrics.num_decode_tokens - before.num_decode_tokens == 16
    assert tiny.metrics.num_prefill_tokens == before.num_prefill_tokens
    assert sorted(o.request_id for o in outs) == sorted(outputs)
    assert all(len(o.outputs[0].delta_token_ids) == 1 for o in outs)
    for out in outs:
        outputs[out.request_id] += out.outputs[0].delta_token_ids
    while tiny.has_unfinished_requests():
        for out in tiny.step():
            outputs[out.request_id] += out.outputs[0].delta_token_ids
    assert {rid: [ids] for rid, ids in outputs.items()} == tiny_alone
    assert_idle(tiny)


def test_a_one_token_prompt_chunk_counts_as_prefill(tiny: Engine) -> None:
    """A one-token prompt rides in the decode call (same shape) but is prefill work: the step statistics must
    count it as a prefill token; its later steps are decodes."""
    before = dataclasses.replace(tiny.metrics)
    tiny.add_request(Prompt([7]), SamplingParams(max_tokens=3, temperature=0.0), request_id="one-token")
    tiny.step()
    assert tiny.metrics.num_prefill_tokens - before.num_prefill_tokens == 1
    assert tiny.metrics.num_decode_tokens == before.num_decode_tokens
    drain(tiny)
    assert tiny.metrics.num_decode_tokens - before.num_decode_tokens == 2  # tokens 2 and 3 come from decodes
    assert tiny.metrics.num_prefill_tokens - before.num_prefill_tokens == 1
    assert_idle(tiny)


def test_tiny_together(tiny: Engine, tiny_alone) -> None:
    r = run(tiny, TINY_REQS)
    assert r.tokens() == tiny_alone
    assert any(len(s.plan.chunks) == 16 and s.device_calls == 1 for s in r.steps)  # 16 decodes, one call
    assert_one_call_per_group(r)
    assert all(o.outputs[0].finish_reason == "length" for o in r.final.values())
    assert_idle(tiny)


def test_tiny_staggered(tiny: Engine, tiny_alone) -> None:
    first, later = staggered_arrivals(TINY_REQS)
    r = run(tiny, first, later)
    assert r.tokens() == tiny_alone
    # Late arrivals were prefilled in the same steps as earlier requests' decodes.
    assert any(s.plan.num_decode_seqs and s.plan.num_prefill_tokens for s in r.steps)
    assert_one_call_per_group(r)
    assert_idle(tiny)


@pytest.mark.parametrize("budget", CHUNK_BUDGETS)
def test_tiny_chunked_prefill(tiny: Engine, tiny_alone, budget: int) -> None:
    check_chunked(tiny, TINY_REQS, tiny_alone, budget)


def test_tiny_preemption(tiny_small: Engine, tiny_alone) -> None:
    before = tiny_small.scheduler.num_preemptions
    r = run(tiny_small, TINY_REQS)
    assert tiny_small.scheduler.num_preemptions - before > 0
    assert any(s.plan.preempted for s in r.steps)
    assert r.tokens() == tiny_alone
    assert_idle(tiny_small)


# --- bad input, abort, n > 1, logprobs (tiny model) -------------------------------------------------------------


def test_bad_input_is_rejected_and_in_flight_request_is_unharmed(tiny: Engine, tiny_alone) -> None:
    good = TINY_REQS[1]
    tiny.add_request(good.prompt, good.params, request_id=good.rid)
    tokens: list[int] = []
    for _ in range(3):
        for out in tiny.step():
            tokens += out.outputs[0].delta_token_ids
    assert tokens  # it is decoding now
    waiting, running, free = tiny.scheduler.num_waiting, tiny.scheduler.num_running, \
        tiny.page_allocator.num_free_pages
    greedy = SamplingParams(temperature=0, max_tokens=4)
    bad = [
        ("", greedy, None, "prompt must not be empty"),
        ([], greedy, None, "prompt must not be empty"),
        ({"prompt_token_ids": []}, greedy, None, "prompt must not be empty"),
        ([5] * TINY_MAX_MODEL_LEN, greedy, None, "context"),
        ([5, 128], greedy, None, "prompt_token_ids"),
        ([5, -1], greedy, None, "prompt_token_ids"),
        ({"prompt": 5}, greedy, None, "prompt_token_ids' or a text 'prompt"),
        ({"prompt_token_ids": [5], "extra": 1}, greedy, None, "unknown key"),
        ("w5 \ud800", greedy, None, "prompt is not valid Unicode text"),
        ([5, 6], SamplingParams(stop_token_ids=[128]), None, r"stop_token_ids contains ids outside \[0, 128\)"),
        ([5, 6], SamplingParams(stop_token_ids=[3, 500], min_tokens=1), None, "stop_token_ids contains ids"),
        ([5, 6], SamplingParams(min_tokens=TINY_MAX_MODEL_LEN - 1, max_tokens=None), None,
         "min_tokens=63: the prompt"),
        ([5, 6], greedy, "id-\udc00", "request_id is not valid Unicode text"),
        ({"cache_salt": "a"}, greedy, None, "prompt_token_ids' or a text 'prompt"),
        ({"prompt": "w5", "cache_salt": 7}, greedy, None, "cache_salt"),
        (3.5, greedy, None, "prompt must be"),
        ([5, 6], {"temperature": 0}, None, "params"),
        ([5, 6], greedy, "", "request_id"),
        ([5, 6], greedy, good.rid, "already in use"),
    ]
    for prompt, params, rid, match in bad:
        with pytest.raises(ValueError, match=match):
            tiny.add_request(prompt, params, request_id=rid)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # Nothing was queued and nothing moved.
    assert (tiny.scheduler.num_waiting, tiny.scheduler.num_running, tiny.page_allocator.num_free_pages) == \
        (waiting, running, free)
    # A rejected id is not taken: it can be used now.
    rid = tiny.add_request([5, 6, 7], greedy, request_id="rejected-before")
    final = {}
    while tiny.has_unfinished_requests():
        for out in tiny.step():
            if out.request_id == good.rid:
                tokens += out.outputs[0].delta_token_ids
            if out.finished:
                final[out.request_id] = out
    assert [tokens] == tiny_alone[good.rid]
    assert final[good.rid].outputs[0].finish_reason == "length"
    assert len(final[rid].outputs[0].token_ids) == 4
    assert_idle(tiny)


def test_stop_ids_and_min_tokens_compile_no_new_step_shape(tiny: Engine) -> None:
    """A request that bans many ids (EOS and 32 stop ids until min_tokens) runs on the compiled step a plain request
    of the same shape used: the banned-id array has one width."""
    prompt = TINY_PROMPTS[2]
    plain = run(tiny, [Req("plain", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])
    compiled = len(tiny.runner._compiled)
    stop_ids = list(range(64, 64 + 32))
    banning = SamplingParams(temperature=0, max_tokens=3, min_tokens=3, stop_token_ids=stop_ids)
    out = run(tiny, [Req("banning", prompt, banning)]).final["banning"].outputs[0]
    assert len(tiny.runner._compiled) == compiled
    assert len(out.token_ids) == 3 and not set(out.token_ids) & (set(stop_ids) | tiny.tokenizer.eos_ids)
    assert plain.final["plain"].outputs[0].finish_reason == "length"


def test_a_prompt_is_tokenized_once_and_admitted_as_it_is(tiny: Engine, monkeypatch) -> None:
    encode = tiny.tokenizer.encode
    calls: list[str] = []
    monkeypatch.setattr(tiny.tokenizer, "encode", lambda text, *a, **kw: calls.append(text) or encode(text, *a, **kw))
    greedy = SamplingParams(temperature=0, max_tokens=2)
    prompt = tiny.make_prompt({"prompt": "w5 w6 w7", "cache_salt": "tenant-a"})
    assert calls == ["w5 w6 w7"] and prompt == Prompt(tuple(encode("w5 w6 w7")), "w5 w6 w7", "tenant-a")
    rid = tiny.add_request(prompt, greedy)
    assert calls == ["w5 w6 w7"]  # the engine took the Prompt as it is
    assert [s.cache_salt for s in tiny.scheduler.get_sequences(rid)] == ["tenant-a"]
    other = tiny.add_request(prompt, greedy, cache_salt="tenant-b")  # the argument wins over the prompt's salt
    assert [s.cache_salt for s in tiny.scheduler.get_sequences(other)] == ["tenant-b"]
    with pytest.raises(ValueError, match="prompt_token_ids"):  # a Prompt built by hand still gets its ids checked
        tiny.add_request(Prompt((5, 128)), greedy)
    outs = drain(tiny)
    assert outs[rid].prompt == "w5 w6 w7" and outs[rid].prompt_token_ids == list(prompt.token_ids)


def test_prompt_plus_max_tokens_beyond_context_is_rejected(tiny: Engine) -> None:
    prompt = (TINY_PROMPTS[0] * TINY_MAX_MODEL_LEN)[: TINY_MAX_MODEL_LEN - 4]
    with pytest.raises(ValueError, match="max_tokens=20"):
        tiny.add_request(prompt, SamplingParams(temperature=0, max_tokens=20), request_id="too-long")
    assert_idle(tiny)


def test_max_tokens_none_stops_at_the_context_limit(tiny: Engine) -> None:
    prompt = (TINY_PROMPTS[0] * TINY_MAX_MODEL_LEN)[: TINY_MAX_MODEL_LEN - 4]
    out = run(tiny, [Req("long", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))])
    completion = out.final["long"].outputs[0]
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"
    assert_idle(tiny)


def test_request_that_can_never_fit_the_pool_is_rejected(tiny_small: Engine, tiny_alone) -> None:
    usable = tiny_small.page_allocator.num_usable_pages
    prompt = [7] * (usable * TINY_PAGE_SIZE - 2)
    assert len(prompt) < TINY_MAX_MODEL_LEN
    good = TINY_REQS[2]
    tiny_small.add_request(good.prompt, good.params, request_id=good.rid)
    tiny_small.step()
    with pytest.raises(ValueError, match="KV pages"):
        tiny_small.add_request(prompt, SamplingParams(max_tokens=8), request_id="too-big")
    with pytest.raises(ValueError, match="KV pages"):  # n = 3: none of its samples is queued
        tiny_small.add_request(prompt, SamplingParams(max_tokens=8, n=3), request_id="too-big")
    tiny_small.add_request(prompt, SamplingParams(max_tokens=2), request_id="fits")  # exactly the pool
    final = drain(tiny_small)
    assert set(final) == {good.rid, "fits"}
    assert [final[good.rid].outputs[0].token_ids] == tiny_alone[good.rid]
    assert_idle(tiny_small)


def test_abort_mid_generation_frees_pages_at_once(tiny: Engine, tiny_alone) -> None:
    reqs = TINY_REQS[:4]
    for r in reqs:
        tiny.add_request(r.prompt, r.params, request_id=r.rid)
    tiny.add_request([9, 10, 11], SamplingParams(max_tokens=4), request_id="queued")
    tiny.abort("queued")  # aborted before it ever ran
    tiny.abort("no-such-request")  # no-op
    for _ in range(4):
        tiny.step()
    victim = reqs[1].rid
    (seq,) = tiny.scheduler.get_sequences(victim)
    assert seq.page_ids and len(seq.output_token_ids) == 4
    produced = list(seq.output_token_ids)
    free = tiny.page_allocator.num_free_pages
    held = len(seq.page_ids)
    tiny.abort(victim)
    assert tiny.page_allocator.num_free_pages == free + held
    assert tiny.scheduler.get_sequences(victim) == []
    outs = {o.request_id: o for o in tiny.step()}
    assert outs[victim].finished and outs[victim].outputs[0].finish_reason == "abort"
    assert outs[victim].outputs[0].token_ids == produced == tiny_alone[victim][0][:4]
    rest = drain(tiny)
    assert victim not in rest
    final_tokens = {rid: [o.outputs[0].token_ids] for rid, o in rest.items()}
    assert final_tokens == {r.rid: tiny_alone[r.rid] for r in reqs if r.rid != victim}
    assert_idle(tiny)


def test_abort_of_a_waiting_request(tiny: Engine) -> None:
    tiny.add_request([9, 10, 11], SamplingParams(max_tokens=4), request_id="queued")
    tiny.abort("queued")
    outs = tiny.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs] == \
        [("queued", True, "abort", [])]
    assert_idle(tiny)


@pytest.mark.parametrize("error", [TypeError, RuntimeError, KeyboardInterrupt])
def test_a_request_of_n_samples_is_queued_whole_or_not_at_all(tiny: Engine, monkeypatch, error) -> None:
    """Any exception while its samples are queued (not only a ValueError) leaves nothing of the request behind."""
    add = tiny.scheduler.add
    seen: list[int] = []

    def add_then_fail(seq) -> None:
        seen.append(seq.sample_index)
        if seq.sample_index == 1:
            raise error("injected failure queueing sample 1")
        add(seq)

    monkeypatch.setattr(tiny.scheduler, "add", add_then_fail)
    with pytest.raises(error, match="injected"):
        tiny.add_request([9, 10, 11], SamplingParams(n=3, max_tokens=4), request_id="half")
    assert seen == [0, 1]  # sample 0 was queued before sample 1 failed
    assert_idle(tiny)
    monkeypatch.undo()
    tiny.add_request([9, 10, 11], SamplingParams(n=3, max_tokens=4), request_id="half")  # the id is free again
    assert len(drain(tiny)["half"].outputs) == 3
    assert_idle(tiny)


def test_n_samples_differ_and_are_reproducible(tiny: Engine) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = TINY_PROMPTS[3]
    alone = run(tiny, [Req("n3", prompt, params)]).final["n3"]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    streams = [tuple(c.token_ids) for c in alone.outputs]
    assert all(len(s) == MAX_TOKENS for s in streams) and len(set(streams)) == 3
    again = run(tiny, [Req("n3", prompt, params)] + TINY_REQS[:5]).final["n3"]
    assert [c.token_ids for c in again.outputs] == [list(s) for s in streams]
    single = run(tiny, [Req("n1", prompt, dataclasses.replace(params, n=1))]).final["n1"]
    assert single.outputs[0].token_ids == list(streams[0])  # sample 0 draws as an n=1 request with that seed
    assert_idle(tiny)


def reference_logprobs(engine: Engine, prompt: list[int], output: list[int]) -> np.ndarray:
    """f64[len(output), V]: the raw log-softmax before each output token, from one full forward over prompt +
    output (`ModelRunner.compute_logits`)."""
    ids = list(prompt) + list(output)
    pages = engine.page_allocator.allocate(pages_for(engine, len(ids)))
    try:
        logits = engine.runner.compute_logits([ScheduledChunk(ids, 0, pages)])
    finally:
        engine.page_allocator.free(pages)
    logits = logits[len(prompt) - 1 : len(ids) - 1].astype(np.float64)
    logsm = logits - logits.max(-1, keepdims=True)
    return logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))


def assert_rank(rank: int, row: np.ndarray, token: int, tol: float = 1e-5) -> None:
    """rank is 1 + the number of raw logprobs strictly above token's, by the f64 reference row; a logprob within
    tol of token's may count either way (the engine compares f32 values)."""
    lowest, highest = 1 + np.sum(row > row[token] + tol), 1 + np.sum(row > row[token] - tol) - 1
    assert lowest <= rank <= max(lowest, highest), (rank, lowest, highest)


def test_logprobs_are_the_models_log_softmax(tiny: Engine) -> None:
    prompt = TINY_PROMPTS[4]
    params = SamplingParams(logprobs=3, temperature=0, max_tokens=6, ignore_eos=True)
    out = run(tiny, [Req("lp", prompt, params)]).final["lp"].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert len(entry) == 3 and next(iter(entry)) == token  # the sampled token first, as vLLM
        assert entry[token].logprob == max(e.logprob for e in entry.values()) and all(
            e.logprob <= 0 for e in entry.values())
    # Against a full forward pass over prompt + output.
    logsm = reference_logprobs(tiny, prompt, out.token_ids)
    for row, token, entry in zip(logsm, out.token_ids, out.logprobs):
        assert token == int(row.argmax())
        top3 = [int(t) for t in np.argsort(row)[::-1][:3]]
        assert set(entry) == set(top3)
        np.testing.assert_allclose([entry[t].logprob for t in top3], row[top3], atol=1e-4)
        assert [entry[t].rank for t in top3] == [1, 2, 3]  # position + 1
        assert all(e.decoded_token == tiny.tokenizer.decode([t], skip_special_tokens=False) for t, e in entry.items())
    sampled_sum = math.fsum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(sampled_sum, rel=1e-12, abs=1e-9)
    assert out.cumulative_logprob == pytest.approx(sum(row[t] for row, t in zip(logsm, out.token_ids)), abs=1e-3)
    # Sampled rows: the dict holds the sampled token (with its own rank, computed on device) even when it is not
    # in the top k; logprobs=0 holds only the sampled token.
    for n in (1, 0):
        sampled = run(tiny, [Req("lp2", prompt, SamplingParams(logprobs=n, temperature=1.0, seed=3, max_tokens=8,
                                                                   ignore_eos=True))]).final["lp2"].outputs[0]
        assert len(sampled.logprobs) == 8
        assert all(next(iter(e)) == t and 1 <= len(e) <= n + 1 for t, e in zip(sampled.token_ids, sampled.logprobs))
        logsm = reference_logprobs(tiny, prompt, sampled.token_ids)
        ranks = [e[t].rank for t, e in zip(sampled.token_ids, sampled.logprobs)]
        for rank, row, token in zip(ranks, logsm, sampled.token_ids):
            assert_rank(rank, row, token)
        assert max(ranks) > 1  # some sampled token lies outside the top 1: its rank is the device's
        assert sampled.cumulative_logprob == pytest.approx(
            math.fsum(e[t].logprob for t, e in zip(sampled.token_ids, sampled.logprobs)), rel=1e-12, abs=1e-9)
    plain = run(tiny, [Req("lp3", prompt, dataclasses.replace(params, logprobs=None))]).final["lp3"].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None  # as vLLM V1, without logprobs
    assert plain.token_ids == out.token_ids
    assert_idle(tiny)


def test_stop_reason_is_the_stop_id_or_stop_string(tiny: Engine) -> None:
    """vLLM's stop_reason: the stop token id, the matched stop string; None when the request ends by length."""
    prompt = TINY_PROMPTS[5]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = run(tiny, [Req("ref", prompt, greedy)]).final["ref"].outputs[0]
    assert (ref.finish_reason, ref.stop_reason) == ("length", None)
    stop_id = ref.token_ids[4]
    stop_str = tiny.tokenizer.decode([ref.token_ids[6]])
    outs = run(tiny, [Req("id", prompt, dataclasses.replace(greedy, stop_token_ids=[stop_id])),
                      Req("str", prompt, dataclasses.replace(greedy, stop=[stop_str]))]).final
    by_id, by_str = outs["id"].outputs[0], outs["str"].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert by_id.token_ids == ref.token_ids[: ref.token_ids.index(stop_id) + 1]
    assert (by_str.finish_reason, by_str.stop_reason) == ("stop", stop_str)
    assert by_str.text == ref.text[: ref.text.index(stop_str)]
    assert_idle(tiny)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2-135M (float32): the real model, through the session engine


SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "At sea level, pure water boils at a temperature of",
    "List three benefits of regular exercise:\n1.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "SELECT name, age FROM users WHERE",
    "Translate to French: I would like a cup of coffee, please.\nFrench:",
    "Photosynthesis is the process by which plants",
    "Q: What is 12 times 7?\nA:",
    "Dear hiring manager, I am writing to apply for the position of software engineer at your company because",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "A haiku about autumn leaves:\n",
    "The most important thing to remember when learning a new programming language is that you should always "
    "start by writing small programs, reading other people's code, and asking questions when",
]
SMOL_REQS = [Req(f"s{i}", text, mixed_params(i)) for i, text in enumerate(SMOL_TEXTS)]


@pytest.fixture(scope="module")
def smol(smollm2_llm) -> Iterator[Engine]:
    """The session SmolLM2 engine, allowed 16 sequences for this module."""
    engine = smollm2_llm.engine
    assert_idle(engine)
    with scheduler_limits(engine, max_num_seqs=16):
        yield engine
    assert_idle(engine)


@pytest.fixture(scope="module")
def smol_alone(smol: Engine) -> dict[str, list[list[int]]]:
    lengths = [len(smol.tokenizer.encode(t)) for t in SMOL_TEXTS]
    assert min(lengths) >= 5 and max(lengths) <= 40, lengths
    ref = {}
    for r in SMOL_REQS:
        ref.update(run(smol, [r]).tokens())
    assert len({tuple(t[0]) for t in ref.values()}) == len(ref)
    return ref


@pytest.mark.slow
def test_smollm2_together(smol: Engine, smol_alone) -> None:
    r = run(smol, SMOL_REQS)
    assert r.tokens() == smol_alone
    assert any(s.plan.num_decode_seqs == 16 and s.device_calls == 1 for s in r.steps)
    assert_one_call_per_group(r)


@pytest.mark.slow
def test_smollm2_staggered(smol: Engine, smol_alone) -> None:
    first, later = staggered_arrivals(SMOL_REQS)
    r = run(smol, first, later)
    assert r.tokens() == smol_alone
    assert any(s.plan.num_decode_seqs and s.plan.num_prefill_tokens for s in r.steps)
    assert_one_call_per_group(r)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [7, 17])
def test_smollm2_chunked_prefill(smol: Engine, smol_alone, budget: int) -> None:
    check_chunked(smol, SMOL_REQS, smol_alone, budget)


@pytest.mark.slow
def test_smollm2_preemption(smol: Engine, smol_alone) -> None:
    need = [pages_for(smol, len(smol.tokenizer.encode(t)) + MAX_TOKENS) for t in SMOL_TEXTS]
    before = smol.scheduler.num_preemptions
    with held_pages(smol, keep_free=max(max(need), sum(need) // 2)):
        r = run(smol, SMOL_REQS)
    assert smol.scheduler.num_preemptions - before > 0
    assert r.tokens() == smol_alone
    assert_idle(smol)


# ---------------------------------------------------------------------------------------------------------------
# Fault isolation (tiny model; last in the module: a failing test may leave poisoned pages behind)


def _absent_token(reqs: list[Req], alone: dict[str, list[list[int]]]) -> int:
    """A word id that appears in none of the requests' prompts or reference outputs."""
    used = {t for r in reqs for t in r.prompt} | {t for r in reqs for t in alone[r.rid][0]}
    free = [t for t in range(3, 128) if t not in used]
    assert free
    return free[0]


@contextlib.contextmanager
def nan_embedding(engine: Engine, token: int) -> Iterator[None]:
    """Makes `token`'s embedding NaN, so that any sequence containing it gets non-finite logits (and K/V)."""
    weights = engine.runner.weights
    engine.runner.weights = dataclasses.replace(weights, embed=weights.embed.at[token].set(jnp.nan))
    try:
        yield
    finally:
        engine.runner.weights = weights


def test_exception_in_step_fails_only_that_request(tiny: Engine, tiny_alone, monkeypatch) -> None:
    good = TINY_REQS[:4]
    marker = next(t for t in range(3, 128) if t not in {r.prompt[0] for r in good})
    real_submit = tiny.runner.submit  # every engine step's device call (`execute` is submit + result)
    calls = []

    def flaky_submit(chunks, rows, **kwargs):
        calls.append(len(chunks))
        if any(c.num_computed_tokens == 0 and c.token_ids[0] == marker for c in chunks):
            raise RuntimeError("injected device failure")
        return real_submit(chunks, rows, **kwargs)

    monkeypatch.setattr(tiny.runner, "submit", flaky_submit)
    tiny.reset_prefix_cache()  # the good prompts ran before: the call counts below assume they are recomputed
    errors = tiny.metrics.num_errors
    bad = Req("bad", [marker] + TINY_PROMPTS[5][:10], mixed_params(0))
    r = run(tiny, good[:2] + [bad] + good[2:])
    assert r.final["bad"].outputs[0].finish_reason == "error"
    assert r.final["bad"].outputs[0].token_ids == []
    assert "injected device failure" in r.final["bad"].outputs[0].error
    assert "RuntimeError" in r.final["bad"].outputs[0].error
    assert r.final["bad"].outputs[0].error_kind == "engine"
    assert tiny.metrics.num_errors - errors == 1
    assert {rid: t for rid, t in r.tokens().items() if rid != "bad"} == {q.rid: tiny_alone[q.rid] for q in good}
    assert all(o.outputs[0].error is None for rid, o in r.final.items() if rid != "bad")
    # The failing prefill call (5 chunks) was retried one chunk per call; the bad chunk failed alone.
    first = r.steps[0]
    assert calls[0] == 5 and calls[1:6] == [1] * 5 and first.device_calls == 6
    assert_idle(tiny)


def test_nan_logits_fail_only_that_request(tiny: Engine, tiny_alone) -> None:
    good = TINY_REQS[6:10]
    marker = _absent_token(good, tiny_alone)
    errors = tiny.metrics.num_errors
    bad = Req("nan", TINY_PROMPTS[11][:7] + [marker] + TINY_PROMPTS[12][:20], mixed_params(1))
    with nan_embedding(tiny, marker):
        r = run(tiny, good[:1] + [bad] + good[1:])
    out = r.final["nan"].outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []
    assert "non-finite" in out.error and out.error_kind == "engine"
    assert tiny.metrics.num_errors - errors == 1
    assert {rid: t for rid, t in r.tokens().items() if rid != "nan"} == {q.rid: tiny_alone[q.rid] for q in good}
    assert all(o.outputs[0].finish_reason == "length" for rid, o in r.final.items() if rid != "nan")
    assert_idle(tiny)


def test_pages_of_a_nan_request_are_safe_to_reuse(tiny: Engine, tiny_alone) -> None:
    """A request that wrote NaN K/V fails; the next owner of its pages must not inherit the NaNs.

    The attention masks positions past a sequence's length, but 0 * NaN is NaN: stale NaN values in a reused
    page's unwritten slots poison the new owner unless the pages are cleared (or masked) first.
    """
    good = TINY_REQS[12]
    marker = _absent_token([good], tiny_alone)
    bad_prompt = [marker] * 30
    pages: list[int] = []
    with nan_embedding(tiny, marker):
        r = run(tiny, [Req("nan", bad_prompt, mixed_params(0))])
        pages = r.steps[0].plan.chunks[0].page_ids
    assert r.final["nan"].outputs[0].finish_reason == "error"
    assert len(pages) == pages_for(tiny, 30)
    alloc = tiny.page_allocator
    everything = alloc.allocate(alloc.num_free_pages)
    alloc.free(pages)  # only the poisoned pages are free: the next request must use them
    try:
        assert len(good.prompt) + MAX_TOKENS <= len(pages) * TINY_PAGE_SIZE
        again = run(tiny, [good])
    finally:
        alloc.free([p for p in everything if p not in pages])
    out = again.final[good.rid].outputs[0]
    assert (out.finish_reason, out.error) == ("length", None)
    assert again.tokens() == {good.rid: tiny_alone[good.rid]}
    assert_idle(tiny)
