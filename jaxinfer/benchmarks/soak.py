r"""`jaxinfer bench soak`: a soak test of a `jaxinfer serve` on this machine (loopback only) that checks every answer.

It sends `--requests` Generate requests from `--concurrency` streams (`soak_plan`: greedy, seeded and unseeded
sampling; text, chat and token-id prompts of `--prompt-len-range` tokens cut from the GPL-3 text; `max_tokens` in
`--max-tokens-range`; `--cancel-share` of them cancelled by the client before the first token or mid-stream), then
checks (`soak_client`):
- every finish reason and token count, and every usage;
- every greedy and seeded request that completed (or `--reference-sample` of them, drawn at random) against the
  same request sent alone after the load, token for token;
- at the end: nothing running or waiting and no KV page in use (the server's `/metrics`), health SERVING.

Reports sent, completed, cancelled, errors by gRPC status, wrong endings, mismatches, pages leaked, and p50/p99 of
TTFT and end-to-end latency (client-side, over the completed requests of the load). Exit status 1 when any check
failed or the started server did not exit cleanly, 2 for bad options or no SERVING server.

`--start-server` runs `jaxinfer serve --port 0 --metrics-port 0 [--model M] [args after --]` itself, as `bench
load` does; with `--target`, give the server's `--metrics-url`.

    .venv/bin/jaxinfer bench soak --start-server --requests 10000 --concurrency 32 --write BENCHMARKS.md \
        -- --max-num-seqs 32 --kv-cache-memory-bytes 1600000000
    .venv/bin/jaxinfer bench soak --target 127.0.0.1:50051 --metrics-url http://127.0.0.1:9090/metrics
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import platform
import random

import grpc
import numpy as np

from jaxinfer.benchmarks import corpus
from jaxinfer.benchmarks.load import add_server_arguments, serve_args
from jaxinfer.benchmarks.load_client import loopback_target, server_under_test, wait_serving
from jaxinfer.benchmarks.report import Report, machine_line
from jaxinfer.benchmarks.soak_client import check_outcome, end_state, reference_mismatch, references, run_phase
from jaxinfer.benchmarks.soak_plan import build_prompts, draw_plan, parse_range
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SECTION = ("<!-- soak: begin -->", "<!-- soak: end -->")
EXAMPLES = 5  # wrong endings and mismatches listed in the report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's options: the server ones of `bench load`, then the workload's shape and checks."""
    add_server_arguments(parser)
    parser.add_argument("--metrics-url", default=None,
                        help="with --target: the server's Prometheus endpoint, http://HOST:PORT/metrics (loopback)")
    parser.add_argument("--requests", type=int, default=1000, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent streams")
    parser.add_argument("--cancel-share", type=float, default=0.2, help="share of requests the client cancels")
    parser.add_argument("--max-tokens-range", default="4-64", help="max_tokens drawn uniformly in LO-HI")
    parser.add_argument("--prompt-len-range", default="8-1000", help="prompt tokens drawn uniformly in LO-HI")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request plan")
    parser.add_argument("--reference-sample", type=int, default=200,
                        help="completed greedy / seeded requests checked against a reference sent alone (at most)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="longest wait after the last request for the server to show nothing in flight")


def _check_options(args: argparse.Namespace) -> list[str]:
    """Validates the options (ValueError naming the option); returns the `jaxinfer serve` arguments."""
    args.max_tokens_lohi = parse_range(args.max_tokens_range, "--max-tokens-range")
    args.prompt_len_lohi = parse_range(args.prompt_len_range, "--prompt-len-range")
    if args.concurrency < 1 or args.reference_sample < 0 or args.drain_timeout_s < 0:
        raise ValueError("--concurrency must be >= 1, --reference-sample and --drain-timeout-s >= 0")
    server_args = serve_args(args)
    if args.start_server:
        if args.metrics_url is not None:
            raise ValueError("--metrics-url is for --target; --start-server reads the started server's")
        if "--metrics-port" not in server_args:
            server_args += ["--metrics-port", "0"]
    elif args.metrics_url is None:
        raise ValueError("--target needs --metrics-url (the server's --metrics-port) to check pages and queues")
    else:
        try:
            loopback_target(args.metrics_url.split("://", 1)[-1].split("/", 1)[0])
        except ValueError as e:
            raise ValueError(f"--metrics-url {args.metrics_url!r}: {e}") from None
    return server_args


async def _soak(args: argparse.Namespace, target: str, metrics_url: str) -> dict:
    plan = draw_plan(args.requests, args.seed, args.cancel_share, args.max_tokens_lohi, args.prompt_len_lohi)
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
        await wait_serving(channel, args.health_timeout_s, target)
        stub = pb_grpc.JaxInferStub(channel)
        info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        await build_prompts(stub, plan, corpus.read_text("soak"), args.seed, info.max_model_len, args.concurrency)
        logger.info("sending %d requests from %d streams", len(plan), args.concurrency)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcomes = await run_phase(stub, plan, args.concurrency, args.request_timeout_s)
        load_s = loop.time() - t0
        eligible = [r for r in plan if r.sampling != "unseeded" and outcomes[r.index].status == "completed"]
        sample = random.Random(args.seed + 2).sample(eligible, min(args.reference_sample, len(eligible)))
        logger.info("load done in %.1f s; %d references, one at a time", load_s, len(sample))
        refs = await references(stub, sample, args.request_timeout_s)
        end = await end_state(channel, metrics_url, args.drain_timeout_s)
    wrong = [f"request {r.index}: {w}" for r, o in zip(plan, outcomes) if (w := check_outcome(r, o))]
    mismatches = [m for r, ref in zip(sample, refs) if (m := reference_mismatch(r, outcomes[r.index], ref))]
    errors = collections.Counter(o.status for o in outcomes + refs if o.status not in ("completed", "cancelled"))
    error_messages: dict[str, list[str]] = {code: [] for code in errors}
    for o in outcomes + refs:  # the first 3 distinct messages of each code
        msgs = error_messages.get(o.status)
        if msgs is not None and len(msgs) < 3 and o.details not in msgs:
            msgs.append(o.details)
    done = [o for o in outcomes if o.status == "completed"]
    ttft = np.array([o.t_first - o.t_send for o in done if o.t_first is not None])
    e2e = np.array([o.t_end - o.t_send for o in done])

    def pct(x: np.ndarray, q: float) -> float | None:
        return float(np.percentile(x, q)) if len(x) else None

    cancelled = [o for o in outcomes if o.status == "cancelled"]
    return {
        "model": {"name": info.model_name, "dtype": info.dtype, "max_model_len": info.max_model_len,
                  "page_size": info.page_size, "mesh": info.mesh, "attention_backend": info.attention_backend},
        "sent": len(outcomes), "completed": len(done), "cancelled": len(cancelled),
        "cancelled_before_first_token": sum(not o.token_ids for o in cancelled),
        "planned": {k: dict(collections.Counter(getattr(r, k) for r in plan)) for k in ("sampling", "input")},
        "finish_reasons": dict(collections.Counter(o.finish_reason for o in done)),
        "errors": dict(errors), "error_messages": error_messages,
        "wrong": len(wrong), "wrong_examples": wrong[:EXAMPLES],
        "references_checked": len(sample), "references_eligible": len(eligible),
        "mismatches": len(mismatches), "mismatch_examples": mismatches[:EXAMPLES],
        "end": end, "pages_leaked": end["kv_pages_used"],
        "output_tokens": sum(len(o.token_ids) for o in outcomes), "load_s": load_s,
        **{f"{name}_p{q}_s": pct(x, q) for name, x in (("ttft", ttft), ("e2e", e2e)) for q in (50, 99)},
    }


async def _run(args: argparse.Namespace, server_args: list[str]) -> dict:
    async with server_under_test(args, server_args, args.metrics_url) as server:
        r = await _soak(args, server.target, server.metrics_url)
        server.keep_log = bool(failed({**r, "server_exit_status": None}))
    r["server_exit_status"] = server.exit_status
    return r


def failed(r: dict) -> list[str]:
    """The checks the run failed, in words (empty: it passed)."""
    end = r["end"]
    return [what for what, bad in (
        ("errors", r["errors"]), ("wrong endings or usage", r["wrong"]), ("reference mismatches", r["mismatches"]),
        ("pages in use at the end", end["kv_pages_used"]), ("requests running or waiting at the end",
                                                           end["running"] + end["waiting"]),
        (f"health {end['health']}", end["health"] != "SERVING"),
        (f"server exit status {r['server_exit_status']}", r["server_exit_status"] not in (None, 0))) if bad]


def markdown(r: dict) -> str:
    """The results as the BENCHMARKS.md section (the runner adds its `soak` markers)."""
    def ms(key: str) -> str:
        return "-" if r[key] is None else f"{r[key] * 1e3:.0f}"

    m, s, end = r["model"], r["settings"], r["end"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
    rows = [("sent / completed / cancelled (of those, before the first token)",
             f"{r['sent']} / {r['completed']} / {r['cancelled']} ({r['cancelled_before_first_token']})"),
            ("errors by gRPC status (references included)", errors),
            ("wrong finish reason, token count or usage", str(r["wrong"])),
            ("greedy / seeded outputs checked against a reference alone (of completed)",
             f"{r['references_checked']} ({r['references_eligible']})"),
            ("mismatches", str(r["mismatches"])),
            ("at the end: pages in use / running / waiting (drained in)",
             f"{end['kv_pages_used']} / {end['running']} / {end['waiting']} ({end['drain_s']:.1f} s)"),
            ("health at the end", end["health"]),
            ("TTFT p50 / p99 ms", f"{ms('ttft_p50_s')} / {ms('ttft_p99_s')}"),
            ("end-to-end latency p50 / p99 ms", f"{ms('e2e_p50_s')} / {ms('e2e_p99_s')}"),
            ("load phase (output tokens/s)", f"{r['load_s']:.0f} s ({r['output_tokens'] / r['load_s']:.1f})"),
            ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items())) or "-")]
    return "\n".join([
        "## gRPC soak test\n",
        f"`jaxinfer bench soak`: {r['sent']} `Generate` requests from {s['concurrency']} concurrent streams on "
        f"loopback; a third each greedy, seeded (temperature 0.9, top_p 0.95) and unseeded (temperature 1, top_k "
        f"50); a third each text, chat and token-id prompts of {s['prompt_len_range']} tokens cut from the GPL-3 "
        f"text; max_tokens {s['max_tokens_range']}, half with ignore_eos; {s['cancel_share']:.0%} cancelled by the "
        "client (half 0-200 ms after sending, half after 1 to max_tokens - 1 tokens). Checked: every finish reason, "
        "token count and usage; the completed greedy and seeded outputs (a sample of at most "
        f"{s['reference_sample']}) against the same request sent alone after the load, token for token; at the "
        "end, the server's metrics and health. Latencies are client-side, over the completed requests.\n",
        "```", r["command"], "```\n",
        f"- date: {r['date']}; server: {r['server_note'] or 'not documented (--server-note)'}",
        f"- model: {m['name']}, {m['dtype']}, max_model_len {m['max_model_len']}, page size {m['page_size']}, "
        f"{m['mesh']}, attention {m['attention_backend']}",
        f"- {machine_line()}, Python {platform.python_version()}\n",
        "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
        *(f"- first {code} messages: " + "; ".join(msgs) for code, msgs in r["error_messages"].items()),
        *(f"- wrong: {w}" for w in r["wrong_examples"]), *(f"- mismatch: {x}" for x in r["mismatch_examples"]),
        f"- result: {'FAILED: ' + ', '.join(r['failed']) if r['failed'] else 'every check passed'}\n"])


