r"""Load test of a running `jaxinfer serve` (loopback only): N concurrent Generate streams for a fixed time.

1. Waits (up to `--health-timeout-s`) for `grpc.health.v1.Health/Check("")` to say SERVING; reads `ModelInfo`.
2. `--concurrency` asyncio workers on one grpc.aio channel send Generate requests back to back: the prompts below
   in turn, temperature 0.8, seed = seed + request number, `max_tokens` (default 64), `ignore_eos` (so every
   request produces exactly `max_tokens` tokens).
3. `--warmup-s` seconds of the same load are not measured (shapes the server did not compile at start-up, such as
   steps that prefill several prompts, compile then); the `--duration-s` window follows. At its end the requests
   still in flight are cancelled and not counted as requests; the tokens they received inside the window count.
4. Reports, timed client-side from sending a request: requests finished in the window, errors by gRPC status code
   (whole run) with their first distinct messages, requests that did not end with finish_reason "length" after
   `max_tokens` tokens, output tokens/s (tokens received in the window / window), requests/s, and p50/p99 of TTFT
   (first token), TPOT ((last token - first token) / (tokens - 1)) and end-to-end latency (last response) over the
   requests sent and finished inside the window.

`--start-server` runs `jaxinfer serve --port 0 [args after --]` itself (stderr to `--server-log`), reads the port it
prints, runs the load, sends SIGTERM and checks that it exits with status 0: a one-command benchmark. Otherwise
`--server-note` says how the server was started. `--json` prints JSON instead of markdown; `--write BENCHMARKS.md`
replaces (or appends) that file's `load-test` section. Exit status 1 when a request failed or the started server
did not exit cleanly, 2 for bad arguments or no SERVING server.

    .venv/bin/python scripts/load_test.py --target 127.0.0.1:50051 --server-note "jaxinfer serve --max-num-seqs 64"
    .venv/bin/python scripts/load_test.py --start-server --concurrency 64 --duration-s 60 --write BENCHMARKS.md \
        -- --max-num-seqs 64 --max-model-len 256 --kv-cache-memory-bytes 400000000
"""

from __future__ import annotations

import md_sections  # noqa: I001 (scripts/ is on sys.path when these run)

import argparse
import asyncio
import collections
import dataclasses
import datetime
import ipaddress
import json
import os
import platform
import shlex
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb  # noqa: E402
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc  # noqa: E402

SECTION_BEGIN = "<!-- load-test: begin -->"
SECTION_END = "<!-- load-test: end -->"
PROMPTS = (
    "Write a short poem about the sea at night.", "Explain how a bicycle stays upright while moving.",
    "What are three good habits for learning a new language?", "Describe the smell of fresh bread in a small bakery.",
    "Give me a recipe idea that uses lentils and spinach.", "Why is the sky blue during the day?",
    "Summarize the plot of a detective story in two sentences.",
    "List some tips for keeping houseplants alive in winter.", "Tell me a story about a robot who learns to paint.",
    "How do bees communicate with each other?", "What should I pack for a weekend hiking trip?",
    "Compare trains and planes for travel across Europe.", "Explain what a prime number is to a child.",
    "Write a friendly email inviting a neighbour to dinner.", "What makes a good cup of coffee?",
    "Describe a busy market on a Saturday morning.",
)


@dataclasses.dataclass
class Stats:
    """What the workers record; times are `time.perf_counter()` seconds."""

    t_measure: float
    t_end: float
    done: list[tuple[float, ...]] = dataclasses.field(default_factory=list)  # send, first/last token, end, tokens
    window_tokens: int = 0
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    error_messages: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    wrong_length: list[str] = dataclasses.field(default_factory=list)
    sent: int = 0


