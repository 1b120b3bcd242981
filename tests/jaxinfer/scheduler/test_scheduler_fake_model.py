"""The scheduler driven by the fake model (fake_model.py): stop rules end to end, streaming, batch invariance."""

from __future__ import annotations

import dataclasses
import random

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig, Sequence
from tests.jaxinfer.scheduler.fake_model import EOS_ID, FakeEngine, Result, make_seq, next_token, reference_generate

MAX_MODEL_LEN = 128


def run(requests: list[tuple[list[int], SamplingParams]], *, num_pages: int = 400, page_size: int = 4,
        max_num_seqs: int = 8, max_num_batched_tokens: int = 256, arrival_steps: list[int] | None = None,
        max_model_len: int = MAX_MODEL_LEN) -> tuple[list[Sequence], FakeEngine, Scheduler]:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          page_size=page_size, max_model_len=max_model_len)
    sched = Scheduler(cfg, PageAllocator(num_pages), frozenset({EOS_ID}))
    engine = FakeEngine(num_pages, page_size)
    seqs = [make_seq(i, prompt, params, arrival_time=float(i)) for i, (prompt, params) in enumerate(requests)]
    arrivals: dict[int, list[Sequence]] = {}
    for seq, at in zip(seqs, arrival_steps or [0] * len(seqs)):
        arrivals.setdefault(at, []).append(seq)
    engine.run(sched, arrivals)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    for seq in seqs:
        assert engine.streamed_ids[seq.seq_id] == seq.output_token_ids
        assert "".join(engine.deltas[seq.seq_id]) == seq.text
    return seqs, engine, sched


def result(seq: Sequence) -> Result:
    return Result(seq.output_token_ids, seq.text, seq.finish_reason)


def test_fake_model_worked_example() -> None:
    ctx = [5, 9, 11, 3]
    for _ in range(8):
        ctx.append(next_token(ctx))
    assert ctx[4:] == [15, 8, 38, 34, 18, 39, 47, 39]
    ref = reference_generate([5, 9, 11, 3], SamplingParams(max_tokens=4), MAX_MODEL_LEN)
    assert (ref.text, ref.finish_reason) == ("piiimmmii", "length")


@pytest.mark.parametrize("include, text, deltas",
                         [(False, "pii", ["", "pi", "i"]), (True, "piiimm", ["", "pi", "iimm"])])
def test_stop_string_spanning_tokens_ends_inside_a_token(include: bool, text: str, deltas: list[str]) -> None:
    # Outputs 15 "p", 8 "iii", 38 "mmm": "imm" spans "iii" + "mmm" and ends inside "mmm"; it starts inside "iii".
    params = SamplingParams(max_tokens=20, stop="imm", include_stop_str_in_output=include)
    (seq,), engine, _ = run([([5, 9, 11, 3], params)])
    assert (seq.output_token_ids, seq.text, seq.finish_reason) == ([15, 8, 38], text, "stop")
    # Streamed after "p", "piii", then the end: the last 2 chars are held back while they could start "imm".
    assert engine.deltas[0] == deltas


def _prompts(count: int, seed: int, max_len: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def test_min_tokens_suppresses_eos_and_stop_ids_end_to_end() -> None:
    # Prompts whose natural run ends on EOS within 6 tokens; min_tokens pushes the end past that point.
    early = [p for p in _prompts(400, 1)
             if reference_generate(p, SamplingParams(max_tokens=6), MAX_MODEL_LEN).finish_reason == "stop"]
    assert len(early) >= 3
    stop_id_prompt = _prompts(1, 2)[0]
    natural = reference_generate(stop_id_prompt, SamplingParams(max_tokens=8, ignore_eos=True), MAX_MODEL_LEN)
    requests = [(p, SamplingParams(min_tokens=8, max_tokens=30)) for p in early[:3]]
    requests.append((stop_id_prompt, SamplingParams(min_tokens=5, max_tokens=30,
                                                    stop_token_ids=natural.token_ids[:3], ignore_eos=True)))
    seqs, _, _ = run(requests)
    for seq, (prompt, params) in zip(seqs, requests):
        suppressed = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS_ID})
        assert len(seq.output_token_ids) >= params.min_tokens
        assert not suppressed & set(seq.output_token_ids[: params.min_tokens - 1])
        assert result(seq) == reference_generate(prompt, params, MAX_MODEL_LEN)


