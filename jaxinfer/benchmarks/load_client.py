"""The gRPC load-test client of `jaxinfer bench load`: N concurrent `Generate` streams against a server on this
machine, and starting / stopping a `jaxinfer serve` of its own (`server_under_test`, shared with `bench soak`).

`run_load`: waits for `grpc.health.v1.Health/Check("")` to say SERVING and reads `ModelInfo`; then `concurrency`
asyncio workers on one grpc.aio channel send Generate requests back to back (the prompts below in turn, seed =
seed + request number, `ignore_eos`, so every request produces exactly `max_tokens` tokens); `warmup_s` seconds of
that load are not measured, the `duration_s` window follows; at its end the requests still in flight are cancelled
and not counted as requests (the tokens they received inside the window count).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import ipaddress
import logging
import math
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
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


async def wait_serving(channel: grpc.aio.Channel, timeout_s: float, target: str = "the server",
                       log_every_s: float = 15.0) -> None:
    """Polls Health/Check("") once a second until SERVING, logging every `log_every_s` seconds what it waits for
    (`target`) and the last health answer or error (a refused connection, say), so a long wait is not silent.

    Raises:
      TimeoutError: not SERVING after `timeout_s` seconds; the message has the last answer.
    """
    stub, t0, last = health_pb2_grpc.HealthStub(channel), time.monotonic(), "no answer"
    deadline, next_log = t0 + timeout_s, t0 + log_every_s
    while (now := time.monotonic()) < deadline:
        if now >= next_log:
            logger.info("still waiting for %s to be SERVING (%.0f s of --health-timeout-s %.0f; last health answer: "
                        "%s)", target, now - t0, timeout_s, last)
            next_log = now + log_every_s
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details()}"
        await asyncio.sleep(1.0)
    raise TimeoutError(f"the server was not SERVING after {timeout_s:.0f} s (last health answer: {last})")


class RequestFailed(Exception):
    """A request that ended in an error: its code (a gRPC status name, or "HTTP <status>") and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def grpc_sender(stub: pb_grpc.JaxInferStub, args: argparse.Namespace):
    """Request k over gRPC: an async iterator of (new tokens, finish reason) per response."""
    async def send(k: int) -> AsyncIterator[tuple[int, str]]:
        request = pb.GenerateRequest(text=PROMPTS[k % len(PROMPTS)], sampling=pb.SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + k, ignore_eos=True))
        call = stub.Generate(request, timeout=args.request_timeout_s)
        try:
            async for response in call:
                yield len(response.token_ids), response.finish_reason
        except grpc.aio.AioRpcError as e:
            raise RequestFailed(e.code().name, e.details()) from None
        finally:
            call.cancel()  # no-op after a clean end; cancels the RPC when the worker is cancelled

    return send