def loopback_target(target: str) -> str:
    """`HOST:PORT` -> the same, if every address HOST resolves to is a loopback address.

    Raises:
      ValueError: a malformed target, or a host that is (or resolves to) anything but loopback.
    """
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--target {target!r} must be HOST:PORT")
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host.strip("[]"), int(port), proto=socket.IPPROTO_TCP)}
    except socket.gaierror as e:
        raise ValueError(f"--target {target!r}: cannot resolve {host}: {e}") from None
    bad = sorted(a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if bad:
        raise ValueError(f"--target {target!r} resolves to non-loopback {', '.join(bad)}; this tool only loads a "
                         "server on this machine (127.0.0.1, ::1, localhost)")
    return target


async def wait_serving(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Polls Health/Check("") until SERVING. Raises TimeoutError after `timeout_s` seconds."""
    stub, deadline, last = health_pb2_grpc.HealthStub(channel), time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details()}"
        await asyncio.sleep(1.0)
    raise TimeoutError(f"the server was not SERVING after {timeout_s:.0f} s (last health answer: {last})")


async def worker(stub: pb_grpc.JaxInferStub, args: argparse.Namespace, stats: Stats) -> None:
    """Sends requests back to back until `stats.t_end`; cancelled by `run_load` at the end."""
    while time.perf_counter() < stats.t_end:
        k = stats.sent
        stats.sent += 1
        request = pb.GenerateRequest(text=PROMPTS[k % len(PROMPTS)], sampling=pb.SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + k, ignore_eos=True))
        t_send, t_first, t_last, n, finish = time.perf_counter(), None, None, 0, ""
        call = stub.Generate(request, timeout=args.request_timeout_s)
        try:
            async for response in call:
                t = time.perf_counter()
                if response.token_ids:
                    t_first, t_last = t_first or t, t
                    n += len(response.token_ids)
                    if stats.t_measure <= t < stats.t_end:
                        stats.window_tokens += len(response.token_ids)
                finish = response.finish_reason or finish
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            stats.errors[code] += 1
            msgs = stats.error_messages.setdefault(code, [])
            if len(msgs) < 3 and not any(m.endswith(f": {e.details()}") for m in msgs):  # first distinct ones
                msgs.append(f"t={time.perf_counter() - stats.t_measure:+.1f} s: {e.details()}")
            await asyncio.sleep(0.1)  # a failing server is not hammered in a tight loop
            continue
        finally:
            call.cancel()  # no-op after a clean end; cancels the RPC when this task is cancelled
        t_done = time.perf_counter()
        if finish != "length" or n != args.max_tokens:
            stats.wrong_length.append(f"finish_reason={finish!r}, {n} tokens")
        if t_first is not None:
            stats.done.append((t_send, t_first, t_last, t_done, n))


async def run_load(args: argparse.Namespace, target: str) -> dict:
    """Runs steps 1-3 of the module docstring against `target`; returns the results."""
    async with grpc.aio.insecure_channel(target) as channel:
        await wait_serving(channel, args.health_timeout_s)
        stub = pb_grpc.JaxInferStub(channel)
        info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        load_start = os.getloadavg()
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = Stats(t_measure=t0 + args.warmup_s, t_end=t0 + args.warmup_s + args.duration_s)
        tasks = [asyncio.create_task(worker(stub, args, stats)) for _ in range(args.concurrency)]
        await asyncio.sleep(stats.t_end - time.perf_counter())
        for task in tasks:
            task.cancel()
        crashed = [e for e in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(e, Exception)]
        if crashed:  # a bug in this tool, not a gRPC error (CancelledError is no Exception)
            raise crashed[0]
        client_cpu_s = time.process_time() - cpu0  # this process, grpc's threads included
    window = [d for d in stats.done if stats.t_measure <= d[3] <= stats.t_end]
    send, first, last, end, n = np.array([d for d in window if d[0] >= stats.t_measure]).reshape(-1, 5).T
    ttft, e2e, tpot = first - send, end - send, ((last - first) / np.maximum(n - 1, 1))[n > 1]

    def pct(x: np.ndarray, q: float) -> float | None:
        return float(np.percentile(x, q)) if len(x) else None

    return {
        "model": {"name": info.model_name, "dtype": info.dtype, "max_model_len": info.max_model_len,
                  "page_size": info.page_size, "mesh": info.mesh, "attention_backend": info.attention_backend},
        "requests_completed": len(window), "requests_timed": len(send), "requests_sent": stats.sent,
        "errors": dict(stats.errors), "error_messages": stats.error_messages,
        "wrong_length": len(stats.wrong_length), "wrong_length_examples": stats.wrong_length[:3],
        "output_tokens_in_window": stats.window_tokens, "output_tok_s": stats.window_tokens / args.duration_s,
        "requests_s": len(window) / args.duration_s,
        **{f"{name}_p{q}_s": pct(x, q) for name, x in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)) for q in (50, 99)},
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "client_cpu_s": client_cpu_s,
        "client_cpu_share": client_cpu_s / (time.perf_counter() - t0),
    }


async def start_server(server_args: list[str], log: Path, timeout_s: float) -> tuple[asyncio.subprocess.Process, str]:
    """Launches `jaxinfer serve --port 0 ...`; returns it and the HOST:PORT it prints on stdout."""
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", *server_args]
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err)
    prefix = b"jaxinfer: serving gRPC on "
    try:
        async with asyncio.timeout(timeout_s):
            while not (line := await proc.stdout.readline()).startswith(prefix):
                if not line:
                    raise RuntimeError(f"the server exited ({await proc.wait()}) before listening; see {log}")
    except TimeoutError:
        proc.kill()
        raise RuntimeError(f"the server printed no port in {timeout_s:.0f} s; see {log}") from None
    asyncio.get_running_loop().create_task(proc.stdout.read())  # drain the rest of stdout
    return proc, line[len(prefix):].decode().split(",")[0].strip()


async def stop_server(proc: asyncio.subprocess.Process, timeout_s: float) -> int:
    """SIGTERM, then the exit status (SIGKILL and -9 after `timeout_s` seconds)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -9


def markdown(r: dict) -> str:
    """The results as a BENCHMARKS.md section between the `load-test` markers."""
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
        SECTION_BEGIN, "## gRPC load test\n",
        f"`scripts/load_test.py`: {s['concurrency']} concurrent `Generate` streams over one grpc.aio channel on "
        f"loopback, each sending requests back to back (16 short English prompts in turn, temperature "
        f"{s['temperature']}, seeded, `max_tokens` {s['max_tokens']}, `ignore_eos`), for a {s['warmup_s']:.0f} s "
        f"unmeasured warm-up and then a {s['duration_s']:.0f} s window. Requests in flight at the end are cancelled "
        "and not counted (their tokens received inside the window are). Times are client-side from sending the "
        "request: TTFT = first token, TPOT = (last token - first token) / (tokens - 1), end-to-end = last response; "
        "latency percentiles are over the requests sent and finished inside the window; tokens/s counts every "
        "token received inside the window. The client shares the 2 cores with the server.\n",
        "```", r["command"], "```\n",
        f"- date: {r['date']}; server: {r['server_note'] or 'not documented (--server-note)'}",
        f"- model: {m['name']}, {m['dtype']}, max_model_len {m['max_model_len']}, page size {m['page_size']}, "
        f"{m['mesh']}, attention {m['attention_backend']}",
        f"- machine: nproc {os.cpu_count()}, {r['cpu']}, Python {platform.python_version()}; 1/5/15-min load "
        f"average at the start {' / '.join(f'{x:.2f}' for x in r['loadavg_start'])}, at the end "
        f"{' / '.join(f'{x:.2f}' for x in r['loadavg_end'])}\n",
        "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
        *(f"- first {code} messages: " + "; ".join(msgs) for code, msgs in r["error_messages"].items()),
        *([""] if r["error_messages"] else []), SECTION_END])


