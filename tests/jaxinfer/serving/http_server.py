"""A jaxinfer server with both front ends (gRPC and the OpenAI HTTP API, one `ServedEngine`) on its own asyncio
loop in a background thread, for synchronous test clients (`openai`, `httpx`, gRPC stubs)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.served import ServedEngine, ServerLimits
from jaxinfer.serving.serve import HTTPServer
from jaxinfer.serving.server import Server
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

API_KEY = "test-key-123"


class BothServers:
    """gRPC on `grpc_port`, HTTP on `http_port` (no API key) and `keyed_port` (API_KEY), all on one engine."""

    def __init__(self, config: EngineConfig, limits: ServerLimits = ServerLimits()) -> None:
        self.served = ServedEngine(config, limits)
        self.grpc = Server(self.served, port=0)
        self.http = HTTPServer(self.served, port=0, grace_s=1.0)
        self.keyed = HTTPServer(self.served, port=0, api_key=API_KEY, grace_s=1.0)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start() -> None:
            await self.grpc.start()
            await self.http.start()
            await self.keyed.start()
            self.served.start()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(60), "the servers did not start"
        self.base_url = f"http://127.0.0.1:{self.http.port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc.port}")
        self.stub = pb_grpc.JaxInferStub(self.channel)

    @property
    def model_name(self) -> str:
        return self.http.model_name

    @property
    def engine(self):
        return self.served.async_engine.engine

    def wait_serving(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.served.serving:
            assert self.served.engine_error is None, self.served.engine_error
            assert time.monotonic() < deadline, "the engine never started serving"
            time.sleep(0.1)

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Waits until no request runs or waits and no KV page is in use; returns the engine's stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine.stats()
            if (stats["running"], stats["waiting"], stats["kv_pages_used"], self.served.in_flight) == (0, 0, 0, 0):
                return stats
            assert time.monotonic() < deadline, f"not idle: {stats}, in flight {self.served.in_flight}"
            time.sleep(0.05)

    def stop(self) -> None:
        async def stop() -> None:
            self.http.close(force=True)
            self.keyed.close(force=True)
            await self.grpc.stop(0)
            await self.served.stop()
            await self.http.wait()
            await self.keyed.wait()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.channel.close()
