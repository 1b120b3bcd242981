"""`jaxinfer bench soak`: the checks of one outcome (each kind of wrong answer is caught), and a smoke run against a
tiny random Llama served on loopback, with one reference deliberately corrupted: the report must show exactly that
one mismatch and every other check passing."""

from __future__ import annotations

import json

import pytest

from jaxinfer.benchmarks import soak, soak_client
from jaxinfer.benchmarks.soak import SECTION, failed
from jaxinfer.benchmarks.soak_client import Outcome, check_outcome, reference_mismatch
from jaxinfer.benchmarks.soak_plan import PlannedRequest, draw_plan, parse_range
from jaxinfer.cli import main
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model


def _request(max_tokens: int = 4, ignore_eos: bool = False) -> PlannedRequest:
    return PlannedRequest(index=7, sampling="greedy", input="text", prompt_len=10, max_tokens=max_tokens,
                          ignore_eos=ignore_eos, seed=None, cancel=None, prompt_tokens=11)


def _outcome(ids: list[int], finish: str, status: str = "completed", usage: tuple | None = None) -> Outcome:
    return Outcome(status, ids, finish, (11, len(ids)) if usage is None else usage, 0.0, 0.1, 0.2)


def test_check_outcome_accepts_right_endings_and_names_each_wrong_one():
    assert check_outcome(_request(), _outcome([5, 6, 7, 8], "length")) is None
    assert check_outcome(_request(), _outcome([5, 6], "stop")) is None
    assert check_outcome(_request(), _outcome([5, 6], "", status="cancelled", usage=())) is None
    assert check_outcome(_request(), _outcome([], "", status="UNAVAILABLE")) is None  # counted as an error instead
    wrong = {
        "length after 3 tokens": (_request(), _outcome([5, 6, 7], "length")),
        "length after 5 tokens": (_request(), _outcome([5, 6, 7, 8, 9], "length")),
        "stop after 2 tokens": (_request(ignore_eos=True), _outcome([5, 6], "stop")),
        "stop after 5 tokens": (_request(), _outcome([5, 6, 7, 8, 9], "stop")),
        "finish_reason 'error'": (_request(), _outcome([5], "error")),
        "finish_reason ''": (_request(), _outcome([5, 6, 7, 8], "")),
        "usage (prompt, completion tokens) (11, 3)": (_request(), _outcome([5, 6, 7, 8], "length", usage=(11, 3))),
        "usage (prompt, completion tokens) (12, 4)": (_request(), _outcome([5, 6, 7, 8], "length", usage=(12, 4))),
        "usage (prompt, completion tokens) None": (_request(), Outcome("completed", [5], "stop", None, 0, 0, 0)),
        "cancelled after 5 tokens": (_request(), _outcome([5, 6, 7, 8, 9], "", status="cancelled")),
    }
    for expected, (r, o) in wrong.items():
        problem = check_outcome(r, o)
        assert problem is not None and expected in problem, (expected, problem)


def test_reference_mismatch_names_the_first_difference():
    r = _request()
    assert reference_mismatch(r, _outcome([5, 6, 7, 8], "length"), _outcome([5, 6, 7, 8], "length")) is None
    problem = reference_mismatch(r, _outcome([5, 6, 7, 8], "length"), _outcome([5, 6, 9, 8], "length"))
    assert "request 7" in problem and "first difference at token 2" in problem
    problem = reference_mismatch(r, _outcome([5, 6], "stop"), _outcome([5, 6, 7, 8], "length"))
    assert "2 tokens (stop) under load, 4 (length) alone" in problem
    assert "the reference failed: UNAVAILABLE" in reference_mismatch(r, _outcome([5], "stop"),
                                                                     _outcome([], "", status="UNAVAILABLE"))


def test_failed_lists_every_failed_check():
    ok = {"errors": {}, "wrong": 0, "mismatches": 0, "server_exit_status": 0,
          "end": {"kv_pages_used": 0, "running": 0, "waiting": 0, "health": "SERVING"}}
    assert failed(ok) == []
    bad = {"errors": {"UNAVAILABLE": 1}, "wrong": 2, "mismatches": 3, "server_exit_status": 1,
           "end": {"kv_pages_used": 4, "running": 1, "waiting": 0, "health": "NOT_SERVING"}}
    assert failed(bad) == ["errors", "wrong endings or usage", "reference mismatches", "pages in use at the end",
                           "requests running or waiting at the end", "health NOT_SERVING", "server exit status 1"]


