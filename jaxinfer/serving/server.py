"""The gRPC server: a thin translation layer between `jaxinfer.v1.JaxInfer` messages and `AsyncEngine` streams.

1. `Server.start()` binds the port (grpc.aio) with the health and reflection services, reports `NOT_SERVING`,
   and starts the `ServedEngine` loading (unless another front end owns it); health turns `SERVING` when it is
   ready, and `NOT_SERVING` when its loop dies or the server stops.
2. `Generate` checks the request (bytes that do not parse, e.g. a string that is not UTF-8, in `wire.py`; size;
   limits and sampling values, in `requests.py`: `INVALID_ARGUMENT` naming the field), refuses it with
   `RESOURCE_EXHAUSTED` when `max_queued_requests` are already in flight (`ServedEngine.slot`), and streams the
   engine's `RequestOutput`s as `GenerateResponse`s: new token ids, text delta, logprobs (with ranks); the last
   response of each completion carries `finish_reason` (and vLLM's stop reason: `stop_str` / `stop_token_id`),
   the request's last one usage.
3. A cancelled call or a passed deadline cancels the handler; leaving the engine stream aborts the request, and
   its KV pages are freed at the engine's next turn (`AsyncEngine.generate`).
4. Every handler ends an exception the same way (`_maps_errors`): `ValueError` -> `INVALID_ARGUMENT` with its
   message, a stopped engine -> `UNAVAILABLE`, anything else -> `INTERNAL` naming the exception (its traceback
   logged), never `UNKNOWN`; the other calls go on. If the engine loop stops (`AsyncEngine`), every stream gets
   `UNAVAILABLE` naming the cause at once, later calls get it without waiting, and the `ServedEngine`'s watchdog
   flips health to `NOT_SERVING` within half a second.
5. `stop(grace_s)` refuses new calls, lets in-flight streams finish for `grace_s` seconds, cancels the rest, then
   stops the engine if this server owns it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.async_engine import AsyncEngine, EngineStoppedError
from jaxinfer.engine.config import EngineConfig
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.request_limits import check_token_ids
from jaxinfer.serving.metrics_port import MetricsPort
from jaxinfer.serving.requests import chat_ids, prompt_from_request, sampling_params_from_proto
from jaxinfer.serving.auth import ApiKeyInterceptor
from jaxinfer.serving.served import Overloaded, ServedEngine, ServerLimits, Unavailable
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.serving.wire import MalformedRequest, add_servicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxInfer"].full_name  # "jaxinfer.v1.JaxInfer"
_DEADLINE_SLACK_S = 0.1


def _token_logprobs(entry: dict[int, Logprob]) -> pb.TokenLogprobs:
    """One position's {token id: Logprob} (the sampled or prompt token first) as `TokenLogprobs`."""
    return pb.TokenLogprobs(top=[pb.TopLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank)
                                 for t, lp in entry.items()])


def _internal_error(e: Exception) -> str:
    """The short details of an unexpected exception: its type and (the first 300 characters of) its message."""
    text = str(e)
    return f"internal error: {type(e).__name__}: {text if len(text) <= 300 else text[:300] + '...'}"


class _Refused(Exception):
    """A call the server refuses with a status of its own (`UNAVAILABLE`, `INVALID_ARGUMENT`,
    `RESOURCE_EXHAUSTED`); `_maps_errors` ends the call with it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and details an exception escaping a handler ends its call with."""
    if isinstance(e, _Refused):
        return e.code, str(e)
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, (EngineStoppedError, Unavailable)):  # not ready, stopping, or the engine loop stopped
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    return grpc.StatusCode.INTERNAL, _internal_error(e)


