"""A router (`ServedCluster` behind the HTTP front end) on its own asyncio loop in a background thread, for
synchronous test clients (`openai`, `httpx`)."""

from __future__ import annotations

import asyncio
import threading
import time

import openai

from jaxinfer.cluster.pool import ReplicaPool
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.cluster.served import ServedCluster
from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.serve import HTTPServer


class RouterServer:
    """The HTTP API on `base_url`, routing over `pool`'s replicas (left running when the router stops); `served`
    takes ServedCluster's other keywords (`disagg`, `health`)."""

    def __init__(self, config: EngineConfig, pool: ReplicaPool, routing: RoutingConfig, **served) -> None:
        self.served = ServedCluster(config, pool, routing, **served)
        self.http = HTTPServer(self.served, port=0, grace_s=1.0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> None:
            await self.http.start()
            self.served.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        deadline = time.monotonic() + 60
        while not self.served.serving:
            assert self.served.engine_error is None, self.served.engine_error
            assert time.monotonic() < deadline, "the router never started serving"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.http.port}"

    @property
    def cluster(self):
        return self.served.async_engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def replica_stats(self) -> list[dict]:
        """Each replica's `Engine.stats()` now (asked directly, not the health check's copy)."""
        import ray

        return [ray.get(r.handle.actor.stats.remote())[0] for r in self.cluster.replicas]

    def stop(self) -> None:
        async def stop() -> None:
            self.http.close(force=True)
            await self.served.stop()
            await self.http.wait()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
