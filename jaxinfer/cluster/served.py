"""`ServedCluster`: a `ServedEngine` whose engine is a `ClusterEngine` over Ray replicas, for the HTTP front end
(`jaxinfer serve --replicas N`); and the router's Prometheus metrics.

1. `start()` (as `ServedEngine`'s) starts the replica pool in the background, so the front end listens and
   answers health checks (503) meanwhile; a pool that fails to start is the server's `engine_error`.
2. A watchdog runs the cluster's health check (`ClusterEngine.watch`) and tells the listeners when the cluster
   stops or starts serving (no replica up, or one up again).
3. `ready()` raises `Unavailable` (HTTP 503, OpenAI-shaped) while no replica is up.
4. The registry of `ServerMetrics` (request counts, latencies; the engines' gauges and counters summed over the
   replicas) gains the router's own families, per replica (label `replica`): `jaxinfer:router_requests_total`,
   `jaxinfer:router_prefix_hit_tokens_total` (prompt tokens the router's index said the replica held when it
   routed there), `jaxinfer:router_requests_in_flight`, `jaxinfer:router_replica_up`, and the replica's own
   prefix-cache counters `jaxinfer:replica_prefix_cache_queries_total` / `_hits_total` (from its last health
   check).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.cluster.engine import ClusterEngine
from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.pool import ReplicaPool
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.metrics import LABEL, P
from jaxinfer.serving.served import ServedEngine, ServerLimits

logger = logging.getLogger(__name__)


class RouterCollector(Collector):
    """The router's per-replica families (module docstring, item 4), read at scrape time."""

    def __init__(self, served: ServedCluster) -> None:
        self._served = served

    def collect(self) -> Iterator:
        cluster = self._served.async_engine
        if cluster is None:
            return
        labels = [LABEL, "replica"]
        families = {
            "requests": CounterMetricFamily(P + "router_requests", "requests routed to the replica", labels=labels),
            "hits": CounterMetricFamily(P + "router_prefix_hit_tokens", "prompt tokens the router's index said "
                                        "the replica held when it routed requests there", labels=labels),
            "in_flight": GaugeMetricFamily(P + "router_requests_in_flight", "requests routed to the replica and "
                                           "not finished", labels=labels),
            "up": GaugeMetricFamily(P + "router_replica_up", "1 while the replica answers its health check",
                                    labels=labels),
            "queries": CounterMetricFamily(P + "replica_prefix_cache_queries", "the replica's prefix cache: prompt "
                                           "tokens looked up (at its last health check)", labels=labels),
            "cached": CounterMetricFamily(P + "replica_prefix_cache_hits", "the replica's prefix cache: tokens "
                                          "taken from it (at its last health check)", labels=labels),
        }
        name = self._served.model_name
        for r in cluster.replicas:
            key = [name, r.name]
            families["requests"].add_metric(key, r.requests_routed)
            families["hits"].add_metric(key, r.routed_hit_tokens)
            families["in_flight"].add_metric(key, r.target.in_flight)
            families["up"].add_metric(key, 1.0 if r.target.up else 0.0)
            if r.stats is not None and "prefix_cache_hit_tokens" in r.stats:
                families["queries"].add_metric(key, r.stats["prefix_cache_queried_tokens"])
                families["cached"].add_metric(key, r.stats["prefix_cache_hit_tokens"])
        yield from families.values()


class ServedCluster(ServedEngine):
    """The cluster a server's front ends drive (module docstring).

    Args:
      config: every replica's engine options.
      cluster: where and how many replicas to start (a `ClusterConfig`), or a started `ReplicaPool` to route over
        (`stop` then leaves it running).
      routing: the routing policy and its knobs.
      limits: the server's limits (request bytes, requests in flight over the whole cluster).
      model_name: the served model name; None derives it from `config.model`.
    """

    def __init__(self, config: EngineConfig, cluster: ClusterConfig | ReplicaPool, routing: RoutingConfig,
                 limits: ServerLimits = ServerLimits(), model_name: str | None = None) -> None:
        super().__init__(config, limits, model_name)
        self.cluster, self.routing = cluster, routing
        self.health = cluster if isinstance(cluster, ClusterConfig) else ClusterConfig()
        self.metrics.registry.register(RouterCollector(self))

    async def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            pool = (self.cluster if isinstance(self.cluster, ReplicaPool)
                    else await ReplicaPool.start(self.config, self.cluster))
        except asyncio.CancelledError:
            logger.info("start-up cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - reported through health and the log (`serve` then exits)
            if not isinstance(e, ValueError):
                logger.exception("the replicas failed to start")
            self.engine_error = e
            return
        self.async_engine = ClusterEngine(pool, self.routing, self.health,
                                          owns_pool=not isinstance(self.cluster, ReplicaPool))
        await self._notify(True)
        logger.info("serving %s on %d replicas, routing %s (ready in %.1f s)", pool.replicas[0].info.model_config.name,
                    len(pool.replicas), self.routing.policy.value, time.perf_counter() - t0)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        health = asyncio.get_running_loop().create_task(self.async_engine.watch())
        serving = True
        try:
            while not self.stopping:
                await asyncio.sleep(self.health.health_period_s / 2)
                if self.serving != serving:
                    serving = self.serving
                    logger.log(logging.INFO if serving else logging.ERROR,
                               "serving again" if serving else "no replica is reachable; reporting not serving")
                    await self._notify(serving)
        finally:
            health.cancel()

    def ready(self) -> ClusterEngine:
        """The cluster engine, for a new call.

        Raises:
          Unavailable: the server is stopping, the replicas are starting or failed to start, or none is up.
        """
        engine = self.async_engine
        if self.stopping or engine is None:
            return super().ready()
        if not engine.is_alive():
            raise engine.unavailable()
        return engine