def test_min_tokens_defers_stop_strings_end_to_end() -> None:
    # "imm" completes at output 3 (see above); with min_tokens=4 it is not a stop, and later text decides.
    params = SamplingParams(max_tokens=12, min_tokens=4, stop="imm", ignore_eos=True)
    (seq,), _, _ = run([([5, 9, 11, 3], params)])
    assert seq.output_token_ids[:3] == [15, 8, 38] and len(seq.output_token_ids) >= 4
    assert seq.text.startswith("piiimmm")


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_exactly(max_tokens: int) -> None:
    requests = [(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in _prompts(6, 3)]
    seqs, _, _ = run(requests, max_num_batched_tokens=5)
    for seq in seqs:
        assert len(seq.output_token_ids) == max_tokens and seq.finish_reason == "length"


def test_context_limit_gives_length() -> None:
    (seq,), _, _ = run([([1] * 10, SamplingParams(max_tokens=50, ignore_eos=True))], max_model_len=16)
    assert (len(seq.output_token_ids), seq.finish_reason) == (6, "length")


# --- batch invariance -------------------------------------------------------------------------------------------

def _workload() -> list[tuple[list[int], SamplingParams]]:
    """12 requests: prompts of 1..100 tokens, and stop strings, stop ids, min_tokens, EOS, lengths, context limit."""
    rng = random.Random(7)
    requests = []
    for i in range(12):
        prompt = [rng.randrange(1, 50) for _ in range(rng.choice([1, 3, 9, 17, 40, 70, 100]))]
        kind = i % 4
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            stop=["mm", "ccd", "Xp", "ii", "Tb"] if kind == 0 else None,
            stop_token_ids=[rng.randrange(1, 50)] if kind == 1 else None,
            min_tokens=rng.randint(0, 5) if kind == 2 else 0,
            ignore_eos=kind == 3,
            include_stop_str_in_output=i % 3 == 0)
        requests.append((prompt, dataclasses.replace(params, min_tokens=min(params.min_tokens, params.max_tokens))))
    return requests


WORKLOAD = _workload()
EXPECTED = [reference_generate(p, sp, MAX_MODEL_LEN) for p, sp in WORKLOAD]


def test_workload_covers_every_finish_kind() -> None:
    reasons = {(r.finish_reason, r.token_ids[-1] == EOS_ID) for r in EXPECTED}
    assert {("stop", True), ("stop", False), ("length", False)} <= reasons
    assert any(len(p) + len(r.token_ids) >= MAX_MODEL_LEN for (p, _), r in zip(WORKLOAD, EXPECTED))
    stop_string_hits = {sp.include_stop_str_in_output for (_, sp), r in zip(WORKLOAD, EXPECTED)
                        if r.finish_reason == "stop" and r.token_ids[-1] not in {EOS_ID, *sp.stop_token_ids}}
    assert stop_string_hits == {False, True}


def test_each_sequence_alone_matches_the_oracle() -> None:
    for req, expected in zip(WORKLOAD, EXPECTED):
        (seq,), _, _ = run([req])
        assert result(seq) == expected


def test_all_together_and_staggered_match_running_alone() -> None:
    seqs, engine, _ = run(WORKLOAD)
    assert [result(s) for s in seqs] == EXPECTED and engine.stats.max_running == 8
    steps = [0, 0, 1, 3, 3, 4, 9, 10, 20, 21, 40, 41]
    seqs, _, _ = run(WORKLOAD, arrival_steps=steps)
    assert [result(s) for s in seqs] == EXPECTED


@pytest.mark.parametrize("budget", [1, 7, 16, 17, 64])
def test_chunked_prefill_gives_the_same_tokens(budget: int) -> None:
    seqs, engine, _ = run(WORKLOAD, max_num_batched_tokens=budget)
    assert [result(s) for s in seqs] == EXPECTED
    assert engine.stats.max_batched_tokens == budget
    assert engine.stats.num_short_chunks > 0
    if budget > 1:
        assert engine.stats.num_partial_chunks > 0


@pytest.mark.parametrize("page_size, extra_pages", [(1, 0), (4, 0), (4, 3), (16, 1)])
def test_a_tiny_page_pool_preempts_and_gives_the_same_tokens(page_size: int, extra_pages: int) -> None:
    need = max(-(-min(len(p) + sp.max_tokens, MAX_MODEL_LEN) // page_size) for p, sp in WORKLOAD)
    seqs, engine, sched = run(WORKLOAD, num_pages=need + 1 + extra_pages, page_size=page_size,
                              max_num_batched_tokens=32)
    assert [result(s) for s in seqs] == EXPECTED
    assert sched.num_preemptions > 0 and sum(s.num_preemptions for s in seqs) == sched.num_preemptions