def splice(existing: str, section: str) -> str:
    """Replaces the load-test section in an existing report, or appends it."""
    return md_sections.splice(existing, section, SECTION_BEGIN, SECTION_END)


async def amain(args: argparse.Namespace, server_args: list[str]) -> int:
    proc, status = None, 0
    if args.start_server:
        log = args.server_log or Path(tempfile.mkstemp(prefix="jaxinfer-serve-", suffix=".log")[1])
        print(f"load_test: starting jaxinfer serve {shlex.join(server_args)} (stderr: {log})", file=sys.stderr)
        proc, target = await start_server(server_args, log, args.health_timeout_s)
        args.server_note = " ".join(x for x in (f"`jaxinfer serve --port 0 {shlex.join(server_args)}` (started by "
                                                "--start-server)", args.server_note) if x)
    else:
        target = args.target
    try:
        loopback_target(target)
        print(f"load_test: waiting for {target} to be SERVING, then {args.warmup_s:.0f} s warm-up + "
              f"{args.duration_s:.0f} s of {args.concurrency} streams", file=sys.stderr)
        r = await run_load(args, target)
    finally:
        if proc is not None:
            code = await stop_server(proc, args.server_stop_timeout_s)
            print(f"load_test: the server exited with status {code}", file=sys.stderr)
            if code != 0:
                status = 1
                print(f"load_test: the server did not exit cleanly; its log: {log}", file=sys.stderr)
    r["settings"] = {k: getattr(args, k) for k in ("concurrency", "duration_s", "warmup_s", "max_tokens",
                                                    "temperature", "seed")}
    python = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable
    r.update(command=f"{python} scripts/load_test.py {shlex.join(sys.argv[1:])}", server_note=args.server_note,
             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             cpu=next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                       if ln.startswith("model name")), platform.processor() or "unknown CPU"),
             server_exit_status=None if proc is None else proc.returncode)
    section = markdown(r)
    print(json.dumps(r, indent=2) if args.json else section)
    if args.write is not None:
        args.write.write_text(splice(args.write.read_text() if args.write.exists() else "", section))
    if r["errors"] and proc is not None:
        print(f"load_test: requests failed; the server's log: {log}", file=sys.stderr)
    return 1 if r["errors"] or status else 0


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a running server (loopback only)")
    ap.add_argument("--start-server", action="store_true",
                    help="launch `jaxinfer serve --port 0 [args after --]` and stop it at the end")
    ap.add_argument("--server-log", type=Path, default=None, help="--start-server: its stderr (default: a temp file)")
    ap.add_argument("--server-note", default="", help="how the server was started, for the report")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    ap.add_argument("--duration-s", type=float, default=60.0, help="measurement window")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="unmeasured load before the window")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0, help="request k uses seed + k")
    ap.add_argument("--request-timeout-s", type=float, default=600.0, help="gRPC deadline of one request")
    ap.add_argument("--health-timeout-s", type=float, default=900.0, help="longest wait for SERVING")
    ap.add_argument("--server-stop-timeout-s", type=float, default=60.0, help="--start-server: wait for its exit")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of markdown")
    ap.add_argument("--write", type=Path, default=None, help="replace or append the load-test section of this file")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.concurrency < 1 or args.max_tokens < 1 or args.duration_s <= 0 or args.warmup_s < 0:
        ap.error("--concurrency and --max-tokens must be >= 1, --duration-s > 0, --warmup-s >= 0")
    if server_args and not args.start_server:
        ap.error("arguments after -- go to jaxinfer serve and need --start-server")
    try:
        return asyncio.run(amain(args, server_args))
    except (ValueError, TimeoutError, RuntimeError) as e:
        print(f"load_test: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
