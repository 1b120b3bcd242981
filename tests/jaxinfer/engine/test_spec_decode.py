"""Speculative decoding end to end on the real SmolLM2-135M-Instruct: greedy outputs equal speculation off.

Three float32 engines of the same shapes, loaded once for the module (one GGUF parse: `_load_once`):
- `off`: speculation off, the reference. Reference outputs are memoised per (prompt, params) (`Refs`).
- `ngram`: prompt-lookup drafting.
- `self_draft`: the target's first DRAFT_LAYERS of its 30 layers draft (an early exit; it accepts a fair share of its
  drafts on the code and timetable copies, SELF_DRAFT_TASKS).
Tests set k and the policy of a speculating engine with `speculation()`, which swaps the engine's `spec_config`
and `SpeculationPolicy` while it is idle. Those two are all of the engine's state that depends on them (the draft
model depends on the method and num_draft_layers only), so this gives an engine built with that config without
another model load, and fresh spec_* counters for each test.

Every request is greedy, so speculation must change nothing a user sees: token ids, text (final and streamed),
finish_reason and log-probabilities (to LOGPROB_TOL) are compared with the spec-off engine's. The prompts are
copy-heavy (repeat a paragraph, rename a function, copy a timetable) so that drafts get accepted, and the tests
assert that they were (spec_accepted_tokens > 0; for n-gram drafts, whole blocks): a verifier that never accepts,
or accepts wrong drafts, fails them. After every step, no sequence may hold pages past its tokens (`run`).

Covered:
1. k = 1, 2, 4, 8 for both proposers.
2. EOS, stop strings and stop token ids on an accepted draft with more tokens after it in the same step (those
   must be dropped), each asserted to happen there (`Block`); max_tokens and min_tokens reached by blocks of
   accepted drafts (which must end there).
3. Preemption, prefix-cache hits (including a follow-up prompt that extends a speculated reply), chunked prefill,
   n > 1, logprobs, and concurrent requests joining a running batch (k shrinking with the batch).

Every sequence stays within MAX_MODEL_LEN = 128 tokens (one page-table width) and batches hold at most MAX_BATCH
sequences, so that the engines compile few step shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import pytest

import jaxinfer.engine.startup as startup_module
from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.scheduler.scheduler import ScheduledChunk
from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from tests.jaxinfer.engine.test_engine import held_pages, scheduler_limits

pytestmark = pytest.mark.slow

PS = 16  # page size (the default)
PAGE_BYTES = 30 * 2 * 3 * PS * 64 * 4  # SmolLM2 f32: layers x (K, V) x KV heads x page x head dim x 4 bytes
NUM_PAGES = 48
MAX_MODEL_LEN = 128
MAX_TOKENS = 40
K_VALUES = (1, 2, 4, 8)
DRAFT_LAYERS = 28
LOGPROB_TOL = 1e-4
MAX_BATCH = 4  # most sequences in one step anywhere in the module

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Every morning the fox runs to the river, drinks cold "
             "water, and then returns to the forest to sleep under the old oak tree.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TIMETABLE = "Monday: math, Tuesday: history, Wednesday: chemistry, Thursday: art, Friday: music, Saturday: football"
ESSAY = ("The first bridges were fallen trees laid across streams, and for thousands of years most crossings stayed "
         "that simple: a beam of wood, a slab of stone, a rope of twisted vines. The Romans changed the scale of the "
         "problem with arches of cut stone.")
COPY_TASKS = {
    "paragraph": "Repeat this paragraph exactly: " + PARAGRAPH,
    "code": "Rename the function add to plus in this code and show the full code:\n" + CODE,
    "timetable": "Copy this timetable exactly, one day per line:\n" + TIMETABLE,
}
LONG_TASK = "Repeat the first sentence of this text exactly.\n\n" + ESSAY
# The early exit agrees with the target on these two; on the paragraph it drafts for many steps and accepts little.
SELF_DRAFT_TASKS = ("code", "timetable")


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    """Greedy sampling params (temperature 0)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@dataclasses.dataclass(frozen=True)
class Req:
    """One request: id, prompt token ids (chat-templated), params."""

    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Block:
    """One step that sampled for one sequence: what it produced and what the stop rules kept.

    Attributes:
      drafts: drafts verified (0: a prefill chunk's or a plain decode's single token).
      emitted: tokens the step produced (accepted drafts + the target's own token).
      kept: of those, the tokens appended to the output (fewer than emitted when a stop rule ended the sequence
        inside the block).
      finished: the sequence finished in this step.
    """

    drafts: int
    emitted: int
    kept: int
    finished: bool


