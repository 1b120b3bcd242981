"""Smoke test of `jaxinfer bench load --start-server`: a tiny random Llama served on loopback, 2 streams for 1.5 s
after a warm-up of 8 requests; checks the counts, rates and latencies of the report, the server's clean exit, and
the section; the wait for a server that is not there, the help text, the warning of an empty window and the
temp server log's removal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import tempfile

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


def _results(requests_timed: int, requests_completed: int, e2e_p50_run_s: float | None) -> dict:
    """`run_load`'s results of a run whose window held `requests_timed` timed requests (latencies None without)."""
    lat = {f"{k}_p{q}_s": (0.5 if requests_timed else None) for k in ("ttft", "tpot", "e2e") for q in (50, 99)}
    return {"model": {"name": "m", "dtype": "float32", "max_model_len": 64, "page_size": 16, "mesh": "none",
                      "attention_backend": "reference"},
            "requests_completed": requests_completed, "requests_timed": requests_timed, "requests_sent": 9,
            "errors": {}, "error_messages": {}, "wrong_length": 0, "output_tokens_in_window": 7, "output_tok_s": 0.7,
            "requests_s": requests_completed / 10, **lat, "e2e_p50_run_s": e2e_p50_run_s,
            "loadavg_start": (1.0, 1.0, 1.0), "loadavg_end": (1.0, 1.0, 1.0), "client_cpu_s": 1.0,
            "client_cpu_share": 0.1, "warmup_actual_s": 6.5, "server_exit_status": None}


@pytest.mark.parametrize("timed, completed, run_p50", [(0, 0, 23.4), (0, 3, 12.0), (0, 0, None), (2, 2, 1.0)])
def test_an_empty_window_is_explained(monkeypatch, caplog, timed, completed, run_p50):
    """Found by a fresh-user trial: --duration-s 10 --warmup-s 5 printed every latency cell as "-" with no hint.
    A window in which no request was sent and finished gets a warning and a line in the section naming the
    window, the warm-up and how long a request took."""
    from jaxinfer.benchmarks import load

    async def fake_run(args, server_args):
        return _results(timed, completed, run_p50), 0

    monkeypatch.setattr(load, "_run", fake_run)
    parser, _ = workload_parser("load")
    args = parser.parse_args(["--duration-s", "10", "--warmup-s", "5"])
    args.command, args.date = "jaxinfer bench load", "today"
    with caplog.at_level(logging.WARNING, logger="jaxinfer.benchmarks.load"):
        report = load.run(args)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if timed:
        assert warnings == [] and "no request was sent" not in report.markdown
        return
    assert len(warnings) == 1 and f"- {warnings[0]}" in report.markdown, (warnings, report.markdown)
    why = warnings[0]
    assert why.startswith("no request was sent and finished inside the 10 s window (--duration-s; it followed 6.5 s "
                          "of warm-up, --warmup-s 5"), why
    assert (f"the {completed} that finished in it were sent before it" in why) == bool(completed)
    assert (f"a request took {run_p50:.1f} s end to end" if run_p50 else "no request finished in the whole run") in why


def _fake_server(monkeypatch, tmp_path, exit_status: int = 0) -> argparse.Namespace:
    """`server_under_test` with a started server that is not there (start / stop faked) and its temp log in
    tmp_path; the args of `--start-server` without `--server-log`."""
    from jaxinfer.benchmarks import load_client

    async def start(server_args, log, timeout_s):
        log.write_text("the server's stderr\n")
        return None, "127.0.0.1:1", None, None

    async def stop(proc, timeout_s):
        return exit_status

    monkeypatch.setattr(load_client, "start_server", start)
    monkeypatch.setattr(load_client, "stop_server", stop)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return argparse.Namespace(start_server=True, server_log=None, server_note="", health_timeout_s=1.0,
                              server_stop_timeout_s=1.0)


@pytest.mark.parametrize("outcome", ["clean", "keep_log", "raises", "exit 1"])
def test_the_temp_server_log_is_removed_only_after_a_clean_run(monkeypatch, tmp_path, outcome):
    """Found by a fresh-user trial: every --start-server run left /tmp/jaxinfer-serve-*.log behind. A clean run
    removes it; a failed one keeps it, and an error raised inside names it."""
    from jaxinfer.benchmarks.load_client import server_under_test

    args = _fake_server(monkeypatch, tmp_path, exit_status=1 if outcome == "exit 1" else 0)
    seen = {}

    async def go():
        async with server_under_test(args, []) as server:
            seen["log"] = server.log
            assert server.log.parent == tmp_path and server.log.read_text() == "the server's stderr\n"
            server.keep_log = outcome == "keep_log"
            if outcome == "raises":
                raise TimeoutError("the server was not SERVING after 1 s")

    if outcome == "raises":
        with pytest.raises(TimeoutError) as e:
            asyncio.run(go())
        assert str(e.value) == f"the server was not SERVING after 1 s; the server's log: {seen['log']}"
    else:
        asyncio.run(go())
    assert seen["log"].exists() == (outcome != "clean")
