"""`ServedEngine`: the one engine that every front end of a `jaxinfer serve` (gRPC, the OpenAI HTTP API) drives.

1. `start()` builds the `Engine` (weights, KV cache, warm-up compiles) in a worker thread, so the front ends can
   listen and answer health checks while it loads; then it wraps it in an `AsyncEngine` and calls the listeners
   (`on_serving_change`) with True. A watchdog calls them with False once the engine loop dies.
2. `ready()` is a front end's first step for every call: the `AsyncEngine`, or `Unavailable` naming why not
   (stopping, warming up, failed to start, engine loop stopped). `slot()` counts a request in flight for its whole
   life and refuses it with `Overloaded` past `ServerLimits.max_queued_requests`, whichever front end sent it.
3. `record_admitted` counts a request's prompt and gives the front end the `RequestRecorder` that it feeds the
   request's outputs (tokens, latencies, outcome) into: one `ServerMetrics` registry for all front ends, every
   sample labelled with the served `model_name`.
4. `stop()` refuses new calls (`ready()` raises), stops the watchdog and shuts the engine down; the front ends
   drain their streams before calling it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.serving.metrics import RequestRecorder, ServerMetrics

logger = logging.getLogger(__name__)

_WATCHDOG_PERIOD_S = 0.5
# A GGUF file name's quantization suffix: "-Q4_1", ".Q4_K_M", "-f16", "-bf16", "-IQ3_XS", ...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|[Ff]16|[Bb][Ff]16|[Ff]32)$")


def served_model_name(model: str | None) -> str:
    """The default `--served-model-name`: the model file's or folder's name without its quantization suffix
    (`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`); None, the default model, likewise."""
    if model is None:
        from jaxinfer.loading.loader import DEFAULT_MODEL_FILE

        model = DEFAULT_MODEL_FILE
    path = Path(model.rstrip("/"))
    name = path.stem if path.suffix.lower() == ".gguf" else path.name
    return _QUANT_SUFFIX.sub("", name) or name


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The server's own limits (those of a request's values are `jaxinfer.request_limits`, for every front end).

    Attributes:
      max_request_bytes: serialized request size (a gRPC message, an HTTP body); a larger request is refused as
        a bad request (`INVALID_ARGUMENT`, HTTP 400).
      max_queued_requests: requests in flight (running or waiting, all front ends together) before new ones are
        refused (`RESOURCE_EXHAUSTED`, HTTP 429).
    """

    max_request_bytes: int = 1 << 20
    max_queued_requests: int = 256


class Unavailable(RuntimeError):
    """The engine cannot take a request now; the message says why (gRPC `UNAVAILABLE`, HTTP 503)."""


class Overloaded(RuntimeError):
    """`max_queued_requests` requests are in flight (gRPC `RESOURCE_EXHAUSTED`, HTTP 429)."""


class ServedEngine:
    """The engine of a server, shared by its front ends.

    Args:
      config: engine options; `start` builds the engine from them.
      limits: the server's limits (request bytes, requests in flight).
      model_name: the served model name (`--served-model-name`: the HTTP API's model, the `model_name` label of
        the metrics); None derives it from `config.model` (`served_model_name`).

    Attributes:
      async_engine: the `AsyncEngine` once loaded, else None.
      engine_error: the exception that stopped the engine from starting, else None.
      in_flight: requests counted by `slot()` now.
      model_name: the served model name.
      metrics: the Prometheus registry of the whole server.
    """

    def __init__(self, config: EngineConfig, limits: ServerLimits = ServerLimits(),
                 model_name: str | None = None) -> None:
        self.config, self.limits = config, limits
        self.model_name = model_name or served_model_name(config.model)
        self.async_engine: AsyncEngine | None = None
        self.engine_error: BaseException | None = None
        self.stopping = False
        self.in_flight = 0
        self.metrics = ServerMetrics(
            lambda: None if self.async_engine is None else self.async_engine.engine.stats(),
            model_name=self.model_name, max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            steps_by_num_tokens=lambda: ({} if self.async_engine is None
                                         else self.async_engine.engine.metrics.steps_by_num_tokens.copy()))
        self.load_task: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._listeners: list[Callable[[bool], object]] = []

    def on_serving_change(self, listener: Callable[[bool], object]) -> None:
        """Calls `listener(serving)` (a plain function or a coroutine function) when the engine becomes ready
        (True) and when its loop dies or the server stops (False)."""
        self._listeners.append(listener)

    async def _notify(self, serving: bool) -> None:
        for listener in self._listeners:
            result = listener(serving)
            if asyncio.iscoroutine(result):
                await result

    def start(self) -> asyncio.Task:
        """Starts loading the engine on the running loop (once); returns the load task."""
        if self.load_task is None:
            self.load_task = asyncio.get_running_loop().create_task(self._load())
        return self.load_task

    async def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = await asyncio.to_thread(Engine, self.config)
        except asyncio.CancelledError:  # stopped while loading: the load thread finishes, nothing is served
            logger.info("start-up cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - reported through health and the log (`serve` then exits)
            if isinstance(e, ValueError):  # bad configuration or model: `serve` raises it (the CLI prints it once)
                logger.debug("the engine failed to start: %s", e)
            else:
                logger.exception("the engine failed to start")
            self.engine_error = e
            return
        self.async_engine = AsyncEngine(engine)
        await self._notify(True)
        logger.info("serving %s (ready in %.1f s)", engine.model_config.name, time.perf_counter() - t0)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
            if self.async_engine is not None and not self.async_engine.is_alive():
                logger.error("the engine loop died; reporting not serving")
                await self._notify(False)
                return

    @property
    def serving(self) -> bool:
        """True while `ready()` would return the engine."""
        engine = self.async_engine
        return not self.stopping and engine is not None and engine.is_alive()

    def ready(self) -> AsyncEngine:
        """The engine, for a new call.

        Raises:
          Unavailable: the server is stopping, the model is warming up or failed to start, or the engine loop
            stopped; the message says which (and the cause).
        """
        engine = self.async_engine
        if self.stopping:
            raise Unavailable("the server is stopping")
        if engine is None:
            raise Unavailable("the model is warming up" if self.engine_error is None
                              else f"the engine failed to start: {self.engine_error}")
        if not engine.is_alive():
            cause = "" if engine.error is None else f": {type(engine.error).__name__}: {engine.error}"
            raise Unavailable(f"the engine loop has stopped{cause}")
        return engine

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Counts one request in flight while the block runs.

        Raises:
          Overloaded: `max_queued_requests` requests are in flight already.
        """
        limit = self.limits.max_queued_requests
        if self.in_flight >= limit:
            raise Overloaded(f"{self.in_flight} requests in flight; the server's limit is {limit}: retry later")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def record_admitted(self, out: RequestOutput) -> RequestRecorder:
        """Counts an admitted request's prompt tokens (call with its first output); returns the recorder to call
        with every output of the request, this first one included (`RequestRecorder.record`)."""
        return self.metrics.admitted(out)

    async def stop(self) -> None:
        """Refuses new calls, stops the watchdog and shuts the engine down (streams still in flight get
        `EngineStoppedError`): call it after the front ends drained."""
        self.stopping = True
        if self.load_task is not None and not self.load_task.done():
            self.load_task.cancel()
        await self._notify(False)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.async_engine is not None:
            await asyncio.to_thread(self.async_engine.shutdown)
