"""The gRPC client of `jaxinfer bench soak`: the load phase, the checks of every outcome, the low-load references,
and the server's state at the end.

1. `run_phase` sends the planned requests (`soak_plan`) from `concurrency` asyncio workers on one grpc.aio
   channel, each taking the next request as soon as its last one ended; a planned cancel is the client's own
   `call.cancel()` (the server sees the stream end, as when a client goes away).
2. `check_outcome` checks each one: a completed request ends with finish_reason "length" after exactly max_tokens
   tokens, or "stop" after at most max_tokens (never with ignore_eos, since no stop strings or ids are set), and its
   usage counts its tokens and the server's prompt tokens of its input; a cancelled one has received no finish and
   at most max_tokens tokens. A gRPC error that is not the client's own cancel is an error, counted by status code.
3. `references`: a sample of the completed greedy and seeded requests is sent again, one at a time after the load,
   and must give the same tokens and finish reason (`reference_mismatch`).
4. `end_state` waits until the server's metrics (`/metrics`) show nothing running or waiting and no KV page in
   use, or `drain_timeout_s` passes, and reads its health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.benchmarks.soak_plan import PlannedRequest
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GAUGES = ("jaxinfer:num_requests_running", "jaxinfer:num_requests_waiting", "jaxinfer:kv_pages_used",
          "jaxinfer:kv_pages_total")


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request; times are `time.perf_counter()` seconds.

    Attributes:
      status: "completed" (a finish_reason arrived), "cancelled" (the client's own cancel before that), or the
        gRPC status code name of an error.
      token_ids: the token ids received, in order.
      finish_reason: the last one received ("" if none).
      usage: (prompt_tokens, completion_tokens) of the last response, or None if none carried usage.
      t_send, t_first, t_end: sending, the first token (None if none), the end of the stream.
      details: the error's message.
    """

    status: str
    token_ids: list[int]
    finish_reason: str
    usage: tuple[int, int] | None
    t_send: float
    t_first: float | None
    t_end: float
    details: str = ""


async def send(stub: pb_grpc.JaxInferStub, r: PlannedRequest, timeout_s: float, cancel: bool = True) -> Outcome:
    """Sends one planned request and reads its stream; cancels it as planned when `cancel`."""
    loop, cancelled = asyncio.get_running_loop(), False
    t_send, t_first = time.perf_counter(), None
    ids, finish, usage, status, details = [], "", None, "completed", ""
    call = stub.Generate(r.request, timeout=timeout_s)

    def cancel_call() -> None:
        nonlocal cancelled
        cancelled = True
        call.cancel()

    timer = loop.call_later(r.cancel_delay_s, cancel_call) if cancel and r.cancel == "before_first" else None
    try:
        async for response in call:
            if response.token_ids:
                t_first = t_first or time.perf_counter()
                ids += response.token_ids
            finish = response.finish_reason or finish
            if response.HasField("usage"):
                usage = (response.usage.prompt_tokens, response.usage.completion_tokens)
            if cancel and r.cancel == "mid_stream" and not finish and len(ids) >= r.cancel_after_tokens:
                cancel_call()
                break
    except asyncio.CancelledError:  # grpc.aio raises it for a call cancelled here
        if not cancelled or asyncio.current_task().cancelling():
            raise
    except grpc.aio.AioRpcError as e:
        if not (cancelled and e.code() == grpc.StatusCode.CANCELLED):
            status, details = e.code().name, e.details() or ""
    finally:
        if timer is not None:
            timer.cancel()
    if status == "completed" and cancelled and not finish:
        status = "cancelled"
    return Outcome(status, ids, finish, usage, t_send, t_first, time.perf_counter(), details)


