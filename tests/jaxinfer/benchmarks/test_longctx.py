"""Smoke test of `jaxinfer bench longctx`: one short length of the tiny rope-scaled model in its child process;
checks the row against what the options ask (prompt, chunks, a cache of just the pages needed), the section, and
that bad lengths are usage errors."""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import pytest

from jaxinfer.benchmarks.longctx import SECTION, TINY_MAX_POSITIONS
from jaxinfer.cli import main
from jaxinfer.loading.hf import load_hf_weights
from models.llama import KVCache
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench


def test_longctx_smoke(tmp_path):
    report, written = run_bench(tmp_path, "longctx", "--lengths", "", "--tiny-lengths", "600", "--runs", "2",
                                "--tiny-model", str(TINY_LLAMA), "--max-num-batched-tokens", "256")
    (row,) = report["data"]["rows"]
    assert (row["length"], row["prompt_tokens"], row["chunks"]) == (600, 599, 3)  # 256 + 256 + 87
    assert row["load_average"] is None or row["load_average"] >= 0
    assert len(row["ttft_s"]) == 2 and row["ttft_median_s"] == pytest.approx(sum(row["ttft_s"]) / 2)
    cfg, _ = load_hf_weights(TINY_LLAMA)
    pages = -(-600 // 16) + 1  # the context's pages and the null page
    assert row["kv_cache_bytes"] == pages * KVCache.bytes_per_page(cfg, 16, jnp.float32)
    for key in ("ttft_median_s", "step_temp_bytes", "rss_before_mib", "compile_s"):
        assert_positive_finite(row[key], key)
    if row["peak_reset"]:
        assert row["peak_rss_mib"] >= row["kv_cache_bytes"] / 2**20
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (report["data"]["plot"] is not None) == has_matplotlib
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Long context" in section and "| tiny Llama 3, RoPE x32 | 600 | 3 |" in section
    assert ("benchmarks/longctx.png" in section) == has_matplotlib


@pytest.mark.parametrize("option, value", [("--tiny-lengths", str(TINY_MAX_POSITIONS + 1)), ("--lengths", "1"),
                                           ("--lengths", "8k"), ("--lengths", "64,9000")])  # SmolLM2: 8192
def test_bad_lengths_are_usage_errors(tmp_path, capsys, option, value):
    assert main(["bench", "longctx", option, value, "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"jaxinfer: error: {option}" in err and "Traceback" not in err