def http_sender(client, base_url: str, args: argparse.Namespace):
    """Request k over the OpenAI HTTP API (a streamed `/v1/completions` with the same prompt and sampling as
    `grpc_sender`'s, usage on every chunk): an async iterator of (new tokens, finish reason) per chunk."""
    import json  # noqa: PLC0415 - only the HTTP client needs it

    async def send(k: int) -> AsyncIterator[tuple[int, str]]:
        body = {"prompt": PROMPTS[k % len(PROMPTS)], "temperature": args.temperature, "max_tokens": args.max_tokens,
                "seed": args.seed + k, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        seen = 0
        async with client.stream("POST", base_url + "/v1/completions", json=body,
                                 timeout=args.request_timeout_s) as r:
            if r.status_code != 200:
                raise RequestFailed(f"HTTP {r.status_code}", (await r.aread()).decode(errors="replace")[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed(f"HTTP {chunk['error']['code']}", chunk["error"]["message"])
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else seen
                finish = chunk["choices"][0]["finish_reason"] if chunk["choices"] else None
                yield tokens - seen, finish or ""
                seen = tokens

    return send


async def worker(send, args: argparse.Namespace, stats: Stats) -> None:
    """Sends requests (`send(k)`: `grpc_sender` / `http_sender`) back to back until `stats.t_end`; cancelled by
    `run_load` at the end."""
    while time.perf_counter() < stats.t_end:
        k = stats.sent
        stats.sent += 1
        t_send, t_first, t_last, n, finish = time.perf_counter(), None, None, 0, ""
        try:
            async with contextlib.aclosing(send(k)) as stream:  # closed at once when the worker is cancelled
                async for tokens, reason in stream:
                    t = time.perf_counter()
                    if tokens:
                        t_first, t_last = t_first or t, t
                        n += tokens
                        if stats.t_measure <= t < stats.t_end:
                            stats.window_tokens += tokens
                    finish = reason or finish
        except RequestFailed as e:
            stats.errors[e.code] += 1
            msgs = stats.error_messages.setdefault(e.code, [])
            if len(msgs) < 3 and not any(m.endswith(f": {e.message}") for m in msgs):  # first distinct ones
                msgs.append(f"t={time.perf_counter() - stats.t_measure:+.1f} s: {e.message}")
            await asyncio.sleep(0.1)  # a failing server is not hammered in a tight loop
            continue
        t_done = time.perf_counter()
        if finish != "length" or n != args.max_tokens:
            stats.wrong_length.append(f"finish_reason={finish!r}, {n} tokens")
        if t_first is not None:
            stats.done.append((t_send, t_first, t_last, t_done, n))


async def warm_up(stats: Stats, t_min: float, min_requests: int, timeout_s: float) -> None:
    """Waits until `t_min` and until `min_requests` requests have ended (done or failed), so that the shapes a
    cold server compiles on first use (several prefills in one step, say) fall before the window; gives up waiting
    for requests `timeout_s` after `t_min`."""
    while time.perf_counter() < t_min or (len(stats.done) + sum(stats.errors.values()) < min_requests
                                          and time.perf_counter() < t_min + timeout_s):
        await asyncio.sleep(0.05)


async def run_load(args: argparse.Namespace, target: str, http_url: str | None = None) -> dict:
    """Runs steps 1-3 of the module docstring against `target` (gRPC: health, `ModelInfo`, and the requests
    unless `http_url` is given: then they go to that OpenAI HTTP API); returns the results."""
    async with contextlib.AsyncExitStack() as stack:
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
        await wait_serving(channel, args.health_timeout_s, target)
        stub = pb_grpc.JaxInferStub(channel)
        info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        if http_url is None:
            send = grpc_sender(stub, args)
        else:
            import httpx2  # noqa: PLC0415 - only the HTTP client needs it

            limits = httpx2.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
            send = http_sender(await stack.enter_async_context(httpx2.AsyncClient(limits=limits)), http_url, args)
        load_start = os.getloadavg()
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = Stats(t_measure=math.inf, t_end=math.inf)  # set when the warm-up is over
        tasks = [asyncio.create_task(worker(send, args, stats)) for _ in range(args.concurrency)]
        await warm_up(stats, t0 + args.warmup_s, args.warmup_requests, args.request_timeout_s)
        stats.t_measure = time.perf_counter()
        stats.t_end = stats.t_measure + args.duration_s
        await asyncio.sleep(args.duration_s)
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
        "e2e_p50_run_s": pct(np.array([d[3] - d[0] for d in stats.done]), 50),  # warm-up included
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "client_cpu_s": client_cpu_s,
        "client_cpu_share": client_cpu_s / (time.perf_counter() - t0), "warmup_actual_s": stats.t_measure - t0,
    }


async def start_server(server_args: list[str], log: Path, timeout_s: float
                       ) -> tuple[asyncio.subprocess.Process, str, str | None, str | None]:
    """Launches `jaxinfer serve --port 0 --http-port 0 ...`; returns it, the gRPC HOST:PORT it prints on stdout,
    its metrics URL (None unless `server_args` has `--metrics-port`) and its HTTP API's base URL (None with
    `--no-http`)."""
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--http-port", "0", *server_args]
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
    # "HOST:PORT" or "HOST:PORT, metrics on http://HOST:MPORT/metrics"
    target, _, metrics = line[len(prefix):].decode().strip().partition(", metrics on ")
    http_url = None
    if "--no-http" not in server_args:  # "jaxinfer: serving HTTP (OpenAI API) on http://HOST:PORT/v1 as ..."
        http_line = (await proc.stdout.readline()).decode()
        http_url = http_line.split(" on ", 1)[1].split("/v1", 1)[0] if " on http" in http_line else None
    asyncio.get_running_loop().create_task(proc.stdout.read())  # drain the rest of stdout
    return proc, target.strip(), metrics.strip() or None, http_url


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



@dataclasses.dataclass
class ServerUnderTest:
    """The server a client workload drives: its gRPC address, its metrics URL and HTTP API URL (or None), and with
    `--start-server` the process, its log, (once stopped) its exit status, and `keep_log`, which the workload sets
    when its run failed, so that a temp log is kept for the user to read."""

    target: str
    metrics_url: str | None
    http_url: str | None = None
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None
    exit_status: int | None = None
    keep_log: bool = False


@contextlib.asynccontextmanager
async def server_under_test(args: argparse.Namespace, server_args: list[str],
                            metrics_url: str | None = None) -> AsyncIterator[ServerUnderTest]:
    """With `args.start_server`: starts `jaxinfer serve --port 0 SERVER_ARGS` (stderr to `args.server_log` or a
    temp file), notes its command in `args.server_note`, and stops it (SIGTERM) on leaving, setting `exit_status`;
    otherwise `args.target` with `metrics_url`. Either way the target must be a loopback address. A temp log is
    removed after a clean run; it is kept, and named, when the server failed to start or exit cleanly, when the
    workload raised (a TimeoutError or RuntimeError: its message gets the log's path) or set `keep_log`.

    Raises:
      RuntimeError: the started server exited or printed no port in `args.health_timeout_s` seconds.
      ValueError: a non-loopback target.
    """
    if not args.start_server:
        yield ServerUnderTest(loopback_target(args.target), metrics_url)
        return
    log = args.server_log or Path(tempfile.mkstemp(prefix="jaxinfer-serve-", suffix=".log")[1])
    logger.info("starting jaxinfer serve %s (stderr: %s)", shlex.join(server_args), log)
    proc, target, started_metrics, http_url = await start_server(server_args, log, args.health_timeout_s)
    args.server_note = " ".join(x for x in (f"`jaxinfer serve --port 0 {shlex.join(server_args)}` (started by "
                                            "--start-server)", args.server_note) if x)
    server, clean = ServerUnderTest(target, started_metrics, http_url, proc, log), False
    try:
        loopback_target(target)
        yield server
        clean = True
    except (TimeoutError, RuntimeError) as e:  # no SERVING server, say: the user reads why in its log
        e.args = (f"{e}; the server's log: {log}",)
        raise
    finally:
        server.exit_status = await stop_server(proc, args.server_stop_timeout_s)
        logger.info("the server exited with status %d", server.exit_status)
        if server.exit_status != 0:
            logger.error("the server did not exit cleanly; its log: %s", log)
        elif clean and not server.keep_log and args.server_log is None:
            log.unlink(missing_ok=True)  # a temp file nobody asked for