def test_plan_options():
    assert parse_range("4-64", "--x") == (4, 64) and parse_range("8", "--x") == (8, 8)
    for bad in ("64-4", "0-3", "a-b", "4-"):
        with pytest.raises(ValueError, match="--x"):
            parse_range(bad, "--x")
    plan = draw_plan(400, 3, 0.25, (4, 64), (8, 1000))
    assert plan == draw_plan(400, 3, 0.25, (4, 64), (8, 1000))  # the same seed, the same requests
    assert {r.sampling for r in plan} == {"greedy", "seeded", "unseeded"} and {r.input for r in plan} == {
        "text", "chat", "token_ids"}
    assert all(4 <= r.max_tokens <= 64 and 8 <= r.prompt_len <= 1000 for r in plan)
    assert all((r.seed is not None) == (r.sampling == "seeded") for r in plan)
    cancelled = [r for r in plan if r.cancel]
    assert 60 <= len(cancelled) <= 140 and {r.cancel for r in cancelled} == {"before_first", "mid_stream"}
    assert all(1 <= r.cancel_after_tokens < r.max_tokens for r in cancelled if r.cancel == "mid_stream")
    with pytest.raises(ValueError, match="--cancel-share"):
        draw_plan(4, 0, 1.5, (4, 64), (8, 1000))


def test_soak_smoke_reports_a_corrupted_reference_and_nothing_else(tmp_path, monkeypatch):
    model = make_tiny_chat_model(tmp_path / "tiny")
    corrupted, scraped = [], []
    real_references, real_scrape = soak.references, soak_client.scrape

    async def corrupt_first_reference(stub, sample, timeout_s):
        refs = await real_references(stub, sample, timeout_s)
        refs[0].token_ids = refs[0].token_ids[:-1] + [(refs[0].token_ids[-1] + 1) % 128]
        corrupted.append(sample[0].index)
        return refs

    def spy_scrape(url):
        scraped.append(real_scrape(url))
        return scraped[-1]

    monkeypatch.setattr(soak, "references", corrupt_first_reference)
    monkeypatch.setattr(soak_client, "scrape", spy_scrape)
    plan = draw_plan(12, 0, 0.5, (2, 8), (8, 30))
    must_cancel = sum(r.cancel == "mid_stream" and r.ignore_eos for r in plan)  # nothing can end these early
    assert must_cancel >= 1
    out_json, out_md = tmp_path / "soak.json", tmp_path / "BENCHMARKS.md"
    status = main(["bench", "soak", "--start-server", "--model", str(model), "--server-log",
                   str(tmp_path / "serve.log"), "--requests", "12", "--concurrency", "2", "--cancel-share", "0.5",
                   "--prompt-len-range", "8-30", "--max-tokens-range", "2-8", "--seed", "0", "--health-timeout-s",
                   "300", "--json", str(out_json), "--write", str(out_md),
                   "--", "--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "32",
                   "--no-warmup"])
    data = json.loads(out_json.read_text())["data"]
    assert status == 1 and data["exit_status"] == 1 and data["failed"] == ["reference mismatches"]
    assert data["mismatches"] == 1 and len(corrupted) == 1
    assert data["mismatch_examples"][0].startswith(f"request {corrupted[0]} ")
    assert data["references_checked"] >= 1 and data["references_checked"] == data["references_eligible"]
    assert data["sent"] == 12 and data["completed"] + data["cancelled"] == 12 and data["errors"] == {}
    assert data["cancelled"] >= must_cancel and data["wrong"] == 0 and data["server_exit_status"] == 0
    end, last = data["end"], scraped[-1]
    assert end["kv_pages_used"] == end["running"] == end["waiting"] == data["pages_leaked"] == 0
    assert end["health"] == "SERVING" and end["kv_pages_total"] == last["jaxinfer:kv_pages_total"] > 0
    assert last["jaxinfer:kv_pages_used"] == 0
    assert data["model"]["max_model_len"] == 64 and data["settings"]["concurrency"] == 2
    for key in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "load_s"):
        assert_positive_finite(data[key], key)
    written = out_md.read_text()
    section = written[written.index(SECTION[0]): written.index(SECTION[1])]
    assert "## gRPC soak test" in section and "12 `Generate` requests from 2 concurrent streams" in section
    assert "machine: nproc" in section and "FAILED: reference mismatches" in section