def _maps_errors(handler):
    """Wraps a `JaxInferService` handler (a coroutine, or an async generator for a stream) so that an exception
    escaping it ends the call with `_status`'s code, never grpc's `UNKNOWN`; `INTERNAL` logs the traceback. A
    stream's final status is counted in `jaxinfer:grpc_requests_total` (before the client can see it; a cancelled
    call as `CANCELLED`, or `DEADLINE_EXCEEDED` when its deadline passed)."""

    async def fail(e: Exception, context: grpc.aio.ServicerContext,
                   count: Callable[[str], None] | None = None) -> None:
        if isinstance(e, grpc.aio.AbortError):  # aborted already, with its status
            raise e
        code, details = _status(e)
        if count is not None:
            count(code.name)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("%s failed", handler.__name__, exc_info=e)
        await context.abort(code, details)

    if not inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def unary(self, request, context: grpc.aio.ServicerContext):
            try:
                return await handler(self, request, context)
            except Exception as e:  # noqa: BLE001 - every failure gets a status of its own
                await fail(e, context)

        return unary

    @functools.wraps(handler)
    async def stream(self, request, context: grpc.aio.ServicerContext):
        count = self._server.metrics.count_grpc
        try:
            async for response in handler(self, request, context):
                yield response
        except Exception as e:  # noqa: BLE001 - every failure gets a status of its own
            await fail(e, context, count)
        except BaseException:  # left early: the client cancelled, or its deadline passed
            # The client's cancel at its deadline reaches us a few ms before our copy of the deadline passes.
            remaining = context.time_remaining()
            count("DEADLINE_EXCEEDED" if remaining is not None and remaining < _DEADLINE_SLACK_S else "CANCELLED")
            raise
        else:
            count("OK")

    return stream


