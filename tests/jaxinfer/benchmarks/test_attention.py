"""Smoke test of `jaxinfer bench attention` with the tiny HF Llama's heads: one shape per dtype, a few calls."""

from __future__ import annotations

import json

from jaxinfer.benchmarks.attention import SECTION
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench


def test_attention_report(tmp_path):
    report, written = run_bench(tmp_path, "attention", "--model", str(TINY_LLAMA), "--contexts", "32",
                                "--batches", "2", "--reps", "2")
    hf = json.loads((TINY_LLAMA / "config.json").read_text())
    rows = report["data"]["rows"]
    assert [(r["dtype"], r["context"], r["batch"]) for r in rows] == [("float32", 32, 2), ("bfloat16", 32, 2)]
    for r, itemsize in zip(rows, (4, 2)):
        assert r["kv_bytes"] == 2 * 2 * 32 * hf["num_key_value_heads"] * hf["head_dim"] * itemsize
        assert_positive_finite(r["ms"], "ms")
        assert_positive_finite(r["gb_s"], "gb_s")
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "4 query / 2 KV heads, head dim 16" in section and "| bfloat16 | 2 | 32 |" in section
