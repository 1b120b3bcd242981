"""Smoke test of `jaxinfer bench sharding`: a tiny random Llama at tp 1 in the plain child and tp 2 in the 8-device one;
checks the rows, the heads against the config, and the section."""

from __future__ import annotations

import json

from jaxinfer.benchmarks.sharding import SECTION
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_sharding_smoke(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "sharding", "--model", str(model), "--tps", "2", "--batches", "2",
                                "--context", "20", "--reps", "1", "--kv-cache-memory-bytes", str(1 << 20))
    data = report["data"]
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    assert data["devices"] == 8
    assert [(r["tp"], r["one_device"]) for r in data["rows"]] == [(1, True), (2, False)]
    heads = f"{config['num_attention_heads']}/{config['num_key_value_heads']}"
    assert all(r["heads"] == heads for r in data["rows"] if r["tp"] == 1)
    assert data["model"]["num_layers"] == config["num_hidden_layers"]
    for r in data["rows"]:
        assert r["batch"] == 2 and r["context"] == 20
        assert_positive_finite(r["ms"], f"tp {r['tp']} ms")
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Tensor parallelism" in section and f"{2 * config['num_hidden_layers'] + 1} all-reduces" in section
    assert "| 1 (plain) |" in section and "| 2 |" in section and "at tp 2" in section
