"""Smoke test of `jaxinfer bench frontends --start-server`: a tiny random Llama served on loopback, 2 streams
through gRPC and then HTTP for 3 s each; checks both rows' counts and latencies, the server's clean exit, and the
section."""

from __future__ import annotations

from jaxinfer.benchmarks.frontends import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_frontends_smoke(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(
        tmp_path, "frontends", "--start-server", "--model", str(model), "--server-log", str(tmp_path / "serve.log"),
        "--server-args", "--max-num-seqs 2 --max-model-len 64 --max-num-batched-tokens 32",
        "--concurrencies", "2", "--warmup-s", "1", "--duration-s", "3", "--max-tokens", "4",
        "--health-timeout-s", "300")
    data = report["data"]
    assert data["server_exit_status"] == 0 and data["exit_status"] == 0
    assert [(r["concurrency"], r["protocol"]) for r in data["rows"]] == [(2, "grpc"), (2, "http")]
    for row in data["rows"]:
        assert row["errors"] == {} and row["wrong_length"] == 0, row  # every request got exactly 4 tokens
        assert row["requests_completed"] >= 1
        assert row["output_tokens_in_window"] >= 4 * row["requests_completed"] - 2 * 4
        assert_positive_finite(row["output_tok_s"], "output_tok_s")
        if row["requests_timed"]:
            assert_positive_finite(row["ttft_p50_s"], "ttft_p50_s")
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Front ends: gRPC and the OpenAI HTTP API" in section and "| 2 | http |" in section
    assert "machine: nproc" in section and "HTTP's overhead against gRPC: concurrency 2:" in section
