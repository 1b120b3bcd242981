"""Smoke test of `jaxinfer bench pipeline` and of the execution events it records (`models.pipeline_events`): a
small random Llama over 2 stages in 4 micro-batches, the measuring child with 4 fake devices."""

from __future__ import annotations

from jaxinfer.benchmarks.pipeline import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench


def test_pipeline_smoke_intervals_follow_the_schedule(tmp_path):
    report, written = run_bench(tmp_path, "pipeline", "--pps", "2", "--micro", "4", "--rows", "16", "--context",
                                "20", "--reps", "1", "--hidden", "64")
    data = report["data"]
    assert data["devices"] == 4
    assert [(r["pp"], r["kind"], r["micro_used"]) for r in data["rows"]] == [(2, "uniform", 4), (2, "uneven", 4)]
    for r in data["rows"]:
        by = {(s, m): (a, b) for s, m, a, b in r["intervals"]}
        assert sorted(by) == [(s, m) for s in range(2) for m in range(4)]  # every stage: M' busy intervals, once
        for s in range(2):
            spans = [by[s, m] for m in range(4)]
            assert all(a < b for a, b in spans)
            assert all(spans[m][1] <= spans[m + 1][0] for m in range(3))  # one stage: in order, no overlap
        for m in range(4):
            assert by[0, m][1] <= by[1, m][0]  # stage 1 starts micro-batch m after stage 0 finished it
        assert all(0 <= x <= 1 for x in r["idle"]) and 0 <= r["textbook"] <= 1
        span = max(b for _, _, _, b in r["intervals"]) - min(a for _, _, a, _ in r["intervals"])
        busy = [sum(b - a for s2, _, a, b in r["intervals"] if s2 == s) for s in range(2)]
        assert all(b < span for b in busy)  # neither stage is busy the whole span: a bubble exists
        for what in ("step_ms", "span_ms"):
            assert_positive_finite(r[what], what)
        assert r["textbook"] == 1 / 5
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "### Bubble accounting" in section and "| 2 | uneven | 4 | 0.20 |" in section
