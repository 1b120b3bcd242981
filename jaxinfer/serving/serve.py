"""`jaxinfer serve`: one `ServedEngine` behind the gRPC server and the OpenAI HTTP API, in one asyncio loop.

1. Both front ends listen before the model loads (health answers "not serving" meanwhile); the engine loads in a
   worker thread; if it cannot start, `serve` stops and raises its error.
2. SIGTERM / SIGINT start a graceful stop: new calls are refused (gRPC `UNAVAILABLE`, HTTP 503; the HTTP
   listener closes), streams in flight may finish for `grace_s` seconds, then the engine stops and the streams
   left get an error (gRPC `UNAVAILABLE`; HTTP a last `data: {"error": ...}` event). A second signal skips the
   wait.
3. uvicorn runs in this loop on a socket bound here (so port 0 works and a bad address is a `ValueError`); its
   own signal handling is off, the loop's handlers above decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import uvicorn

from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.metrics_port import MetricsPort
from jaxinfer.serving.openai.app import OpenAIApp
from jaxinfer.serving.served import ServedEngine, ServerLimits
from jaxinfer.serving.server import Server

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: `serve` owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port).

    Raises:
      ValueError: the address cannot be bound (in use, or not an address of this machine).
    """
    name = host[1:-1] if host.startswith("[") else host
    try:
        family, kind, proto, _, address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        sock.listen(2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


class HTTPServer:
    """The OpenAI HTTP API of a `ServedEngine` on one port, served by uvicorn in the running loop.

    Args:
      served: the shared engine (its owner starts and stops it).
      host, port: where to listen (port 0: a free one; see `port` after `start`).
      model_name: the name the API serves the model as; None: the `ServedEngine`'s (`served.model_name`, which
        also labels the metrics).
      api_key: bearer token every `/v1` route requires, or None.
      grace_s: the longest uvicorn waits for open connections once stopping, past the engine's own grace.
    """

    def __init__(self, served: ServedEngine, *, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str | None = None, api_key: str | None = None, grace_s: float = 10.0) -> None:
        self.served, self.host, self.port = served, host, port
        self.model_name = model_name or served.model_name
        self.api = OpenAIApp(served, self.model_name, api_key)
        config = uvicorn.Config(self.api.app, log_config=None, access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=grace_s + 5.0, timeout_keep_alive=30)
        self._uvicorn = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Binds the port and starts serving (returns once listening).

        Raises:
          ValueError: the port cannot be bound.
        """
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():  # uvicorn failed to start: its exception
            self._task.result()
            raise ValueError(f"the HTTP server on {self.host}:{self.port} did not start")
        logger.info("HTTP listening on %s:%d", self.host, self.port)

    def close(self, force: bool = False) -> None:
        """Stops listening; open connections finish (all of them are dropped with `force`)."""
        self._uvicorn.should_exit = True
        self._uvicorn.force_exit = self._uvicorn.force_exit or force

    async def wait(self) -> None:
        if self._task is not None:
            await self._task


async def _drain(served: ServedEngine, grace_s: float) -> None:
    """Waits until no request is in flight, for at most grace_s seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while served.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int | None = 50051,
                http_port: int | None = 8000, metrics_port: int | None = None,
                limits: ServerLimits = ServerLimits(), grace_s: float = 10.0, model_name: str | None = None,
                api_key: str | None = None, served: ServedEngine | None = None) -> None:
    """Runs the gRPC server (`port`; None: none) and the HTTP API (`http_port`; None: none) on one engine until
    SIGTERM or SIGINT, then stops them gracefully (module docstring). `served`: the engine to serve (a
    `jaxinfer.cluster` one, say); None builds a `ServedEngine` of `config`, `limits` and `model_name`.

    Raises:
      ValueError: a port cannot be bound, or the engine cannot start from this configuration.
      RuntimeError: the engine failed to start for another reason.
    """
    if port is None and http_port is None:
        raise ValueError("nothing to serve: both the gRPC and the HTTP server are off")
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a signal during the model load stops cleanly too
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    served = served if served is not None else ServedEngine(config, limits, model_name)
    grpc_server = None if port is None else Server(served, host=host, port=port, api_key=api_key)
    http = None
    exporter = None
    try:
        if grpc_server is not None:
            await grpc_server.start()
        if http_port is not None:
            http = HTTPServer(served, host=host, port=http_port, model_name=model_name, api_key=api_key,
                              grace_s=grace_s)
            await http.start()
        if metrics_port is not None:
            try:
                exporter = MetricsPort(served.metrics.registry, metrics_port, host)
            except OSError as e:
                raise ValueError(f"cannot serve metrics on {host}:{metrics_port}: {e}") from None
            metrics_port = exporter.port
    except BaseException:
        if grpc_server is not None:
            await grpc_server.stop(0)
        if http is not None:
            http.close(force=True)
            await http.wait()
        raise
    if grpc_server is not None:
        print(f"jaxinfer: serving gRPC on {host}:{grpc_server.port}"
              + (f", metrics on http://{host}:{metrics_port}/metrics" if metrics_port is not None else ""),
              flush=True)
    if http is not None:
        print(f"jaxinfer: serving HTTP (OpenAI API) on http://{host}:{http.port}/v1 as model {http.model_name!r}",
              flush=True)
    logger.info("loading the model")
    # Stop on a signal, or when the engine cannot start (a bad mesh, model or budget): nothing could ever be served.
    served.start().add_done_callback(lambda task: stop.set() if served.engine_error is not None else None)
    await stop.wait()
    served.stopping = True  # new calls get UNAVAILABLE / 503 from here on
    if served.engine_error is None:
        logger.info("shutting down (grace %.1f s; a second signal cancels the streams in flight now)", grace_s)
    if http is not None:
        http.close()
    grpc_stop = None if grpc_server is None else loop.create_task(grpc_server.stop(0 if hurry.is_set() else grace_s))
    hurried = loop.create_task(hurry.wait())
    await asyncio.wait((loop.create_task(_drain(served, grace_s)), hurried), return_when=asyncio.FIRST_COMPLETED)
    await served.stop()  # the streams left get EngineStoppedError: UNAVAILABLE / an error event
    if grpc_stop is not None:
        if hurry.is_set():
            await grpc_server.stop(0)
        await grpc_stop
    if http is not None:
        await asyncio.sleep(0.1)  # the streams' last events go out
        http.close(force=True)
        await http.wait()
    hurried.cancel()
    if exporter is not None:
        await asyncio.to_thread(exporter.close)
    if served.engine_error is not None:
        error = served.engine_error
        raise error if isinstance(error, ValueError) else RuntimeError(f"the engine failed to start: {error}")


def run(config: EngineConfig, **kw) -> int:
    """Blocking `serve`; returns the exit status 0 after a graceful shutdown.

    Raises:
      ValueError, RuntimeError: as `serve` (the CLI exits 2 on a ValueError).
    """
    asyncio.run(serve(config, **kw))
    return 0
