"""Smoke test of `jaxinfer bench quant` on the tiny HF Llama: bf16 and int8 (w8a8) weights at batch 1 (each more
batch is one more compile per format), one timed call each; the byte counts are checked against the config's
arithmetic."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.benchmarks.quant import CONTEXT, SECTION
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_quant_report(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "quant", "--model", str(model), "--formats", "bf16;int8 (w8a8)",
                                "--batches", "1", "--reps", "1", "--max-model-len", "256", "--bw-gib", "0.016",
                                "--bw-reps", "1")
    data = report["data"]
    rows = {(r["format"], r["batch"]): r for r in data["rows"]}
    assert list(rows) == [("bf16", 1), ("int8 (w8a8)", 1)]
    for r in data["rows"]:
        for key in ("ms", "tok_s", "roofline_tok_s", "of_roofline", "step_bytes"):
            assert_positive_finite(r[key], key)
        assert r["roofline_tok_s"] == pytest.approx(r["batch"] * data["roofline_gb_s"] * 1e9 / r["step_bytes"])
    cfg, weights = load_hf_weights(model, np.float32)
    bf16_bytes = sum(a.size * 2 for a in jax.tree.leaves(weights))
    assert rows[("bf16", 1)]["weight_bytes"] == bf16_bytes
    assert rows[("int8 (w8a8)", 1)]["weight_bytes"] < bf16_bytes
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    embed = weights.embed.size * 2  # untied: the gather reads `batch` rows of the table
    assert rows[("bf16", 1)]["step_bytes"] == pytest.approx(
        bf16_bytes - embed + embed / cfg.vocab_size + CONTEXT * kv_per_token)
    assert rows[("bf16", 1)]["copies"] == [] and rows[("int8 (w8a8)", 1)]["copies"] == []
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "| int8 (w8a8) | 1 |" in section and "- Batch 1: int8 (w8a8)" in section