def run(args: argparse.Namespace) -> Report:
    """Runs the soak (starting the server first with `--start-server`); the report.

    `Report.data`: model (ModelInfo), sent / completed / cancelled counts, errors and error_messages by gRPC status,
    wrong (+ examples), references_checked, mismatches (+ examples), end (running, waiting, kv_pages_used,
    kv_pages_total, drain_s, health), pages_leaked, ttft / e2e p50 and p99 in seconds (None when nothing
    completed), settings, failed (the failed checks), server_exit_status, exit_status (1 when a check failed).

    Raises:
      ValueError: bad options, a non-loopback target, prompts that cannot fit the context, or no SERVING server.
    """
    server_args = _check_options(args)
    try:
        r = asyncio.run(_run(args, server_args))
    except (TimeoutError, RuntimeError, OSError) as e:
        raise ValueError(str(e)) from None
    except grpc.RpcError as e:  # the server failed a Tokenize, ModelInfo or health call: no soak to report
        raise ValueError(f"the server failed a setup call: {e.code().name}: {e.details()}") from None
    r["settings"] = {k: getattr(args, k) for k in ("requests", "concurrency", "cancel_share", "max_tokens_range",
                                                    "prompt_len_range", "seed", "reference_sample")}
    r.update(command=args.command, server_note=args.server_note, date=args.date)
    r["failed"] = failed(r)
    r["exit_status"] = 1 if r["failed"] else 0
    return Report("soak", markdown(r), r)
