"""Smoke test of `jaxinfer bench structured` on SmolLM2 (the tiny random models' tokenizers have no decoder,
which llguidance needs): both batch sizes, the three constraints,
positive rates, every pass generating all its tokens, and the section."""

from __future__ import annotations

from jaxinfer.benchmarks.structured import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench


def test_structured_smoke(tmp_path):
    report, written = run_bench(tmp_path, "structured", "--dtype", "float32",
                                "--batches", "1,2", "--max-tokens", "4")
    rows = report["data"]["rows"]
    assert [(r["batch"], r["constraint"]) for r in rows] == [(b, c) for b in (1, 2) for c in ("none", "regex", "json")]
    for r in rows:
        assert r["tokens"] == 4 * r["batch"], r  # ignore_eos: every request ran to max_tokens
        assert_positive_finite(r["tok_s"], "tok_s")
    for b in (1, 2):  # masks cost host time only for constrained rows (the others take the no-matcher path)
        none, *constrained = [r["grammar_ms_per_step"] for r in rows if r["batch"] == b]
        assert all(ms > none for ms in constrained), rows
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Structured output" in section and "| 2 | json |" in section and "machine: nproc" in section
