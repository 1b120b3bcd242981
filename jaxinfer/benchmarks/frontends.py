r"""`jaxinfer bench frontends`: the same load through the gRPC service and the OpenAI HTTP API of one
`jaxinfer serve`, side by side, at several concurrencies (`load_client`).

For each concurrency (`--concurrencies`, default 1, 8, 32) and each front end in turn (gRPC first, then HTTP),
`load_client.run_load` sends streamed requests back to back (the same prompts, seeds, temperature and
`max_tokens`, `ignore_eos`) for an unmeasured warm-up and a measured window, and reports output tokens/s and the
p50 / p99 of TTFT and TPOT, client-side. HTTP requests are streamed `/v1/completions` with vLLM's
`continuous_usage_stats`, so that each chunk says how many tokens it carries.

The HTTP front end's overhead per token is HTTP's TPOT p50 minus gRPC's at the same concurrency, and the
client's CPU seconds per token of each (the client shares the machine's cores with the server).

    .venv/bin/jaxinfer bench frontends --start-server --write BENCHMARKS.md -- --max-num-seqs 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform

from jaxinfer.benchmarks.load import add_server_arguments, serve_args
from jaxinfer.benchmarks.load_client import run_load, server_under_test
from jaxinfer.benchmarks.report import Report, int_list, machine_line, table

logger = logging.getLogger(__name__)

SECTION = ("<!-- frontends: begin -->", "<!-- frontends: end -->")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options: the server (as `bench load`'s, plus `--http-target`), the concurrencies, the load's shape."""
    add_server_arguments(parser)
    parser.add_argument("--http-target", default="http://127.0.0.1:8000",
                        help="base URL of the running server's HTTP API (without --start-server)")
    parser.add_argument("--concurrencies", default="1,8,32", help="comma-separated concurrent streams")
    parser.add_argument("--duration-s", type=float, default=30.0, help="measurement window per configuration")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="unmeasured load before each window")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="request k uses seed + k")


def _concurrencies(text: str) -> list[int]:
    return int_list("--concurrencies", text)


async def _run(args: argparse.Namespace, concurrencies: list[int]) -> tuple[list[dict], dict, int]:
    async with server_under_test(args, serve_args(args)) as server:
        http_url = server.http_url if server.proc is not None else args.http_target.rstrip("/")
        if http_url is None:
            raise ValueError("the server has no HTTP API (started with --no-http?)")
        rows, model = [], None
        for c in concurrencies:
            for protocol in ("grpc", "http"):
                args.concurrency, args.warmup_requests = c, c
                logger.info("concurrency %d over %s: %.0f s warm-up + %.0f s", c, protocol, args.warmup_s,
                            args.duration_s)
                r = await run_load(args, server.target, http_url if protocol == "http" else None)
                model = r["model"]
                rows.append({"concurrency": c, "protocol": protocol, **{k: v for k, v in r.items() if k != "model"}})
                server.keep_log |= bool(r["errors"])
    return rows, model, int(server.exit_status not in (None, 0))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def markdown(r: dict) -> str:
    """The results as the BENCHMARKS.md section."""
    m, s = r["model"], r["settings"]
    rows, by = [], {(x["concurrency"], x["protocol"]): x for x in r["rows"]}
    for x in r["rows"]:
        grpc = by[(x["concurrency"], "grpc")]
        ratio = x["output_tok_s"] / grpc["output_tok_s"] if grpc["output_tok_s"] else float("nan")
        cpu_per_token = x["client_cpu_s"] / max(x["output_tokens_in_window"], 1) * 1e3
        errors = ", ".join(f"{k} {v}" for k, v in sorted(x["errors"].items())) or "0"
        rows.append([str(x["concurrency"]), x["protocol"], f"{x['output_tok_s']:.1f}", f"{ratio:.2f}",
                     f"{_ms(x['ttft_p50_s'])} / {_ms(x['ttft_p99_s'])}", f"{_ms(x['tpot_p50_s'])} / "
                     f"{_ms(x['tpot_p99_s'])}", f"{cpu_per_token:.2f}", f"{x['requests_timed']}", errors])
    overhead = []
    for c in s["concurrencies"]:
        g, h = by[(c, "grpc")], by[(c, "http")]
        if g["tpot_p50_s"] is not None and h["tpot_p50_s"] is not None:
            overhead.append(f"concurrency {c}: {(h['tpot_p50_s'] - g['tpot_p50_s']) * 1e3:+.2f} ms per token "
                            f"(TPOT p50), TTFT p50 {(h['ttft_p50_s'] - g['ttft_p50_s']) * 1e3:+.1f} ms")
    return "\n".join([
        "## Front ends: gRPC and the OpenAI HTTP API\n",
        f"`jaxinfer bench frontends`: one `jaxinfer serve`, the same load through each front end in turn: "
        f"concurrent streams sending requests back to back (16 short English prompts, temperature "
        f"{s['temperature']}, seeded, `max_tokens` {s['max_tokens']}, `ignore_eos`; HTTP: streamed "
        f"`/v1/completions`), {s['warmup_s']:.0f} s unmeasured, then a {s['duration_s']:.0f} s window. Times are "
        "client-side: TTFT = first token after sending, TPOT = (last token - first token) / (tokens - 1), p50 / p99 "
        "over the requests sent and finished in the window. The client (one Python process) shares the 2 cores "
        "with the server.\n",
        "```", r["command"], "```\n",
        f"- date: {r['date']}; server: {r['server_note'] or 'not documented (--server-note)'}",
        f"- model: {m['name']}, {m['dtype']}, max_model_len {m['max_model_len']}, {m['mesh']}, attention "
        f"{m['attention_backend']}",
        f"- {machine_line()}, Python {platform.python_version()}\n",
        table(["concurrency", "front end", "output tok/s", "vs gRPC", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
               "client CPU ms / token", "requests timed", "errors"], rows),
        "",
        "HTTP's overhead against gRPC: " + ("; ".join(overhead) or "not measured") + ".",
    ])


def run(args: argparse.Namespace) -> Report:
    """Runs every concurrency over both front ends; the report.

    `Report.data`: model, rows (one per concurrency and front end: `load_client.run_load`'s results), settings,
    server_exit_status, exit_status (1 when a request failed or the started server did not exit cleanly).

    Raises:
      ValueError: bad options, a non-loopback target, or no serving server (in time).
    """
    concurrencies = _concurrencies(args.concurrencies)
    if args.max_tokens < 1 or args.duration_s <= 0 or args.warmup_s < 0:
        raise ValueError("--max-tokens must be >= 1, --duration-s > 0, --warmup-s >= 0")
    try:
        rows, model, status = asyncio.run(_run(args, concurrencies))
    except (TimeoutError, RuntimeError) as e:
        raise ValueError(str(e)) from None
    r = {"model": model, "rows": rows, "command": args.command, "date": args.date, "server_note": args.server_note,
         "settings": {"concurrencies": concurrencies, "duration_s": args.duration_s, "warmup_s": args.warmup_s,
                      "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}}
    r["server_exit_status"] = status
    r["exit_status"] = 1 if any(x["errors"] for x in rows) or status else 0
    return Report("frontends", markdown(r), r)