async def run_phase(stub: pb_grpc.JaxInferStub, plan: list[PlannedRequest], concurrency: int,
                    timeout_s: float) -> list[Outcome]:
    """Step 1 of the module docstring; the outcomes in plan order."""
    outcomes: list[Outcome | None] = [None] * len(plan)
    pending, ended = iter(plan), 0
    every = max(1, len(plan) // 10)

    async def worker() -> None:
        nonlocal ended
        for r in pending:  # one shared iterator: each request is taken once
            outcomes[r.index] = await send(stub, r, timeout_s)
            ended += 1
            if ended % every == 0:
                logger.info("%d of %d requests ended", ended, len(plan))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def check_outcome(r: PlannedRequest, o: Outcome) -> str | None:
    """Step 2 of the module docstring: None if the outcome is right, else what is wrong (errors are counted by
    status code, not here)."""
    n = len(o.token_ids)
    if o.status == "cancelled":
        return None if n <= r.max_tokens else f"cancelled after {n} tokens, more than max_tokens {r.max_tokens}"
    if o.status != "completed":
        return None
    if o.finish_reason == "length" and n != r.max_tokens:
        return f"finish_reason length after {n} tokens, max_tokens {r.max_tokens}"
    if o.finish_reason == "stop" and (r.ignore_eos or n > r.max_tokens):
        return f"finish_reason stop after {n} tokens (max_tokens {r.max_tokens}, ignore_eos {r.ignore_eos})"
    if o.finish_reason not in ("length", "stop"):
        return f"finish_reason {o.finish_reason!r} after {n} tokens"
    if o.usage != (r.prompt_tokens, n):
        return f"usage (prompt, completion tokens) {o.usage}, expected {(r.prompt_tokens, n)}"
    return None


async def references(stub: pb_grpc.JaxInferStub, sample: list[PlannedRequest], timeout_s: float) -> list[Outcome]:
    """Step 3 of the module docstring: each sampled request alone, uncancelled, one after the other."""
    return [await send(stub, r, timeout_s, cancel=False) for r in sample]


def reference_mismatch(r: PlannedRequest, o: Outcome, ref: Outcome) -> str | None:
    """None if the load's outcome equals the reference token for token, with the same finish reason."""
    if ref.status != "completed":
        return f"the reference failed: {ref.status} {ref.details}"
    if o.token_ids == ref.token_ids and o.finish_reason == ref.finish_reason:
        return None
    first = next((i for i, (a, b) in enumerate(zip(o.token_ids, ref.token_ids)) if a != b),
                 min(len(o.token_ids), len(ref.token_ids)))
    return (f"request {r.index} ({r.sampling}, {r.input}): {len(o.token_ids)} tokens ({o.finish_reason}) under load, "
            f"{len(ref.token_ids)} ({ref.finish_reason}) alone; first difference at token {first}")


def scrape(metrics_url: str) -> dict[str, float]:
    """The server's `/metrics` samples by name (label-free ones; labelled ones as `name{k="v"}`; the `model_name`
    label every sample has is left out, a server serves one model).

    Raises:
      OSError: the endpoint does not answer.
    """
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


async def end_state(channel: grpc.aio.Channel, metrics_url: str, drain_timeout_s: float) -> dict:
    """Step 4 of the module docstring: {running, waiting, kv_pages_used, kv_pages_total, drain_s, health}.

    Raises:
      RuntimeError: the metrics endpoint does not answer.
    """
    t0 = time.perf_counter()
    while True:
        try:
            s = await asyncio.to_thread(scrape, metrics_url)
        except OSError as e:
            raise RuntimeError(f"cannot read the server's metrics at {metrics_url}: {e}") from None
        busy = [s[g] for g in GAUGES[:3]]
        if not any(busy) or time.perf_counter() - t0 > drain_timeout_s:
            break
        await asyncio.sleep(0.1)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as e:
        health = f"{e.code().name}: {e.details()}"
    return {"running": int(busy[0]), "waiting": int(busy[1]), "kv_pages_used": int(busy[2]),
            "kv_pages_total": int(s[GAUGES[3]]), "drain_s": time.perf_counter() - t0, "health": health}
