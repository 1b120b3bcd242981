r"""`jaxinfer bench load`: load test of a running `jaxinfer serve` (loopback only): N concurrent Generate streams
for a fixed time (`load_client`).

Reports, timed client-side from sending a request: requests finished in the window, errors by gRPC status code
(whole run) with their first distinct messages, requests that did not end with finish_reason "length" after
`--max-tokens` tokens, output tokens/s (tokens received in the window / window), requests/s, and p50/p99 of TTFT
(first token), TPOT ((last token - first token) / (tokens - 1)) and end-to-end latency (last response) over the
requests sent and finished inside the window.

`--start-server` runs `jaxinfer serve --port 0 [--model M] [--server-args ...] [args after --]` itself (stderr to
`--server-log`, default a temp file removed after a clean run), reads the port it prints, runs the load, sends
SIGTERM and checks that it exits with status 0: a one-command benchmark. Otherwise `--server-note` says how the server was started. Exit status 1 when a request
failed or the started server did not exit cleanly, 2 for bad arguments or no SERVING server.

    .venv/bin/jaxinfer bench load --target 127.0.0.1:50051 --server-note "jaxinfer serve --max-num-seqs 64"
    .venv/bin/jaxinfer bench load --start-server --concurrency 64 --duration-s 60 --write BENCHMARKS.md \
        -- --max-num-seqs 64 --max-model-len 256 --kv-cache-memory-bytes 400000000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import shlex
from pathlib import Path

from jaxinfer.benchmarks.load_client import run_load, server_under_test
from jaxinfer.benchmarks.report import Report, machine_line

logger = logging.getLogger(__name__)

SECTION = ("<!-- load-test: begin -->", "<!-- load-test: end -->")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a workload that drives a gRPC server: the target or a server to start, its log and note,
    timeouts, and `jaxinfer serve` arguments after `--` (shared with `bench soak`)."""
    parser.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a running server (loopback only)")
    parser.add_argument("--start-server", action="store_true",
                        help="launch `jaxinfer serve --port 0 [args after --]` and stop it at the end")
    parser.add_argument("--model", default=None, help="--start-server: the server's --model (default: its default)")
    parser.add_argument("--server-args", default="",
                        help="--start-server: more `jaxinfer serve` arguments, as one shell-quoted string (the same "
                             "as arguments after --)")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="--start-server: its stderr (default: a temp file, removed after a clean run)")
    parser.add_argument("--server-note", default="", help="how the server was started, for the report")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="gRPC deadline of one request, in seconds (default: %(default)g)")
    parser.add_argument("--health-timeout-s", type=float, default=900.0,
                        help="longest wait for the server to listen and be SERVING, in seconds (default: "
                             "%(default)g); a line every 15 s says what it waits for")
    parser.add_argument("--server-stop-timeout-s", type=float, default=60.0,
                        help="--start-server: longest wait for its exit, in seconds (default: %(default)g)")
    parser.add_argument("serve_args", nargs="*", metavar="-- SERVE_ARGS",
                        help="--start-server: arguments after -- go to `jaxinfer serve` (so --write / --json go "
                             "before --)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load test's options: the target or a server to start, the load's shape, timeouts."""
    add_server_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    parser.add_argument("--duration-s", type=float, default=60.0, help="measurement window")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="unmeasured load before the window")
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="the warm-up also lasts until this many requests have ended (default: 2 x --concurrency), "
                             "so first-use compiles of a cold server fall before the window")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="request k uses seed + k")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `jaxinfer serve` arguments of `--start-server`: `--model`, `--server-args`, then those after `--`.

    Raises:
      ValueError: any of them without `--start-server`.
    """
    server_args = (["--model", str(args.model)] if args.model is not None else []) + shlex.split(args.server_args)
    server_args += args.serve_args
    if server_args and not args.start_server:
        raise ValueError("--model, --server-args and arguments after -- go to jaxinfer serve and need --start-server")
    return server_args


def _server_args(args: argparse.Namespace) -> list[str]:
    """The `jaxinfer serve` arguments of `--start-server`. Raises ValueError for bad combinations or values."""
    if args.concurrency < 1 or args.max_tokens < 1 or args.duration_s <= 0 or args.warmup_s < 0:
        raise ValueError("--concurrency and --max-tokens must be >= 1, --duration-s > 0, --warmup-s >= 0")
    if args.warmup_requests is None:
        args.warmup_requests = 2 * args.concurrency  # the first round prefills together, the second apart
    elif args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests {args.warmup_requests} must be >= 0")
    return serve_args(args)


async def _run(args: argparse.Namespace, server_args: list[str]) -> tuple[dict, int]:
    """(results, 0 or 1 when the started server did not exit cleanly); starts and stops the server if asked."""
    async with server_under_test(args, server_args) as server:
        logger.info("waiting for %s to be SERVING, then %.0f s warm-up + %.0f s of %d streams", server.target,
                    args.warmup_s, args.duration_s, args.concurrency)
        r = await run_load(args, server.target)
        if r["errors"] and server.proc is not None:
            server.keep_log = True
            logger.error("requests failed; the server's log: %s", server.log)
    r["server_exit_status"] = server.exit_status
    return r, int(server.exit_status not in (None, 0))


def empty_window(r: dict) -> str | None:
    """Why the latency cells are "-", in words, when no request was both sent and finished inside the window (a
    window shorter than one request's end-to-end time); None when some was."""
    if r["requests_timed"]:
        return None
    s, run_p50 = r["settings"], r["e2e_p50_run_s"]
    fix = ("no request finished in the whole run either: give a longer --duration-s" if run_p50 is None else
           f"a request took {run_p50:.1f} s end to end (median over the run, warm-up included): give --duration-s "
           "several times that")
    n = r["requests_completed"]
    early = f"; the {n} that finished in it were sent before it" if n else ""
    return (f"no request was sent and finished inside the {s['duration_s']:g} s window (--duration-s; it followed "
            f"{r['warmup_actual_s']:.1f} s of warm-up, --warmup-s {s['warmup_s']:g}{early}), so the latency cells "
            f"are \"-\"; {fix}, or lower --max-tokens or --concurrency")


def markdown(r: dict) -> str:
    """The results as the BENCHMARKS.md section (the runner adds its `load-test` markers)."""
    def ms(key: str) -> str:
        return "-" if r[key] is None else f"{r[key] * 1e3:.0f}"

    m, s = r["model"], r["settings"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
    rows = [("requests completed in the window (sent in it, used for latencies)",
             f"{r['requests_completed']} ({r['requests_timed']})"),
            ("errors by gRPC status (whole run, warm-up included)", errors),
            ("requests not ending with finish_reason length after max_tokens tokens (whole run)",
             str(r["wrong_length"])),
            ("output tokens/s (aggregate)", f"{r['output_tok_s']:.1f}"), ("requests/s", f"{r['requests_s']:.2f}"),
            ("TTFT p50 / p99 ms", f"{ms('ttft_p50_s')} / {ms('ttft_p99_s')}"),
            ("TPOT p50 / p99 ms", f"{ms('tpot_p50_s')} / {ms('tpot_p99_s')}"),
            ("end-to-end latency p50 / p99 ms", f"{ms('e2e_p50_s')} / {ms('e2e_p99_s')}"),
            ("load-test client CPU (warm-up + window; share of one core)",
             f"{r['client_cpu_s']:.1f} s ({r['client_cpu_share']:.0%})")]
    return "\n".join([
        "## gRPC load test\n",
        f"`jaxinfer bench load`: {s['concurrency']} concurrent `Generate` streams over one grpc.aio channel on "
        f"loopback, each sending requests back to back (16 short English prompts in turn, temperature "
        f"{s['temperature']}, seeded, `max_tokens` {s['max_tokens']}, `ignore_eos`), for an unmeasured warm-up "
        f"(at least {s['warmup_s']:.0f} s and {s['warmup_requests']} ended requests; it took "
        f"{r['warmup_actual_s']:.1f} s) and then a {s['duration_s']:.0f} s window. Requests in flight at the end are cancelled "
        "and not counted (their tokens received inside the window are). Times are client-side from sending the "
        "request: TTFT = first token, TPOT = (last token - first token) / (tokens - 1), end-to-end = last response; "
        "latency percentiles are over the requests sent and finished inside the window; tokens/s counts every "
        "token received inside the window. The client shares the 2 cores with the server.\n",
        "```", r["command"], "```\n",
        f"- date: {r['date']}; server: {r['server_note'] or 'not documented (--server-note)'}",
        f"- model: {m['name']}, {m['dtype']}, max_model_len {m['max_model_len']}, page size {m['page_size']}, "
        f"{m['mesh']}, attention {m['attention_backend']}",
        f"- {machine_line()}, Python {platform.python_version()}; 1/5/15-min load "
        f"average at the start {' / '.join(f'{x:.2f}' for x in r['loadavg_start'])}, at the end "
        f"{' / '.join(f'{x:.2f}' for x in r['loadavg_end'])}\n",
        "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
        *(f"- first {code} messages: " + "; ".join(msgs) for code, msgs in r["error_messages"].items()),
        *([f"- {empty_window(r)}"] if empty_window(r) else []),
        *([""] if r["error_messages"] or empty_window(r) else [])])

def run(args: argparse.Namespace) -> Report:
    """Runs the load (starting the server first with `--start-server`); the report.

    `Report.data`: model (ModelInfo), requests_completed / requests_timed / requests_sent, errors, error_messages,
    wrong_length, output_tokens_in_window, output_tok_s, requests_s, ttft / tpot / e2e p50 and p99 in seconds
    (None when no request finished: a warning says why, `empty_window`), e2e_p50_run_s (over the whole run),
    load averages, client CPU, settings, server_exit_status, exit_status (1 when a
    request failed or the started server did not exit cleanly).

    Raises:
      ValueError: bad options, a non-loopback target, or no SERVING server (in time).
    """
    server_args = _server_args(args)
    try:
        r, status = asyncio.run(_run(args, server_args))
    except (TimeoutError, RuntimeError) as e:
        raise ValueError(str(e)) from None
    r["settings"] = {k: getattr(args, k) for k in ("concurrency", "duration_s", "warmup_s", "warmup_requests", "max_tokens",
                                                    "temperature", "seed")}
    r.update(command=args.command, server_note=args.server_note, date=args.date)
    if (why := empty_window(r)) is not None:
        logger.warning("%s", why)
    r["exit_status"] = 1 if r["errors"] or status else 0
    return Report("load", markdown(r), r)