class JaxInferService(pb_grpc.JaxInferServicer):
    """The `jaxinfer.v1.JaxInfer` servicer. Holds no engine logic: it checks, translates and streams."""

    def __init__(self, server: Server) -> None:
        self._server = server

    def _ready(self) -> AsyncEngine:
        """The engine, or `Unavailable` (UNAVAILABLE) while the server is stopping, warming up or its engine is
        dead."""
        if self._server.stopping:
            raise Unavailable("the server is stopping")
        return self._server.served.ready()

    def _check_request(self, request) -> None:
        """`_Refused` (INVALID_ARGUMENT) for a request that did not parse (naming the field) or is over the size
        limit."""
        if isinstance(request, MalformedRequest):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        limit = self._server.limits.max_request_bytes
        if request.ByteSize() > limit:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"request of {request.ByteSize()} bytes is above the server's limit of {limit}")

    @_maps_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        engine = self._ready()
        served = self._server.served
        self._check_request(request)
        params = sampling_params_from_proto(request.sampling)
        # Tokenizing a long prompt takes a while: in a worker thread, not on the event loop or engine thread.
        prompt = await asyncio.to_thread(prompt_from_request, request, engine.engine)
        with served.slot():  # RESOURCE_EXHAUSTED past the limit of requests in flight
            stream = engine.generate(prompt, params, request.request_id or None)
            out: RequestOutput | None = await anext(stream)  # admission: a ValueError names the field
            recorder = served.record_admitted(out)
            finished: set[int] = set()
            first = True
            try:
                while out is not None:
                    recorder.record(out)  # before the client sees it
                    responses = self._responses(out, finished)
                    if first and responses and out.prompt_logprobs is not None:
                        responses[0].prompt_logprobs.extend(_token_logprobs(e) for e in out.prompt_logprobs[1:])
                    first = first and not responses
                    for response in responses:
                        yield response
                    out = None if out.finished else await anext(stream, None)
            finally:
                recorder.abandoned()  # a cancelled call or a passed deadline: counted as aborted (no-op when done)

    def _responses(self, out: RequestOutput, finished: set[int]) -> list[pb.GenerateResponse]:
        """One response per completion with new tokens or a new finish; usage rides on the request's last one."""
        responses = []
        for c in out.outputs:
            done = c.finish_reason is not None and c.index not in finished
            if not c.delta_token_ids and not done:
                continue
            msg = pb.GenerateResponse(request_id=out.request_id, index=c.index, token_ids=c.delta_token_ids,
                                      text=c.delta_text)
            if c.logprobs is not None and c.delta_token_ids:
                msg.logprobs.extend(_token_logprobs(entry)
                                    for entry in c.logprobs[len(c.logprobs) - len(c.delta_token_ids):])
            if done:
                finished.add(c.index)
                msg.finish_reason = c.finish_reason
                if c.error is not None:
                    msg.error, msg.error_kind = c.error, c.error_kind or "engine"
                if isinstance(c.stop_reason, str):
                    msg.stop_str = c.stop_reason
                elif c.stop_reason is not None:
                    msg.stop_token_id = c.stop_reason
            responses.append(msg)
        if out.finished:
            usage = pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                             completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                             cached_prompt_tokens=out.num_cached_tokens)
            if not responses:
                responses.append(pb.GenerateResponse(request_id=out.request_id))
            responses[-1].usage.CopyFrom(usage)
        return responses

    @_maps_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        engine = self._ready().engine
        self._check_request(request)

        def tokenize() -> list[int]:
            which = request.WhichOneof("input")
            if which == "text":
                return engine.tokenizer.encode(request.text)
            if which == "chat":
                return chat_ids(engine, request.chat, for_generation=False)
            raise ValueError("input is required: set one of text, chat")

        return pb.TokenizeResponse(token_ids=await asyncio.to_thread(tokenize))

    @_maps_errors
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        engine = self._ready().engine
        self._check_request(request)
        ids = list(check_token_ids("token_ids", list(request.token_ids), engine.tokenizer.vocab_size))
        text = await asyncio.to_thread(engine.tokenizer.decode, ids, skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    @_maps_errors
    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        engine = self._ready().engine
        self._check_request(request)
        devices = engine.runner.kv_cache.k.devices()
        platform = next(iter(devices)).platform
        return pb.ModelInfoResponse(model_name=self._server.served.model_name, max_model_len=engine.max_model_len,
                                    vocab_size=engine.tokenizer.vocab_size, dtype=engine.config.dtype,
                                    page_size=engine.page_size, mesh=f"{len(devices)} x {platform}",
                                    attention_backend=engine.runner.attention.name)


class Server:
    """A jaxinfer gRPC server on one port.

    Args:
      config: engine options (the engine is built by `start`), or a `ServedEngine` that another front end shares
        (then its owner starts and stops it).
      host, port: where to listen; port 0 picks a free one (see `port` after `start`).
      limits: the server's limits (with a `ServedEngine`, its own apply).
      metrics_port: HTTP port of the Prometheus exporter (`/metrics` only); None: no exporter (metrics are still
        kept).
      api_key: when set, every call of the jaxinfer service needs the metadata `authorization: Bearer <api_key>`,
        else it ends `UNAUTHENTICATED`; health and reflection stay open (`jaxinfer.serving.auth`).
    """

    def __init__(self, config: EngineConfig | ServedEngine, *, host: str = "127.0.0.1", port: int = 50051,
                 limits: ServerLimits = ServerLimits(), metrics_port: int | None = None,
                 api_key: str | None = None) -> None:
        self.api_key = api_key
        self._owns_engine = not isinstance(config, ServedEngine)
        self.served = ServedEngine(config, limits) if self._owns_engine else config
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.stopping = False
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._exporter: MetricsPort | None = None
        self.served.on_serving_change(lambda serving: self._set_health(
            health_pb2.HealthCheckResponse.SERVING if serving and not self.stopping
            else health_pb2.HealthCheckResponse.NOT_SERVING))

    # The shared engine's state, under the names the gRPC server has always had.
    config = property(lambda self: self.served.config)
    limits = property(lambda self: self.served.limits)
    metrics = property(lambda self: self.served.metrics)
    async_engine = property(lambda self: self.served.async_engine)
    engine_error = property(lambda self: self.served.engine_error)
    in_flight = property(lambda self: self.served.in_flight)
    _load_task = property(lambda self: self.served.load_task)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        """Binds the port and serves health/reflection at once; the engine loads in the background."""
        interceptors = [] if self.api_key is None else [ApiKeyInterceptor(self.api_key, SERVICE_NAME)]
        self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 * self.limits.max_request_bytes),
                                              ("grpc.so_reuseport", 0)], interceptors=interceptors)
        add_servicer(JaxInferService(self), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc)
        address = f"{self.host}:{self.port}"
        try:
            bound = self._grpc.add_insecure_port(address)
        except RuntimeError:  # grpcio raises on a port in use or an unknown host
            bound = 0
        if bound == 0:
            await self._grpc.stop(0)
            raise ValueError(f"cannot listen on {address}: in use, or not an address of this machine")
        self.port = bound
        await self._set_health(health_pb2.HealthCheckResponse.SERVING if self.served.serving
                               else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._grpc.start()
        if self.metrics_port is not None:
            try:
                self._exporter = MetricsPort(self.metrics.registry, self.metrics_port, self.host)
            except OSError as e:
                await self._grpc.stop(0)
                raise ValueError(f"cannot serve metrics on {self.host}:{self.metrics_port}: {e}") from None
            self.metrics_port = self._exporter.port
        logger.info("gRPC listening on %s:%d", self.host, self.port)
        if self._owns_engine:
            logger.info("loading the model")
            self.served.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting calls, lets streams in flight finish for `grace_s` seconds, cancels the rest; then
        stops the engine if this server owns it."""
        self.stopping = True
        if self._owns_engine:
            self.served.stopping = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._exporter is not None:
            await asyncio.to_thread(self._exporter.close)
            self._exporter = None
        if self._owns_engine:
            await self.served.stop()

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()

