"""Smoke test of `jaxinfer bench breakdown` on the tiny HF Llama: every part of every step timed and reported."""

from __future__ import annotations

import pytest

from jaxinfer.benchmarks.breakdown import PARTS, SECTION
from jaxinfer.cli import main
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench


def test_breakdown_report(tmp_path):
    report, written = run_bench(tmp_path, "breakdown", "--model", str(TINY_LLAMA), "--dtypes", "float32",
                                "--context", "20", "--batches", "3", "--prefill-len", "24", "--rounds", "1")
    rows = report["data"]["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("decode batch 3, context 20", 3), ("prefill 24", 1)]
    for r in rows:
        for part in PARTS:
            assert_positive_finite(r[part], part)
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "| float32 | prefill 24 |" in section and "dense matmuls" in section


@pytest.mark.parametrize("options, message", [
    (["--batches", "0"], "--batches '0': expected comma-separated integers >= 1"),
    (["--context", "0"], "--context 0 must be >= 1"),
    (["--prefill-len", "-5"], "--prefill-len -5 must be >= 0"),
    (["--context", "100000"], "exceed the model's context (256 tokens)"),
])
def test_breakdown_refuses_bad_options(options, message, capsys):
    assert main(["bench", "breakdown", "--model", str(TINY_LLAMA), *options]) != 0
    assert message in capsys.readouterr().err
