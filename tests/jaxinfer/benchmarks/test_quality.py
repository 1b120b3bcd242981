"""Smoke tests of `jaxinfer bench quality` on the tiny HF Llama (word-level tokenizer) over a short text of its
words: one configuration, and a 2 x 2 `--matrix`."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from jaxinfer.benchmarks.quality import SECTION
from jaxinfer.cli import main
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_quality")
    model = make_tiny_model_dir(root / "tiny")
    (ids,) = random_prompts(1, seed=0, min_len=40, max_len=40)
    text = root / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in ids))
    return root, model, text, ids


def test_quality_one_configuration(tiny, tmp_path):
    _, model, text, ids = tiny
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(model), "--text", str(text), "--tokens", "40", "--chunk", "16",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())["data"]
    assert data["tokens"] == 40 and data["dtype"] == "float32"
    assert_positive_finite(data["perplexity"], "perplexity")
    assert data["perplexity"] == pytest.approx(math.exp(data["mean_nll"]))
    # random weights: about as good as a uniform guess over the 128 ids, far from perfect
    assert 10 < data["perplexity"] < 1000
    cfg, weights = load_hf_weights(model, np.float32)
    assert data["weight_bytes"] == sum(a.size * 4 for a in jax.tree.leaves(weights))


def test_quality_write_needs_matrix(tiny, tmp_path, capsys):
    _, model, text, _ = tiny
    assert main(["bench", "quality", "--model", str(model), "--text", str(text), "--write",
                 str(tmp_path / "B.md")]) == 2
    assert "--write records the --matrix table; add --matrix" in capsys.readouterr().err


def test_quality_matrix(tiny, tmp_path):
    _, model, text, _ = tiny
    report, written = run_bench(tmp_path, "quality", "--matrix", "--model", str(model), "--text", str(text),
                                "--tokens", "40", "--chunk", "16", "--formats", "bf16;int8 (w8a8)",
                                "--kv-dtypes", "auto,int8")
    rows = report["data"]["rows"]
    assert [(r["weights"], r["kv_cache"]) for r in rows] == [
        ("bf16", "bf16"), ("bf16", "int8"), ("int8 (w8a8)", "bf16"), ("int8 (w8a8)", "int8")]
    assert rows[0]["top1_agreement"] == 1.0
    for r in rows:
        assert_positive_finite(r["perplexity"], "perplexity")
        assert 0 < r["top1_agreement"] <= 1
    cfg, weights = load_hf_weights(model, np.float32)
    assert rows[0]["weight_bytes"] == sum(a.size * 2 for a in jax.tree.leaves(weights))
    assert rows[0]["quantized_share"] == 0 and rows[2]["quantized_share"] > 0.9  # norms stay unquantized
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "| int8 (w8a8) | int8 |" in section and "the first 40 tokens of `words.txt`" in section
