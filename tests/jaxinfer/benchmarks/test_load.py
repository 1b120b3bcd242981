"""Smoke test of `jaxinfer bench load --start-server`: a tiny random Llama served on loopback, 2 streams for 1.5 s
after a warm-up of 8 requests; checks the counts, rates and latencies of the report, the server's clean exit, and
the section."""

from __future__ import annotations

from jaxinfer.benchmarks.load import SECTION
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_load_smoke(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    # The server's warm-up compiles the decode and single-prefill shapes; a step that prefills both streams at once
    # compiles on first use (2-7 s on 2 busy cores), maybe inside the window: 6 s leaves room for one such compile.
    report, written = run_bench(
        tmp_path, "load", "--start-server", "--model", str(model), "--server-log", str(tmp_path / "serve.log"),
        "--server-args", "--max-num-seqs 2 --max-model-len 64 --max-num-batched-tokens 32",
        "--concurrency", "2", "--warmup-s", "0", "--warmup-requests", "8", "--duration-s", "6", "--max-tokens", "4",
        "--health-timeout-s", "300")
    data = report["data"]
    assert data["server_exit_status"] == 0 and data["exit_status"] == 0
    assert data["errors"] == {} and data["wrong_length"] == 0
    assert data["model"]["max_model_len"] == 64 and data["settings"]["concurrency"] == 2
    assert data["requests_sent"] >= data["requests_completed"] >= 1
    assert data["output_tokens_in_window"] >= 4 * data["requests_completed"] - 2 * 4
    for key in ("output_tok_s", "requests_s", "e2e_p50_s", "e2e_p99_s", "client_cpu_s"):
        assert_positive_finite(data[key], key)
    if data["requests_timed"]:
        assert_positive_finite(data["ttft_p50_s"], "ttft_p50_s")
        assert_positive_finite(data["tpot_p50_s"], "tpot_p50_s")
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## gRPC load test" in section and "2 concurrent `Generate` streams" in section
    assert "machine: nproc" in section and "max_model_len 64, page size 16" in section
