"""Smoke test of `jaxinfer bench checkpoint` on the tiny HF Llama (with a word-level tokenizer): one dtype, one
timed load per kind."""

from __future__ import annotations

from jaxinfer.benchmarks.checkpoint import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_checkpoint_report(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "checkpoint", "--model", str(model), "--dtypes", "bfloat16", "--reps", "1")
    data = report["data"]
    assert data["source_kind"] == "HF safetensors"
    assert [(r["source"], r["target"]) for r in data["rows"]] == [
        ("HF safetensors", "host numpy"), ("HF safetensors", "default device (device_put)"),
        ("orbax", "host numpy"), ("orbax", "default device (restored sharded)")]
    for r in data["rows"]:
        for key in ("first_s", "median_s", "min_s", "convert_s"):
            assert_positive_finite(r[key], key)
    assert data["bytes_on_disk"]["source"] == sum(p.stat().st_size for p in model.iterdir())
    assert_positive_finite(data["bytes_on_disk"]["bfloat16"], "orbax bytes")
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "## Checkpoint load: orbax vs HF safetensors (tiny)" in section and "| bfloat16 | orbax |" in section