@dataclasses.dataclass
class Run:
    """Final outputs by request id; every sampling step's `Block` by (request id, sample index), in order; and
    each engine step's chunks (drafts included), in order."""

    outputs: dict[str, RequestOutput]
    blocks: dict[tuple[str, int], list[Block]]
    steps: list[list[ScheduledChunk]]

    def last_block(self, rid: str, index: int = 0) -> Block:
        """The step in which the sequence finished."""
        last = self.blocks[(rid, index)][-1]
        assert last.finished
        return last

    def all_blocks(self) -> list[Block]:
        """Every sequence's blocks."""
        return [b for bs in self.blocks.values() for b in bs]

    def inside_positions(self, rid: str) -> list[int]:
        """Output positions of tokens that a step emitted with more tokens after them (accepted drafts)."""
        out, pos = [], 0
        for b in self.blocks[(rid, 0)]:
            out += range(pos, pos + b.kept - 1)
            pos += b.kept
        return out


# ---------------------------------------------------------------------------------------------------------------
# Engines


@pytest.fixture(scope="module")
def _load_once() -> Iterator[None]:
    """The module's engines share one parsed checkpoint (the GGUF parse and dequantisation take seconds)."""
    real, memo = startup_module.load_model, {}

    def load(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = real(*args, **kwargs)
        return memo[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(startup_module, "load_model", load)
        yield


def _make(spec: dict | None) -> Engine:
    engine = Engine(EngineConfig.create(dtype="float32", warmup=False, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                 kv_cache_memory_bytes=NUM_PAGES * PAGE_BYTES, speculative_config=spec))
    assert engine.page_allocator.num_usable_pages == NUM_PAGES
    assert engine.prefix_cache is not None
    return engine


@pytest.fixture(scope="module")
def off(_load_once) -> Engine:
    return _make(None)


@pytest.fixture(scope="module")
def ngram(_load_once) -> Engine:
    return _make({"method": "ngram", "num_speculative_tokens": 8})


@pytest.fixture(scope="module")
def self_draft(_load_once) -> Engine:
    return _make({"method": "self_draft", "num_speculative_tokens": 8, "num_draft_layers": DRAFT_LAYERS})


@pytest.fixture(autouse=True)
def clean_engines(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with empty prefix caches and leaves its engines idle with every page free."""
    names = set(request.fixturenames)
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "method" in callspec.params:
        names.add(callspec.params["method"])
    engines = [request.getfixturevalue(n) for n in ("off", "ngram", "self_draft") if n in names]
    for engine in engines:
        engine.reset_prefix_cache()
    yield
    for engine in engines:
        for seq in engine.scheduler.running + engine.scheduler.waiting:  # a failed test's leftovers
            engine.abort(seq.request_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert_idle(engine)


def assert_idle(engine: Engine) -> None:
    """Nothing runs and every page is free (cached pages nobody owns count as free)."""
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished()
    assert engine.page_allocator.num_free_pages == engine.page_allocator.num_usable_pages


@contextlib.contextmanager
def speculation(engine: Engine, **changes) -> Iterator[None]:
    """Runs the block with the engine's speculative config changed (e.g. num_speculative_tokens) and fresh spec_*
    counters; see the module docstring."""
    assert_idle(engine)
    config, policy = engine.spec_config, engine.spec_policy
    engine.spec_config = dataclasses.replace(config, **changes)
    engine.spec_policy = SpeculationPolicy(engine.spec_config, jax.default_backend())
    try:
        yield
    finally:
        engine.spec_config, engine.spec_policy = config, policy


# ---------------------------------------------------------------------------------------------------------------
# Running and comparing


def chat(engine: Engine, text: str) -> tuple[int, ...]:
    """`text` as a user turn in the chat template, ready for the assistant's reply."""
    return tuple(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True))


def run(engine: Engine, reqs: list[Req], arrivals: dict[int, list[Req]] | None = None,
        max_steps: int = 1000) -> Run:
    """Adds `reqs` (and `arrivals[s]` before step s), steps until all finish, and records every `Block`.

    Checks on the way: no running sequence holds pages past its tokens after a step (those of rejected drafts and
    unused slots were freed), a request reports `finished` once, and the concatenated deltas (ids and text) of each
    completion equal its final ids and text.
    """
    pending = {s: list(v) for s, v in (arrivals or {}).items()}
    pending[0] = list(reqs) + pending.get(0, [])
    blocks: dict[tuple[str, int], list[Block]] = {}
    steps: list[list[ScheduledChunk]] = []
    sched = engine.scheduler
    real_update = sched.update

    def recording_update(output, sampled):
        before = {id(c.seq): len(c.seq.output_token_ids) for c in output.chunks}
        produced = real_update(output, sampled)
        steps.append(list(output.chunks))
        got_tokens = {id(seq) for seq in produced}
        for c in output.chunks:
            if c.samples and id(c.seq) in got_tokens:
                value = sampled[c.seq.seq_id]
                blocks.setdefault((c.seq.request_id, c.seq.sample_index), []).append(Block(
                    drafts=c.num_draft_tokens, emitted=len(value) if isinstance(value, (list, tuple)) else 1,
                    kept=len(c.seq.output_token_ids) - before[id(c.seq)], finished=c.seq.is_finished))
        return produced

    sched.update = recording_update
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, dict[int, list]] = {}
    added: list[str] = []
    ok = False
    try:
        step = 0
        while pending or engine.has_unfinished_requests():
            for r in pending.pop(step, []):
                added.append(engine.add_request(list(r.prompt), r.params, request_id=r.rid))
            step += 1
            if not engine.has_unfinished_requests():
                continue
            outs = engine.step()
            for seq in engine.scheduler.running:  # the pages of rejected drafts went back
                assert len(seq.page_ids) <= -(-seq.num_tokens // PS), seq.request_id
            for out in outs:
                assert out.request_id not in final, f"{out.request_id} reported after it finished"
                acc = streamed.setdefault(out.request_id, {})
                for c in out.outputs:
                    ids, text = acc.get(c.index, ([], ""))
                    acc[c.index] = (ids + c.delta_token_ids, text + c.delta_text)
                if out.finished:
                    final[out.request_id] = out
            assert step < max_steps, "requests did not finish"
        ok = True
    finally:
        del sched.update  # back to the class's method
        if not ok:
            for rid in added:
                engine.abort(rid)
            while engine.has_unfinished_requests():
                engine.step()
    assert set(final) == set(added)
    for rid, out in final.items():
        for c in out.outputs:
            assert streamed[rid][c.index] == (c.token_ids, c.text), f"{rid}[{c.index}]: streamed deltas differ"
    return Run(final, blocks, steps)


class Refs:
    """Spec-off outputs of requests, memoised by (prompt, params); missing ones are computed in batches."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._memo: dict[tuple, RequestOutput] = {}

    def get(self, reqs: list[Req]) -> dict[str, RequestOutput]:
        """The reference output of each request, by its rid."""
        missing = {(r.prompt, r.params): r for r in reqs if (r.prompt, r.params) not in self._memo}
        keys = list(missing)
        for i in range(0, len(keys), MAX_BATCH):
            batch = {key: dataclasses.replace(missing[key], rid=f"ref-{i + j}")
                     for j, key in enumerate(keys[i : i + MAX_BATCH])}
            outs = run(self.engine, list(batch.values())).outputs
            for key, r in batch.items():
                self._memo[key] = outs[r.rid]
        return {r.rid: self._memo[(r.prompt, r.params)] for r in reqs}


@pytest.fixture(scope="module")
def refs(off: Engine) -> Refs:
    return Refs(off)


def assert_same(got: RequestOutput, ref: RequestOutput, ref_index: int | None = None) -> None:
    """Each completion of `got` equals the reference's (or the reference's completion `ref_index`, to compare n > 1
    samples with n = 1): ids, text, finish reason, and log-probabilities to LOGPROB_TOL, one entry per token."""
    assert got.outputs
    if ref_index is None:
        assert len(got.outputs) == len(ref.outputs)
    for c in got.outputs:
        r = ref.outputs[c.index if ref_index is None else ref_index]
        name = f"{got.request_id}[{c.index}]"
        assert c.error is None and c.finish_reason in ("stop", "length"), (name, c.finish_reason, c.error)
        assert c.token_ids == r.token_ids, name
        assert c.text == r.text, name
        assert c.finish_reason == r.finish_reason, name
        assert (c.logprobs is None) == (r.logprobs is None), name
        if r.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids) == len(r.logprobs), name
            for pos, (entry, ref_entry) in enumerate(zip(c.logprobs, r.logprobs)):
                assert list(entry) == list(ref_entry), (name, pos)
                for token, want in ref_entry.items():
                    got = entry[token]
                    assert got.logprob == pytest.approx(want.logprob, abs=LOGPROB_TOL), (name, pos, token)
                    assert (got.rank, got.decoded_token) == (want.rank, want.decoded_token), (name, pos, token)
            assert c.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=LOGPROB_TOL * len(c.token_ids))
        assert c.stop_reason == r.stop_reason, name


def assert_all_same(r: Run, ref: dict[str, RequestOutput]) -> None:
    """Every request of the run equals its reference."""
    assert set(r.outputs) == set(ref)
    for rid, out in r.outputs.items():
        assert_same(out, ref[rid])


def spec_stats(engine: Engine) -> dict[str, float]:
    """The engine's spec_* counters (since the current `speculation()` block began)."""
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_")}


def copy_reqs(engine: Engine, params: SamplingParams = greedy(), prefix: str = "",
              tasks: tuple[str, ...] = tuple(COPY_TASKS)) -> list[Req]:
    """One request per copy task (of `tasks`)."""
    return [Req(f"{prefix}{name}", chat(engine, COPY_TASKS[name]), params) for name in tasks]


def method_reqs(engine: Engine, method: str) -> list[Req]:
    """The copy requests a proposer is tested on."""
    return copy_reqs(engine, tasks=SELF_DRAFT_TASKS if method == "self_draft" else tuple(COPY_TASKS))


# ---------------------------------------------------------------------------------------------------------------
# 1. Greedy outputs equal speculation off, for both proposers and k = 1, 2, 4, 8


@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_greedy_outputs_equal_spec_off(request: pytest.FixtureRequest, refs: Refs, method: str, k: int) -> None:
    engine: Engine = request.getfixturevalue(method)
    reqs = method_reqs(engine, method)
    ref = refs.get(reqs)
    with speculation(engine, num_speculative_tokens=k, max_step_tokens=4 * (k + 1)):  # k for up to 4 decoding
        r = run(engine, reqs)
        stats = spec_stats(engine)
    assert_all_same(r, ref)
    blocks = r.all_blocks()
    assert all(b.drafts <= k and 1 <= b.emitted <= b.drafts + 1 for b in blocks)
    assert sum(b.drafts for b in blocks) == stats["spec_draft_tokens"]
    assert sum(b.emitted - 1 for b in blocks) == stats["spec_accepted_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # and some were rejected
    if method == "ngram":
        assert any(b.emitted == k + 1 for b in blocks)  # a whole block accepted, plus the target's bonus token
        # the copy ends with EOS, which the prompt has right after the text: drafted, accepted, tokens after it dropped
        assert any(b.finished and b.kept < b.emitted and r.outputs[rid].outputs[0].finish_reason == "stop"
                   for (rid, _), bs in r.blocks.items() for b in bs)


# ---------------------------------------------------------------------------------------------------------------
# 2. Stops inside an accepted block


def two_token_stop_string(engine: Engine, reply: list[int], positions: list[int]) -> tuple[str, int]:
    """A stop string of the text of reply tokens p-1 and p that first appears in the reply at token p, for the first
    p of `positions` that has one; returns (string, p)."""
    decode = engine.tokenizer.decode
    for p in positions:
        s = decode(reply[p - 1 : p + 1]).strip()
        if len(s) >= 4 and " " in s and s not in decode(reply[:p]) and s in decode(reply[: p + 1]):
            return s, p
    raise AssertionError(f"no two-token stop string ends at one of the positions {positions}")


@pytest.mark.parametrize("k", [4, 8])
def test_stops_inside_an_accepted_block(ngram: Engine, refs: Refs, k: int) -> None:
    prompt = chat(ngram, COPY_TASKS["paragraph"])
    tok = ngram.tokenizer
    paragraph = tok.encode(PARAGRAPH)
    # Batches of 4 must not shrink k for the step (rule 1 of the policy): these requests each see k.
    with speculation(ngram, num_speculative_tokens=k, max_step_tokens=4 * (k + 1)):
        # The paragraph and EOS (whose place in a block the k sweep asserts), and max_tokens and min_tokens cutting
        # in while the copy is accepted.
        limits = [Req("eos", prompt, greedy(48)), Req("max_7", prompt, greedy(7)),
                  Req("max_13", prompt, greedy(13)), Req("min_tokens", prompt, greedy(48, min_tokens=len(paragraph)))]
        first = run(ngram, limits)
        reply = first.outputs["eos"].outputs[0].token_ids
        assert reply[:-1] == paragraph and reply[-1] in tok.eos_ids
        # Stops at tokens the first run emitted inside a block, followed by more tokens of that block.
        inside = [p for p in first.inside_positions("eos") if 4 <= p < len(paragraph)]
        assert len(inside) >= 8, inside
        stop_id_at = next(p for p in inside if reply[p] not in reply[:p])
        s1, p1 = two_token_stop_string(ngram, reply, inside)
        s2, p2 = two_token_stop_string(ngram, reply, [p for p in inside if p > p1 + 1])
        s3, p3 = two_token_stop_string(ngram, reply, [p for p in inside if p > p2 + 1])
        stops = [Req("stop_id", prompt, greedy(48, stop_token_ids=[reply[stop_id_at]], logprobs=2)),
                 Req("stop_string", prompt, greedy(48, stop=[s2])),
                 Req("stop_string_included", prompt, greedy(48, stop=[s1], include_stop_str_in_output=True)),
                 Req("two_stop_strings", prompt, greedy(48, stop=[s3, s2]))]  # the earlier match wins
        second = run(ngram, stops)
        stats = spec_stats(ngram)
    ref = refs.get(limits + stops)
    assert_all_same(first, {r.rid: ref[r.rid] for r in limits})
    assert_all_same(second, {r.rid: ref[r.rid] for r in stops})
    assert stats["spec_accepted_tokens"] > 0
    reasons = {rid: out.outputs[0].stop_reason for rid, out in (first.outputs | second.outputs).items()}
    assert reasons == {"eos": None, "max_7": None, "max_13": None, "min_tokens": None, "stop_id": reply[stop_id_at],
                       "stop_string": s2, "stop_string_included": s1, "two_stop_strings": s2}

    # where the reference stopped
    text = tok.decode(paragraph)
    out = {rid: o.outputs[0] for rid, o in (first.outputs | second.outputs).items()}
    assert out["eos"].finish_reason == "stop" and out["eos"].text == PARAGRAPH
    assert out["stop_id"].token_ids == reply[: stop_id_at + 1] and out["stop_id"].finish_reason == "stop"
    for rid, s, p, included in (("stop_string", s2, p2, False), ("stop_string_included", s1, p1, True),
                                ("two_stop_strings", s2, p2, False)):
        assert out[rid].token_ids == reply[: p + 1], rid
        assert out[rid].text == text[: text.index(s) + (len(s) if included else 0)], rid
        assert out[rid].finish_reason == "stop", rid
    # each stop came from an accepted draft, and its step emitted tokens after it, which were dropped
    for rid in ("stop_id", "stop_string", "stop_string_included", "two_stop_strings"):
        last = second.last_block(rid)
        assert last.drafts > 0 and last.kept < last.emitted, (rid, last)
    # max_tokens: blocks never reach past it, so nothing is dropped
    for rid, n in (("max_7", 7), ("max_13", 13)):
        assert out[rid].finish_reason == "length" and len(out[rid].token_ids) == n, rid
        assert all(b.kept == b.emitted for b in first.blocks[(rid, 0)]), rid
    assert any(first.last_block(rid).emitted > 1 for rid in ("max_7", "max_13"))  # max_tokens ended a block
    # min_tokens: EOS is banned on a whole block, so blocks stop before min_tokens; EOS may then end the
    # output right after it (the reference's EOS is token min_tokens + 1)
    assert out["min_tokens"].token_ids == reply
    done = 0
    for b in first.blocks[("min_tokens", 0)]:
        assert done >= len(paragraph) or done + b.emitted <= len(paragraph), "a block reached past min_tokens"
        done += b.kept


# ---------------------------------------------------------------------------------------------------------------
# 3. Interplay with the rest of the engine


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_preemption(request: pytest.FixtureRequest, refs: Refs, method: str) -> None:
    engine: Engine = request.getfixturevalue(method)
    reqs = method_reqs(engine, method)
    ref = refs.get(reqs)
    need = [-(-(len(r.prompt) + MAX_TOKENS) // PS) for r in reqs]
    before = engine.stats()["preemptions"]
    with speculation(engine, num_speculative_tokens=4), held_pages(engine, keep_free=max(need) + 2):
        r = run(engine, reqs)
        stats = spec_stats(engine)
    assert engine.stats()["preemptions"] - before > 0
    assert stats["spec_accepted_tokens"] > 0
    assert_all_same(r, ref)


def test_prefix_cache_hit(ngram: Engine, refs: Refs) -> None:
    reqs = copy_reqs(ngram, tasks=("paragraph", "timetable"))
    ref = refs.get(reqs)
    with speculation(ngram, num_speculative_tokens=4):
        first = run(ngram, reqs)
        hits_before = ngram.stats()["prefix_cache_hit_tokens"]
        again = run(ngram, [dataclasses.replace(r, rid=r.rid + "-again") for r in reqs])
        stats = spec_stats(ngram)
    assert ngram.stats()["prefix_cache_hit_tokens"] > hits_before
    for out in again.outputs.values():  # every full page of the prompt (its last token is always computed)
        n = len(out.prompt_token_ids)
        assert out.num_cached_tokens == min(n // PS * PS, n - 1) > 0
    assert stats["spec_accepted_tokens"] > 0
    assert_all_same(first, ref)
    assert_all_same(again, {r.rid + "-again": ref[r.rid] for r in reqs})


def test_follow_up_hits_pages_completed_by_accepted_drafts(off: Engine, ngram: Engine) -> None:
    """A follow-up prompt that extends a reply (prompt + reply + more) finds the reply's full pages in the prefix
    cache, as many with speculation as without: pages completed inside a block of accepted drafts are cached too."""
    prompt = chat(ngram, COPY_TASKS["paragraph"])
    cached, outputs = {}, {}
    for name, engine in (("off", off), ("ngram", ngram)):
        with speculation(engine, num_speculative_tokens=8) if name == "ngram" else contextlib.nullcontext():
            reply = run(engine, [Req("first", prompt, greedy(48))]).outputs["first"].outputs[0].token_ids
            follow_up = prompt + tuple(reply) + tuple(engine.tokenizer.encode("\nThanks!"))
            out = run(engine, [Req("follow-up", follow_up, greedy(4))]).outputs["follow-up"]
            cached[name], outputs[name] = out.num_cached_tokens, out
            if name == "ngram":
                assert spec_stats(engine)["spec_accepted_tokens"] > 0
    assert_same(outputs["ngram"], outputs["off"])
    assert cached["off"] == (len(prompt) + len(reply) - 1) // PS * PS  # every full page of prompt + reply
    assert cached["ngram"] == cached["off"]


def test_chunked_prefill(ngram: Engine, refs: Refs) -> None:
    short = Req("short", chat(ngram, COPY_TASKS["paragraph"]), greedy())
    long = Req("long", chat(ngram, LONG_TASK), greedy(24))
    assert len(long.prompt) >= 80
    ref = refs.get([short, long])
    budget = 16
    with speculation(ngram, num_speculative_tokens=4), scheduler_limits(ngram, max_num_batched_tokens=budget):
        r = run(ngram, [short], arrivals={3: [long]})
        stats = spec_stats(ngram)
    assert stats["spec_accepted_tokens"] > 0
    assert_all_same(r, ref)
    assert all(sum(len(c.token_ids) for c in step) <= budget for step in r.steps)
    # the long prompt's prefill took several steps, next to the short request's verify blocks
    partial = [step for step in r.steps if any(c.seq.request_id == "long" and not c.samples for c in step)]
    assert len(partial) >= 5
    assert sum(1 for step in partial if any(c.num_draft_tokens for c in step)) >= 3
    assert any(b.drafts for b in r.blocks[("long", 0)])


def test_n_greedy_samples(ngram: Engine, refs: Refs) -> None:
    req = Req("paragraph", chat(ngram, COPY_TASKS["paragraph"]), greedy())
    ref = refs.get([req])["paragraph"]
    with speculation(ngram, num_speculative_tokens=4):
        r = run(ngram, [dataclasses.replace(req, params=greedy(n=3))])
        stats = spec_stats(ngram)
    assert stats["spec_accepted_tokens"] > 0
    out = r.outputs["paragraph"]
    assert len(out.outputs) == 3
    assert_same(out, ref, ref_index=0)
    assert all(any(b.kept > 1 for b in r.blocks[("paragraph", i)]) for i in range(3))


def test_logprobs(ngram: Engine, refs: Refs) -> None:
    reqs = copy_reqs(ngram, greedy(24, logprobs=3))
    ref = refs.get(reqs)
    with speculation(ngram, num_speculative_tokens=4):
        r = run(ngram, reqs)
        stats = spec_stats(ngram)
    assert stats["spec_accepted_tokens"] > 0
    assert_all_same(r, ref)
    assert all(len(entry) == 3 for q in reqs for entry in r.outputs[q.rid].outputs[0].logprobs)


def test_concurrent_requests_joining_a_running_batch(ngram: Engine, refs: Refs) -> None:
    reqs = copy_reqs(ngram, prefix="c-") + [Req("c-prose", chat(ngram, "Write two sentences about the sea."),
                                               greedy(30))]
    ref = refs.get(reqs)
    with speculation(ngram, num_speculative_tokens=8):  # the default max_step_tokens: k shrinks with the batch
        policy = ngram.spec_policy
        r = run(ngram, reqs[:2], arrivals={2: reqs[2:3], 4: reqs[3:]})
        stats = spec_stats(ngram)
    assert stats["spec_accepted_tokens"] > 0
    assert_all_same(r, ref)
    full = shrunk = False  # a block drafted to its step's k; a step with several decoding reserved a smaller k
    for step in r.steps:
        decodes = [c for c in step if c.samples and len(c.token_ids) == c.num_draft_tokens + 1]
        k = policy.step_k(len(decodes)) if decodes else 0
        assert all(c.num_draft_tokens <= c.spec_slots <= k for c in decodes)
        full |= k > 0 and any(c.num_draft_tokens == k for c in decodes)
        shrunk |= 0 < k < 8 and any(c.spec_slots == k and c.num_draft_tokens for c in decodes)
    assert full and shrunk
