"""Smoke test of `jaxinfer bench structured` on a tiny random Llama: both batch sizes, the three constraints,
positive rates, every pass generating all its tokens, and the section."""

from __future__ import annotations

from jaxinfer.benchmarks.structured import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_structured_smoke(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "structured", "--model", str(model), "--dtype", "float32",
                                "--batches", "1,2", "--max-tokens", "4")
    rows = report["data"]["rows"]
    assert [(r["batch"], r["constraint"]) for r in rows] == [(b, c) for b in (1, 2) for c in ("none", "regex", "json")]
    for r in rows:
        assert r["tokens"] == 4 * r["batch"], r  # ignore_eos: every request ran to max_tokens
        assert_positive_finite(r["tok_s"], "tok_s")
        assert (r["grammar_ms_per_step"] > 0) == (r["constraint"] != "none")
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Structured output" in section and "| 2 | json |" in section and "machine: nproc" in section
