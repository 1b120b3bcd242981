"""Smoke test of `jaxinfer bench load --start-server`: a tiny random Llama served on loopback, 2 streams for 1.5 s
after a warm-up of 8 requests; checks the counts, rates and latencies of the report, the server's clean exit, and
the section; the wait for a server that is not there, and the help text."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest

from jaxinfer.benchmarks.cli import workload_parser
from jaxinfer.benchmarks.load import SECTION
from jaxinfer.benchmarks.load_client import wait_serving
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


def test_wait_serving_logs_what_it_waits_for(caplog):
    """Nothing listens on the port: the wait logs the target and the refused connection while it lasts, then
    raises TimeoutError with the last answer."""
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"

    async def wait() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            await wait_serving(channel, 2.5, target, log_every_s=0.5)

    with caplog.at_level(logging.INFO, logger="jaxinfer.benchmarks.load_client"), \
            pytest.raises(TimeoutError, match="not SERVING after 2 s .*UNAVAILABLE"):
        asyncio.run(wait())
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert lines, caplog.text
    assert all(target in line and "UNAVAILABLE" in line for line in lines[1:]), lines


def test_load_help_shows_the_health_timeout_default(capsys):
    """`--help` names the 900 s default of --health-timeout-s, read back from the parser."""
    parser, _ = workload_parser("load")
    default = parser.parse_args([]).health_timeout_s
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {default:g})" in help_text.rsplit("--health-timeout-s HEALTH_TIMEOUT_S", 1)[1].split("--", 1)[0]
