"""Smoke test of `jaxinfer bench kv_handoff` on the tiny random Llama-3: every length and wire dtype, the payload's
bytes as its shapes give them (2 layers x 2 KV heads x 16 head dims, K and V, plus f32 scales for int8), positive
times, and the section."""

from __future__ import annotations

from jaxinfer.benchmarks.kv_handoff import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_kv_handoff_smoke(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "kv_handoff", "--model", str(model), "--lengths", "8,20",
                                "--wire", "float32,int8", "--reps", "1")
    rows = report["data"]["rows"]
    assert [(r["tokens"], r["wire"]) for r in rows] == [(n, w) for n in (8, 20) for w in ("float32", "int8")]
    numbers = 2 * 2 * 2 * 16  # per token: layers x KV heads x (K, V) x head dim
    for r in rows:
        per_token = numbers * 4 if r["wire"] == "float32" else numbers + 2 * 2 * 2 * 4  # int8 + f32 scales
        assert r["bytes"] == per_token * r["tokens"], r
        for key in ("export_ms", "import_ms", "export_us_per_token", "import_us_per_token"):
            assert_positive_finite(r[key], key)
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## KV handoff" in section and "| 20 | int8 |" in section and "machine: nproc" in section
